"""Does `--scoring megabench` give MEGA-Bench's own numbers? Case-by-case agreement with its code.

`mmrl/eval/megabench.py` (and the task scorers in `mmrl/eval/task_metrics.py`) reproduce
MEGA-Bench's parsers and metrics, quirks included. This script generates a fixed, seeded set of
cases, scores every case twice -- with MEGA-Bench's own classes (imported from a checkout of
TIGER-AI-Lab/MEGA-Bench, run in a separate worker process) and with mmrl's reproduction -- and
prints, per metric and per parser, the number of cases, how many agree, how many MEGA-Bench
scored above 0 (`MB>0`), and the first disagreements with their inputs. The exit status is 1
when any case disagrees.

Run it::

    git clone https://github.com/TIGER-AI-Lab/MEGA-Bench /tmp/megabench-src
    pip install -e '.[megabench]'              # rapidfuzz, unidecode, sacrebleu, jieba, nltk, pronouncing
    pip install --no-deps --target /tmp/antlr411 antlr4-python3-runtime==4.11.0
    python benchmarks/megabench_agreement.py --megabench /tmp/megabench-src --antlr411 /tmp/antlr411

MEGA-Bench's side needs what its metric modules import: `datasets` (its `utils.py`), `regex`,
`numpy`, `sympy`, `matplotlib` and `Pillow` (its `conversions.py`) besides the `megabench` extra.
SymPy's `parse_latex` refuses any ANTLR runtime but 4.11 (MEGA-Bench pins 4.11; mmrl's
environment has 4.13, which mmrl's own LaTeX reader drives directly). Under a 4.13 runtime
MEGA-Bench's `parse_latex` raises and its LaTeX/number metrics would not give its real numbers,
so its worker puts `--antlr411` (a `pip --target` folder holding the 4.11 runtime) first on its
path; mmrl's side runs in this process with the environment's runtime, as `mmrl eval` does.

How each side is called (MEGA-Bench: `megabench/evaluation_processor.py`):

- **metrics**: the reference goes through `evaluate_as_string` (both sides), then MEGA-Bench's
  `MetricType.match`, which turns any exception into a score of 0, with the arguments its
  `evaluate_field` passes (`eval_context` and `task_info` for `symbolic_planning_test` and
  `program_judge`, the whole parsed response for `constrained_generation`, `eval_context` for
  `xml_norm_point_in_bbox`, whose `(score, info)` result the evaluator unpacks); mmrl:
  `megabench.score_reference` with the `FieldContext` `mmrl eval` builds. Scores agree within
  1e-9; MEGA-Bench's NaN (an empty `nbbox_iou_sequence`) agrees with mmrl's -1 (its stand-in,
  left out of aggregation as NaN is). When MEGA-Bench's evaluator itself would crash (an
  exception outside `MetricType.match`'s wrapper, or a wrapped 0 it then fails to unpack) there
  is no MEGA-Bench number: such a case is counted under "MEGA-Bench crashes" and agrees only if
  mmrl raises too (none are generated on purpose; any that appear are listed).
- **parsers**: the response parsing of `EvaluationProcessor.process` (single-field parsers with
  `is_single_line_ans` from the reference; `json` falling back to the raw response per field;
  `dummy`) against `megabench.parse_fields`; the parsed values must be equal with the same types
  (`1` is not `1.0` is not `True`; dict keys keep their types).
- **queries**: whole queries (parser, several fields with their metrics, weights, `mean`/`min`
  aggregation) through MEGA-Bench's `process` loop and `AggregationType`, against mmrl's
  `runner.score_response(..., scoring="megabench")`: every field score and the query score.

Covered: every metric of `megabench.REFERENCE_METRICS` under its MEGA-Bench name except the
model judges; the parsers `answer_string`, `ascii_answer_string`, `verbatim_answer_string`,
`json`, `dummy`. Cases: hand-picked edge cases (the quirk classes of `mmrl/eval/megabench.py`'s
docstring) and seeded random responses/targets (letters, numbers in many notations, LaTeX,
lists/sets/dicts as text and as values, JSON, BLEU and Chinese texts, boxes, points,
coordinates, PDDL plans, poems under constraints, small programs, None and empty values).

Not covered (and why):

- `gpt_4o_as_judge` / `ascii_art_gpt4o_judge` (an LLM call), `nli_entailment` and
  `geo_proximity_location_dict` (a Hugging Face model / a geocoding web service; mmrl has
  neither metric), mmrl's alias names (`general_numerical_match`, `longest_common_prefix_ratio`,
  `normalized_similarity_demarau_levenshtein`, `model_judge`: MEGA-Bench's `MetricType` does not
  know them) and mmrl's `raw` parser.
- `constrained_generation`'s `contain*` constraints: they need NLTK's `punkt_tab` and `wordnet`
  data, which cannot be fetched offline (mmrl skips such queries; MEGA-Bench would score 0).
- Inputs on which MEGA-Bench's code hangs until its time limits (SIGALRM 10-15 s, `eval` in a
  subprocess 5 s): mmrl sets no such limits (see its docstring); and programs that read
  `sys.stdin` or touch the file system (MEGA-Bench runs them unsandboxed in its own process).
- `program_judge` runs only where mmrl's sandbox works (Linux namespaces); else its cases are
  reported as unavailable.

Nothing is stubbed on MEGA-Bench's side: its modules are imported as they are (the judge, NLI
and geocoding modules are simply never imported). `program_judge` gets `results_file=None`, so
MEGA-Bench writes no test-result files.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

SEED = 20250101
TOL = 1e-9
TASK_INFO = {"task_name": "megabench_agreement", "results_file": None}

JUDGES = ("gpt_4o_as_judge", "ascii_art_gpt4o_judge", "model_judge")
ALIASES = (
    "general_numerical_match",
    "longest_common_prefix_ratio",
    "normalized_similarity_demarau_levenshtein",
)
PARSERS = ("answer_string", "ascii_answer_string", "verbatim_answer_string", "json", "dummy")

# =========================================================================== case generation

CASES_FILE = Path(__file__).with_name("megabench_agreement_cases.txt")
"""The hand-written case tables: a `[TABLE]` header, then one Python literal per line."""


def load_case_tables(path: Path = CASES_FILE) -> dict[str, list[Any]]:
    """Every table of `path` by name, in file order (the order seeds the generated cases)."""
    tables: dict[str, list[Any]] = {}
    current: list[Any] | None = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]") and line[1:-1].isidentifier():
            current = tables.setdefault(line[1:-1], [])
        elif current is None:
            raise ValueError(f"{path}:{number}: a case before the first [TABLE] header")
        else:
            try:
                current.append(ast.literal_eval(line))
            except (ValueError, SyntaxError) as exc:
                raise ValueError(f"{path}:{number}: not a Python literal ({exc})") from None
    return tables


CASE_TABLES = load_case_tables()
LETTERS = "ABCDEFGH"
WORDS = CASE_TABLES["WORDS"]
ACCENTED = CASE_TABLES["ACCENTED"]
CHINESE = CASE_TABLES["CHINESE"]
CHESS = CASE_TABLES["CHESS"]


def _word(rng: random.Random) -> str:
    return rng.choice(WORDS)


def _phrase(rng: random.Random, lo: int = 1, hi: int = 5) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(lo, hi)))


def _case_variant(rng: random.Random, text: str) -> str:
    return rng.choice([text, text.upper(), text.lower(), text.title(), text.swapcase()])


def _perturb(rng: random.Random, text: str) -> str:
    """A near copy: case, spacing, punctuation or one character changed (or the same)."""
    ops = [
        lambda t: t,
        lambda t: t,
        lambda t: _case_variant(rng, t),
        lambda t: " " + t + " ",
        lambda t: t.replace(" ", "  "),
        lambda t: t.replace(" ", "-"),
        lambda t: t + ".",
        lambda t: t + "\n",
        lambda t: "\t" + t,
        lambda t: t[:-1] if len(t) > 1 else t + "x",
        lambda t: t + rng.choice("xyz"),
        lambda t: t.replace("e", "é"),
        lambda t: "The " + t,
        lambda t: "a " + t,
    ]
    return rng.choice(ops)(text)


def _number(rng: random.Random) -> float | int:
    kind = rng.random()
    if kind < 0.35:
        return rng.randint(-20, 200)
    if kind < 0.7:
        return round(rng.uniform(-100, 1000), rng.randint(0, 4))
    if kind < 0.8:
        return 0
    if kind < 0.9:
        return round(rng.uniform(0, 1), 3)
    return rng.choice([1e-5, 1e6, 2.5e3, 123456789, -0.001])


def _number_text(rng: random.Random, x: float | int) -> str:
    """One of many notations for x (most read back as x, some deliberately not)."""
    forms = [
        lambda: str(x),
        lambda: f"{x}",
        lambda: f"{float(x)}",
        lambda: f"{x:.2f}" if isinstance(x, float) else f"{x}.0",
        lambda: f"{x:,}",
        lambda: f"{x:e}",
        lambda: f"${x}",
        lambda: f"{x}%",
        lambda: f"{x}°",
        lambda: f"{x}°C",
        lambda: f"{x} C",
        lambda: f"¥{x}",
        lambda: f"x = {x}",
        lambda: f"y ≈ {x}",
        lambda: f"\\approx {x}",
        lambda: f"\\({x}\\)",
        lambda: f"\\[{x}\\]",
        lambda: f"${x}$",
        lambda: f" {x} ",
        lambda: f"{x} apples",
        lambda: f"about {x}",
        lambda: f"\\frac{{{int(x)}}}{{{rng.randint(1, 9)}}}",
        lambda: f"{int(x)}/{rng.randint(1, 9)}",
        lambda: f"{int(x)}*{rng.randint(1, 9)}",
        lambda: f"({x})",
        lambda: f"-{x}",
        lambda: f"+{x}",
        lambda: f"{x}\\pi",
        lambda: f"{int(x)}π",
        lambda: f"\\boxed{{{x}}}",
        lambda: f"\\sqrt{{{abs(int(x))}}}",
        lambda: f"{int(x)}^2",
        lambda: f"{int(x)}**2",
        lambda: f"{str(x).replace('.', ',')}",
        lambda: f"[{x}, {_number(rng)}]",
        lambda: f"({x}, {_number(rng)})",
    ]
    return rng.choice(forms)()


NUMBER_EDGES = CASE_TABLES["NUMBER_EDGES"]

LIST_EDGES = CASE_TABLES["LIST_EDGES"]


def _item(rng: random.Random) -> Any:
    return rng.choice(
        [
            lambda: _word(rng),
            lambda: _word(rng).upper(),
            lambda: rng.choice(LETTERS),
            lambda: rng.randint(0, 9),
            lambda: round(rng.uniform(0, 10), 1),
            lambda: _phrase(rng, 2, 2),
            lambda: rng.choice(CHESS),
        ]
    )()


def _items(rng: random.Random, lo: int = 0, hi: int = 5) -> list:
    return [_item(rng) for _ in range(rng.randint(lo, hi))]


def _list_text(rng: random.Random, items: list) -> str:
    """items written as a Python/JSON list, a set, a tuple, or bare comma-separated text."""
    quoted = [repr(i) for i in items]
    dq = [f'"{i}"' if isinstance(i, str) else str(i) for i in items]
    bare = [str(i) for i in items]
    style = rng.random()
    if style < 0.3:
        return "[" + ", ".join(quoted) + "]"
    if style < 0.4:
        return "[" + ", ".join(dq) + "]"
    if style < 0.5:
        return "[" + ",".join(bare) + "]"
    if style < 0.6:
        return "{" + ", ".join(quoted) + "}" if items else "{}"
    if style < 0.7:
        return "(" + ", ".join(quoted) + ("," if len(items) == 1 else "") + ")"
    if style < 0.9:
        return ", ".join(bare)
    return rng.choice([", ", ",", " , "]).join(bare)


def _related_list(rng: random.Random, items: list) -> list:
    """The same items, or shuffled, re-cased, one dropped, one added, or one changed."""
    out = list(items)
    op = rng.randrange(7)
    if op == 1:
        rng.shuffle(out)
    elif op == 2:
        out = [i.upper() if isinstance(i, str) and rng.random() < 0.5 else i for i in out]
    elif op == 3 and out:
        out.pop(rng.randrange(len(out)))
    elif op == 4:
        out.insert(rng.randint(0, len(out)), _item(rng))
    elif op == 5 and out:
        out[rng.randrange(len(out))] = _item(rng)
    elif op == 6:
        out = out + out[:1]
    return out


def _list_value(rng: random.Random, items: list) -> Any:
    """The value form of a list (as a JSON parser would hand it over), or text."""
    r = rng.random()
    if r < 0.6:
        return _list_text(rng, items)
    if r < 0.8:
        return list(items)
    if r < 0.9:
        return tuple(items)
    return rng.choice([None, 3, 2.5, {"a": 1}, {"x": [1, 2]}, True, "", [], [[1, 2], [3]]])


def _box(rng: random.Random, ints: bool = False) -> list:
    if ints:
        x1, y1 = rng.randint(0, 50), rng.randint(0, 50)
        return [x1, y1, x1 + rng.randint(-5, 50), y1 + rng.randint(-5, 50)]
    x1, y1 = round(rng.uniform(0, 0.8), 2), round(rng.uniform(0, 0.8), 2)
    return [
        x1,
        y1,
        round(min(1.0, x1 + rng.uniform(-0.05, 0.4)), 2),
        round(min(1.0, y1 + rng.uniform(-0.05, 0.4)), 2),
    ]


def _near_box(rng: random.Random, box: list) -> list:
    if rng.random() < 0.25:
        return list(box)
    return [
        round(c + rng.uniform(-0.1, 0.1), 2) if isinstance(c, float) else c + rng.randint(-5, 5) for c in box
    ]


def _boxes_text(rng: random.Random, boxes: list) -> str:
    r = rng.random()
    if r < 0.35:
        return str(boxes)
    if r < 0.5:
        return str([tuple(b) for b in boxes])
    if r < 0.6 and len(boxes) == 1:
        return str(boxes[0])
    if r < 0.7 and len(boxes) == 1:
        return str(tuple(boxes[0]))
    if r < 0.8:
        return str(boxes).replace(" ", "")
    if r < 0.85:
        return str(boxes)[:-1]
    if r < 0.9:
        return "[" + ", ".join("[" + ", ".join(str(c) for c in b[:3]) + "]" for b in boxes) + "]"
    return rng.choice(
        ["[]", "", "None", "[[0.1, 0.2, 'a', 0.4]]", "[0.1, 0.2]", "abc", "[[1, 2, 3, 4, 5]]", "0.5"]
    )


def _boxes_value(rng: random.Random, boxes: list) -> Any:
    r = rng.random()
    if r < 0.75:
        return _boxes_text(rng, boxes)
    if r < 0.9:
        return [list(b) for b in boxes]
    return rng.choice([tuple(boxes[0]) if boxes else (), boxes[0] if boxes else [], None, 5, {"a": 1}])


def _xml_boxes(rng: random.Random, boxes: list) -> str:
    parts = ["<box>" + rng.choice([", ", ","]).join(str(c) for c in b) + "</box>" for b in boxes]
    text = rng.choice(["", "The box is ", "Answer: "]) + rng.choice([" ", "\n", ""]).join(parts)
    if rng.random() < 0.1:
        text = text.replace("</box>", "")
    if rng.random() < 0.05:
        text = text.replace(",", " ")
    return text


def _point(rng: random.Random) -> tuple:
    return (round(rng.uniform(-0.1, 1.1), 3), round(rng.uniform(-0.1, 1.1), 3))


def _xml_point(rng: random.Random, p: tuple) -> Any:
    r = rng.random()
    if r < 0.6:
        return f"<point>{p[0]}, {p[1]}</point>"
    if r < 0.7:
        return f"I think <point>{p[0]},{p[1]}</point>."
    if r < 0.75:
        return f"<point>{p[0]}, {p[1]}</point> <point>{p[1]}, {p[0]}</point>"
    if r < 0.8:
        return f"<point>{p[0]}, {p[1]}, 0.5</point>"
    if r < 0.85:
        return f"<point>{p[0]} {p[1]}</point>"
    if r < 0.9:
        return list(p)
    if r < 0.93:
        return tuple(p) + (0.1,)
    return rng.choice([None, "", "0.5, 0.5", "<point>a, b</point>", "<point>nan, 0.5</point>", 3, [0.1]])


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(0, 14))]
    text = " ".join(words)
    if rng.random() < 0.3:
        text = text.capitalize() + rng.choice([".", "!", "?", ","])
    return text


def _near_sentence(rng: random.Random, text: str) -> str:
    words = text.split()
    op = rng.randrange(5)
    if op == 0 or not words:
        return text
    if op == 1:
        words[rng.randrange(len(words))] = _word(rng)
    elif op == 2:
        words.pop(rng.randrange(len(words)))
    elif op == 3:
        words.insert(rng.randint(0, len(words)), _word(rng))
    else:
        rng.shuffle(words)
    return " ".join(words)


def _chinese(rng: random.Random) -> str:
    text = "".join(rng.choice(CHINESE) for _ in range(rng.randint(0, 8)))
    if rng.random() < 0.2:
        text += rng.choice(["。", "，", " hello", "123"])
    return text


LATEX_EDGES = CASE_TABLES["LATEX_EDGES"]


def _latex(rng: random.Random) -> str:
    v, w = rng.choice("xyab"), rng.choice("xyab")
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return rng.choice(
        [
            f"\\frac{{{a}}}{{{b}}}",
            f"{a}/{b}",
            f"{a / b}",
            f"{v}^{a}",
            f"{v}^{{{a}}}",
            f"{a}{v}",
            f"{a}{v} + {b}",
            f"{b} + {a}{v}",
            f"{v} + {w}",
            f"{w} + {v}",
            f"\\sqrt{{{a * a}}}",
            f"{a}",
            f"{v} \\cdot {w}",
            f"{v}{w}",
            f"({v} + {a})^2",
            f"{v}^2 + {2 * a}{v} + {a * a}",
            f"\\frac{{{v}}}{{{a}}}",
            f"{v}/{a}",
            f"\\sin({v})",
            f"{v} = {a}",
            rng.choice(LATEX_EDGES),
        ]
    )


def _text_with_latex(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 3)):
        parts.append(_phrase(rng, 0, 3))
        if rng.random() < 0.8:
            parts.append("$" + _latex(rng) + "$")
    if rng.random() < 0.1:
        parts.append("$unclosed")
    return " ".join(parts).replace(" ,", ",")


# --- symbolic planning: a blocks world (MEGA-Bench's planning tasks are PDDL of this shape)

BW_ACTIONS = dict(CASE_TABLES["BW_ACTIONS"])


def _domain_pddl(variant: str) -> str:
    actions = []
    for name, (params, pre, eff) in BW_ACTIONS.items():
        if variant == "single" and name != "pickup":
            continue
        if variant == "typed":
            plist = " ".join(f"?{p} - block" for p in params)
        else:
            plist = " ".join(f"?{p}" for p in params)
        pre = list(pre)
        if variant == "negpre" and name == "pickup":
            pre.append("(not (holding ?ob))")
        pre_text = pre[0] if len(pre) == 1 else "(and " + " ".join(pre) + ")"
        actions.append(
            f"  (:action {name}\n    :parameters ({plist})\n    :precondition {pre_text}\n"
            f"    :effect (and {' '.join(eff)}))"
        )
    types = "  (:types block)\n" if variant == "typed" else ""
    return (
        "(define (domain blocksworld)\n  (:requirements :strips)\n" + types +
        "  (:predicates (clear ?x) (on-table ?x) (arm-empty) (holding ?x) (on ?x ?y))\n" + "\n".join(actions) + ")"
    )  # fmt: skip


def _bw_apply(state: set, name: str, objs: list) -> set | None:
    params, pre, eff = BW_ACTIONS[name]
    bind = dict(zip(params, objs))

    def ground(c: str) -> str:
        for p, o in bind.items():
            c = c.replace(f"?{p})", f"{o})").replace(f"?{p} ", f"{o} ")
        return c

    if any(ground(c) not in state for c in pre):
        return None
    state = set(state)
    for e in eff:
        g = ground(e)
        if g.startswith("(not "):
            state.discard(g[5:-1])
        else:
            state.add(g)
    return state


def _planning_case(rng: random.Random) -> tuple[Any, dict]:
    blocks = ["a", "b", "c", "d"][: rng.randint(2, 4)]
    state = {"(arm-empty)"}
    towers: list[list[str]] = []
    for b in blocks:
        if towers and rng.random() < 0.5:
            towers[rng.randrange(len(towers))].append(b)
        else:
            towers.append([b])
    for t in towers:
        state.add(f"(on-table {t[0]})")
        for lower, upper in zip(t, t[1:]):
            state.add(f"(on {upper} {lower})")
        state.add(f"(clear {t[-1]})")
    init = sorted(state)
    plan = []
    for _ in range(rng.randint(0, 6)):
        moves = [
            (n, list(o))
            for n in BW_ACTIONS
            for o in ([[x] for x in blocks] if len(BW_ACTIONS[n][0]) == 1 else [[x, y] for x in blocks for y in blocks if x != y])
            if _bw_apply(state, n, list(o)) is not None
        ]  # fmt: skip
        if not moves:
            break
        n, o = rng.choice(moves)
        state = _bw_apply(state, n, o)
        plan.append(f"({n} {' '.join(o)})")
    goal_atoms = sorted(
        a for a in state if a.startswith("(on ") or a.startswith("(on-table") or a.startswith("(holding")
    )
    goal = (
        rng.sample(goal_atoms, k=min(len(goal_atoms), rng.randint(1, 3))) if goal_atoms else ["(arm-empty)"]
    )
    if rng.random() < 0.1:
        goal.append("(not (arm-empty))" if "(arm-empty)" in state else "(not (holding a))")
    goal_text = goal[0] if len(goal) == 1 and rng.random() < 0.3 else "(and " + " ".join(goal) + ")"
    task = (
        f"(define (problem bw-{len(blocks)})\n  (:domain blocksworld)\n  (:objects {' '.join(blocks)})\n"
        f"  (:init {' '.join(init)})\n  (:goal {goal_text}))"
    )
    if rng.random() < 0.03:
        task = task.replace("(:init", "(:start")
    variant = rng.choices(["plain", "typed", "negpre", "single"], weights=[6, 2, 1, 1])[0]
    ctx = {"domain_pddl": _domain_pddl(variant), "task_pddl": task}
    # the response: the plan, or a broken one
    steps = list(plan)
    op = rng.randrange(10)
    if op == 1 and steps:
        steps.pop(rng.randrange(len(steps)))
    elif op == 2 and len(steps) > 1:
        i = rng.randrange(len(steps) - 1)
        steps[i], steps[i + 1] = steps[i + 1], steps[i]
    elif op == 3:
        steps.append(rng.choice(["(fly a)", "(pickup)", "(stack a)", "(pickup a b)", "(unstack a a)"]))
    elif op == 4 and steps:
        steps = [s.replace("a", rng.choice(blocks)) for s in steps]
    elif op == 5:
        steps = ["Plan:"] + [rng.choice(["", "  ", "1. "]) + s for s in steps]
    elif op == 6:
        steps = [s.upper() if rng.random() < 0.3 else s for s in steps]
    elif op == 7:
        steps = [s + rng.choice(["", " ", "\r"]) for s in steps]
    r = rng.random()
    if r < 0.75:
        response: Any = "\n".join(steps)
    elif r < 0.9:
        response = list(steps)
    elif r < 0.95:
        response = tuple(steps)
    else:
        response = rng.choice([None, 3, {"plan": steps}])
    return response, ctx


# --- constrained generation

POEM_WORDS = CASE_TABLES["POEM_WORDS"]


def _poem(rng: random.Random, lines: int, first_letters: str | None = None) -> str:
    out = []
    for i in range(lines):
        words = [rng.choice(POEM_WORDS) for _ in range(rng.randint(1, 6))]
        if first_letters and i < len(first_letters) and first_letters[i] != " ":
            starts = [w for w in POEM_WORDS if w.startswith(first_letters[i].lower())] or ["x"]
            words[0] = rng.choice(starts)
            if rng.random() < 0.3:
                words = [rng.choice(starts) for _ in words]
        if first_letters and i < len(first_letters) and first_letters[i] == " ":
            words = []
        line = " ".join(words)
        if rng.random() < 0.2:
            line = line.capitalize() + rng.choice([",", ".", "!", "?", ";", " —", " (A)"])
        if rng.random() < 0.05:
            line = "**" + line + "**"
        out.append(line)
    text = "\n".join(out)
    if rng.random() < 0.1:
        text = "  " + text + "\n"
    return text


def _constraint_case(rng: random.Random) -> tuple[str, dict]:
    n = rng.randint(1, 5)
    constraints: dict[str, str] = {}
    letters = "".join(rng.choice("abcdefghlmnoprstw ") for _ in range(n))
    for key in rng.sample(["length", "acrostic", "acrostic_alliteration", "syllables", "rhyming_scheme", "poetry_meter"], rng.randint(1, 3)):  # fmt: skip
        if key == "length":
            constraints[key] = rng.choice([f"<{rng.randint(1, 30)}", f">{rng.randint(0, 20)}", "", "<x"])
        elif key.startswith("acrostic"):
            constraints[key] = letters if rng.random() < 0.8 else letters.upper()
        elif key == "syllables":
            constraints[key] = rng.choice(
                [
                    "".join(str(rng.randint(1, 9)) for _ in range(n)),
                    "".join(f"[{rng.randint(1, 4)},{rng.randint(4, 12)}]" for _ in range(n)),
                    "575",
                    "[7,10][5]7 ",
                ]  # fmt: skip
            )
        elif key == "rhyming_scheme":
            constraints[key] = "".join(rng.choice("AAB ") for _ in range(n))
        else:
            constraints[key] = rng.choice(["iambic", "yes", " "])
    response = _poem(
        rng, n if rng.random() < 0.85 else rng.randint(1, 6), letters if rng.random() < 0.6 else None
    )
    return response, constraints


# --- program judge

PROGRAMS = CASE_TABLES["PROGRAMS"]


def _program_case(rng: random.Random) -> tuple[Any, dict]:
    code = rng.choice(PROGRAMS)
    cases = []
    for _ in range(rng.randint(0, 3)):
        k = rng.randint(1, 12)
        inputs = [str(k), str(rng.randint(1, 9)), str(rng.randint(1, 9))][: rng.randint(0, 3)]
        expected = rng.choice([str(k * 2), str(k + int(inputs[1]) if len(inputs) > 1 else k), str(k * k), "\n".join(str(i) for i in range(k)), str(sum(range(k + 1))), "1\n2", str(k) + "\n"])  # fmt: skip
        cases.append({"input": inputs, "expected": expected})
    if rng.random() < 0.1 and cases:
        cases = cases[0]
    if rng.random() < 0.05:
        cases = [{"input": "12", "expected": "21"}]
    response = code if rng.random() < 0.95 else rng.choice([None, 5])
    return response, {"test_case": cases}


# --- per-metric generators: each returns (response, reference, eval_context)


def _gen_letters(rng: random.Random) -> tuple:
    ref = rng.choice([rng.choice(LETTERS), rng.choice(LETTERS).lower(), _word(rng), _phrase(rng, 1, 3), str(rng.randint(0, 99)), "", "None"])  # fmt: skip
    r = rng.random()
    if r < 0.4:
        resp: Any = _perturb(rng, ref)
    elif r < 0.7:
        letter = ref[:1] or rng.choice(LETTERS)
        resp = rng.choice([f"({letter})", f"{letter}.", f"{letter}. {_phrase(rng)}", f"({letter}) {_phrase(rng)}", f"{letter} . x", f"{letter}{_word(rng)}", _word(rng).capitalize(), f" {letter}", f"{letter}\n"])  # fmt: skip
    elif r < 0.9:
        resp = _phrase(rng)
    else:
        resp = rng.choice([None, 1, 0, True, ["B"], {"a": "B"}, 2.5, "", "None"])
    if rng.random() < 0.05:
        ref = rng.choice(["'B'", '"cat"', "'A'", "[1]", "3"])
    return resp, ref, {}


def _gen_code_result(rng: random.Random) -> tuple:
    out = rng.choice([_phrase(rng), str(rng.randint(0, 99)), "B", "a\nb", "  x  ", ""])
    ref = rng.choice([f"```\n{out}\n```", f"```output\n{out}\n```", f"```{out}```", out, f"```\n{out}\n\n```", f"text ```\n{out}\n``` more"])  # fmt: skip
    resp = _perturb(rng, out) if rng.random() < 0.8 else rng.choice([None, 3, ""])
    return resp, ref, {}


def _gen_fuzzy(rng: random.Random) -> tuple:
    ref = rng.choice(
        [_phrase(rng, 1, 6), rng.choice(ACCENTED), "The " + _phrase(rng, 1, 3), "", rng.choice(LETTERS)]
    )
    resp: Any = _perturb(rng, ref) if rng.random() < 0.7 else rng.choice([_phrase(rng), rng.choice(ACCENTED)])
    if rng.random() < 0.05:
        resp = rng.choice([None, 5, ["a"]])
    if rng.random() < 0.03:
        ref = rng.choice(["'quoted'", "['x']", "5"])
    return resp, ref, {}


def _gen_multi_ref(rng: random.Random) -> tuple:
    refs = [_phrase(rng, 1, 2) for _ in range(rng.randint(1, 4))]
    ref = rng.choice(
        [
            ", ".join(refs),
            "，".join(refs),
            str(refs),
            rng.choice(LIST_EDGES),
            str(rng.randint(0, 9)),
            "[1, 2]",
        ]
    )
    resp: Any = _perturb(rng, rng.choice(refs)) if rng.random() < 0.6 else _phrase(rng)
    if rng.random() < 0.05:
        resp = rng.choice([None, 1, ["a"], ""])
    return resp, ref, {}


def _gen_number_text(rng: random.Random) -> tuple:
    x = _number(rng)
    ref = rng.choice([str(x), _number_text(rng, x), rng.choice(NUMBER_EDGES)])
    r = rng.random()
    if r < 0.4:
        resp: Any = _number_text(rng, x)
    elif r < 0.6:
        resp = _number_text(rng, round(x * rng.uniform(0.98, 1.02), 4) if x else x)
    elif r < 0.75:
        resp = _number_text(rng, _number(rng))
    elif r < 0.9:
        resp = rng.choice(NUMBER_EDGES)
    else:
        resp = rng.choice([x, float(x), True, False, None, [x], (x,), 1j])
    return resp, ref, {}


def _gen_boxed(rng: random.Random) -> tuple:
    resp, ref, ctx = _gen_number_text(rng)
    if isinstance(resp, str) and rng.random() < 0.6:
        resp = rng.choice([f"\\boxed{{{resp}}}", f"The answer is \\boxed{{{resp}}}.", f"\\boxed{{1}} or \\boxed{{{resp}}}", f"\\boxed {resp}", f"$\\boxed{{{resp}}}$"])  # fmt: skip
    if rng.random() < 0.3:
        ref = f"\\boxed{{{ref}}}"
    return resp, ref, ctx


def _gen_positive_int(rng: random.Random) -> tuple:
    k = rng.randint(-3, 20)
    ref = rng.choice([str(k), str(k), "0", "-1", "3.0", "abc", "", "[1]", " 5", "05", "1_0"])
    resp = rng.choice([str(k), str(k + rng.randint(-1, 1)), str(float(k)), "abc", "", "-2", "0", "[3]", k, None, "True", "1_0", "+3"])  # fmt: skip
    return resp, ref, {}


def _gen_rel_diff(rng: random.Random) -> tuple:
    x = _number(rng)
    ref = rng.choice([str(x), str(x), "0", "0.0", "abc", "[1]", "1e3", "1_000", "-5", "True", "1+2j"])
    y = x * rng.uniform(0, 2) if rng.random() < 0.7 else _number(rng)
    resp = rng.choice([str(round(y, 3)), str(x), y, x, "abc", "", None, True, "[1]", "1+2j", "1e400", "-inf", float("nan"), "1_000"])  # fmt: skip
    return resp, ref, {}


def _gen_nrmse(rng: random.Random) -> tuple:
    x = round(rng.uniform(-1, 1), 3)
    ref = rng.choice([str(x), str(x), str(x), "0", "[0.1, 0.2]", "abc"])
    resp = rng.choice([str(round(x + rng.uniform(-0.2, 0.2), 3)), str(round(x + rng.uniform(-0.05, 0.05), 3)), str(x), "abc", "", "[0.1, 0.2]", "None", "True", "1e400"])  # fmt: skip
    return resp, ref, {}


def _gen_angles(rng: random.Random) -> tuple:
    xs = [round(rng.uniform(0, 360), 1) for _ in range(rng.randint(0, 4))]
    ref = rng.choice([str(xs), ", ".join(map(str, xs)), "[]", "[1, 'a']", "5", "None"])
    ys = [round(x + rng.uniform(-15, 15), 1) for x in xs] if rng.random() < 0.8 else _items(rng)
    resp = _list_value(rng, ys) if rng.random() < 0.9 else rng.choice([None, "[nan, 1]", "[inf]", "[[1, 2]]"])
    return resp, ref, {}


def _gen_set_like(rng: random.Random) -> tuple:
    items = _items(rng)
    ref = _list_text(rng, items) if rng.random() < 0.85 else rng.choice(LIST_EDGES)
    resp = _list_value(rng, _related_list(rng, items)) if rng.random() < 0.85 else rng.choice(LIST_EDGES)
    if rng.random() < 0.05:
        ref = rng.choice([list(items), tuple(items), None, 3])
    return resp, ref, {}


def _gen_set_tuples(rng: random.Random) -> tuple:
    """jaccard_index_case_insensitive: targets of strings or of tuples."""
    if rng.random() < 0.5:
        return _gen_set_like(rng)
    pairs = [(_phrase(rng, 1, 2), rng.choice(["x-y", "A_B", "c.d", "e f", str(rng.randint(0, 9))])) for _ in range(rng.randint(0, 3))]  # fmt: skip
    ref = str(pairs)
    other = (
        [(a.upper().replace(" ", rng.choice(["", " ", "-"])), b) for a, b in pairs]
        if rng.random() < 0.6
        else pairs[:1]
    )
    resp = rng.choice([str(other), other, str([list(p) for p in other]), "[(1, 2)]", "a, b", None])
    return resp, ref, {}


def _gen_line_sets(rng: random.Random) -> tuple:
    items = [_phrase(rng, 1, 2) for _ in range(rng.randint(0, 4))]
    ref = rng.choice(["\n".join(items), "\\n".join(items), "\n".join(items) + "\n"])
    other = _related_list(rng, items)
    other = [str(i) for i in other]
    resp: Any = rng.choice(
        ["\n".join(other), "\\n".join(other), "\n".join(o.upper() for o in other), ", ".join(other)]
    )
    if rng.random() < 0.05:
        resp = rng.choice([None, ["a"], 3])
    return resp, ref, {}


def _gen_chess(rng: random.Random) -> tuple:
    moves = rng.sample(CHESS, rng.randint(0, 5))
    ref = _list_text(rng, moves)
    other = [
        m.rstrip("!#+") if isinstance(m, str) and rng.random() < 0.3 else m for m in _related_list(rng, moves)
    ]
    resp = _list_value(rng, other) if rng.random() < 0.9 else rng.choice([None, "", "None", 5])
    return resp, ref, {}


def _dict_value(rng: random.Random) -> Any:
    return rng.choice(
        [
            lambda: _word(rng),
            lambda: rng.choice(LETTERS),
            lambda: str(rng.randint(0, 9)),
            lambda: rng.randint(0, 9),
            lambda: _items(rng, 0, 3),
            lambda: _list_text(rng, _items(rng, 0, 3)),
            lambda: None,
            lambda: {"x": rng.randint(0, 3)},
            lambda: [_box(rng) for _ in range(rng.randint(0, 2))],
            lambda: str([_box(rng) for _ in range(rng.randint(1, 2))]),
        ]
    )()


def _related_dict(rng: random.Random, d: dict) -> dict:
    out = dict(d)
    op = rng.randrange(6)
    if op == 1 and out:
        out.pop(rng.choice(list(out)))
    elif op == 2:
        out[rng.choice(["k9", "extra", "a"])] = _dict_value(rng)
    elif op == 3 and out:
        k = rng.choice(list(out))
        v = out[k]
        out[k] = _list_value(rng, _related_list(rng, v)) if isinstance(v, list) else _dict_value(rng)
    elif op == 4 and out:
        k = rng.choice(list(out))
        out[k] = str(out[k]) if not isinstance(out[k], str) else out[k].upper()
    return out


def _dict_text(rng: random.Random, d: dict) -> str:
    import json

    r = rng.random()
    if r < 0.45:
        return json.dumps(d)
    if r < 0.7:
        return repr(d)
    if r < 0.8:
        return f"```json\n{json.dumps(d, indent=rng.choice([None, 2]))}\n```"
    if r < 0.85:
        return "Answer: " + json.dumps(d)
    if r < 0.9:
        return json.dumps(d)[:-1]
    return rng.choice(
        ["{}", "[]", "", "None", "not a dict", "{'a': }", '{"a": "{\\"b\\": 1}"}', "[1, 2]", "{1: 'x'}"]
    )


def _gen_dict(rng: random.Random) -> tuple:
    keys = rng.sample(["a", "b", "c", "name", "k1", "k2", "1"], rng.randint(0, 4))
    d = {k: _dict_value(rng) for k in keys}
    ref: Any = _dict_text(rng, d) if rng.random() < 0.8 else d
    other = _related_dict(rng, d)
    resp: Any = other if rng.random() < 0.5 else _dict_text(rng, other)
    if rng.random() < 0.05:
        resp = rng.choice([None, 3, [1, 2], "x"])
    return resp, ref, {}


def _gen_dict_boxes(rng: random.Random) -> tuple:
    keys = rng.sample(["cat", "dog", "car", "person"], rng.randint(0, 3))
    d = {k: [_box(rng) for _ in range(rng.randint(0, 2))] for k in keys}
    ref: Any = _dict_text(rng, d) if rng.random() < 0.7 else d
    other = {k: [_near_box(rng, b) for b in v] for k, v in d.items()}
    other = _related_dict(rng, other) if rng.random() < 0.3 else other
    resp: Any = other if rng.random() < 0.5 else _dict_text(rng, other)
    if rng.random() < 0.1:
        resp = rng.choice([None, "{}", {"cat": "[0.1, 0.1, 0.5, 0.5]"}, {"cat": [0.1, 0.1, 0.5, 0.5]}, {"cat": [[0.1, "a", 0.5, 0.5]]}])  # fmt: skip
    return resp, ref, {}


def _gen_sequence(rng: random.Random) -> tuple:
    items = _items(rng, 0, 5)
    ref = _list_text(rng, items) if rng.random() < 0.9 else rng.choice(LIST_EDGES)
    other = _related_list(rng, items)
    resp = _list_value(rng, other) if rng.random() < 0.9 else rng.choice(LIST_EDGES)
    return resp, ref, {}


def _gen_bbox_tuple(rng: random.Random) -> tuple:
    ints = rng.random() < 0.1
    boxes = [_box(rng, ints) for _ in range(rng.randint(0, 3))]
    ref = _boxes_value(rng, boxes) if rng.random() < 0.9 else _boxes_text(rng, boxes)
    near = [_near_box(rng, b) for b in boxes]
    near = _related_list(rng, near) if rng.random() < 0.3 else near
    near = [b for b in near if isinstance(b, list)] or near[:0]
    resp = _boxes_value(rng, near)
    return resp, ref, {}


def _gen_bbox_single(rng: random.Random) -> tuple:
    box = _box(rng, rng.random() < 0.1)
    ref = rng.choice([str(box), str(tuple(box)), str(box), str([box]) if rng.random() < 0.1 else str(box)])
    near = _near_box(rng, box)
    resp = rng.choice([str(near), str(tuple(near)), str(box), str([near]), "[0.1, 0.2]", "abc", "", "[0.1, 0.2, 0.3, 'a']", "None", str(near)[:-1]])  # fmt: skip
    return resp, ref, {}


def _gen_xml_bbox(rng: random.Random) -> tuple:
    boxes = [_box(rng) for _ in range(rng.randint(0, 2))]
    ref: Any = _xml_boxes(rng, boxes) if rng.random() < 0.95 else rng.choice([boxes, (0.1, 0.1, 0.5, 0.5)])
    near = [_near_box(rng, b) for b in boxes] + ([_box(rng)] if rng.random() < 0.2 else [])
    r = rng.random()
    if r < 0.8:
        resp: Any = _xml_boxes(rng, near)
    elif r < 0.9:
        resp = near[0] if near else []
    else:
        resp = rng.choice(
            [None, "", "<box>a, b, c, d</box>", [[0.1, 0.1, 0.3, 0.3]], (0.1, 0.2, 0.3, 0.4), 5]
        )
    return resp, ref, {}


def _gen_point_in_bbox(rng: random.Random) -> tuple:
    boxes = [_box(rng) for _ in range(rng.randint(1, 3))]
    texts = [rng.choice([str(b), str(tuple(b))]) for b in boxes]
    p = _point(rng)
    if rng.random() < 0.5:
        b = rng.choice(boxes)
        p = (round(rng.uniform(b[0], max(b[0], b[2])), 3), round(rng.uniform(b[1], max(b[1], b[3])), 3))
    return _xml_point(rng, p), "", {"bounding_boxes": texts}


def _gen_point_distance(rng: random.Random) -> tuple:
    p = _point(rng)
    q = (round(p[0] + rng.uniform(-0.3, 0.3), 3), round(p[1] + rng.uniform(-0.3, 0.3), 3))
    ref = _xml_point(rng, p) if rng.random() < 0.9 else rng.choice([list(p), "<point>0.5, 0.5</point>"])
    return _xml_point(rng, q), ref, {}


def _gen_coords(rng: random.Random) -> tuple:
    pts = [[round(rng.uniform(0, 1), 3), round(rng.uniform(0, 1), 3)] for _ in range(rng.randint(0, 4))]
    ref: Any = rng.choice([str(pts), str([tuple(p) for p in pts]), str(pts)]) if rng.random() < 0.95 else pts
    near = [[round(c + rng.uniform(-0.1, 0.1), 3) for c in p] for p in pts]
    if rng.random() < 0.2:
        near = near[:-1] if near else [[0.5, 0.5]]
    r = rng.random()
    if r < 0.7:
        resp: Any = rng.choice([str(near), str([tuple(p) for p in near]), str(near).replace(" ", "")])
    elif r < 0.85:
        resp = near
    else:
        resp = rng.choice(
            [None, "", "[[0.1, 0.2, 0.3]]", "[[0.1, 'a']]", "abc", "[0.1, 0.2]", "[[0.1, 0.2], [0.3]]", "5"]
        )
    return resp, ref, {}


def _gen_bleu(rng: random.Random) -> tuple:
    if rng.random() < 0.15:
        n = rng.randint(0, 3)
        refs = [_sentence(rng) for _ in range(n)]
        hyps = [_near_sentence(rng, s) for s in refs] + ([_sentence(rng)] if rng.random() < 0.1 else [])
        return rng.choice([hyps, tuple(hyps)]), rng.choice([refs, tuple(refs)]), {}
    ref = _sentence(rng)
    resp: Any = _near_sentence(rng, ref) if rng.random() < 0.7 else _sentence(rng)
    if rng.random() < 0.05:
        resp = rng.choice([None, 3, ["a b c d"], ""])
    return resp, ref, {}


def _gen_gleu(rng: random.Random) -> tuple:
    ref = _chinese(rng)
    resp: Any = ref if rng.random() < 0.2 else (_chinese(rng) if rng.random() < 0.5 else ref[: len(ref) // 2] + _chinese(rng))  # fmt: skip
    if rng.random() < 0.05:
        resp = rng.choice([None, 3, ["我们"]])
    return resp, ref, {}


def _gen_latex(rng: random.Random) -> tuple:
    ref = _latex(rng)
    resp: Any = rng.choice([ref, _latex(rng), ref.replace(" ", ""), f"${ref}$", f"\\({ref}\\)"]) if rng.random() < 0.95 else rng.choice([None, 2])  # fmt: skip
    return resp, ref, {}


def _gen_text_latex(rng: random.Random) -> tuple:
    ref = _text_with_latex(rng)
    resp: Any = rng.choice(
        [ref, _text_with_latex(rng), ref.replace("$", ""), ref.upper(), ref.replace(" ", "")]
    )
    if rng.random() < 0.03:
        resp = None
    return resp, ref, {}


def _gen_planning(rng: random.Random) -> tuple:
    resp, ctx = _planning_case(rng)
    return resp, "", ctx


def _gen_constrained(rng: random.Random) -> tuple:
    resp, ctx = _constraint_case(rng)
    return resp, "", ctx


def _gen_program(rng: random.Random) -> tuple:
    resp, ctx = _program_case(rng)
    return resp, "", ctx


GENERATORS: dict[str, tuple[Any, int]] = {
    # metric: (generator, random cases at --scale 1)
    "exact_str_match": (_gen_letters, 1500),
    "simple_str_match": (_gen_letters, 1500),
    "exact_str_match_case_insensitive": (_gen_letters, 1000),
    "code_result_exact_str_match": (_gen_code_result, 500),
    "normalized_similarity_damerau_levenshtein": (_gen_fuzzy, 800),
    "near_str_match": (_gen_fuzzy, 800),
    "multi_ref_phrase": (_gen_multi_ref, 800),
    "number_rel_diff_ratio": (_gen_rel_diff, 1000),
    "positive_int_match": (_gen_positive_int, 800),
    "normalized_rmse": (_gen_nrmse, 600),
    "angle_seq_float_rmse": (_gen_angles, 600),
    "general_single_numerical_match": (_gen_number_text, 1200),
    "boxed_single_numerical_match": (_gen_boxed, 600),
    "latex_expr_equality": (_gen_latex, 500),
    "text_with_latex_expr_equality": (_gen_text_latex, 400),
    "set_equality": (_gen_set_like, 1200),
    "set_equality_case_insensitive": (_gen_set_like, 800),
    "str_set_equality_line_break": (_gen_line_sets, 600),
    "str_set_equality_comma": (_gen_set_like, 800),
    "jaccard_index": (_gen_set_like, 1000),
    "jaccard_index_case_insensitive": (_gen_set_tuples, 800),
    "set_precision": (_gen_set_like, 800),
    "chess_move_list_jaccard_index": (_gen_chess, 600),
    "sequence_equality": (_gen_sequence, 800),
    "sequence_equality_case_insensitive": (_gen_sequence, 800),
    "sequence_accuracy_case_insensitive": (_gen_sequence, 800),
    "longest_common_list_prefix_ratio": (_gen_sequence, 800),
    "dict_equality": (_gen_dict, 800),
    "dict_precision": (_gen_dict, 800),
    "dict_exact_str_match_agg_recall": (_gen_dict, 800),
    "dict_set_equality_agg_jaccard": (_gen_dict, 800),
    "dict_jaccard_agg_jaccard": (_gen_dict, 800),
    "dict_nbbox_iou_tuple_agg_jaccard": (_gen_dict_boxes, 800),
    "nbbox_iou_tuple": (_gen_bbox_tuple, 1000),
    "nbbox_iou_single": (_gen_bbox_single, 800),
    "nbbox_iou_sequence": (_gen_bbox_tuple, 800),
    "xml_nbbox_iou_single": (_gen_xml_bbox, 800),
    "xml_norm_point_in_bbox": (_gen_point_in_bbox, 600),
    "xml_norm_point_distance": (_gen_point_distance, 600),
    "sequence_coords_similarity": (_gen_coords, 600),
    "bleu": (_gen_bleu, 1000),
    "gleu_cn": (_gen_gleu, 600),
    "symbolic_planning_test": (_gen_planning, 600),
    "constrained_generation": (_gen_constrained, 600),
    "program_judge": (_gen_program, 40),
}

# Hand-picked cases: (metric, response, reference) -- the quirk classes of mmrl/eval/megabench.py
EDGE_CASES = CASE_TABLES["EDGE_CASES"]

EDGE_CONTEXT_CASES = CASE_TABLES["EDGE_CONTEXT_CASES"]

PARSER_EDGES = CASE_TABLES["PARSER_EDGES"]


def _parser_response(rng: random.Random, parser: str, answer: dict) -> str:
    import json

    key = next(iter(answer))
    if parser == "json" or rng.random() < 0.15:
        d = {k: (_dict_value(rng) if rng.random() < 0.5 else v) for k, v in answer.items()}
        if rng.random() < 0.2:
            d[rng.choice(["extra", "1", "a"])] = _dict_value(rng)
        body = rng.choice([json.dumps(d), repr(d), json.dumps(d, indent=2), json.dumps(d).replace('"', "'"), json.dumps(list(d.values()))])  # fmt: skip
    else:
        body = rng.choice([str(answer[key]), _perturb(rng, str(answer[key])), _phrase(rng), rng.choice(LETTERS), _list_text(rng, _items(rng)), rng.choice(NUMBER_EDGES), _poem(rng, rng.randint(1, 3))])  # fmt: skip
    wrap = rng.choice(
        [
            "{b}",
            "Answer: {b}",
            "answer: {b}",
            "**Answer:** {b}",
            "**Answer: {b}**",
            "Reasoning here.\nAnswer: {b}",
            "Let me think.\n\nAnswer: {b}\n\nBecause {r}.",
            "Answer: {b}\n{r}",
            "Answer:\n```\n{b}\n```",
            "Answer: ```json\n{b}\n```",
            "```json\n{b}\n```",
            "{r}\n{b}",
            "Answer: first\nAnswer: {b}",
            "Answer:\n\n{b}\n\n",
            "  {b}  ",
            "{b}\n\n{r}",
            "'{b}'",
            "Answer: '{b}'",
        ]
    )
    return wrap.replace("{r}", _phrase(rng)).replace("{b}", body)


def _parser_answer(rng: random.Random, parser: str) -> dict:
    if parser in ("json", "dummy"):
        keys = rng.sample(["a", "b", "name", "1", "##aux"], rng.randint(1, 3))
        return {k: str(_dict_value(rng)) if rng.random() < 0.7 else _dict_value(rng) for k in keys}
    value = rng.choice(
        [rng.choice(LETTERS), _phrase(rng), "a\nb", str(rng.randint(0, 99)), "", _poem(rng, 2)]
    )
    return {rng.choice(["Answer", "answer", "x"]): value}


# --- whole queries

QUERY_METRICS = [
    ("exact_str_match", _gen_letters), ("simple_str_match", _gen_letters), ("set_equality", _gen_set_like),
    ("jaccard_index", _gen_set_like), ("number_rel_diff_ratio", _gen_rel_diff), ("positive_int_match", _gen_positive_int),
    ("nbbox_iou_tuple", _gen_bbox_tuple), ("dict_equality", _gen_dict), ("sequence_equality", _gen_sequence),
    ("nbbox_iou_sequence", _gen_bbox_tuple), ("bleu", _gen_bleu), ("longest_common_list_prefix_ratio", _gen_sequence),
]  # fmt: skip


def _query_case(rng: random.Random) -> dict:
    import json

    parser = rng.choice(["json", "json", "answer_string"])
    n = 1 if parser == "answer_string" else rng.randint(1, 4)
    fields, answer, values = {}, {}, {}
    for i in range(n):
        name = f"f{i}"
        metric, gen = rng.choice(QUERY_METRICS)
        resp, ref, _ = gen(rng)
        fields[name] = metric
        if not isinstance(ref, str) and (parser == "answer_string" or rng.random() < 0.5):
            ref = json.dumps(ref)  # single-field answers are text in MEGA-Bench's tasks
        answer[name] = ref
        values[name] = resp
    if parser == "json" and rng.random() < 0.2:
        answer["##hint"] = "aux"
    aggregation = rng.choice(["mean", "mean", "min"])
    weights = {f: rng.choice([1, 1, 2, 0.5]) for f in fields}
    if parser == "answer_string":
        (value,) = values.values()
        body = value if isinstance(value, str) else str(value)
        response = rng.choice(
            ["Answer: {b}", "{b}", "**Answer:** {b}", "Thinking.\nAnswer: {b}\n\nExplanation."]
        ).replace("{b}", body)
    else:
        payload = {k: v for k, v in values.items() if rng.random() < 0.9}
        try:
            body = json.dumps(payload) if rng.random() < 0.6 else repr(payload)
        except (TypeError, ValueError):
            body = repr(payload)
        response = rng.choice(
            ["{b}", "Answer: {b}", "```json\n{b}\n```", "Here: {b}", "{b}\n\nDone.", "not json"]
        ).replace("{b}", body)
    return {
        "parser": parser,
        "fields": fields,
        "weights": weights,
        "aggregation": aggregation,
        "answer": answer,
        "response": response,
    }


def generate_cases(seed: int = SEED, scale: float = 1.0) -> list[dict]:
    """The fixed case list: every metric's edge and random cases, then parser and query cases.

    Deterministic for a given (seed, scale); needs neither MEGA-Bench nor mmrl's optional deps."""
    cases: list[dict] = []
    for name, response, reference in EDGE_CASES:
        cases.append({"kind": "metric", "name": name, "response": response, "reference": reference, "ctx": {}, "origin": "edge"})  # fmt: skip
    for name, response, ctx in EDGE_CONTEXT_CASES:
        cases.append({"kind": "metric", "name": name, "response": response, "reference": "", "ctx": ctx, "origin": "edge"})  # fmt: skip
    for name, (gen, count) in GENERATORS.items():
        rng = random.Random(f"{seed}:{name}")
        for _ in range(max(1, int(count * scale))):
            response, reference, ctx = gen(rng)
            cases.append({"kind": "metric", "name": name, "response": response, "reference": reference, "ctx": ctx, "origin": "random"})  # fmt: skip
    for parser in PARSERS:
        rng = random.Random(f"{seed}:parser:{parser}")
        for response in PARSER_EDGES:
            for answer in ({"Answer": "B"}, {"Answer": "a\nb"}, {"a": "1", "b": "x"}):
                if parser in ("json", "dummy") or len(answer) == 1:
                    cases.append({"kind": "parser", "name": parser, "response": response, "answer": answer, "origin": "edge"})  # fmt: skip
        for _ in range(max(1, int(1500 * scale))):
            answer = _parser_answer(rng, parser)
            cases.append({"kind": "parser", "name": parser, "response": _parser_response(rng, parser, answer), "answer": answer, "origin": "random"})  # fmt: skip
    rng = random.Random(f"{seed}:queries")
    for _ in range(max(1, int(1500 * scale))):
        q = _query_case(rng)
        cases.append({"kind": "query", "name": f"query/{q['parser']}", **q, "origin": "random"})
    return cases


# =========================================================================== MEGA-Bench's side (worker)


def _megabench_dir(path: str) -> str:
    for candidate in (os.path.join(path, "megabench"), path):
        if os.path.isdir(os.path.join(candidate, "metrics", "scoring")):
            return candidate
    raise SystemExit(f"{path}: not a MEGA-Bench checkout (no megabench/metrics/scoring)")


def _worker(args: argparse.Namespace) -> None:
    import logging

    warnings.filterwarnings("ignore")
    if args.antlr411:
        sys.path.insert(0, os.path.abspath(args.antlr411))
    sys.path.insert(0, _megabench_dir(args.megabench))
    logging.disable(logging.CRITICAL)
    from metrics import AggregationType, MetricType, ResponseParseType  # MEGA-Bench's own modules
    from metrics.parsing.common.utils import evaluate_as_string

    def evaluate_field(metric, field, response_obj, correct_value, eval_context):
        # megabench/evaluation_processor.py, EvaluationProcessor.evaluate_field (sanity-check mode off)
        correct_value = evaluate_as_string(correct_value)
        if metric == MetricType.UNSUPPORTED:
            return None
        if metric in (MetricType.SYMBOLIC_PLANNING_TEST, MetricType.PROGRAM_JUDGE):
            return metric.match(response_obj.get(field), eval_context, TASK_INFO)
        if metric == MetricType.CONSTRAINED_GENERATION:
            score, _info = metric.match(response_obj, eval_context)
            return score
        if metric == MetricType.XML_NORM_POINT_IN_BBOX:
            score, _info = metric.match(response_obj.get(field), eval_context)
            return score
        return metric.match(response_obj.get(field), correct_value)

    def parse(parser_name, response, correct_answer):
        # megabench/evaluation_processor.py, EvaluationProcessor.process: the response parsing
        answer_fields = [f for f in correct_answer if not f.startswith("##")]
        parser = ResponseParseType.from_string(parser_name)
        ok = True
        if parser.is_single_field_parser():
            assert len(answer_fields) == 1
            key = answer_fields[0]
            obj = parser.parse(
                response,
                key,
                global_description="",
                query_question="",
                is_single_line_ans="\n" not in correct_answer[key],
            )
            assert isinstance(obj[key], str), "Single-field parsing results must be string"
        else:
            obj = parser.parse(response)
            if parser == ResponseParseType.JSON and (not isinstance(obj, dict) or not obj):
                ok = False
                obj = {f: response for f in correct_answer}
        return obj, ok

    def run(case):
        if case["kind"] == "metric":
            metric = MetricType.from_string(case["name"])
            if metric == MetricType.CONSTRAINED_GENERATION:
                response_obj = case["response"]  # the whole parsed response (the `dummy` parser's text)
            else:
                response_obj = {"field": case["response"]}
            return evaluate_field(metric, "field", response_obj, case["reference"], case["ctx"])
        if case["kind"] == "parser":
            return parse(case["name"], case["response"], case["answer"])
        # a whole query
        obj, ok = parse(case["parser"], case["response"], case["answer"])
        scores = {}
        for field, correct_value in case["answer"].items():
            metric = MetricType.from_string(case["fields"].get(field))
            score = evaluate_field(metric, field, obj, correct_value, {})
            if score is not None:
                scores[field] = score
        query = AggregationType.from_string(case["aggregation"]).aggregate(scores, case["weights"])
        return {"fields": scores, "query": query, "parse_ok": ok}

    def outcome(case, value):
        # A complex score (normalized_rmse of a complex literal) is no number: the evaluator's
        # aggregation (`s >= 0` in MeanAggregation / MinAggregation) raises TypeError on it.
        scores = (
            [value]
            if case["kind"] == "metric"
            else list(value["fields"].values())
            if case["kind"] == "query"
            else []
        )
        if any(isinstance(s, complex) for s in scores):
            return ("crash", f"non-real score {value!r}: MEGA-Bench's aggregation raises TypeError on it")
        return ("ok", value)

    with open(args.cases, "rb") as f:
        cases = pickle.load(f)
    results = []
    start = time.time()
    for i, case in enumerate(cases):
        try:
            results.append(outcome(case, _plain(run(case))))
        except BaseException as exc:  # noqa: BLE001 - outside MetricType.match: the evaluator would crash
            if isinstance(exc, KeyboardInterrupt):
                raise
            results.append(("crash", f"{type(exc).__name__}: {exc}"))
        if (i + 1) % 5000 == 0:
            print(
                f"  MEGA-Bench: {i + 1}/{len(cases)} cases, {time.time() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    with open(args.out, "wb") as f:
        pickle.dump(results, f)


def _plain(value: Any) -> Any:
    """numpy scalars to Python numbers (results cross a process boundary)."""
    if type(value).__module__ == "numpy":
        try:
            return value.item()
        except (AttributeError, ValueError):
            return repr(value)
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# =========================================================================== mmrl's side


def _mmrl_scorer():
    import mmrl.eval.task_metrics  # noqa: F401 - registers program_judge, symbolic planning, constrained generation
    from mmrl.eval import megabench as mb
    from mmrl.eval.metrics import FieldContext
    from mmrl.eval.runner import score_response
    from mmrl.eval.suite import MetricInfo, Query, Task

    def run(case):
        if case["kind"] == "metric":
            ctx = FieldContext(
                eval_context=case["ctx"], answer={"field": case["reference"]}, parsed=case["response"]
            )
            try:
                score, _error = mb.score_reference(case["name"], case["response"], mb.evaluate_as_string(case["reference"]), ctx)  # fmt: skip
            except mb.MetricUnavailable as exc:
                return ("unavailable", str(exc))
            return ("ok", score)
        if case["kind"] == "parser":
            answer = case["answer"]
            fields = [f for f in answer if not f.startswith("##")]
            values, ok, whole = mb.parse_fields(case["response"], case["name"], answer, fields)
            return ("ok", (whole if case["name"] == "dummy" else values, ok))
        info = MetricInfo(
            field_score_function=case["fields"],
            aggregation=case["aggregation"],
            field_weights=case["weights"],
            response_parse_function=case["parser"],
            raw={},
        )
        query = Query(idx=0, text="", media=[], answer=case["answer"], eval_context={})
        task = Task("agreement", "", "", [], [], [query], info)
        out = score_response(task, query, case["response"], scoring="megabench")
        return ("ok", {"fields": out["field_scores"], "query": out["score"], "parse_ok": out["parse_ok"]})

    return run


# =========================================================================== comparison


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or isinstance(x, (int, float)):
        return float(x)
    return None


def _positive(score: Any) -> bool:
    """MEGA-Bench gave a score above 0 (the `MB>0` column: how many cases are not trivially 0)."""
    x = _num(score)
    return x is not None and not math.isnan(x) and x > 0


def same_score(reference: Any, ours: Any) -> bool:
    """MEGA-Bench's number vs mmrl's (NaN there is mmrl's -1)."""
    r, o = _num(reference), _num(ours)
    if r is None or o is None:
        return False
    if math.isnan(r):
        return o == -1.0 or math.isnan(o)
    if math.isnan(o):
        return False
    return abs(r - o) <= TOL or r == o


def same_value(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (1, 1.0 and True differ; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            any(type(k) is type(k2) and k == k2 and same_value(v, b[k2]) for k2 in b) for k, v in a.items()
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, (set, frozenset)):
        return a == b
    return a == b


def agrees(case: dict, reference: tuple, ours: tuple) -> bool:
    if reference[0] == "crash":
        return ours[0] == "crash"
    if ours[0] != "ok":
        return False
    ref, mine = reference[1], ours[1]
    if case["kind"] == "metric":
        return same_score(ref, mine)
    if case["kind"] == "parser":
        return same_value(ref[0], mine[0]) and ref[1] == mine[1]
    if ref["parse_ok"] != mine["parse_ok"] or set(ref["fields"]) != set(mine["fields"]):
        return False
    if not all(same_score(ref["fields"][f], mine["fields"][f]) for f in ref["fields"]):
        return False
    return same_score(ref["query"], mine["query"])


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _inputs(case: dict) -> str:
    if case["kind"] == "metric":
        extra = f", eval_context={_short(case['ctx'], 200)}" if case["ctx"] else ""
        return f"response={_short(case['response'])}, reference={_short(case['reference'])}{extra}"
    if case["kind"] == "parser":
        return f"response={_short(case['response'])}, answer={_short(case['answer'])}"
    return (
        f"response={_short(case['response'])}, answer={_short(case['answer'])}, fields={case['fields']}, "
        f"weights={case['weights']}, aggregation={case['aggregation']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--megabench", required=True, help="a checkout of TIGER-AI-Lab/MEGA-Bench")
    parser.add_argument("--antlr411", default=None, help="a folder holding antlr4-python3-runtime 4.11 (pip install --target)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the number of random cases")
    parser.add_argument("--only", default=None, help="comma-separated metric/parser names to run")
    parser.add_argument("--show", type=int, default=5, help="disagreements printed per metric/parser")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if os.environ.get("PYTHONHASHSEED") != "0":
        # str() of a set of strings (MEGA-Bench's answer_string parser passes parsed sets on as
        # text) depends on the hash seed: both processes get the same one.
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])

    _megabench_dir(args.megabench)
    if args.antlr411 is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            runtime = version("antlr4-python3-runtime")
        except PackageNotFoundError:
            runtime = "none"
        if not runtime.startswith("4.11"):
            raise SystemExit(
                f"SymPy's parse_latex (MEGA-Bench's LaTeX reader) needs the ANTLR 4.11 runtime; this environment has "
                f"{runtime}. Install it aside and pass it: pip install --no-deps --target /tmp/antlr411 "
                "antlr4-python3-runtime==4.11.0 ... --antlr411 /tmp/antlr411"
            )

    cases = generate_cases(args.seed, args.scale)
    if args.only:
        wanted = set(args.only.split(","))
        cases = [c for c in cases if c["name"] in wanted or c["name"].removeprefix("query/") in wanted]
    print(f"{len(cases)} cases (seed {args.seed}, scale {args.scale})", flush=True)

    with tempfile.TemporaryDirectory(prefix="megabench-agreement-") as tmp:
        case_file, out_file = os.path.join(tmp, "cases.pkl"), os.path.join(tmp, "results.pkl")
        with open(case_file, "wb") as f:
            pickle.dump(cases, f)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--megabench", args.megabench, "--cases", case_file, "--out", out_file]  # fmt: skip
        if args.antlr411:
            cmd += ["--antlr411", args.antlr411]
        start = time.time()
        log_path = os.path.join(tmp, "worker.log")
        with open(
            log_path, "w"
        ) as log:  # MEGA-Bench prints per test case / plan step, and its children's tracebacks
            worker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=tmp)
            run = _mmrl_scorer()
            ours = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # numpy's ComplexWarning / RuntimeWarning on odd inputs
                for i, case in enumerate(cases):
                    try:
                        ours.append(run(case))
                    except Exception as exc:  # noqa: BLE001
                        ours.append(("crash", f"{type(exc).__name__}: {exc}"))
                    if (i + 1) % 10000 == 0:
                        print(f"  mmrl: {i + 1}/{len(cases)} cases, {time.time() - start:.0f} s", flush=True)
            print(f"  mmrl done ({time.time() - start:.0f} s); waiting for MEGA-Bench's worker", flush=True)
            code = worker.wait()
        if code != 0:
            with open(log_path) as log:
                sys.stderr.write(log.read()[-5000:])
            raise SystemExit(f"the MEGA-Bench worker failed (exit {code})")
        with open(out_file, "rb") as f:
            reference = pickle.load(f)
    print(f"scored in {time.time() - start:.0f} s\n")

    groups: dict[tuple[str, str], dict] = defaultdict(lambda: {"cases": 0, "agree": 0, "crash": 0, "unavailable": 0, "scored": 0, "bad": [], "crashes": []})  # fmt: skip
    for case, ref, mine in zip(cases, reference, ours):
        g = groups[(case["kind"], case["name"])]
        if mine[0] == "unavailable":
            g["unavailable"] += 1
            continue
        if ref[0] == "crash":  # no MEGA-Bench number to compare with
            g["crash"] += 1
            g["crashes"].append((case, ref, mine))
            continue
        g["cases"] += 1
        g["scored"] += case["kind"] != "parser" and _positive(
            ref[1] if case["kind"] == "metric" else ref[1]["query"]
        )
        if agrees(case, ref, mine):
            g["agree"] += 1
        else:
            g["bad"].append((case, ref, mine))

    total = agree = unavailable = crashes = 0
    for kind in ("metric", "parser", "query"):
        names = sorted(n for k, n in groups if k == kind)
        if not names:
            continue
        print(f"{kind:<8}{'':<38}{'cases':>7}{'agree':>7}{'' if kind == 'parser' else 'MB>0':>7}  notes")
        for name in names:
            g = groups[(kind, name)]
            notes = []
            if g["crash"]:
                notes.append(f"+{g['crash']} where MEGA-Bench's evaluator crashes (not counted)")
            if g["unavailable"]:
                notes.append(f"{g['unavailable']} unavailable to mmrl here (not counted)")
            scored = "" if kind == "parser" else g["scored"]
            print(f"  {name:<44}{g['cases']:>7}{g['agree']:>7}{scored:>7}  {'; '.join(notes)}")
            total += g["cases"]
            agree += g["agree"]
            unavailable += g["unavailable"]
            crashes += g["crash"]
        print()
    print(f"TOTAL: {agree} of {total} cases agree")
    print(f"not counted: {crashes} cases where MEGA-Bench's evaluator crashes (no number), {unavailable} unavailable to mmrl here")  # fmt: skip
    for (kind, name), g in sorted(groups.items()):
        if g["crashes"]:
            print(f"\n{kind} {name}: MEGA-Bench crashes on {len(g['crashes'])}")
            for case, ref, mine in g["crashes"][: args.show]:
                print(f"  {_inputs(case)}")
                print(f"    MEGA-Bench: {_short(ref, 300)}\n    mmrl:       {_short(mine, 300)}")

    shown = False
    for (kind, name), g in sorted(groups.items()):
        if not g["bad"]:
            continue
        if not shown:
            print("\nDisagreements (MEGA-Bench vs mmrl):")
            shown = True
        print(f"\n{kind} {name}: {len(g['bad'])} disagree")
        for case, ref, mine in g["bad"][: args.show]:
            print(f"  {_inputs(case)}")
            print(f"    MEGA-Bench: {_short(ref, 300)}\n    mmrl:       {_short(mine, 300)}")
    return 0 if agree == total else 1


if __name__ == "__main__":
    sys.exit(main())
