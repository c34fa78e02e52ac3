"""PPO with a critic in the trainer (`algo.advantage=gae` / `turn_gae`): the value head on the
policy's last hidden state, its values from the old log-prob pass, the critic's advantages and
returns (`mmrl.algos.critic`), the clipped value loss in the update, its checkpoint; and the
default GRPO path without any of it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.environments import ParsedTurn, ToolCall, register_call_format
from mmrl.models.loading import make_policy
from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm
from mmrl.rollout.hf import SamplingParams
from mmrl.rollout.multiturn import generate_trajectories
from mmrl.train import grpo
from mmrl.train.data import PromptSampler
from mmrl.types import AgentSpec, RolloutBatch, Trajectory, VerifyContext
from tests.conftest import bias_stop_token

BASE = [
    "trainer.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
    "trainer.mini_batches=1", "trainer.progress=false", "reward.num_workers=0",
    # The random tiny model scores 0 everywhere: the overlong punishment gives its long
    # responses a negative reward, so the returns (and the value loss) are not all 0.
    "algo.overlong_buffer=6", "algo.critic_lr=0.01",
]  # fmt: skip
MULTITURN = ["agent.call_format=critic_always_zoom", "agent.max_turns=2"]


@register_call_format("critic_always_zoom")
def _always_zoom(text: str) -> ParsedTurn:
    """Every turn read as a call to `zoom_in` (the random tiny model writes none by itself), as
    tests/test_multiturn.py does: two model turns with an observation between them."""
    return ParsedTurn(
        calls=[ToolCall("zoom_in", {"bbox_2d": [0, 0, 32, 32]}, text)], errors=[], error_kinds=[]
    )


def _samples(n: int, tools: bool = False) -> list:
    samples = make_samples(["colour_code", "count"], n, "train")
    if tools:
        samples = [dataclasses.replace(s, agent=AgentSpec(tools=["zoom_in"])) for s in samples]
    return samples


def _policy(multiturn: bool = False):
    """The random tiny Qwen2-VL; `multiturn`: with an LM head bias that makes its stop token
    likely, so that its turns end within a few tokens and go on to a second turn (as
    tests/test_multiturn.py does)."""
    spec = TinyVLMSpec()
    policy = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
    return bias_stop_token(policy) if multiturn else policy


def _steps(cfg, t, samples, n: int) -> list[dict[str, float]]:
    sampler = PromptSampler(samples, cfg.trainer.seed)
    return [grpo.grpo_step(cfg, t, sampler, VerifyContext(k, n), step=k + 1) for k in range(n)]


CRITIC_METRICS = (
    "critic/value_loss", "critic/vf_clipfrac", "critic/values_mean", "critic/returns_mean",
    "critic/explained_var", "critic/vpred_mean", "critic/grad_norm",
)  # fmt: skip


@pytest.mark.parametrize("estimator, extra", [("gae", []), ("turn_gae", MULTITURN)])
def test_critic_steps_train_the_value_head_with_their_metrics(mmrl_cache, estimator, extra):
    cfg = load_config("vision_reasoning", overrides=[*BASE, *extra, f"algo.advantage={estimator}"])
    grpo.seed_everything(cfg.trainer.seed)
    t = grpo.make_trainee(cfg, _policy(multiturn=bool(extra)), None)
    assert t.value_head is not None
    assert [g["name"] for g in t.optimizer.param_groups][-1] == "critic"
    assert t.optimizer.param_groups[-1]["lr"] == 0.01
    head_before = {k: v.clone() for k, v in t.value_head.state_dict().items()}
    policy_before = {k: v.detach().clone() for k, v in t.policy.model.state_dict().items()}
    try:
        metrics = _steps(cfg, t, _samples(4, tools=bool(extra)), 2)
    finally:
        t.close()
    for m in metrics:
        for key in CRITIC_METRICS:
            assert key in m and math.isfinite(m[key]), key
        assert m["critic/returns_mean"] != 0.0  # the overlong punishment reached the returns
        assert m["critic/value_loss"] > 0.0
        if extra:
            assert m["agent/turns"] == 2.0 and m["agent/observation_tokens"] > 0
    assert metrics[0]["critic/values_mean"] == 0.0  # the head starts at 0
    assert metrics[1]["critic/values_mean"] != 0.0  # and has learnt by the second rollout
    assert any(not torch.equal(head_before[k], v) for k, v in t.value_head.state_dict().items())
    after = t.policy.model.state_dict()
    assert any(not torch.equal(policy_before[k], after[k]) for k in policy_before)


def _multiturn_batch(cfg, t) -> RolloutBatch:
    samples = _samples(2, tools=True)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens)
    batch = generate_trajectories(t.engine, samples, params, cfg.agent)
    assert batch.observation_mask is not None and int(batch.observation_mask.sum()) > 0
    batch.response_mask = batch.response_mask.clone()
    return batch


@pytest.mark.parametrize("estimator", ["gae", "turn_gae"])
def test_observation_tokens_get_no_value_advantage_or_value_loss_gradient(mmrl_cache, estimator):
    from mmrl.algos.critic import value_loss
    from mmrl.train.forward import response_logprobs_and_values
    from mmrl.train.update import critic_targets

    cfg = load_config("vision_reasoning", overrides=[*BASE, *MULTITURN, f"algo.advantage={estimator}"])
    t = grpo.make_trainee(cfg, _policy(multiturn=True), None)
    t.router.close()
    with torch.no_grad():  # a head that gives every position a nonzero value
        t.value_head.weight.normal_(0.0, 0.1)
        t.value_head.bias.fill_(0.3)
    batch = _multiturn_batch(cfg, t)
    obs = batch.observation_mask.bool()
    _, _, old_values = t.old_ref_and_values(cfg, batch)
    assert bool((old_values[batch.response_mask.bool()] != 0).all())
    assert bool((old_values[obs] == 0).all())
    scores = torch.tensor([1.0, -0.5, 0.25, 2.0])
    advantages, targets = critic_targets(cfg, batch, scores, old_values, t.value_head)
    assert advantages.shape == batch.response_mask.shape
    assert bool((advantages[obs] == 0).all()) and bool((targets.returns[obs] == 0).all())
    assert bool((advantages[batch.response_mask.bool()] != 0).any())
    _, _, vpreds = response_logprobs_and_values(t.policy.model, batch, t.policy.blocked, 1.0, t.value_head)
    vpreds.retain_grad()
    loss, _ = value_loss(vpreds, targets.returns, targets.values, batch.response_mask, 0.5)
    loss.backward()
    assert bool((vpreds.grad[obs] == 0).all())
    assert bool((vpreds.grad[batch.response_mask.bool()] != 0).any())
    assert t.value_head.weight.grad is not None and bool(t.value_head.weight.grad.abs().sum() > 0)


def test_turn_gae_puts_each_turns_env_reward_on_its_last_model_token():
    from mmrl.train.update import token_level_rewards

    cfg = load_config(overrides=["algo.advantage=turn_gae", "agent.env_reward_weight=2.0"])
    # Row 0: 3 turns (model tokens 0-1, 4, 7-8), observations between; row 1: 2 turns, no env.
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1, 0, 0, 0, 0]])
    batch = RolloutBatch.__new__(RolloutBatch)
    batch.response_mask = mask
    batch.trajectories = [
        Trajectory(turns=3, env_id="toy", turn_rewards=[0.5, 0.0, 1.0], env_return=1.5),
        Trajectory(turns=2),
    ]
    # The scores hold the env return (2 x 1.5 = 3) plus the verifier's 0.25; row 1 scores 1.
    scores = torch.tensor([3.25, 1.0])
    rewards = token_level_rewards(cfg, batch, scores, env_parts=[3.0, 0.0])
    expected = torch.zeros(2, 10)
    expected[0, 1], expected[0, 8] = 1.0, 2.0 + 0.25
    expected[1, 5] = 1.0
    torch.testing.assert_close(rewards, expected, rtol=0, atol=0)
    gae_cfg = load_config(overrides=["algo.advantage=gae"])
    flat = token_level_rewards(gae_cfg, batch, scores)
    expected = torch.zeros(2, 10)
    expected[0, 8], expected[1, 5] = 3.25, 1.0
    torch.testing.assert_close(flat, expected, rtol=0, atol=0)


def test_the_value_loss_on_a_fixed_batch_decreases_over_updates(mmrl_cache):
    from mmrl.train.update import critic_targets, update_policy

    cfg = load_config(
        "vision_reasoning",
        overrides=[*BASE, "algo.advantage=gae", "algo.cliprange_value=10", "algo.critic_lr=0.003"],
    )
    grpo.seed_everything(cfg.trainer.seed)
    t = grpo.make_trainee(cfg, _policy(), None)
    t.router.close()
    samples = _samples(2)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    batch = t.engine.generate(samples, params)
    old, _, values = t.old_ref_and_values(cfg, batch)
    advantages, targets = critic_targets(
        cfg, batch, torch.tensor([1.0, 0.0, -1.0, 0.5]), values, t.value_head
    )
    losses = []
    for _ in range(8):
        m = update_policy(cfg, t.policy, t.optimizer, batch, advantages, old.clone(), None, critic=targets)
        losses.append(m["critic/value_loss"])
    assert losses[-1] < 0.75 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_a_checkpoint_restores_the_value_head_and_resumes_exactly(mmrl_cache, tmp_path):
    cfg = load_config(
        "vision_reasoning", overrides=[*BASE, "algo.advantage=gae", f"trainer.run_dir={tmp_path}"]
    )
    samples = _samples(4)
    grpo.seed_everything(cfg.trainer.seed)
    t = grpo.make_trainee(cfg, _policy(), None)
    sampler = PromptSampler(samples, cfg.trainer.seed)
    try:
        grpo.grpo_step(cfg, t, sampler, VerifyContext(0, 2), step=1)
        assert bool(t.value_head.weight.abs().sum() > 0)
        path = grpo.write_checkpoint(cfg, t, sampler, grpo.RunProgress(step=1), tmp_path)
        fresh = grpo.make_trainee(cfg, _policy(), None)
        fresh_sampler = PromptSampler(samples, cfg.trainer.seed)
        try:
            assert not torch.equal(fresh.value_head.weight, t.value_head.weight)
            progress = grpo.RunProgress()
            assert grpo.resume_from(cfg, fresh, fresh_sampler, progress, tmp_path, checkpoint=path)
            for k, v in t.value_head.state_dict().items():
                assert torch.equal(fresh.value_head.state_dict()[k], v)
            critic_state = [t.optimizer.state[p] for p in t.value_head.parameters()]
            fresh_state = [fresh.optimizer.state[p] for p in fresh.value_head.parameters()]
            for a, b in zip(critic_state, fresh_state):
                assert all(torch.equal(a[k], b[k]) for k in a)
            # The next step, from the checkpoint and uninterrupted, is the same step.
            resumed = grpo.grpo_step(cfg, fresh, fresh_sampler, VerifyContext(1, 2), step=2)
        finally:
            fresh.close()
        grpo.set_rng_state(grpo.load_trainer_state(path)["rng"])
        straight = grpo.grpo_step(cfg, t, sampler, VerifyContext(1, 2), step=2)
    finally:
        t.close()
    for key in (*CRITIC_METRICS, "actor/pg_loss", "reward/mean"):
        assert resumed[key] == straight[key], key
    for k, v in t.value_head.state_dict().items():
        assert torch.equal(fresh.value_head.state_dict()[k], v)


def test_the_default_grpo_path_has_no_critic(mmrl_cache):
    cfg = load_config("vision_reasoning", overrides=BASE)
    assert cfg.algo.advantage == "grpo"
    grpo.seed_everything(cfg.trainer.seed)
    t = grpo.make_trainee(cfg, _policy(), None)
    assert t.value_head is None
    assert all(g["name"] != "critic" for g in t.optimizer.param_groups)
    assert not any("value" in name for name, _ in t.policy.model.named_parameters())
    try:
        (m,) = _steps(cfg, t, _samples(4), 1)
    finally:
        t.close()
    assert not any(k.startswith("critic/") for k in m)


def test_backends_that_cannot_carry_the_critic_are_refused():
    for override in ("trainer.strategy=deepspeed", "trainer.backend=ray"):
        with pytest.raises(ValueError, match="does not carry|do not carry"):
            load_config(overrides=["algo.advantage=turn_gae", override])
    with pytest.raises(ValueError, match="algo.cliprange_value must be > 0"):
        load_config(overrides=["algo.advantage=gae", "algo.cliprange_value=0"])
    with pytest.raises(ValueError, match=r"algo.high_level_gamma must be in \[0, 1\]"):
        load_config(overrides=["algo.high_level_gamma=1.5"])


def test_the_value_head_computes_in_float32_a_chunk_at_a_time_under_bfloat16_autocast(monkeypatch):
    """bfloat16 hidden states under autocast: the values and the head's gradients are those of
    float64 arithmetic on the same (bfloat16) inputs to float32 rounding, the gradient to the
    hidden states comes back in bfloat16, and chunking (several chunks here) changes nothing."""
    from mmrl.train.forward import ValueHead, _Float32Dot

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(37, 16, generator=g) * 30).to(torch.bfloat16).requires_grad_()
    head = ValueHead(16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(16, generator=g))
        head.bias.fill_(0.25)
    upstream = torch.randn(37, generator=g)
    results = []
    for chunk_bytes in (_Float32Dot.CHUNK_BYTES, 4 * 16 * 5):  # one chunk; chunks of 5 positions
        monkeypatch.setattr(_Float32Dot, "CHUNK_BYTES", chunk_bytes)
        head.zero_grad(set_to_none=True)
        h.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            values = head(h)
        assert values.dtype == torch.float32
        (values * upstream).sum().backward()
        assert h.grad.dtype == torch.bfloat16
        results.append((values.detach(), head.weight.grad.clone(), head.bias.grad.clone(), h.grad.clone()))
    h64, w64 = h.detach().double(), head.weight.detach().double()
    expected = h64 @ w64 + 0.25
    for values, w_grad, b_grad, h_grad in results:
        torch.testing.assert_close(values.double(), expected, rtol=1e-6, atol=1e-4)
        torch.testing.assert_close(w_grad.double(), upstream.double() @ h64, rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(b_grad.double(), upstream.double().sum(), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(
            h_grad, (upstream.unsqueeze(1) * head.weight.detach()).to(torch.bfloat16), rtol=0, atol=0
        )
    for a, b in zip(results[0], results[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-4)
