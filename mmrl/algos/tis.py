"""Truncated importance sampling for the rollout/trainer mismatch (Yao et al. 2025, "Your Efficient
RL Framework Secretly Brings You Off-Policy RL Training").

The rollout engine (vLLM, or a different kernel/precision) samples from pi_rollout, which is not
exactly the trainer's pi_old. Re-weighting each token by pi_old / pi_rollout corrects the
policy gradient; truncating the weight at a cap bounds its variance. Pass the weights as
`weights=` to any loss in `mmrl.algos.losses.POLICY_LOSSES`.
"""

from __future__ import annotations

import math

import torch

from mmrl.algos.kl import kl_estimate

TIS_LEVELS = ("token", "sequence")
TIS_MODES = ("truncate", "mask", "band")

# Raw (before truncation) weights are reported as at most e^80, finite in float32.
_METRIC_LOG_CLAMP = 80.0


def check_logprob_pair(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> None:
    """Raise ValueError unless the two log-prob tensors and the mask are all the same [N, R]."""
    if not (trainer_logprobs.shape == rollout_logprobs.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(
            f"trainer_logprobs {list(trainer_logprobs.shape)}, rollout_logprobs "
            f"{list(rollout_logprobs.shape)} and mask {list(mask.shape)} must all be the same [N, R]"
        )


def tis_weights(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    cap: float = 2.0,
    mode: str = "truncate",
    low: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached importance weights pi_trainer / pi_rollout, truncated or masked at `cap`.

        token:    log w_t = trainer_t - rollout_t
        sequence: log w_t = sum_{t' in response} m_t' (trainer_t' - rollout_t')   (every token of
                  the response gets its response's product of token ratios)
        truncate: w = min(w, cap)             (TIS)
        mask:     w = 0 where w > cap         (MIS: such tokens / responses leave the loss)
        band:     w = 0 where w < low or w > cap, w itself inside [low, cap]   (IcePop, Ling
                  team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking
                  Model": a token whose train/rollout ratio leaves the band sends no gradient)

    Computed in log space, so an enormous sequence ratio never overflows.

    Args:
        trainer_logprobs: [N, R] the trainer's log-probs of the sampled tokens (pi_old).
        rollout_logprobs: [N, R] the rollout engine's log-probs of the same tokens.
        mask: [N, R] 1 on response tokens.
        level: `token` or `sequence`.
        cap: C > 0; weights never exceed it.
        mode: `truncate`, `mask` or `band`.
        low: the band's lower bound (mode `band` only; 0 < low < cap; default 1 / cap).

    Returns:
        weights [N, R] (detached, 0 on masked-out positions) and metrics over the masked tokens
        (a sequence-level weight counts once per token): `tis/weight_mean`, `tis/weight_min`,
        `tis/weight_max` (of the raw weights, before truncation; the max saturates at e^80),
        `tis/applied_weight_mean` (after), `tis/truncated_frac` (mode truncate) or
        `tis/masked_frac` (modes mask and band: both tails), and the rollout-vs-trainer KL
        `rollout/kl_k1`, `rollout/kl_k3`: estimates of KL(pi_rollout || pi_trainer), the
        tokens having been sampled by the rollout engine.
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {level!r}: choose from {list(TIS_LEVELS)}")
    if mode not in TIS_MODES:
        raise ValueError(f"unknown TIS mode {mode!r}: choose from {list(TIS_MODES)}")
    if not cap > 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    if mode == "band":
        low = 1.0 / cap if low is None else low
        if not 0 < low < cap:
            raise ValueError(f"TIS band: low must be in (0, cap={cap}), got {low}")
    check_logprob_pair(trainer_logprobs, rollout_logprobs, mask)
    with torch.no_grad():
        m = mask > 0
        zero = torch.zeros_like(trainer_logprobs, dtype=torch.float32)
        trainer = torch.where(m, trainer_logprobs.float(), zero)
        rollout = torch.where(m, rollout_logprobs.float(), zero)
        log_w = trainer - rollout
        if level == "sequence":
            log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
        log_cap = math.log(cap)
        over = log_w > log_cap
        w = torch.exp(log_w.clamp(max=log_cap)).clamp(max=cap)  # min(e^log_w, cap), no overflow
        if mode == "band":
            over = over | (log_w < math.log(low))
        if mode != "truncate":
            w = torch.where(over, zero, w)
        w = torch.where(m, w, zero)

        n = max(int(m.sum()), 1)
        empty = not bool(m.any())
        raw = torch.exp(log_w[m].clamp(max=_METRIC_LOG_CLAMP))
        metrics = {
            "tis/weight_mean": 1.0 if empty else float(raw.mean()),
            "tis/weight_min": 1.0 if empty else float(raw.min()),
            "tis/weight_max": 1.0 if empty else float(raw.max()),
            "tis/applied_weight_mean": 1.0 if empty else float(w[m].mean()),
            f"tis/{'truncated' if mode == 'truncate' else 'masked'}_frac": float((over & m).sum()) / n,
            "rollout/kl_k1": float(kl_estimate(rollout, trainer, "k1")[m].sum()) / n,
            "rollout/kl_k3": float(kl_estimate(rollout, trainer, "k3")[m].sum()) / n,
        }
    return w, metrics
