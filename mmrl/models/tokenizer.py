"""An offline byte-level tokenizer with the Qwen special tokens and chat template.

The tiny built-in models use it so nothing is ever downloaded: a BPE model over the 256 byte
symbols with no merges (every byte is one token), wrapped in `PreTrainedTokenizerFast`, plus
the special tokens a Qwen2-VL processor expects. Other families add their own image tokens (and
the named attributes their processors read, e.g. Gemma 3's `tokenizer.boi_token`) and put their
own image placeholder in the chat template (`mmrl.models.tiny_families`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def chat_template(image: str = QWEN_IMAGE, video: str = QWEN_VIDEO) -> str:
    """Qwen's template, trimmed: no default system prompt (every byte is a token here, so a
    long system prompt would dominate the sequence). Each image (video) part becomes `image`
    (`video`): the placeholder the family's processor expands into image tokens."""
    return (
        "{%- for message in messages -%}"
        "<|im_start|>{{ message['role'] + '\\n' }}"
        "{%- if message['content'] is string -%}"
        "{{ message['content'] }}"
        "{%- else -%}"
        "{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' or 'image' in part -%}"
        f"{image}"
        "{%- elif part['type'] == 'video' or 'video' in part -%}"
        f"{video}"
        "{%- elif part['type'] == 'text' -%}"
        "{{ part['text'] }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


CHAT_TEMPLATE = chat_template()


def build_byte_tokenizer(
    extra_tokens: Sequence[str] = (),
    named_tokens: Mapping[str, str] | None = None,
    template: str = CHAT_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0..255 are bytes, then the special tokens in `SPECIAL_TOKENS`,
    then `extra_tokens` (a family's image tokens). `named_tokens` become tokenizer attributes
    (`{"boi_token": "<start_of_image>"}` gives `tokenizer.boi_token` and `.boi_token_id`), as
    processors read them; `template` is the chat template."""
    specials = list(SPECIAL_TOKENS) + [t for t in extra_tokens if t not in SPECIAL_TOKENS]
    byte_symbols = list(pre_tokenizers.ByteLevel.alphabet())
    byte_symbols.sort(key=lambda s: _byte_of_symbol()[s])
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols)}
    for token in specials:
        vocab[token] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.add_special_tokens(specials)
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials,
        padding_side="left",
        chat_template=template,
        model_max_length=4096,
        **dict(named_tokens or {}),
    )
    return tokenizer


def _byte_of_symbol() -> dict[str, int]:
    # GPT-2's reversible byte -> printable-unicode map, inverted.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes)}
