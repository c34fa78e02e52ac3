"""`visual_search`: a task the zoom tool is needed for ("thinking with images").

A high-resolution image (4x the model's input side: 256x256 for the tiny base's 64x64) holds
four small shapes, one at the centre of each quarter, in four different colours; the question
asks for the colour code of one quarter's shape. The processor shrinks the whole image 4x, so
each shape covers a few pixels among its neighbours and the background's noise; `zoom_in` on
the quarter's central box gives it back at full resolution, where it is as large as the shape
the `colour_code` kind draws at the model's input size.

The reference trajectory (the supervised cold start's demonstration) calls
`zoom_in(bbox_2d=<the quarter's central box>)` in Qwen's hermes format, then answers with
`\\boxed{code}`. The same images with the tool sentence dropped and no tools (`without_tools`)
measure the base without tools, answering directly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from PIL import Image, ImageDraw

from mmrl.datasets.kinds import Drawn, register_kind
from mmrl.datasets.vision_reasoning import ANSWER_FORMAT, COLOUR_CODE, COLOURS, SHAPES, _draw_shape, _jitter
from mmrl.types import IMAGE_PLACEHOLDER, Sample

SCALE = 4
"""The image's side over the model's input side: what the processor shrinks it by."""
QUARTERS = ("top left", "top right", "bottom left", "bottom right")
_CODE_TEXT = " ".join(f"{name}={code}" for name, code in COLOUR_CODE.items())
QUESTION = (
    "Colour code: " + _CODE_TEXT + ". What is the code of the colour of the shape in the {quarter} quarter?"
)
TOOL_SENTENCE = " The image is {side}x{side}; zoom_in to see a box of it."


def quarter_box(quarter: int, side: int) -> list[int]:
    """The central box of a quarter (a quarter of the quarter's side), in pixels: where its
    shape is, and what a zoom should read."""
    half, q = side // 2, side // 8
    x0 = (quarter % 2) * half + half // 2 - q // 2
    y0 = (quarter // 2) * half + half // 2 - q // 2
    return [x0, y0, x0 + q, y0 + q]


def _specks(draw: ImageDraw.ImageDraw, rng: np.random.Generator, side: int, n: int) -> None:
    """Small dots of the task's colours all over: at the model's input size they blur into
    coloured noise beside the (few pixels wide) shapes."""
    names = list(COLOURS)
    for _ in range(n):
        x, y = rng.uniform(0, side, size=2)
        r = rng.uniform(0.6, 1.6)
        draw.ellipse([x - r, y - r, x + r, y + r], fill=COLOURS[names[int(rng.integers(len(names)))]])


def _noisy_background(rng: np.random.Generator, side: int) -> Image.Image:
    grey = int(rng.integers(200, 240))
    noise = rng.integers(-28, 29, size=(side, side, 3))
    pixels = np.clip(grey + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


@register_kind("visual_search", "visual_search", stream=20)
def _visual_search(rng: np.random.Generator, size: int) -> Drawn:
    from mmrl.environments import tool_call_text

    side = size * SCALE
    image = _noisy_background(rng, side)
    draw = ImageDraw.Draw(image)
    _specks(draw, rng, side, n=side * side // 160)
    colours = [str(c) for c in rng.choice(list(COLOURS), size=4, replace=False)]
    box_side = side // 8
    r = box_side * 0.3  # the shape fills about 60% of its zoom box's side
    for quarter, colour in enumerate(colours):
        box = quarter_box(quarter, side)
        cx = (box[0] + box[2]) / 2 + rng.uniform(-0.08, 0.08) * box_side
        cy = (box[1] + box[3]) / 2 + rng.uniform(-0.08, 0.08) * box_side
        _draw_shape(draw, str(rng.choice(SHAPES)), cx, cy, r, _jitter(COLOURS[colour], rng))
    asked = int(rng.integers(0, 4))
    answer = COLOUR_CODE[colours[asked]]
    call = tool_call_text({"name": "zoom_in", "arguments": {"bbox_2d": quarter_box(asked, side)}})
    question = QUESTION.format(quarter=QUARTERS[asked])
    return Drawn(
        image=image,
        question=question + TOOL_SENTENCE.format(side=side) + ANSWER_FORMAT,
        ground_truth=str(answer),
        reference=f"\\boxed{{{answer}}}",
        ability="perception",
        agent={"tools": ["zoom_in"], "max_turns": 2},
        details={
            "colours": colours,
            "asked": asked,
            "tool_demonstration": [call, f"\\boxed{{{answer}}}"],
            "question_without_tools": question + ANSWER_FORMAT,
        },
    )


def without_tools(sample: Sample) -> Sample:
    """The same sample with no tools: for this task's samples, the tool sentence dropped from
    the question too (the model answers directly, from the whole image at its input size);
    any other sample keeps its prompt."""
    if "question_without_tools" not in sample.extra_info:
        return dataclasses.replace(sample, agent=None)
    text = IMAGE_PLACEHOLDER + sample.extra_info["question_without_tools"]
    return dataclasses.replace(sample, prompt=[{"role": "user", "content": text}], agent=None)
