"""`reward.update_while_scoring`: the update starts on the first mini-batch's groups while later
groups are still being scored, and it is the same update as waiting for every reward first."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.models.base import builtin_base
from mmrl.models.loading import load_policy
from mmrl.train import grpo
from mmrl.train.data import PromptSampler, load_data
from mmrl.types import VerifyContext

pytestmark = pytest.mark.slow

PLUGINS = str(Path(__file__).parent / "plugins")
BASE = [
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "trainer.mini_batches=2",  # 16 rows: two mini-batches of 2 groups each
    "trainer.eval_size=8",
    "trainer.progress=false",
    "trainer.threads=1",
    "reward.num_workers=1",
    "reward.plugins=[hang_verifier]",
]
# Every row-wise piece of steps b-e: dropped verifier errors, the overlong penalty, the KL in
# the reward, truncated importance sampling.
RECIPE = [
    "reward.on_error=drop",
    "algo.overlong_buffer=4",
    "algo.kl_coef=0.05",
    "algo.kl_in_reward=true",
    "algo.tis=token",
]
TIMING = ("time/", "throughput/")


def _steps(overrides: list[str], marked: str, which=None, steps: int = 3, spy: list | None = None):
    """`steps` GRPO steps from the built-in base, with a verifier that fails (`marked`: error
    or nan) on the training samples `which(samples, cfg)` picks (default every third). Returns
    (metrics per step, initial weights, final weights)."""
    cfg = load_config("vision_reasoning", overrides=[*BASE, *overrides])
    samples, _ = load_data(cfg)
    samples = copy.deepcopy(samples)
    chosen = which(samples, cfg) if which else {s.id for s in samples[::3]}
    for s in samples:
        s.reward_model.verifier = f"{marked}_on_marked"
        s.extra_info[marked] = s.id in chosen
    policy = load_policy(builtin_base(cfg))
    initial = _weights(policy)
    grpo.seed_everything(cfg.trainer.seed)
    t = grpo.make_trainee(cfg, policy, None)
    sampler = PromptSampler(samples, cfg.trainer.seed)
    original_rows = grpo.DeferredRewards.rows

    def rows(self, wanted):
        if spy is not None:
            spy.append(list(wanted))
        return original_rows(self, wanted)

    grpo.DeferredRewards.rows = rows
    try:
        metrics = [grpo.grpo_step(cfg, t, sampler, VerifyContext(k, steps), step=k + 1) for k in range(steps)]
    finally:
        grpo.DeferredRewards.rows = original_rows
        t.close()
    return metrics, initial, _weights(policy)


def _weights(policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


def _untimed(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(TIMING)}


def test_the_update_started_while_scoring_is_the_update_after_all_rewards(mmrl_cache, monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS)  # workers inherit sys.path
    calls: list[list[int]] = []
    piped, initial, piped_weights = _steps(RECIPE, "error", spy=calls)
    waited, _, waited_weights = _steps([*RECIPE, "reward.update_while_scoring=false"], "error")
    # Pipelined: each mini-batch waited for its own two groups only, in order.
    assert calls == [list(range(0, 8)), list(range(8, 16))] * 3
    assert sum(m["verifier/dropped"] for m in piped) > 0  # the drop path was exercised
    assert all("tis/applied_weight_mean" in m and "reward/shaped_mean" in m for m in piped)
    for a, b in zip(piped, waited):
        assert _untimed(a) == _untimed(b)
    assert any(not torch.equal(v, initial[k]) for k, v in piped_weights.items())  # it trained
    for name, value in piped_weights.items():
        assert torch.equal(value, waited_weights[name]), name


def test_batch_normalised_advantages_wait_for_every_reward(mmrl_cache, monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS)
    calls: list[list[int]] = []
    _steps(["algo.advantage=reinforce_pp"], "error", steps=1, spy=calls)
    assert calls == []  # not group-local: no partial waits


def _second_mini_batch_of_step_1(samples, cfg) -> set[str]:
    """The samples drawn for the last two groups of the first step (its second mini-batch)."""
    drawn = PromptSampler(samples, cfg.trainer.seed).next(cfg.trainer.prompts_per_step)
    return {s.id for s in drawn[2:]}


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_non_finite_reward_in_the_second_mini_batch(mmrl_cache, monkeypatch, caplog, pipelined):
    """Pipelined, the first mini-batch was already stepped on when the NaN arrives: the update
    stops there and the step is reported as the partial step it is (not "skipped": the weights
    changed). Waiting for every reward first, the step is skipped whole and nothing changes.
    Either way every non-finite reward is counted."""
    monkeypatch.syspath_prepend(PLUGINS)
    flag = [] if pipelined else ["reward.update_while_scoring=false"]
    with caplog.at_level(logging.WARNING):
        metrics, initial, final = _steps(flag, "nan", which=_second_mini_batch_of_step_1, steps=1)
    # The log says what happened to the step and names the samples.
    assert ("a partial step" in caplog.text) == pipelined and ("step skipped" in caplog.text) != pipelined
    assert "non-finite reward for samples ['vision_reasoning/" in caplog.text
    changed = any(not torch.equal(v, initial[k]) for k, v in final.items())
    assert changed == pipelined
    assert metrics[0]["guard/skipped_step"] == (0.0 if pipelined else 1.0)
    assert metrics[0].get("guard/partial_step", 0.0) == (1.0 if pipelined else 0.0)
    assert metrics[0].get("guard/applied_minibatches", 0.0) == (1.0 if pipelined else 0.0)
    assert metrics[0]["guard/nonfinite_rewards"] == 8  # 2 groups x 4 responses


def _first_and_second_mini_batch_of_step_1(samples, cfg) -> set[str]:
    """One sample of each mini-batch of the first step (groups 0 and 2)."""
    drawn = PromptSampler(samples, cfg.trainer.seed).next(cfg.trainer.prompts_per_step)
    return {drawn[0].id, drawn[2].id}


def test_every_non_finite_reward_is_counted_when_the_first_mini_batch_stops_the_step(mmrl_cache, monkeypatch):
    """The first mini-batch's NaN stops the pipelined update before anything is applied (a real
    skip); the second mini-batch's NaNs, scored after, are counted too."""
    monkeypatch.syspath_prepend(PLUGINS)
    metrics, initial, final = _steps([], "nan", which=_first_and_second_mini_batch_of_step_1, steps=1)
    assert all(torch.equal(v, initial[k]) for k, v in final.items())
    assert metrics[0]["guard/skipped_step"] == 1.0 and "guard/partial_step" not in metrics[0]
    assert metrics[0]["guard/nonfinite_rewards"] == 8  # groups 0 and 2, 4 responses each
