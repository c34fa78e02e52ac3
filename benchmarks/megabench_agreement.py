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

LETTERS = "ABCDEFGH"
WORDS = (
    "the a cat dog blue red tree sea day way night light bright bat hat sat mat run fun sun "
    "apple banana stone river moon star road home time fire water green yellow house mouse "
    "over under happy quickly slowly bird sing ring king thing song long strong"
).split()
ACCENTED = ["café", "naïve", "Zürich", "São Paulo", "Ñandú", "Ångström", "crème brûlée"]
CHINESE = [
    "我们",
    "喜欢",
    "学习",
    "中文",
    "今天",
    "天气",
    "很好",
    "北京",
    "大学",
    "的",
    "是",
    "一个",
    "猫",
    "狗",
    "在",
    "家",
]
CHESS = [
    "e4",
    "e5",
    "Nf3",
    "Nc6",
    "Bb5",
    "a6",
    "Qxh7+",
    "Qxf7#",
    "O-O",
    "O-O-O",
    "exd5",
    "Rxe8!",
    "Nf3+",
    "Kg1",
]


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


NUMBER_EDGES = [
    "0", "-0", "0.0", "1", "1.0", "1.", ".5", "1e3", "1E-3", "1_000", "1,000", "1,000,000", "3.14", "\\pi",
    "π", "2\\pi", "2π", "{π}", "3*\\pi", "\\frac{\\pi}{2}", "50%", "12.5%", "$5", "$5.00", "5°C", "30°", "¥100",
    "x = 5", "x=5=6", "≈ 3.14", "a \\approx 2", "\\(2\\)", "\\[3\\]", "$\\frac{3}{4}$", "\\frac{1}{2}", "1/2",
    "2**3", "2^3", "2^{10}", "\\sqrt{2}", "\\sqrt{16}", "\\dfrac{1}{3}", "\\frac12", "E", "math.pi", "math.e",
    "True", "False", "None", "inf", "-inf", "nan", "1e400", "(1, 2)", "[1, 2]", "[2, 1]", "[1, 2, 3]", "[]",
    "()", "[1, 'a']", "['1', '2']", "{1, 2}", "abc", "five", "", " ", "5 apples", "3 + 4", "10 - 2 * 3",
    "7 // 2", "7 % 3", "1 < 2", "-(3)", "~5", "3 & 1", "2 << 3", "\\boxed{5}", "\\boxed{\\frac{1}{2}}",
    "\\boxed{3} then \\boxed{4}", "\\boxed{{1}{2}}", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\text{5}", "5\\%",
    "\\$5", "3.0000001", "2.99", "3.03", "1j", "1+2j", "0x10", "0b101", "1e-10", "100000000000000000000",
    "\\infty", "x", "\\alpha", "ς", "√2", "½", "٣", "３", "1 2", "1\n2", "答案是 5",
]  # fmt: skip

LIST_EDGES = [
    "['a', 'b']", "[a, b]", "a, b", "a,b", " a , b ", "a,b,,c", "{'a', 'b'}", "('a', 'b')", "('a',)", "{'a': 1, 'b': 2}",
    "{'a': [1, 2]}", "[[1, 2], [3]]", "[(1, 2), (3, 4)]", "[('a', 'b'), ('c', 'd')]", "'abc'", '"abc"', "None", "[]",
    "()", "{}", "", " ", "[1, 2, 3]", "[1, 2, 2]", "[3, 2, 1]", "1", "1.5", "-2", "True", "[1, 'a']", "['A', 'b']",
    "['a', 'B']", "[a, b", "(a, b", "{a}", "{a, b}", "[ ]", "[None]", "[[]]", "['a']", "a", "A", "b, a", "B, A",
    "[\"A\", \"b\"]", "[1.0, 2.0]", "['1', '2']", "1, 2", "[1,2]", "(1,2)", "{1: 'a'}", "[{'a': 1}]", "a\nb",
    "['a b', 'c']", "['ab', 'c']", "[' a', 'b ']", "x y z", "[e4, Nf3]", "e4, Nf3#", "['Qxf7#', 'O-O']",
    "['O-O', 'Qxf7']", "Nf3+, e4", "Nf3, e4", "[1, 2, 3, 4]", "[0.1, 0.2, 0.3, 0.4]",
]  # fmt: skip


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


LATEX_EDGES = [
    "\\frac{1}{2}", "0.5", "1/2", "\\dfrac{1}{2}", "x^2", "x \\cdot x", "x*x", "x^{2}", "2x", "x+x", "\\sqrt{4}", "2",
    "a+b", "b+a", "\\alpha", "α", "\\alpha + 1", "α+1", "\\beta", "β", "\\bar{x}", "\\overline{x}", "x̄", "ā",
    "\\overline{AB}_1", "\\begin{pmatrix}1\\end{pmatrix}", "\\(x\\)", "\\[x\\]", "$x$", "\\frac{", "", " ", "ς",
    "Ρ", "\\sin(x)", "\\sin x", "\\cos^2 x + \\sin^2 x", "1", "\\pi", "π", "3.14159", "\\infty", "x = 2", "2 = x",
    "x < 3", "3 > x", "\\{1, 2\\}", "(1, 2)", "\\text{yes}", "yes", "Yes", "\\mathrm{m}", "10^{3}", "1000",
    "\\frac{x}{y}", "x/y", "\\log(x)", "\\ln x", "e^{i\\pi}", "-1", "\\left(x\\right)", "x",
]  # fmt: skip


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

BW_ACTIONS = {
    "pickup": (["ob"], ["(clear ?ob)", "(on-table ?ob)", "(arm-empty)"],
               ["(holding ?ob)", "(not (clear ?ob))", "(not (on-table ?ob))", "(not (arm-empty))"]),
    "putdown": (["ob"], ["(holding ?ob)"], ["(clear ?ob)", "(arm-empty)", "(on-table ?ob)", "(not (holding ?ob))"]),
    "stack": (["ob", "underob"], ["(clear ?underob)", "(holding ?ob)"],
              ["(arm-empty)", "(clear ?ob)", "(on ?ob ?underob)", "(not (clear ?underob))", "(not (holding ?ob))"]),
    "unstack": (["ob", "underob"], ["(on ?ob ?underob)", "(clear ?ob)", "(arm-empty)"],
                ["(holding ?ob)", "(clear ?underob)", "(not (on ?ob ?underob))", "(not (clear ?ob))",
                 "(not (arm-empty))"]),
}  # fmt: skip


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

POEM_WORDS = (
    "cat hat bat sat mat day way say play stay night light bright sight tree free sea see "
    "love above dove heart apart start moon soon june rain again plain the a of and to in "
    "gentle river morning flower silver garden beautiful yesterday remember forever "
    "walked jumped played dreams stars eyes wishes unhappy untold 'neath o'er doggo fiery "
    "cat's dog's zzxq blorf"
).split()


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

PROGRAMS = [
    "x = int(input())\nprint(x * 2)",
    "a = input()\nb = input()\nprint(int(a) + int(b))",
    "print(input()[::-1])",
    "def f(n):\n    return n * n\nprint(f(int(input())))",
    "def g(n):\n    return n + 1\ndef f(n):\n    return g(n) * 2\nprint(f(int(input())))",
    "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\nprint(fact(int(input())))",
    'def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\nif __name__ == "__main__":\n    print(fact(int(input())))',
    "import math\nprint(math.isqrt(int(input())))",
    "n = int(input())\nprint(sum(range(n + 1)))\n",
    "print('  padded  ')",
    "print(1)\nprint(2)",
    "raise ValueError('bad')",
    "x = input()\ny = input()\nprint(x)",
    "import sys\nsys.stdout.write(input().upper())",
    "print(sum(int(t) for t in input().split()))",
    "s = [int(input()) for _ in range(3)]\nprint(max(s))",
    "print(undefined_name)",
    "exit(0)",
    "print('a', end='')\nprint('b')",
    "x = int(input())\nprint(x // 0)",
    "for i in range(int(input())):\n    print(i)",
]


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
EDGE_CASES: list[tuple[str, Any, Any]] = [
    ("exact_str_match", "Because", "B"), ("exact_str_match", "(B) blue", "B"), ("exact_str_match", "B. x", "B"),
    ("exact_str_match", "b", "B"), ("exact_str_match", None, "None"), ("exact_str_match", None, "N"),
    ("exact_str_match", 1, "1"), ("exact_str_match", ["B"], "B"), ("exact_str_match", "", ""), ("exact_str_match", "(", "B"),
    ("exact_str_match", "'B'", "B"), ("exact_str_match", "B", "'B'"), ("exact_str_match", "1.", "1"),
    ("simple_str_match", "because", "b"), ("simple_str_match", "New-York", "new york"), ("simple_str_match", None, "none"),
    ("simple_str_match", "a.b.c", "ABC"), ("simple_str_match", {"a": 1}, "{'a':1}"),
    ("exact_str_match_case_insensitive", 5, "5"), ("exact_str_match_case_insensitive", "BECAUSE", "b"),
    ("exact_str_match_case_insensitive", "x", 5), ("exact_str_match_case_insensitive", None, "none"),
    ("code_result_exact_str_match", "42", "```\n42\n```"), ("code_result_exact_str_match", "42", "```output\n42\n```"),
    ("code_result_exact_str_match", "42", "42"), ("code_result_exact_str_match", "", "```\n\n```"),
    ("normalized_similarity_damerau_levenshtein", None, "x"), ("normalized_similarity_damerau_levenshtein", "", ""),
    ("normalized_similarity_damerau_levenshtein", "ab", "ba"), ("normalized_similarity_damerau_levenshtein", "x", None),
    ("near_str_match", "The Café", "cafe"), ("near_str_match", "a cat", "the cat"), ("near_str_match", "kitten", "sitting"),
    ("near_str_match", "", ""), ("near_str_match", None, "x"),
    ("multi_ref_phrase", "New York", "['new york', 'NYC']"), ("multi_ref_phrase", "nyc", "new york，nyc"),
    ("multi_ref_phrase", "1", "[1, 2]"), ("multi_ref_phrase", "x", "None"), ("multi_ref_phrase", None, "none, x"),
    ("number_rel_diff_ratio", True, "1"), ("number_rel_diff_ratio", "0", "0"), ("number_rel_diff_ratio", 5, "10"),
    ("number_rel_diff_ratio", "15", "10"), ("number_rel_diff_ratio", "30", "10"), ("number_rel_diff_ratio", "abc", "1"),
    ("number_rel_diff_ratio", "1", "abc"), ("number_rel_diff_ratio", "1+1j", "1"), ("number_rel_diff_ratio", "-5", "-10"),
    ("positive_int_match", 3, "3"), ("positive_int_match", "3", "3"), ("positive_int_match", "0", "0"),
    ("positive_int_match", "-1", "0"), ("positive_int_match", "3", ""), ("positive_int_match", "3", "3.0"),
    ("positive_int_match", "3", "abc"), ("positive_int_match", "True", "1"), ("positive_int_match", "abc", "3"),
    ("normalized_rmse", "0.05", "0"), ("normalized_rmse", "1", "0"), ("normalized_rmse", "abc", "0"),
    ("normalized_rmse", "[1]", "[1]"), ("normalized_rmse", "1j", "0"),
    ("angle_seq_float_rmse", "[10, 20]", "[10, 25]"), ("angle_seq_float_rmse", "[]", "[]"),
    ("angle_seq_float_rmse", "[1, 'a']", "[1, 2]"), ("angle_seq_float_rmse", "a, b", "[1, 2]"),
    ("angle_seq_float_rmse", "[1j, 2]", "[1, 2]"), ("angle_seq_float_rmse", "[1e400, 2]", "[1, 2]"),
    ("general_single_numerical_match", "3\\pi", "9.42"), ("general_single_numerical_match", "True", "1"),
    ("general_single_numerical_match", "(1, 2)", "(1, 2)"), ("general_single_numerical_match", "[2, 1]", "[1, 2]"),
    ("general_single_numerical_match", "0.001", "0"), ("general_single_numerical_match", "0", "0"),
    ("general_single_numerical_match", "50%", "0.5"), ("general_single_numerical_match", "x = 5", "5"),
    ("general_single_numerical_match", "1,000", "1000"), ("general_single_numerical_match", "\\frac{1}{2}", "0.5"),
    ("general_single_numerical_match", "2**3", "8"), ("general_single_numerical_match", "2^3", "8"),
    ("general_single_numerical_match", "E", "2.718"), ("general_single_numerical_match", "math.pi", "3.14159"),
    ("general_single_numerical_match", "five", "5"), ("general_single_numerical_match", "Five", "five"),
    ("general_single_numerical_match", 5, "5"), ("general_single_numerical_match", None, "None"),
    ("general_single_numerical_match", "nan", "nan"), ("general_single_numerical_match", "inf", "inf"),
    ("general_single_numerical_match", "$5", "5"), ("general_single_numerical_match", "5°C", "5"),
    ("boxed_single_numerical_match", "\\boxed{3} then \\boxed{4}", "4"), ("boxed_single_numerical_match", "\\boxed{\\frac{1}{2}}", "0.5"),
    ("boxed_single_numerical_match", "\\boxed{{1}{2}}", "12"), ("boxed_single_numerical_match", "no box 5", "5"),
    ("latex_expr_equality", "\\frac{1}{2}", "0.5"), ("latex_expr_equality", "x^2", "x \\cdot x"),
    ("latex_expr_equality", "α", "\\alpha"), ("latex_expr_equality", "x̄", "\\bar{x}"), ("latex_expr_equality", "ς", "x"),
    ("latex_expr_equality", "\\frac{", "\\frac{"), ("latex_expr_equality", None, "x"), ("latex_expr_equality", "", ""),
    ("text_with_latex_expr_equality", "The answer is $x^2$", "the answer is $x \\cdot x$"),
    ("text_with_latex_expr_equality", "no latex", "No Latex"), ("text_with_latex_expr_equality", "$1,000$", "$1000$"),
    ("set_equality", "{'a': 1, 'b': 2}", "['a', 'b']"), ("set_equality", {"a": 1}, "['a']"), ("set_equality", "None", "[]"),
    ("set_equality", "None", "None"), ("set_equality", "[[1, 2], [3]]", "[]"), ("set_equality", "'abc'", "['a', 'b', 'c']"),
    ("set_equality", "[a, b", "[]"), ("set_equality", "1", "[1]"), ("set_equality", ["a", "b"], "b, a"),
    ("set_equality", None, "[]"), ("set_equality", 3, "[3]"),
    ("set_equality_case_insensitive", "[1, 2]", "[1, 2]"), ("set_equality_case_insensitive", "A, b", "a, B"),
    ("set_equality_case_insensitive", "None", "None"),
    ("str_set_equality_line_break", "a\\nb", "b\na"), ("str_set_equality_line_break", ["a"], "a"),
    ("str_set_equality_comma", "None", "none"), ("str_set_equality_comma", "[1, 'A']", "[1, 'a']"),
    ("jaccard_index", None, "[1]"), ("jaccard_index", "[]", "[]"), ("jaccard_index", "a, b", "b, c"),
    ("jaccard_index_case_insensitive", "[]", "[]"), ("jaccard_index_case_insensitive", "[1, 'A']", "['a', '1']"),
    ("jaccard_index_case_insensitive", "[('A B', 'c')]", "[('ab', 'C')]"), ("jaccard_index_case_insensitive", "[1]", "[2]"),
    ("jaccard_index_case_insensitive", "[(1, 2)]", "[('1', '2')]"), ("jaccard_index_case_insensitive", None, "[1]"),
    ("set_precision", "[]", "[1]"), ("set_precision", "a, b", "a"), ("set_precision", None, "a"),
    ("chess_move_list_jaccard_index", "Nf3+, e4", "Nf3, e4"), ("chess_move_list_jaccard_index", "Qxf7#", "Qxf7"),
    ("chess_move_list_jaccard_index", None, "e4"), ("chess_move_list_jaccard_index", "Rxe8!", "Rxe8"),
    ("sequence_equality", "[1, 2]", "1, 2"), ("sequence_equality", ["a", "b"], "['a', 'b']"), ("sequence_equality", None, "None"),
    ("sequence_equality_case_insensitive", "[A, b]", "['a', 'B']"), ("sequence_equality_case_insensitive", "[1, 2]", "['1', '2']"),
    ("sequence_accuracy_case_insensitive", "[]", "[]"), ("sequence_accuracy_case_insensitive", "[1, 2]", "['a', 'b']"),
    ("sequence_accuracy_case_insensitive", "[A, b, c]", "[a, B, d]"), ("sequence_accuracy_case_insensitive", "[1, 2]", "[1, 3]"),
    ("longest_common_list_prefix_ratio", "[]", "[]"), ("longest_common_list_prefix_ratio", "[1, 2, 4]", "[1, 2, 3]"),
    ("longest_common_list_prefix_ratio", "a, b", "a, c"),
    ("dict_equality", {"a": "1"}, '{"a": "1"}'), ("dict_equality", "{}", "{}"), ("dict_equality", {"a": 1}, '{"a": "1"}'),
    ("dict_equality", "x", "x"), ("dict_equality", {1: "x"}, '{"1": "x"}'),
    ("dict_precision", {}, '{"a": 1}'), ("dict_precision", {"a": "B", "b": "x"}, '{"a": "B"}'),
    ("dict_precision", {"a": "Because"}, '{"a": "B"}'),
    ("dict_exact_str_match_agg_recall", {}, "{}"), ("dict_exact_str_match_agg_recall", {"a": None}, '{"a": "None"}'),
    ("dict_exact_str_match_agg_recall", "x", '{"a": 1}'),
    ("dict_set_equality_agg_jaccard", {}, {}), ("dict_set_equality_agg_jaccard", {"a": "x, y"}, {"a": ["y", "x"]}),
    ("dict_set_equality_agg_jaccard", {"a": "x", "b": "{[1, 2]}"}, '{"a": "x", "b": [[1, 2]]}'),
    ("dict_equality", "{[1, 2]}", "{}"), ("dict_exact_str_match_agg_recall", {"a": "{{'b': 1}}"}, '{"a": "x"}'),
    ("dict_jaccard_agg_jaccard", {}, {}), ("dict_jaccard_agg_jaccard", {"a": [1, 2]}, {"a": [2, 3], "b": [1]}),
    ("dict_nbbox_iou_tuple_agg_jaccard", {}, {}), ("dict_nbbox_iou_tuple_agg_jaccard", {"a": "[0, 0, 1, 1]"}, {"a": [[0, 0, 1, 1]]}),
    ("nbbox_iou_tuple", "[0, 0, 1, 1]", "[0, 0, 1, 1]"), ("nbbox_iou_tuple", "[]", "[]"), ("nbbox_iou_tuple", "[0, 0, 0, 0]", "[0, 0, 0, 0]"),
    ("nbbox_iou_tuple", [[0, 0, 1, 1]], "[[0, 0, 0.5, 0.5]]"), ("nbbox_iou_tuple", "abc", "[0, 0, 1, 1]"),
    ("nbbox_iou_tuple", [["a", 0, 1, 1]], "[0, 0, 1, 1]"), ("nbbox_iou_tuple", "[1, 1, 0, 0]", "[0, 0, 1, 1]"),
    ("nbbox_iou_single", "[0, 0, 1, 1]", "[0, 0, 0.5, 1]"), ("nbbox_iou_single", "abc", "[0, 0, 1, 1]"),
    ("nbbox_iou_single", "[0, 0, 1", "[0, 0, 1, 1]"), ("nbbox_iou_single", "[0, 0]", "[0, 0, 1, 1]"),
    ("nbbox_iou_sequence", "[]", "[]"), ("nbbox_iou_sequence", "[[0, 0, 1, 1]]", "[[0, 0, 1, 1]]"),
    ("nbbox_iou_sequence", None, "[]"), ("nbbox_iou_sequence", 5, "[]"), ("nbbox_iou_sequence", [], []),
    ("xml_nbbox_iou_single", "<box>0, 0, 1, 1</box>", "<box>0, 0, 1, 1</box>"), ("xml_nbbox_iou_single", "", "<box>0, 0, 1, 1</box>"),
    ("xml_nbbox_iou_single", [0, 0, 1, 1], "<box>0, 0, 1, 1</box>"), ("xml_nbbox_iou_single", "<box>0, 0, 1, 1</box>", ""),
    ("xml_norm_point_distance", "<point>0.5, 0.5</point>", "<point>0.5, 0.5</point>"),
    ("xml_norm_point_distance", "<point>1.5, 0.5</point>", "<point>0.5, 0.5</point>"),
    ("xml_norm_point_distance", [0.1, 0.1], (0.1, 0.1)), ("xml_norm_point_distance", None, "<point>0.5, 0.5</point>"),
    ("sequence_coords_similarity", "[[0.1, 0.1]]", "[[0.1, 0.1]]"), ("sequence_coords_similarity", "[]", "[]"),
    ("sequence_coords_similarity", "[[0.1, 0.1], [0.2]]", "[[0.1, 0.1]]"), ("sequence_coords_similarity", None, "[[0.1, 0.1]]"),
    ("bleu", "the cat sat on the mat", "the cat"), ("bleu", "the cat", "the cat sat on the mat"), ("bleu", "a b", "a b"),
    ("bleu", "x y z w", "a b c d"), ("bleu", ["a dog", "the cat"], ["the cat", "a dog"]), ("bleu", "", ""),
    ("bleu", ["a b c d"], ["a b c d", "e f g h"]), ("bleu", None, "x"), ("bleu", "a b c d e", "a b c d e"),
    ("gleu_cn", "我们喜欢学习", "我们喜欢学习"), ("gleu_cn", "", ""), ("gleu_cn", "我们", "你们"), ("gleu_cn", None, "我们"),
]  # fmt: skip

EDGE_CONTEXT_CASES: list[tuple[str, Any, dict]] = [
    ("xml_norm_point_in_bbox", "<point>0.3, 0.3</point>", {"bounding_boxes": ["[0.1, 0.1, 0.5, 0.5]"]}),
    ("xml_norm_point_in_bbox", "<point>0.7, 0.3</point>", {"bounding_boxes": ["[0.1, 0.1, 0.5, 0.5]", "(0.6, 0.2, 0.9, 0.4)"]}),
    ("xml_norm_point_in_bbox", [0.3, 0.3], {"bounding_boxes": ["[0.1, 0.1, 0.5, 0.5]"]}),
    ("xml_norm_point_in_bbox", [0.3], {"bounding_boxes": ["[0.1, 0.1, 0.5, 0.5]"]}),
    ("xml_norm_point_in_bbox", "no point", {"bounding_boxes": ["[0.1, 0.1, 0.5, 0.5]"]}),
    ("constrained_generation", "cat\nhat", {"rhyming_scheme": "AA"}),
    ("constrained_generation", "cat\ndog", {"rhyming_scheme": "AA"}),
    ("constrained_generation", "one two three", {"length": "<4"}),
    ("constrained_generation", "one two three", {"length": "=3"}),
    ("constrained_generation", "one two three", {"length": ""}),
    ("constrained_generation", "apple\nbanana", {"acrostic": "ab"}),
    ("constrained_generation", "the cat sat on the mat", {"syllables": "6"}),
    ("constrained_generation", "the cat sat on the mat", {"poetry_meter": "iambic"}),
    ("program_judge", "print(int(input()) * 2)", {"test_case": [{"input": ["3"], "expected": "6"}]}),
    ("program_judge", "print(int(input()) * 2)", {"test_case": {"input": ["4"], "expected": "8\n"}}),
    ("program_judge", "print(int(input()) * 2)", {"test_case": []}),
    ("program_judge", "def g():\n    return 1\ndef f():\n    return g()\nprint(f())", {"test_case": [{"input": [], "expected": "1"}]}),
]  # fmt: skip

PARSER_EDGES = [
    "**Answer:** B", "**Answer: B**", "*Answer: B*", "ANSWER: B", "answer: a\nAnswer: C", "Answer: B\n\nBecause it is blue",
    "Answer: 'B'", 'Answer: "B"', "Answer: {'b': 1}", "Answer: [1, 2]", "Answer: []", "Answer: {}", "Answer: [a, b]",
    "Answer: B\nC", "Answer:\nB", "Answer:B", "The answer is B", "B", "", " ", "Answer: ", "Answer: ```\nB\n```",
    "```python\nprint(1)\n```", "Answer: (B)", "Answer: B.", "Answer: B, C", "Answer: 12-3_x", 'Answer: {"a": 1,\n "b": 2}',
    'Answer: {"a": 1}\n{"b": 2}', 'Answer:\n{"a": 1}', '{"a": "{\\"b\\": 1}"}', "Answer: {1: 'x', 2: 'y'}",
    "```json\n{\"a\": [1, 2]}\n```", "{'a': 'it's'}", "{\"a\": \"x\\\"y\"}", "[{\"a\": 1}, {\"b\": 2}]", "{\"a\": 1} {\"b\": 2}",
    "Answer: {'a': None, 'b': True}", "Answer: {\"a\": null, \"b\": true}", "Answer: {'a': \"'quoted'\"}",
    "Answer: {\"a\": \"'quoted'\"}", "Answer: {\"a\": \"[1, 2]\"}", "Answer: {\"a\": 1.0}", "Answer: [1,\n2]",
    "Answer: {\"a\": [\"x\", {\"y\": 1}]}", "Answer: {a: 1}", "{", "}", "[", "Answer: 'unterminated", "Answer: '''x'''",
    "Answer: **B**", "Answer: B **bold**", "**Answer:**\nB", "Answer:   \n\n  B  \n\n", "answer: b", "The Answer: B",
    "Reasoning...\nAnswer: X\nMore text", "Answer: x\n\n\n\ny", "   ascii\n  art  \n\n\n   ", "Answer:\n  /\\\n /  \\\n",
    "```\n  /\\\n /  \\\n```", "Answer: ```text\n a\n\n b \n```", "Answer: 1e3", "Answer: \"\"", "Answer: ''",
    "Answer: \\boxed{5}", "Answer: $x^2$", "Answer: (1, 2)", "Answer: {1, 2}", "Answer: set()", "Answer: None",
    "Answer: {[1, 2]}", "{'a': {[1]}}", "Answer: {'a', 'b', 'c'}",
]  # fmt: skip


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
