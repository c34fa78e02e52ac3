"""Tiny VLMs built from config: the real architectures, ~0.5M parameters.

The Qwen-VL families are built here; LLaVA (1.5 / NeXT / OneVision), Idefics3, SmolVLM, Gemma 3
and InternVL in `mmrl.models.tiny_families`, through the same two functions. Everything here
runs offline. For the Qwen models, the processor pairs the byte tokenizer with the real Qwen2-VL
image and video processors; patch and merge sizes match the vision config so that a 64x64 image
becomes (64/8/2)^2 = 16 image tokens.
"""

from __future__ import annotations

import torch
from transformers import (
    PreTrainedModel,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from mmrl.models.tiny_spec import QWEN_ARCHITECTURES, TINY_ARCHITECTURES, TinyVLMSpec, decoder_dims
from mmrl.models.tokenizer import build_byte_tokenizer

TINY_MOE_EXPERTS = 4
"""Experts per MoE layer of the tiny `qwen3_vl_moe` (every text layer is sparse)."""
TINY_MOE_TOP_K = 2
"""Experts each token is routed to in the tiny `qwen3_vl_moe`."""


def architectures() -> tuple[str, ...]:
    """Every `TinyVLMSpec.architecture` that can be built."""
    return TINY_ARCHITECTURES


def _check(spec: TinyVLMSpec) -> None:
    if spec.architecture not in architectures():
        raise ValueError(
            f"unknown tiny architecture {spec.architecture!r}: expected one of {', '.join(architectures())}"
        )


def build_processor(spec: TinyVLMSpec) -> ProcessorMixin:
    """The family's processor around the byte tokenizer, sized for `spec`."""
    _check(spec)
    if spec.architecture not in QWEN_ARCHITECTURES:
        from mmrl.models.tiny_families import build_family_processor

        return build_family_processor(spec)
    tokenizer = build_byte_tokenizer()
    pixels = spec.image_size * spec.image_size
    vision_kwargs = dict(
        patch_size=spec.patch_size,
        merge_size=spec.merge_size,
        temporal_patch_size=2,
        size={"shortest_edge": pixels, "longest_edge": pixels},
    )
    if spec.architecture in ("qwen3_vl", "qwen3_vl_moe"):
        from transformers import Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        return Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(**vision_kwargs),
            video_processor=Qwen3VLVideoProcessor(**vision_kwargs),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision_kwargs),
        video_processor=Qwen2VLVideoProcessor(**vision_kwargs),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def build_tiny_vlm(spec: TinyVLMSpec, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised tiny VLM whose special-token ids match its processor's tokenizer."""
    _check(spec)
    if spec.architecture not in QWEN_ARCHITECTURES:
        return _build_family_vlm(spec, seed)
    tokenizer = build_byte_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
    head_dim = spec.hidden_size // spec.num_heads
    # mrope splits head_dim/2 rotary frequencies over (time, height, width); Qwen uses 1:1.5:1.5.
    half = head_dim // 2
    t_part = half // 4
    h_part = (half - t_part) // 2
    mrope_section = [t_part, h_part, half - t_part - h_part]
    text_config = dict(
        **decoder_dims(spec, len(tokenizer)),
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    token_ids = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    if spec.architecture == "qwen2_vl":
        vision_config = dict(
            depth=spec.vision_depth,
            embed_dim=spec.vision_width,
            hidden_size=spec.hidden_size,
            num_heads=spec.vision_heads,
            mlp_ratio=2,
            patch_size=spec.patch_size,
            spatial_merge_size=spec.merge_size,
            temporal_patch_size=2,
        )
        config = Qwen2VLConfig(text_config=text_config, vision_config=vision_config, **token_ids)
        model_cls = Qwen2VLForConditionalGeneration
    elif spec.architecture == "qwen2_5_vl":
        window = spec.patch_size * spec.merge_size * 2
        vision_config = dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_width,
            out_hidden_size=spec.hidden_size,
            intermediate_size=spec.vision_width * 2,
            num_heads=spec.vision_heads,
            patch_size=spec.patch_size,
            spatial_merge_size=spec.merge_size,
            temporal_patch_size=2,
            window_size=window,
            fullatt_block_indexes=[spec.vision_depth - 1],
        )
        config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **token_ids)
        model_cls = Qwen2_5_VLForConditionalGeneration
    else:  # qwen3_vl, qwen3_vl_moe
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        text_config["head_dim"] = head_dim
        text_config["rope_parameters"]["mrope_interleaved"] = True
        patches_per_side = spec.image_size // spec.patch_size
        vision_config = dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_width,
            intermediate_size=spec.vision_width * 2,
            num_heads=spec.vision_heads,
            patch_size=spec.patch_size,
            spatial_merge_size=spec.merge_size,
            temporal_patch_size=2,
            out_hidden_size=spec.hidden_size,
            num_position_embeddings=patches_per_side * patches_per_side,
            deepstack_visual_indexes=[0],
        )
        if spec.architecture == "qwen3_vl_moe":
            from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

            text_config.update(
                num_experts=TINY_MOE_EXPERTS,
                num_experts_per_tok=TINY_MOE_TOP_K,
                moe_intermediate_size=max(1, spec.intermediate_size // 2),
                decoder_sparse_step=1,
            )
            config = Qwen3VLMoeConfig(text_config=text_config, vision_config=vision_config, **token_ids)
            model_cls = Qwen3VLMoeForConditionalGeneration
        else:
            config = Qwen3VLConfig(text_config=text_config, vision_config=vision_config, **token_ids)
            model_cls = Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    return _with_generation_ids(model_cls(config), ids)


def _build_family_vlm(spec: TinyVLMSpec, seed: int) -> PreTrainedModel:
    from transformers import AutoModelForImageTextToText

    from mmrl.models.tiny_families import draw_zero_initialised, family_config, family_tokenizer

    tokenizer = family_tokenizer(spec.architecture)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    config = family_config(spec)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    draw_zero_initialised(model, spec)  # a random model must see its images (Gemma 3's connector)
    return _with_generation_ids(model, ids)


def _with_generation_ids(model: PreTrainedModel, ids: dict[str, int]) -> PreTrainedModel:
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    return model
