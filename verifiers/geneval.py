"""The `geneval` verifier: does a generated image show what its prompt asked for?

GenEval (Ghosh et al., 2023) checks generated images with an object detector: the right objects,
their count, colour and relative position. Here the objects are flat coloured shapes (the
built-in task, `mmrl.datasets.geneval`), so plain image analysis replaces the detector:

1. the background is the median colour of the image's border; pixels farther than
   `FOREGROUND_DISTANCE` from it are foreground (more than `MAX_FOREGROUND` of the image
   foreground: not a drawing, score 0);
2. each foreground pixel takes the nearest of the six colours (`COLOURS`) if it is within
   `COLOUR_DISTANCE` of it (otherwise it is an edge blend or another colour: ignored);
3. connected regions (4-neighbour) of one colour are candidate objects; one is an *object* when
   its area is at least `MIN_AREA` of the image, its box has an aspect ratio within
   [1 / `MAX_ASPECT`, `MAX_ASPECT`] and it does not span most of the image; its shape is the
   ideal square, circle or up-pointing triangle it overlaps best (IoU), each matched to the
   region's centroid and spread (`shape_fits`: moments, not the box, so that ragged edges and
   stray edge pixels do not turn a square into a circle), `other` below `MIN_SHAPE_FIT`;
4. the spec is checked, with partial credit per attribute: for each requested group (colour c,
   shape s, count n) with detected objects O_c of colour c, `colour` = [|O_c| >= 1], `count` =
   [|O_c| = n], `shape` = min(n, #{o in O_c of shape s}) / max(n, |O_c|); for a relation,
   `position` = [the relation holds between the largest objects of the two colours], by
   GenEval's rule (box centres, offset reduced by 0.1 x the summed box sizes, a direction when
   its share of the offset exceeds 0.5). The accuracy is the mean of those credits times `clean`,
   the share of the image's coloured pixels that belong to objects of requested colours (so an
   image of every colour, or stripes of them, cannot collect credit);
5. `correct` is GenEval's strict verdict: every credit 1 and no object of another colour.

The image is the sample's only image (the generated one); the response text is not read. The
ground truth is the spec as a dict (`ImageSpec.to_dict()`); a `text` spec (a rendered word) is
scored by the OCR reward, not here (`mmrl.rewards.geneval` routes it). Components: `accuracy`,
`format` (1 when the image is a drawing at all), `colour`, `count`, `shape`, `shape_fit` (graded:
the IoU of the asked-for colour's objects with the ideal asked-for shape, counted like `shape`;
`shape_fits`), `position` (NaN-free: 1 when no relation is asked), `clean`,
`correct`, `objects` (how many were detected).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from mmrl.datasets.geneval import COLOURS, ImageSpec, spec_from_dict
from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.registry import SampleFieldError, Verifier, mix_score, register_verifier

FOREGROUND_DISTANCE = 60.0
"""RGB distance from the background beyond which a pixel is foreground."""
COLOUR_DISTANCE = 80.0
"""RGB distance within which a pixel takes a palette colour (the closest palette pair, blue and
purple, is 116 apart)."""
MAX_FOREGROUND = 0.6
"""More foreground than this share of the image: not a drawing of objects (noise, a pattern)."""
MIN_AREA = 0.012
"""Smallest object, as a share of the image (12 pixels at 32 x 32; drawn shapes have 35+)."""
MAX_SPAN = 0.75
"""A region whose box spans more than this share of the image's width or height is a stripe
or a background patch, not an object."""
MAX_ASPECT = 2.0
"""Largest width / height (or height / width) ratio of an object's box."""
ANALYSIS_SIDE = 128
"""Larger images are downsampled (box filter) to this side before the analysis."""
POSITION_THRESHOLD = 0.1
"""GenEval's: the centre offset is reduced by this times the two boxes' summed sizes."""

_PALETTE = np.array(list(COLOURS.values()), dtype=np.float32)
_NAMES = list(COLOURS)


@dataclass
class DetectedObject:
    """One detected object: colour, shape (`circle`, `square`, `triangle` or `other`), area in
    pixels, box [x0, y0, x1, y1] (inclusive pixel bounds), centroid (x, y)."""

    colour: str
    shape: str
    area: int
    box: tuple[int, int, int, int]
    centroid: tuple[float, float]
    fit: dict[str, float] = field(default_factory=dict)
    """IoU of the region with each moment-matched ideal shape (`shape_fits`); `shape` is the best."""


@dataclass
class Analysis:
    """What `analyse` found in one image."""

    objects: list[DetectedObject]
    foreground: float
    """Share of the image that is foreground."""
    coloured: dict[str, int]
    """Pixels assigned to each palette colour (objects and specks)."""
    size: tuple[int, int]
    """(width, height) analysed."""


def analyse(image: Image.Image | np.ndarray) -> Analysis:
    """Steps 1-3 of the module docs on one RGB image."""
    if isinstance(image, Image.Image):
        image = image.convert("RGB")
        if max(image.size) > ANALYSIS_SIDE:
            scale = ANALYSIS_SIDE / max(image.size)
            image = image.resize(
                (max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.BOX
            )
        rgb = np.asarray(image, dtype=np.float32)
    else:
        rgb = np.asarray(image, dtype=np.float32)
        if rgb.ndim != 3 or rgb.shape[2] != 3:
            raise ValueError(f"expected an [H, W, 3] RGB array, got shape {list(rgb.shape)}")
    h, w, _ = rgb.shape
    border = np.concatenate([rgb[0], rgb[-1], rgb[:, 0], rgb[:, -1]])
    background = np.median(border, axis=0)
    foreground = np.linalg.norm(rgb - background, axis=2) > FOREGROUND_DISTANCE
    distances = np.linalg.norm(rgb[:, :, None, :] - _PALETTE[None, None], axis=3)  # [H, W, 6]
    nearest = distances.argmin(axis=2)
    labels = np.where(foreground & (distances.min(axis=2) <= COLOUR_DISTANCE), nearest, -1)
    coloured = {name: int((labels == i).sum()) for i, name in enumerate(_NAMES)}
    objects = []
    min_area = max(4, MIN_AREA * h * w)
    for region, colour in _regions(labels):
        area = len(region)
        if area < min_area:  # most regions of a noisy image: skip them before measuring
            continue
        ys, xs = region[:, 0], region[:, 1]
        x0, x1, y0, y1 = int(xs.min()), int(xs.max()), int(ys.min()), int(ys.max())
        bw, bh = x1 - x0 + 1, y1 - y0 + 1
        if bw > MAX_SPAN * w or bh > MAX_SPAN * h:
            continue
        if max(bw / bh, bh / bw) > MAX_ASPECT:
            continue
        fit = shape_fits(ys - y0, xs - x0, bw, bh)
        objects.append(
            DetectedObject(
                _NAMES[colour],
                _shape(fit),
                area,
                (x0, y0, x1, y1),
                (float(xs.mean()), float(ys.mean())),
                fit,
            )
        )
    objects.sort(key=lambda o: -o.area)
    return Analysis(objects, float(foreground.mean()), coloured, (w, h))


def _regions(labels: np.ndarray):
    """(pixels [K, 2] as (y, x), colour index) of each 4-connected region of equal label >= 0."""
    h, w = labels.shape
    seen = labels < 0
    for y0, x0 in np.argwhere(~seen):
        if seen[y0, x0]:
            continue
        colour = labels[y0, x0]
        seen[y0, x0] = True
        queue, pixels = deque([(int(y0), int(x0))]), []
        while queue:
            y, x = queue.popleft()
            pixels.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and labels[ny, nx] == colour:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        yield np.array(pixels), int(colour)


MIN_SHAPE_FIT = 0.5
"""A region whose best `shape_fits` IoU is below this is shape `other`."""


def _shape(fit: dict[str, float]) -> str:
    """The verdict: the ideal shape the region overlaps best (`shape_fits`), `other` when even
    that one covers too little of it."""
    best = max(fit, key=fit.get)
    return best if fit[best] >= MIN_SHAPE_FIT else "other"


def shape_fits(ys: np.ndarray, xs: np.ndarray, bw: int, bh: int) -> dict[str, float]:
    """IoU of a region (box-relative pixel coordinates, box `bw` x `bh`) with the ideal square,
    circle and triangle (pointing up) whose centroid and horizontal and vertical spread are the
    region's (moment-matched).

    Matching by moments, not by the bounding box, is what makes the measure robust to the edges
    a generator draws: one stray pixel or a ragged row on an edge moves a box by a pixel or two
    (on a 20-pixel square that alone drops its fill of the box to a circle's), but the moments
    hardly at all. Each ideal shape of a uniform density gets the size its own spread implies:
    a rectangle of half-sides sqrt(3) sigma, an ellipse of semi-axes 2 sigma, a triangle of base
    sqrt(24) sigma_x and height sqrt(18) sigma_y with its centroid 2/3 of the height below the
    apex. The verdict is the best fit (`_shape`); the graded `shape_fit` is the asked shape's."""
    ys = np.asarray(ys, dtype=np.float64)
    xs = np.asarray(xs, dtype=np.float64)
    cx, cy = xs.mean(), ys.mean()
    sx, sy = max(float(xs.std()), 0.3), max(float(ys.std()), 0.3)
    # The grid covers every template whole, wherever it reaches past the region's box (a
    # clipped template would shrink the union and inflate the IoU): from the centroid the
    # templates reach sqrt(6) sigma_x sideways (the triangle's base), 2 sqrt(2) sigma_y up (its
    # apex) and 2 sigma_y down (the ellipse).
    reach_x, up, down = np.sqrt(6.0) * sx, 2.0 * np.sqrt(2.0) * sy, 2.0 * sy
    left = int(np.ceil(max(0.0, reach_x - cx))) + 1
    right = int(np.ceil(max(0.0, cx + reach_x - (bw - 1)))) + 1
    top = int(np.ceil(max(0.0, up - cy))) + 1
    bottom = int(np.ceil(max(0.0, cy + down - (bh - 1)))) + 1
    mask = np.zeros((top + bh + bottom, left + bw + right), dtype=bool)
    mask[ys.astype(np.int64) + top, xs.astype(np.int64) + left] = True
    y, x = np.mgrid[0 : mask.shape[0], 0 : mask.shape[1]].astype(np.float64)
    x, y = x - left - cx, y - top - cy  # pixel centres relative to the centroid
    base, height = np.sqrt(24.0) * sx, np.sqrt(18.0) * sy
    v = (y + 2.0 * height / 3.0) / height  # 0 at the apex, 1 at the base
    templates = {
        "square": (np.abs(x) <= np.sqrt(3.0) * sx) & (np.abs(y) <= np.sqrt(3.0) * sy),
        "circle": (x / (2.0 * sx)) ** 2 + (y / (2.0 * sy)) ** 2 <= 1.0,
        "triangle": (v >= 0.0) & (v <= 1.0) & (np.abs(x) <= v * base / 2.0),
    }
    return {name: float((mask & t).sum() / max(1, (mask | t).sum())) for name, t in templates.items()}


def relative_position(a: DetectedObject, b: DetectedObject) -> set[str]:
    """GenEval's relations of `a` to `b` (a subset of left of / right of / above / below)."""
    box_a, box_b = np.array(a.box, dtype=np.float64), np.array(b.box, dtype=np.float64)
    centre_a, centre_b = (box_a[:2] + box_a[2:]) / 2, (box_b[:2] + box_b[2:]) / 2
    dim_a, dim_b = box_a[2:] - box_a[:2] + 1, box_b[2:] - box_b[:2] + 1
    offset = centre_a - centre_b
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def check_spec(spec: ImageSpec, analysis: Analysis) -> dict[str, float]:
    """Step 4-5 of the module docs: the credits, `clean`, `accuracy` and `correct`."""
    if spec.text is not None:
        raise ValueError("a text spec is scored by the OCR reward, not by the geneval verifier")
    if analysis.foreground > MAX_FOREGROUND:
        zero = dict.fromkeys(
            ("colour", "count", "shape", "shape_fit", "position", "clean", "accuracy", "correct"), 0.0
        )
        return {**zero, "format": 0.0, "objects": float(len(analysis.objects))}
    by_colour: dict[str, list[DetectedObject]] = {}
    for o in analysis.objects:
        by_colour.setdefault(o.colour, []).append(o)
    colour, count, shape, fit = [], [], [], []
    for group in spec.objects:
        found = by_colour.get(group.colour, [])
        colour.append(float(len(found) >= 1))
        count.append(float(len(found) == group.count))
        matching = sum(1 for o in found if o.shape == group.shape)
        shape.append(min(group.count, matching) / max(group.count, len(found)))
        best = sorted((o.fit.get(group.shape, 0.0) for o in found), reverse=True)[: group.count]
        fit.append(sum(best) / max(group.count, len(found)))
    credits = colour + count + shape
    position = 1.0
    if spec.relation is not None:
        a = by_colour.get(spec.objects[0].colour)
        b = by_colour.get(spec.objects[1].colour)
        position = float(bool(a and b) and spec.relation in relative_position(a[0], b[0]))
        credits.append(position)
    wanted = {g.colour for g in spec.objects}
    requested = sum(o.area for o in analysis.objects if o.colour in wanted)
    total = sum(analysis.coloured.values())
    clean = requested / total if total else 0.0
    extra = any(o.colour not in wanted for o in analysis.objects)
    correct = float(all(c == 1.0 for c in credits) and not extra)
    return {
        "colour": float(np.mean(colour)),
        "count": float(np.mean(count)),
        "shape": float(np.mean(shape)),
        "shape_fit": float(np.mean(fit)),
        "position": position,
        "clean": clean,
        "accuracy": float(np.mean(credits)) * clean,
        "correct": correct,
        "format": 1.0,
        "objects": float(len(analysis.objects)),
    }


@register_verifier("geneval")
class GenEvalVerifier(Verifier):
    """GenEval-style prompt following of a generated image (see the module docs)."""

    def check_sample(self, sample: Sample) -> None:
        try:
            spec = spec_from_dict(sample.reward_model.ground_truth, where="ground truth")
        except ValueError as exc:
            raise SampleFieldError("reward_model.ground_truth", str(exc)) from None
        if spec.text is not None:
            raise SampleFieldError(
                "reward_model.ground_truth", "a text spec is scored by the OCR reward (`ocr`), not by geneval"
            )
        if len(sample.images) != 1:
            raise SampleFieldError(
                "images", f"needs exactly one image (the generated one), got {len(sample.images)}"
            )
        unknown = set(sample.reward_model.verifier_params) - {"format"}
        if unknown:
            raise SampleFieldError("reward_model.verifier_params", f"unknown keys {sorted(unknown)}")

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        spec = spec_from_dict(sample.reward_model.ground_truth, where="ground truth")
        if len(sample.images) != 1:
            raise ValueError(f"geneval needs exactly one image (the generated one), got {len(sample.images)}")
        parts = check_spec(spec, analyse(sample.pil_images()[0]))
        return VerifierResult(
            score=mix_score(sample, parts["accuracy"], parts["format"]),
            components=parts,
            extracted=f"{int(parts['objects'])} objects",
        )


def prompt_following(images, prompts: list[str]) -> dict[str, float]:
    """GenEval-style scores of generated images for their prompts: `accuracy` (the share that
    is `correct`, GenEval's number), `score` (the mean partial-credit accuracy), and
    `accuracy/<kind>` per prompt kind. `images`: [N, 3, H, W] floats in [0, 1] (a pipeline's
    output), or a list of PIL images / [H, W, 3] uint8 arrays. Text prompts are skipped (OCR
    scores them)."""
    from mmrl.datasets.geneval import parse_prompt

    if isinstance(images, torch.Tensor):
        images = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
        images = list(images.cpu().numpy())
    if len(images) != len(prompts):
        raise ValueError(f"prompt_following: {len(images)} images for {len(prompts)} prompts")
    correct: dict[str, list[float]] = {}
    scores = []
    for image, prompt in zip(images, prompts):
        spec = parse_prompt(prompt)
        if spec.text is not None:
            continue
        parts = check_spec(spec, analyse(image))
        correct.setdefault(spec.kind, []).append(parts["correct"])
        scores.append(parts["accuracy"])
    everything = [c for group in correct.values() for c in group]
    out = {
        "accuracy": float(np.mean(everything)) if everything else float("nan"),
        "score": float(np.mean(scores)) if scores else float("nan"),
    }
    out.update({f"accuracy/{kind}": float(np.mean(v)) for kind, v in sorted(correct.items())})
    return out
