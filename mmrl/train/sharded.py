"""The trained weights and the optimizer state as a sharded checkpoint (torch's distributed
checkpoint, DCP), readable on any number of processes.

A checkpoint's `sharded/` folder (`SHARDED`) holds one file per process that wrote it
(`__<rank>_0.distcp`) and DCP's `.metadata`: each process writes only its own shard of every
trained parameter and of its optimizer state, keyed by parameter name
(`torch.distributed.checkpoint.state_dict.get_state_dict`), so no process gathers the whole
optimizer state. Reading (`load_sharded`), each process reads the parts of the files that its own
shards cover, whatever the number of processes that wrote them: a checkpoint of a 2-process FSDP2
group resumes in 1 process or in 4, and one of the single-process trainer (a plain module, no
process group) in a group, and back.

Frozen parameters are not written (`ignore_frozen_params`): they are the base model's, read from
its folder as at the start (with LoRA, only the adapters are trained and written).

Used by the single-process trainer (`mmrl.train.grpo.Trainee.save_sharded`) and by each process
of an FSDP2 training group (`mmrl.distributed.training_group.GroupLearner.save_sharded`).
DeepSpeed groups keep their own optimizer layout (gathered by name into `trainer_state.pt`).
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

SHARDED = "sharded"
"""The folder of a checkpoint that holds the sharded training state."""
KEY = "train"
"""The top-level key of the state in DCP's files (`train.model.*`, `train.optimizer.*`)."""
_OPTIONS = StateDictOptions(ignore_frozen_params=True)


class TrainingState(Stateful):
    """A model and its optimizer as one DCP state: `{"model": ..., "optimizer": ...}`, each keyed
    by parameter name (the same names with or without FSDP2, in any number of processes)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # strict=False: the frozen parameters are not in the state (they were never written)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )


def _single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError (a full disk, a read-only folder) inside DCP's `CheckpointException`, which
    wraps each rank's failure; None if there is none (or `exc` is not one)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, OSError):
                return inner
    return None


@contextlib.contextmanager
def _storage_error_unwrapped():
    """A storage failure while DCP writes is raised as the OSError it is (so `storage_errors`
    names the path and the cause), not as DCP's wrapper."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        inner = os_error_of(exc)
        if inner is None or inner is exc:
            raise
        raise inner from exc


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save and load that it assumes one process, even when
    told so (`no_dist=True`): that is what mmrl asked for, so the warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path) -> None:
    """Write this process's shard of the trained weights and optimizer state into `folder`. In a
    process group every process calls it (they agree on the plan in collectives); rank 0 writes
    the metadata."""
    with _quiet_single_process(), _storage_error_unwrapped():
        dcp.save({KEY: TrainingState(model, optimizer)}, checkpoint_id=str(folder), no_dist=_single_process())


def start_save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: str | Path,
    process_group: dist.ProcessGroup | None = None,
) -> Future:
    """`save_sharded` in the background (`dcp.async_save`): this process's shards are copied
    here (DCP's staging: the copy is what gets written, so training may change the weights at
    once), then written by a thread; the returned future completes when they are on disk (and
    raises the write's error). In a process group, pass a gloo group of its own
    (`process_group`): the writer's collectives then never interleave with training's."""
    with _quiet_single_process():
        return dcp.async_save(
            {KEY: TrainingState(model, optimizer)},
            checkpoint_id=str(folder),
            process_group=process_group,
            no_dist=_single_process(),
        )


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path) -> None:
    """Read the trained weights and optimizer state from `folder` into `model` and `optimizer`
    (this process's shards only), whatever the number of processes that wrote it. A trained
    parameter missing from the checkpoint is an error naming it."""
    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder}: not a sharded checkpoint (no .metadata)")
    try:
        with _quiet_single_process():
            dcp.load(
                {KEY: TrainingState(model, optimizer)}, checkpoint_id=str(folder), no_dist=_single_process()
            )
    except Exception as exc:  # DCP wraps each rank's error; name the folder and what it read into
        raise RuntimeError(f"cannot read the sharded training state in {folder}: {exc}") from exc


def read_sharded(folder: str | Path) -> dict[str, Any]:
    """The whole sharded state of `folder` in this process, as plain tensors by name
    (`{"model": {name: tensor}, "optimizer": {"state": {name: {...}}, "param_groups": [...]}}`):
    for inspection and tests; a training process reads its shards with `load_sharded`."""

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder), f"{tmp}/state.pt")
        return torch.load(f"{tmp}/state.pt", weights_only=False)[KEY]
