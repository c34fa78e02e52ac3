"""One run per run directory: `run.lock` names the writer (host, pid, start, command); a second
trainer or eval on a folder in use is refused at once with the holder and the fix; a lock whose
holder is gone is taken over with a warning; a resumed run takes the lock too.

The holder in the two-process tests is a small Python process that takes the lock and waits
(no model: these tests only need a live process that holds it); the second process is the real
`mmrl train` / `mmrl eval` command line. The tests that start processes are marked slow (5-35 s
each on the shared 2-core machine, most of it importing torch)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.train.rundir import LOCK_NAME, LockHolder, RunDirInUse, RunDirLock

HOLD = (
    "import sys\n"
    "from mmrl.train.rundir import RunDirLock\n"
    "RunDirLock(sys.argv[1], 'mmrl train').acquire()\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


@pytest.fixture()
def holder(tmp_path):
    """A live process holding the lock of `tmp_path / "run"`; yields (folder, process)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env()
    )
    try:
        assert proc.stdout.readline().strip() == b"held"
        yield run_dir, proc
    finally:
        proc.kill()
        proc.wait()


def _mmrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmrl.cli", *args], capture_output=True, text=True, env=_env(), check=False
    )


@pytest.mark.slow
def test_a_second_trainer_on_a_directory_in_use_is_refused_naming_the_holder_and_the_fix(holder):
    run_dir, proc = holder
    lock_before = (run_dir / LOCK_NAME).read_text()
    out = _mmrl("train", "--task", "vision_reasoning", f"trainer.run_dir={run_dir}", "trainer.progress=false")
    assert out.returncode == 2, out.stderr
    message = out.stderr
    assert f"pid {proc.pid} on host {socket.gethostname()}" in message
    started = json.loads(lock_before)["start"]
    assert f"started {started}" in message and "mmrl train" in message
    assert "choose another trainer.run_dir" in message and "--resume auto" in message
    # Refused before anything was written or cleaned: the holder's lock is intact, no config, no metrics.
    assert (run_dir / LOCK_NAME).read_text() == lock_before
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()
    # --resume takes the lock too.
    resumed = _mmrl("train", "--resume", "auto", f"trainer.run_dir={run_dir}", "trainer.progress=false")
    assert resumed.returncode == 2 and f"pid {proc.pid}" in resumed.stderr, resumed.stderr


@pytest.mark.slow
def test_eval_into_a_folder_in_use_is_refused(holder, tmp_path):
    run_dir, proc = holder
    out = _mmrl("eval", "--model", str(tmp_path / "no-model-needed"), "--output", str(run_dir))
    assert out.returncode == 2, out.stderr
    assert f"pid {proc.pid}" in out.stderr and "choose another --output" in out.stderr


@pytest.mark.slow
def test_a_lock_left_by_a_killed_process_is_taken_over_with_a_warning(holder, caplog):
    run_dir, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    dead = LockHolder.read(run_dir / LOCK_NAME)
    assert dead.pid == proc.pid
    with caplog.at_level(logging.WARNING, logger="mmrl.train.rundir"):
        with RunDirLock(run_dir, "mmrl train"):
            assert LockHolder.read(run_dir / LOCK_NAME).pid == os.getpid()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"pid {proc.pid}" in warned[0] and "no longer running" in warned[0]
    assert not (run_dir / LOCK_NAME).exists()  # released on the way out


def test_a_resumed_run_takes_over_a_stale_lock_before_it_loads_the_model(tmp_path, monkeypatch, caplog):
    """The path a SIGKILLed run's `--resume auto` takes: the dead trainer's lock is replaced by
    the new one's, with a warning, and it is released when the run stops (here: at the model)."""
    from mmrl.config import load_config
    from mmrl.train.grpo import train

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = LockHolder(socket.gethostname(), _dead_pid(), "2026-01-01T00:00:00+0000", "mmrl train")
    (run_dir / LOCK_NAME).write_text(json.dumps(stale.__dict__))
    seen = []

    def at_the_model(*args, **kwargs):
        seen.append(LockHolder.read(run_dir / LOCK_NAME))
        raise RuntimeError("stop here")

    monkeypatch.setattr("mmrl.train.grpo.builtin_base", at_the_model)
    cfg = load_config(
        "vision_reasoning",
        overrides=[
            "data.num_train=8",
            "data.num_heldout=4",
            f"trainer.run_dir={run_dir}",
            "trainer.resume=auto",
        ],
    )
    with (
        caplog.at_level(logging.WARNING, logger="mmrl.train.rundir"),
        pytest.raises(RuntimeError, match="stop"),
    ):
        train(cfg)
    assert [h.pid for h in seen] == [os.getpid()]
    assert any(f"pid {stale.pid}" in r.getMessage() for r in caplog.records)
    assert not (run_dir / LOCK_NAME).exists()


def test_a_second_trainer_is_refused_before_it_loads_its_data(tmp_path, monkeypatch, capsys):
    """Issue 48, item 19: `mmrl train` takes the lock of a named run directory first; the
    trainer took it only after loading (and validating) every record."""
    from mmrl.cli import main

    def loads_the_data(cfg):
        raise AssertionError("the data was loaded before the run directory's lock was taken")

    monkeypatch.setattr("mmrl.train.grpo.load_data_report", loads_the_data)
    run_dir = tmp_path / "run"
    with RunDirLock(run_dir, "mmrl train"):  # held by this process: a second writer all the same
        before = (run_dir / LOCK_NAME).read_text()
        assert main(["train", f"trainer.run_dir={run_dir}", "trainer.progress=false"]) == 2
        assert (run_dir / LOCK_NAME).read_text() == before
    err = capsys.readouterr().err
    assert f"mmrl train: error: {run_dir} is in use by mmrl train (pid {os.getpid()}" in err


def test_the_trainer_keeps_the_lock_the_command_line_took_and_it_is_released(tmp_path, monkeypatch):
    from mmrl.cli import main

    seen = []

    def at_the_model(*args, **kwargs):
        seen.append(LockHolder.read(run_dir / LOCK_NAME))
        raise RuntimeError("stop here")

    monkeypatch.setattr("mmrl.train.grpo.builtin_base", at_the_model)
    run_dir = tmp_path / "run"
    args = [
        "train",
        f"trainer.run_dir={run_dir}",
        "data.num_train=8",
        "data.num_heldout=4",
        "trainer.progress=false",
    ]
    assert main(args) == 1  # "stopped: stop here"
    assert [h.pid for h in seen] == [os.getpid()]  # one lock, taken once: no refusal of its own
    assert not (run_dir / LOCK_NAME).exists()


def test_a_run_refused_after_taking_the_lock_leaves_no_empty_folder(tmp_path, monkeypatch, capsys):
    from mmrl.cli import main

    def bad_data(cfg):
        raise ValueError("train.jsonl:3: field 'prompt': missing")

    monkeypatch.setattr("mmrl.train.grpo.load_data_report", bad_data)
    run_dir = tmp_path / "new" / "run"
    assert main(["train", f"trainer.run_dir={run_dir}", "trainer.progress=false"]) == 2
    assert "field 'prompt': missing" in capsys.readouterr().err
    assert not run_dir.exists()  # created for the lock, removed with it


def test_a_lock_of_another_host_is_never_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = LockHolder("gpu-node-7", 4242, "2026-01-01T00:00:00+0000", "mmrl train")
    (run_dir / LOCK_NAME).write_text(json.dumps(other.__dict__))
    with pytest.raises(RunDirInUse, match="pid 4242 on host gpu-node-7.*on another host") as info:
        RunDirLock(run_dir, "mmrl train").acquire()
    assert f"delete {run_dir / LOCK_NAME}" in str(info.value)


def test_a_reused_pid_or_a_reboot_does_not_keep_a_lock_alive(tmp_path):
    """The pid is alive (this very process) but is not the holder: another process start time,
    or another boot of the machine."""
    me = LockHolder.me("mmrl train")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for stale in (
        LockHolder(me.host, me.pid, me.start, "mmrl train", me.boot_id, (me.pid_start or 0) + 1),
        LockHolder(me.host, me.pid, me.start, "mmrl train", "another-boot", me.pid_start),
    ):
        assert stale.is_running() is False
        (run_dir / LOCK_NAME).write_text(json.dumps(stale.__dict__))
        RunDirLock(run_dir, "mmrl train").acquire().release()
    assert me.is_running() is True


def test_a_process_holding_the_lock_refuses_a_second_lock_of_its_own(tmp_path):
    """Two runs in one process (two threads, say) are two writers too."""
    with RunDirLock(tmp_path / "run", "mmrl train"):
        with pytest.raises(RunDirInUse, match=f"pid {os.getpid()}"):
            RunDirLock(tmp_path / "run", "mmrl train").acquire()
    RunDirLock(tmp_path / "run", "mmrl train").acquire().release()  # free again once released


def test_an_unreadable_lock_is_refused_naming_the_file(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).write_text("{not json")
    with pytest.raises(RunDirInUse, match="cannot be read"):
        RunDirLock(run_dir, "mmrl train").acquire()


def test_release_leaves_a_lock_that_is_no_longer_this_process_s(tmp_path):
    lock = RunDirLock(tmp_path / "run", "mmrl train").acquire()
    other = LockHolder("elsewhere", 1, "2026-01-01T00:00:00+0000", "mmrl train")
    (tmp_path / "run" / LOCK_NAME).write_text(json.dumps(other.__dict__))
    lock.release()
    assert LockHolder.read(tmp_path / "run" / LOCK_NAME) == other


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_holders_are_compared_field_by_field_after_a_round_trip(tmp_path):
    me = LockHolder.me("mmrl eval")
    path = Path(tmp_path) / LOCK_NAME
    path.write_text(json.dumps(me.__dict__))
    assert LockHolder.read(path) == me


@pytest.mark.parametrize("task", ["text_to_image", "text_to_image_decoupled"])
def test_the_diffusion_trainers_take_the_lock_before_they_touch_the_folder(task, tmp_path):
    from mmrl.train.decoupled import run_decoupled
    from mmrl.train.flow_config import load_flow_config
    from mmrl.train.flow_grpo import run_text_to_image

    run_dir = tmp_path / "run"
    stale_tmp = run_dir / "checkpoints" / ".tmp_step_00000002_1"  # what a resume would clean
    stale_tmp.mkdir(parents=True)
    cfg = load_flow_config(task, overrides=[f"trainer.run_dir={run_dir}", "trainer.resume=auto"])
    run = run_decoupled if task.endswith("decoupled") else run_text_to_image
    with RunDirLock(run_dir, "mmrl train"), pytest.raises(RunDirInUse, match=f"pid {os.getpid()}"):
        run(cfg)
    assert stale_tmp.exists()


# Each process is slowed down between finding no lock and writing its own (0.3 s: a slow file
# system), so that without the folder's flock all three would take it (checked: they did).
RACE = (
    "import os, sys, time\n"
    "from mmrl.train import rundir\n"
    "from mmrl.train.rundir import RunDirInUse, RunDirLock\n"
    "me = rundir.LockHolder.me\n"
    "rundir.LockHolder.me = classmethod(lambda cls, command: (time.sleep(0.3), me(command))[1])\n"
    "print('ready', flush=True)\n"
    "while not os.path.exists(sys.argv[2]):\n"
    "    time.sleep(0.001)\n"
    "try:\n"
    "    RunDirLock(sys.argv[1], 'mmrl train').acquire()\n"
    "    print('took', flush=True)\n"
    "except RunDirInUse:\n"
    "    print('refused', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.mark.slow
def test_processes_starting_at_the_same_moment_leave_exactly_one_holder(tmp_path):
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(tmp_path / "run"), str(go)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )  # fmt: skip
        for _ in range(3)
    ]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 3
        go.touch()  # every process polls for it every millisecond: they try at (nearly) once
        said = sorted(p.stdout.readline().strip() for p in procs)  # all still alive, holding or refused
        assert said == ["refused", "refused", "took"], said
        assert LockHolder.read(tmp_path / "run" / LOCK_NAME).pid in {p.pid for p in procs}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_in_use_only_looks_it_neither_takes_over_nor_warns(tmp_path, caplog):
    """`RunDirLock.in_use` (what `mmrl eval` reports with its other problems) says why a folder
    is refused and changes nothing: a stale lock is not in use, stays in place and is not
    announced as taken over; a live holder (this process) and an unreadable lock are named."""
    lock = RunDirLock(tmp_path, "mmrl eval", option="--output")
    assert lock.in_use() is None  # no lock at all
    stale = LockHolder(socket.gethostname(), _dead_pid(), "2026-01-01T00:00:00+0000", "mmrl train")
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale.__dict__))
    with caplog.at_level(logging.WARNING, logger="mmrl.train.rundir"):
        assert lock.in_use() is None
    assert not caplog.records and LockHolder.read(tmp_path / LOCK_NAME) == stale
    live = LockHolder.me("mmrl train")
    (tmp_path / LOCK_NAME).write_text(json.dumps(live.__dict__))
    busy = lock.in_use()
    assert f"pid {os.getpid()}" in busy and "choose another --output" in busy
    (tmp_path / LOCK_NAME).write_text("{not json")
    assert "cannot be read" in lock.in_use()
