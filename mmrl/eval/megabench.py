"""MEGA-Bench's own scoring, reproduced: `--scoring megabench` (the default of `mmrl eval`).

MEGA-Bench (Chen et al., 2025; TIGER-AI-Lab/MEGA-Bench, `megabench/metrics/`) defines its
numbers by its code, quirks included. This module reproduces that code's behaviour (our own
implementation, written from reading theirs), so a Core / Open score here is comparable to a
leaderboard one. `mmrl.eval.metrics` / `mmrl.eval.parsers` hold mmrl's corrected definitions
(`--scoring corrected`). The quirks a user should know, each tested in
`tests/test_megabench_reference.py`:

- **Letters.** A one-letter reference (`B`) is compared with the first letter of any response
  that starts with a letter or `(letter`: `Because` matches `B`. `simple_str_match` normalises
  first, so a lower-case one-letter reference behaves the same.
- **`**Answer:** X`** parses to an empty string (the bold pattern closes on the `**` right after
  the colon); only lower-case `answer:` is recognised besides `Answer:` (`ANSWER:` is not).
- **JSON** is read from the first line that starts with `Answer:` (that line only), the last
  balanced `{...}` / `[...]` span that loads (JSON, single-quoted JSON, or a Python literal);
  a string value that is itself JSON is inlined; keys keep their types (`{1: "a"}` has the
  integer key 1, which no field name matches).
- **Lists and sets** from text: a Python literal when it reads (a dict gives its *keys*, a
  quoted string its *characters*, `None` the empty string, a number a one-item list, nested
  lists nothing), else comma-separated items; a dict value gives its *items*.
- **`None`** responses are scored as the text `"None"` by the string metrics.
- **Exceptions score 0**: every metric call is wrapped, so a zero target in
  `number_rel_diff_ratio`, empty reference lists, empty dicts or a non-string where a string
  is needed all give 0 (mmrl's corrected mode gives 1 to the empty/empty cases).
- **Numbers** (`general_single_numerical_match`): `\\pi` becomes 3.14, `%` is `/100`, the text
  after the first `=` / `≈` is the answer, LaTeX is read with SymPy's `parse_latex`, the result
  is evaluated as a Python expression (booleans are numbers; tuples never match; a zero target
  needs an exact 0); the tolerance is 1 % of the target. `boxed_single_numerical_match` reads
  the *first* `\\boxed{}` with at most one level of nested braces.
- **BLEU** is SacreBLEU's corpus BLEU with the arguments swapped (the reference is scored as
  the hypothesis), lists zipped sentence by sentence.
- **Aggregation**: the weighted mean over fields scoring >= 0 needs a weight for every such
  field and a non-zero total (MEGA-Bench raises otherwise: here a clear error before the run,
  see `check_task`).

Deliberate differences, where MEGA-Bench's code is unsafe rather than a definition:

- MEGA-Bench `eval`s response text as Python (numbers) and `exec`s it (programs) in the
  evaluator's own process. Here expressions go through a small arithmetic evaluator with the
  same results on arithmetic (and None where `eval` would run anything else), and programs run
  in `mmrl.eval.sandbox`.
- A JSON span that MEGA-Bench's reader fails on with an error it does not catch (`{[1, 2]}`:
  a set of a list, `TypeError`) scores the metric 0 in both, but in a response parser it
  crashes MEGA-Bench's evaluator; here the parser skips that span.
- A complex number (`1j` against `0` in `normalized_rmse`, `[1j, 2]` in
  `angle_seq_float_rmse`): MEGA-Bench computes a complex score and its aggregation then raises
  (`s >= 0`), so it has no number to match; here it scores 0, never its real part (which would
  give an imaginary answer full credit).
- Per-metric SIGALRM time limits (10-15 s) are not set: each sandboxed program has its own
  limits, the rest is bounded by input size.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from numbers import Number
from typing import Any

from mmrl.eval.metrics import FieldContext, model_judge

Reference = Callable[[Any, Any, FieldContext], float]
REFERENCE_METRICS: dict[str, Reference] = {}
"""MEGA-Bench metric name -> its reproduction `fn(response, reference, ctx)`."""

JSON_TIMEOUT_S = 0.1
"""MEGA-Bench's time limit on its recursive JSON-span regex (then the parse is empty)."""


class MetricUnavailable(Exception):
    """A metric needs something this installation lacks (a package or data): its queries are
    skipped with the message as the reason, never scored 0."""


def _reference(*names: str) -> Callable[[Reference], Reference]:
    def wrap(fn: Reference) -> Reference:
        for name in names:
            REFERENCE_METRICS[name] = fn
        return fn

    return wrap


def score_reference(name: str, response: Any, reference: Any, ctx: FieldContext) -> tuple[float, str | None]:
    """One field as MEGA-Bench scores it, and the error behind a 0 if one was raised: any
    exception (other than a missing dependency) scores 0, as its `MetricType.match` does. NaN
    (an empty `nbbox_iou_sequence`) becomes -1, which aggregation leaves out as it leaves out
    NaN."""
    try:
        score = float(REFERENCE_METRICS[name](response, reference, ctx))
    except MetricUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - MEGA-Bench assigns 0 to any metric error
        return 0.0, f"{type(exc).__name__}: {exc}"
    return (-1.0 if math.isnan(score) else score), None


# --------------------------------------------------------------------------- parsing


def evaluate_as_string(value: Any) -> Any:
    """A quoted Python string literal becomes its content; anything else is returned as is."""
    try:
        evaluated = ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, RecursionError):
        return value
    except MemoryError:
        return ""
    return evaluated if isinstance(evaluated, str) else value


def _keep_last_answer(text: str) -> str:
    text = text.replace("answer:", "Answer:")
    last = text.rfind("Answer:")
    if last == -1:
        return text
    return text[:last].replace("Answer:", "") + text[last:]


def extract_answer_content(response: str, ascii_art: bool = False, strip_surrounding: bool = True) -> str:
    """The text after the last `Answer:` as MEGA-Bench's parser finds it (see the module notes)."""
    response = _keep_last_answer(response)
    if ascii_art:
        pattern = r"\*\*?Answer:(.*?)\*\*?|\bAnswer:(.*)"
    else:
        pattern = r"\*\*?Answer:\s*(.*?)\*\*?|\bAnswer:\s*(.*)"
    match = re.search(pattern, response, re.DOTALL)
    if match:
        response = match.group(1) or match.group(2) or ""
    if ascii_art:
        response = re.sub(r"^\s*$(\n^\s*$)+", "", response, flags=re.MULTILINE)
        response = response.rstrip() if strip_surrounding else re.sub(r"(\n\s*)+$", "", response)
        return re.sub(r"^(\s*\n)+", "", response)
    return response.strip()


def extract_code_block(
    text: str, code_type: str | None = None, ascii_art: bool = False, strip_surrounding: bool = True
) -> tuple[str, bool]:
    """The inside of the first ``` block (stripped unless ASCII art) and True, or (text, False)."""
    if code_type:
        pattern = rf"```{code_type}\s*\n*(.*?)\s*```"
    elif ascii_art:
        if not text.strip() or len(text) > 10000:
            text = text.rstrip()
        pattern = (
            r"```\w*(?:\s*\n+)?(.*?)\s*```" if strip_surrounding else r"```\w*(?:\s*\n+)?(.*?)(?:\n+\s*)?```"
        )
    else:
        pattern = r"```\w*\s*\n*(.*?)\s*```"
    match = re.search(pattern, text, flags=re.DOTALL)
    if not match:
        return text, False
    return (match.group(1), True) if ascii_art else (match.group(1).strip(), True)


def _multiline_answer(text: str) -> bool:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip():
            return not (i + 1 < len(lines) and lines[i + 1].strip() == "")
    return False


_SHORT = re.compile(
    r"^(?:(?:[a-zA-Z0-9_-]+)(?:,\s*[a-zA-Z0-9_-]+)*|(?:[a-zA-Z0-9_-]+)\.|\((?:[a-zA-Z0-9_-]+)\)$)"
)


def drop_additional_text(text: str) -> str:
    """The first paragraph when it looks like a short answer on a line of its own."""
    first = text.split("\n\n")[0].strip()
    if _SHORT.search(first) and first != "" and not _multiline_answer(text):
        return first
    return text


_JSON_SPAN = r"(\{(?:[^{}]|(?R))*\}|\[(?:[^{}]|(?R))*\])"
_STRING_LITERAL = r'"(?:\\.|[^"\\])*"'


def _answer_line(response: str) -> str:
    match = re.search(r"^(?:\*\*Answer:|Answer:)\s*(.+)", response, re.MULTILINE)
    return match.group(1).strip() if match else response.strip()


def _span_values(span: str, strict: bool = False) -> list[Any]:
    """What MEGA-Bench's JSON reader collects from one balanced span (0, 1 or 2 values).

    MEGA-Bench catches only `SyntaxError` / `ValueError` around `ast.literal_eval`, so a span
    such as `{[1, 2]}` (a set of a list: `TypeError`, unhashable) raises out of its `parse_json`.
    Inside a metric (`strict`: `cast_to_dict`) that error scores the field 0, as there; in the
    response parsers MEGA-Bench's evaluator would crash, so there the span is skipped instead."""
    import regex

    errors: tuple[type[BaseException], ...] = (SyntaxError, ValueError)
    json_errors: tuple[type[BaseException], ...] = (json.JSONDecodeError,)
    if not strict:
        errors += (TypeError, MemoryError, RecursionError)
        json_errors += (RecursionError,)

    found: list[Any] = []
    span = span.replace('\\"', "__DOUBLE_QUOTE__").replace("\\'", "__SINGLE_QUOTE__")
    for literal in regex.findall(_STRING_LITERAL, span):
        inner = literal[1:-1].replace("__DOUBLE_QUOTE__", '"').replace("__SINGLE_QUOTE__", "'")
        try:
            nested = json.loads(inner)
        except json_errors:
            continue
        if isinstance(nested, (dict, list)):
            span = span.replace(literal, json.dumps(nested))
    span = span.replace("__DOUBLE_QUOTE__", '\\"').replace("__SINGLE_QUOTE__", "\\'")
    try:
        found.append(json.loads(span))
    except json_errors:
        try:
            found.append(json.loads(re.sub(r"(?<!\w)\'|\'(?!\w)", '"', span)))
        except json_errors:
            pass
    for candidate in (span, span.replace('\\"', '\\\\"').replace("\\'", "\\\\'")):
        try:
            found.append(ast.literal_eval(candidate))
            break
        except errors:
            continue
    return found


def parse_json(response: str, strict: bool = False) -> Any:
    """MEGA-Bench's `parse_json`: the last value read from a balanced span of the `Answer:` line
    (or the whole response), else `[]` if that text starts with `[`, else `{}`. `strict`: let
    the errors MEGA-Bench does not catch through (see `_span_values`)."""
    import regex

    text = _answer_line(response)
    text, _ = extract_code_block(text, "json")
    try:
        spans = regex.findall(_JSON_SPAN, text, timeout=JSON_TIMEOUT_S)
    except TimeoutError:
        spans = []
    values: list[Any] = []
    for span in spans:
        values.extend(_span_values(span, strict))
    if values:
        return values[-1]
    return [] if text.startswith("[") else {}


def parse_answer_string(
    response: str | None, ascii_art: bool = False, strip_surrounding: bool = True, single_line: bool = True
) -> str:
    """MEGA-Bench's `answer_string` (and ASCII / verbatim) parser: always a string."""
    content = extract_answer_content(response or "", ascii_art, strip_surrounding)
    content, is_code = extract_code_block(content, ascii_art=ascii_art, strip_surrounding=strip_surrounding)
    if not is_code and single_line and not ascii_art:
        content = drop_additional_text(content)
    if content.startswith(("{", "[")):
        value = parse_json(content)
        if value == {} and "{}" not in content:
            return content
        if value == [] and "[]" not in content:
            return content
        return str(value)
    return evaluate_as_string(content)


def parse_fields(
    response: str | None, parser: str, answer: dict[str, Any], fields: list[str]
) -> tuple[dict, bool, Any]:
    """(per-field answers, parse_ok, the whole parsed object) as MEGA-Bench's evaluator builds them.

    `fields` are the answer fields (their names in `answer`). With the `json` parser a response
    without a non-empty dict stands for every field of `answer` (parse failure)."""
    from mmrl.eval.parsers import SINGLE_FIELD_PARSERS

    if parser in SINGLE_FIELD_PARSERS:
        key = fields[0]
        single_line = "\n" not in str(answer.get(key, ""))
        ascii_art = parser != "answer_string"
        text = parse_answer_string(
            response, ascii_art, strip_surrounding=parser != "verbatim_answer_string", single_line=single_line
        )
        return {key: text}, True, {key: text}
    if parser == "json":
        value = parse_json(response or "")
        if isinstance(value, dict) and value:
            value = {k: evaluate_as_string(v) for k, v in value.items()}
            return value, True, value
        return {f: response for f in answer}, False, {f: response for f in answer}
    text = (response or "").strip()  # dummy / raw: the stripped response
    return {f: text for f in fields}, True, text


# --------------------------------------------------------------------------- conversions


def str_to_iterable(kind: type, value: Any) -> Any:
    """MEGA-Bench's list / set reading of a string (see the module notes)."""
    if not isinstance(value, str):
        return kind()
    text = value.strip(" ")
    if not text:
        return kind()
    closers = {"(": ")", "{": "}", "[": "]"}
    bracketed = text[0] in closers
    if bracketed and not text.endswith(closers[text[0]]):
        return kind()
    try:
        evaluated = ast.literal_eval(text)
        if evaluated is None:
            return ""
        if isinstance(evaluated, (int, float)):
            evaluated = [evaluated]
        return kind(evaluated)
    except (SyntaxError, ValueError):
        inner = text[1:-1] if bracketed else text
        return kind(item.strip() for item in inner.split(","))
    except TypeError:
        return kind()


def freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return frozenset((k, freeze(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, set):
        return frozenset(value)
    return value


def cast_to_set(value: Any) -> Any:
    frozen = freeze(value)
    if isinstance(frozen, (frozenset, set, tuple)):
        return set(frozen)
    return str_to_iterable(set, frozen)


def cast_to_dict(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: cast_to_dict(v) for k, v in value.items()}
    if isinstance(value, str):
        parsed = parse_json(value, strict=True)  # an error here scores the metric 0, as in MEGA-Bench
        return parsed if parsed else value
    return value


def _relevance(pred: Any, gt: Any, denominator: Callable[[set, set], int]) -> float:
    p, g = set(pred), set(gt)
    d = denominator(p, g)
    return 1.0 if not d else len(p & g) / d


def _jaccard(pred: Any, gt: Any) -> float:
    return _relevance(pred, gt, lambda p, g: len(p | g))


# --------------------------------------------------------------------------- strings


def _first_letter(text: str) -> str:
    match = re.match(r"^\(?([A-Za-z])\)?(?:\s*\.\s*|\.)?(.*)", text)
    return match.group(1) if match else text


@_reference("exact_str_match")
def exact_str_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    response = response if isinstance(response, str) else str(response)
    reference = reference if isinstance(reference, str) else str(reference)
    if len(reference) == 1 and reference.isalpha() and len(response) > 1:
        response = _first_letter(response)
    return 1.0 if response == reference else 0.0


@_reference("code_result_exact_str_match")
def code_result_exact_str_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    inner, _ = extract_code_block(reference, ascii_art=True, strip_surrounding=False)
    return exact_str_match(response, inner)


@_reference("exact_str_match_case_insensitive")
def exact_str_match_case_insensitive(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if not isinstance(response, str) and isinstance(reference, str):
        return 0.0
    return exact_str_match(response.lower(), reference.lower())


def _simple(text: str) -> str:
    for ch in (" ", "-", "\n", "\t", "."):
        text = text.replace(ch, "")
    return text.lower()


@_reference("simple_str_match")
def simple_str_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    response = response if isinstance(response, str) else str(response)
    return exact_str_match(_simple(response), _simple(reference))


def _dl_similarity(a: str, b: str, cutoff: float | None = None) -> float:
    try:
        from rapidfuzz.distance import DamerauLevenshtein
    except ImportError:
        raise MetricUnavailable("needs the rapidfuzz package (pip install 'mmrl[megabench]')") from None
    return DamerauLevenshtein.normalized_similarity(a, b, score_cutoff=cutoff)


@_reference("normalized_similarity_damerau_levenshtein", "normalized_similarity_demarau_levenshtein")
def normalized_similarity_damerau_levenshtein(
    response: Any, reference: Any, ctx: FieldContext | None = None
) -> float:
    if not isinstance(response, str) and isinstance(reference, str):
        return 0.0
    return _dl_similarity(response, reference)


@_reference("near_str_match")
def near_str_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0
    try:
        from unidecode import unidecode
    except ImportError:
        raise MetricUnavailable("needs the unidecode package (pip install 'mmrl[megabench]')") from None

    def approximate(text: str) -> str:
        kept = [w for w in text.split(" ") if w.lower() not in {"the", "a"}]
        return unidecode(" ".join(kept)).lower()

    return _dl_similarity(approximate(response), approximate(reference), cutoff=0.9)


@_reference("multi_ref_phrase")
def multi_ref_phrase(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    for ref in str_to_iterable(list, reference.replace("，", ",")):
        if simple_str_match(response, ref if isinstance(ref, str) else str(ref)):
            return 1.0
    return 0.0


# --------------------------------------------------------------------------- numbers


@_reference("number_rel_diff_ratio")
def number_rel_diff_ratio(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    try:
        pred = response if isinstance(response, Number) else ast.literal_eval(response)
        if not isinstance(pred, Number):
            return 0.0
        gt = ast.literal_eval(reference)
        return max(0.0, 1 - math.fabs((pred - gt) / gt))  # a zero target raises: 0
    except (SyntaxError, ValueError):
        return 0.0


@_reference("positive_int_match")
def positive_int_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    try:
        pred = ast.literal_eval(response)  # an int (not a string) is not a literal to read: 0
    except (SyntaxError, ValueError):
        return 0.0
    if not reference:
        return 0.0
    gt = ast.literal_eval(reference)
    if not isinstance(gt, int):
        raise ValueError("the reference is not an integer")
    if not isinstance(pred, int):
        return 0.0
    if gt <= 0 and pred <= 0:
        return -1.0
    return 1.0 if pred == gt else 0.0


def _clip_score(error: float, high: float) -> float:
    import numpy as np

    error = float(np.clip(error, 0.0, high))
    return 1.0 - error / high


@_reference("normalized_rmse")
def normalized_rmse(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    import numpy as np

    try:
        squared = (ast.literal_eval(response) - ast.literal_eval(reference)) ** 2
        if np.iscomplexobj(squared):  # `1j`: MEGA-Bench's aggregation raises on it; no credit
            return 0.0
        return _clip_score(float(np.sqrt(squared)), 0.1)
    except Exception:  # noqa: BLE001 - the reference returns 0 for any error here
        return 0.0


@_reference("angle_seq_float_rmse")
def angle_seq_float_rmse(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    import numpy as np

    pred, gt = str_to_iterable(list, response), str_to_iterable(list, reference)
    if len(pred) != len(gt):
        return 0.0
    try:
        with np.errstate(all="ignore"):
            diff = np.array(pred) - np.array(gt)
            if np.iscomplexobj(diff):  # as in normalized_rmse: an imaginary answer gets nothing
                return 0.0
            error = float(np.sqrt(diff**2).sum() / len(gt))
    except Exception:  # noqa: BLE001
        return 0.0
    score = _clip_score(error, 10.0) if not math.isnan(error) else math.nan
    return 0.0 if math.isnan(score) else score


def _clean_units(text: str) -> str:
    text = text.replace("\\pi", "π")
    text = re.sub(r"(?<![\d}])\\?π", "3.14", text)
    text = re.sub(r"(\d)(\\?π)", r"\1*3.14", text)
    text = re.sub(r"\{(\\?π)\}", "3.14", text)
    text = re.sub(r"\*(\\?π)", "*3.14", text)
    text = text.replace("%", "/100").replace("$", "").replace("¥", "")
    return text.replace("°C", "").replace(" C", "").replace("°", "")


def _floatify(value: Any) -> int | float | None:
    try:
        number = float(value)
    except Exception:  # noqa: BLE001
        return None
    return round(number) if number.is_integer() else number


def _parse_latex(text: str) -> Any:
    """SymPy's ANTLR LaTeX parser (MEGA-Bench's `parse_latex`), run through its own pieces.

    SymPy's grammar was generated with ANTLR 4.11 and its `parse_latex` refuses any other
    runtime; math-verify needs the 4.13 runtime (its 4.11 parser is stale), and the 4.13 runtime
    reads 4.11's serialised grammar. So the lexer/parser/converter are driven directly (checked
    against MEGA-Bench under ANTLR 4.11 on the same inputs)."""
    import contextlib
    import io

    import antlr4
    from sympy.parsing.latex import _parse_latex_antlr as backend

    if backend.LaTeXParser is None or backend.MathErrorListener is None:
        raise ImportError("SymPy's LaTeX parser is not available")
    text = text.strip()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        listener = backend.MathErrorListener(text)
        lexer = backend.LaTeXLexer(antlr4.InputStream(text))
        lexer.removeErrorListeners()
        lexer.addErrorListener(listener)
        parser = backend.LaTeXParser(antlr4.CommonTokenStream(lexer))
        parser.removeErrorListeners()
        parser.addErrorListener(listener)
        return backend.convert_relation(parser.math().relation())


_EVAL_NAMES: dict[str, Any] = {"E": 2.718, "True": True, "False": False, "None": None}
_MATH_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf, "nan": math.nan}


class _NotArithmetic(Exception):
    pass


def python_value(text: str) -> Any:
    """What MEGA-Bench's `eval(text)` would give for numbers, tuples and lists (its module
    defines `E = 2.718` and imports `math`), without running anything: any other expression
    raises `_NotArithmetic` (there: an error or a time-out, both read as "not a number")."""
    import operator

    binary = {
        ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.BitXor: operator.xor, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
        ast.LShift: operator.lshift, ast.RShift: operator.rshift,
    }  # fmt: skip

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, complex, bool, type(None))):
            return node.value
        if isinstance(node, ast.Name) and node.id in _EVAL_NAMES:
            return _EVAL_NAMES[node.id]
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "math"
            and node.attr in _MATH_CONSTANTS
        ):
            return _MATH_CONSTANTS[node.attr]
        if isinstance(node, (ast.Tuple, ast.List)):
            items = [value(e) for e in node.elts]
            return tuple(items) if isinstance(node, ast.Tuple) else items
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub, ast.Invert)):
            operand = value(node.operand)
            op = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert}
            return op[type(node.op)](operand)
        if isinstance(node, ast.BinOp) and type(node.op) in binary:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, (ast.Pow, ast.LShift)) and (
                isinstance(right, Number)
                and abs(right) > 4096
                or isinstance(left, Number)
                and abs(left) > 1e300
            ):
                raise _NotArithmetic("too large (MEGA-Bench's eval would time out)")
            if isinstance(left, (list, tuple)) or isinstance(right, (list, tuple)):
                if isinstance(node.op, ast.Mult) and any(
                    isinstance(x, int) and abs(x) > 10_000 for x in (left, right)
                ):
                    raise _NotArithmetic("too large")
            return binary[type(node.op)](left, right)
        raise _NotArithmetic(type(node).__name__)

    if len(text) > 10_000:
        raise _NotArithmetic("too long")
    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except _NotArithmetic:
        raise
    except Exception as exc:  # noqa: BLE001 - any error of the expression itself
        raise _NotArithmetic(str(exc)) from None


def number_it(value: Any) -> Any:
    """MEGA-Bench's `number_it`: a number, a list/tuple, or None."""
    if isinstance(value, (int, float)):
        return value
    value = _clean_units(value)
    try:
        value = str(_parse_latex(value))
    except Exception:  # noqa: BLE001
        pass
    number = _floatify(value)
    if number is not None:
        return number
    try:
        evaluated = python_value(value)
    except _NotArithmetic:
        return None
    if isinstance(evaluated, (list, tuple)):
        return evaluated
    return _floatify(evaluated)


def _within(pred: Any, gt: Any) -> bool:
    try:
        if math.isnan(pred):
            return False
        eps = abs(gt) * 0.01
        return gt - eps <= pred <= gt + eps
    except Exception:  # noqa: BLE001
        return False


def _same_numbers(pred: Any, gt: Any) -> bool:
    if not isinstance(pred, list) or len(pred) != len(gt):
        return False
    if any(not isinstance(x, (int, float)) for x in pred):
        return False
    return all(_within(p, g) for p, g in zip(sorted(pred), sorted(gt)))


def _strip_math_brackets(text: str) -> str:
    # The reference's `$(.*?)$` pattern matches at the end of any string, so the \( \) and
    # \[ \] delimiters are always removed; `$` signs stay (clean-up drops them later).
    text = re.sub(r"\\\((.*?)\\\)", r"\1", text)
    return re.sub(r"\\\[(.*?)\\\]", r"\1", text)


def _after_assignment(text: str) -> str:
    match = re.search(r"(?:=|≈|\\approx)\s*(.+)", text)
    return match.group(1).strip() if match else text


@_reference("general_single_numerical_match", "general_numerical_match")
def general_single_numerical_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    response = response if isinstance(response, str) else str(response)
    response = _after_assignment(_strip_math_brackets(response))
    reference = _after_assignment(_strip_math_brackets(reference))
    pred, gt = number_it(response), number_it(reference)
    if pred is None or gt is None:
        return simple_str_match(response, reference)
    if isinstance(pred, list) and isinstance(gt, list) or isinstance(pred, tuple) and isinstance(gt, tuple):
        return float(_same_numbers(pred, gt))
    return float(_within(pred, gt))


def first_boxed(text: str) -> str:
    """The first `\\boxed{...}` with at most one level of nested braces, else the text."""
    match = re.search(r"\\boxed\{((?:[^\{\}]+|\{[^\{\}]*\})*)\}", text)
    return match.group(1) if match else text


@_reference("boxed_single_numerical_match")
def boxed_single_numerical_match(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    response = response if isinstance(response, str) else str(response)
    return general_single_numerical_match(first_boxed(response), first_boxed(reference))


_GREEK = dict(
    zip(
        "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩ",
        [
            "alpha",
            "beta",
            "gamma",
            "delta",
            "epsilon",
            "zeta",
            "eta",
            "theta",
            "iota",
            "kappa",
            "lambda",
            "mu",
            "nu",
            "xi",
            "omicron",
            "pi",
            "rho",
            "sigma",
            "tau",
            "upsilon",
            "phi",
            "chi",
            "psi",
            "omega",
            "Alpha",
            "Beta",
            "Gamma",
            "Delta",
            "Epsilon",
            "Zeta",
            "Eta",
            "Theta",
            "Iota",
            "Kappa",
            "Lambda",
            "Mu",
            "Nu",
            "Xi",
            "Omicron",
            "Pi",
            "Rho",
            "Sigma",
            "Tau",
            "Upsilon",
            "Phi",
            "Chi",
            "Psi",
            "Omega",
        ],  # fmt: skip
    )
)


def normalize_latex(text: str) -> str:
    """MEGA-Bench's LaTeX clean-up before SymPy: bars, macrons, Greek letters, delimiters."""
    import unicodedata

    text = text.replace("\\bar", "\\overline")
    out: list[str] = []
    for ch in text:
        if ch.isalpha():
            parts = unicodedata.normalize("NFD", ch)
            out.append(f"\\overline{{{parts[0]}}}" if len(parts) > 1 and parts[1] == "\u0304" else ch)
        elif ch != "\u0304":
            out.append(ch)
        else:
            out[-1] = f"\\overline{{{out[-1]}}}"
    text = "".join(out)
    text = re.sub(r"\\overline\{([^}]*)\}_([^{}\\ ]*)", r"\\overline{\1_\2}", text)
    # The reference's character class [α-ωΑ-Ω] also spans ς and the gap after Ρ; those map to
    # nothing in its table and raise, which scores the field 0, as here.
    text = re.sub(r"[α-ωΑ-Ω]", lambda m: "\\" + _GREEK[m.group()] + " ", text)
    text = re.sub(r"\\(begin|end)\{.*?\}(?:\[[^\[\]]*\])?", "", text)
    text = re.sub(r"\\\(|\\\)", "", text)
    return re.sub(r"\\\[|\\\]", "", text)


@_reference("latex_expr_equality")
def latex_expr_equality(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0
    from sympy.core.sympify import SympifyError
    from sympy.parsing.latex.errors import LaTeXParsingError

    try:
        response, reference = normalize_latex(response), normalize_latex(reference)
        return 1.0 if _parse_latex(response).equals(_parse_latex(reference)) else 0.0
    except (LaTeXParsingError, SympifyError, TypeError, NotImplementedError):
        return simple_str_match(response, reference)


@_reference("text_with_latex_expr_equality")
def text_with_latex_expr_equality(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0

    def split(text: str) -> tuple[str, str]:
        parts = re.split(r"(\$[^$]*\$)", text)
        latex = [p for p in parts if p.startswith("$") and p.endswith("$")]
        plain = [p.strip() for p in parts if not (p.startswith("$") and p.endswith("$"))]
        return "".join(plain).replace(",", ""), " ".join(p[1:-1].strip().replace(",", "") for p in latex)

    r_text, r_latex = split(response)
    g_text, g_latex = split(reference)
    return float(bool(simple_str_match(r_text, g_text)) and bool(latex_expr_equality(r_latex, g_latex)))


# --------------------------------------------------------------------------- sets and sequences


@_reference("set_equality")
def set_equality(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    return 1.0 if cast_to_set(response) == cast_to_set(reference) else 0.0


@_reference("set_equality_case_insensitive")
def set_equality_case_insensitive(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    try:
        pred = {t.upper() for t in cast_to_set(response)}
        gt = {t.upper() for t in cast_to_set(reference)}
    except AttributeError:
        return 0.0
    return 1.0 if pred == gt else 0.0


def _lower_set(items: Any) -> set:
    return {i.lower() if isinstance(i, str) else i for i in items}


@_reference("str_set_equality_line_break")
def str_set_equality_line_break(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    pred = _lower_set(response.replace("\\n", "\n").split("\n"))
    gt = _lower_set(reference.replace("\\n", "\n").split("\n"))
    return 1.0 if pred == gt else 0.0


@_reference("str_set_equality_comma")
def str_set_equality_comma(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    pred = _lower_set(str_to_iterable(set, response))
    gt = _lower_set(str_to_iterable(set, reference))
    return 1.0 if pred == gt else 0.0


@_reference("jaccard_index")
def jaccard_index(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if response is None:
        return 0.0
    return _jaccard(cast_to_set(response), cast_to_set(reference))


def _squash(text: str) -> str:
    for ch in (" ", "-", "\n", "\t", "_", "."):
        text = text.replace(ch, "")
    return text


@_reference("jaccard_index_case_insensitive")
def jaccard_index_case_insensitive(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if response is None:
        return 0.0
    pred, gt = cast_to_set(response), cast_to_set(reference)
    first = list(gt)[0]
    if isinstance(first, str):
        return _jaccard(
            {i.lower() if isinstance(i, str) else str(i).lower() for i in pred}, {i.lower() for i in gt}
        )
    if isinstance(first, tuple):
        try:
            p = {tuple(_squash(item.lower()) for item in res) for res in pred}
        except Exception:  # noqa: BLE001
            return 0.0
        return _jaccard(p, {tuple(_squash(item.lower()) for item in t) for t in gt})
    return 0.0


@_reference("set_precision")
def set_precision(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if response is None:
        return 0.0
    return _relevance(cast_to_set(response), cast_to_set(reference), lambda p, g: len(p))


@_reference("chess_move_list_jaccard_index")
def chess_move_list_jaccard_index(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if response is None:
        return 0.0

    def moves(value: Any) -> set:
        return {m.removesuffix("!").removesuffix("#") for m in str_to_iterable(set, value)}

    return _jaccard(moves(response), moves(reference))


@_reference("sequence_equality")
def sequence_equality(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    response = response if isinstance(response, str) else str(response)
    return 1.0 if str_to_iterable(list, response) == str_to_iterable(list, reference) else 0.0


@_reference("sequence_equality_case_insensitive")
def sequence_equality_case_insensitive(
    response: Any, reference: Any, ctx: FieldContext | None = None
) -> float:
    response = response if isinstance(response, str) else str(response)
    pred = [i.lower() if isinstance(i, str) else str(i) for i in str_to_iterable(list, response)]
    gt = [i.lower() for i in str_to_iterable(list, reference)]
    return 1.0 if pred == gt else 0.0


@_reference("sequence_accuracy_case_insensitive")
def sequence_accuracy_case_insensitive(
    response: Any, reference: Any, ctx: FieldContext | None = None
) -> float:
    pred, gt = str_to_iterable(list, response), str_to_iterable(list, reference)
    if len(pred) != len(gt):
        return 0.0
    correct = 0
    for p, g in zip(pred, gt):
        if isinstance(g, str):
            correct += p.lower() == g.lower()
        elif isinstance(g, Number) and isinstance(p, Number):
            correct += p == g
    return correct / len(gt)


@_reference("longest_common_list_prefix_ratio", "longest_common_prefix_ratio")
def longest_common_list_prefix_ratio(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    pred, gt = str_to_iterable(list, response), str_to_iterable(list, reference)
    n = 0
    while n < min(len(pred), len(gt)) and pred[n] == gt[n]:
        n += 1
    return n / len(gt)


# --------------------------------------------------------------------------- dicts


@_reference("dict_equality")
def dict_equality(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    pred, gt = cast_to_dict(response), cast_to_dict(reference)
    if not isinstance(pred, dict):
        return 0.0
    return 1.0 if pred == gt else 0.0


@_reference("dict_precision")
def dict_precision(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    pred, gt = cast_to_dict(response), cast_to_dict(reference)
    if not isinstance(pred, dict) or not pred:
        return 0.0
    matched = sum(1 for k, v in pred.items() if k in gt and exact_str_match(v, gt[k]))
    return matched / len(pred)


@_reference("dict_exact_str_match_agg_recall")
def dict_exact_str_match_agg_recall(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    pred, gt = cast_to_dict(response), cast_to_dict(reference)
    if not isinstance(pred, dict):
        return 0.0
    items = list(gt.items())
    return sum(exact_str_match(pred.get(k), v) for k, v in items) / len(items)


def _dict_union(score: Callable[[Any, Any], float], response: Any, reference: Any) -> float:
    pred, gt = cast_to_dict(response), cast_to_dict(reference)
    if not isinstance(pred, dict):
        return 0.0
    keys = set(pred) | set(gt)
    total = sum(score(pred.get(k, []), gt.get(k, [])) for k in keys)
    return total / len(keys)


@_reference("dict_set_equality_agg_jaccard")
def dict_set_equality_agg_jaccard(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    return _dict_union(set_equality, response, reference)


@_reference("dict_jaccard_agg_jaccard")
def dict_jaccard_agg_jaccard(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    return _dict_union(jaccard_index, response, reference)


@_reference("dict_nbbox_iou_tuple_agg_jaccard")
def dict_nbbox_iou_tuple_agg_jaccard(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    return _dict_union(nbbox_iou_tuple, response, reference)


# --------------------------------------------------------------------------- boxes and points


def _iou(a: Any, b: Any) -> float:
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0


def best_ious(pred: Any, gt: Any) -> list[float]:
    """For each predicted box, its best IoU with any reference box (0 when none)."""
    out = []
    for p in pred:
        best = 0
        for g in gt:
            best = max(best, _iou(p, g))
        out.append(best)
    return out


def str_to_bboxes(value: Any) -> list:
    if not isinstance(value, str):
        return []
    try:
        boxes = ast.literal_eval(value)
    except (SyntaxError, ValueError):
        try:
            boxes = json.loads(value)
        except json.JSONDecodeError:
            return []
    if len(boxes) == 4 and isinstance(boxes[0], Number):
        boxes = [boxes]
    if not isinstance(boxes, (tuple, list)):
        return []
    return [
        b
        for b in boxes
        if isinstance(b, (tuple, list)) and len(b) == 4 and all(isinstance(c, (float, int)) for c in b)
    ]


@_reference("nbbox_iou_tuple")
def nbbox_iou_tuple(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    pred = response if isinstance(response, (tuple, list)) else str_to_bboxes(response)
    gt = reference if isinstance(reference, (tuple, list)) else str_to_bboxes(reference)
    try:
        scores = best_ious(pred, gt)
    except Exception:  # noqa: BLE001
        return 0.0
    return sum(scores) / len(scores) if scores else 0.0


@_reference("nbbox_iou_single")
def nbbox_iou_single(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    gt = ast.literal_eval(reference)
    try:
        pred = ast.literal_eval(response)
    except SyntaxError:
        return 0.0
    try:
        scores = best_ious([pred], [gt])
    except Exception:  # noqa: BLE001
        return 0.0
    return sum(scores) / len(scores)


@_reference("nbbox_iou_sequence")
def nbbox_iou_sequence(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    import numpy as np

    if not isinstance(response, (tuple, list)):
        response = str_to_bboxes(response if isinstance(response, str) else str(response))
    gt = reference if isinstance(reference, (tuple, list)) else str_to_bboxes(reference)
    if len(gt) != len(response):
        return 0.0
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(np.mean([best_ious([r], [g]) for r, g in zip(response, gt)]))


def xml_point(value: Any) -> tuple[float, ...] | None:
    if not isinstance(value, str):
        return None
    matches = re.findall(r"<point>(.*?)<\/point>", value)
    if len(matches) != 1:
        return None
    coords = matches[0].split(",")
    if len(coords) != 2:
        return None
    try:
        return tuple(float(c.strip()) for c in coords)
    except ValueError:
        return None


def xml_boxes(value: Any) -> list:
    if not isinstance(value, str):
        return []
    out = []
    for match in re.findall(r"<box>(.*?)<\/box>", value):
        coords = match.split(",")
        if len(coords) != 4:
            continue
        try:
            out.append(tuple(float(c.strip()) for c in coords))
        except ValueError:
            continue
    return out


@_reference("xml_nbbox_iou_single")
def xml_nbbox_iou_single(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    pred = response if isinstance(response, (tuple, list)) else xml_boxes(response)
    gt = reference if isinstance(reference, (tuple, list)) else xml_boxes(reference)
    if len(pred) == 0:
        return 0.0
    if isinstance(pred[0], Number) and len(pred) == 4:
        pred = [pred]
    scores = best_ious(pred, gt)
    return sum(scores) / len(scores) if scores else 0.0


@_reference("xml_norm_point_in_bbox")
def xml_norm_point_in_bbox(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    boxes = [str_to_bboxes(s)[0] for s in (ctx.eval_context if ctx else {})["bounding_boxes"]]
    if not boxes:
        raise ValueError("no bounding boxes in eval_context")
    if not isinstance(response, (tuple, list)):
        response = xml_point(response)
        if not response:
            return 0.0
    elif len(response) != 2:
        return 0.0
    x, y = response
    return 1.0 if any(b[0] <= x <= b[2] and b[1] <= y <= b[3] for b in boxes) else 0.0


def _unit_point(value: Any) -> tuple:
    if not isinstance(value, (tuple, list)):
        value = xml_point(value)
        if not value:
            raise ValueError("no point")
    elif len(value) != 2:
        raise ValueError("not 2D")
    if not all(0 <= c <= 1 for c in value):
        raise ValueError("not normalised")
    return tuple(value)


@_reference("xml_norm_point_distance")
def xml_norm_point_distance(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    try:
        pred, gt = _unit_point(response), _unit_point(reference)
    except ValueError:
        return 0.0
    if len(pred) != len(gt):
        raise ValueError("points of different dimensions")
    return max(0.0, 1 - math.sqrt(sum((p - g) ** 2 for p, g in zip(pred, gt))))


def str_to_coords(value: Any) -> list:
    if not isinstance(value, str):
        return []
    try:
        coords = ast.literal_eval(value)
    except SyntaxError:
        try:
            coords = json.loads(value)
        except json.JSONDecodeError:
            return []
    return [
        c
        for c in coords
        if isinstance(c, (tuple, list)) and len(c) == 2 and all(isinstance(x, (float, int)) for x in c)
    ]


@_reference("sequence_coords_similarity")
def sequence_coords_similarity(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    import numpy as np

    pred = response if isinstance(response, (tuple, list)) else str_to_coords(response)
    gt = reference if isinstance(reference, (tuple, list)) else str_to_coords(reference)
    try:
        p = np.array(pred)
    except ValueError:
        return 0.0
    g = np.array(gt)
    if p.shape != g.shape:
        return 0.0
    distances = np.linalg.norm(p - g, axis=1)
    return float(np.mean(np.exp(-10 * distances / np.sqrt(2))))


# --------------------------------------------------------------------------- text overlap


@_reference("bleu")
def bleu(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if isinstance(response, str) and isinstance(reference, str):
        hyps, refs = [reference], [response]
    elif isinstance(response, (list, tuple)) and isinstance(reference, (list, tuple)):
        hyps, refs = tuple(reference), tuple(response)
    else:
        return 0.0
    try:
        import sacrebleu
    except ImportError:
        raise MetricUnavailable("needs the sacrebleu package (pip install 'mmrl[megabench]')") from None
    # MEGA-Bench passes the reference as the hypothesis and the response as the reference.
    return sacrebleu.corpus_bleu(hyps, [refs]).score / 100


@_reference("gleu_cn")
def gleu_cn(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0
    try:
        import jieba
        from nltk.translate.gleu_score import sentence_gleu
    except ImportError:
        raise MetricUnavailable("needs the jieba and nltk packages (pip install 'mmrl[megabench]')") from None
    import logging

    jieba.setLogLevel(logging.WARNING)
    return sentence_gleu([list(jieba.cut_for_search(response))], list(jieba.cut_for_search(reference)))


# --------------------------------------------------------------------------- judges


@_reference("gpt_4o_as_judge", "ascii_art_gpt4o_judge", "model_judge")
def judge(response: Any, reference: Any, ctx: FieldContext | None = None) -> float:
    return model_judge(response, reference, ctx)


# --------------------------------------------------------------------------- aggregation


def aggregate_query(scores: dict[str, float], weights: dict[str, float], function: str = "mean") -> float:
    """MEGA-Bench's query score: fields scoring < 0 are left out; -1 when none is left. `mean`
    is `np.average` with the fields' weights (a missing weight or a zero total raises, as
    there; `check_task` reports both before a run)."""
    counted = {f: s for f, s in scores.items() if s >= 0}
    if not counted:
        return -1.0
    if function == "min":
        return min(counted.values())
    missing = [f for f in counted if f not in weights]
    if missing:
        raise KeyError(f"no field weight for {missing} (MEGA-Bench's mean aggregation needs one per field)")
    total = sum(float(weights[f]) for f in counted)
    if total == 0:
        raise ZeroDivisionError(
            f"the field weights of {sorted(counted)} sum to 0 (MEGA-Bench: np.average raises)"
        )
    return sum(s * float(weights[f]) for f, s in counted.items()) / total


def check_task(
    name: str, field_metrics: dict[str, str], weights: dict[str, float], function: str
) -> str | None:
    """Why MEGA-Bench's evaluator would crash on this task's metric_info, or None."""
    if function != "mean":
        return None
    scored = [f for f in field_metrics if not f.startswith("##") or field_metrics.get(f)]
    missing = [f for f in scored if f not in weights]
    if missing:
        return (
            f"task {name!r}: metric_info.aggregation.field_weights has no weight for {missing}; MEGA-Bench's "
            "mean aggregation raises KeyError on it (give every scored field a weight, or use --scoring corrected)"
        )
    if scored and sum(float(weights[f]) for f in scored) == 0:
        return (
            f"task {name!r}: the field weights of {scored} sum to 0; MEGA-Bench's np.average raises "
            "ZeroDivisionError (give a field a positive weight, or use --scoring corrected)"
        )
    return None
