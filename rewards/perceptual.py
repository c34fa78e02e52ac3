"""The `perceptual` reward: perceptual similarity of each image to its reference image.

The high-frequency reward of decoupled RL (GLM-Image trains its diffusion decoder on it): how
closely the rendering matches a reference of what it should look like. Two backends:

- `lpips` (Zhang et al., 2018, "The Unreasonable Effectiveness of Deep Features as a Perceptual
  Metric") through the maintained `lpips` package: the reward is `-distance` (0 is identical).
  The package ships its calibrated linear heads; the backbone's ImageNet weights are read from a
  local file (`backbone_weights`: torchvision's `alexnet-owt-7be5be79.pth` / `vgg16-397923af.pth`,
  or a safetensors file of the same keys), never downloaded.
- `ssim` (default; Wang et al., 2004): the mean structural similarity of the luminance, with an
  11 x 11 Gaussian window (sigma 1.5) and the paper's constants, in [-1, 1] (1 is identical).
  It needs no weights; it is the honest substitute where LPIPS's backbone is not on the machine,
  and not LPIPS: its numbers are not comparable with LPIPS's.

References come per image as `references=[...]` (PIL images, paths, bytes, arrays; resized to the
generated image's size with bicubic filtering when they differ). Components: `lpips_distance` or
`ssim`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from mmrl.rewards.base import (
    RewardInputs,
    RewardModel,
    RewardModelError,
    RewardOutput,
    WeightsFileError,
    as_pil_images,
    batch_slices,
    load_state_dict_file,
    register_reward_model,
)

BACKENDS = ("ssim", "lpips")
LPIPS_NETS = ("alex", "vgg")


def _to_tensor(images: list[Image.Image]) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.asarray(im, dtype=np.float32) / 255.0 for im in images])).permute(
        0, 3, 1, 2
    )


def ssim(x: torch.Tensor, y: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Mean SSIM of the luminance (ITU-R BT.601) of x and y ([N, 3, H, W] in [0, 1]) -> [N].
    Constants C1 = (0.01 L)^2, C2 = (0.03 L)^2 with L = 1; the window shrinks to the image's
    smaller side when that is below `window` (odd); borders are not padded ("valid")."""
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype).view(1, 3, 1, 1)
    gx, gy = (x * weights).sum(1, keepdim=True), (y * weights).sum(1, keepdim=True)
    size = min(window, min(x.shape[-2:]))
    size -= 1 - size % 2
    coords = torch.arange(size, dtype=x.dtype) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    kernel = (g[:, None] * g[None, :]).view(1, 1, size, size)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, kernel)

    mu_x, mu_y = blur(gx), blur(gy)
    var_x = blur(gx * gx) - mu_x**2
    var_y = blur(gy * gy) - mu_y**2
    cov = blur(gx * gy) - mu_x * mu_y
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return s.flatten(1).mean(1)


@register_reward_model("perceptual")
class PerceptualReward(RewardModel):
    """Similarity of each image to its reference (see the module docs)."""

    requires = ("images", "references")

    def __init__(
        self,
        backend: str = "ssim",
        net: str = "alex",
        backbone_weights: str | None = None,
        batch_size: int = 32,
        device: str | torch.device = "cpu",
    ):
        super().__init__(device)
        if backend not in BACKENDS:
            raise ValueError(f"perceptual: backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.batch_size = int(batch_size)
        self._lpips = None
        if backend == "lpips":
            self._lpips = _build_lpips(net, backbone_weights).to(self._device)
        else:
            self.cpu_only = True

    def torch_modules(self) -> dict[str, torch.nn.Module]:
        return {"lpips": self._lpips} if self._lpips is not None else {}

    def score_inputs(self, x: RewardInputs) -> RewardOutput:
        pil = x.images
        refs = x.fields["references"]
        if len(refs) != len(pil):
            raise RewardModelError(f"perceptual: {len(refs)} references for {len(pil)} images")
        ref_pil = []
        for i, (image, ref) in enumerate(zip(pil, refs)):
            if ref is None:
                raise RewardModelError(f"perceptual: image {i} has no reference")
            r = as_pil_images([ref])[0]
            ref_pil.append(r if r.size == image.size else r.resize(image.size, Image.BICUBIC))
        scores: list[float] = []
        for batch in batch_slices(len(pil), self.batch_size):
            a, b = _to_tensor(pil[batch]), _to_tensor(ref_pil[batch])
            if self._lpips is None:
                scores += ssim(a.double(), b.double()).tolist()
            else:
                with torch.no_grad():
                    d = self._lpips(a.to(self._device) * 2 - 1, b.to(self._device) * 2 - 1)
                scores += (-d.flatten().float().cpu()).tolist()
        name = "ssim" if self._lpips is None else "lpips_distance"
        parts = scores if self._lpips is None else [-s for s in scores]
        return RewardOutput(scores=[float(s) for s in scores], components={name: parts})


def _build_lpips(net: str, backbone_weights: str | None) -> torch.nn.Module:
    """The `lpips` package's LPIPS v0.1 with its shipped linear heads and the backbone's weights
    from a local file (its `features.<i>.*` keys go to the package's `net.slice<k>.<i>.*`)."""
    if net not in LPIPS_NETS:
        raise ValueError(f"perceptual: net must be one of {LPIPS_NETS}, got {net!r}")
    if not backbone_weights:
        raise WeightsFileError(
            f"perceptual: backend=lpips needs backbone_weights, a local file of torchvision's {net} "
            "ImageNet weights (nothing is downloaded); or use backend=ssim"
        )
    try:
        import lpips
    except ImportError as exc:  # pragma: no cover - installed with the rewards extra
        raise ImportError("perceptual: backend=lpips needs the `lpips` package (pip install lpips)") from exc
    state = load_state_dict_file(backbone_weights, f"the LPIPS {net} backbone")
    model = lpips.LPIPS(pretrained=True, net=net, pnet_rand=True, verbose=False)
    mapped = {}
    for key in model.net.state_dict():
        m = re.fullmatch(r"slice\d+\.(\d+)\.(\w+)", key)
        source = f"features.{m.group(1)}.{m.group(2)}" if m else key
        if source not in state:
            raise WeightsFileError(
                f"perceptual: {str(Path(backbone_weights))!r} has no {source!r}: not torchvision {net} weights"
            )
        mapped[key] = state[source]
    model.net.load_state_dict(mapped)
    return model.eval().requires_grad_(False)
