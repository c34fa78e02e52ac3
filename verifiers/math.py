"""The `math` verifier: the answer in `\\boxed{}` or `<answer>` checked with math-verify.

math-verify parses both sides to SymPy and compares them, so `\\frac{1}{2}`, `0.5` and `1/2`
are the same answer, and `5\\text{ cm}` matches `5`. Its own signal-based time-outs are switched
off in favour of the verifier's per-call limit (one timer, not two fighting over SIGALRM).

What a policy cannot get reward for (each closed hole has a test in tests/test_math_hacking.py):

- **Hedging over boxes.** Several different `\\boxed{}` (or `\\fbox{}`) answers anywhere in the
  response are read together as the set they form, as V-Triune's math-verify setting
  (`boxed="all"`) reads them: `\\boxed{3} or \\boxed{4}` is right only when the gold is the set
  or list {3, 4}. Repeating one answer is not hedging.
- **Unbalanced braces.** The answer region (the `<answer>` body, else the text from the first
  box to the end) must balance its braces (escaped `\\{ \\}` aside): `<answer>5} \\text{ or }
  {6</answer>` would otherwise be read as `\\boxed{5}` plus junk, `\\boxed{5}}` as 5.
- **Alternatives hidden in text.** A digit inside `\\text{}` (or `\\mbox`, `\\textbf`, ...)
  of the answer scores 0: math-verify drops such groups as units, so `3\\text{ (or 4)}` would
  otherwise count as 3.
- **Flooding.** More than `MAX_BOXED_ANSWERS` different boxes are not parsed (accuracy 0).
- **Babbling.** An answer past a cap of `context.limits` (`mmrl.types.AnswerLimits`: length,
  bracket nesting, tokens) is not parsed: an error result of its own kind
  (`answer_too_long`, ...), at once instead of after math-verify's time-out.

With `verifier_params.style = "vtriune"` (what `/judge` uses for V-Triune's `mathverify`) the
accuracy is V-Triune's own: both texts lower-cased, the gold parsed with math-verify's
defaults, the response with its boxed-first LaTeX configuration over the whole text (no
`<answer>`-only fallback); the guards above still apply, and a gold math-verify cannot parse
is an error, not V-Triune's silent 0.
"""

from __future__ import annotations

import functools
import logging
import re

from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.format import answer_tag_content, check_format_param, format_score
from mmrl.verifiers.limits import answer_limit_error
from mmrl.verifiers.registry import SampleFieldError, Verifier, mix_score, register_verifier

logging.getLogger("math_verify").setLevel(logging.ERROR)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; None if absent.

    A `\\boxed` not followed (after spaces) by a balanced `{...}` is skipped in favour of an
    earlier one. Linear time: a brace left open after position p means no earlier `\\boxed`
    can close after p, so each earlier scan stops where the previous one started."""
    limit = len(text)
    boxed, fbox = text.rfind("\\boxed"), text.rfind("\\fbox")
    while max(boxed, fbox) != -1:
        start = max(boxed, fbox)
        name = "\\boxed" if start == boxed else "\\fbox"
        i = text.find("{", start, limit)
        if i != -1 and text[start + len(name) : i].strip() == "":
            depth = 0
            for j in range(i, limit):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
        limit = start
        if start == boxed:  # only the one just tried moves: each rfind covers new text only
            boxed = text.rfind("\\boxed", 0, start)
        else:
            fbox = text.rfind("\\fbox", 0, start)
    return None


def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` / `\\fbox{...}` whose braces close, in order of their
    start. One pass with a stack of open braces, so linear in the length of the text."""
    found: list[tuple[int, str]] = []
    opens: list[tuple[int, bool]] = []  # (index of "{", opens a box)
    box_at: set[int] = set()
    for name in ("\\boxed", "\\fbox"):
        start = text.find(name)
        while start != -1:
            i = start + len(name)
            while i < len(text) and text[i] in " \t\n":
                i += 1
            if i < len(text) and text[i] == "{":
                box_at.add(i)
            start = text.find(name, start + 1)
    if not box_at:
        return []
    for i, ch in enumerate(text):
        if ch == "{":
            opens.append((i, i in box_at))
        elif ch == "}" and opens:
            j, is_box = opens.pop()
            if is_box:
                found.append((j, text[j + 1 : i]))
    return [content for _, content in sorted(found)]


def extract_answer(response: str) -> str | None:
    """The final answer: the boxed answer(s) if any, else the last `<answer>...</answer>` body.

    Several different boxed answers are joined with ", " into the set they form (hedging is
    scored as that set); one answer repeated counts once."""
    boxes = list(dict.fromkeys(b.strip() for b in boxed_contents(response)))
    if boxes:
        return boxes[0] if len(boxes) == 1 else ", ".join(boxes)
    return answer_tag_content(response)


MAX_BOXED_ANSWERS = 64
"""More different boxed answers than this are not parsed (a set that large is a hedge, and
math-verify's time grows with it): accuracy 0."""

_TEXT_WITH_DIGIT = re.compile(r"\\(?:text|textbf|textit|textrm|textsf|texttt|mbox)\s*\{[^{}]*\d")


def malformed_answer(response: str, answer: str) -> str | None:
    """Why the answer must not be credited (unbalanced braces in the answer region, a digit
    hidden in a text group), or None."""
    region = answer_tag_content(response)
    if region is None:
        starts = [i for i in (response.find("\\boxed"), response.find("\\fbox")) if i >= 0]
        region = response[min(starts) :] if starts else answer
    depth = 0
    for ch in region.replace("\\{", "").replace("\\}", ""):
        depth += ch == "{"
        depth -= ch == "}"
        if depth < 0:
            break
    if depth != 0:
        return "unbalanced braces in the answer"
    if _TEXT_WITH_DIGIT.search(answer):
        return "a number inside a text group of the answer"
    if len({b.strip() for b in boxed_contents(response)}) > MAX_BOXED_ANSWERS:
        return f"more than {MAX_BOXED_ANSWERS} different boxed answers"
    return None


def _parse(text: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(
        "\\boxed{" + text + "}",
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=None,
        raise_on_error=True,
    )


@functools.lru_cache(maxsize=4096)
def _parse_gold(text: str) -> tuple:
    """The ground truth's parse, kept: a GRPO group scores G responses against one gold answer,
    and parsing it again for each was half of the verifier's time. (A tuple of immutable sympy
    objects, so a cached value cannot be changed by a caller.)"""
    return tuple(_parse(text))


@functools.lru_cache(maxsize=4096)
def _parse_gold_vtriune(text: str) -> tuple:
    """V-Triune's gold parse: lower-cased, math-verify's default extraction, first match."""
    from math_verify import parse

    return tuple(
        parse(text.lower(), extraction_mode="first_match", parsing_timeout=None, raise_on_error=True)
    )


def _parse_response_vtriune(text: str) -> list:
    """V-Triune's response parse: lower-cased, LaTeX only, boxed first (all boxes joined),
    no extraction without an anchor (a bare `5` is no answer; `$5$` or `\\boxed{5}` is)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse

    config = LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    return parse(
        text.lower(),
        extraction_config=[config],
        extraction_mode="first_match",
        parsing_timeout=None,
        raise_on_error=True,
    )


STYLES = ("mmrl", "vtriune")
"""`verifier_params.style`: mmrl's answer extraction, or V-Triune's `mathverify` accuracy."""


PARAM_KEYS = ("format", "style")
"""The `verifier_params` the math verifier knows; any other key is an error (as for the others)."""


def _check_param_keys(sample: Sample) -> None:
    for key in sample.reward_model.verifier_params:
        if key not in PARAM_KEYS:
            raise SampleFieldError(
                f"reward_model.verifier_params.{key}",
                f"unknown parameter for the math verifier (known: {sorted(PARAM_KEYS)})",
            )


def _style(sample: Sample) -> str:
    style = sample.reward_model.verifier_params.get("style", "mmrl")
    if style not in STYLES:
        raise SampleFieldError(
            "reward_model.verifier_params.style", f"must be one of {list(STYLES)}, got {style!r}"
        )
    return style


@register_verifier("math")
class MathVerifier(Verifier):
    """Accuracy 1 if the extracted answer equals the ground truth (math-verify). Format: see
    `mmrl.verifiers.format` (by default 1 when an answer could be extracted). See the module
    docstring for what is never credited."""

    def check_sample(self, sample: Sample) -> None:
        _check_param_keys(sample)
        check_format_param(sample)
        style = _style(sample)
        gold = sample.reward_model.ground_truth
        field = "reward_model.ground_truth"
        if not isinstance(gold, (str, int, float)) or isinstance(gold, bool):
            raise SampleFieldError(
                field, f"must be a string or number for the math verifier, got {type(gold).__name__}"
            )
        text = str(gold) if style == "vtriune" else extract_answer(str(gold)) or str(gold)
        if not text.strip():
            raise SampleFieldError(field, "is empty")
        if not (_parse_gold_vtriune(text) if style == "vtriune" else _parse(text)):
            raise SampleFieldError(field, f"math-verify cannot parse {text!r}")

    def warm_up(self) -> None:
        from math_verify import verify

        verify(_parse("\\frac{1}{2}"), _parse("0.5"), timeout_seconds=None)

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        from math_verify import verify

        gold = str(sample.reward_model.ground_truth)
        answer = extract_answer(response)
        problem = malformed_answer(response, answer) if answer is not None else None
        if answer is not None and problem is None:
            too_big = answer_limit_error(answer, context.limits)
            if too_big is not None:  # refused before math-verify spends its time limit on it
                return VerifierResult(score=0.0, error=too_big)
        accuracy = 0.0
        if _style(sample) == "vtriune":
            # V-Triune reads the whole response; the guards still veto a malformed answer region.
            gold_parsed = _parse_gold_vtriune(gold)
            if not gold_parsed:
                raise ValueError(f"math-verify cannot parse the ground truth {gold!r}")
            predicted = _parse_response_vtriune(response)
            if problem is None and verify(
                list(gold_parsed), predicted, timeout_seconds=None, raise_on_error=True
            ):
                accuracy = 1.0
        elif answer and problem is None:
            predicted = _parse(answer)
            gold_text = extract_answer(gold) or gold
            if predicted and verify(
                list(_parse_gold(gold_text)), predicted, timeout_seconds=None, raise_on_error=True
            ):
                accuracy = 1.0
        fmt = format_score(response, sample, answer is not None and problem is None)
        components = {"accuracy": accuracy, "format": fmt}
        if problem is not None:
            components["malformed"] = 1.0
        return VerifierResult(score=mix_score(sample, accuracy, fmt), components=components, extracted=answer)
