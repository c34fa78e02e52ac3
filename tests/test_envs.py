"""Environments as a sample's trajectory: MiniGrid driven by words, Gymnasium envs (one of the
user's own file), the adapters, the failure cases (malformed action, crash, hang, huge
observations, unknown id) and exact replay from seed and actions."""

from __future__ import annotations

import importlib
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces
from PIL import Image

from mmrl.environments import (
    ACTION_WORDS,
    MINIGRID_TASKS,
    EnvSession,
    EnvStep,
    Observation,
    ToolLimits,
    UnknownEnvError,
    default_action,
    default_observation,
    env_known,
    env_names,
    expert_actions,
    register_env,
    reset_sessions,
    step_sessions,
    unregister_env,
)
from mmrl.types import EnvSpec

PLUGINS = Path(__file__).parent / "plugins"


def _act(word: str) -> str:
    """A model turn that names its action the way the prompt asks (some reasoning first)."""
    return f"The goal is ahead, so I pick {word}.\n<action>{word}</action>"


def _pixels(obs: Observation) -> list[bytes]:
    return [im.tobytes() + str(im.size).encode() for im in obs.images]


# ---------------------------------------------------------------------------------------------
# Test envs registered in mmrl (plain classes: the registry needs no Gymnasium subclass)


class Counter3:
    """Three actions (Discrete(3)); the observation is a str. Its step raises when
    `fail_at` steps were taken, or waits for `hang` (an Event) when it is given."""

    def __init__(self, fail_at: int | None = None, hang: threading.Event | None = None, huge: bool = False):
        self.action_space = spaces.Discrete(3)
        self.fail_at, self.hang, self.huge = fail_at, hang, huge
        self.count = 0
        self.stepped = 0
        self.closed = False

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict]:
        if self.fail_at == 0:
            raise RuntimeError("the reset exploded")
        self.count = 0
        return self._obs(), {}

    def _obs(self) -> Any:
        if self.huge:  # a wall of text and a giant image
            return {"text": "x" * 100_000, "image": np.zeros((3000, 2000, 3), dtype=np.uint8)}
        return f"count {self.count}"

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        if self.hang is not None:
            self.hang.wait(60)
        if self.fail_at is not None and self.stepped >= self.fail_at:
            raise RuntimeError("the physics exploded")
        self.stepped += 1
        self.count += int(action)
        return self._obs(), float(action), self.count >= 4, False, {"count": self.count}

    def close(self) -> None:
        self.closed = True


@pytest.fixture()
def hang_event():
    event = threading.Event()
    yield event
    event.set()  # lets the abandoned step's thread finish


@pytest.fixture()
def test_envs(hang_event):
    def many_images(env: Any, obs: Any, info: dict) -> Observation:
        return Observation(
            text="y" * 50_000, images=[Image.new("RGB", (1600, 1200), (i * 40, 0, 0)) for i in range(5)]
        )

    register_env("test-counter", Counter3)
    register_env("test-raising", lambda **kw: Counter3(fail_at=1, **kw))
    register_env("test-raising-reset", lambda: Counter3(fail_at=0))
    register_env("test-hanging", lambda: Counter3(hang=hang_event))
    register_env("test-huge", lambda: Counter3(huge=True))
    register_env("test-many-images", Counter3, observation=many_images)
    yield
    for name in ("counter", "raising", "raising-reset", "hanging", "huge", "many-images"):
        unregister_env(f"test-{name}")


# ---------------------------------------------------------------------------------------------
# MiniGrid


def test_minigrid_tasks_registered_and_known() -> None:
    assert set(MINIGRID_TASKS) <= set(env_names())
    assert all(env_known(name) and env_known(gym_id) for name, gym_id in MINIGRID_TASKS.items())


def test_minigrid_expert_reaches_goal_by_words() -> None:
    """The expert's words, written as model turns, drive each task to its goal with a positive
    reward on several seeds; on the fixed 5x5 room it is the known shortest path."""
    for name in (
        "minigrid-empty-5x5",
        "minigrid-empty-random-5x5",
        "minigrid-lavagap-5",
        "minigrid-fourrooms",
    ):
        for seed in range(3):
            sessions = [EnvSession(EnvSpec(id=name, seed=seed))]
            first = reset_sessions(sessions)[0]
            assert first.error is None and len(first.images) == 1
            plan = expert_actions(sessions[0].env)
            assert plan and set(plan) <= {"left", "right", "forward"}
            for n, word in enumerate(plan):
                step = step_sessions(sessions, [_act(word)], ToolLimits(timeout_s=30))[0]
                assert step.error is None, step.observation.text
                assert step.terminated == (n == len(plan) - 1), (name, seed, n)
            assert step.reward > 0 and sessions[0].episode_return == step.reward
            assert sessions[0].ended == "terminated" and sessions[0].steps == len(plan)
            sessions[0].close()
    room = EnvSession("minigrid-empty-5x5")
    room.reset(0)  # the agent at (1, 1) facing right, the goal at (3, 3)
    assert expert_actions(room.env) == ["forward", "forward", "right", "forward", "forward"]
    room.step(_act("forward"))
    assert expert_actions(room.env) == ["forward", "right", "forward", "forward"]  # from where it is now


def test_minigrid_lava_avoided_and_fatal() -> None:
    """The expert never walks into lava, and walking into it ends the episode with no reward."""
    session = EnvSession(EnvSpec(id="minigrid-lavagap-5", seed=0))
    session.reset()
    base = session.env.unwrapped
    lava = {
        (x, y)
        for x in range(base.width)
        for y in range(base.height)
        if (c := base.grid.get(x, y)) and c.type == "lava"
    }
    assert lava
    x, y, d = *base.agent_pos, base.agent_dir
    for word in expert_actions(session.env):  # replay the plan on paper: never on lava
        if word == "forward":
            x, y = {0: (x + 1, y), 1: (x, y + 1), 2: (x - 1, y), 3: (x, y - 1)}[d]
            assert (x, y) not in lava
        d = (d + (1 if word == "right" else -1 if word == "left" else 0)) % 4
    # Walk the agent into the lava: turn until it faces a lava cell next to a reachable cell.
    base.agent_pos, base.agent_dir = next(
        ((lx - dx, ly - dy), d)
        for lx, ly in sorted(lava)
        for d, (dx, dy) in enumerate([(1, 0), (0, 1), (-1, 0), (0, -1)])
        if base.grid.get(lx - dx, ly - dy) is None
    )
    step = session.step(_act("forward"))
    assert step.terminated and step.reward == 0.0 and step.error is None


def test_minigrid_observation_image_and_text() -> None:
    """The first observation: a small RGB image of the grid (tile size and view as asked), the
    mission and the action words; the same seed gives the same image, other seeds other ones."""
    session = EnvSession(EnvSpec(id="minigrid-empty-random-5x5"))
    obs = session.reset(0)
    image = obs.images[0]
    assert image.mode == "RGB" and image.size == (160, 160)
    assert obs.text.startswith("Mission: get to the green goal square.")
    assert all(word in obs.text for word in ACTION_WORDS)
    # Same seed, a new instance: the same pixels; a few other seeds: some other layout.
    again = EnvSession(EnvSpec(id="minigrid-empty-random-5x5")).reset(0)
    assert _pixels(again) == _pixels(obs) and again.text == obs.text
    others = [
        _pixels(o)
        for o in reset_sessions([EnvSession("minigrid-empty-random-5x5") for _ in range(4)], [1, 2, 3, 4])
    ]
    assert any(p != _pixels(obs) for p in others)
    # The image shows the grid in 32-pixel tiles: the goal cell (3, 3) green, walls grey, and
    # the agent's view shaded (highlight, MiniGrid's default) unless turned off.
    plain = EnvSession(EnvSpec(id="minigrid-empty-random-5x5", kwargs={"highlight": False})).reset(0)
    pixels = np.asarray(plain.images[0])
    assert _pixels(plain) != _pixels(obs)
    assert tuple(pixels[3 * 32 + 16, 3 * 32 + 16]) == (0, 255, 0)
    assert tuple(pixels[16, 16]) == (100, 100, 100)
    small = EnvSession(EnvSpec(id="minigrid-empty-5x5", kwargs={"tile_size": 8})).reset(0)
    assert small.images[0].size == (40, 40)
    pov = EnvSession(EnvSpec(id="minigrid-empty-5x5", kwargs={"view": "agent", "tile_size": 10})).reset(0)
    assert pov.images[0].size == (70, 70)  # the agent's 7x7 view
    assert EnvSession("minigrid-fourrooms").reset(0).images[0].size == (152, 152)  # 19 cells of 8
    with pytest.raises(ValueError, match="view must be"):
        EnvSession(EnvSpec(id="minigrid-empty-5x5", kwargs={"view": "sideways"}))


def test_minigrid_gymnasium_id_uses_minigrid_adapters() -> None:
    """MiniGrid's own Gymnasium id works as an env id too, seen and acted on the same way."""
    session = EnvSession(EnvSpec(id="MiniGrid-Empty-5x5-v0", seed=0))
    obs = session.reset()
    assert obs.text.startswith("Mission:") and obs.images[0].size == (160, 160)
    step = session.step("forward")  # the last word
    assert step.error is None and session.env.unwrapped.agent_pos == (2, 1)


# ---------------------------------------------------------------------------------------------
# Malformed actions


def test_malformed_action_is_counted_and_does_not_step() -> None:
    session = EnvSession(EnvSpec(id="minigrid-empty-5x5", kwargs={"actions": ["left", "right", "forward"]}))
    session.reset(0)
    base = session.env.unwrapped
    steps = step_sessions([session], ["<action>jump</action>"])
    bad = steps[0]
    assert bad.error == "bad_action" and bad.observation.error == "bad_action"
    assert "'jump'" in bad.observation.text and "left, right, forward" in bad.observation.text
    assert not bad.terminated and bad.reward == 0.0 and bad.action is None
    assert base.step_count == 0 and base.agent_pos == (1, 1) and session.actions == []
    assert session.errors["bad_action"] == 1 and not session.done
    # A word this env does not take, and no action at all: bad too, counted.
    assert session.step("<action>pickup</action>").error == "bad_action"
    empty = session.step("")
    assert empty.error == "bad_action" and "no action found" in empty.observation.text
    assert session.errors["bad_action"] == 3 and base.step_count == 0
    # The trajectory goes on: a good action steps the env (by word, any case, or by number).
    assert session.step("<ACTION> Forward </ACTION>").error is None and base.agent_pos == (2, 1)
    assert session.step("<action>1</action>").error is None and base.agent_dir == 1  # right
    assert session.actions == [2, 1] and base.step_count == 2


def test_default_action_reading() -> None:
    class Env:
        action_space = spaces.Discrete(4)

    env = Env()
    assert default_action(env, "I go with 3") == 3
    assert default_action(env, "<action>2</action> and then maybe 3") == 2
    assert default_action(env, "first <action>0</action>, no: <action>1") == 1  # unclosed last tag
    with pytest.raises(ValueError, match="an integer from 0 to 3"):
        default_action(env, "<action>4</action>")
    env.action_words = {"up": 0, "down": 1}  # names (a subset of the space)
    assert default_action(env, "<action>go down</action>") == 1  # the tag's last word
    assert default_action(env, "UP") == 0
    with pytest.raises(ValueError, match="valid actions: up, down"):
        default_action(env, "<action>3</action>")  # a number the names do not cover

    class Continuous:
        action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)

    box = Continuous()
    assert default_action(box, "push <action>[0.5, -0.25]</action>").tolist() == [0.5, -0.25]
    with pytest.raises(ValueError, match="expected 2 number"):
        default_action(box, "<action>0.5</action>")
    with pytest.raises(ValueError, match="out of bounds"):
        default_action(box, "<action>2, 0</action>")


def test_default_observation_reading() -> None:
    class Env:
        render_mode = None

    picture = np.zeros((6, 4, 3), dtype=np.uint8)
    picture[..., 0] = 255
    obs = default_observation(Env(), {"image": picture, "mission": "find it", "score": 0.123456789}, {})
    assert obs.text == "find it\nscore: 0.123457" and obs.images[0].size == (4, 6)
    assert obs.images[0].getpixel((0, 0)) == (255, 0, 0)
    vector = default_observation(Env(), np.array([0.5, 1.0, -2.0], dtype=np.float32), {})
    assert vector.text == "[ 0.5, 1. , -2. ]" and vector.images == []
    assert default_observation(Env(), 7, {}).text == "7"
    long = default_observation(Env(), np.arange(10_000.0), {})
    assert len(long.text) <= 300

    class Rendered:
        render_mode = "rgb_array"

        def render(self) -> np.ndarray:
            return np.full((3, 5, 3), 9, dtype=np.uint8)

    seen = default_observation(Rendered(), 3, {})
    assert seen.text == "3" and seen.images[0].size == (5, 3)


# ---------------------------------------------------------------------------------------------
# Failures: crash, hang, huge observations, unknown ids


def test_env_that_raises_ends_its_trajectory(test_envs) -> None:
    crash, fine = EnvSession("test-raising"), EnvSession("test-counter")
    reset_sessions([crash, fine], [0, 0])
    first = step_sessions([crash, fine], ["1", "1"])
    assert [s.error for s in first] == [None, None]
    second = step_sessions([crash, fine], ["1", "<action>2</action>"])
    assert second[0].error == "env_error" and second[0].terminated
    assert "RuntimeError: the physics exploded" in second[0].observation.text
    assert crash.done and crash.ended == "env_error" and crash.errors["env_error"] == 1
    assert second[1].error is None and second[1].observation.text == "count 3" and second[1].reward == 2.0
    # The ended trajectory is not stepped again; the other goes on to its own end.
    third = step_sessions([crash, fine], ["1", "1"])
    assert third[0].error == "episode_over" and crash.env.stepped == 1
    assert third[1].terminated and third[1].error is None and fine.ended == "terminated"
    # A reset that raises: an error observation, the session done.
    broken = EnvSession("test-raising-reset")
    obs = reset_sessions([broken])[0]
    assert obs.error == "env_error" and "the reset exploded" in obs.text and broken.done
    for session in (crash, fine, broken):
        session.close()
    assert fine.env.closed


def test_env_that_hangs_times_out(test_envs) -> None:
    hung, fine = EnvSession("test-hanging"), EnvSession("test-counter")
    reset_sessions([hung, fine], [0, 0])
    steps = step_sessions([hung, fine], ["1", "2"], ToolLimits(timeout_s=0.5))
    assert steps[0].error == "env_timeout" and steps[0].terminated
    assert "0.5 s" in steps[0].observation.text
    assert hung.done and hung.abandoned and hung.ended == "env_timeout" and hung.errors["env_timeout"] == 1
    assert steps[1].error is None and steps[1].observation.text == "count 2"
    # Never touched again: no step, no reset, and close leaves it alone.
    again = step_sessions([hung], ["1"], ToolLimits(timeout_s=0.5))[0]
    assert again.error == "env_timeout" and again.terminated
    assert reset_sessions([hung], [1], ToolLimits(timeout_s=0.5))[0].error == "env_timeout"
    hung.close()
    assert not hung.env.closed


def test_huge_observations_are_capped(test_envs) -> None:
    limits = ToolLimits(max_text_chars=500, max_image_pixels=160 * 160, max_images=2)
    huge = EnvSession("test-huge")
    first = reset_sessions([huge], [0], limits)[0]
    assert first.error == "text_too_long" and len(first.text) <= 500
    assert len(first.images) == 1 and first.images[0].width * first.images[0].height <= 160 * 160
    assert first.images[0].size[1] > first.images[0].size[0]  # aspect kept (3000 tall, 2000 wide)
    step = step_sessions([huge], ["1"], limits)[0]
    assert step.error == "text_too_long" and not step.terminated and huge.errors["text_too_long"] == 2
    assert len(step.observation.text) <= 500 and "downscaled from 2000x3000" in step.observation.text
    many = EnvSession("test-many-images")
    many.reset(0)
    capped = step_sessions([many], ["2"], limits)[0]
    assert len(capped.observation.images) == 2 and "kept the first 2 of 5 images" in capped.observation.text
    assert all(im.width * im.height <= 160 * 160 for im in capped.observation.images)
    assert capped.observation.images[1].getpixel((0, 0)) == (40, 0, 0)  # the first two, in order
    assert not many.done and step_sessions([many], ["2"], limits)[0].reward == 2.0  # it goes on


def test_unknown_env_id_is_named() -> None:
    with pytest.raises(UnknownEnvError) as info:
        EnvSession(EnvSpec(id="minigrid-emtpy-5x5"))
    message = str(info.value)
    assert "'minigrid-emtpy-5x5'" in message and "minigrid-fourrooms" in message
    assert "Did you mean: minigrid-empty-5x5" in message
    assert not env_known("minigrid-emtpy-5x5") and env_known("CartPole-v1")
    with pytest.raises(UnknownEnvError, match="importing module 'no_such_module_xyz' failed"):
        EnvSession("no_such_module_xyz:Thing-v0")


def test_register_env_rejects_a_taken_name(test_envs) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_env("test-counter", Counter3)
    with pytest.raises(TypeError, match="making environment 'test-counter' with {'bogus': 1}"):
        EnvSession(EnvSpec(id="test-counter", kwargs={"bogus": 1}))
    register_env("test-counter", lambda: Counter3(fail_at=0), replace=True)
    assert EnvSession("test-counter").reset(0).error == "env_error"


# ---------------------------------------------------------------------------------------------
# A Gymnasium env from a user's own file


def test_user_file_gymnasium_env(monkeypatch) -> None:
    """A Gymnasium env registered with `gymnasium.register` in a user's module, imported as a
    plugin by name, runs through `EnvSession` with the default adapters."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    assert env_known("user_gym_env:UserCorridor-v0")  # imports the module by name
    importlib.import_module("user_gym_env")
    assert env_known("UserCorridor-v0") and env_known("UserCorridor")  # the latest version
    session = EnvSession(EnvSpec(id="UserCorridor-v0", kwargs={"length": 4}, seed=0))
    obs = session.reset()
    assert obs.images[0].size == (32, 8) and obs.text == ""
    start = session.env.unwrapped.position
    bad = session.step("<action>sideways</action>")
    assert bad.error == "bad_action" and "back, ahead" in bad.observation.text
    assert session.step("<action>back</action>").error is None  # by name (get_action_meanings)
    steps = []
    while not session.done:
        steps.append(step_sessions([session], ["Moving on: <action>1</action>"])[0])  # by number
    assert steps[-1].terminated and steps[-1].reward == 1.0 and session.episode_return == 1.0
    assert len(steps) == 3 and session.actions == [0, 1, 1, 1]
    assert start in (0, 1) and steps[-1].info == {"position": 3}
    # The observation is the env's own picture: the agent (red) on the last, green, cell.
    assert steps[-1].observation.images[0].getpixel((28, 4)) == (220, 0, 0)
    session.close()


# ---------------------------------------------------------------------------------------------
# Exact replay from seed and actions


def test_replay_equals_the_original() -> None:
    spec = EnvSpec(id="minigrid-empty-random-6x6", kwargs={"tile_size": 16})
    original = EnvSession(spec)
    original.reset(7)
    words = ["left", "forward", "jump", "right", "forward", "left"]
    last = None
    for word in words:
        step = original.step(_act(word))
        if step.error is None:
            last = step.observation
    assert original.errors["bad_action"] == 1 and original.steps == 5
    history = json.loads(json.dumps(original.history()))  # JSON-able, as a checkpoint keeps it
    replayed, obs = EnvSession.replay(spec, **history)
    assert _pixels(obs) == _pixels(last) and obs.text == last.text
    assert replayed.actions == original.actions and replayed.rewards == original.rewards
    assert replayed.seed == 7
    # The next observation of each, for the same next turns, is the same, to the goal.
    for word in expert_actions(original.env):
        a, b = step_sessions([original, replayed], [_act(word), _act(word)])
        assert _pixels(a.observation) == _pixels(b.observation) and a.observation.text == b.observation.text
        assert (a.reward, a.terminated, a.truncated) == (b.reward, b.terminated, b.truncated)
    assert a.terminated and a.reward > 0
    base_a, base_b = original.env.unwrapped, replayed.env.unwrapped
    assert base_a.agent_pos == base_b.agent_pos and base_a.step_count == base_b.step_count


def test_replay_rejects_a_history_that_does_not_fit() -> None:
    session = EnvSession("minigrid-empty-5x5")
    session.reset(0)
    for word in expert_actions(session.env):
        session.step(word)
    with pytest.raises(RuntimeError, match="ended"):
        EnvSession.replay("minigrid-empty-5x5", 0, [*session.actions, 2])


def test_step_sessions_checks_its_arguments() -> None:
    session = EnvSession("minigrid-empty-5x5")
    session.reset(0)
    with pytest.raises(ValueError, match="1 sessions but 2 texts"):
        step_sessions([session], ["left", "right"])
    with pytest.raises(ValueError, match="more than once"):
        step_sessions([session, session], ["left", "right"])
    assert isinstance(step_sessions([], []), list)
    assert isinstance(session.step("left"), EnvStep)
