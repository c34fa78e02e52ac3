"""Model-based rewards (installed as `mmrl.rewards`).

A reward model scores a batch of images / prompts / responses: `model.score(images=...)` ->
`list[float]`; models are registered by name (`get_reward_model(name, **kwargs)`). The built-in
models register themselves when the registry is first asked (`get_reward_model`,
`reward_model_names`); heavy dependencies (open_clip, rapidocr) are imported only when a model
that needs them is built.

Importing this package imports nothing heavy: `mmrl.rewards.config` (the config dataclasses the
run config holds) loads without torch, so `import mmrl.config` stays light. The names below are
loaded from `mmrl.rewards.base` on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

BUILTIN_MODULES = ("aesthetic", "clip_score", "geneval", "jpeg", "ocr", "perceptual", "vlm_judge")
"""Modules whose import registers the built-in reward models."""

__all__ = [
    "RewardModel",
    "RewardModelError",
    "RewardOutput",
    "WeightsFileError",
    "as_pil_images",
    "get_reward_model",
    "register_reward_model",
    "reward_model_names",
]


def load_builtins() -> None:
    """Import the built-in reward models (each registers itself; idempotent)."""
    for name in BUILTIN_MODULES:
        importlib.import_module(f"mmrl.rewards.{name}")


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mmrl.rewards import base

        load_builtins()
        return getattr(base, name)
    raise AttributeError(f"module 'mmrl.rewards' has no attribute {name!r}")
