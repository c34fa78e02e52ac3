"""The `ocr`, `choice`, `number` and `counting` verifiers: short textual answers.

All four take the final answer with the shared rule of `mmrl.verifiers.math.extract_answer` (the
`\\boxed{}` answer, several different boxes joined into the set they form, else the last
`<answer>...</answer>` body; see `final_answer`). `ocr` and `choice` then fall back to the whole
response, stripped, because models often answer those bare ("STOP", "B"); `number` and
`counting` do not (a bare response is full of numbers that are not the answer). Hedging is
never right by luck: `number` and `counting` call an answer holding two different values
malformed (`\\boxed{3} or \\boxed{4}`, `<answer>3 or 4</answer>`), and both refuse an answer
past `context.limits` (`mmrl.verifiers.limits`) before reading it.

Each verifier reports `accuracy` and `format` components and mixes them with the sample's
`accuracy_ratio` / `format_ratio` (`mix_score`). The `format` component is
`format_score(response, sample, found)` where `found` means the verifier could read a gradable
answer: a non-empty text (`ocr`), a letter or set of letters (`choice`), a finite number
(`number`), a non-negative integer (`counting`). A response without one scores accuracy 0; that
is a normal result, not an `error`.

Every verifier validates its ground truth and every `verifier_params` key at load time
(`check_sample`); unknown keys are errors. The shared key `format` is allowed everywhere.

Robustness: the regular expressions here are simple (no nested quantifiers), and answers are
capped before any super-linear work, so a response of a million characters is scored promptly:

- `ocr` compares at most `MAX_OCR_CHARS` (2,000) normalised characters of each side (Levenshtein
  is O(n*m) in pure Python; 2,000 x 2,000 takes well under a second, keeping far inside the
  verifier's default 5 s limit); longer predictions (and ground truths) are truncated to that;
- `choice` parses at most `MAX_CHOICE_CHARS` characters as a letter set or option text; beyond
  that only the leading-letter rule ("B. because ...") is tried;
- `number` and `counting` read only the last `MAX_NUMBER_CHARS` characters of the answer (they
  take the last number, so the tail is the part that matters).
"""

from __future__ import annotations

import math
import re
import string
import unicodedata
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.format import check_format_param, format_score
from mmrl.verifiers.limits import answer_limit_error
from mmrl.verifiers.math import extract_answer
from mmrl.verifiers.registry import SampleFieldError, Verifier, mix_score, register_verifier

MAX_OCR_CHARS = 2000
"""Characters of each normalised OCR text compared (edit similarity is O(n*m))."""
MAX_CHOICE_CHARS = 1000
"""Longest choice answer parsed as letters / option text (longer: leading letter only)."""
MAX_NUMBER_CHARS = 1000
"""Characters at the end of a number / counting answer that are read."""

GROUND_TRUTH = "reward_model.ground_truth"


# --------------------------------------------------------------------------- shared helpers


def final_answer(response: str) -> str | None:
    """The final answer by the shared rule (`mmrl.verifiers.math.extract_answer`): the boxed
    answer (different boxes joined with ", "), else the last `<answer>...</answer>` body, else None."""
    return extract_answer(response)


def _answer_or_bare(response: str) -> str | None:
    """`final_answer`, else the whole response stripped (None when that is empty)."""
    answer = final_answer(response)
    if answer is not None:
        return answer
    return response.strip() or None


_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_LATEX_ESCAPE = re.compile(r"\\([%&$#_{} ])")


def _unwrap_latex_text(text: str) -> str:
    """`\\text{STOP}` -> `STOP`, `50\\%` -> `50%` (boxed answers are often LaTeX)."""
    return _LATEX_ESCAPE.sub(r"\1", _LATEX_TEXT.sub(r"\1", text))


def _check_param_keys(sample: Sample, verifier: str, known: Iterable[str]) -> dict[str, Any]:
    """The sample's verifier params; raises on a key the verifier does not know."""
    check_format_param(sample)
    params = sample.reward_model.verifier_params
    allowed = {"format", *known}
    for key in params:
        if key not in allowed:
            raise SampleFieldError(
                f"reward_model.verifier_params.{key}",
                f"unknown parameter for the {verifier} verifier (known: {sorted(allowed)})",
            )
    return params


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    """The last non-overlapping match of `pattern` in `text` (one linear scan), or None."""
    last = deque(pattern.finditer(text), maxlen=1)
    return last[0] if last else None


def _param_field(key: str) -> str:
    return f"reward_model.verifier_params.{key}"


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _result(
    response: str,
    sample: Sample,
    accuracy: float,
    found: bool,
    extracted: str | None,
    **extra: float,
) -> VerifierResult:
    """Mix accuracy with the format component and package the result."""
    fmt = format_score(response, sample, found)
    return VerifierResult(
        score=mix_score(sample, accuracy, fmt),
        components={"accuracy": accuracy, "format": fmt, **extra},
        extracted=extracted,
    )


def _malformed(response: str, sample: Sample, answer: str) -> VerifierResult:
    """An answer that must not be credited (two different final answers): accuracy 0, no
    gradable answer for the format component, and `malformed` 1 (as the math verifier)."""
    result = _result(response, sample, 0.0, False, answer)
    result.components["malformed"] = 1.0
    return result


# --------------------------------------------------------------------------- ocr


def _strip_punctuation(text: str) -> str:
    return "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))


_NORMALIZERS: dict[str, Callable[[str], str]] = {
    "lower": str.lower,
    "strip_punctuation": _strip_punctuation,
    "collapse_whitespace": lambda text: " ".join(text.split()),
    "remove_whitespace": lambda text: "".join(text.split()),
    "nfkc": lambda text: unicodedata.normalize("NFKC", text),
}
NORMALIZE_STEPS = tuple(_NORMALIZERS)
DEFAULT_NORMALIZE = ("nfkc", "lower", "collapse_whitespace")
OCR_METRICS = ("edit_similarity", "exact_match")


def normalize_text(text: str, steps: Sequence[str] = DEFAULT_NORMALIZE) -> str:
    """Apply the normalisation `steps` in the order given, then strip both ends.

    Steps: `lower`, `strip_punctuation` (drops Unicode punctuation, categories P*; symbols
    such as `$` or `+` stay), `collapse_whitespace` (runs of whitespace -> one space),
    `remove_whitespace`, `nfkc` (Unicode NFKC: full-width forms, ligatures). Raises ValueError
    on an unknown step.
    """
    for step in steps:
        if step not in _NORMALIZERS:
            raise ValueError(f"unknown normalisation step {step!r} (known: {list(NORMALIZE_STEPS)})")
        text = _NORMALIZERS[step](text)
    return text.strip()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions each cost 1).

    Two-row dynamic programme, O(len(a) * len(b)) time and O(min) memory, after dropping the
    common prefix and suffix (free, and most OCR answers are near-misses). Callers cap lengths.
    """
    start = 0
    while start < len(a) and start < len(b) and a[start] == b[start]:
        start += 1
    end_a, end_b = len(a), len(b)
    while end_a > start and end_b > start and a[end_a - 1] == b[end_b - 1]:
        end_a -= 1
        end_b -= 1
    a, b = a[start:end_a], b[start:end_b]
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        best = i
        for j, char_b in enumerate(b):
            substitute = previous[j] + (char_a != char_b)
            delete = previous[j + 1] + 1
            best += 1  # insert: the cell to the left plus one
            if substitute < best:
                best = substitute
            if delete < best:
                best = delete
            current.append(best)
        previous = current
    return previous[-1]


def edit_similarity(prediction: str, gold: str) -> float:
    """1 - levenshtein / max(len): 1.0 for equal strings (also both empty), 0.0 for nothing alike."""
    longest = max(len(prediction), len(gold))
    if longest == 0:
        return 1.0
    return 1.0 - levenshtein(prediction, gold) / longest


def _check_normalize(params: dict[str, Any]) -> None:
    steps = params.get("normalize", DEFAULT_NORMALIZE)
    field = _param_field("normalize")
    if not isinstance(steps, (list, tuple)) or not all(isinstance(s, str) for s in steps):
        raise SampleFieldError(field, f"must be a list of step names, got {steps!r}")
    unknown = [s for s in steps if s not in _NORMALIZERS]
    if unknown:
        raise SampleFieldError(field, f"unknown steps {unknown} (known: {list(NORMALIZE_STEPS)})")


@register_verifier("ocr")
class OcrVerifier(Verifier):
    """Text read from an image, compared after normalisation.

    Ground truth: the text (a string; may be empty). Params: `normalize` (list of steps, default
    `["nfkc", "lower", "collapse_whitespace"]`, see `normalize_text`), `metric`
    (`"edit_similarity"`, default, or `"exact_match"`: which one is `accuracy`).
    Components: `accuracy`, `format`, `exact_match` (1/0), `edit_similarity` (both 0.0 when no
    answer was found). The answer is the boxed / `<answer>` text, else the whole response;
    `\\text{...}` wrappers and LaTeX escapes such as `\\%` are undone. Raw inputs are cut to
    4 x `MAX_OCR_CHARS` before normalising and to `MAX_OCR_CHARS` after, for edit similarity.
    """

    def check_sample(self, sample: Sample) -> None:
        params = _check_param_keys(sample, "ocr", ("normalize", "metric"))
        if not isinstance(sample.reward_model.ground_truth, str):
            gold = sample.reward_model.ground_truth
            raise SampleFieldError(GROUND_TRUTH, f"must be a string (the text), got {type(gold).__name__}")
        _check_normalize(params)
        metric = params.get("metric", "edit_similarity")
        if metric not in OCR_METRICS:
            raise SampleFieldError(
                _param_field("metric"), f"must be one of {list(OCR_METRICS)}, got {metric!r}"
            )

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        params = sample.reward_model.verifier_params
        steps = params.get("normalize", DEFAULT_NORMALIZE)
        answer = _answer_or_bare(response)
        if answer is None:
            return _result(response, sample, 0.0, False, None, exact_match=0.0, edit_similarity=0.0)
        raw_cap = 4 * MAX_OCR_CHARS
        prediction = normalize_text(_unwrap_latex_text(answer[:raw_cap]), steps)
        gold = normalize_text(str(sample.reward_model.ground_truth)[:raw_cap], steps)
        exact = 1.0 if prediction == gold else 0.0
        similarity = edit_similarity(prediction[:MAX_OCR_CHARS], gold[:MAX_OCR_CHARS])
        metric = params.get("metric", "edit_similarity")
        accuracy = exact if metric == "exact_match" else similarity
        return _result(
            response, sample, accuracy, True, answer, exact_match=exact, edit_similarity=similarity
        )


# --------------------------------------------------------------------------- choice

_ANSWER_MARKER = re.compile(r"\b(?:answer|option|choice)\s*(?:is\b|:)", re.IGNORECASE)
_MARKER_TAIL = re.compile(r"[\s:]*(?:(?:option|choice)\b)?", re.IGNORECASE)
_BRACKETED = re.compile(r"[(\[{]([^()\[\]{}]*)[)\]}]")
_PIECE_SEPARATOR = re.compile(r"[,;&/]")
_AND = re.compile(r"\band\b", re.IGNORECASE)
_LEADING_LETTER = re.compile(r"\(?([A-Za-z])([).:]|\s)")


def _choice_letters(options: Sequence[str] | None) -> str:
    """The valid letters: one per option, or A..Z without options."""
    return string.ascii_uppercase[: len(options)] if options else string.ascii_uppercase


def _option_key(text: str) -> str:
    return " ".join(text.split()).casefold()


def _option_letter(text: str, options: Sequence[str] | None) -> str | None:
    """The letter of the option whose text equals `text` (case-insensitive), if any."""
    if not options or len(text) > MAX_CHOICE_CHARS:
        return None
    key = _option_key(text)
    for letter, option in zip(string.ascii_uppercase, options):
        if key == _option_key(option):
            return letter
    return None


def _strip_wrappers(text: str) -> str:
    """Peel `(B)`, `[B]`, `**B**`, quotes, `\\text{B}` and trailing `.,;:!?` (a few rounds)."""
    for _ in range(4):
        before = text
        text = _unwrap_latex_text(text).strip().strip("*_`'\"").rstrip(".,;:!?").strip()
        bracketed = _BRACKETED.fullmatch(text)
        if bracketed:
            text = bracketed.group(1).strip()
        if text == before:
            break
    return text


def _after_marker(text: str) -> str | None:
    """What follows the last "answer is" / "answer:" (or "option is" ...), if there is one."""
    last = _last_match(_ANSWER_MARKER, text)
    if last is None:
        return None
    rest = text[last.end() :]
    return rest[_MARKER_TAIL.match(rest).end() :]


def _leading_letter(text: str, valid: str) -> str | None:
    """`B) text`, `b. text`, `(B) text`, `B: text`, `B text` -> B. After whitespace only an
    upper-case letter counts ("a cat" is prose, not option A)."""
    found = _LEADING_LETTER.match(text)
    if not found:
        return None
    letter, delimiter = found.groups()
    if delimiter.isspace() and not letter.isupper():
        return None
    return letter.upper() if letter.upper() in valid else None


def _token_letters(part: str, valid: str) -> set[str] | None:
    """`A`, `a`, `AC`, `A C`, `(A) (C)` -> letters; None if any token is not letters."""
    letters: set[str] = set()
    for token in part.split():
        token = _strip_wrappers(token)
        if len(token) == 1 and token.upper() in valid:
            letters.add(token.upper())
        elif len(token) > 1 and token.isupper() and all(ch in valid for ch in token):
            letters.update(token)
        elif token:
            return None
    return letters


def _part_letters(part: str, options: Sequence[str] | None, valid: str) -> set[str] | None:
    """One comma/"and"-separated part: option text, letter tokens, or a leading letter."""
    hit = _option_letter(part, options)
    if hit:
        return {hit}
    letters = _token_letters(part, valid)
    if letters is not None:
        return letters
    lead = _leading_letter(part, valid)
    return {lead} if lead else None


def _letter_set(body: str, options: Sequence[str] | None, valid: str) -> set[str] | None:
    """Parse `A, C` / `AC` / `A and C` / `(A) & (C)` / option texts into letters, or None."""
    letters: set[str] = set()
    for piece in _PIECE_SEPARATOR.split(body):
        piece = _strip_wrappers(piece)
        hit = _option_letter(piece, options)
        if hit:
            letters.add(hit)
            continue
        for part in _AND.split(piece):
            part = _strip_wrappers(part)
            if not part:
                continue
            found = _part_letters(part, options, valid)
            if found is None:
                return None
            letters |= found
    return letters or None


def _choice_from(text: str, options: Sequence[str] | None, valid: str) -> str | None:
    """Spec order: a single letter; an option text; a letter set; a leading letter."""
    body = _strip_wrappers(text)
    if len(body) == 1 and body.upper() in valid:
        return body.upper()
    hit = _option_letter(text.strip(), options) or _option_letter(body, options)
    if hit:
        return hit
    if len(body) <= MAX_CHOICE_CHARS:
        letters = _letter_set(body, options, valid)
        if letters:
            return "".join(sorted(letters))
    return _leading_letter(body[:MAX_CHOICE_CHARS], valid)


def extract_choice(text: str, options: Sequence[str] | None = None) -> str | None:
    """The chosen letter(s) in `text`, upper case and sorted ("B", "AC"), or None.

    Accepts "B", "b", "(B)", "B.", "b) text", "Answer: B", "The answer is (B)", "**B**",
    `\\text{B}`, the text of an option (case-insensitive, when `options` are given), and sets
    such as "A, C", "AC", "A and C", "(A) (C)". Letters must be within the options (A..Z
    without options). When the text holds "answer is" / "answer:", what follows the last one is
    tried first, then the whole text.
    """
    valid = _choice_letters(options)
    after = _after_marker(text)
    candidates = [after, text] if after is not None else [text]
    for candidate in candidates:
        found = _choice_from(candidate, options, valid)
        if found:
            return found
    return None


def _choice_gold(gold: Any, options: Sequence[str] | None) -> str:
    """The ground truth as sorted upper-case letters; ValueError if malformed or out of range."""
    items = gold if isinstance(gold, (list, tuple)) else [gold]
    if not items:
        raise ValueError("is an empty list of letters")
    valid = _choice_letters(options)
    letters = set()
    for item in items:
        if not isinstance(item, str) or len(item.strip()) != 1 or not item.strip().isalpha():
            raise ValueError(f"must be a letter or a list of letters, got {gold!r}")
        letter = item.strip().upper()
        if letter not in valid:
            raise ValueError(f"letter {letter!r} is outside the options A..{valid[-1]}")
        letters.add(letter)
    return "".join(sorted(letters))


def _check_options(options: Any) -> None:
    field = _param_field("options")
    if not isinstance(options, (list, tuple)) or not options:
        raise SampleFieldError(field, f"must be a non-empty list of option texts, got {options!r}")
    if len(options) > len(string.ascii_uppercase):
        raise SampleFieldError(field, f"has {len(options)} options; at most 26 (A..Z)")
    seen: dict[str, str] = {}
    for letter, option in zip(string.ascii_uppercase, options):
        if not isinstance(option, str) or not option.strip():
            raise SampleFieldError(field, f"option {letter} must be a non-empty string, got {option!r}")
        key = _option_key(option)
        if key in seen:
            raise SampleFieldError(field, f"options {seen[key]} and {letter} have the same text {option!r}")
        seen[key] = letter


@register_verifier("choice")
class ChoiceVerifier(Verifier):
    """Multiple choice. Ground truth: a letter ("B") or a list of letters (multi-answer: the
    exact set is required), case-insensitive. Param `options`: the option texts in letter order,
    so an answer may be the option's text. Components: `accuracy`, `format` (`format` counts a
    letter or set of letters found). The answer is the boxed / `<answer>` text, else the whole
    response (see `extract_choice`). For a single-letter ground truth an answer naming several
    letters ("B and C") is wrong, not a hit.
    """

    def check_sample(self, sample: Sample) -> None:
        params = _check_param_keys(sample, "choice", ("options",))
        options = params.get("options")
        if options is not None:
            _check_options(options)
        try:
            _choice_gold(sample.reward_model.ground_truth, options)
        except ValueError as exc:
            raise SampleFieldError(GROUND_TRUTH, str(exc)) from None

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        options = sample.reward_model.verifier_params.get("options")
        gold = _choice_gold(sample.reward_model.ground_truth, options)
        answer = _answer_or_bare(response)
        predicted = extract_choice(answer, options) if answer is not None else None
        accuracy = 1.0 if predicted == gold else 0.0
        return _result(response, sample, accuracy, predicted is not None, answer)


# --------------------------------------------------------------------------- number

_UNUMBER = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d*)?|\d+(?:\.\d*)?|\.\d+)"
_NUMBER = re.compile(
    r"(?:(?<![\w.)])(?P<sign>[-+]))?"  # a sign, unless it joins two operands ("3-5")
    r"(?<![A-Za-z_])"  # not the tail of an identifier ("H2O", "x2")
    rf"(?P<num>{_UNUMBER}(?:[eE][-+]?\d+)?)"
    rf"(?:\s*/\s*(?P<den>{_UNUMBER}))?"
    r"(?P<pct>\s*(?:%|percent\b))?",
    re.IGNORECASE,
)
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TIMES_TEN = re.compile(r"(\d)\s*(?:\\times|\\cdot|×|\*|x)\s*10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?")
_TEN_POWER = re.compile(r"(?<![\d.])10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?")
_UNIT_POWER = re.compile(r"([A-Za-z])\s*\^\s*\{?\s*[-+]?\d+\s*\}?")
_LATEX_SPACE = re.compile(r"\\[,!;:]")
PERCENT_MODES = ("as_is", "fraction")


def _prepare_number_text(text: str) -> str:
    """LaTeX and Unicode spellings -> plain: `\\frac{3}{4}` -> `3/4`, `1.2\\times10^{3}` ->
    `1.2e3`, `cm^{2}` -> `cm`, `1{,}234` / `1\\,234` -> `1,234` / `1234`, `\\%` -> `%`."""
    text = text.replace("\u2212", "-").replace("{,}", ",").replace("\\%", "%").replace("\\ ", " ")
    text = _LATEX_SPACE.sub("", _unwrap_latex_text(text))
    text = _FRAC.sub(lambda m: f"{m.group(1).strip()}/{m.group(2).strip()}", text)
    text = _TIMES_TEN.sub(r"\1e\2", text)
    text = _TEN_POWER.sub(r"1e\1", text)
    return _UNIT_POWER.sub(r"\1", text)


def _number_value(found: re.Match[str], percent: str) -> float | None:
    """The value of one `_NUMBER` match; None for x/0 or a non-finite value."""
    value = float(found["num"].replace(",", ""))
    if found["den"] is not None:
        denominator = float(found["den"].replace(",", ""))
        if denominator == 0:
            return None
        value /= denominator
    if found["sign"] == "-":
        value = -value
    if found["pct"] and percent == "fraction":
        value /= 100.0
    return value if math.isfinite(value) else None


def parse_number(text: str, percent: str = "as_is") -> float | None:
    """The last number in `text`, or None.

    Units, currency signs and thousands separators are ignored ("1,234.5 cm" -> 1234.5,
    "$12" -> 12); scientific notation ("1.5e-3", `1.5\\times10^{-3}`), simple fractions ("3/4")
    and `\\frac{3}{4}` are read. A percentage is kept as written with `percent="as_is"`
    ("45%" -> 45) or divided by 100 with `"fraction"` (0.45). Only the last
    `MAX_NUMBER_CHARS` characters are read. Decimal commas ("1,5") and mixed numbers ("1 1/2")
    are not understood.
    """
    last = _last_match(_NUMBER, _prepare_number_text(text[-MAX_NUMBER_CHARS:]))
    return None if last is None else _number_value(last, percent)


def number_values(text: str, percent: str = "as_is") -> list[float]:
    """Every distinct number in `text`, read as `parse_number` reads one, in order of first
    appearance ("3 or 4" -> [3, 4]; "1,234.5 cm" -> [1234.5]; "1.2\\times10^{3}" -> [1200])."""
    values: list[float] = []
    for found in _NUMBER.finditer(_prepare_number_text(text)):
        value = _number_value(found, percent)
        if value is not None and value not in values:
            values.append(value)
    return values


def _gold_text(gold: Any) -> str:
    """A ground truth as text; a boxed / `<answer>` ground truth is unwrapped."""
    text = str(gold)
    return final_answer(text) or text


def _number_gold(gold: Any, percent: str) -> float | None:
    if isinstance(gold, bool):
        return None
    if isinstance(gold, (int, float)):
        value = float(gold)
        return value if math.isfinite(value) else None
    if isinstance(gold, str):
        return parse_number(_gold_text(gold), percent)
    return None


def _within(prediction: float, gold: float, rel_tol: float, abs_tol: float) -> bool:
    """|pred - gold| <= max(rel_tol * |gold|, abs_tol), allowing for float rounding at the edge."""
    difference = abs(prediction - gold)
    tolerance = max(rel_tol * abs(gold), abs_tol)
    return difference <= tolerance or math.isclose(difference, tolerance, rel_tol=1e-9)


@register_verifier("number")
class NumberVerifier(Verifier):
    """A numeric answer within a tolerance.

    Ground truth: a number, or a string holding one (its last number counts, read like the
    prediction; must be finite). Params: `rel_tol` (default 0.01, i.e. 1%), `abs_tol` (default
    0.0), `percent` (`"as_is"` or `"fraction"`, applied to both sides; see `parse_number`).
    Accuracy 1 if |pred - gold| <= max(rel_tol * |gold|, abs_tol): for a ground truth of 0 set
    `abs_tol`. Components: `accuracy`, `format`, `relative_error` (|pred - gold| / max(|gold|,
    1e-12), capped at 1e6; absent when no number was found). The answer must be boxed or in
    `<answer>`: a bare response is not read. An answer holding two different numbers (`\\boxed{3}
    or \\boxed{4}`, `<answer>3 or 4</answer>`, a range "3-5") is malformed: accuracy 0, format 0,
    component `malformed` (a hedge is never right by luck); a number written twice is one.
    """

    def check_sample(self, sample: Sample) -> None:
        params = _check_param_keys(sample, "number", ("rel_tol", "abs_tol", "percent"))
        for key in ("rel_tol", "abs_tol"):
            value = params.get(key, 0.0)
            if not _is_real(value) or not math.isfinite(value) or value < 0:
                raise SampleFieldError(_param_field(key), f"must be a finite number >= 0, got {value!r}")
        percent = params.get("percent", "as_is")
        if percent not in PERCENT_MODES:
            raise SampleFieldError(
                _param_field("percent"), f"must be one of {list(PERCENT_MODES)}, got {percent!r}"
            )
        if _number_gold(sample.reward_model.ground_truth, percent) is None:
            gold = sample.reward_model.ground_truth
            raise SampleFieldError(
                GROUND_TRUTH, f"must be a finite number or a string holding one, got {gold!r}"
            )

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        params = sample.reward_model.verifier_params
        percent = params.get("percent", "as_is")
        gold = _number_gold(sample.reward_model.ground_truth, percent)
        if gold is None:
            raise ValueError(f"ground truth {sample.reward_model.ground_truth!r} is not a finite number")
        answer = final_answer(response)
        if answer is not None:
            if (too_big := answer_limit_error(answer, context.limits)) is not None:
                return VerifierResult(score=0.0, error=too_big)
            if len(number_values(answer, percent)) > 1:  # "3 or 4": a hedge is never right
                return _malformed(response, sample, answer)
        predicted = parse_number(answer, percent) if answer is not None else None
        if predicted is None:
            return _result(response, sample, 0.0, False, answer)
        rel_tol, abs_tol = float(params.get("rel_tol", 0.01)), float(params.get("abs_tol", 0.0))
        accuracy = 1.0 if _within(predicted, gold, rel_tol, abs_tol) else 0.0
        relative_error = min(abs(predicted - gold) / max(abs(gold), 1e-12), 1e6)
        return _result(response, sample, accuracy, True, answer, relative_error=relative_error)


# --------------------------------------------------------------------------- counting

_INTEGER = re.compile(r"(?<![\w.])(?P<sign>-)?(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?")
NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()
_WORD_VALUES = {word: value for value, word in enumerate(NUMBER_WORDS)}
_NUMBER_WORD = re.compile(
    r"(?<![\w-])(" + "|".join(sorted(NUMBER_WORDS, key=len, reverse=True)) + r")(?![\w-])",
    re.IGNORECASE,
)
_MAX_ERROR = 1e15


def parse_count(text: str) -> int | None:
    """The last integer in `text` ("1,024" -> 1024, "5.0" -> 5), else the last number word
    zero..twenty ("three" -> 3), else None.

    Digits win over words ("4 apples, one of them red" -> 4). A negative or fractional last
    number ("-3", "2.5") is not a count: None. Hyphenated words ("twenty-one") are not read.
    Only the last `MAX_NUMBER_CHARS` characters are read.
    """
    text = text[-MAX_NUMBER_CHARS:]
    last = _last_match(_INTEGER, text)
    if last is not None:
        fraction = last["frac"] or ""
        if last["sign"] or fraction.strip(".0"):
            return None
        return int(last["int"].replace(",", ""))
    last = _last_match(_NUMBER_WORD, text)
    return None if last is None else _WORD_VALUES[last.group(1).lower()]


def count_values(text: str) -> list[str]:
    """The distinct numbers of `text` as `parse_count` would read them: its digit numbers (as
    written, "1,024" as 1024), or, when it has none, its number words."""
    numbers = [
        m["int"].replace(",", "") + (m["frac"] or "").rstrip("0").rstrip(".") for m in _INTEGER.finditer(text)
    ]
    if not numbers:
        numbers = [str(_WORD_VALUES[m.group(1).lower()]) for m in _NUMBER_WORD.finditer(text)]
    return list(dict.fromkeys(n.lstrip("0") or "0" for n in numbers))


def _count_gold(gold: Any) -> int:
    """A non-negative int or digit string as an int; ValueError otherwise."""
    if isinstance(gold, int) and not isinstance(gold, bool) and gold >= 0:
        return gold
    if isinstance(gold, str) and re.fullmatch(r"[0-9]{1,18}", gold.strip()):
        return int(gold.strip())
    raise ValueError(f"must be a non-negative integer or a string of digits, got {gold!r}")


@register_verifier("counting")
class CountingVerifier(Verifier):
    """How many: an exact integer. Ground truth: a non-negative int or a digit string. Param
    `partial` (bool, default false): accuracy max(0, 1 - |pred - gold| / max(gold, 1)) instead
    of exact match. Components: `accuracy`, `format`, `abs_error` (absent when no count was
    found). The answer must be boxed or in `<answer>` (see `parse_count`). An answer holding
    two different counts ("3 or 4", "three or four"; digits decide when there are any) is
    malformed: accuracy 0, format 0, component `malformed`.
    """

    def check_sample(self, sample: Sample) -> None:
        params = _check_param_keys(sample, "counting", ("partial",))
        partial = params.get("partial", False)
        if not isinstance(partial, bool):
            raise SampleFieldError(_param_field("partial"), f"must be true or false, got {partial!r}")
        try:
            _count_gold(sample.reward_model.ground_truth)
        except ValueError as exc:
            raise SampleFieldError(GROUND_TRUTH, str(exc)) from None

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        gold = _count_gold(sample.reward_model.ground_truth)
        answer = final_answer(response)
        if answer is not None:
            if (too_big := answer_limit_error(answer, context.limits)) is not None:
                return VerifierResult(score=0.0, error=too_big)
            if len(count_values(answer)) > 1:  # "3 or 4": a hedge is never right
                return _malformed(response, sample, answer)
        predicted = parse_count(answer) if answer is not None else None
        if predicted is None:
            return _result(response, sample, 0.0, False, answer)
        error = float(min(abs(predicted - gold), int(_MAX_ERROR)))
        if sample.reward_model.verifier_params.get("partial", False):
            accuracy = max(0.0, 1.0 - error / max(gold, 1))
        else:
            accuracy = 1.0 if predicted == gold else 0.0
        return _result(response, sample, accuracy, True, answer, abs_error=error)
