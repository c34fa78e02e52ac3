"""Runs inside each vLLM worker process: the methods mmrl calls there by name.

vLLM builds its worker class with this one mixed in (`LLM(worker_extension_cls=
"mmrl.rollout.vllm_worker.WeightSyncExtension")`), and `LLM.collective_rpc("mmrl_load_weights",
args=(weights,))` calls the method on every worker (each tensor-parallel rank). Only the method's
name and its arguments (names and CPU tensors, which vLLM V1 serialises natively) cross the
process boundary; passing a Python function instead would need VLLM_ALLOW_INSECURE_SERIALIZATION=1
(pickled code) on vLLM V1. This is the mechanism of vLLM's own RLHF examples
(`examples/offline_inference/rlhf_utils.py`); veRL and OpenRLHF extend the worker the same way.

This module must stay importable without vLLM and without mmrl's heavier modules: the worker
imports it while vLLM builds its worker class.
"""

from __future__ import annotations

from typing import Any

import torch

EXTENSION = "mmrl.rollout.vllm_worker.WeightSyncExtension"
"""The qualified name passed as vLLM's `worker_extension_cls`."""


class WeightSyncExtension:
    """Mixed into vLLM's worker class (which provides `model_runner`)."""

    model_runner: Any

    def mmrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load `(name, tensor)` pairs (Hugging Face names) into this worker's model; the model's
        own `load_weights` maps the names, fuses projections and takes this rank's shard for
        tensor parallelism. Returns how many tensors it was given."""
        self.model_runner.model.load_weights(weights=[(name, tensor) for name, tensor in weights])
        return len(weights)
