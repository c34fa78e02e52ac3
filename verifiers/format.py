"""Format rewards: is the response shaped the way the sample asks?

- `think_answer_format`: V-Triune's structure reward, 0.25 for each of `<think>\\n`,
  `\\n</think>\\n`, `\\n<answer>\\n`, `\\n</answer>` present exactly once.
- `answer_present_format`: 1.0 when a final answer can be extracted at all.

A sample picks one with `verifier_params.format`: `"answer"` (default) or `"think_answer"`.
"""

from __future__ import annotations

import re

from mmrl.types import Sample

THINK_ANSWER_TAGS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
FORMATS = ("answer", "think_answer")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def think_answer_format(text: str) -> float:
    """0.25 per V-Triune tag that occurs exactly once (0.0 .. 1.0)."""
    return 0.25 * sum(1 for tag in THINK_ANSWER_TAGS if text.count(tag) == 1)


def answer_tag_content(text: str) -> str | None:
    """Body of the last `<answer>...</answer>`, stripped; None when there is none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


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
