"""The on-policy loop with a vLLM engine beside the trainer (`rollout.engine=vllm`, sync mode).

The same pieces as `grpo_step`, composed as veRL's hybrid engine lays them out on one GPU:

    generate    the vLLM engine wakes (weights, then KV cache), generates, and goes back to
                sleep (`rollout.vllm_sleep_level`: weights offloaded or dropped, KV cache freed)
                before the trainer computes log-probs and updates, so the two never hold the
                GPU's memory at the same time; each prompt's responses reach the router the
                step vLLM finishes it (rewards overlap generation)
    update      steps b-g of `grpo_step`, unchanged, on the trainer's own model
    sync        the updated weights go to the engine (`VLLMRolloutEngine.load_weights`: only its
                weights wake, the KV cache stays free until the next batch); before the first
                step too, since a resumed run's weights are not the folder's vLLM loaded

The engine holds its own copy of the weights in `model.dtype`, so its log-probs are not bit-equal
to the trainer's recomputation: `algo.old_logprobs=recompute` (the default) scores the update
against the trainer's own numbers, and `algo.tis` can correct the remaining mismatch. Evaluation
generates greedily with the same engine (after the sync, so with the weights it reports).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from mmrl.config import Config
from mmrl.models.loading import Policy
from mmrl.train.async_grpo import make_rollout_engine
from mmrl.train.data import PromptSampler
from mmrl.train.grpo import Composition, Trainee, grpo_step, make_trainee
from mmrl.types import VerifyContext


@dataclasses.dataclass
class ColocatedTrainee(Trainee):
    """A trainee whose `engine` is a vLLM engine with its own copy of the policy's weights."""

    synced: bool = False
    """Whether the engine holds the policy's current weights."""

    def sync_weights(self) -> float:
        """Send the policy's weights to the engine; returns the seconds it took."""
        start = time.monotonic()
        self.engine.load_weights(self.policy.model.state_dict())
        self.synced = True
        return time.monotonic() - start

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        super().close()


def colocated_composition(cfg: Config) -> Composition:
    return Composition(make_trainee=make_colocated_trainee, step=colocated_grpo_step)


def make_colocated_trainee(cfg: Config, policy: Policy, run_dir: Path | None = None) -> ColocatedTrainee:
    """The on-policy trainee with the HF engine replaced by vLLM (built after LoRA and frozen
    parts are applied, so it knows which weights a sync sends)."""
    t = make_trainee(cfg, policy, run_dir)
    fields = {f.name: getattr(t, f.name) for f in dataclasses.fields(Trainee)}
    fields["engine"] = make_rollout_engine(cfg, t.policy)
    return ColocatedTrainee(**fields)


def colocated_grpo_step(
    cfg: Config, t: ColocatedTrainee, sampler: PromptSampler, context: VerifyContext, step: int = 0
) -> dict[str, float]:
    """`grpo_step` (the engine sleeps through the update), then the new weights to the engine."""
    before = 0.0 if t.synced else t.sync_weights()  # the first step (a resumed run's weights)
    metrics = grpo_step(cfg, t, sampler, context, step=step)
    t.synced = False
    metrics["time/weight_sync_s"] = before + t.sync_weights()
    return metrics
