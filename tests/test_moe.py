"""Mixture-of-experts policies (issue 19, part 4): a tiny Qwen3-VL-MoE built from config, router
freezing, and the routing metrics (hand-worked, then from a real update)."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.config import load_config
from mmrl.models.loading import Policy, make_policy
from mmrl.models.moe import RouterStats, freeze_router, router_modules
from mmrl.models.tiny import TINY_MOE_EXPERTS, TINY_MOE_TOP_K, TinyVLMSpec, build_processor, build_tiny_vlm


@pytest.fixture()
def moe_policy() -> Policy:
    spec = TinyVLMSpec(architecture="qwen3_vl_moe")
    return make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))


def _batch(policy: Policy):
    from mmrl.datasets.procedural import make_samples
    from mmrl.models.base import teacher_forced_batch

    samples = make_samples(["colour_code"], n=2, split="train")
    return teacher_forced_batch(
        policy, [samples[0], samples[0], samples[1], samples[1]], ["\\boxed{1}", "ab", "c", "d"]
    )


def test_the_tiny_moe_has_a_router_per_layer_and_shares_prompts_like_the_dense_models(moe_policy):
    from mmrl.train.forward import response_logprobs

    routers = router_modules(moe_policy.model)
    assert sorted(routers) == [f"model.language_model.layers.{i}.mlp.gate" for i in range(2)]
    assert all(r.weight.shape[0] == TINY_MOE_EXPERTS for r in routers.values())
    assert router_modules(build_tiny_vlm(TinyVLMSpec(), seed=0)) == {}  # a dense Qwen2-VL has none
    batch = _batch(moe_policy)
    shared, _ = response_logprobs(moe_policy.model, batch, moe_policy.blocked, 1.0)
    full, _ = response_logprobs(moe_policy.model, batch, moe_policy.blocked, 1.0, share_prompts=False)
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)


def test_router_stats_by_hand():
    stats = RouterStats(torch.nn.Linear(1, 1))  # no router inside: fed by hand
    # Two positions, router probabilities (0.4, 0.4, 0.1, 0.1), top-2: both go to experts 0 and 1.
    logits = torch.log(torch.tensor([[0.4, 0.4, 0.1, 0.1]] * 2))
    stats.record("layer", logits, 2)
    m = stats.metrics()
    # f = (1/2, 1/2, 0, 0), P = (0.4, 0.4, 0.1, 0.1): E sum f P = 4 * 0.4 = 1.6.
    assert m["moe/load_balance"] == pytest.approx(1.6)
    assert m["moe/router_entropy"] == pytest.approx(-(0.8 * math.log(0.4) + 0.2 * math.log(0.1)))
    assert m["moe/expert_frac_max"] == pytest.approx(0.5) and m["moe/routers"] == 1.0
    # A uniform router is balanced by this measure (1) with the maximal entropy log E.
    uniform = RouterStats(torch.nn.Linear(1, 1))
    uniform.record("layer", torch.zeros(8, 4), 2)
    assert uniform.metrics()["moe/load_balance"] == pytest.approx(1.0)
    assert uniform.metrics()["moe/router_entropy"] == pytest.approx(math.log(4))
    assert RouterStats(torch.nn.Linear(1, 1)).metrics() == {}


def test_router_stats_hooks_see_the_real_routers(moe_policy):
    from mmrl.train.forward import response_logprobs

    batch = _batch(moe_policy)
    with RouterStats(moe_policy.model) as stats:
        response_logprobs(moe_policy.model, batch, moe_policy.blocked, 1.0)
    m = stats.metrics()
    assert m["moe/routers"] == 2.0
    assert 0 < m["moe/router_entropy"] <= math.log(TINY_MOE_EXPERTS) + 1e-6
    assert 1 / TINY_MOE_EXPERTS <= m["moe/expert_frac_max"] <= 1 / TINY_MOE_TOP_K + 1e-6
    assert m["moe/load_balance"] > 0
    # Removed on exit: another forward adds nothing.
    before = dict(stats.positions)
    response_logprobs(moe_policy.model, batch, moe_policy.blocked, 1.0)
    assert stats.positions == before


def test_freeze_router_keeps_the_routing_and_trains_the_experts(moe_policy):
    from mmrl.models.adapters import freeze_parts, param_groups
    from mmrl.train.update import update_policy

    cfg = load_config(
        overrides=[
            "model.freeze_router=true",
            "rollout.group_size=2",
            "trainer.mini_batches=1",
            "optim.lr=0.01",
        ]
    )
    model = moe_policy.model
    freeze_parts(model, cfg)
    routers = router_modules(model)
    assert all(not p.requires_grad for r in routers.values() for p in r.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(param_groups(model, cfg), lr=0.01)
    batch = _batch(moe_policy)
    with torch.no_grad():
        from mmrl.train.forward import response_logprobs

        old, _ = response_logprobs(model, batch, moe_policy.blocked, 1.0)
    metrics = update_policy(
        cfg, moe_policy, optimizer, batch, torch.tensor([1.0, -1.0, 1.0, -1.0]), old, None
    )
    assert metrics["actor/skipped_steps"] == 0
    assert (
        metrics["moe/routers"] == 2.0
        and 0 < metrics["moe/router_entropy"] <= math.log(TINY_MOE_EXPERTS) + 1e-6
    )
    after = dict(model.named_parameters())
    for name in routers:
        assert torch.equal(after[f"{name}.weight"], before[f"{name}.weight"]), name
    experts = [n for n in after if ".mlp.experts." in n]
    assert experts and any(not torch.equal(after[n], before[n]) for n in experts)


def test_freeze_router_on_a_dense_model_is_an_error(tiny_policy):
    with pytest.raises(ValueError, match="has no mixture-of-experts router"):
        freeze_router(tiny_policy.model)
