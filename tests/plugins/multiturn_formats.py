"""A test-only call format: every model turn reads as a call to `zoom_in` on the first image's
top-left corner, so that a random tiny model's rollouts really are multi-turn (its tokens are
still its own samples, and the tool really runs)."""

from __future__ import annotations

from mmrl.environments import ParsedTurn, ToolCall, register_call_format


@register_call_format("plugin_always_zoom")
def always_zoom(text: str) -> ParsedTurn:
    return ParsedTurn(calls=[ToolCall("zoom_in", {"bbox_2d": [0, 0, 32, 32]}, text)], errors=[], error_kinds=[])
