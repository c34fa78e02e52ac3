"""Asynchronous GRPO (`trainer.mode=async`): the staleness bound holds, generation really runs
ahead of training, a generator failure reaches the trainer, and the mode still learns."""

from __future__ import annotations

import json
import threading
import time

import pytest

from mmrl.compose import train
from mmrl.config import load_config
from mmrl.train.async_grpo import StalenessBoundedPipeline

WAIT_S = 30.0
"""How long a fake trainer waits for an event that must happen (a liveness guard, never a
timing assertion: the events take milliseconds)."""


class FakeRun:
    """A generator and a trainer around the pipeline, recording who did what.

    The engine's weights are a version number: `load(v)` makes the engine hold version v; the
    trainer publishes version k after training step k. `started[s]` is set when the generator
    starts step s.
    """

    def __init__(self, max_staleness: int, steps: int, fail_at: int | None = None):
        self.steps, self.fail_at = steps, fail_at
        self.engine_version = 0
        self.published = 0
        self.generated: dict[int, int] = {}  # step -> engine version while generating it
        self.published_at_start: dict[int, int] = {}  # step -> trainer's version when it started
        self.started = {s: threading.Event() for s in range(1, steps + 2)}
        self.lock = threading.Lock()
        self.pipeline = StalenessBoundedPipeline(self.generate, self.load, max_staleness, last_step=steps)

    def load(self, weights: int) -> None:
        self.engine_version = weights

    def generate(self, step: int) -> str:
        with self.lock:
            self.generated[step] = self.engine_version
            self.published_at_start[step] = self.published
        self.started[step].set()
        if step == self.fail_at:
            raise ValueError("verifier exploded")
        time.sleep(0.005)
        return f"batch {step}"

    def train(self, ahead: int) -> list[int]:
        """The trainer's loop; returns each step's staleness. Training step k waits (bounded)
        until the generator has started step k + `ahead` (it may while k trains iff ahead <= S):
        a slow trainer, against which the generator runs as far ahead as the gate lets it."""
        staleness = []
        self.pipeline.start(first_step=1, version=0)
        try:
            for step in range(1, self.steps + 1):
                item = self.pipeline.get(step)
                assert item.payload == f"batch {step}"
                staleness.append(step - 1 - item.version)
                if ahead and step + ahead <= self.steps:
                    started = self.started[step + ahead].wait(WAIT_S)
                    assert started, f"step {step + ahead} never started while step {step} trained"
                # The update; long enough for a generator that ignores the gate to start the
                # step after the allowed one (the version checks then catch it).
                if step + ahead + 1 <= self.steps:
                    self.started[step + ahead + 1].wait(0.05)
                with self.lock:
                    self.published = step
                self.pipeline.publish(step, version=step)
        finally:
            self.pipeline.close()
        return staleness


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_no_batch_is_generated_by_a_policy_older_than_the_bound(max_staleness):
    run = FakeRun(max_staleness, steps=12)
    staleness = run.train(ahead=max_staleness)
    for step, version in run.generated.items():
        assert step - 1 - max_staleness <= version <= step - 1, (step, version)
    assert all(0 <= s <= max_staleness for s in staleness)
    assert staleness == [step - 1 - run.generated[step] for step in range(1, 13)]


def test_with_no_staleness_generation_never_overlaps_training():
    """S = 0: step s is generated only after the trainer has published version s - 1."""
    run = FakeRun(0, steps=8)
    staleness = run.train(ahead=0)
    assert staleness == [0] * 8
    assert all(run.published_at_start[s] == s - 1 for s in range(1, 9))


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_with_a_bound_of_one_or_more_the_generator_runs_ahead(max_staleness):
    """Against a slow trainer the generator runs S steps ahead: every step after the first is
    started before its predecessor is trained, and batches are exactly S versions old once the
    pipeline is full."""
    run = FakeRun(max_staleness, steps=10)
    staleness = run.train(ahead=max_staleness)
    overlapped = [s for s in range(2, 11) if run.published_at_start[s] < s - 1]
    assert overlapped == list(range(2, 11))
    assert staleness == [min(step - 1, max_staleness) for step in range(1, 11)]


def test_a_generator_error_reaches_the_trainer_at_the_failed_step():
    run = FakeRun(1, steps=6, fail_at=3)
    run.pipeline.start(first_step=1, version=0)
    try:
        for step in (1, 2):
            assert run.pipeline.get(step).payload == f"batch {step}"
            run.pipeline.publish(step, version=step)
        with pytest.raises(
            RuntimeError, match=r"failed at step 3: ValueError\('verifier exploded'\)"
        ) as info:
            run.pipeline.get(3)
        assert isinstance(info.value.__cause__, ValueError)
        assert 4 not in run.generated  # the generator stopped at the failure
    finally:
        run.pipeline.close()


def test_close_stops_a_generator_waiting_at_the_gate():
    run = FakeRun(0, steps=5)
    run.pipeline.start(first_step=1, version=0)
    assert run.pipeline.get(1).payload == "batch 1"
    # Step 2 waits for version 1, which is never published.
    run.pipeline.close()
    assert not run.pipeline._thread.is_alive()
    assert 2 not in run.generated
    with pytest.raises(RuntimeError, match="not running"):
        run.pipeline.get(2)


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        StalenessBoundedPipeline(lambda s: s, lambda w: None, -1, last_step=3)


def test_async_mode_needs_importance_sampling_correction():
    with pytest.raises(ValueError, match="trainer.mode=async needs algo.tis"):
        load_config("vision_reasoning", overrides=["trainer.mode=async"])


# ---------------------------------------------------------------------------------------------
# End to end on the built-in task
# ---------------------------------------------------------------------------------------------

ASYNC_RECIPE = [
    "trainer.mode=async",
    "trainer.max_staleness=1",
    "algo.tis=token",
    "trainer.total_steps=50",
    "trainer.eval_every=50",
    "optim.schedule=constant",
    "trainer.progress=false",
]
# Margin: held-out accuracy is measured on 512 prompts (sampling noise at most 2.2 points), so
# a run that learned nothing lands within a few points of its start. With this recipe (50 steps,
# one step ahead, token TIS) trainer.seed 0-3 gained +33.4, +28.5, +21.1 and +33.2 points
# (measured on the 2-core machine with an evaluation at step 25 too, 83-145 s per run; this
# test's own run, seed 0: +33.4 in 78 s). 10 points is ~4.5 sigma of the evaluation
# noise and less than half of the smallest measured gain.
MIN_GAIN = 0.10


@pytest.mark.slow
def test_async_mode_learns_on_the_builtin_task_within_its_staleness_bound(mmrl_cache, tmp_path):
    cfg = load_config("vision_reasoning", overrides=[*ASYNC_RECIPE, f"trainer.run_dir={tmp_path / 'run'}"])
    result = train(cfg)
    gain = result.final_accuracy - result.start_accuracy
    assert gain >= MIN_GAIN, f"{result.start_accuracy:.3f} -> {result.final_accuracy:.3f}"

    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "async/staleness" in r]
    assert [r["step"] for r in steps] == list(range(1, 51))
    staleness = [r["async/staleness"] for r in steps]
    assert all(0 <= s <= 1 for s in staleness)
    assert all(r["async/policy_version"] == r["step"] - 1 - r["async/staleness"] for r in steps)
    # It really ran ahead: after the first step, batches come from the policy one update back.
    assert staleness[0] == 0 and sum(s == 1 for s in staleness) >= len(staleness) // 2
    assert all(r["tis/weight_mean"] > 0 for r in steps)  # the correction was applied
