"""Field scoring functions, registered by their MEGA-Bench names.

Every metric is `fn(response, reference, ctx) -> float`: `response` is the parsed field (a string,
or a JSON value from the `json` parser), `reference` the task's answer for that field, `ctx` the
query's `FieldContext` (eval context, prompt, judge). Scores are in [0, 1]; `positive_int_match`
may return -1, meaning "this field does not count" (see `aggregate.aggregate_query`).

The definitions follow MEGA-Bench (Chen et al., 2025; `metrics/README.md` there) so scores are
comparable; where their code has a bug rather than a definition we say so and differ:

- `exact_str_match`: a single-letter reference (`B`) matches a response that *is* that option
  letter: `B`, `(B)`, `B.`, `B) text`, `B. text`, `B text`. MEGA-Bench's regex takes the first
  letter of any response, so `Because` would match `B`; here it does not.
- Set metrics follow MEGA-Bench's convention that an empty denominator scores 1: two empty sets
  are equal (Jaccard 1), and an empty prediction has set precision 1 (`set_precision`).
- `bleu` scores the response against the reference (MEGA-Bench passes them the other way round).
- `gleu_cn` tokenises Chinese per character (MEGA-Bench uses jieba, not a dependency here).
- `latex_expr_equality` compares with math-verify (MEGA-Bench: sympy's ANTLR LaTeX parser).
- `boxed_single_numerical_match` reads the last `\\boxed{}` (as mmrl's math verifier does).

Judge metrics (`gpt_4o_as_judge`, `ascii_art_gpt4o_judge`, `model_judge`) call the configured
judge `judge(prompt, response, reference) -> float in [0, 1]`; tasks using one are "Open", the
others "Core". `program_judge` (sandboxed), `symbolic_planning_test` and `constrained_generation`
are in `mmrl.eval.task_metrics`. MEGA-Bench metrics that need an NLI model or geocoding
(`UNSUPPORTED`) are known by name: tasks using them are reported and skipped, not crashed.

This module is the `--scoring corrected` mode; the default, `--scoring megabench`, reproduces
MEGA-Bench's own code (`mmrl.eval.megabench`), whose numbers are the comparable ones.
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

from mmrl.eval.parsers import extract_code_block, parse_json_value
from mmrl.verifiers.math import last_boxed

Judge = Callable[[str, str, str], float]
"""`judge(prompt, response, reference) -> score in [0, 1]` for open-ended answers."""

MAX_EDIT_CHARS = 1000
"""Characters of each side compared by edit-distance metrics (O(n*m) in Python: ~1 s at 1000)."""
MAX_LITERAL_CHARS = 100_000
"""Longest text read as a Python/JSON literal (longer text is compared as plain text)."""

UNSUPPORTED = {
    "nli_entailment": "needs an NLI model",
    "geo_proximity_location_dict": "geocodes place names over the network",
}
"""MEGA-Bench metrics not implemented, with why; their tasks are skipped and counted."""


@dataclass
class FieldContext:
    """What a metric may need besides the response and the reference."""

    eval_context: dict[str, Any] = field(default_factory=dict)
    """The query's `eval_context` (e.g. `bounding_boxes` for `xml_norm_point_in_bbox`)."""
    prompt: str = ""
    """The full prompt text the model saw (for judges)."""
    answer: dict[str, Any] = field(default_factory=dict)
    """The whole reference answer (every field)."""
    judge: Judge | None = None
    """The judge for judge metrics."""
    parsed: Any = None
    """The whole parsed response (MEGA-Bench hands it to `constrained_generation` and aux metrics)."""
    task_name: str = ""
    """The task's name (for messages)."""


@dataclass(frozen=True)
class Metric:
    name: str
    fn: Callable[[Any, Any, FieldContext], float]
    is_judge: bool = False


_METRICS: dict[str, Metric] = {}


def register_metric(*names: str, is_judge: bool = False):
    """Register `fn(response, reference, ctx)` under one or more names."""

    def wrap(fn):
        for name in names:
            if name in _METRICS:
                raise ValueError(f"metric {name!r} already registered")
            _METRICS[name] = Metric(name, fn, is_judge)
        return fn

    return wrap


def get_metric(name: str) -> Metric:
    try:
        return _METRICS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_METRICS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KeyError(f"unknown metric {name!r}{hint}") from None


def metric_names() -> list[str]:
    return sorted(_METRICS)


def is_judge_metric(name: str) -> bool:
    return name in _METRICS and _METRICS[name].is_judge


def score_field(name: str, response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Score one field with the named metric (exceptions propagate; the runner records them)."""
    score = float(get_metric(name).fn(response, reference, ctx or FieldContext()))
    if not math.isfinite(score):
        raise ValueError(f"metric {name!r} returned {score}")
    return score


# --------------------------------------------------------------------------- conversions


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else str(value))


def _literal(text: Any) -> Any:
    """A Python/JSON literal read from a string (None if it is not one); non-strings unchanged."""
    if not isinstance(text, str):
        return text
    text = text.strip()
    if len(text) > MAX_LITERAL_CHARS:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _freeze(value: Any) -> Any:
    """Hashable form of nested lists / dicts (so they can be set members)."""
    if isinstance(value, dict):
        return frozenset((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, set):
        return frozenset(value)
    return value


def to_list(value: Any) -> list:
    """MEGA-Bench's list reading: a list/tuple as is; a string as a Python literal (a bare number
    is a one-item list), else split on commas (outer brackets dropped); a bracket opened but
    not closed, or anything else, is the empty list."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (set, frozenset)):
        return list(value)
    if not isinstance(value, str):
        return [] if value is None else [value]
    text = value.strip(" ")
    if not text:
        return []
    closing = {"(": ")", "[": "]", "{": "}"}
    bracketed = text[0] in closing
    if bracketed and not text.endswith(closing[text[0]]):
        return []
    if len(text) > MAX_LITERAL_CHARS:
        return [text]
    try:
        evaluated = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        inner = text[1:-1] if bracketed else text
        return [item.strip() for item in inner.split(",")]
    except TypeError:
        return []
    if evaluated is None:
        return []
    if isinstance(evaluated, (list, tuple, set, frozenset)):
        return list(evaluated)
    if isinstance(evaluated, dict):
        return list(evaluated.items())
    return [evaluated]


def to_set(value: Any) -> set:
    return {_freeze(v) for v in to_list(value)}


def to_dict(value: Any) -> dict | None:
    """A dict as is, or read from a string (JSON / Python); None when it is not one."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        parsed = parse_json_value(value)
        return parsed if isinstance(parsed, dict) else None
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, Number):
        return float(value)
    value = _literal(value)
    if isinstance(value, Number) and not isinstance(value, bool):
        return float(value)
    return None


# --------------------------------------------------------------------------- strings

_LETTER_OPTION = re.compile(r"^\(?([A-Za-z])(?:\)|\.|:|\s|$)")


def _exact(response: Any, reference: Any) -> float:
    response, reference = _text(response), _text(reference)
    if len(reference) == 1 and reference.isalpha() and len(response) > 1:
        match = _LETTER_OPTION.match(response.strip())
        if match:
            response = match.group(1)
    return 1.0 if response == reference else 0.0


@register_metric("exact_str_match")
def exact_str_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """1 if the strings are identical; a single-letter reference matches `(B)`, `B.`, `B) text`."""
    return _exact(response, reference)


@register_metric("code_result_exact_str_match")
def code_result_exact_str_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Exact match against the inside of the reference's code block."""
    inner, _ = extract_code_block(_text(reference))
    return _exact(response, inner)


@register_metric("exact_str_match_case_insensitive")
def exact_str_match_case_insensitive(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    return _exact(_text(response).lower(), _text(reference).lower())


def _simple(text: Any) -> str:
    text = _text(text)
    for ch in (" ", "-", "\n", "\t", "."):
        text = text.replace(ch, "")
    return text.lower()


@register_metric("simple_str_match")
def simple_str_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Exact match after removing spaces, hyphens, tabs, newlines and dots, case-insensitive."""
    return _exact(_simple(response), _simple(reference))


def damerau_levenshtein(a: str, b: str) -> int:
    """Unrestricted Damerau-Levenshtein distance (insert, delete, substitute, transpose adjacent;
    a substring may be edited after a transposition): Lowrance-Wagner's algorithm, O(n*m)."""
    n, m = len(a), len(b)
    big = n + m
    last_row: dict[str, int] = {}
    # d[i + 1][j + 1] is the distance between a[:i] and b[:j]; row/column 0 hold the sentinel.
    d = [[big] * (m + 2)] + [[big] + [0] * (m + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        d[i + 1][1] = i
    for j in range(m + 1):
        d[1][j + 1] = j
    for i in range(1, n + 1):
        last_col = 0
        for j in range(1, m + 1):
            k = last_row.get(b[j - 1], 0)
            ell = last_col
            cost = 0 if a[i - 1] == b[j - 1] else 1
            if cost == 0:
                last_col = j
            d[i + 1][j + 1] = min(
                d[i][j] + cost,
                d[i + 1][j] + 1,
                d[i][j + 1] + 1,
                d[k][ell] + (i - k - 1) + 1 + (j - ell - 1),
            )
        last_row[a[i - 1]] = i
    return d[n + 1][m + 1]


def normalized_dl_similarity(a: str, b: str) -> float:
    """1 - distance / max(len): 1 for identical strings (two empty strings included)."""
    a, b = a[:MAX_EDIT_CHARS], b[:MAX_EDIT_CHARS]
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - damerau_levenshtein(a, b) / longest


@register_metric("normalized_similarity_damerau_levenshtein", "normalized_similarity_demarau_levenshtein")
def normalized_similarity_damerau_levenshtein(
    response: Any, reference: Any, ctx: FieldContext | None = None
) -> float:
    """Normalised Damerau-Levenshtein similarity (case-sensitive); 0 for a non-string response."""
    if not isinstance(response, str):
        return 0.0
    return normalized_dl_similarity(response, _text(reference))


def _approximate(text: str) -> str:
    words = [w for w in text.split(" ") if w.lower() not in ("the", "a")]
    folded = unicodedata.normalize("NFKD", " ".join(words))
    return "".join(c for c in folded if not unicodedata.combining(c)).lower()


@register_metric("near_str_match")
def near_str_match(
    response: Any, reference: Any, ctx: FieldContext | None = None, threshold: float = 0.9
) -> float:
    """Damerau-Levenshtein similarity after folding accents, dropping `the`/`a` and case; 0 below
    the cut-off (0.9)."""
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0
    similarity = normalized_dl_similarity(_approximate(response), _approximate(reference))
    return similarity if similarity >= threshold else 0.0


@register_metric("multi_ref_phrase")
def multi_ref_phrase(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """1 if the response matches (`simple_str_match`) any of several references (a list, or
    comma-separated; a Chinese comma counts as a comma)."""
    refs = to_list(_text(reference).replace("，", ","))
    return 1.0 if any(simple_str_match(response, _text(ref)) for ref in refs) else 0.0


# --------------------------------------------------------------------------- numbers


@register_metric("number_rel_diff_ratio")
def number_rel_diff_ratio(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """max(0, 1 - |pred - gt| / |gt|) for numeric literals; 0 when the response is not a number
    (a zero reference scores 1 only for an exact 0)."""
    pred, gt = _number(response), _number(reference)
    if pred is None or gt is None:
        return 0.0
    if gt == 0:
        return 1.0 if pred == 0 else 0.0
    return max(0.0, 1.0 - abs((pred - gt) / gt))


@register_metric("positive_int_match")
def positive_int_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """1 if both are the same integer; -1 (the field does not count) when both are <= 0; else 0."""
    pred, gt = _literal(response), _literal(reference)
    if not isinstance(gt, int) or isinstance(gt, bool):
        return 0.0
    if not isinstance(pred, int) or isinstance(pred, bool):
        return 0.0
    if gt <= 0 and pred <= 0:
        return -1.0
    return 1.0 if pred == gt else 0.0


def _rmse_score(rmse: float, low: float, high: float) -> float:
    rmse = min(max(rmse, low), high)
    return 1.0 - (rmse - low) / (high - low)


@register_metric("normalized_rmse")
def normalized_rmse(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """1 - clip(|pred - gt|, 0, 0.1) / 0.1 (the RMSE of one number, normalised to [0, 0.1])."""
    pred, gt = _number(response), _number(reference)
    if pred is None or gt is None:
        return 0.0
    return _rmse_score(abs(pred - gt), 0.0, 0.1)


@register_metric("angle_seq_float_rmse")
def angle_seq_float_rmse(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """1 - clip(e, 0, 10) / 10 with e the mean absolute difference of two equally long number
    sequences (angles in degrees; MEGA-Bench's "RMSE" here is the mean of sqrt((p - g)^2))."""
    pred, gt = to_list(response), to_list(reference)
    if len(pred) != len(gt) or not gt:
        return 0.0
    try:
        error = sum(abs(float(p) - float(g)) for p, g in zip(pred, gt)) / len(gt)
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if math.isnan(error) else _rmse_score(error, 0.0, 10.0)


_LATEX_DELIMS = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$")
_UNIT_TAIL = re.compile(
    r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(?:[A-Za-z°µ²³/^.\\]{1,20}\s*){1,3}$"
)
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])")


def _strip_braced(text: str, command: str) -> str:
    """`\\text{cm}` -> `` (the command and its braced argument removed)."""
    return re.sub(r"\\" + command + r"\s*\{[^{}]*\}", "", text)


def _latex_to_expr(text: str) -> str:
    s = text
    for cmd in ("text", "mathrm", "textbf", "mbox", "operatorname"):
        s = _strip_braced(s, cmd)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"((\1)/(\2))", s)
    s = re.sub(r"\\sqrt\s*\[([^\]]*)\]\s*\{([^{}]*)\}", r"((\2)**(1/(\1)))", s)
    s = re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"((\1)**0.5)", s)
    s = s.replace("\\times", "*").replace("\\cdot", "*").replace("×", "*").replace("\\div", "/")
    s = s.replace("\\pi", "(pi)").replace("π", "(pi)").replace("^", "**").replace("{", "(").replace("}", ")")
    s = re.sub(r"\\%|%", "/100", s)
    for junk in ("$", "¥", "€", "£", "°C", "°F", "°", "\\circ", "\\degree"):
        s = s.replace(junk, "")
    s = re.sub(r"([\d)])\s*\(", r"\1*(", s)  # implicit products: 2(pi), 2((4)**0.5), (a)(b)
    return s.strip()


_ALLOWED_BINOPS = {ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.Mod}


def _safe_eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _safe_eval(node.body)
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return float(node.value)
    if isinstance(node, ast.Name) and node.id in ("pi", "e"):
        return math.pi if node.id == "pi" else math.e
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _safe_eval(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_BINOPS:
        left, right = _safe_eval(node.left), _safe_eval(node.right)
        if not isinstance(left, float) or not isinstance(right, float):
            raise ValueError("arithmetic on a sequence")
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("power too large")
        ops = {
            ast.Add: lambda: left + right,
            ast.Sub: lambda: left - right,
            ast.Mult: lambda: left * right,
            ast.Div: lambda: left / right,
            ast.Pow: lambda: left**right,
            ast.Mod: lambda: left % right,
        }
        result = ops[type(node.op)]()
        if isinstance(result, complex):
            raise ValueError("complex result")
        return float(result)
    if isinstance(node, (ast.Tuple, ast.List)):
        return [_safe_eval(e) for e in node.elts]
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def to_number(value: Any) -> float | list[float] | None:
    """A number (or a sequence of numbers) read from text with LaTeX, units, percentages and
    thousands separators; the part after an `=` / `≈` / `\\approx` is the answer. None if none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, Number):
        return float(value)
    if isinstance(value, (list, tuple)):
        numbers = [to_number(v) for v in value]
        return numbers if all(isinstance(n, float) for n in numbers) else None
    text = _text(value)[:1000]
    text = _LATEX_DELIMS.sub("", text)
    parts = re.split(r"=|≈|\\approx", text)
    text = parts[-1].strip().rstrip(".")
    if not text:
        return None
    text = _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), text)
    for candidate in (text, _UNIT_TAIL.sub(r"\1", text)):
        expr = _latex_to_expr(candidate)
        if len(expr) > 200:
            continue
        try:
            result = _safe_eval(ast.parse(expr, mode="eval"))
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError, RecursionError):
            continue
        if isinstance(result, list):
            if all(isinstance(v, float) for v in result):
                return result
            continue
        if math.isfinite(result):
            return result
    return None


def _within(pred: float, gt: float, rel: float = 0.01) -> bool:
    return not math.isnan(pred) and abs(pred - gt) <= abs(gt) * rel


@register_metric("general_single_numerical_match", "general_numerical_match")
def general_single_numerical_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Numbers (LaTeX, units, %, `x = 3`) equal within 1% of the reference; sequences compared
    sorted, element by element; anything not numeric falls back to `simple_str_match`."""
    pred, gt = to_number(response), to_number(reference)
    if pred is None or gt is None:
        return simple_str_match(response, reference)
    if isinstance(pred, list) or isinstance(gt, list):
        if not (isinstance(pred, list) and isinstance(gt, list)) or len(pred) != len(gt):
            return 0.0
        return float(all(_within(p, g) for p, g in zip(sorted(pred), sorted(gt))))
    return float(_within(pred, gt))


@register_metric("boxed_single_numerical_match")
def boxed_single_numerical_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """`general_single_numerical_match` on the last `\\boxed{}` of each side (or the whole text)."""
    response, reference = _text(response), _text(reference)
    pred = last_boxed(response)
    gt = last_boxed(reference)
    return general_single_numerical_match(response if pred is None else pred, reference if gt is None else gt)


@register_metric("latex_expr_equality")
def latex_expr_equality(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Mathematical equality of two LaTeX expressions (math-verify), else `simple_str_match`."""
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0
    import threading

    from math_verify import parse, verify

    # math-verify's time limits are SIGALRM timers, which only the main thread may set.
    limit = 5 if threading.current_thread() is threading.main_thread() else None

    def read(text: str):
        text = _LATEX_DELIMS.sub("", text).strip()
        return parse(f"${text}$", parsing_timeout=limit) if text else []

    gold, pred = read(reference), read(response)
    if gold and pred:
        return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0
    return simple_str_match(response, reference)


@register_metric("text_with_latex_expr_equality")
def text_with_latex_expr_equality(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Text outside `$...$` must match (`simple_str_match`, commas ignored) and the `$...$` parts,
    joined, must be equal expressions."""
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0

    def split(text: str) -> tuple[str, str]:
        parts = re.split(r"(\$[^$]*\$)", text)
        plain = "".join(
            p.strip() for p in parts if not (p.startswith("$") and p.endswith("$") and len(p) > 1)
        )
        latex = " ".join(
            p[1:-1].strip().replace(",", "")
            for p in parts
            if p.startswith("$") and p.endswith("$") and len(p) > 1
        )
        return plain.replace(",", ""), latex

    r_text, r_latex = split(response)
    g_text, g_latex = split(reference)
    return float(bool(simple_str_match(r_text, g_text)) and bool(latex_expr_equality(r_latex, g_latex)))


# --------------------------------------------------------------------------- sets and sequences


def _relevance(pred: set, gt: set, denominator: int) -> float:
    return 1.0 if denominator == 0 else len(pred & gt) / denominator


def jaccard(pred: Iterable, gt: Iterable) -> float:
    """|P ∩ G| / |P ∪ G|; 1 when both are empty."""
    p, g = set(pred), set(gt)
    return _relevance(p, g, len(p | g))


def precision(pred: Iterable, gt: Iterable) -> float:
    """|P ∩ G| / |P|; 1 when P is empty (MEGA-Bench's convention)."""
    p, g = set(pred), set(gt)
    return _relevance(p, g, len(p))


def _lower_items(items: Iterable) -> set:
    return {i.lower() if isinstance(i, str) else i for i in items}


@register_metric("set_equality")
def set_equality(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """1 if the two sets are equal (order and duplicates ignored; both empty counts as equal)."""
    return 1.0 if to_set(response) == to_set(reference) else 0.0


@register_metric("set_equality_case_insensitive")
def set_equality_case_insensitive(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    return 1.0 if _lower_items(to_set(response)) == _lower_items(to_set(reference)) else 0.0


@register_metric("str_set_equality_line_break")
def str_set_equality_line_break(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Sets of lines (a literal `\\n` counts as a line break), case-insensitive."""

    def lines(text: Any) -> set:
        return {line.lower() for line in _text(text).replace("\\n", "\n").split("\n")}

    return 1.0 if lines(response) == lines(reference) else 0.0


@register_metric("str_set_equality_comma")
def str_set_equality_comma(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Sets of comma-separated items, case-insensitive."""
    return 1.0 if _lower_items(to_set(_text(response))) == _lower_items(to_set(_text(reference))) else 0.0


@register_metric("jaccard_index")
def jaccard_index(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """|P ∩ G| / |P ∪ G| of the two sets; a missing (None) response scores 0."""
    if response is None:
        return 0.0
    return jaccard(to_set(response), to_set(reference))


@register_metric("jaccard_index_case_insensitive")
def jaccard_index_case_insensitive(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if response is None:
        return 0.0

    def norm(item: Any) -> Any:
        if isinstance(item, tuple):
            return tuple(re.sub(r"[\s\-_.]", "", str(i)).lower() for i in item)
        return str(item).lower()

    return jaccard({norm(i) for i in to_set(response)}, {norm(i) for i in to_set(reference)})


@register_metric("set_precision")
def set_precision(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """|P ∩ G| / |P|; an empty predicted set scores 1 (MEGA-Bench), a missing response 0."""
    if response is None:
        return 0.0
    return precision(to_set(response), to_set(reference))


@register_metric("chess_move_list_jaccard_index")
def chess_move_list_jaccard_index(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Jaccard index of SAN move sets, check / mate / annotation suffixes (`+ # ! ?`) ignored."""
    if response is None:
        return 0.0

    def moves(value: Any) -> set:
        return {str(m).rstrip("+#!?") for m in to_set(value)}

    return jaccard(moves(response), moves(reference))


@register_metric("sequence_equality")
def sequence_equality(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    return 1.0 if to_list(response) == to_list(reference) else 0.0


@register_metric("sequence_equality_case_insensitive")
def sequence_equality_case_insensitive(
    response: Any, reference: Any, ctx: FieldContext | None = None
) -> float:
    pred = [str(i).lower() for i in to_list(response)]
    gt = [str(i).lower() for i in to_list(reference)]
    return 1.0 if pred == gt else 0.0


@register_metric("sequence_accuracy_case_insensitive")
def sequence_accuracy_case_insensitive(
    response: Any, reference: Any, ctx: FieldContext | None = None
) -> float:
    """Fraction of positions that agree (strings case-insensitive); 0 if the lengths differ."""
    pred, gt = to_list(response), to_list(reference)
    if len(pred) != len(gt) or not gt:
        return 1.0 if not pred and not gt else 0.0
    correct = 0
    for p, g in zip(pred, gt):
        if isinstance(g, str):
            correct += isinstance(p, str) and p.lower() == g.lower()
        elif isinstance(g, Number) and isinstance(p, Number):
            correct += p == g
    return correct / len(gt)


@register_metric("longest_common_list_prefix_ratio", "longest_common_prefix_ratio")
def longest_common_list_prefix_ratio(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Length of the longest common prefix of the two lists over the reference's length."""
    pred, gt = to_list(response), to_list(reference)
    if not gt:
        return 1.0 if not pred else 0.0
    n = 0
    while n < min(len(pred), len(gt)) and pred[n] == gt[n]:
        n += 1
    return n / len(gt)


# --------------------------------------------------------------------------- boxes and points


def box_iou(a: list[float], b: list[float]) -> float:
    """IoU of two `[x1, y1, x2, y2]` boxes; 0 when the union is empty."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _is_box(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) == 4
        and all(isinstance(c, Number) and not isinstance(c, bool) for c in value)
    )


def to_boxes(value: Any) -> list[list[float]]:
    """Boxes from a list / string: one 4-number box or a list of them; malformed entries dropped."""
    if isinstance(value, str):
        value = _literal(value)
    if _is_box(value):
        return [list(map(float, value))]
    if not isinstance(value, (list, tuple)):
        return []
    return [list(map(float, b)) for b in value if _is_box(b)]


def best_match_iou(pred: list[list[float]], gt: list[list[float]]) -> float:
    """Mean over predicted boxes of each one's best IoU with any reference box; 0 if none."""
    if not pred:
        return 0.0
    return sum(max((box_iou(p, g) for g in gt), default=0.0) for p in pred) / len(pred)


@register_metric("nbbox_iou_tuple")
def nbbox_iou_tuple(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Boxes normalised to [0, 1]: each predicted box scores its best IoU with a reference box;
    the mean over predicted boxes (no prediction: 0)."""
    return best_match_iou(to_boxes(response), to_boxes(reference))


@register_metric("nbbox_iou_single")
def nbbox_iou_single(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """IoU of one predicted box with one reference box."""
    pred, gt = _literal(response), _literal(reference)
    if not _is_box(pred) or not _is_box(gt):
        return 0.0
    return box_iou(list(map(float, pred)), list(map(float, gt)))


@register_metric("nbbox_iou_sequence")
def nbbox_iou_sequence(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Mean IoU of box i with reference box i (tracking); 0 unless the counts are equal."""
    pred, gt = (
        to_boxes(_text(response) if not isinstance(response, (list, tuple)) else response),
        to_boxes(reference),
    )
    if len(pred) != len(gt) or not gt:
        return 0.0
    return sum(box_iou(p, g) for p, g in zip(pred, gt)) / len(gt)


_XML_POINT = re.compile(r"<point>(.*?)</point>")
_XML_BOX = re.compile(r"<box>(.*?)</box>")


def _xml_numbers(text: str, n: int) -> tuple[float, ...] | None:
    coords = text.split(",")
    if len(coords) != n:
        return None
    try:
        return tuple(float(c.strip()) for c in coords)
    except ValueError:
        return None


def xml_point(value: Any) -> tuple[float, float] | None:
    """`<point>x, y</point>` (exactly one) or a 2-number list; None otherwise."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or not all(isinstance(c, Number) and not isinstance(c, bool) for c in value):
            return None
        return (float(value[0]), float(value[1]))
    matches = _XML_POINT.findall(_text(value))
    if len(matches) != 1:
        return None
    return _xml_numbers(matches[0], 2)  # type: ignore[return-value]


def xml_boxes(value: Any) -> list[list[float]]:
    if isinstance(value, (list, tuple)):
        return to_boxes(value)
    out = []
    for match in _XML_BOX.findall(_text(value)):
        box = _xml_numbers(match, 4)
        if box is not None:
            out.append(list(box))
    return out


@register_metric("xml_norm_point_distance")
def xml_norm_point_distance(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """max(0, 1 - Euclidean distance) of two `<point>x, y</point>` in [0, 1]; 0 if unreadable."""
    pred, gt = xml_point(response), xml_point(reference)
    if pred is None or gt is None or not all(0 <= c <= 1 for c in (*pred, *gt)):
        return 0.0
    return max(0.0, 1.0 - math.dist(pred, gt))


@register_metric("xml_norm_point_in_bbox")
def xml_norm_point_in_bbox(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """1 if the `<point>` lies in any box of `eval_context["bounding_boxes"]` (edges included)."""
    boxes = [b for s in (ctx.eval_context if ctx else {}).get("bounding_boxes", []) for b in to_boxes(s)[:1]]
    if not boxes:
        raise ValueError("xml_norm_point_in_bbox needs eval_context['bounding_boxes']")
    point = xml_point(response)
    if point is None:
        return 0.0
    x, y = point
    return 1.0 if any(b[0] <= x <= b[2] and b[1] <= y <= b[3] for b in boxes) else 0.0


@register_metric("xml_nbbox_iou_single")
def xml_nbbox_iou_single(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """`<box>x1, y1, x2, y2</box>` boxes: mean over predicted boxes of the best IoU."""
    return best_match_iou(xml_boxes(response), xml_boxes(reference))


@register_metric("sequence_coords_similarity")
def sequence_coords_similarity(
    response: Any, reference: Any, ctx: FieldContext | None = None, k: float = 10.0
) -> float:
    """Mean over keypoints of exp(-k * d / sqrt(2)) (d: distance in [0, 1] coordinates); 0 unless
    both are equally long lists of 2D points."""

    def points(value: Any) -> list[tuple[float, float]] | None:
        items = _literal(value) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            return None
        out = []
        for p in items:
            if not (isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(c, Number) for c in p)):
                return None
            out.append((float(p[0]), float(p[1])))
        return out

    pred, gt = points(response), points(reference)
    if pred is None or gt is None or len(pred) != len(gt) or not gt:
        return 0.0
    return sum(math.exp(-k * math.dist(p, g) / math.sqrt(2)) for p, g in zip(pred, gt)) / len(gt)


# --------------------------------------------------------------------------- dicts


def _dict_agg(score: Callable[[Any, Any], float], response: Any, reference: Any) -> float:
    """Score each key of the union (a missing side is the empty list); sum over the union size."""
    pred, gt = to_dict(response), to_dict(reference)
    if pred is None or gt is None:
        return 0.0
    keys = set(pred) | set(gt)
    if not keys:
        return 1.0
    return sum(score(pred.get(k, []), gt.get(k, [])) for k in keys) / len(keys)


@register_metric("dict_equality")
def dict_equality(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    pred, gt = to_dict(response), to_dict(reference)
    return 1.0 if pred is not None and pred == gt else 0.0


@register_metric("dict_precision")
def dict_precision(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Fraction of the predicted keys whose value exactly matches the reference's; empty: 0."""
    pred, gt = to_dict(response), to_dict(reference)
    if not pred or gt is None:
        return 0.0
    return sum(1 for k, v in pred.items() if k in gt and _exact(v, gt[k])) / len(pred)


@register_metric("dict_exact_str_match_agg_recall")
def dict_exact_str_match_agg_recall(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Mean over the reference's keys of the exact match of the predicted value (missing: 0)."""
    pred, gt = to_dict(response), to_dict(reference)
    if pred is None or not gt:
        return 0.0
    return sum(_exact(pred.get(k), v) for k, v in gt.items()) / len(gt)


@register_metric("dict_set_equality_agg_jaccard")
def dict_set_equality_agg_jaccard(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Set equality per key, summed over the union of keys and divided by its size."""
    return _dict_agg(set_equality, response, reference)


@register_metric("dict_jaccard_agg_jaccard")
def dict_jaccard_agg_jaccard(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Jaccard index per key, summed over the union of keys and divided by its size."""
    return _dict_agg(jaccard_index, response, reference)


@register_metric("dict_nbbox_iou_tuple_agg_jaccard")
def dict_nbbox_iou_tuple_agg_jaccard(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """`nbbox_iou_tuple` per key, summed over the union of keys and divided by its size."""
    return _dict_agg(nbbox_iou_tuple, response, reference)


# --------------------------------------------------------------------------- text overlap


def tokenize_13a(text: str) -> list[str]:
    """A close reading of SacreBLEU's default `13a` tokeniser: punctuation split off words, and
    periods / commas split off unless between digits."""
    text = re.sub(r"([{-~\[-` -&(-+:-@/])", r" \1 ", text)
    text = re.sub(r"([^0-9])([.,])", r"\1 \2 ", text)
    text = re.sub(r"([.,])([^0-9])", r" \1 \2", text)
    text = re.sub(r"([0-9])(-)", r"\1 \2 ", text)
    return text.split()


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def sentence_bleu(hypothesis: list[str], reference: list[str], max_n: int = 4) -> float:
    """BLEU-4 of one sentence in [0, 1]: clipped n-gram precisions with SacreBLEU's `exp`
    smoothing (the k-th zero count becomes 1 / 2^k), geometric mean, brevity penalty."""
    if not hypothesis or not reference:
        return 0.0
    log_sum, smooth = 0.0, 1.0
    for n in range(1, max_n + 1):
        hyp, ref = _ngrams(hypothesis, n), _ngrams(reference, n)
        total = sum(hyp.values())
        if total == 0:
            return 0.0 if n == 1 else math.exp(log_sum / (n - 1)) * _brevity(hypothesis, reference)
        matches = sum(min(c, ref[g]) for g, c in hyp.items())
        if matches == 0:
            smooth *= 2
            p = 1.0 / (smooth * total)
        else:
            p = matches / total
        log_sum += math.log(p)
    return math.exp(log_sum / max_n) * _brevity(hypothesis, reference)


def _brevity(hypothesis: list[str], reference: list[str]) -> float:
    c, r = len(hypothesis), len(reference)
    return 1.0 if c >= r else math.exp(1 - r / c)


@register_metric("bleu")
def bleu(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """Sentence BLEU-4 of the response against the reference (13a tokens, exp smoothing)."""
    if isinstance(response, (list, tuple)) and isinstance(reference, (list, tuple)):
        response, reference = " ".join(map(str, response)), " ".join(map(str, reference))
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0
    return sentence_bleu(tokenize_13a(response), tokenize_13a(reference))


def sentence_gleu(hypothesis: list[str], reference: list[str], min_n: int = 1, max_n: int = 4) -> float:
    """GLEU (Wu et al., 2016): matching 1..4-grams over the larger of the two n-gram totals, that
    is min(precision, recall) over all orders pooled. Symmetric in its arguments."""
    matches = hyp_total = ref_total = 0
    for n in range(min_n, max_n + 1):
        hyp, ref = _ngrams(hypothesis, n), _ngrams(reference, n)
        hyp_total += sum(hyp.values())
        ref_total += sum(ref.values())
        matches += sum((hyp & ref).values())
    denominator = max(hyp_total, ref_total)
    return matches / denominator if denominator else 0.0


def _cjk_tokens(text: str) -> list[str]:
    """Each CJK character is a token; other runs split on whitespace."""
    return re.findall(r"[\u3400-\u9fff\uf900-\ufaff]|[^\s\u3400-\u9fff\uf900-\ufaff]+", text)


@register_metric("gleu")
def gleu(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0
    return sentence_gleu(tokenize_13a(response), tokenize_13a(reference))


@register_metric("gleu_cn")
def gleu_cn(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """GLEU over Chinese text, one token per character (an approximation of jieba words)."""
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0
    return sentence_gleu(_cjk_tokens(response), _cjk_tokens(reference))


# --------------------------------------------------------------------------- model as judge


def judge_reference(reference: Any, answer: dict[str, Any]) -> str:
    """The reference text shown to a judge: the field's value, or the whole answer as JSON."""
    if isinstance(reference, str):
        return reference
    if reference is answer or isinstance(reference, dict):
        return json.dumps(reference, ensure_ascii=False)
    return str(reference)


@register_metric("gpt_4o_as_judge", "ascii_art_gpt4o_judge", "model_judge", is_judge=True)
def model_judge(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    """The configured judge's score of the response, which must be a number in [0, 1]."""
    if ctx is None or ctx.judge is None:
        raise ValueError("this field is scored by a judge, and none is configured (--judge)")
    score = ctx.judge(ctx.prompt, _text(response), judge_reference(reference, ctx.answer))
    try:
        value = float(score)
    except (TypeError, ValueError):
        raise ValueError(f"the judge returned {score!r}, not a number in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"the judge returned {value}, outside [0, 1]")
    return value
