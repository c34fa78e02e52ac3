"""Verifier throughput: responses scored per second, per verifier, in one process.

    python benchmarks/verifiers.py [--n 400]

Each verifier scores a mix of right, wrong and malformed responses to procedural samples (the
same inputs every run). Calls go through `Verifier.__call__`, so the per-call time limit's
timer is included; `math` includes math-verify's SymPy parsing of both sides.
"""

from __future__ import annotations

import argparse
import json
import time

from mmrl.datasets.procedural import make_samples
from mmrl.types import RewardSpec, Sample, VerifyContext
from mmrl.verifiers import get_verifier
from mmrl.verifiers.registry import warm_up_verifiers


def _responses(sample) -> list[str]:
    gt = sample.reward_model.ground_truth
    verifier = sample.reward_model.verifier
    if verifier == "detection":
        right = json.dumps(gt)
        shifted = json.dumps([{**b, "bbox_2d": [c + 3 for c in b["bbox_2d"]]} for b in gt])
        return [right, shifted, '[{"bbox_2d": [1, 2], "label": "x"}]', "no boxes"]
    return [f"\\boxed{{{gt}}}", "\\boxed{7}", "\\boxed{}", "I cannot tell"]


def _synthetic(verifier: str, n: int) -> list[Sample]:
    """Text-only samples for verifiers no procedural kind uses."""
    out = []
    for i in range(n):
        if verifier == "choice":
            spec = RewardSpec("ABCD"[i % 4], "choice", {"options": ["red", "green", "blue", "cyan"]})
        else:
            spec = RewardSpec(f"{1.5 * i:.1f}", "number", {"rel_tol": 0.01})
        out.append(
            Sample(
                verifier, [{"role": "user", "content": "q"}], [], verifier, spec, {"id": f"{verifier}/{i}"}
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=400, help="responses per verifier")
    args = parser.parse_args()
    warm_up_verifiers()
    by_verifier = {
        "math": make_samples(["colour_code", "arithmetic"], args.n, "train"),
        "detection": make_samples(["detection", "grounding"], args.n, "train"),
        "ocr": make_samples(["ocr"], args.n, "train"),
        "counting": make_samples(["counting"], args.n, "train"),
        "choice": _synthetic("choice", args.n),
        "number": _synthetic("number", args.n),
    }
    print(f"verifier throughput, one process, {args.n} responses each (right / wrong / malformed mix)")
    for name, samples in by_verifier.items():
        verifier = get_verifier(name)
        work = [(s, r) for s in samples for r in _responses(s)][: args.n]
        start = time.perf_counter()
        errors = sum(verifier(r, s, VerifyContext(0, 100)).error is not None for s, r in work)
        seconds = time.perf_counter() - start
        print(
            f"  {name:<10} {len(work) / seconds:9.1f} responses/s  ({1000 * seconds / len(work):6.2f} ms each, {errors} errors)"
        )


if __name__ == "__main__":
    main()
