"""`trainer.backend=ray`: the roles of a run as Ray actors, composed into the same loop.

    driver (this process)   the loop of `mmrl.train.grpo.train` and `grpo_step`, unchanged; it
                            keeps a copy of the weights for checkpoints and the final save
    rollout workers         `trainer.rollout_workers` actors, each with its own engine
                            (`rollout.engine`: HF generate or vLLM) and copy of the weights; a
                            batch's prompts are split between them
    reward workers          `trainer.reward_workers` actors, each holding a verifier router (its
                            worker processes, time limits and error policy) and the run's model
                            rewards, placed across nodes (their own SPREAD placement group);
                            each response goes to the one with the fewest responses waiting, as
                            each rollout worker's share arrives; a batch's model rewards are
                            split evenly over them (`RayModelRewards`)
    training group          `trainer.train_workers` actors, one `GroupLearner` each (FSDP2,
                            data parallel, `mmrl.distributed.training_group`; DeepSpeed ZeRO
                            with `trainer.strategy=deepspeed`, `mmrl.distributed.deepspeed_group`)

The rollout workers and the training group live in one placement group, the reward workers in a
second one spread over the nodes (`trainer.ray_cpus_per_actor` each; `trainer.ray_gpus_per_actor`
for rollout and training actors, `trainer.ray_reward_gpus` for reward workers, whose model
rewards score there and go to host memory around each update by the local placement rules).
The pieces plug into the same `Trainee` as the local backend: the rollout workers are its
`engine` (`RolloutPool`), the reward workers its `router` (`RayRouter`) and model rewards, the
training group its learner (`RayTrainee.old_and_ref_logprobs` / `update_policy`); after each
update the group's weights go to the driver's copy and from it to every rollout worker (one
object in Ray's store). Metrics and the run directory are the local backend's. The actors'
classes live in light modules (`mmrl.distributed.actors`, `mmrl.distributed.reward_worker`): Ray
imports an actor's module to start it, and their constructors import the heavy libraries with
the garbage collector paused (`mmrl.heap`).

LoRA: the group trains the adapters (the KL reference is the base with them disabled); the
driver's copy has the same adapters (checkpoints save them, the final save merges them); the
rollout workers get the adapters alone (`trainer.lora_sync=adapters`: their engine runs them
unmerged) or the model with them merged in (`merged`). Measured in `benchmarks/lora_sync.py`.

Resume: a checkpoint holds the driver's copy (the trained weights), the group's optimizer state
gathered by parameter name, the schedule and the rollout workers' random generators
(`RayTrainee.checkpoint_state`); `RayTrainee.restore` sends them back to the processes of a new
group and to the new rollout workers, so a resumed run continues bit for bit (tested after
SIGKILL at three points, `tests/test_distributed_ray_cluster.py`).

Failures: a call to a dead rollout worker or training process raises an error naming the actor;
a dead reward worker is replaced (its share of the batch scored again) and the replacement
logged, at most `MAX_REWARD_RESTARTS` times a run. `close()` stops every actor and the placement
group (and Ray, when this run started it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmrl.config import Config
from mmrl.distributed.actors import RolloutWorker, TrainWorker, lora_sync, ray_module
from mmrl.distributed.reward_worker import RewardWorker
from mmrl.distributed.training_group import merge_metrics
from mmrl.distributed.weight_channel import ChannelEnd, Layout, free_address, layout_of
from mmrl.models.adapters import apply_lora, is_lora, merged_state_dict, param_groups
from mmrl.models.loading import Policy
from mmrl.rollout.hf import SamplingParams, concat_rollouts
from mmrl.router import RewardBatch
from mmrl.train.async_grpo import Streaming, async_grpo_step, make_stream, scoring_generator
from mmrl.train.grpo import Composition, Trainee, grpo_step, lr_lambda
from mmrl.types import RolloutBatch, Sample, VerifierResult, VerifyContext

log = logging.getLogger(__name__)

MAX_REWARD_RESTARTS = 3
"""A run replaces dead reward workers at most this many times in all, then stops with an error."""
SAVE_POLL_S = 0.5
"""How often the driver asks the training processes whether a background save is written."""
READY_TIMEOUT_S = 300.0
"""How long the placement group and the actors' start may take before the run stops."""


def _light(sample: Sample) -> Sample:
    """Verifiers never need the pixels: send samples to the reward worker without them."""
    return dataclasses.replace(sample, images=[])


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

    runs_trajectories = True
    """Each worker runs the multi-turn loop itself, its tools on its own side
    (`RolloutWorker.generate`): a batch comes back with its trajectories whole."""

    def __init__(
        self,
        ray,
        workers: list,
        names: list[str],
        pad_token_id: int,
        channel: ChannelEnd | None = None,
        ranks: list[int] | None = None,
    ):
        self.ray, self.workers, self.names, self.pad_token_id = ray, workers, names, pad_token_id
        self.channel = channel
        """The weight channel (None: weights go through Ray's object store, a unit test's pool)."""
        self.ranks = ranks if ranks is not None else [1 + k for k in range(len(workers))]
        self._facts: list[dict[str, float]] = []  # each worker's engine facts of the last `generate`

    def part(self, k: int) -> RolloutPool:
        """A pool of worker `k` alone (an asynchronous generator's), on the same channel."""
        return RolloutPool(self.ray, [self.workers[k]], [self.names[k]], self.pad_token_id, self.channel,
                           [self.ranks[k]])  # fmt: skip

    def generate(self, samples: list[Sample], params: SamplingParams, on_response=None) -> RolloutBatch:
        """`on_response(row, text)` is called for each row of a worker's part as soon as that
        worker returns it (scoring starts while the other workers still generate)."""
        k = len(self.workers)
        bounds = [round(i * len(samples) / k) for i in range(k + 1)]
        parts = [(i, bounds[i], bounds[i + 1]) for i in range(k) if bounds[i + 1] > bounds[i]]
        refs = {self.workers[i].generate.remote(samples[a:b], params): (i, a) for i, a, b in parts}
        self._facts = []
        chunks: dict[int, RolloutBatch] = {}
        waiting = list(refs)
        while waiting:
            ready, waiting = self.ray.wait(waiting, num_returns=1)
            i, first = refs[ready[0]]
            ((chunk, facts),) = _get(self.ray, ready, [self.names[i]])
            chunks[first] = chunk
            self._facts.append(facts)
            if on_response is not None:
                for row, text in enumerate(chunk.texts):
                    on_response(first * params.n + row, text)
        ordered = [chunks[a] for a in sorted(chunks)]
        batch = ordered[0] if len(ordered) == 1 else concat_rollouts(ordered, self.pad_token_id)
        batch.group_size = params.n
        return batch

    def load_weights(self, state_dict: dict[str, torch.Tensor], adapters: bool = False) -> None:
        """The weights to every worker over the weight channel (each receives while the next is
        sent to); without a channel, through Ray's object store."""
        if self.channel is None:
            ref = self.ray.put(state_dict)
            _get(self.ray, [w.load_weights.remote(ref, adapters) for w in self.workers], self.names)
            return
        layout = layout_of(state_dict)
        refs = [w.receive_weights.remote(layout, adapters) for w in self.workers]
        for k, rank in enumerate(self.ranks):
            try:
                self.channel.send(state_dict, rank, layout)
            except Exception as exc:
                for later in self.ranks[k + 1 :]:  # they wait for a status: release them
                    with contextlib.suppress(Exception):
                        self.channel.fail(later, repr(exc))
                _get(self.ray, refs[: k + 1], self.names[: k + 1])  # a dead worker is named here
                raise RuntimeError(f"sending the weights to {self.names[k]} failed: {exc}") from exc
        _get(self.ray, refs, self.names)

    def rollout_metrics(self) -> dict[str, float]:
        """The local engine's rollout facts over the workers of the last `generate`: whether LoRA
        was merged or decoding captured (every worker: the minimum), compactions summed, the
        decode step time and live cache as the workers' mean."""
        out: dict[str, float] = {}
        for key in set().union(*self._facts):
            values = [f[key] for f in self._facts if key in f]
            if key == "rollout/compactions":
                out[key] = float(sum(values))
            elif key in ("rollout/lora_merged", "rollout/decode_captured"):
                out[key] = float(min(values))
            else:
                out[key] = sum(values) / len(values)
        return out

    def rng_states(self) -> list[dict[str, Any]]:
        return _get(self.ray, [w.rng_state.remote() for w in self.workers], self.names)

    def seed_workers(self, base: int) -> None:
        """Seed worker k's generators with `base + k` (a resume that has no state for them)."""
        _get(self.ray, [w.seed.remote(base + k) for k, w in enumerate(self.workers)], self.names)

    def set_rng_states(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self.workers):
            raise ValueError(f"the checkpoint holds {len(states)} rollout workers' generators, the run has "
                             f"{len(self.workers)} (trainer.rollout_workers changed)")  # fmt: skip
        _get(self.ray, [w.set_rng_state.remote(st) for w, st in zip(self.workers, states)], self.names)

    def sleep(self) -> None:
        _get(self.ray, [w.sleep.remote() for w in self.workers], self.names)

    def wake(self) -> None:
        _get(self.ray, [w.wake.remote() for w in self.workers], self.names)


class RayPending:
    """One batch being scored by the reward workers (the `PendingRewards` interface): each row
    goes to the worker with the fewest rows waiting when it is added."""

    def __init__(self, router: RayRouter, context: VerifyContext, n_rows: int):
        self.router, self.context, self.n_rows = router, context, n_rows
        self.key = uuid.uuid4().hex
        self.started: dict[int, Any] = {}  # slot -> the actor the batch was started on
        self.slot_of: dict[int, int] = {}  # row -> slot

    def _actor(self, slot: int):
        actor = self.router.actors[slot]
        if self.started.get(slot) is not actor:  # first row there, or a replacement since
            actor.start.remote(self.key, self.context, self.n_rows)
            self.started[slot] = actor
        return actor

    def add(self, row: int, sample: Sample, text: str) -> None:
        slot = self.slot_of.get(row)
        if slot is None:
            slot = self.slot_of[row] = self.router.take_slot()
        self._actor(slot).add.remote(self.key, row, _light(sample), text)

    def wait(self, rows, samples: list[Sample], texts: list[str]) -> list[VerifierResult]:
        """The results of `rows` (`samples`, `texts`: the whole batch's); rows never added are
        sent now. A worker that died is replaced and its rows scored again."""
        ray = self.router.ray
        rows = list(rows)
        by_slot: dict[int, list[int]] = {}
        for row in rows:
            if row not in self.slot_of:
                self.slot_of[row] = self.router.take_slot()
            by_slot.setdefault(self.slot_of[row], []).append(row)
        refs = {}
        for slot, mine in by_slot.items():
            part_samples: list[Sample | None] = [None] * self.n_rows
            part_texts: list[str | None] = [None] * self.n_rows
            for row in mine:
                part_samples[row], part_texts[row] = _light(samples[row]), texts[row]
            actor = self._actor(slot)
            refs[slot] = (actor, actor.wait.remote(self.key, mine, part_samples, part_texts))
        out: dict[int, VerifierResult] = {}
        for slot, (actor, ref) in refs.items():
            mine = by_slot[slot]
            try:
                results = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self.router.replace(slot, actor, exc)
                results = self.router.score([samples[r] for r in mine], [texts[r] for r in mine],
                                            self.context).results  # fmt: skip
            self.router.done(slot, len(mine))
            out.update(zip(mine, results))
        return [out[row] for row in rows]

    def result(self, samples: list[Sample], texts: list[str]) -> RewardBatch:
        if len(samples) != len(texts) or len(texts) != self.n_rows:
            raise ValueError(f"{len(samples)} samples, {len(texts)} responses, {self.n_rows} rows")
        try:
            return RewardBatch.gather(samples, self.wait(range(self.n_rows), samples, texts))
        finally:
            for actor in self.started.values():
                with contextlib.suppress(Exception):
                    actor.release.remote(self.key)


class RayRouter:
    """The router interface over the reward workers (`n_workers` slots; `start_worker(name,
    slot)` starts one): rows are spread by load; a dead worker is replaced and its rows scored
    again (logged with the worker's name)."""

    def __init__(self, ray, start_worker, time_limit_s: float, n_workers: int = 1):
        if n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        self.ray, self.start_worker, self.time_limit_s = ray, start_worker, time_limit_s
        self.replacements = 0
        self._started = 0
        self.names: list[str] = []
        self.actors: list = []
        for slot in range(n_workers):
            self.names.append(self._next_name())
            self.actors.append(start_worker(self.names[slot], slot))
        self.waiting = [0] * n_workers  # rows sent to each slot and not collected yet
        self._lock = threading.Lock()

    def _next_name(self) -> str:
        name = f"reward worker mmrl-reward-{self._started}"
        self._started += 1
        return name

    @property
    def actor(self):
        """The first reward worker (the only one with `trainer.reward_workers=1`)."""
        return self.actors[0]

    @property
    def name(self) -> str:
        return self.names[0]

    def take_slot(self) -> int:
        """The slot with the fewest rows waiting (the row is counted there)."""
        with self._lock:
            slot = min(range(len(self.actors)), key=lambda k: self.waiting[k])
            self.waiting[slot] += 1
            return slot

    def done(self, slot: int, rows: int) -> None:
        with self._lock:
            self.waiting[slot] = max(0, self.waiting[slot] - rows)

    def start(self, context: VerifyContext, n_rows: int) -> RayPending:
        return RayPending(self, context, n_rows)

    def score(self, samples: list[Sample], texts: list[str], context: VerifyContext) -> RewardBatch:
        """Score a whole batch, split evenly over the workers (errors are logged by them)."""
        k = len(self.actors)
        bounds = [round(i * len(samples) / k) for i in range(k + 1)]
        parts = {
            slot: (bounds[slot], bounds[slot + 1]) for slot in range(k) if bounds[slot + 1] > bounds[slot]
        }
        light = [_light(s) for s in samples]
        refs = {slot: (self.actors[slot], self.actors[slot].score.remote(light[a:b], texts[a:b], context))
                for slot, (a, b) in parts.items()}  # fmt: skip
        results: list[VerifierResult] = []
        for slot, (a, b) in parts.items():
            actor, ref = refs[slot]
            for _ in range(MAX_REWARD_RESTARTS + 1):
                try:
                    results.extend(self.ray.get(ref))
                    break
                except self.ray.exceptions.RayActorError as exc:
                    self.replace(slot, actor, exc)
                    actor = self.actors[slot]
                    ref = actor.score.remote(light[a:b], texts[a:b], context)
        return RewardBatch.of(results, samples)

    def replace(self, slot: int, dead, exc: Exception) -> None:
        """Start a new reward worker in slot `slot` in place of `dead` (once, however many calls
        saw it die)."""
        if dead is not self.actors[slot]:
            return  # already replaced
        name = self.names[slot]
        if self.replacements >= MAX_REWARD_RESTARTS:
            raise RuntimeError(f"{name} died ({exc}); {self.replacements} replacements already") from exc
        log.warning("%s died (%s); starting a replacement and scoring its rows again", name, exc)
        with contextlib.suppress(Exception):
            self.ray.kill(dead, no_restart=True)
        self.replacements += 1
        self.names[slot] = self._next_name()
        self.actors[slot] = self.start_worker(self.names[slot], slot)
        _get(self.ray, [self.actors[slot].warm_up.remote()], [self.names[slot]])

    def warm_up(self) -> float:
        return max(_get(self.ray, [a.warm_up.remote() for a in self.actors], self.names))

    def scored(self) -> list[int]:
        """Rows each reward worker returned results for (since it started)."""
        return _get(self.ray, [a.scored.remote() for a in self.actors], self.names)

    def close(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.get(actor.close.remote(), timeout=30)


class RayModelRewards:
    """The model rewards (`reward.model_rewards`) in the reward workers, with the interface of a
    local `RewardPlacement` the step uses: a batch's rows are split evenly over the workers
    (each holds the models, placed on its own device by the local rules); around each update
    every worker moves its offloaded models to host memory."""

    def __init__(self, router: RayRouter):
        self.router = router

    def score_rows(
        self, samples: list[Sample], texts: list[str], failures: dict[int, tuple[str, str]]
    ) -> list[dict[str, float]]:
        actors, names = self.router.actors, self.router.names
        k = len(actors)
        bounds = [round(i * len(samples) / k) for i in range(k + 1)]
        parts = [(i, bounds[i], bounds[i + 1]) for i in range(k) if bounds[i + 1] > bounds[i]]
        refs = [actors[i].score_models.remote(samples[a:b], texts[a:b]) for i, a, b in parts]
        results = _get(self.router.ray, refs, [names[i] for i, _, _ in parts])
        rows: list[dict[str, float]] = []
        for (_, first, _), (part_rows, part_failures) in zip(parts, results):
            rows.extend(part_rows)
            failures.update({first + r: f for r, f in part_failures.items()})
        return rows

    @contextlib.contextmanager
    def training(self):
        _get(self.router.ray, [a.before_update.remote() for a in self.router.actors], self.router.names)
        yield

    def metrics(self) -> dict[str, float]:
        """The first reward worker's placement (every worker places the same models alike)."""
        return _get(self.router.ray, [self.router.actor.placement_metrics.remote()], [self.router.name])[0]


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

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        return self.call("full_state_dict", trainable_only)[0]

    def receive_state(
        self, channel: ChannelEnd, layout: Layout, trainable_only: bool
    ) -> dict[str, torch.Tensor]:
        """The policy's weights, gathered by every process and sent by rank 0 over the weight
        channel (`layout`: what the driver's copy holds, in its dtypes)."""
        refs = [w.send_state.remote(layout, trainable_only, 0) for w in self.workers]
        state = channel.recv(layout, channel.world - 1)
        _get(self.ray, refs, self.names)  # (a failure the sender reported is raised here)
        if state is None:
            raise RuntimeError("the training group sent no weights")
        return state

    def optimizer_state_dict(self) -> dict:
        return self.call("optimizer_state_dict")[0]

    def save_sharded(self, folder: Path) -> None:
        """Every process writes its own shards into `folder` (a path all of them can reach)."""
        self.call("save_sharded", str(folder))

    def start_sharded_save(self, folder: Path) -> Callable[[], None]:
        """`save_sharded` in the background: returns once every process has copied its shards;
        the returned function waits until all of them are written (polling, so the processes
        go on taking the loop's calls meanwhile)."""
        self.call("start_sharded_save", str(folder))

        def written() -> None:
            while not all(self.call("sharded_save_done")):
                time.sleep(SAVE_POLL_S)

        return written

    def load_sharded(self, folder: Path, steps: int) -> None:
        """Every process reads its own shards of `folder`, whatever number of processes wrote it."""
        self.call("load_sharded", str(folder), steps)

    def load_state(self, weights: dict[str, torch.Tensor], optimizer: dict | None, steps: int) -> None:
        """Every process: the trained weights, the optimizer state, the schedule's position."""
        weights, optimizer = self.ray.put(weights), self.ray.put(optimizer)  # one copy for all
        self.call("load_state", weights, optimizer, steps)


class GroupOptimizerState:
    """Stands for the optimizer in checkpoints: its state is the training group's (gathered).
    A resumed run's state is held here until `RayTrainee.restore` sends it to the group with
    the weights."""

    def __init__(self, group: RayTrainingGroup):
        self.group = group
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        return self.group.optimizer_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


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
    lora_sync: str | None = None
    """With LoRA: `adapters` or `merged` (`trainer.lora_sync`, `auto` resolved); None without."""
    fsdp2: bool = True
    """The group shards with FSDP2 (sharded checkpoints); False: DeepSpeed (gathered)."""
    seed: int = 0
    """`trainer.seed`: rollout workers that have no generator state in a checkpoint are seeded
    from it and the step."""
    updates_while_scoring = False  # the group's update runs in other processes, in one call
    _resume_from: Path | None = None  # a sharded checkpoint the group reads in `restore`

    @property
    def shards_state(self) -> bool:
        return self.fsdp2

    def save_sharded(self, folder: Path, background: bool = False) -> Callable[[], None] | None:
        """Each training process writes its own shards; the driver's copy is not involved."""
        if background:
            return self.group.start_sharded_save(folder)
        self.group.save_sharded(folder)
        return None

    def load_sharded(self, folder: Path) -> None:
        """Read in `restore`, with the schedule's position (every process reads its own shards)."""
        if not self.fsdp2:
            super().load_sharded(folder)  # the refusal naming what cannot read it
        self._resume_from = folder

    def old_and_ref_logprobs(self, cfg: Config, batch: RolloutBatch):
        return self.group.old_and_ref_logprobs(batch)

    def update_policy(
        self, cfg, batch, advantages, old_logprobs, ref_logprobs, weights, before_minibatch=None
    ) -> dict[str, float]:
        """The group's update, then the new weights to the driver and every rollout worker."""
        if before_minibatch is not None:  # `updates_while_scoring` is False: never passed one
            raise ValueError("the Ray training group updates the whole batch in one call")
        metrics = self.group.update(batch, advantages, old_logprobs, ref_logprobs, weights)
        self.take_new_weights()
        return metrics

    def take_new_weights(self) -> None:
        """After an update: the group's weights to the driver's copy and every rollout worker."""
        self.pull_weights()
        self.push_weights()

    def pull_weights(self) -> None:
        """The group's weights into the driver's copy (LoRA: every adapter weight, nothing else),
        over the weight channel. The layout asked for is the driver's own: the group's rank 0
        refuses to send names or shapes that differ from it (`ChannelEnd.send`), saying which."""
        lora = is_lora(self.policy.model)
        own = self.policy.model.state_dict()
        wanted = {k: v for k, v in own.items() if ".lora_" in k} if lora else own
        state = self.group.receive_state(self.engine.channel, layout_of(wanted), lora)
        self.policy.model.load_state_dict(state, strict=not lora)

    def push_weights(self, pool: RolloutPool | None = None) -> None:
        """The driver's weights to every rollout worker (of `pool`; default all): the whole model,
        or with LoRA the adapters (`trainer.lora_sync=adapters`) or the model with them merged in
        (`merged`)."""
        model = self.policy.model
        engine = self.engine if pool is None else pool
        if not is_lora(model):
            engine.load_weights(model.state_dict())
        elif self.lora_sync == "adapters":
            engine.load_weights({k: v for k, v in model.state_dict().items() if ".lora_" in k}, adapters=True)
        else:
            engine.load_weights(merged_state_dict(model))

    def checkpoint_state(self) -> dict[str, Any]:
        """The rollout workers' generators (each samples with its own)."""
        return {"rollout_rng": self.engine.rng_states()}

    def restore(self, state: dict[str, Any]) -> None:
        """A resumed run: the group reads the checkpoint's trained weights and optimizer state
        (sharded: each process its own shards, on any number of processes; DeepSpeed: the
        driver's copy of the weights and the gathered optimizer state, sent to every process) and
        the schedule's position; the rollout workers get the weights and their generators."""
        steps = int(state["scheduler"]["last_epoch"])
        if self._resume_from is not None:
            self.group.load_sharded(self._resume_from, steps)
            self._resume_from = None
        else:
            weights = {n: p.detach() for n, p in self.policy.model.named_parameters() if p.requires_grad}
            self.group.load_state(weights, self.optimizer.loaded, steps)
            self.optimizer.loaded = None
        self.push_weights()
        saved = state.get("rollout_rng")  # None: written by the single-process trainer
        if saved is not None and len(saved) == len(self.engine.workers):
            self.engine.set_rng_states(saved)
        else:
            what = "none" if saved is None else f"{len(saved)} rollout workers'"
            log.warning(
                "the checkpoint holds %s sampling generators and the run has %d rollout workers: they are "
                "seeded from trainer.seed and the step (the run goes on, not bit for bit as it would have)",
                what, len(self.engine.workers),
            )  # fmt: skip
            self.engine.seed_workers(self.seed + 1 + 1000 * (steps + 1))

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown(self.router)


@dataclasses.dataclass
class RayAsyncTrainee(Streaming, RayTrainee):
    """`trainer.mode=async` on Ray, fully asynchronous: one generator thread per rollout worker
    (`mmrl.train.async_grpo.GroupStream`), each having its worker generate and the reward
    workers score groups into the queue, on its own schedule, while the training group updates on
    the groups that have completed, at most `trainer.max_staleness` versions behind.

    Weights: after each update the group's weights go to the driver's copy (under `_lock`, the
    version counted with them); before each call a generator sends the driver's copy to its own
    worker if it is newer than the worker's (under the same lock: never a copy half way through
    an update), and that call's tokens are labelled with the version it sent. A call runs on one
    version throughout (partial rollouts need the engine in the driver: `trainer.backend=local`)."""

    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def take_new_weights(self) -> None:
        """After an update: the group's weights into the driver's copy, counted as a version; the
        rollout workers get them from their generators, between calls (`send_newest`)."""
        with self._lock:
            self.pull_weights()
            self.version += 1

    def evaluation_engine(self) -> RolloutPool:
        """The rollout workers, sent the current weights first (they may hold an older version
        while the generators run ahead; a call a generator then starts is labelled no newer than
        the weights it runs on)."""
        self.send_newest()
        return self.engine

    def published_weights(self) -> None:
        """Nothing travels with `publish`: the driver's copy is the newest, read by `send_newest`."""
        return None

    def send_newest(self, pool: RolloutPool | None = None) -> int:
        """The driver's copy to the workers of `pool` (default all); returns its version."""
        with self._lock:
            self.push_weights(pool)
            return self.version


def make_ray_async_trainee(cfg: Config, policy: Policy, run_dir: Path | None = None) -> RayAsyncTrainee:
    """`make_ray_trainee`, and a generator thread per rollout worker (its own pool of one) that
    shares the reward workers and the router."""
    t = make_ray_trainee(cfg, policy, run_dir)
    a = RayAsyncTrainee(**{f.name: getattr(t, f.name) for f in dataclasses.fields(RayTrainee) if f.init})
    pool = t.engine
    generators = []
    for k in range(len(pool.workers)):
        own = pool.part(k)
        generating = Trainee(**{f.name: getattr(t, f.name) for f in dataclasses.fields(Trainee) if f.init})
        generating.engine = own
        generators.append(scoring_generator(cfg, generating, lambda _weights, own=own: a.send_newest(own)))
    a.stream = make_stream(cfg, generators)
    return a


class RayCluster:
    """The placement group and every actor of a run; `shutdown` removes them all."""

    def __init__(self, cfg: Config):
        ray = self.ray = ray_module()
        self.started_ray = False
        self.reaper: subprocess.Popen | None = None
        if not ray.is_initialized():
            if cfg.trainer.ray_address in (None, "", "local"):  # Ray's processes are this driver's children
                self.reaper = start_reaper()
            ray.init(address=cfg.trainer.ray_address, include_dashboard=False, logging_level=logging.WARNING)
            self.started_ray = True
        tr = cfg.trainer
        cpus, gpus = tr.ray_cpus_per_actor, tr.ray_gpus_per_actor
        self.threads = max(1, int(cpus))
        self.n_gpu_roles = tr.rollout_workers + tr.train_workers
        bundles = [{"CPU": cpus, **({"GPU": gpus} if gpus else {})} for _ in range(self.n_gpu_roles)]
        from ray.util.placement_group import placement_group

        self.pg = placement_group(bundles, strategy="PACK")
        # The reward workers: CPU only, spread over the nodes so verifier throughput grows with them.
        reward_gpus = {"GPU": tr.ray_reward_gpus} if tr.ray_reward_gpus else {}
        self.reward_pg = placement_group([{"CPU": cpus, **reward_gpus} for _ in range(tr.reward_workers)],
                                         strategy="SPREAD")  # fmt: skip
        for pg, n, what in ((self.pg, len(bundles), f"{cpus} CPU / {gpus} GPU"),
                            (self.reward_pg, tr.reward_workers,
                             f"{cpus} CPU / {tr.ray_reward_gpus} GPU (reward workers)")):  # fmt: skip
            try:
                ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                self._remove_groups()
                raise RuntimeError(
                    f"the Ray cluster cannot place {n} actors of {what} each (it has "
                    f"{ray.cluster_resources()}): lower trainer.ray_cpus_per_actor or the worker counts"
                ) from None
        self.actors: list = []
        self.env = {"PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(self.threads)}  # fmt: skip
        # built-in bases; DeepSpeed's compiled ops; where plugin modules (verifiers, reward models) are
        for name in ("MMRL_CACHE", "TORCH_EXTENSIONS_DIR", "PYTHONPATH"):
            if os.environ.get(name):
                self.env[name] = os.environ[name]

    def start(self, cls, bundle: int, gpu: bool, *args, pg=None):
        """Start an actor of `cls` in bundle `bundle` of the placement group (`pg`: another one,
        the reward workers')."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = self.pg if pg is None else pg
        remote = self.ray.remote(cls).options(
            num_cpus=pg.bundle_specs[bundle]["CPU"],
            num_gpus=pg.bundle_specs[bundle].get("GPU", 0) if gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle
            ),
            runtime_env={"env_vars": self.env},
            max_restarts=0,
        )
        actor = remote.remote(*args)
        self.actors.append(actor)
        return actor

    def start_reward_worker(self, cfg: Config, slot: int):
        """A `RewardWorker` in bundle `slot` of the reward workers' placement group (with its GPU
        share, `trainer.ray_reward_gpus`, for the model rewards)."""
        return self.start(RewardWorker, slot, True, cfg, self.threads, pg=self.reward_pg)

    def shutdown(self, router: RayRouter | None = None) -> None:
        ray = self.ray
        if router is not None:
            router.close()
            self.actors.extend(router.actors)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._remove_groups()
        if self.started_ray:
            ray.shutdown()
        if self.reaper is not None:  # a clean end: it exits without touching anything
            with contextlib.suppress(OSError):
                self.reaper.stdin.write(b"done\n")
            self.reaper.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.reaper.wait(timeout=15)

    def _remove_groups(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in (self.pg, self.reward_pg):
            with contextlib.suppress(Exception):
                remove_placement_group(pg)


def start_reaper() -> subprocess.Popen | None:
    """`mmrl.distributed.reaper` watching this process (its own session; its standard input a pipe
    from here, which closes when this process exits or is killed). None without psutil."""
    try:
        import psutil  # noqa: F401 - the reaper's only dependency
    except ImportError:
        log.warning("psutil is not installed: Ray processes of a killed driver are not cleaned up")
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "mmrl.distributed.reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )


def ray_composition(cfg: Config) -> Composition:
    if cfg.trainer.mode == "async":
        return Composition(make_trainee=make_ray_async_trainee, step=async_grpo_step)
    return Composition(make_trainee=make_ray_trainee, step=grpo_step)


def open_channel(ray, rollout: list, rollout_names: list[str], trainer, trainer_name: str) -> ChannelEnd:
    """The run's weight channel: the driver (rank 0, here), rollout worker k (1 + k) and the
    training group's rank 0 (the last), all joining at once."""
    world = len(rollout) + 2
    address = free_address()
    refs = [w.join_channel.remote(address, 1 + k, world) for k, w in enumerate(rollout)]
    refs.append(trainer.join_channel.remote(address, world - 1, world))
    ends: list = []
    joining = threading.Thread(target=lambda: ends.append(ChannelEnd(address, 0, world)), daemon=True)
    joining.start()
    _get(ray, refs, [*rollout_names, trainer_name])  # (an actor that fails to join is named here)
    joining.join()
    if not ends:
        raise RuntimeError(f"the weight channel at {address} did not form")
    return ends[0]


def make_ray_trainee(cfg: Config, policy: Policy, run_dir: Path | None = None) -> RayTrainee:
    """Start the actors and wire them into a trainee; `policy` (loaded from its folder) stays
    on the driver as the copy that checkpoints and the final save read."""
    model_path = str(policy.model.name_or_path)
    if cfg.model.lora_rank > 0:  # the driver's copy saves the adapters (checkpoints) and the merged final
        policy.model = apply_lora(policy.model, cfg)
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
        channel = open_channel(ray, rollout, rollout_names, train[0], train_names[0])
        router = RayRouter(ray, lambda name, slot: cluster.start_reward_worker(cfg, slot),
                           cfg.reward.time_limit_s, n_workers=tr.reward_workers)  # fmt: skip
    except BaseException:
        cluster.shutdown()
        raise
    policy.model.train()
    group = RayTrainingGroup(ray, train, train_names)
    t = RayTrainee(
        policy=policy,
        reference=None,
        engine=RolloutPool(ray, rollout, rollout_names, policy.pad_token_id, channel),
        router=router,
        optimizer=GroupOptimizerState(group),
        scheduler=ScheduleMirror([g["lr"] for g in param_groups(policy.model, cfg)], lr_lambda(cfg)),
        run_dir=run_dir,
        reward_models=RayModelRewards(router) if cfg.reward.model_rewards.models else None,
        group=group,
        cluster=cluster,
        lora_sync=lora_sync(cfg),
        fsdp2=tr.strategy == "fsdp2",
        seed=tr.seed,
    )
    try:
        if cfg.model.lora_rank > 0:  # the group drew the adapters: the driver and the workers take them
            t.pull_weights()
            t.push_weights()
        log_placement(ray, {**dict(zip(rollout_names, rollout)), **dict(zip(train_names, train)),
                            **dict(zip(router.names, router.actors))})  # fmt: skip
    except BaseException:
        t.close()
        raise
    return t


def log_placement(ray, actors: dict[str, Any]) -> dict[str, str]:
    """Log (and return) the node each actor runs on."""
    nodes = dict(zip(actors, _get(ray, [a.node.remote() for a in actors.values()], list(actors))))
    log.info("placement: %s", ", ".join(f"{name} on node {node[:12]}" for name, node in nodes.items()))
    return nodes
