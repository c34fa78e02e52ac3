"""DeepSpeed ZeRO as the training strategy (`trainer.strategy=deepspeed`), beside FSDP2.

The update is the one every other layout runs (`mmrl.train.update.update_policy`), with the
FSDP2 group's re-weighting (`mmrl.distributed.training_group`: each process's loss share of
every mini-batch). DeepSpeed owns what it is for:

    the optimizer       AdamW on the ZeRO partitions (torch's kernel), or DeepSpeedCPUAdam on the
                        host with `trainer.zero_offload_optimizer` (ZeRO-Offload)
    the partitioning    ZeRO-2 (`trainer.zero_stage=2`): optimizer state and gradients split
                        across the processes, parameters whole on each; ZeRO-3: parameters too,
                        gathered a module at a time (`trainer.zero_offload_params`: kept on the host)
    clipping            `optim.grad_clip` is its `gradient_clipping`; a non-finite gradient norm
                        skips the step on every process (its overflow check)
    precision           `model.dtype` resolving to bfloat16 (the default on a GPU): bfloat16
                        weights and compute, float32 master weights in the optimizer, gradients
                        accumulated in float32; else float32 throughout

With LoRA (`model.lora_rank > 0`) the engine's optimizer holds the adapters only (ZeRO-2
partitions their state; ZeRO-3 partitions the frozen base weights too), and the KL reference is
the same engine's model with its adapters disabled (`EngineModule.disable_adapter`): no copy.

Two things differ from FSDP2 and are handled here. DeepSpeed averages the processes' gradients
(their sum / world size) where the FSDP2 group sums them, so each loss share is scaled by the
world size (`GroupLearner.averages_gradients`). Gradient accumulation is left to the caller
(`managed_gradient_accumulation=false`): each micro-batch's `engine.backward` accumulates (ZeRO-2/3
reduce into the partitions as they go) and the `engine.step()` at the end of a mini-batch is the
boundary, so a mini-batch may have any number of micro-batches (`DeepSpeedSteps`).

Two compositions use it:

    DeepSpeedLearner        one process of a training group (`GroupLearner`'s interface): the Ray
                            backend's training actors, or `torchrun ... -m mmrl.distributed.one_update`
    deepspeed_composition   the local backend: the loop's own trainee, its update run by a
                            one-process engine (ZeRO-2; with optimizer offload a 7B model's float32
                            master weights and Adam moments, ~84 GB, live in host memory)

Checkpoints: the optimizer state is consolidated per parameter name (float32 master weight, Adam
moments, step count, learning rates: `consolidated_optimizer_state`, any stage or world size) and
put back into the partitions when a run resumes (`load_consolidated_optimizer_state`; in a group
by `DeepSpeedLearner.load_state`, with the trained weights). Tested: `tests/test_deepspeed.py` (the 2-process ZeRO-2 and
ZeRO-3 updates against the 1-process one, the local backend's update and resume, a Ray run).

ZeRO-3 records the order in which the model's modules run and requires it to be the same on every
process. mmrl's forward keeps it so when the processes' shares are alike: whole prompt groups
(checked in the config), the LM head's weight gathered for the whole pass (`register_head`). A
batch mixing samples with and without images could still give two processes different modules
(the vision tower runs only for images): DeepSpeed then stops with "Detected a disagreement on
list length".

Compiled ops: DeepSpeed builds its C++ ops on first use (`DS_BUILD_OPS=0` installs none): on the
CPU a communication op (~50 s) at the first `initialize`, CPU Adam (~75 s) at the first engine with
optimizer offload. They are cached in `TORCH_EXTENSIONS_DIR` (the tests and the benchmarks point it
at a folder per virtual environment under `~/.cache/mmrl/torch_extensions`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import socket
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mmrl.config import Config
from mmrl.distributed.training_group import GroupLearner
from mmrl.models.adapters import is_lora, param_groups
from mmrl.models.loading import Policy
from mmrl.models.precision import Precision, resolve_dtype
from mmrl.train.grpo import Composition, Trainee, grpo_step, lr_lambda, make_trainee
from mmrl.train.update import OptimizerSteps, old_and_ref_logprobs, update_policy
from mmrl.types import RolloutBatch

log = logging.getLogger(__name__)


def require_deepspeed():
    """The `deepspeed` module, or an error saying how to install it."""
    try:
        import deepspeed
    except ImportError as exc:  # pragma: no cover - the distributed extra is not installed
        raise ImportError(
            "trainer.strategy=deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install 'mmrl[distributed]' "
            "(its ops are then built on first use)"
        ) from exc
    return deepspeed


def deepspeed_config(cfg: Config, world_size: int, bf16: bool, pin_memory: bool) -> dict[str, Any]:
    """The DeepSpeed config of a policy engine from the run's config.

    mmrl forms its own mini- and micro-batches (`trainer.mini_batches`, `micro_batch_rows`), so
    the batch sizes here only satisfy DeepSpeed's arithmetic (train_batch_size = micro x
    accumulation x world); the accumulation boundary is each `engine.step()`."""
    t, o = cfg.trainer, cfg.optim
    zero: dict[str, Any] = {"stage": t.zero_stage, "contiguous_gradients": True}
    if t.zero_offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if t.zero_offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": o.grad_clip,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        # DeepSpeed's AdamW: torch's kernel on the partitions, DeepSpeedCPUAdam with offload.
        # (FusedAdam, its default on a GPU, is a CUDA op that DS_BUILD_OPS=0 would compile at
        # start-up; torch's AdamW does the same arithmetic.)
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": list(o.betas),
                "eps": 1e-8,
                "weight_decay": o.weight_decay,
                "torch_adam": not t.zero_offload_optimizer,
            },
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }
    if bf16:  # accumulate micro-batch gradients in float32, as the FSDP2 group reduces them
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def reference_config(cfg: Config, world_size: int, bf16: bool, pin_memory: bool) -> dict[str, Any]:
    """The DeepSpeed config of a frozen ZeRO-3 reference (no optimizer): partitioned like the
    policy (and on the host with `trainer.zero_offload_params`)."""
    zero: dict[str, Any] = {"stage": 3}
    if cfg.trainer.zero_offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }


def join_process_group(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """torch.distributed for DeepSpeed (gloo on the CPU, NCCL on GPUs), unless this process is in
    a group already (a one-process group is reused by every later engine of the process);
    DeepSpeed reads the local device index from LOCAL_RANK."""
    os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def local_rendezvous() -> str:
    """A free TCP address on this host, for a one-process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def register_head(module: torch.nn.Module) -> None:
    """ZeRO-3: DeepSpeed gathers the LM head's weight for the model's whole forward and backward,
    and the log-prob pass uses it directly (`mmrl.algos.logprobs.head_logprobs`, a chunk of
    positions at a time) instead of calling the head once per chunk. Besides sparing the calls,
    this keeps the modules every process runs, and their order, independent of its number of
    response tokens: ZeRO-3 records that order and requires it to be the same on every process."""
    from mmrl.train.forward import output_head

    head, _ = output_head(module)
    if type(head) is not torch.nn.Linear:
        return  # a head that is not a plain linear layer runs as a module (its hooks gather it)
    for p in (head.weight, head.bias):
        if isinstance(p, torch.nn.Parameter):
            require_deepspeed().zero.register_external_parameter(module, p)
    head.gathered_by_model = True


def initialize_engine(cfg: Config, model: torch.nn.Module, world_size: int, bf16: bool, device: torch.device):
    """A DeepSpeed engine (with its optimizer) over `model`'s trainable parameter groups (one per
    part, each with its learning rate: `param_groups`)."""
    deepspeed = require_deepspeed()
    config = deepspeed_config(cfg, world_size, bf16, pin_memory=device.type == "cuda")
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, cfg), config=config, dist_init_required=False
    )
    if cfg.trainer.zero_stage == 3:
        register_head(engine.module)
    return engine


def reference_engine(cfg: Config, model: torch.nn.Module, world_size: int, bf16: bool, device: torch.device):
    """A frozen ZeRO-3 copy of `model` (no optimizer), for the KL reference."""
    deepspeed = require_deepspeed()
    config = reference_config(cfg, world_size, bf16, pin_memory=device.type == "cuda")
    engine, *_ = deepspeed.initialize(model=model.eval().requires_grad_(False), config=config,
                                      dist_init_required=False)  # fmt: skip
    register_head(engine.module)
    return engine


class EngineModule(torch.nn.Module):
    """A DeepSpeed engine as the log-prob pass sees a model: `run_as_forward(fn)` runs `fn(model)`
    as the wrapped model's forward, called through the engine (`mmrl.train.forward.call_as_forward`
    asks for this), so DeepSpeed's hooks (ZeRO-3 gathering, its backward bookkeeping) see the
    whole pass.

    The engine is held outside this module's tree: nothing (a `.to()`, `.parameters()`, a state
    dict) reaches past DeepSpeed into the parameters it partitions and places."""

    def __init__(self, engine):
        super().__init__()
        object.__setattr__(self, "engine", engine)

    def disable_adapter(self):
        """LoRA: the engine's model with its adapters off (the KL reference)."""
        return self.engine.module.disable_adapter()

    def run_as_forward(self, fn):
        module = self.engine.module
        module.forward = types.MethodType(lambda self: fn(self), module)  # this call only
        try:
            return self.engine()
        finally:
            del module.forward


class DeepSpeedSteps(OptimizerSteps):
    """`update_policy`'s optimizer steps on a DeepSpeed engine: `engine.backward` per micro-batch,
    `engine.step()` (clip, step, or skip on a non-finite norm) at the end of the mini-batch."""

    def __init__(self, engine):
        self.engine = engine

    def zero_grad(self) -> None:
        pass  # the engine's step (or its skip) leaves its gradient partitions empty

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> float:
        self.engine.step()
        if not self.engine.was_step_applied():
            return math.inf
        norm = self.engine.get_global_grad_norm()
        return float(norm)

    def discard(self, loss: torch.Tensor) -> None:
        # DeepSpeed drops accumulated gradient partitions only in its own overflow skip: a
        # gradient that is non-finite everywhere the loss reaches, then its step.
        self.engine.backward(loss * float("nan"))
        self.engine.step()
        if self.engine.was_step_applied():
            raise RuntimeError("DeepSpeed applied a step whose gradient was non-finite")


# ---------------------------------------------------------------------------------------------
# The optimizer state, consolidated per parameter name (checkpoints, resume)
# ---------------------------------------------------------------------------------------------

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _trainable(engine) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]


def _flat_partitions(engine) -> list[torch.Tensor]:
    """This process's float32 partitions, the tensors the base optimizer steps (ZeRO-1/2: one per
    parameter group; ZeRO-3: one per sub-group)."""
    zero = engine.optimizer
    flats = getattr(zero, "single_partition_of_fp32_groups", None)
    return list(flats if flats is not None else zero.fp32_partitioned_groups_flat)


def _adam_states(engine) -> list[dict]:
    """The base optimizer's state of each flat partition."""
    return [engine.optimizer.optimizer.state[p] for p in _flat_partitions(engine)]


def _link_adam_states(engine) -> None:
    """ZeRO-1/2: point every parameter's view of the optimizer state at its partition's Adam
    moments. (DeepSpeed links them once, at its first step, while only the first parameter
    group's state exists: with a group per model part the others would stay unlinked.)"""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    zero = engine.optimizer
    if hasattr(zero, "single_partition_of_fp32_groups"):
        for lp, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
            lazy_init_hp_params_optimizer_state(lp, flat, zero.optimizer.state)


def consolidated_optimizer_state(engine, rank: int) -> dict[str, Any] | None:
    """The whole optimizer state on rank 0 (None elsewhere; every rank must call):
    `{"master": {name: float32 weight}, "exp_avg": {...}, "exp_avg_sq": {...}, "step": n,
    "lr": [per parameter group]}`; no moments before the first step."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    states = _adam_states(engine)
    started = all(k in s for s in states for k in ADAM_KEYS) and bool(states)
    out: dict[str, Any] = {"master": {}, **({k: {} for k in ADAM_KEYS} if started else {})}
    if started:
        _link_adam_states(engine)
    for name, p in _trainable(engine):
        master = safe_get_full_fp32_param(p)  # collective under ZeRO-2/3
        moments = {k: safe_get_full_optimizer_state(p, k) for k in ADAM_KEYS} if started else {}
        if rank == 0:
            out["master"][name] = master.detach().float().cpu()
            for k, v in moments.items():
                out[k][name] = v.detach().float().cpu()
    if rank != 0:
        return None
    out["step"] = max((int(s["step"]) for s in states if "step" in s), default=0)
    out["lr"] = [g["lr"] for g in engine.basic_optimizer.param_groups]
    return out


def load_consolidated_optimizer_state(engine, state: dict[str, Any]) -> None:
    """Put a `consolidated_optimizer_state` back into the engine's partitions (every rank, each
    with the whole state): master weights, Adam moments and step counts, learning rates. The
    model's own (bfloat16 or float32) weights are the checkpoint's and are loaded apart."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    names = [name for name, _ in _trainable(engine)]
    missing = sorted(set(names) - set(state.get("master", {})))
    if missing:
        raise ValueError(
            f"the checkpoint's optimizer state is not a DeepSpeed one of this model (no master weight for "
            f"{missing[:3]}); it was written by another trainer.strategy or model"
        )
    opt = engine.optimizer.optimizer
    if "exp_avg" in state:
        # Adam creates its state lazily at the first step: create it (zeros) to fill it.
        for flat in _flat_partitions(engine):
            s = opt.state[flat]
            for k in ADAM_KEYS:
                s.setdefault(k, torch.zeros_like(flat, dtype=torch.float32))
            s.setdefault("step", 0 if isinstance(opt, _cpu_adam_type()) else torch.tensor(0.0))
        _link_adam_states(engine)
    for name, p in _trainable(engine):
        safe_set_full_fp32_param(p, state["master"][name].to(p.device))
        for k in ADAM_KEYS:
            if k in state:
                safe_set_full_optimizer_state(p, state[k][name].to(p.device), k)
    for s in _adam_states(engine):
        if "step" in s:
            s["step"] = state["step"] if isinstance(s["step"], int) else torch.tensor(float(state["step"]))
    for group, lr in zip(opt.param_groups, state["lr"]):
        group["lr"] = lr


def _cpu_adam_type() -> type:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam


def full_state_dict(engine, rank: int, only: set[str] | None = None) -> dict[str, torch.Tensor] | None:
    """The model's weights (its own dtype) on CPU on rank 0 (None elsewhere; every rank must
    call): under ZeRO-3 each parameter is gathered in turn, never the whole model at once.
    `only`: these keys alone (the trained parameters)."""
    gathered = require_deepspeed().zero.GatheredParameters
    full = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if only is not None and key not in only:
            continue
        if hasattr(value, "ds_id"):  # a ZeRO-3 partitioned parameter
            with gathered([value]):
                if rank == 0:
                    full[key] = value.detach().to("cpu", copy=True)
        elif rank == 0:
            full[key] = value.detach().to("cpu", copy=True)  # never a view of the live weights
    return full if rank == 0 else None


class DeepSpeedOptimizerState:
    """Stands for the optimizer where the loop reads or writes its state: checkpoints (the
    consolidated state), resume, and a reference reset's clearing (`state`: the base optimizer's
    per-partition state; Adam re-creates it at its next step)."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def state(self) -> dict:
        return self.engine.basic_optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return consolidated_optimizer_state(self.engine, dist.get_rank())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_consolidated_optimizer_state(self.engine, state)


def load_trained_weights(engine, weights: dict[str, torch.Tensor], rank: int) -> None:
    """Set every trained parameter of `engine` from `weights` (by name; every rank, each with
    the whole dict): the model's copy in its own dtype (ZeRO-3: gathered, written on rank 0 and
    partitioned again) and the optimizer's float32 master weight."""
    from deepspeed.utils import safe_set_full_fp32_param

    gathered = require_deepspeed().zero.GatheredParameters
    trained = _trainable(engine)
    missing = sorted({name for name, _ in trained} - weights.keys())
    if missing:
        raise KeyError(f"the state to load lacks trained parameters {missing[:5]}")
    with torch.no_grad():
        for name, p in trained:
            value = weights[name]
            if hasattr(p, "ds_id"):  # ZeRO-3: partitioned
                with gathered([p], modifier_rank=0):
                    if rank == 0:
                        p.data.copy_(value.to(device=p.device, dtype=p.dtype))
            else:
                p.data.copy_(value.to(device=p.device, dtype=p.dtype))
            safe_set_full_fp32_param(p, value.to(device=p.device, dtype=torch.float32))


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """DeepSpeed's weight and compute dtype: bfloat16 (its bf16 mode, float32 master weights in
    the optimizer) or float32."""
    dtype = resolve_dtype(cfg.model.dtype, device)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"trainer.strategy=deepspeed computes in float32 or bfloat16, not {dtype}")
    return dtype


# ---------------------------------------------------------------------------------------------
# One process of a training group
# ---------------------------------------------------------------------------------------------


class DeepSpeedLearner(GroupLearner):
    """One process of a DeepSpeed ZeRO training group: `GroupLearner`'s rows, loss shares and
    update (`update_policy` with `DeepSpeedSteps`), DeepSpeed's engine in place of FSDP2."""

    averages_gradients = True

    def _shard(self, policy: Policy, dtype: torch.dtype) -> None:
        if dtype != torch.float32:
            raise ValueError(f"trainer.strategy=deepspeed keeps float32 master weights; got dtype {dtype}")
        cfg, device = self.cfg, self.device
        os.environ.setdefault("LOCAL_RANK", str(device.index or 0))  # DeepSpeed's device index
        compute = compute_dtype(cfg, device)
        bf16 = compute == torch.bfloat16
        model = policy.model.train()
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        reference = None
        if cfg.algo.kl_coef > 0 and is_lora(model):
            reference = "adapters_disabled"  # the base model, through the engine: nothing to copy
        elif cfg.algo.kl_coef > 0:
            frozen = copy.deepcopy(model).eval().requires_grad_(False)
            if cfg.trainer.zero_stage == 3:  # partitioned like the policy
                reference = EngineModule(reference_engine(cfg, frozen, self.world_size, bf16, device))
            else:  # ZeRO-2 keeps whole parameters on every process: so does the reference
                reference = frozen.to(device=device, dtype=compute)
        self.engine = initialize_engine(cfg, model, self.world_size, bf16, device)
        self.model = EngineModule(self.engine)
        self.reference = reference
        self.precision = Precision(device, compute, compute)  # DeepSpeed casts; no autocast
        t = cfg.trainer
        log.info("training group: DeepSpeed ZeRO-%d on %s, compute %s%s%s", t.zero_stage, device, compute,
                 ", optimizer offloaded" if t.zero_offload_optimizer else "",
                 ", parameters offloaded" if t.zero_offload_params else "")  # fmt: skip
        self.policy = Policy(self.model, policy.processor, policy.blocked.to(device),
                             policy.stop_token_ids, policy.pad_token_id, self.precision)  # fmt: skip
        self.optimizer = DeepSpeedSteps(self.engine)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.engine.basic_optimizer, lr_lambda(cfg))

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        return full_state_dict(self.engine, self.rank, self.trainable_names() if trainable_only else None)

    def trainable_names(self) -> set[str]:
        return {name for name, _ in _trainable(self.engine)}

    def save_sharded(self, folder: str) -> None:
        raise NotImplementedError("a DeepSpeed group's optimizer state is gathered into trainer_state.pt")

    load_sharded = start_sharded_save = save_sharded

    def optimizer_state_dict(self) -> dict | None:
        return consolidated_optimizer_state(self.engine, self.rank)

    def load_state(self, weights: dict[str, torch.Tensor], optimizer: dict | None, steps: int) -> None:
        load_trained_weights(self.engine, weights, self.rank)
        if optimizer is not None:  # its master weights are the checkpoint's float32 ones
            load_consolidated_optimizer_state(self.engine, optimizer)
        self._set_schedule(steps)

    def close(self, end_group: bool = True) -> None:
        self.engine.destroy()  # its hooks on the model (and DeepSpeed's collectives in them)
        if isinstance(self.reference, EngineModule):
            self.reference.engine.destroy()
        super().close(end_group)


# ---------------------------------------------------------------------------------------------
# The local backend: the loop's trainee, updated by a one-process engine
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DeepSpeedTrainee(Trainee):
    """The local trainee whose update runs through a one-process DeepSpeed engine. The rollout
    engine, checkpoints and the final save read the same module (ZeRO-2 keeps it whole)."""

    ds_engine: Any = None

    def _through_engine(self) -> Policy:
        return dataclasses.replace(self.policy, model=EngineModule(self.ds_engine))

    def old_and_ref_logprobs(self, cfg: Config, batch: RolloutBatch):
        return old_and_ref_logprobs(cfg, self._through_engine(), self.reference, batch)

    def update_policy(self, cfg, batch, advantages, old_logprobs, ref_logprobs, weights,
                      before_minibatch=None) -> dict[str, float]:  # fmt: skip
        return update_policy(
            cfg, self._through_engine(), DeepSpeedSteps(self.ds_engine), batch, advantages,
            old_logprobs, ref_logprobs, weights, before_minibatch,
        )  # fmt: skip

    def close(self) -> None:
        try:
            super().close()
        finally:
            # The one-process group stays for the process's lifetime: DeepSpeed keeps its own
            # handles to it, which a later engine (a resumed run in the same process) reuses.
            self.ds_engine.destroy()


def make_deepspeed_trainee(cfg: Config, policy: Policy, run_dir: Path | None = None) -> DeepSpeedTrainee:
    """The local trainee (`make_trainee`: placement, reference, rollout engine, router, model
    rewards), its optimizer and update handed to a one-process DeepSpeed engine over the same
    module. (`make_trainee`'s AdamW is dropped before it ever steps, so it never holds state.)"""
    t = make_trainee(cfg, policy, run_dir)
    device = policy.device
    try:
        join_process_group(0, 1, local_rendezvous(), device)
        compute = compute_dtype(cfg, device)
        engine = initialize_engine(cfg, policy.model, 1, compute == torch.bfloat16, device)
    except BaseException:
        t.close()
        raise
    policy.precision = Precision(device, compute, compute)  # DeepSpeed's own bf16 mode; no autocast
    log.info("policy update: DeepSpeed ZeRO-%d in this process, compute %s%s", cfg.trainer.zero_stage,
             compute, ", optimizer state and master weights in host memory" if cfg.trainer.zero_offload_optimizer
             else "")  # fmt: skip
    fields = {f.name: getattr(t, f.name) for f in dataclasses.fields(Trainee) if f.init}
    fields.update(optimizer=DeepSpeedOptimizerState(engine),
                  scheduler=torch.optim.lr_scheduler.LambdaLR(engine.basic_optimizer, lr_lambda(cfg)))  # fmt: skip
    return DeepSpeedTrainee(**fields, ds_engine=engine)


def deepspeed_composition(cfg: Config) -> Composition:
    """`trainer.strategy=deepspeed` on the local backend: the usual step, this trainee."""
    return Composition(make_trainee=make_deepspeed_trainee, step=grpo_step)
