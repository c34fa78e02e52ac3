"""Runs inside each vLLM worker process: the methods mmrl calls there by name.

vLLM builds its worker class with this one mixed in (`LLM(worker_extension_cls=
"mmrl.rollout.vllm_worker.WeightSyncExtension")`), and `LLM.collective_rpc(name, args=...)` calls
the method on every worker (each tensor-parallel rank). This is the separate-engine weight sync
(`rollout.vllm_weight_sync=nccl`), as vLLM's RLHF example (`examples/offline_inference/
rlhf_utils.py`), veRL and OpenRLHF do it:

    mmrl_init_weight_group   join a NCCL group with the trainer's process (rank 0), once
    mmrl_receive_weights     for each name, dtype and shape in the message, receive the tensor
                             by a NCCL broadcast from rank 0, then load them into the model
    mmrl_device_uuid         this worker's GPU (the trainer's must be another: NCCL cannot
                             connect two ranks on one device)

No tensor ever goes through `collective_rpc`: vLLM V1's engine core decodes RPC arguments with
an untyped msgpack decoder, so a tensor would arrive as a `[dtype, shape, buffer]` list. The
messages hold only str, int, float, bool, None, lists and dicts (`mmrl.rollout.vllm.plain`
checks every one before it is sent; tests/test_vllm_engine.py round-trips them through msgpack
as vLLM does). The in-process engine (`rollout.vllm_weight_sync=inprocess`) needs none of this:
mmrl loads the weights straight into its model.

This module must stay importable without vLLM and without mmrl's heavier modules: the worker
imports it while vLLM builds its worker class.
"""

from __future__ import annotations

from typing import Any

import torch

EXTENSION = "mmrl.rollout.vllm_worker.WeightSyncExtension"
"""The qualified name passed as vLLM's `worker_extension_cls`."""


class WeightSyncExtension:
    """Mixed into vLLM's worker class (which provides `model_runner`, `device` and `rank`)."""

    model_runner: Any
    device: Any
    rank: int

    def mmrl_init_weight_group(self, spec: dict) -> int:
        """Join the weight-sync group: `spec` = {host, port, world_size, rank_offset}; this
        worker is rank `rank_offset` + its own rank (the trainer's process is rank 0). Returns
        that rank."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        rank = int(spec["rank_offset"]) + int(getattr(self, "rank", 0))
        group = StatelessProcessGroup.create(
            host=spec["host"], port=int(spec["port"]), rank=rank, world_size=int(spec["world_size"])
        )
        self._mmrl_group = PyNcclCommunicator(group, device=self.device)
        return rank

    def mmrl_receive_weights(self, meta: dict) -> int:
        """Receive the tensors `meta` names ({names, dtypes, shapes}: lists, in the order rank 0
        broadcasts them) and load them into this worker's model, whose `load_weights` maps the
        Hugging Face names, fuses projections and takes this rank's shard. Returns how many."""
        weights = []
        for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"]):
            tensor = torch.empty(list(shape), dtype=getattr(torch, dtype), device=self.device)
            self._mmrl_group.broadcast(tensor, src=0, stream=_stream(self.device))
            weights.append((name, tensor))
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)

    def mmrl_device_uuid(self) -> str:
        """This worker's GPU, as a string (compared with the sending process's)."""
        return device_uuid(self.device)


def device_uuid(device: Any) -> str:
    """A GPU's UUID as a string ('' off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def _stream(device: Any):
    device = torch.device(device)
    return torch.cuda.current_stream(device) if device.type == "cuda" else None
