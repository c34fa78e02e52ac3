"""GRPO on a vision-language model: the whole training loop, top to bottom.

One step:
  1. take B prompts; the rollout engine samples G responses each (token ids + log-probs)
  2. each response goes to the verifier its sample names -> reward
  3. group-normalised advantages within each prompt's G responses
  4. old log-probs (the policy that sampled) and, with a KL penalty, the reference's
  5. split the B x G rows into mini-batches; per mini-batch: recompute log-probs, clipped
     objective (+ k3 KL), backward, clip the gradient, AdamW step
  6. metrics overall and per data source; greedy held-out evaluation every `eval_every` steps
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mmrl.algos.advantages import get_advantage_estimator
from mmrl.algos.kl import kl_estimate
from mmrl.algos.losses import clipped_policy_loss, masked_mean
from mmrl.config import Config
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.readers import read_samples
from mmrl.models.base import builtin_base
from mmrl.models.loading import Policy, load_policy
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.router import Router, import_plugins
from mmrl.train.batching import select_rows
from mmrl.train.evaluation import evaluate
from mmrl.train.forward import response_logprobs
from mmrl.train.metrics_log import MetricsLogger
from mmrl.train.plots import plot_training_curves
from mmrl.train.rundir import create_run_dir
from mmrl.train.step_metrics import step_metrics
from mmrl.types import RolloutBatch, Sample, VerifyContext

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_dir: Path
    start_accuracy: float
    """Greedy held-out accuracy of the starting policy."""
    final_accuracy: float
    """Greedy held-out accuracy of the final policy (the one saved), not the best evaluation."""
    best_accuracy: float
    """Best greedy held-out accuracy seen at any evaluation (reported, never substituted)."""
    steps: int
    seconds: float


@dataclass
class Trainee:
    """What one GRPO step works on."""

    policy: Policy
    reference: torch.nn.Module | None
    engine: HFRolloutEngine
    router: Router
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def train(cfg: Config) -> TrainResult:
    t_start = time.monotonic()
    # 1. Setup: seeds, threads.
    if cfg.trainer.threads > 0:
        torch.set_num_threads(cfg.trainer.threads)
    seed_everything(cfg.trainer.seed)

    # 2. Data: every record is validated here, before anything is written or trained.
    train_samples, heldout = load_data(cfg)
    if cfg.trainer.eval_size:
        heldout = heldout[: cfg.trainer.eval_size]
    sampler = PromptSampler(train_samples, seed=cfg.trainer.seed)
    run_dir = create_run_dir(cfg)

    # 3. Policy, frozen reference (only with a KL penalty), rollout engine, router, optimizer.
    model_path = Path(cfg.model.path) if cfg.model.path else builtin_base(cfg)
    policy = load_policy(model_path)
    t = make_trainee(cfg, policy)
    t.router.warm_up()
    metrics_log = MetricsLogger(run_dir)
    total = cfg.trainer.total_steps

    def run_eval(step: int) -> float:
        metrics = evaluate(
            t.engine, t.router, heldout, cfg.rollout.max_new_tokens, VerifyContext(step, total)
        )
        metrics_log.log(step, metrics)
        log.info("step %d: greedy held-out accuracy %.3f", step, metrics["eval/accuracy"])
        return metrics["eval/accuracy"]

    # 4. The loop: one GRPO step per rollout batch, greedy evaluation every `eval_every` steps.
    try:
        start_acc = best_acc = final_acc = run_eval(0)
        bar = tqdm(range(1, total + 1), desc="GRPO", disable=not cfg.trainer.progress, dynamic_ncols=True)
        for step in bar:
            metrics = grpo_step(
                cfg, t, sampler.next(cfg.trainer.prompts_per_step), VerifyContext(step - 1, total)
            )
            metrics_log.log(step, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{final_acc:.3f}")
            if step % cfg.trainer.eval_every == 0 or step == total:
                final_acc = run_eval(step)
                best_acc = max(best_acc, final_acc)
        bar.close()
    finally:
        t.router.close()
        metrics_log.close()

    # 5. Final checkpoint (HF format), training curves, summary.
    if cfg.trainer.save_final:
        policy.model.save_pretrained(run_dir / "final")
        policy.processor.save_pretrained(run_dir / "final")
    plot_training_curves(run_dir / "metrics.jsonl", run_dir / "training_curves.png")
    result = TrainResult(
        run_dir=run_dir,
        start_accuracy=start_acc,
        final_accuracy=final_acc,
        best_accuracy=best_acc,
        steps=total,
        seconds=time.monotonic() - t_start,
    )
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in result.__dict__.items()}
    summary["model_path"] = str(model_path)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return result


def make_trainee(cfg: Config, policy: Policy) -> Trainee:
    """Wire a policy into what a GRPO step needs: reference, engine, router, optimizer."""
    policy.model.train()
    reference = copy.deepcopy(policy.model).eval().requires_grad_(False) if cfg.algo.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(
        [p for p in policy.model.parameters() if p.requires_grad],
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        weight_decay=cfg.optim.weight_decay,
    )
    return Trainee(
        policy=policy,
        reference=reference,
        engine=HFRolloutEngine.from_policy(policy, max_batch_rows=cfg.rollout.max_batch_rows),
        router=Router(cfg.reward.num_workers, cfg.reward.time_limit_s, cfg.reward.plugins),
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg)),
    )


def grpo_step(cfg: Config, t: Trainee, samples: list[Sample], context: VerifyContext) -> dict[str, float]:
    """One GRPO step on B prompts; returns its metrics."""
    G = cfg.rollout.group_size
    t0 = time.monotonic()
    # a. Rollout: B x G responses with their log-probs. With `reward.overlap`, each response
    #    goes to the router the moment it is finished, so scoring overlaps generation.
    params = SamplingParams(
        n=G, temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens
    )
    rows = [s for s in samples for _ in range(G)]
    pending = t.router.start(context, len(rows))
    on_response = (lambda r, text: pending.add(r, rows[r], text)) if overlap_rewards(cfg) else None
    batch = t.engine.generate(samples, params, on_response=on_response)
    t1 = time.monotonic()
    # b. Rewards from each sample's own verifier (waits only for what is still running).
    rewards = pending.result(batch.samples, batch.texts)
    t2 = time.monotonic()
    # c. Advantages within each prompt's group; with `reward.on_error=drop` a response whose
    #    verifier failed is left out of its group's statistics and of the loss.
    valid = torch.tensor([r.error is None for r in rewards.results])
    estimator = get_advantage_estimator(cfg.algo.advantage)
    if cfg.reward.on_error == "drop" and not valid.all():
        batch.response_mask = batch.response_mask * valid.unsqueeze(1).long()
        advantages = estimator(rewards.scores, G, eps=cfg.algo.adv_eps, valid=valid)
    else:
        advantages = estimator(rewards.scores, G, eps=cfg.algo.adv_eps)
    # d. Log-probs of the sampling policy ("old") and of the reference.
    old_logprobs, ref_logprobs = old_and_ref_logprobs(cfg, t.policy, t.reference, batch)
    # e. Policy update over mini-batches, then the learning-rate schedule.
    metrics = update_policy(cfg, t.policy, t.optimizer, batch, advantages, old_logprobs, ref_logprobs)
    metrics["actor/lr"] = t.scheduler.get_last_lr()[0]
    t.scheduler.step()
    t3 = time.monotonic()

    metrics.update(step_metrics(batch, rewards, advantages, G))
    metrics["verifier/dropped"] = float((~valid).sum()) if cfg.reward.on_error == "drop" else 0.0
    if cfg.algo.old_logprobs == "recompute":
        diff = (old_logprobs - batch.rollout_logprobs).abs() * batch.response_mask
        metrics["rollout/trainer_logprob_diff_max"] = float(diff.max())
    generated = float(batch.response_mask.sum())
    metrics.update(
        {
            "time/rollout_s": t1 - t0,
            "time/reward_s": t2 - t1,
            "time/update_s": t3 - t2,
            "time/step_s": t3 - t0,
            "throughput/samples_per_s": len(batch) / (t3 - t0),
            "throughput/generated_tokens_per_s": generated / (t3 - t0),
        }
    )
    return metrics


def overlap_rewards(cfg: Config) -> bool:
    """Score responses while generation goes on (needs verifier worker processes)."""
    return cfg.reward.overlap and cfg.reward.num_workers > 0


def load_data(cfg: Config) -> tuple[list[Sample], list[Sample]]:
    """Training and held-out samples: from files when given, else the procedural task."""
    import_plugins(cfg.reward.plugins)  # verifier names are checked while loading
    d = cfg.data
    kw = dict(kinds_=d.kinds, seed=d.seed, image_size=d.image_size)
    if d.train_files:
        train = [s for f in d.train_files for s in read_samples(f)]
    else:
        train = make_samples(n=d.num_train, split="train", **kw)
    if d.heldout_files:
        heldout = [s for f in d.heldout_files for s in read_samples(f)]
    elif not d.train_files:
        heldout = make_samples(n=d.num_heldout, split="heldout", **kw)
    else:
        raise ValueError("data.train_files is set: give data.heldout_files too")
    if not train:
        raise ValueError("no training samples")
    return train, heldout


class PromptSampler:
    """Shuffled passes over the training samples; deterministic by seed."""

    def __init__(self, samples: list[Sample], seed: int):
        self.samples = samples
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(len(samples))
        self.cursor = 0

    def next(self, n: int) -> list[Sample]:
        out = []
        while len(out) < n:
            if self.cursor == len(self.order):
                self.order, self.cursor = self.rng.permutation(len(self.samples)), 0
            out.append(self.samples[self.order[self.cursor]])
            self.cursor += 1
        return out


@torch.no_grad()
def old_and_ref_logprobs(
    cfg: Config, policy: Policy, reference: torch.nn.Module | None, batch: RolloutBatch
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the sampling policy and of the reference, [N, R], computed per mini-batch
    shape so that the first on-policy mini-batch sees a ratio of exactly 1."""
    T = cfg.rollout.temperature
    old = batch.rollout_logprobs if cfg.algo.old_logprobs == "rollout" else None
    ref = None
    if old is not None and reference is None:
        return old, None
    old_parts, ref_parts, rows = [], [], []
    for idx in row_chunks(cfg, len(batch), shuffle=False):
        sub = select_rows(batch, idx)
        if old is None:
            old_parts.append(response_logprobs(policy.model, sub, policy.blocked, T)[0])
        if reference is not None:
            ref_parts.append(response_logprobs(reference, sub, policy.blocked, T)[0])
        rows.extend(idx)
    inverse = torch.empty(len(rows), dtype=torch.long)
    inverse[torch.tensor(rows)] = torch.arange(len(rows))
    if old is None:
        old = torch.cat(old_parts)[inverse]
    if reference is not None:
        ref = torch.cat(ref_parts)[inverse]
    return old, ref


def row_chunks(
    cfg: Config, n_rows: int, shuffle: bool, generator: torch.Generator | None = None
) -> list[list[int]]:
    """Rows split into forward-sized chunks: mini-batches, then micro-batches within each."""
    order = torch.randperm(n_rows, generator=generator).tolist() if shuffle else list(range(n_rows))
    size = n_rows // cfg.trainer.mini_batches
    micro = cfg.trainer.micro_batch_rows or size
    chunks = []
    for start in range(0, n_rows, size):
        mb = order[start : start + size]
        chunks.extend(mb[i : i + micro] for i in range(0, len(mb), micro))
    return chunks


def update_policy(
    cfg: Config,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
) -> dict[str, float]:
    """`ppo_epochs` passes of `mini_batches` optimizer steps over the rollout batch."""
    model = policy.model
    a = cfg.algo
    n = len(batch)
    mb_size = n // cfg.trainer.mini_batches
    micro = cfg.trainer.micro_batch_rows or mb_size
    sums: dict[str, list[float]] = defaultdict(list)
    extremes: dict[str, float] = {}
    skipped = 0
    for epoch in range(cfg.trainer.ppo_epochs):
        # The first pass keeps row order so the first mini-batch matches the old log-prob pass.
        order = list(range(n)) if epoch == 0 else torch.randperm(n).tolist()
        for start in range(0, n, mb_size):
            mb_rows = order[start : start + mb_size]
            denom = float(batch.response_mask[mb_rows].sum().clamp(min=1))
            optimizer.zero_grad(set_to_none=True)
            for i in range(0, len(mb_rows), micro):
                rows = mb_rows[i : i + micro]
                sub = select_rows(batch, rows)
                mask = sub.response_mask.float()
                logprobs, entropy = response_logprobs(
                    model,
                    sub,
                    policy.blocked,
                    cfg.rollout.temperature,
                    with_entropy=True,
                    entropy_grad=a.entropy_coef > 0,
                )
                pg_loss, pg_metrics = clipped_policy_loss(
                    logprobs,
                    old_logprobs[rows],
                    advantages[rows],
                    mask,
                    clip_low=a.clip_low,
                    clip_high=a.clip_high,
                    token_denom=denom,
                )
                loss = pg_loss
                ent = masked_mean(entropy, mask, denom)
                if a.entropy_coef > 0:
                    loss = loss - a.entropy_coef * ent
                if ref_logprobs is not None:
                    ref_kl = masked_mean(
                        kl_estimate(logprobs, ref_logprobs[rows], a.kl_estimator), mask, denom
                    )
                    loss = loss + a.kl_coef * ref_kl
                    sums["actor/ref_kl"].append(ref_kl.item() * denom)
                loss.backward()
                with torch.no_grad():
                    ppo_kl = masked_mean(kl_estimate(logprobs, old_logprobs[rows], "k3"), mask, denom)
                sums["actor/pg_loss"].append(pg_loss.item() * denom)
                sums["actor/entropy"].append(ent.item() * denom)
                sums["actor/ppo_kl"].append(ppo_kl.item() * denom)
                tokens = float(mask.sum())
                for k in ("clip_frac_low", "clip_frac_high", "ratio_mean"):
                    sums[f"actor/{k}"].append(pg_metrics[k] * tokens)
                extremes["actor/ratio_min"] = min(
                    extremes.get("actor/ratio_min", math.inf), pg_metrics["ratio_min"]
                )
                extremes["actor/ratio_max"] = max(
                    extremes.get("actor/ratio_max", -math.inf), pg_metrics["ratio_max"]
                )
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            )
            if not torch.isfinite(grad_norm):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                log.warning("non-finite gradient norm: optimizer step skipped")
            else:
                optimizer.step()
            sums["actor/grad_norm"].append(float(grad_norm))
    # Token-weighted means over every mini-batch of every epoch; the grad norm is per step.
    total_tokens = float(batch.response_mask.sum().clamp(min=1)) * cfg.trainer.ppo_epochs
    metrics = {k: sum(v) / total_tokens for k, v in sums.items() if k != "actor/grad_norm"}
    metrics["actor/grad_norm"] = sum(sums["actor/grad_norm"]) / len(sums["actor/grad_norm"])
    metrics.update(extremes)
    metrics["actor/skipped_steps"] = float(skipped)
    return metrics


def lr_lambda(cfg: Config):
    o, total = cfg.optim, cfg.trainer.total_steps

    def factor(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
        if o.schedule == "linear":
            return max(0.0, 1.0 - progress)
        if o.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
