"""The `geneval` verifier: does a generated image show what its prompt asked for?

GenEval (Ghosh et al., 2023) checks generated images with an object detector: the right objects,
their count, colour and relative position. Here the objects are flat coloured shapes (the
built-in task, `mmrl.datasets.geneval`), so plain image analysis replaces the detector:

1. the background is the median colour of the image's border; pixels farther than
   `FOREGROUND_DISTANCE` from it are foreground (more than `MAX_FOREGROUND` of the image
   foreground: not a drawing, score 0);
2. each foreground pixel takes the nearest of the named colours (`NAMED_COLOURS`: the task's
   six, and orange, pink, brown, black, white and grey, as GenEval's ten colours have them) if
   it is within `LABEL_DISTANCE` of it, else the label `other` (a colour none of them names);
3. connected regions (4-neighbour) of one label are *objects*, whatever their colour, when
   their area is at least `MIN_AREA` of the image, at least `MIN_CORE` of it lies inside the
   region (pixels whose four neighbours are in it too: a one- or two-pixel rim, such as the
   blend round another object's edge, is no object) and they do not fill the frame (a box
   spanning more than `FRAME_SPAN` of the width or height). Size is otherwise free: a large
   object is judged as a small one. An object's colour is the named colour nearest the median
   of its pixels, `other` when that is farther than `COLOUR_DISTANCE` (a near miss, such as
   lavender for purple, is a miss);
4. an object's shape is the ideal shape it overlaps best (IoU), of the task's three (an
   axis-aligned square, a circle, a triangle pointing up, as `draw` draws them) and a bank of
   decoys (octagons, hexagons, pentagons, plus signs, squares turned 30-60 degrees, triangles
   pointing elsewhere, each at several rotations), every one matched to the region's centroid
   and size (`shape_fits`: the ideal shape keeps its own proportions, so a 2:1 rectangle fits a
   square badly). It is `other` when a decoy fits better, when the best fit is under
   `MIN_SHAPE_FIT`, or when the region is more elongated than the shape by more than
   `MAX_ELONGATION` (aspect ratio is part of the shape). A polygon decoy applies only to regions
   large enough that its sides cut a pixel or more into a disc (`MIN_SIDE_DEPTH`): an octagon
   from a radius of 13 pixels, a hexagon from 7.5, a pentagon from 5.2; smaller, a rasterised
   disc fits the polygon as well as the disc, and the two are not told apart;
5. the spec is checked, with partial credit per attribute: for each requested group (colour c,
   shape s, count n) with detected objects O_c of colour c, `colour` = [|O_c| >= 1], `count` =
   [|O_c| = n], `shape` = min(n, #{o in O_c of shape s}) / max(n, |O_c|); for a relation,
   `position` = [the relation holds between the largest objects of the two colours], by
   GenEval's rule (box centres, offset reduced by 0.1 x the summed box sizes, a direction when
   its share of the offset exceeds 0.5). The accuracy is the mean of those credits times `clean`,
   the requested objects' share of the foreground that is not the rim of an object (every other
   object, of any colour, and every stray mark count against it);
6. `correct` is GenEval's strict verdict, stricter on extras: every credit 1 and no other object
   at all (another colour, `other`, or anything the spec did not ask for).

The analysis also measures the image's quality, which none of the credits sees: `edge_noise`, the
standard deviation of the border pixels (per channel, averaged; a clean drawing's is 0), and
`noise`, the same over every background pixel at least `RIM` pixels from the foreground; the
reward (`mmrl.rewards.geneval`, `background=`) can charge for the latter.

The image is the sample's only image (the generated one); the response text is not read. The
ground truth is the spec as a dict (`ImageSpec.to_dict()`); a `text` spec (a rendered word) is
scored by the OCR reward, not here (`mmrl.rewards.geneval` routes it). Components: `accuracy`,
`format` (1 when the image is a drawing at all), `colour`, `count`, `shape`, `shape_fit` (graded:
the IoU of the asked-for colour's objects with the ideal asked-for shape, counted like `shape`;
`shape_fits`), `position` (NaN-free: 1 when no relation is asked), `clean`, `correct`, `objects`
(how many were detected), `noise` and `edge_noise`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import cache

import numpy as np
from PIL import Image

from mmrl.datasets.geneval import COLOURS, ImageSpec, spec_from_dict
from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.registry import SampleFieldError, Verifier, mix_score, register_verifier

NAMED_COLOURS: dict[str, tuple[int, int, int]] = {
    **COLOURS,
    "orange": (250, 150, 20),
    "pink": (240, 120, 180),
    "brown": (130, 80, 40),
    "black": (20, 20, 20),
    "white": (250, 250, 250),
    "grey": (128, 128, 128),
}
"""Every colour an object can be named: the task's six (`mmrl.datasets.geneval.COLOURS`) and the
rest of GenEval's ten (orange, pink, brown, black, white) and grey. Orange sits between the
task's red and yellow, pink between red and purple, so a drift toward either is a miss."""
FOREGROUND_DISTANCE = 60.0
"""RGB distance from the background beyond which a pixel is foreground."""
LABEL_DISTANCE = 80.0
"""RGB distance within which a pixel takes a named colour's label (farther: `other`)."""
COLOUR_DISTANCE = 60.0
"""RGB distance from the median of an object's pixels to the nearest named colour beyond which
the object's colour is `other` (the drawings' colours are within 26 of theirs)."""
MAX_FOREGROUND = 0.85
"""More foreground than this share of the image: not a drawing of objects (noise, a pattern)."""
MIN_AREA = 0.012
"""Smallest object, as a share of the image (12 pixels at 32 x 32; drawn shapes have 35+)."""
MIN_CORE = 0.2
"""Share of an object's pixels whose four neighbours are in it too, at least (a rim has none)."""
FRAME_SPAN = 0.9
"""A region whose box spans more than this share of the image's width or height fills the frame:
a background patch or a stripe, not an object. Any smaller object is judged whatever its size."""
MAX_ELONGATION = 1.25
"""Largest ratio of a region's long to short spread (principal axes), relative to the shape's
own (1 for a square or circle; a triangle's height over its base is part of its shape)."""
MIN_SHAPE_FIT = 0.75
"""A region whose best fit among the three shapes is below this is shape `other`."""
MIN_SIDE_DEPTH = 1.0
"""A regular polygon decoy (octagon, hexagon, pentagon) is tried only on a region whose disc of
the same spread (radius R) its sides would cut into by at least this many pixels,
R (1 - cos(pi / sides)) >= 1: an octagon from R = 13.1, a hexagon from 7.5, a pentagon from 5.2.
Below that the pixels do not tell the polygon from a disc (rasterised discs fit it as well)."""
RIM = 2
"""Pixels round the foreground that are neither object nor background (edge blends)."""
ANALYSIS_SIDE = 128
"""Larger images are downsampled (box filter) to this side before the analysis."""
POSITION_THRESHOLD = 0.1
"""GenEval's: the centre offset is reduced by this times the two boxes' summed sizes."""

_PALETTE = np.array(list(NAMED_COLOURS.values()), dtype=np.float32)
_NAMES = [*NAMED_COLOURS, "other"]
_OTHER = len(NAMED_COLOURS)


@dataclass
class DetectedObject:
    """One detected object: colour (a `NAMED_COLOURS` name or `other`), shape (`circle`,
    `square`, `triangle` or `other`), area in pixels, box [x0, y0, x1, y1] (inclusive pixel
    bounds), centroid (x, y)."""

    colour: str
    shape: str
    area: int
    box: tuple[int, int, int, int]
    centroid: tuple[float, float]
    fit: dict[str, float] = field(default_factory=dict)
    """IoU of the region with each ideal shape and decoy (`shape_fits`)."""
    elongation: float = 1.0
    """Long over short spread of the region (principal axes)."""


@dataclass
class Analysis:
    """What `analyse` found in one image."""

    objects: list[DetectedObject]
    foreground: float
    """Share of the image that is foreground."""
    stray: int
    """Foreground pixels in no object and farther than `RIM` from every object (specks, stripes,
    rims of nothing)."""
    size: tuple[int, int]
    """(width, height) analysed."""
    noise: float = 0.0
    """Standard deviation of the background pixels at least `RIM` from the foreground (per
    channel, averaged)."""
    edge_noise: float = 0.0
    """Standard deviation of the border pixels (per channel, averaged)."""


def analyse(image: Image.Image | np.ndarray) -> Analysis:
    """Steps 1-4 of the module docs on one RGB image."""
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
    border = np.concatenate([rgb[0], rgb[-1], rgb[1:-1, 0], rgb[1:-1, -1]])
    background = np.median(border, axis=0)
    foreground = np.linalg.norm(rgb - background, axis=2) > FOREGROUND_DISTANCE
    distances = np.linalg.norm(rgb[:, :, None, :] - _PALETTE[None, None], axis=3)  # [H, W, colours]
    labels = np.where(distances.min(axis=2) <= LABEL_DISTANCE, distances.argmin(axis=2), _OTHER)
    labels = np.where(foreground, labels, -1)
    objects, in_objects = [], np.zeros((h, w), dtype=bool)
    min_area = max(4, MIN_AREA * h * w)
    for region, _label in _regions(labels, min_area):  # most regions of a noisy image are specks
        area = len(region)
        ys, xs = region[:, 0], region[:, 1]
        x0, x1, y0, y1 = int(xs.min()), int(xs.max()), int(ys.min()), int(ys.max())
        if x1 - x0 + 1 > FRAME_SPAN * w or y1 - y0 + 1 > FRAME_SPAN * h:
            continue
        if _core(ys - y0, xs - x0, x1 - x0 + 1, y1 - y0 + 1) < MIN_CORE * area:
            continue
        in_objects[ys, xs] = True
        fit = shape_fits(ys, xs)
        objects.append(
            DetectedObject(
                _colour_name(rgb[ys, xs]),
                _shape(
                    fit, lambda proportion, ys=ys, xs=xs: _elongation(ys, xs, proportion), _radius(ys, xs)
                ),
                area,
                (x0, y0, x1, y1),
                (float(xs.mean()), float(ys.mean())),
                fit,
                _elongation(ys, xs),
            )
        )
    objects.sort(key=lambda o: -o.area)
    stray = int((foreground & ~_dilate(in_objects, RIM)).sum())
    clear = ~_dilate(foreground, RIM)
    noise = float(rgb[clear].std(axis=0).mean()) if clear.sum() > 1 else 0.0
    edge_noise = float(border.std(axis=0).mean())
    return Analysis(objects, float(foreground.mean()), stray, (w, h), noise, edge_noise)


def _regions(labels: np.ndarray, min_area: float = 0):
    """(pixels [K, 2] as (y, x), label) of each 4-connected region of equal label >= 0 with at
    least `min_area` pixels, in the order of their first pixel (row-major).

    Each pixel starts as its own index; every pass takes the smallest index among it and its
    connected neighbours and then that index's own (pointer jumping), until nothing changes:
    then every pixel holds the first pixel of its region."""
    h, w = labels.shape
    valid = labels >= 0
    none = h * w  # larger than any index
    ids = np.where(valid, np.arange(h * w).reshape(h, w), none)
    down = valid[:-1] & (labels[:-1] == labels[1:])  # (y, x) joins (y + 1, x)
    right = valid[:, :-1] & (labels[:, :-1] == labels[:, 1:])  # (y, x) joins (y, x + 1)
    while True:
        low = ids.copy()
        low[:-1] = np.minimum(low[:-1], np.where(down, ids[1:], none))
        low[1:] = np.minimum(low[1:], np.where(down, ids[:-1], none))
        low[:, :-1] = np.minimum(low[:, :-1], np.where(right, ids[:, 1:], none))
        low[:, 1:] = np.minimum(low[:, 1:], np.where(right, ids[:, :-1], none))
        low = np.where(valid, low.ravel()[np.minimum(low, none - 1)].reshape(h, w), none)
        low = np.minimum(low, ids)
        if np.array_equal(low, ids):
            break
        ids = low
    flat = ids.ravel()
    members = np.flatnonzero(flat < none)
    roots, sizes = np.unique(flat[members], return_counts=True)
    order = members[np.argsort(flat[members], kind="stable")]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for root, size, start in zip(roots.tolist(), sizes.tolist(), starts[:-1].tolist()):
        if size < min_area:
            continue
        pixels = order[start : start + size]
        yield np.stack([pixels // w, pixels % w], axis=1), int(labels.flat[root])


def _core(ys: np.ndarray, xs: np.ndarray, bw: int, bh: int) -> int:
    """Pixels of a region (box-relative coordinates) whose four neighbours are in it too."""
    mask = np.zeros((bh + 2, bw + 2), dtype=bool)
    mask[ys + 1, xs + 1] = True
    inner = mask[1:-1, 1:-1] & mask[:-2, 1:-1] & mask[2:, 1:-1] & mask[1:-1, :-2] & mask[1:-1, 2:]
    return int(inner.sum())


def _dilate(mask: np.ndarray, r: int) -> np.ndarray:
    """`mask` grown by `r` pixels (a (2r + 1)-square neighbourhood)."""
    h, w = mask.shape
    padded = np.pad(mask, r)
    out = np.zeros_like(mask)
    for dy in range(2 * r + 1):
        for dx in range(2 * r + 1):
            out |= padded[dy : dy + h, dx : dx + w]
    return out


def _colour_name(pixels: np.ndarray) -> str:
    """The named colour nearest the median of an object's [K, 3] pixels; `other` past
    `COLOUR_DISTANCE`."""
    distances = np.linalg.norm(_PALETTE - np.median(pixels, axis=0), axis=1)
    best = int(distances.argmin())
    return _NAMES[best] if distances[best] <= COLOUR_DISTANCE else "other"


# --- shapes ------------------------------------------------------------------------------------
def _regular(k: int, degrees: float) -> np.ndarray:
    """A regular k-gon of circumradius 1, a vertex straight up, turned by `degrees` (y down)."""
    a = np.radians(degrees) + np.pi / 2 + 2 * np.pi * np.arange(k) / k
    return np.stack([np.cos(a), -np.sin(a)], axis=1)


def _turned(polygon: np.ndarray, degrees: float) -> np.ndarray:
    c, s = np.cos(np.radians(degrees)), np.sin(np.radians(degrees))
    return polygon @ np.array([[c, s], [-s, c]])


_SQUARE = np.array([[-1.0, -1.0], [1.0, -1.0], [1.0, 1.0], [-1.0, 1.0]])
_TRIANGLE = np.array([[0.0, -1.0], [1.0, 1.0], [-1.0, 1.0]])  # as `draw_shape`: base = height
_PLUS = np.array(
    [[-1, -1 / 3], [-1 / 3, -1 / 3], [-1 / 3, -1], [1 / 3, -1], [1 / 3, -1 / 3], [1, -1 / 3],
     [1, 1 / 3], [1 / 3, 1 / 3], [1 / 3, 1], [-1 / 3, 1], [-1 / 3, 1 / 3], [-1, 1 / 3]]
)  # fmt: skip
SHAPE_TEMPLATES: dict[str, np.ndarray | None] = {"square": _SQUARE, "circle": None, "triangle": _TRIANGLE}
"""The task's shapes as `draw_shape` draws them (None: the unit disc)."""
DECOYS: dict[str, list[np.ndarray]] = {
    "octagon": [_regular(8, d) for d in (0, 11.25, 22.5, 33.75)],
    "hexagon": [_regular(6, d) for d in (0, 15, 30, 45)],
    "pentagon": [_regular(5, d) for d in (0, 18, 36, 54)],
    "plus": [_turned(_PLUS, d) for d in (0, 22.5, 45, 67.5)],
    "turned square": [_turned(_SQUARE, d) for d in (30, 45, 60)],
    "turned triangle": [_turned(_TRIANGLE, d) for d in (45, 90, 135, 180, 225, 270, 315)],
}
"""Shapes that are none of the three, each at the rotations it is tried in: a region that fits
one of them better than the shapes is `other`."""
POLYGON_SIDES = {"octagon": 8, "hexagon": 6, "pentagon": 5}
"""The decoys that approach a disc, and their sides (`MIN_SIDE_DEPTH`)."""
SAMPLE_POINTS = 16384
"""Quasi-random points (a Halton sequence) over the box that holds every ideal shape; those
inside one sample it when it is laid over a region."""


@cache
def _template_moments(name: str, variant: int) -> tuple[float, float, float, float, float]:
    """(area, centroid x, centroid y, spread, elongation) of an ideal shape, worked out exactly
    from its polygon (the disc: pi, 0, 0, 1/2, 1). Spread: sqrt of the mean of the two axes'
    variances; elongation: sqrt(var_y / var_x) (the shapes are symmetric about a vertical axis
    before they are turned)."""
    polygon = SHAPE_TEMPLATES[name] if name in SHAPE_TEMPLATES else DECOYS[name][variant]
    if polygon is None:
        return np.pi, 0.0, 0.0, 0.5, 1.0
    x, y = polygon[:, 0], polygon[:, 1]
    xn, yn = np.roll(x, -1), np.roll(y, -1)
    cross = x * yn - xn * y
    area = cross.sum() / 2
    cx = ((x + xn) * cross).sum() / (6 * area)
    cy = ((y + yn) * cross).sum() / (6 * area)
    exx = ((x * x + x * xn + xn * xn) * cross).sum() / (12 * area) - cx * cx
    eyy = ((y * y + y * yn + yn * yn) * cross).sum() / (12 * area) - cy * cy
    return abs(area), cx, cy, float(np.sqrt((exx + eyy) / 2)), float(np.sqrt(eyy / exx))


@cache
def _template_points(name: str, variant: int) -> np.ndarray:
    """[M, 2] points inside an ideal shape: the `SAMPLE_POINTS` first of a Halton sequence
    (bases 2 and 3) over [-1.5, 1.5]^2, which holds every shape at any turn (the farthest
    corner, a square's, is sqrt(2) from the centre)."""
    polygon = SHAPE_TEMPLATES[name] if name in SHAPE_TEMPLATES else DECOYS[name][variant]
    i = np.arange(1, SAMPLE_POINTS + 1)
    points = np.stack([_halton(i, 2), _halton(i, 3)], axis=1) * 3.0 - 1.5
    return points[_inside(polygon, points[:, 0], points[:, 1])]


@cache
def _bank() -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Every ideal shape and decoy variant at once: (the name of each variant, [V] its area,
    [P, 2] the points of all of them relative to their variant's centroid, in units of its
    spread, [P] the variant of each point)."""
    names, areas, points, owner = [], [], [], []
    variants = [(n, 0) for n in SHAPE_TEMPLATES] + [
        (n, i) for n, vs in DECOYS.items() for i in range(len(vs))
    ]
    for v, (name, i) in enumerate(variants):
        area, cx, cy, spread, _ = _template_moments(name, i)
        names.append(name)
        areas.append(area / spread**2)
        points.append((_template_points(name, i) - [cx, cy]) / spread)
        owner.append(np.full(len(points[-1]), v))
    return names, np.array(areas), np.concatenate(points).astype(np.float32), np.concatenate(owner)


def _halton(i: np.ndarray, base: int) -> np.ndarray:
    """The radical inverse of each index in `base` (a low-discrepancy sequence in [0, 1))."""
    out, f, i = np.zeros(len(i)), 1.0, i.copy()
    while i.any():
        f /= base
        out += f * (i % base)
        i //= base
    return out


def _inside(polygon: np.ndarray | None, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Points inside the unit disc (None) or a simple polygon (even-odd rule)."""
    if polygon is None:
        return x * x + y * y <= 1.0
    inside = np.zeros(x.shape, dtype=bool)
    xj, yj = polygon[-1]
    for xi, yi in polygon:
        crosses = (yi > y) != (yj > y)
        with np.errstate(divide="ignore", invalid="ignore"):
            at = (xj - xi) * (y - yi) / (yj - yi) + xi
        inside ^= crosses & (x < at)
        xj, yj = xi, yi
    return inside


def _moments(ys: np.ndarray, xs: np.ndarray) -> tuple[float, float, np.ndarray]:
    """Centroid (x, y) and the 2 x 2 covariance of a region's pixels (each a unit square)."""
    xs, ys = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    cx, cy = xs.mean(), ys.mean()
    dx, dy = xs - cx, ys - cy
    cov = np.array(
        [[(dx * dx).mean() + 1 / 12, (dx * dy).mean()], [(dx * dy).mean(), (dy * dy).mean() + 1 / 12]]
    )
    return cx, cy, cov


def _radius(ys: np.ndarray, xs: np.ndarray) -> float:
    """The radius of the disc with the region's spread (pixels)."""
    _, _, cov = _moments(ys, xs)
    return float(2 * np.sqrt(np.trace(cov) / 2))


def _elongation(ys: np.ndarray, xs: np.ndarray, shape_elongation: float = 1.0) -> float:
    """Long over short spread of the region's principal axes, its height first divided by
    `shape_elongation` (so that an ideal shape of that proportion measures 1)."""
    _, _, cov = _moments(ys, xs)
    scale = np.array([1.0, 1.0 / shape_elongation])
    values = np.linalg.eigvalsh(cov * np.outer(scale, scale))
    return float(np.sqrt(values[1] / max(values[0], 1e-12)))


def shape_fits(ys: np.ndarray, xs: np.ndarray) -> dict[str, float]:
    """IoU of a region (pixel coordinates) with each ideal shape of `SHAPE_TEMPLATES` and each
    decoy of `DECOYS` (its best rotation), placed on the region's centroid and scaled to its
    spread (moment-matched), the ideal shape keeping its own proportions.

    Matching by moments, not by the bounding box, is what makes the measure robust to the edges
    a generator draws: one stray pixel or a ragged row moves a box by a pixel or two, the
    moments hardly at all. The ideal shape is sampled by its `_template_points` laid over the
    region's pixel grid: with I its area (exact) times the share of the points that land on the
    region's pixels, the IoU is I / (|region| + area - I)."""
    cx, cy, cov = _moments(ys, xs)
    spread = float(np.sqrt(np.trace(cov) / 2))
    ys, xs = np.asarray(ys, dtype=np.int64), np.asarray(xs, dtype=np.int64)
    # the region on a grid with room for any ideal shape laid over it (none reaches more than
    # 3.1 of its spreads from its centroid: a triangle's apex)
    pad = int(np.ceil(4 * spread)) + 2
    x0, y0 = int(xs.min()) - pad, int(ys.min()) - pad
    grid = np.zeros((int(ys.max()) - y0 + pad + 1, int(xs.max()) - x0 + pad + 1), dtype=bool)
    grid[ys - y0, xs - x0] = True
    names, areas, points, owner = _bank()
    # pixel of each point (truncation is the floor: the pad keeps every coordinate positive)
    px = (points[:, 0] * np.float32(spread) + np.float32(cx - x0 + 0.5)).astype(np.int32)
    py = (points[:, 1] * np.float32(spread) + np.float32(cy - y0 + 0.5)).astype(np.int32)
    hits = np.bincount(owner, weights=grid.ravel()[py * grid.shape[1] + px], minlength=len(names))
    counts = np.bincount(owner, minlength=len(names))
    pixels = areas * spread**2  # each variant's area in pixels, at the region's spread
    covered = pixels * hits / counts
    iou = covered / (len(xs) + pixels - covered)
    fits: dict[str, float] = {}
    for name, value in zip(names, iou.tolist()):
        fits[name] = max(fits.get(name, 0.0), value)
    return fits


def _shape(fit: dict[str, float], elongation_of, radius: float) -> str:
    """The verdict of step 4 of the module docs. `elongation_of(shape_elongation)`: the region's
    elongation relative to a shape of that proportion."""
    candidates = [s for s in SHAPE_TEMPLATES if elongation_of(_template_moments(s, 0)[4]) <= MAX_ELONGATION]
    if not candidates:
        return "other"
    best = max(candidates, key=fit.get)
    decoys = [
        d
        for d in DECOYS
        if d not in POLYGON_SIDES or radius * (1 - np.cos(np.pi / POLYGON_SIDES[d])) >= MIN_SIDE_DEPTH
    ]
    if fit[best] < MIN_SHAPE_FIT or any(fit[d] > fit[best] for d in decoys):
        return "other"
    return best


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


PARTS = ("colour", "count", "shape", "shape_fit", "position", "clean", "accuracy", "correct")


def check_spec(spec: ImageSpec, analysis: Analysis) -> dict[str, float]:
    """Steps 5-6 of the module docs: the credits, `clean`, `accuracy` and `correct` (and the
    analysis's `noise`, `edge_noise` and object count)."""
    if spec.text is not None:
        raise ValueError("a text spec is scored by the OCR reward, not by the geneval verifier")
    quality = {"noise": analysis.noise, "edge_noise": analysis.edge_noise}
    if analysis.foreground > MAX_FOREGROUND:
        return {
            **dict.fromkeys(PARTS, 0.0),
            "format": 0.0,
            "objects": float(len(analysis.objects)),
            **quality,
        }
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
    total = sum(o.area for o in analysis.objects) + analysis.stray
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
        **quality,
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
    is `correct`, GenEval's number) with `n` (images scored), `correct` (how many) and its Wilson
    95% interval `accuracy_low` / `accuracy_high`; `score` (the mean partial-credit accuracy);
    `edge_noise` and `noise` (means of the analysis's); `accuracy/<kind>` per prompt kind.
    `images`: [N, 3, H, W] floats in [0, 1] (a pipeline's output), or a list of PIL images /
    [H, W, 3] uint8 arrays. Text prompts are skipped (OCR scores them)."""
    from mmrl.datasets.geneval import parse_prompt
    from mmrl.stats import wilson_interval

    torch = sys.modules.get("torch")  # a tensor means torch is loaded: scoring never loads it
    if torch is not None and isinstance(images, torch.Tensor):
        images = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
        images = list(images.cpu().numpy())
    if len(images) != len(prompts):
        raise ValueError(f"prompt_following: {len(images)} images for {len(prompts)} prompts")
    correct: dict[str, list[float]] = {}
    scores, noise, edge_noise = [], [], []
    for image, prompt in zip(images, prompts):
        spec = parse_prompt(prompt)
        if spec.text is not None:
            continue
        parts = check_spec(spec, analyse(image))
        correct.setdefault(spec.kind, []).append(parts["correct"])
        scores.append(parts["accuracy"])
        noise.append(parts["noise"])
        edge_noise.append(parts["edge_noise"])
    everything = [c for group in correct.values() for c in group]
    right = int(sum(everything))
    low, high = wilson_interval(right, len(everything))
    nan = float("nan")
    out = {
        "accuracy": right / len(everything) if everything else nan,
        "accuracy_low": low,
        "accuracy_high": high,
        "n": float(len(everything)),
        "correct": float(right),
        "score": float(np.mean(scores)) if scores else nan,
        "noise": float(np.mean(noise)) if noise else nan,
        "edge_noise": float(np.mean(edge_noise)) if edge_noise else nan,
    }
    out.update({f"accuracy/{kind}": float(np.mean(v)) for kind, v in sorted(correct.items())})
    return out
