"""TRL-style environment classes (`environment_factory`) through the tool loop
(`mmrl.environments.trl_env`).

The random tiny model never writes a call by itself: a call format of this file reads every turn
as the same three calls (a guess of 1, the tries so far, a guess of -1 that raises), so the
methods really run on each trajectory's own instance."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from PIL import Image

from mmrl.config import AgentConfig
from mmrl.environments import (
    ParsedTurn,
    ToolCall,
    ToolContext,
    ToolLimits,
    register_call_format,
    register_environment_class,
    run_tool_batches,
    sample_row,
    tool_schemas,
)
from mmrl.environments.executor import release_all
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.rollout.multiturn import generate_trajectories, shape_results
from mmrl.types import AgentSpec, RewardSpec, Sample, VerifierResult
from tests.conftest import bias_stop_token


class GuessGame:
    """A number to guess; the reward counts the right guesses."""

    made: list[GuessGame] = []

    def __init__(self):
        GuessGame.made.append(self)
        self.rows: list[dict] = []
        self.guesses: list[int] = []

    def reset(self, **row):
        self.rows.append(row)
        self.target = int(row["target"])
        self.guesses = []
        return "Guess a number."

    def guess(self, n: int) -> str:
        """Guess the number.

        Args:
            n: The guess, 0 or more.
        """
        if n < 0:
            raise ValueError("guesses are not negative")
        self.guesses.append(n)
        return "right" if n == self.target else ("higher" if n < self.target else "lower")

    def tries(self) -> str:
        """How many guesses were made."""
        return f"tries: {len(self.guesses)}"

    def get_reward(self) -> float:
        return float(self.guesses.count(self.target))

    def _hidden(self) -> None:  # private: not a tool
        pass


@register_call_format("trl_env_guesses")
def _guesses(text: str) -> ParsedTurn:
    calls = [
        ToolCall("trl_guess", {"n": 1}, text),
        ToolCall("trl_tries", {}, text),
        ToolCall("trl_guess", {"n": -1}, text),
    ]
    return ParsedTurn(calls=calls, errors=[], error_kinds=[])


@pytest.fixture()
def game():
    env = register_environment_class(GuessGame, prefix="trl_", replace=True)
    GuessGame.made.clear()  # (the probe registration made)
    yield env
    env.unregister()


@pytest.fixture()
def tiny_policy(tiny_policy):
    """The random tiny Qwen2-VL with its stop token likely (as in test_multiturn), so that its
    turns end within a few tokens."""
    return bias_stop_token(tiny_policy)


def _samples(tools: list[str]) -> list[Sample]:
    return [
        Sample(
            data_source="guess", prompt=[{"role": "user", "content": f"Guess a number, {i}."}], images=[],
            ability="agent", reward_model=RewardSpec(ground_truth="1", verifier="math"),
            extra_info={"id": f"g{i}", "target": i + 1}, agent=AgentSpec(tools=tools),
        )
        for i in range(2)
    ]  # fmt: skip


def test_schemas_come_from_the_methods_and_skip_self_reset_reward_and_private(game):
    assert game.tool_names == ["trl_guess", "trl_tries"]
    guess, tries = tool_schemas(game.tool_names)
    assert guess["function"]["name"] == "trl_guess"
    assert guess["function"]["description"] == "Guess the number."
    assert guess["function"]["parameters"]["properties"] == {
        "n": {"type": "integer", "description": "The guess, 0 or more."}
    }
    assert guess["function"]["parameters"]["required"] == ["n"]
    assert tries["function"]["parameters"]["properties"] == {}
    with pytest.raises(ValueError, match="already registered"):
        register_environment_class(GuessGame, prefix="trl_")


def test_a_trajectory_runs_on_its_own_instance_reset_with_its_row_and_rewarded_at_its_end(
    tiny_policy, game, monkeypatch
):
    samples = _samples(game.tool_names)
    by_id = {s.id: s for s in samples}

    processor = tiny_policy.processor
    shown: list = []
    template = processor.apply_chat_template

    def spy(*args, **kwargs):
        shown.append(kwargs.get("tools"))
        return template(*args, **kwargs)

    monkeypatch.setattr(processor, "apply_chat_template", spy)
    engine = HFRolloutEngine.from_policy(tiny_policy)
    agent = AgentConfig(call_format="trl_env_guesses", max_turns=3, max_tokens=400, tool_reward_weight=0.5)
    batch = generate_trajectories(engine, samples, SamplingParams(n=2, max_new_tokens=8), agent)

    # the methods' schemas reached the chat template
    assert shown and all(tools == tool_schemas(game.tool_names) for tools in shown)
    # one instance per trajectory, reset once with its sample's extra_info and prompt
    assert len(GuessGame.made) == len(batch.trajectories) == 4
    for instance in GuessGame.made:
        assert len(instance.rows) == 1
        row = instance.rows[0]
        sample = by_id[row["id"]]
        assert row == {**sample.extra_info, "prompt": sample.prompt}
    assert Counter(instance.rows[0]["id"] for instance in GuessGame.made) == {"g0": 2, "g1": 2}
    for r, traj in enumerate(batch.trajectories):
        assert traj.turns == 3 and traj.termination == "max_turns"  # turns 1 and 2 ran their calls
        assert traj.tool_calls == 6
        assert traj.tool_errors == {"tool_error": 2}  # guess(-1) raised, each time counted
        target = batch.samples[r].extra_info["target"]
        assert traj.tool_reward == (2.0 if target == 1 else 0.0)  # get_reward() at its end
        observed = [m for m in traj.messages if m["role"] != "assistant"]
        text = repr(observed)
        assert "tries: 1" in text and "tries: 2" in text and "tries: 3" not in text
        assert "guesses are not negative" in text
    # each instance saw its own trajectory's calls only
    assert all(instance.guesses == [1, 1] for instance in GuessGame.made)

    results = [VerifierResult(score=0.0, components={"accuracy": 0.0})] * len(batch.trajectories)
    shaped = shape_results(results, batch.trajectories, agent)
    for traj, result in zip(batch.trajectories, shaped):
        assert result.components["tool_reward"] == 0.5 * traj.tool_reward
        assert result.score == 0.5 * traj.tool_reward


def test_direct_calls_async_methods_images_and_release(game):
    """Without the rollout: the executor's calls on two contexts, an async environment whose
    method returns an image, and release returning the last reward."""

    class Painter:
        def reset(self, **row):
            self.colour = row["colour"]
            self.painted = 0

        async def paint(self, side: int) -> Image.Image:
            """Paint a square.

            Args:
                side: Its side in pixels.
            """
            self.painted += 1
            return Image.new("RGB", (side, side), self.colour)

        async def get_reward(self) -> float:
            return 0.25 * self.painted

    painter = register_environment_class(Painter, prefix="trl_", replace=True)
    try:
        sample = _samples(painter.tool_names)[0]
        red_sample = Sample(**{**sample.__dict__, "extra_info": {"id": "a", "colour": "red"}})
        red = ToolContext(images=[], sample_id="a", sample=red_sample)
        blue = ToolContext(images=[], sample_id="b")
        blue_row = {"id": "b", "colour": "blue"}
        painter.row = lambda ctx: blue_row if ctx.sample is None else sample_row(ctx)
        call = ToolCall("trl_paint", {"side": 3}, "")
        [r1, b1] = run_tool_batches([([call, call], red), ([call], blue)], ToolLimits())
        assert [o.error for o in r1 + b1] == [None, None, None]
        assert r1[0].images[0].getpixel((0, 0)) == (255, 0, 0)
        assert b1[0].images[0].getpixel((0, 0)) == (0, 0, 255)
        assert [o.reward for o in r1] == [0.25, 0.25] and b1[0].reward == 0.25
        bad = run_tool_batches([([ToolCall("trl_paint", {"side": "x"}, "")], red)], ToolLimits())[0][0]
        assert bad.error == "bad_arguments"
        assert asyncio.run(release_all(red)) == {"trl_paint": 0.5}
        assert not red.state and asyncio.run(release_all(red)) == {}
    finally:
        painter.unregister()
    assert sample_row(ToolContext(images=[], sample_id="z")) == {"id": "z"}


def test_a_failing_reset_is_an_error_observation_and_is_retried():
    class Flaky:
        resets = 0

        def reset(self, **row):
            Flaky.resets += 1
            if Flaky.resets == 1:
                raise RuntimeError("not ready")

        def ping(self) -> str:
            """Ping."""
            return "pong"

    env = register_environment_class(Flaky, prefix="trl_flaky_")
    try:
        ctx = ToolContext(images=[], sample_id="f")
        call = ToolCall("trl_flaky_ping", {}, "")
        [[first, second]] = run_tool_batches([([call, call], ctx)], ToolLimits())
        assert first.error == "tool_error" and "not ready" in first.text
        assert second.error is None and second.text == "pong" and second.reward == 0.0
        assert asyncio.run(release_all(ctx)) == {}  # no get_reward: no release reward
    finally:
        env.unregister()
