"""flow-GRPO survives crashes: a real `mmrl train` of the tiny diffusion task killed with SIGKILL
mid-step, right after a checkpoint and during a checkpoint write resumes to exactly the metrics
and weights (bit for bit) of an uninterrupted run; SIGTERM to the process group writes a
checkpoint and exits cleanly; damaged checkpoints, changed configs and failed writes are refused
with messages naming them; step dumps hold each image with its rewards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmrl.train.checkpoint import list_checkpoints, load_trainer_state
from mmrl.train.flow_config import load_flow_config
from mmrl.train.flow_grpo import run_text_to_image

TINY = [
    "sample.group_size=2",
    "sample.num_steps=2",
    "sample.eval_num_steps=2",
    "trainer.prompts_per_step=2",
    "trainer.mini_batches=2",
    "trainer.eval_size=2",
    "trainer.eval_every=3",
    "trainer.progress=false",
    "trainer.save_final=false",
    "trainer.threads=1",
]

# Runs `mmrl train` (mmrl.cli.main) in this process after arranging for it to SIGKILL itself at
# one point given by MMRL_TEST_KILL: `mid_step:<n>` (step n's weights updated, nothing logged or
# saved yet), `after_checkpoint:<n>` (checkpoint n complete), `in_checkpoint:<n>` (checkpoint
# n's files written into its temporary folder, manifest not yet).
DRIVER = r"""
import os, signal, sys
from mmrl.heap import imports_without_gc
with imports_without_gc():  # as `mmrl train` imports the trainer
    import mmrl.train.checkpoint as ck
    import mmrl.train.flow_grpo as fg
    from mmrl.cli import main

kind, _, at = os.environ.get("MMRL_TEST_KILL", "none:0").partition(":")
at = int(at)
current = {"step": 0}

def die():
    os.kill(os.getpid(), signal.SIGKILL)

step_fn = fg.flow_grpo_step
def flow_grpo_step(cfg, t, prompts, step, **kw):
    current["step"] = step
    return step_fn(cfg, t, prompts, step, **kw)
fg.flow_grpo_step = flow_grpo_step

update_fn = fg.update_policy
def update_policy(*a, **kw):
    out = update_fn(*a, **kw)
    if kind == "mid_step" and current["step"] == at:
        die()
    return out
fg.update_policy = update_policy

write_fn = fg.write_flow_checkpoint
def write_flow_checkpoint(cfg, t, order, progress, run_dir):
    out = write_fn(cfg, t, order, progress, run_dir)
    if kind == "after_checkpoint" and progress.step == at:
        die()
    return out
fg.write_flow_checkpoint = write_flow_checkpoint

sha_fn = ck._sha256
def _sha256(path):
    if kind == "in_checkpoint" and f".tmp_step_{at:08d}" in str(path):
        die()
    return sha_fn(path)
ck._sha256 = _sha256

sys.exit(main(sys.argv[1:]))
"""


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", **extra)


def _train(args: list[str], kill: str = "none:0") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", DRIVER, "train", "--task", "text_to_image_jpeg", *args],
        env=_env(MMRL_TEST_KILL=kill),
        capture_output=True,
        text=True,
    )


def _metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without wall-clock figures (the only thing that may differ)."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.append({k: v for k, v in record.items() if not k.startswith(("time/", "throughput/"))})
    return rows


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    """Weights, EMA, optimizer state, prompt order, counters and RNG states: equal bit for bit."""
    for name in ("trainable.safetensors", "ema.safetensors"):
        wa, wb = load_file(a / "model" / name), load_file(b / "model" / name)
        assert wa.keys() == wb.keys() and wa
        for key in wa:
            assert torch.equal(wa[key], wb[key]), f"{name}: {key} differs"
    sa, sb = load_trainer_state(a), load_trainer_state(b)
    for p, state in sa["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, sb["optimizer"]["state"][p][k]), f"optimizer state {p}/{k} differs"
    assert sa["optimizer"]["param_groups"] == sb["optimizer"]["param_groups"]
    for key in ("updates", "ema_updates", "prompt_order", "progress", "step"):
        assert sa[key] == sb[key], key
    assert torch.equal(sa["rng"]["torch"], sb["rng"]["torch"])
    assert str(sa["rng"]["numpy"]) == str(sb["rng"]["numpy"]) and sa["rng"]["python"] == sb["rng"]["python"]


@pytest.mark.slow
def test_sigkill_at_three_points_then_resume_auto_equals_the_uninterrupted_run(tmp_path):
    cache = tmp_path / "cache"
    args = [*TINY, f"model.cache_dir={cache}", "trainer.total_steps=6", "trainer.checkpoint_every=2"]
    whole = _train([*args, f"trainer.run_dir={tmp_path / 'whole'}", "trainer.keep_last=0"])
    assert whole.returncode == 0, whole.stderr[-3000:]

    run = tmp_path / "killed"
    args = [*args, f"trainer.run_dir={run}", "trainer.keep_last=2"]
    # 1. Killed inside step 3: checkpoint 2 exists, step 3 was never logged.
    first = _train(args, kill="mid_step:3")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert [c.step for c in list_checkpoints(run)] == [2]
    assert max(r["step"] for r in _metrics(run)) == 2
    # 2. Resumed, then killed right after checkpoint 4 was written.
    second = _train([*args, "--resume", "auto"], kill="after_checkpoint:4")
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "step_00000002" in second.stderr
    assert [c.step for c in list_checkpoints(run)] == [2, 4]
    # 3. Resumed, then killed while writing the last checkpoint (6): a temporary folder is left.
    third = _train([*args, "--resume", "auto"], kill="in_checkpoint:6")
    assert third.returncode == -signal.SIGKILL, third.stderr[-3000:]
    assert "step_00000004" in third.stderr
    assert [c.step for c in list_checkpoints(run)] == [2, 4]
    assert list((run / "checkpoints").glob(".tmp_step_00000006_*"))
    assert max(r["step"] for r in _metrics(run)) == 6  # logged by the killed run; dropped on resume
    # 4. Resumed to the end: the leftover is removed, steps 5 and 6 are recomputed.
    last = _train([*args, "--resume", "auto"])
    assert last.returncode == 0, last.stderr[-3000:]
    assert "removing" in last.stderr and not list((run / "checkpoints").glob(".tmp_*"))
    assert [c.step for c in list_checkpoints(run)] == [4, 6]  # keep_last=2

    assert _metrics(run) == _metrics(tmp_path / "whole")  # no line lost, none repeated
    steps = [r["step"] for r in _metrics(run) if "reward/mean" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    ckpt = "checkpoints/step_00000006"
    _assert_same_checkpoint(run / ckpt, tmp_path / "whole" / ckpt)
    _assert_same_checkpoint(run / "checkpoints/step_00000004", tmp_path / "whole/checkpoints/step_00000004")


@pytest.mark.slow
def test_sigterm_to_the_process_group_checkpoints_exits_cleanly_and_resumes_exactly(tmp_path):
    cache = tmp_path / "cache"
    args = [*TINY, f"model.cache_dir={cache}", "trainer.total_steps=40"]
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mmrl.cli",
            "train",
            "--task",
            "text_to_image_jpeg",
            *args,
            f"trainer.run_dir={run}",
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as under Slurm or systemd
    )
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and '"reward/mean"' in metrics.read_text()):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)  # at least one step done
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "interrupted at step" in out and "--resume auto" in out
    (ckpt,) = list_checkpoints(run)
    assert 1 <= ckpt.step < 40
    assert json.loads((run / "summary.json").read_text())["interrupted"] is True
    assert not (run / "final").exists()

    # Resumed to a shorter total (allowed), it equals a run that was never stopped.
    stop = ckpt.step + 1
    resumed = _train([*args, f"trainer.run_dir={run}", f"trainer.total_steps={stop}", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = _train([*args, f"trainer.run_dir={tmp_path / 'whole'}", f"trainer.total_steps={stop}"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert _metrics(run) == _metrics(tmp_path / "whole")
    last = f"checkpoints/step_{stop:08d}"
    _assert_same_checkpoint(run / last, tmp_path / "whole" / last)


# --- in-process checks ---------------------------------------------------------------------
def _cfg(tmp_path: Path, run: str, *overrides: str):
    return load_flow_config(
        "text_to_image_jpeg",
        overrides=[
            *TINY,
            f"model.cache_dir={tmp_path / 'cache'}",
            f"trainer.run_dir={tmp_path / run}",
            *overrides,
        ],
    )


def test_lora_resume_from_an_explicit_checkpoint_is_exact(tmp_path):
    lora = ["lora.enabled=true", "lora.rank=2", "lora.alpha=4", "optim.lr=0.05", "trainer.checkpoint_every=1"]
    run_text_to_image(_cfg(tmp_path, "whole", *lora, "trainer.total_steps=2", "trainer.keep_last=0"))
    whole = tmp_path / "whole" / "checkpoints"
    names = load_file(whole / "step_00000002" / "model" / "trainable.safetensors").keys()
    assert names and all("lora" in n for n in names)  # the adapters alone
    # A copy of the run as it was after step 1, continued from the named checkpoint.
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    import shutil

    shutil.copytree(whole / "step_00000001", part / "checkpoints" / "step_00000001")
    lines = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    (part / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in lines if json.loads(line)["step"] <= 1)
    )
    resume = f"trainer.resume={part / 'checkpoints' / 'step_00000001'}"
    result = run_text_to_image(_cfg(tmp_path, "part", *lora, "trainer.total_steps=2", resume))
    assert result.steps == 2 and not result.interrupted
    assert _metrics(part) == _metrics(tmp_path / "whole")
    _assert_same_checkpoint(part / "checkpoints" / "step_00000002", whole / "step_00000002")


def test_resume_refuses_a_changed_config_and_damaged_checkpoints_without_touching_the_run(tmp_path):
    base = ["trainer.total_steps=1", "sample.eval_num_steps=1"]
    run_text_to_image(_cfg(tmp_path, "run", *base))
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"optim.lr: 0.003 -> 0.1"):
        run_text_to_image(_cfg(tmp_path, "run", *base, "optim.lr=0.1", "trainer.resume=auto"))
    with pytest.raises(ValueError, match="already holds a run"):
        run_text_to_image(_cfg(tmp_path, "run", *base))
    state = tmp_path / "run" / "checkpoints" / "step_00000001" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # a crash mid-write, or a full disk
    with pytest.raises(ValueError, match=r"every checkpoint .* is damaged .*trainer_state.pt"):
        run_text_to_image(_cfg(tmp_path, "run", *base, "trainer.resume=auto"))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # nothing truncated
    assert state.stat().st_size == 100  # nor overwritten


def test_a_failed_checkpoint_write_names_the_folder_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    import mmrl.train.checkpoint as ck

    real_save = torch.save
    calls = {"n": 0}

    def full_disk(obj, path, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(ck.torch, "save", full_disk)
    from mmrl.train.storage import StorageError

    with pytest.raises(StorageError, match=r"checkpoint step 2 .*no space left.*step_00000001 is intact"):
        run_text_to_image(_cfg(tmp_path, "run", "trainer.total_steps=2", "trainer.checkpoint_every=1"))
    assert [c.step for c in list_checkpoints(tmp_path / "run")] == [1]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp_*"))


def test_dump_steps_writes_each_image_with_its_prompt_rewards_and_advantage(tmp_path):
    from PIL import Image

    result = run_text_to_image(_cfg(tmp_path, "run", "trainer.total_steps=1", "trainer.dump_steps=true"))
    rows = [
        json.loads(line) for line in (result.run_dir / "dumps" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 4 and [r["group"] for r in rows] == [0, 0, 1, 1]
    assert rows[0]["prompt"] == rows[1]["prompt"] != rows[2]["prompt"]
    (step,) = [r for r in _metrics(result.run_dir) if "reward/mean" in r]
    assert sum(r["reward"] for r in rows) / 4 == pytest.approx(step["reward/mean"])
    assert all(r["reward"] == r["rewards"]["jpeg_compressibility"] for r in rows)
    assert sum(r["advantage"] for r in rows[:2]) == pytest.approx(0, abs=1e-5)  # centred per prompt
    with Image.open(result.run_dir / rows[3]["image"]) as image:
        assert image.size == (64, 64)
