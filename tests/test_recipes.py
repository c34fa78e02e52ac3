"""Every recipe in `configs/` loads and validates (no model is loaded or downloaded), so none
can rot: the config checks, the data sources' syntax, the reward models and their keyword
arguments, and, for recipes naming a real model, the command that runs it and the memory per
GPU and steps/hour, each marked as an estimate."""

from __future__ import annotations

import inspect
import re
from importlib import resources

import pytest

from mmrl.config import Config, load_config, task_names
from mmrl.datasets.sources import parse_source
from mmrl.train.flow_config import FlowConfig, is_diffusion_task, load_flow_config

RECIPES = task_names()


def _load(task: str) -> Config | FlowConfig:
    return load_flow_config(task) if is_diffusion_task(task) else load_config(task)


def _header(task: str) -> str:
    text = (resources.files("mmrl.configs") / f"{task}.yaml").read_text()
    return "\n".join(line for line in text.splitlines() if line.startswith("#"))


def test_the_real_model_recipes_are_there():
    assert {"qwen2_5_vl_7b_vtriune", "qwen2_5_vl_3b_grpo_lora", "sd3_5_medium_flow_grpo_lora"} <= set(RECIPES)


@pytest.mark.parametrize("task", RECIPES)
def test_every_recipe_loads_and_validates(task):
    cfg = _load(task)
    for entry in [*getattr(cfg.data, "train_files", []), *getattr(cfg.data, "heldout_files", [])]:
        parse_source(entry)  # the syntax and options of every data source, without reading it
    assert cfg.data.task == task or not cfg.model.path  # a real-model recipe names its run folder
    if isinstance(cfg, FlowConfig):
        from mmrl.rewards import reward_model_names
        from mmrl.rewards.base import _REGISTRY

        assert set(cfg.reward.names) <= set(reward_model_names()), cfg.reward.names
        assert set(cfg.reward.kwargs) <= set(cfg.reward.names), "kwargs for a reward the recipe does not use"
        for name, kwargs in cfg.reward.kwargs.items():
            accepted = inspect.signature(_REGISTRY[name]).parameters
            assert set(kwargs) <= set(accepted), f"{name}: unknown arguments {set(kwargs) - set(accepted)}"


@pytest.mark.parametrize("task", [t for t in RECIPES if _load(t).model.path])
def test_real_model_recipes_state_their_command_and_estimates(task):
    header = _header(task)
    assert f"mmrl train --task {task}" in header
    memory = re.search(r"memory per GPU \(estimate\):[^~]*~(\d+)-(\d+) GB", header)
    speed = re.search(r"steps/hour \(estimate\): ~(\d+)-(\d+)", header)
    assert memory and speed, f"configs/{task}.yaml must state memory per GPU and steps/hour as estimates"
    assert int(memory.group(2)) <= 80  # the recipes name 80 GB GPUs
    assert "not measured" in header


def test_the_ray_recipe_uses_the_gpus_it_names():
    cfg = load_config("qwen2_5_vl_7b_vtriune")
    t = cfg.trainer
    assert "on 8 GPUs" in _header("qwen2_5_vl_7b_vtriune")
    assert (t.backend, cfg.rollout.engine) == ("ray", "vllm")
    assert (t.rollout_workers + t.train_workers) * t.ray_gpus_per_actor == 8
    assert cfg.model.freeze_vision and cfg.algo.clip_high > cfg.algo.clip_low  # frozen ViT, clip-higher


# --- recipes faithful to what they cite --------------------------------------------------------
# Each faithful recipe, field by field, against the upstream values it cites (the upstream setting
# is named beside each value). The few that cannot match are the rows of the table in the
# recipe's header, which must name them (`CANNOT_MATCH`: words each row holds).
EASYR1 = ("hiyouga/EasyR1", "b44b311b669bf1fd1aa2fc36f2251482ba33cb16")
VTRIUNE = ("MiniMax-AI/One-RL-to-See-Them-All", "39bcf0d0537d7aa211d2f6ce73c8e51c396c1adb")
FLOW_GRPO = ("yifan123/flow_grpo", "ac4c86e8cae021841f1fde853d340e0db67690dd")
MATH_JINJA = (
    " You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)

UPSTREAM = {
    # examples/qwen2_5_vl_3b_geo3k_grpo.sh over examples/config.yaml
    "qwen2_5_vl_3b_geo3k_grpo": (
        EASYR1,
        {
            "model.path": "Qwen/Qwen2.5-VL-3B-Instruct",  # worker.actor.model.model_path
            "model.dtype": "bfloat16",  # fsdp.mp_param_dtype bf16 (float32 master weights)
            "model.master_dtype": "auto",  # float32
            "model.gradient_checkpointing": True,  # enable_gradient_checkpointing: true
            "model.freeze_vision": False,  # freeze_vision_tower: false
            "model.lora_rank": 0,  # lora.rank: 0
            "data.train_files": ["hiyouga/geometry3k@train"],  # the .sh's data.train_files
            "data.heldout_files": ["hiyouga/geometry3k@test"],  # data.val_files
            "data.cot_prompts": True,  # format_prompt: math.jinja
            "data.cot_prompt_pool": [MATH_JINJA],
            "rollout.group_size": 5,  # rollout.n
            "rollout.temperature": 1.0,  # rollout.temperature (top_p 1.0)
            "rollout.max_new_tokens": 2048,  # data.max_response_length
            "rollout.engine": "vllm",
            "rollout.vllm_gpu_memory_utilization": 0.6,  # rollout.gpu_memory_utilization
            "algo.advantage": "grpo",  # algorithm.adv_estimator
            "algo.policy_loss": "ppo",  # actor.loss_type: default
            "algo.clip_low": 0.2,  # clip_ratio_low
            "algo.clip_high": 0.3,  # clip_ratio_high
            "algo.clip_dual": 3.0,  # clip_ratio_dual
            "algo.kl_coef": 0.01,  # algorithm.kl_coef with use_kl_loss: true
            "algo.kl_estimator": "k3",  # kl_penalty: low_var_kl
            "algo.kl_in_reward": False,  # use_kl_loss: true
            "algo.loss_agg": "token_mean",  # loss_avg_mode: token
            "algo.dynamic_sampling": False,  # online_filtering: false
            "algo.entropy_coef": 0.0,
            "optim.lr": 1e-6,  # optim.lr
            "optim.betas": [0.9, 0.999],  # OptimConfig.betas
            "optim.weight_decay": 1e-2,  # optim.weight_decay
            "optim.schedule": "constant",  # lr_scheduler_type: constant
            "optim.warmup_steps": 0,  # lr_warmup_ratio: 0.0
            "optim.grad_clip": 1.0,  # max_grad_norm
            "trainer.total_steps": 60,  # total_epochs 15 x (2,101 rows // 512)
            "trainer.prompts_per_step": 512,  # data.rollout_batch_size
            "trainer.mini_batches": 4,  # 512 // actor.global_batch_size 128
            "trainer.ppo_epochs": 1,  # actor.ppo_epochs
            "trainer.micro_batch_rows": 1,  # micro_batch_size_per_device_for_update
            "trainer.seed": 1,  # data.seed
            "trainer.eval_every": 5,  # trainer.val_freq (val_before_train: step 0 too)
            "trainer.eval_size": 0,  # the whole validation split
            "trainer.checkpoint_every": 5,  # trainer.save_freq
            "trainer.keep_last": 3,  # trainer.save_limit
            "trainer.keep_best": False,
            "trainer.log_generations": 3,  # trainer.val_generations_to_log
            "trainer.loggers": ["jsonl", "wandb"],  # trainer.logger: [file, wandb]
            "trainer.train_workers": 2,  # trainer.n_gpus_per_node=2 (the .sh): two FSDP ranks
        },
        [
            "2 GPUs",
            "format",
            "temperature 0.6",
            "pixels",
            "2,048 tokens",
            "drop_last",
            "validation prompts",
            "ref.fsdp.enable_cpu_offload",
            "micro_batch_size_per_device_for_experience",
            "find_last_checkpoint",
        ],
    ),
    # scripts/train.sh over verl/trainer/config/ppo_trainer.yaml
    "qwen2_5_vl_7b_vtriune": (
        VTRIUNE,
        {
            "model.path": "Qwen/Qwen2.5-VL-7B-Instruct",  # ACTOR_LOAD_PATH (a local copy of it)
            "model.gradient_checkpointing": True,  # enable_gradient_checkpointing=True
            "model.freeze_vision": True,  # ACTOR_LR_FREEZE=[vit,connector]
            "model.freeze_connector": True,
            "model.lora_rank": 0,
            "data.train_files": [  # DATA_TRAIN_FILE
                "One-RL-to-See-Them-All/Orsta-Data-47k@train?data_files=train/train_puzzle_puzzlevqa_2648_x2.parquet",
                "One-RL-to-See-Them-All/Orsta-Data-47k@train?data_files=train/train_detection_v3det_4000.parquet",
            ],
            "data.heldout_files": [  # DATA_TEST_FILE
                "One-RL-to-See-Them-All/Orsta-Data-47k@train?data_files=test/test_math_megabench_237.parquet",
                "One-RL-to-See-Them-All/Orsta-Data-47k@train?data_files=test/test_detection_coco_test_multi_2000.parquet",
            ],
            "rollout.group_size": 8,  # ROLLOUT_N
            "rollout.temperature": 1.0,  # ROLLOUT_TEMP
            "rollout.max_new_tokens": 2048,  # DATA_MAX_RES_LENGTH
            "rollout.engine": "vllm",  # rollout.name=vllm
            "rollout.vllm_gpu_memory_utilization": 0.7,  # ROLLOUT_MAX_GPU_MEM
            "rollout.vllm_tensor_parallel_size": 1,  # ROLLOUT_TP_SIZE
            "algo.advantage": "grpo",  # ALGO_ADV_ESTIMATOR
            "algo.policy_loss": "ppo",
            "algo.clip_low": 0.2,  # ACTOR_CLIP_RATIO_LOW
            "algo.clip_high": 0.28,  # ACTOR_CLIP_RATIO_HIGH
            "algo.clip_dual": 3.0,  # ENABLE_DUAL_CLIP=True, clip_ratio_c 3.0
            "algo.kl_coef": 0.001,  # ACTOR_KL_LOSS_COEFF with ACTOR_USE_KL_LOSS=True
            "algo.kl_estimator": "k2",  # ACTOR_KL_LOSS_TYPE=mse
            "algo.kl_in_reward": False,  # algorithm.use_kl_in_reward=False (kl_ctrl.kl_coef 0)
            "algo.entropy_coef": 0.0,  # ACTOR_ENTROPY_COEFF
            "algo.loss_agg": "token_mean",  # ACTOR_LOSS_AGG_MODE=token-mean
            "optim.lr": 1e-6,  # ACTOR_LR
            "optim.weight_decay": 0.01,  # actor.optim.weight_decay
            "optim.schedule": "constant",  # WARMUP_STYLE
            "optim.warmup_steps": 1,  # int(LR_WARMUP_STEPS_RATIO 0.05 x 27)
            "optim.grad_clip": 1.0,  # actor.grad_clip
            "trainer.total_steps": 27,  # TRAIN_TOTAL_EPOCHS 3 x (9,296 rows // 1,024)
            "trainer.prompts_per_step": 1024,  # DATA_TRAIN_BATCH_SIZE
            "trainer.mini_batches": 1,  # ACTOR_PPO_GLOBAL_BSZ 1024: one update per step
            "trainer.ppo_epochs": 1,  # actor.ppo_epochs
            "trainer.micro_batch_rows": 16,  # ACTOR_PPO_MICRO_BSZ
            "trainer.eval_size": 0,  # the whole test files
            "trainer.checkpoint_every": 5,  # TRAIN_SAVE_FREQ
            "trainer.keep_last": 0,  # max_actor_ckpt_to_keep: null
            "trainer.log_generations": 0,  # log_val_generations: 0
            "trainer.loggers": ["jsonl", "wandb"],  # trainer.logger=['console','wandb']
        },
        [
            "8 GPUs",
            "remote reward server",
            "test_freq",
            "8,192 tokens",
            "first step at lr 0",
            "resume_mode",
            "drop_last",
            "data.seed (default 1)",
            "limit_images=1",
        ],
    ),
    # config/grpo.py:general_ocr_sd3 over config/base.py; scripts/train_sd3.py's LoRA and EMA
    "sd3_5_medium_flow_grpo_ocr": (
        FLOW_GRPO,
        {
            "model.path": "stabilityai/stable-diffusion-3.5-medium",  # pretrained.model
            "model.dtype": "float16",  # mixed_precision: fp16
            "sample.resolution": 512,  # resolution
            "sample.num_steps": 10,  # sample.num_steps
            "sample.eval_num_steps": 40,  # sample.eval_num_steps
            "sample.guidance_scale": 4.5,  # sample.guidance_scale (evaluation too)
            "sample.eval_guidance_scale": None,
            "sample.group_size": 24,  # sample.num_image_per_prompt
            "sample.noise_level": 0.7,  # sample.noise_level
            "sample.sde_type": "sde",  # flow_grpo's SDE (no window at this commit)
            "sample.sde_window_size": 0,
            "sample.same_latent": False,  # (not set: fresh noise per image)
            "sample.batch_size": 9,  # sample.train_batch_size
            "reward.names": ["ocr"],  # reward_fn: {ocr: 1.0}
            "reward.weights": [1.0],
            "reward.combine": "sum",
            "algo.clip_range": 1e-4,  # train.clip_range
            "algo.adv_clip_max": 5.0,  # train.adv_clip_max
            "algo.global_std": True,  # sample.global_std
            "algo.adv_eps": 1e-4,  # stat_tracking.py: std + 1e-4
            "algo.kl_coef": 0.04,  # train.beta
            "algo.timestep_fraction": 0.99,  # train.timestep_fraction
            "algo.train_cfg": True,  # train.cfg
            "algo.old_logprobs": "rollout",  # the sampler's log-probs
            "lora.enabled": True,  # use_lora
            "lora.rank": 32,  # LoraConfig(r=32)
            "lora.alpha": 64,  # lora_alpha=64
            "lora.init": "gaussian",  # init_lora_weights="gaussian"
            "lora.target_modules": [
                "attn.to_q",
                "attn.to_k",
                "attn.to_v",
                "attn.to_out.0",
                "attn.add_q_proj",
                "attn.add_k_proj",
                "attn.add_v_proj",
                "attn.to_add_out",
            ],  # fmt: skip
            "optim.lr": 3e-4,  # train.learning_rate
            "optim.betas": [0.9, 0.999],  # adam_beta1, adam_beta2
            "optim.weight_decay": 1e-4,  # adam_weight_decay
            "optim.eps": 1e-8,  # adam_epsilon
            "optim.grad_clip": 1.0,  # max_grad_norm
            "optim.schedule": "constant",
            "optim.warmup_steps": 0,
            "trainer.prompts_per_step": 48,  # 32 GPUs x 9 x 4 batches / 24 images
            "trainer.mini_batches": 2,  # 4 batches / gradient_accumulation_steps 2
            "trainer.inner_epochs": 1,  # train.num_inner_epochs
            "trainer.eval_every": 60,  # eval_freq
            "trainer.ema": True,  # train.ema
            "trainer.ema_decay": 0.9,  # EMAModuleWrapper(decay=0.9, ...)
            "trainer.ema_every": 8,  # update_step_interval=8
            "trainer.seed": 42,  # seed
            "trainer.checkpoint_every": 60,  # save_freq
            "trainer.keep_last": 5,  # num_checkpoint_limit
        },
        ["32 GPUs", "first int(10 x 0.99)", "test.txt", "manually stopped", "PaddleOCR"],
    ),
}

VARIANTS = {
    # recipe: (its faithful recipe, {key: value} of every field it changes)
    "qwen2_5_vl_3b_grpo_lora": (
        "qwen2_5_vl_3b_geo3k_grpo",
        {
            "model.lora_rank": 64,  # examples/qwen3_vl_4b_geo3k_grpo_lora.sh
            "model.lora_alpha": 64.0,  # examples/config.yaml lora.alpha
            "optim.lr": 1e-5,  # the LoRA example's lr
            "data.task": "qwen2_5_vl_3b_grpo_lora",
            # one process on one GPU instead of the Ray workers
            "trainer.backend": "local",
            "trainer.strategy": "fsdp2",
            "trainer.zero_stage": 2,
            "trainer.zero_offload_params": False,
            "trainer.zero_offload_optimizer": False,
            "trainer.train_workers": 1,
            "trainer.ray_gpus_per_actor": 0.0,
        },
    ),
    "sd3_5_medium_flow_grpo_lora": (
        "sd3_5_medium_flow_grpo_ocr",
        {
            "sample.group_size": 8,  # general_ocr_sd3_1gpu: num_image_per_prompt
            "sample.batch_size": 8,  # train_batch_size
            "trainer.prompts_per_step": 8,  # 1 GPU x 8 x 8 batches / 8 images
            "data.task": "sd3_5_medium_flow_grpo_lora",
        },
    ),
}


def _flat(task: str) -> dict:
    from mmrl.train.preflight import flatten

    cfg = _load(task)
    if isinstance(cfg, FlowConfig):
        from mmrl.train.flow_config import flow_config_dict

        return flatten(flow_config_dict(cfg))
    from mmrl.config import config_to_dict

    return flatten(config_to_dict(cfg))


@pytest.mark.parametrize("task", sorted(UPSTREAM))
def test_a_faithful_recipe_matches_its_source_field_by_field(task):
    (repo, commit), upstream, cannot_match = UPSTREAM[task]
    header = _header(task)
    assert f"github.com/{repo} at commit" in header and commit in header.replace("#", "").replace(
        "\n", ""
    ).replace(" ", ""), f"configs/{task}.yaml must name its source repository and commit"
    assert "faithful recipe" in header
    ours = _flat(task)
    wrong = {
        key: (ours.get(key, "<missing>"), value)
        for key, value in upstream.items()
        if ours.get(key, "<missing>") != (pytest.approx(value) if isinstance(value, float) else value)
    }
    assert not wrong, f"configs/{task}.yaml differs from {repo}@{commit[:8]}: {wrong}"
    table = header[header.index("What cannot match") :]
    for words in cannot_match:
        assert words in table, f"configs/{task}.yaml: the table of what cannot match has no row for {words!r}"


@pytest.mark.parametrize("task", sorted(VARIANTS))
def test_a_variant_differs_from_its_faithful_recipe_only_where_it_says(task):
    faithful, changes = VARIANTS[task]
    header = _header(task)
    assert header.startswith(f"# VARIANT of {faithful}.yaml"), "a variant says so on its first line"
    ours, theirs = _flat(task), _flat(faithful)
    differing = {key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key)}
    assert differing == set(changes), sorted(differing ^ set(changes))
    for key, value in changes.items():
        assert ours[key] == value, key


def test_every_real_model_recipe_is_faithful_or_a_labelled_variant():
    real = {t for t in RECIPES if _load(t).model.path}
    assert real == set(UPSTREAM) | set(VARIANTS)


STALE = {
    # mmrl.algos.kl clamps k3 to [-10, 10], as veRL's / EasyR1's low_var_kl does.
    "qwen2_5_vl_3b_geo3k_grpo": ["| k3 | no clamp |", "does not clamp"],
    # The Ray backend resumes exactly (docs/scaling.md, tests/test_distributed_ray_cluster.py).
    "qwen2_5_vl_7b_vtriune": ["does not resume yet", "| no resume |"],
}
"""Claims a recipe header once made that the code no longer bears out (issue 48, item 4)."""


@pytest.mark.parametrize("task", sorted(STALE))
def test_recipe_headers_make_no_stale_claims(task):
    header = _header(task)
    stale = [words for words in STALE[task] if words in header]
    assert not stale, f"configs/{task}.yaml still says {stale}"
