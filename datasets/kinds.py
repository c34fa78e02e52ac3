"""The registry of procedural kinds: what a kind draws (`Drawn`) and how it is registered.

The floor under the kinds: `vision_reasoning.py` and `perception.py` register theirs here, and
`procedural.py`, above them all, imports them and turns kinds into samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image


@dataclass
class Drawn:
    """One generated example."""

    image: Image.Image | None
    """The prompt's image; None for a kind whose picture comes from its environment's reset."""
    question: str
    ground_truth: Any
    reference: str
    """An ideal response (the supervised warm-up of the built-in base trains on it)."""
    verifier: str = "math"
    verifier_params: dict[str, Any] = field(default_factory=dict)
    ability: str = "math"
    details: dict[str, Any] = field(default_factory=dict)
    agent: dict[str, Any] | None = None
    """The sample's tools and limits (its `agent` field), for kinds that need a tool."""


@dataclass(frozen=True)
class Kind:
    name: str
    task: str
    """Task family, the first part of the data source (`vision_reasoning/colour_code`)."""
    stream: int
    """Fixed random-stream id, so adding kinds never changes another kind's data."""
    draw: Callable[..., Drawn]
    takes_split: bool = False
    """`draw(rng, size, split)`: the kind keeps its own held-out items out of the other splits
    (e.g. `minigrid`'s layouts), beyond drawing each split from its own random stream."""


_KINDS: dict[str, Kind] = {}


def register_kind(name: str, task: str, stream: int, takes_split: bool = False):
    def wrap(fn: Callable[..., Drawn]):
        if name in _KINDS or any(k.stream == stream for k in _KINDS.values()):
            raise ValueError(f"kind {name!r} or stream {stream} already registered")
        _KINDS[name] = Kind(name, task, stream, fn, takes_split)
        return fn

    return wrap


def registered_kinds() -> dict[str, Kind]:
    """The kinds registered so far, by name (`procedural.kinds()` has every built-in one)."""
    return dict(_KINDS)
