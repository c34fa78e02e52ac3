"""The detection verifier: box parsing, IoU, both greedy matchings, the IoU threshold schedules,
COCO mAP and the final mix, each checked against numbers worked out by hand."""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest

from mmrl.types import RewardSpec, Sample, VerifyContext
from mmrl.verifiers import get_verifier, verifier_names
from mmrl.verifiers.detection import (
    AVERAGE_THRESHOLDS,
    Box,
    box_iou,
    coco_map,
    dynamic_iou_threshold,
    match_label_first,
    match_max_iou_first,
    matching_scores,
    parse_boxes,
    rescale_boxes,
    size_penalty,
)
from mmrl.verifiers.registry import SampleFieldError


def _sample(gt, fmt_ratio: float = 0.0, **params) -> Sample:
    return Sample(
        data_source="toy",
        prompt=[{"role": "user", "content": "<image>Find the cars."}],
        images=[],
        ability="detection",
        reward_model=RewardSpec(
            ground_truth=gt,
            verifier="detection",
            verifier_params=params,
            accuracy_ratio=1.0,
            format_ratio=fmt_ratio,
        ),
        extra_info={"id": "d"},
    )


def _boxes(*items: tuple[list[float], str]) -> str:
    """A response body: the boxes as a JSON list."""
    return json.dumps([{"bbox_2d": coords, "label": label} for coords, label in items])


def _answer(*items: tuple[list[float], str]) -> str:
    return f"<think>\nlooking\n</think>\n<answer>\n{_boxes(*items)}\n</answer>"


CAR = Box(0, 0, 10, 10, "car")


# --- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '[{"bbox_2d": [0, 0, 10, 10], "label": "car"}]',
        "[{'bbox_2d': [0, 0, 10, 10], 'label': 'car'}]",
        '{"bbox_2d": [0, 0, 10, 10], "label": "car"}',  # a single dict is a one-element list
        '```json\n[{"bbox_2d": [0, 0, 10, 10], "label": "car"}]\n```',
        'Here:\n```\n[{"bbox_2d": [0.0, 0, 10, 10.0], "label": "car"}]\n```',
        "<think>\nhm\n</think>\n<answer>\n[{'bbox_2d': [0, 0, 10, 10], 'label': ' Car '}]\n</answer>",
        '<answer>[{"bbox_2d": [1, 1, 2, 2], "label": "x"}]</answer> no, <answer>\n```json\n'
        '[{"bbox_2d": [0, 0, 10, 10], "label": "CAR"}]\n```\n</answer>',  # the last answer counts
    ],
)
def test_parse_boxes_accepts_common_answer_shapes(text):
    assert parse_boxes(text) == [CAR]


def test_parse_boxes_skips_malformed_items_and_exact_duplicates():
    text = (
        "[1, 'car', {'label': 'car'}, {'bbox_2d': [0, 0, 1, 1]},"
        " {'bbox_2d': [0, 0, 1], 'label': 'car'},"  # 3 numbers
        " {'bbox_2d': [True, 0, 1, 1], 'label': 'car'},"  # a bool is not a number
        " {'bbox_2d': ['0', 0, 1, 1], 'label': 'car'},"
        " {'bbox_2d': [5, 0, 1, 1], 'label': 'car'},"  # x2 < x1
        " {'bbox_2d': [0, 5, 1, 1], 'label': 'car'},"  # y2 < y1
        " {'bbox_2d': [0, 0, 1, 1], 'label': 7},"
        " {'bbox_2d': [0, 0, 10, 10], 'label': 'car'},"
        " {'bbox_2d': [0.0, 0.0, 10.0, 10.0], 'label': 'Car'},"  # an exact duplicate
        " {'bbox_2d': [0, 0, 10, 10], 'label': 'dog'},"  # same box, other label: kept
        " {'bbox_2d': [2, 2, 2, 2], 'label': 'dot'}]"  # degenerate but valid
    )
    assert parse_boxes(text) == [CAR, Box(0, 0, 10, 10, "dog"), Box(2, 2, 2, 2, "dot")]
    # JSON's NaN / Infinity parse but are not finite coordinates.
    assert (
        parse_boxes(
            '[{"bbox_2d": [0, 0, NaN, 1], "label": "a"}, {"bbox_2d": [0, 0, 1, Infinity], "label": "a"}]'
        )
        == []
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "no boxes here",
        "42",
        '"[]"',  # a string, not a list
        '[{"bbox_2d": [0, 0, 10, 10], "label": "car"}',  # unterminated
        "<answer></answer>",
        "__import__('os').system('echo pwned')",  # never evaluated
        "[" * 40_000 + "]" * 40_000,  # too deep for either parser
        "[" + "0," * 60_000 + "0]",  # longer than the 100k-character cap
    ],
)
def test_parse_boxes_returns_none_for_garbage(text):
    assert parse_boxes(text) is None


@pytest.mark.parametrize("text", ["[]", "[1, 2]", '[{"box": [0, 0, 1, 1], "label": "a"}]', "{}"])
def test_parse_boxes_returns_empty_list_when_no_box_is_valid(text):
    assert parse_boxes(text) == []


def test_parse_boxes_is_fast_on_hostile_input():
    start = time.perf_counter()
    assert parse_boxes("<answer>" * 100_000 + "[") is None
    assert parse_boxes("```" * 100_000) is None
    assert time.perf_counter() - start < 1.0


# --- IoU and matchings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "iou"),
    [
        ([0, 0, 10, 10], [5, 0, 15, 10], 50 / 150),  # overlap 5x10, union 100 + 100 - 50
        ([0, 0, 10, 10], [0, 0, 5, 5], 25 / 100),  # contained
        ([0, 0, 10, 10], [20, 20, 30, 30], 0.0),  # disjoint
        ([0, 0, 10, 10], [10, 0, 20, 10], 0.0),  # touching edges
        ([0, 0, 10, 10], [0, 0, 10, 10], 1.0),
        ([3, 3, 3, 3], [3, 3, 3, 3], 1.0),  # identical degenerate boxes: zero-area union
        ([3, 3, 3, 3], [4, 4, 4, 4], 0.0),
        ([0, 5, 10, 5], [0, 0, 10, 10], 0.0),  # a line inside a box has no area
    ],
)
def test_box_iou_hand_cases(a, b, iou):
    assert box_iou(Box(*a, "x"), Box(*b, "x")) == pytest.approx(iou)
    assert box_iou(Box(*b, "x"), Box(*a, "x")) == pytest.approx(iou)


# gt: a car and a dog. Predictions: a "dog" exactly on the car (wrong label, IoU 1), a car
# with IoU 80/100 = 0.8 on the car, and the dog exactly.
GT_CAR_DOG = [Box(0, 0, 10, 10, "car"), Box(20, 0, 30, 10, "dog")]
PRED_WRONG_LABEL = [Box(0, 0, 10, 10, "dog"), Box(0, 0, 10, 8, "car"), Box(20, 0, 30, 10, "dog")]


def test_max_iou_first_lets_a_wrong_label_consume_the_ground_truth():
    matches = match_max_iou_first(PRED_WRONG_LABEL, GT_CAR_DOG, 0.5)
    # IoU 1 pairs first (pred 0 before pred 2); pred 0 takes the car with score 0, so the
    # 0.8 car prediction finds its ground truth taken.
    assert matches == [(0, 0, 0.0), (2, 1, 1.0)]
    s = matching_scores(matches, n_pred=3, n_gt=2, completeness_weight=0.3)
    assert s["mean_iou"] == pytest.approx((0 + 1) / 2)
    assert s["miss"] == 0.0
    assert s["false_alarm"] == pytest.approx(1 / 3)
    assert s["completeness"] == pytest.approx(1 - (0 + 1 / 3) / 2)  # 5/6
    assert s["precision"] == pytest.approx(2 / 3)
    assert s["recall"] == 1.0
    assert s["weighted_iou"] == pytest.approx(0.5 * 0.7 + 5 / 6 * 0.3)  # 0.6


def test_label_first_only_matches_same_labels():
    matches = match_label_first(PRED_WRONG_LABEL, GT_CAR_DOG, 0.5)
    assert matches == [(1, 0, pytest.approx(0.8)), (2, 1, 1.0)]
    s = matching_scores(matches, n_pred=3, n_gt=2, completeness_weight=0.3)
    assert s["mean_iou"] == pytest.approx((0.8 + 1) / 2)
    assert s["completeness"] == pytest.approx(5 / 6)
    assert s["precision"] == pytest.approx(2 / 3)
    assert s["recall"] == 1.0
    assert s["weighted_iou"] == pytest.approx(0.9 * 0.7 + 5 / 6 * 0.3)  # 0.88


def test_matchings_break_ties_by_lowest_index_and_respect_the_threshold():
    gt = [CAR]
    pred = [Box(0, 0, 10, 5, "car"), Box(0, 5, 10, 10, "car")]  # both IoU 0.5
    assert match_max_iou_first(pred, gt, 0.5) == [(0, 0, 0.5)]
    assert match_label_first(pred, gt, 0.5) == [(0, 0, 0.5)]
    assert match_max_iou_first(pred, gt, 0.51) == []
    assert match_label_first(pred, gt, 0.51) == []


def test_max_iou_first_takes_the_global_maximum_not_ground_truth_order():
    gt = [Box(0, 0, 10, 10, "a"), Box(0, 0, 10, 9, "a")]
    pred = [Box(0, 0, 10, 9, "a")]  # IoU 0.9 with gt 0, 1.0 with gt 1
    assert match_max_iou_first(pred, gt, 0.5) == [(0, 1, 1.0)]
    assert match_label_first(pred, gt, 0.5) == [(0, 0, pytest.approx(0.9))]  # gt 0 asks first


def test_completeness_counts_misses_and_false_alarms():
    # 3 gt, 2 predictions, one matched with IoU 0.9: miss 2/3, false alarm 1/2.
    s = matching_scores([(0, 0, 0.9)], n_pred=2, n_gt=3, completeness_weight=0.5)
    assert s["mean_iou"] == pytest.approx(0.3)
    assert s["miss"] == pytest.approx(2 / 3)
    assert s["false_alarm"] == pytest.approx(1 / 2)
    assert s["completeness"] == pytest.approx(1 - (2 / 3 + 1 / 2) / 2)  # 5/12
    assert s["precision"] == pytest.approx(0.5)
    assert s["recall"] == pytest.approx(1 / 3)
    assert s["weighted_iou"] == pytest.approx(0.3 * 0.5 + 5 / 12 * 0.5)
    # No prediction: nothing is a false alarm, everything is missed.
    empty = matching_scores([], n_pred=0, n_gt=2, completeness_weight=0.3)
    assert (empty["false_alarm"], empty["miss"], empty["completeness"]) == (0.0, 1.0, 0.5)


def test_size_penalty_through_the_verifier():
    assert size_penalty(3, 1) == pytest.approx(0.36)
    assert size_penalty(2, 2) == 1.0
    sample = _sample(_boxes(([0, 0, 10, 10], "car")), iou_threshold=0.5, completeness_weight=0.0)
    response = _answer(([0, 0, 10, 10], "car"), ([50, 50, 60, 60], "car"), ([70, 70, 80, 80], "car"))
    result = get_verifier("detection")(response, sample)
    assert result.error is None
    assert result.components["iou_max_label_first"] == 1.0  # the one gt is found exactly
    assert result.components["size_penalty"] == pytest.approx(0.6**2)
    assert result.components["accuracy"] == pytest.approx(0.36)
    assert result.components["n_pred"] == 3.0
    assert result.components["n_gt"] == 1.0
    assert result.components["precision@0.5"] == pytest.approx(1 / 3)
    assert result.components["recall@0.5"] == 1.0


# --- IoU thresholds -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "threshold"), [(0, 0.85), (10, 0.85), (11, 0.95), (25, 0.95), (26, 0.99), (100, 0.99)]
)
def test_dynamic_threshold_schedule(step, threshold):
    assert dynamic_iou_threshold(step, 100) == threshold


def test_dynamic_threshold_tightens_during_training():
    # IoU 90/100 = 0.9: above 0.85 (early), below 0.99 (late).
    sample = _sample([{"bbox_2d": [0, 0, 10, 10], "label": "car"}], completeness_weight=0.0)
    response = _answer(([0, 0, 10, 9], "car"))
    verifier = get_verifier("detection")
    early = verifier(response, sample, VerifyContext(step=5, total_steps=100))
    assert early.components["iou_threshold"] == 0.85
    assert early.components["accuracy"] == pytest.approx(0.9)
    late = verifier(response, sample, VerifyContext(step=50, total_steps=100))
    assert late.components["iou_threshold"] == 0.99
    assert late.components["accuracy"] == 0.0


def test_fixed_threshold():
    response = _answer(([0, 0, 10, 9], "car"))  # IoU 0.9
    verifier = get_verifier("detection")
    for threshold, accuracy in [(0.8, 0.9), (0.95, 0.0)]:
        sample = _sample(_boxes(([0, 0, 10, 10], "car")), iou_threshold=threshold, completeness_weight=0.0)
        result = verifier(response, sample, VerifyContext(step=99, total_steps=100))
        assert result.components["iou_threshold"] == threshold
        assert result.components["accuracy"] == pytest.approx(accuracy)


def test_average_threshold_by_hand():
    assert len(AVERAGE_THRESHOLDS) == 11
    # IoU 80/100 = 0.8 passes the 7 thresholds 0.5, 0.55, ..., 0.8 and fails the other 4.
    response = _answer(([0, 0, 10, 8], "car"))
    verifier = get_verifier("detection")
    sample = _sample(_boxes(([0, 0, 10, 10], "car")), iou_threshold="average", completeness_weight=0.0)
    result = verifier(response, sample)
    assert result.components["accuracy"] == pytest.approx(7 * 0.8 / 11)
    assert "iou_threshold" not in result.components
    # With completeness weight 0.5: a pass scores 0.8 * 0.5 + 1 * 0.5 = 0.9; a failure leaves
    # one miss and one false alarm, completeness 0, so 0.
    sample = _sample(_boxes(([0, 0, 10, 10], "car")), iou_threshold="average", completeness_weight=0.5)
    assert verifier(response, sample).components["accuracy"] == pytest.approx(7 * 0.9 / 11)


# --- normalized coordinates ---------------------------------------------------------------------


def test_normalized_ground_truth_rescales_pixel_predictions():
    # 20/200*1000 = 100, 10/100*1000 = 100, 100/200*1000 = 500, 50/100*1000 = 500.
    gt = [{"bbox_2d": [100, 100, 500, 500], "label": "car"}]
    response = _answer(([20, 10, 100, 50], "car"))
    verifier = get_verifier("detection")
    sample = _sample(gt, normalized=True, image_size=[200, 100], iou_threshold=0.99)
    result = verifier(response, sample)
    assert result.error is None
    assert result.components["iou_max_label_first"] == pytest.approx(1.0)
    assert result.components["accuracy"] == pytest.approx(1.0)
    assert verifier(response, _sample(gt, iou_threshold=0.99)).components["accuracy"] == 0.0


def test_rescale_keeps_fractions():
    (box,) = rescale_boxes([Box(1, 1, 2, 3, "a")], width=3, height=7)
    assert (box.x1, box.y1, box.x2, box.y2) == pytest.approx((1000 / 3, 1000 / 7, 2000 / 3, 3000 / 7))


# --- COCO mAP -----------------------------------------------------------------------------------


def _cocoeval_stats(pred: list[Box], gt: list[Box]) -> list[float]:
    """stats[0:3] of a plain, default COCOeval run on one image (the reference)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    labels = sorted({b.label for b in gt})
    cat = {label: k + 1 for k, label in enumerate(labels)}

    def xywh(b):
        return [b.x1, b.y1, b.x2 - b.x1, b.y2 - b.y1]

    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = {
            "images": [{"id": 7}],
            "categories": [{"id": cat[label], "name": label} for label in labels],
            "annotations": [
                {
                    "id": n + 1,
                    "image_id": 7,
                    "category_id": cat[b.label],
                    "bbox": xywh(b),
                    "area": (b.x2 - b.x1) * (b.y2 - b.y1),
                    "iscrowd": 0,
                }
                for n, b in enumerate(gt)
            ],
        }
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(
            [{"image_id": 7, "category_id": cat[b.label], "bbox": xywh(b), "score": 1.0} for b in pred]
        )
        evaluator = COCOeval(coco_gt, coco_dt, "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return [float(s) for s in evaluator.stats[:3]]


def test_coco_map_perfect_prediction(capsys):
    gt = [Box(10, 10, 50, 60, "car"), Box(100, 20, 180, 90, "dog")]
    assert coco_map(list(gt), gt) == pytest.approx({"map": 1.0, "map50": 1.0, "map75": 1.0})
    assert capsys.readouterr().out == ""  # pycocotools' printing is silenced


def test_coco_map_matches_a_direct_cocoeval_run():
    gt = [Box(10, 10, 50, 60, "car"), Box(100, 20, 180, 90, "dog")]
    pred = [
        Box(12, 10, 50, 58, "car"),  # IoU 0.91 with the car
        Box(100, 20, 150, 90, "dog"),  # IoU 0.625 with the dog
        Box(200, 200, 220, 220, "car"),  # a false positive
    ]
    ours = coco_map(pred, gt)
    assert [ours["map"], ours["map50"], ours["map75"]] == pytest.approx(_cocoeval_stats(pred, gt))
    # The dog counts at IoU 0.5 but not 0.75, so AP75 is below AP50.
    assert ours["map50"] > ours["map75"] > 0


def test_coco_map_half_recall_by_hand():
    # Two cars, one found exactly, no false positive: precision 1 up to recall 0.5, and no
    # detection reaches higher recall. COCO interpolates precision at the 101 recall points
    # 0, 0.01, ..., 1: the 51 points <= 0.5 get 1, the other 50 get 0, so AP = 51/101 at
    # every IoU threshold (not exactly 0.5). COCO divides tp by tp + fp + eps, hence approx.
    gt = [Box(0, 0, 10, 10, "car"), Box(20, 0, 30, 10, "car")]
    ours = coco_map([Box(0, 0, 10, 10, "car")], gt)
    assert ours == pytest.approx({"map": 51 / 101, "map50": 51 / 101, "map75": 51 / 101})
    assert [ours["map"], ours["map50"], ours["map75"]] == pytest.approx(
        _cocoeval_stats([Box(0, 0, 10, 10, "car")], gt)
    )
    # One category per car instead: AP 1 for the found one, 0 for the other, mean 0.5.
    assert coco_map([Box(0, 0, 10, 10, "car")], [gt[0], Box(20, 0, 30, 10, "dog")])["map"] == pytest.approx(
        0.5
    )


def test_coco_map_drops_unknown_labels():
    assert coco_map([Box(0, 0, 10, 10, "truck")], [CAR]) == {"map": 0.0, "map50": 0.0, "map75": 0.0}
    assert coco_map([], [CAR]) == {"map": 0.0, "map50": 0.0, "map75": 0.0}


# --- the final mix ------------------------------------------------------------------------------


def test_weighted_mix_by_hand():
    # gt: a car and a dog; the response finds only the car, exactly. Threshold 0.5, cw 0.3.
    # label-first: mean IoU 1/2, miss 1/2, no false alarm, completeness 0.75,
    #   weighted IoU 0.5 * 0.7 + 0.75 * 0.3 = 0.575.
    # mAP50: car AP 1, dog AP 0 (no detection) -> 0.5.  Size penalty 0.6 (1 pred vs 2 gt).
    # accuracy = 0.6 * (1.0 * 0.575 + 0.5 * 0.5) / (1.0 + 0.5) = 0.6 * 0.55 = 0.33.
    gt = _boxes(([0, 0, 10, 10], "car"), ([20, 0, 30, 10], "dog"))
    sample = _sample(gt, iou_threshold=0.5, weights={"iou_max_label_first": 1.0, "map50": 0.5})
    result = get_verifier("detection")(_answer(([0, 0, 10, 10], "car")), sample)
    assert result.components["iou_max_label_first"] == pytest.approx(0.575)
    assert result.components["map50"] == pytest.approx(0.5)
    assert result.components["size_penalty"] == pytest.approx(0.6)
    assert result.components["accuracy"] == pytest.approx(0.33)
    assert result.score == pytest.approx(0.33)


def test_default_weights_use_label_first_and_both_matchings_are_reported():
    gt = [{"bbox_2d": [b.x1, b.y1, b.x2, b.y2], "label": b.label} for b in GT_CAR_DOG]
    response = _answer(*[([b.x1, b.y1, b.x2, b.y2], b.label) for b in PRED_WRONG_LABEL])
    result = get_verifier("detection")(response, _sample(gt, iou_threshold=0.5))
    c = result.components
    assert c["iou_max_iou_first"] == pytest.approx(0.6)
    assert c["iou_max_label_first"] == pytest.approx(0.88)
    assert c["accuracy"] == pytest.approx(0.6 * 0.88)  # 3 predictions vs 2 gt
    assert set(c) == {
        "accuracy",
        "format",
        "iou_threshold",
        "size_penalty",
        "iou_max_iou_first",
        "iou_max_label_first",
        "map",
        "map50",
        "map75",
        "n_pred",
        "n_gt",
        *(f"{kind}@{t}" for t in ("0.5", "0.75", "0.95") for kind in ("precision", "recall")),
    }
    assert all(isinstance(v, float) for v in c.values())


# --- samples, responses and the registry --------------------------------------------------------


GOOD_GT = [{"bbox_2d": [0, 0, 10, 10], "label": "car"}]


@pytest.mark.parametrize(
    ("gt", "params", "field"),
    [
        (GOOD_GT, {"iou_threshold": 1.5}, "reward_model.verifier_params.iou_threshold"),
        (GOOD_GT, {"iou_threshold": "fast"}, "reward_model.verifier_params.iou_threshold"),
        (GOOD_GT, {"iou_threshold": True}, "reward_model.verifier_params.iou_threshold"),
        (GOOD_GT, {"iou": 0.5}, "reward_model.verifier_params.iou"),
        (GOOD_GT, {"weights": {"map": 0.0}}, "reward_model.verifier_params.weights"),
        (GOOD_GT, {"weights": {"recall": 1.0}}, "reward_model.verifier_params.weights"),
        (GOOD_GT, {"weights": {"map": 2.0}}, "reward_model.verifier_params.weights"),
        (GOOD_GT, {"weights": [1.0]}, "reward_model.verifier_params.weights"),
        (GOOD_GT, {"completeness_weight": -0.1}, "reward_model.verifier_params.completeness_weight"),
        (GOOD_GT, {"normalized": True}, "reward_model.verifier_params.image_size"),
        (GOOD_GT, {"normalized": "yes"}, "reward_model.verifier_params.normalized"),
        (GOOD_GT, {"image_size": [0, 100]}, "reward_model.verifier_params.image_size"),
        (GOOD_GT, {"format": "xml"}, "reward_model.verifier_params.format"),
        ("no boxes", {}, "reward_model.ground_truth"),
        ([], {}, "reward_model.ground_truth"),
        ([{"bbox_2d": [5, 5, 1, 1], "label": "car"}], {}, "reward_model.ground_truth"),
        (3, {}, "reward_model.ground_truth"),
    ],
)
def test_check_sample_names_the_bad_field(gt, params, field):
    with pytest.raises(SampleFieldError) as info:
        get_verifier("detection").check_sample(_sample(gt, **params))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("gt", "params"),
    [
        (GOOD_GT, {}),
        ("<answer>\n[{'bbox_2d': [0, 0, 10, 10], 'label': 'car'}]\n</answer>", {}),
        (GOOD_GT[0], {"iou_threshold": 0, "completeness_weight": 1}),
        (
            GOOD_GT,
            {
                "iou_threshold": "average",
                "weights": {"map": 0.5, "iou_max_iou_first": 0.5},
                "normalized": True,
                "image_size": [640, 480],
                "format": "think_answer",
            },
        ),
    ],
)
def test_check_sample_accepts_valid_samples(gt, params):
    get_verifier("detection").check_sample(_sample(gt, **params))


@pytest.mark.parametrize(
    "response", ["I cannot see any car.", "<answer>[]</answer>", "<answer>[{'bbox_2d': 1}]</answer>"]
)
def test_malformed_response_scores_zero_without_error(response):
    result = get_verifier("detection")(response, _sample(GOOD_GT, fmt_ratio=0.5))
    assert result.error is None
    assert result.score == 0.0
    assert result.components["accuracy"] == 0.0
    assert result.components["format"] == 0.0
    assert result.components["n_pred"] == 0.0
    assert result.components["recall@0.5"] == 0.0


def test_format_component():
    verifier = get_verifier("detection")
    miss = _answer(([50, 50, 60, 60], "car"))  # a valid box, in the wrong place
    result = verifier(miss, _sample(GOOD_GT, fmt_ratio=0.5))
    assert (result.components["accuracy"], result.components["format"]) == (0.0, 1.0)
    assert result.score == pytest.approx(0.5)
    # think_answer: V-Triune's tag structure, whatever the boxes.
    sample = _sample(GOOD_GT, fmt_ratio=0.5, format="think_answer")
    assert verifier(miss, sample).components["format"] == 1.0
    assert verifier("<answer>[]</answer>", sample).components["format"] == 0.0
    hit = verifier(_answer(([0, 0, 10, 10], "car")), sample, VerifyContext(step=90, total_steps=100))
    assert hit.score == pytest.approx(1.0 + 0.5)
    assert hit.extracted == _boxes(([0, 0, 10, 10], "car"))


def test_registry_knows_the_detection_verifier():
    assert "detection" in verifier_names()
    assert get_verifier("detection").name == "detection"
