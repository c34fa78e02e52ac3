"""Fully asynchronous RL on Ray against the synchronous Ray run, side by side in one run.

    python benchmarks/async_scale.py [--steps N] [--gain-steps K] [--max-new-tokens T] [--stops S]

Layout for both modes: Ray, 2 rollout workers, 1 training process, 1 reward worker
(`trainer.ray_cpus_per_actor=0.5`). The asynchronous mode: `trainer.mode=async
trainer.max_staleness=1 algo.tis=token trainer.async_call_prompts=4` (one generator per rollout
worker, each taking 4 prompts' groups at a time into the queue; `--call-prompts`, `--staleness`).

1. Throughput under long-tailed response lengths. A random tiny Qwen2-VL whose generation config
   names S stop tokens besides its own, so every draw ends the response with a small probability
   and lengths spread from a few tokens to the cap T (geometric-like: the longest response of a
   batch, printed beside the mean, is many times the mean, as with reasoning models).
   One untimed warm-up step, then N timed steps of the default recipe (16 prompts x 8
   responses) in each mode: generated tokens/s and the ratio.
2. Held-out gain at the same number of trained samples. The built-in base on vision_reasoning, K
   steps of the default recipe in each mode, greedy held-out accuracy before -> after with 95%
   intervals over the held-out prompts.
3. Checkpoints (memory on the driver and each worker, sharded against gathered; save time,
   synchronous against background): `benchmarks/checkpoint_scale.py`, reported in
   docs/results.md beside these figures.

On a 2-core machine every actor shares the same two cores: generation cannot really run beside
the update, so this measures the overlap the schedule allows and its overheads, not the speed-up
of separate GPUs per role.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

RAY = [
    "trainer.backend=ray",
    "trainer.rollout_workers=2",
    "trainer.train_workers=1",
    "trainer.reward_workers=1",
    "trainer.ray_cpus_per_actor=0.5",
]
MODES: dict[str, list[str]] = {"sync (Ray)": []}
"""The modes run, by label; `main` adds the asynchronous one with its options."""


def long_tailed_model(folder: Path, stops: int) -> Path:
    """A random tiny Qwen2-VL saved to `folder` whose generation config stops on `stops` more
    token ids (printable ASCII first): each draw ends the response with a small probability."""
    from mmrl.models.loading import make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm

    spec = TinyVLMSpec()
    policy = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
    policy.model.generation_config.eos_token_id = [policy.stop_token_ids[0], *range(32, 32 + stops)]
    policy.model.save_pretrained(folder)
    policy.processor.save_pretrained(folder)
    return folder


def throughput(overrides: list[str], steps: int) -> dict[str, float]:
    """One warm-up step, then `steps` timed steps: generated tokens/s over the wall time, the mean
    and longest response length, and the median time the trainer waited for its rollouts (sync:
    the whole generation; async: for the queue)."""
    from mmrl.compose import composition
    from mmrl.config import load_config
    from mmrl.models.loading import load_policy
    from mmrl.train.data import PromptSampler, load_data
    from mmrl.train.grpo import seed_everything
    from mmrl.types import VerifyContext

    total = steps + 1
    cfg = load_config("vision_reasoning", overrides=[*overrides, f"trainer.total_steps={total}"])
    compose = composition(cfg)
    seed_everything(cfg.trainer.seed)
    train_samples, _ = load_data(cfg)
    sampler = PromptSampler(train_samples, seed=cfg.trainer.seed)
    t = compose.make_trainee(cfg, load_policy(cfg.model.path), None)
    lengths: list[float] = []
    try:
        t.router.warm_up()
        compose.step(cfg, t, sampler, VerifyContext(0, total), step=1)  # untimed: actors, queue filled
        rows = []
        start = time.perf_counter()
        for step in range(2, total + 1):
            rows.append(compose.step(cfg, t, sampler, VerifyContext(step - 1, total), step=step))
            lengths.append(rows[-1]["response/length_max"])
        wall = time.perf_counter() - start
    finally:
        t.close()
    tokens = sum(r["throughput/generated_tokens_per_s"] * r["time/step_s"] for r in rows)
    parts = {k: statistics.median(r[k] for r in rows) for k in sorted(rows[0]) if k.startswith("time/")}
    print("   ", "  ".join(f"{k[5:]} {v:.2f}" for k, v in parts.items()), flush=True)
    out = {
        "tokens_per_s": tokens / wall,
        "step_s": wall / steps,
        "length_mean": statistics.mean(r["response/length_mean"] for r in rows),
        "length_max": max(lengths),
        "trainer_wait_s": statistics.median(r.get("async/trainer_wait_s", r["time/rollout_s"]) for r in rows),
    }
    return out


def held_out_gain(overrides: list[str], steps: int, run_dir: Path):
    """`mmrl train` for `steps` steps; its TrainResult (held-out accuracy before and after)."""
    from mmrl.compose import train
    from mmrl.config import load_config

    cfg = load_config(
        "vision_reasoning",
        overrides=[*overrides, f"trainer.total_steps={steps}", f"trainer.eval_every={steps}",
                   "trainer.save_final=false", f"trainer.run_dir={run_dir}"],
    )  # fmt: skip
    return train(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode (throughput)")
    parser.add_argument("--gain-steps", type=int, default=30, help="trained steps per mode (held-out gain)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--stops", type=int, default=8, help="extra stop token ids of the random model")
    parser.add_argument(
        "--call-prompts", type=int, default=4, help="trainer.async_call_prompts of the async mode"
    )
    parser.add_argument("--staleness", type=int, default=1, help="trainer.max_staleness of the async mode")
    parser.add_argument("--skip-gain", action="store_true")
    args = parser.parse_args()
    ASYNC = f"async (Ray, S={args.staleness})"
    MODES[ASYNC] = [
        "trainer.mode=async",
        f"trainer.max_staleness={args.staleness}",
        "algo.tis=token",
        f"trainer.async_call_prompts={args.call_prompts}",
    ]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
    results: dict[str, dict[str, float]] = {}
    gains = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = long_tailed_model(Path(tmp) / "model", args.stops)
            common = ["trainer.progress=false", f"model.path={model}", f"rollout.max_new_tokens={args.max_new_tokens}",
                      "data.kinds=[ocr]", *RAY]  # fmt: skip
            for name, mode in MODES.items():
                t0 = time.perf_counter()
                results[name] = throughput([*common, *mode], args.steps)
                print(f"  ({name}: throughput measured in {time.perf_counter() - t0:.0f} s)", flush=True)
            if not args.skip_gain:
                for name, mode in MODES.items():
                    t0 = time.perf_counter()
                    gains[name] = held_out_gain(["trainer.progress=false", *RAY, *mode], args.gain_steps,
                                                Path(tmp) / name.split()[0])  # fmt: skip
                    print(
                        f"  ({name}: {args.gain_steps} steps trained in {time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
    finally:
        ray.shutdown()

    print(f"\n1. Throughput, long-tailed lengths (random tiny Qwen2-VL, {args.stops} extra stop ids, "
          f"cap {args.max_new_tokens}): {args.steps} timed steps of 16 x 8 responses")  # fmt: skip
    print(f"{'mode':<18} {'tokens/s':>9} {'s/step':>7} {'mean len':>9} {'max len':>8} {'trainer waits':>14}")
    for name, m in results.items():
        print(f"{name:<18} {m['tokens_per_s']:9.1f} {m['step_s']:7.2f} {m['length_mean']:9.1f} {m['length_max']:8.0f} "
              f"{m['trainer_wait_s']:13.2f}s")  # fmt: skip
    sync, asyn = results["sync (Ray)"], results[ASYNC]
    print(f"async / sync tokens/s: {asyn['tokens_per_s'] / sync['tokens_per_s']:.2f}x (goal >= 1.5x)")
    if gains:
        print(f"\n2. Held-out gain (built-in base, {args.gain_steps} steps of 16 x 8 each, greedy accuracy "
              f"on {next(iter(gains.values())).eval_size} held-out prompts, 95% intervals)")  # fmt: skip
        for name, r in gains.items():
            lo0, hi0 = r.start_interval
            lo1, hi1 = r.final_interval
            print(f"{name:<18} {r.start_accuracy:.3f} [{lo0:.3f}, {hi0:.3f}] -> {r.final_accuracy:.3f} "
                  f"[{lo1:.3f}, {hi1:.3f}]  gain {r.final_accuracy - r.start_accuracy:+.3f}  ({r.seconds:.0f} s)")  # fmt: skip
        s, a = gains["sync (Ray)"], gains[ASYNC]
        inside = s.final_interval[0] <= a.final_accuracy <= s.final_interval[1]
        print(f"async's final accuracy inside the sync run's interval: {inside} (goal: inside)")
    print(f"caveat: {os.cpu_count()} CPU cores shared by every actor")


if __name__ == "__main__":
    main()
