"""The policy update of one step: old/reference log-probs, then mini-batched optimizer steps.

`update_policy` is the loss written out: for each mini-batch, recompute log-probs, the policy
loss chosen by `algo.policy_loss` (PPO / GSPO / CISPO / GMPO / SAPO / ...) aggregated by
`algo.loss_agg`, times the truncated importance-sampling weights if on (and the forking-token
and off-policy-sequence masks), plus the KL to the reference (from two log-probs, or exact over
the vocabulary), plus the supervised term on demonstrations, minus the entropy bonus; backward
over micro-batches; clip; step. A non-finite loss or gradient skips the step (counted), never
corrupts the weights.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from collections.abc import Callable

import torch

from mmrl.algos.demonstrations import demonstration_loss
from mmrl.algos.kl import kl_estimate, kl_in_loss
from mmrl.algos.logprobs import chunk_positions
from mmrl.algos.losses import aggregate, get_policy_loss, loss_denominator, loss_options
from mmrl.algos.stability import forking_token_mask, off_policy_sequence_mask
from mmrl.config import Config
from mmrl.models.adapters import adapters_disabled
from mmrl.models.loading import Policy
from mmrl.models.moe import RouterStats, router_modules
from mmrl.models.precision import model_device
from mmrl.train.batching import select_rows
from mmrl.train.demonstrations import demonstrations
from mmrl.train.forward import reference_hidden, response_logprobs, response_logprobs_and_full_kl
from mmrl.types import RolloutBatch

log = logging.getLogger(__name__)


def row_chunks(cfg: Config, n_rows: int) -> list[list[int]]:
    """Rows in forward-sized chunks: mini-batches, then micro-batches within each, in order."""
    size = n_rows // cfg.trainer.mini_batches
    micro = cfg.trainer.micro_batch_rows or size
    chunks = []
    for start in range(0, n_rows, size):
        mb = list(range(start, min(start + size, n_rows)))
        chunks.extend(mb[i : i + micro] for i in range(0, len(mb), micro))
    return chunks


def old_from_update(cfg: Config) -> bool:
    """Whether the first mini-batch's old log-probs are left to the update (`update_policy`'s
    `old_from_first_pass`) instead of a pass of their own: they are recomputed by the trainer
    (`algo.old_logprobs=recompute`) and nothing reads them before the update (no truncated IS,
    no rollout rejection, no KL in the reward). The update's first mini-batch runs before any
    optimizer step of this update, on the weights the pass would read, in the same chunks, so
    its own forward gives these log-probs exactly (a ratio of 1, as TRL's on-policy GRPO takes
    it); the separate pass then covers the later mini-batches only (half of it with 2
    mini-batches, none with 1)."""
    a = cfg.algo
    return a.old_logprobs == "recompute" and a.tis == "off" and a.rejection == "off" and not a.kl_in_reward


@torch.no_grad()
def old_and_ref_logprobs(
    cfg: Config,
    policy: Policy,
    reference: torch.nn.Module | str | None,
    batch: RolloutBatch,
    first_from_update: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, R] of the sampling policy ("old") and of the reference.

    Computed in the same chunks as the first pass of the update, so the first on-policy
    mini-batch sees a ratio of exactly 1. `reference` is a frozen copy, the string
    "adapters_disabled" (the LoRA base model), or None. With `first_from_update`
    (`old_from_update`), the old log-probs of the first mini-batch's rows are NaN here, left for
    `update_policy(old_from_first_pass=True)` to fill from its own first forward.
    """
    T = cfg.rollout.temperature
    chunk = logits_chunk(cfg, policy)
    old = batch.rollout_logprobs if cfg.algo.old_logprobs == "rollout" else None
    if old is not None and reference is None:
        return old, None
    row_sets = row_chunks(cfg, len(batch))
    chunks: dict[int, RolloutBatch] = {}  # selected once, when a pass first needs them
    first = len(batch) // cfg.trainer.mini_batches if first_from_update else 0

    def logprobs_of(model: torch.nn.Module, skip_first: bool = False) -> torch.Tensor:
        parts = []
        for i, rows in enumerate(row_sets):
            if skip_first and rows[-1] < first:
                parts.append(torch.full((len(rows), batch.response_mask.shape[1]), math.nan,
                                        dtype=torch.float32, device=batch.response_mask.device))  # fmt: skip
                continue
            if i not in chunks:
                chunks[i] = select_rows(batch, rows)
            parts.append(response_logprobs(model, chunks[i], policy.blocked, T, chunk=chunk)[0])
        return torch.cat(parts)

    with policy.autocast():
        if old is None:
            old = logprobs_of(policy.model, skip_first=first > 0)
        if reference is None:
            return old, None
        if reference == "adapters_disabled":
            with adapters_disabled(policy.model):
                return old, logprobs_of(policy.model)
        with on_device(reference, policy.device):  # a reference kept on the host visits the device
            return old, logprobs_of(reference)


def logits_chunk(cfg: Config, policy: Policy) -> int:
    """Positions per chunk of the LM head in the log-prob pass (`trainer.logits_chunk_mb`)."""
    return chunk_positions(policy.blocked.shape[0], cfg.trainer.logits_chunk_mb * 2**20)


@contextlib.contextmanager
def on_device(module: torch.nn.Module, device: torch.device):
    """`module` on `device` for the duration (moved back where it was afterwards)."""
    home = model_device(module)
    if home == device:
        yield module
        return
    module.to(device)
    try:
        yield module
    finally:
        module.to(home)


class OptimizerSteps:
    """How `update_policy` takes a mini-batch's optimizer step: the backward of each micro-batch's
    loss, then one step (clipped to `optim.grad_clip`) unless the gradient is non-finite. The
    default drives a torch optimizer (`TorchSteps`); a DeepSpeed engine, which owns its
    optimizer, gradient partitions and clipping, has its own
    (`mmrl.distributed.deepspeed_group.DeepSpeedSteps`)."""

    def zero_grad(self) -> None:
        """Before a mini-batch's first backward."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate a micro-batch's gradient."""
        raise NotImplementedError

    def step(self) -> float:
        """Clip and step; returns the gradient norm before clipping. A non-finite norm means the
        step was not taken (and the gradients were dropped)."""
        raise NotImplementedError

    def discard(self, loss: torch.Tensor) -> None:
        """Drop the mini-batch's gradients without a step (its loss, `loss`, is non-finite)."""
        raise NotImplementedError


class TorchSteps(OptimizerSteps):
    """`OptimizerSteps` of a torch optimizer: `loss.backward()`, global-norm clipping over its
    parameters, `optimizer.step()`."""

    def __init__(self, optimizer: torch.optim.Optimizer, grad_clip: float):
        self.optimizer, self.grad_clip = optimizer, grad_clip
        self.params = [p for g in optimizer.param_groups for p in g["params"]]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip if self.grad_clip > 0 else math.inf)
        )
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def discard(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def update_policy(
    cfg: Config,
    policy: Policy,
    optimizer: torch.optim.Optimizer | OptimizerSteps,
    batch: RolloutBatch,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    tis_weights: torch.Tensor | None = None,
    before_minibatch: Callable[[list[int]], None] | None = None,
    reference: torch.nn.Module | str | None = None,
    old_from_first_pass: bool = False,
) -> dict[str, float]:
    """`ppo_epochs` passes of `mini_batches` optimizer steps over the rollout batch.

    Shapes: advantages [N]; old/ref log-probs and TIS weights [N, R] (R = response width).
    `reference` (a frozen copy or "adapters_disabled") is needed only by the exact KL
    (`algo.kl_estimator=full`), which runs it on each micro-batch.
    `before_minibatch(rows)`, if given, is called before each mini-batch of the first epoch
    reads its rows of the batch's mask, the advantages, log-probs and weights: it may fill
    those rows in place (the trainer does, as their rewards arrive). The mini-batch's first
    forward runs before the call, so it overlaps the wait. `optimizer`: a torch optimizer, or the
    `OptimizerSteps` of one that runs its own backward and step (DeepSpeed).
    `old_from_first_pass` (`old_from_update`): the first mini-batch's rows of `old_logprobs`
    are not computed yet; each of its micro-batches' forward, before the update's first
    optimizer step, fills them in place (masked like the batch) before its loss reads them.
    """
    model, a = policy.model, cfg.algo
    policy_loss = get_policy_loss(a.policy_loss)
    options = loss_options(a)  # clip_cov / kl_cov parameters
    max_len = cfg.rollout.max_new_tokens
    n = len(batch)
    mb_size = n // cfg.trainer.mini_batches
    micro = cfg.trainer.micro_batch_rows or mb_size
    sums: dict[str, float] = defaultdict(float)
    extremes: dict[str, float] = {}
    grad_norms: list[float] = []
    skipped = 0
    steps = optimizer if isinstance(optimizer, OptimizerSteps) else TorchSteps(optimizer, cfg.optim.grad_clip)

    chunk = logits_chunk(cfg, policy)
    full_kl = ref_logprobs is not None and not a.kl_in_reward and a.kl_estimator == "full"
    if full_kl and reference is None:
        raise ValueError("algo.kl_estimator=full needs the reference model in the update")
    G = cfg.rollout.group_size
    demos = demonstrations(policy, batch, G) if a.demo_loss != "off" and a.demo_coef > 0 else None

    def forward(sub: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-probs, entropy and (exact KL only) the per-token KL to the reference, [n, R]."""
        with policy.autocast():  # the backward runs outside autocast, as torch recommends
            if full_kl:
                if reference == "adapters_disabled":
                    with adapters_disabled(model):
                        ref = reference_hidden(model, sub)
                else:
                    ref = reference_hidden(reference, sub)
                return response_logprobs_and_full_kl(
                    model, sub, policy.blocked, cfg.rollout.temperature, ref,
                    entropy_grad=a.entropy_coef > 0, chunk=chunk,
                )  # fmt: skip
            logprobs, entropy = response_logprobs(
                model, sub, policy.blocked, cfg.rollout.temperature,
                with_entropy=True, entropy_grad=a.entropy_coef > 0, chunk=chunk,
            )  # fmt: skip
            return logprobs, entropy, None

    def demo_logprobs(sub: RolloutBatch) -> torch.Tensor:
        with policy.autocast():
            return response_logprobs(model, sub, policy.blocked, cfg.rollout.temperature, chunk=chunk)[0]

    counts: dict[str, float] = defaultdict(float)  # denominators of the OPSM / demonstration metrics

    routing = RouterStats(model) if router_modules(model) else contextlib.nullcontext()
    with routing:  # mixture-of-experts models: how the routers route in the update's passes
        for epoch in range(cfg.trainer.ppo_epochs):
            # The first pass keeps row order so its first mini-batch matches the old log-prob pass.
            order = list(range(n)) if epoch == 0 else torch.randperm(n).tolist()
            for start in range(0, n, mb_size):
                mb_rows = order[start : start + mb_size]
                early = None
                if epoch == 0 and before_minibatch is not None:
                    # The first micro-batch's forward needs no rewards: it runs before waiting for
                    # them (and is masked below like the rest, once dropped rows are known).
                    early = forward(select_rows(batch, mb_rows[:micro]))
                    before_minibatch(mb_rows)
                mb_mask = batch.response_mask[mb_rows].float()
                denom = loss_denominator(
                    mb_mask, a.loss_agg, max_len
                )  # micro-batch losses sum to the mini-batch's
                token_denom = float(mb_mask.sum().clamp(min=1))
                demo_denom = demos.tokens_for(mb_rows) if demos is not None else 1.0
                steps.zero_grad()
                finite = True
                for i in range(0, len(mb_rows), micro):
                    rows = mb_rows[i : i + micro]
                    sub = select_rows(batch, rows)
                    mask = sub.response_mask.float()  # [n, R]
                    if i == 0 and early is not None:
                        logprobs, entropy, token_kl = (
                            None if x is None else x.masked_fill(mask == 0, 0.0) for x in early
                        )
                    else:
                        logprobs, entropy, token_kl = forward(sub)
                    if old_from_first_pass and epoch == 0 and start == 0:
                        old_logprobs[rows] = logprobs.detach().masked_fill(mask == 0, 0.0)
                    weights = None if tis_weights is None else tis_weights[rows]
                    if a.forking_frac > 0:  # only the top-entropy tokens train (the normaliser stays)
                        fork = forking_token_mask(entropy, mask, a.forking_frac, a.forking_scope)
                        weights = fork if weights is None else weights * fork
                        sums["actor/forking_frac"] += float(fork.sum())
                    if a.opsm_delta is not None:  # drifted negative-advantage responses leave the loss
                        keep, opsm = off_policy_sequence_mask(
                            logprobs, sub.rollout_logprobs, advantages[rows], mask, a.opsm_delta
                        )
                        keep = keep.unsqueeze(1).expand_as(mask)
                        weights = keep if weights is None else weights * keep
                        rows_with_tokens = float((mask.sum(dim=1) > 0).sum())
                        sums["opsm/masked_frac"] += opsm["opsm/masked_frac"] * rows_with_tokens
                        sums["opsm/kl_mean"] += opsm["opsm/kl_mean"] * rows_with_tokens
                        counts["opsm"] += rows_with_tokens
                    pg_loss, pg_metrics = policy_loss(
                        logprobs, old_logprobs[rows], advantages[rows], mask,
                        clip_low=a.clip_low, clip_high=a.clip_high, clip_dual=a.clip_dual or None,
                        agg=a.loss_agg, denom=denom, max_len=max_len, weights=weights, **options,
                    )  # fmt: skip
                    ent = aggregate(entropy, mask, "token_mean", token_denom)
                    loss = pg_loss - a.entropy_coef * ent if a.entropy_coef > 0 else pg_loss
                    if ref_logprobs is not None and not a.kl_in_reward:
                        if token_kl is not None:  # the exact KL over the vocabulary
                            ref_kl = aggregate(token_kl, mask, a.loss_agg, denom, max_len)
                        else:
                            ref_kl = kl_in_loss(
                                logprobs,
                                ref_logprobs[rows],
                                mask,
                                estimator=a.kl_estimator,
                                agg=a.loss_agg,
                                denom=denom,
                                max_len=max_len,
                            )
                        loss = loss + a.kl_coef * ref_kl
                        sums["actor/ref_kl"] += ref_kl.item()
                    if demos is not None and (demo_rows := demos.rows_for(rows)):
                        demo = select_rows(demos.batch, demo_rows)
                        demo_mask = demo.response_mask.float()
                        demo_term, demo_metrics = demonstration_loss(
                            demo_logprobs(demo), demo_mask, a.demo_loss, a.demo_alpha, demo_denom
                        )
                        loss = loss + a.demo_coef * demo_term
                        sums["demo/loss"] += demo_term.item()
                        n_demo = demo_metrics["demo/tokens"]
                        for key in ("demo/nll", "demo/token_prob", "demo/trust_frac"):
                            sums[key] += demo_metrics[key] * n_demo
                        counts["demo"] += n_demo
                    if not torch.isfinite(loss):
                        finite = False
                        log.warning(
                            "non-finite loss in a mini-batch of rows %s: optimizer step skipped", rows[:8]
                        )
                        break
                    steps.backward(loss)
                    tokens = float(mask.sum())
                    with torch.no_grad():
                        ppo_kl = aggregate(
                            kl_estimate(logprobs, old_logprobs[rows], "k3"), mask, "token_mean", token_denom
                        )
                    sums["actor/pg_loss"] += pg_loss.item()  # micro-batch parts sum to the mini-batch loss
                    sums["actor/entropy"] += ent.item() * token_denom
                    sums["actor/ppo_kl"] += ppo_kl.item() * token_denom
                    for k in ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "ratio_mean", "cov_frac"):
                        if k in pg_metrics:
                            sums[f"actor/{k}"] += pg_metrics[k] * tokens
                    extremes["actor/ratio_min"] = min(
                        extremes.get("actor/ratio_min", math.inf), pg_metrics["ratio_min"]
                    )
                    extremes["actor/ratio_max"] = max(
                        extremes.get("actor/ratio_max", -math.inf), pg_metrics["ratio_max"]
                    )
                if not finite:
                    steps.discard(loss)
                    skipped += 1
                    if old_from_first_pass and epoch == 0 and start == 0:
                        # the rows after the non-finite micro-batch still need their old
                        # log-probs (the mismatch metrics read them): the weights have not moved
                        rest = mb_rows[i + micro :]
                        with torch.no_grad():
                            for j in range(0, len(rest), micro):
                                sub = select_rows(batch, rest[j : j + micro])
                                old_logprobs[rest[j : j + micro]] = forward(sub)[0].masked_fill(
                                    sub.response_mask == 0, 0.0
                                )
                    continue
                grad_norm = steps.step()
                if not math.isfinite(grad_norm):
                    skipped += 1
                    bad_ids = sorted({batch.samples[r].id for r in mb_rows})
                    log.warning(
                        "non-finite gradient in the mini-batch of samples %s: optimizer step skipped",
                        bad_ids[:20],
                    )
                    continue
                grad_norms.append(grad_norm)

    # Losses: the mean mini-batch loss; the rest: token-weighted means over every mini-batch of
    # every epoch; the gradient norm: the mean over the optimizer steps taken.
    tokens_total = float(batch.response_mask.sum().clamp(min=1)) * cfg.trainer.ppo_epochs
    n_minibatches = cfg.trainer.ppo_epochs * math.ceil(n / mb_size)
    metrics = {}
    for key, value in sums.items():
        if key.startswith("opsm/"):
            metrics[key] = value / max(counts["opsm"], 1.0)  # row-weighted
        elif key in ("demo/nll", "demo/token_prob", "demo/trust_frac"):
            metrics[key] = value / max(counts["demo"], 1.0)  # demonstration-token-weighted
        elif key in ("actor/pg_loss", "actor/ref_kl", "demo/loss"):
            metrics[key] = value / n_minibatches
        else:
            metrics[key] = value / tokens_total
    if demos is not None:
        metrics["demo/prompts"] = float(len(demos.batch))
    metrics.update(extremes)
    if isinstance(routing, RouterStats):
        metrics.update(routing.metrics())
    metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics["actor/skipped_steps"] = float(skipped)
    return metrics
