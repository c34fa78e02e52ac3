"""Configuration of model-based rewards: which models to build, where, and how to combine them.

`ModelRewardsConfig` is meant to sit in the run config (e.g. `reward.models`); each
`RewardModelConfig` names an instance (what samples ask for), its registered type, and its
constructor arguments, which are checked against the typed config of that type (`AestheticConfig`,
... below: one field per constructor argument, each documented) so that a misspelt key fails
with the key named. `build_reward_models(cfg)` (`mmrl.rewards.catalog`) builds them all.

This module imports no torch (torch and the models are imported where they are built), so
that `mmrl.config`, which holds `ModelRewardsConfig`, stays light.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class ClipConfig:
    """The CLIP model a CLIP-based reward embeds with (the shared part of the configs below)."""

    clip_model: str = "ViT-L-14-quickgelu"
    """A built-in open_clip name, a local open_clip folder, or (transformers) a CLIPModel folder."""
    clip_weights: str | None = None
    """Local CLIP checkpoint file; None: the weights in the `clip_model` folder."""
    clip_backend: str = "open_clip"
    """`open_clip` or `transformers`."""
    clip_processor: str | None = None
    """transformers only: a local processor folder, if not the model's own."""
    dtype: str = "float32"
    """Weights dtype (`float32`, `bfloat16`, `float16`)."""
    batch_size: int = 32
    """Items embedded per forward pass."""


@dataclass
class AestheticConfig(ClipConfig):
    """Constructor arguments of `aesthetic` (the LAION aesthetic predictor)."""

    head_weights: str | None = None
    """Local file of the MLP head's state dict (`sac+logos+ava1-l14-linearMSE.pth`)."""


@dataclass
class ClipScoreConfig(ClipConfig):
    """Constructor arguments of `clip_score` (`scale * cos(image, text)`)."""

    scale: float = 1.0
    """Multiplies the cosine (Hessel et al. use 2.5)."""


@dataclass
class PickScoreConfig(ClipConfig):
    """Constructor arguments of `pickscore` (`scale * logit_scale * cos(image, text)`)."""

    clip_model: str = ""
    """The local PickScore_v1 folder (a transformers CLIPModel), or an open_clip model/folder."""
    clip_backend: str = "transformers"
    """`transformers` (PickScore_v1) or `open_clip`."""
    clip_processor: str | None = None
    """A local processor folder (PickScore uses CLIP-ViT-H-14-laion2B-s32B-b79K's)."""
    scale: float = 1.0
    """Multiplies the logit (flow-GRPO uses 1/26)."""


@dataclass
class OcrConfig:
    """Constructor arguments of `ocr` (flow-GRPO's OCR reward with rapidocr)."""

    text_score: float = 0.5
    """Recognised lines below this confidence are ignored."""
    det_model_path: str | None = None
    """A PP-OCR detection ONNX model; None: the one rapidocr ships."""
    rec_model_path: str | None = None
    """A PP-OCR recognition ONNX model; None: the one rapidocr ships."""
    num_threads: int = -1
    """onnxruntime intra-op threads (-1: its default)."""


@dataclass
class JpegConfig:
    """Constructor arguments of `jpeg_compressibility` / `jpeg_incompressibility` (DDPO)."""

    quality: int = 95
    """JPEG quality the size is measured at."""


@dataclass
class VLMJudgeConfig:
    """Constructor arguments of `vlm_judge` (a VLM grading against a rubric)."""

    model_path: str | None = None
    """Local Hugging Face VLM folder of the judge."""
    rubric: str = ""
    """Rubric for answers; empty: `mmrl.rewards.vlm_judge.DEFAULT_RUBRIC`."""
    image_rubric: str = ""
    """Rubric for generated images; empty: `DEFAULT_IMAGE_RUBRIC`."""
    min_score: float = 0.0
    """Lowest grade the judge is asked for (maps to reward 0)."""
    max_score: float = 10.0
    """Highest grade the judge is asked for (maps to reward 1)."""
    max_new_tokens: int = 64
    """Length limit of the judge's output."""
    fail_score: float = 0.0
    """Reward of an output with no readable grade (counted in `judge_parse_failed`)."""
    batch_size: int = 16
    """Judge prompts generated per batch."""
    dtype: str = "float32"
    """Judge weights dtype."""


TYPED_CONFIGS: dict[str, type] = {
    "aesthetic": AestheticConfig,
    "clip_score": ClipScoreConfig,
    "pickscore": PickScoreConfig,
    "ocr": OcrConfig,
    "jpeg_compressibility": JpegConfig,
    "jpeg_incompressibility": JpegConfig,
    "vlm_judge": VLMJudgeConfig,
}
"""The typed config of each built-in reward model type."""


@dataclass
class RewardModelConfig:
    """One reward model instance."""

    name: str = ""
    """The name samples use (`reward_model.models[].name`) and the metrics show."""
    type: str = ""
    """The registered reward model to build; empty: the same as `name`."""
    device: str | None = None
    """Where it scores; None: the placement's accelerator (host for CPU-only models)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments, checked against the type's typed config (e.g. `AestheticConfig`)."""


@dataclass
class PlacementConfig:
    """Where reward models live while the policy trains (see `mmrl.rewards.placement`)."""

    accelerator: str = "auto"
    """Device the reward models score on: `auto` is the policy's (`trainer.device`), or a
    torch device string (`cuda:1`)."""
    host: str = "cpu"
    """Where offloaded reward models wait during the update."""
    budget_mb: float | None = None
    """Accelerator memory (MB) the reward models may keep during the update; None: all stay."""


@dataclass
class ModelRewardsConfig:
    """The model-based rewards of a run."""

    models: list[RewardModelConfig] = field(default_factory=list)
    """The reward model instances, in priority order (earlier ones stay resident first)."""
    combine: str = "sum"
    """`sum`: weighted sum, then the usual group normalisation; `gdpo`: decoupled normalisation."""
    gdpo_batch_normalise: bool = True
    """GDPO: normalise the summed advantage over the batch."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Sharing the accelerator with the policy."""


def accelerator_device(placement: PlacementConfig, policy_device: str | torch.device) -> torch.device:
    """The reward models' accelerator: `placement.accelerator`, where `auto` is the policy's."""
    import torch

    return torch.device(policy_device if placement.accelerator == "auto" else placement.accelerator)


def check_kwargs(model_type: str, kwargs: dict[str, Any], where: str = "kwargs") -> dict[str, Any]:
    """`kwargs` filled in from the typed config of `model_type` (unknown keys raise, naming them)."""
    typed = TYPED_CONFIGS.get(model_type)
    if typed is None:
        return dict(kwargs)
    known = {f.name for f in dataclasses.fields(typed)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {unknown} for reward model type {model_type!r} (known: {sorted(known)})"
        )
    out = dataclasses.asdict(typed(**kwargs))
    if out.get("rubric") == "":
        out.pop("rubric")
    if out.get("image_rubric") == "":
        out.pop("image_rubric")
    if isinstance(out.get("dtype"), str):
        import torch

        dtype = getattr(torch, out["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}.dtype: unknown dtype {out['dtype']!r}")
        out["dtype"] = dtype
    return out
