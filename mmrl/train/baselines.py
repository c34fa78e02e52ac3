"""ReMax's greedy baseline (Li et al. 2024, arXiv 2310.10505): one argmax-decoded response per
prompt, scored like the sampled ones, whose reward is the baseline of that prompt's samples.

The greedy responses are generated and scored only for their reward: they are not trained on,
not dumped and not part of the batch. `learn_from_rollouts` (`mmrl.train.grpo`) calls
`greedy_baselines` for the estimators in `NEEDS_BASELINE` before the advantages (step d) and
passes the result on as the estimator's `baselines`; nothing else in the step changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from mmrl.algos.dapo import overlong_penalty
from mmrl.config import Config
from mmrl.rollout.hf import SamplingParams
from mmrl.router import RewardBatch
from mmrl.types import RolloutBatch
from mmrl.verifiers.limits import is_refusal

log = logging.getLogger(__name__)


def greedy_baselines(
    cfg: Config, engine, score: Callable[[RolloutBatch], RewardBatch], batch: RolloutBatch
) -> tuple[torch.Tensor, dict[str, float]]:
    """The reward of a greedy response to each row's prompt, [N] on the batch's device.

    Args:
        cfg: the run's config (`rollout.max_new_tokens`; DAPO's overlong punishment, if on, is
            applied to the greedy response as to the samples, so both sides are shaped alike).
        engine: the rollout engine (its `generate` with `greedy=True`).
        score: scores a rollout batch as the step scores its samples (verifiers and any reward
            models the samples name).
        batch: the step's rollouts, prompt-major with groups of `cfg.rollout.group_size`.

    Returns:
        baselines [N] (each row gets its prompt's greedy reward; NaN where the greedy response
        could not be scored, which the estimator turns into advantage 0), and metrics
        `remax/baseline_mean`, `remax/baseline_errors`, `time/baseline_s`.
    """
    start = time.monotonic()
    G = cfg.rollout.group_size
    if len(batch) % G:
        raise ValueError(f"{len(batch)} rollout rows do not split into groups of {G}")
    prompts = batch.samples[::G]
    params = SamplingParams(n=1, greedy=True, max_new_tokens=cfg.rollout.max_new_tokens)
    greedy = engine.generate(prompts, params)
    rewards = score(greedy)
    scores = rewards.scores.to(batch.device, dtype=torch.float32, copy=True)
    if cfg.algo.overlong_buffer > 0:
        lengths = greedy.response_mask.sum(dim=1).to(batch.device)
        scores = scores + overlong_penalty(
            lengths, cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer, cfg.algo.overlong_penalty
        )
    errors = torch.tensor(  # a greedy answer refused by a size cap is a verdict: a baseline of 0
        [r.error is not None and not is_refusal(r.error) for r in rewards.results],
        dtype=torch.bool,
        device=batch.device,
    )
    if errors.any():
        ids = [s.id for s, bad in zip(prompts, errors.tolist()) if bad]
        log.warning(
            "remax: the greedy baseline of samples %s could not be scored: their advantages are 0", ids[:20]
        )
    per_prompt = torch.where(errors, torch.full_like(scores, float("nan")), scores)
    ok = ~errors
    metrics = {
        "remax/baseline_mean": float(per_prompt[ok].mean()) if ok.any() else float("nan"),
        "remax/baseline_errors": float(errors.sum()),
        "time/baseline_s": time.monotonic() - start,
    }
    return per_prompt.repeat_interleave(G), metrics
