"""The `detection` verifier (also used for grounding): box lists scored with V-Triune's rules.

A response answers with a JSON-like list of boxes, in `<answer>` tags or on its own (a
```json fenced block is unwrapped; single quotes are accepted):

    <answer>[{"bbox_2d": [x1, y1, x2, y2], "label": "car"}, ...]</answer>

The ground truth (`reward_model.ground_truth`) is such a list, either as Python data or as a
string in the same format (possibly inside `<answer>` tags, as V-Triune's data is).

Scores, for a threshold `t` on the IoU:

- Two greedy matchings of predictions to ground-truth boxes. *max-IoU-first*: repeatedly take
  the largest IoU among unmatched pairs (ties: lowest prediction index, then lowest ground-truth
  index) while it is >= t; a matched pair with different labels still consumes both boxes but
  scores 0. *label-first*: for each ground-truth box in order, the unmatched prediction with the
  same label and the largest IoU (ties: lowest index), matched when its IoU is >= t.
- From a matching: `mean_iou = sum(credited IoUs) / n_gt`, `miss = unmatched gt / n_gt`,
  `false_alarm = unmatched predictions / n_pred` (0 without predictions),
  `completeness = 1 - (miss + false_alarm) / 2`, and the weighted IoU
  `mean_iou * (1 - completeness_weight) + completeness * completeness_weight`.
- COCO mAP, mAP@0.5 and mAP@0.75 of the one image, computed with pycocotools (every prediction
  has score 1; predictions whose label is not a ground-truth label are dropped).
- A size penalty `0.6 ** |n_pred - n_gt|` multiplies every score before they are mixed.

Accuracy is the weighted mean of the penalised scores (see `weights`); it is 0 when the response
holds no valid box. The format component comes from `mmrl.verifiers.format` (by default 1 when
at least one valid box was parsed).

`verifier_params` (all optional):

- `iou_threshold`: `"dynamic"` (default), `"average"` or a number in [0, 1]. Dynamic is
  V-Triune's schedule on `r = step / total_steps`: 0.85 while r <= 0.1, 0.95 while r <= 0.25,
  0.99 after. Average is the mean weighted IoU over the thresholds 0.5, 0.55, ..., 0.95, 0.99.
- `weights`: mixing weights in [0, 1] of the scores `iou_max_iou_first`, `iou_max_label_first`,
  `map`, `map50` and `map75`; default `{"iou_max_label_first": 1.0}`. Their sum must be > 0.
- `completeness_weight`: number in [0, 1], default 0.3 (see the weighted IoU above).
- `normalized`: bool, default false. When true the ground truth is on Qwen2-VL's 0-1000 grid
  and predictions are in pixels of an image of size `image_size`; predictions are rescaled
  (`x / width * 1000`, `y / height * 1000`) before scoring.
- `image_size`: `[width, height]`, positive numbers; required when `normalized` is true.
- `format`: which format reward to use, see `mmrl.verifiers.format`.
- `style`: `"mmrl"` (default) or `"vtriune"`: V-Triune's own parsing, format reward, truncated
  normalised coordinates and component names (`score_vtriune`; what `/judge` uses).

Components: `accuracy`, `format`, `iou_threshold` (the threshold used; absent for "average"),
`size_penalty`, `iou_max_iou_first` and `iou_max_label_first` (weighted IoUs before the size
penalty), `map`, `map50`, `map75` (before the size penalty), `n_pred`, `n_gt`, and the
precision and recall of the max-IoU-first matching at IoU 0.5, 0.75 and 0.95
(`precision@0.5`, `recall@0.5`, ...). When the response holds no valid box every score,
precision and recall is reported as 0.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.format import answer_tag_content, check_format_param, format_score
from mmrl.verifiers.registry import SampleFieldError, Verifier, mix_score, register_verifier

MAX_ANSWER_CHARS = 100_000
"""Longer answers are treated as unparseable (keeps parsing time bounded)."""
AVERAGE_THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)
"""The thresholds averaged over by `iou_threshold: "average"`."""
REPORT_THRESHOLDS = (0.5, 0.75, 0.95)
"""Thresholds at which max-IoU-first precision and recall are reported."""
SCORE_KEYS = ("iou_max_iou_first", "iou_max_label_first", "map", "map50", "map75")
DEFAULT_WEIGHTS = {"iou_max_label_first": 1.0}
DEFAULT_COMPLETENESS_WEIGHT = 0.3
SIZE_PENALTY_BASE = 0.6
PARAM_KEYS = (
    "iou_threshold",
    "weights",
    "completeness_weight",
    "normalized",
    "image_size",
    "format",
    "style",
)
STYLES = ("mmrl", "vtriune")
"""`verifier_params.style`: mmrl's parsing and components, or V-Triune's (see `score_vtriune`)."""
VTRIUNE_REPORT = (("iou", (0.5, 0.95)), ("label", (0.5, 0.75, 0.95, 0.99)))
"""V-Triune's reported matchings: (strategy, thresholds) for `report_iou_<t>_<strategy>_match_*`."""
VTRIUNE_COMPONENTS = (
    "size_penalty",
    "pure_iou_score_max_iou",
    "pure_iou_score_max_label",
    "pure_map_score",
    "pure_map50_score",
    "pure_map75_score",
    "weighted_iou_score_max_iou",
    "weighted_iou_score_max_label",
    "weighted_map_score",
    "weighted_map50_score",
    "weighted_map75_score",
    *(
        f"report_iou_{round(t * 100)}_{kind}_match_{part}"
        for kind, thresholds in VTRIUNE_REPORT
        for t in thresholds
        for part in ("pure", "precision", "recall")
    ),
)
"""The accuracy components V-Triune's detection verifier returns (its `/judge` adds `_reward`)."""

Match = tuple[int, int, float]
"""(prediction index, ground-truth index, credited IoU) of one matched pair."""
Matcher = Callable[..., list[Match]]


@dataclass(frozen=True)
class Box:
    """An axis-aligned box `[x1, y1, x2, y2]` (x1 <= x2, y1 <= y2) with a normalised label."""

    x1: float
    y1: float
    x2: float
    y2: float
    label: str


# ---------------------------------------------------------------------------------------------
# Parsing


def answer_text(text: str) -> str:
    """The part of a response that should hold the box list.

    The body of the last `<answer>...</answer>` if there is one, else the whole text; stripped,
    and unwrapped from a ``` fenced block (with or without a `json` tag) when it holds one.
    Uses `str.rfind` only, so it is linear in the length of the text.
    """
    tagged = answer_tag_content(text)
    body = tagged if tagged is not None else text.strip()
    fence_end = body.rfind("```")
    fence_start = body.rfind("```", 0, fence_end) if fence_end >= 0 else -1
    if fence_start >= 0:
        body = body[fence_start + 3 : fence_end]
        tag, newline, rest = body.partition("\n")
        if newline and (not tag.strip() or tag.strip().isidentifier()):
            body = rest
        elif body[:4].lower() == "json":
            body = body[4:]
        body = body.strip()
    return body


def _as_coordinate(value: Any) -> float | None:
    """`value` as a finite float, or None if it is not a finite (non-bool) number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _as_box(item: Any) -> Box | None:
    """A `{"bbox_2d": [x1, y1, x2, y2], "label": str}` item as a `Box`; None if malformed."""
    if not isinstance(item, dict) or "bbox_2d" not in item or "label" not in item:
        return None
    coords, label = item["bbox_2d"], item["label"]
    if not isinstance(label, str) or not isinstance(coords, (list, tuple)) or len(coords) != 4:
        return None
    numbers = [_as_coordinate(c) for c in coords]
    if any(n is None for n in numbers):
        return None
    x1, y1, x2, y2 = numbers
    if x2 < x1 or y2 < y1:
        return None
    return Box(x1, y1, x2, y2, label.strip().lower())


def boxes_from_items(items: Iterable[Any]) -> list[Box]:
    """The valid boxes among `items`, in order, malformed items and exact duplicates dropped."""
    boxes: list[Box] = []
    seen: set[Box] = set()
    for item in items:
        box = _as_box(item)
        if box is not None and box not in seen:
            seen.add(box)
            boxes.append(box)
    return boxes


def _load_literal(text: str) -> Any:
    """`text` parsed as JSON, else as a Python literal; None when neither works."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def parse_boxes(text: str) -> list[Box] | None:
    """The boxes of a response or ground-truth string.

    None when the answer (see `answer_text`) is not a list or dict at all, or is longer than
    `MAX_ANSWER_CHARS`; `[]` when it parsed but holds no valid box. A single dict counts as a
    one-element list.
    """
    return _boxes_in_answer(answer_text(text))


def _boxes_in_answer(body: str) -> list[Box] | None:
    """`parse_boxes` for an answer already extracted with `answer_text`."""
    if not body or len(body) > MAX_ANSWER_CHARS:
        return None
    data = _load_literal(body)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, (list, tuple)):
        return None
    return boxes_from_items(data)


def ground_truth_boxes(ground_truth: Any) -> list[Box]:
    """The valid boxes of a ground truth given as a string, a list of dicts or one dict."""
    if isinstance(ground_truth, str):
        return parse_boxes(ground_truth) or []
    if isinstance(ground_truth, dict):
        ground_truth = [ground_truth]
    if isinstance(ground_truth, (list, tuple)):
        return boxes_from_items(ground_truth)
    return []


def rescale_boxes(boxes: Sequence[Box], width: float, height: float) -> list[Box]:
    """Pixel boxes of a `width` x `height` image moved onto Qwen2-VL's 0-1000 grid."""
    return [
        Box(b.x1 / width * 1000, b.y1 / height * 1000, b.x2 / width * 1000, b.y2 / height * 1000, b.label)
        for b in boxes
    ]


# ---------------------------------------------------------------------------------------------
# IoU and matching


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes.

    0 when they do not overlap; for a zero-area union (degenerate boxes) 1.0 if the boxes are
    identical, else 0.0. Never divides by zero.
    """
    inter_w = min(a.x2, b.x2) - max(a.x1, b.x1)
    inter_h = min(a.y2, b.y2) - max(a.y1, b.y1)
    inter = max(inter_w, 0.0) * max(inter_h, 0.0)
    union = (a.x2 - a.x1) * (a.y2 - a.y1) + (b.x2 - b.x1) * (b.y2 - b.y1) - inter
    same = (a.x1, a.y1, a.x2, a.y2) == (b.x1, b.y1, b.x2, b.y2)
    if union <= 0 or not math.isfinite(union):
        return 1.0 if same else 0.0
    return min(max(inter / union, 0.0), 1.0)


def iou_matrix(pred: Sequence[Box], gt: Sequence[Box]) -> list[list[float]]:
    """`ious[i][j]`: IoU of prediction i with ground-truth box j."""
    return [[box_iou(p, g) for g in gt] for p in pred]


def match_max_iou_first(
    pred: Sequence[Box], gt: Sequence[Box], threshold: float, ious: list[list[float]] | None = None
) -> list[Match]:
    """Greedy matching by the globally largest IoU among unmatched pairs, while >= `threshold`.

    Ties go to the lowest prediction index, then the lowest ground-truth index. A matched pair
    consumes both boxes and is credited its IoU if the labels are equal, else 0.
    """
    ious = iou_matrix(pred, gt) if ious is None else ious
    candidates = sorted(
        (-iou, i, j) for i, row in enumerate(ious) for j, iou in enumerate(row) if iou >= threshold
    )
    used_pred: set[int] = set()
    used_gt: set[int] = set()
    matches: list[Match] = []
    for neg_iou, i, j in candidates:
        if i in used_pred or j in used_gt:
            continue
        used_pred.add(i)
        used_gt.add(j)
        matches.append((i, j, -neg_iou if pred[i].label == gt[j].label else 0.0))
    return matches


def match_label_first(
    pred: Sequence[Box], gt: Sequence[Box], threshold: float, ious: list[list[float]] | None = None
) -> list[Match]:
    """Greedy matching by ground truth: for each ground-truth box in order, the unmatched
    prediction with the same label and the largest IoU (ties: lowest index), if >= `threshold`."""
    ious = iou_matrix(pred, gt) if ious is None else ious
    used_pred: set[int] = set()
    matches: list[Match] = []
    for j, g in enumerate(gt):
        best, best_iou = -1, -1.0
        for i, p in enumerate(pred):
            if i not in used_pred and p.label == g.label and ious[i][j] > best_iou:
                best, best_iou = i, ious[i][j]
        if best >= 0 and best_iou >= threshold:
            used_pred.add(best)
            matches.append((best, j, best_iou))
    return matches


def matching_scores(
    matches: Sequence[Match], n_pred: int, n_gt: int, completeness_weight: float
) -> dict[str, float]:
    """Mean IoU, miss rate, false-alarm rate, completeness, precision, recall and the weighted
    IoU of a matching (see the module docstring). `n_gt` must be positive."""
    mean_iou = sum(m[2] for m in matches) / n_gt
    miss = (n_gt - len(matches)) / n_gt
    false_alarm = (n_pred - len(matches)) / n_pred if n_pred else 0.0
    completeness = 1.0 - (miss + false_alarm) / 2
    return {
        "mean_iou": mean_iou,
        "miss": miss,
        "false_alarm": false_alarm,
        "completeness": completeness,
        "precision": 1.0 - false_alarm,
        "recall": 1.0 - miss,
        "weighted_iou": mean_iou * (1 - completeness_weight) + completeness * completeness_weight,
    }


def dynamic_iou_threshold(step: int, total_steps: int) -> float:
    """V-Triune's schedule on `r = step / total_steps`: 0.85 while r <= 0.1, 0.95 while
    r <= 0.25, 0.99 after (r = 0 when `total_steps` is not positive)."""
    ratio = step / total_steps if total_steps > 0 else 0.0
    if ratio <= 0.1:
        return 0.85
    if ratio <= 0.25:
        return 0.95
    return 0.99


def size_penalty(n_pred: int, n_gt: int) -> float:
    """`0.6 ** |n_pred - n_gt|`."""
    return SIZE_PENALTY_BASE ** abs(n_pred - n_gt)


# ---------------------------------------------------------------------------------------------
# COCO mAP


def coco_map(pred: Sequence[Box], gt: Sequence[Box]) -> dict[str, float]:
    """COCO mAP, mAP@0.5 and mAP@0.75 (`map`, `map50`, `map75`) of one image with pycocotools.

    Categories are the ground-truth labels; predictions with other labels are dropped; every
    prediction has score 1.0. The same numbers as COCOeval's `stats[0:3]` (area "all", 100
    detections), but only that area range and detection limit are evaluated, and the "all"
    range is widened to any area so that huge boxes count too. pycocotools' printing is
    silenced. All three are 0 when no prediction has a ground-truth label.
    """
    import numpy as np
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    categories = {label: k + 1 for k, label in enumerate(dict.fromkeys(b.label for b in gt))}
    kept = [b for b in pred if b.label in categories]
    if not kept or not gt:
        return {"map": 0.0, "map50": 0.0, "map75": 0.0}

    def coco_box(b: Box) -> list[float]:
        return [b.x1, b.y1, b.x2 - b.x1, b.y2 - b.y1]

    gt_dataset = {
        "images": [{"id": 1}],
        "categories": [{"id": k, "name": label} for label, k in categories.items()],
        "annotations": [
            {
                "id": n + 1,
                "image_id": 1,
                "category_id": categories[b.label],
                "bbox": coco_box(b),
                "area": (b.x2 - b.x1) * (b.y2 - b.y1),
                "iscrowd": 0,
            }
            for n, b in enumerate(gt)
        ],
    }
    detections = [
        {"image_id": 1, "category_id": categories[b.label], "bbox": coco_box(b), "score": 1.0} for b in kept
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = gt_dataset
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(detections)
        evaluator = COCOeval(coco_gt, coco_dt, iouType="bbox")
        evaluator.params.areaRng = [[0.0, float("inf")]]
        evaluator.params.areaRngLbl = ["all"]
        evaluator.params.maxDets = [100]
        evaluator.evaluate()
        evaluator.accumulate()
    precision = evaluator.eval["precision"][:, :, :, 0, 0]  # [iou thresholds, recall, category]
    thresholds = evaluator.params.iouThrs

    def mean_ap(values: Any) -> float:
        valid = values[values > -1]
        return float(np.mean(valid)) if valid.size else 0.0

    return {
        "map": mean_ap(precision),
        "map50": mean_ap(precision[np.isclose(thresholds, 0.5)]),
        "map75": mean_ap(precision[np.isclose(thresholds, 0.75)]),
    }


# ---------------------------------------------------------------------------------------------
# Parameters


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def detection_params(sample: Sample) -> dict[str, Any]:
    """The sample's `verifier_params` checked and completed with defaults.

    Raises `SampleFieldError` naming the offending `reward_model.verifier_params.<key>`.
    """
    params = sample.reward_model.verifier_params or {}

    def fail(key: str, problem: str) -> SampleFieldError:
        return SampleFieldError(f"reward_model.verifier_params.{key}", problem)

    for key in params:
        if key not in PARAM_KEYS:
            raise fail(key, f"unknown detection parameter; known: {list(PARAM_KEYS)}")

    threshold = params.get("iou_threshold", "dynamic")
    if not (threshold in ("dynamic", "average") or (_is_number(threshold) and 0 <= threshold <= 1)):
        raise fail("iou_threshold", f'must be "dynamic", "average" or a number in [0, 1], got {threshold!r}')

    weights = params.get("weights", DEFAULT_WEIGHTS)
    if not isinstance(weights, dict):
        raise fail("weights", f"must be a mapping of {list(SCORE_KEYS)} to weights, got {weights!r}")
    for key, weight in weights.items():
        if key not in SCORE_KEYS:
            raise fail("weights", f"unknown score {key!r}; known: {list(SCORE_KEYS)}")
        if not (_is_number(weight) and 0 <= weight <= 1):
            raise fail("weights", f"weight of {key!r} must be a number in [0, 1], got {weight!r}")
    if sum(weights.values()) <= 0:
        raise fail("weights", "weights must not sum to 0")

    completeness_weight = params.get("completeness_weight", DEFAULT_COMPLETENESS_WEIGHT)
    if not (_is_number(completeness_weight) and 0 <= completeness_weight <= 1):
        raise fail("completeness_weight", f"must be a number in [0, 1], got {completeness_weight!r}")

    normalized = params.get("normalized", False)
    if not isinstance(normalized, bool):
        raise fail("normalized", f"must be true or false, got {normalized!r}")
    style = params.get("style", "mmrl")
    if style not in STYLES:
        raise fail("style", f"must be one of {list(STYLES)}, got {style!r}")

    image_size = params.get("image_size")
    if image_size is not None and not (
        isinstance(image_size, (list, tuple))
        and len(image_size) == 2
        and all(_is_number(v) and v > 0 for v in image_size)
    ):
        raise fail("image_size", f"must be [width, height] with positive numbers, got {image_size!r}")
    if normalized and image_size is None and style != "vtriune":
        # V-Triune scores unscaled boxes when it has no image grid (and logs a warning).
        raise fail("image_size", "is required when normalized is true")

    return {
        "iou_threshold": threshold,
        "weights": dict(weights),
        "completeness_weight": float(completeness_weight),
        "normalized": normalized,
        "image_size": None if image_size is None else (float(image_size[0]), float(image_size[1])),
        "style": style,
    }


# ---------------------------------------------------------------------------------------------
# The verifier


def _weighted_iou(
    matcher: Matcher,
    pred: list[Box],
    gt: list[Box],
    thresholds: Sequence[float],
    ious: list[list[float]],
    cw: float,
) -> float:
    """Mean over `thresholds` of the weighted IoU of `matcher`'s matching."""
    total = 0.0
    for t in thresholds:
        total += matching_scores(matcher(pred, gt, t, ious), len(pred), len(gt), cw)["weighted_iou"]
    return total / len(thresholds)


def _iou_thresholds(threshold: float | str, context: VerifyContext) -> tuple[float, ...]:
    """The IoU thresholds a sample's `iou_threshold` names: `average` (0.5:0.05:0.95),
    `dynamic` (one, by training progress), or the one number given."""
    if threshold == "average":
        return AVERAGE_THRESHOLDS
    if threshold == "dynamic":
        return (dynamic_iou_threshold(context.step, context.total_steps),)
    return (float(threshold),)


def _pure_scores(
    pred: list[Box], gt: list[Box], thresholds: Sequence[float], ious: list[list[float]], cw: float
) -> dict[str, float]:
    """The scores before the size penalty: each matching's weighted IoU (mean over
    `thresholds`) and COCO mAP (`map`, `map50`, `map75`)."""
    return {
        "iou_max_iou_first": _weighted_iou(match_max_iou_first, pred, gt, thresholds, ious, cw),
        "iou_max_label_first": _weighted_iou(match_label_first, pred, gt, thresholds, ious, cw),
        **coco_map(pred, gt),
    }


def _penalised_accuracy(weights: dict[str, float], penalty: float, scores: dict[str, float]) -> float:
    """The accuracy: the `weights`-weighted mean of the scores, each times the size penalty."""
    return sum(w * penalty * scores[k] for k, w in weights.items()) / sum(weights.values())


@register_verifier("detection")
class DetectionVerifier(Verifier):
    """Box-list answers scored against ground-truth boxes (IoU matchings and COCO mAP, mixed
    by `weights` and scaled by the size penalty). See the module docstring."""

    def check_sample(self, sample: Sample) -> None:
        check_format_param(sample)
        detection_params(sample)
        gold = sample.reward_model.ground_truth
        if isinstance(gold, str) and len(answer_text(gold)) > MAX_ANSWER_CHARS:
            raise SampleFieldError(
                "reward_model.ground_truth",
                f"is a box list of {len(answer_text(gold)):,} characters, more than the "
                f"{MAX_ANSWER_CHARS:,} this verifier reads from a string (about 2,000 boxes): give the "
                "boxes as a JSON array instead of a string (an array has no such limit)",
            )
        if not ground_truth_boxes(gold):
            raise SampleFieldError(
                "reward_model.ground_truth",
                'holds no valid box (expected [{"bbox_2d": [x1, y1, x2, y2], "label": "..."}, ...])',
            )

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        params = detection_params(sample)
        if params["style"] == "vtriune":
            return score_vtriune(response, sample, context, params)
        gt = ground_truth_boxes(sample.reward_model.ground_truth)
        if not gt:
            raise ValueError("the ground truth holds no valid box")
        body = answer_text(response)
        pred = _boxes_in_answer(body) or []
        if params["normalized"] and pred:
            pred = rescale_boxes(pred, *params["image_size"])

        threshold = params["iou_threshold"]
        thresholds = _iou_thresholds(threshold, context)
        penalty = size_penalty(len(pred), len(gt))
        report: dict[str, float] = {}
        if pred:
            cw = params["completeness_weight"]
            ious = iou_matrix(pred, gt)
            scores = _pure_scores(pred, gt, thresholds, ious, cw)
            for t in REPORT_THRESHOLDS:
                found = matching_scores(match_max_iou_first(pred, gt, t, ious), len(pred), len(gt), cw)
                report[f"precision@{t:g}"] = found["precision"]
                report[f"recall@{t:g}"] = found["recall"]
            accuracy = _penalised_accuracy(params["weights"], penalty, scores)
        else:  # no valid box: nothing to score
            scores = dict.fromkeys(SCORE_KEYS, 0.0)
            report = {f"{kind}@{t:g}": 0.0 for t in REPORT_THRESHOLDS for kind in ("precision", "recall")}
            accuracy = 0.0

        fmt = format_score(response, sample, bool(pred))
        components = {"accuracy": accuracy, "format": fmt}
        if threshold != "average":
            components["iou_threshold"] = thresholds[0]
        components.update({"size_penalty": penalty, **scores, **report})
        components.update({"n_pred": float(len(pred)), "n_gt": float(len(gt))})
        return VerifierResult(
            score=mix_score(sample, accuracy, fmt), components=components, extracted=body[:500]
        )


# ---------------------------------------------------------------------------------------------
# V-Triune's detection reward (`style: "vtriune"`, what `/judge` uses)


def vtriune_answer_block(text: str) -> str:
    """The body of the *first* `<answer>...</answer>`, stripped; "" when there is none."""
    start = text.find("<answer>")
    end = text.find("</answer>", start + len("<answer>")) if start >= 0 else -1
    return text[start + len("<answer>") : end].strip() if end >= 0 else ""


def vtriune_items(body: str) -> list[Any] | None:
    """V-Triune's box-list reading of an (already lower-cased) answer: `[[` and `]]` flattened,
    a list cut short after its last complete item closed, quotes made double, backslashes
    dropped, then JSON. None when that is not a JSON list."""
    if not body or not body.strip() or len(body) > MAX_ANSWER_CHARS:
        return None
    body = body.replace("[[", "[").replace("]]", "]")
    if not body.endswith("]"):
        body = body.rsplit("},", 1)[0] + "}]"
    body = body.replace("'", '"').replace("\\", "")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, list) else None


def vtriune_boxes(items: Iterable[Any] | None) -> list[Box]:
    """V-Triune's valid boxes: a dict with `bbox_2d` (4 numbers, x1 <= x2, y1 <= y2) and a str
    `label`; the first box at each position is kept (a second label there is dropped)."""
    boxes: list[Box] = []
    seen: set[tuple[float, ...]] = set()
    for item in items or []:
        box = _as_box(item) if isinstance(item, dict) else None
        if box is None or not isinstance(item.get("label"), str):
            continue
        box = Box(box.x1, box.y1, box.x2, box.y2, item["label"])  # V-Triune does not strip labels
        position = (box.x1, box.y1, box.x2, box.y2)
        if position not in seen:
            seen.add(position)
            boxes.append(box)
    return boxes


def vtriune_format(response: str) -> float:
    """V-Triune's detection format reward: 1 when `\\n<answer>\\n` occurs and `\\n</answer>`
    occurs exactly once, and the first answer block holds a valid box."""
    if not (response.count("\n<answer>\n") and response.count("\n</answer>") == 1):
        return 0.0
    return 1.0 if vtriune_boxes(vtriune_items(vtriune_answer_block(response.strip()).lower())) else 0.0


def _lower_item(item: Any) -> Any:
    """A ground-truth item as V-Triune sees it after lower-casing its text."""
    if not isinstance(item, dict):
        return item
    return {str(k).lower(): (v.lower() if isinstance(v, str) else v) for k, v in item.items()}


def vtriune_ground_truth(ground_truth: Any) -> list[Box]:
    if isinstance(ground_truth, str):
        text = ground_truth.strip()
        body = vtriune_answer_block(text) if "<answer>" in text else text
        return vtriune_boxes(vtriune_items(body.lower()))
    if isinstance(ground_truth, dict):
        ground_truth = [ground_truth]
    if isinstance(ground_truth, (list, tuple)):
        return vtriune_boxes([_lower_item(i) for i in ground_truth])
    return []


def score_vtriune(
    response: str, sample: Sample, context: VerifyContext, params: dict[str, Any]
) -> VerifierResult:
    """V-Triune's `DetectionVerifier` reward, component for component.

    The same as V-Triune's server (`reward_server/verify.py`) except where that is a bug:
    max-IoU-first matching takes the pair with the largest IoU (V-Triune's loop keeps the last
    pair it visited, so reordered boxes score differently), and a ground truth without a valid
    box, or weights summing to 0, is an error rather than a silent 0. Normalised predictions
    are truncated to integers on the 0-1000 grid, as V-Triune does; without an image size they
    are scored as given.
    """
    gt = vtriune_ground_truth(sample.reward_model.ground_truth)
    if not gt:
        raise ValueError("the ground truth holds no valid box")
    fmt = vtriune_format(response)
    pred = vtriune_boxes(vtriune_items(vtriune_answer_block(response.strip()).lower()))
    if pred and params["normalized"] and params["image_size"] is not None:
        width, height = params["image_size"]
        pred = [
            Box(
                int(b.x1 / width * 1000),
                int(b.y1 / height * 1000),
                int(b.x2 / width * 1000),
                int(b.y2 / height * 1000),
                b.label,
            )  # fmt: skip
            for b in pred
        ]
    components: dict[str, float] = dict.fromkeys(VTRIUNE_COMPONENTS, 0.0)
    accuracy = 0.0
    if pred:
        thresholds = _iou_thresholds(params["iou_threshold"], context)
        cw = params["completeness_weight"]
        ious = iou_matrix(pred, gt)
        penalty = size_penalty(len(pred), len(gt))
        pure = _pure_scores(pred, gt, thresholds, ious, cw)
        components.update(
            size_penalty=penalty,
            pure_iou_score_max_iou=pure["iou_max_iou_first"],
            pure_iou_score_max_label=pure["iou_max_label_first"],
            pure_map_score=pure["map"],
            pure_map50_score=pure["map50"],
            pure_map75_score=pure["map75"],
            weighted_iou_score_max_iou=pure["iou_max_iou_first"] * penalty,
            weighted_iou_score_max_label=pure["iou_max_label_first"] * penalty,
            weighted_map_score=pure["map"] * penalty,
            weighted_map50_score=pure["map50"] * penalty,
            weighted_map75_score=pure["map75"] * penalty,
        )
        matchers = {"iou": match_max_iou_first, "label": match_label_first}
        for kind, report_thresholds in VTRIUNE_REPORT:
            for t in report_thresholds:
                found = matching_scores(matchers[kind](pred, gt, t, ious), len(pred), len(gt), cw)
                name = f"report_iou_{round(t * 100)}_{kind}_match"
                components[f"{name}_pure"] = found["mean_iou"]
                components[f"{name}_precision"] = found["precision"]
                components[f"{name}_recall"] = found["recall"]
        accuracy = _penalised_accuracy(params["weights"], penalty, pure)
    return VerifierResult(
        score=mix_score(sample, accuracy, fmt),
        components={"accuracy": accuracy, "format": fmt, **components},
        extracted=vtriune_answer_block(response.strip())[:500],
    )
