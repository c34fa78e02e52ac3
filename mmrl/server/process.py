"""`mmrl serve` in a child process, for tests, benchmarks and notebooks: `start_server_process`
returns once the server is ready."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

from mmrl.server.config import ServeConfig


class ServerProcess:
    """A `mmrl serve` child process; `url` is its base URL. Stop it with `stop()` or `with`."""

    def __init__(self, proc: Any, url: str, log_path: str, tmpdir: Any):
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self._tmpdir = tmpdir

    def log_text(self) -> str:
        """Everything the server wrote to stdout/stderr so far."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout_s: float = 15.0) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._tmpdir.cleanup()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server_process(
    cfg: ServeConfig,
    *,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 180.0,
    all_workers: bool = True,
) -> ServerProcess:
    """Start `mmrl serve` with `cfg` in a child process and wait until it is ready (every worker
    warm with `all_workers`). `cfg.port` 0 picks a free loopback port. Raises `RuntimeError`
    with the server's log if it exits or does not become ready in time."""
    import subprocess
    import tempfile
    import urllib.request

    from omegaconf import OmegaConf

    cfg.validate()
    port = cfg.port
    bind = cfg.bind_address()
    if port == 0:
        with socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET) as s:
            s.bind((bind, 0))
            port = s.getsockname()[1]
    tmpdir = tempfile.TemporaryDirectory(prefix="mmrl-serve-")
    config_path = os.path.join(tmpdir.name, "serve.yaml")
    with open(os.open(config_path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    log_path = os.path.join(tmpdir.name, "serve.log")
    code = "import sys; from mmrl.server import main; sys.exit(main(sys.argv[1:]))"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "--config", config_path, "--port", str(port)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    host = f"[{bind}]" if ":" in bind else bind
    server = ServerProcess(proc, f"http://{host}:{port}", log_path, tmpdir)
    wanted = cfg.resolved_workers() if all_workers else 1
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            text = server.log_text()
            server.stop()
            raise RuntimeError(f"the reward server exited with status {proc.returncode}:\n{text}")
        try:
            with urllib.request.urlopen(server.url + "/ready", timeout=2) as answer:
                if json.loads(answer.read())["workers_ready"] >= wanted:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            text = server.log_text()
            server.stop()
            raise RuntimeError(f"the reward server was not ready after {ready_timeout_s:g}s:\n{text}")
        time.sleep(0.1)
