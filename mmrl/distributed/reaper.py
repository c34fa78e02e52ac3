"""Removes the Ray processes a driver started if the driver dies without stopping them.

When `mmrl train` starts its own Ray (no `trainer.ray_address`), Ray's head processes are the
driver's children: the GCS server, the raylet and, under it, `ray::DashboardAgent`,
`ray::RuntimeEnvAgent` and the actors. `ray.shutdown()` stops them on a normal exit. A driver
killed with SIGKILL cannot: the agents (about 100 MB each) were left running, ignoring SIGTERM.

The reaper is a small process of its own session (a Ctrl-C to the terminal's process group does
not reach it), started by the driver right after `ray.init`:

    python -m mmrl.distributed.reaper DRIVER_PID

Until its standard input closes (the driver exits or dies: the pipe's only writer is gone), it
records every descendant of the driver once a second, by pid and start time. If the driver said
`done` first (`RayCluster.shutdown`, after `ray.shutdown()`), it exits and touches nothing: the
driver may still be using other children (a tracker's process, verifier workers). Otherwise the
driver died: it kills each recorded process that is still running with the same start time (a
pid since reused by another process is left alone), and their descendants. Reads only `/proc`
through psutil.
"""

from __future__ import annotations

import os
import select
import sys
import time

POLL_S = 1.0
"""How often the reaper records the driver's descendants."""


def _descendants(pid: int) -> dict[int, float]:
    import psutil

    me = os.getpid()  # the reaper is one of them: never its own victim
    try:
        return {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=True) if p.pid != me}
    except psutil.Error:
        return {}


def reap(known: dict[int, float]) -> list[int]:
    """SIGKILL every process in `known` (pid -> start time) still running as itself, and its
    descendants; returns the pids killed."""
    import psutil

    victims: dict[int, psutil.Process] = {}
    for pid, started in known.items():
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - started) > 1e-3:
                continue  # the pid now belongs to another process
            victims[pid] = proc
            for child in proc.children(recursive=True):
                victims.setdefault(child.pid, child)
        except psutil.Error:
            continue
    killed = []
    for pid, proc in victims.items():
        try:
            proc.kill()
            killed.append(pid)
        except psutil.Error:
            pass
    psutil.wait_procs(list(victims.values()), timeout=10)
    return killed


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    driver = int(args[0])
    known: dict[int, float] = {}
    fd = sys.stdin.fileno()
    said = b""
    while True:
        known.update(_descendants(driver))
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:  # end of file: the driver is done or gone
                break
            said += chunk
    if b"done" in said:
        return 0
    time.sleep(0.2)
    killed = reap(known)
    if killed:
        print(
            f"mmrl: removed {len(killed)} processes left by driver {driver} (pids {killed})", file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
