"""What a Ray reward worker costs to start, against the same worker importing the trainer first.

    python benchmarks/reward_worker_start.py [--repeats 3]

Ray starts an actor by importing its class's module. `RewardWorker` lives in
`mmrl.distributed.reward_worker`, which loads no torch; before, it lived in
`mmrl.distributed.ray_backend`, whose imports (the trainer, torch, transformers) every reward
worker paid. The baseline here is the same class with that import added at the top of its
`__init__`, so both run side by side on one local Ray cluster. For each, R actors one after the
other, each timed from start to a warm verifier pool (`warm_up`). Printed per actor: seconds to
ready, the actor process's CPU seconds and its resident memory (the verifier worker processes
it starts are not counted: they are the same in both).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import psutil
import ray

from mmrl.config import load_config
from mmrl.distributed.reward_worker import RewardWorker


class TrainerImportingRewardWorker(RewardWorker):
    """The baseline: the reward worker as it was, loading the trainer's modules first."""

    def __init__(self, cfg, threads: int):
        import mmrl.distributed.ray_backend  # noqa: F401  (torch, transformers, the trainer)

        super().__init__(cfg, threads)


def start_cost(cls, cfg) -> tuple[float, float, float]:
    """(seconds to ready, actor CPU seconds, actor resident MiB) of one actor of `cls`."""
    t = time.monotonic()
    actor = ray.remote(cls).options(num_cpus=0.1).remote(cfg, 1)
    ray.get(actor.warm_up.remote())
    ready = time.monotonic() - t
    proc = psutil.Process(ray.get(actor.pid.remote()))
    cpu = proc.cpu_times()
    rss = proc.memory_info().rss / 2**20
    ray.kill(actor)
    return ready, cpu.user + cpu.system, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    cfg = load_config("vision_reasoning", overrides=["reward.num_workers=1"])
    try:
        rows = {}
        for name, cls in (
            ("reward worker", RewardWorker),
            ("importing the trainer", TrainerImportingRewardWorker),
        ):
            runs = [start_cost(cls, cfg) for _ in range(args.repeats)]
            rows[name] = [statistics.median(col) for col in zip(*runs)]
            for ready, cpu, rss in runs:
                print(f"{name:>22}: ready {ready:.2f} s, actor CPU {cpu:.2f} s, resident {rss:.0f} MiB")
        (light, heavy) = rows.values()
        print(
            f"medians of {args.repeats}: ready {light[0]:.2f} s vs {heavy[0]:.2f} s, CPU {light[1]:.2f} s vs "
            f"{heavy[1]:.2f} s, resident {light[2]:.0f} MiB vs {heavy[2]:.0f} MiB"
        )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
