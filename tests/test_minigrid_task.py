"""The built-in `minigrid` task: layouts held out by split, the expert's demonstrations laid out
as the rollout loop lays out an episode, and the random baseline."""

from __future__ import annotations

import torch

from mmrl.config import AgentConfig
from mmrl.datasets.minigrid import MAX_TURNS, layout_split, random_policy_success
from mmrl.datasets.procedural import make_samples
from mmrl.rollout.multiturn import demonstration_batch, trajectory_metrics
from mmrl.train.forward import response_logprobs


def test_held_out_layouts_are_never_in_the_training_or_validation_data():
    train = make_samples(["minigrid"], 3000, "train")
    validation = make_samples(["minigrid"], 300, "validation")
    heldout = make_samples(["minigrid"], 300, "heldout")
    rooms = {split: {tuple(s.extra_info["layout"]) for s in data} for split, data in
             [("train", train), ("validation", validation), ("heldout", heldout)]}  # fmt: skip
    assert not rooms["heldout"] & (rooms["train"] | rooms["validation"])
    assert not rooms["validation"] & rooms["train"]
    assert all(layout_split(r) == split for split, rs in rooms.items() for r in rs)
    assert len(rooms["train"]) > 150  # most of the ~200 training rooms: the split is by room, not by luck
    seeds = {s.agent.env.seed for s in train}
    assert not seeds & {s.agent.env.seed for s in heldout}
    s = heldout[0]
    assert s.images == [] and s.reward_model.verifier == "env" and s.agent.env.id == "minigrid-goal"
    assert 1 <= len(s.extra_info["env_demonstration"]) <= 6 and s.agent.max_turns == MAX_TURNS


def test_the_experts_episodes_reach_the_goal_laid_out_as_a_rollout(tiny_policy):
    """The cold start's batch: the reset's picture in the prompt, one action word per turn, each
    step's picture between them as a user turn; every episode ends on the goal with MiniGrid's
    reward; the trainer's forward reads it like any multi-turn batch."""
    samples = make_samples(["minigrid"], 6, "train")
    turns = [s.extra_info["env_demonstration"] for s in samples]
    batch = demonstration_batch(
        tiny_policy.processor, samples, turns, tiny_policy.stop_token_ids[0], tiny_policy.pad_token_id,
        AgentConfig(max_tokens=512, max_images=10),
    )  # fmt: skip
    for r, (traj, words) in enumerate(zip(batch.trajectories, turns)):
        assert traj.termination == "env_done" and traj.turns == len(words) == traj.env_steps
        assert traj.turn_texts == words and 0 < traj.env_return <= 1
        assert batch.images_per_row[r] == len(words)  # the reset's, then one per step but the last
    assert trajectory_metrics(batch, 1)["agent/env_success"] == 1.0
    tokenizer = tiny_policy.processor.tokenizer
    assert "Reach the green square." in tokenizer.decode(batch.prompt_ids[0])
    model_text = tokenizer.decode(batch.response_ids[0][batch.response_mask[0].bool()])
    assert model_text.replace("<|im_end|>", " ").split() == turns[0]
    with torch.no_grad():
        logprobs, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    assert torch.isfinite(logprobs).all() and (logprobs[batch.observation_mask.bool()] == 0).all()


def test_the_random_policy_baseline_is_measured_on_the_same_seeds():
    seeds = [s.agent.env.seed for s in make_samples(["minigrid"], 64, "heldout")]
    wins, n = random_policy_success(seeds)
    assert n == 64 and 0 < wins < 32  # it sometimes stumbles on the goal, rarely
    assert random_policy_success(seeds) == (wins, n)  # seeded
