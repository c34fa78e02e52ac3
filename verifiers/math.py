"""The `math` verifier: the answer in `\\boxed{}` or `<answer>` checked with math-verify.

math-verify parses both sides to SymPy and compares them, so `\\frac{1}{2}`, `0.5` and `1/2`
are the same answer, and `5\\text{ cm}` matches `5`. Its own signal-based time-outs are switched
off in favour of the verifier's per-call limit (one timer, not two fighting over SIGALRM).
"""

from __future__ import annotations

import functools
import logging

from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.format import answer_tag_content, check_format_param, format_score
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


def extract_answer(response: str) -> str | None:
    """The final answer: last `\\boxed{}` if any, else the last `<answer>...</answer>` body."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    return answer_tag_content(response)


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


@register_verifier("math")
class MathVerifier(Verifier):
    """Accuracy 1 if the extracted answer equals the ground truth (math-verify). Format: see
    `mmrl.verifiers.format` (by default 1 when an answer could be extracted)."""

    def check_sample(self, sample: Sample) -> None:
        check_format_param(sample)
        gold = sample.reward_model.ground_truth
        field = "reward_model.ground_truth"
        if not isinstance(gold, (str, int, float)) or isinstance(gold, bool):
            raise SampleFieldError(
                field, f"must be a string or number for the math verifier, got {type(gold).__name__}"
            )
        text = extract_answer(str(gold)) or str(gold)
        if not text.strip():
            raise SampleFieldError(field, "is empty")
        if not _parse(text):
            raise SampleFieldError(field, f"math-verify cannot parse {text!r}")

    def warm_up(self) -> None:
        from math_verify import verify

        verify(_parse("\\frac{1}{2}"), _parse("0.5"), timeout_seconds=None)

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        from math_verify import verify

        gold_text = extract_answer(str(sample.reward_model.ground_truth)) or str(
            sample.reward_model.ground_truth
        )
        answer = extract_answer(response)
        accuracy = 0.0
        if answer:
            predicted = _parse(answer)
            if predicted and verify(
                list(_parse_gold(gold_text)), predicted, timeout_seconds=None, raise_on_error=True
            ):
                accuracy = 1.0
        fmt = format_score(response, sample, answer is not None)
        return VerifierResult(
            score=mix_score(sample, accuracy, fmt),
            components={"accuracy": accuracy, "format": fmt},
            extracted=answer,
        )
