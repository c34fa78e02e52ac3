"""Configuration of decoupled RL on a planner + diffusion-decoder generator (`--task text_to_image_decoupled`).

    cfg = load_decoupled_config("text_to_image_decoupled", overrides=["trainer.total_steps=10"])

The decoder half is configured exactly as flow-GRPO (`mmrl.train.flow_config`: `model`,
`sample`, `reward`, `algo`, `lora`, `optim`, `trainer`); `sample.group_size` is K, the images
per plan, and `reward` holds the decoder's (high-frequency) rewards, scored against the plan it
was given. `planner` adds the autoregressive half: its model, G plans per request, its GRPO-family
objective and optimizer, and its own (low-frequency) rewards, scored against what the request
means. `train_halves` says which halves are updated (the other still samples: the ablations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmrl.config import load_structured
from mmrl.models.planner import DEFAULT_INSTRUCTION, PlannerSpec, PlannerWarmupConfig
from mmrl.train.flow_config import FlowConfig, FlowDataConfig

HALVES = ("planner", "decoder")


@dataclass
class PlannerRewardConfig:
    """The planner's rewards: scored on the final images against the request's target (what it
    means), averaged over the K images of each plan."""

    names: list[str] = field(default_factory=lambda: ["geneval"])
    """Registered reward models (`mmrl.rewards`)."""
    weights: list[float] = field(default_factory=lambda: [1.0])
    """One weight per reward."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments per reward name."""


@dataclass
class PlannerConfig:
    """The autoregressive half: a causal LM that rewrites each request into the decoder's prompt."""

    path: str | None = None
    """Local causal-LM folder or hub id (`AutoModelForCausalLM`); None: the built-in tiny planner."""
    revision: str | None = None
    """Hub revision when `path` is a hub id."""
    tiny: PlannerSpec = field(default_factory=PlannerSpec)
    """Shape of the built-in planner."""
    warmup: PlannerWarmupConfig = field(default_factory=PlannerWarmupConfig)
    """Its supervised warm-up (cached)."""
    template: str | None = None
    """`{request}` prompt format; None: the folder's own (the built-in planner's), else the
    tokenizer's chat template with `instruction`."""
    instruction: str = DEFAULT_INSTRUCTION
    """User message of a chat-template planner (`{request}` is filled)."""
    max_new_tokens: int = 0
    """Longest plan in tokens; 0: the folder's own, else 16."""
    group_size: int = 4
    """G: plans sampled per request (the planner's GRPO group)."""
    temperature: float = 1.0
    """Sampling temperature (the log-probs are the tempered distribution's)."""
    advantage: str = "grpo"
    """Advantage estimator over each request's G plans (`mmrl.algos.advantages`)."""
    loss: str = "ppo"
    """Policy loss (`mmrl.algos.losses`: ppo, gspo, cispo, ...)."""
    clip_low: float = 0.2
    """Lower clip range of the planner's ratio (1 - clip_low)."""
    clip_high: float = 0.2
    """Upper clip range of the planner's ratio (1 + clip_high; clip-higher when above clip_low)."""
    agg: str = "token_mean"
    """Loss aggregation (`mmrl.algos.losses.AGGREGATIONS`)."""
    lr: float = 1e-3
    """AdamW learning rate of the planner."""
    weight_decay: float = 0.0
    """AdamW weight decay of the planner."""
    grad_clip: float = 1.0
    """Clip the planner's gradient norm to this (0: off)."""
    mini_batches: int = 1
    """Optimizer steps per inner epoch over the B x G plans."""
    inner_epochs: int = 1
    """Passes over each step's plans (PPO epochs)."""
    rewards: PlannerRewardConfig = field(default_factory=PlannerRewardConfig)
    """The planner's rewards (see `PlannerRewardConfig`)."""


def _paraphrase_data() -> FlowDataConfig:
    return FlowDataConfig(task="text_to_image_decoupled", builtin="paraphrase", kinds=["single"])


@dataclass
class DecoupledConfig(FlowConfig):
    """Everything a decoupled run needs: the flow-GRPO config of the decoder, plus `planner`."""

    KIND = "decoupled"
    BUILTINS = ("paraphrase",)

    kind: str = "decoupled"
    data: FlowDataConfig = field(default_factory=_paraphrase_data)
    """`builtin=paraphrase`: the synonym requests of `mmrl.datasets.paraphrase`; or
    `prompt_file`, a JSONL of {"request", "target" (optional: what the planner's rewards check;
    default the request), "reference" (optional: an image path for `perceptual`)}."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """The autoregressive half."""
    train_halves: list[str] = field(default_factory=lambda: list(HALVES))
    """Which halves are updated: both, or one of them (the other samples as it is)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        p, t = self.planner, self.trainer
        checks = [
            (p.group_size >= 2, "planner.group_size must be >= 2 (advantages are relative to the group)"),
            (p.temperature > 0, "planner.temperature must be > 0"),
            (p.max_new_tokens >= 0, "planner.max_new_tokens must be >= 0"),
            (len(p.rewards.names) >= 1, "planner.rewards.names must name at least one reward"),
            (
                len(p.rewards.weights) == len(p.rewards.names),
                "planner.rewards.weights must have one weight per planner.rewards.names entry",
            ),
            (
                p.mini_batches >= 1 and p.inner_epochs >= 1,
                "planner.mini_batches and inner_epochs must be >= 1",
            ),
            (
                (t.prompts_per_step * p.group_size) % p.mini_batches == 0,
                "planner.mini_batches must divide trainer.prompts_per_step * planner.group_size",
            ),
            (
                bool(self.train_halves) and all(h in HALVES for h in self.train_halves),
                f"train_halves must be a non-empty list of {list(HALVES)}, got {list(self.train_halves)}",
            ),
            (
                self.data.prompt_file is None or str(self.data.prompt_file).endswith(".jsonl"),
                "data.prompt_file must be a .jsonl file of requests for the decoupled loop",
            ),
        ]
        from mmrl.algos.advantages import ADVANTAGE_ESTIMATORS, NEEDS_BASELINE
        from mmrl.algos.losses import AGGREGATIONS, POLICY_LOSSES

        # the planner's reward is one number per plan: no greedy baseline (ReMax), no reward
        # columns (GDPO: combine the planner's rewards by weight instead)
        usable = sorted(set(ADVANTAGE_ESTIMATORS) - NEEDS_BASELINE - {"gdpo"})
        checks += [
            (p.advantage in usable, f"planner.advantage must be one of {usable}, got {p.advantage!r}"),
            (p.loss in POLICY_LOSSES, f"planner.loss must be one of {sorted(POLICY_LOSSES)}"),
            (p.agg in AGGREGATIONS, f"planner.agg must be one of {list(AGGREGATIONS)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid config: {message}")


def load_decoupled_config(
    task: str = "text_to_image_decoupled",
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
) -> DecoupledConfig:
    """Defaults <- task recipe <- config file <- `key=value` overrides, validated."""
    return load_structured(DecoupledConfig, task, config_file, overrides)
