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
from dataclasses import dataclass

import torch

from mmrl.algos.advantages import clip_advantages
from mmrl.algos.critic import (
    gae_advantages_returns,
    place_turn_rewards,
    turn_end_mask,
    turn_level_gae,
    value_loss,
)
from mmrl.algos.demonstrations import demonstration_loss
from mmrl.algos.kl import kl_estimate, kl_in_loss
from mmrl.algos.logprobs import chunk_positions
from mmrl.algos.losses import aggregate, get_policy_loss, loss_denominator, loss_options
from mmrl.algos.stability import forking_token_mask, off_policy_sequence_mask
from mmrl.config import CRITIC_ESTIMATORS, Config
from mmrl.models.adapters import adapters_disabled
from mmrl.models.loading import Policy
from mmrl.models.moe import RouterStats, router_modules
from mmrl.models.precision import model_device
from mmrl.train.batching import select_rows
from mmrl.train.demonstrations import demonstrations
from mmrl.train.forward import (
    ValueHead,
    reference_hidden,
    response_logprobs,
    response_logprobs_and_full_kl,
    response_logprobs_and_values,
)
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
    return (
        a.old_logprobs == "recompute"
        and a.tis == "off"
        and a.rejection == "off"
        and not a.kl_in_reward
        and a.advantage not in CRITIC_ESTIMATORS  # the critic's advantages need every row's old values first
    )


@dataclass
class CriticTargets:
    """What the value loss of `update_policy` needs: the value head (trained with the policy),
    the rollout-time values the clip is around and the returns, both [N, R] float32 (0 off the
    response mask)."""

    head: ValueHead
    values: torch.Tensor
    returns: torch.Tensor


def token_level_rewards(
    cfg: Config, batch: RolloutBatch, scores: torch.Tensor, env_parts: list[float] | None = None
) -> torch.Tensor:
    """[N, R] float32 rewards of the critic's advantages: each row's (shaped) score on its last
    model token (`gae`). With `turn_gae` on a multi-turn batch, each turn's environment reward
    (`trajectories[i].turn_rewards` x `agent.env_reward_weight`) on that turn's last model token
    (`mmrl.algos.critic.place_turn_rewards`) and the rest of the score, `env_parts[i]` (the
    discounted return the score holds) taken out, on the last turn's: the turns' rewards then
    reach earlier turns through `algo.high_level_gamma`, not `agent.turn_discount`. Environment
    rewards past the mask's last turn are added to it. Rows without model tokens get none."""
    mask = batch.response_mask != 0
    ends = turn_end_mask(mask)
    counts = ends.sum(dim=1)
    last = ends & (ends.long().cumsum(dim=1) == counts.unsqueeze(1))
    score = scores.to(device=mask.device, dtype=torch.float32).unsqueeze(1)
    if cfg.algo.advantage != "turn_gae" or batch.trajectories is None:
        return torch.where(last, score, torch.zeros((), dtype=torch.float32, device=mask.device))
    n_turns = counts.tolist()
    width = max([1, *n_turns])
    weight = cfg.agent.env_reward_weight
    table = []
    for i, trajectory in enumerate(batch.trajectories):
        row = [0.0] * width
        n = n_turns[i]
        if n > 0:
            env = [weight * r for r in trajectory.turn_rewards] if trajectory.env_id else []
            for k, r in enumerate(env):
                row[min(k, n - 1)] += r
            row[n - 1] += float(scores[i]) - (env_parts[i] if env_parts is not None else 0.0)
        table.append(row)
    per_turn = torch.tensor(table, dtype=torch.float32, device=mask.device)
    return place_turn_rewards(per_turn, mask)


def critic_targets(
    cfg: Config,
    batch: RolloutBatch,
    scores: torch.Tensor,
    values: torch.Tensor,
    head: ValueHead,
    env_parts: list[float] | None = None,
) -> tuple[torch.Tensor, CriticTargets]:
    """The critic's token-level advantages [N, R] (whitened over the batch's model tokens, then
    `algo.adv_clip`) and the update's `CriticTargets`, from the rollout-time `values` [N, R]:
    `algo.advantage=gae` is veRL's GAE over the tokens (`algo.gamma`, `algo.lam`), `turn_gae`
    VAGEN's turn-level GAE (`algo.high_level_gamma` across turns). Observation tokens and
    masked-out rows get no value, advantage or return (all 0)."""
    a = cfg.algo
    mask = batch.response_mask
    values = values.masked_fill(mask == 0, 0.0)
    rewards = token_level_rewards(cfg, batch, scores, env_parts)
    if a.advantage == "turn_gae":
        advantages, returns = turn_level_gae(rewards, values, mask, a.gamma, a.lam, a.high_level_gamma)
    else:
        advantages, returns = gae_advantages_returns(rewards, values, mask, a.gamma, a.lam)
    returns = returns.masked_fill(mask == 0, 0.0)
    advantages = clip_advantages(advantages, a.adv_clip or None)
    return advantages, CriticTargets(head, values, returns)


def critic_metrics(batch: RolloutBatch, advantages: torch.Tensor, targets: CriticTargets) -> dict[str, float]:
    """The step's `critic/...` figures over the model tokens: the rollout-time values, the
    returns, the explained variance 1 - Var[R - V] / Var[R] (of the rollout-time values), and
    the token-level advantages' `adv/...` (replacing the per-row ones)."""
    m = batch.response_mask != 0
    if not bool(m.any()):
        return {}
    v, r, adv = targets.values[m], targets.returns[m], advantages[m]
    var_r = r.var(unbiased=False)
    explained = (
        1.0 - (r - v).var(unbiased=False) / var_r if float(var_r) > 0 else torch.zeros((), device=r.device)
    )
    return {
        "critic/values_mean": float(v.mean()),
        "critic/returns_mean": float(r.mean()),
        "critic/explained_var": float(explained),
        "adv/mean": float(adv.mean()),
        "adv/std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "adv/abs_max": float(adv.abs().max()),
    }


def row_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N]: the advantages themselves, or per-token ones [N, R] averaged over each row's mask
    (for the per-row step metrics and dumps)."""
    if advantages.dim() == 1:
        return advantages
    m = mask.float()
    return (advantages * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)


def old_and_ref_logprobs(
    cfg: Config,
    policy: Policy,
    reference: torch.nn.Module | str | None,
    batch: RolloutBatch,
    first_from_update: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, R] of the sampling policy ("old") and of the reference (`old_ref_and_values`
    without a critic)."""
    old, ref, _ = old_ref_and_values(cfg, policy, reference, batch, first_from_update)
    return old, ref


@torch.no_grad()
def old_ref_and_values(
    cfg: Config,
    policy: Policy,
    reference: torch.nn.Module | str | None,
    batch: RolloutBatch,
    first_from_update: bool = False,
    value_head: ValueHead | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs [N, R] of the sampling policy ("old") and of the reference, and with a
    `value_head` the critic's values [N, R] of the rollout (from the same policy forward as the
    old log-probs, which runs for them even when the old log-probs are the rollout's).

    Computed in the same chunks as the first pass of the update, so the first on-policy
    mini-batch sees a ratio of exactly 1. `reference` is a frozen copy, the string
    "adapters_disabled" (the LoRA base model), or None. With `first_from_update`
    (`old_from_update`), the old log-probs of the first mini-batch's rows are NaN here, left for
    `update_policy(old_from_first_pass=True)` to fill from its own first forward.
    """
    T = cfg.rollout.temperature
    chunk = logits_chunk(cfg, policy)
    old = batch.rollout_logprobs if cfg.algo.old_logprobs == "rollout" else None
    if old is not None and reference is None and value_head is None:
        return old, None, None
    row_sets = row_chunks(cfg, len(batch))
    chunks: dict[int, RolloutBatch] = {}  # selected once, when a pass first needs them
    first = len(batch) // cfg.trainer.mini_batches if first_from_update else 0
    values: list[torch.Tensor] = []

    def logprobs_of(
        model: torch.nn.Module, skip_first: bool = False, head: ValueHead | None = None
    ) -> torch.Tensor:
        parts = []
        for i, rows in enumerate(row_sets):
            if skip_first and rows[-1] < first:
                parts.append(torch.full((len(rows), batch.response_mask.shape[1]), math.nan,
                                        dtype=torch.float32, device=batch.response_mask.device))  # fmt: skip
                continue
            if i not in chunks:
                chunks[i] = select_rows(batch, rows)
            if head is None:
                parts.append(response_logprobs(model, chunks[i], policy.blocked, T, chunk=chunk)[0])
            else:
                logp, _, v = response_logprobs_and_values(
                    model, chunks[i], policy.blocked, T, head, chunk=chunk
                )
                parts.append(logp)
                values.append(v)
        return torch.cat(parts)

    with policy.autocast():
        if old is None or value_head is not None:
            computed = logprobs_of(policy.model, skip_first=first > 0, head=value_head)
            old = computed if old is None else old
        critic_values = torch.cat(values) if value_head is not None else None
        if reference is None:
            return old, None, critic_values
        if reference == "adapters_disabled":
            with adapters_disabled(policy.model):
                return old, logprobs_of(policy.model), critic_values
        with on_device(reference, policy.device):  # a reference kept on the host visits the device
            return old, logprobs_of(reference), critic_values


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
    parameters, `optimizer.step()`. A value head's parameter group (named `critic`) is clipped
    on its own, by the same bound, and its norm kept in `critic_grad_norm`: the value loss's
    gradient does not shrink the policy's through a shared norm."""

    def __init__(self, optimizer: torch.optim.Optimizer, grad_clip: float):
        self.optimizer, self.grad_clip = optimizer, grad_clip
        groups = optimizer.param_groups
        self.params = [p for g in groups if g.get("name") != "critic" for p in g["params"]]
        self.critic_params = [p for g in groups if g.get("name") == "critic" for p in g["params"]]
        self.critic_grad_norm = math.nan

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip if self.grad_clip > 0 else math.inf)
        )
        if self.critic_params:
            self.critic_grad_norm = float(
                torch.nn.utils.clip_grad_norm_(
                    self.critic_params, self.grad_clip if self.grad_clip > 0 else math.inf
                )
            )
            if not math.isfinite(self.critic_grad_norm):
                grad_norm = self.critic_grad_norm  # no step: the caller counts it as skipped
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
    critic: CriticTargets | None = None,
) -> dict[str, float]:
    """`ppo_epochs` passes of `mini_batches` optimizer steps over the rollout batch.

    Shapes: advantages [N] (or [N, R] per token, a critic's); old/ref log-probs and TIS weights
    [N, R] (R = response width). With `critic` (PPO with a value head), each micro-batch's
    forward also gives the head's values and the clipped value loss
    (`mmrl.algos.critic.value_loss`, aggregated as the policy loss) is added times
    `algo.vf_coef`; the head steps with the policy (`critic/...` metrics).
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
    critic_norms: list[float] = []
    skipped = 0
    steps = optimizer if isinstance(optimizer, OptimizerSteps) else TorchSteps(optimizer, cfg.optim.grad_clip)

    chunk = logits_chunk(cfg, policy)
    full_kl = ref_logprobs is not None and not a.kl_in_reward and a.kl_estimator == "full"
    if full_kl and reference is None:
        raise ValueError("algo.kl_estimator=full needs the reference model in the update")
    G = cfg.rollout.group_size
    demos = demonstrations(policy, batch, G) if a.demo_loss != "off" and a.demo_coef > 0 else None

    def forward(
        sub: RolloutBatch,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probs, entropy, (exact KL only) the per-token KL to the reference and (with a
        critic) the values, [n, R]."""
        with policy.autocast():  # the backward runs outside autocast, as torch recommends
            if critic is not None:
                logprobs, entropy, values = response_logprobs_and_values(
                    model, sub, policy.blocked, cfg.rollout.temperature, critic.head,
                    with_entropy=True, entropy_grad=a.entropy_coef > 0, chunk=chunk,
                )  # fmt: skip
                return logprobs, entropy, None, values
            if full_kl:
                if reference == "adapters_disabled":
                    with adapters_disabled(model):
                        ref = reference_hidden(model, sub)
                else:
                    ref = reference_hidden(reference, sub)
                return (*response_logprobs_and_full_kl(
                    model, sub, policy.blocked, cfg.rollout.temperature, ref,
                    entropy_grad=a.entropy_coef > 0, chunk=chunk,
                ), None)  # fmt: skip
            logprobs, entropy = response_logprobs(
                model, sub, policy.blocked, cfg.rollout.temperature,
                with_entropy=True, entropy_grad=a.entropy_coef > 0, chunk=chunk,
            )  # fmt: skip
            return logprobs, entropy, None, None

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
                        logprobs, entropy, token_kl, vpreds = (
                            None if x is None else x.masked_fill(mask == 0, 0.0) for x in early
                        )
                    else:
                        logprobs, entropy, token_kl, vpreds = forward(sub)
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
                    if critic is not None:  # the clipped value loss, over the same tokens
                        v_loss, vf_clipfrac = value_loss(
                            vpreds, critic.returns[rows], critic.values[rows], mask, a.cliprange_value,
                            a.loss_agg, denom=denom, max_len=max_len,
                        )  # fmt: skip
                        loss = loss + a.vf_coef * v_loss
                        sums["critic/value_loss"] += v_loss.item()
                        sums["critic/vf_clipfrac"] += float(vf_clipfrac) * float(mask.sum())
                        sums["critic/vpred_mean"] += float((vpreds.detach() * mask).sum())
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
                if critic is not None and isinstance(steps, TorchSteps):
                    critic_norms.append(steps.critic_grad_norm)

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
        elif key in ("actor/pg_loss", "actor/ref_kl", "demo/loss", "critic/value_loss"):
            metrics[key] = value / n_minibatches
        else:
            metrics[key] = value / tokens_total
    if demos is not None:
        metrics["demo/prompts"] = float(len(demos.batch))
    metrics.update(extremes)
    if isinstance(routing, RouterStats):
        metrics.update(routing.metrics())
    metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    if critic is not None:
        metrics["critic/grad_norm"] = sum(critic_norms) / len(critic_norms) if critic_norms else float("nan")
    metrics["actor/skipped_steps"] = float(skipped)
    return metrics
