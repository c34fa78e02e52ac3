"""Fault injection in real training runs: a verifier worker SIGKILLed mid-step, SIGTERM to the
whole process group (what Slurm and systemd send), a reward model that raises. The run goes on,
or ends with a checkpoint and resumes; every fault is counted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.readers import write_jsonl
from mmrl.rewards.base import RewardModel, RewardOutput, register_reward_model
from mmrl.train.checkpoint import find_resume_checkpoint
from mmrl.train.grpo import train

pytestmark = pytest.mark.slow

PLUGINS = Path(__file__).parent / "plugins"
SHORT = [
    "trainer.prompts_per_step=4",
    "rollout.group_size=2",
    "trainer.eval_size=8",
    "trainer.eval_every=3",
    "trainer.progress=false",
    "trainer.save_final=false",
    "trainer.threads=1",
]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if "reward/mean" in r]


def test_sigterm_to_the_process_group_checkpoints_exits_cleanly_and_resumes(mmrl_cache, tmp_path):
    """Slurm's and systemd's stop signal goes to every process of the group, verifier workers
    included: the workers go on (they ignore it), the trainer finishes its step with no verifier
    error, checkpoints, closes its workers and exits 0; `--resume auto` continues the run."""
    run = tmp_path / "run"
    args = [*SHORT, "trainer.total_steps=8", "reward.num_workers=2", f"trainer.run_dir={run}"]
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "mmrl.cli", "train", *args]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    start = time.monotonic()
    while not ((run / "metrics.jsonl").exists() and _steps(run)):  # at least one step done
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() - start < 900, "no step after 900 s"  # a hang guard
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # the trainer and its verifier workers alike
    try:
        out, err = proc.communicate(timeout=600)  # a hang guard
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the run hung after SIGTERM to its process group") from None
    assert proc.returncode == 0, err[-3000:]
    assert "interrupted at step" in out
    assert _group_ends(proc.pid), _group_members(proc.pid)
    ckpt = find_resume_checkpoint(run)
    assert ckpt is not None and 1 <= ckpt.step < 8
    assert json.loads((run / "summary.json").read_text())["interrupted"] is True
    steps = _steps(run)
    assert all(s["verifier/errors"] == 0 for s in steps), [s["verifier/errors"] for s in steps]

    resumed = subprocess.run([*command, "--resume", "auto"], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert [s["step"] for s in _steps(run)] == list(range(1, 9))


def _group_members(pgid: int) -> list[str]:
    """The live (not zombie) processes of a process group, as "pid state command" lines."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
        state, _, pgrp = text[text.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(f"{stat.parent.name} {state} {cmdline}")
    return members


def _group_ends(pgid: int) -> bool:
    """Whether every process of the group ends (no verifier worker is left behind; the
    resource tracker of `multiprocessing` may take a moment after its parent)."""
    for _ in range(600):  # a hang guard: 60 s
        if not _group_members(pgid):
            return True
        time.sleep(0.1)
    return False


def _data(tmp_path: Path, verifier: str = "math", mark: str | None = None, models=None) -> None:
    samples = make_samples(["colour_code"], 8, "train")
    for i, s in enumerate(samples):
        s.reward_model.verifier = verifier
        if mark:
            s.extra_info[mark] = i == 0
        if models:
            s.reward_model.models = models
    write_jsonl(samples, tmp_path / "train.jsonl")
    write_jsonl(samples[1:5], tmp_path / "heldout.jsonl")


def _config(tmp_path: Path, *extra: str):
    return load_config(
        "vision_reasoning",
        overrides=[
            f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            f"data.heldout_files=[{tmp_path / 'heldout.jsonl'}]",
            "trainer.prompts_per_step=4",
            "rollout.group_size=2",
            "trainer.eval_every=2",
            "trainer.progress=false",
            f"trainer.run_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def test_a_verifier_worker_sigkilled_mid_step_costs_its_responses_and_training_goes_on(
    mmrl_cache, tmp_path, monkeypatch
):
    """The worker scoring sample 0's responses is SIGKILLed (like the OOM killer would): those
    responses get error results, counted per source; the pool replaces the worker; both steps
    run and the final checkpoint is written."""
    monkeypatch.syspath_prepend(str(PLUGINS))  # workers inherit sys.path
    _data(tmp_path, "die_on_marked", "die")
    cfg = _config(tmp_path, "reward.plugins=[fault_verifiers]", "trainer.total_steps=2")
    result = train(cfg)
    steps = _steps(result.run_dir)
    assert len(steps) == 2
    assert sum(r["verifier/errors"] for r in steps) == 2  # sample 0 drawn once, both responses
    assert sum(r.get("verifier/errors/die_on_marked/vision_reasoning/colour_code", 0) for r in steps) == 2
    assert sum(r["verifier/timeouts"] for r in steps) == 0
    assert find_resume_checkpoint(result.run_dir).step == 2


@register_reward_model("test_flaky")
class Flaky(RewardModel):
    """Raises on its first call (a reward model's CUDA error, a bad input), then scores 1."""

    requires = ("responses",)
    cpu_only = True
    calls = 0

    def __init__(self, device="cpu"):
        super().__init__("cpu")

    def score_with_components(self, images=None, prompts=None, responses=None, **fields):
        Flaky.calls += 1
        if Flaky.calls == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return RewardOutput(scores=[1.0] * len(responses))


def test_a_reward_model_that_raises_gives_counted_error_results_and_the_step_goes_on(mmrl_cache, tmp_path):
    Flaky.calls = 0
    _data(tmp_path, models=[{"name": "flaky"}])
    cfg = _config(
        tmp_path, "reward.model_rewards.models=[{name: flaky, type: test_flaky}]", "trainer.total_steps=2"
    )
    result = train(cfg)
    first, second = _steps(result.run_dir)
    assert first["verifier/errors"] == 8  # every row of the failed call: 4 prompts x 2
    assert first["verifier/errors/model/flaky/vision_reasoning/colour_code"] == 8
    assert first["reward/mean"] == 0.0  # errors score 0 (`reward.on_error=zero`)
    assert second["verifier/errors"] == 0 and second["reward/model/flaky"] == 1.0
