"""Advantage estimators: pure functions over per-response rewards, selected by name.

Rows are prompt-major: rows i*G .. i*G+G-1 are the G responses to prompt i. Every estimator in
`ADVANTAGE_ESTIMATORS` is called the same way,

    fn(rewards, group_size, *, eps=1e-6, valid=None) -> [N]

with `rewards` [N] (GDPO: [N, K], one column per reward component, plus `weights`). `valid`
([N] bool) leaves rows out of every statistic and gives them advantage 0 (a dropped verifier
error). No estimator ever returns NaN: a statistic over fewer than two valid rows, or over rows
whose rewards are all equal, gives advantage 0 to the rows it would have normalised.

| name | A_i |
|---|---|
| `grpo` | (r_i - mean_group) / (std_group + eps) |
| `dr_grpo` | r_i - mean_group |
| `rloo` | r_i - mean_{j != i in group} r_j |
| `reinforce_pp` | r_i whitened per token over the batch (veRL's `masked_whiten`) |
| `reinforce_pp_baseline` | x_i = r_i - mean_group, then whitened per token over the batch (veRL's `masked_whiten`) |
| `gdpo` | sum_k w_k grpo(r[:, k]), then batch-normalised as above (or only scaled, or neither) |
| `remax` | r_i - b_i, b_i the reward of the greedy response to row i's prompt |
| `opo` | r_i - sum_j L_j r_j / sum_j L_j over the group (L: response tokens) |
| `gpg` | alpha (r_i - mean_group), alpha = valid rows / rows of groups with a spread |
| `pass_at_k` | the analytic pass@k advantage of a binary reward (Chen et al. 2025) |
| `grpo_passk` | veRL's: (r_max - r_second) / (std_group + eps) for the group's best response, 0 for the rest |

Every std is the unbiased sample std (Bessel), as in TRL and veRL, except `pass_at_k`'s, which
is the Bernoulli std sqrt(p (1 - p)) its paper derives.

All but `gdpo` are written over one batch's rewards grouped by prompt, r and v [B, G], and
registered with `group_estimator`, which checks the inputs and groups the rows for all of them.

Estimators that need more than the rewards say so in a set and take it as a keyword argument:
`token_counts` ([N] response tokens, `TOKEN_WEIGHTED`), `baselines` ([N] the greedy response's
reward, `NEEDS_BASELINE`), `k` (`pass_at_k`).

Those in `GROUP_LOCAL` (`grpo`, `dr_grpo`, `rloo`, `remax`, `opo`, `pass_at_k`, `grpo_passk`) are
*group-local*: a group's advantages depend on that group's rows alone, so the trainer may update
on the first mini-batch's groups while later groups are still being scored
(`reward.update_while_scoring`; tests/test_algos_registry.py checks the property for each). The
batch-normalised ones need every reward first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

AdvantageFn = Callable[..., torch.Tensor]
GroupFn = Callable[..., torch.Tensor]
"""`fn(r [B, G], v [B, G], eps, **options) -> [B, G]`: an estimator over grouped rewards."""
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
GROUP_LOCAL: set[str] = set()
"""Estimators whose advantages for a group read only that group's rewards."""
TOKEN_WEIGHTED: set[str] = {"reinforce_pp", "reinforce_pp_baseline", "opo"}
"""Estimators that take `token_counts` ([N] response tokens per row): veRL whitens the
REINFORCE++ ones per token; OPO weighs its baseline by them."""
NEEDS_BASELINE: set[str] = {"remax"}
"""Estimators that take `baselines` ([N] the reward of a greedy response to each row's prompt)."""


def register_advantage(name: str, group_local: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register `fn` under `name`; `group_local` declares that a group's advantages read only
    its own rows (so they may be computed group by group, as rewards arrive)."""

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS[name] = fn
        if group_local:
            GROUP_LOCAL.add(name)
        return fn

    return wrap


def get_advantage_estimator(name: str) -> AdvantageFn:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}: choose from {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def _prepare(
    rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None, *, components: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked float rewards ([N] or [N, K]) with invalid rows zeroed, and the [N] bool valid mask."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    want = "[N] or [N, K]" if components else "[N]"
    if rewards.dim() not in ((1, 2) if components else (1,)):
        raise ValueError(f"rewards must be {want}, got shape {list(rewards.shape)}")
    n = rewards.shape[0]
    if n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of {group_size}")
    if valid is None:
        v = torch.ones(n, dtype=torch.bool, device=rewards.device)
    else:
        if valid.shape != (n,):
            raise ValueError(f"valid must be [N] = [{n}] like rewards, got shape {list(valid.shape)}")
        v = valid.to(device=rewards.device, dtype=torch.bool)
    r = rewards.float()
    finite = torch.isfinite(r) if r.dim() == 1 else torch.isfinite(r).all(dim=-1)
    bad = (~finite & v).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"non-finite reward at rows {bad[:10].tolist()} (mark them invalid to drop them)")
    r = torch.where(v if r.dim() == 1 else v.unsqueeze(-1), r, torch.zeros_like(r))
    return r, v


def group_estimator(name: str, group_local: bool = False) -> Callable[[GroupFn], AdvantageFn]:
    """Decorator: register `fn(r, v, eps, **options) -> [B, G]` as the estimator `name`, called
    with the common signature `(rewards, group_size, *, eps=1e-6, valid=None, **options) -> [N]`.

    The registered estimator checks `rewards` [N], `group_size` and `valid` once for all
    (`_prepare`), and gives `fn` them grouped, prompt by prompt: r [B, G] float32 rewards (0 on
    invalid rows) and v [B, G] bool, B = N / G; options (`token_counts`, ...) pass through.
    `fn`'s docstring, which becomes the estimator's, is written for that common call.
    """

    def wrap(fn: GroupFn) -> AdvantageFn:
        def estimator(
            rewards: torch.Tensor,
            group_size: int,
            *,
            eps: float = 1e-6,
            valid: torch.Tensor | None = None,
            **options,
        ) -> torch.Tensor:
            r, v = _prepare(rewards, group_size, valid)
            return fn(r.view(-1, group_size), v.view(-1, group_size), eps, **options).reshape(-1)

        estimator.__name__, estimator.__qualname__ = fn.__name__, fn.__qualname__
        estimator.__doc__ = fn.__doc__
        return register_advantage(name, group_local)(estimator)

    return wrap


def _standardise(
    x: torch.Tensor, mask: torch.Tensor, eps: float, *, centre: bool = True, scale: bool = True
) -> torch.Tensor:
    """(x - mean) / (std + eps) along the last dim over `mask`ed entries; 0 elsewhere.

    x, mask: [..., M] (mask bool). A slice with fewer than two masked entries, or whose masked
    entries are all equal, is all 0 (no baseline / no signal; never 0/0).
    """
    if x.numel() == 0:
        return torch.zeros_like(x)
    _, mean, std = _masked_mean_std(x, mask)
    out = torch.where(mask, x - mean if centre else x, torch.zeros_like(x))
    if scale:
        out = out / (std + eps)
    return torch.where(mask & _spread(x, mask), out, torch.zeros_like(out))


def _masked_mean_std(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, unbiased std) of x along the last dim over `mask`ed entries, each [..., 1]
    (mean 0 without entries; the std divides by max(count - 1, 1))."""
    n = mask.sum(dim=-1, keepdim=True).to(x.dtype)
    mean = torch.where(mask, x, torch.zeros_like(x)).sum(dim=-1, keepdim=True) / n.clamp(min=1)
    var = torch.where(mask, x - mean, torch.zeros_like(x)).square().sum(dim=-1, keepdim=True)
    return n, mean, (var / (n - 1).clamp(min=1)).sqrt()


def _spread(grouped: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[..., 1] True where a slice has at least two masked entries and they are not all equal."""
    hi = torch.where(mask, grouped, torch.full_like(grouped, -torch.inf)).amax(dim=-1, keepdim=True)
    lo = torch.where(mask, grouped, torch.full_like(grouped, torch.inf)).amin(dim=-1, keepdim=True)
    return (mask.sum(dim=-1, keepdim=True) >= 2) & (hi > lo)


@group_estimator("grpo", group_local=True)
def group_advantages(r: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(group)) / (std(group) + eps).

    Args:
        rewards: [B x G] one scalar reward per response.
        group_size: G.
        eps: added to the std (kept from the GRPO recipe; all-equal groups are exactly 0 anyway).
        valid: [B x G] bool; responses marked False are left out of their group's mean and
            std and get advantage 0 (a dropped verifier error).

    Returns:
        [B x G] advantages. The std is the unbiased sample std, as in TRL and veRL; a group with
        fewer than two valid responses has no baseline and gets advantage 0, and so does a group
        whose valid rewards are all equal.
    """
    return _standardise(r, v, eps)


@group_estimator("dr_grpo", group_local=True)
def dr_grpo_advantages(r: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean(group).

    Dropping GRPO's division by the group std removes its question-difficulty bias (groups that
    are nearly all right or all wrong are no longer up-weighted). Pair it with the
    `seq_mean_token_sum_norm` loss aggregation to also remove the length bias.

    Args:
        rewards: [B x G]; group_size: G; eps: unused (uniform signature); valid: [B x G] bool.

    Returns:
        [B x G]; 0 for invalid rows and for groups with fewer than two valid rows.
    """
    del eps
    return _standardise(r, v, 0.0, scale=False)


@group_estimator("rloo", group_local=True)
def rloo_advantages(r: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j.

    The leave-one-out baseline over the n valid rows of the group equals
    n / (n - 1) * (r_i - mean(group)), which is how it is computed.

    Args:
        rewards: [B x G]; group_size: G; eps: unused (uniform signature); valid: [B x G] bool.

    Returns:
        [B x G]; 0 for invalid rows and for groups with fewer than two valid rows (no baseline).
    """
    del eps
    n = v.sum(dim=1, keepdim=True).float()
    centred = _standardise(r, v, 0.0, scale=False)
    return centred * n / (n - 1).clamp(min=1)


def _token_whiten(x: torch.Tensor, valid: torch.Tensor, token_counts: torch.Tensor | None) -> torch.Tensor:
    """veRL's `masked_whiten` of per-response values spread over their tokens.

    Every response token carries its response's x, so with L_i tokens in response i and
    T = sum_i L_i over the valid rows,

        mu = sum_i L_i x_i / (T + 1e-8),   var = sum_i L_i (x_i - mu)^2 / (T + 1e-8) * T / (T - 1),
        A_i = (x_i - mu) / sqrt(var + 1e-8)

    Without `token_counts` every response counts as one token.

    Args:
        x: [N] per-response values (0 on invalid rows); valid: [N] bool;
        token_counts: [N] response tokens per row, or None.

    Returns:
        [N] float32; all 0 when the valid rows hold fewer than two tokens (veRL raises) or x has
        no spread over them; 0 on rows with no token.
    """
    if token_counts is None:
        w = torch.ones_like(x)
    else:
        if token_counts.shape != x.shape:
            raise ValueError(
                f"token_counts must be [N] = [{x.numel()}], got shape {list(token_counts.shape)}"
            )
        w = token_counts.to(device=x.device, dtype=torch.float32)
    w = torch.where(valid, w, torch.zeros_like(w))
    total = w.sum()
    used = w > 0
    if total <= 1 or not used.any():
        return torch.zeros_like(x)
    mean = (w * x).sum() / (total + 1e-8)
    var = (w * (x - mean).square()).sum() / (total + 1e-8) * (total / (total - 1))
    adv = (x - mean) * torch.rsqrt(var + 1e-8)
    spread = x[used].amax() > x[used].amin()
    return torch.where(used & spread, adv, torch.zeros_like(adv))


@group_estimator("reinforce_pp")
def reinforce_pp_advantages(
    r: torch.Tensor, v: torch.Tensor, eps: float, token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262), veRL's `compute_reinforce_plus_plus_outcome_advantage`:
    global whitening of the returns over every response token of the batch, no per-prompt
    baseline.

    With an outcome reward and gamma = 1 (veRL's default) every token of response i carries the
    return r_i, and veRL whitens those returns **per token** (`masked_whiten`): with L_i tokens
    in response i and T = sum_i L_i,

        mu = sum_i L_i r_i / T,   var = sum_i L_i (r_i - mu)^2 / (T - 1),
        A_i = (r_i - mu) / sqrt(var + 1e-8)

    so long responses weigh more in mu and var (veRL's masked mean divides by T + 1e-8,
    reproduced too). Without `token_counts` every response counts as one token: the
    per-response whitening (r_i - mean) / std over the batch.

    Args:
        rewards: [N]; group_size: G (only checked: N must be a multiple); valid: [N] bool
            (invalid rows are left out of every statistic and get 0).
        eps: accepted for the common signature and unused: veRL's whitening adds 1e-8 to the
            variance, not eps to the std.
        token_counts: [N] response tokens per row (the response mask's row sums).

    Returns:
        [N] float32; all 0 if fewer than two tokens are valid or all valid rewards are equal.
    """
    del eps  # see the docstring: the variance gets 1e-8, as in veRL
    return _token_whiten(r.view(-1), v.view(-1), token_counts)


@group_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    r: torch.Tensor, v: torch.Tensor, eps: float, token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025), veRL's `compute_reinforce_plus_plus_baseline_outcome_advantage`.

    x_i = r_i - mean(group) (a group with a single valid response keeps x_i = r_i: veRL's
    baseline for it is 0), then x is whitened **per token** as veRL's `masked_whiten` does:
    every response token carries its response's x, so with L_i tokens in response i and
    T = sum_i L_i,

        mu = sum_i L_i x_i / T,   var = sum_i L_i (x_i - mu)^2 / (T - 1),
        A_i = (x_i - mu) / sqrt(var + 1e-8)

    (veRL's masked mean divides by T + 1e-8, reproduced too). Long responses weigh more in mu
    and var. Without `token_counts` every response counts as one token (equal lengths then
    differ from veRL only by Bessel's factor, T/(T-1) instead of N/(N-1)).

    Args:
        rewards: [B x G]; group_size: G; valid: [B x G] bool (invalid rows are left out of
            every statistic and get 0).
        eps: accepted for the common signature and unused: veRL's whitening adds 1e-8 to the
            variance, not eps to the std.
        token_counts: [B x G] response tokens per row (the response mask's row sums).

    Returns:
        [B x G] float32; all 0 when fewer than two tokens are valid (veRL raises) or the
        centred rewards have no spread; 0 on rows with no token.
    """
    del eps  # see the docstring: the variance gets 1e-8, as in veRL
    n = v.sum(dim=1, keepdim=True)
    group_mean = torch.where(
        n > 1, (r * v).sum(dim=1, keepdim=True) / n.clamp(min=1), torch.zeros_like(r[:, :1])
    )
    x = torch.where(v, r - group_mean, torch.zeros_like(r)).view(-1)
    return _token_whiten(x, v.view(-1), token_counts)


GDPO_BATCH_NORMS = ("mean_std", "std", "none")


@register_advantage("gdpo")
def gdpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
    weights: Sequence[float] | None = None,
    batch_norm: str = "mean_std",
) -> torch.Tensor:
    """GDPO (Liu et al. 2026, arXiv 2601.05242): per-component group normalisation, weighted sum,
    then batch normalisation.

        A_i^k = (r_i^k - mean_group(r^k)) / (std_group(r^k) + eps)        for each component k
        S_i   = sum_k w_k A_i^k
        A_i   = (S_i - mean_batch(S)) / (std_batch(S) + eps)      batch_norm="mean_std" (the paper)
        A_i   = S_i / (std_batch(S) + eps)                        batch_norm="std" (scale only)
        A_i   = S_i                                               batch_norm="none"

    Normalising each reward separately keeps distinct reward combinations distinct (GRPO on the
    summed reward collapses e.g. (1, 0) and (0, 1) into the same advantage). The batch step
    keeps the advantage's scale from growing with the number of components; since every A^k
    has group mean 0, S already has batch mean ~0 and `std` only rescales.

    A component missing in a row (NaN, as `RewardBatch.component` gives it) is left out of that
    component's group statistics only and contributes 0 to that row's sum, as TRL's nan-aware
    `normalize_then_sum` does (nanmean / nanstd per component, nansum over components); a row
    missing every component is unscorable: advantage 0, out of the batch statistics.

    Args:
        rewards: [N, K] reward components (an [N] tensor is one component); NaN = missing,
            +-inf is an error.
        group_size: G.
        eps: added to every std.
        valid: [N] bool, applied to all components.
        weights: K weights (default all 1).
        batch_norm: `mean_std`, `std` or `none` (see above).

    Returns:
        [N]; a component that is constant within a group contributes 0 for that group.
    """
    if batch_norm not in GDPO_BATCH_NORMS:
        raise ValueError(f"gdpo: unknown batch_norm {batch_norm!r}: choose from {list(GDPO_BATCH_NORMS)}")
    r = rewards.float()
    if r.dim() == 1:
        r = r.unsqueeze(-1)
    present = ~torch.isnan(r)  # [N, K]: NaN marks a missing component, never an error
    v0 = torch.ones(r.shape[0], dtype=torch.bool, device=r.device) if valid is None else valid.to(r.device)
    if v0.shape == r.shape[:1]:
        v0 = v0.bool() & present.any(dim=-1)  # a row with no component at all is unscorable
    r, v = _prepare(torch.where(present, r, torch.zeros_like(r)), group_size, v0, components=True)
    k = r.shape[1]
    if weights is None:
        w = torch.ones(k, device=r.device)
    else:
        if len(weights) != k:
            raise ValueError(f"gdpo: {len(weights)} weights for {k} reward components")
        w = torch.tensor([float(x) for x in weights], device=r.device)
    per_group = r.view(-1, group_size, k).transpose(1, 2)  # [B, K, G]
    mask = (v.unsqueeze(-1) & present).view(-1, group_size, k).transpose(1, 2)  # [B, K, G]
    summed = (_standardise(per_group, mask, eps) * w.view(1, k, 1)).sum(dim=1)  # [B, G]
    if batch_norm == "none":
        return torch.where(v, summed.view(-1), torch.zeros_like(summed.view(-1)))
    return _standardise(summed.view(1, -1), v.view(1, -1), eps, centre=batch_norm == "mean_std").view(-1)


def _group_baseline_check(name: str, extra: torch.Tensor | None, n: int, what: str) -> torch.Tensor:
    if extra is None:
        raise ValueError(f"{name}: needs `{what}` ([N] = [{n}])")
    if extra.shape != (n,):
        raise ValueError(f"{name}: {what} must be [N] = [{n}], got shape {list(extra.shape)}")
    return extra


@group_estimator("remax", group_local=True)
def remax_advantages(
    r: torch.Tensor, v: torch.Tensor, eps: float, baselines: torch.Tensor | None = None
) -> torch.Tensor:
    """ReMax (Li et al. 2024, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models", arXiv 2310.10505): A_i = r_i - b_i, where b_i is
    the reward of the greedy (argmax-decoded) response to row i's prompt, as veRL's
    `compute_remax_outcome_advantage` with an outcome reward.

    The greedy response is generated and scored for the baseline only (it is not trained on);
    the trainer does that (`mmrl.train.baselines.greedy_baselines`). No group statistic is
    involved, so G = 1 works (the paper's setting).

    Args:
        rewards: [N]; group_size: G (only checked); eps: unused (uniform signature);
        valid: [N] bool; baselines: [N] the greedy reward of each row's prompt (NaN: the greedy
            response could not be scored, and the row gets 0).

    Returns:
        [N]; 0 for invalid rows and rows without a baseline.
    """
    del eps
    b = _group_baseline_check("remax", baselines, r.numel(), "baselines").to(r.device).float().view_as(r)
    has = v & torch.isfinite(b)
    return torch.where(has, r - torch.where(has, b, torch.zeros_like(b)), torch.zeros_like(r))


@group_estimator("opo", group_local=True)
def opo_advantages(
    r: torch.Tensor, v: torch.Tensor, eps: float, token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585): the
    length-weighted group baseline that minimises the gradient variance under exact on-policy
    training (gradient norms grow with response length),

        b = sum_j L_j r_j / sum_j L_j   over the group's valid rows,   A_i = r_i - b

    with L_j the response's token count (veRL's `compute_opo_outcome_advantage`). Without
    `token_counts` every row weighs 1 (then this is Dr.GRPO).

    Args:
        rewards: [B x G]; group_size: G; eps: unused; valid: [B x G] bool;
        token_counts: [B x G] response tokens per row (rows with 0 tokens weigh nothing).

    Returns:
        [B x G]; 0 for invalid rows, for groups with fewer than two valid rows (veRL keeps a
        single row's reward with baseline 0; its own length-weighted mean would give 0) and for
        groups whose valid rewards are all equal or whose tokens sum to 0.
    """
    del eps
    if token_counts is None:
        w = torch.ones_like(r)
    else:
        w = _group_baseline_check("opo", token_counts, r.numel(), "token_counts").to(r.device).float()
    w = torch.where(v, w.view_as(r), torch.zeros_like(r))
    total = w.sum(dim=1, keepdim=True)
    baseline = (w * r).sum(dim=1, keepdim=True) / total.clamp(min=1e-12)
    ok = v & _spread(r, v) & (total > 0)
    return torch.where(ok, r - baseline, torch.zeros_like(r))


@group_estimator("gpg")
def gpg_advantages(r: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv 2504.02546): group-mean advantages (F_norm = 1, no std division) scaled by
    the paper's accurate-gradient-estimation factor,

        A_i   = alpha (r_i - mean_group(r))
        alpha = B / (B - M)

    with B the valid responses of the batch and M those in groups with no reward spread (all
    equal, or a single valid row): they carry no gradient, and the batch's mean gradient would
    otherwise be diluted by them. Pair it with the `gpg` policy loss (-A log pi).

    veRL's `compute_gpg_outcome_advantage` computes alpha as N / count_nonzero(rewards) (rows
    with a non-zero reward), which equals the paper's B / (B - M) only when exactly the
    zero-reward rows are the ones in no-spread groups; this follows the paper.

    Args:
        rewards: [B x G]; group_size: G; eps: unused; valid: [B x G] bool.

    Returns:
        [B x G]; all 0 when no group has a spread. Not group-local (alpha reads the batch).
    """
    del eps
    spread = _spread(r, v)  # [B, 1]
    n_valid = v.sum()
    n_signal = (v & spread).sum()
    if n_signal == 0:
        return torch.zeros_like(r)
    alpha = n_valid.float() / n_signal.float()
    return alpha * _standardise(r, v, 0.0, scale=False)


def _comb_ratio(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """C(a, k) / C(b, k) elementwise for integer-valued a <= b, b >= k (0 when a < k), float64."""
    out = torch.ones_like(a, dtype=torch.float64)
    for i in range(k):
        out = out * ((a - i).clamp(min=0) / (b - i).clamp(min=1))
    return out


@group_estimator("pass_at_k", group_local=True)
def pass_at_k_advantages(r: torch.Tensor, v: torch.Tensor, eps: float, k: int = 4) -> torch.Tensor:
    """Pass@k advantages in closed form (Chen et al. 2025, "Pass@k Training for Adaptively
    Balancing Exploration and Exploitation of Large Reasoning Models", arXiv 2508.10751, the
    "analytical derivation"): the exact expectation over every k-subset of the group of the
    pass@k group reward (1 if any of its k responses is correct), so no subsets are sampled.

    With n valid responses of which n_neg are wrong (reward 0) and n_pos right (reward 1):

        R   = 1 - C(n_neg, k) / C(n, k)                         mean pass@k over k-subsets
        s   = sqrt(R (1 - R))                                   its (Bernoulli) std
        A_+ = (1 - R) / s                                       every subset with a right one passes
        A_- = (1 - R - C(n_neg - 1, k - 1) / C(n - 1, k - 1)) / s

    A_- uses the chance that a subset holding this wrong response holds no right one. The
    advantages of a group sum to 0, and k = 1 is GRPO with the population std sqrt(p (1 - p)).

    Args:
        rewards: [B x G] binary rewards (0 or 1; anything else is an error); group_size: G;
        eps: added to s; valid: [B x G] bool; k: 1 <= k (a group with fewer than k valid rows
            gets 0).

    Returns:
        [B x G] float32; 0 for invalid rows and for groups all right, all wrong or too small.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"pass_at_k: k must be a positive integer, got {k!r}")
    bad = (v & (r != 0) & (r != 1)).view(-1).nonzero().flatten()
    if bad.numel():
        raise ValueError(
            f"pass_at_k needs binary rewards (0 or 1): rows {bad[:10].tolist()} have "
            f"{r.view(-1)[bad[:10]].tolist()} (use an accuracy-only reward, format_ratio 0, no shaping)"
        )
    r = r.double()
    n = v.sum(dim=1, keepdim=True).double()
    n_pos = torch.where(v, r, torch.zeros_like(r)).sum(dim=1, keepdim=True)
    n_neg = n - n_pos
    mean = 1.0 - _comb_ratio(n_neg, n, k)
    std = (mean * (1.0 - mean)).clamp(min=0).sqrt()
    miss = _comb_ratio(n_neg - 1, n - 1, k - 1)
    a_pos = (1.0 - mean) / (std + eps)
    a_neg = (1.0 - mean - miss) / (std + eps)
    ok = v & (n >= k) & (n_pos > 0) & (n_neg > 0) & (std > 0)  # std 0: every k-subset passes
    adv = torch.where(r > 0.5, a_pos, a_neg)
    return torch.where(ok, adv, torch.zeros_like(adv)).float()


@group_estimator("grpo_passk", group_local=True)
def grpo_passk_advantages(r: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """veRL's `grpo_passk` (`compute_grpo_passk_outcome_advantage`, after Chen et al. 2025,
    arXiv 2503.19595): only the best response of each group is rewarded, by its margin over the
    runner-up, scaled by the group's std,

        A_best = (r_max - r_second) / (std(group) + eps),   A_i = 0 for every other response

    with `best` the first row holding the group's largest reward and std the unbiased sample
    std. Unlike `pass_at_k` (the analytic expectation over k-subsets), no k enters and rewards
    need not be binary.

    Args:
        rewards: [B x G]; group_size: G >= 2 (veRL refuses smaller groups); eps: added to the
            std; valid: [B x G] bool (invalid rows are neither best nor runner-up and get 0).

    Returns:
        [B x G]; a group with fewer than two valid rows gets 0 (veRL raises), and so does a
        group whose two largest rewards are equal.
    """
    if r.shape[1] < 2:
        raise ValueError(f"grpo_passk needs at least 2 responses per prompt, got group_size {r.shape[1]}")
    masked = torch.where(v, r, torch.full_like(r, -torch.inf))
    best = masked.argmax(dim=1, keepdim=True)  # the first maximal row, as veRL's topk on CPU
    r_max = masked.gather(1, best)
    r_second = masked.scatter(1, best, -torch.inf).amax(dim=1, keepdim=True)
    n, _, std = _masked_mean_std(r, v)
    margin = torch.where(n >= 2, (r_max - r_second) / (std + eps), torch.zeros_like(r_max))
    return torch.zeros_like(r).scatter(1, best, margin)


def clip_advantages(advantages: torch.Tensor, max_abs: float | None) -> torch.Tensor:
    """Clamp advantages to [-max_abs, max_abs] (any shape); None returns them unchanged."""
    if max_abs is None:
        return advantages
    if not max_abs > 0:
        raise ValueError(f"max_abs must be > 0 (or None for no clipping), got {max_abs}")
    return advantages.clamp(min=-max_abs, max=max_abs)
