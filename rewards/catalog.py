"""The built-in reward models, and looking reward models up by name.

Importing this module imports every built-in model's module, which registers it
(`register_reward_model` in `mmrl.rewards.base`); the lookups below therefore always see them,
whatever else has been imported. Models of other packages register when their module is
imported. The arrows point one way: this module -> the model modules -> `base` (the registry).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Importing the modules registers their reward models (heavy imports happen in constructors).
from mmrl.rewards import aesthetic as _aesthetic  # noqa: F401
from mmrl.rewards import clip_score as _clip_score  # noqa: F401
from mmrl.rewards import geneval as _geneval  # noqa: F401
from mmrl.rewards import jpeg as _jpeg  # noqa: F401
from mmrl.rewards import ocr as _ocr  # noqa: F401
from mmrl.rewards import perceptual as _perceptual  # noqa: F401
from mmrl.rewards import vlm_judge as _vlm_judge  # noqa: F401
from mmrl.rewards.base import _REGISTRY, RewardModel
from mmrl.rewards.config import ModelRewardsConfig, accelerator_device, check_kwargs

if TYPE_CHECKING:
    import torch


def get_reward_model(name: str, **kwargs: Any) -> RewardModel:
    """A new instance of the reward model registered as `name`, built with `kwargs`."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward model {name!r} (known: {', '.join(sorted(_REGISTRY))})")
    model = _REGISTRY[name](**kwargs)
    if not model.name:
        model.name = name
    return model


def reward_model_names() -> list[str]:
    """The registered reward-model names, sorted."""
    return sorted(_REGISTRY)


def build_reward_models(
    cfg: ModelRewardsConfig, policy_device: str | torch.device = "cpu"
) -> dict[str, RewardModel]:
    """Build every configured reward model, by name, on its device (`placement.accelerator`;
    `auto`: `policy_device`), its arguments checked against its typed config (`check_kwargs`)."""
    models: dict[str, RewardModel] = {}
    for i, model_cfg in enumerate(cfg.models):
        where = f"reward.models[{i}]"
        if not model_cfg.name:
            raise ValueError(f"{where}.name: missing")
        if model_cfg.name in models:
            raise ValueError(f"{where}.name: {model_cfg.name!r} is configured twice")
        model_type = model_cfg.type or model_cfg.name
        kwargs = check_kwargs(model_type, model_cfg.kwargs, f"{where}.kwargs")
        device = model_cfg.device or accelerator_device(cfg.placement, policy_device)
        model = get_reward_model(model_type, device=device, **kwargs)
        model.name = model_cfg.name
        models[model_cfg.name] = model
    return models
