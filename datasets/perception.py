"""The built-in perception kinds: detection, grounding, OCR and counting (V-Triune's four).

Boxes are `[x1, y1, x2, y2]` in pixels of the (square) image, as Qwen2.5-VL answers; the
detection verifier's `normalized` option covers ground truths on Qwen2-VL's 0-1000 grid.

- `detection`: one shape; its box, labelled with its colour (one box keeps the answer within
  64 byte tokens; colour labels are what a tiny model can learn to see on a CPU).
- `grounding`: two or three shapes of different colours; the box of the one of a named colour.
- `ocr`: a word rendered in the image; the word (`ocr` verifier, edit similarity).
- `counting`: one to six shapes; how many (`counting` verifier).
"""

from __future__ import annotations

import json

import numpy as np
from PIL import ImageDraw, ImageFont

from mmrl.datasets.kinds import Drawn, register_kind
from mmrl.datasets.vision_reasoning import COLOURS, SHAPES, _background, _draw_shape, _jitter

WORDS = (
    "cat", "dog", "sun", "map", "red", "box", "cup", "pen", "key", "hat",
    "tree", "fish", "bird", "book", "door", "lamp", "milk", "rain", "ship", "star",
    "apple", "bread", "chair", "cloud", "grape", "house", "light", "mouse", "plant", "river",
)  # fmt: skip
DETECTION_PARAMS = {"iou_threshold": 0.0, "completeness_weight": 0.3}
"""Procedural detection samples use a fixed IoU threshold of 0: a box with the right label
earns 0.3 + 0.7 * IoU however far off it is, a dense reward that a small model can climb from
scratch. V-Triune's `dynamic` schedule (0.85 -> 0.95 -> 0.99) suits models that already
localise well: set `iou_threshold` in your own data."""

BOX_FORMAT = ' Answer with a JSON list of {"bbox_2d": [x1, y1, x2, y2], "label": ...} in pixels.'


def _place(rng: np.random.Generator, size: int, n: int) -> list[tuple[float, float, float]]:
    """`n` shapes (cx, cy, r) in distinct quadrants, near each quadrant's centre: where a shape
    is, is a coarse choice (which quadrant) plus a few pixels of jitter in place and size."""
    cell = size / 2
    out = []
    for c in rng.permutation(4)[:n]:
        r = cell * rng.uniform(0.3, 0.42)
        slack = cell / 2 - r
        cx = (c % 2 + 0.5) * cell + rng.uniform(-slack, slack)
        cy = (c // 2 + 0.5) * cell + rng.uniform(-slack, slack)
        out.append((cx, cy, r))
    return out


def _box(cx: float, cy: float, r: float) -> list[int]:
    return [round(cx - r), round(cy - r), round(cx + r), round(cy + r)]


def _boxes_answer(boxes: list[dict]) -> str:
    return json.dumps(boxes, separators=(",", ":"))


@register_kind("detection", "perception", stream=10)
def _detection(rng: np.random.Generator, size: int) -> Drawn:
    image = _background(rng, size)
    ((cx, cy, r),) = _place(rng, size, 1)
    colour = str(rng.choice(list(COLOURS)))
    _draw_shape(ImageDraw.Draw(image), str(rng.choice(SHAPES)), cx, cy, r, _jitter(COLOURS[colour], rng))
    boxes = [{"bbox_2d": _box(cx, cy, r), "label": colour}]
    return Drawn(
        image=image,
        question="Detect the shape and label it with its colour." + BOX_FORMAT,
        ground_truth=boxes,
        reference=_boxes_answer(boxes),
        verifier="detection",
        verifier_params=dict(DETECTION_PARAMS),
        ability="detection",
    )


@register_kind("grounding", "perception", stream=11)
def _grounding(rng: np.random.Generator, size: int) -> Drawn:
    image = _background(rng, size)
    draw = ImageDraw.Draw(image)
    places = _place(rng, size, int(rng.integers(2, 4)))
    colours = [str(c) for c in rng.permutation(list(COLOURS))[: len(places)]]
    for (cx, cy, r), colour in zip(places, colours):
        _draw_shape(draw, str(rng.choice(SHAPES)), cx, cy, r, _jitter(COLOURS[colour], rng))
    k = int(rng.integers(0, len(places)))
    target = [{"bbox_2d": _box(*places[k]), "label": colours[k]}]
    return Drawn(
        image=image,
        question=f"Locate the {colours[k]} shape; label it {colours[k]}." + BOX_FORMAT,
        ground_truth=target,
        reference=_boxes_answer(target),
        verifier="detection",
        verifier_params=dict(DETECTION_PARAMS),
        ability="grounding",
    )


@register_kind("ocr", "perception", stream=12)
def _ocr(rng: np.random.Generator, size: int) -> Drawn:
    image = _background(rng, size)
    word = str(rng.choice(WORDS))
    font = ImageFont.load_default(size=max(8, int(size * rng.uniform(0.24, 0.3))))
    left, top, right, bottom = ImageDraw.Draw(image).textbbox((0, 0), word, font=font)
    x = rng.uniform(0, max(1.0, size - (right - left))) - left
    y = rng.uniform(0, max(1.0, size - (bottom - top))) - top
    ImageDraw.Draw(image).text((x, y), word, fill=(20, 20, 20), font=font)
    return Drawn(
        image=image,
        question="What word is written in the image? Answer with \\boxed{word}.",
        ground_truth=word,
        reference=f"\\boxed{{{word}}}",
        verifier="ocr",
        ability="ocr",
    )


@register_kind("counting", "perception", stream=13)
def _counting(rng: np.random.Generator, size: int) -> Drawn:
    image = _background(rng, size)
    draw = ImageDraw.Draw(image)
    n = int(rng.integers(1, 7))
    cell = size / 3
    for c in rng.permutation(9)[:n]:
        cx, cy = (c % 3 + 0.5) * cell, (c // 3 + 0.5) * cell
        colour = COLOURS[str(rng.choice(list(COLOURS)))]
        _draw_shape(
            draw, str(rng.choice(SHAPES)), cx, cy, cell * rng.uniform(0.28, 0.42), _jitter(colour, rng)
        )
    return Drawn(
        image=image,
        question="How many shapes are there? Answer with \\boxed{n}.",
        ground_truth=n,
        reference=f"\\boxed{{{n}}}",
        verifier="counting",
        ability="counting",
    )
