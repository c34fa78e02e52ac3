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
