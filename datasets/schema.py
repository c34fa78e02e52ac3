"""Validation of sample records in V-Triune's sample-level format.

Every record is checked when it is loaded, never mid-training: required fields and their types,
the chat prompt, the images (decoded once to prove they are readable), the verifier name, and
the verifier's own view of the ground truth and parameters. Errors name where the record came
from (file and line, or record index), its id when it has one, and the field.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from pathlib import Path
from typing import Any

from PIL import Image

from mmrl.files import not_a_regular_file
from mmrl.types import (
    IMAGE_PLACEHOLDER,
    AgentSpec,
    EnvSpec,
    ImageError,
    ImageSource,
    RewardSpec,
    Sample,
    load_image,
)

_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")

MAX_PROMPT_CHARS = 200_000
"""Default limit on a record's prompt text (all messages together), in characters: a longer one
is refused at load time instead of dying later inside the tokenizer (`data.max_prompt_chars`)."""


MAX_ASPECT_RATIO = 200
"""Longest side over shortest side of an image a sample may have: the Qwen2-VL-family image
processors (the built-in base's among them) refuse more ("absolute aspect ratio must be smaller
than 200"), which would otherwise stop training mid-step without naming the sample."""


class SampleError(ValueError):
    """A record that is not a valid sample. The message says where and which field."""

    def __init__(self, where: str, field: str, problem: str, record_id: str | None = None):
        self.where = where
        self.field = field
        self.problem = problem
        self.record_id = record_id
        id_part = f" (id={record_id})" if record_id is not None else ""
        super().__init__(f"{where}{id_part}: field '{field}': {problem}")


def sample_from_record(
    record: Any,
    where: str,
    base_dir: Path | None = None,
    check_images: bool = True,
    max_prompt_chars: int = MAX_PROMPT_CHARS,
) -> Sample:
    """Validate one record and turn it into a `Sample`.

    Args:
        record: the parsed record (a dict).
        where: location for error messages, e.g. `"train.jsonl:17"`.
        base_dir: folder that relative image paths are resolved against.
        check_images: decode every image once to prove it is readable.
        max_prompt_chars: refuse a prompt whose text (all messages) is longer than this.
    """
    if not isinstance(record, dict):
        raise SampleError(where, "<record>", f"expected a JSON object, got {type(record).__name__}")
    extra = record.get("extra_info")
    if isinstance(extra, str):  # Parquet files written by mmrl keep it as a JSON string
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError:
            pass
    record_id = None
    if isinstance(extra, dict) and extra.get("id") is not None:
        record_id = str(extra["id"])

    def fail(field: str, problem: str) -> SampleError:
        return SampleError(where, field, problem, record_id)

    for name in ("data_source", "prompt", "reward_model", "extra_info"):
        if name not in record or record[name] is None:
            raise fail(name, "missing")
    data_source = record["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise fail("data_source", "must be a non-empty string")
    if not isinstance(extra, dict):
        raise fail("extra_info", f"must be an object, got {type(extra).__name__}")
    if record_id is None:
        raise fail("extra_info.id", "missing (every sample needs a unique id)")
    demonstration = extra.get("demonstration")
    if demonstration is not None and (not isinstance(demonstration, str) or not demonstration):
        raise fail(
            "extra_info.demonstration",
            f"must be a non-empty string (a reference response), got {type(demonstration).__name__}",
        )

    prompt = _check_prompt(record["prompt"], fail)
    n_chars = sum(
        len(m["content"])
        if isinstance(m["content"], str)
        else sum(len(part.get("text") or "") for part in m["content"] if part.get("type") == "text")
        for m in prompt
    )
    if n_chars > max_prompt_chars:
        raise fail(
            "prompt",
            f"{n_chars:,} characters of text, more than the limit of {max_prompt_chars:,} "
            "(data.max_prompt_chars)",
        )
    images = _check_images(record.get("images") or [], base_dir, check_images, fail)
    n_placeholders = sum(
        m["content"].count(IMAGE_PLACEHOLDER)
        if isinstance(m["content"], str)
        else sum(1 for part in m["content"] if part.get("type") == "image")
        for m in prompt
    )
    if n_placeholders != len(images):
        raise fail(
            "prompt",
            f"has {n_placeholders} '{IMAGE_PLACEHOLDER}' placeholder(s) but the record has "
            f"{len(images)} image(s); they must match one to one",
        )

    reward = _check_reward(record["reward_model"], fail)
    ability = record.get("ability") or ""
    if not isinstance(ability, str):
        raise fail("ability", f"must be a string, got {type(ability).__name__}")
    agent = _check_agent(record.get("agent"), fail)
    sample = Sample(
        data_source=data_source,
        prompt=prompt,
        images=images,
        ability=ability,
        reward_model=reward,
        extra_info=dict(extra),
        agent=agent,
    )

    from mmrl.verifiers.registry import get_verifier, verifier_names

    try:
        verifier = get_verifier(reward.verifier)
    except KeyError:
        raise fail(
            "reward_model.verifier",
            f"unknown verifier {reward.verifier!r} (known: {', '.join(verifier_names())})",
        ) from None
    try:
        verifier.check_sample(sample)
    except ValueError as exc:
        field = getattr(exc, "field", "reward_model.ground_truth")
        raise fail(field, str(exc)) from None
    return sample


def _check_prompt(prompt: Any, fail) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if hasattr(prompt, "tolist"):  # numpy arrays from Parquet
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt:
        raise fail("prompt", "must be a non-empty list of chat messages or a string")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise fail(f"prompt[{i}]", "must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant"):
            raise fail(f"prompt[{i}].role", f"must be system/user/assistant, got {role!r}")
        if hasattr(content, "tolist"):
            content = content.tolist()
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
                    raise fail(f"prompt[{i}].content[{j}]", "must be {'type': 'text'|'image', ...}")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise fail(f"prompt[{i}].content[{j}].text", "must be a string")
        elif not isinstance(content, str):
            raise fail(f"prompt[{i}].content", "must be a string or a list of parts")
        messages.append({"role": role, "content": content})
    return messages


def _check_images(images: Any, base_dir: Path | None, check: bool, fail) -> list[ImageSource]:
    if hasattr(images, "tolist"):
        images = images.tolist()
    if not isinstance(images, list):
        raise fail("images", f"must be a list, got {type(images).__name__}")
    out: list[ImageSource] = []
    for i, item in enumerate(images):
        field = f"images[{i}]"
        source = _image_source(item, base_dir, field, fail)
        if check:
            try:
                width, height = load_image(source).size
            except ImageError as exc:
                raise fail(field, str(exc)) from None
            if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
                what = source if isinstance(source, str) else "image"
                raise fail(
                    field,
                    f"{what}: {width}x{height} pixels, an aspect ratio of {max(width, height) / min(width, height):,.0f}:1, "
                    f"more than the {MAX_ASPECT_RATIO}:1 that VLM image processors take (Qwen2-VL's refuses it)",
                )
        out.append(source)
    return out


def _image_source(item: Any, base_dir: Path | None, field: str, fail) -> ImageSource:
    # Hugging Face datasets store images as {"bytes": ..., "path": ...}.
    if isinstance(item, dict):
        if item.get("bytes"):
            item = item["bytes"]
        elif item.get("path"):
            item = item["path"]
        elif item.get("image"):
            item = item["image"]
        else:
            raise fail(field, "image object needs 'bytes' or 'path'")
    if isinstance(item, Image.Image):
        return item
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if isinstance(item, str):
        if item.startswith("data:image/") and ";base64," in item:
            item = item.split(";base64,", 1)[1]
            return _b64(item, field, fail)
        path = Path(item)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if path.exists() or len(item) < 128 or not _BASE64.fullmatch(item[:4096]):
            problem = not_a_regular_file(path)  # from os.stat: opening a FIFO would block
            if problem is not None:
                raise fail(field, f"{path} {problem} (an image path names an image file)")
            return str(path)  # a missing file is reported when the image is checked
        return _b64(item, field, fail)
    raise fail(
        field, f"must be a path, bytes, base64 string or {{'bytes','path'}}, got {type(item).__name__}"
    )


def _b64(text: str, field: str, fail) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise fail(field, "neither an existing path nor valid base64") from None


def _check_agent(agent: Any, fail) -> AgentSpec | None:
    """The record's `agent` field: the tools the sample may call and its trajectory limits."""
    if agent is None:
        return None
    if isinstance(agent, str):  # Parquet columns may hold it as JSON text
        try:
            agent = json.loads(agent)
        except ValueError as exc:
            raise fail("agent", f"not valid JSON: {exc}") from None
    if not isinstance(agent, dict):
        raise fail("agent", f"must be an object, got {type(agent).__name__}")
    unknown = sorted(set(agent) - {"tools", "max_turns", "max_tokens", "max_images", "env"})
    if unknown:
        raise fail(
            f"agent.{unknown[0]}", "unknown field (known: tools, max_turns, max_tokens, max_images, env)"
        )
    tools = agent.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise fail("agent.tools", f"must be a list of tool names, got {tools!r}")
    from mmrl.environments import tool_names

    known = tool_names()
    for i, name in enumerate(tools):
        if name not in known:
            raise fail(f"agent.tools[{i}]", f"unknown tool {name!r} (known: {', '.join(known)})")
    limits = {}
    for name, low in (("max_turns", 1), ("max_tokens", 1), ("max_images", 0)):
        value = agent.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise fail(f"agent.{name}", f"must be an integer >= {low}, got {value!r}")
        limits[name] = value
    env = _check_env(agent.get("env"), fail)
    return AgentSpec(tools=list(tools), env=env, **limits)


def _check_env(env: Any, fail) -> EnvSpec | None:
    """The record's `agent.env`: `{"id": ..., "kwargs": {...}, "seed": int}`."""
    if env is None:
        return None
    if isinstance(env, str):
        env = {"id": env}
    if not isinstance(env, dict):
        raise fail("agent.env", f"must be an object with an 'id', got {type(env).__name__}")
    unknown = sorted(set(env) - {"id", "kwargs", "seed"})
    if unknown:
        raise fail(f"agent.env.{unknown[0]}", "unknown field (known: id, kwargs, seed)")
    env_id = env.get("id")
    if not isinstance(env_id, str) or not env_id:
        raise fail("agent.env.id", f"must be an environment name, got {env_id!r}")
    kwargs = env.get("kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise fail("agent.env.kwargs", f"must be an object of keyword arguments, got {kwargs!r}")
    seed = env.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise fail("agent.env.seed", f"must be an integer >= 0, got {seed!r}")
    return EnvSpec(id=env_id, kwargs=dict(kwargs), seed=seed)


def _check_reward(reward: Any, fail) -> RewardSpec:
    if not isinstance(reward, dict):
        raise fail("reward_model", f"must be an object, got {type(reward).__name__}")
    verifier = reward.get("verifier")
    if not isinstance(verifier, str) or not verifier:
        raise fail("reward_model.verifier", "missing (name of the verifier that scores this sample)")
    if "ground_truth" not in reward or reward["ground_truth"] is None:
        raise fail("reward_model.ground_truth", "missing")
    params = reward.get("verifier_params")
    if params is None:
        params = reward.get("verifier_parm")  # V-Triune's spelling
    if params is None:
        params = {}
    if isinstance(params, str):
        try:
            params = json.loads(params) if params.strip() else {}
        except json.JSONDecodeError as exc:
            raise fail("reward_model.verifier_params", f"not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise fail("reward_model.verifier_params", f"must be an object, got {type(params).__name__}")
    ratios = {}
    for name, default in (("accuracy_ratio", 1.0), ("format_ratio", 0.0)):
        value = reward.get(name, default)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise fail(f"reward_model.{name}", f"must be a number in [0, 1], got {value!r}")
        ratios[name] = float(value)
    ground_truth = reward["ground_truth"]
    if hasattr(ground_truth, "tolist"):
        ground_truth = ground_truth.tolist()
    models = reward.get("models") or []
    if isinstance(models, str):
        try:
            models = json.loads(models)
        except json.JSONDecodeError as exc:
            raise fail("reward_model.models", f"not valid JSON: {exc}") from None
    if hasattr(models, "tolist"):
        models = models.tolist()
    from mmrl.rewards.router_bridge import check_model_entries

    try:
        entries = check_model_entries(models, "reward_model.models")
    except ValueError as exc:
        raise fail("reward_model.models", str(exc)) from None
    return RewardSpec(
        ground_truth=ground_truth,
        verifier=verifier,
        verifier_params=dict(params),
        **ratios,
        models=[{"name": e.name, "weight": e.weight, "params": e.params} for e in entries],
    )
