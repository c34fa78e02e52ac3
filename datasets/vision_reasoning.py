"""The built-in `vision_reasoning` task: procedurally drawn images with numeric questions.

Every question is answered by a number that only the image reveals (the question text is the
same for many different answers), and the `math` verifier checks it. Deterministic by seed;
the `train`, `heldout` and `validation` splits draw from independent random streams.

Kinds (select with `data.kinds`):
- `colour_code`: one shape; the prompt gives a fixed colour -> number code; answer the code of the
  shape's colour. The kind a ~0.5M-parameter model learns to see within minutes on a CPU, so the
  default run uses it.
- `count`: several shapes; how many are of a given colour (1-5).
- `arithmetic`: two digits drawn in the image; their sum.
- `bar_chart`: three labelled bars on a grid; the value of one bar (1-5).

The other kinds are there for real checkpoints and evaluation: a tiny model trained for
minutes on a CPU does not learn to count (measured), so they are not in the default mix.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mmrl.datasets.kinds import Drawn, register_kind

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 200, 30),
    "purple": (150, 50, 190),
    "cyan": (30, 200, 210),
}
COLOUR_CODE = {name: i + 1 for i, name in enumerate(COLOURS)}
SHAPES = ("circle", "square", "triangle")
KINDS = ("colour_code", "count", "arithmetic", "bar_chart")

_CODE_TEXT = " ".join(f"{name}={code}" for name, code in COLOUR_CODE.items())
QUESTIONS = {
    "colour_code": f"Colour code: {_CODE_TEXT}. What is the code of the shape's colour?",
    "count": "How many {colour} shapes are there?",
    "arithmetic": "What is the sum of the two numbers in the image?",
    "bar_chart": "What is the value of bar {label}?",
}
ANSWER_FORMAT = " Answer with \\boxed{n}."


def _numeric(image: Image.Image, answer: int, question: str, details: dict) -> Drawn:
    return Drawn(
        image=image,
        question=question + ANSWER_FORMAT,
        ground_truth=str(answer),
        reference=f"\\boxed{{{answer}}}",
        details=details,
    )


def _background(rng: np.random.Generator, size: int) -> Image.Image:
    grey = int(rng.integers(225, 256))
    return Image.new("RGB", (size, size), (grey, grey, grey))


def _jitter(rgb: tuple[int, int, int], rng: np.random.Generator, amount: int = 20) -> tuple[int, ...]:
    return tuple(int(np.clip(c + rng.integers(-amount, amount + 1), 0, 255)) for c in rgb)


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)


@register_kind("colour_code", "vision_reasoning", stream=0)
def _colour_code(rng: np.random.Generator, size: int) -> Drawn:
    image = _background(rng, size)
    colour = str(rng.choice(list(COLOURS)))
    shape = str(rng.choice(SHAPES))
    r = rng.uniform(0.14, 0.3) * size
    cx, cy = rng.uniform(r, size - r, size=2)
    _draw_shape(ImageDraw.Draw(image), shape, cx, cy, r, _jitter(COLOURS[colour], rng))
    return _numeric(image, COLOUR_CODE[colour], QUESTIONS["colour_code"], {"colour": colour, "shape": shape})


@register_kind("count", "vision_reasoning", stream=1)
def _count(rng: np.random.Generator, size: int) -> Drawn:
    image = _background(rng, size)
    draw = ImageDraw.Draw(image)
    target = str(rng.choice(list(COLOURS)))
    n_target = int(rng.integers(1, 6))
    others = [c for c in COLOURS if c != target]
    n_other = int(rng.integers(0, 4))
    colours = [target] * n_target + [str(rng.choice(others)) for _ in range(n_other)]
    # Non-overlapping cells of a 4x4 grid keep every shape countable.
    cells = rng.permutation(16)[: len(colours)]
    cell = size / 4
    for colour, c in zip(colours, cells):
        cx, cy = (c % 4 + 0.5) * cell, (c // 4 + 0.5) * cell
        shape = str(rng.choice(SHAPES))
        _draw_shape(draw, shape, cx, cy, cell * rng.uniform(0.3, 0.45), _jitter(COLOURS[colour], rng))
    return _numeric(image, n_target, QUESTIONS["count"].format(colour=target), {"colour": target})


@register_kind("arithmetic", "vision_reasoning", stream=2)
def _arithmetic(rng: np.random.Generator, size: int) -> Drawn:
    image = _background(rng, size)
    draw = ImageDraw.Draw(image)
    a, b = (int(x) for x in rng.integers(0, 10, size=2))
    font = ImageFont.load_default(size=max(8, int(size * 0.45)))
    for k, digit in enumerate((a, b)):
        x = (0.08 + 0.5 * k) * size + rng.uniform(0, 0.08) * size
        y = rng.uniform(0.1, 0.35) * size
        draw.text((x, y), str(digit), fill=(20, 20, 20), font=font)
    return _numeric(image, a + b, QUESTIONS["arithmetic"], {"digits": [a, b]})


@register_kind("bar_chart", "vision_reasoning", stream=3)
def _bar_chart(rng: np.random.Generator, size: int) -> Drawn:
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    labels = ("A", "B", "C")
    values = [int(v) for v in rng.integers(1, 6, size=3)]
    top, bottom = 0.08 * size, 0.84 * size
    unit = (bottom - top) / 5
    for v in range(6):  # grid lines at every unit
        y = bottom - v * unit
        draw.line([(0, y), (size, y)], fill=(200, 200, 200))
    font = ImageFont.load_default(size=max(6, int(size * 0.14)))
    width = size / 3
    for k, (label, value) in enumerate(zip(labels, values)):
        x0 = k * width + 0.2 * width
        draw.rectangle([x0, bottom - value * unit, x0 + 0.6 * width, bottom], fill=(50, 90, 200))
        draw.text((x0 + 0.15 * width, bottom + 0.01 * size), label, fill=(0, 0, 0), font=font)
    asked = int(rng.integers(0, 3))
    return _numeric(
        image, values[asked], QUESTIONS["bar_chart"].format(label=labels[asked]), {"values": values}
    )
