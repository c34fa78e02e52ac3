"""Flow-GRPO costs on a text-to-image recipe (built-in tiny SD3), side by side.

    python benchmarks/flow_grpo.py [--task text_to_image_jpeg] [--repeats 20] [--train-steps 10] [key=value ...]

`--task text_to_image_jpeg` (the default here): the random 64 x 64 tiny SD3 with a 16-channel
latent VAE; `--task text_to_image`: the built-in image base (32 x 32, pixel space; warmed up first
if it is not in the cache yet).

1. Sampling: the SDE sampler with log-probs at every step (`FlowSampler.sample`) against the
   diffusers pipeline's own `pipe(...)`, same components, prompts, steps, batch, resolution,
   guidance and output type (`pt`), interleaved, median of `--repeats` runs each; the ODE mode
   of the sampler is timed too. Goal: at most 1.05x the pipeline.
2. Training cost per trained timestep (forward with grad + SDE log-prob + clipped loss +
   backward, plus the reference pass when algo.kl_coef > 0) relative to one no-grad denoising
   step at the same batch (the reference implementation measures about 2.4x).
3. Training throughput of whole flow-GRPO steps: images/s and trained timesteps/s, and where a
   step's time goes.

The numbers depend on the machine (and on what else runs on it): compare on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmrl.algos.sde import clipped_step_loss, mean_kl
from mmrl.models.tiny_diffusion import load_flow_pipeline
from mmrl.train.flow_config import load_flow_config
from mmrl.train.flow_grpo import (
    PromptOrder,
    flow_grpo_step,
    flow_model_path,
    load_prompts,
    make_flow_trainee,
    rollout,
    seed_everything,
    train_guidance,
)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per measurement")
    parser.add_argument("--train-steps", type=int, default=10, help="flow-GRPO steps timed for throughput")
    parser.add_argument("--model", help="local diffusers pipeline folder (default: the built-in tiny SD3)")
    parser.add_argument("--task", default="text_to_image_jpeg", help="the diffusion recipe")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = list(args.overrides) + (["model.path=" + args.model] if args.model else [])
    cfg = load_flow_config(args.task, overrides=overrides + ["trainer.progress=false"])
    if cfg.trainer.threads > 0:
        torch.set_num_threads(cfg.trainer.threads)
    seed_everything(cfg.trainer.seed)
    s = cfg.sample
    path = flow_model_path(cfg)
    t = make_flow_trainee(cfg, load_flow_pipeline(path))
    pipe, sampler = t.pipe, t.sampler
    train_prompts, _ = load_prompts(cfg)
    n = cfg.trainer.prompts_per_step * s.group_size
    prompts = PromptOrder(train_prompts, 0).next(n)
    res, steps, gs = s.resolution, s.num_steps, s.guidance_scale
    msl = sampler.max_sequence_length
    print(
        f"flow-GRPO benchmark: {sampler.family} pipeline {path}\n"
        f"  batch {n} images, {steps} steps, {res}x{res}, guidance {gs}, output pt, "
        f"torch threads {torch.get_num_threads()}"
    )

    # 1. Sampling, side by side (interleaved so that load changes hit both alike).
    t.transformer.eval()

    def run_pipeline():
        kwargs = dict(
            num_inference_steps=steps, height=res, width=res, output_type="pt", max_sequence_length=msl
        )
        kwargs["generator"] = torch.Generator().manual_seed(0)
        if sampler.family == "sd3":
            kwargs["guidance_scale"] = gs
        elif gs > 1:
            kwargs.update(true_cfg_scale=gs, negative_prompt=[s.negative_prompt] * n)
        with torch.no_grad():
            return pipe(prompts, **kwargs).images

    def run_sde():
        return sampler.sample(
            prompts,
            steps,
            res,
            res,
            gs,
            torch.Generator().manual_seed(0),
            noise_level=s.noise_level,
            sde_type=s.sde_type,
            negative_prompt=s.negative_prompt,
        )

    def run_ode():
        return sampler.sample(prompts, steps, res, res, gs, torch.Generator().manual_seed(0), sde_steps=())

    for fn in (run_pipeline, run_sde, run_ode):  # warm-up
        fn()
    timings: dict[str, list[float]] = {"pipeline": [], "sde": [], "ode": []}
    runs = [("pipeline", run_pipeline), ("sde", run_sde), ("ode", run_ode)]
    for i in range(args.repeats):
        for name, fn in runs[i % 3 :] + runs[: i % 3]:  # rotate the order: no position bias
            start = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in timings.items()}
    ratios = [a / b for a, b in zip(timings["sde"], timings["pipeline"])]
    print(f"1. sampling (median of {args.repeats} interleaved runs)")
    print(f"  diffusers pipeline          {med['pipeline'] * 1000:8.1f} ms")
    print(f"  SDE sampler + log-probs     {med['sde'] * 1000:8.1f} ms   {med['sde'] / med['pipeline']:.3f}x")
    print(f"  ODE sampler (eval mode)     {med['ode'] * 1000:8.1f} ms   {med['ode'] / med['pipeline']:.3f}x")
    print(f"  per-run ratio SDE/pipeline: median {statistics.median(ratios):.3f}x (goal <= 1.05x)")

    # 2. Training cost per trained timestep vs one no-grad denoising step, same batch.
    gen = torch.Generator().manual_seed(1)
    traj = rollout(cfg, t, PromptOrder(train_prompts, 1).next(cfg.trainer.prompts_per_step), gen)
    mb = n // cfg.trainer.mini_batches
    rows = list(range(mb))
    cond = traj.cond.select(rows)
    j = traj.sde_steps[len(traj.sde_steps) // 2]
    gtrain = train_guidance(cfg)
    adv = torch.randn(mb)
    x_j = traj.latents[rows, j]

    def denoise_step():
        with torch.no_grad():
            sampler.velocity(t.transformer, x_j, traj.timesteps[j], cond, gtrain, res, res)

    def train_step(with_kl: bool):
        t.transformer.train()
        out = sampler.step_log_prob(
            t.transformer, traj, rows, j, cond, gtrain, s.noise_level, s.sde_type, res, res
        )
        loss, _ = clipped_step_loss(out.log_prob, traj.log_probs[rows, j], adv, cfg.algo.clip_range)
        if with_kl and t.reference is not None:
            with torch.no_grad(), t.reference.model() as ref:
                ref_mean = sampler.step_log_prob(
                    ref, traj, rows, j, cond, gtrain, s.noise_level, s.sde_type
                ).mean
            loss = loss + cfg.algo.kl_coef * mean_kl(out.mean, ref_mean, out.std, s.sde_type).mean()
        loss.backward()
        t.optimizer.zero_grad(set_to_none=True)

    t.transformer.eval()
    denoise_step()
    train_step(True)
    base, plain, with_kl = [], [], []
    for _ in range(args.repeats):
        t.transformer.eval()
        base.append(_median_time(denoise_step, 1))
        plain.append(_median_time(lambda: train_step(False), 1))
        with_kl.append(_median_time(lambda: train_step(True), 1))
    b = statistics.median(base)
    print(f"2. training cost per trained timestep (batch {mb}, step {j})")
    print(f"  no-grad denoising step      {b * 1000:8.2f} ms")
    print(
        f"  train timestep (no KL)      {statistics.median(plain) * 1000:8.2f} ms   {statistics.median(plain) / b:.2f}x"
    )
    if t.reference is not None:
        kl = statistics.median(with_kl)
        print(f"  train timestep (+ KL ref)   {kl * 1000:8.2f} ms   {kl / b:.2f}x   (reference ~2.4x)")

    # 3. Whole flow-GRPO steps.
    order = PromptOrder(train_prompts, cfg.trainer.seed)
    flow_grpo_step(cfg, t, order.next(cfg.trainer.prompts_per_step), 0)  # untimed warm-up
    rows_m = []
    start = time.perf_counter()
    for step in range(1, args.train_steps + 1):
        rows_m.append(flow_grpo_step(cfg, t, order.next(cfg.trainer.prompts_per_step), step))
    wall = time.perf_counter() - start
    trained = sum(m["train/timesteps"] for m in rows_m) * n * cfg.trainer.inner_epochs
    print(f"3. training throughput ({args.train_steps} steps of {n} images)")
    print(f"  images/s                    {args.train_steps * n / wall:8.2f}")
    print(f"  trained timesteps/s         {trained / wall:8.2f}   (image x timestep pairs)")
    step_med = statistics.median(m["time/step_s"] for m in rows_m)
    print(f"  step time (median)          {step_med:8.3f} s")
    for part in ("rollout", "reward", "update"):
        p = statistics.median(m[f"time/{part}_s"] for m in rows_m)
        print(f"    {part:<8} {p:8.3f} s  ({100 * p / step_med:4.1f}%)")


if __name__ == "__main__":
    main()
