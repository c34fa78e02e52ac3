"""Model-based rewards (installed as `mmrl.rewards`).

A reward model scores a batch of images / prompts / responses: `model.score(images=...)` ->
`list[float]`; models are registered by name (`get_reward_model(name, **kwargs)`). Importing
this package registers the built-in models; heavy dependencies (open_clip, rapidocr) are
imported only when a model that needs them is built.
"""

# Importing the modules registers their reward models (heavy imports happen in constructors).
from mmrl.rewards import aesthetic as _aesthetic  # noqa: F401
from mmrl.rewards import clip_score as _clip_score  # noqa: F401
from mmrl.rewards import geneval as _geneval  # noqa: F401
from mmrl.rewards import jpeg as _jpeg  # noqa: F401
from mmrl.rewards import ocr as _ocr  # noqa: F401
from mmrl.rewards import perceptual as _perceptual  # noqa: F401
from mmrl.rewards import vlm_judge as _vlm_judge  # noqa: F401
from mmrl.rewards.base import (
    RewardModel,
    RewardModelError,
    RewardOutput,
    WeightsFileError,
    as_pil_images,
    get_reward_model,
    register_reward_model,
    reward_model_names,
)

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
