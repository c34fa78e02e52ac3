"""Chat templates for multi-turn, tool-using rollouts, and the checks that keep them token-in/token-out.

`qwen_tool_template` is the Qwen2-VL chat template with Qwen2.5's tool section (hermes style:
`<tools>` in the system message, `<tool_call>` blocks in assistant turns, tool results grouped
into one user turn of `<tool_response>` blocks), keeping `mmrl.models.tokenizer.chat_template`'s
choice of no default system prompt when no tools are given.

A multi-turn trajectory (design.md, "Trajectory (multi-turn)") keeps the model's tokens exactly as
generated and tokenizes only the observations. That is right only if the template is
PREFIX-PRESERVING, which `qwen_tool_template` is; for any conversation
`[system?, user, assistant, tool..., assistant, tool..., ...]`:

1. `render(messages[:k], add_generation_prompt=True)` is a string prefix of
   `render(messages[:k+1])` whenever `messages[k]` is an assistant turn: the generation prompt
   `<|im_start|>assistant\\n` is where the model's text starts, and earlier turns never change
   when one is added (no "drop the reasoning of earlier turns" rule as in Qwen3's template).
2. With `cut` the position just after the stop token (`<|im_end|>`) that ends the last assistant
   turn of `render(messages)`, `render(messages)[:cut] + observation_text(tool_messages)
   == render(messages + tool_messages, add_generation_prompt=True)`.

Who emits the separator: the model's generated ids end with its stop token `<|im_end|>`; the
`\\n` the template writes after it is NOT the model's. It is the first character of the
observation text, which therefore reads `\\n<|im_start|>user\\n<tool_response>\\n...` and ends
with the next generation prompt `<|im_start|>assistant\\n`. Its tokens are observation tokens
(masked out of the loss).

`tokenization_drift` re-renders a finished conversation and compares it with the ids the model
actually saw, to catch a template or an observation builder that does not follow these rules.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from mmrl.models.tokenizer import QWEN_IMAGE, QWEN_VIDEO

log = logging.getLogger(__name__)

IM_END = "<|im_end|>"
"""The stop token that ends every turn of the Qwen templates."""

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
QWEN2_5_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
"""The system line Qwen2.5's template puts ahead of the tools when no system message is given
(pass it as `qwen_tool_template(default_system=...)` to render exactly as Qwen2.5 does)."""

ASSISTANT_END_MARK = "{#- assistant end -#}"
"""A Jinja comment right after the literal that closes an assistant turn in `qwen_tool_template`
(so a test can derive a variant that drops the separator)."""

_DUMMY_PREFIX: tuple[dict[str, Any], ...] = (
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
)


def _literal(text: str) -> str:
    # A Jinja string literal (JSON's escapes are a subset of Jinja's).
    return json.dumps(text, ensure_ascii=False)


def qwen_tool_template(
    image: str = QWEN_IMAGE, video: str = QWEN_VIDEO, default_system: str = "", system_without_tools: str = ""
) -> str:
    """Qwen2-VL's chat template with Qwen2.5's hermes tool section.

    - `tools` given: a system turn `[system message content + "\\n\\n" |
      default_system + "\\n\\n"] + TOOLS_PREAMBLE + one JSON line per tool + TOOLS_POSTAMBLE`,
      as Qwen2.5 renders it (Qwen2.5's own default is `QWEN2_5_DEFAULT_SYSTEM`; here none, so
      the tiny byte-level models are not drowned by it). No tools: the system message, if any,
      verbatim; else `system_without_tools` as the system turn if given (Qwen2-VL's own
      template always writes "You are a helpful assistant."), else none.
    - assistant turns verbatim: the content string (the model's text as generated, including any
      `<tool_call>` blocks it wrote), then one hermes block per entry of a `tool_calls` field
      (OpenAI style, `{"function": {"name", "arguments"}}` or `{"name", "arguments"}`;
      `arguments` a dict or an already-encoded JSON string).
    - consecutive `tool` messages become ONE user turn
      `<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>...<|im_end|>\\n`; a tool
      message's content is a string or a list of parts (`{"type": "text"}`, `{"type": "image"}`,
      `{"type": "video"}`).
    - image (video) parts anywhere become `image` (`video`), the placeholder the processor expands.

    Prefix-preserving (module docstring)."""
    return (
        "{%- macro render_content(content) -%}"
        "{%- if content is string -%}{{- content -}}"
        "{%- elif content is not none -%}"
        "{%- for part in content -%}"
        "{%- if part['type'] == 'image' or 'image' in part -%}"
        f"{{{{- {_literal(image)} -}}}}"
        "{%- elif part['type'] == 'video' or 'video' in part -%}"
        f"{{{{- {_literal(video)} -}}}}"
        "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{%- endmacro -%}"
        # -- system turn: the tools section, merged into a given system message
        "{%- if tools -%}"
        "{{- '<|im_start|>system\\n' -}}"
        "{%- if messages[0]['role'] == 'system' -%}"
        "{{- render_content(messages[0]['content']) + '\\n\\n' -}}"
        + (f"{{%- else -%}}{{{{- {_literal(default_system + chr(10) * 2)} -}}}}" if default_system else "")
        + "{%- endif -%}"
        f"{{{{- {_literal(TOOLS_PREAMBLE)} -}}}}"
        "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
        f"{{{{- {_literal(TOOLS_POSTAMBLE + IM_END + chr(10))} -}}}}"
        "{%- elif messages[0]['role'] == 'system' -%}"
        "{{- '<|im_start|>system\\n' + render_content(messages[0]['content']) + '<|im_end|>\\n' -}}"
        + (
            f"{{%- else -%}}{{{{- {_literal('<|im_start|>system' + chr(10) + system_without_tools + IM_END + chr(10))} -}}}}"
            if system_without_tools
            else ""
        )
        + "{%- endif -%}"
        # -- the turns
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' and loop.first -%}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{{- '<|im_start|>assistant' -}}"
        "{%- if message['content'] or not message['tool_calls'] -%}"
        "{{- '\\n' + render_content(message['content']) -}}"
        "{%- endif -%}"
        "{%- for tool_call in message['tool_calls'] or [] -%}"
        "{%- if tool_call['function'] is defined -%}{%- set tool_call = tool_call['function'] -%}{%- endif -%}"
        "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' -}}"
        "{%- if tool_call['arguments'] is string -%}{{- tool_call['arguments'] -}}"
        "{%- else -%}{{- tool_call['arguments'] | tojson -}}{%- endif -%}"
        "{{- '}\\n</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<|im_end|>\\n' -}}" + ASSISTANT_END_MARK + "{%- elif message['role'] == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' + render_content(message['content']) + '\\n</tool_response>' -}}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- else -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + render_content(message['content']) + '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


QWEN_TOOL_TEMPLATE = qwen_tool_template()

QWEN2_VL_DEFAULT_SYSTEM = "You are a helpful assistant."
"""The system turn Qwen2-VL's and Qwen2.5-VL's own templates write when a conversation has none."""


def handles_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (else tool schemas passed to it vanish)."""
    return re.search(r"\btools\b", template) is not None


def ensure_tool_template(processor: Any) -> str:
    """Make `processor` (and its tokenizer) render tools, before a tool-using rollout.

    Qwen2-VL's and Qwen2.5-VL's own templates have no tool section: `tools=` is ignored, so the
    model would never see the tool schemas, and a `tool` message renders as an untrained
    `<|im_start|>tool` turn. For such a template (recognised by Qwen's vision markers and its
    default system line), `qwen_tool_template` replaces it, keeping what the model's own
    template writes for conversations without tools (the default system line included), and
    adding Qwen2.5's hermes tool section with that default line ahead of the tools, as veRL's
    template does. Returns what was done:

    - `"own"`: the template already reads `tools` (the model's own is used);
    - `"mmrl"`: mmrl's tool template was installed (logged once);
    - `"none"`: any other template without a tool section (e.g. mmrl's built-in tiny bases,
      trained without schemas in the prompt): left as it is, with a warning that the schemas are
      not shown to the model, which then knows its tools only from training."""
    template = _template_of(processor, None)
    if handles_tools(template):
        return "own"
    if "<|im_start|>" in template and QWEN_IMAGE in template and QWEN2_VL_DEFAULT_SYSTEM in template:
        new = qwen_tool_template(
            default_system=QWEN2_VL_DEFAULT_SYSTEM, system_without_tools=QWEN2_VL_DEFAULT_SYSTEM
        )
        processor.chat_template = new
        tokenizer = _tokenizer_of(processor)
        if tokenizer is not processor:
            tokenizer.chat_template = new
        log.info(
            "the model's chat template (Qwen2-VL style) has no tool section: using mmrl's "
            "(mmrl.models.chat_templates.qwen_tool_template; unchanged for prompts without tools)"
        )
        return "mmrl"
    if template not in _WARNED:
        _WARNED.add(template)
        (log.info if _is_tiny_template(template) else log.warning)(
            "%s has no tool section: tool schemas are not shown to the model (it knows its tools only "
            "from training); give the model a chat template that reads `tools` to show them",
            _describe(template),
        )
    return "none"


_WARNED: set[str] = set()


def _is_tiny_template(template: str) -> bool:
    """Whether `template` is `mmrl.models.tokenizer.chat_template` with some image and video
    placeholders (the built-in tiny bases': no tool section by design, so not worth a warning)."""
    from mmrl.models.tokenizer import chat_template

    pos = 0
    for part in re.split("[\x00\x01]", chat_template("\x00", "\x01")):
        pos = template.find(part, pos)
        if pos < 0:
            return False
        pos += len(part)
    return True


def _tokenizer_of(tokenizer_or_processor: Any) -> Any:
    return getattr(tokenizer_or_processor, "tokenizer", tokenizer_or_processor)


def _template_of(tokenizer_or_processor: Any, template: str | None) -> str:
    if template is not None:
        return template
    found = getattr(tokenizer_or_processor, "chat_template", None)
    found = found or getattr(_tokenizer_of(tokenizer_or_processor), "chat_template", None)
    if not isinstance(found, str):
        raise ValueError(
            f"{type(tokenizer_or_processor).__name__} has no (single) chat template; pass template="
        )
    return found


def render(
    tokenizer_or_processor: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    template: str | None = None,
) -> str:
    """The chat template's text for `messages` (no tokenization). `template` defaults to the
    processor's, else the tokenizer's; a processor is rendered through its tokenizer (no image
    loading, placeholders stay unexpanded)."""
    return _tokenizer_of(tokenizer_or_processor).apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        chat_template=_template_of(tokenizer_or_processor, template),
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )


def _describe(template: str) -> str:
    head = template[:60].replace("\n", "\\n")
    return f"chat template {head!r}... ({len(template)} chars)"


def _stop_token(tokenizer_or_processor: Any) -> str:
    eos = getattr(_tokenizer_of(tokenizer_or_processor), "eos_token", None)
    return eos if isinstance(eos, str) and eos else IM_END


def observation_text(
    tokenizer_or_processor: Any, tool_messages: Sequence[dict[str, Any]], template: str | None = None
) -> str:
    """The text a group of tool messages adds after an assistant turn, up to and including the
    next generation prompt: it starts right after the model's stop token (`<|im_end|>`), so with
    the Qwen templates it reads `\\n<|im_start|>user\\n<tool_response>\\n...<|im_start|>assistant\\n`.

    Computed as veRL and TRL do: render a fixed dummy conversation ending in an assistant turn,
    render it again with `tool_messages` appended and the generation prompt, and take what the
    second adds after the first's stop token. Raises ValueError, naming the template, if the
    longer render does not start with the shorter (the template is not prefix-preserving) or the
    dummy assistant turn does not end with the tokenizer's eos token. Tokenize the result on its
    own (`add_special_tokens=False`, or through the processor when it holds images)."""
    if not tool_messages:
        raise ValueError("observation_text needs at least one tool message")
    template = _template_of(tokenizer_or_processor, template)
    stop = _stop_token(tokenizer_or_processor)
    short = render(tokenizer_or_processor, _DUMMY_PREFIX, template=template)
    long = render(
        tokenizer_or_processor,
        [*_DUMMY_PREFIX, *tool_messages],
        add_generation_prompt=True,
        template=template,
    )
    if not long.startswith(short):
        at = next((i for i, (a, b) in enumerate(zip(short, long)) if a != b), min(len(short), len(long)))
        raise ValueError(
            f"{_describe(template)} is not prefix-preserving: appending tool messages changes the text "
            f"before them at character {at} ({short[at - 20 : at + 20]!r} -> {long[at - 20 : at + 20]!r})"
        )
    end = short.rfind(stop)
    if end < 0 or short[end + len(stop) :].strip():
        raise ValueError(
            f"{_describe(template)}: the assistant turn does not end with the stop token {stop!r} "
            f"(rendered {short[-40:]!r})"
        )
    return long[end + len(stop) :]


def _pad_ids(tokenizer_or_processor: Any) -> set[int]:
    tok = _tokenizer_of(tokenizer_or_processor)
    ids = set()
    for name in ("image_token_id", "video_token_id"):
        value = getattr(tokenizer_or_processor, name, None)
        if isinstance(value, int):
            ids.add(value)
    vocab = tok.get_vocab()
    for token in ("<|image_pad|>", "<|video_pad|>"):
        if token in vocab:
            ids.add(vocab[token])
    return ids


def _collapse(ids: Sequence[int], pads: set[int]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i in pads and out and out[-1] == i:
            continue
        out.append(int(i))
    return out


def tokenization_drift(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    images_expand: Callable[[str], str] | None = None,
    template: str | None = None,
    stopped: bool = True,
) -> dict[str, Any]:
    """Compare the ids a multi-turn rollout actually fed the model (`prompt_ids + response_ids`,
    token-in/token-out: assistant turns as generated, observations tokenized alone) with a
    re-tokenization of the final conversation rendered by the chat template.

    `messages` is the whole conversation: the prompt's messages, each assistant turn with its text
    as generated (content = decoded ids without the stop token), each tool turn. `tokenizer` is a
    tokenizer or a processor (its tokenizer tokenizes; its template renders unless `template`).

    The render is cut where the model stopped: after the stop token of a final assistant turn
    (the separator after it was never fed), or, with `stopped=False` (the last turn ran out of
    length), before that stop token; a conversation ending in tool messages is rendered with
    the generation prompt.

    Images: the processor expands one image pad per merged patch, the render holds one per image.
    With `images_expand` (a function rewriting the rendered text's placeholders as the processor
    would, e.g. `lambda t: t.replace("<|image_pad|>", "<|image_pad|>" * 16)`), both sequences are
    compared as they are. Without it, every run of a repeated image/video pad id is collapsed to
    one in both: a missing or extra image still shows, a wrong pad count per image does not (that
    count is the processor's business, not the template's).

    Returns `{"drift_tokens": positions from the first difference to the end of the longer
    sequence (0 if identical), "first_diff": that index or -1, "equal": bool}`; indices are in
    the (collapsed, when collapsing) sequences."""
    tok = _tokenizer_of(tokenizer)
    messages = list(messages)
    ends_with_assistant = bool(messages) and messages[-1]["role"] == "assistant"
    text = render(
        tokenizer, messages, tools, add_generation_prompt=not ends_with_assistant, template=template
    )
    if ends_with_assistant:
        stop = _stop_token(tokenizer)
        end = text.rfind(stop)
        if end >= 0:
            text = text[: end + len(stop)] if stopped else text[:end]
    if images_expand is not None:
        text = images_expand(text)
    rendered = list(tok(text, add_special_tokens=False)["input_ids"])
    seen = [int(i) for i in prompt_ids] + [int(i) for i in response_ids]
    if images_expand is None:
        pads = _pad_ids(tokenizer)
        rendered, seen = _collapse(rendered, pads), _collapse(seen, pads)
    first = next((i for i, (a, b) in enumerate(zip(seen, rendered)) if a != b), None)
    if first is None and len(seen) != len(rendered):
        first = min(len(seen), len(rendered))
    if first is None:
        return {"drift_tokens": 0, "first_diff": -1, "equal": True}
    return {"drift_tokens": max(len(seen), len(rendered)) - first, "first_diff": first, "equal": False}
