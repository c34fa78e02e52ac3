"""The OCR reward of flow-GRPO: how well the text rendered in an image matches the text asked for.

The image is read by rapidocr (PP-OCR detection + recognition, ONNX models bundled with the
package: nothing is downloaded); recognised lines with confidence >= `text_score` are joined.
Both sides are lower-cased and stripped of spaces; then, as flow-GRPO's `OcrScorer` does::

    d = 0 if target in recognised else edit_distance(recognised, target)
    reward = 1 - min(d, len(target)) / len(target)

The target of item i is `texts[i]` if that field is given, else the first double-quoted span of
`prompts[i]` (`A sign that says "Open 24 hours"` -> `Open 24 hours`; curly quotes too).

rapidocr runs on onnxruntime's CPU provider here, so the model is `cpu_only`; `memory_bytes`
reports the size of the ONNX models it has loaded.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mmrl.rewards.base import (
    RewardInputs,
    RewardModel,
    RewardModelError,
    RewardOutput,
    register_reward_model,
)
from mmrl.verifiers.text import levenshtein

_QUOTED = re.compile(r"[\"“”](.+?)[\"“”]", re.S)


def target_from_prompt(prompt: str) -> str | None:
    """The first double-quoted span of `prompt` (straight or curly quotes), or None."""
    match = _QUOTED.search(prompt)
    return match.group(1) if match else None


def ocr_reward(recognised: str, target: str) -> float:
    """flow-GRPO's OCR reward: 1 - min(edit distance, len) / len, after lower-casing and removing
    spaces on both sides; 1 if the target occurs in the recognised text."""
    recognised = recognised.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    if not target:
        raise ValueError("OCR reward: the target text is empty")
    distance = 0 if target in recognised else levenshtein(recognised, target)
    return 1.0 - min(distance, len(target)) / len(target)


@register_reward_model("ocr")
class OcrReward(RewardModel):
    """flow-GRPO's OCR reward with rapidocr; components: `ocr` (the reward) and, per item, the
    recognised text's length (`ocr_chars`)."""

    requires = ("images",)
    cpu_only = True

    def __init__(
        self,
        text_score: float = 0.5,
        det_model_path: str | None = None,
        rec_model_path: str | None = None,
        num_threads: int = -1,
        device: str = "cpu",
    ):
        super().__init__("cpu")
        from rapidocr import RapidOCR

        params: dict[str, Any] = {
            "Global.use_cls": False,  # flow-GRPO: use_angle_cls=False
            "Global.text_score": text_score,
            "Global.log_level": "critical",
            "EngineConfig.onnxruntime.intra_op_num_threads": num_threads,
        }
        for key, path in (("Det.model_path", det_model_path), ("Rec.model_path", rec_model_path)):
            if path is not None:
                if not os.path.isfile(path):
                    raise FileNotFoundError(
                        f"ocr: {key} {path!r} does not exist (expected a PP-OCR ONNX model)"
                    )
                params[key] = path
        self.engine = RapidOCR(params=params)
        self.last_texts: list[str] = []
        # Load the detection and recognition sessions now, not inside the first timed call.
        warm = Image.new("RGB", (160, 64), "white")
        ImageDraw.Draw(warm).text((8, 8), "ok", fill="black", font=ImageFont.load_default(size=40))
        self.read(warm)

    def read(self, image: Image.Image) -> str:
        """The text rapidocr reads in `image` (lines joined without separator, as flow-GRPO)."""
        result = self.engine(np.asarray(image.convert("RGB"))[:, :, ::-1])  # rapidocr wants BGR arrays
        return "".join(result.txts) if result.txts else ""

    def memory_bytes(self) -> int:
        total = 0
        for part in (self.engine.text_det, self.engine.text_rec):
            path = getattr(getattr(getattr(part, "session", None), "session", None), "_model_path", None)
            if path and os.path.isfile(path):
                total += os.path.getsize(path)
        return total

    def score_inputs(self, x: RewardInputs) -> RewardOutput:
        targets = x.fields.get("texts")
        if targets is None:
            if x.prompts is None:
                raise RewardModelError("reward model 'ocr' needs a 'texts' field or prompts with quoted text")
            targets = []
            for i, prompt in enumerate(x.prompts):
                target = target_from_prompt(prompt)
                if not target or not target.strip():
                    raise RewardModelError(f"ocr: prompt {i} has no double-quoted text to render: {prompt!r}")
                targets.append(target)
        texts = [self.read(image) for image in x.images]
        self.last_texts = texts
        scores = [ocr_reward(text, str(target)) for text, target in zip(texts, targets)]
        assert len(scores) == x.n
        return RewardOutput(
            scores=scores, components={"ocr": list(scores), "ocr_chars": [float(len(t)) for t in texts]}
        )
