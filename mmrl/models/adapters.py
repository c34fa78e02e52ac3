"""What of the policy trains: LoRA adapters (peft), frozen vision tower / connector, and the
optimizer's parameter groups (own learning rates for the vision tower and the connector)."""

from __future__ import annotations

import contextlib
import re

import torch
from transformers import PreTrainedModel

from mmrl.config import Config

# Qwen2-VL / Qwen2.5-VL / Qwen3-VL module names: `...visual.merger` is the connector, the rest
# of `...visual` the vision tower.
_CONNECTOR = re.compile(r"(^|\.)visual\.(merger|deepstack_merger_list)(\.|$)")
_VISION = re.compile(r"(^|\.)visual(\.|$)")


def part_of(name: str) -> str:
    """`vision`, `connector` or `language` for a parameter or module name."""
    if _CONNECTOR.search(name):
        return "connector"
    if _VISION.search(name):
        return "vision"
    return "language"


def apply_lora(model: PreTrainedModel, cfg: Config) -> PreTrainedModel:
    """Wrap the model with LoRA adapters on the modules matching `model.lora_targets`."""
    from peft import LoraConfig, get_peft_model

    m = cfg.model
    targets = [
        n
        for n, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and re.fullmatch(m.lora_targets, n)
    ]
    if not targets:
        raise ValueError(
            f"model.lora_targets={m.lora_targets!r} matches no linear layer of {type(model).__name__}"
        )
    if any(part_of(n) != "language" for n in targets) and m.freeze_vision:
        raise ValueError("model.lora_targets reaches into the vision tower while model.freeze_vision is set")
    config = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=0.0, target_modules=targets)
    return get_peft_model(model, config)


def freeze_parts(model: torch.nn.Module, cfg: Config) -> None:
    """Freeze the vision tower, the connector and/or the MoE routers as configured."""
    for name, p in model.named_parameters():
        part = part_of(name)
        if (part == "vision" and cfg.model.freeze_vision) or (
            part == "connector" and cfg.model.freeze_connector
        ):
            p.requires_grad_(False)
    if cfg.model.freeze_router:
        from mmrl.models.moe import freeze_router

        freeze_router(model)


def param_groups(model: torch.nn.Module, cfg: Config) -> list[dict]:
    """Trainable parameters grouped by part, each with its learning rate."""
    o = cfg.optim
    lrs = {"language": o.lr, "vision": o.vision_lr or o.lr, "connector": o.connector_lr or o.lr}
    groups: dict[str, list[torch.nn.Parameter]] = {"language": [], "vision": [], "connector": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups[part_of(name)].append(p)
    return [{"params": ps, "lr": lrs[part], "name": part} for part, ps in groups.items() if ps]


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model (LoRA adapters off): the KL reference when training with LoRA."""
    with model.disable_adapter():
        yield model


def merged_copy_for_saving(model: torch.nn.Module) -> PreTrainedModel:
    """The model to save in HF format: LoRA adapters merged into a copy, else the model."""
    if not is_lora(model):
        return model
    import copy

    return copy.deepcopy(model).merge_and_unload()
