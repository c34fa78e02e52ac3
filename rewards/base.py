"""The reward-model base class, the registry, and helpers shared by every reward model.

A reward model scores a batch of N items at once. Each item may have an image (generated
images for flow-GRPO / DDPO), a prompt (the text it was asked for) and a response (a VLM's
answer), plus named per-item fields (`texts=[...]` for OCR, `references=[...]` for the
judge)::

    model = get_reward_model("jpeg_compressibility")
    scores = model.score(images=images)                       # list[float], length N
    out = model.score_with_components(images=images, prompts=prompts)
    out.scores, out.components                                # {"jpeg_kb": [...]} etc.

Images may be PIL images, encoded bytes or paths, a float tensor `[N, 3, H, W]` in [0, 1]
(what a diffusion pipeline decodes to), a uint8 tensor `[N, 3, H, W]`, or a uint8 array
`[N, H, W, 3]` (see `as_pil_images`).

Every model declares its device and the memory it holds (`memory_bytes()`: parameters and
buffers of its torch modules; models outside torch report what they load), and moves with
`to(device)`, which is what the placement policy (`mmrl.rewards.placement`) uses to share the
accelerator with the policy.

A model implements `score_inputs(x)`, which gets the checked inputs with the images decoded
once (`RewardInputs`); `score_with_components` and `score`, the public calls, do the rest.

The registry (`register_reward_model`) lives here, below the models that register into it; the
lookups by name, `get_reward_model` and `reward_model_names`, live in `mmrl.rewards.catalog`,
which imports the built-in models first (both are also `mmrl.rewards.<name>`).

This module's API is stable: other subsystems (flow-GRPO) import it.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from PIL import Image

from mmrl.types import load_image

ImagesLike = Sequence[Any] | torch.Tensor | np.ndarray
"""A batch of images: a sequence of PIL images / bytes / paths, a `[N, 3, H, W]` tensor
(float in [0, 1] or uint8), or a `[N, H, W, 3]` uint8 array."""


class RewardModelError(ValueError):
    """A reward model was given unusable input (missing field, wrong batch length, ...)."""


class WeightsFileError(RuntimeError):
    """A weights file is missing or does not have the layout the reward model expects."""


@dataclass
class RewardInputs:
    """The inputs of one scoring call, checked (`RewardModel.check_inputs`): N items."""

    n: int
    """The number of items N."""
    images: list[Image.Image] | None
    """The images as RGB PIL images (`as_pil_images`), or None when none were given."""
    prompts: Sequence[str] | None
    """The prompts, or None."""
    responses: Sequence[str] | None
    """The responses, or None."""
    fields: dict[str, Sequence[Any]]
    """Named per-item fields (`texts`, `references`, ...), each of length N."""


@dataclass
class RewardOutput:
    """Scores for a batch of N items, with named components kept for logging."""

    scores: list[float]
    """The reward of each item, length N."""
    components: dict[str, list[float]] = field(default_factory=dict)
    """Named per-item parts or diagnostics of the score (each length N)."""


class RewardModel:
    """Base class of every reward model: batched scoring, a device, memory accounting.

    Subclasses implement `score_inputs` (checked inputs, images decoded), list the torch
    modules they hold in `torch_modules()` (so `to`, `device` and `memory_bytes` work without
    more code), and set `requires` to the inputs they cannot do without. A subclass may instead
    implement `score_with_components` or `score` itself, on the inputs as the caller gave them.
    """

    name: str = ""
    """Registry name, set by `register_reward_model`."""
    requires: tuple[str, ...] = ()
    """Inputs `score` needs: some of "images", "prompts", "responses", or field names."""
    cpu_only: bool = False
    """True for models that always run on the host (JPEG size, ONNX OCR): `to` keeps them there."""

    def __init__(self, device: str | torch.device = "cpu"):
        self._device = torch.device(device)

    # --- device and memory -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the model's weights live and where it scores."""
        return self._device

    def torch_modules(self) -> dict[str, torch.nn.Module]:
        """The torch modules this model holds, by name (none by default)."""
        return {}

    def memory_bytes(self) -> int:
        """Bytes held by the model's parameters and buffers (each tensor counted once)."""
        seen: set[int] = set()
        total = 0
        for module in self.torch_modules().values():
            for tensor in [*module.parameters(), *module.buffers()]:
                key = tensor.data_ptr()
                if key in seen:
                    continue
                seen.add(key)
                total += tensor.numel() * tensor.element_size()
        return total

    def to(self, device: str | torch.device) -> RewardModel:
        """Move the model's weights to `device` (a no-op for `cpu_only` models); returns self."""
        if self.cpu_only:
            return self
        device = torch.device(device)
        for module in self.torch_modules().values():
            module.to(device)
        self._device = device
        return self

    # --- scoring -------------------------------------------------------------------------
    def accepts_prompt(self, prompt: str) -> bool:
        """Whether `score` can grade an image for `prompt` at all (a rule reward with a grammar
        refuses prompts outside it); True by default. The decoupled trainer asks before it
        scores a plan, so one plan outside the grammar costs only its own images."""
        return True

    def score_inputs(self, x: RewardInputs) -> RewardOutput:
        """Score the N checked items of `x` (what subclasses implement)."""
        raise NotImplementedError(
            f"{type(self).__name__} implements none of score_inputs, score_with_components and score"
        )

    def score_with_components(
        self,
        images: ImagesLike | None = None,
        prompts: Sequence[str] | None = None,
        responses: Sequence[str] | None = None,
        **fields: Sequence[Any],
    ) -> RewardOutput:
        """Score N items; `images`, `prompts`, `responses` and each field have length N.

        Checks the inputs against `requires` and one another, decodes the images once, and
        hands them to `score_inputs`; a subclass that implements only `score` gets the inputs
        as they are, and its scores are the one component, named after the model."""
        if _overrides(self, "score") and not _overrides(self, "score_inputs"):
            scores = self.score(images=images, prompts=prompts, responses=responses, **fields)
            return RewardOutput(scores=scores, components={self.name: list(scores)})
        n = self.check_inputs(images, prompts, responses, fields)
        pil = None if images is None else as_pil_images(images)
        return self.score_inputs(RewardInputs(n, pil, prompts, responses, dict(fields)))

    def score(
        self,
        images: ImagesLike | None = None,
        prompts: Sequence[str] | None = None,
        responses: Sequence[str] | None = None,
        **fields: Sequence[Any],
    ) -> list[float]:
        """The reward of each of N items (length N)."""
        return self.score_with_components(
            images=images, prompts=prompts, responses=responses, **fields
        ).scores

    def __call__(self, *args: Any, **kwargs: Any) -> list[float]:
        return self.score(*args, **kwargs)

    def check_inputs(
        self,
        images: ImagesLike | None,
        prompts: Sequence[str] | None,
        responses: Sequence[str] | None,
        fields: dict[str, Sequence[Any]],
    ) -> int:
        """Check that the required inputs are present and all inputs have one length; return N."""
        given: dict[str, Any] = {"images": images, "prompts": prompts, "responses": responses, **fields}
        for needed in self.requires:
            if given.get(needed) is None:
                raise RewardModelError(f"reward model {self.name!r} needs {needed!r} (got none)")
        lengths = {k: len(v) for k, v in given.items() if v is not None}
        if len(set(lengths.values())) > 1:
            raise RewardModelError(f"reward model {self.name!r}: inputs differ in length: {lengths}")
        return next(iter(lengths.values()), 0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={self.device}, memory_bytes={self.memory_bytes()})"


def _overrides(model: RewardModel, method: str) -> bool:
    """Whether `model`'s class replaces `RewardModel.<method>`."""
    return getattr(type(model), method) is not getattr(RewardModel, method)


# --- registry ------------------------------------------------------------------------------
_REGISTRY: dict[str, Callable[..., RewardModel]] = {}
R = TypeVar("R", bound=Callable[..., RewardModel])


def register_reward_model(name: str) -> Callable[[R], R]:
    """Decorator: register a `RewardModel` subclass (or a factory returning one) under `name`.

    `get_reward_model(name, **kwargs)` (`mmrl.rewards.catalog`) then builds a fresh instance
    with `kwargs`.
    """

    def wrap(factory: R) -> R:
        if name in _REGISTRY:
            raise ValueError(f"reward model {name!r} is already registered")
        if isinstance(factory, type):
            factory.name = name
        _REGISTRY[name] = factory
        return factory

    return wrap


# --- helpers -------------------------------------------------------------------------------
def as_pil_images(images: ImagesLike) -> list[Image.Image]:
    """A batch of images as RGB PIL images.

    Float tensors `[N, 3, H, W]` are taken to be in [0, 1] and quantised as DDPO does
    (`(x * 255).round().clamp(0, 255)`); uint8 tensors `[N, 3, H, W]` and uint8 arrays
    `[N, H, W, 3]` are used as they are. A sequence may also mix PIL images, bytes, paths,
    `[3, H, W]` tensors and `[H, W, 3]` arrays.
    """
    if isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[1] not in (1, 3):
            raise RewardModelError(f"image tensor must be [N, 3, H, W], got {list(images.shape)}")
        if images.dtype != torch.uint8:
            images = (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)
        array = images.cpu().permute(0, 2, 3, 1).numpy()
        return [Image.fromarray(a.squeeze(-1) if a.shape[-1] == 1 else a).convert("RGB") for a in array]
    if isinstance(images, np.ndarray):
        if images.ndim != 4 or images.shape[-1] not in (1, 3):
            raise RewardModelError(f"image array must be [N, H, W, 3], got {list(images.shape)}")
        if images.dtype != np.uint8:
            images = (images.astype(np.float64) * 255).round().clip(0, 255).astype(np.uint8)
        return [Image.fromarray(a.squeeze(-1) if a.shape[-1] == 1 else a).convert("RGB") for a in images]
    return [_one_pil(img) for img in images]


def batch_slices(n: int, size: int) -> Iterator[slice]:
    """The slices [0:size], [size:2 size], ... that cover N items, for scoring in batches."""
    for start in range(0, n, size):
        yield slice(start, start + size)


def _one_pil(image: Any) -> Image.Image:
    """One image (PIL, bytes, path, `[3, H, W]` tensor or `[H, W, 3]` array) as RGB PIL."""
    if isinstance(image, torch.Tensor):
        return as_pil_images(image.unsqueeze(0))[0]
    if isinstance(image, np.ndarray):
        return as_pil_images(image[None] if image.ndim == 3 else image[None, ..., None])[0]
    return load_image(image)


def jpeg_size_kb(image: Image.Image, quality: int = 95) -> float:
    """Size in kB (1000 bytes) of `image` encoded as JPEG at `quality` (DDPO's measure)."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000


def load_state_dict_file(path: str | Path, what: str) -> dict[str, torch.Tensor]:
    """Read a state dict from `path` (`.safetensors`, or a torch pickle of tensors only).

    Raises `WeightsFileError` naming the file and `what` it should hold if it is missing or
    unreadable.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsFileError(f"{what}: weights file {str(path)!r} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any read failure names the file
        raise WeightsFileError(
            f"{what}: cannot read weights file {str(path)!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsFileError(f"{what}: weights file {str(path)!r} does not hold a state dict of tensors")
    return state


def check_state_dict(
    state: dict[str, torch.Tensor], module: torch.nn.Module, path: str | Path, what: str
) -> None:
    """Raise `WeightsFileError` unless `state` has exactly `module`'s keys and shapes.

    The message names the file, the missing / unexpected / mis-shaped keys, and the whole
    expected layout (key: shape) so that a wrong file is easy to diagnose.
    """
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    if not (missing or unexpected or wrong):
        return
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}")
    if wrong:
        problems.append(
            "wrong shapes "
            + ", ".join(f"{k}: expected {list(expected[k])}, got {list(got[k])}" for k in wrong)
        )
    layout = ", ".join(f"{k}: {list(s)}" for k, s in expected.items())
    if len(layout) > 2000:
        layout = layout[:2000] + " ..."
    raise WeightsFileError(
        f"{what}: weights file {str(path)!r} does not match the expected layout: {'; '.join(problems)}. "
        f"Expected layout ({len(expected)} tensors): {layout}"
    )
