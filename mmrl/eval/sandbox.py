"""Running untrusted model-written Python (MEGA-Bench's `program_judge`) in a sandbox.

Each run is a fresh process tree, isolated with Linux namespaces (no root needed: a user
namespace grants the rest):

- **its own filesystem**: a read-only tmpfs root holding only read-only views of the Python
  runtime (`/usr`, `/lib`, `/lib64`, `/bin`, the interpreter's prefix) and `/dev/null`,
  `/dev/zero`, `/dev/urandom`, plus a fresh scratch folder at `/work` (the only writable place,
  deleted afterwards). `/etc`, `/home`, `/root`, `/tmp`, the repository and everything else of
  the host are not there to read or write;
- **no network**: a new network namespace without interfaces (only a down loopback);
- **its own PID namespace**: the program is PID 1, so when it ends every process it started
  ends with it;
- **limits**: wall-clock time (from the moment the program starts), CPU time, address space
  (memory), processes (a fork bomb stops at the limit), file size, and output size.

Where Linux namespaces are unavailable the sandbox refuses to run (`SandboxUnavailable`):
model-written code is never executed without it.

`run_program` reproduces MEGA-Bench's `CodeTester` semantics inside the sandbox: input lines are
served by `input()` (running out raises `StopIteration`), `sys.stdin` is empty, what `print`s to
`sys.stdout` is the output (right-stripped), an exception gives `ERROR during execution: <msg>`,
and a program without the exact text `if __name__ == "__main__":` is run as MEGA-Bench runs it
(inside a function's namespace, under a module name that is not `__main__`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TIME_LIMIT_S = 2.0
"""MEGA-Bench's per-test-case wall-clock limit."""
MEMORY_LIMIT_MB = 512
"""Address-space limit of the sandboxed process."""
MAX_PROCESSES = 16
"""Processes the program may have at once (fork bombs stop here)."""
MAX_OUTPUT_BYTES = 1 << 20
"""Output beyond this is cut (the process is killed)."""
MAX_FILE_BYTES = 16 << 20
"""Largest file the program may write in its scratch folder."""
SETUP_TIMEOUT_S = 20.0
"""Time allowed to build the sandbox before the program starts (not counted in its limit)."""

_LAUNCHER = Path(__file__).with_name("_sandbox_child.py")


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate a program (no user/mount/network namespaces)."""


@dataclass
class ProgramRun:
    """What one sandboxed run produced."""

    output: str
    """MEGA-Bench's output string: the captured stdout (right-stripped) or an `ERROR...` text."""
    status: str
    """`ok`, `error` (the program raised), `timeout`, `no_output` (it exited without a result,
    e.g. `sys.exit`), `killed` (a limit or a signal) or `output_limit`."""


def run_program(
    code: str,
    input_lines: list[str],
    *,
    time_limit_s: float = TIME_LIMIT_S,
    memory_mb: int = MEMORY_LIMIT_MB,
    max_processes: int = MAX_PROCESSES,
) -> ProgramRun:
    """Run `code` in a fresh sandbox with `input_lines` as the lines `input()` returns."""
    scratch = Path(tempfile.mkdtemp(prefix="mmrl-sandbox-"))
    work = scratch / "work"
    work.mkdir()
    os.chmod(scratch, 0o700)
    config = {
        "code": code,
        "lines": list(input_lines),
        "work": str(work),
        "root": str(scratch / "root"),
        "python": os.path.realpath(sys.executable),
        "prefixes": sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}),
        "memory_bytes": int(memory_mb) << 20,
        "cpu_s": int(time_limit_s) + 2,
        "processes": int(max_processes),
        "file_bytes": MAX_FILE_BYTES,
    }
    try:
        proc = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", "-S", "-B", str(_LAUNCHER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=scratch,
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"},
        )
        try:
            return _drive(proc, json.dumps(config).encode(), time_limit_s)
        finally:
            _kill(proc)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _drive(proc: subprocess.Popen, config: bytes, time_limit_s: float) -> ProgramRun:
    import selectors

    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(config)
    proc.stdin.close()
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    out = bytearray()
    started: float | None = None
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if started is None:
                raise SandboxUnavailable("the sandbox did not start in time")
            return ProgramRun("ERROR: Code execution exceeded the time limit.", "timeout")
        if not selector.select(remaining):
            continue
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        out += chunk
        if started is None and out[:1] == b"R":  # the program starts now: its clock too
            started = time.monotonic()
            deadline = started + time_limit_s
            del out[:1]
        elif started is None and out[:1] == b"U":
            proc.wait()
            raise SandboxUnavailable(proc.stderr.read().decode(errors="replace").strip()[-500:])
        if len(out) > MAX_OUTPUT_BYTES + 4096:
            return ProgramRun("ERROR: the program's output exceeded the limit.", "output_limit")
    proc.wait()
    if started is None:
        raise SandboxUnavailable(proc.stderr.read().decode(errors="replace").strip()[-500:] or "no start")
    text = out.decode("utf-8", errors="replace")
    marker = text.rfind("\x00RESULT\x00")
    if marker < 0:
        # Died without reporting (sys.exit, os._exit, a limit, a signal): MEGA-Bench's queue
        # stays empty and it reports this text.
        status = "no_output" if proc.returncode == 0 else "killed"
        return ProgramRun("ERROR: No output was produced before timeout.", status)
    try:
        result = json.loads(text[marker + len("\x00RESULT\x00") :])
    except json.JSONDecodeError:
        return ProgramRun("ERROR: No output was produced before timeout.", "killed")
    return ProgramRun(str(result.get("output", "")), str(result.get("status", "ok")))
