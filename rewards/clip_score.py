"""Text-image agreement rewards from CLIP: `clip_score` and the PickScore-style preference score.

- `clip_score`: `scale * cos(image, text)` with CLIP's image and text embeddings (Hessel et
  al., 2021 use `2.5 * max(cos, 0)`; flow-GRPO `logit_scale * cos / 30`). Components:
  `clip_cosine`.
- `pickscore`: `scale * logit_scale * cos(image, text)` (Kirstain et al., 2023: PickScore is a
  CLIP-H fine-tuned on human preferences; its score is the CLIP logit, `logit_scale` = 100;
  flow-GRPO uses `scale=1/26`). Components: `pickscore_cosine`, `pickscore_logit`.

The text of item i is `texts[i]` if that field is given, else `prompts[i]`.

With the real weights: `get_reward_model("pickscore", clip_model="/models/PickScore_v1",
clip_processor="/models/CLIP-ViT-H-14-laion2B-s32B-b79K")` (transformers backend, the default
for `pickscore`); `get_reward_model("clip_score", clip_model="ViT-L-14-quickgelu",
clip_weights=".../open_clip_pytorch_model.bin")`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mmrl.rewards.base import (
    ImagesLike,
    RewardModel,
    RewardModelError,
    RewardOutput,
    as_pil_images,
    register_reward_model,
)
from mmrl.rewards.clip_models import ClipEncoder, load_clip, normalise


class _ClipAgreement(RewardModel):
    requires = ("images",)
    use_logit_scale: bool = False
    prefix: str = ""

    def __init__(
        self,
        clip_model: str,
        clip_weights: str | Path | None = None,
        clip_backend: str = "open_clip",
        clip_processor: str | Path | None = None,
        scale: float = 1.0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(device)
        self.clip: ClipEncoder = load_clip(
            clip_model, clip_weights, clip_backend, clip_processor, device, dtype
        )
        self.scale = scale
        self.batch_size = batch_size

    def torch_modules(self) -> dict[str, torch.nn.Module]:
        return {"clip": self.clip.module}

    def cosines(self, images: list, texts: list[str]) -> torch.Tensor:
        """[N] cosine similarity of image i and text i."""
        out = []
        for start in range(0, len(images), self.batch_size):
            img = normalise(self.clip.embed_images(images[start : start + self.batch_size]))
            txt = normalise(self.clip.embed_texts(texts[start : start + self.batch_size]))
            out.append((img * txt).sum(-1).cpu())
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def score_with_components(
        self,
        images: ImagesLike | None = None,
        prompts: Sequence[str] | None = None,
        responses: Sequence[str] | None = None,
        **fields: Sequence[Any],
    ) -> RewardOutput:
        self.check_inputs(images, prompts, responses, fields)
        texts = fields.get("texts", prompts)
        if texts is None:
            raise RewardModelError(f"reward model {self.name!r} needs 'prompts' (or a 'texts' field)")
        cos = self.cosines(as_pil_images(images), [str(t) for t in texts])
        components = {f"{self.prefix}_cosine": cos.tolist()}
        logits = cos * (self.clip.logit_scale() if self.use_logit_scale else 1.0)
        if self.use_logit_scale:
            components[f"{self.prefix}_logit"] = logits.tolist()
        return RewardOutput(scores=(self.scale * logits).tolist(), components=components)


@register_reward_model("clip_score")
class ClipScore(_ClipAgreement):
    """`scale * cos(CLIP image, CLIP text)`."""

    prefix = "clip"

    def __init__(
        self,
        clip_model: str = "ViT-L-14-quickgelu",
        clip_weights: str | Path | None = None,
        clip_backend: str = "open_clip",
        clip_processor: str | Path | None = None,
        scale: float = 1.0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(
            clip_model, clip_weights, clip_backend, clip_processor, scale, device, dtype, batch_size
        )


@register_reward_model("pickscore")
class PickScore(_ClipAgreement):
    """`scale * logit_scale * cos(CLIP image, CLIP text)` (PickScore_v1 through transformers)."""

    use_logit_scale = True
    prefix = "pickscore"

    def __init__(
        self,
        clip_model: str,
        clip_weights: str | Path | None = None,
        clip_backend: str = "transformers",
        clip_processor: str | Path | None = None,
        scale: float = 1.0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(
            clip_model, clip_weights, clip_backend, clip_processor, scale, device, dtype, batch_size
        )
