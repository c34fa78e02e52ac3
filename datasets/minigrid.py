"""`minigrid`: act in a MiniGrid room from pixels (`mmrl train --task minigrid`).

Each sample is an episode of the `minigrid-goal` environment (`mmrl.environments.grid_goal`): a
walled 5x5 room (3x3 cells inside) with the goal and the agent placed by the episode's seed. The
prompt says what to do; the environment's reset adds the room's picture, each turn's action
word (`left`, `right`, `forward`) steps it, and each new picture is the next user turn. The
reward is MiniGrid's (1 - 0.9 x steps / max_steps on reaching the goal), through the `env`
verifier.

Held out by layout, not only by seed: a layout is (agent cell, direction, goal cell), 288 of
them; each belongs to one split by a hash (20% held out, 10% validation, 70% train), and a
split's samples are drawn only from its own layouts, so no held-out room is ever trained on or
warmed up on. The supervised cold start's demonstration is the shortest action sequence
(`mmrl.environments.expert_actions`, a breadth-first search), one word per turn.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import numpy as np

from mmrl.datasets.kinds import Drawn, register_kind

SIZE = 5
"""The room's side in cells, walls included (3x3 cells inside)."""
QUESTION = (
    "You are the red triangle in a room, seen from above and turned so that you face up. Reach the "
    "green square. Each turn, reply with one action: left or right (turn) or forward (one step)."
)
SPLIT_SHARES = (("heldout", 2), ("validation", 1), ("train", 7))
"""Tenths of the layouts per split (by `layout_split`)."""
MAX_TURNS = 8
"""The turn limit of an episode (the longest shortest path in the 3x3 interior is 6 actions)."""


def layout_split(layout: tuple[int, ...]) -> str:
    """The split a layout belongs to, by a hash of it."""
    tenth = zlib.crc32(repr(tuple(layout)).encode()) % 10
    for split, share in SPLIT_SHARES:
        if tenth < share:
            return split
        tenth -= share
    raise AssertionError("unreachable")


@functools.cache
def _env(tile_size: int) -> Any:
    from mmrl.environments.grid_goal import make_goal_env

    return make_goal_env(size=SIZE, tile_size=tile_size)


def episode(seed: int, tile_size: int) -> tuple[tuple[int, ...], list[str]]:
    """A seed's layout and its shortest action words."""
    from mmrl.environments import expert_actions
    from mmrl.environments.grid_goal import layout

    env = _env(tile_size)
    env.reset(seed=seed)
    return layout(env), expert_actions(env)


@register_kind("minigrid", "minigrid", stream=21, takes_split=True)
def _minigrid(rng: np.random.Generator, size: int, split: str) -> Drawn:
    tile = 16  # one cell per merged patch of the tiny Qwen2-VL (patch 8, merge 2): 80x80 pixels
    for _ in range(1000):
        seed = int(rng.integers(0, 2**31 - 1))
        room, actions = episode(seed, tile)
        if layout_split(room) == split:
            break
    else:
        raise RuntimeError(f"minigrid: no {split} layout in 1000 draws")
    spec = {"id": "minigrid-goal", "kwargs": {"size": SIZE, "tile_size": tile}, "seed": seed}
    return Drawn(
        image=None,
        question=QUESTION,
        ground_truth="",
        reference=actions[0],
        verifier="env",
        ability="agent",
        agent={"tools": [], "env": spec, "max_turns": MAX_TURNS, "max_images": MAX_TURNS, "max_tokens": 512},
        details={"env_demonstration": actions, "layout": list(room)},
    )


def random_policy_success(seeds: list[int], tile_size: int = 16, rng_seed: int = 0) -> tuple[int, int]:
    """The uniform random policy over `left`, `right`, `forward` on these episodes, each up to
    `MAX_TURNS` actions (a model's turn limit): (successes, episodes). The baseline RL is
    measured against on the same held-out seeds."""
    env = _env(tile_size)
    rng = np.random.default_rng(rng_seed)
    words = env.unwrapped.action_words
    names = ("left", "right", "forward")
    wins = 0
    for seed in seeds:
        env.reset(seed=seed)
        for _ in range(MAX_TURNS):
            _, reward, terminated, truncated, _ = env.step(words[names[int(rng.integers(3))]])
            if terminated or truncated:
                wins += int(terminated and reward > 0)
                break
    return wins, len(seeds)
