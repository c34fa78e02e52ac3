"""Answer-size caps applied before a verifier parses an answer (`mmrl.types.AnswerLimits`).

A policy can learn to answer with a 40,000-character sum, braces nested thousands deep or
twenty thousand listed numbers; each of those runs math-verify into its time limit (5 s of a
verifier worker's CPU per response), and each scores 0 anyway. `answer_limit_error` measures
the answer in one linear pass and names the first cap it exceeds, so the verifier can refuse
it at once: an error result whose message starts with the kind (`answer_too_long: ...`).
"""

from __future__ import annotations

import re

from mmrl.types import AnswerLimits

ANSWER_LIMIT_KINDS = ("answer_too_long", "answer_too_deep", "answer_too_many_tokens")
"""The error kinds of answers refused by a cap (the prefix of their error message)."""

_TOKEN = re.compile(r"\\[A-Za-z]+|\d+(?:\.\d+)?|[A-Za-z]+|\S")
_OPEN, _CLOSE = frozenset("{(["), frozenset("})]")


def nesting_depth(text: str) -> int:
    """The deepest nesting of `{ ( [` brackets in `text` (closers without an opener ignored)."""
    depth = deepest = 0
    for ch in text:
        if ch in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in _CLOSE and depth:
            depth -= 1
    return deepest


def count_tokens(text: str, stop_after: int = 0) -> int:
    """Tokens of `text` as `AnswerLimits.max_tokens` counts them; with `stop_after` > 0,
    counting stops once past it (the exact count is not needed then)."""
    n = 0
    for _ in _TOKEN.finditer(text):
        n += 1
        if stop_after and n > stop_after:
            break
    return n


def answer_limit_error(answer: str, limits: AnswerLimits) -> str | None:
    """Why `answer` is past a cap of `limits` (`"<kind>: ..."`), or None. Linear in its length."""
    if limits.max_chars and len(answer) > limits.max_chars:
        return f"answer_too_long: the answer has {len(answer)} characters (limit {limits.max_chars})"
    if limits.max_depth:
        depth = nesting_depth(answer)
        if depth > limits.max_depth:
            return f"answer_too_deep: brackets nested {depth} deep in the answer (limit {limits.max_depth})"
    if limits.max_tokens and count_tokens(answer, stop_after=limits.max_tokens) > limits.max_tokens:
        return f"answer_too_many_tokens: the answer has more than {limits.max_tokens} tokens"
    return None


def answer_limit_kind(error: str | None) -> str | None:
    """The cap kind of an error message made by `answer_limit_error`, else None."""
    if error is None:
        return None
    kind = error.split(":", 1)[0]
    return kind if kind in ANSWER_LIMIT_KINDS else None


def is_refusal(error: str | None) -> bool:
    """Whether `error` is an answer refused by a cap: a verdict on the response (it scores 0
    whatever `reward.on_error` says), not a failure to score it. Under `on_error=drop` a
    babbling policy would otherwise escape the penalty of its refused answers."""
    return answer_limit_kind(error) is not None
