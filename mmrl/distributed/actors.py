"""The Ray backend's rollout and training actors (`mmrl.distributed.ray_backend` composes them).

A light module of their own: Ray starts an actor by importing its class's module, and the
actor then imports torch, transformers and the trainer in its constructor with the garbage
collector paused (`mmrl.heap.imports_without_gc`), as `mmrl train` does: for those imports,
`benchmarks/startup_gc.py` measured 0.8 of 3.5 CPU-seconds spent in the collector without the
pause (the actors' own start was not timed apart). Plain classes: `ray.remote` is applied when
they are started (`RayCluster.start`).
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

from mmrl.heap import imports_without_gc

if TYPE_CHECKING:
    import torch

    from mmrl.config import Config
    from mmrl.rollout.hf import SamplingParams
    from mmrl.types import RolloutBatch, Sample


def ray_module():
    """`ray`, or an error saying how to install it."""
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the distributed extra is not installed
        raise ImportError("trainer.backend=ray needs Ray: pip install 'mmrl[distributed]'") from exc
    return ray


def lora_sync(cfg: Config) -> str | None:
    """What the rollout workers receive with LoRA (`trainer.lora_sync`, `auto` resolved); None
    without LoRA."""
    if cfg.model.lora_rank == 0:
        return None
    if cfg.trainer.lora_sync != "auto":
        return cfg.trainer.lora_sync
    return "adapters" if cfg.rollout.engine == "hf" else "merged"


def host_memory(reset_peak: bool = False) -> dict[str, int]:
    """The calling process's resident set (`rss`) and its high-water mark (`peak`), in bytes,
    from `/proc/self/status`; `reset_peak`: start the mark over first (`/proc/self/clear_refs`)."""
    from pathlib import Path

    if reset_peak:
        Path("/proc/self/clear_refs").write_text("5")
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024  # kB
    return {"rss": fields["VmRSS"], "peak": fields["VmHWM"]}


class RolloutWorker:
    """A rollout engine with its own copy of the policy."""

    def __init__(self, cfg: Config, model_path: str, seed: int, threads: int):
        with imports_without_gc():
            import torch

            from mmrl.models.loading import load_inference_policy
            from mmrl.train.async_grpo import make_rollout_engine
            from mmrl.train.grpo import seed_everything

        if threads > 0:
            torch.set_num_threads(threads)
        seed_everything(seed)  # every generator it has, so its checkpointed state is the run's own
        # On the actor's own device (Ray exposes its GPU as cuda:0), in the compute dtype.
        policy = load_inference_policy(model_path, cfg.trainer.device, cfg.model.dtype, cfg.model.revision)
        if lora_sync(cfg) == "adapters":  # the same adapters as the policy's, run unmerged
            from mmrl.models.adapters import apply_lora

            policy.model = apply_lora(policy.model, cfg)
        self.engine = make_rollout_engine(cfg, policy)
        self.agent = cfg.agent
        from mmrl.verifier_pool import import_plugins

        import_plugins(cfg.agent.plugins)  # the run's own tools and call formats, here too

    def generate(
        self, samples: list[Sample], params: SamplingParams
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """The rollouts, and the engine's facts about them (`HFRolloutEngine.rollout_metrics`:
        decode form, LoRA merged, decode step time) in the same reply. Samples that name
        tools run the multi-turn loop here, their tools on this worker."""
        from mmrl.rollout.multiturn import generate_trajectories

        batch = generate_trajectories(self.engine, samples, params, self.agent)
        facts = getattr(self.engine, "rollout_metrics", None)
        return batch, facts() if callable(facts) else {}

    def load_weights(self, state_dict: dict[str, torch.Tensor], adapters: bool = False) -> None:
        """The policy's new weights: all of them, or (`adapters`) every LoRA adapter weight."""
        import torch

        model = getattr(self.engine, "model", None)
        if isinstance(model, torch.nn.Module):  # HF: every key must match, nothing silently kept
            own = model.state_dict().keys()
            expected = {k for k in own if ".lora_" in k} if adapters else own
            missing, unexpected = expected - state_dict.keys(), state_dict.keys() - expected
            if missing or unexpected:
                raise KeyError(f"weights do not fit the rollout model: missing {sorted(missing)[:5]}, "
                               f"unexpected {sorted(unexpected)[:5]}")  # fmt: skip
        self.engine.load_weights(state_dict)

    def join_channel(self, address: str, rank: int, world: int) -> None:
        """Join the run's weight channel (`mmrl.distributed.weight_channel`) as `rank`."""
        from mmrl.distributed.weight_channel import ChannelEnd

        self.channel = ChannelEnd(address, rank, world)

    def receive_weights(self, layout: Any, adapters: bool = False) -> None:
        """New weights from the driver over the weight channel (`layout` says what comes)."""
        state_dict = self.channel.recv(layout, 0)
        if state_dict is None:
            raise RuntimeError("the driver reported a failure instead of sending the weights")
        self.load_weights(state_dict, adapters)

    def rng_state(self) -> dict[str, Any]:
        """The sampling generators' state (a checkpoint's, to resume exactly)."""
        from mmrl.train.checkpoint import rng_state

        return rng_state()

    def seed(self, seed: int) -> None:
        from mmrl.train.grpo import seed_everything

        seed_everything(seed)

    def set_rng_state(self, state: dict[str, Any]) -> None:
        from mmrl.train.checkpoint import set_rng_state

        set_rng_state(state)

    def node(self) -> str:
        return ray_module().get_runtime_context().get_node_id()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def pid(self) -> int:
        return os.getpid()


class TrainWorker:
    """One process of the training group (a `GroupLearner` once `setup` has run)."""

    def __init__(self, threads: int):
        with imports_without_gc():
            import torch

        if threads > 0:
            torch.set_num_threads(threads)
        self.learner = None
        self.channel = None  # the weight channel (rank 0 of the group only)

    def address(self) -> str:
        """A rendezvous address on this node (rank 0's)."""
        ray = ray_module()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, cfg: Config, model_path: str, rank: int, world_size: int, init_method: str) -> None:
        with imports_without_gc():  # the group's learner: transformers, FSDP or DeepSpeed
            from mmrl.distributed.learners import learner_class

            cls = learner_class(cfg)
        self.learner = cls(cfg, model_path, rank, world_size, init_method)

    def call(self, method: str, *args):
        return getattr(self.learner, method)(*args)

    def join_channel(self, address: str, rank: int, world: int) -> None:
        """Join the run's weight channel as `rank` (the group's rank 0 does)."""
        from mmrl.distributed.weight_channel import ChannelEnd

        self.channel = ChannelEnd(address, rank, world)

    def send_state(self, layout: Any, trainable_only: bool, dst: int) -> None:
        """The policy's gathered weights (every process takes part; rank 0, on the channel, sends
        them to rank `dst`); a failure is sent as such, so the receiver stops waiting."""
        try:
            state = self.learner.full_state_dict(trainable_only)
        except BaseException as exc:
            if self.channel is not None:
                self.channel.send(None, dst, layout, error=repr(exc))
            raise
        if self.channel is not None:
            self.channel.send(state, dst, layout)

    def host_memory(self, reset_peak: bool = False) -> dict[str, int]:
        """This process's resident set and its high-water mark, in bytes (Linux `/proc`);
        `reset_peak` starts the mark over from the current resident set first (for measuring
        what one call costs, `benchmarks/checkpoint_scale.py`)."""
        return host_memory(reset_peak)

    def node(self) -> str:
        return ray_module().get_runtime_context().get_node_id()

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()
