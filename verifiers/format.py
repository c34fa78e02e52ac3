"""Format rewards: is the response shaped the way the sample asks?

- `think_answer_format`: V-Triune's structure reward, 0.25 for each of `<think>\\n`,
  `\\n</think>\\n`, `\\n<answer>\\n`, `\\n</answer>` present exactly once.
- `answer_present_format`: 1.0 when a final answer can be extracted at all.

A sample picks one with `verifier_params.format`: `"answer"` (default) or `"think_answer"`.
"""

from __future__ import annotations

from mmrl.types import Sample

THINK_ANSWER_TAGS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
FORMATS = ("answer", "think_answer")


def think_answer_format(text: str) -> float:
    """0.25 per V-Triune tag that occurs exactly once (0.0 .. 1.0)."""
    return 0.25 * sum(1 for tag in THINK_ANSWER_TAGS if text.count(tag) == 1)


def answer_tag_content(text: str) -> str | None:
    """Body of the last `<answer>...</answer>`, stripped; None when there is none.

    Two `rfind`s, not a regex: a lazy `<answer>(.*?)</answer>` is quadratic on a response
    full of unclosed `<answer>` tags."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    return text[start + len("<answer>") : end].strip()


def format_score(text: str, sample: Sample, answer_found: bool) -> float:
    """The format component the sample asks for (`verifier_params.format`)."""
    kind = sample.reward_model.verifier_params.get("format", "answer")
    if kind == "think_answer":
        return think_answer_format(text)
    return 1.0 if answer_found else 0.0


def check_format_param(sample: Sample) -> None:
    from mmrl.verifiers.registry import SampleFieldError

    kind = sample.reward_model.verifier_params.get("format", "answer")
    if kind not in FORMATS:
        raise SampleFieldError(
            "reward_model.verifier_params.format", f"must be one of {list(FORMATS)}, got {kind!r}"
        )
