"""Procedural data: kinds of drawn images with questions, turned into samples.

A *kind* is a function `(rng, image_size) -> Drawn` registered with `register_kind`. The built-in
kinds live in `vision_reasoning.py` (numeric questions, math verifier) and `perception.py`
(detection, grounding, OCR, counting). `make_samples` is deterministic in its arguments; the
`train`, `validation` and `heldout` splits draw from independent random streams.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from mmrl.types import RewardSpec, Sample

SPLITS = {"train": 0, "heldout": 1, "validation": 2}


@dataclass
class Drawn:
    """One generated example."""

    image: Image.Image
    question: str
    ground_truth: Any
    reference: str
    """An ideal response (the supervised warm-up of the built-in base trains on it)."""
    verifier: str = "math"
    verifier_params: dict[str, Any] = field(default_factory=dict)
    ability: str = "math"
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Kind:
    name: str
    task: str
    """Task family, the first part of the data source (`vision_reasoning/colour_code`)."""
    stream: int
    """Fixed random-stream id, so adding kinds never changes another kind's data."""
    draw: Callable[[np.random.Generator, int], Drawn]


_KINDS: dict[str, Kind] = {}


def register_kind(name: str, task: str, stream: int):
    def wrap(fn: Callable[[np.random.Generator, int], Drawn]):
        if name in _KINDS or any(k.stream == stream for k in _KINDS.values()):
            raise ValueError(f"kind {name!r} or stream {stream} already registered")
        _KINDS[name] = Kind(name, task, stream, fn)
        return fn

    return wrap


def kinds() -> dict[str, Kind]:
    """Every registered kind by name."""
    from mmrl.datasets import perception, vision_reasoning  # noqa: F401 - registers the kinds

    return dict(_KINDS)


def make_samples(
    kinds_: list[str] | tuple[str, ...],
    n: int,
    split: str,
    seed: int = 0,
    image_size: int = 64,
) -> list[Sample]:
    """`n` samples cycling through `kinds_`, deterministic in all arguments."""
    known = kinds()
    unknown = [k for k in kinds_ if k not in known]
    if unknown or not kinds_:
        raise ValueError(f"unknown procedural kind(s) {unknown}: choose from {sorted(known)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: choose from {list(SPLITS)}")
    samples = []
    for i in range(n):
        kind = known[kinds_[i % len(kinds_)]]
        rng = np.random.default_rng([seed, SPLITS[split], kind.stream, i])
        drawn = kind.draw(rng, image_size)
        samples.append(
            Sample(
                data_source=f"{kind.task}/{kind.name}",
                prompt=[{"role": "user", "content": "<image>" + drawn.question}],
                images=[drawn.image],
                ability=drawn.ability,
                reward_model=RewardSpec(
                    ground_truth=drawn.ground_truth,
                    verifier=drawn.verifier,
                    verifier_params=dict(drawn.verifier_params),
                ),
                extra_info={
                    "id": f"{kind.task}/{kind.name}/{split}/{seed}/{i}",
                    "reference": drawn.reference,
                    "demonstration": drawn.reference,  # a reference solution (`algo.demo_loss`)
                    **drawn.details,
                },
            )
        )
    return samples


def reference_response(sample: Sample) -> str:
    """The ideal response of a procedural sample (KeyError for other data)."""
    return sample.extra_info["reference"]


def image_digest(image: Image.Image) -> str:
    """A content hash, used to show that the splits share no image."""
    return hashlib.sha1(image.tobytes()).hexdigest()
