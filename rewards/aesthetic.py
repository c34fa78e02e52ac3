"""The LAION aesthetic predictor: a CLIP image embedding, L2-normalised, into an MLP head.

The head is the improved-aesthetic-predictor's (christophschuhmann/improved-aesthetic-predictor,
`sac+logos+ava1-l14-linearMSE.pth`, trained on OpenAI CLIP ViT-L/14 embeddings), as DDPO and
flow-GRPO use it::

    layers.0: Linear(D, 1024)   layers.1: Dropout(0.2)
    layers.2: Linear(1024, 128) layers.3: Dropout(0.2)
    layers.4: Linear(128, 64)   layers.5: Dropout(0.1)
    layers.6: Linear(64, 16)    layers.7: Linear(16, 1)

D is the CLIP model's embedding width (768 for ViT-L/14). The score of an image is
`head(e / |e|)` with `e` its CLIP image embedding (roughly 1-10 for the real weights).

With the real weights: `get_reward_model("aesthetic", clip_model="ViT-L-14-quickgelu",
clip_weights="/models/clip-vit-l-14-openai/open_clip_pytorch_model.bin",
head_weights="/models/sac+logos+ava1-l14-linearMSE.pth")`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mmrl.rewards.base import (
    RewardInputs,
    RewardModel,
    RewardOutput,
    batch_slices,
    check_state_dict,
    load_state_dict_file,
    register_reward_model,
)
from mmrl.rewards.clip_models import ClipEncoder, load_clip, normalise


class AestheticMLP(nn.Module):
    """The improved-aesthetic-predictor head: [N, D] normalised embeddings -> [N, 1] scores."""

    def __init__(self, input_dim: int = 768):
        super().__init__()
        self.input_dim = input_dim
        self.layers = nn.Sequential(
            nn.Linear(input_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed: torch.Tensor) -> torch.Tensor:
        return self.layers(embed)


@register_reward_model("aesthetic")
class AestheticScorer(RewardModel):
    """LAION aesthetic score of each image; components: `aesthetic`."""

    requires = ("images",)

    def __init__(
        self,
        clip_model: str = "ViT-L-14-quickgelu",
        clip_weights: str | Path | None = None,
        head_weights: str | Path | None = None,
        clip_backend: str = "open_clip",
        clip_processor: str | Path | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(device)
        if head_weights is None:
            raise ValueError(
                "aesthetic: head_weights=<local .pth/.safetensors file of the MLP head> is required"
            )
        self.clip: ClipEncoder = load_clip(
            clip_model, clip_weights, clip_backend, clip_processor, device, dtype
        )
        self.head = AestheticMLP(self.clip.embed_dim)
        what = (
            f"aesthetic MLP head for a {self.clip.embed_dim}-d CLIP embedding "
            f"(improved-aesthetic-predictor layout: layers.0 Linear({self.clip.embed_dim}, 1024), layers.2 "
            f"Linear(1024, 128), layers.4 Linear(128, 64), layers.6 Linear(64, 16), layers.7 Linear(16, 1))"
        )
        state = load_state_dict_file(head_weights, what)
        check_state_dict(state, self.head, head_weights, what)
        self.head.load_state_dict(state)
        self.head.eval().requires_grad_(False).to(device=self.device, dtype=dtype)
        self.batch_size = batch_size

    def torch_modules(self) -> dict[str, torch.nn.Module]:
        return {"clip": self.clip.module, "head": self.head}

    @torch.no_grad()
    def score_inputs(self, x: RewardInputs) -> RewardOutput:
        scores: list[float] = []
        for batch in batch_slices(x.n, self.batch_size):
            embed = normalise(self.clip.embed_images(x.images[batch]))
            head_dtype = next(self.head.parameters()).dtype
            scores += self.head(embed.to(head_dtype)).float().squeeze(-1).tolist()
        return RewardOutput(scores=scores, components={"aesthetic": list(scores)})
