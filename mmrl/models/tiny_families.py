"""Tiny random VLMs of the other families, built from config offline: LLaVA 1.5, LLaVA-NeXT,
LLaVA-OneVision, Idefics3, SmolVLM, Gemma 3 and InternVL (the Qwen-VL ones are in `tiny.py`).

Each is the real transformers architecture (`AutoModelForImageTextToText` loads it back) with
its real processor around the byte tokenizer, which gets the family's image tokens and the
attributes its processor reads. Sizes follow `TinyVLMSpec`: the text model is the spec's, the
vision tower is `vision_depth` x `vision_width` with `patch_size`-pixel patches, and where the
family merges patches (pixel shuffle, pooling) it merges `merge_size`^2 of them, so a
`image_size`-pixel image is (image_size / patch_size / merge_size)^2 = 16 language-model tokens
by default, as on the Qwen models. LLaVA, which does not merge, takes patches of
patch_size x merge_size pixels instead; the tiling families (LLaVA-NeXT / OneVision, and
InternVL and Idefics3 for images larger than a tile) add one tile's tokens per extra tile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedConfig, PreTrainedTokenizerFast, ProcessorMixin

from mmrl.models.tiny_spec import decoder_dims
from mmrl.models.tokenizer import build_byte_tokenizer, chat_template

if TYPE_CHECKING:
    from mmrl.models.tiny_spec import TinyVLMSpec

# What each family adds to the byte tokenizer: tokens, named tokenizer attributes (read by its
# processor), and the placeholder its chat template writes for an image.
_TOKENS: dict[str, tuple[tuple[str, ...], dict[str, str], str]] = {
    "llava": (("<image>",), {}, "<image>"),
    "llava_next": (("<image>",), {}, "<image>"),
    "llava_onevision": (("<image>", "<video>"), {}, "<image>"),
    "idefics3": (
        ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"),
        {},
        "<image>",
    ),
    "smolvlm": (
        ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"),
        {},
        "<image>",
    ),
    "gemma3": (
        ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        "<start_of_image>",
    ),
    "internvl": (
        ("<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
        {
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
        "<IMG_CONTEXT>",
    ),
}
# Idefics3 / SmolVLM write a tile's position as a token (up to 6 x 6 tiles).
_TILE_TOKENS = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))

ARCHITECTURES = tuple(_TOKENS)
"""The families built here (`TinyVLMSpec.architecture`)."""


def family_tokenizer(architecture: str) -> PreTrainedTokenizerFast:
    """The byte tokenizer with `architecture`'s image tokens and chat template."""
    tokens, named, image = _TOKENS[architecture]
    if architecture in ("idefics3", "smolvlm"):
        tokens = tokens + _TILE_TOKENS
    return build_byte_tokenizer(tokens, named, chat_template(image=image, video="<video>"))


def build_family_processor(spec: TinyVLMSpec) -> ProcessorMixin:
    """`spec.architecture`'s processor around its byte tokenizer, sized for `spec`."""
    return _PROCESSORS[spec.architecture](spec, family_tokenizer(spec.architecture))


def family_config(spec: TinyVLMSpec) -> PreTrainedConfig:
    """`spec.architecture`'s model config, its token ids those of `family_tokenizer`."""
    tokenizer = family_tokenizer(spec.architecture)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
    text = dict(
        **decoder_dims(spec, len(tokenizer)),
        max_position_embeddings=4096,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        hidden_size=spec.vision_width,
        intermediate_size=spec.vision_width * 2,
        num_hidden_layers=spec.vision_depth,
        num_attention_heads=spec.vision_heads,
        patch_size=spec.patch_size,
        image_size=spec.image_size,
    )
    return _CONFIGS[spec.architecture](spec, text, vision, ids)


def draw_zero_initialised(model: torch.nn.Module, spec: TinyVLMSpec) -> None:
    """Draw the weights a family's own initialisation leaves at zero where that makes a random
    model blind to images. Gemma 3's connector projects the pooled vision features with
    `mm_input_projection_weight`, which transformers initialises to zeros (a real checkpoint
    loads trained values over it): every image token's embedding is then 0 whatever the pixels.
    It is drawn like the other linear weights, N(0, initializer_range^2), from the global RNG the
    builder seeded. (`mm_soft_emb_norm.weight` is zero too, but Gemma's RMSNorm scales by
    1 + weight: zero is its identity, not a blind spot.)"""
    if spec.architecture == "gemma3":
        projector = model.model.multi_modal_projector
        std = model.config.text_config.initializer_range
        with torch.no_grad():
            projector.mm_input_projection_weight.normal_(0.0, std)


def _tile(spec: TinyVLMSpec) -> int:
    """Tile side of the tiling LLaVA families: half the image, so 16 tokens a tile by default."""
    return spec.image_size // spec.merge_size


# --- configs -------------------------------------------------------------------------------


def _llava(spec, text, vision, ids):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(**{**vision, "patch_size": spec.patch_size * spec.merge_size})
    return LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(**text),
        image_token_index=ids["<image>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=(spec.image_size // (spec.patch_size * spec.merge_size)) ** 2,
    )


def _pinpoints(spec: TinyVLMSpec) -> list[list[int]]:
    t = _tile(spec)
    return [[t, t], [t, 2 * t], [2 * t, t], [2 * t, 2 * t]]


def _llava_next(spec, text, vision, ids):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig

    return LlavaNextConfig(
        vision_config=CLIPVisionConfig(**{**vision, "image_size": _tile(spec)}),
        text_config=LlamaConfig(**text),
        image_token_index=ids["<image>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=_pinpoints(spec),
        image_seq_length=(_tile(spec) // spec.patch_size) ** 2,
    )


def _llava_onevision(spec, text, vision, ids):
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    return LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**{**vision, "image_size": _tile(spec)}),
        text_config=Qwen2Config(**text),
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        image_grid_pinpoints=_pinpoints(spec),
    )


def _idefics3(spec, text, vision, ids):
    from transformers import Idefics3Config, LlamaConfig

    return Idefics3Config(
        vision_config=vision,
        text_config=LlamaConfig(**text),
        image_token_id=ids["<image>"],
        scale_factor=spec.merge_size,
    )


def _smolvlm(spec, text, vision, ids):
    from transformers import LlamaConfig, SmolVLMConfig

    return SmolVLMConfig(
        vision_config=vision,
        text_config=LlamaConfig(**text),
        image_token_id=ids["<image>"],
        scale_factor=spec.merge_size,
    )


def _gemma3(spec, text, vision, ids):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    head_dim = spec.hidden_size // spec.num_heads
    text_config = Gemma3TextConfig(
        **text,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=512,
        sliding_window_pattern=2,
    )
    return Gemma3Config(
        text_config=text_config,
        vision_config=SiglipVisionConfig(**vision),
        mm_tokens_per_image=(spec.image_size // spec.patch_size // spec.merge_size) ** 2,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )


def _internvl(spec, text, vision, ids):
    from transformers import InternVLConfig, Qwen2Config

    return InternVLConfig(
        vision_config=dict(vision, use_mean_pooling=False),
        text_config=Qwen2Config(**text),
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=_image_tokens(spec),
        downsample_ratio=1 / spec.merge_size,
    )


def _image_tokens(spec: TinyVLMSpec) -> int:
    return (spec.image_size // spec.patch_size // spec.merge_size) ** 2


# --- processors ----------------------------------------------------------------------------


def _llava_processor(spec, tokenizer):
    from transformers import CLIPImageProcessor, LlavaProcessor

    side = spec.image_size
    return LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        ),
        tokenizer=tokenizer,
        patch_size=spec.patch_size * spec.merge_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by the "default" strategy
        chat_template=tokenizer.chat_template,
    )


def _llava_next_processor(spec, tokenizer):
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    t = _tile(spec)
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": t}, crop_size={"height": t, "width": t}, image_grid_pinpoints=_pinpoints(spec)
    )
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )


def _llava_onevision_processor(spec, tokenizer):
    from transformers import (
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    t = _tile(spec)
    size = {"height": t, "width": t}
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=_pinpoints(spec)),
        video_processor=LlavaOnevisionVideoProcessor(size=size),
        tokenizer=tokenizer,
        num_image_tokens=(t // spec.patch_size) ** 2,
        vision_feature_select_strategy="full",
        chat_template=tokenizer.chat_template,
    )


def _idefics3_processor(spec, tokenizer):
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    side = {"longest_edge": spec.image_size}
    return Idefics3Processor(
        image_processor=Idefics3ImageProcessor(size=side, max_image_size=side, do_image_splitting=True),
        tokenizer=tokenizer,
        image_seq_len=_image_tokens(spec),
        chat_template=tokenizer.chat_template,
    )


def _smolvlm_processor(spec, tokenizer):
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    side = {"longest_edge": spec.image_size}
    return SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(size=side, max_image_size=side, do_image_splitting=True),
        video_processor=SmolVLMVideoProcessor(size=side, max_image_size=side),
        tokenizer=tokenizer,
        image_seq_len=_image_tokens(spec),
        chat_template=tokenizer.chat_template,
    )


def _gemma3_processor(spec, tokenizer):
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    side = spec.image_size
    return Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": side, "width": side}),
        tokenizer=tokenizer,
        image_seq_length=_image_tokens(spec),
        chat_template=tokenizer.chat_template,
    )


def _internvl_processor(spec, tokenizer):
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    size = {"height": spec.image_size, "width": spec.image_size}
    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, max_patches=4),
        video_processor=InternVLVideoProcessor(size=size),
        tokenizer=tokenizer,
        image_seq_length=_image_tokens(spec),
        chat_template=tokenizer.chat_template,
    )


_CONFIGS: dict[str, Callable] = {
    "llava": _llava,
    "llava_next": _llava_next,
    "llava_onevision": _llava_onevision,
    "idefics3": _idefics3,
    "smolvlm": _smolvlm,
    "gemma3": _gemma3,
    "internvl": _internvl,
}
_PROCESSORS: dict[str, Callable] = {
    "llava": _llava_processor,
    "llava_next": _llava_next_processor,
    "llava_onevision": _llava_onevision_processor,
    "idefics3": _idefics3_processor,
    "smolvlm": _smolvlm_processor,
    "gemma3": _gemma3_processor,
    "internvl": _internvl_processor,
}
