"""One clear line instead of a traceback (issue 48, item 16): a missing `reward.plugins` module
(train and serve), an unknown reward-model type, a damaged `run.lock` (`null`, a list, a string,
pid "abc", pid 10**30, pid 0 or -1), and `mmrl eval --output` on a read-only folder or a full
disk (simulated: the writes raise the errno)."""

from __future__ import annotations

import errno
import importlib.util
import json
from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.train.rundir import LOCK_NAME, DamagedLock, LockHolder, RunDirInUse, RunDirLock

DAMAGED = {
    "null": ("null", "not null"),
    "a list": ("[1, 2]", "not a list"),
    "a string": ('"abc"', 'not a string ("abc")'),
    "pid abc": ('{"host": "h", "pid": "abc"}', "field 'pid': \"abc\" is not a process id"),
    "pid 10**30": (json.dumps({"host": "h", "pid": 10**30}), f"field 'pid': {10**30} is not a process id"),
    "pid 0": ('{"host": "h", "pid": 0}', "field 'pid': 0 is not a process id"),
    "pid -1": ('{"host": "h", "pid": -1}', "field 'pid': -1 is not a process id"),
    "pid true": ('{"host": "h", "pid": true}', "field 'pid': true is not a process id"),
    "no host": ('{"pid": 5}', "field 'host': null is not a host name"),
}


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_lock_is_refused_naming_the_file_and_the_fault(tmp_path, case):
    """Before: `null`/a list/a string raised AttributeError, pid "abc" TypeError, pid 10**30
    OverflowError, and pid 0 or -1 counted as a live holder forever (kill(0) and kill(-1) ask
    about process groups)."""
    text, fault = DAMAGED[case]
    (tmp_path / LOCK_NAME).write_text(text)
    with pytest.raises(DamagedLock, match="is damaged") as info:
        LockHolder.read(tmp_path / LOCK_NAME)
    assert str(tmp_path / LOCK_NAME) in str(info.value) and fault in str(info.value)
    lock = RunDirLock(tmp_path, "mmrl train")
    busy = lock.in_use()
    assert busy is not None and fault in busy
    assert f"delete {tmp_path / LOCK_NAME}" in busy and "choose another trainer.run_dir" in busy
    assert "in use by" not in busy  # not a live holder
    with pytest.raises(RunDirInUse, match="damaged"):
        lock.acquire()
    assert (tmp_path / LOCK_NAME).read_text() == text  # left as it was, for the user to look at


def test_train_refuses_a_damaged_lock_on_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).write_text('{"host": "h", "pid": 0}')
    assert main(["train", f"trainer.run_dir={run_dir}", "trainer.progress=false"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("mmrl train: error: ") and "pid': 0 is not a process id" in line


def test_a_lock_with_a_pid_past_the_limit_names_no_live_process():
    assert LockHolder("h", 10**30, "", "mmrl train").is_running() in (None, False)
    import socket

    for pid in (0, -1, 10**30):
        assert LockHolder(socket.gethostname(), pid, "", "mmrl train").is_running() is False


# --- plugins and reward models ---------------------------------------------------------------
def test_train_names_a_missing_plugin_module_on_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    status = main(["train", "reward.plugins=[no_such_plugin_module]", f"trainer.run_dir={run_dir}"])
    assert status == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("mmrl train: reward.plugins[0]: cannot import module 'no_such_plugin_module'")
    assert "PYTHONPATH" in line
    assert not run_dir.exists()


@pytest.mark.skipif(importlib.util.find_spec("fastapi") is None, reason="the serve extra is not installed")
def test_serve_names_a_missing_plugin_module_on_one_line(tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text("plugins: [no_such_plugin_module]\n")
    assert main(["serve", "--config", str(config)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("mmrl serve: plugins[0]: cannot import module 'no_such_plugin_module'")


def test_train_names_an_unknown_reward_model_type_on_one_line(tmp_path, capsys):
    """Before: `KeyError: "unknown reward model 'no_such_type' ..."` with a traceback, after the
    data and the policy had loaded."""
    config = tmp_path / "run.yaml"
    config.write_text("reward:\n  model_rewards:\n    models:\n      - {name: judge, type: no_such_type}\n")
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(config), f"trainer.run_dir={run_dir}"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(
        "mmrl train: reward.model_rewards.models[0].type: unknown reward model type 'no_such_type' (known: "
    )
    assert "aesthetic" in line and not run_dir.exists()


# --- mmrl eval --output ----------------------------------------------------------------------
def _fake_model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_eval_output_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys, code):
    """A read-only --output folder (EROFS; as root, chmod does not make one) or a full disk
    (ENOSPC): every write under it fails. Before: a traceback from the lock's write."""
    out = tmp_path / "out"
    real = Path.write_text

    def failing(self, *args, **kwargs):
        if out in self.parents or self == out:
            raise OSError(code, "simulated", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing)
    status = main(["eval", "--model", str(_fake_model(tmp_path)), "--output", str(out), "--max-queries", "1"])
    assert status == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("mmrl eval: error: cannot ") and str(out) in line
    cause = "read-only" if code == errno.EROFS else "no space left on the device"
    assert cause in line


def test_eval_results_on_a_full_disk_name_the_file_and_keep_the_finished_queries(tmp_path, monkeypatch):
    from mmrl.eval import runner
    from mmrl.train.storage import StorageError

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runner, "plot_results", full)
    monkeypatch.setattr(runner, "results_markdown", lambda result: "x")

    class Result:
        def to_json(self):
            return {}

    with pytest.raises(StorageError) as info:
        runner.write_outputs(Result(), tmp_path)
    message = str(info.value)
    assert str(tmp_path / "results.png") in message and "disk is full" in message
    assert "rerun the same command to continue" in message
    cache = runner.RecordCache(tmp_path)
    monkeypatch.setattr(Path, "open", full)
    with pytest.raises(StorageError, match="queries.jsonl"):
        cache.put({"task": "t", "query_idx": 0})
