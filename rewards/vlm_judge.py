"""A generative reward: a VLM, run through mmrl's rollout engine, grades against a rubric.

Two uses, one model:

- answers: `score(prompts=questions, responses=answers, references=refs)` asks the judge to
  grade each answer (with the sample's image when `images` is given) against the rubric and
  the reference answer;
- images: `score(images=generated, prompts=prompts)` (no responses) asks how well each image
  follows its prompt.

The judge is any local Hugging Face VLM folder (`model_path`, loaded by
`mmrl.models.loading.load_policy`) or a `Policy` passed in; it decodes greedily, so a score is
reproducible. Its output is parsed by `parse_judge_score`; an output with no usable score gets
`fail_score` (default 0) and is counted in the `judge_parse_failed` component, with the reason
kept in `last_errors`: nothing is scored silently.

`VLMJudge.judge(prompt, response, reference) -> float` is the callable the evaluation module
accepts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmrl.rewards.base import (
    ImagesLike,
    RewardInputs,
    RewardModel,
    RewardModelError,
    RewardOutput,
    as_pil_images,
    register_reward_model,
)
from mmrl.types import IMAGE_PLACEHOLDER, RewardSpec, Sample

DEFAULT_RUBRIC = (
    "Grade the response for correctness against the reference answer and for clarity. "
    "10 means fully correct and clear, 0 means wrong or missing."
)
"""The default grading rubric for answers."""
DEFAULT_IMAGE_RUBRIC = (
    "Grade how faithfully the image shows everything the prompt asks for, and its visual quality. "
    "10 means perfect, 0 means unrelated."
)
"""The default grading rubric for generated images."""
ANSWER_TEMPLATE = (
    "You are a strict grader. {rubric}\n"
    "Question: {prompt}\n"
    "Reference answer: {reference}\n"
    "Response: {response}\n"
    "Reply with one line 'Score: N', N an integer from {low} to {high}."
)
"""Judge prompt for answers; `{rubric} {prompt} {reference} {response} {low} {high}` are filled."""
IMAGE_TEMPLATE = (
    "You are a strict grader. {rubric}\n"
    "Prompt: {prompt}\n"
    "Reply with one line 'Score: N', N an integer from {low} to {high}."
)
"""Judge prompt for images (the image comes first); `{rubric} {prompt} {low} {high}` are filled."""

_NUM = r"([-+]?\d+(?:\.\d+)?)"
# In priority order; the last match of the first pattern that matches anywhere wins (a judge
# that reasons first and concludes with its score).
_PATTERNS = [
    re.compile(r"\\boxed\{\s*" + _NUM + r"\s*(?:/\s*" + _NUM + r")?\s*\}"),
    re.compile(r"<score>\s*" + _NUM + r"\s*(?:/\s*" + _NUM + r")?\s*</score>", re.I),
    re.compile(r"\[\[\s*" + _NUM + r"\s*(?:/\s*" + _NUM + r")?\s*\]\]"),
    re.compile(
        r"\b(?:score|rating|grade)\b\s*(?:is)?\s*[:=]?\s*\**\s*" + _NUM + r"\s*(?:/\s*" + _NUM + r")?", re.I
    ),
    re.compile(r"^\s*" + _NUM + r"\s*(?:/\s*" + _NUM + r")?\s*\.?\s*$"),
]


@dataclass
class JudgeParse:
    """A judge output, parsed."""

    score: float | None
    """The grade mapped to [0, 1]; None if the output holds no usable grade."""
    raw: float | None = None
    """The number the judge wrote."""
    error: str | None = None
    """Why no grade could be read."""


def parse_judge_score(text: str, low: float = 0.0, high: float = 10.0) -> JudgeParse:
    """Read a grade from a judge's output and map it to [0, 1].

    Accepted, in this order of precedence: `\\boxed{N}`, `<score>N</score>`, `[[N]]`
    (MT-Bench), `Score: N` / `Rating: N` / `Grade: N`, or an output that is just `N`; each
    optionally `N/M` (then the grade is N/M, with 0 <= N <= M). Otherwise
    `(N - low) / (high - low)`, and N must lie in [low, high]. The last occurrence counts.
    """
    for pattern in _PATTERNS:
        matches = pattern.findall(text)
        if not matches:
            continue
        number, denominator = matches[-1]
        raw = float(number)
        if denominator:
            den = float(denominator)
            if den <= 0 or not 0 <= raw <= den:
                return JudgeParse(None, raw, f"grade {number}/{denominator} is not a fraction in [0, 1]")
            return JudgeParse(raw / den, raw)
        if not low <= raw <= high:
            return JudgeParse(None, raw, f"grade {number} outside [{low:g}, {high:g}]")
        return JudgeParse((raw - low) / (high - low), raw)
    snippet = text if len(text) <= 80 else text[:77] + "..."
    return JudgeParse(None, None, f"no grade found in judge output {snippet!r}")


@register_reward_model("vlm_judge")
class VLMJudge(RewardModel):
    """A VLM grading answers or images against a rubric; components: `judge` (the reward in
    [0, 1], `fail_score` when unparsed) and `judge_parse_failed` (1 where unparsed)."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        policy: Any = None,
        rubric: str = DEFAULT_RUBRIC,
        image_rubric: str = DEFAULT_IMAGE_RUBRIC,
        answer_template: str = ANSWER_TEMPLATE,
        image_template: str = IMAGE_TEMPLATE,
        min_score: float = 0.0,
        max_score: float = 10.0,
        max_new_tokens: int = 64,
        fail_score: float = 0.0,
        batch_size: int = 16,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__(device)
        from mmrl.models.loading import load_policy
        from mmrl.rollout.hf import HFRolloutEngine, SamplingParams

        if (model_path is None) == (policy is None):
            raise ValueError("vlm_judge: give exactly one of model_path (a local VLM folder) or policy")
        if not max_score > min_score:
            raise ValueError(f"vlm_judge: max_score {max_score} must exceed min_score {min_score}")
        self.policy = load_policy(model_path, dtype=dtype) if policy is None else policy
        self.policy.model.eval().requires_grad_(False).to(self.device)
        self.engine = HFRolloutEngine.from_policy(self.policy, max_batch_rows=batch_size)
        self.params = SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens)
        self.rubric, self.image_rubric = rubric, image_rubric
        self.answer_template, self.image_template = answer_template, image_template
        self.low, self.high = float(min_score), float(max_score)
        self.fail_score = fail_score
        self.last_outputs: list[str] = []
        self.last_errors: list[str | None] = []

    def torch_modules(self) -> dict[str, torch.nn.Module]:
        return {"judge": self.policy.model}

    def to(self, device: str | torch.device) -> VLMJudge:
        super().to(device)
        # The engine masks logits with `blocked` on the logits' device.
        self.policy.blocked = self.policy.blocked.to(self.device)
        self.engine.blocked = self.policy.blocked
        return self

    def build_samples(
        self,
        images: ImagesLike | None,
        prompts: Sequence[str] | None,
        responses: Sequence[str] | None,
        references: Sequence[Any] | None,
    ) -> list[Sample]:
        """The judge's prompts as samples (one per item), with the image first where given."""
        n = len(prompts) if prompts is not None else len(responses or [])
        pil = as_pil_images(images) if images is not None else [None] * n
        samples = []
        for i in range(n):
            prompt = "" if prompts is None else str(prompts[i])
            if responses is not None:
                reference = "(none)" if references is None or references[i] is None else str(references[i])
                text = self.answer_template.format(
                    rubric=self.rubric, prompt=prompt, reference=reference, response=str(responses[i]),
                    low=f"{self.low:g}", high=f"{self.high:g}",
                )  # fmt: skip
            else:
                text = self.image_template.format(
                    rubric=self.image_rubric, prompt=prompt, low=f"{self.low:g}", high=f"{self.high:g}"
                )
            image = pil[i]
            samples.append(
                Sample(
                    data_source="vlm_judge",
                    prompt=[
                        {"role": "user", "content": (IMAGE_PLACEHOLDER if image is not None else "") + text}
                    ],
                    images=[image] if image is not None else [],
                    ability="judge",
                    reward_model=RewardSpec(ground_truth="", verifier="vlm_judge"),
                    extra_info={"id": f"vlm_judge/{i}"},
                )
            )
        return samples

    def generate(self, samples: list[Sample]) -> list[str]:
        """The judge's greedy outputs, in order (items with and without an image batched apart)."""
        outputs: list[str] = [""] * len(samples)
        for has_image in (True, False):
            idx = [i for i, s in enumerate(samples) if bool(s.images) == has_image]
            if idx:
                batch = self.engine.generate([samples[i] for i in idx], self.params)
                for i, text in zip(idx, batch.texts):
                    outputs[i] = text
        return outputs

    def score_inputs(self, x: RewardInputs) -> RewardOutput:
        if x.responses is None and (x.images is None or x.prompts is None):
            raise RewardModelError(
                "vlm_judge needs responses (to grade answers) or images and prompts (to grade images)"
            )
        outputs = self.generate(
            self.build_samples(x.images, x.prompts, x.responses, x.fields.get("references"))
        )
        parsed = [parse_judge_score(text, self.low, self.high) for text in outputs]
        self.last_outputs = outputs
        self.last_errors = [p.error for p in parsed]
        scores = [self.fail_score if p.score is None else p.score for p in parsed]
        assert all(math.isfinite(s) for s in scores)
        return RewardOutput(
            scores=scores,
            components={
                "judge": list(scores),
                "judge_parse_failed": [float(p.score is None) for p in parsed],
            },
        )

    def judge(self, prompt: str, response: str, reference: Any = None) -> float:
        """Grade one answer in [0, 1]: the `judge(prompt, response, reference)` callable of evaluation."""
        return self.score(prompts=[prompt], responses=[response], references=[reference])[0]
