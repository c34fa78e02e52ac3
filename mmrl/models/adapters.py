"""What of the policy trains: LoRA adapters (peft), frozen vision tower / connector, and the
optimizer's parameter groups (own learning rates for the vision tower and the connector).
Which parameters are the vision tower and the connector is the model family's to say
(`mmrl.models.families`: Qwen-VL's `visual` / `visual.merger`, LLaVA's `vision_tower` /
`multi_modal_projector`, Idefics3's `vision_model` / `connector`, ...)."""

from __future__ import annotations

import contextlib
import re

import torch
from transformers import PreTrainedModel

from mmrl.config import Config
from mmrl.models.families import family_of


def part_of(name: str, model: torch.nn.Module) -> str:
    """`vision`, `connector` or `language` for a parameter or module name of `model`."""
    return family_of(model).part_of(name)


def parts(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter name of `model` -> its part (`part_of`)."""
    family = family_of(model)
    return {name: family.part_of(name) for name, _ in model.named_parameters()}


def _require(model: torch.nn.Module, found: dict[str, str], part: str, setting: str) -> None:
    if part not in found.values():
        raise ValueError(
            f"{setting} is set, but no parameter of {type(model).__name__} is its {part} "
            f"(family adapter {family_of(model).name!r}, mmrl.models.families: add one for this model)"
        )


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
    if any(part_of(n, model) != "language" for n in targets) and m.freeze_vision:
        raise ValueError("model.lora_targets reaches into the vision tower while model.freeze_vision is set")
    config = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=0.0, target_modules=targets)
    return get_peft_model(model, config)


def freeze_parts(model: torch.nn.Module, cfg: Config) -> None:
    """Freeze the vision tower, the connector and/or the MoE routers as configured."""
    found = parts(model)
    if cfg.model.freeze_vision:
        _require(model, found, "vision", "model.freeze_vision")
    if cfg.model.freeze_connector:
        _require(model, found, "connector", "model.freeze_connector")
    for name, p in model.named_parameters():
        part = found[name]
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
    found = parts(model)
    if o.vision_lr is not None and not cfg.model.freeze_vision:
        _require(model, found, "vision", "optim.vision_lr")
    if o.connector_lr is not None and not cfg.model.freeze_connector:
        _require(model, found, "connector", "optim.connector_lr")
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups[found[name]].append(p)
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


LORA_MERGE = ("auto", "merged", "unmerged")


def resolve_lora_merge(setting: str, device: torch.device) -> bool:
    """Whether rollouts merge LoRA adapters into the weights (`rollout.lora_merge`): `auto` does
    on CUDA (each adapted layer of the decode step then reads one weight instead of three)."""
    if setting not in LORA_MERGE:
        raise ValueError(f"rollout.lora_merge={setting!r}: choose one of {', '.join(LORA_MERGE)}")
    return setting == "merged" or (setting == "auto" and device.type == "cuda")


class MergedAdapters:
    """peft's `merge_adapter()` for a rollout, undone exactly afterwards.

    Merging adds scaling * B @ A into each adapted base weight in the weight's dtype; peft's
    `unmerge_adapter()` subtracts it again, which in bfloat16 does not give the original weight
    back (round(round(W + D) - D) != W: tested), and the frozen base weights would drift a
    rounding step per rollout. So the adapted base weights are copied (on their device) before
    merging and copied back after `unmerge_adapter()`: exact, at the cost of one copy of those
    weights held during the rollout only. The copy is taken every time, so weights loaded into
    the model between rollouts (a resume, a sync) are what is restored.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @property
    def applies(self) -> bool:
        """Whether the model has LoRA adapters to merge."""
        return is_lora(self.model) and bool(self._base_weights())

    def _base_weights(self) -> list[torch.Tensor]:
        from peft.tuners.lora import LoraLayer

        out = []
        for module in self.model.modules():
            if isinstance(module, LoraLayer):
                base = module.get_base_layer()
                out.extend(
                    p for p in (getattr(base, "weight", None), getattr(base, "bias", None)) if p is not None
                )
        return out

    @contextlib.contextmanager
    def merged(self):
        weights = self._base_weights()
        with torch.no_grad():
            saved = [w.detach().clone() for w in weights]
            self.model.merge_adapter()
        try:
            yield self.model
        finally:
            with torch.no_grad():
                self.model.unmerge_adapter()  # peft's bookkeeping: the adapters count again
                for w, original in zip(weights, saved):
                    w.copy_(original)  # the exact weights (the subtraction rounds)
            del saved


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the base model with `model`'s LoRA adapters merged in (W + scale * B A),
    named as the plain model names them; no copy of the model is made (what a rollout engine
    without adapters loads). Equal to `merged_copy_for_saving(model).state_dict()`."""
    from peft.tuners.lora import LoraLayer

    inner = model.get_base_model()
    deltas = {
        f"{name}.weight": module.get_delta_weight("default")
        for name, module in inner.named_modules()
        if isinstance(module, LoraLayer)
    }
    merged = {}
    for key, value in inner.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        merged[key] = value + deltas[key].to(value.dtype) if key in deltas else value
    return merged
