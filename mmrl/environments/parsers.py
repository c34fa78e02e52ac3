"""Reading tool calls out of a model's turn, and writing them (for demonstrations).

Formats are registered by name, like tools. The built-in "hermes" format is Qwen's (Qwen2.5-VL,
Qwen3-VL and their chat templates): each call is a block

    <tool_call>
    {"name": "zoom_in", "arguments": {"bbox_2d": [10, 20, 60, 80]}}
    </tool_call>

A malformed call is never dropped silently: it becomes one error message with its kind, so the
model reads back what was wrong and the run counts it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from mmrl.environments.tools import Observation, ParsedTurn, ToolCall

Parser = Callable[[str], ParsedTurn]
Renderer = Callable[[ToolCall], str]

_PARSERS: dict[str, Parser] = {}
_RENDERERS: dict[str, Renderer] = {}


def register_call_format(name: str, render: Renderer | None = None) -> Callable[[Parser], Parser]:
    """Decorator: register a parser `text -> ParsedTurn` as format `name`, with an optional
    `render(call) -> str` that writes one call in the format (for `tool_call_text`)."""

    def wrap(fn: Parser) -> Parser:
        if name in _PARSERS:
            raise ValueError(f"tool-call format {name!r} is already registered")
        _PARSERS[name] = fn
        if render is not None:
            _RENDERERS[name] = render
        return fn

    return wrap


def call_format_names() -> list[str]:
    """The registered tool-call formats, sorted."""
    return sorted(_PARSERS)


def parse_tool_calls(text: str, fmt: str = "hermes") -> ParsedTurn:
    """Every tool call in one model turn, read in format `fmt` (KeyError if unknown)."""
    try:
        parser = _PARSERS[fmt]
    except KeyError:
        raise KeyError(
            f"unknown tool-call format {fmt!r}; registered: {', '.join(call_format_names())}"
        ) from None
    return parser(text)


def tool_call_text(call: ToolCall | dict[str, Any], fmt: str = "hermes") -> str:
    """One call written in format `fmt`, as a model would write it (a `ToolCall` or a
    {"name": ..., "arguments": {...}} dict)."""
    if isinstance(call, dict):
        call = ToolCall(name=call["name"], arguments=dict(call.get("arguments") or {}), raw="")
    try:
        render = _RENDERERS[fmt]
    except KeyError:
        raise KeyError(f"tool-call format {fmt!r} has no renderer") from None
    return render(call)


# ---------------------------------------------------------------------------------------------
# hermes (Qwen)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _short(message: str, limit: int = 120) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _read_hermes_call(body: str, number: int) -> tuple[ToolCall | None, str, str]:
    """One block's call, or None with the error kind and message."""
    body = body.strip()
    fenced = _FENCE.match(body)  # some models wrap the JSON in a ```json fence
    if fenced:
        body = fenced.group(1)
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, "bad_json", f"tool call {number}: bad JSON ({_short(str(exc))})"
    if not isinstance(payload, dict):
        kind = type(payload).__name__
        return None, "bad_json", f"tool call {number}: expected a JSON object, got {kind}"
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, "no_name", f'tool call {number}: no tool name (a "name" string is required)'
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return None, "bad_arguments", f"tool call {number}: arguments are bad JSON ({_short(str(exc))})"
    if not isinstance(arguments, dict):
        kind = type(arguments).__name__
        return None, "bad_arguments", f"tool call {number}: arguments must be a JSON object, got {kind}"
    return ToolCall(name=name.strip(), arguments=arguments, raw=""), "", ""


def _parse_hermes(text: str) -> ParsedTurn:
    turn = ParsedTurn(calls=[], errors=[], error_kinds=[], error_indices=[])
    end = 0
    index = 0
    for match in _BLOCK.finditer(text):
        call, kind, message = _read_hermes_call(match.group(1), index + 1)
        if call is None:
            turn.errors.append(message)
            turn.error_kinds.append(kind)
            turn.error_indices.append(index)
        else:
            call.raw = match.group(0)
            call.index = index
            turn.calls.append(call)
        end = match.end()
        index += 1
    if _OPEN in text[end:]:  # cut off mid-call (length limit or a stop string)
        turn.errors.append(f"tool call {index + 1}: bad JSON (unclosed {_OPEN}, no {_CLOSE})")
        turn.error_kinds.append("bad_json")
        turn.error_indices.append(index)
    return turn


def _render_hermes(call: ToolCall) -> str:
    payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{_OPEN}\n{payload}\n{_CLOSE}"


register_call_format("hermes", render=_render_hermes)(_parse_hermes)


# ---------------------------------------------------------------------------------------------
# Putting a turn's observations back in order


def error_observations(turn: ParsedTurn) -> list[Observation]:
    """One error observation per malformed call of the turn, in order."""
    return [
        Observation(text=msg, error=kind) for msg, kind in zip(turn.errors, turn.error_kinds, strict=True)
    ]


def merge_observations(turn: ParsedTurn, call_observations: Sequence[Observation]) -> list[Observation]:
    """One observation per `<tool_call>` block of the turn, in the order written: the run calls'
    observations (`call_observations`, parallel to `turn.calls`) with the malformed calls' errors
    in between, so the model reads back one answer per call it wrote."""
    if len(call_observations) != len(turn.calls):
        raise ValueError(f"{len(call_observations)} observations for {len(turn.calls)} calls")
    placed: list[tuple[int, int, Observation]] = []
    for n, (call, obs) in enumerate(zip(turn.calls, call_observations, strict=True)):
        placed.append((call.index if call.index >= 0 else n, 0, obs))
    for index, obs in zip(
        turn.error_indices or range(len(turn.errors)), error_observations(turn), strict=True
    ):
        placed.append((index, 1, obs))
    return [obs for _, _, obs in sorted(placed, key=lambda item: (item[0], item[1]))]
