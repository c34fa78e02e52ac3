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

from pathlib import Path

import torch

from mmrl.rewards.base import (
    RewardInputs,
    RewardModel,
    RewardModelError,
    RewardOutput,
    batch_slices,
    register_reward_model,
)
from mmrl.rewards.clip_models import ClipEncoder, load_clip, normalise


class _ClipAgreement(RewardModel):
    """CLIP text-image agreement; the registered subclasses differ in their default CLIP model
    and backend (`clip_model` / `clip_backend` None: the class's) and in the logit scale."""

    requires = ("images",)
    use_logit_scale: bool = False
    prefix: str = ""
    default_model: str = ""
    """The `clip_model` when none is given ("": one must be)."""
    default_backend: str = "open_clip"
    """The `clip_backend` when none is given."""

    def __init__(
        self,
        clip_model: str | None = None,
        clip_weights: str | Path | None = None,
        clip_backend: str | None = None,
        clip_processor: str | Path | None = None,
        scale: float = 1.0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(device)
        clip_model = clip_model or self.default_model
        if not clip_model:
            raise ValueError(
                f"{self.name}: clip_model=<a local CLIP folder, or an open_clip name> is required"
            )
        self.clip: ClipEncoder = load_clip(
            clip_model, clip_weights, clip_backend or self.default_backend, clip_processor, device, dtype
        )
        self.scale = scale
        self.batch_size = batch_size

    def torch_modules(self) -> dict[str, torch.nn.Module]:
        return {"clip": self.clip.module}

    def cosines(self, images: list, texts: list[str]) -> torch.Tensor:
        """[N] cosine similarity of image i and text i."""
        out = []
        for batch in batch_slices(len(images), self.batch_size):
            img = normalise(self.clip.embed_images(images[batch]))
            txt = normalise(self.clip.embed_texts(texts[batch]))
            out.append((img * txt).sum(-1).cpu())
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def score_inputs(self, x: RewardInputs) -> RewardOutput:
        texts = x.fields.get("texts", x.prompts)
        if texts is None:
            raise RewardModelError(f"reward model {self.name!r} needs 'prompts' (or a 'texts' field)")
        cos = self.cosines(x.images, [str(t) for t in texts])
        components = {f"{self.prefix}_cosine": cos.tolist()}
        logits = cos * (self.clip.logit_scale() if self.use_logit_scale else 1.0)
        if self.use_logit_scale:
            components[f"{self.prefix}_logit"] = logits.tolist()
        return RewardOutput(scores=(self.scale * logits).tolist(), components=components)


@register_reward_model("clip_score")
class ClipScore(_ClipAgreement):
    """`scale * cos(CLIP image, CLIP text)`; by default open_clip's ViT-L-14-quickgelu."""

    prefix = "clip"
    default_model = "ViT-L-14-quickgelu"


@register_reward_model("pickscore")
class PickScore(_ClipAgreement):
    """`scale * logit_scale * cos(CLIP image, CLIP text)` (PickScore_v1 through transformers, the
    default backend; `clip_model` is required)."""

    use_logit_scale = True
    prefix = "pickscore"
    default_backend = "transformers"
