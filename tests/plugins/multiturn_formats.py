"""Test-only call formats: every model turn reads as a call to `zoom_in` on the first image's
top-left corner, so that a random tiny model's rollouts really are multi-turn (its tokens are
still its own samples, and the tool really runs).

`plugin_marked_zoom` also appends a line to the file named by `MMRL_TEST_CALL_MARKER` at each
turn it parses, so a test can tell that a run is inside a multi-turn step."""

from __future__ import annotations

import os

from mmrl.environments import ParsedTurn, ToolCall, register_call_format


@register_call_format("plugin_always_zoom")
def always_zoom(text: str) -> ParsedTurn:
    return ParsedTurn(
        calls=[ToolCall("zoom_in", {"bbox_2d": [0, 0, 32, 32]}, text)], errors=[], error_kinds=[]
    )


@register_call_format("plugin_marked_zoom")
def marked_zoom(text: str) -> ParsedTurn:
    marker = os.environ.get("MMRL_TEST_CALL_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write("call\n")
    return always_zoom(text)
