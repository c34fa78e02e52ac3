"""What differs between VLM families, in one small adapter per family with a generic default.

Everything else in mmrl (rollout, the trainer's forward, batching, freezing) works through the
Auto classes and asks the policy's family only for these:

- **vision inputs**: how each processor output maps to the batch's rows (`layout`): one entry
  per row (the default), per token ([N, P], left padded with the prompt ids: Gemma 3's
  `token_type_ids`, Qwen's `mm_token_type_ids`), or concatenated over the rows' images or
  patches, with so many leading entries per row (LLaVA's `pixel_values`: one per image;
  Qwen-VL's: the patches of the image grid; InternVL's: the tiles, from its image tokens);
- **position ids** of a forward's inputs, as generation lays them out (plain positions from
  the attention mask by default; Qwen-VL's multimodal RoPE);
- whether the **shared-prompt forward** applies (default: yes, with plain positions);
- the **vision and connector modules**, by parameter name (freezing, their own learning rates);
- the **tokens to block** when sampling and in the log-prob pass, besides the tokenizer's special
  tokens: the model config's image / video token ids and the processor's.

A family is picked by the model config's `model_type` (and, where only the processor is at hand,
by the processor's class). A new family is a subclass that overrides what differs, registered
with `register` (see `Idefics3Family` for a three-line one). Families not registered get
`VLMFamily` itself, which fits the LLaVA-style layout most processors produce.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import torch

from mmrl.types import VisionLayout

log = logging.getLogger(__name__)


class VLMFamily:
    """The generic default (LLaVA-style): per-image `pixel_values` and `image_sizes`, per-token
    type ids, plain positions, a `vision_tower` and a `multi_modal_projector`."""

    name = "generic"
    model_types: tuple[str, ...] = ()
    """`config.model_type` values of the family."""
    processor_classes: tuple[str, ...] = ()
    """Class names of its processors (to pick the family from a processor alone)."""
    per_image: tuple[str, ...] = ("pixel_values", "image_sizes")
    """Processor outputs with one entry per image, concatenated over the batch's rows."""
    per_token: tuple[str, ...] = ("token_type_ids", "mm_token_type_ids")
    """Processor outputs [N, P] aligned with the prompt ids."""
    vision_modules = re.compile(r"(^|\.)(vision_tower|vision_model|vision_encoder)(\.|$)")
    """Parameter names of the vision tower."""
    connector_modules = re.compile(r"(^|\.)(multi_modal_projector|mm_projector|image_newline)(\.|$)")
    """Parameter names of the vision-language connector (checked before the tower)."""

    # --- vision inputs ---------------------------------------------------------------------

    def extents(
        self, inputs: dict[str, torch.Tensor], images_per_row: Sequence[int], processor
    ) -> dict[str, list[int]]:
        """For each input concatenated over rows, how many leading entries each row has."""
        return {k: list(images_per_row) for k in self.per_image if k in inputs}

    def layout(
        self, inputs: dict[str, torch.Tensor], images_per_row: Sequence[int], processor
    ) -> VisionLayout:
        """How the vision inputs of `inputs` (processor outputs) map to its rows; checked."""
        vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        layout = VisionLayout(
            extents=self.extents(inputs, images_per_row, processor),
            per_token=tuple(k for k in self.per_token if k in vision),
        )
        layout.check(vision, len(images_per_row), f"the {self.name} family's processor outputs")
        return layout

    # --- positions and the shared-prompt forward -------------------------------------------

    def position_ids(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Position ids [N, L] of `inputs` as `generate` lays them out: each row counts its
        unpadded tokens from 0 (left padding gets 0). None: the model lays them out itself."""
        if _own_multimodal_positions(model):
            return None  # an unregistered family with its own layout (Qwen-like RoPE): let it
        mask = inputs["attention_mask"]
        return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)

    def why_no_shared_prompts(self, model: torch.nn.Module) -> str | None:
        """Why the shared-prompt forward does not apply to `model` (None: it does)."""
        if _own_multimodal_positions(model):
            return (
                f"{type(_base(model)).__name__} lays out its own multimodal positions and no mmrl family "
                "adapter says how (mmrl.models.families)"
            )
        return None

    # --- what trains -----------------------------------------------------------------------

    def part_of(self, name: str) -> str:
        """`vision`, `connector` or `language` for a parameter or module name."""
        if self.connector_modules.search(name):
            return "connector"
        if self.vision_modules.search(name):
            return "vision"
        return "language"

    # --- tokens never sampled --------------------------------------------------------------

    def vision_token_ids(self, model: torch.nn.Module, processor) -> set[int]:
        """Image / video token ids named by the model config and the processor."""
        ids: set[int] = set()
        config = _base(model).config
        for source in (config, processor):
            for attr in dir(source):
                if _VISION_TOKEN_ATTR.fullmatch(attr) and not attr.startswith("_"):
                    try:
                        value = getattr(source, attr)
                    except Exception:  # a property that needs state the object lacks
                        continue
                    ids.update(_ints(value))
        return ids


_VISION_TOKEN_ATTR = re.compile(
    r"(image|video|vision|boi|eoi|img)\w*_(token_)?(id|ids|index)|(boi|eoi)_token_(id|index)|row_col_ids"
)


def _ints(value) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value] if value >= 0 else []
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return [v for v in value if v >= 0]
    return []


class QwenVLFamily(VLMFamily):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL: patches concatenated over images (`image_grid_thw` gives
    each image's t x h x w), multimodal RoPE positions [3, N, L], a `visual` tower whose
    `merger` (and Qwen3-VL's deepstack mergers) is the connector."""

    name = "qwen_vl"
    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
    processor_classes = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor")
    per_image = ("image_grid_thw",)
    vision_modules = re.compile(r"(^|\.)visual(\.|$)")
    connector_modules = re.compile(r"(^|\.)visual\.(merger|deepstack_merger_list)(\.|$)")

    def extents(self, inputs, images_per_row, processor):
        out = super().extents(inputs, images_per_row, processor)
        if "pixel_values" in inputs:
            sizes = inputs["image_grid_thw"].prod(dim=-1).tolist()  # patches of each image
            out["pixel_values"] = _sum_by_row(sizes, images_per_row)
        return out

    def position_ids(self, model, inputs):
        """Multimodal RoPE positions [3, N, L] (`compute_3d_position_ids`), or 0..L-1 when
        there is no image (the text model then counts positions from 0, padding included)."""
        core = _base(model).model
        input_ids = inputs["input_ids"]
        extra = {k: inputs.get(k) for k in _signature(type(core).compute_3d_position_ids) & _GRID_INPUTS}
        with torch.no_grad():
            positions = core.compute_3d_position_ids(
                input_ids=input_ids,
                inputs_embeds=None,
                attention_mask=inputs["attention_mask"],
                cache=None,
                **extra,
            )
        if positions is None:
            L = input_ids.shape[1]
            positions = (
                torch.arange(L, device=input_ids.device).view(1, 1, L).expand(3, input_ids.shape[0], L)
            )
        return positions

    def why_no_shared_prompts(self, model):
        return None


class InternVLFamily(VLMFamily):
    """InternVL: `pixel_values` holds every image's tiles in order; a row's tiles are its image
    tokens over the tokens a tile becomes (`image_seq_length`)."""

    name = "internvl"
    model_types = ("internvl",)
    processor_classes = ("InternVLProcessor",)
    per_image = ()

    def extents(self, inputs, images_per_row, processor):
        if "pixel_values" not in inputs:
            return {}
        tokens = (inputs["input_ids"] == processor.image_token_id).sum(dim=1).tolist()
        tiles = [t // processor.image_seq_length for t in tokens]
        if any(t % processor.image_seq_length for t in tokens):
            raise ValueError(
                f"InternVL prompt rows hold {tokens} image tokens, not multiples of image_seq_length="
                f"{processor.image_seq_length}: were prompts truncated?"
            )
        return {"pixel_values": tiles}


class Idefics3Family(VLMFamily):
    """Idefics3 and SmolVLM: images per row, padded to the batch's most ([N, max images, ...],
    the padding all zeros), a `vision_model` and a `connector`."""

    name = "idefics3"
    model_types = ("idefics3", "smolvlm")
    processor_classes = ("Idefics3Processor", "SmolVLMProcessor")
    per_image = ()
    connector_modules = re.compile(r"(^|\.)connector(\.|$)")


_FAMILIES: list[type[VLMFamily]] = []


def register(family: type[VLMFamily]) -> type[VLMFamily]:
    """Add a family (usable as a class decorator); later registrations win."""
    _FAMILIES.insert(0, family)
    return family


for _family in (QwenVLFamily, InternVLFamily, Idefics3Family):
    register(_family)


def family_of(model: torch.nn.Module) -> VLMFamily:
    """The family of a model (LoRA-wrapped or not), by its config's `model_type`."""
    model_type = getattr(getattr(_base(model), "config", None), "model_type", None)
    for family in _FAMILIES:
        if model_type in family.model_types:
            return family()
    return VLMFamily()


def family_of_processor(processor) -> VLMFamily:
    """The family of a processor, by its class (or a base class) name."""
    names = {cls.__name__ for cls in type(processor).__mro__}
    for family in _FAMILIES:
        if names & set(family.processor_classes):
            return family()
    return VLMFamily()


def vision_layout(processor, inputs: dict[str, torch.Tensor], images_per_row: Sequence[int]) -> VisionLayout:
    """The row layout of processor outputs `inputs` (see `VLMFamily.layout`)."""
    return family_of_processor(processor).layout(inputs, images_per_row, processor)


_said: set[tuple[str, str]] = set()


def shares_prompts(model: torch.nn.Module) -> bool:
    """Whether rows with the same prompt can share one prompt pass on this model; when not, the
    plain forward is used and the reason logged once per model class."""
    why = family_of(model).why_no_shared_prompts(model)
    if why is None:
        return True
    key = (type(_base(model)).__name__, why)
    if key not in _said:
        _said.add(key)
        log.info("shared-prompt forward off, using the plain forward: %s", why)
    return False


def blocked_token_ids(model: torch.nn.Module, processor) -> set[int]:
    """Ids never to sample nor score besides the tokenizer's special tokens (see the module docs)."""
    return family_of(model).vision_token_ids(model, processor)


# --- helpers -------------------------------------------------------------------------------

_GRID_INPUTS = frozenset({"image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids"})


def _sum_by_row(sizes: list[int], images_per_row: Sequence[int]) -> list[int]:
    out, i = [], 0
    for n in images_per_row:
        out.append(sum(sizes[i : i + n]))
        i += n
    return out


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA (peft)


def _own_multimodal_positions(model: torch.nn.Module) -> bool:
    """Whether the model's inner model lays out multimodal positions itself (Qwen-like RoPE)."""
    core = getattr(_base(model), "model", None)
    return any(hasattr(type(core), m) for m in ("compute_3d_position_ids", "get_rope_index"))


def _signature(function) -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(function).parameters)


def mm_token_types(
    input_ids: torch.Tensor, image_token_id: int | None, video_token_id: int | None
) -> torch.Tensor:
    """Qwen-VL's `mm_token_type_ids` for `input_ids`, as its processor makes them: 1 on image
    tokens, 2 on video tokens, 0 elsewhere. Multi-turn sequences need them over the whole
    sequence, images inside the response included (transformers' M-RoPE reads them)."""
    types = torch.zeros_like(input_ids)
    if image_token_id is not None:
        types = types.masked_fill(input_ids == image_token_id, 1)
    if video_token_id is not None:
        types = types.masked_fill(input_ids == video_token_id, 2)
    return types
