"""The shape of a built-in tiny VLM and the architecture names, without torch or transformers.

`mmrl.config` holds a `TinyVLMSpec` and checks `model.tiny.architecture` against
`TINY_ARCHITECTURES`; keeping them here lets `import mmrl.config` stay light (a config error or
`--help` answers before torch loads). The builders are in `mmrl.models.tiny` and
`mmrl.models.tiny_families`.
"""

from __future__ import annotations

from dataclasses import dataclass

QWEN_ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
"""The Qwen-VL families `mmrl.models.tiny` builds."""

FAMILY_ARCHITECTURES = ("llava", "llava_next", "llava_onevision", "idefics3", "smolvlm", "gemma3", "internvl")
"""The other families, built by `mmrl.models.tiny_families` (its `ARCHITECTURES`, in the same order)."""

TINY_ARCHITECTURES = QWEN_ARCHITECTURES + FAMILY_ARCHITECTURES
"""Every `TinyVLMSpec.architecture` that can be built."""


@dataclass
class TinyVLMSpec:
    """Shape of a tiny built-in VLM. Defaults: the measured ~0.5M-parameter Qwen2-VL."""

    architecture: str = "qwen2_vl"
    """`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`, `qwen3_vl_moe` (Qwen3-VL with a mixture-of-experts
    language model: 4 experts, top-2 routing, experts half of `intermediate_size` wide), or one of
    `mmrl.models.tiny_families.ARCHITECTURES` (`llava`, `llava_next`, `llava_onevision`,
    `idefics3`, `smolvlm`, `gemma3`, `internvl`)."""
    hidden_size: int = 128
    """Text width; also the vision merger's output width."""
    num_layers: int = 2
    """Text decoder layers."""
    num_heads: int = 4
    """Text attention heads (head size = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Text key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """Text MLP width."""
    vision_depth: int = 2
    """Vision transformer blocks."""
    vision_width: int = 64
    """Vision transformer width."""
    vision_heads: int = 4
    """Vision attention heads."""
    patch_size: int = 8
    """Vision patch size in pixels."""
    merge_size: int = 2
    """Spatial merge: merge_size^2 patches become one language-model token."""
    image_size: int = 64
    """Images are resized so both sides are this many pixels (fixed token count per image)."""


def decoder_dims(spec: object, vocab_size: int) -> dict[str, int]:
    """The decoder sizes every tiny language model here shares, as transformers' config keys:
    from a spec with `hidden_size`, `intermediate_size`, `num_layers`, `num_heads` and
    `num_kv_heads` (a `TinyVLMSpec`, the planner's `PlannerSpec`)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
    )
