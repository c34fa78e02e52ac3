"""Model-based rewards (installed as `mmrl.rewards`).

A reward model scores a batch of images / prompts / responses: `model.score(images=...)` ->
`list[float]`; models are registered by name (`get_reward_model(name, **kwargs)`). Looking a
model up registers the built-in ones first (`mmrl.rewards.catalog`); heavy dependencies
(open_clip, rapidocr) are imported only when a model that needs them is built.

Importing this package imports no torch: `mmrl.config` imports `mmrl.rewards.config`, and a
config error or `--help` must stay instant. The names below load their modules on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmrl.rewards.base import (
        RewardInputs,
        RewardModel,
        RewardModelError,
        RewardOutput,
        WeightsFileError,
        as_pil_images,
        register_reward_model,
    )
    from mmrl.rewards.catalog import get_reward_model, reward_model_names

__all__ = [
    "RewardInputs",
    "RewardModel",
    "RewardModelError",
    "RewardOutput",
    "WeightsFileError",
    "as_pil_images",
    "get_reward_model",
    "register_reward_model",
    "reward_model_names",
]

_LOOKUPS = ("get_reward_model", "reward_model_names")


def __getattr__(name: str) -> Any:
    if name in _LOOKUPS:
        from mmrl.rewards import catalog as module
    elif name in __all__:
        from mmrl.rewards import base as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
