"""`env`: the verifier of samples whose reward is their environment's.

A sample that acts in an environment (`agent.env` in its record) is rewarded by the environment:
its return (`Trajectory.env_return`, weighted by `agent.env_reward_weight`) is added to the
verifier's score by the rollout side (`mmrl.rollout.multiturn.shape_results`). This verifier
scores the final text 0, so that the return is the whole reward; a sample may name any other
verifier instead to add a check of its final answer.
"""

from __future__ import annotations

from mmrl.types import Sample, VerifierResult
from mmrl.verifiers.registry import SampleFieldError, Verifier, VerifyContext, register_verifier


@register_verifier("env")
class EnvVerifier(Verifier):
    """Scores 0: the environment's return is the reward (added with the trajectory's)."""

    def check_sample(self, sample: Sample) -> None:
        if sample.agent is None or sample.agent.env is None:
            raise SampleFieldError("reward_model.verifier", "'env' needs an environment (agent.env)")

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        return VerifierResult(score=0.0, components={})
