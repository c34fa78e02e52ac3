"""Rollout + training throughput of GRPO on the default task (built-in base, default recipe).

    python benchmarks/throughput.py [--steps N] [key=value ...]

Runs N GRPO steps after one untimed warm-up step and prints samples/s, generated tokens/s and
where the step time goes: rollout (generation, with scoring overlapped), reward_wait (scoring
still running after generation), prep (old log-probs, advantages), update (the mini-batches). The numbers depend on the machine: run it
where you compare.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mmrl.config import load_config
from mmrl.models.base import builtin_base
from mmrl.models.loading import load_policy
from mmrl.train.data import PromptSampler, load_data
from mmrl.train.grpo import grpo_step, make_trainee, seed_everything
from mmrl.types import VerifyContext


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config("vision_reasoning", overrides=args.overrides)
    seed_everything(cfg.trainer.seed)
    train_samples, _ = load_data(cfg)
    policy = load_policy(cfg.model.path or builtin_base(cfg))
    t = make_trainee(cfg, policy)
    t.router.warm_up()
    sampler = PromptSampler(train_samples, cfg.trainer.seed)
    B, G = cfg.trainer.prompts_per_step, cfg.rollout.group_size
    try:
        grpo_step(cfg, t, sampler, VerifyContext(0, args.steps + 1))  # untimed warm-up
        rows = []
        start = time.perf_counter()
        for step in range(args.steps):
            rows.append(grpo_step(cfg, t, sampler, VerifyContext(step + 1, args.steps + 1)))
        wall = time.perf_counter() - start
    finally:
        t.router.close()
    tokens = sum(r["throughput/generated_tokens_per_s"] * r["time/step_s"] for r in rows)
    samples = args.steps * B * G

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"GRPO throughput on vision_reasoning: {args.steps} steps of {B} prompts x {G} responses")
    print(f"  samples/s           {samples / wall:8.1f}")
    print(f"  generated tokens/s  {tokens / wall:8.1f}")
    print(f"  step time (median)  {med('time/step_s'):8.3f} s")
    for part in ("rollout", "reward_wait", "prep", "update"):
        share = med(f"time/{part}_s") / med("time/step_s")
        print(f"    {part:<11} {med(f'time/{part}_s'):8.3f} s  ({100 * share:4.1f}%)")
    print(f"  mean response length {tokens / samples:7.2f} tokens")


if __name__ == "__main__":
    main()
