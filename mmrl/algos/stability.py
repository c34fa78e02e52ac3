"""Stability pieces beyond truncated IS: rollout rejection, IS-weight batch normalisation,
forking-token selection and an adaptive entropy coefficient. Pure functions over [N, R] tensors
(N responses, R response positions; `mask` 1 on response tokens).

| piece | what it does | from |
|---|---|---|
| `rejection_keep` | drops whole responses whose rollout/trainer ratio is out of a band | veRL rollout correction (`rollout_rs`: `geometric`, `sequence`); Liu, Li et al. 2025, "When Speed Kills Stability" |
| `batch_normalize_weights` | divides IS weights by their batch mean (veRL's order, or mean 1 over the kept tokens) | veRL `rollout_is_batch_normalize` |
| `forking_token_mask` | keeps only the top-entropy ("forking") tokens | Wang et al. 2025, "Beyond the 80/20 Rule" |
| `AdaptiveEntropyCoef` | steps the entropy coefficient towards a target entropy | He et al. 2025, "Skywork Open Reasoner 1 Technical Report" |
| `off_policy_sequence_mask` | drops negative-advantage responses that drifted too far from the sampling policy | DeepSeek-AI 2025, "DeepSeek-V3.2" (eq. 9); TRL's `off_policy_mask_threshold` |

Token-level masking (IcePop) is `mmrl.algos.tis.tis_weights(mode="band")`; Clip-Cov and KL-Cov
are policy losses in `mmrl.algos.losses`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmrl.algos.tis import check_logprob_pair

REJECTION_LEVELS = ("geometric", "sequence", "max_token")
FORKING_SCOPES = ("response", "batch")


def rejection_keep(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "geometric",
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Which responses to keep: rollout rejection sampling on the ratio pi_trainer / pi_rollout.

    With x_t = trainer_t - rollout_t on the response's tokens (T of them):

        geometric:  keep iff low <= exp(1/T sum_t x_t) <= high      (the geometric-mean ratio)
        sequence:   keep iff low <= exp(sum_t x_t) <= high           (the sequence ratio)
        max_token:  keep iff low <= exp(x_t) <= high for every t     (the largest token deviation)

    In veRL's current options: `geometric` is `seq_mean_k1`, `sequence` is `seq_sum_k1`, and
    `max_token` keeps what `token_k1` leaves whole, each with bounds "1/high_1/low" (veRL's k1 is
    log pi_rollout / pi_trainer). Compared in log space (no overflow). A rejected response leaves the loss as a whole; its
    reward still counts in its group's statistics (as in veRL, where the rejection mask only
    changes the loss mask). A row with no response token is kept (there is nothing to judge).

    Returns:
        keep [N] bool, and metrics `rejection/seq_frac` (rejected / rows with tokens),
        `rejection/token_frac` (tokens of rejected rows / all tokens), `rejection/stat_max`,
        `rejection/stat_min` (the statistic compared, as a ratio, over rows with tokens;
        1 when there are none).
    """
    if level not in REJECTION_LEVELS:
        raise ValueError(f"unknown rejection level {level!r}: choose from {list(REJECTION_LEVELS)}")
    if not 0 < low < high:
        raise ValueError(f"rejection bounds must satisfy 0 < low < high, got low={low}, high={high}")
    check_logprob_pair(trainer_logprobs, rollout_logprobs, mask)
    with torch.no_grad():
        m = mask > 0
        zero = torch.zeros_like(trainer_logprobs, dtype=torch.float32)
        x = torch.where(m, trainer_logprobs.float() - rollout_logprobs.float(), zero)
        n_tok = m.sum(dim=-1)
        has = n_tok > 0
        log_low, log_high = math.log(low), math.log(high)
        if level == "max_token":
            out = m & ((x < log_low) | (x > log_high))
            reject = out.any(dim=-1)
            hi = torch.where(m, x, torch.full_like(x, -math.inf)).max(dim=-1).values
            lo = torch.where(m, x, torch.full_like(x, math.inf)).min(dim=-1).values
        else:
            stat = x.sum(dim=-1)
            if level == "geometric":
                stat = stat / n_tok.clamp(min=1)
            reject = (stat < log_low) | (stat > log_high)
            hi = lo = stat
        reject = reject & has
        n_rows = max(int(has.sum()), 1)
        n_tokens = max(int(m.sum()), 1)
        metrics = {
            "rejection/seq_frac": float(reject.sum()) / n_rows,
            "rejection/token_frac": float(n_tok[reject].sum()) / n_tokens,
            "rejection/stat_max": float(math.exp(min(float(hi[has].max()), 80.0))) if has.any() else 1.0,
            "rejection/stat_min": float(math.exp(float(lo[has].min()))) if has.any() else 1.0,
        }
    return ~reject, metrics


BATCH_NORM_SCOPES = ("verl", "kept")


def batch_normalize_weights(
    weights: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    *,
    stat_weights: torch.Tensor | None = None,
    stat_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """IS weights divided by a batch mean (veRL's `rollout_is_batch_normalize`).

        token:     mean = sum_{i,t} m' w' / sum_{i,t} m'
        sequence:  mean = mean over rows with tokens of (the row's mean w')

    where w', m' are `stat_weights` and `stat_mask` (default: `weights` and `mask` themselves).
    veRL's order takes the mean of the *truncated* weights over the response mask *before*
    rollout rejection and token masking, and then masks (a rejected token's weight counts in
    the mean; its zero does not): pass those as `stat_weights` / `stat_mask`. Taking the
    defaults instead (the applied weights over the loss mask, IS-masked zeros included) makes
    the applied weights average exactly 1 (`algo.tis_batch_norm_scope=kept`).

    A mean <= 1e-8 (every weight masked to 0, or an empty mask) leaves the weights as they are
    (factor 1). Returns the normalised weights (detached, 0 outside `mask`) and the factor
    divided by.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown IS level {level!r}: choose from ['token', 'sequence']")
    if weights.shape != mask.shape or mask.dim() != 2:
        raise ValueError(f"weights {list(weights.shape)} and mask {list(mask.shape)} must both be [N, R]")
    stat_weights = weights if stat_weights is None else stat_weights
    stat_mask = mask if stat_mask is None else stat_mask
    if stat_weights.shape != mask.shape or stat_mask.shape != mask.shape:
        raise ValueError(
            f"stat_weights {list(stat_weights.shape)} and stat_mask {list(stat_mask.shape)} must be "
            f"[N, R] = {list(mask.shape)}"
        )
    with torch.no_grad():
        w = weights.detach().float() * (mask > 0).float()
        m = (stat_mask > 0).float()
        sw = stat_weights.detach().float() * m
        if level == "token":
            mean = sw.sum() / m.sum().clamp(min=1)
        else:
            rows = m.sum(dim=-1)
            has = rows > 0
            per_row = sw.sum(dim=-1) / rows.clamp(min=1)
            mean = per_row[has].sum() / has.sum().clamp(min=1)
        factor = float(mean)
        if not factor > 1e-8:
            return w, 1.0
        return w / factor, factor


def off_policy_sequence_mask(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The off-policy sequence mask (OPSM) of DeepSeek-V3.2 (DeepSeek-AI 2025, "DeepSeek-V3.2:
    Pushing the Frontier of Open Large Language Models", eq. 9), as TRL's `get_off_policy_mask`:

        kl_i = (1 / |y_i|) sum_t m_t (log pi_sampling(y_t) - log pi_theta(y_t))
        M_i  = 0  if A_i < 0 and kl_i > delta,   else 1

    A response the current policy has moved far away from (or that the inference engine sampled
    from a distribution far from the trainer's) is a poor negative example: pushing its
    probability further down mostly adds noise, so it leaves the loss. Positive-advantage
    responses always stay. kl_i is a per-token sample estimate (k1) of the drift, computed
    from the current log-probs (detached); use the rollout engine's log-probs as
    `sampling_logprobs` to catch train/inference mismatch as well as the drift of earlier
    mini-batches. Multiply the per-token loss by M (its normaliser unchanged).

    Args:
        logprobs: [N, R] current policy log-probs.
        sampling_logprobs: [N, R] log-probs of the policy that sampled the responses.
        advantages: [N] one per response.
        mask: [N, R] 1 on response tokens.
        delta: the bound (TRL suggests e.g. 0.5; >= 0).

    Returns:
        M [N] float (1 keep, 0 drop) and metrics `opsm/masked_frac` (dropped / rows with tokens)
        and `opsm/kl_mean` (mean kl_i over rows with tokens; 0 if none). A row with no token is
        kept.
    """
    if not delta >= 0:
        raise ValueError(f"OPSM delta must be >= 0, got {delta}")
    check_logprob_pair(logprobs, sampling_logprobs, mask)
    if advantages.shape != mask.shape[:1]:
        raise ValueError(f"advantages must be [N] = [{mask.shape[0]}], got shape {list(advantages.shape)}")
    with torch.no_grad():
        m = mask > 0
        x = torch.where(
            m,
            sampling_logprobs.float() - logprobs.detach().float(),
            torch.zeros_like(mask, dtype=torch.float32),
        )
        n_tok = m.sum(dim=-1)
        has = n_tok > 0
        kl = x.sum(dim=-1) / n_tok.clamp(min=1)
        drop = has & (advantages.to(kl.device) < 0) & (kl > delta)
        rows = max(int(has.sum()), 1)
        metrics = {
            "opsm/masked_frac": float(drop.sum()) / rows,
            "opsm/kl_mean": float(kl[has].mean()) if has.any() else 0.0,
        }
        return (~drop).float(), metrics


def _count(frac: float, n: int) -> int:
    """ceil(frac * n), at least 1, robust to float error (0.3 * 10 = 3.0000000000000004)."""
    return max(1, math.ceil(frac * n - 1e-9))


def forking_token_mask(
    entropy: torch.Tensor, mask: torch.Tensor, frac: float = 0.2, scope: str = "response"
) -> torch.Tensor:
    """1 on the top-`frac` entropy ("forking") tokens, 0 elsewhere (Wang et al. 2025, "Beyond the
    80/20 Rule: High-Entropy Minority Tokens Drive Effective RL for LLM Reasoning").

    scope `response`: in each response, its ceil(frac * T_i) highest-entropy tokens (at least
    one per non-empty response); scope `batch`: the ceil(frac * T) highest over all T tokens of
    the batch (the paper's per-batch quantile). Ties at the threshold keep the earlier token.
    The paper multiplies the per-token loss by this indicator and keeps the normaliser (every
    token), so pass it as a per-token weight.

    Args:
        entropy: [N, R] per-token entropies (detached here).
        mask: [N, R] 1 on response tokens.
        frac: the fraction kept, in (0, 1].
    """
    if not 0 < frac <= 1:
        raise ValueError(f"forking-token fraction must be in (0, 1], got {frac}")
    if scope not in FORKING_SCOPES:
        raise ValueError(f"unknown forking-token scope {scope!r}: choose from {list(FORKING_SCOPES)}")
    if entropy.shape != mask.shape or mask.dim() != 2:
        raise ValueError(f"entropy {list(entropy.shape)} and mask {list(mask.shape)} must both be [N, R]")
    with torch.no_grad():
        m = mask > 0
        e = torch.where(m, entropy.detach().float(), torch.full_like(entropy, -math.inf, dtype=torch.float32))
        keep = torch.zeros_like(e)
        if scope == "batch":
            total = int(m.sum())
            if total:
                k = _count(frac, total)
                idx = torch.sort(e.flatten(), descending=True, stable=True).indices[:k]
                keep.view(-1)[idx] = 1.0
        else:
            for i in range(e.shape[0]):
                t = int(m[i].sum())
                if t:
                    idx = torch.sort(e[i], descending=True, stable=True).indices[: _count(frac, t)]
                    keep[i, idx] = 1.0
        return keep * m.float()


@dataclass
class AdaptiveEntropyCoef:
    """Skywork-OR1's adaptive entropy control (He et al. 2025, "Skywork Open Reasoner 1
    Technical Report", sec. 3.2): a coefficient c stepped towards holding the entropy at a target,

        c_{k+1} = clip(c_k + delta * sign(target - e_k), 0, c_max)
        bonus applied at step k+1 = c_{k+1} if e_k <= target else 0

    e_k is the policy's mean token entropy measured during step k's update. The first step
    applies c_0 (`algo.entropy_coef`).
    """

    coef: float
    target: float
    delta: float
    max_coef: float
    applied: float = -1.0  # < 0: not updated yet (the first step applies `coef`)

    def current(self) -> float:
        """The coefficient the next update applies."""
        return self.coef if self.applied < 0 else self.applied

    def update(self, entropy: float) -> float:
        """Step the coefficient with the entropy `entropy` just measured; returns the next one."""
        if not math.isfinite(entropy):
            return self.current()
        if entropy < self.target:
            self.coef += self.delta
        elif entropy > self.target:
            self.coef -= self.delta
        self.coef = min(max(self.coef, 0.0), self.max_coef)
        self.applied = self.coef if entropy <= self.target else 0.0
        return self.applied
