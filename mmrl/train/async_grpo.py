"""Fully asynchronous GRPO: generators fill a bounded queue of scored groups while the trainer
trains on the groups that have completed (`trainer.mode=async`).

The same pieces as the on-policy loop, composed differently:

  generator threads: each with its own engine (here one copy of the policy; on Ray one per
                     rollout worker, `mmrl.distributed.ray_backend`): wait at the staleness gate,
                     draw prompts, load the newest published weights, `generate_and_score`
                     (generation, verifiers; the same function as on-policy), split the result
                     into groups (one prompt's G responses) and put them in the queue
  trainer:           take B groups as they complete (dropping those older than the bound and,
                     with DAPO, those with no learning signal, each counted);
                     `learn_from_rollouts` (steps b-g of `grpo_step`); publish the new weights

Versions: the policy after k updates is version k; step k trains version k - 1. Every token
records the version that sampled it (`RolloutBatch.token_versions`). A group's staleness at step
k is `(k - 1) - v`, v the oldest version among its tokens.

Staleness gate (AReaL's rule, counted in groups): no group starts while more than
`(max_staleness + version + 1) x prompts_per_step` groups have been started and not discarded
(dropped or filtered groups give their place back; without that a dropped group would stall the
run), nor more than the run's `total_steps x prompts_per_step`. Groups are trained in the order
they complete, so with several generators a slow group can be overtaken and fall behind the
bound: it is then dropped and counted (`async/dropped_groups`), never trained on.

Weights reach the generators between their calls. With `trainer.partial_rollout` a call is also
interrupted every `trainer.partial_chunk_tokens` tokens: the newest weights are loaded and the
unfinished responses go on with them (`mmrl.rollout.multiturn.Interrupt`); their tokens then
carry two or more versions, each with its own behaviour log-prob.

Off-policy correction (decoupled PPO, as in AReaL): the old log-probs are recomputed with the
current policy (the proximal policy); the rollout log-probs are the behaviour policy's, per token;
truncated or masked importance sampling (`algo.tis`, required in this mode) re-weights each token
by pi_proximal / pi_behaviour (`mmrl.algos.tis`).

Resume: a checkpoint records the prompts drawn and not yet trained (queued or being generated)
with the sampler's position, taken together; a resumed run generates those prompts first
(`async/reissued_prompts`), so no prompt is lost or trained twice. Not bit-reproducible: the
generators and the trainer draw from torch's random generator in several threads.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmrl.config import Config
from mmrl.models.loading import Policy
from mmrl.models.precision import Precision
from mmrl.rollout.hf import concat_rollouts
from mmrl.rollout.multiturn import Interrupt
from mmrl.router import RewardBatch
from mmrl.train.batching import select_rows
from mmrl.train.data import PromptSampler
from mmrl.train.grpo import (
    Composition,
    Trainee,
    generate_and_score,
    informative_groups,
    learn_from_rollouts,
    make_trainee,
)
from mmrl.types import RolloutBatch, Sample, VerifyContext

Key = tuple[int, int, int]
"""A prompt drawn: `(draw number, sample index, CoT instruction index or -1)` (`PromptSampler.draw`)."""


@dataclass
class Group:
    """One prompt's G scored responses."""

    key: Key
    batch: RolloutBatch
    rewards: RewardBatch
    oldest: int
    """The oldest policy version among its tokens (its staleness is counted from this)."""
    newest: int
    """The newest (differs from `oldest` only for a partial rollout)."""
    metrics: dict[str, float]
    """The metrics of the generator call it came from."""


@dataclass
class Generator:
    """One generator thread's work: `generate(samples, refresh, version) -> (batch, rewards,
    metrics)` with G responses per sample, prompt-major; `refresh()` (for partial rollouts) loads
    the newest weights and returns the version the engine holds, `version` is the one it held at
    the start. `load(weights)` loads published weights into its engine and may return the version
    it really loaded (`weights` None: the newest the trainer has, read under its own lock, on Ray)."""

    generate: Callable[[list[Sample], Callable[[], int], int], tuple[RolloutBatch, RewardBatch, dict]]
    load: Callable[[Any], int | None]


@dataclass
class Taken:
    """What the trainer took for one step."""

    groups: list[Group]
    dropped: list[Key]
    """Groups older than the bound, dropped."""
    filtered: list[Key]
    """Groups with no learning signal, dropped (DAPO dynamic sampling)."""
    informative: int
    """Groups taken that `accept` accepted (0 when the step trains on the fallback)."""
    waited_s: float
    """Time the trainer waited for groups."""
    queued: int
    """Groups that had completed and were waiting when the trainer came."""
    generator_wait_s: float
    """Time the generators waited at the staleness gate since the last step (summed)."""
    in_flight: int
    """Groups started and not yet trained or discarded, after the take."""


class GroupStream:
    """Generator threads fill a queue of scored groups under the staleness gate; the trainer
    takes them (`take`) and publishes new weights (`publish`); see the module's docstring.

    Args:
        generators: one thread each (`Generator`).
        max_staleness: the bound S.
        groups_per_step: B, the groups a step trains.
        total_groups: the most groups the run trains (`total_steps x B`): no group starts beyond.
        call_groups: the most groups a generator takes per call.
    """

    def __init__(
        self,
        generators: list[Generator],
        max_staleness: int,
        groups_per_step: int,
        total_groups: int,
        call_groups: int,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.generators = generators
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.total_groups = total_groups
        self.call_groups = max(1, call_groups)
        self._cond = threading.Condition()
        self._queue: deque[Group] = deque()
        self._published: tuple[int, Any] = (0, None)
        self._engine_version = [-1] * len(generators)
        self._sampler: PromptSampler | None = None
        self._in_flight: dict[Key, None] = {}  # drawn, not yet trained or discarded (draw order)
        self._reissue: list[Key] = []  # a resumed run's in-flight prompts, generated first
        self._started = 0  # groups started (this run's, plus the trained and discarded of a resume)
        self._discarded = 0  # dropped or filtered
        self._trained = 0
        self._totals = {"dropped": 0, "filtered": 0, "reissued": 0}
        self._gate_wait = 0.0
        self._error: BaseException | None = None
        self._stop = False
        self._threads: list[threading.Thread] = []

    @property
    def started(self) -> bool:
        return bool(self._threads)

    def start(self, sampler: PromptSampler, version: int, weights: Any) -> None:
        """Start the generators: prompts from `sampler` (after any re-issued ones), their engines
        loaded with `weights` of `version` (the trainer's current policy)."""
        self._sampler = sampler
        self._published = (version, weights)
        for i, generator in enumerate(self.generators):
            generator.load(weights)
            self._engine_version[i] = version
        for i in range(len(self.generators)):
            thread = threading.Thread(target=self._run, args=(i,), name=f"mmrl-generator-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def publish(self, weights: Any, version: int) -> None:
        """The trainer's weights after `version` updates (must not be changed afterwards)."""
        with self._cond:
            self._published = (version, weights)
            self._cond.notify_all()

    def take(
        self, n: int, version: int, accept: Callable[[Group], bool] | None = None, most: int | None = None
    ) -> Taken:
        """`n` groups to train version `version` on, in the order they completed. A group more
        than `max_staleness` versions older than `version` is dropped; one that `accept` refuses
        is filtered. At most `most` groups within the bound are consumed (default `n`), then the
        step trains on what it has (nothing accepted: the last groups consumed, as the on-policy loop does)."""
        most = n if most is None else most
        kept: list[Group] = []
        fallback: deque[Group] = deque(maxlen=n)
        dropped: list[Key] = []
        filtered: list[Key] = []
        consumed = 0
        waited = 0.0
        with self._cond:
            queued = len(self._queue)
            while len(kept) < n and (consumed < most or not fallback):
                start = time.monotonic()
                while not self._queue:
                    self._check_alive()
                    self._cond.wait(timeout=1.0)
                waited += time.monotonic() - start
                group = self._queue.popleft()
                if version - group.oldest > self.max_staleness:  # (not counted in `most`)
                    dropped.append(group.key)
                    self._discard(group)
                    continue
                consumed += 1
                fallback.append(group)
                if accept is not None and not accept(group):
                    filtered.append(group.key)
                    self._discard(group)
                    continue
                kept.append(group)
            informative = len(kept)
            if not kept:  # nothing with a learning signal: the last groups (advantages 0)
                kept = list(fallback)
                filtered = [key for key in filtered if key not in {g.key for g in kept}]
                self._discarded -= len(kept)
            for group in kept:
                self._in_flight.pop(group.key, None)
            self._trained += len(kept)
            self._totals["dropped"] += len(dropped)
            self._totals["filtered"] += len(filtered)
            gate_wait, self._gate_wait = self._gate_wait, 0.0
            self._cond.notify_all()
            return Taken(
                kept, dropped, filtered, informative, waited, queued, gate_wait, len(self._in_flight)
            )

    def totals(self) -> dict[str, int]:
        """Dropped and filtered groups and re-issued prompts over the run (a resumed run's included)."""
        with self._cond:
            return dict(self._totals)

    def state_dict(self) -> dict[str, Any]:
        """The prompts drawn and not yet trained, with the sampler's position, taken together."""
        with self._cond:
            return {
                "in_flight": [list(key) for key in self._in_flight],
                "sampler": None if self._sampler is None else self._sampler.state_dict(),
                "trained": self._trained,
                "discarded": self._discarded,
                "totals": dict(self._totals),
            }

    def load_state_dict(self, state: dict[str, Any], sampler: PromptSampler) -> None:
        """A resumed run: the checkpoint's in-flight prompts are generated first (counted)."""
        if state.get("sampler") is not None:
            sampler.load_state_dict(state["sampler"])
        keys = [tuple(key) for key in state["in_flight"]]
        self._reissue = keys
        self._in_flight = {}
        self._trained = int(state["trained"])
        self._discarded = int(state["discarded"])
        self._started = self._trained + self._discarded
        self._totals = {**self._totals, **state["totals"]}
        self._totals["reissued"] += len(keys)

    def close(self, timeout_s: float = 600.0) -> None:
        """Stop after the calls in progress and join the threads."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=timeout_s)

    # -- inside (the lock held where it says) ---------------------------------------------------

    def _room(self) -> int:
        """Groups that may start now (the gate; lock held)."""
        version = self._published[0]
        cap = min((self.max_staleness + version + 1) * self.groups_per_step, self.total_groups)
        return cap - (self._started - self._discarded)

    def _discard(self, group: Group) -> None:
        """A dropped or filtered group gives its place at the gate back (lock held)."""
        self._discarded += 1
        self._in_flight.pop(group.key, None)
        self._cond.notify_all()

    def _draw(self, k: int) -> list[Key]:
        keys = self._reissue[:k]
        self._reissue = self._reissue[k:]
        keys += self._sampler.draw(k - len(keys))
        for key in keys:
            self._in_flight[key] = None
        self._started += k
        return keys

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"a rollout generator failed: {self._error!r}") from self._error
        if not any(thread.is_alive() for thread in self._threads):
            raise RuntimeError("no rollout generator is running (the queue will not fill)")

    def _refresh(self, i: int) -> int:
        """Generator `i`'s engine gets the newest published weights if it holds older ones."""
        with self._cond:
            version, weights = self._published
        if version > self._engine_version[i]:
            loaded = self.generators[i].load(weights)
            self._engine_version[i] = version if loaded is None else loaded
        return self._engine_version[i]

    def _run(self, i: int) -> None:
        generator = self.generators[i]
        while True:
            with self._cond:
                start = time.monotonic()
                while not self._stop and self._room() <= 0:
                    self._cond.wait()
                if self._stop:
                    return
                self._gate_wait += time.monotonic() - start
                keys = self._draw(min(self.call_groups, self._room()))
                samples = [self._sampler.sample(key) for key in keys]
            try:
                version = self._refresh(i)
                batch, rewards, metrics = generator.generate(samples, lambda: self._refresh(i), version)
                groups = split_groups(batch, rewards, keys, version, metrics)
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer thread in take()
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._queue.extend(groups)
                self._cond.notify_all()


def split_groups(
    batch: RolloutBatch, rewards: RewardBatch, keys: list[Key], version: int, metrics: dict[str, float]
) -> list[Group]:
    """A generator call's rows as one `Group` per prompt, each token labelled with its version
    (the call's `version` where the engine did not record one)."""
    if batch.token_versions is None:
        batch.token_versions = torch.where(batch.response_mask.bool(), version, -1).long()
    G = len(batch) // len(keys)
    out = []
    for g, key in enumerate(keys):
        rows = list(range(g * G, (g + 1) * G))
        part = select_rows(batch, rows)
        model = part.token_versions[part.response_mask.bool()]
        oldest = int(model.min()) if model.numel() else version
        newest = int(model.max()) if model.numel() else version
        out.append(Group(key, part, rewards.select(rows), oldest, newest, metrics))
    return out


@dataclass
class Streaming:
    """What an asynchronous trainee adds to its base (`Trainee` here, `RayTrainee` on Ray; this
    class comes first among the bases): the stream, the version, and the stream's part of a
    checkpoint (the in-flight prompts with the sampler)."""

    stream: GroupStream | None = None
    """The generators and their queue (started at the first step, after any resume)."""
    version: int = 0
    """The policy version the trainer holds (updates applied; set at the first step)."""
    resumed_stream: dict[str, Any] | None = None
    """A resumed run's stream state, loaded when the stream starts."""

    def checkpoint_state(self) -> dict[str, Any]:
        own = (
            {}
            if self.stream is None or not self.stream.started
            else {"async_stream": self.stream.state_dict()}
        )
        return {**super().checkpoint_state(), **own}

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        self.resumed_stream = state.get("async_stream")

    def close(self) -> None:
        try:
            if self.stream is not None:
                self.stream.close()
        finally:
            super().close()


@dataclass
class AsyncTrainee(Streaming, Trainee):
    """A trainee whose rollouts come from a generator thread with its own engine (`GroupStream`)."""

    def published_weights(self) -> Any:
        """What `stream.publish` hands the generators: a copy of the weights (the trainer goes
        on changing its own)."""
        return policy_weights(self.policy.model)


def async_composition(cfg: Config) -> Composition:
    return Composition(make_trainee=make_async_trainee, step=async_grpo_step)


def call_groups(cfg: Config, generators: int) -> int:
    """Prompts a generator takes per call (`trainer.async_call_prompts`; 0: the step's prompts
    shared among the generators)."""
    if cfg.trainer.async_call_prompts > 0:
        return cfg.trainer.async_call_prompts
    return max(1, -(-cfg.trainer.prompts_per_step // generators))


def make_stream(cfg: Config, generators: list[Generator]) -> GroupStream:
    tr = cfg.trainer
    return GroupStream(
        generators,
        tr.max_staleness,
        tr.prompts_per_step,
        total_groups=tr.total_steps * tr.prompts_per_step,
        call_groups=call_groups(cfg, len(generators)),
    )


def scoring_generator(cfg: Config, generating: Trainee, load: Callable[[Any], int | None]) -> Generator:
    """A generator over `generating`'s engine and router (`generate_and_score`), interrupted for
    partial rollouts when the config asks."""
    total = cfg.trainer.total_steps

    def generate(samples: list[Sample], refresh: Callable[[], int], version: int):
        interrupt = (
            Interrupt(cfg.trainer.partial_chunk_tokens, refresh) if cfg.trainer.partial_rollout else None
        )
        context = VerifyContext(max(0, version), total)
        batch, rewards, waited = generate_and_score(cfg, generating, samples, context, interrupt=interrupt)
        return batch, rewards, {"time/reward_wait_s": waited}

    return Generator(generate, load)


def make_async_trainee(cfg: Config, policy: Policy, run_dir=None) -> AsyncTrainee:
    """The on-policy trainee plus a generator whose engine holds its own copy of the weights."""
    t = make_trainee(cfg, policy, run_dir)
    t = AsyncTrainee(**{f.name: getattr(t, f.name) for f in dataclasses.fields(Trainee)})
    rollout_engine = make_rollout_engine(cfg, t.policy)
    # What the generator works with: the same router and reward models, its own engine.
    generating = Trainee(**{f.name: getattr(t, f.name) for f in dataclasses.fields(Trainee)})
    generating.engine = rollout_engine
    t.stream = make_stream(cfg, [scoring_generator(cfg, generating, rollout_engine.load_weights)])
    return t


def make_rollout_engine(cfg: Config, policy: Policy):
    """An engine with its own copy of the policy's weights (`rollout.engine`)."""
    if cfg.rollout.engine == "vllm":
        from mmrl.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine.from_policy(policy, cfg)
    from mmrl.rollout.hf import HFRolloutEngine

    # Its copy needs no master weights: the compute dtype on the policy's device, as an inference
    # engine holds it (the small rollout/trainer mismatch that leaves is what `algo.tis` corrects).
    p = policy.precision
    model = copy.deepcopy(policy.model).to(device=p.device, dtype=p.compute).eval().requires_grad_(False)
    inference = Precision(p.device, p.compute, p.compute)
    own = Policy(**{**policy.__dict__, "model": model, "precision": inference})
    return HFRolloutEngine.from_policy(own, rollout=cfg.rollout)


def policy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the weights to publish (the trainer goes on changing its own)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def async_grpo_step(
    cfg: Config, t: AsyncTrainee, sampler: PromptSampler, context: VerifyContext, step: int = 0
) -> dict[str, float]:
    """One step on B groups from the queue (waiting for them if they have not completed)."""
    t0 = time.monotonic()
    stream = t.stream
    if not stream.started:  # after any resume has loaded the weights
        if t.resumed_stream is not None:
            stream.load_state_dict(t.resumed_stream, sampler)
        t.version = step - 1
        stream.start(sampler, version=step - 1, weights=t.published_weights())
    batch, rewards, rollout_metrics, taken = take_batch(cfg, stream, step - 1, t.policy.pad_token_id)
    metrics = learn_from_rollouts(cfg, t, batch, rewards, rollout_metrics, step, t0)
    t.version = step
    stream.publish(t.published_weights(), version=step)
    metrics.update(stream_metrics(cfg, stream, taken, batch, version=step - 1))
    if t.run_dir is not None:
        record_prompts(t.run_dir, step, taken)
    return metrics


PROMPTS_LOG = "async_prompts.jsonl"
"""In the run folder: per step of an asynchronous run, the draw numbers of the prompts trained,
dropped and filtered (a resumed run appends its own lines for the steps it redoes)."""


def record_prompts(run_dir: Any, step: int, taken: Taken) -> None:
    """One line of `PROMPTS_LOG` (what says no prompt was lost or trained twice)."""
    line = {
        "step": step,
        "trained": [g.key[0] for g in taken.groups],
        "dropped": [key[0] for key in taken.dropped],
        "filtered": [key[0] for key in taken.filtered],
    }
    with open(Path(run_dir) / PROMPTS_LOG, "a") as f:
        f.write(json.dumps(line) + "\n")


def take_batch(
    cfg: Config, stream: GroupStream, version: int, pad_token_id: int
) -> tuple[RolloutBatch, RewardBatch, dict[str, float], Taken]:
    """The step's groups from the stream as one batch, their rewards, and the generators' metrics
    averaged over the groups. With DAPO dynamic sampling, groups whose rewards are all equal are
    filtered, at most `algo.max_resample_batches` extra batches' worth consumed."""
    B, G = cfg.trainer.prompts_per_step, cfg.rollout.group_size
    a = cfg.algo
    accept = (lambda g: bool(informative_groups(g.rewards.scores, G)[0])) if a.dynamic_sampling else None
    most = B * (1 + a.max_resample_batches) if a.dynamic_sampling else B
    taken = stream.take(B, version, accept=accept, most=most)
    groups = taken.groups
    batch = groups[0].batch if len(groups) == 1 else concat_rollouts([g.batch for g in groups], pad_token_id)
    batch.group_size = G
    rewards = RewardBatch.concat([g.rewards for g in groups])
    metrics: dict[str, float] = {}
    for key in {k for g in groups for k in g.metrics}:
        values = [g.metrics[key] for g in groups if key in g.metrics]
        metrics[key] = sum(values) / len(values)
    if a.dynamic_sampling:
        consumed = taken.informative + len(taken.filtered)  # (dropped groups were never scored for it)
        metrics["dapo/informative_groups"] = float(taken.informative)
        metrics["dapo/informative_fraction"] = taken.informative / max(1, consumed)
    return batch, rewards, metrics, taken


def stream_metrics(
    cfg: Config, stream: GroupStream, taken: Taken, batch: RolloutBatch, version: int
) -> dict[str, float]:
    """The step's asynchronous figures: versions and staleness (per token and per group), the
    queue, the waits, and the dropped, filtered and re-issued counts."""
    model = batch.response_mask.bool()
    lags = (version - batch.token_versions[model]).float() if batch.token_versions is not None else None
    out = {
        "async/policy_version": float(min(g.oldest for g in taken.groups)),
        "async/staleness": float(max(version - g.oldest for g in taken.groups)),
        "async/staleness_mean": sum(version - g.oldest for g in taken.groups) / len(taken.groups),
        "async/partial_groups": float(sum(g.newest != g.oldest for g in taken.groups)),
        "async/queue_groups": float(taken.queued),
        "async/in_flight_groups": float(taken.in_flight),
        "async/trainer_wait_s": taken.waited_s,
        "async/generator_wait_s": taken.generator_wait_s,
        "async/dropped_groups": float(len(taken.dropped)),
        "async/filtered_groups": float(len(taken.filtered)),
    }
    if lags is not None and lags.numel():
        out["async/token_lag_mean"] = float(lags.mean())
        out["async/token_lag_max"] = float(lags.max())
        for k in range(cfg.trainer.max_staleness + 1):  # the staleness histogram, per token
            out[f"async/token_lag_{k}"] = float((lags == k).float().mean())
    for name, value in stream.totals().items():
        out[f"async/{name}_total"] = float(value)
    return out
