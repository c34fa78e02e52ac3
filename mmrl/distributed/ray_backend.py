"""`trainer.backend=ray`: the roles of a run as Ray actors, composed into the same loop.

    driver (this process)   the loop of `mmrl.train.grpo.train` and `grpo_step`, unchanged; it
                            keeps a copy of the weights for checkpoints and the final save
    rollout workers         `trainer.rollout_workers` actors, each with its own engine
                            (`rollout.engine`: HF generate or vLLM) and copy of the weights; a
                            batch's prompts are split between them
    reward worker           one actor holding the verifier router (its worker processes, time
                            limits and error policy); responses are scored as each rollout
                            worker's share arrives
    training group          `trainer.train_workers` actors, one `GroupLearner` each (FSDP2,
                            data parallel, `mmrl.distributed.training_group`; DeepSpeed ZeRO
                            with `trainer.strategy=deepspeed`, `mmrl.distributed.deepspeed_group`)

All of them live in one placement group (`trainer.ray_cpus_per_actor`,
`trainer.ray_gpus_per_actor` each). The pieces plug into the same `Trainee` as the local backend:
the rollout workers are its `engine` (`RolloutPool`), the reward worker its `router`
(`RayRouter`), the training group its learner (`RayTrainee.old_and_ref_logprobs` /
`update_policy`); after each update the group's weights go to every rollout worker (one object
in Ray's store) and to the driver's copy. Metrics and the run directory are the local backend's.

Failures: a call to a dead rollout worker or training process raises an error naming the actor;
a dead reward worker is replaced (its batch scored again by the new one) and the replacement
logged, at most `MAX_REWARD_RESTARTS` times a run. `close()` stops every actor and the placement
group (and Ray, when this run started it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import torch

from mmrl.config import Config
from mmrl.distributed.training_group import merge_metrics
from mmrl.models.adapters import param_groups
from mmrl.models.loading import Policy
from mmrl.rollout.hf import SamplingParams, concat_rollouts
from mmrl.router import RewardBatch
from mmrl.train.grpo import Composition, Trainee, grpo_step, lr_lambda, make_router
from mmrl.types import RolloutBatch, Sample, VerifyContext

log = logging.getLogger(__name__)

MAX_REWARD_RESTARTS = 3
"""A run replaces a dead reward worker at most this many times, then stops with an error."""
READY_TIMEOUT_S = 300.0
"""How long the placement group and the actors' start may take before the run stops."""


def _ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the distributed extra is not installed
        raise ImportError("trainer.backend=ray needs Ray: pip install 'mmrl[distributed]'") from exc
    return ray


def _light(sample: Sample) -> Sample:
    """Verifiers never need the pixels: send samples to the reward worker without them."""
    return dataclasses.replace(sample, images=[])


# ---------------------------------------------------------------------------------------------
# The actors (plain classes; `ray.remote` is applied when they are started)
# ---------------------------------------------------------------------------------------------


class RolloutWorker:
    """A rollout engine with its own copy of the policy."""

    def __init__(self, cfg: Config, model_path: str, seed: int, threads: int):
        from mmrl.models.loading import load_inference_policy
        from mmrl.train.async_grpo import make_rollout_engine

        if threads > 0:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        # On the actor's own device (Ray exposes its GPU as cuda:0), in the compute dtype.
        policy = load_inference_policy(model_path, cfg.trainer.device, cfg.model.dtype, cfg.model.revision)
        self.engine = make_rollout_engine(cfg, policy)

    def generate(self, samples: list[Sample], params: SamplingParams) -> RolloutBatch:
        return self.engine.generate(samples, params)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        model = getattr(self.engine, "model", None)
        if isinstance(model, torch.nn.Module):  # HF: every key must match, nothing silently kept
            missing = model.state_dict().keys() - state_dict.keys()
            unexpected = state_dict.keys() - model.state_dict().keys()
            if missing or unexpected:
                raise KeyError(f"weights do not fit the rollout model: missing {sorted(missing)[:5]}, "
                               f"unexpected {sorted(unexpected)[:5]}")  # fmt: skip
        self.engine.load_weights(state_dict)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def pid(self) -> int:
        return os.getpid()


class RewardWorker:
    """The verifier router (or a reward-server client) in its own actor."""

    def __init__(self, cfg: Config, threads: int):
        if threads > 0:
            torch.set_num_threads(threads)
        self.router = make_router(cfg)
        self.pending: dict[str, Any] = {}

    def warm_up(self) -> float:
        return self.router.warm_up()

    def start(self, key: str, context: VerifyContext, n_rows: int) -> None:
        self.pending[key] = self.router.start(context, n_rows)

    def add(self, key: str, row: int, sample: Sample, text: str) -> None:
        self.pending[key].add(row, sample, text)

    def result(self, key: str, samples: list[Sample], texts: list[str]) -> RewardBatch:
        return self.pending.pop(key).result(samples, texts)

    def score(self, samples: list[Sample], texts: list[str], context: VerifyContext) -> RewardBatch:
        return self.router.score(samples, texts, context)

    def close(self) -> None:
        self.router.close()

    def pid(self) -> int:
        return os.getpid()


class TrainWorker:
    """One process of the training group (a `GroupLearner` once `setup` has run)."""

    def __init__(self, threads: int):
        if threads > 0:
            torch.set_num_threads(threads)
        self.learner = None

    def address(self) -> str:
        """A rendezvous address on this node (rank 0's)."""
        ray = _ray()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, cfg: Config, model_path: str, rank: int, world_size: int, init_method: str) -> None:
        from mmrl.distributed.training_group import learner_class

        self.learner = learner_class(cfg)(cfg, model_path, rank, world_size, init_method)

    def call(self, method: str, *args):
        return getattr(self.learner, method)(*args)

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()


# ---------------------------------------------------------------------------------------------
# Driver-side views of the actors, with the interfaces the loop already uses
# ---------------------------------------------------------------------------------------------


def _get(ray, refs: list, names: list[str]) -> list:
    """`ray.get` each ref; a dead or failing actor raises an error naming it."""
    out = []
    for ref, name in zip(refs, names):
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"{name} died: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            raise RuntimeError(f"{name} failed: {exc}") from exc
    return out


class RolloutPool:
    """The rollout engine interface over the rollout workers: the prompts of a batch are split
    into contiguous parts, one per worker; rows keep the prompt-major order ([B x G])."""

    def __init__(self, ray, workers: list, names: list[str], pad_token_id: int):
        self.ray, self.workers, self.names, self.pad_token_id = ray, workers, names, pad_token_id

    def generate(self, samples: list[Sample], params: SamplingParams, on_response=None) -> RolloutBatch:
        """`on_response(row, text)` is called for each row of a worker's part as soon as that
        worker returns it (scoring starts while the other workers still generate)."""
        k = len(self.workers)
        bounds = [round(i * len(samples) / k) for i in range(k + 1)]
        parts = [(i, bounds[i], bounds[i + 1]) for i in range(k) if bounds[i + 1] > bounds[i]]
        refs = {self.workers[i].generate.remote(samples[a:b], params): (i, a) for i, a, b in parts}
        chunks: dict[int, RolloutBatch] = {}
        waiting = list(refs)
        while waiting:
            ready, waiting = self.ray.wait(waiting, num_returns=1)
            i, first = refs[ready[0]]
            (chunk,) = _get(self.ray, ready, [self.names[i]])
            chunks[first] = chunk
            if on_response is not None:
                for row, text in enumerate(chunk.texts):
                    on_response(first * params.n + row, text)
        ordered = [chunks[a] for a in sorted(chunks)]
        batch = ordered[0] if len(ordered) == 1 else concat_rollouts(ordered, self.pad_token_id)
        batch.group_size = params.n
        return batch

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        ref = self.ray.put(state_dict)  # one copy in the object store, read by every worker
        _get(self.ray, [w.load_weights.remote(ref) for w in self.workers], self.names)

    def sleep(self) -> None:
        _get(self.ray, [w.sleep.remote() for w in self.workers], self.names)

    def wake(self) -> None:
        _get(self.ray, [w.wake.remote() for w in self.workers], self.names)


class RayPending:
    """One batch being scored by the reward worker (the `PendingRewards` interface)."""

    def __init__(self, router: RayRouter, context: VerifyContext, n_rows: int):
        self.router, self.context = router, context
        self.actor, self.key = router.actor, uuid.uuid4().hex
        self.actor.start.remote(self.key, context, n_rows)

    def add(self, row: int, sample: Sample, text: str) -> None:
        self.actor.add.remote(self.key, row, _light(sample), text)

    def result(self, samples: list[Sample], texts: list[str]) -> RewardBatch:
        ray = self.router.ray
        try:
            return ray.get(self.actor.result.remote(self.key, [_light(s) for s in samples], texts))
        except ray.exceptions.RayActorError as exc:
            self.router.replace(self.actor, exc)
            return self.router.score(samples, texts, self.context)


class RayRouter:
    """The router interface over the reward worker; a dead worker is replaced and its batch
    scored again (logged with the worker's name)."""

    def __init__(self, ray, start_worker, time_limit_s: float):
        self.ray, self.start_worker, self.time_limit_s = ray, start_worker, time_limit_s
        self.generation = 0
        self.replacements = 0
        self.actor = start_worker(self.name)

    @property
    def name(self) -> str:
        return f"reward worker mmrl-reward-{self.generation}"

    def start(self, context: VerifyContext, n_rows: int) -> RayPending:
        return RayPending(self, context, n_rows)

    def score(self, samples: list[Sample], texts: list[str], context: VerifyContext) -> RewardBatch:
        light = [_light(s) for s in samples]
        for _ in range(MAX_REWARD_RESTARTS + 1):
            actor = self.actor
            try:
                return self.ray.get(actor.score.remote(light, texts, context))
            except self.ray.exceptions.RayActorError as exc:
                self.replace(actor, exc)
        raise AssertionError("unreachable: replace() raises past MAX_REWARD_RESTARTS")

    def replace(self, dead, exc: Exception) -> None:
        """Start a new reward worker in place of `dead` (once, however many calls saw it die)."""
        if dead is not self.actor:
            return  # already replaced
        if self.replacements >= MAX_REWARD_RESTARTS:
            raise RuntimeError(f"{self.name} died ({exc}); {self.replacements} replacements already") from exc
        log.warning("%s died (%s); starting a replacement and scoring its batch again", self.name, exc)
        with contextlib.suppress(Exception):
            self.ray.kill(dead, no_restart=True)
        self.replacements += 1
        self.generation += 1
        self.actor = self.start_worker(self.name)
        _get(self.ray, [self.actor.warm_up.remote()], [self.name])

    def warm_up(self) -> float:
        return _get(self.ray, [self.actor.warm_up.remote()], [self.name])[0]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ray.get(self.actor.close.remote(), timeout=30)


class RayTrainingGroup:
    """The training group's actors, called together (they meet in collectives)."""

    def __init__(self, ray, workers: list, names: list[str]):
        self.ray, self.workers, self.names = ray, workers, names

    def call(self, method: str, *args) -> list:
        refs = [self.ray.put(a) if isinstance(a, RolloutBatch) else a for a in args]
        return _get(self.ray, [w.call.remote(method, *refs) for w in self.workers], self.names)

    def old_and_ref_logprobs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts = self.call("old_and_ref_logprobs", batch)
        N, R = batch.response_ids.shape
        old = torch.zeros(N, R, dtype=parts[0][1].dtype)
        ref = None if parts[0][2] is None else torch.zeros(N, R, dtype=parts[0][2].dtype)
        for rows, part_old, part_ref in parts:
            old[rows] = part_old
            if ref is not None:
                ref[rows] = part_ref
        return old, ref

    def update(self, batch, advantages, old_logprobs, ref_logprobs, weights) -> dict[str, float]:
        return merge_metrics(self.call("update", batch, advantages, old_logprobs, ref_logprobs, weights))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.call("full_state_dict")[0]

    def optimizer_state_dict(self) -> dict:
        return self.call("optimizer_state_dict")[0]


class GroupOptimizerState:
    """Stands for the optimizer in checkpoints: its state is the training group's (gathered)."""

    def __init__(self, group: RayTrainingGroup):
        self.group = group

    def state_dict(self) -> dict:
        return self.group.optimizer_state_dict()

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("resuming a trainer.backend=ray run is not supported yet")


# ---------------------------------------------------------------------------------------------
# The composition
# ---------------------------------------------------------------------------------------------


class ScheduleMirror:
    """The training group's learning-rate schedule as the driver sees it (`actor/lr`,
    checkpoints): the same lambda over the same parameter groups, stepped in lockstep."""

    def __init__(self, base_lrs: list[float], factor):
        self.base_lrs, self.factor, self.last_epoch = base_lrs, factor, 0

    def get_last_lr(self) -> list[float]:
        return [lr * self.factor(self.last_epoch) for lr in self.base_lrs]

    def step(self) -> None:
        self.last_epoch += 1

    def state_dict(self) -> dict:
        return {"base_lrs": self.base_lrs, "last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch = state["last_epoch"]


@dataclasses.dataclass
class RayTrainee(Trainee):
    """The local trainee's interface over the actors; `policy` is the driver's copy."""

    group: RayTrainingGroup | None = None
    cluster: RayCluster | None = None
    updates_while_scoring = False  # the group's update runs in other processes, in one call

    def old_and_ref_logprobs(self, cfg: Config, batch: RolloutBatch):
        return self.group.old_and_ref_logprobs(batch)

    def update_policy(
        self, cfg, batch, advantages, old_logprobs, ref_logprobs, weights, before_minibatch=None
    ) -> dict[str, float]:
        """The group's update, then the new weights to every rollout worker and the driver."""
        if before_minibatch is not None:  # `updates_while_scoring` is False: never passed one
            raise ValueError("the Ray training group updates the whole batch in one call")
        metrics = self.group.update(batch, advantages, old_logprobs, ref_logprobs, weights)
        state = self.group.full_state_dict()
        self.engine.load_weights(state)
        self.policy.model.load_state_dict(state, strict=True)
        return metrics

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown(self.router)


class RayCluster:
    """The placement group and every actor of a run; `shutdown` removes them all."""

    def __init__(self, cfg: Config):
        ray = self.ray = _ray()
        self.started_ray = False
        if not ray.is_initialized():
            ray.init(address=cfg.trainer.ray_address, include_dashboard=False, logging_level=logging.WARNING)
            self.started_ray = True
        tr = cfg.trainer
        cpus, gpus = tr.ray_cpus_per_actor, tr.ray_gpus_per_actor
        self.threads = max(1, int(cpus))
        self.n_gpu_roles = tr.rollout_workers + tr.train_workers
        bundles = [{"CPU": cpus, **({"GPU": gpus} if gpus else {})} for _ in range(self.n_gpu_roles)]
        bundles.append({"CPU": cpus})  # the reward worker
        from ray.util.placement_group import placement_group

        self.pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the Ray cluster cannot place {len(bundles)} actors of {cpus} CPU / {gpus} GPU each "
                f"(it has {ray.cluster_resources()}): lower trainer.ray_cpus_per_actor or the worker counts"
            ) from None
        self.actors: list = []
        self.env = {"PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(self.threads)}  # fmt: skip
        for name in ("MMRL_CACHE", "TORCH_EXTENSIONS_DIR"):  # built-in bases; DeepSpeed's compiled ops
            if os.environ.get(name):
                self.env[name] = os.environ[name]

    def start(self, cls, bundle: int, gpu: bool, *args):
        """Start an actor of `cls` in bundle `bundle` of the placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = self.ray.remote(cls).options(
            num_cpus=self.pg.bundle_specs[bundle]["CPU"],
            num_gpus=self.pg.bundle_specs[bundle].get("GPU", 0) if gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=bundle
            ),
            runtime_env={"env_vars": self.env},
            max_restarts=0,
        )
        actor = remote.remote(*args)
        self.actors.append(actor)
        return actor

    def shutdown(self, router: RayRouter | None = None) -> None:
        ray = self.ray
        if router is not None:
            router.close()
            self.actors.append(router.actor)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(self.pg)
        if self.started_ray:
            ray.shutdown()


def ray_composition(cfg: Config) -> Composition:
    return Composition(make_trainee=make_ray_trainee, step=grpo_step)


def make_ray_trainee(cfg: Config, policy: Policy, run_dir: Path | None = None) -> RayTrainee:
    """Start the actors and wire them into a trainee; `policy` (loaded from its folder) stays
    on the driver as the copy that checkpoints and the final save read."""
    model_path = str(policy.model.name_or_path)
    if not (Path(model_path) / "config.json").exists():
        raise ValueError(
            f"the Ray backend starts every actor from the policy's folder; {model_path!r} is not one"
        )
    tr = cfg.trainer
    cluster = RayCluster(cfg)
    ray = cluster.ray
    try:
        rollout_names = [f"rollout worker mmrl-rollout-{k}" for k in range(tr.rollout_workers)]
        rollout = [cluster.start(RolloutWorker, k, True, cfg, model_path, tr.seed + 1 + k, cluster.threads)
                   for k in range(tr.rollout_workers)]  # fmt: skip
        train_names = [f"training process mmrl-train-{r}" for r in range(tr.train_workers)]
        train = [cluster.start(TrainWorker, tr.rollout_workers + r, True, cluster.threads)
                 for r in range(tr.train_workers)]  # fmt: skip
        (address,) = _get(ray, [train[0].address.remote()], train_names[:1])
        _get(ray, [w.setup.remote(cfg, model_path, r, tr.train_workers, address) for r, w in enumerate(train)],
             train_names)  # fmt: skip
        _get(ray, [w.pid.remote() for w in rollout], rollout_names)  # started
        reward_bundle = cluster.n_gpu_roles
        router = RayRouter(ray, lambda name: cluster.start(RewardWorker, reward_bundle, False, cfg, cluster.threads),
                           cfg.reward.time_limit_s)  # fmt: skip
    except BaseException:
        cluster.shutdown()
        raise
    policy.model.train()
    group = RayTrainingGroup(ray, train, train_names)
    return RayTrainee(
        policy=policy,
        reference=None,
        engine=RolloutPool(ray, rollout, rollout_names, policy.pad_token_id),
        router=router,
        optimizer=GroupOptimizerState(group),
        scheduler=ScheduleMirror([g["lr"] for g in param_groups(policy.model, cfg)], lr_lambda(cfg)),
        run_dir=run_dir,
        group=group,
        cluster=cluster,
    )
