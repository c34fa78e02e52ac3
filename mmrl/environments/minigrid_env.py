"""MiniGrid (the `minigrid` package) as built-in environments, acted on with words, seen as RGB.

    session = EnvSession(EnvSpec(id="minigrid-empty-random-5x5", seed=3))
    first = session.reset()        # a 160x160 image of the grid; "Mission: ...\\nActions: ..."
    session.step("<action>forward</action>")

The tasks (`MINIGRID_TASKS`, registered on import under short names) are the small ones a tiny
model can learn: empty rooms, lava gaps, one crossing, four rooms. Their kwargs (`EnvSpec.kwargs`):

- `tile_size`: pixels per grid cell; None: the largest (at most 32) that keeps the image at most
  `MAX_SIDE` (160) pixels a side (32 for a 5x5 grid: 160x160).
- `view`: "full" (the whole grid, from above) or "agent" (the agent's own 7x7 view, rotated).
- `highlight`: shade the cells the agent sees (MiniGrid's default, True).
- `actions`: the action words the model may use (default: all seven, `ACTION_WORDS`).
- anything else goes to the MiniGrid env (`max_steps`, `agent_view_size`, ...).

The observation text is the mission and the action words; the actions are words (`left`,
`right`, `forward`, `pickup`, `drop`, `toggle`, `done`), read by `default_action` (inside the last
`<action>...</action>`, else the last word). MiniGrid's Gymnasium ids ("MiniGrid-Empty-5x5-v0")
work as env ids too, with the same adapters. `expert_actions(env)` is the shortest way to the goal
(for demonstrations).

`minigrid` (with pygame) is imported on first use, not on import of `mmrl.environments`.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from typing import Any

from PIL import Image

from mmrl.environments.envs import action_words, register_env, register_gym_family
from mmrl.environments.tools import Observation

ACTION_WORDS = ("left", "right", "forward", "pickup", "drop", "toggle", "done")
"""MiniGrid's actions (its `Actions` enum's names), in the enum's order."""

MAX_SIDE = 160
"""The default tile size keeps a full-grid image at most this many pixels a side."""

MINIGRID_TASKS: dict[str, str] = {
    "minigrid-empty-5x5": "MiniGrid-Empty-5x5-v0",
    "minigrid-empty-random-5x5": "MiniGrid-Empty-Random-5x5-v0",
    "minigrid-empty-6x6": "MiniGrid-Empty-6x6-v0",
    "minigrid-empty-random-6x6": "MiniGrid-Empty-Random-6x6-v0",
    "minigrid-empty-8x8": "MiniGrid-Empty-8x8-v0",
    "minigrid-lavagap-5": "MiniGrid-LavaGapS5-v0",
    "minigrid-lavagap-6": "MiniGrid-LavaGapS6-v0",
    "minigrid-lavagap-7": "MiniGrid-LavaGapS7-v0",
    "minigrid-simplecrossing-9": "MiniGrid-SimpleCrossingS9N1-v0",
    "minigrid-lavacrossing-9": "MiniGrid-LavaCrossingS9N1-v0",
    "minigrid-fourrooms": "MiniGrid-FourRooms-v0",
}
"""mmrl's MiniGrid task names -> MiniGrid's Gymnasium ids (small grids first)."""


@functools.cache
def _import_minigrid() -> Any:
    """Import minigrid (registering its Gymnasium ids), without pygame's banner on stdout."""
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    import minigrid

    return minigrid


def _default_tile(base: Any, view: str) -> int:
    side = base.agent_view_size if view == "agent" else max(base.width, base.height)
    return max(1, min(32, MAX_SIDE // side))


def make_minigrid(
    gym_id: str,
    *,
    tile_size: int | None = None,
    view: str = "full",
    highlight: bool = True,
    actions: list[str] | tuple[str, ...] | None = None,
    **kwargs: Any,
) -> Any:
    """A MiniGrid env (`gymnasium.make(gym_id, render_mode="rgb_array", ...)`) set up for mmrl:
    rendered at `tile_size` pixels a cell ("full" grid or the "agent"'s view), acting on the
    action words `actions` (default all of `ACTION_WORDS`). `kwargs` go to the MiniGrid env."""
    if view not in ("full", "agent"):
        raise ValueError(f"view must be 'full' or 'agent', got {view!r}")
    words = list(ACTION_WORDS if actions is None else actions)
    unknown = [w for w in words if w not in ACTION_WORDS]
    if unknown or not words:
        raise ValueError(
            f"unknown MiniGrid action word(s) {unknown}; the words are: {', '.join(ACTION_WORDS)}"
        )
    if tile_size is not None and (not isinstance(tile_size, int) or tile_size < 1):
        raise ValueError(f"tile_size must be a positive integer, got {tile_size!r}")
    _import_minigrid()
    import gymnasium
    from minigrid.core.actions import Actions

    env = gymnasium.make(
        gym_id, render_mode="rgb_array", agent_pov=view == "agent", highlight=highlight, **kwargs
    )
    base = env.unwrapped
    base.tile_size = tile_size if tile_size is not None else _default_tile(base, view)
    base.action_words = {word: int(Actions[word]) for word in words}  # read by `action_words`
    return env


def minigrid_observation(env: Any, obs: Any, info: dict[str, Any]) -> Observation:
    """A MiniGrid observation as a user turn: the grid rendered as RGB (the env's tile size and
    view), and the text "Mission: <mission>.\\nActions: <the action words>."."""
    base = env.unwrapped
    frame = base.get_frame(base.highlight, base.tile_size, base.agent_pov)
    mission = obs.get("mission") if isinstance(obs, dict) else None
    mission = str(mission or base.mission).rstrip(".")
    text = f"Mission: {mission}.\nActions: {', '.join(action_words(env))}."
    return Observation(text=text, images=[Image.fromarray(frame).convert("RGB")])


def expert_actions(env: Any) -> list[str]:
    """The shortest action words from the env's current state to its goal: a breadth-first
    search over (position, direction) on the current grid, through empty cells and cells the
    agent may walk on (open doors, the goal), never lava. ValueError if no goal is reachable so
    (e.g. behind a closed door) or the env's words lack left, right or forward."""
    _import_minigrid()
    from minigrid.core.constants import DIR_TO_VEC

    base = env.unwrapped
    words = action_words(env)
    missing = [w for w in ("left", "right", "forward") if w not in words]
    if missing:
        raise ValueError(f"the expert needs the actions {missing}, which this env does not take")
    grid = base.grid
    start = (int(base.agent_pos[0]), int(base.agent_pos[1]), int(base.agent_dir))
    parents: dict[tuple[int, int, int], tuple[tuple[int, int, int], str] | None] = {start: None}
    queue = deque([start])

    def path_to(state: tuple[int, int, int]) -> list[str]:
        out: list[str] = []
        while parents[state] is not None:
            state, word = parents[state]  # type: ignore[misc]
            out.append(word)
        return out[::-1]

    while queue:
        state = queue.popleft()
        x, y, d = state
        dx, dy = (int(v) for v in DIR_TO_VEC[d])
        fx, fy = x + dx, y + dy
        moves: list[tuple[str, tuple[int, int, int]]] = []
        if 0 <= fx < grid.width and 0 <= fy < grid.height:
            cell = grid.get(fx, fy)
            if cell is not None and cell.type == "goal":
                return [*path_to(state), "forward"]
            if cell is None or (cell.can_overlap() and cell.type != "lava"):
                moves.append(("forward", (fx, fy, d)))
        moves += [("left", (x, y, (d - 1) % 4)), ("right", (x, y, (d + 1) % 4))]
        for word, nxt in moves:
            if nxt not in parents:
                parents[nxt] = (state, word)
                queue.append(nxt)
    raise ValueError(f"no goal reachable from position {start[:2]}, direction {start[2]} on this grid")


for _name, _gym_id in MINIGRID_TASKS.items():
    register_env(
        _name, functools.partial(make_minigrid, _gym_id), observation=minigrid_observation, replace=True
    )
for _prefix in ("MiniGrid-", "BabyAI-"):
    register_gym_family(_prefix, observation=minigrid_observation, load=_import_minigrid)
