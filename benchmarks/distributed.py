"""Throughput of the ways a run can be laid out, side by side on the same model and steps:

    local on-policy          trainer.backend=local trainer.mode=sync (the baseline)
    local async (S=1)        trainer.mode=async trainer.max_staleness=1 algo.tis=token
    Ray, 1 rollout worker    trainer.backend=ray trainer.rollout_workers=1 trainer.train_workers=1
    Ray, 2 rollout workers   trainer.backend=ray trainer.rollout_workers=2 trainer.train_workers=1
    Ray async (S=1), 2 rw    the same with trainer.mode=async trainer.max_staleness=1 algo.tis=token
    local DeepSpeed ZeRO-2   trainer.strategy=deepspeed (the update by a one-process engine)
    Ray, FSDP2 x2            trainer.backend=ray trainer.rollout_workers=1 trainer.train_workers=2
    Ray, DeepSpeed ZeRO-2 x2 ... trainer.strategy=deepspeed trainer.zero_stage=2
    Ray, DeepSpeed ZeRO-3 x2 ... trainer.strategy=deepspeed trainer.zero_stage=3

    python benchmarks/distributed.py [--steps N] [--only NAME ...] [key=value ...]

Each layout runs one untimed warm-up step (actors started, the async pipeline filled), then N
timed steps of the default recipe (16 prompts x 8 responses) on the built-in base. Printed:
samples/s, generated tokens/s, wall time per step, the first two as ratios to local on-policy,
and where a step's time goes. In async mode `rollout` is the wait for the generator's batch
(generation overlapped with the previous update), not the generation itself.
Ray actors get `trainer.ray_cpus_per_actor=0.5` (two rollout workers, or one and a 2-process
training group, and the reward worker fill 2 CPUs) and one torch thread each. The last three
compare the training group's strategies on the same layout (FSDP2, DeepSpeed ZeRO-2, ZeRO-3). On a 2-core machine every layout
shares the same two cores, so this measures the overheads and the overlap, not the scaling a
cluster gives: read the ratios with that in mind.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from dataclasses import dataclass

from mmrl.compose import composition
from mmrl.config import load_config
from mmrl.distributed import torch_extensions_dir
from mmrl.models.base import builtin_base
from mmrl.models.loading import load_policy
from mmrl.train.data import PromptSampler, load_data
from mmrl.train.grpo import seed_everything
from mmrl.types import VerifyContext

LAYOUTS: dict[str, list[str]] = {
    "local on-policy": [],
    "local async (S=1)": ["trainer.mode=async", "trainer.max_staleness=1", "algo.tis=token"],
    "Ray, 1 rollout worker": [
        "trainer.backend=ray",
        "trainer.rollout_workers=1",
        "trainer.train_workers=1",
        "trainer.ray_cpus_per_actor=0.5",
    ],
    "Ray, 2 rollout workers": [
        "trainer.backend=ray",
        "trainer.rollout_workers=2",
        "trainer.train_workers=1",
        "trainer.ray_cpus_per_actor=0.5",
    ],
    "Ray async (S=1), 2 rw": [
        "trainer.backend=ray",
        "trainer.rollout_workers=2",
        "trainer.train_workers=1",
        "trainer.ray_cpus_per_actor=0.5",
        "trainer.mode=async",
        "trainer.max_staleness=1",
        "algo.tis=token",
    ],
    "local DeepSpeed ZeRO-2": ["trainer.strategy=deepspeed"],
    **{
        name: [
            "trainer.backend=ray",
            "trainer.rollout_workers=1",
            "trainer.train_workers=2",
            "trainer.ray_cpus_per_actor=0.5",
            *strategy,
        ]
        for name, strategy in {
            "Ray, FSDP2 x2": ["trainer.strategy=fsdp2"],
            "Ray, DeepSpeed ZeRO-2 x2": ["trainer.strategy=deepspeed", "trainer.zero_stage=2"],
            "Ray, DeepSpeed ZeRO-3 x2": ["trainer.strategy=deepspeed", "trainer.zero_stage=3"],
        }.items()
    },
}


@dataclass
class Measured:
    samples_per_s: float
    tokens_per_s: float
    step_s: float
    reward: float
    parts: dict[str, float]
    """Median seconds per step in rollout (generation + scoring), prep (old log-probs,
    advantages) and update (the mini-batches, and the weight sync on Ray)."""


def run_layout(overrides: list[str], steps: int) -> Measured:
    """One warm-up step, then `steps` timed steps of the layout; wall-clock throughput."""
    cfg = load_config("vision_reasoning", overrides=[*overrides, f"trainer.total_steps={steps + 1}"])
    compose = composition(cfg)
    seed_everything(cfg.trainer.seed)
    train_samples, _ = load_data(cfg)
    sampler = PromptSampler(train_samples, seed=cfg.trainer.seed)
    t = compose.make_trainee(cfg, load_policy(cfg.model.path or builtin_base(cfg)), None)
    total = steps + 1
    try:
        t.router.warm_up()
        compose.step(cfg, t, sampler, VerifyContext(0, total), step=1)  # untimed warm-up
        rows = []
        start = time.perf_counter()
        for step in range(2, total + 1):
            rows.append(compose.step(cfg, t, sampler, VerifyContext(step - 1, total), step=step))
        wall = time.perf_counter() - start
    finally:
        t.close()
    samples = sum(r["throughput/samples_per_s"] * r["time/step_s"] for r in rows)
    tokens = sum(r["throughput/generated_tokens_per_s"] * r["time/step_s"] for r in rows)
    reward = sum(r["reward/mean"] for r in rows) / len(rows)
    parts = {p: statistics.median(r[f"time/{p}_s"] for r in rows) for p in ("rollout", "prep", "update")}
    return Measured(samples / wall, tokens / wall, wall / steps, reward, parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", nargs="*", default=None, help="layout names (default: all)")
    parser.add_argument("overrides", nargs="*", help="key=value applied to every layout")
    args = parser.parse_args()
    names = args.only or list(LAYOUTS)
    common = ["trainer.progress=false", *args.overrides]
    # DeepSpeed's ops, built at its first start (~50 s on the CPU), reused from the tests' cache.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())

    ray = None
    if any("backend=ray" in o for n in names for o in LAYOUTS[n]):
        import ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
    results: dict[str, Measured] = {}
    try:
        for name in names:
            t0 = time.perf_counter()
            results[name] = run_layout([*common, *LAYOUTS[name]], args.steps)
            print(f"  ({name}: measured in {time.perf_counter() - t0:.0f} s including start-up)", flush=True)
    finally:
        if ray is not None:
            ray.shutdown()

    cfg = load_config("vision_reasoning")
    B, G = cfg.trainer.prompts_per_step, cfg.rollout.group_size
    print(
        f"\nGRPO layouts on vision_reasoning (built-in base): {args.steps} timed steps of {B} x {G} responses"
    )
    print(
        f"{'layout':<25} {'samples/s':>10} {'tokens/s':>10} {'s/step':>8} {'x samples/s':>12} {'x tokens/s':>11} {'reward':>7}"
    )
    base = results.get("local on-policy")
    for name, m in results.items():
        ratio = f"{m.samples_per_s / base.samples_per_s:11.2f}x" if base else f"{'-':>12}"
        tratio = f"{m.tokens_per_s / base.tokens_per_s:10.2f}x" if base else f"{'-':>11}"
        print(
            f"{name:<25} {m.samples_per_s:10.1f} {m.tokens_per_s:10.1f} {m.step_s:8.2f} {ratio} {tratio} "
            f"{m.reward:7.3f}   {m.parts['rollout']:.2f} / {m.parts['prep']:.2f} / {m.parts['update']:.2f}"
        )
    print(
        f"caveat: {os.cpu_count()} CPU cores shared by every role (generation, verifiers, training, Ray "
        "actors): this shows overheads and overlap, not the speed-up of separate GPUs per role"
    )


if __name__ == "__main__":
    main()
