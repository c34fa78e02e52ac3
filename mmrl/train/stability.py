"""The trainer's side of the stability options (`mmrl.algos.stability`): state kept across steps
(the adaptive entropy coefficient), ProRL's reference reset, and per-source mismatch metrics.

`learn_from_rollouts` (`mmrl.train.grpo`) asks `StabilityState.step_config` for the config the
update runs with (the adaptive coefficient in place of `algo.entropy_coef`) and calls
`StabilityState.after_update` with the update's metrics.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from mmrl.algos.stability import AdaptiveEntropyCoef
from mmrl.algos.tis import tis_weights
from mmrl.config import Config
from mmrl.types import RolloutBatch

log = logging.getLogger(__name__)


@dataclass
class StabilityState:
    """What the stability options carry from one step to the next."""

    entropy: AdaptiveEntropyCoef | None = None
    last_reset_step: int = 0
    resets: list[int] = field(default_factory=list)
    """Steps after which the reference was reset (the events)."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps (the reference weights after a reset are not kept: a resumed
        run's reference is the initial policy until its next reset)."""
        return {
            "entropy": None if self.entropy is None else dataclasses.asdict(self.entropy),
            "last_reset_step": self.last_reset_step,
            "resets": list(self.resets),
        }

    def load_state_dict(self, state: dict) -> None:
        self.entropy = None if state["entropy"] is None else AdaptiveEntropyCoef(**state["entropy"])
        self.last_reset_step = state["last_reset_step"]
        self.resets = list(state["resets"])

    def step_config(self, cfg: Config) -> Config:
        """`cfg` with `algo.entropy_coef` the adaptive coefficient's current value (or `cfg`)."""
        a = cfg.algo
        if a.entropy_target <= 0:
            return cfg
        if self.entropy is None:
            self.entropy = AdaptiveEntropyCoef(
                coef=a.entropy_coef,
                target=a.entropy_target,
                delta=a.entropy_coef_delta,
                max_coef=a.entropy_coef_max,
            )
        coef = self.entropy.current()
        if coef == a.entropy_coef:
            return cfg
        return dataclasses.replace(cfg, algo=dataclasses.replace(a, entropy_coef=coef))

    def after_update(self, cfg: Config, trainee, metrics: dict[str, float], step: int) -> dict[str, float]:
        """Step the entropy controller and reset the reference if due; returns metrics to add:
        `entropy/coef` (the coefficient this step applied), `entropy/next_coef`, and
        `event/ref_reset` (1 at a reset, else 0) with `event/optimizer_reset`."""
        a, out = cfg.algo, {}
        if a.entropy_target > 0 and self.entropy is not None:
            out["entropy/coef"] = self.entropy.current()
            out["entropy/next_coef"] = self.entropy.update(metrics.get("actor/entropy", float("nan")))
        if a.ref_reset_every > 0 or a.ref_reset_kl > 0:
            due_every = a.ref_reset_every > 0 and step - self.last_reset_step >= a.ref_reset_every
            kl = metrics.get("actor/ref_kl", 0.0)
            due_kl = a.ref_reset_kl > 0 and kl > a.ref_reset_kl
            reset = (due_every or due_kl) and metrics.get("actor/skipped_steps", 0.0) == 0
            out["event/ref_reset"] = float(reset)
            if reset:
                reset_reference(trainee, clear_optimizer=a.ref_reset_optimizer)
                self.last_reset_step = step
                self.resets.append(step)
                out["event/optimizer_reset"] = float(a.ref_reset_optimizer)
                log.info(
                    "step %d: reference reset to the current policy (%s)%s",
                    step,
                    f"every {a.ref_reset_every} steps"
                    if due_every
                    else f"reference KL {kl:.4g} > {a.ref_reset_kl}",
                    "; optimizer state cleared" if a.ref_reset_optimizer else "",
                )
        return out


@torch.no_grad()
def reset_reference(trainee, clear_optimizer: bool = False) -> None:
    """ProRL's reference reset (Liu et al. 2025, "ProRL: Prolonged Reinforcement Learning Expands
    Reasoning Boundaries in Large Language Models"): the frozen reference takes the policy's
    current weights (cast to its own dtype, on its own device); optionally the optimizer's state
    (AdamW moments and step counts) is cleared so the next steps start afresh."""
    reference = trainee.reference
    if not isinstance(reference, torch.nn.Module):
        raise ValueError(
            "algo.ref_reset_every / ref_reset_kl need a frozen reference copy (algo.kl_coef > 0, no LoRA), "
            f"got reference {reference!r}"
        )
    reference.load_state_dict(trainee.policy.model.state_dict())
    if clear_optimizer:
        trainee.optimizer.state.clear()


def mismatch_source_metrics(
    cfg: Config, batch: RolloutBatch, old: torch.Tensor, rejected: torch.Tensor | None
) -> dict[str, float]:
    """How many tokens the TIS mask / band left out and how many responses rejection dropped,
    overall and per data source: `mismatch/masked_token_frac[/<source>]` (of the source's
    kept response tokens) and `mismatch/rejected_frac[/<source>]` (of the source's responses)."""
    a = cfg.algo
    masking = a.tis != "off" and a.tis_mode in ("mask", "band")
    if not masking and rejected is None:
        return {}
    rows_by_source: dict[str, list[int]] = defaultdict(list)
    for i, sample in enumerate(batch.samples):
        rows_by_source[sample.data_source].append(i)
    out: dict[str, float] = {}
    for suffix, rows in [("", list(range(len(batch))))] + [
        (f"/{s}", r) for s, r in sorted(rows_by_source.items())
    ]:
        if masking:
            _, m = tis_weights(
                old[rows], batch.rollout_logprobs[rows], batch.response_mask[rows].float(),
                level=a.tis, cap=a.tis_cap, mode=a.tis_mode, low=a.tis_low or None,
            )  # fmt: skip
            out[f"mismatch/masked_token_frac{suffix}"] = m["tis/masked_frac"]
        if rejected is not None:
            out[f"mismatch/rejected_frac{suffix}"] = float(rejected[rows].float().mean())
    return out
