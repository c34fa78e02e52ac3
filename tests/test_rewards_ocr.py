"""flow-GRPO's OCR reward with rapidocr's bundled PP-OCR models on images rendered with PIL."""

from __future__ import annotations

import pytest
from PIL import Image, ImageDraw, ImageFont

from mmrl.rewards import RewardModelError, get_reward_model
from mmrl.rewards.ocr import ocr_reward, target_from_prompt


def render(text: str, size: tuple[int, int] = (360, 96)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((12, 20), text, fill="black", font=ImageFont.load_default(size=40))
    return image


@pytest.fixture(scope="module")
def ocr():
    return get_reward_model("ocr")


def test_reward_formula_by_hand():
    assert ocr_reward("Open 24h", "open24h") == 1.0  # spaces and case ignored
    assert ocr_reward("sale: open24h now", "Open 24h") == 1.0  # contained: distance 0
    assert ocr_reward("open12h", "open24h") == pytest.approx(1 - 2 / 7)  # two substitutions
    assert ocr_reward("opn24h", "open24h") == pytest.approx(1 - 1 / 7)  # one deletion
    assert ocr_reward("", "abc") == 0.0  # distance 3 = len
    assert ocr_reward("completely different", "ab") == 0.0  # distance capped at len
    with pytest.raises(ValueError, match="empty"):
        ocr_reward("x", "  ")


def test_target_is_the_quoted_text():
    assert target_from_prompt('A neon sign that says "Open 24h" at night') == "Open 24h"
    assert target_from_prompt("A poster reading “Big Sale” in red") == "Big Sale"
    assert target_from_prompt("no quotes") is None


def test_rendered_requested_text_scores_one_and_wrong_text_lower(ocr):
    prompts = ['a shop sign that says "Open 24h"'] * 4
    images = [render("Open 24h"), render("Open 12h"), render("Closed"), Image.new("RGB", (360, 96), "white")]
    out = ocr.score_with_components(images=images, prompts=prompts)
    assert ocr.last_texts[0].replace(" ", "").lower() == "open24h"
    assert out.scores[0] == 1.0
    assert out.scores[1] == pytest.approx(1 - 2 / 7)  # read as "Open 12h": two characters off
    assert out.scores[2] == 0.0  # nothing in common: distance capped at the length
    assert out.scores[3] == 0.0  # a blank image reads as nothing
    assert out.components["ocr"] == out.scores
    assert out.components["ocr_chars"][3] == 0.0


def test_texts_field_overrides_the_prompt_and_bad_prompts_are_named(ocr):
    image = render("HELLO")
    assert ocr.score(images=[image], texts=["hello"]) == [1.0]
    assert ocr.score(images=[image], prompts=['says "bye"'], texts=["hello"]) == [1.0]
    with pytest.raises(RewardModelError, match="prompt 1 has no double-quoted text"):
        ocr.score(images=[image, image], prompts=['"hello"', "hello"])
    with pytest.raises(RewardModelError, match="needs 'images'"):
        ocr.score(prompts=['"hello"'])


def test_ocr_reports_its_models_and_stays_on_the_host(ocr):
    assert ocr.cpu_only and ocr.to("cuda").device.type == "cpu"
    assert ocr.memory_bytes() > 1_000_000  # the det + rec ONNX models it loaded


def test_a_missing_model_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Rec.model_path .*rec\.onnx.*does not exist"):
        get_reward_model("ocr", rec_model_path=str(tmp_path / "rec.onnx"))


def test_geneval_reward_scores_text_prompts_with_ocr(ocr):
    """The `geneval` reward routes `the text "..."` prompts to this OCR reward (its own engine
    is replaced by the module's, already loaded)."""
    import numpy as np

    from mmrl.datasets.geneval import draw, parse_prompt
    from mmrl.rewards import get_reward_model

    reward = get_reward_model("geneval")
    reward._ocr = ocr
    rng = np.random.default_rng(0)
    images = [draw(parse_prompt(f'the text "{w}"'), rng, 128) for w in ("cat", "map")]
    out = reward.score_with_components(images=images, prompts=['the text "cat"', 'the text "sun"'])
    assert out.scores == [1.0, 0.0] and out.components["correct"] == [1.0, 0.0]
