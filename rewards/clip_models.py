"""CLIP image and text encoders from local files, through open_clip or transformers.

The aesthetic predictor, `clip_score` and PickScore all need the same two things from a CLIP
model: image embeddings `[N, D]`, text embeddings `[N, D]` and its learned `logit_scale`. This
module loads either backend from local files only (mmrl never downloads) and checks the
weights against the architecture, so that a wrong file fails with the file named and the
layout expected:

- open_clip (`backend="open_clip"`): `model` is a built-in open_clip name (`"ViT-L-14"`,
  `"ViT-H-14"`) with `weights` a local checkpoint file (`open_clip_pytorch_model.bin` /
  `open_clip_model.safetensors`, a state dict of the CLIP module), or a local folder in the
  open_clip hub layout (`open_clip_config.json` with `model_cfg` and `preprocess_cfg`, plus
  one of those weight files; `weights` then overrides the file in the folder).
- transformers (`backend="transformers"`): `model` is a local folder saved with
  `CLIPModel.save_pretrained` (PickScore_v1 is one), with its processor in the same folder or
  in `processor` (PickScore's processor is `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`'s).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mmrl.rewards.base import WeightsFileError, check_state_dict, load_state_dict_file

OPEN_CLIP_WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
"""Weight file names looked for in an open_clip folder, in order."""
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
"""Weight file names looked for in a transformers folder, in order."""


class ClipEncoder:
    """A loaded CLIP model: `embed_images`, `embed_texts`, `logit_scale`; weights in `module`."""

    def __init__(self, backend: str, module: torch.nn.Module, source: str):
        self.backend = backend
        self.module = module.eval()
        self.source = source
        self.module.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    @property
    def embed_dim(self) -> int:
        """D, the width of the joint embedding."""
        raise NotImplementedError

    def embed_images(self, images: list[Image.Image]) -> torch.Tensor:
        """[N, D] image embeddings (not normalised), float32 on the model's device."""
        raise NotImplementedError

    def embed_texts(self, texts: list[str]) -> torch.Tensor:
        """[N, D] text embeddings (not normalised), float32 on the model's device."""
        raise NotImplementedError

    def logit_scale(self) -> float:
        """exp of the learned log temperature (100 for trained CLIP models)."""
        raise NotImplementedError


class OpenClipEncoder(ClipEncoder):
    def __init__(self, module: torch.nn.Module, preprocess: Any, tokenizer: Any, source: str):
        super().__init__("open_clip", module, source)
        self.preprocess = preprocess
        self.tokenizer = tokenizer

    @property
    def embed_dim(self) -> int:
        return (
            int(self.module.text_projection.shape[-1])
            if hasattr(self.module, "text_projection")
            else int(self.module.visual.output_dim)
        )

    @torch.no_grad()
    def embed_images(self, images: list[Image.Image]) -> torch.Tensor:
        pixels = torch.stack([self.preprocess(image) for image in images]).to(self.device, self.dtype)
        return self.module.encode_image(pixels).float()

    @torch.no_grad()
    def embed_texts(self, texts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(list(texts)).to(self.device)
        return self.module.encode_text(tokens).float()

    def logit_scale(self) -> float:
        return float(self.module.logit_scale.detach().float().exp())


class HFClipEncoder(ClipEncoder):
    def __init__(self, module: torch.nn.Module, processor: Any, source: str):
        super().__init__("transformers", module, source)
        self.processor = processor

    @property
    def embed_dim(self) -> int:
        return int(self.module.config.projection_dim)

    @torch.no_grad()
    def embed_images(self, images: list[Image.Image]) -> torch.Tensor:
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].to(
            self.device, self.dtype
        )
        pooled = self.module.vision_model(pixel_values=pixels).pooler_output
        return self.module.visual_projection(pooled).float()

    @torch.no_grad()
    def embed_texts(self, texts: list[str]) -> torch.Tensor:
        max_length = self.module.config.text_config.max_position_embeddings
        inputs = self.processor(
            text=list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        pooled = self.module.text_model(
            input_ids=inputs["input_ids"].to(self.device),
            attention_mask=inputs["attention_mask"].to(self.device),
        ).pooler_output
        return self.module.text_projection(pooled).float()

    def logit_scale(self) -> float:
        return float(self.module.logit_scale.detach().float().exp())


def load_clip(
    model: str,
    weights: str | Path | None = None,
    backend: str = "open_clip",
    processor: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ClipEncoder:
    """Load a CLIP model from local files (see the module docstring for the layouts)."""
    if backend == "open_clip":
        encoder: ClipEncoder = _load_open_clip(model, weights)
    elif backend == "transformers":
        encoder = _load_hf_clip(model, weights, processor)
    else:
        raise ValueError(f"unknown CLIP backend {backend!r} (choose open_clip or transformers)")
    encoder.module.to(device=torch.device(device), dtype=dtype)
    return encoder


def _load_open_clip(model: str, weights: str | Path | None) -> OpenClipEncoder:
    import open_clip

    folder = Path(model)
    if folder.is_dir():
        config = folder / "open_clip_config.json"
        if not config.is_file():
            raise WeightsFileError(
                f"open_clip folder {str(folder)!r} has no open_clip_config.json (expected the open_clip hub "
                f"layout: open_clip_config.json with 'model_cfg' and 'preprocess_cfg', and one of "
                f"{', '.join(OPEN_CLIP_WEIGHT_FILES)})"
            )
        try:
            model_cfg = json.loads(config.read_text())["model_cfg"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightsFileError(
                f"{config}: not an open_clip config with a 'model_cfg' object ({exc})"
            ) from None
        if weights is None:
            found = [folder / name for name in OPEN_CLIP_WEIGHT_FILES if (folder / name).is_file()]
            if not found:
                raise WeightsFileError(
                    f"open_clip folder {str(folder)!r} holds no weights file (looked for "
                    f"{', '.join(OPEN_CLIP_WEIGHT_FILES)})"
                )
            weights = found[0]
        model_id = f"local-dir:{folder}"
        what = f"open_clip CLIP (embed_dim {model_cfg.get('embed_dim')}) from {folder}"
    else:
        if model not in open_clip.list_models():
            raise ValueError(
                f"{model!r} is neither a local open_clip folder nor a built-in open_clip model name "
                f"(e.g. ViT-L-14, ViT-H-14)"
            )
        if weights is None:
            raise WeightsFileError(
                f"open_clip model {model!r} needs weights=<local checkpoint file> "
                f"(a state dict of the CLIP module); mmrl never downloads"
            )
        model_id = model
        what = f"open_clip CLIP {model}"
    # open_clip warns that the model is "initialized randomly": our own loader fills it next.
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        module, _, preprocess = open_clip.create_model_and_transforms(
            model_id, load_weights=False, pretrained_image=False, pretrained_text=False
        )
    finally:
        logging.disable(previous)
    state = load_state_dict_file(weights, what)
    check_state_dict(state, module, weights, what)
    module.load_state_dict(state)
    tokenizer = open_clip.get_tokenizer(model_id)
    return OpenClipEncoder(module, preprocess, tokenizer, source=str(weights))


def _load_hf_clip(model: str, weights: str | Path | None, processor: str | Path | None) -> HFClipEncoder:
    from transformers import AutoProcessor, CLIPConfig, CLIPModel

    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise WeightsFileError(
            f"{str(folder)!r} is not a transformers CLIP folder (no config.json); expected a folder saved "
            f"with CLIPModel.save_pretrained: config.json and one of {', '.join(HF_WEIGHT_FILES)}"
        )
    config = CLIPConfig.from_pretrained(folder, local_files_only=True)
    what = f"transformers CLIPModel (projection_dim {config.projection_dim}) from {folder}"
    reference = CLIPModel(config)  # the expected layout, for the error message and the check
    if weights is None:
        found = [folder / name for name in HF_WEIGHT_FILES if (folder / name).is_file()]
        if not found:
            raise WeightsFileError(
                f"{what}: no weights file in {str(folder)!r} (looked for {', '.join(HF_WEIGHT_FILES)})"
            )
        weights = found[0]
    weights = Path(weights)
    if weights.name.endswith(".index.json"):
        index = json.loads(weights.read_text())
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            state.update(load_state_dict_file(weights.parent / shard, what))
    else:
        state = load_state_dict_file(weights, what)
    # Older checkpoints (PickScore_v1, 2023) still store the position-id buffers.
    state = {k: v for k, v in state.items() if not k.endswith("embeddings.position_ids")}
    check_state_dict(state, reference, weights, what)
    reference.load_state_dict(state)
    try:
        proc = AutoProcessor.from_pretrained(processor or folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - name the folder
        raise WeightsFileError(
            f"{what}: cannot load the CLIP processor from {str(processor or folder)!r} "
            f"(expected preprocessor_config.json and tokenizer files): {type(exc).__name__}: {exc}"
        ) from exc
    return HFClipEncoder(reference, proc, source=str(weights))


def normalise(x: torch.Tensor) -> torch.Tensor:
    """[N, D] rows divided by their L2 norm."""
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)
