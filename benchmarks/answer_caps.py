"""What an answer costs the math verifier, with and without the answer-size caps.

    python benchmarks/answer_caps.py [--limit 10]

For answers growing in bracket nesting and in length, prints the seconds math-verify spends on
them with the caps off (`AnswerLimits(0, 0, 0)`, each call stopped at `--limit` seconds) and
with the default caps (`mmrl.types.AnswerLimits`): what a babbling policy costs a verifier
worker per response, and what the caps leave (answers just under them are still parsed).
One process, one thread; the figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import time

from mmrl.types import AnswerLimits, RewardSpec, Sample, VerifyContext
from mmrl.verifiers import get_verifier
from mmrl.verifiers.registry import warm_up_verifiers

CASES = [
    *[(f"braces {d} deep", lambda leaf, d=d: "{" * d + leaf + "}" * d) for d in (6, 8, 10, 12, 14)],
    *[(f"parentheses {d} deep", lambda leaf, d=d: "(" * d + leaf + ")" * d) for d in (10, 16)],
    *[
        (f"sum of {n} x_i^2 terms", lambda leaf, n=n: "+".join(f"x_{{{i}}}^{{{leaf}}}" for i in range(n)))
        for n in (40, 200)
    ],
    *[(f"sum of {n} ones", lambda leaf, n=n: "+".join([leaf] * n)) for n in (400, 20_000)],
    ("20,000 listed numbers", lambda leaf: ", ".join(str(i) for i in range(20_000)) + leaf),
]
"""(name, answer for a leaf digit): each column gets its own digit, so math-verify's parse cache
never serves the second column from the first."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=10.0, help="time limit per call (s)")
    args = parser.parse_args()
    warm_up_verifiers()
    verifier = get_verifier("math")
    sample = Sample("bench", [], [], "", RewardSpec("5", "math", {}, 1.0, 0.0), {"id": "b"})
    off = VerifyContext(limits=AnswerLimits(max_chars=0, max_depth=0, max_tokens=0))
    on = VerifyContext()
    print(f"{'answer':28s} {'chars':>7s} {'caps off':>10s} {'default caps':>14s}")
    for name, answer in CASES:
        cells = []
        for context, leaf in ((off, "5"), (on, "7")):
            response = f"\\boxed{{{answer(leaf)}}}"
            start = time.perf_counter()
            result = verifier(response, sample, context, time_limit_s=args.limit)
            seconds = time.perf_counter() - start
            kind = (result.error or "").split(":")[0]
            cells.append(f"{seconds:6.2f} s" + (f" {kind}" if kind else ""))
        print(f"{name:28s} {len(answer('5')):7d} {cells[0]:>10s}   {cells[1]}")


if __name__ == "__main__":
    main()
