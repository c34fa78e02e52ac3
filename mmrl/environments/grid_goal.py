"""`minigrid-goal`: a MiniGrid room with a random goal and a random start, for `--task minigrid`.

A real MiniGrid env (`minigrid.minigrid_env.MiniGridEnv`): a walled `size` x `size` room, the
goal (green) and the agent (the red triangle, pointing where it faces) placed at random by the
reset's seed, so that a layout is a seed's (agent cell, direction, goal cell), and held-out
layouts can be kept out of training (`datasets/minigrid.py`). MiniGrid's reward: 1 - 0.9 x
steps / max_steps on reaching the goal, else 0.

The model acts with the words `left`, `right`, `forward` and sees the room centred on itself and
turned so that it faces up (`view="ego"`; "full", from above, and MiniGrid's 7x7 "agent" view,
which does not see behind, are options), rendered at `tile_size` pixels a cell: the reset's picture follows the prompt's instructions, and each
step's picture alone is the next user turn (no repeated text: with byte-level tiny tokenizers a
sentence per turn would be most of the sequence).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from PIL import Image

from mmrl.environments.envs import register_env
from mmrl.environments.minigrid_env import _import_minigrid, make_minigrid
from mmrl.environments.tools import Observation

GOAL_ACTIONS = ("left", "right", "forward")
GYM_ID = "mmrl/MiniGrid-RandomGoal-v0"
MISSION = "get to the green goal square"


@functools.cache
def _register_gym() -> None:
    """Register the env with Gymnasium (once): a MiniGridEnv subclass, built on first use."""
    _import_minigrid()
    import gymnasium
    from minigrid.core.grid import Grid
    from minigrid.core.mission import MissionSpace
    from minigrid.core.world_object import Goal
    from minigrid.minigrid_env import MiniGridEnv

    class RandomGoalEnv(MiniGridEnv):
        def __init__(self, size: int = 6, max_steps: int | None = None, **kwargs: Any):
            super().__init__(
                mission_space=MissionSpace(mission_func=lambda: MISSION),
                grid_size=size,
                max_steps=max_steps if max_steps is not None else 4 * size,
                see_through_walls=True,
                **kwargs,
            )

        def _gen_grid(self, width: int, height: int) -> None:
            self.grid = Grid(width, height)
            self.grid.wall_rect(0, 0, width, height)
            self.place_obj(Goal())
            self.place_agent()
            self.mission = MISSION

    gymnasium.register(id=GYM_ID, entry_point=RandomGoalEnv)


def make_goal_env(size: int = 6, tile_size: int = 11, view: str = "ego", max_steps: int | None = None) -> Any:
    """The goal room, acted on with `GOAL_ACTIONS`, rendered at `tile_size` pixels a cell
    without the agent-view shading: centred on the agent and turned so that it faces up
    (`view="ego"`: "forward" is always up the picture from the middle, the goal's place
    relative to the agent is all there is to read; `goal_observation`), from above as MiniGrid
    draws it (`"full"`), or MiniGrid's own 7x7 agent view (`"agent"`: the cells behind the
    agent are not seen)."""
    if view not in ("ego", "full", "agent"):
        raise ValueError(f"view must be 'ego', 'full' or 'agent', got {view!r}")
    _register_gym()
    extra = {} if max_steps is None else {"max_steps": max_steps}
    env = make_minigrid(
        GYM_ID,
        tile_size=tile_size,
        view="agent" if view == "agent" else "full",
        highlight=False,
        actions=GOAL_ACTIONS,
        size=size,
        **extra,
    )
    env.unwrapped.mmrl_view = view
    return env


def goal_observation(env: Any, obs: Any, info: dict[str, Any]) -> Observation:
    """The room as a picture, no text. `ego`: centred on the agent and turned so that it faces
    up (MiniGrid's directions 0-3 are right, down, left, up, so (direction + 1) quarter turns
    counter-clockwise bring it up), cut to the (2 x size - 5)-cell square around it that holds
    every inside cell whatever the agent's place: each cell is where it is relative to the agent."""
    base = env.unwrapped
    frame = base.get_frame(base.highlight, base.tile_size, base.agent_pov)
    if getattr(base, "mmrl_view", "full") == "ego":
        tile, (w, h) = base.tile_size, (base.width, base.height)
        ax, ay = int(base.agent_pos[0]), int(base.agent_pos[1])
        canvas = np.zeros(((2 * h - 1) * tile, (2 * w - 1) * tile, 3), dtype=frame.dtype)
        top, left = (h - 1 - ay) * tile, (w - 1 - ax) * tile
        canvas[top : top + h * tile, left : left + w * tile] = frame
        r = w - 3  # every inside cell is at most this many cells from the agent
        canvas = canvas[(h - 1 - r) * tile : (h + r) * tile, (w - 1 - r) * tile : (w + r) * tile]
        frame = np.ascontiguousarray(np.rot90(canvas, k=(int(base.agent_dir) + 1) % 4))
    return Observation(text="", images=[Image.fromarray(frame).convert("RGB")])


def layout(env: Any) -> tuple[int, int, int, int, int]:
    """A reset env's layout: (agent x, agent y, direction, goal x, goal y)."""
    base = env.unwrapped
    goal = next(
        (x, y)
        for x in range(base.grid.width)
        for y in range(base.grid.height)
        if (cell := base.grid.get(x, y)) is not None and cell.type == "goal"
    )
    return (int(base.agent_pos[0]), int(base.agent_pos[1]), int(base.agent_dir), goal[0], goal[1])


register_env("minigrid-goal", make_goal_env, observation=goal_observation, replace=True)
