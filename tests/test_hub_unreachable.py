"""An unreachable hub without `HF_HUB_OFFLINE`: one short request, then one clear error that
suggests `HF_HUB_OFFLINE=1` or a local folder, with no page of retry warnings (it used to take
162 s and ~60 warning lines for a model, 222 s for `mmrl eval`).

The hub is a local port that takes connections, reads their request line and never answers;
`HF_HUB_OFFLINE` is unset only inside the subprocesses, whose hub cache is empty."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading

import pytest


@dataclasses.dataclass
class SilentHub:
    url: str
    """`http://127.0.0.1:<port>`"""
    received: list[str]
    """The request line of every connection so far."""


@pytest.fixture(scope="module")
def silent_hub():
    """A hub that takes every connection, reads its request line and never answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    hub = SilentHub(f"http://127.0.0.1:{sock.getsockname()[1]}", [])
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:  # closed at teardown
                return
            held.append(conn)  # kept open, never answered
            hub.received.append(conn.makefile("rb").readline().decode("latin-1").strip())

    threading.Thread(target=serve, daemon=True).start()
    yield hub
    sock.close()
    for conn in held:
        conn.close()


def _online_env(endpoint: str, tmp_path) -> dict[str, str]:
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"))
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_CACHE"):
        env.pop(key, None)
    env["MMRL_HUB_TIMEOUT"] = "1"  # each test waits this long for the silent hub
    return env


def _run(args: list[str], env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd)


def _assert_one_clear_error(out: subprocess.CompletedProcess, what: str) -> None:
    assert "Retrying in" not in out.stderr and "thrown while requesting" not in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert what in out.stderr, out.stderr[-3000:]
    assert "did not answer within 1 s" in out.stderr
    assert "Set HF_HUB_OFFLINE=1 to use only the local cache, or pass a local folder instead" in out.stderr


def test_train_and_check_with_a_hub_model_fail_fast_suggesting_the_flag(silent_hub, tmp_path):
    env = _online_env(silent_hub.url, tmp_path)
    for command in ("train", "check"):
        out = _run(["-m", "mmrl.cli", command, "--model", "some-org/some-vlm"], env, tmp_path)
        assert out.returncode == 2, out.stderr[-3000:]
        _assert_one_clear_error(
            out, f"mmrl {command}: model.path: some-org/some-vlm (not in the local cache): the hub at"
        )
        assert out.stderr.count("\n") == 1  # one line, nothing else
        assert not (tmp_path / "runs").exists()


def test_eval_with_a_hub_model_fails_fast_suggesting_the_flag(silent_hub, tmp_path):
    out = _run(
        ["-m", "mmrl.cli", "eval", "--model", "some-org/some-vlm"],
        _online_env(silent_hub.url, tmp_path),
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    _assert_one_clear_error(out, "mmrl eval: --model: some-org/some-vlm (not in the local cache): the hub at")


def test_load_policy_and_a_hub_dataset_fail_fast_suggesting_the_flag(silent_hub, tmp_path):
    """The library entry points too: `load_policy` (what eval, judges and the trainer call) and a
    hub id in `data.train_files`."""
    code = (
        "import sys\n"
        "from mmrl.models.loading import load_policy\n"
        "from mmrl.datasets.sources import read_source\n"
        "for call in (lambda: load_policy('some-org/some-vlm'), lambda: read_source('some-org/some-data@train')):\n"
        "    try:\n"
        "        call()\n"
        "    except (OSError, ValueError) as exc:\n"
        "        print(f'{type(exc).__name__}: {exc}', file=sys.stderr)\n"
    )
    out = _run(["-c", code], _online_env(silent_hub.url, tmp_path), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    _assert_one_clear_error(
        out, "ModelNotFoundError: model 'some-org/some-vlm' (no local folder of that name"
    )
    assert lines[1].startswith(
        "ValueError: data source 'some-org/some-data@train': hub dataset 'some-org/some-data'"
    )
    assert "did not answer within 1 s" in lines[1] and "HF_HUB_OFFLINE=1" in lines[1]


def test_the_only_request_is_the_one_that_is_timed(silent_hub, tmp_path):
    """huggingface_hub builds each request's user agent by first fetching the hub's agent-harness
    registry, with a 3 s time-out of its own (a fresh HF_HOME has no copy of it): on a silent hub
    that was a second wait before the timed request (`mmrl check` ended after 9.7 s, 6.5 s
    without it, at the default 5 s time-out). The hub is asked once."""
    before = len(silent_hub.received)
    out = _run(
        ["-m", "mmrl.cli", "check", "--model", "some-org/some-vlm"],
        _online_env(silent_hub.url, tmp_path),
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "did not answer within 1 s" in out.stderr
    received = silent_hub.received[before:]
    assert len(received) == 1, received
    assert received[0].startswith("GET /api/models/some-org/some-vlm"), received
