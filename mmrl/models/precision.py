"""Where models run and in what precision: `trainer.device`, `model.dtype`, `model.master_dtype`.

mmrl trains the way practitioners expect on an accelerator: **mixed precision with float32
master weights**. The weights that train (the whole model, or only the LoRA adapters) and the
optimizer's state stay float32; the forward and backward run under `torch.autocast` in the
compute dtype (bfloat16 by default on an accelerator); weights that never train (a frozen vision
tower, the LoRA base model, the KL reference) are stored in the compute dtype, which halves their
memory. Log-probs, losses and advantages are float32 whatever the compute dtype
(`mmrl.algos.logprobs`). `model.master_dtype=bfloat16` (equal to `model.dtype`) trains the
weights themselves in bfloat16: half the memory for weights and optimizer state, at the price of
updates rounded to bfloat16's 8-bit mantissa.

On a CPU the default is float32 everywhere (no autocast); `model.dtype=bfloat16` runs the same
mixed-precision path on the CPU (tested).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from mmrl.config import DTYPE_NAMES

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES if name != "auto"}
"""The dtype names config fields accept (besides `auto`), as torch dtypes."""


def resolve_device(spec: str = "auto") -> torch.device:
    """`auto`: the local accelerator (under torchrun the local rank's GPU; under Ray the actor's
    own, which Ray exposes as `cuda:0`), else the CPU. Anything else: `torch.device(spec)`."""
    if spec != "auto":
        device = torch.device(spec)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"trainer.device={spec!r}: this machine has no CUDA device (torch.cuda.is_available() is False)"
            )
        return device
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on a GPU that supports it, float32 elsewhere; else the named dtype."""
    if spec == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if spec not in DTYPES:
        raise ValueError(f"unknown dtype {spec!r}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[spec]


@dataclass(frozen=True)
class Precision:
    """A model's device and its two dtypes (see the module docs)."""

    device: torch.device
    compute: torch.dtype
    """Activations, the matmuls under autocast, and weights that never train."""
    master: torch.dtype
    """Weights that train, and so their gradients and the optimizer's state."""

    @property
    def autocast(self) -> bool:
        """Whether forwards run under `torch.autocast` (master weights wider than compute)."""
        return self.compute != self.master

    def context(self) -> contextlib.AbstractContextManager:
        """The autocast context of a forward (a no-op when compute == master)."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute)

    def describe(self) -> str:
        name = {v: k for k, v in DTYPES.items()}
        if self.autocast:
            return (
                f"device {self.device}; mixed precision: trainable weights and optimizer state "
                f"{name[self.master]}, compute (autocast) and frozen weights {name[self.compute]}; "
                "log-probs, losses and advantages float32"
            )
        return (
            f"device {self.device}; weights, optimizer state and compute {name[self.compute]}; "
            "log-probs, losses and advantages float32"
        )


def precision_from(device: str, dtype: str, master_dtype: str) -> Precision:
    """The `Precision` of `trainer.device`, `model.dtype` and `model.master_dtype` (`auto`:
    float32, or the compute dtype when that is float32)."""
    dev = resolve_device(device)
    compute = resolve_dtype(dtype, dev)
    master = torch.float32 if master_dtype == "auto" else resolve_dtype(master_dtype, dev)
    if master != torch.float32 and master != compute:
        raise ValueError(
            f"model.master_dtype={master_dtype!r} with model.dtype={dtype!r}: master weights are either "
            "float32 (mixed precision) or the compute dtype itself"
        )
    if compute == torch.float16 and master == torch.float32:
        log.warning("float16 autocast without a gradient scaler can underflow; bfloat16 is the safer choice")
    return Precision(dev, compute, master)


def place(model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    """Move `model` to its device, trainable parameters in the master dtype and frozen ones (and
    floating-point buffers of frozen modules) in the compute dtype. Call after LoRA and freezing
    have decided what trains."""
    model.to(precision.device)
    for p in model.parameters():
        want = precision.master if p.requires_grad else precision.compute
        if p.is_floating_point() and p.dtype != want:
            p.data = p.data.to(want)
    return model


def frozen_copy_dtype(module: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    """A frozen module (the KL reference) in the compute dtype, on the device."""
    return module.to(device=precision.device, dtype=precision.compute).eval().requires_grad_(False)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """AdamW, fused (one kernel per parameter group, no temporaries) where torch has the fused
    kernel for every parameter (CUDA and CPU tensors of a floating dtype). The default
    implementations allocate a temporary the size of the state they update: the multi-tensor
    one (the default on a GPU) for all parameters at once, which for a 7B model with float32
    master weights is another 28 GB at every step."""
    groups = list(params)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = bool(tensors) and all(
        type(p) is torch.nn.Parameter and p.device.type in ("cuda", "cpu") and p.is_floating_point()
        for p in tensors
    )
    return torch.optim.AdamW(groups, fused=fused or None, **kwargs)
