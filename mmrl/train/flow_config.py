"""Configuration of flow-GRPO on diffusion models (`mmrl train --task text_to_image`).

    cfg = load_flow_config("text_to_image", overrides=["trainer.total_steps=20"])

Same pattern as `mmrl.config`: these dataclasses hold every default (each field documented
under it), `configs/<task>.yaml` the recipe, then `--config FILE`, then `key=value` overrides;
OmegaConf rejects unknown keys and wrong types with the full key name. A recipe is a diffusion
recipe when its top level says `kind: diffusion` (`is_diffusion_task`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mmrl.config import MlflowConfig, WandbConfig, load_structured, logger_checks, number_checks, recipe_kind
from mmrl.models.image_base import ImageWarmupConfig
from mmrl.models.planner import DEFAULT_INSTRUCTION, PlannerSpec, PlannerWarmupConfig
from mmrl.models.tiny_diffusion import TinyDiffusionSpec
from mmrl.train.schedule import SCHEDULES

LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]


@dataclass
class FlowModelConfig:
    """The text-to-image pipeline being trained."""

    path: str | None = None
    """Local diffusers pipeline folder (SD3 / SD3.5 / FLUX). None: the built-in tiny pipeline."""
    base: str = "random"
    """Without `path`: `random` (the tiny pipeline of `tiny`, random weights) or `geneval` (that
    pipeline after the flow-matching warm-up on GenEval-style drawings, `mmrl.models.image_base`;
    cached)."""
    tiny: TinyDiffusionSpec = field(default_factory=TinyDiffusionSpec)
    """Shape of the built-in tiny pipeline (`tiny.family=flux` for FLUX)."""
    warmup: ImageWarmupConfig = field(default_factory=ImageWarmupConfig)
    """The warm-up of `base=geneval` (its seed seeds the weights; `seed` is not used then)."""
    seed: int = 0
    """Seed of the built-in tiny pipeline's random weights (`base=random`)."""
    cache_dir: str | None = None
    """Where the built-in pipeline is saved; default `$MMRL_CACHE` or `~/.cache/mmrl`."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `path` is a hub id."""
    dtype: str = "auto"
    """Compute dtype (`mmrl.models.precision`): the frozen parts (VAE, text encoders, the LoRA
    base) are stored in it and the transformer runs under autocast in it; `auto`: bfloat16 on a
    GPU, float32 on a CPU. float32, bfloat16 or float16. The SDE arithmetic and log-probs stay
    float32."""
    master_dtype: str = "auto"
    """Dtype of the weights that train (LoRA adapters or the whole transformer) and of AdamW's
    state; `auto`: float32 (mixed precision). Set to `model.dtype` to train in it."""
    max_sequence_length: int = 0
    """T5 tokens per prompt; 0: 256 for a loaded pipeline, 8 for the built-in one (no T5: zeros)."""


@dataclass
class FlowDataConfig:
    """Prompts."""

    task: str = "text_to_image"
    """Task name (names the run directory)."""
    prompts: list[str] = field(default_factory=list)
    """Training prompts; empty: `prompt_file`, else the built-in set `builtin`."""
    builtin: str = "scenes"
    """Built-in prompts: `scenes` (captions, `mmrl.datasets.prompts_t2i`) or `geneval` (the
    GenEval-style grammar, `mmrl.datasets.geneval`: its train split, evaluated on its held-out
    split)."""
    prompt_file: str | None = None
    """Text file of training prompts, one per line."""
    kinds: list[str] = field(default_factory=lambda: ["single", "count", "position"])
    """`builtin=geneval`: the prompt kinds trained and evaluated on (`mmrl.datasets.geneval.KINDS`;
    the train split and the held-out prompts of these kinds, interleaved)."""
    eval_prompts: list[str] = field(default_factory=list)
    """Evaluation prompts; empty: the built-in set's held-out prompts. When every one is a
    GenEval-style prompt, evaluations also log `eval/geneval/accuracy` (whatever the reward)."""


@dataclass
class FlowSampleConfig:
    """How images are sampled (rollouts and evaluation)."""

    resolution: int = 64
    """Image side in pixels."""
    num_steps: int = 10
    """Denoising steps of a training rollout."""
    eval_num_steps: int = 20
    """Denoising steps of the ODE-only evaluation (denoising reduction: train few, evaluate many)."""
    guidance_scale: float = 1.0
    """Classifier-free guidance scale of rollouts (1: none; flow-GRPO uses 4.5 on SD3.5)."""
    eval_guidance_scale: float | None = None
    """Guidance scale of evaluation; None: `guidance_scale`."""
    group_size: int = 8
    """G: images per prompt; advantages are normalised within each prompt's group."""
    noise_level: float = 0.7
    """a: the SDE's noise level."""
    sde_type: str = "sde"
    """`sde` (flow-GRPO) or `cps` (coefficients-preserving sampling)."""
    sde_window_size: int = 0
    """Steps taken with the SDE (and trained) per rollout, a window placed at random
    (Flow-GRPO-Fast); 0: every step is an SDE step."""
    sde_window_range: list[int] = field(default_factory=list)
    """[lo, hi): where the window may lie; empty: anywhere in the schedule."""
    same_latent: bool = False
    """The G images of a prompt start from the same initial noise (seeded per prompt and step)."""
    negative_prompt: str = ""
    """Negative prompt of classifier-free guidance."""
    batch_size: int = 0
    """Images per sampling call (bounds memory); 0: the whole rollout batch at once."""


@dataclass
class FlowRewardConfig:
    """Image rewards (`mmrl.rewards`), combined with weights."""

    names: list[str] = field(default_factory=lambda: ["jpeg_compressibility"])
    """Registered reward models (`mmrl.rewards.reward_model_names()`)."""
    weights: list[float] = field(default_factory=lambda: [1.0])
    """One weight per reward."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments per reward name, e.g. {aesthetic: {weights: /models/aes.pt}}."""
    combine: str = "sum"
    """`sum`: the weighted sum is the reward, normalised per prompt; `gdpo`: each reward is
    normalised per prompt, then weighted, summed and batch-normalised (GDPO)."""
    on_error: str = "zero"
    """A reward model that raises, or returns a wrong count or non-finite scores, is an error for
    the images it did not score (logged, counted as `reward/errors/<name>`): `zero` scores them 0
    for that reward; `drop` leaves those images out of the update and of their group's statistics."""


@dataclass
class FlowAlgoConfig:
    """The flow-GRPO objective."""

    clip_range: float = 1e-4
    """PPO clip range of the per-step ratio (log-probs are per-element means, so ratios stay near 1)."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to [-adv_clip_max, adv_clip_max]."""
    global_std: bool = True
    """Divide the per-prompt centred rewards by the batch's std instead of the group's."""
    adv_eps: float = 1e-4
    """Added to the std before dividing."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference on the predicted mean (0: no reference pass)."""
    timestep_fraction: float = 1.0
    """Fraction of the SDE steps trained per update (a random subset, at least one)."""
    train_cfg: bool = True
    """With guidance_scale > 1, recompute log-probs with guidance, as sampled (False: train the
    conditional velocity alone; needs old_logprobs=recompute)."""
    old_logprobs: str = "rollout"
    """`rollout`: the sampler's log-probs; `recompute`: a no-grad trainer pass before the update."""


@dataclass
class FlowLoraConfig:
    """LoRA on the transformer (peft); disabled means full fine-tuning."""

    enabled: bool = True
    """Train LoRA adapters; False trains every transformer weight."""
    rank: int = 32
    """LoRA rank r."""
    alpha: int = 64
    """LoRA alpha (scale alpha / r)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module name suffixes that get adapters (SD3 and FLUX attention projections)."""
    init: str = "gaussian"
    """peft `init_lora_weights` (B = 0 either way: training starts from the base model)."""


@dataclass
class FlowOptimConfig:
    """AdamW on the trainable weights."""

    lr: float = 3e-4
    """Learning rate (constant, as flow-GRPO)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over the first N optimizer steps (lr x (n + 1) / N at the
    n-th), then constant; 0: constant from the start. Adam's first steps move every weight by
    ~lr whatever the gradient's size (its second moment is still one sample): with full
    fine-tuning on a policy gradient that is mostly noise, that first move alone can wreck the
    base."""
    schedule: str = "constant"
    """After the warm-up: `constant` (flow-GRPO's), or `linear` / `cosine` decay to 0 over the
    run's optimizer steps (`trainer.total_steps` x `inner_epochs` x `mini_batches`), as the
    GRPO trainer's `optim.schedule`: a policy that has found its gains keeps them instead of
    drifting on at full step size."""


@dataclass
class FlowTrainerConfig:
    """The loop."""

    total_steps: int = 100
    """RL steps (one rollout batch each)."""
    device: str = "auto"
    """Where the pipeline runs: `auto` (the local GPU, under torchrun the local rank's; else the
    CPU), or a torch device name."""
    prompts_per_step: int = 4
    """B: prompts per rollout batch (B x G images)."""
    mini_batches: int = 2
    """Optimizer steps per inner epoch (the batch is split; each accumulates over its trained steps)."""
    inner_epochs: int = 1
    """Passes over each rollout batch."""
    eval_every: int = 10
    """Steps between ODE evaluations (also at step 0 and at the end); 0: only those two."""
    eval_size: int = 8
    """Evaluation prompts (one image each, fixed seed; the grid PNG shows them)."""
    train_eval_size: int = 0
    """Training prompts also evaluated at every evaluation (one image each, another fixed seed),
    when the prompts are GenEval-style: their strict accuracy is reported beside the held-out
    one (`eval/geneval/train/*`). 0: none."""
    ema: bool = True
    """Keep an EMA of the trainable weights and evaluate / save it."""
    ema_decay: float = 0.9
    """EMA decay per update (warmed up as min(decay, (1 + n) / (10 + n)))."""
    ema_every: int = 1
    """Optimizer steps between EMA updates."""
    seed: int = 0
    """Seed of prompts order, initial noise and SDE noise."""
    run_dir: str | None = None
    """Run directory; default `runs/<task>-<timestamp>`."""
    threads: int = 0
    """torch CPU threads; 0: leave torch's default."""
    save_final: bool = True
    """Save the final pipeline (EMA weights, LoRA merged) under `<run_dir>/final`."""
    progress: bool = True
    """Show a progress bar."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where metrics go: `jsonl` (always), `tensorboard`, `wandb`, `mlflow` (as the VLM trainer's
    `trainer.loggers`); the trackers also get each evaluation's image grid."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases settings (with `wandb` in `loggers`)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow settings (with `mlflow` in `loggers`)."""
    checkpoint_every: int = 0
    """Write a resumable checkpoint every N steps (0: only at the end and on SIGINT/SIGTERM)."""
    keep_last: int = 2
    """Checkpoints kept (the newest); 0 keeps all."""
    resume: str | None = None
    """`auto`: continue from the newest complete checkpoint in `run_dir` (start fresh if there is
    none yet); a checkpoint folder: continue from it; None: start fresh."""
    dump_steps: bool = False
    """Write every step's images (PNG) and their prompts, rewards and advantages to
    `<run_dir>/dumps/step_<n>.jsonl` and `<run_dir>/dumps/step_<n>/`."""


@dataclass
class FlowConfig:
    """Everything a flow-GRPO run needs."""

    KIND = "diffusion"
    """The `kind` this config class runs (a subclass runs another loop)."""
    BUILTINS = ("scenes", "geneval")
    """The `data.builtin` prompt sets it knows."""

    kind: str = "diffusion"
    """Marks a diffusion recipe (the CLI dispatches on it)."""
    model: FlowModelConfig = field(default_factory=FlowModelConfig)
    """The pipeline: a local folder or the built-in tiny one."""
    data: FlowDataConfig = field(default_factory=FlowDataConfig)
    """Training and evaluation prompts."""
    sample: FlowSampleConfig = field(default_factory=FlowSampleConfig)
    """Rollout and evaluation sampling."""
    reward: FlowRewardConfig = field(default_factory=FlowRewardConfig)
    """Rewards and how they are combined."""
    algo: FlowAlgoConfig = field(default_factory=FlowAlgoConfig)
    """The objective."""
    lora: FlowLoraConfig = field(default_factory=FlowLoraConfig)
    """LoRA or full fine-tuning."""
    optim: FlowOptimConfig = field(default_factory=FlowOptimConfig)
    """Optimizer."""
    trainer: FlowTrainerConfig = field(default_factory=FlowTrainerConfig)
    """Loop, evaluation, EMA, run directory."""

    def __post_init__(self) -> None:
        from mmrl.datasets.geneval import KINDS as GENEVAL_KINDS

        s, a, t, r = self.sample, self.algo, self.trainer, self.reward
        checks = [
            (self.kind == self.KIND, f"kind must be {self.KIND}"),
            (self.model.tiny.family in ("sd3", "flux"), "model.tiny.family must be sd3 or flux"),
            (self.model.base in ("random", "geneval"), "model.base must be random or geneval"),
            (
                self.model.base != "geneval" or self.model.tiny.family == "sd3",
                "model.base=geneval is an SD3 pipeline: model.tiny.family must be sd3 (or model.base=random)",
            ),
            (self.data.builtin in self.BUILTINS, f"data.builtin must be one of {list(self.BUILTINS)}"),
            (
                bool(self.data.kinds) and all(k in GENEVAL_KINDS for k in self.data.kinds),
                f"data.kinds must be a non-empty list of {list(GENEVAL_KINDS)}, got {list(self.data.kinds)}",
            ),
            (self.model.warmup.max_steps >= 1, "model.warmup.max_steps must be >= 1"),
            (self.model.warmup.eval_every >= 1, "model.warmup.eval_every must be >= 1"),
            (0 <= self.model.warmup.cond_dropout < 1, "model.warmup.cond_dropout must be in [0, 1)"),
            (self.model.warmup.object_scale > 0, "model.warmup.object_scale must be > 0"),
            (
                self.model.dtype in ("auto", "float32", "bfloat16", "float16"),
                "model.dtype must be auto, float32, bfloat16 or float16",
            ),
            (
                self.model.master_dtype in ("auto", "float32", "bfloat16", "float16"),
                "model.master_dtype must be auto, float32, bfloat16 or float16",
            ),
            (s.group_size >= 2, "sample.group_size must be >= 2 (advantages are relative to the group)"),
            (s.num_steps >= 1 and s.eval_num_steps >= 1, "sample.num_steps and eval_num_steps must be >= 1"),
            (s.sde_type in ("sde", "cps"), "sample.sde_type must be sde or cps"),
            (s.noise_level > 0, "sample.noise_level must be > 0"),
            (0 <= s.sde_window_size <= s.num_steps, "sample.sde_window_size must be in [0, num_steps]"),
            (len(s.sde_window_range) in (0, 2), "sample.sde_window_range must be [] or [lo, hi]"),
            (len(r.names) >= 1, "reward.names must name at least one reward"),
            (r.on_error in ("zero", "drop"), f"reward.on_error must be zero or drop, got {r.on_error!r}"),
            (len(r.weights) == len(r.names), "reward.weights must have one weight per reward.names entry"),
            (r.combine in ("sum", "gdpo"), "reward.combine must be sum or gdpo"),
            (a.clip_range > 0, "algo.clip_range must be > 0"),
            (a.adv_clip_max > 0, "algo.adv_clip_max must be > 0"),
            (a.kl_coef >= 0, "algo.kl_coef must be >= 0"),
            (0 < a.timestep_fraction <= 1, "algo.timestep_fraction must be in (0, 1]"),
            (a.old_logprobs in ("rollout", "recompute"), "algo.old_logprobs must be rollout or recompute"),
            (
                a.train_cfg or s.guidance_scale <= 1 or a.old_logprobs == "recompute",
                "algo.train_cfg=false with guidance needs algo.old_logprobs=recompute "
                "(the rollout's log-probs are the guided policy's)",
            ),
            (self.lora.rank >= 1, "lora.rank must be >= 1"),
            (self.optim.warmup_steps >= 0, "optim.warmup_steps must be >= 0"),
            (
                self.optim.schedule in SCHEDULES,
                f"optim.schedule must be one of {', '.join(SCHEDULES)}, got {self.optim.schedule!r}",
            ),
            (t.prompts_per_step >= 1, "trainer.prompts_per_step must be >= 1"),
            (
                t.mini_batches >= 1 and t.inner_epochs >= 1,
                "trainer.mini_batches and inner_epochs must be >= 1",
            ),
            (
                (t.prompts_per_step * s.group_size) % t.mini_batches == 0,
                "trainer.mini_batches must divide prompts_per_step * sample.group_size",
            ),
            (0 < t.ema_decay < 1 and t.ema_every >= 1, "trainer.ema_decay must be in (0, 1), ema_every >= 1"),
            (t.eval_size >= 1, "trainer.eval_size must be >= 1"),
            (t.train_eval_size >= 0, "trainer.train_eval_size must be >= 0"),
            (t.total_steps >= 1, "trainer.total_steps must be >= 1"),
            (t.eval_every >= 0, "trainer.eval_every must be >= 0"),
            (t.checkpoint_every >= 0, "trainer.checkpoint_every must be >= 0 (0: only at the end)"),
            (t.keep_last >= 0, "trainer.keep_last must be >= 0 (0: keep all)"),
            (not t.resume or bool(t.run_dir), "trainer.resume needs trainer.run_dir (the run to continue)"),
            *logger_checks(t),
        ]
        for ok, message in [*number_checks(self), *checks]:
            if not ok:
                raise ValueError(f"invalid config: {message}")


def load_flow_config(
    task: str = "text_to_image",
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
) -> FlowConfig:
    """Defaults <- task recipe <- config file <- `key=value` overrides, validated. A `kind:
    decoupled` recipe gives its subclass (`mmrl.train.flow_config.DecoupledConfig`)."""
    if recipe_kind(task) == "decoupled":
        return load_structured(DecoupledConfig, task, config_file, overrides)
    return load_structured(FlowConfig, task, config_file, overrides)


def is_diffusion_task(task: str) -> bool:
    """True when `configs/<task>.yaml` says `kind: diffusion` (or `decoupled`: an autoregressive
    planner in front of the pipeline, `mmrl.train.decoupled`) at its top level."""
    return recipe_kind(task) in ("diffusion", "decoupled")


def flow_config_dict(cfg: FlowConfig) -> dict[str, Any]:
    """The resolved config as plain nested dicts and lists."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def flow_config_to_yaml(cfg: FlowConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# ---------------------------------------------------------------------------------------------
# Decoupled RL on a planner + diffusion-decoder generator (`--task text_to_image_decoupled`)
#
#     cfg = load_decoupled_config("text_to_image_decoupled", overrides=["trainer.total_steps=10"])
#
# The decoder half is configured exactly as flow-GRPO above (`model`, `sample`, `reward`,
# `algo`, `lora`, `optim`, `trainer`); `sample.group_size` is K, the images per plan, and
# `reward` holds the decoder's (high-frequency) rewards, scored against the plan it was given.
# `planner` adds the autoregressive half: its model, G plans per request, its GRPO-family
# objective and optimizer, and its own (low-frequency) rewards, scored against what the request
# means. `train_halves` says which halves are updated (the other still samples: the ablations).
# ---------------------------------------------------------------------------------------------

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
