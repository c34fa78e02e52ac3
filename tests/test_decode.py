"""The HF engine's decode forms (`mmrl.rollout.decode`): eager, static, captured.

What a CPU can prove: with a fixed seed the static step (a StaticCache of fixed shapes per
batch-size bucket, the 4-D mask opened a column per step, finished rows compacted into smaller
buckets) gives exactly the eager tokens and the same log-probs; the captured form gives them too
when its capture is a stand-in that replays the step on the tensors it was captured with (and
fails if any of them moved, as a CUDA graph would silently read the old place). What it cannot
prove: that the model's code is capturable by a real CUDA graph, and how fast a replay is; the
CUDA test at the end and `benchmarks/gpu_scale.py` do that on a GPU.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from mmrl.datasets.procedural import make_samples
from mmrl.environments import ParsedTurn, ToolCall, register_call_format
from mmrl.rollout import decode as dec
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.train.forward import response_logprobs


class StandInGraph:
    """A stand-in for `decode.cuda_graph_capture` on the CPU: the "capture" runs the step once,
    and each replay runs it again and copies its result into the captured output tensor (a graph
    writes its output where it was at capture). Every replay first checks that each tensor the
    step reads is where it was at capture: a graph would read the old place."""

    def __init__(self):
        self.captures: Counter[int] = Counter()  # rows of each captured step
        self.replays = 0

    def __call__(self, step, device, pool, reads):
        where = [t.data_ptr() for t in reads()]
        output = step()
        self.captures[output.shape[0]] += 1

        def replay():
            now = [t.data_ptr() for t in reads()]
            moved = [i for i, (a, b) in enumerate(zip(now, where)) if a != b]
            assert len(now) == len(where) and not moved, (
                f"tensors {moved[:5]} the step reads moved since its capture"
            )
            output.copy_(step())
            self.replays += 1

        return replay, output


def _stop_sooner(policy, boost: float = 2.5):
    """Raise the stop token's logit so rows finish at different steps (compaction happens)."""
    stop = policy.stop_token_ids[0]
    head = policy.model.get_output_embeddings()
    return head.register_forward_hook(
        lambda m, i, out: out.index_add(
            -1, torch.tensor([stop], device=out.device), torch.full((*out.shape[:-1], 1), boost).to(out)
        )
    )


def _engine(policy, form: str, graph: StandInGraph | None = None) -> HFRolloutEngine:
    engine = HFRolloutEngine.from_policy(policy, max_batch_rows=64)
    engine.decode = form
    if graph is not None:
        engine.capture = graph
    return engine


def _samples(n: int = 6):
    # Different kinds, different question lengths: prompts are left padded differently.
    return make_samples(["colour_code", "count", "bar_chart"], n, "train")


def _generate(engine, samples, seed: int, **params):
    torch.manual_seed(seed)
    return engine.generate(
        samples, SamplingParams(**{"n": 4, "temperature": 0.7, "max_new_tokens": 12, **params})
    )


@pytest.mark.parametrize("form", ["static", "captured"])
def test_static_and_captured_steps_sample_the_eager_tokens_with_the_same_log_probs(tiny_policy, form):
    """Three batches (the later ones reuse the workspace and, captured, the graphs of the
    first), rows stopping at different steps so that running rows are compacted into smaller
    buckets; tokens equal to the eager ones, log-probs to 1e-5 (the static step attends over
    more, masked, positions: float sums in another order), and equal to the trainer's."""
    graph = StandInGraph() if form == "captured" else None
    eager, other = _engine(tiny_policy, "eager"), _engine(tiny_policy, form, graph)
    hook = _stop_sooner(tiny_policy)
    try:
        compactions, captured_after_first = 0, None
        for seed, samples in [(0, _samples()), (1, _samples()), (2, _samples(3))]:
            want, got = _generate(eager, samples, seed), _generate(other, samples, seed)
            compactions += other.rollout_metrics()["rollout/compactions"]
            assert torch.equal(got.response_ids, want.response_ids), seed
            assert torch.equal(got.response_mask, want.response_mask)
            torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, atol=1e-5, rtol=0)
            with torch.no_grad():
                recomputed, _ = response_logprobs(tiny_policy.model, got, tiny_policy.blocked, 0.7)
            torch.testing.assert_close(recomputed, got.rollout_logprobs, atol=1e-5, rtol=0)
            if graph is not None and captured_after_first is None:
                captured_after_first = Counter(graph.captures)
        assert compactions >= 2  # compaction really happened
        assert 0 < got.response_mask.sum(1).min() < got.response_mask.sum(1).max()
    finally:
        hook.remove()
    if graph is not None:
        assert other.rollout_metrics()["rollout/decode_captured"] == 1.0
        assert graph.replays > 3 * sum(graph.captures.values())  # captured once, replayed many times
        # The first batch's graphs serve the later batches (same cache length: same workspace).
        assert all(graph.captures[rows] == 1 for rows in captured_after_first), graph.captures


def test_greedy_decoding_is_the_same_in_every_form(tiny_policy):
    outs = [_generate(_engine(tiny_policy, form, StandInGraph()), _samples(3), 0, greedy=True, n=2)
            for form in ("eager", "static", "captured")]  # fmt: skip
    assert all(torch.equal(o.response_ids, outs[0].response_ids) for o in outs)
    assert outs[0].texts[0::2] == outs[0].texts[1::2]  # G identical greedy rows per prompt


def test_the_captured_step_follows_weights_updated_in_place_and_moved(tiny_policy):
    """An optimizer step changes the weights in place: the captured step (same addresses)
    samples with the new values. Weights given new storage (a `.to()`, a load that replaces
    tensors) invalidate the graphs: they are dropped and captured again."""
    graph = StandInGraph()
    eager, captured = _engine(tiny_policy, "eager"), _engine(tiny_policy, "captured", graph)
    _generate(captured, _samples(3), 0)
    with torch.no_grad():
        for p in tiny_policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # in place, like an optimizer step
    assert torch.equal(
        _generate(captured, _samples(3), 1).response_ids, _generate(eager, _samples(3), 1).response_ids
    )
    first = sum(graph.captures.values())
    with torch.no_grad():
        head = tiny_policy.model.get_output_embeddings()
        head.weight.data = head.weight.data.clone()  # new storage
    assert torch.equal(
        _generate(captured, _samples(3), 2).response_ids, _generate(eager, _samples(3), 2).response_ids
    )
    assert sum(graph.captures.values()) > first  # captured again


def test_under_bfloat16_autocast_the_captured_step_matches_static_with_a_tied_head(tiny_policy):
    """Mixed precision: float32 weights, bfloat16 autocast. The captured step runs on persistent
    bfloat16 copies of the linear weights (`CastWeights`, autocast's own rounding) except the LM
    head tied to the input embeddings, which autocast casts inside the step (its cache off):
    exactly the static step's tokens and log-probs (which autocast casts the float32 weights
    for), and the trainer's log-probs within bfloat16 rounding."""
    from mmrl.models.precision import Precision

    model = tiny_policy.model
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tie them
    tiny_policy.precision = Precision(torch.device("cpu"), torch.bfloat16, torch.float32)
    assert tiny_policy.precision.autocast
    static, captured = _engine(tiny_policy, "static"), _engine(tiny_policy, "captured", StandInGraph())
    for seed in (0, 1):
        want, got = _generate(static, _samples(3), seed), _generate(captured, _samples(3), seed)
        assert torch.equal(got.response_ids, want.response_ids)
        torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, atol=0, rtol=0)
        with torch.no_grad(), tiny_policy.autocast():
            recomputed, _ = response_logprobs(model, got, tiny_policy.blocked, 0.7)
        torch.testing.assert_close(recomputed, got.rollout_logprobs, atol=3e-2, rtol=0)
    cast = captured._cast
    assert cast is not None and cast.dtype == torch.bfloat16
    assert all(p is not model.lm_head.weight for p in cast.params)  # the tied head is not swapped
    assert any(p is model.model.language_model.layers[0].mlp.up_proj.weight for p in cast.params)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # swapped back after the batch


def test_a_step_that_cannot_be_captured_falls_back_to_uncaptured_with_a_warning(tiny_policy, caplog):
    """A model whose decode step a CUDA graph cannot hold (a host sync in its code raises during
    capture): the engine warns, decodes that batch and the later ones uncaptured, with the same
    tokens as the static step, and says so in its metrics."""

    def refuse(step, device, pool, reads):
        raise RuntimeError("operation not permitted when stream is capturing")

    captured, static = _engine(tiny_policy, "captured", refuse), _engine(tiny_policy, "static")
    with caplog.at_level(logging.WARNING, logger="mmrl.rollout.decode"):
        got = _generate(captured, _samples(3), 0)
    assert "capturing the decode step failed" in caplog.text and "stream is capturing" in caplog.text
    assert captured.decode == "static" and captured.rollout_metrics()["rollout/decode_captured"] == 0.0
    assert torch.equal(got.response_ids, _generate(static, _samples(3), 0).response_ids)


def test_a_model_the_static_step_does_not_fit_decodes_eagerly_and_says_why(tiny_policy, caplog, monkeypatch):
    config = tiny_policy.model.config.get_text_config(decoder=True)
    monkeypatch.setattr(config, "_attn_implementation", "flash_attention_2")
    assert "flash_attention_2" in dec.static_unsupported(tiny_policy.model)
    dec._said.clear()
    with caplog.at_level(logging.INFO, logger="mmrl.rollout.decode"):
        engine = _engine(tiny_policy, "static")
        assert engine._decode_form() == "eager"
    assert "decoding eagerly instead" in caplog.text and "flash_attention_2" in caplog.text


def test_captured_decoding_needs_cuda_unless_a_capture_is_given(tiny_policy):
    engine = HFRolloutEngine.from_policy(tiny_policy)
    engine.decode = "captured"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        engine.generate(_samples(1), SamplingParams(n=2, max_new_tokens=2))
    with pytest.raises(ValueError, match="rollout.decode='fast'"):
        HFRolloutEngine(tiny_policy.model, tiny_policy.processor, tiny_policy.blocked, [1], 0, decode="fast")
    assert dec.resolve_decode("auto", torch.device("cpu")) == "eager"
    assert dec.resolve_decode("auto", torch.device("cuda")) == "captured"


def test_buckets_by_hand():
    assert dec.decode_buckets(128) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert dec.decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert dec.decode_buckets(1) == [1]
    assert dec.decode_buckets(300)[-3:] == [240, 256, 300]
    assert [dec.bucket_for(n, dec.decode_buckets(64)) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    with pytest.raises(ValueError, match="exceed"):
        dec.bucket_for(65, dec.decode_buckets(64))


def test_the_exponential_race_samples_the_categorical_distribution():
    """argmax(p / q), q ~ Exp(1): frequencies of 40,000 draws within 0.01 of p (the standard
    error is <= 0.0025), and a zero-probability id never drawn."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    draws = 40_000
    torch.manual_seed(0)
    samples = dec.exponential_race(p.expand(draws, -1).clone(), torch.empty(draws, 5).exponential_())
    freq = torch.bincount(samples, minlength=5).float() / draws
    assert freq[4] == 0
    torch.testing.assert_close(freq, p, atol=0.01, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_on_a_gpu_the_captured_step_samples_the_static_tokens(tiny_policy):
    """A real CUDA graph per bucket: the tiny model's decode step is capturable, and replays give
    the static step's tokens (the same kernels; bfloat16 autocast, as a GPU run has it) and
    log-probs the trainer agrees with; the graphs are kept for the next batch."""
    from mmrl.models.precision import Precision

    tiny_policy.model.to("cuda")
    tiny_policy.blocked = tiny_policy.blocked.to("cuda")
    tiny_policy.precision = Precision(torch.device("cuda"), torch.bfloat16, torch.float32)
    static, captured = _engine(tiny_policy, "static"), _engine(tiny_policy, "captured")
    hook = _stop_sooner(tiny_policy)
    try:
        for seed in (0, 1):
            want, got = _generate(static, _samples(), seed), _generate(captured, _samples(), seed)
            assert torch.equal(got.response_ids, want.response_ids), seed
            torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, atol=1e-6, rtol=0)
            with torch.no_grad(), tiny_policy.autocast():
                recomputed, _ = response_logprobs(tiny_policy.model, got, tiny_policy.blocked, 0.7)
            torch.testing.assert_close(recomputed, got.rollout_logprobs, atol=3e-2, rtol=0)
    finally:
        hook.remove()
    assert captured._workspace is not None and all(
        b.replay is not None for b in captured._workspace.buckets.values()
    )


def test_a_growing_layer_holds_what_a_dynamic_layer_holds():
    """The eager steps' cache layer writes new columns in place (no copy of the whole cache per
    step): the same keys and values as transformers' `DynamicLayer` through updates past its
    room, row reordering and cropping."""
    from transformers.cache_utils import DynamicLayer

    from mmrl.rollout.decode import GrowingLayer, grow_in_place

    torch.manual_seed(0)
    keys, values = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 6)
    plain = DynamicLayer()
    plain.update(keys, values)
    growing = GrowingLayer(keys, values, room=2)
    for step in range(4):  # (the third outgrows the room)
        k, v = torch.randn(3, 2, 1 + step % 2, 4), torch.randn(3, 2, 1 + step % 2, 6)
        expected, got = plain.update(k, v), growing.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        assert growing.get_seq_length() == plain.get_seq_length()
    order = torch.tensor([2, 0])
    plain.reorder_cache(order)
    growing.reorder_cache(order)
    plain.crop(-2)
    growing.crop(-2)
    assert torch.equal(plain.keys, growing.keys) and torch.equal(plain.values, growing.values)
    k, v = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 6)
    assert all(torch.equal(a, b) for a, b in zip(plain.update(k, v), growing.update(k, v)))

    class Cache:  # what grow_in_place reads of a dynamic cache
        layers = [DynamicLayer()]

    Cache.layers[0].update(keys, values)
    grow_in_place(Cache, room=3, rows=torch.tensor([1, 1, 0, 2]))
    layer = Cache.layers[0]
    assert isinstance(layer, GrowingLayer) and torch.equal(layer.keys, keys[[1, 1, 0, 2]])


@register_call_format("decode_always_zoom")
def _always_zoom(text: str) -> ParsedTurn:
    return ParsedTurn(
        calls=[ToolCall("zoom_in", {"bbox_2d": [0, 0, 32, 32]}, text)], errors=[], error_kinds=[]
    )


@pytest.mark.parametrize("form", ["static", "captured"])
def test_multi_turn_continuations_sample_the_eager_tokens_in_every_form(tiny_policy, form):
    """Multi-turn trajectories (`mmrl.rollout.multiturn`): the continuations prefill from the
    caches kept since the last turn (copied out of the static buffers, which the next turn
    reuses) and decode in the chosen form; rows finish at different steps (kept as they are
    compacted out). The eager tokens and log-probs, and the trainer's log-probs."""
    import dataclasses

    from mmrl.config import AgentConfig
    from mmrl.rollout.multiturn import generate_trajectories
    from mmrl.types import AgentSpec

    samples = [dataclasses.replace(s, agent=AgentSpec(tools=["zoom_in"])) for s in _samples(3)]
    agent = AgentConfig(call_format="decode_always_zoom", max_turns=3, max_tokens=400)
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=12)
    hook = _stop_sooner(tiny_policy, boost=4.0)
    try:
        batches = []
        for engine in (_engine(tiny_policy, "eager"), _engine(tiny_policy, form, StandInGraph())):
            torch.manual_seed(5)
            batches.append(generate_trajectories(engine, samples, params, agent))
        compactions = engine.rollout_metrics()["rollout/compactions"]
        want, got = batches
        with torch.no_grad():
            recomputed, _ = response_logprobs(tiny_policy.model, got, tiny_policy.blocked, 0.7)
    finally:
        hook.remove()
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(
        got.response_mask, want.response_mask
    )
    torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, atol=1e-5, rtol=0)
    assert compactions >= 1 and {t.turns for t in got.trajectories} == {3}
    torch.testing.assert_close(recomputed, got.rollout_logprobs, atol=1e-5, rtol=0)
