"""Flow-GRPO on a text-to-image pipeline (SD3 / FLUX): the whole training loop, top to bottom.

One step (`flow_grpo_step`):
  1. take B prompts; sample G images each with the SDE sampler (`mmrl.rollout.diffusion`),
     recording latents and log-probs at the SDE steps (all steps, or a random window)
  2. score the images with the configured rewards (weighted sum, or GDPO's per-reward
     normalisation)
  3. per-prompt advantages (group or global std), clipped
  4. old log-probs: the rollout's, or a no-grad recomputation
  5. per inner epoch, the B x G rows are shuffled and split into mini-batches; per mini-batch,
     for each trained step j: recompute the step's log-prob with grad, PPO-clipped ratio loss,
     plus the KL to the reference on the predicted mean; gradients accumulate over the trained
     steps, then one clipped AdamW step and an EMA update
  6. metrics (JSONL + TensorBoard); every `eval_every` steps an ODE-only evaluation with more
     steps and the EMA weights (the same prompts and seed each time; on GenEval-style prompts
     also their held-out accuracy, `eval/geneval/accuracy`), its image grid saved as a PNG in
     the run directory; optionally
     the step's images, rewards and advantages (`trainer.dump_steps`)
The loop also writes resumable checkpoints (`mmrl.train.flow_checkpoint`) every
`checkpoint_every` steps, at the end and on SIGINT / SIGTERM, and `trainer.resume` continues
from one exactly.

    from mmrl.train.flow_config import load_flow_config
    from mmrl.train.flow_grpo import run_text_to_image
    result = run_text_to_image(load_flow_config("text_to_image", overrides=["trainer.total_steps=20"]))
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmrl.algos.sde import clipped_step_loss, flow_grpo_advantages, mean_kl
from mmrl.models.precision import Precision, adamw, place, precision_from
from mmrl.models.saving import skip_unused_deepspeed_probe
from mmrl.models.tiny_diffusion import builtin_pipeline_path, load_flow_pipeline
from mmrl.progress import ProgressBar
from mmrl.rollout.diffusion import FlowSampler, Trajectory, choose_sde_steps
from mmrl.train.ema import EMA
from mmrl.train.flow_checkpoint import (
    FlowProgress,
    check_config_unchanged,
    find_flow_checkpoint,
    remove_stale_temporaries,
    restore_flow_checkpoint,
    write_flow_checkpoint,
    write_flow_dump,
)
from mmrl.train.flow_config import FlowConfig, flow_config_dict, flow_config_to_yaml
from mmrl.train.metrics_log import check_trackers_installed, open_metrics_log
from mmrl.train.plots import plot_flow_curves
from mmrl.train.rundir import hold_run_dir
from mmrl.train.schedule import schedule_factor

log = logging.getLogger(__name__)


@dataclass
class FlowTrainResult:
    run_dir: Path
    start_reward: float
    """Mean evaluation reward of the starting pipeline."""
    final_reward: float
    """Mean evaluation reward of the final weights (the ones saved), not the best evaluation."""
    best_reward: float
    """Best mean evaluation reward seen at any evaluation (reported, never substituted)."""
    steps: int
    seconds: float
    interrupted: bool = False
    """Stopped early by SIGINT / SIGTERM (a checkpoint was written)."""
    start_accuracy: float | None = None
    """Held-out GenEval-style accuracy of the starting pipeline (None: not GenEval-style prompts)."""
    final_accuracy: float | None = None
    """Held-out GenEval-style accuracy of the final weights."""
    start_eval: dict[str, float] | None = None
    """The first evaluation's GenEval figures (`eval_figures`; None: not GenEval-style prompts)."""
    final_eval: dict[str, float] | None = None
    """The last evaluation's GenEval figures."""

    def summary_line(self, task: str = "text_to_image") -> str:
        """The line `mmrl train --task <task>` ends with."""
        if self.interrupted:
            return (
                f"interrupted at step {self.steps}; checkpoint written. Continue with: mmrl train --task "
                f"{task} trainer.run_dir={self.run_dir} --resume auto ..."
            )
        accuracy = ""
        if self.start_eval and self.final_eval:
            accuracy = describe_figures(self.start_eval, self.final_eval) + "; "
        return (
            f"done in {self.seconds:.0f}s: {accuracy}eval reward {self.start_reward:.4f} -> "
            f"{self.final_reward:.4f} ({self.final_reward - self.start_reward:+.4f}; best "
            f"{self.best_reward:.4f}); run directory {self.run_dir}"
        )


def eval_figures(metrics: dict[str, float]) -> dict[str, float] | None:
    """What the final line reports of one evaluation's metrics: held-out strict accuracy, its
    Wilson 95% interval and size (`accuracy`, `low`, `high`, `n`), the same on training prompts
    (`train_*`, when they were evaluated) and the held-out images' `edge_noise`; None without
    GenEval-style held-out prompts."""
    if "eval/geneval/accuracy" not in metrics:
        return None
    out = {}
    for prefix, name in (("eval/geneval/", ""), ("eval/geneval/train/", "train_")):
        if f"{prefix}accuracy" in metrics:
            out[f"{name}accuracy"] = metrics[f"{prefix}accuracy"]
            out[f"{name}low"] = metrics[f"{prefix}accuracy_low"]
            out[f"{name}high"] = metrics[f"{prefix}accuracy_high"]
            out[f"{name}n"] = metrics[f"{prefix}n"]
    out["edge_noise"] = metrics.get("eval/geneval/edge_noise", float("nan"))
    return out


def _interval(f: dict[str, float], name: str = "") -> str:
    return f"{f[name + 'accuracy']:.1%} [{100 * f[name + 'low']:.1f}-{100 * f[name + 'high']:.1f}]"


def describe_eval(f: dict[str, float]) -> str:
    """One evaluation's `eval_figures` in words (the log line of each evaluation)."""
    parts = [f"held-out GenEval accuracy {_interval(f)} ({int(f['n'])} images)"]
    if "train_accuracy" in f:
        parts.append(f"training prompts {_interval(f, 'train_')} ({int(f['train_n'])} images)")
    parts.append(f"edge noise {f['edge_noise']:.1f}")
    return ", ".join(parts)


def describe_figures(start: dict[str, float], final: dict[str, float]) -> str:
    """'held-out GenEval accuracy a% [lo-hi] -> b% [lo-hi] (+x points; n images each); training
    prompts ...; edge noise u -> v' from two `eval_figures` (the brackets: Wilson 95% intervals)."""

    def change(name: str, what: str) -> str:
        n0, n1 = int(start[name + "n"]), int(final[name + "n"])
        sizes = f"{n1} images each" if n0 == n1 else f"{n0} and {n1} images"
        gain = 100 * (final[name + "accuracy"] - start[name + "accuracy"])
        return f"{what} {_interval(start, name)} -> {_interval(final, name)} ({gain:+.1f} points; {sizes})"

    parts = [change("", "held-out GenEval accuracy")]
    if "train_accuracy" in start and "train_accuracy" in final:
        parts.append(change("train_", "training prompts"))
    parts.append(f"edge noise {start['edge_noise']:.1f} -> {final['edge_noise']:.1f}")
    return "; ".join(parts)


class Reference:
    """The frozen reference policy for the KL term.

    With LoRA it is the base model itself: the adapters are switched off for the reference
    pass (no second copy); with full fine-tuning it is a frozen copy made before training.
    """

    def __init__(self, transformer: torch.nn.Module, lora: bool, dtype: torch.dtype | None = None):
        self.transformer = transformer
        self.copy = None
        if not lora:  # frozen: stored in the compute dtype, like the pipeline's other frozen parts
            self.copy = copy.deepcopy(transformer).eval().requires_grad_(False)
            if dtype is not None:
                self.copy.to(dtype=dtype)
        self.lora_layers = []
        if lora:
            from peft.tuners.tuners_utils import BaseTunerLayer

            self.lora_layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]

    @contextmanager
    def model(self) -> Iterator[torch.nn.Module]:
        if self.copy is not None:
            yield self.copy
            return
        for m in self.lora_layers:
            m.enable_adapters(False)
        try:
            yield self.transformer
        finally:
            for m in self.lora_layers:
                m.enable_adapters(True)


@dataclass
class FlowTrainee:
    """What one flow-GRPO step works on."""

    pipe: object
    sampler: FlowSampler
    transformer: torch.nn.Module
    params: list[torch.nn.Parameter]
    reference: Reference | None
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    rewards: list
    updates: int = 0


def holding_the_run_dir(cfg: FlowConfig, run: Callable[[FlowConfig], FlowTrainResult]) -> FlowTrainResult:
    """`run(cfg)` while this process holds the run directory's lock (the image trainers' entry).

    The folder is fixed once (`runs/<task>-<time>` when none is set), so the lock and everything
    after name the same one. One run writes a run directory at a time, a resumed one too: the
    lock comes before anything there is read or cleaned (a second trainer is refused at once,
    naming the first)."""
    if not cfg.trainer.run_dir:
        cfg = copy.deepcopy(cfg)
        cfg.trainer.run_dir = f"runs/{cfg.data.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    skip_unused_deepspeed_probe()  # saves need not import DeepSpeed (mmrl.models.saving)
    with hold_run_dir(cfg.trainer.run_dir, "mmrl train"):
        return run(cfg)


def run_text_to_image(cfg: FlowConfig) -> FlowTrainResult:
    """`mmrl train --task text_to_image`: train, evaluate, save; returns the figures."""
    return holding_the_run_dir(cfg, _run_text_to_image)


def _run_text_to_image(cfg: FlowConfig) -> FlowTrainResult:
    """`run_text_to_image` while this process holds the run directory's lock."""
    from mmrl.train.grpo import StopRequest

    t_start = time.monotonic()
    # 1. Setup: seeds, threads, prompts (checked before anything is written).
    if cfg.trainer.threads > 0:
        torch.set_num_threads(cfg.trainer.threads)
    train_prompts, eval_prompts = load_prompts(cfg)
    train_eval_prompts = training_eval_prompts(cfg, train_prompts)
    sampler_order = PromptOrder(train_prompts, cfg.trainer.seed)
    checkpoint = None
    if cfg.trainer.resume:  # the checkpoint and its config are checked before anything is written
        remove_stale_temporaries(Path(cfg.trainer.run_dir))
        checkpoint = find_flow_checkpoint(cfg, Path(cfg.trainer.run_dir))
        if checkpoint is not None:
            check_config_unchanged(cfg, checkpoint)
    check_trackers_installed(cfg.trainer.loggers)
    run_dir = create_run_dir(cfg)
    (run_dir / "images").mkdir(exist_ok=True)

    # 2. Pipeline, trainable weights (LoRA or all), reference, optimizer, EMA, rewards; then the
    #    checkpoint's state, if resuming (its weights replace the trained ones, not the reference).
    precision = flow_precision(cfg)
    model_path = flow_model_path(cfg, precision.device)
    pipe = load_flow_pipeline(model_path, precision.compute, revision=cfg.model.revision)
    # Seeded after the pipeline exists: building the built-in one (first use of a cache) draws
    # from the global RNG, which must not change the LoRA initialisation or anything after it.
    seed_everything(cfg.trainer.seed)
    t = make_flow_trainee(cfg, pipe)
    progress = FlowProgress()
    if checkpoint is not None:
        restore_flow_checkpoint(checkpoint, t, sampler_order, progress)
        log.info("resumed from %s at step %d", checkpoint, progress.step)
    elif cfg.trainer.resume:
        log.info("resume=auto: no checkpoint in %s yet; starting fresh", run_dir)
    # A resumed run drops what the crashed one logged after its checkpoint; `resume=auto` with
    # no checkpoint yet starts the files over.
    keep_until = progress.step if checkpoint is not None else (-1 if cfg.trainer.resume else None)
    metrics_log = open_metrics_log(run_dir, cfg.trainer, flow_config_dict(cfg), resume_after=keep_until)
    total = cfg.trainer.total_steps

    def run_eval(step: int) -> float:
        metrics, images = evaluate(cfg, t, eval_prompts, train_eval_prompts)
        metrics_log.log(step, metrics)
        grid = save_grid(images, run_dir / "images" / f"eval_step_{step:05d}.png")
        metrics_log.log_image("eval/images", grid, step)
        figures = eval_figures(metrics)
        log.info(
            "step %d: eval reward %.4f%s", step, metrics["eval/reward/mean"],
            "" if figures is None else "; " + describe_eval(figures),
        )  # fmt: skip
        if step == 0:
            progress.start_accuracy = metrics.get("eval/geneval/accuracy")
            progress.start_eval = figures
        progress.final_accuracy = metrics.get("eval/geneval/accuracy")
        progress.final_eval = figures
        return metrics["eval/reward/mean"]

    # 3. The loop: one flow-GRPO step per rollout batch, ODE evaluation every `eval_every` steps,
    #    a checkpoint every `checkpoint_every` steps, at the end and when SIGINT / SIGTERM asks
    #    to stop.
    stop = StopRequest()
    p = progress
    with metrics_log:  # every sink closed on the way out; the trackers told "failed" on an error
        with stop.installed():
            if checkpoint is None:
                p.start_reward = p.best_reward = p.final_reward = run_eval(0)
            bar = ProgressBar(
                range(p.step + 1, total + 1),
                desc="flow-GRPO",
                disable=not cfg.trainer.progress,
                dynamic_ncols=True,
            )
            for step in bar:
                prompts = sampler_order.next(cfg.trainer.prompts_per_step)
                dump_dir = run_dir if cfg.trainer.dump_steps else None
                metrics = flow_grpo_step(cfg, t, prompts, step, dump_dir=dump_dir)
                metrics_log.log(step, metrics)
                p.step = step
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", eval=f"{p.final_reward:.3f}")
                if (cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0) or step == total:
                    p.final_reward = run_eval(step)
                    p.best_reward = max(p.best_reward, p.final_reward)
                every = cfg.trainer.checkpoint_every
                if (every and step % every == 0) or step == total or stop.requested:
                    write_flow_checkpoint(cfg, t, sampler_order, p, run_dir)
                if stop.requested:
                    log.warning("stopping at step %d on %s; checkpoint written", step, stop.signal_name)
                    break
            bar.close()

        # 4. Final pipeline (EMA weights, LoRA merged; not for an interrupted run: its checkpoint is
        #    what continues it), curves, summary.
        if cfg.trainer.save_final and not stop.requested:
            save_pipeline(cfg, t, run_dir / "final")
        plot_flow_curves(run_dir / "metrics.jsonl", run_dir / "training_curves.png")
        metrics_log.log_image("plots/training_curves", run_dir / "training_curves.png", p.step)
        metrics_log.status = "interrupted" if stop.requested else "finished"
    result = FlowTrainResult(
        run_dir, p.start_reward, p.final_reward, p.best_reward, p.step, time.monotonic() - t_start,
        interrupted=stop.requested, start_accuracy=p.start_accuracy, final_accuracy=p.final_accuracy,
        start_eval=p.start_eval, final_eval=p.final_eval,
    )  # fmt: skip
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in result.__dict__.items()}
    summary["model_path"] = str(model_path)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return result


def create_run_dir(cfg: FlowConfig) -> Path:
    """`trainer.run_dir` (default `runs/<task>-<time>`) with the resolved config; a folder that
    already holds a run (a non-empty metrics.jsonl) is refused unless resuming. (Like
    `mmrl.train.rundir.create_run_dir`, which is typed to the VLM config.)"""
    if cfg.trainer.run_dir:
        path = Path(cfg.trainer.run_dir)
    else:
        path = Path("runs") / f"{cfg.data.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    metrics = path / "metrics.jsonl"
    if not cfg.trainer.resume and metrics.exists() and metrics.stat().st_size > 0:
        raise ValueError(
            f"{path} already holds a run (metrics.jsonl): continue it with --resume auto, or choose another "
            "trainer.run_dir"
        )
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(flow_config_to_yaml(cfg))
    return path


def flow_model_path(cfg: FlowConfig, device: str | torch.device = "cpu") -> Path:
    """The pipeline folder: `model.path`, else the built-in one (`model.base`): the random tiny
    pipeline, or the warmed-up image base (made on `device` the first time, then cached)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    if cfg.model.base == "geneval":
        from mmrl.models.image_base import builtin_image_base

        msl = cfg.model.max_sequence_length or 8
        return builtin_image_base(
            cfg.model.tiny, cfg.model.warmup, cfg.model.cache_dir, device, msl, progress=cfg.trainer.progress
        )
    return builtin_pipeline_path(cfg.model.tiny, cfg.model.seed, cfg.model.cache_dir)


def flow_precision(cfg: FlowConfig) -> Precision:
    """The pipeline's device and dtypes from `trainer.device`, `model.dtype`, `model.master_dtype`
    (`mmrl.models.precision`: the same rules as the VLM trainer's)."""
    return precision_from(cfg.trainer.device, cfg.model.dtype, cfg.model.master_dtype)


def make_flow_trainee(cfg: FlowConfig, pipe) -> FlowTrainee:
    """Freeze what is not trained, add LoRA (or unfreeze the transformer), place everything on
    the device in its dtype (frozen parts in the compute dtype, trained weights in the master
    dtype), build the rest."""
    precision = flow_precision(cfg)
    pipe.to(precision.device)
    pipe.set_progress_bar_config(disable=True)
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.requires_grad_(False).eval()
    transformer = pipe.transformer
    if cfg.lora.enabled:
        from peft import LoraConfig

        transformer.requires_grad_(False)
        transformer.add_adapter(
            LoraConfig(
                r=cfg.lora.rank,
                lora_alpha=cfg.lora.alpha,
                init_lora_weights=cfg.lora.init,
                target_modules=list(cfg.lora.target_modules),
            )
        )
    else:
        transformer.requires_grad_(True)
    place(transformer, precision)
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.to(device=precision.device, dtype=precision.compute)
    log.info("flow pipeline: %s", precision.describe())
    params = [p for p in transformer.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"no trainable parameters: lora.target_modules {cfg.lora.target_modules} matched nothing"
        )
    o = cfg.optim
    optimizer = adamw(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
    msl = cfg.model.max_sequence_length or (8 if cfg.model.path is None else 256)
    return FlowTrainee(
        pipe=pipe,
        sampler=FlowSampler(pipe, max_sequence_length=msl, autocast=precision.context),
        transformer=transformer,
        params=params,
        reference=Reference(transformer, cfg.lora.enabled, precision.compute)
        if cfg.algo.kl_coef > 0
        else None,
        optimizer=optimizer,
        ema=EMA(params, cfg.trainer.ema_decay) if cfg.trainer.ema else None,
        rewards=make_rewards(cfg, precision.device),
    )


def make_rewards(cfg: FlowConfig, device: str | torch.device = "cpu") -> list:
    """The configured reward models (`mmrl.rewards` registry), built once, on the pipeline's
    `device` unless a reward's kwargs name its own (`reward.kwargs.<name>.device`). Their weights
    keep each model's own dtype default (float32, as flow_grpo scores), set by `dtype` in kwargs."""
    from mmrl.rewards import get_reward_model, reward_model_names

    known = reward_model_names()
    models = []
    for name in cfg.reward.names:
        if name not in known:
            raise ValueError(f"reward.names: unknown reward {name!r} (known: {', '.join(known)})")
        kwargs = {"device": str(device), **dict(cfg.reward.kwargs.get(name, {}) or {})}
        models.append(get_reward_model(name, **kwargs))
    return models


def flow_grpo_step(
    cfg: FlowConfig, t: FlowTrainee, prompts: list[str], step: int, dump_dir: Path | None = None
) -> dict[str, float]:
    """One flow-GRPO step on B prompts (B x G images); returns its metrics. With `dump_dir`
    (a run directory) the step's images, rewards and advantages are written under its `dumps/`."""
    s, a = cfg.sample, cfg.algo
    G = s.group_size
    gen = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + step)
    t0 = time.monotonic()
    # a. Rollout: G images per prompt with SDE log-probs at the chosen steps.
    traj = rollout(cfg, t, prompts, gen)
    rows_prompts = [p for p in prompts for _ in range(G)]
    t1 = time.monotonic()
    # b. Rewards, one column per reward model.
    scores, reward_metrics = score_images(cfg, t, traj.images, rows_prompts)
    t2 = time.monotonic()
    # c. Per-prompt advantages, clipped.
    advantages = compute_advantages(cfg, scores)
    # d. Old log-probs: the sampler's, or a no-grad recomputation with the trainer.
    trained = choose_trained_steps(traj.sde_steps, a.timestep_fraction, gen)
    old = traj.log_probs if a.old_logprobs == "rollout" else recompute_log_probs(cfg, t, traj, trained)
    # e. Policy update over mini-batches, accumulating over the trained steps.
    metrics = update_policy(cfg, t, traj, advantages, old, trained, gen)
    t3 = time.monotonic()

    n = len(rows_prompts)
    grouped = scores.nan_to_num(nan=0.0) @ torch.tensor(cfg.reward.weights, dtype=torch.float32)
    if dump_dir is not None:
        write_flow_dump(
            dump_dir, step, rows_prompts, traj.images, scores, list(cfg.reward.names), grouped, advantages, G
        )
    metrics.update(reward_metrics)
    metrics.update(
        {
            "reward/zero_std_frac": float((grouped.view(-1, G).std(dim=1) == 0).float().mean()),
            "adv/abs_mean": float(advantages.abs().mean()),
            "adv/max": float(advantages.max()),
            "adv/min": float(advantages.min()),
            "rollout/sde_steps": float(len(traj.sde_steps)),
            "rollout/window_start": float(traj.sde_steps[0]) if traj.sde_steps else -1.0,
            "train/timesteps": float(len(trained)),
            "time/rollout_s": t1 - t0,
            "time/reward_s": t2 - t1,
            "time/update_s": t3 - t2,
            "time/step_s": t3 - t0,
            "throughput/images_per_s": n / (t3 - t0),
            "throughput/trained_timesteps_per_s": n * len(trained) * cfg.trainer.inner_epochs / (t3 - t0),
        }
    )
    return metrics


@torch.no_grad()
def rollout(cfg: FlowConfig, t: FlowTrainee, prompts: list[str], gen: torch.Generator) -> Trajectory:
    """B x G images (prompt-major) sampled with the SDE at the chosen steps."""
    s = cfg.sample
    G, res = s.group_size, s.resolution
    t.transformer.eval()
    guided = s.guidance_scale > 1.0
    cond = t.sampler.encode(prompts, guidance=guided, negative_prompt=s.negative_prompt)
    cond = cond.select(torch.arange(len(prompts)).repeat_interleave(G))
    n = len(cond)
    if s.same_latent:
        latents = t.sampler.initial_latents(len(prompts), res, res, gen).repeat_interleave(G, dim=0)
    else:
        latents = t.sampler.initial_latents(n, res, res, gen)
    sde_steps = choose_sde_steps(s.num_steps, s.sde_window_size, s.sde_window_range, gen)
    chunk = s.batch_size or n
    parts = []
    for i in range(0, n, chunk):
        rows = list(range(i, min(n, i + chunk)))
        parts.append(
            t.sampler.sample(
                cond.select(rows),
                num_steps=s.num_steps,
                height=res,
                width=res,
                guidance_scale=s.guidance_scale,
                generator=gen,
                latents=latents[i : i + chunk],
                noise_level=s.noise_level,
                sde_steps=sde_steps,
                sde_type=s.sde_type,
                output_type="pt",
            )
        )
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return Trajectory(
        latents=torch.cat([p.latents for p in parts]),
        log_probs=torch.cat([p.log_probs for p in parts]),
        timesteps=first.timesteps,
        sigmas=first.sigmas,
        sde_steps=first.sde_steps,
        images=torch.cat([p.images for p in parts]),
        cond=cond,
    )


def score_images(
    cfg: FlowConfig, t: FlowTrainee, images: torch.Tensor, prompts: list[str]
) -> tuple[torch.Tensor, dict[str, float]]:
    """[N, K] rewards (one column per reward model of `reward.names`) and their metrics
    (`score_columns`)."""
    r = cfg.reward
    return score_columns(r.names, t.rewards, r.weights, r.on_error, images, prompts)


def score_columns(
    names: Sequence[str],
    models: Sequence,
    weights: Sequence[float],
    on_error: str,
    images: torch.Tensor,
    prompts: list[str],
    prefix: str = "reward",
    **fields,
) -> tuple[torch.Tensor, dict[str, float]]:
    """[N, K] rewards, one column per reward model, and their metrics under `prefix`.

    A reward model that raises, returns the wrong number of scores, or non-finite ones is an
    error for the images concerned, never a silent score: it is logged and counted
    (`<prefix>/errors/<name>`), and those entries are NaN in the result; `compute_advantages`
    then scores them 0 or drops the images (`on_error`). `fields` (e.g. `references=[...]`) go
    to every model."""
    columns, metrics = [], {}
    for name, model in zip(names, models):
        try:
            out = model.score_with_components(images=images, prompts=prompts, **fields)
            col = torch.tensor(out.scores, dtype=torch.float32)
            if col.shape != (len(prompts),):
                raise ValueError(
                    f"returned {col.shape[0] if col.dim() else 'no'} scores for {len(prompts)} images"
                )
            metrics.update(component_means(name, out.components, len(prompts), prefix))
        except Exception as exc:  # a reward model's failure is counted like a verifier error
            log.warning("reward %r failed on %d images: %s: %s", name, len(prompts), type(exc).__name__, exc)
            col = torch.full((len(prompts),), float("nan"))
        failed = ~torch.isfinite(col)
        if failed.any() and not failed.all():
            log.warning(
                "reward %r: non-finite scores for %d of %d images", name, int(failed.sum()), len(prompts)
            )
        columns.append(col)
        metrics[f"{prefix}/errors/{name}"] = float(failed.sum())
        good = col[~failed]
        metrics[f"{prefix}/{name}/mean"] = float(good.mean()) if good.numel() else float("nan")
        metrics[f"{prefix}/{name}/std"] = float(good.std()) if good.numel() > 1 else 0.0
    scores = torch.stack(columns, dim=1)
    failed_rows = (~torch.isfinite(scores)).any(dim=1)
    metrics[f"{prefix}/errors"] = float((~torch.isfinite(scores)).sum())
    total = scores.nan_to_num(nan=0.0) @ torch.tensor(list(weights), dtype=torch.float32)
    kept = total if on_error == "zero" else total[~failed_rows]
    metrics[f"{prefix}/mean"] = float(kept.mean()) if kept.numel() else float("nan")
    metrics[f"{prefix}/std"] = float(kept.std()) if kept.numel() > 1 else 0.0
    return scores, metrics


def component_means(
    name: str, components: dict[str, list[float]], n: int, prefix: str = "reward"
) -> dict[str, float]:
    """`<prefix>/<name>/<component>`: the mean over the batch of each per-image component a
    reward model reports (GenEval's colour / count / shape / position / clean, ...), NaN entries
    (not applicable, e.g. a text prompt's shape) left out; a component that is not one number
    per image, or is NaN throughout, is not logged."""
    out = {}
    for key, values in components.items():
        if key in ("mean", "std", name) or len(values) != n:  # `name`: the score itself
            continue
        try:
            col = torch.tensor([float(v) for v in values], dtype=torch.float64)
        except (TypeError, ValueError):  # not numbers (a label, a text): nothing to average
            continue
        col = col[torch.isfinite(col)]
        if col.numel():
            out[f"{prefix}/{name}/{key}"] = float(col.mean())
    return out


def compute_advantages(
    cfg: FlowConfig, scores: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """[N] advantages from [N, K] rewards: weighted sum then per-prompt normalisation, or GDPO.
    Failed entries (NaN, see `score_images`) count 0 with `reward.on_error=zero`; with `drop`
    their images get advantage 0 and stay out of every statistic. Rows where `keep` ([N] bool)
    is False are always left out so (the decoupled loop's images of plans no reward can read)."""
    a, G = cfg.algo, cfg.sample.group_size
    valid = torch.isfinite(scores).all(dim=1)
    if cfg.reward.on_error == "zero":
        valid = torch.ones_like(valid)
    if keep is not None:
        valid = valid & keep
    scores = scores.nan_to_num(nan=0.0)
    if cfg.reward.combine == "gdpo":
        from mmrl.algos.advantages import get_advantage_estimator

        adv = get_advantage_estimator("gdpo")(
            scores, G, eps=a.adv_eps, weights=list(cfg.reward.weights), valid=valid
        )
        return adv.clamp(-a.adv_clip_max, a.adv_clip_max) * valid
    total = scores @ torch.tensor(cfg.reward.weights, dtype=torch.float32)
    if bool(valid.all()):
        return flow_grpo_advantages(total, G, global_std=a.global_std, eps=a.adv_eps, clip=a.adv_clip_max)
    adv = torch.zeros_like(total)
    if valid.any():
        group_ids = torch.arange(total.numel()) // G
        adv[valid] = flow_grpo_advantages(
            total[valid],
            global_std=a.global_std,
            eps=a.adv_eps,
            clip=a.adv_clip_max,
            group_ids=group_ids[valid],
        )
    return adv


def choose_trained_steps(sde_steps: list[int], fraction: float, gen: torch.Generator) -> list[int]:
    """A random subset (at least one) of the SDE steps, `fraction` of them, in order."""
    k = max(1, int(round(fraction * len(sde_steps))))
    if k >= len(sde_steps):
        return list(sde_steps)
    pick = torch.randperm(len(sde_steps), generator=gen)[:k].sort().values.tolist()
    return [sde_steps[i] for i in pick]


def train_guidance(cfg: FlowConfig) -> float:
    """Guidance scale of the trainer's log-prob pass (flow-GRPO's `train.cfg`)."""
    gs = cfg.sample.guidance_scale
    return gs if (cfg.algo.train_cfg and gs > 1.0) else 1.0


@torch.no_grad()
def recompute_log_probs(
    cfg: FlowConfig, t: FlowTrainee, traj: Trajectory, trained: list[int]
) -> torch.Tensor:
    """[N, S] log-probs of the stored steps under the current weights (no grad), in the
    mini-batch shapes of the first update so that its first ratio is exactly 1."""
    n = traj.latents.shape[0]
    old = traj.log_probs.clone()
    size = n // cfg.trainer.mini_batches
    res = cfg.sample.resolution
    for start in range(0, n, size):
        rows = list(range(start, start + size))
        cond = traj.cond.select(rows)
        for j in trained:
            out = t.sampler.step_log_prob(
                t.transformer,
                traj,
                rows,
                j,
                cond,
                train_guidance(cfg),
                cfg.sample.noise_level,
                cfg.sample.sde_type,
                res,
                res,
            )
            old[rows, j] = out.log_prob
    return old


def update_policy(
    cfg: FlowConfig,
    t: FlowTrainee,
    traj: Trajectory,
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    trained: list[int],
    gen: torch.Generator,
) -> dict[str, float]:
    """`inner_epochs` passes of `mini_batches` optimizer steps; each mini-batch accumulates the
    per-step clipped loss (+ KL) over the trained steps."""
    a, s = cfg.algo, cfg.sample
    n = traj.latents.shape[0]
    size = n // cfg.trainer.mini_batches
    res = s.resolution
    gs = train_guidance(cfg)
    advantages = advantages.to(traj.latents.device)
    t.transformer.train()
    sums: dict[str, list[float]] = defaultdict(list)
    ratio_min, ratio_max, skipped = math.inf, -math.inf, 0
    first_ratio = None
    for _ in range(cfg.trainer.inner_epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for start in range(0, n, size):
            rows = order[start : start + size]
            cond = traj.cond.select(rows)
            adv = advantages[rows]
            t.optimizer.zero_grad(set_to_none=True)
            for j in trained:
                out = t.sampler.step_log_prob(
                    t.transformer, traj, rows, j, cond, gs, s.noise_level, s.sde_type, res, res
                )
                old = old_log_probs[rows, j]
                pg_loss, ratio = clipped_step_loss(out.log_prob, old, adv, a.clip_range)
                loss = pg_loss
                if t.reference is not None:
                    with torch.no_grad(), t.reference.model() as ref:
                        ref_mean = t.sampler.step_log_prob(
                            ref, traj, rows, j, cond, gs, s.noise_level, s.sde_type, res, res
                        ).mean
                    kl = mean_kl(out.mean, ref_mean, out.std, s.sde_type).mean()
                    loss = loss + a.kl_coef * kl
                    sums["actor/kl"].append(kl.item())
                (loss / len(trained)).backward()
                with torch.no_grad():
                    log_ratio = out.log_prob - old
                    if first_ratio is None:
                        first_ratio = ratio.detach().clone()
                    sums["actor/policy_loss"].append(pg_loss.item())
                    sums["actor/approx_kl"].append(float(0.5 * log_ratio.square().mean()))
                    sums["actor/clip_frac"].append(float(((ratio - 1).abs() > a.clip_range).float().mean()))
                    sums["actor/ratio_mean"].append(float(ratio.mean()))
                    ratio_min = min(ratio_min, float(ratio.min()))
                    ratio_max = max(ratio_max, float(ratio.max()))
            clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(t.params, clip)
            if torch.isfinite(grad_norm):
                for group in t.optimizer.param_groups:
                    group["lr"] = learning_rate(cfg, t.updates)
                t.optimizer.step()
                t.updates += 1
                if t.ema is not None and t.updates % cfg.trainer.ema_every == 0:
                    t.ema.update()
            else:
                skipped += 1
                log.warning("non-finite gradient norm: optimizer step skipped")
            t.optimizer.zero_grad(set_to_none=True)
            sums["actor/grad_norm"].append(float(grad_norm))
    metrics = {k: sum(v) / len(v) for k, v in sums.items()}
    metrics["actor/ratio_min"] = ratio_min
    metrics["actor/ratio_max"] = ratio_max
    metrics["actor/first_ratio_max_dev"] = (
        float((first_ratio - 1).abs().max()) if first_ratio is not None else 0.0
    )
    metrics["actor/skipped_steps"] = float(skipped)
    metrics["actor/lr"] = t.optimizer.param_groups[0]["lr"]
    return metrics


def learning_rate(cfg: FlowConfig, updates: int) -> float:
    """The learning rate of optimizer step `updates` (0-based): `optim.lr` after a linear
    warm-up over `optim.warmup_steps` steps, then by `optim.schedule` over the run's optimizer
    steps (`trainer.total_steps` x `inner_epochs` x `mini_batches`)."""
    o, t = cfg.optim, cfg.trainer
    total = t.total_steps * t.inner_epochs * t.mini_batches
    return o.lr * schedule_factor(o.schedule, updates, total, o.warmup_steps)


@torch.no_grad()
def evaluate(
    cfg: FlowConfig, t: FlowTrainee, prompts: list[str], train_prompts: Sequence[str] = ()
) -> tuple[dict[str, float], torch.Tensor]:
    """ODE-only sampling (no SDE step) with `eval_num_steps`, a fixed seed and the EMA weights:
    the evaluation prompts' rewards (`eval/reward/*`) and, on GenEval-style prompts, their strict
    accuracy with its Wilson 95% interval, per kind, and the images' noise (`eval/geneval/*`,
    `mmrl.verifiers.geneval.prompt_following`); the same GenEval figures of `train_prompts`
    (another seed) as `eval/geneval/train/*`. Returns the metrics and the evaluation images."""
    from mmrl.verifiers.geneval import prompt_following

    images = ode_images(cfg, t, list(prompts), cfg.trainer.seed + 12345)
    _, reward_metrics = score_images(cfg, t, images, list(prompts))
    metrics = {f"eval/{k}": v for k, v in reward_metrics.items()}
    if geneval_style(prompts):
        metrics.update({f"eval/geneval/{k}": v for k, v in prompt_following(images, list(prompts)).items()})
    if train_prompts:
        seen = ode_images(cfg, t, list(train_prompts), cfg.trainer.seed + 23456)
        metrics.update(
            {f"eval/geneval/train/{k}": v for k, v in prompt_following(seen, list(train_prompts)).items()}
        )
    return metrics, images


@torch.no_grad()
def ode_images(cfg: FlowConfig, t: FlowTrainee, prompts: list[str], seed: int) -> torch.Tensor:
    """[N, 3, H, W] images of `prompts`: the ODE sampler with `eval_num_steps`, the EMA weights,
    noise from `seed`, in chunks of `sample.batch_size` (0: all at once)."""
    s = cfg.sample
    gs = s.eval_guidance_scale if s.eval_guidance_scale is not None else s.guidance_scale
    t.transformer.eval()
    gen = torch.Generator().manual_seed(seed)
    chunk = s.batch_size or len(prompts)
    parts = []
    with t.ema.applied() if t.ema is not None else _nothing():
        for i in range(0, len(prompts), chunk):
            traj = t.sampler.sample(
                prompts[i : i + chunk],
                num_steps=s.eval_num_steps,
                height=s.resolution,
                width=s.resolution,
                guidance_scale=gs,
                generator=gen,
                sde_steps=(),
                negative_prompt=s.negative_prompt,
            )
            parts.append(traj.images)
    return torch.cat(parts)


def training_eval_prompts(cfg: FlowConfig, train: list[str]) -> list[str]:
    """The training prompts evaluated beside the held-out ones (`trainer.train_eval_size`, only
    GenEval-style prompts): the built-in set's `validation` split (a seeded sample of its
    training prompts, the kinds interleaved), else the training prompts in order, cycling."""
    n = cfg.trainer.train_eval_size
    if n == 0 or not geneval_style(train):
        return []
    if cfg.data.builtin == "geneval" and not cfg.data.prompts and not cfg.data.prompt_file:
        from mmrl.datasets.geneval import geneval_prompts

        return geneval_prompts("validation", tuple(cfg.data.kinds), n=n)
    return [train[i % len(train)] for i in range(n)]


def geneval_style(prompts: Sequence[str]) -> bool:
    """Whether every prompt is one of the GenEval-style grammar with objects (not text)."""
    from mmrl.datasets.geneval import parse_prompt

    try:
        return all(parse_prompt(p).text is None for p in prompts)
    except ValueError:
        return False


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def save_pipeline(cfg: FlowConfig, t: FlowTrainee, path: Path) -> None:
    """The final pipeline (EMA weights if kept, LoRA merged into the transformer), loadable
    with `--model` / `load_flow_pipeline`."""
    with torch.no_grad():
        if t.ema is not None:
            for s, p in zip(t.ema.shadow, t.params):
                p.copy_(s)
    if cfg.lora.enabled:
        t.transformer.fuse_lora()
        t.transformer.unload_lora()
    t.pipe.save_pretrained(path)


def save_grid(images: torch.Tensor, path: Path, columns: int = 8) -> Path:
    """[N, 3, H, W] images in [0, 1] as one PNG grid (row-major, `columns` per row)."""
    from PIL import Image

    n, _, h, w = images.shape
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    grid = torch.ones(3, rows * h, cols * w)
    for i in range(n):
        r, c = divmod(i, cols)
        grid[:, r * h : (r + 1) * h, c * w : (c + 1) * w] = images[i].float().cpu()
    array = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(array).save(path)
    return path


def load_prompts(cfg: FlowConfig) -> tuple[list[str], list[str]]:
    """Training and evaluation prompts: from the config, a file, or the built-in set
    (`data.builtin`; GenEval-style: its train split, and the first `eval_size` held-out prompts,
    the kinds interleaved)."""
    from mmrl.datasets.geneval import geneval_prompts
    from mmrl.datasets.prompts_t2i import builtin_prompts, read_prompt_file

    d = cfg.data
    geneval = d.builtin == "geneval"
    if d.prompts:
        train = list(d.prompts)
    elif d.prompt_file:
        train = read_prompt_file(d.prompt_file)
    else:
        train = geneval_prompts("train", tuple(d.kinds)) if geneval else builtin_prompts("train")
    if any(not isinstance(p, str) or not p.strip() for p in train):
        raise ValueError("data.prompts: every prompt must be a non-empty string")
    if d.eval_prompts:
        eval_prompts = list(d.eval_prompts)
    else:
        eval_prompts = (
            geneval_prompts("heldout", tuple(d.kinds), n=cfg.trainer.eval_size)
            if geneval
            else builtin_prompts("eval")
        )
    return train, eval_prompts[: cfg.trainer.eval_size]


class PromptOrder:
    """Shuffled passes over the training prompts; deterministic by seed. A step's B prompts
    are distinct whenever there are at least B prompts."""

    def __init__(self, prompts: list[str], seed: int):
        self.prompts = prompts
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(len(prompts))
        self.cursor = 0

    def state_dict(self) -> dict:
        """The position in the current pass and the generator of the next ones."""
        return {"order": self.order.tolist(), "cursor": self.cursor, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if len(state["order"]) != len(self.prompts):
            raise ValueError(
                f"the checkpoint's prompt order covers {len(state['order'])} prompts, the data has "
                f"{len(self.prompts)}: were the training prompts changed?"
            )
        self.order = np.asarray(state["order"], dtype=np.int64)
        self.cursor = int(state["cursor"])
        self.rng.bit_generator.state = state["rng"]

    def next(self, n: int) -> list[str]:
        out = []
        while len(out) < n:
            if self.cursor == len(self.order):
                self.order, self.cursor = self.rng.permutation(len(self.prompts)), 0
            out.append(self.prompts[self.order[self.cursor]])
            self.cursor += 1
        return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
