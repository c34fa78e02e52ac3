"""The multi-turn rollout loop (`mmrl.rollout.multiturn`) and the trainer's side of it.

The random tiny model never writes a tool call by itself, so these tests register a call format
that reads every turn as a call to `zoom_in` (`always_zoom`): the model's tokens are still its
own samples, the tool really runs, and its crops really enter the sequence as images."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmrl.config import AgentConfig
from mmrl.datasets.procedural import make_samples
from mmrl.environments import ParsedTurn, ToolCall, register_call_format
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.rollout.multiturn import generate_trajectories, trajectory_metrics
from mmrl.train.batching import select_rows
from mmrl.train.forward import output_head, response_logprobs
from mmrl.types import AgentSpec
from tests.conftest import bias_stop_token


@register_call_format("always_zoom")
def _always_zoom(text: str) -> ParsedTurn:
    return ParsedTurn(
        calls=[ToolCall("zoom_in", {"bbox_2d": [0, 0, 32, 32]}, text)], errors=[], error_kinds=[]
    )


@register_call_format("never_called")
def _never(text: str) -> ParsedTurn:
    return ParsedTurn(calls=[], errors=[], error_kinds=[])


@pytest.fixture()
def tiny_policy(tiny_policy):
    """The random tiny Qwen2-VL with an LM head bias that makes its stop token likely (about half
    of the draws), so that its turns end on their stop token within a few tokens."""
    return bias_stop_token(tiny_policy)


def _tool_samples(n: int, tools: bool = True, **limits):
    samples = make_samples(["colour_code", "count"], n, "train")
    if not tools:
        return samples
    return [dataclasses.replace(s, agent=AgentSpec(tools=["zoom_in"], **limits)) for s in samples]


def _agent(**kw) -> AgentConfig:
    return AgentConfig(**{"call_format": "always_zoom", "max_turns": 3, "max_tokens": 400, **kw})


def test_three_turn_trajectories_recompute_the_rollout_logprobs_and_train_no_observation_token(tiny_policy):
    """The acceptance test: a float32 tiny model, 3-turn trajectories with two observation
    images each. The trainer's log-probs of the model tokens equal the rollout's within 1e-5 and
    observation tokens enter no loss: no log-prob, no gradient through the LM head."""
    engine = HFRolloutEngine.from_policy(tiny_policy)
    samples = _tool_samples(3)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12)
    batch = generate_trajectories(engine, samples, params, _agent())
    assert batch.observation_mask is not None and batch.trajectories is not None
    for r, traj in enumerate(batch.trajectories):
        assert traj.turns == 3 and traj.termination == "max_turns"  # a call in turn 3 is not run
        assert len(traj.images) == 2  # two zoom crops: the observation images
        assert batch.images_per_row[r] == len(batch.samples[r].images) + 2
        assert traj.observation_tokens == int(batch.observation_mask[r].sum()) > 0
    # model and observation tokens never overlap; observations carry no rollout log-prob
    assert not (batch.response_mask.bool() & batch.observation_mask.bool()).any()
    assert (batch.rollout_logprobs[batch.observation_mask.bool()] == 0).all()
    image_pad = tiny_policy.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (batch.response_ids[batch.observation_mask.bool()] == image_pad).any()  # images in the response

    with torch.no_grad():
        recomputed, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    torch.testing.assert_close(recomputed, batch.rollout_logprobs, atol=1e-5, rtol=0)
    # a sub-batch keeps each row's own images (pixel slices of multi-image rows)
    rows = [5, 0, 3]
    with torch.no_grad():
        sub, _ = response_logprobs(tiny_policy.model, select_rows(batch, rows), tiny_policy.blocked, 1.0)
    torch.testing.assert_close(sub, batch.rollout_logprobs[rows], atol=1e-5, rtol=0)

    # Gradients: the per-token log-probs at observation positions are exactly 0 and get exactly
    # zero gradient, and the LM head's gradient is the one from the model tokens' positions alone.
    model = tiny_policy.model
    model.zero_grad()
    logprobs, _ = response_logprobs(model, batch, tiny_policy.blocked, 1.0)
    logprobs.retain_grad()
    advantages = torch.linspace(-1.0, 1.0, len(batch))[:, None]
    loss = -(logprobs * advantages * batch.response_mask).sum()
    loss.backward()
    obs = batch.observation_mask.bool()
    assert (logprobs.detach()[obs] == 0).all() and (logprobs.grad[obs] == 0).all()
    head, _ = output_head(model)
    if head.weight is not model.get_input_embeddings().weight:  # (untied: its gradient is the head's alone)
        full_grad = head.weight.grad.clone()
        captured = {}

        def keep(module, args, output):
            captured["h"] = output.last_hidden_state.detach()

        from mmrl.train.forward import decoder, full_hidden

        handle = decoder(model).register_forward_hook(keep)
        try:
            with torch.no_grad():
                full_hidden(model, batch)
        finally:
            handle.remove()
        P = batch.prompt_ids.shape[1]
        h = captured["h"][:, P - 1 : P - 1 + batch.response_ids.shape[1]][batch.response_mask.bool()]
        y = batch.response_ids[batch.response_mask.bool()]
        w = head.weight.detach().clone().requires_grad_(True)
        logits = (h @ w.T + head.bias.detach()).masked_fill(tiny_policy.blocked[: w.shape[0]], float("-inf"))
        lp = torch.log_softmax(logits, -1).gather(-1, y[:, None]).squeeze(-1)
        adv = advantages.expand_as(batch.response_mask)[batch.response_mask.bool()]
        (-(lp * adv).sum()).backward()
        torch.testing.assert_close(full_grad, w.grad, atol=1e-5, rtol=1e-4)
    model.zero_grad()


def test_samples_without_tools_are_the_one_turn_case(tiny_policy):
    engine = HFRolloutEngine.from_policy(tiny_policy)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12)
    torch.manual_seed(1)
    plain = engine.generate(_tool_samples(2, tools=False), params)
    torch.manual_seed(1)
    looped = generate_trajectories(engine, _tool_samples(2, tools=False), params, _agent())
    assert looped.observation_mask is None and looped.trajectories is None
    assert torch.equal(plain.response_ids, looped.response_ids)
    assert torch.equal(plain.rollout_logprobs, looped.rollout_logprobs)


def test_with_and_without_tools_mix_in_one_batch(tiny_policy):
    engine = HFRolloutEngine.from_policy(tiny_policy)
    samples = _tool_samples(2) + _tool_samples(2, tools=False)
    samples = [
        dataclasses.replace(s, extra_info={**s.extra_info, "id": f"{i}"}) for i, s in enumerate(samples)
    ]
    batch = generate_trajectories(engine, samples, SamplingParams(n=2, max_new_tokens=12), _agent())
    turns = [t.turns for t in batch.trajectories]
    assert turns[:4] == [3] * 4 and turns[4:] == [1] * 4
    assert batch.observation_mask[4:].sum() == 0
    with torch.no_grad():
        recomputed, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    torch.testing.assert_close(recomputed, batch.rollout_logprobs, atol=1e-5, rtol=0)
    metrics = trajectory_metrics(batch, 2)
    assert metrics["agent/tool_call_rate"] == 0.5
    assert metrics["agent/group_tool_call_rate_min"] == 0.0
    assert metrics["agent/end_max_turns"] == 0.5 and metrics["agent/end_answer"] == 0.5


@pytest.mark.parametrize(
    ("limits", "reason", "images"),
    [({"max_images": 1}, "image_budget", 1), ({"max_tokens": 30}, "token_budget", None)],
)
def test_budgets_end_a_trajectory_before_the_observation_is_appended(tiny_policy, limits, reason, images):
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = generate_trajectories(
        engine, _tool_samples(1, **limits), SamplingParams(n=2, max_new_tokens=12), _agent()
    )
    for r, traj in enumerate(batch.trajectories):
        assert traj.termination == reason
        if images is not None:
            assert len(traj.images) == images
        n = int((batch.response_mask[r] | batch.observation_mask[r]).sum())
        assert n <= batch.samples[r].agent.max_tokens if batch.samples[r].agent.max_tokens else True


def test_over_limit_mask_takes_the_trajectory_out_of_the_loss(tiny_policy):
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = generate_trajectories(
        engine, _tool_samples(1), SamplingParams(n=2, max_new_tokens=12), _agent(over_limit="mask")
    )
    assert all(t.termination == "max_turns" for t in batch.trajectories)
    assert batch.response_mask.sum() == 0 and batch.observation_mask.sum() > 0


def test_grpo_steps_train_on_trajectories_with_their_metrics(tiny_policy, mmrl_cache):
    """Two GRPO steps of the trainer's own loop (`grpo_step`) on samples that name a tool: the
    update runs on multi-turn batches (the weights move) and the `agent/` metrics are reported,
    overall and per data source."""
    from mmrl.config import load_config
    from mmrl.train import grpo
    from mmrl.train.data import PromptSampler
    from mmrl.types import VerifyContext

    cfg = load_config(
        "vision_reasoning",
        overrides=[
            "trainer.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "trainer.mini_batches=1", "trainer.progress=false", "reward.num_workers=0",
            "agent.call_format=always_zoom", "agent.max_turns=2", "rollout.tokenization_check=true",
            "algo.entropy_coef=0.01",  # a gradient even where the random model's groups all score 0
        ],
    )  # fmt: skip
    before = {k: v.detach().clone() for k, v in tiny_policy.model.state_dict().items()}
    grpo.seed_everything(cfg.trainer.seed)
    t = grpo.make_trainee(cfg, tiny_policy, None)
    sampler = PromptSampler(_tool_samples(4), cfg.trainer.seed)
    try:
        metrics = [grpo.grpo_step(cfg, t, sampler, VerifyContext(k, 2), step=k + 1) for k in range(2)]
    finally:
        t.close()
    for m in metrics:
        assert m["agent/turns"] == 2.0 and m["agent/tool_call_rate"] == 1.0
        assert m["agent/end_max_turns"] == 1.0 and m["agent/observation_tokens"] > 0
        assert m["agent/tokenization_drift"] >= 0.0  # (which rows drift: the next test)
        assert any(k.startswith("agent/turns/") for k in m)  # per data source
        assert all(
            torch.isfinite(torch.tensor(v)) for k, v in m.items() if k.startswith(("actor/", "agent/"))
        )
    after = tiny_policy.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_deepeyes_reward_gives_the_tool_bonus_only_to_correct_answers_that_used_a_tool():
    from mmrl.rollout.multiturn import shape_results
    from mmrl.types import Trajectory, VerifierResult

    used = Trajectory(turns=2, tool_calls=1)
    failed = Trajectory(turns=2, tool_calls=1, tool_errors={"bad_arguments": 1})
    none = Trajectory(turns=1, tool_calls=0)
    results = [
        VerifierResult(score=1.0, components={"accuracy": 1.0}),
        VerifierResult(score=0.0, components={"accuracy": 0.0}),
        VerifierResult(score=1.0, components={"accuracy": 1.0}),
        VerifierResult(score=1.0, components={"accuracy": 1.0}),
        VerifierResult(score=0.0, error="timeout: math verifier ran past 5s"),
    ]
    agent = AgentConfig(reward="deepeyes", tool_bonus=0.5)
    shaped = shape_results(results, [used, used, failed, none, used], agent)
    assert [r.score for r in shaped] == [1.5, 0.0, 1.0, 1.0, 0.0]
    assert shaped[0].components["tool_bonus"] == 0.5 and results[0].score == 1.0  # the router's own kept
    weighted = shape_results(
        results[:1], [Trajectory(tool_calls=1, tool_reward=2.0)], AgentConfig(tool_reward_weight=0.25)
    )
    assert weighted[0].score == 1.5


def test_the_tokenization_check_finds_drift_exactly_where_a_turn_decodes_lossily(tiny_policy):
    """The random model samples arbitrary bytes: a turn that is not valid UTF-8 decodes with
    U+FFFD and re-tokenizes differently (drift > 0); every other row re-renders to exactly the
    ids the model saw (drift 0) through the byte template."""
    from mmrl.rollout.multiturn import row_drifts

    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = generate_trajectories(
        engine, _tool_samples(4), SamplingParams(n=4, max_new_tokens=12), _agent(max_turns=2)
    )
    tok = tiny_policy.processor.tokenizer
    stop = tiny_policy.stop_token_ids[0]
    drifts = row_drifts(batch, tiny_policy.processor)
    lossless = []
    for r in range(len(batch)):
        ids = [i for i in batch.response_ids[r][batch.response_mask[r].bool()].tolist() if i != stop]
        lossless.append(tok.encode("".join(batch.trajectories[r].turn_texts)) == ids)
    assert any(lossless) and not all(lossless)  # both kinds in the batch (seeded)
    assert [d == 0 for d in drifts] == lossless


def test_the_last_line_carries_the_tool_figures():
    from pathlib import Path

    from mmrl.train.grpo import TrainResult

    result = TrainResult(
        run_dir=Path("runs/x"), start_accuracy=0.4, final_accuracy=0.6, best_accuracy=0.6, steps=10,
        seconds=5.0, start_interval=(0.35, 0.45), final_interval=(0.55, 0.65), eval_size=256,
        tools={"start_tool_call_rate": 0.9, "final_tool_call_rate": 1.0, "start_no_tools": 0.17,
               "start_no_tools_low": 0.13, "start_no_tools_high": 0.22, "final_no_tools": 0.18,
               "final_no_tools_low": 0.14, "final_no_tools_high": 0.23},
    )  # fmt: skip
    line = result.summary_line()
    assert "0.400 [0.350-0.450] -> 0.600 [0.550-0.650] (+20.0 points; 256 prompts each" in line
    assert "tool-call rate 0.900 -> 1.000" in line
    assert "with the tools off 0.170 [0.130-0.220] -> 0.180 [0.140-0.230]" in line


# ---------------------------------------------------------------------------------------------
# The HF engine's turns: images processed once, continuations in its own decode loop from the
# key/value cache kept since the last turn
# ---------------------------------------------------------------------------------------------


def _prefill_widths(model) -> tuple[list[int], object]:
    """The widths of the forwards over more than one new position (prefills), as they run."""
    widths: list[int] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            widths.append(int(ids.shape[1]))

    return widths, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_each_image_goes_through_the_image_processor_once_and_the_batch_is_bit_identical(
    tiny_policy, monkeypatch
):
    """The prompt's images come from the first turn's processor outputs and each observation's
    from its own tokenization: nothing else runs the image processor, and the batch's vision
    inputs are exactly the image processor's outputs over every row's images, row by row."""
    from mmrl.rollout.hf import image_inputs

    processor = tiny_policy.processor
    processed: list[int] = []
    real = processor.image_processor.preprocess

    def counting(images, *args, **kwargs):
        processed.append(len(images) if isinstance(images, list) else 1)
        return real(images, *args, **kwargs)

    monkeypatch.setattr(processor.image_processor, "preprocess", counting)
    engine = HFRolloutEngine.from_policy(tiny_policy)
    samples = _tool_samples(3)
    batch = generate_trajectories(engine, samples, SamplingParams(n=2, max_new_tokens=12), _agent())
    observation_images = sum(len(t.images) for t in batch.trajectories)
    assert observation_images == 2 * len(batch)
    assert sum(processed) == sum(len(s.images) for s in samples) + observation_images
    monkeypatch.setattr(processor.image_processor, "preprocess", real)
    rows = [s.pil_images() + list(t.images) for s, t in zip(batch.samples, batch.trajectories)]
    reference = image_inputs(processor, rows)
    assert torch.equal(batch.vision_inputs["pixel_values"], reference["pixel_values"])
    assert torch.equal(batch.vision_inputs["image_grid_thw"], reference["image_grid_thw"])


def test_observations_tokenized_together_are_the_ids_of_each_tokenized_alone(tiny_policy):
    from mmrl.environments import Observation
    from mmrl.rollout.multiturn import observation_batch, observation_tokens

    processor = tiny_policy.processor
    image = make_samples(["colour_code"], 1, "train")[0].pil_images()[0]
    turns = [
        [Observation(text="a crop", images=[image.crop((0, 0, 40, 40))])],
        [Observation(text="no image here, a longer text than the others")],
        [
            Observation(text="two", images=[image, image.crop((8, 8, 60, 30))]),
            Observation(text="and a second call"),
        ],
    ]
    together = observation_batch(processor, turns)
    for turn, (ids, images, messages) in zip(turns, together):
        # (what observation_tokens did before: one processor call of its own, unpadded)
        from mmrl.models.chat_templates import observation_text

        alone_ids, alone_images, alone_messages = observation_tokens(processor, turn)
        assert ids == alone_ids and images == alone_images and messages == alone_messages
        text = observation_text(processor, messages)
        own = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        assert ids == own["input_ids"][0].tolist()


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_continuation_from_the_kept_cache_samples_what_a_full_prefill_samples(
    tiny_policy, monkeypatch, decode
):
    """The same seed with and without the kept key/value caches: the same tokens, log-probs
    within 1e-5 of each other and of the trainer's, while the continuations prefill only the
    observations (not the whole sequence again)."""
    from mmrl.rollout.hf import TurnCache

    engine = HFRolloutEngine.from_policy(tiny_policy)
    engine.decode = decode
    samples = _tool_samples(3)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12)
    runs = {}
    for keep in (True, False):
        monkeypatch.setattr(engine, "turn_cache", lambda keep=keep: TurnCache(keep_kv=keep))
        widths, handle = _prefill_widths(tiny_policy.model)
        torch.manual_seed(3)
        try:
            runs[keep] = (generate_trajectories(engine, samples, params, _agent()), widths)
        finally:
            handle.remove()
    (kept, kept_widths), (full, full_widths) = runs[True], runs[False]
    assert torch.equal(kept.response_ids, full.response_ids)
    assert torch.equal(kept.observation_mask, full.observation_mask)
    torch.testing.assert_close(kept.rollout_logprobs, full.rollout_logprobs, atol=1e-5, rtol=0)
    with torch.no_grad():
        recomputed, _ = response_logprobs(tiny_policy.model, kept, tiny_policy.blocked, 1.0)
    torch.testing.assert_close(recomputed, kept.rollout_logprobs, atol=1e-5, rtol=0)
    # the first turn's prefill, then two continuations each: observation (+ the stop token) vs all
    assert len(kept_widths) == len(full_widths) == 3
    observation = max(int(t.observation_tokens) for t in kept.trajectories)
    assert all(w <= observation for w in kept_widths[1:])
    assert all(w > kept.prompt_mask.sum(1).min() for w in full_widths[1:])


def test_kept_positions_go_on_as_the_models_layout_of_the_whole_sequence(tiny_policy):
    """A continuation's positions from a kept cache (the model's layout over the new tokens,
    moved to continue from the kept last position) are the M-RoPE positions of the whole
    sequence, images inside the response included."""
    from mmrl.models.families import family_of, mm_token_types
    from mmrl.rollout.hf import _KeptRow, continuation_inputs, image_inputs

    engine = HFRolloutEngine.from_policy(tiny_policy)
    model, processor = tiny_policy.model, tiny_policy.processor
    batch = generate_trajectories(engine, _tool_samples(2), SamplingParams(n=1, max_new_tokens=12), _agent())
    stop = tiny_policy.stop_token_ids[0]
    for r in range(len(batch)):
        prompt = batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist()
        response = batch.response_ids[r][batch.response_attention()[r].bool()].tolist()
        ids = prompt + response
        images = batch.samples[r].pil_images() + list(batch.trajectories[r].images)
        full = torch.tensor([ids])
        inputs = {
            "input_ids": full,
            "attention_mask": torch.ones_like(full),
            **image_inputs(processor, [images]),
        }
        inputs["mm_token_type_ids"] = mm_token_types(full, processor.image_token_id, None)
        positions = family_of(model).position_ids(model, inputs)  # [3, 1, T]
        model_turns = [i for i, t in enumerate(response) if t == stop]
        assert len(model_turns) >= 2
        for end in model_turns[:2]:  # kept through a model turn's stop token
            k = len(prompt) + end + 1
            held_images = len(batch.samples[r].images) + (end > model_turns[0])
            layers = [(torch.zeros(1, 2, k, 32), torch.zeros(1, 2, k, 32))]
            kept = _KeptRow(ids[:k], held_images, layers, 0, torch.arange(k), positions[:, 0, k - 1].tolist())
            got, _ = continuation_inputs(processor, model, [ids], [images], [kept], 0, torch.device("cpu"))
            assert torch.equal(got["position_ids"], positions[..., k:])
            assert torch.equal(got["input_ids"], full[:, k:])
            assert got["attention_mask"].shape == (1, len(ids)) and bool(got["attention_mask"].all())


@register_call_format("always_note")
def _always_note(text: str) -> ParsedTurn:
    return ParsedTurn(calls=[ToolCall("mt_note", {}, text)], errors=[], error_kinds=[])


def _register_note_tool():
    from mmrl.environments import ToolContext, register_tool

    def mt_note(*, context: ToolContext) -> str:
        """Write a note."""
        calls = context.state["calls"] = context.state.get("calls", 0) + 1
        return "note " * (len(context.sample_id) % 3 + 2 * calls)

    register_tool("mt_note", replace=True)(mt_note)


def test_text_only_trajectories_keep_their_positions_across_turns(tiny_policy):
    """No image anywhere: Qwen-VL's positions then count left padding, which differs between
    the first turn's batch and a continuation's; the kept cache's own positions go on, and the
    trainer's log-probs still match."""
    from mmrl.types import RewardSpec, Sample

    _register_note_tool()
    engine = HFRolloutEngine.from_policy(tiny_policy)
    samples = [
        Sample(
            data_source="notes", prompt=[{"role": "user", "content": "count " * (3 + 5 * i)}], images=[],
            ability="math", reward_model=RewardSpec(ground_truth="1", verifier="math"),
            extra_info={"id": "n" * (i + 1)}, agent=AgentSpec(tools=["mt_note"]),
        )
        for i in range(3)
    ]  # fmt: skip
    widths, handle = _prefill_widths(tiny_policy.model)
    try:
        batch = generate_trajectories(
            engine, samples, SamplingParams(n=2, max_new_tokens=10), _agent(call_format="always_note")
        )
    finally:
        handle.remove()
    assert [t.turns for t in batch.trajectories] == [3] * 6
    assert batch.prompt_mask.sum(1).unique().numel() > 1  # really padded
    # prefilled from kept caches: at most a turn's observations (the whole sequence is longer)
    assert len(widths) == 3 and all(
        w <= max(t.observation_tokens for t in batch.trajectories) for w in widths[1:]
    )
    with torch.no_grad():
        recomputed, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    torch.testing.assert_close(recomputed, batch.rollout_logprobs, atol=1e-5, rtol=0)


def test_partial_rollouts_chunk_every_turn_and_keep_the_trajectory_exact(tiny_policy):
    """Multi-turn trajectories generated in chunks of 1 token (`Interrupt`), the version going up
    at every chunk (the weights kept, so the log-probs can be checked): model tokens carry the
    version of their chunk and observations -1, a turn longer than a chunk spans versions, and
    the trainer's log-probs of the whole trajectory equal the rollout's (the continuations
    resume a turn exactly where the chunk cut it)."""
    from mmrl.rollout.multiturn import Interrupt

    engine = HFRolloutEngine.from_policy(tiny_policy)
    calls = []

    def refresh() -> int:
        calls.append(None)
        return len(calls) - 1

    torch.manual_seed(2)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    batch = generate_trajectories(
        engine, _tool_samples(2), params, _agent(), interrupt=Interrupt(chunk=1, refresh=refresh)
    )
    versions, model, obs = batch.token_versions, batch.response_mask.bool(), batch.observation_mask.bool()
    assert (versions[obs] == -1).all() and (versions[model] >= 0).all()
    assert any(traj.turns > 1 for traj in batch.trajectories)  # tools really ran between turns
    spans = [len(set(versions[r][model[r]].tolist())) for r in range(len(batch))]
    assert max(spans) > max(traj.turns for traj in batch.trajectories)  # turns cut into chunks
    with torch.no_grad():
        recomputed, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    torch.testing.assert_close(recomputed, batch.rollout_logprobs, atol=1e-5, rtol=0)
