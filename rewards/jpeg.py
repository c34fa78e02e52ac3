"""DDPO's JPEG rewards: the size of an image encoded as JPEG at quality 95, in kB.

`jpeg_incompressibility` is the size (larger is rewarded: detail, texture, noise);
`jpeg_compressibility` is minus the size (smaller is rewarded: flat, simple images). Both are
cheap and run on the host, whatever device they are configured with (Black et al., 2023,
"Training Diffusion Models with Reinforcement Learning").
"""

from __future__ import annotations

import torch

from mmrl.rewards.base import (
    RewardInputs,
    RewardModel,
    RewardOutput,
    jpeg_size_kb,
    register_reward_model,
)


class _JpegSize(RewardModel):
    """Scores `sign * (JPEG size in kB at `quality`)`; the size is also reported as `jpeg_kb`."""

    requires = ("images",)
    cpu_only = True
    sign: float = 1.0

    def __init__(self, quality: int = 95, device: str | torch.device = "cpu"):
        super().__init__("cpu")
        if not 1 <= quality <= 100:
            raise ValueError(f"{self.name}: JPEG quality must be in [1, 100], got {quality}")
        self.quality = quality

    def score_inputs(self, x: RewardInputs) -> RewardOutput:
        sizes = [jpeg_size_kb(image, self.quality) for image in x.images]
        return RewardOutput(scores=[self.sign * s for s in sizes], components={"jpeg_kb": sizes})


@register_reward_model("jpeg_incompressibility")
class JpegIncompressibility(_JpegSize):
    """Reward = JPEG size in kB (DDPO's `jpeg_incompressibility`)."""

    sign = 1.0


@register_reward_model("jpeg_compressibility")
class JpegCompressibility(_JpegSize):
    """Reward = minus the JPEG size in kB (DDPO's `jpeg_compressibility`)."""

    sign = -1.0
