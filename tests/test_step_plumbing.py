"""The training step reaches the verifiers through /get_reward, the TRL adapter and the veRL
adapter, so V-Triune's dynamic IoU threshold advances for those trainers too."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmrl.integrations.trl import make_reward_function, trainer_context
from mmrl.integrations.verl import MMRLRewardManager
from mmrl.server.protocol import RequestError, parse_get_reward
from mmrl.types import VerifyContext
from mmrl.verifiers import get_verifier
from mmrl.verifiers.detection import dynamic_iou_threshold

KNOWN = frozenset({"math", "detection"})


class FakeClient:
    """Scores locally with the real verifiers and records the context it was given."""

    def __init__(self):
        self.contexts: list[VerifyContext | None] = []

    def score_records(self, records, responses, context=None, sample_index=None):
        from mmrl.server.protocol import fields_sample, parse_record

        self.contexts.append(context)
        index = range(len(responses)) if sample_index is None else sample_index
        ctx = context or VerifyContext()
        out = []
        for j, text in zip(index, responses):
            sample = fields_sample(parse_record(records[j], f"samples[{j}]", KNOWN))
            result = get_verifier(sample.reward_model.verifier)(text, sample, ctx)
            out.append({"score": result.score, "components": result.components, "error": result.error})
        return out


GT = [{"bbox_2d": [0, 0, 100, 100], "label": "cat"}]
# IoU 0.9025 with GT: matched under the early threshold (0.85), not under the late one (0.99).
PRED = json.dumps([{"bbox_2d": [0, 0, 95, 95], "label": "cat"}])
DETECTION = {"ground_truth": GT, "verifier": "detection", "verifier_params": {"iou_threshold": "dynamic"}}


def test_the_dynamic_threshold_depends_on_the_step():
    assert dynamic_iou_threshold(0, 100) == 0.85 and dynamic_iou_threshold(90, 100) == 0.99


def test_get_reward_takes_the_step_from_the_request():
    body = {"query": ["a", "b"], "labels": ["1", "2"], "step": 30, "total_steps": 100}
    batch = parse_get_reward(body, KNOWN, 10, "auto", "math")
    assert [(item[2], item[3]) for item in batch.items] == [(30, 100), (30, 100)]
    body = {"query": ["a"], "labels": ["1"], "context": {"step": 7, "total_steps": 9}}
    assert parse_get_reward(body, KNOWN, 10, "auto", "math").items[0][2:4] == (7, 9)
    # OpenRLHF's own client sends no step: step 0 of 1, as before
    assert parse_get_reward({"query": ["a"], "labels": ["1"]}, KNOWN, 10, "auto", "math").items[0][2:4] == (
        0,
        1,
    )
    with pytest.raises(RequestError, match="step: must be >= 0"):
        parse_get_reward({"query": ["a"], "labels": ["1"], "step": -1}, KNOWN, 10, "auto", "math")


def test_trl_reward_function_scores_at_the_trainer_s_step():
    client = FakeClient()
    reward = make_reward_function(client=client)
    completions = [PRED]
    early = reward(
        prompts=["p"],
        completions=completions,
        reward_model=[DETECTION],
        trainer_state=SimpleNamespace(global_step=0, max_steps=100),
    )
    late = reward(
        prompts=["p"],
        completions=completions,
        reward_model=[DETECTION],
        trainer_state=SimpleNamespace(global_step=90, max_steps=100),
    )
    assert [(c.step, c.total_steps) for c in client.contexts] == [(0, 100), (90, 100)]
    assert early[0] > late[0]
    assert trainer_context(None) is None


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) for i in ids).decode()


def _verl_batch(text: str, step: int | None):
    ids = list(text.encode())
    prompt = torch.zeros(1, 3, dtype=torch.long)
    responses = torch.tensor([ids + [0, 0]])
    mask = torch.cat([torch.ones(1, 3), torch.ones(1, len(ids)), torch.zeros(1, 2)], dim=1).long()
    return SimpleNamespace(
        batch={"prompts": prompt, "responses": responses, "attention_mask": mask},
        non_tensor_batch={
            "data_source": np.array(["coco"], dtype=object),
            "reward_model": np.array([{"ground_truth": GT}], dtype=object),
            "extra_info": np.array([{"reward_model": DETECTION}], dtype=object),
        },
        meta_info={} if step is None else {"global_steps": step},
    )


def test_verl_reward_manager_reads_the_global_step_and_rewards_the_last_token():
    client = FakeClient()
    manager = MMRLRewardManager(_Tokenizer(), total_steps=100, client=client)
    early = manager(_verl_batch(PRED, 0))
    late = manager(_verl_batch(PRED, 90), return_dict=True)
    assert [(c.step, c.total_steps) for c in client.contexts] == [(0, 100), (90, 100)]
    n = len(PRED.encode())
    # early: matched at 0.85; late: unmatched at 0.99, so IoU and completeness are both 0
    assert early[0, n - 1] > 0 and late["reward_tensor"][0, n - 1] == 0
    assert early[0, : n - 1].abs().sum() == 0 and early[0, n:].abs().sum() == 0
    assert late["reward_extra_info"]["error"] == [0.0]
    # a veRL version without global_steps on the reward batch: one call per training step
    counting = MMRLRewardManager(_Tokenizer(), total_steps=10, client=client)
    counting(_verl_batch(PRED, None))
    counting(_verl_batch(PRED, None))
    assert [(c.step, c.total_steps) for c in client.contexts[-2:]] == [(0, 10), (1, 10)]
