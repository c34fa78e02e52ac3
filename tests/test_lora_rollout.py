"""LoRA merged for rollouts (`rollout.lora_merge`, `mmrl.models.adapters.MergedAdapters`).

The rollout samples with the adapters merged into the base weights (one weight read per layer on
a GPU); the trainer scores with them unmerged. What is pinned here: the weights come back
bit-exact after every rollout (peft's own unmerge does not give them back), the rounding the
merge adds to the rollout's log-probs, measured against the trainer's in float32 and in bfloat16,
and that a step reports it (`rollout/lora_merged` beside the `rollout/` mismatch metrics).
"""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.models.adapters import MergedAdapters, resolve_lora_merge
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.train.grpo import prepare_policy
from mmrl.train.update import old_and_ref_logprobs

FAST = ["trainer.prompts_per_step=2", "rollout.group_size=4", "trainer.mini_batches=1", "model.lora_rank=8"]


def _lora_policy(policy, dtype: str, *extra: str):
    """The tiny policy with LoRA (rank 8) and trained-looking adapters (B no longer zero)."""
    cfg = load_config("vision_reasoning", overrides=[*FAST, f"model.dtype={dtype}", *extra])
    prepare_policy(cfg, policy)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return cfg


def _base_weights(model) -> list[torch.Tensor]:
    from peft.tuners.lora import LoraLayer

    return [m.get_base_layer().weight for m in model.modules() if isinstance(m, LoraLayer)]


@pytest.mark.parametrize(
    ("dtype", "mean_bound", "max_bound"),
    [
        # Measured (tiny model, seeds 0-2, 8 prompts x 4, rank 8): float32 mean 1.8e-7 to 2.4e-7,
        # max 9.5e-7 nats (unmerged rollouts: the same max); bfloat16 (frozen base in bfloat16,
        # autocast) mean 1.3e-3 to 1.5e-3, max 5.7e-3 to 7.2e-3 (unmerged: mean <= 1e-5).
        # The bounds leave a factor of ~4.
        ("float32", 1e-6, 5e-6),
        ("bfloat16", 0.006, 0.03),
    ],
)
def test_a_merged_rollout_restores_the_weights_exactly_and_its_rounding_is_bounded(
    tiny_policy, dtype, mean_bound, max_bound
):
    cfg = _lora_policy(tiny_policy, dtype, "rollout.lora_merge=merged")
    model = tiny_policy.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = HFRolloutEngine.from_policy(tiny_policy, rollout=cfg.rollout)
    batch = engine.generate(make_samples(["colour_code"], 8, "train"), SamplingParams(n=4, max_new_tokens=10))
    assert engine.rollout_metrics()["rollout/lora_merged"] == 1.0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-exact, every tensor
    assert not any(getattr(m, "merged", False) for m in model.modules())  # peft: unmerged again
    old, _ = old_and_ref_logprobs(cfg, tiny_policy, None, batch)  # the trainer: adapters unmerged
    diff = (old - batch.rollout_logprobs)[batch.response_mask.bool()].abs()
    assert diff.mean() < mean_bound and diff.max() < max_bound, (float(diff.mean()), float(diff.max()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peft_unmerge_alone_does_not_give_the_weights_back(tiny_policy, dtype):
    """Why `MergedAdapters` copies the base weights: subtracting the delta again rounds, so
    merge + unmerge changes the frozen base weights (every adapted one, in both dtypes here)."""
    _lora_policy(tiny_policy, dtype)
    weights = _base_weights(tiny_policy.model)
    original = [w.clone() for w in weights]
    with torch.no_grad():
        tiny_policy.model.merge_adapter()
        tiny_policy.model.unmerge_adapter()
    changed = sum(not torch.equal(a, b) for a, b in zip(original, weights))
    assert changed > len(weights) // 2, (changed, len(weights))
    for w, o in zip(weights, original):  # restore, then the same through MergedAdapters
        w.data.copy_(o)
    with MergedAdapters(tiny_policy.model).merged():
        assert any(not torch.equal(a, b) for a, b in zip(original, weights))  # really merged
    assert all(torch.equal(a, b) for a, b in zip(original, weights))


def test_a_step_reports_that_its_rollout_was_merged(tiny_policy):
    from mmrl.train.data import PromptSampler
    from mmrl.train.grpo import grpo_step, make_trainee
    from mmrl.types import VerifyContext

    cfg = load_config(
        "vision_reasoning",
        overrides=[*FAST, "rollout.lora_merge=merged", "rollout.max_new_tokens=6", "reward.num_workers=0",
                   "trainer.progress=false"],
    )  # fmt: skip
    t = make_trainee(cfg, tiny_policy)
    try:
        sampler = PromptSampler(make_samples(["colour_code"], 4, "train"), 0)
        metrics = grpo_step(cfg, t, sampler, VerifyContext(0, 1), step=1)
    finally:
        t.router.close()
    assert metrics["rollout/lora_merged"] == 1.0
    assert math.isfinite(metrics["rollout/kl_k1"]) and abs(metrics["rollout/kl_k1"]) < 1e-4


def test_lora_merge_settings():
    assert resolve_lora_merge("auto", torch.device("cuda")) and not resolve_lora_merge(
        "auto", torch.device("cpu")
    )
    assert resolve_lora_merge("merged", torch.device("cpu")) and not resolve_lora_merge(
        "unmerged", torch.device("cuda")
    )
    with pytest.raises(ValueError, match="rollout.lora_merge='on'"):
        resolve_lora_merge("on", torch.device("cpu"))
    with pytest.raises(ValueError, match="rollout.lora_merge must be auto, merged or unmerged"):
        load_config(overrides=["rollout.lora_merge=sometimes"])
