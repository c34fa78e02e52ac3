"""Rows with the same prompt share one prompt pass (rollout and trainer): same numbers as the
plain full-sequence forward, to float rounding, log-probs, entropies and gradients alike."""

from __future__ import annotations

import pytest
import torch

from mmrl.datasets.procedural import make_samples
from mmrl.models.loading import make_policy
from mmrl.models.tiny import TinyVLMSpec, architectures, build_processor, build_tiny_vlm
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.train.batching import prompt_groups, select_rows
from mmrl.train.forward import response_logprobs, shares_prompts


def _mixed_samples(n=4):
    # Different kinds have different question lengths, so prompts are left padded.
    return make_samples(["colour_code", "count", "bar_chart"], n, "train")


def test_rows_share_a_prompt_only_when_they_come_from_the_same_sample(tiny_policy):
    # Every colour_code question has the same text: only the image tells two samples apart.
    samples = make_samples(["colour_code"], 3, "train")
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(samples, SamplingParams(n=3, max_new_tokens=4))
    assert torch.equal(batch.prompt_ids[0], batch.prompt_ids[3])  # same text, different images
    first, inverse = prompt_groups(batch)
    assert first == [0, 3, 6]
    assert inverse.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    first, inverse = prompt_groups(select_rows(batch, [7, 1, 4, 0]))
    assert first == [0, 1, 2] and inverse.tolist() == [0, 1, 2, 1]
    assert prompt_groups(select_rows(batch, [0, 3, 6])) is None  # nothing to share


@pytest.mark.parametrize("architecture", architectures())
def test_shared_prompt_pass_gives_the_plain_forwards_logprobs_entropy_and_gradients(architecture):
    spec = TinyVLMSpec(architecture=architecture)
    policy = make_policy(build_tiny_vlm(spec, seed=1), build_processor(spec))
    assert shares_prompts(policy.model)
    engine = HFRolloutEngine.from_policy(policy)
    batch = engine.generate(_mixed_samples(), SamplingParams(n=3, max_new_tokens=10))
    assert batch.prompt_mask.sum(1).unique().numel() > 1  # really padded
    batch = select_rows(batch, [5, 0, 1, 7, 2, 11, 9])  # groups split and out of order
    model = policy.model.train()

    def run(share: bool):
        model.zero_grad()
        logprobs, entropy = response_logprobs(
            model, batch, policy.blocked, 0.8, with_entropy=True, entropy_grad=True, share_prompts=share
        )
        mask = batch.response_mask
        (-(logprobs * mask).sum() / mask.sum() - 0.1 * entropy.sum() / mask.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logprobs.detach(), entropy.detach(), grads

    plain, shared = run(False), run(True)
    torch.testing.assert_close(shared[0], plain[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared[1], plain[1], atol=1e-5, rtol=0)
    assert shared[2].keys() == plain[2].keys()
    # A floor for gradients that are zero in exact arithmetic and float noise here: a key
    # projection's bias (CLIP, SigLIP) shifts every logit of a query alike, which softmax ignores.
    floor = 1e-7 * max(grad.abs().max().item() for grad in plain[2].values())
    for name, grad in plain[2].items():  # the vision tower's gradient comes through the cache
        atol = max(1e-5 * grad.abs().max().item(), floor)
        torch.testing.assert_close(shared[2][name], grad, atol=atol, rtol=1e-4)


def test_shared_rollouts_record_the_logprobs_of_the_plain_forward(tiny_policy):
    """The engine's own positions and cache give the log-probs the full forward recomputes."""
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(_mixed_samples(), SamplingParams(n=4, temperature=0.7, max_new_tokens=12))
    assert [s.id for s in batch.samples[:4]] == [batch.samples[0].id] * 4
    with torch.no_grad():
        plain, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 0.7, share_prompts=False)
    torch.testing.assert_close(batch.rollout_logprobs, plain, atol=1e-5, rtol=0)
    counted = batch.response_ids[batch.response_mask.bool()]
    assert not tiny_policy.blocked[counted].any()


def test_rows_are_streamed_to_the_scorer_as_they_finish(tiny_policy):
    engine = HFRolloutEngine.from_policy(tiny_policy)
    engine.max_batch_rows = 6  # two groups of 3 per chunk: rows are numbered across chunks
    seen: dict[int, str] = {}
    batch = engine.generate(
        _mixed_samples(),
        SamplingParams(n=3, max_new_tokens=8),
        on_response=lambda r, t: seen.setdefault(r, t),
    )
    assert sorted(seen) == list(range(len(batch)))
    assert [seen[r] for r in range(len(batch))] == batch.texts
