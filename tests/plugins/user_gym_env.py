"""A Gymnasium env as a user writes it in a file of their own (not mmrl's): plain Gymnasium 1.x,
registered with `gymnasium.register`, known to mmrl only once this module is imported (a plugin
module named by name) or named as "user_gym_env:UserCorridor-v0".

A corridor of `length` cells, the agent starting at the left end: "ahead" moves right, "back"
moves left; reaching the right end ends the episode with reward 1. Its observation is an RGB
picture (HxWx3 uint8; the agent red, the goal green), with `rgb_array` rendering of the same."""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

CELL = 8  # pixels a side per corridor cell


class UserCorridor(gymnasium.Env):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, length: int = 4, render_mode: str | None = None):
        if length < 2:
            raise ValueError(f"length must be at least 2, got {length}")
        self.length = length
        self.render_mode = render_mode
        self.action_space = spaces.Discrete(2)
        self.observation_space = spaces.Box(0, 255, shape=(CELL, CELL * length, 3), dtype=np.uint8)
        self.position = 0
        self.steps = 0

    def get_action_meanings(self) -> list[str]:
        return ["back", "ahead"]

    def _picture(self) -> np.ndarray:
        image = np.full((CELL, CELL * self.length, 3), 255, dtype=np.uint8)
        image[:, (self.length - 1) * CELL :, :] = (0, 200, 0)
        image[:, self.position * CELL : (self.position + 1) * CELL, :] = (220, 0, 0)
        return image

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        # The start is random (seeded): 0 or 1 cells in, so that seeds matter.
        self.position = int(self.np_random.integers(0, 2))
        self.steps = 0
        return self._picture(), {"position": self.position}

    def step(self, action: int):
        if not self.action_space.contains(action):
            raise ValueError(f"invalid action {action!r}")
        self.steps += 1
        self.position = max(0, self.position + (1 if action == 1 else -1))
        terminated = self.position >= self.length - 1
        return (
            self._picture(),
            (1.0 if terminated else 0.0),
            terminated,
            self.steps >= 20,
            {"position": self.position},
        )

    def render(self) -> np.ndarray:
        return self._picture()


gymnasium.register(id="UserCorridor-v0", entry_point=UserCorridor)
