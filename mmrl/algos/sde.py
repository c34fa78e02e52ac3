"""Flow-GRPO's stochastic sampling step with log-probabilities, and the objective's pieces.

Rectified-flow models predict a velocity v = dx/dsigma along x_sigma = (1 - sigma) x_0 + sigma
x_1 (sigma = 1 is noise, 0 is data); the deterministic sampler is the Euler ODE step
x' = x + v dt with dt = sigma' - sigma < 0. Flow-GRPO (Liu et al. 2025, arXiv 2505.05470)
replaces it by an SDE with the same marginals, so each step is a Gaussian policy whose
log-density can be optimised with GRPO:

    std   = a * sqrt(sigma / (1 - sigma))        (at sigma = 1 the next sigma is used in the
                                                  denominator, as the reference code does)
    mean  = x + [v + std^2 / (2 sigma) * (x + (1 - sigma) v)] dt
    x'    = mean + std * sqrt(-dt) * eps,         eps ~ N(0, I)

`a` is the noise level (0 gives back the ODE step). The coefficients-preserving variant (CPS,
Wang & Yu 2025, arXiv 2509.05952) re-noises the predicted clean sample so that the noise
coefficient of x' is exactly sigma' (the marginal variance is preserved at every step):

    x0_hat = x - sigma v,   x1_hat = x + (1 - sigma) v,   s = sigma' * sin(a * pi / 2)
    mean   = (1 - sigma') x0_hat + sqrt(sigma'^2 - s^2) x1_hat,   x' = mean + s * eps

Log-probabilities are per sample, averaged over every non-batch dimension (flow-GRPO's
convention: the ratio is then a per-element geometric mean and clip ranges are ~1e-4). CPS
uses the reference's variance-free log-probability -(x' - mean)^2 (its last step has s = 0).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

SDE_TYPES = ("sde", "cps")
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class SDEStep(NamedTuple):
    """What one stochastic step returns (B = batch)."""

    prev_sample: torch.Tensor
    """[B, ...] the next latent x' (the given one when `prev_sample` was passed)."""
    log_prob: torch.Tensor
    """[B] log-density of x' under N(mean, std^2), averaged over the non-batch dimensions."""
    mean: torch.Tensor
    """[B, ...] the Gaussian's mean (the predicted mean the KL to the reference is taken on)."""
    std: torch.Tensor
    """[B, 1, ...] (or [] for a scalar sigma) the Gaussian's standard deviation per element:
    std * sqrt(-dt) for `sde`, s for `cps`."""


def _bcast(value: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """A scalar stays a Python float (cheap arithmetic); a [B] tensor becomes [B, 1, ..., 1]."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return float(value)
        return value.to(device=like.device, dtype=torch.float32).view(-1, *([1] * (like.dim() - 1)))
    return float(value)


def sde_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    noise: torch.Tensor | None = None,
    sde_type: str = "sde",
) -> SDEStep:
    """One flow-GRPO step from sigma to sigma_next, with the log-density of the next latent.

    Args:
        velocity: [B, ...] the model's (guided) velocity prediction v at `sample`.
        sample: [B, ...] the current latent x at `sigma`.
        sigma: the current sigma (a float, or [B] per sample), in (0, 1].
        sigma_next: the next sigma (same form), < sigma; 0 at the last step.
        noise_level: a, the noise level (sde: std = a sqrt(sigma/(1-sigma)); cps: s = sigma'
            sin(a pi/2)). Must be > 0 for `sde` (0 has no density: use the ODE step).
        prev_sample: [B, ...] a given next latent (from a stored trajectory): its log-prob is
            computed and no noise is drawn.
        generator: for the noise when sampling (one generator, or one per sample).
        noise: [B, ...] the standard normal noise to use instead of drawing it.
        sde_type: `sde` (flow-GRPO) or `cps` (coefficients-preserving).

    Returns:
        `SDEStep(prev_sample, log_prob, mean, std)`. Computed in float32 (half precision
        overflows in the mean); `prev_sample` is float32.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r}: choose from {', '.join(SDE_TYPES)}")
    v = velocity.float()
    x = sample.float()
    s = _bcast(sigma, x)
    s_next = _bcast(sigma_next, x)
    if sde_type == "sde":
        if not noise_level > 0:
            raise ValueError(f"sde step needs noise_level > 0 (got {noise_level}); a = 0 is the ODE step")
        if isinstance(s, float) and isinstance(s_next, float):
            denom = 1.0 - (s_next if s == 1.0 else s)
            dt = s_next - s
            std_t = noise_level * math.sqrt(s / denom)
            std = std_t * math.sqrt(-dt)
            k = std_t * std_t / (2.0 * s)
            # mean = x + [v + k (x + (1 - s) v)] dt = x (1 + k dt) + v (1 + k (1 - s)) dt
            mean = torch.add(x * (1.0 + k * dt), v, alpha=(1.0 + k * (1.0 - s)) * dt)
        else:
            s_t = torch.as_tensor(s, dtype=torch.float32, device=x.device)
            s_n = torch.as_tensor(s_next, dtype=torch.float32, device=x.device)
            dt = s_n - s_t
            std_t = noise_level * torch.sqrt(s_t / (1.0 - torch.where(s_t == 1.0, s_n, s_t)))
            std = std_t * torch.sqrt(-dt)
            k = std_t.square() / (2.0 * s_t)
            mean = x + (v + k * (x + (1.0 - s_t) * v)) * dt
    else:
        if isinstance(s, float) and isinstance(s_next, float):
            std = s_next * math.sin(noise_level * math.pi / 2)
            c_noise = math.sqrt(max(s_next * s_next - std * std, 0.0))
        else:
            s_t = torch.as_tensor(s, dtype=torch.float32, device=x.device)
            s_n = torch.as_tensor(s_next, dtype=torch.float32, device=x.device)
            std = s_n * math.sin(noise_level * math.pi / 2)
            c_noise = torch.sqrt((s_n.square() - std.square()).clamp(min=0.0))
            s, s_next = s_t, s_n
        x0_hat = x - s * v
        x1_hat = x + (1.0 - s) * v
        mean = (1.0 - s_next) * x0_hat + c_noise * x1_hat

    if prev_sample is None:
        if noise is None:
            noise = _randn(x, generator)
        prev_sample = mean + std * noise.float()
    else:
        prev_sample = prev_sample.float()

    dims = tuple(range(1, x.dim()))
    diff = prev_sample.detach() - mean
    if sde_type == "sde":
        std_t = torch.as_tensor(std, dtype=torch.float32, device=x.device)
        var = std_t.square()
        log_prob = (
            -diff.square().mean(dim=dims) / (2.0 * var.reshape(-1))
            - torch.log(std_t).reshape(-1)
            - _HALF_LOG_2PI
        )
    else:
        log_prob = -diff.square().mean(dim=dims)
    std_out = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    return SDEStep(prev_sample, log_prob, mean, std_out)


def ode_step(velocity: torch.Tensor, sample: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """The deterministic Euler step x' = x + v (sigma' - sigma), in float32 like diffusers'
    `FlowMatchEulerDiscreteScheduler.step`, cast back to the velocity's dtype."""
    return (sample.float() + (sigma_next - sigma) * velocity).to(velocity.dtype)


def _randn(like: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None) -> torch.Tensor:
    if isinstance(generator, list):
        if len(generator) != like.shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {like.shape[0]}")
        return torch.cat(
            [torch.randn(like.shape[1:], generator=g, dtype=like.dtype).unsqueeze(0) for g in generator]
        ).to(like.device)
    device = generator.device if generator is not None else like.device
    return torch.randn(like.shape, generator=generator, dtype=like.dtype, device=device).to(like.device)


def mean_kl(
    mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, sde_type: str = "sde"
) -> torch.Tensor:
    """KL between the policy's and the reference's step Gaussians, per sample [B].

    The two share the standard deviation, so KL(N(m, s^2) || N(m_ref, s^2)) per element is
    (m - m_ref)^2 / (2 s^2); it is averaged over the non-batch dimensions like the log-prob.
    (Flow-GRPO's reference code divides by the SDE coefficient std^2 instead of the step's
    std^2 (-dt) std^2, i.e. reports KL * (-dt).) For `cps`, consistent with its variance-free
    log-prob, the KL is mean((m - m_ref)^2).
    """
    dims = tuple(range(1, mean.dim()))
    sq = (mean - ref_mean).square().mean(dim=dims)
    if sde_type == "cps":
        return sq
    return sq / (2.0 * std.reshape(-1).square())


def flow_grpo_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    global_std: bool = False,
    eps: float = 1e-4,
    clip: float | None = None,
    *,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-prompt advantages: A_i = (r_i - mean_group) / (std + eps), optionally clipped.

    The formula of flow_grpo's `PerPromptStatTracker.update`: float64 arithmetic and the
    *population* standard deviation (`np.std`, divisor n), so a group of 2 with rewards {0, 1}
    gets advantages -+0.5 / (0.5 + eps). With `global_std` the divisor is the population std of
    every reward in the batch, whatever the groups' sizes.

    Args:
        rewards: [N] one reward per image.
        group_size: G for the usual prompt-major layout (rows i*G .. i*G+G-1 share prompt i);
            ignored when `group_ids` is given.
        global_std: divide by the std of the whole batch instead of the group's (flow-GRPO's
            `global_std`: groups with little spread are not blown up).
        eps: added to the std (flow-GRPO uses 1e-4).
        clip: clamp to [-clip, clip] (flow-GRPO's `adv_clip_max`); None: no clipping.
        group_ids: [N] the prompt (any integer id) of each image, for groups of different
            sizes, in any order (flow-GRPO groups by prompt text the same way).

    Returns:
        [N] float32 (computed in float64). A group of one image has no spread around its own
        mean and gets 0; with eps = 0 a spread-free divisor gives 0 rather than NaN.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {list(rewards.shape)}")
    r = rewards.detach().to(torch.float64)
    if group_ids is None:
        if group_size is None or group_size < 1 or rewards.numel() % group_size:
            raise ValueError(
                f"rewards must be [B x G] with G = {group_size}, got shape {list(rewards.shape)}"
            )
        group_ids = torch.arange(rewards.numel(), device=r.device) // group_size
    elif group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids {list(group_ids.shape)} must match rewards {list(rewards.shape)}")
    _, inverse, counts = torch.unique(group_ids.to(r.device), return_inverse=True, return_counts=True)
    n = counts.to(torch.float64)
    mean = torch.zeros_like(n).index_add_(0, inverse, r) / n
    centred = r - mean[inverse]
    if global_std:
        std = (r - r.mean()).square().mean().sqrt().expand_as(r)
    else:
        std = (torch.zeros_like(n).index_add_(0, inverse, centred.square()) / n).sqrt()[inverse]
    denom = std + eps
    adv = torch.where(denom > 0, centred / denom.clamp(min=1e-300), torch.zeros_like(centred))
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.to(torch.float32)


def clipped_step_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate for one denoising step (flow-GRPO), mean over the batch.

        ratio = exp(log_prob - old_log_prob)                                 # [B]
        loss  = mean(max(-A ratio, -A clip(ratio, 1 - clip_range, 1 + clip_range)))

    Returns (loss, ratio).
    """
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).mean(), ratio
