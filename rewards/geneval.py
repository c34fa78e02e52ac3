"""The `geneval` reward: GenEval-style prompt following of generated images, by rule.

Each prompt is parsed with the GenEval-style grammar (`mmrl.datasets.geneval.parse_prompt`);
an object prompt ("two red circles", "a blue square left of a green triangle") is scored by the
`geneval` verifier's rules (`mmrl.verifiers.geneval`: partial credit for colour, count, shape
and position, times `clean`), a text prompt (`the text "cat"`) by the OCR reward (`ocr`, built
on first use: rapidocr loads its models then). Components: `correct` (GenEval's strict verdict;
the OCR reward's exact match for text), and the verifier's `colour`, `count`, `shape`,
`shape_fit`, `position`, `clean`, `noise` (NaN for text prompts: they do not apply there, and a 1
would inflate a mixed batch's means of them; average them with `nanmean`).

It runs on the host (image analysis in NumPy), whatever device it is configured with. A prompt
outside the grammar is a `RewardModelError` naming it (the trainer counts the batch as failed
for this reward, never scores it silently).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmrl.rewards.base import (
    ImagesLike,
    RewardModel,
    RewardModelError,
    RewardOutput,
    as_pil_images,
    register_reward_model,
)

PARTS = ("correct", "colour", "count", "shape", "shape_fit", "position", "clean", "noise")
NOISE_UNIT = 10.0
"""Grey levels of background noise (the verifier's `noise`) that cost `background` reward."""


@register_reward_model("geneval")
class GenEvalReward(RewardModel):
    """Partial-credit GenEval-style accuracy per image (see the module docs)."""

    requires = ("images", "prompts")
    cpu_only = True

    def __init__(
        self,
        strict: bool = False,
        shape_fit: float = 0.0,
        correct: float = 0.0,
        background: float = 0.0,
        device: str | torch.device = "cpu",
    ):
        """`strict`: the reward is GenEval's 0/1 `correct` instead of the partial credit.
        `shape_fit`: add this weight times the graded `shape_fit` (times `clean`) to an object
        prompt's score, so that a blob a little closer to the asked shape scores a little more
        even while the verdict is still wrong (the verdict and `correct` are unchanged). With
        `strict` the term is added to the 0/1 verdict the same way. `correct`: add this weight
        times the strict 0/1 verdict to the partial credit (not with `strict`, whose score the
        verdict already is), so that crossing into "right" is worth more than one more credit.
        `background`: subtract this weight times the background noise (the verifier's `noise`,
        the standard deviation of the background pixels away from the objects) in units of
        `NOISE_UNIT` grey levels, so that speckle and smears cost reward (none of the credits
        sees them: they stay under the foreground distance)."""
        super().__init__("cpu")
        if shape_fit < 0:
            raise ValueError(f"geneval: shape_fit must be >= 0, got {shape_fit}")
        if correct < 0:
            raise ValueError(f"geneval: correct must be >= 0, got {correct}")
        if background < 0:
            raise ValueError(f"geneval: background must be >= 0, got {background}")
        if strict and correct:
            raise ValueError(
                "geneval: correct is a bonus on the partial credit; with strict the verdict is the score"
            )
        self.strict = strict
        self.shape_fit = float(shape_fit)
        self.correct = float(correct)
        self.background = float(background)
        self._ocr = None

    def accepts_prompt(self, prompt: str) -> bool:
        """True when `prompt` parses in the GenEval-style grammar."""
        from mmrl.datasets.geneval import parse_prompt

        try:
            parse_prompt(prompt)
        except ValueError:
            return False
        return True

    def score_with_components(
        self,
        images: ImagesLike | None = None,
        prompts: Sequence[str] | None = None,
        responses: Sequence[str] | None = None,
        **fields: Sequence[Any],
    ) -> RewardOutput:
        from mmrl.datasets.geneval import parse_prompt
        from mmrl.verifiers.geneval import analyse, check_spec

        self.check_inputs(images, prompts, responses, fields)
        specs = []
        for i, prompt in enumerate(prompts or []):
            try:
                specs.append(parse_prompt(prompt))
            except ValueError as exc:
                raise RewardModelError(f"geneval: prompt {i}: {exc}") from None
        pil = as_pil_images(images)
        scores: list[float] = [0.0] * len(pil)
        # the object attributes do not apply to text prompts: NaN there, not a free 1.0
        parts: dict[str, list[float]] = {k: [float("nan")] * len(pil) for k in PARTS}
        text_rows = [i for i, s in enumerate(specs) if s.text is not None]
        for i, (image, spec) in enumerate(zip(pil, specs)):
            if spec.text is not None:
                continue
            found = check_spec(spec, analyse(image))
            scores[i] = found["correct"] if self.strict else found["accuracy"]
            scores[i] += self.shape_fit * found["shape_fit"] * found["clean"]
            scores[i] += self.correct * found["correct"]
            scores[i] -= self.background * found["noise"] / NOISE_UNIT
            for k in PARTS:
                parts[k][i] = found[k]
        if text_rows:
            if self._ocr is None:
                from mmrl.rewards.ocr import OcrReward

                self._ocr = OcrReward()
            out = self._ocr.score_with_components(
                images=[pil[i] for i in text_rows], texts=[specs[i].text for i in text_rows]
            )
            for i, score in zip(text_rows, out.scores):
                scores[i] = float(score == 1.0) if self.strict else score
                parts["correct"][i] = float(score == 1.0)
        return RewardOutput(scores=scores, components=parts)
