"""Agreement of mmrl's `/judge` with V-Triune's own reward server, on our own payloads.

Run both servers on loopback, then this script (it only sends HTTP requests):

    # V-Triune's server, from a checkout of MiniMax-AI/One-RL-to-See-Them-All, in its own venv
    # (uvicorn fastapi numpy pycocotools matplotlib math-verify; DET_IOU_THRESHOLD unset, as its
    # launch script leaves it):
    cd reward_server && uvicorn reward_serving_fastapi:app --host 127.0.0.1 --port 18192
    # mmrl's:
    mmrl serve --port 18193 --workers 2
    python benchmarks/vtriune_judge_agreement.py --vtriune http://127.0.0.1:18192 --mmrl http://127.0.0.1:18193

Payloads are generated from a fixed seed: detection (exact, shifted, missing, extra, relabelled
and reordered boxes; upper-case keys and labels, `[[...]]` wrappers, backslashes, truncated
lists, two answer blocks, missing tags; normalised coordinates with and without an image grid;
several `det_reward_ratio`s, out-of-range ones included) and math (right and wrong answers in
several forms, `<answer>` without LaTeX, hedges, format variants, ratios). Every reward key of
V-Triune's answer is compared (absolute tolerance 1e-9).

A case is left out of the agreement rate, and counted by kind, when the difference is one of
the two documented corrections of V-Triune bugs:

- `max_iou_first`: V-Triune's max-IoU-first matching keeps the last pair its loop visited
  instead of the best one; the case is a bug case when that rule and the correct one give
  different matchings at one of the IoU thresholds it uses (then only the max-IoU-first values,
  and a final reward weighting them, may differ);
- `error_not_zero`: V-Triune gives accuracy 0 to a sample it cannot score (a ground truth it
  cannot parse, weights summing to 0, an exception) and still adds the format reward; mmrl
  answers zeros and an `error` (counted and logged by the server).

and the one deliberate reward-hacking fix: `brace_guard` (mmrl does not credit an answer region
with unbalanced braces, V-Triune does).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

import httpx

THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)
LABELS = ("cat", "dog", "car")


def _iou(a: list[float], b: list[float]) -> float:
    ix, iy = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
    if ix <= 0 or iy <= 0:
        return 0.0
    inter = ix * iy
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def _matching(pred: list[list[float]], gt: list[list[float]], t: float, buggy: bool) -> list[tuple[int, int]]:
    """Greedy max-IoU-first pairs; `buggy` keeps the last pair visited (with the max's value)."""
    ious = [[_iou(p, g) for g in gt] for p in pred]
    free_p, free_g, pairs = list(range(len(pred))), list(range(len(gt))), []
    while free_p and free_g:
        best, bi, bj = -1.0, -1, -1
        for i in free_p:
            for j in free_g:
                if ious[i][j] > best:
                    best, bi, bj = ious[i][j], i, j
        if best < t:
            break
        if buggy:
            bi, bj = free_p[-1], free_g[-1]
        pairs.append((bi, bj))
        free_p.remove(bi)
        free_g.remove(bj)
    return pairs


def _box(rng: random.Random) -> list[int]:
    x, y = rng.randint(0, 600), rng.randint(0, 600)
    return [x, y, x + rng.randint(40, 300), y + rng.randint(40, 300)]


def _jitter(box: list[int], rng: random.Random, amount: int) -> list[int]:
    out = [c + rng.randint(-amount, amount) for c in box]
    return [min(out[0], out[2]), min(out[1], out[3]), max(out[0], out[2]), max(out[1], out[3])]


def detection_cases(rng: random.Random, n: int) -> list[dict[str, Any]]:
    ratios = [
        {"iou_max_label_first": 1.0},
        {"iou_max_label_first": 0.5, "map": 0.5, "iou_completeness": 0.3},
        {"iou_max_iou_first": 1.0, "iou_completeness": 0.2},
        {"map50": 1.0},
        {"iou_max_label_first": 1.0, "map75": 2.0},  # out of range: reset to 0
        {"iou_max_label_first": 0.7, "iou_max_iou_first": 0.3, "map": 0.2, "iou_completeness": 0.5},
        {},  # every ratio 0: V-Triune's final score is a silent 0
    ]
    cases = []
    for k in range(n):
        gt = [{"bbox_2d": _box(rng), "label": rng.choice(LABELS)} for _ in range(rng.randint(1, 3))]
        kind = k % 16
        pred = [dict(b) for b in gt]
        if kind == 1:
            pred = [{"bbox_2d": _jitter(b["bbox_2d"], rng, 8), "label": b["label"]} for b in gt]
        elif kind == 2:
            pred = [{"bbox_2d": _jitter(b["bbox_2d"], rng, 60), "label": b["label"]} for b in gt]
        elif kind == 3:
            pred = pred[:-1] or pred
        elif kind == 4:
            pred = pred + [{"bbox_2d": _box(rng), "label": rng.choice(LABELS)}]
        elif kind == 5:
            pred = [{"bbox_2d": b["bbox_2d"], "label": "bird"} for b in gt]
        elif kind == 6:
            pred = list(
                reversed([{"bbox_2d": _jitter(b["bbox_2d"], rng, 15), "label": b["label"]} for b in gt])
            )
        text = json.dumps(pred)
        if kind == 7:
            text = text.replace("bbox_2d", "BBOX_2D").replace('"label"', '"Label"').upper()
        elif kind == 8:
            text = "[" + text + "]"
        elif kind == 9:
            text = text.replace('"', '\\"')
        elif kind == 10:
            text = text[:-1] + ', {"bbox_2d": [1, 2'  # cut short mid-item
        elif kind == 11:
            text = text.replace('"', "'")
        parm: dict[str, Any] = {
            "is_training": True,
            "step": rng.randint(0, 100),
            "total_steps": 100,
            "image_path": ["/x.jpg"],
            "image_grid_thw": None,
            "det_reward_ratio": rng.choice(ratios),
        }
        if kind == 12:  # normalised: predictions in pixels of the model input
            h, w = rng.choice([(280, 420), (336, 336), (700, 500)])
            parm.update(det_verifier_normalized=True, image_grid_thw=[[1, h, w]])
            text = json.dumps(
                [
                    {
                        "bbox_2d": [c * (w if i % 2 == 0 else h) / 1000 for i, c in enumerate(b["bbox_2d"])],
                        "label": b["label"],
                    }
                    for b in pred
                ]
            )
        elif kind == 13:
            parm.update(det_verifier_normalized=True)  # no grid: unscaled
        if kind == 14:
            response = f"<think>look</think><answer>{text}</answer>"  # no newlines: format 0
        elif kind == 15:
            response = f"<think>\nfirst\n</think>\n<answer>\n[]\n</answer> then <answer>\n{text}\n</answer>"
        else:
            response = f"<think>\nI see it.\n</think>\n<answer>\n{text}\n</answer>"
        cases.append(
            {
                "response": response,
                "prompt": "Find the objects.",
                "answer": json.dumps(gt),
                "solution": "<answer> " + str(gt) + " </answer>",
                "data_source": "det",
                "reward_verifier": "detection",
                "reward_verifier_parm": json.dumps(parm),
                "format_ratio": rng.choice([0.1, 0.5, 1.0]),
                "accuracy_ratio": 1.0,
            }
        )
    return cases


def math_cases(rng: random.Random, n: int) -> list[dict[str, Any]]:
    golds = [("4", ["4", "4.0", "\\frac{8}{2}", "5", "four"]), ("\\frac{1}{2}", ["0.5", "\\frac{1}{2}", "1/2", "\\frac{1}{3}"]),
             ("25\\%", ["0.25", "25\\%", "25"]), ("\\sqrt{2}", ["2^{1/2}", "\\sqrt{2}", "1.41"]),
             ("x^2+1", ["x^2 + 1", "1 + x^2", "x^2"]), ("\\pi", ["\\pi", "3.14159", "\\Pi"]),
             ("10", ["10", "10\\text{ cm}", "1e1", "9.99"])]  # fmt: skip
    cases = []
    for k in range(n):
        gold, answers = rng.choice(golds)
        answer = rng.choice(answers)
        kind = k % 8
        body = {0: f"\\boxed{{{answer}}}", 1: f"${answer}$", 2: answer, 3: f"\\boxed{{{answer}}} or \\boxed{{7}}",
                4: f"The answer is \\boxed{{{answer}}}.", 5: f"\\boxed{{{answer}}}", 6: f"\\boxed{{{answer}}}}}",
                7: f"\\boxed{{{answer.upper()}}}"}[kind]  # fmt: skip
        think = rng.choice(["<think>\nwork\n</think>\n", "<think>work</think>", ""])
        response = f"{think}<answer>\n{body}\n</answer>" if kind != 5 else f"{think}{body}"
        solution = rng.choice([gold, f"<answer> {gold} </answer>", f"${gold}$"])
        payload = {
            "response": response,
            "prompt": "Solve.",
            "answer": gold,
            "solution": solution,
            "data_source": "math",
            "reward_verifier": "mathverify",
            "reward_verifier_parm": json.dumps({"is_training": True, "step": 3, "total_steps": 10}),
        }
        if rng.random() < 0.7:
            payload["format_ratio"] = rng.choice([0.1, 0.5])
        cases.append(payload)
    return cases


def classify(payload: dict[str, Any], mmrl: dict[str, Any], theirs: dict[str, float]) -> str | None:
    """The documented correction behind a difference on this payload, if any (checked: the
    difference must be only what that correction changes)."""
    ours = mmrl["rewards"]
    if mmrl.get("error"):
        # V-Triune's accuracy is its silent 0 (it still adds the format reward); mmrl's answer
        # is zeros and the error.
        return "error_not_zero" if theirs["accuracy_reward"] == 0.0 else None
    differing = {k for k in theirs if abs(float(ours.get(k, 0.0)) - float(theirs[k])) > 1e-9}
    if payload["reward_verifier"] == "mathverify":
        body = payload["response"]
        unbalanced = body.count("{") != body.count("}")
        flipped = theirs["accuracy_reward"] == 1.0 and ours["accuracy_reward"] == 0.0
        return (
            "brace_guard"
            if unbalanced and flipped and differing <= {"accuracy_reward", "final_reward"}
            else None
        )
    max_iou_keys = {k for k in theirs if "max_iou" in k or "iou_match" in k}
    if (
        json.loads(payload["reward_verifier_parm"]).get("det_reward_ratio", {}).get("iou_max_iou_first", 0)
        > 0
    ):
        max_iou_keys |= {"accuracy_reward", "final_reward"}
    if not differing <= max_iou_keys:
        return None
    parm = json.loads(payload["reward_verifier_parm"])
    try:
        gt = [b["bbox_2d"] for b in json.loads(payload["answer"])]
        start = payload["response"].index("<answer>") + len("<answer>")
        pred = [
            b["bbox_2d"]
            for b in json.loads(
                payload["response"][start : payload["response"].index("</answer>", start)].strip()
            )
        ]
    except (ValueError, KeyError, TypeError):
        return None
    if parm.get("det_verifier_normalized") and parm.get("image_grid_thw"):
        _, h, w = parm["image_grid_thw"][0]
        pred = [[int(c / (w if i % 2 == 0 else h) * 1000) for i, c in enumerate(b)] for b in pred]
    for t in THRESHOLDS:
        if _matching(pred, gt, t, buggy=False) != _matching(pred, gt, t, buggy=True):
            return "max_iou_first"
    return None


def compare(vtriune_url: str, mmrl_url: str, n_detection: int, n_math: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    report: dict[str, Any] = {}
    with httpx.Client(timeout=60) as client:
        for name, payloads in (
            ("detection", detection_cases(rng, n_detection)),
            ("math", math_cases(rng, n_math)),
        ):
            agree = total = 0
            excluded: dict[str, int] = {}
            examples = []
            for payload in payloads:
                theirs = client.post(f"{vtriune_url}/judge", json=payload).json()["rewards"]
                answer = client.post(f"{mmrl_url}/judge", json=payload)
                ours_full = answer.json()
                ours = ours_full["rewards"]
                same = (
                    answer.status_code == 200
                    and set(ours) == set(theirs)
                    and all(abs(float(ours[k]) - float(theirs[k])) <= 1e-9 for k in theirs)
                )
                if not same:
                    kind = classify(payload, ours_full, theirs)
                    if kind is not None:
                        excluded[kind] = excluded.get(kind, 0) + 1
                        continue
                    if len(examples) < 5:
                        diff = {
                            k: (theirs.get(k), ours.get(k))
                            for k in set(theirs) | set(ours)
                            if theirs.get(k) != ours.get(k)
                        }
                        examples.append({"payload": payload, "diff": diff})
                total += 1
                agree += same
            report[name] = {
                "agree": agree,
                "compared": total,
                "agreement": agree / total if total else None,
                "excluded_documented_corrections": excluded,
                "disagreements": examples,
            }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vtriune", default="http://127.0.0.1:18192", help="V-Triune's reward server")
    parser.add_argument("--mmrl", default="http://127.0.0.1:18193", help="mmrl's reward server")
    parser.add_argument("--detection", type=int, default=400, help="detection payloads")
    parser.add_argument("--math", type=int, default=400, help="math payloads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)
    report = compare(args.vtriune, args.mmrl, args.detection, args.math, args.seed)
    for name, r in report.items():
        print(
            f"{name}: {r['agree']}/{r['compared']} agree ({100 * (r['agreement'] or 0):.1f}%), left out as documented corrections: {r['excluded_documented_corrections']}"
        )
        for example in r["disagreements"]:
            print("  differs:", json.dumps(example["diff"])[:300])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
