"""Trajectories that act in an environment (`agent.env`), through the multi-turn loop: each
model turn is an action, each observation (image and text) the next user turn, the reward the
env's; failures end or continue a trajectory as `mmrl.environments.step_sessions` reports them,
counted. The random tiny model writes no valid action by itself, so most tests register the
user's corridor (`tests/plugins/user_gym_env.py`) with an action adapter that reads every turn
as "ahead": its tokens are still its own samples and the env really steps."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from mmrl.config import AgentConfig
from mmrl.datasets.procedural import make_samples
from mmrl.environments import register_env, unregister_env
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.rollout.multiturn import generate_trajectories, shape_results, trajectory_metrics
from mmrl.train.forward import response_logprobs
from mmrl.types import AgentSpec, EnvSpec, RewardSpec, VerifierResult
from tests.conftest import bias_stop_token
from tests.plugins.user_gym_env import UserCorridor


@pytest.fixture()
def tiny_policy(tiny_policy):
    """The random tiny Qwen2-VL with an LM head bias that makes its stop token likely, so that
    its turns end on their stop token within a few tokens (as in tests/test_multiturn.py)."""
    return bias_stop_token(tiny_policy)


class Crashing(UserCorridor):
    def step(self, action):
        if self.steps >= 1:
            raise RuntimeError("the simulator lost its device")
        return super().step(action)


class Hanging(UserCorridor):
    def step(self, action):
        if self.steps >= 1:
            time.sleep(30)
        return super().step(action)


class FailingReset(UserCorridor):
    def reset(self, *, seed=None, options=None):
        raise OSError("no display")


@pytest.fixture(autouse=True)
def _envs():
    ahead = lambda env, text: 1  # noqa: E731 - every turn is "ahead"
    for name, cls in [
        ("test-corridor", UserCorridor), ("test-crashing", Crashing), ("test-hanging", Hanging),
        ("test-failing-reset", FailingReset),
    ]:  # fmt: skip
        register_env(name, cls, action=ahead, replace=True)
    yield
    for name in ("test-corridor", "test-crashing", "test-hanging", "test-failing-reset"):
        unregister_env(name)


def _env_samples(n: int, env: str = "test-corridor", seed: int | None = 3, **limits):
    samples = make_samples(["colour_code"], n, "train")
    spec = EnvSpec(id=env, kwargs={"length": 4}, seed=seed)
    return [
        dataclasses.replace(
            s,
            prompt=[{"role": "user", "content": "Walk to the green cell. Say ahead or back."}],
            images=[],
            reward_model=RewardSpec(ground_truth="", verifier="env"),
            agent=AgentSpec(env=spec, **{"max_turns": 6, "max_images": 8, **limits}),
        )
        for s in samples
    ]


def _run(policy, samples, n=2, **agent):
    engine = HFRolloutEngine.from_policy(policy)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=6)
    return generate_trajectories(engine, samples, params, AgentConfig(**{"max_tokens": 600, **agent}))


def test_an_episode_is_a_trajectory_with_the_envs_rewards_and_its_logprobs_recomputed(tiny_policy):
    """Seed 3 starts the corridor 1 cell in (length 4): two "ahead" steps reach the goal. The
    first observation is in the prompt, the second (after step 1) in the response as a user
    turn; the episode ends on the model's last action; the trainer's log-probs of the model
    tokens equal the rollout's within 1e-5."""
    start = UserCorridor(length=4).reset(seed=3)[1]["position"]
    steps = 4 - 1 - start
    batch = _run(tiny_policy, _env_samples(2), turn_discount=0.5)
    for r, traj in enumerate(batch.trajectories):
        assert traj.env_id == "test-corridor" and traj.termination == "env_done"
        assert traj.turns == steps == traj.env_steps and traj.turn_rewards == [0.0] * (steps - 1) + [1.0]
        assert traj.env_return == 0.5 ** (steps - 1)
        assert len(traj.images) == steps - 1  # one per observation appended (not the last)
        assert batch.images_per_row[r] == 1 + steps - 1  # the reset's picture is the prompt's
        assert traj.messages[1]["role"] == "user" and traj.observation_tokens > 0
    prompt_text = tiny_policy.processor.tokenizer.decode(batch.prompt_ids[0])
    assert "Walk to the green cell." in prompt_text and "<|image_pad|>" in prompt_text
    assert not (batch.response_mask.bool() & batch.observation_mask.bool()).any()
    with torch.no_grad():
        recomputed, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    torch.testing.assert_close(recomputed, batch.rollout_logprobs, atol=1e-5, rtol=0)
    # the return is the reward (verifier `env` scores 0), weighted by agent.env_reward_weight
    results = shape_results(
        [VerifierResult(score=0.0)] * len(batch), batch.trajectories, AgentConfig(env_reward_weight=2.0)
    )
    assert [r.components["env_return"] for r in results] == [2 * 0.5 ** (steps - 1)] * len(batch)
    m = trajectory_metrics(batch, 2)
    assert m["agent/env_success"] == 1.0 and m["agent/end_env_done"] == 1.0
    assert m["agent/env_steps"] == steps and m["agent/env_bad_action_rate"] == 0.0


def test_env_samples_mix_with_tool_and_plain_samples_in_one_batch(tiny_policy):
    from tests.test_multiturn import _tool_samples  # noqa: F401 - registers always_zoom

    plain = make_samples(["count"], 1, "train")
    tools = [dataclasses.replace(s, agent=AgentSpec(tools=["zoom_in"], max_turns=2)) for s in plain]
    samples = _env_samples(1) + tools + plain
    batch = _run(tiny_policy, samples, call_format="always_zoom")
    ends = [t.termination for t in batch.trajectories]
    assert ends[:2] == ["env_done"] * 2 and ends[2:4] == ["max_turns"] * 2
    assert [t.turns for t in batch.trajectories[4:]] == [1, 1] and batch.trajectories[4].env_id is None
    assert all(t.tool_calls == 1 for t in batch.trajectories[2:4])


@pytest.mark.parametrize(
    "env, reason",
    [("test-crashing", "env_error"), ("test-hanging", "env_timeout"), ("test-failing-reset", "env_error")],
)
def test_an_env_that_crashes_or_hangs_ends_its_trajectory_counted(tiny_policy, env, reason):
    batch = _run(tiny_policy, _env_samples(1, env=env, seed=0), env_timeout_s=1.0)
    for traj in batch.trajectories:
        assert traj.termination == reason and traj.env_errors == {reason: 1}
        # the reset failed: one turn from the prompt alone; else the first step ran
        assert traj.turns == (1 if env == "test-failing-reset" else 2)
    m = trajectory_metrics(batch, 2)
    assert m[f"agent/end_{reason}"] == 1.0 and m["agent/env_return"] == 0.0


def test_invalid_actions_are_counted_and_the_trajectory_goes_on_to_its_turn_limit(tiny_policy):
    """The corridor by its Gymnasium id through the user's file (the default action adapter,
    words `back` / `ahead`): the random model's turns are no valid action, so the env is never
    stepped, each turn gets an error observation naming the valid actions, and max_turns ends it."""
    import tests.plugins.user_gym_env  # noqa: F401 - registers UserCorridor-v0 with Gymnasium

    batch = _run(tiny_policy, _env_samples(1, env="UserCorridor-v0", max_turns=3))
    for traj in batch.trajectories:
        assert traj.termination == "max_turns" and traj.turns == 3
        bad = traj.env_errors.get("bad_action", 0)
        assert bad + traj.env_steps == 2 and len(traj.turn_rewards) == 2
    texts = [m for t in batch.trajectories for m in t.messages if m["role"] == "user"]
    assert any("ahead" in p.get("text", "") for m in texts for p in m["content"] if p["type"] == "text")
