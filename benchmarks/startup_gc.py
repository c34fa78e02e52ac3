"""What Python's garbage collector costs a process that starts the trainer, with and without
`mmrl.heap.imports_without_gc` (the collector paused during the heavy imports, the result frozen).

    python benchmarks/startup_gc.py [--repeats 5] [--runs 3]

1. Import: a fresh process imports the trainer (`mmrl.compose`: torch, transformers, the loop)
   and prints its own CPU seconds, the collector's passes and their seconds, as `mmrl train`
   does now (paused) and plainly (the baseline), alternately.
2. A run: `mmrl train --task vision_reasoning` for 2 steps (the built-in base from the cache; it
   is built first if missing), the child's CPU seconds as measured by the parent, once as it is
   and once with the pause replaced by a no-op, alternately.

Medians of each, then the ratio. Both parts run here side by side, so the machine's noise is
shared.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile

IMPORT = """
import gc, json, time, contextlib
passes = [0, 0.0]
start = [0.0]
def watch(phase, info):
    if phase == "start":
        start[0] = time.perf_counter()
    else:
        passes[0] += 1
        passes[1] += time.perf_counter() - start[0]
gc.callbacks.append(watch)
from mmrl.heap import imports_without_gc
block = imports_without_gc() if {paused} else contextlib.nullcontext()
with block:
    import mmrl.compose
print(json.dumps({{"cpu": time.process_time(), "passes": passes[0], "gc_s": passes[1]}}))
"""

RUN = """
import contextlib, sys
import mmrl.heap
if not {paused}:
    mmrl.heap.imports_without_gc = contextlib.nullcontext
from mmrl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def child_cpu(argv: list[str]) -> float:
    """CPU seconds (user + system) of the child process `argv`, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="import measurements of each")
    parser.add_argument("--runs", type=int, default=3, help="2-step training runs of each")
    args = parser.parse_args()
    py = sys.executable

    rows: dict[str, list[dict]] = {"paused": [], "plain": []}
    for _ in range(args.repeats):
        for name in rows:
            out = subprocess.run(
                [py, "-c", IMPORT.format(paused=name == "paused")], check=True, capture_output=True, text=True
            )
            rows[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"1. importing the trainer (medians of {args.repeats} fresh processes)")
    for name, rs in rows.items():
        print(
            f"   {name:6s}: {statistics.median(r['cpu'] for r in rs):.2f} CPU-s, "
            f"{statistics.median(r['passes'] for r in rs):.0f} collector passes taking "
            f"{statistics.median(r['gc_s'] for r in rs):.2f} s"
        )
    ratio = statistics.median(r["cpu"] for r in rows["paused"]) / statistics.median(
        r["cpu"] for r in rows["plain"]
    )
    print(f"   paused / plain: {ratio:.2f}")

    with tempfile.TemporaryDirectory() as tmp:
        train = ["train", "--task", "vision_reasoning", "trainer.total_steps=2", "trainer.eval_every=2",
                 "trainer.eval_size=32", "trainer.progress=false", "trainer.save_final=false"]  # fmt: skip
        subprocess.run(
            [py, "-m", "mmrl.cli", *train, f"trainer.run_dir={tmp}/warm"], check=True, capture_output=True
        )
        cpu: dict[str, list[float]] = {"paused": [], "plain": []}
        for k in range(args.runs):
            for name in cpu:
                code = RUN.format(paused=name == "paused")
                cpu[name].append(child_cpu([py, "-c", code, *train, f"trainer.run_dir={tmp}/{name}{k}"]))
    print(f"2. `mmrl train`, 2 steps (medians of {args.runs} runs, the child's CPU seconds)")
    for name, values in cpu.items():
        print(
            f"   {name:6s}: {statistics.median(values):.2f} CPU-s  ({', '.join(f'{v:.2f}' for v in values)})"
        )
    print(f"   paused / plain: {statistics.median(cpu['paused']) / statistics.median(cpu['plain']):.2f}")


if __name__ == "__main__":
    main()
