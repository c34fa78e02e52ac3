"""The VLM judge: its parser on well-formed and malformed outputs, and its plumbing through the
rollout engine with a tiny random VLM (which writes gibberish: every output must then be counted
as unparsed, never silently scored)."""

from __future__ import annotations

import pytest
import torch

from mmrl.models.loading import make_policy
from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm
from mmrl.rewards import RewardModelError, get_reward_model
from mmrl.rewards.vlm_judge import VLMJudge, parse_judge_score


@pytest.mark.parametrize(
    "text, score, raw",
    [
        ("Score: 7", 0.7, 7.0),
        ("The answer is right but terse.\nScore: 8", 0.8, 8.0),
        ("score = 10", 1.0, 10.0),
        ("Rating: **6**", 0.6, 6.0),
        ("Grade: 3.5", 0.35, 3.5),
        ("Score: 4/5", 0.8, 4.0),  # a fraction is taken as written
        ("[[9]]", 0.9, 9.0),  # MT-Bench
        ("<score>2</score>", 0.2, 2.0),
        ("reasoning... \\boxed{5}", 0.5, 5.0),
        ("7", 0.7, 7.0),
        ("0", 0.0, 0.0),
        ("Score: 3 at first, but on reflection Score: 6", 0.6, 6.0),  # the last one counts
        ("Score: 2. \\boxed{9}", 0.9, 9.0),  # boxed takes precedence
    ],
)
def test_parser_reads_well_formed_outputs(text, score, raw):
    parsed = parse_judge_score(text)
    assert parsed.score == pytest.approx(score) and parsed.raw == raw and parsed.error is None


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "no grade found"),
        ("The response is good.", "no grade found"),
        ("Score: excellent", "no grade found"),
        ("Score: 11", "outside [0, 10]"),
        ("Score: -1", "outside [0, 10]"),
        ("Score: 6/5", "not a fraction"),
        ("Score: 3/0", "not a fraction"),
        ("I would give it 7 out of 10 maybe", "no grade found"),  # a bare number in prose is not a grade
    ],
)
def test_parser_rejects_malformed_outputs_with_a_reason(text, reason):
    parsed = parse_judge_score(text)
    assert parsed.score is None and reason in parsed.error


def test_parser_maps_other_scales():
    assert parse_judge_score("Score: 3", low=1, high=5).score == pytest.approx(0.5)
    assert parse_judge_score("Score: 0", low=1, high=5).error == "grade 0 outside [1, 5]"


@pytest.fixture(scope="module")
def policy():
    spec = TinyVLMSpec()
    return make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))


@pytest.fixture(scope="module")
def judge(policy):
    return get_reward_model("vlm_judge", policy=policy, max_new_tokens=8)


def test_judge_prompts_carry_rubric_question_answer_and_reference(judge):
    samples = judge.build_samples(None, ["What is 2+2?"], ["5"], ["4"])
    text = samples[0].prompt[0]["content"]
    assert "Question: What is 2+2?" in text and "Response: 5" in text and "Reference answer: 4" in text
    assert judge.rubric in text and "from 0 to 10" in text and not samples[0].images
    image_samples = judge.build_samples(torch.rand(1, 3, 64, 64), ["a red cat"], None, None)
    assert image_samples[0].prompt[0]["content"].startswith("<image>")
    assert "Prompt: a red cat" in image_samples[0].prompt[0]["content"] and len(image_samples[0].images) == 1


def test_random_judge_outputs_are_counted_as_unparsed(judge):
    out = judge.score_with_components(prompts=["What is 2+2?", "Name a colour"], responses=["4", "blue"])
    assert len(judge.last_outputs) == 2 and all(isinstance(t, str) for t in judge.last_outputs)
    for text, score, failed, error in zip(
        judge.last_outputs, out.scores, out.components["judge_parse_failed"], judge.last_errors
    ):
        parsed = parse_judge_score(text)
        assert score == (parsed.score if parsed.score is not None else 0.0)
        assert failed == float(parsed.score is None) and (error is None) == (parsed.score is not None)
    # Greedy decoding: the same grades every time.
    first = list(judge.last_outputs)
    judge.score(prompts=["What is 2+2?", "Name a colour"], responses=["4", "blue"])
    assert judge.last_outputs == first


def test_judge_grades_images(judge):
    out = judge.score_with_components(images=torch.rand(2, 3, 64, 64), prompts=["a cat", "a dog"])
    assert len(out.scores) == 2 and len(judge.last_outputs) == 2


class _ScriptedEngine:
    """Stands in for the rollout engine: answers each judge prompt from a script."""

    def __init__(self, answers):
        self.answers = answers
        self.seen = []

    def generate(self, samples, params):
        self.seen += samples
        assert params.greedy

        class _Batch:
            texts = [
                self.answers[s.prompt[0]["content"].split("Response: ")[1].split("\n")[0]] for s in samples
            ]

        return _Batch()


def test_grades_flow_to_rewards_in_order(policy):
    judge = VLMJudge(policy=policy, fail_score=-1.0)
    judge.engine = _ScriptedEngine({"a": "Score: 9", "b": "no idea", "c": "[[2]]"})
    out = judge.score_with_components(prompts=["q"] * 3, responses=["a", "b", "c"], references=["r"] * 3)
    assert out.scores == pytest.approx([0.9, -1.0, 0.2])
    assert out.components["judge_parse_failed"] == [0.0, 1.0, 0.0]
    assert judge.last_errors[1].startswith("no grade found")
    # The evaluation module's judge(prompt, response, reference) -> float.
    assert judge.judge("q", "c", "r") == pytest.approx(0.2)


def test_judge_loads_from_a_folder(tmp_path, policy, judge):
    policy.model.save_pretrained(tmp_path)
    policy.processor.save_pretrained(tmp_path)
    from_disk = get_reward_model("vlm_judge", model_path=str(tmp_path), max_new_tokens=8)
    from_disk.score(prompts=["What is 2+2?"], responses=["4"])
    judge.score(prompts=["What is 2+2?"], responses=["4"])
    assert from_disk.last_outputs == judge.last_outputs
    assert from_disk.memory_bytes() == judge.memory_bytes() > 0


def test_bad_configuration_and_inputs_are_named(policy, judge):
    with pytest.raises(ValueError, match="exactly one of model_path"):
        VLMJudge()
    with pytest.raises(ValueError, match="max_score"):
        VLMJudge(policy=policy, min_score=5, max_score=5)
    with pytest.raises(RewardModelError, match="needs responses"):
        judge.score(prompts=["q"])
    with pytest.raises(FileNotFoundError, match="no such local folder"):
        VLMJudge(model_path="/nonexistent/judge")
