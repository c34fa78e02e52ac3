"""Configuration: dataclasses hold every default; YAML recipes and `key=value` overrides on top.

    cfg = load_config(task="vision_reasoning", overrides=["trainer.total_steps=50"])

Loading order: these defaults, then the task's recipe (`configs/<task>.yaml`, installed as
`mmrl.configs`), then `--config FILE`, then dot-list overrides. Unknown keys and wrong types fail
with the full key name (OmegaConf structured configs do the checking).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

# Light imports only: `import mmrl.config` must not load torch or transformers, so that `--help`
# and a config error answer at once (tests/test_cli.py checks it in a fresh interpreter).
from mmrl.files import not_a_regular_file, size_in_words
from mmrl.models.tiny_spec import TINY_ARCHITECTURES, TinyVLMSpec
from mmrl.rewards.config import ModelRewardsConfig
from mmrl.types import AnswerLimits

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
"""What `model.dtype` / `model.master_dtype` accept (`mmrl.models.precision.DTYPES` maps the names
to torch dtypes)."""


@dataclass
class WarmupConfig:
    """The short supervised warm-up that turns the random tiny model into the built-in base.

    RL needs a policy that sometimes succeeds. The warm-up trains on answer tokens until the
    greedy held-out accuracy has reached `target_accuracy` on `patience` evaluations in a row,
    then stops, leaving the model clearly imperfect.
    """

    lr: float = 1e-3
    """AdamW learning rate."""
    batch_size: int = 16
    """Samples per step."""
    max_steps: int = 1500
    """Give up (and keep the model as it is) after this many steps."""
    eval_every: int = 10
    """Steps between greedy evaluations (often: accuracy can jump 30 points in 20 steps)."""
    eval_size: int = 256
    """Validation samples per warm-up evaluation (a split disjoint from the held-out one)."""
    target_accuracy: float = 0.30
    """Stop once greedy held-out accuracy reaches this ..."""
    patience: int = 2
    """... on this many evaluations in a row (one lucky evaluation is not enough: measured)."""
    seed: int = 0
    """Seed of the random initialisation and of the warm-up data order."""
    direct_fraction: float = 0.3
    """Tool tasks (`visual_search`): the share of the cold start's demonstrations that answer
    directly, with the tools switched off, so that the base can also be measured without tools;
    the rest are tool-use demonstrations (a call, its observation, then the answer)."""


@dataclass
class ModelConfig:
    """The policy."""

    path: str | None = None
    """A Hugging Face VLM (model + processor): a local folder, or a hub id such as
    `Qwen/Qwen2.5-VL-3B-Instruct` (downloaded into the standard cache unless HF_HUB_OFFLINE=1).
    None: the built-in tiny base."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub id; None: the default branch."""
    dtype: str = "auto"
    """Compute dtype: activations, autocast matmuls, and weights that never train (frozen parts,
    the LoRA base, the KL reference). `auto`: bfloat16 on a GPU, float32 on the CPU; or
    float32, bfloat16, float16."""
    master_dtype: str = "auto"
    """Dtype of the weights that train and of the optimizer state. `auto`: float32 (mixed
    precision: autocast to `dtype`); set it equal to `dtype` to train the weights in bfloat16
    themselves (half the memory, updates rounded)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward (language model and vision tower) instead of
    keeping them: much less activation memory for ~30% more compute. The prompt-sharing
    forward is then off (checkpointing drops the key/value cache it relies on)."""
    reference_on_cpu: bool = False
    """Keep the frozen KL reference in host memory and move it to the device only for its
    log-prob pass (one weight copy less on the accelerator, a host-device copy per step). With
    LoRA the reference is the base model with adapters off and costs nothing either way."""
    tiny: TinyVLMSpec = field(default_factory=TinyVLMSpec)
    """Shape of the built-in tiny model."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """How the built-in base is made from the random tiny model."""
    cache_dir: str | None = None
    """Where built-in bases are cached; default `$MMRL_CACHE` or `~/.cache/mmrl`."""
    lora_rank: int = 0
    """LoRA rank (peft) on the language model's linear layers; 0: full fine-tuning."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (scale = alpha / rank)."""
    lora_targets: str = (
        r".*(language_model|text_model).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"
    )
    """Regex of the module names LoRA adapts (by default the language model's, `text_model` in
    Idefics3 / SmolVLM; the vision tower is excluded)."""
    freeze_vision: bool = False
    """Freeze the vision tower (patch embedding and blocks), as V-Triune does for stability."""
    freeze_connector: bool = False
    """Freeze the vision-language connector (the merger)."""
    freeze_router: bool = False
    """Freeze the router (expert gate) of every mixture-of-experts layer of the language model
    (Qwen3-VL-MoE and the like); the experts still train. An error on a dense model."""


@dataclass
class DataConfig:
    """Training and held-out data."""

    task: str = "vision_reasoning"
    """Built-in procedural task generating the data when no files are given."""
    kinds: list[str] = field(default_factory=lambda: ["colour_code"])
    """Procedural kinds to draw (`vision_reasoning`: colour_code, count, arithmetic, bar_chart;
    `perception`: detection, grounding, ocr, counting)."""
    num_train: int = 4096
    """Procedural training samples (cycled through in shuffled epochs)."""
    num_heldout: int = 512
    """Procedural held-out samples (greedy evaluation)."""
    train_files: list[str] = field(default_factory=list)
    """Training samples, replacing the procedural data when set: JSONL / Parquet files, or
    datasets by name (`mmrl.datasets.sources`): hub ids `org/name@split?config=..&revision=..`,
    local hub copies, `save_to_disk` folders; mmrl/V-Triune, veRL and EasyR1 layouts."""
    heldout_files: list[str] = field(default_factory=list)
    """Held-out samples, in the same forms as `train_files`."""
    image_size: int = 64
    """Side of the procedural images in pixels."""
    seed: int = 0
    """Seed of the procedural data."""
    cot_prompts: bool = False
    """Append a chain-of-thought instruction drawn at random from `cot_prompt_pool` (or the
    built-in pool) to every math-ability prompt (V-Triune's randomised prompt pool)."""
    cot_prompt_pool: list[str] = field(default_factory=list)
    """Instructions to draw from; empty: `mmrl.train.data.DEFAULT_COT_PROMPTS`."""
    source_aliases: dict[str, str] = field(default_factory=dict)
    """Short names of data sources, as metric names and the logs show them
    (`{hiyouga/geometry3k: geo3k}`). A source of rows read from the hub that is not listed and
    whose name has a `/` is shortened to its last part (`hiyouga/geometry3k` -> `geometry3k`)
    unless two sources would then share it; other sources keep their names."""
    max_prompt_chars: int = 200_000
    """A sample file's record whose prompt text is longer than this many characters is refused
    when the file is loaded (naming file, line and id), not deep inside the tokenizer later."""


@dataclass
class RolloutConfig:
    """How responses are sampled."""

    group_size: int = 8
    """G: responses per prompt; advantages are computed within each prompt's group."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are of the temperature-scaled distribution)."""
    max_new_tokens: int = 16
    """Response length limit, stop token included."""
    max_batch_rows: int = 256
    """Rows generated at once (bounds memory)."""
    engine: str = "hf"
    """Rollout engine, in every loop: `hf` (Hugging Face generate; the on-policy loop's runs on
    the trainer's own model) or `vllm` (GPU only, the `vllm` extra; its own copy of the weights,
    synced after each update: colocated with the trainer and asleep during the update in the
    on-policy loop, in the asynchronous mode's generator, in each Ray rollout worker)."""
    vllm_gpu_memory_utilization: float = 0.5
    """vLLM: fraction of the GPU its engine may take (weights + KV cache)."""
    vllm_sleep_level: int = 1
    """vLLM: sleep level while the policy trains (1: offload weights to CPU and drop the KV
    cache; 2: drop the weights too, they are synced from the trainer anyway); 0: never sleep."""
    vllm_tensor_parallel_size: int = 1
    """vLLM: GPUs each engine shards the model over (tensor parallelism); with the Ray backend
    each rollout worker needs that many (`trainer.ray_gpus_per_actor`)."""
    vllm_max_images: int = 8
    """vLLM: most images per prompt (`limit_mm_per_prompt`), the prompt's and a multi-turn
    trajectory's observations together."""
    vllm_weight_sync: str = "auto"
    """vLLM: how new weights reach the engine (never through its RPC): `inprocess` (the engine
    runs in this process, weights loaded straight into its model), `nccl` (a separate engine:
    names, dtypes and shapes by RPC, the data broadcast over NCCL from this process's GPU, which
    must not be one of the engine's), or `auto` (inprocess with one GPU per engine, else nccl)."""
    decode: str = "auto"
    """HF engine decode steps (`mmrl.rollout.decode`): `eager`, `static` (a static KV cache of
    fixed shapes per batch-size bucket), `captured` (static, captured once per bucket as a CUDA
    graph and replayed; CUDA only) or `auto` (captured on CUDA, eager elsewhere)."""
    lora_merge: str = "auto"
    """HF engine with LoRA: `merged` (the adapters merged into the weights for the rollout, the
    weights restored exactly after it), `unmerged`, or `auto` (merged on CUDA). The trainer
    scores unmerged; the merge's rounding shows in the `rollout/` mismatch metrics."""
    tokenization_check: bool = False
    """Multi-turn: re-apply the chat template to each final conversation and report how far its
    tokens drift from the ids the model saw (`agent/tokenization_drift`); never changes training."""


@dataclass
class AgentConfig:
    """Multi-turn tool use (`mmrl.rollout.multiturn`): the defaults for samples that name tools
    (their record's `agent` field may set `max_turns`, `max_tokens` and `max_images` itself),
    and how tool rewards combine with the verifier's. Samples without tools are single-turn."""

    max_turns: int = 4
    """Most model turns per trajectory; a tool call in the last turn is not run (`max_turns`)."""
    max_tokens: int = 512
    """Most response tokens per trajectory, the model's and the observations' together; an
    observation that would not leave room for one more model token ends it (`token_budget`)."""
    max_images: int = 4
    """Most observation images per trajectory, checked before one is appended (`image_budget`)."""
    call_format: str = "hermes"
    """How the model writes tool calls (`mmrl.environments.parse_tool_calls`): `hermes`
    (Qwen's `<tool_call>{"name": ..., "arguments": ...}</tool_call>`)."""
    tool_timeout_s: float = 10.0
    """Per-call tool time limit; a call past it gets a `timeout` error observation."""
    max_tool_text_chars: int = 2000
    """Longer tool text is cut to this (noted in the observation, counted as `text_too_long`)."""
    max_calls_per_turn: int = 4
    """Tool calls run per model turn; further ones get a `too_many_calls` error observation."""
    over_limit: str = "score"
    """Trajectories that end on a limit (`max_turns`, `token_budget`, `image_budget`, or a turn
    cut at `rollout.max_new_tokens`): `score` them as they are, or `mask` them out of the loss
    (Mini-o3's over-turn masking; their rewards stay in their groups' statistics)."""
    reward: str = "weighted"
    """How tool rewards join the verifier's score: `weighted` (score + `tool_reward_weight` x
    the tools' own rewards) or `deepeyes` (DeepEyes: + `tool_bonus` only when the answer is
    correct, accuracy > 0, and the trajectory called a tool without error)."""
    tool_reward_weight: float = 0.0
    """Weight of the tools' own rewards (veRL `calc_reward`) in the score."""
    tool_bonus: float = 1.0
    """DeepEyes' tool bonus (`reward=deepeyes`)."""
    env_reward_weight: float = 1.0
    """Weight of an environment's return in the score of a sample that acts in one (`agent.env`
    in its record): score = verifier score + `env_reward_weight` x return."""
    turn_discount: float = 1.0
    """Discount of an environment's per-turn rewards in its return, sum_t turn_discount^t r_t
    (1: the episode's undiscounted return, as Gymnasium reports it)."""
    env_timeout_s: float = 10.0
    """Time limit of one environment reset or step; past it the trajectory ends (`env_timeout`)."""
    plugins: list[str] = field(default_factory=list)
    """Modules to import wherever tools run (this process, and each Ray rollout worker) before
    the first trajectory: they register your tools and call formats (`mmrl.environments`)."""


@dataclass
class RewardConfig:
    """How responses are scored."""

    num_workers: int = 1
    """Verifier worker processes; a call past the time limit has its worker killed (hard limit).
    0 scores in the trainer's process, where the limit cannot interrupt C code."""
    time_limit_s: float = 5.0
    """Per-call verifier time limit in seconds; a time-out is an error (see `on_error`)."""
    on_error: str = "zero"
    """A verifier error or time-out is always counted and logged with the sample id; then
    `zero`: the response scores 0 and stays in its group; `drop`: it is left out of its group's
    advantage statistics and of the loss. An answer refused by `answer_limits` is counted as an
    error too, but always scores 0 and stays (it is the response's fault, not the verifier's)."""
    overlap: bool = True
    """Score each response as soon as it is generated, overlapping generation (needs workers
    or a remote reward service)."""
    update_while_scoring: bool = True
    """With `overlap`: start the update on the first mini-batch once its groups are scored,
    while later groups are still being scored. Taken when the advantage estimator is
    group-local (grpo, dr_grpo, rloo, remax, opo, pass_at_k, grpo_passk), `trainer.mini_batches` > 1, no reward model scores the
    batch and the update runs in this process; the update is the same as without it. One
    difference: a non-finite reward found after a mini-batch was already stepped on stops the
    update there (the step is counted as skipped) instead of skipping the whole step."""
    remote_url: str | list[str] | None = None
    """Score on reward servers (`mmrl serve`) instead of local workers: one URL, or a list
    (`[http://a:8000,http://b:8000]`) over which requests are spread by load, a server that
    stops answering being skipped and retried later (`mmrl.server.client.RewardServerPool`);
    the bearer token comes from $MMRL_REWARD_TOKEN. Verifiers only: model rewards stay local."""
    remote_batch_size: int = 32
    """Responses per request to a reward server while responses stream in (a GRPO group is the
    usual size: fewer requests cost less HTTP, smaller ones spread better over servers)."""
    plugins: list[str] = field(default_factory=list)
    """Python modules to import (here and in every verifier worker) that register extra
    verifiers with `@register_verifier`."""
    answer_limits: AnswerLimits = field(default_factory=AnswerLimits)
    """Caps on a response's final answer (characters, bracket nesting, tokens) checked before a
    verifier parses it: past one, the response scores 0 with an error of its own kind
    (`answer_too_long`, `answer_too_deep`, `answer_too_many_tokens`), counted in
    `verifier/rejected_answers` (a remote reward server applies its own `answer_limits`)."""
    model_rewards: ModelRewardsConfig = field(default_factory=ModelRewardsConfig)
    """Model-based rewards (aesthetic, CLIP, OCR, VLM judge, ...) for samples whose
    `reward_model.models` name them; scored in the trainer's process, added to the verifier's
    score, and sharing the accelerator with the policy (`placement`)."""


CRITIC_ESTIMATORS = ("gae", "turn_gae")
"""`algo.advantage` values that need a critic (a value head; `mmrl.algos.critic`)."""


@dataclass
class AlgoConfig:
    """The RL objective: advantage estimator, policy loss, KL, DAPO pieces, mismatch correction."""

    # -- advantages --
    advantage: str = "grpo"
    """Advantage estimator: grpo, dr_grpo (no std division), rloo, reinforce_pp (batch
    whitening per token), reinforce_pp_baseline (group mean, then the same), gdpo, remax
    (a greedy response's reward as baseline), opo (length-weighted group baseline), gpg
    (group mean, rescaled by the share of informative rows), pass_at_k (optimises pass@k),
    grpo_passk (veRL's: only each group's best response, by its margin over the runner-up);
    with a critic (PPO; a value head on the policy's last hidden state, trained with it): gae
    (veRL's token-level GAE) or turn_gae (VAGEN's turn-level GAE for multi-turn trajectories)."""
    adv_eps: float = 1e-6
    """Added to standard deviations before dividing."""
    adv_clip: float = 0.0
    """Clip advantages to [-adv_clip, adv_clip] (0: off)."""
    gdpo_components: list[str] = field(default_factory=lambda: ["accuracy", "format"])
    """GDPO: the reward components normalised separately within each group, then summed."""
    gdpo_weights: list[float] = field(default_factory=list)
    """GDPO: one weight per component (empty: all 1)."""
    gdpo_batch_norm: str = "mean_std"
    """GDPO's last step over the batch: `mean_std` (centre and scale, the paper), `std` (scale
    by the batch std only) or `none`."""
    passk_k: int = 4
    """pass_at_k: the k of pass@k (1 <= k <= rollout.group_size; k = 1 is GRPO)."""
    # -- PPO with a critic (mmrl.algos.critic; docs/guide/critic.md) --
    gamma: float = 1.0
    """gae, turn_gae: the discount per model token (veRL's `algo.gamma`)."""
    lam: float = 1.0
    """gae, turn_gae: GAE's lambda (veRL's `algo.lam`; turn_gae uses it at both levels)."""
    high_level_gamma: float = 0.95
    """turn_gae: the discount per turn (VAGEN's `high_level_gamma`)."""
    cliprange_value: float = 0.5
    """gae, turn_gae: the value loss clips the new value to the rollout-time value +- this
    (veRL's `critic.cliprange_value`)."""
    vf_coef: float = 0.5
    """gae, turn_gae: weight of the clipped value loss added to the policy loss (the value head
    shares the policy's backbone and optimizer step)."""
    critic_lr: float = 0.0
    """gae, turn_gae: learning rate of the value head's own parameter group (0: optim.lr)."""
    # -- policy loss --
    policy_loss: str = "ppo"
    """ppo (clip-higher, optional dual-clip), gspo (sequence-level ratio), cispo (clipped,
    stop-gradient importance weight times log-prob), cispo_seq (the same with the sequence
    ratio), clip_cov or kl_cov (Cui et al. 2025: no gradient for / a KL penalty on the tokens of
    highest log-prob/advantage covariance), gmpo (geometric mean of token ratios), sapo (soft
    sigmoid gate instead of the clip), gpg (plain -A log pi)."""
    cispo_seq_floor: bool = False
    """cispo_seq: also bound the sequence weight below at 1 - clip_low (TRL has no lower bound)."""
    sapo_tau_pos: float = 1.0
    """sapo: gate temperature of positive-advantage tokens (the paper's 1.0)."""
    sapo_tau_neg: float = 1.05
    """sapo: gate temperature of the others (the paper's 1.05: they are damped faster)."""
    opsm_delta: float | None = None
    """Off-policy sequence mask (DeepSeek-V3.2): leave out of the loss every negative-advantage
    response whose mean log(pi_rollout / pi_current) exceeds this (e.g. 0.5); None: off."""
    loss_agg: str = "token_mean"
    """token_mean, seq_mean_token_mean, or seq_mean_token_sum_norm (Dr.GRPO: token sums over a
    constant, rollout.max_new_tokens)."""
    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low (GSPO's paper uses 3e-4)."""
    clip_high: float = 0.28
    """Clip-higher (DAPO): the ratio is clipped above at 1 + clip_high (GSPO: 4e-4)."""
    clip_dual: float = 0.0
    """Dual-clip (PPO, Ye et al. 2020): cap the loss of negative-advantage tokens at
    -A * clip_dual (> 1, typically 3; 0: off)."""
    # -- KL to the reference --
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (0: no reference model is kept)."""
    kl_estimator: str = "k3"
    """KL estimator in the loss: k1, k2, k3 (Schulman's unbiased, non-negative one), abs,
    k1+ / k3+ (their value with k2's gradient, veRL's straight-through), k2+ (= k2), or full (the
    exact KL over the vocabulary from both models' distributions, chunked)."""
    kl_in_reward: bool = False
    """Subtract kl_coef * sum_t k1 from each response's reward instead of adding KL to the loss."""
    # -- other loss terms --
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (subtracted from the loss)."""
    old_logprobs: str = "recompute"
    """`recompute`: a no-grad trainer forward before the update; `rollout`: reuse the engine's
    log-probs (valid when the engine runs the same weights, as the HF engine does)."""
    # -- rollout/trainer mismatch (truncated importance sampling) --
    tis: str = "off"
    """Truncated importance sampling with the rollout engine's log-probs: off, token or sequence."""
    tis_cap: float = 2.0
    """TIS weights are truncated (or masked) above this."""
    tis_mode: str = "truncate"
    """truncate: min(w, cap); mask: weight 0 where w > cap; band: weight 0 where w leaves
    [tis_low, tis_cap] (IcePop)."""
    # -- stability (mmrl.algos.stability; README "Stability") --
    tis_low: float = 0.0
    """tis_mode=band: the band's lower bound (0: 1 / tis_cap)."""
    tis_batch_norm: bool = False
    """Divide the IS weights by their batch mean (veRL's rollout_is_batch_normalize)."""
    tis_batch_norm_scope: str = "verl"
    """tis_batch_norm's mean: `verl` (veRL's order: the truncated weights over every loss token
    before rejection and IS masking) or `kept` (the applied weights over the loss mask left
    after rejection, IS-masked tokens counting as 0: they then average exactly 1)."""
    rejection: str = "off"
    """Rollout rejection: drop whole responses whose pi_trainer / pi_rollout is out of
    [rejection_low, rejection_high]: off, geometric (geometric-mean ratio), sequence (product)
    or max_token (any token out of the band)."""
    rejection_low: float = 0.0
    """Lower bound of the rejection band (0: 1 / rejection_high)."""
    rejection_high: float = 2.0
    """Upper bound of the rejection band."""
    cov_ratio: float = 2e-4
    """clip_cov / kl_cov: fraction of the tokens selected by covariance (veRL's default)."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens with covariance above this are candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: only tokens with covariance below this are candidates."""
    kl_cov_coef: float = 1.0
    """kl_cov: weight of |log r| on the selected tokens (veRL's ppo_kl_coef)."""
    entropy_target: float = 0.0
    """> 0: adaptive entropy coefficient (Skywork-OR1) holding the mean token entropy near this;
    algo.entropy_coef is its starting value."""
    entropy_coef_delta: float = 0.005
    """Adaptive entropy: the coefficient's step per training step."""
    entropy_coef_max: float = 0.05
    """Adaptive entropy: the coefficient's ceiling."""
    forking_frac: float = 0.0
    """> 0: train only on the top `forking_frac` entropy tokens (Wang et al. 2025, 0.2)."""
    forking_scope: str = "response"
    """Forking tokens chosen per `response` or over the whole (micro-)`batch` as in the paper."""
    ref_reset_every: int = 0
    """ProRL: reset the KL reference to the current policy every N steps (0: never)."""
    ref_reset_kl: float = 0.0
    """ProRL: also reset when the step's reference KL (actor/ref_kl) exceeds this (0: never)."""
    ref_reset_optimizer: bool = False
    """ProRL: clear the optimizer state (AdamW moments) at each reference reset."""
    # -- DAPO --
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and generate more until the batch is full."""
    max_resample_batches: int = 3
    """Dynamic sampling: at most this many extra generation rounds per step."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment over the last `overlong_buffer` tokens of the limit (0: off)."""
    overlong_penalty: float = 1.0
    """Scale of the overlong punishment (a reward of -overlong_penalty at the limit)."""
    mask_truncated: bool = False
    """Leave responses that hit the length limit out of the loss (overlong filtering)."""
    # -- learning from demonstrations (mmrl.algos.demonstrations) --
    demo_loss: str = "off"
    """A supervised term on each prompt's demonstration (`extra_info.demonstration`, a reference
    response) added to the RL loss: off, nll (plain negative log-likelihood, as LUFFY / SRFT mix
    in) or trust_region (TRAPO's trust-region SFT: tokens below demo_alpha probability get a
    damped gradient)."""
    demo_coef: float = 0.1
    """Weight of the demonstration term (its token mean) in the loss."""
    demo_alpha: float = 0.1
    """trust_region: the probability below which a demonstration token's gradient is scaled by
    p / demo_alpha (TRAPO's alpha, 0.1)."""


@dataclass
class OptimConfig:
    """Optimizer and schedule."""

    lr: float = 3e-4
    """Peak AdamW learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    schedule: str = "linear"
    """`constant`, `linear` (decay to 0 at the last step) or `cosine`."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    vision_lr: float | None = None
    """Learning rate of the vision tower (None: `lr`)."""
    connector_lr: float | None = None
    """Learning rate of the connector (None: `lr`)."""


LOGGER_NAMES = ("jsonl", "tensorboard", "wandb", "mlflow")
"""What `trainer.loggers` may name (`mmrl.train.metrics_log`)."""


@dataclass
class WandbConfig:
    """Weights & Biases (`trainer.loggers` with `wandb`; the `wandb` extra). Its run files go
    under `<run_dir>/wandb/`; login, mode and host also come from wandb's own environment
    variables (`WANDB_API_KEY`, `WANDB_MODE=offline`, ...)."""

    project: str = "mmrl"
    """W&B project."""
    entity: str | None = None
    """W&B entity (user or team); None: the logged-in user's default."""
    name: str | None = None
    """Run name; None: the run directory's name."""
    group: str | None = None
    """Run group (to compare seeds or variants together); None: none."""
    tags: list[str] = field(default_factory=list)
    """Run tags."""
    mode: str | None = None
    """`online`, `offline` (written under `<run_dir>/wandb/`, uploaded later with `wandb sync`)
    or `disabled`; None: wandb's own choice (`WANDB_MODE`, else online)."""


@dataclass
class MlflowConfig:
    """MLflow (`trainer.loggers` with `mlflow`; the `mlflow` extra)."""

    tracking_uri: str | None = None
    """Tracking server or database (`http://host:5000`, `sqlite:///mlflow.db`); None: MLflow's
    own default (`MLFLOW_TRACKING_URI`, else `sqlite:///mlflow.db`). Not the file store
    (`file:./mlruns`): it keeps metric names as paths and mmrl's nest (`reward/mean` and
    `reward/mean/<data_source>`)."""
    experiment: str = "mmrl"
    """Experiment the run is filed under (created if missing)."""
    artifact_location: str | None = None
    """Where a newly created experiment keeps artifacts (config, PNGs, generation tables); None:
    MLflow's default: a tracking server's own artifact store, or, with a local database
    (`sqlite:///...`), `./mlruns/<experiment id>/` under the folder mmrl was started from (not
    beside the database, not in the run folder). An experiment that exists keeps its location."""
    run_name: str | None = None
    """Run name; None: the run directory's name."""
    tags: dict[str, str] = field(default_factory=dict)
    """Run tags."""


MAX_CONFIG_INT = 2**63 - 1
"""Largest magnitude of an integer config value: it must fit the 64-bit integers that torch,
numpy and the step counters hold it in (the reward server's limit for `step` too)."""


def number_checks(obj: Any, prefix: str = "") -> list[tuple[bool, str]]:
    """Every number of a config dataclass (nested ones and lists included) usable at all: an
    integer within +-(2^63 - 1) and a float finite (NaN and infinities refused; no field gives
    them a meaning). Range rules of single fields come on top, in each `__post_init__`."""
    checks: list[tuple[bool, str]] = []
    for f in dataclasses.fields(obj):
        checks += _value_checks(getattr(obj, f.name), f"{prefix}{f.name}")
    return checks


def _value_checks(value: Any, key: str) -> list[tuple[bool, str]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return number_checks(value, f"{key}.")
    if isinstance(value, (list, tuple)):
        return [c for i, item in enumerate(value) for c in _value_checks(item, f"{key}[{i}]")]
    if isinstance(value, dict):
        return [c for k, item in value.items() for c in _value_checks(item, f"{key}.{k}")]
    if isinstance(value, bool):
        return []
    if isinstance(value, int) and abs(value) > MAX_CONFIG_INT:
        return [
            (False, f"{key} must be within +-(2^63 - 1), got an integer of {len(str(abs(value)))} digits")
        ]
    if isinstance(value, float) and not math.isfinite(value):
        return [(False, f"{key} must be a finite number, got {value}")]
    return []


def answer_limit_checks(limits: AnswerLimits, key: str) -> list[tuple[bool, str]]:
    """Each cap of `limits` (the training and serve configs' `answer_limits`) >= 0 (0: off)."""
    return [
        (getattr(limits, name) >= 0, f"{key}.{name} must be >= 0 (0: no cap), got {getattr(limits, name)}")
        for name in ("max_chars", "max_depth", "max_tokens")
    ]


def logger_checks(trainer: Any) -> list[tuple[bool, str]]:
    """Checks of `trainer.loggers` and the trackers' settings (both trainers' configs)."""
    loggers = trainer.loggers
    unknown = [name for name in loggers if name not in LOGGER_NAMES]
    return [
        (not unknown, f"trainer.loggers: unknown logger(s) {unknown} (known: {', '.join(LOGGER_NAMES)})"),
        (
            "jsonl" in loggers,
            "trainer.loggers must include jsonl: metrics.jsonl is the run's own record (resume, the "
            "training-curve PNG and the summary read it)",
        ),
        (len(set(loggers)) == len(loggers), f"trainer.loggers names a logger twice: {loggers}"),
        (
            trainer.wandb.mode in (None, "online", "offline", "disabled"),
            f"trainer.wandb.mode must be online, offline, disabled or null, got {trainer.wandb.mode!r}",
        ),
        (bool(trainer.mlflow.experiment), "trainer.mlflow.experiment must be a non-empty name"),
    ]


@dataclass
class TrainerConfig:
    """The training loop."""

    total_steps: int = 200
    """RL steps (one rollout batch each)."""
    prompts_per_step: int = 16
    """B: prompts per rollout batch (B x G responses)."""
    mini_batches: int = 2
    """Policy updates per rollout batch (the batch is split into this many mini-batches)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch."""
    micro_batch_rows: int = 0
    """Rows per forward/backward (gradient accumulation); 0: a whole mini-batch at once."""
    eval_every: int = 25
    """Steps between greedy held-out evaluations (also at step 0 and at the end)."""
    eval_at_start: bool = True
    """Evaluate the starting policy (step 0) before the first step, as veRL's
    `trainer.val_before_train`. Off: training starts at once and the run's start accuracy is
    unknown (NaN, and the last line says so): for several runs from one starting point whose
    evaluation is known already."""
    eval_without_tools: bool = False
    """Tool tasks: the first and last held-out evaluations also run with the tools switched off
    (`eval_no_tools/...` metrics), to show what the tool is worth."""
    eval_size: int = 512
    """Held-out samples per evaluation (0: all)."""
    seed: int = 0
    """Seed of the rollout sampling and data order."""
    run_dir: str | None = None
    """Run directory; default `runs/<task>-<timestamp>`."""
    threads: int = 0
    """torch CPU threads; 0: leave torch's default."""
    device: str = "auto"
    """Where the policy, reference and rollout engine run: `auto` (the local accelerator --
    under torchrun the local rank's GPU, under Ray the actor's own -- else the CPU), or a torch
    device string (`cuda:1`, `cpu`)."""
    logits_chunk_mb: int = 128
    """The log-prob pass runs the LM head over chunks of positions whose float32 logits take at
    most this many MB (forward and backward), so memory does not grow with vocabulary x length."""
    save_final: bool = True
    """Save the final policy in Hugging Face format under `<run_dir>/final`."""
    checkpoint_every: int = 0
    """Write a resumable checkpoint every N steps (0: only at the end and on SIGINT/SIGTERM)."""
    async_checkpoint: bool = False
    """Write periodic checkpoints in the background: the loop stops only to write the Hugging
    Face weights and the trainer state and to copy the sharded training state (each training
    process its own shards, `mmrl.train.sharded`); the shards are written, every file checksummed,
    synced and the folder renamed into place by threads while training goes on. A checkpoint
    counts (for a resume, for retention) only once all of that is done, so a crash meanwhile
    leaves the earlier ones in use. The last checkpoint and one a signal asks for are written
    before the run stops. Costs host memory for the copy of this process's shards."""
    keep_last: int = 2
    """Checkpoints to keep (the newest); 0 keeps all."""
    keep_best: bool = True
    """Also keep the checkpoint with the best greedy held-out accuracy."""
    resume: str | None = None
    """`auto`: continue from the newest complete checkpoint in `run_dir` (start fresh if there is
    none); a checkpoint folder: continue from it; None: start fresh."""
    max_consecutive_skips: int = 5
    """Stop the run (the last good checkpoint intact) after this many steps in a row were skipped
    for non-finite rewards, losses or gradients."""
    progress: bool = True
    """Show a progress bar."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where metrics go: `jsonl` (`metrics.jsonl`, always), `tensorboard`, `wandb`, `mlflow` (the
    `wandb` / `mlflow` extras). The same metric names everywhere; the trackers also get the
    config as the run's parameters and the training-curve PNG, and a resumed run continues the
    same tracker run."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases settings (with `wandb` in `loggers`)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow settings (with `mlflow` in `loggers`)."""
    log_generations: int = 8
    """Rows of the sample-generations table (prompt, image thumbnail, response, reward and each
    component) the trackers get at every held-out evaluation: the first N held-out samples, the
    same ones each time; also written to `<run_dir>/generations.jsonl`. 0: none."""
    eval_suite: str | None = None
    """A MEGA-Bench-style suite evaluated during training (a path, or `builtin` for the built-in
    mini-suite); None: off."""
    eval_suite_every: int = 50
    """Steps between suite evaluations (also at step 0 and at the end)."""
    eval_suite_max_queries: int | None = None
    """At most this many queries per suite task."""
    dump_steps: bool = False
    """Write every step's prompts, responses, log-probs, reward components and advantages to
    `<run_dir>/dumps/step_<n>.jsonl`."""
    # -- scaling out (mmrl.distributed, mmrl.train.async_grpo) --
    backend: str = "local"
    """`local`: everything in this process; `ray`: rollout workers, a reward worker and the
    training group as Ray actors (the `distributed` extra)."""
    mode: str = "sync"
    """`sync`: on-policy, each step generates with the weights it trains; `async`: fully
    asynchronous, generators (an engine with its own copy of the weights; on Ray, each rollout
    worker) fill a bounded queue of scored groups while the trainer trains on those that have
    completed, at most `max_staleness` policy versions behind, corrected by `algo.tis`
    (`mmrl.train.async_grpo`)."""
    max_staleness: int = 1
    """Async mode: every token trained at step k was sampled by a policy at most this many updates
    older than the one it updates (0: no overlap; 1: one step ahead). No group starts while more
    than (max_staleness + version + 1) x prompts_per_step groups are in use (AReaL's rule); a group
    that completes too late is dropped and counted (`async/dropped_groups`)."""
    async_call_prompts: int = 0
    """Async mode: the most prompts a generator takes per call (0: prompts_per_step shared among
    the generators). Smaller calls fill the queue more evenly, larger ones batch better."""
    partial_rollout: bool = False
    """Async mode: interrupt generation every `partial_chunk_tokens` tokens to load the newest
    weights, and go on with them (AReaL's interruptible rollouts); a response's tokens then carry
    the versions that sampled them. False: a call finishes on the weights it started with. Needs
    the engine in the trainer's process (`trainer.backend=local`)."""
    partial_chunk_tokens: int = 32
    """Partial rollouts: tokens generated between weight checks."""
    rollout_workers: int = 1
    """Ray: rollout worker actors, each with its own engine and copy of the weights; a batch's
    prompts are split between them."""
    reward_workers: int = 1
    """Ray: reward worker actors (each with `reward.num_workers` verifier processes), placed
    across nodes (a SPREAD placement group); responses go to the one with the fewest waiting."""
    train_workers: int = 1
    """Ray: processes of the training group (data parallel, parameters, gradients and optimizer
    state sharded by `strategy`); each mini-batch is split evenly between them."""
    strategy: str = "fsdp2"
    """How the policy update is sharded: `fsdp2` (PyTorch FSDP2 in a Ray training group; the
    plain torch optimizer on the local backend) or `deepspeed` (DeepSpeed ZeRO, its optimizer,
    clipping and bf16 master weights; on the local backend too, in one process). The
    `distributed` extra."""
    zero_stage: int = 2
    """`strategy=deepspeed`: ZeRO stage 2 (optimizer state and gradients partitioned across the
    training group, parameters whole on every process) or 3 (parameters partitioned too,
    gathered a layer at a time; Ray backend only)."""
    zero_offload_optimizer: bool = False
    """`strategy=deepspeed`: keep the optimizer state and float32 master weights in host memory and
    step them there with DeepSpeedCPUAdam (ZeRO-Offload: a 7B model trains on one GPU)."""
    zero_offload_params: bool = False
    """`strategy=deepspeed` with `zero_stage=3`: keep the partitioned parameters in host memory,
    fetched to the device a layer at a time."""
    ray_address: str | None = None
    """Ray: the cluster to join (`auto`, or `ray://host:port`); None: the running one, else a new
    local one."""
    ray_cpus_per_actor: float = 1.0
    """Ray: CPUs reserved for each actor in the placement group (fractions allowed)."""
    ray_gpus_per_actor: float = 0.0
    """Ray: GPUs reserved for each rollout and training actor (0: CPU only; the training group
    then communicates with gloo, else NCCL)."""
    ray_reward_gpus: float = 0.0
    """Ray: GPUs reserved for each reward worker, where `reward.model_rewards` score (a fraction
    shares a GPU with policy actors that take the rest of it; the models are moved to host memory
    around each update by `reward.model_rewards.placement`, as in a local run); 0: the CPU."""
    lora_sync: str = "auto"
    """Ray with LoRA: what the rollout workers receive after each update. `adapters`: the adapter
    weights only (the workers run them unmerged); `merged`: the whole model with the adapters
    merged in; `auto`: adapters for the HF engine, merged for vLLM (which loads whole weights)."""


def agent_checks(a: AgentConfig) -> list[tuple[bool, str]]:
    """Range and choice rules of `agent.*`."""
    return [
        (a.max_turns >= 1, f"agent.max_turns must be >= 1, got {a.max_turns}"),
        (a.max_tokens >= 1, f"agent.max_tokens must be >= 1, got {a.max_tokens}"),
        (a.max_images >= 0, f"agent.max_images must be >= 0, got {a.max_images}"),
        (a.tool_timeout_s > 0, f"agent.tool_timeout_s must be > 0, got {a.tool_timeout_s}"),
        (a.max_tool_text_chars >= 1, f"agent.max_tool_text_chars must be >= 1, got {a.max_tool_text_chars}"),
        (a.max_calls_per_turn >= 1, f"agent.max_calls_per_turn must be >= 1, got {a.max_calls_per_turn}"),
        (a.over_limit in ("score", "mask"), f"agent.over_limit must be score or mask, got {a.over_limit!r}"),
        (0 <= a.turn_discount <= 1, f"agent.turn_discount must be in [0, 1], got {a.turn_discount}"),
        (a.env_timeout_s > 0, f"agent.env_timeout_s must be > 0, got {a.env_timeout_s}"),
        (
            a.reward in ("weighted", "deepeyes"),
            f"agent.reward must be weighted or deepeyes, got {a.reward!r}",
        ),
    ]


@dataclass
class Config:
    """Everything a training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy: a local checkpoint or the built-in tiny base."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and held-out samples."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling of responses."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn tool use, for samples that name tools."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring of responses by verifiers."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The RL objective."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop: steps, batch sizes, evaluation, run directory."""

    def __post_init__(self) -> None:
        for ok, message in number_checks(self):  # first: the checks below compute with them
            if not ok:
                raise ValueError(f"invalid config: {message}")
        t, d, r = self.trainer, self.data, self.rollout
        checks = [
            (t.total_steps >= 1, f"trainer.total_steps must be >= 1, got {t.total_steps}"),
            (t.eval_every >= 1, f"trainer.eval_every must be >= 1, got {t.eval_every}"),
            (
                t.checkpoint_every >= 0,
                f"trainer.checkpoint_every must be >= 0 (0: only at the end), got {t.checkpoint_every}",
            ),
            (t.keep_last >= 0, f"trainer.keep_last must be >= 0 (0: keep all), got {t.keep_last}"),
            (t.eval_size >= 0, f"trainer.eval_size must be >= 0 (0: all), got {t.eval_size}"),
            (t.ppo_epochs >= 1, f"trainer.ppo_epochs must be >= 1, got {t.ppo_epochs}"),
            (
                t.max_consecutive_skips >= 1,
                f"trainer.max_consecutive_skips must be >= 1, got {t.max_consecutive_skips}",
            ),
            (t.micro_batch_rows >= 0, f"trainer.micro_batch_rows must be >= 0, got {t.micro_batch_rows}"),
            (t.eval_suite_every >= 1, f"trainer.eval_suite_every must be >= 1, got {t.eval_suite_every}"),
            (
                t.eval_suite_max_queries is None or t.eval_suite_max_queries >= 1,
                "trainer.eval_suite_max_queries must be >= 1 (or null: all)",
            ),
            (t.threads >= 0, f"trainer.threads must be >= 0, got {t.threads}"),
            (t.log_generations >= 0, f"trainer.log_generations must be >= 0, got {t.log_generations}"),
            *logger_checks(t),
            (r.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {r.max_new_tokens}"),
            (r.vllm_max_images >= 1, f"rollout.vllm_max_images must be >= 1, got {r.vllm_max_images}"),
            *agent_checks(self.agent),
            (r.max_batch_rows >= 1, f"rollout.max_batch_rows must be >= 1, got {r.max_batch_rows}"),
            (d.num_train >= 0 and d.num_heldout >= 0, "data.num_train and data.num_heldout must be >= 0"),
            (d.image_size >= 1, f"data.image_size must be >= 1, got {d.image_size}"),
            (d.max_prompt_chars >= 1, f"data.max_prompt_chars must be >= 1, got {d.max_prompt_chars}"),
            (self.optim.lr > 0, f"optim.lr must be > 0, got {self.optim.lr}"),
            (self.optim.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.optim.warmup_steps}"),
            (self.optim.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0: off), got {self.optim.grad_clip}"),
            (len(self.optim.betas) == 2, f"optim.betas must be two numbers, got {self.optim.betas}"),
            (
                self.algo.max_resample_batches >= 0,
                f"algo.max_resample_batches must be >= 0, got {self.algo.max_resample_batches}",
            ),
            (
                self.algo.overlong_buffer >= 0,
                f"algo.overlong_buffer must be >= 0, got {self.algo.overlong_buffer}",
            ),
            (self.algo.adv_clip >= 0, f"algo.adv_clip must be >= 0 (0: off), got {self.algo.adv_clip}"),
            (self.algo.kl_coef >= 0, f"algo.kl_coef must be >= 0, got {self.algo.kl_coef}"),
            (self.rollout.group_size >= 1, "rollout.group_size must be >= 1"),
            (self.rollout.temperature > 0, "rollout.temperature must be > 0"),
            (self.reward.num_workers >= 0, "reward.num_workers must be >= 0"),
            *answer_limit_checks(self.reward.answer_limits, "reward.answer_limits"),
            (self.reward.time_limit_s > 0, "reward.time_limit_s must be > 0"),
            (self.reward.on_error in ("zero", "drop"), "reward.on_error must be zero or drop"),
            (self.trainer.prompts_per_step >= 1, "trainer.prompts_per_step must be >= 1"),
            (
                self.trainer.mini_batches >= 1,
                f"trainer.mini_batches must be >= 1, got {self.trainer.mini_batches}",
            ),
            (
                self.trainer.mini_batches < 1  # reported above (a modulo by 0 would raise here)
                or (self.trainer.prompts_per_step * self.rollout.group_size) % self.trainer.mini_batches == 0,
                "trainer.mini_batches must divide prompts_per_step * group_size",
            ),
            (
                0 <= self.algo.clip_low
                and (self.algo.clip_low < 1 or self.algo.policy_loss in ("cispo", "cispo_seq")),
                "algo.clip_low must be in [0, 1) (>= 1 only with algo.policy_loss=cispo or cispo_seq: no "
                "lower bound)",
            ),
            (self.algo.clip_high >= 0, "algo.clip_high must be >= 0"),
            *self._family_checks(),
            *self._stability_checks(),
            (
                self.algo.loss_agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
                "algo.loss_agg must be token_mean, seq_mean_token_mean or seq_mean_token_sum_norm",
            ),
            (self.algo.clip_dual == 0 or self.algo.clip_dual > 1, "algo.clip_dual must be 0 (off) or > 1"),
            (self.algo.tis in ("off", "token", "sequence"), "algo.tis must be off, token or sequence"),
            (
                self.algo.tis_mode in ("truncate", "mask", "band"),
                "algo.tis_mode must be truncate, mask or band",
            ),
            (self.algo.tis_cap > 0, "algo.tis_cap must be > 0"),
            (
                self.algo.tis == "off" or self.algo.old_logprobs == "recompute",
                "algo.tis needs algo.old_logprobs=recompute (with rollout log-probs the weights are all 1)",
            ),
            (
                self.algo.overlong_buffer < self.rollout.max_new_tokens,
                "algo.overlong_buffer must be < rollout.max_new_tokens",
            ),
            (self.model.lora_rank >= 0, "model.lora_rank must be >= 0"),
            (
                self.model.tiny.architecture in TINY_ARCHITECTURES,
                f"model.tiny.architecture must be one of {', '.join(TINY_ARCHITECTURES)}",
            ),
            (self.model.dtype in DTYPE_NAMES, f"model.dtype must be one of {', '.join(DTYPE_NAMES)}"),
            (
                self.model.master_dtype in DTYPE_NAMES,
                f"model.master_dtype must be one of {', '.join(DTYPE_NAMES)}",
            ),
            (self.trainer.logits_chunk_mb > 0, "trainer.logits_chunk_mb must be > 0"),
            (
                not self.trainer.resume or bool(self.trainer.run_dir),
                "trainer.resume needs trainer.run_dir (the run to continue)",
            ),
            (
                self.algo.old_logprobs in ("recompute", "rollout"),
                "algo.old_logprobs must be recompute or rollout",
            ),
            (
                self.optim.schedule in ("constant", "linear", "cosine"),
                "optim.schedule must be constant, linear or cosine",
            ),
            (self.rollout.engine in ("hf", "vllm"), "rollout.engine must be hf or vllm"),
            (
                self.rollout.decode in ("auto", "eager", "static", "captured"),
                "rollout.decode must be auto, eager, static or captured",
            ),
            (
                self.rollout.lora_merge in ("auto", "merged", "unmerged"),
                "rollout.lora_merge must be auto, merged or unmerged",
            ),
            (
                self.rollout.vllm_weight_sync in ("auto", "inprocess", "nccl"),
                "rollout.vllm_weight_sync must be auto, inprocess or nccl",
            ),
            (
                self.rollout.engine != "vllm" or self.model.lora_rank <= 512,
                f"model.lora_rank={self.model.lora_rank} with rollout.engine=vllm: vLLM serves LoRA ranks up to 512",
            ),
            (self.rollout.vllm_sleep_level in (0, 1, 2), "rollout.vllm_sleep_level must be 0, 1 or 2"),
            (
                self.rollout.vllm_tensor_parallel_size >= 1,
                f"rollout.vllm_tensor_parallel_size must be >= 1, got {self.rollout.vllm_tensor_parallel_size}",
            ),
            (
                self.rollout.engine != "vllm"
                or self.trainer.backend != "ray"
                or self.trainer.ray_gpus_per_actor >= self.rollout.vllm_tensor_parallel_size,
                "rollout.engine=vllm with trainer.backend=ray: each rollout worker holds one vLLM engine "
                "on its own GPUs, so trainer.ray_gpus_per_actor must be >= rollout.vllm_tensor_parallel_size "
                f"(got {self.trainer.ray_gpus_per_actor} and {self.rollout.vllm_tensor_parallel_size})",
            ),
            (self.reward.remote_batch_size >= 1, "reward.remote_batch_size must be >= 1"),
            *self._remote_url_checks(),
            (self.trainer.reward_workers >= 1, "trainer.reward_workers must be >= 1"),
            (self.trainer.backend in ("local", "ray"), "trainer.backend must be local or ray"),
            (self.trainer.mode in ("sync", "async"), "trainer.mode must be sync or async"),
            (self.trainer.max_staleness >= 0, "trainer.max_staleness must be >= 0"),
            (self.trainer.async_call_prompts >= 0, "trainer.async_call_prompts must be >= 0"),
            (self.trainer.partial_chunk_tokens >= 1, "trainer.partial_chunk_tokens must be >= 1"),
            (
                not self.trainer.partial_rollout or self.trainer.mode == "async",
                "trainer.partial_rollout needs trainer.mode=async (on-policy rollouts are never interrupted)",
            ),
            (
                not self.trainer.partial_rollout or self.trainer.backend == "local",
                "trainer.partial_rollout needs trainer.backend=local for now: the Ray rollout workers run "
                "each call whole (weights reach them between calls)",
            ),
            (self.trainer.rollout_workers >= 1, "trainer.rollout_workers must be >= 1"),
            (self.trainer.train_workers >= 1, "trainer.train_workers must be >= 1"),
            (
                self.trainer.mode == "sync" or self.algo.tis != "off",
                "trainer.mode=async needs algo.tis=token or sequence (importance-sampling correction "
                "of the stale policy's rollouts)",
            ),
            (
                self.trainer.mode == "sync"
                or self.trainer.backend == "local"
                or not self.reward.model_rewards.models,
                "trainer.mode=async with trainer.backend=ray does not take reward.model_rewards yet (the reward "
                "workers move their models to host memory around each update while the generator scores)",
            ),
            (
                self.trainer.lora_sync in ("auto", "adapters", "merged"),
                f"trainer.lora_sync must be auto, adapters or merged, got {self.trainer.lora_sync!r}",
            ),
            (
                self.trainer.lora_sync != "adapters" or self.rollout.engine == "hf",
                "trainer.lora_sync=adapters needs rollout.engine=hf (vLLM loads whole weights: use merged)",
            ),
            (self.trainer.ray_reward_gpus >= 0, "trainer.ray_reward_gpus must be >= 0"),
            (
                self.trainer.train_workers == 1 or not self.algo.dynamic_sampling,
                "trainer.train_workers > 1 does not support algo.dynamic_sampling yet (a step's rows "
                "must split evenly between the training processes)",
            ),
            (
                self.trainer.train_workers == 1
                or self.trainer.mini_batches * self.trainer.train_workers < 1  # reported elsewhere
                or (self.trainer.prompts_per_step * self.rollout.group_size)
                % (self.trainer.mini_batches * self.trainer.train_workers)
                == 0,
                "trainer.mini_batches * trainer.train_workers must divide prompts_per_step * group_size "
                "(every training process gets an equal share of each mini-batch)",
            ),
            (
                self.trainer.train_workers == 1 or self.trainer.ppo_epochs == 1,
                "trainer.train_workers > 1 needs trainer.ppo_epochs=1 (later epochs shuffle rows "
                "within each process, not across the group)",
            ),
            (
                self.trainer.train_workers == 1
                or self.algo.entropy_coef == 0
                or self.algo.loss_agg == "token_mean",
                "trainer.train_workers > 1 with algo.entropy_coef > 0 needs algo.loss_agg=token_mean",
            ),
            *self._strategy_checks(),
            *self._critic_checks(),
        ]
        from mmrl.algos.advantages import ADVANTAGE_ESTIMATORS

        checks.append(
            (
                self.algo.advantage in ADVANTAGE_ESTIMATORS or self.algo.advantage in CRITIC_ESTIMATORS,
                f"algo.advantage must be one of {', '.join(sorted([*ADVANTAGE_ESTIMATORS, *CRITIC_ESTIMATORS]))}, "
                f"got {self.algo.advantage!r}",
            )
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid config: {message}")

    def _family_checks(self) -> list[tuple[bool, str]]:
        """Checks of the estimator, loss and KL names (from their registries) and of the fields
        of the rest of the family (remax, pass_at_k, gdpo, sapo, OPSM, full KL, demonstrations)."""
        from mmrl.algos.advantages import GDPO_BATCH_NORMS
        from mmrl.algos.kl import KL_ESTIMATORS
        from mmrl.algos.losses import NO_DUAL_CLIP, POLICY_LOSSES

        a, local = self.algo, self.trainer.backend == "local"
        return [
            (
                a.kl_estimator in KL_ESTIMATORS,
                f"algo.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {a.kl_estimator!r}",
            ),
            (
                a.policy_loss in POLICY_LOSSES,
                f"algo.policy_loss must be one of {', '.join(sorted(POLICY_LOSSES))}, got {a.policy_loss!r}",
            ),
            (
                a.policy_loss not in NO_DUAL_CLIP or a.clip_dual == 0,
                f"algo.clip_dual does not apply to {a.policy_loss} (set it to 0)",
            ),
            (
                a.gdpo_batch_norm in GDPO_BATCH_NORMS,
                f"algo.gdpo_batch_norm must be one of {', '.join(GDPO_BATCH_NORMS)}",
            ),
            (
                a.advantage != "pass_at_k" or 1 <= a.passk_k <= self.rollout.group_size,
                "algo.passk_k must be in [1, rollout.group_size] (a group must hold k responses)",
            ),
            (
                a.advantage != "pass_at_k" or (a.overlong_buffer == 0 and not a.kl_in_reward),
                "algo.advantage=pass_at_k needs binary rewards: no algo.overlong_buffer, no algo.kl_in_reward",
            ),
            (
                a.advantage != "grpo_passk" or self.rollout.group_size >= 2,
                "algo.advantage=grpo_passk needs rollout.group_size >= 2 (a best and a runner-up)",
            ),
            (a.advantage != "remax" or local, "algo.advantage=remax needs trainer.backend=local"),
            (
                a.sapo_tau_pos > 0 and a.sapo_tau_neg > 0,
                "algo.sapo_tau_pos and algo.sapo_tau_neg must be > 0",
            ),
            (a.opsm_delta is None or a.opsm_delta >= 0, "algo.opsm_delta must be >= 0 (or null: off)"),
            (
                a.kl_estimator != "full" or not a.kl_in_reward,
                "algo.kl_estimator=full is a loss term: it needs algo.kl_in_reward=false",
            ),
            (
                a.kl_estimator != "full" or a.kl_coef == 0 or local,
                "algo.kl_estimator=full needs trainer.backend=local (a reference pass in the update)",
            ),
            (
                a.kl_estimator != "full" or a.kl_coef == 0 or not self.model.reference_on_cpu,
                "algo.kl_estimator=full runs the reference in every micro-batch: it needs "
                "model.reference_on_cpu=false",
            ),
            (
                a.demo_loss in ("off", "nll", "trust_region"),
                "algo.demo_loss must be off, nll or trust_region",
            ),
            (a.demo_coef >= 0, "algo.demo_coef must be >= 0"),
            (0 < a.demo_alpha <= 1, "algo.demo_alpha must be in (0, 1]"),
            (
                a.demo_loss == "off" or local,
                "algo.demo_loss needs trainer.backend=local (a demonstration pass in the update)",
            ),
        ]

    def _critic_checks(self) -> list[tuple[bool, str]]:
        """Checks of the critic's fields (`algo.advantage` gae / turn_gae) and of where it runs:
        the value head is carried by the single-process trainer only (local, async, colocated
        vLLM); the Ray training groups (FSDP2) and DeepSpeed do not carry it, and are refused."""
        a, t = self.algo, self.trainer
        on = a.advantage in CRITIC_ESTIMATORS
        return [
            (0 <= a.gamma <= 1, f"algo.gamma must be in [0, 1], got {a.gamma}"),
            (0 <= a.lam <= 1, f"algo.lam must be in [0, 1], got {a.lam}"),
            (
                0 <= a.high_level_gamma <= 1,
                f"algo.high_level_gamma must be in [0, 1], got {a.high_level_gamma}",
            ),
            (a.cliprange_value > 0, f"algo.cliprange_value must be > 0, got {a.cliprange_value}"),
            (a.vf_coef >= 0, f"algo.vf_coef must be >= 0, got {a.vf_coef}"),
            (a.critic_lr >= 0, f"algo.critic_lr must be >= 0 (0: optim.lr), got {a.critic_lr}"),
            (
                not on or (t.backend == "local" and t.strategy == "fsdp2"),
                f"algo.advantage={a.advantage} (a value head) runs in the single-process trainer only: "
                "trainer.backend=ray (FSDP2 training groups) and trainer.strategy=deepspeed do not carry "
                "the value head yet",
            ),
            (
                not on or a.kl_estimator != "full" or a.kl_coef == 0,
                f"algo.advantage={a.advantage} does not combine with algo.kl_estimator=full yet",
            ),
            (
                not on or a.opsm_delta is None,
                f"algo.advantage={a.advantage}: algo.opsm_delta reads one advantage per response (the "
                "critic's are per token)",
            ),
        ]

    def _remote_url_checks(self) -> list[tuple[bool, str]]:
        """`reward.remote_url`: one http(s) URL or a non-empty list of distinct ones (any other
        scheme, `ftp://...` or none, is refused here, not retried until the client gives up)."""
        urls = self.reward.remote_url
        if urls is None:
            return []
        if isinstance(urls, str):
            return [(is_http_url(urls), f"reward.remote_url: {urls!r} {HTTP_URL_NEEDED}")]
        urls = list(urls)
        not_http = [u for u in urls if isinstance(u, str) and u and not is_http_url(u)]
        return [
            (bool(urls), "reward.remote_url is an empty list (null: score locally)"),
            (
                all(isinstance(u, str) and u for u in urls),
                f"reward.remote_url: every entry must be a URL, got {urls}",
            ),
            (not not_http, f"reward.remote_url: {not_http[0]!r} {HTTP_URL_NEEDED}" if not_http else ""),
            (len(set(urls)) == len(urls), f"reward.remote_url lists a server twice: {urls}"),
        ]

    def _strategy_checks(self) -> list[tuple[bool, str]]:
        """Checks of `trainer.strategy` and the DeepSpeed ZeRO options."""
        t, m = self.trainer, self.model
        ds = t.strategy == "deepspeed"
        return [
            (
                t.strategy in ("fsdp2", "deepspeed"),
                f"trainer.strategy must be fsdp2 or deepspeed, got {t.strategy!r}",
            ),
            (t.zero_stage in (2, 3), f"trainer.zero_stage must be 2 or 3, got {t.zero_stage}"),
            (
                ds or (t.zero_stage == 2 and not t.zero_offload_optimizer and not t.zero_offload_params),
                "trainer.zero_stage / zero_offload_optimizer / zero_offload_params configure DeepSpeed: "
                "set trainer.strategy=deepspeed",
            ),
            (
                not t.zero_offload_params or t.zero_stage == 3,
                "trainer.zero_offload_params needs trainer.zero_stage=3 (ZeRO-2 keeps whole parameters on "
                "every process; use trainer.zero_offload_optimizer there)",
            ),
            (
                not ds or t.backend == "ray" or t.zero_stage == 2,
                "trainer.zero_stage=3 needs trainer.backend=ray (in one process there is nothing to partition "
                "across, and the local loop's rollout engine and checkpoints read whole parameters); use "
                "zero_stage=2 with trainer.zero_offload_optimizer to fit a larger model on one GPU",
            ),
            (
                not ds
                or t.zero_stage == 2
                or t.train_workers == 1
                or t.prompts_per_step % (t.mini_batches * t.train_workers) == 0,
                "trainer.zero_stage=3 with trainer.train_workers > 1 needs trainer.mini_batches * "
                "trainer.train_workers to divide trainer.prompts_per_step (each process's share of a "
                "mini-batch whole prompt groups: ZeRO-3 needs every process to run the model's modules "
                "in the same order, and the prompt-sharing forward follows the prompts)",
            ),
            (
                not ds or t.backend == "ray" or self.rollout.engine == "hf",
                "trainer.strategy=deepspeed on the local backend generates with the HF engine: "
                "rollout.engine=vllm beside a DeepSpeed engine is not wired (use trainer.backend=ray)",
            ),
            (
                not ds or t.mode == "sync",
                "trainer.strategy=deepspeed runs with trainer.mode=sync (the asynchronous mode's generator "
                "keeps a plain copy of the weights)",
            ),
            (
                not ds or m.master_dtype in ("auto", "float32"),
                "trainer.strategy=deepspeed keeps float32 master weights in its optimizer: model.master_dtype "
                "must be auto or float32 (bfloat16 compute is model.dtype=bfloat16)",
            ),
            (
                not ds or m.dtype in ("auto", "float32", "bfloat16"),
                "trainer.strategy=deepspeed computes in float32 or bfloat16 (model.dtype auto, float32 or "
                "bfloat16; float16 would need its loss scaling, not wired here)",
            ),
        ]

    def _stability_checks(self) -> list[tuple[bool, str]]:
        """Checks of the stability fields of `algo` (mmrl.algos.stability)."""
        a = self.algo
        resets = a.ref_reset_every > 0 or a.ref_reset_kl > 0
        high = a.rejection_high
        return [
            (
                a.tis_low >= 0 and (a.tis_low == 0 or a.tis_low < a.tis_cap),
                "algo.tis_low must be 0 (1 / tis_cap) or in (0, tis_cap)",
            ),
            (
                a.tis_mode != "band" or a.tis_cap > 1 or a.tis_low > 0,
                "algo.tis_mode=band needs tis_cap > 1 or tis_low set",
            ),
            (not a.tis_batch_norm or a.tis != "off", "algo.tis_batch_norm needs algo.tis=token or sequence"),
            (
                a.tis_batch_norm_scope in ("verl", "kept"),
                f"algo.tis_batch_norm_scope must be verl or kept, got {a.tis_batch_norm_scope!r}",
            ),
            (
                a.rejection in ("off", "geometric", "sequence", "max_token"),
                "algo.rejection must be off, geometric, sequence or max_token",
            ),
            (
                a.rejection == "off" or a.old_logprobs == "recompute",
                "algo.rejection needs algo.old_logprobs=recompute (with rollout log-probs every ratio is 1)",
            ),
            (
                a.rejection_low >= 0
                and high > 0
                and (a.rejection_low if a.rejection_low > 0 else 1 / high) < high,
                "algo.rejection_low (0: 1 / rejection_high) must be below algo.rejection_high",
            ),
            (0 < a.cov_ratio <= 1, "algo.cov_ratio must be in (0, 1]"),
            (a.clip_cov_lb < a.clip_cov_ub, "algo.clip_cov_lb must be < algo.clip_cov_ub"),
            (a.kl_cov_coef >= 0, "algo.kl_cov_coef must be >= 0"),
            (a.entropy_target >= 0, "algo.entropy_target must be >= 0 (0: off)"),
            (a.entropy_coef_delta >= 0, "algo.entropy_coef_delta must be >= 0"),
            (
                a.entropy_target == 0 or 0 <= a.entropy_coef <= a.entropy_coef_max,
                "algo.entropy_coef (the adaptive coefficient's start) must be in [0, algo.entropy_coef_max]",
            ),
            (
                self.trainer.train_workers == 1 or a.entropy_target == 0 or a.loss_agg == "token_mean",
                "trainer.train_workers > 1 with algo.entropy_target > 0 needs algo.loss_agg=token_mean",
            ),
            (0 <= a.forking_frac <= 1, "algo.forking_frac must be in [0, 1] (0: off)"),
            (a.forking_scope in ("response", "batch"), "algo.forking_scope must be response or batch"),
            (
                a.ref_reset_every >= 0 and a.ref_reset_kl >= 0,
                "algo.ref_reset_every and algo.ref_reset_kl must be >= 0",
            ),
            (
                not resets or a.kl_coef > 0,
                "algo.ref_reset_every / ref_reset_kl need a reference (algo.kl_coef > 0)",
            ),
            (
                a.ref_reset_kl == 0 or not a.kl_in_reward,
                "algo.ref_reset_kl reads the loss's reference KL (actor/ref_kl): it needs algo.kl_in_reward=false",
            ),
            (
                not resets or self.model.lora_rank == 0,
                "algo.ref_reset_every / ref_reset_kl are not supported with LoRA (the reference is the base model)",
            ),
            (
                not resets or self.trainer.backend == "local",
                "algo.ref_reset_every / ref_reset_kl need trainer.backend=local",
            ),
        ]


HTTP_URL_NEEDED = "is not an http:// or https:// URL (a reward server's address, e.g. http://host:8000)"


def is_http_url(url: str) -> bool:
    """An `http://` or `https://` URL with a host: what a reward server (`mmrl serve`) answers on."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url.strip())
    except ValueError:  # e.g. an invalid IPv6 address
        return False
    return parts.scheme.lower() in ("http", "https") and bool(parts.hostname)


def task_names() -> list[str]:
    """Tasks with a recipe in `configs/`."""
    return sorted(p.name[:-5] for p in resources.files("mmrl.configs").iterdir() if p.name.endswith(".yaml"))


def recipe_kind(task: str) -> str | None:
    """The top-level `kind` of `configs/<task>.yaml` (`diffusion`, `decoupled`; None: a VLM
    recipe, or no such recipe). Read without loading the trainers, so the CLI can pick one."""
    recipe = resources.files("mmrl.configs") / f"{task}.yaml"
    if not recipe.is_file():
        return None
    conf = OmegaConf.create(recipe.read_text())
    return conf.get("kind") if isinstance(conf, type(OmegaConf.create({}))) else None


def load_config(
    task: str | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
) -> Config:
    """Defaults <- task recipe <- config file <- `key=value` overrides, validated."""
    return load_structured(Config, task, config_file, overrides)


def load_structured(
    schema: type, task: str | None, config_file: str | Path | None, overrides: list[str] | None
):
    """Any config dataclass: its defaults, then `configs/<task>.yaml`, then `config_file`, then
    `key=value` overrides; unknown keys and wrong types fail with the full key name."""
    merged = OmegaConf.structured(schema)
    if task is not None:
        recipe = resources.files("mmrl.configs") / f"{task}.yaml"
        if not recipe.is_file():
            raise ValueError(f"unknown task {task!r}: choose from {', '.join(task_names())}")
        where = f"configs/{task}.yaml"
        merged = _merge(merged, _yaml(recipe.read_text(), where), where)
    if config_file is not None:
        merged = merge_config_file(merged, config_file)
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"overrides must be key=value, got {bad}")
        try:
            dotlist = OmegaConf.from_dotlist(list(overrides))
        except Exception as exc:  # noqa: BLE001 - OmegaConf and YAML errors alike, on one line
            raise _config_error(f"invalid override in {list(overrides)}: {_one_line(exc)}", exc) from None
        merged = merge_config_values(merged, dotlist, "overrides")
    return config_object(merged)


def merge_config_file(merged: Any, config_file: str | Path) -> Any:
    """`merged` (an OmegaConf structured config) with a YAML file on top; a missing file is
    `FileNotFoundError`, everything else wrong (a folder, not UTF-8, bad YAML at file:line:column,
    an unknown key with the closest known one, a wrong type) a one-line `ConfigError` naming it."""
    path = Path(config_file)
    return _merge(merged, _yaml(read_config_file(path), str(path)), str(path))


def merge_config_values(merged: Any, values: Any, where: str) -> Any:
    """`merged` with `values` (a mapping or OmegaConf config) on top; errors name `where`."""
    return _merge(merged, values, where)


def config_object(merged: Any) -> Any:
    """The dataclass instance of an OmegaConf structured config (its `__post_init__` checks
    run); OmegaConf's errors as one-line `ConfigError`s."""
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _config_error(f"invalid config: {_describe(exc)}", exc) from None


MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read (1 MiB; a recipe is a few KiB): `--config /dev/zero`, or a data file
given by mistake, is refused instead of read until memory runs out."""


def read_config_file(path: Path) -> str:
    """The text of a YAML config file; a missing file is `FileNotFoundError`, a folder, a file
    that is not a regular one (a device, a FIFO, a socket), one over `MAX_CONFIG_BYTES`, an
    unreadable file or text that is not UTF-8 a `ConfigError`, each naming the path."""
    if not path.exists():
        raise FileNotFoundError(f"config file not found: {path}")
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder, not a config file (give a .yaml file)")
    problem = not_a_regular_file(path)
    if problem is not None:
        raise ConfigError(f"{path}: {problem} (give a .yaml file)")
    try:
        with path.open("rb") as f:  # no further than the limit, whatever the size said
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{path}: more than {size_in_words(MAX_CONFIG_BYTES)}, too large for a config file "
                "(give a .yaml file)"
            )
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None


class ConfigError(ValueError):
    """A config that cannot be loaded; the message is one line naming the file or key."""


_COMPAT: dict[type, type] = {}


def _config_error(message: str, exc: BaseException | None = None) -> ConfigError:
    """A `ConfigError` that is also an instance of OmegaConf's exception class (`exc`'s), so
    callers catching either keep working."""
    if exc is None or not isinstance(exc, OmegaConfBaseException):
        return ConfigError(message)
    base = type(exc)
    if base not in _COMPAT:
        _COMPAT[base] = type(base.__name__, (ConfigError, base), {"__str__": lambda self: self.args[0]})
    err = _COMPAT[base](message)
    err.full_key = getattr(exc, "full_key", None)
    return err


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _describe(exc: OmegaConfBaseException) -> str:
    """OmegaConf's multi-line message as one line with the full key (and, for an unknown key,
    the closest known ones)."""
    key = getattr(exc, "full_key", None)
    message = _one_line(exc)
    if isinstance(exc, ConfigKeyError) and key:
        return f"unknown key {key!r}{did_you_mean(key, getattr(exc, 'object_type', None))}"
    if key and key not in message:
        return f"{key}: {message}"
    return message


def did_you_mean(key: str, schema: Any) -> str:
    """` (did you mean 'trainer.total_steps'?)` for an unknown dotted `key` whose parent is the
    dataclass `schema`, naming its closest field (difflib); "" when none is close."""
    import difflib

    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return ""
    parent, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(schema)], n=1, cutoff=0.6)
    if not close:
        return ""
    suggestion = f"{parent}.{close[0]}" if parent else close[0]
    return f" (did you mean {suggestion!r}?)"


def _merge(base: Any, extra: Any, where: str) -> Any:
    """`OmegaConf.merge` with its errors (unknown key, wrong type) as one-line ValueErrors
    naming `where` the value came from and the full key."""
    try:
        return OmegaConf.merge(base, extra)
    except OmegaConfBaseException as exc:
        raise _config_error(f"{where}: {_describe(exc)}", exc) from None


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass `cls` (and of its dataclass bases), by name.

    A field's doc is the string literal on the line after its annotated assignment (the
    attribute-docstring convention that Sphinx and mkdocstrings read)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _nested(cls: type):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield type(default)
        elif isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            yield type(default[0])
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        for arg in typing.get_args(hints.get(f.name)) or ():
            if dataclasses.is_dataclass(arg):
                yield arg


def undocumented_fields(cls: type, seen: set | None = None) -> list[str]:
    """`Class.field` for every field, here and in nested config dataclasses, with no docstring."""
    seen = set() if seen is None else seen
    if cls in seen:
        return []
    seen.add(cls)
    documented = set(field_docs(cls))
    missing = [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls) if f.name not in documented]
    for sub in _nested(cls):
        missing += undocumented_fields(sub, seen)
    return missing


def count_fields(cls: type, seen: set | None = None) -> int:
    seen = set() if seen is None else seen
    if cls in seen:
        return 0
    seen.add(cls)
    return len(dataclasses.fields(cls)) + sum(count_fields(sub, seen) for sub in _nested(cls))


def _yaml(text: str, where: str) -> Any:
    import yaml

    try:
        conf = OmegaConf.create(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or _one_line(exc)
        context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and start is not None:  # where the unclosed bracket or quote began
            problem += f" ({context} at line {start.line + 1}, column {start.column + 1})"
        raise ConfigError(f"{where}{at}: invalid YAML: {problem}") from None
    except OmegaConfBaseException as exc:
        raise _config_error(f"{where}: {_describe(exc)}", exc) from None
    if conf is None or not isinstance(conf, type(OmegaConf.create({}))):
        raise ValueError(f"{where}: expected a mapping at the top level")
    return conf


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def config_to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
