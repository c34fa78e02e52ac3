"""Ctrl-C anywhere ends with one line, never a traceback: during the base warm-up and the held-out
evaluation before training (exit status 130, nothing to resume), during `mmrl eval` (130, the
finished queries kept), and during an evaluation once training has begun (a checkpoint, then
the usual "interrupted at step N" and status 130, so `mmrl train ... && mmrl eval ...` stops; after
SIGTERM, a scheduler's stop, the status is 0).

SIGINT goes to the whole process group, as a terminal's Ctrl-C does (verifier workers
included), the moment the command logs that the stage began (an evaluation of 512 samples lasts seconds;
the signal arrives within milliseconds of the line)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from mmrl.config import load_config
from mmrl.models.base import builtin_base

LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|DEBUG) ")
QUICK = [
    "trainer.progress=false",
    "trainer.prompts_per_step=4",
    "rollout.group_size=2",
    "trainer.save_final=false",
]


def _interrupt_when(
    args: list[str], marker: str, env: dict[str, str], cwd
) -> tuple[int, list[str], list[str]]:
    """Run `python -m mmrl.cli ARGS`, send SIGINT to its process group once a stderr line holds
    `marker`; returns (status, stderr lines before the signal, stderr lines after it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmrl.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
        # As from a terminal: a shell without job control starts background commands with SIGINT
        # ignored, and Python then installs no KeyboardInterrupt handler in the child.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    before = []
    for line in proc.stderr:
        before.append(line.rstrip("\n"))
        if marker in line:
            os.killpg(proc.pid, signal.SIGINT)
            break
    else:
        proc.wait()
        pytest.fail(f"{marker!r} never appeared: {before[-20:]}")
    out, rest = proc.communicate()
    return proc.returncode, before, rest.splitlines()


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", **extra)


def _only_line(after: list[str]) -> list[str]:
    """What was printed after the signal, log lines aside."""
    return [line for line in after if not LOG_LINE.match(line)]


@pytest.mark.trains
def test_ctrl_c_during_the_warm_up_leaves_one_line_and_status_130(tmp_path):
    cache = tmp_path / "cache"  # empty: the base has to be warmed up
    status, _, after = _interrupt_when(
        ["train", f"trainer.run_dir={tmp_path / 'run'}", *QUICK],
        "building the built-in base model",
        _env(MMRL_CACHE=str(cache)),
        tmp_path,
    )
    assert status == 130, after[-30:]
    assert _only_line(after) == [
        "mmrl train: interrupted (Ctrl-C); stopped before training began, nothing to resume"
    ]
    assert not list(cache.glob("bases/*/warmup.json"))  # no half-built base is kept


@pytest.mark.slow
def test_ctrl_c_during_the_first_evaluation_leaves_one_line_and_status_130(mmrl_cache, tmp_path):
    builtin_base(load_config("vision_reasoning"))  # cached: the run goes straight to its evaluation
    status, _, after = _interrupt_when(
        ["train", f"trainer.run_dir={tmp_path / 'run'}", *QUICK],
        "step 0: held-out evaluation of 512 samples",
        _env(MMRL_CACHE=mmrl_cache),
        tmp_path,
    )
    assert status == 130, after[-30:]
    assert _only_line(after) == [
        "mmrl train: interrupted (Ctrl-C); stopped before training began, nothing to resume"
    ]
    assert not (tmp_path / "run" / "checkpoints").exists() or not list(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


@pytest.mark.slow
def test_ctrl_c_during_an_evaluation_in_training_writes_a_checkpoint(mmrl_cache, tmp_path):
    from mmrl.train.checkpoint import find_resume_checkpoint

    builtin_base(load_config("vision_reasoning"))
    run = tmp_path / "run"
    status, _, after = _interrupt_when(
        [
            "train",
            f"trainer.run_dir={run}",
            "trainer.total_steps=3",
            "trainer.eval_every=1",
            *QUICK,
        ],
        "step 1: held-out evaluation of 512 samples",
        _env(MMRL_CACHE=mmrl_cache),
        tmp_path,
    )
    assert status == 130, after[-30:]
    assert not any("Traceback" in line for line in after)
    ckpt = find_resume_checkpoint(run)
    assert ckpt is not None and ckpt.step == 1
    evals = [
        json.loads(line)["step"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if "eval/accuracy" in line
    ]
    assert evals == [0]  # step 1's evaluation was cut short, not logged
    assert json.loads((run / "summary.json").read_text())["interrupted"] is True


def test_ctrl_c_during_mmrl_eval_leaves_one_line_and_status_130(mmrl_cache, tmp_path):
    base = builtin_base(load_config("vision_reasoning"))
    status, _, after = _interrupt_when(
        [
            "eval",
            "--model",
            str(base),
            "--output",
            str(tmp_path / "out"),
            "--no-progress",
            "--builtin-queries",
            "64",
        ],
        "eval: ",
        _env(MMRL_CACHE=mmrl_cache),
        tmp_path,
    )
    assert status == 130, after[-30:]
    assert _only_line(after) == [
        "mmrl eval: interrupted (Ctrl-C); finished queries are kept, rerun the same command to continue"
    ]


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_a_run_stopped_by_a_signal_exits_130_on_ctrl_c_and_0_on_sigterm(
    signum, status, monkeypatch, tmp_path, capsys
):
    """What the command line makes of a run the trainer stopped on a signal (its checkpoint
    written): the trainer's own handler takes the signal, as in `mmrl.train.grpo.train`."""
    from mmrl.cli import main
    from mmrl.train.grpo import StopRequest, TrainResult

    def stopped_run(cfg):
        stop = StopRequest()
        with stop.installed():
            os.kill(os.getpid(), signum)
        assert stop.requested
        return TrainResult(cfg.trainer.run_dir, 0.5, 0.5, 0.5, steps=1, seconds=1.0, interrupted=True)

    monkeypatch.setattr("mmrl.compose.train", stopped_run)
    assert main(["train", f"trainer.run_dir={tmp_path / 'run'}", *QUICK]) == status
    assert "interrupted at step 1; checkpoint written" in capsys.readouterr().out
