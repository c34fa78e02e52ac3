"""The run directory: resolved config, metrics, TensorBoard events, plots, checkpoints; and its
lock (`RunDirLock`: one writer at a time)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from mmrl.config import Config, config_to_yaml
from mmrl.train.checkpoint import clean_stale_temporaries
from mmrl.train.storage import check_writable, storage_errors

log = logging.getLogger(__name__)


def run_dir_path(cfg: Config) -> Path:
    """Where the run is written (nothing is created)."""
    if cfg.trainer.run_dir:
        return Path(cfg.trainer.run_dir)
    return Path("runs") / f"{cfg.data.task}-{time.strftime('%Y%m%d-%H%M%S')}"


def create_run_dir(cfg: Config, path: Path | None = None) -> Path:
    """Create (or reopen, on resume) the run directory: refuse a finished run without --resume,
    prove the folder writable (`StorageError` naming it and the cause otherwise), remove the
    temporaries a crash mid-checkpoint left, then write the resolved config."""
    path = run_dir_path(cfg) if path is None else Path(path)
    metrics = path / "metrics.jsonl"
    if not cfg.trainer.resume and metrics.exists() and metrics.stat().st_size > 0:
        raise ValueError(
            f"{path} already holds a run (metrics.jsonl): continue it with --resume auto, or choose another "
            "trainer.run_dir"
        )
    clean_stale_temporaries(path)  # first: on a full disk the leftover may be what fills it
    check_writable(path)
    with storage_errors("write the config to", path / "config.yaml"):
        (path / "config.yaml").write_text(config_to_yaml(cfg))
    return path


# ---------------------------------------------------------------------------------------------
# One writer per run directory
# ---------------------------------------------------------------------------------------------

LOCK_NAME = "run.lock"
"""The lock file in a run directory: JSON naming the process that writes the run."""


class RunDirInUse(ValueError):
    """Another live process holds the run directory; the message names it and the fix."""


class DamagedLock(ValueError):
    """`run.lock` is not the JSON object mmrl writes; the message names the file and the fault."""


PID_LIMIT = 4_194_304
"""The largest process id Linux hands out (`PID_MAX_LIMIT`, 2**22): a lock's pid past it (or
below 1: `kill(0)` and `kill(-1)` would ask about a whole process group) names no process."""


def _json_kind(value: object) -> str:
    """What a JSON value is, in words, for a damaged lock's message."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"a string ({json.dumps(value)[:40]})"
    return f"{type(value).__name__} {json.dumps(value)[:40]}"


def _boot_id() -> str | None:
    """This boot of this machine's kernel (Linux), so a lock from before a reboot is stale."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (Linux `/proc/<pid>/stat`, field 22); None
    where unknown. Tells a live holder from a new process that reuses a dead holder's pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: count after the last ")".
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_alive(pid: int) -> bool:
    if not 0 < pid <= PID_LIMIT:  # 0 and -1 would ask about process groups, never "no such process"
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run directory (the lock file's contents)."""

    host: str
    pid: int
    start: str
    """When the holder took the lock (local time, ISO 8601)."""
    command: str
    """What it runs (`mmrl train`, `mmrl eval`, ...)."""
    boot_id: str | None = None
    pid_start: int | None = None
    """The holder process's start (`_process_start`), to detect a reused pid."""

    @classmethod
    def me(cls, command: str) -> LockHolder:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, time.strftime("%Y-%m-%dT%H:%M:%S%z"), command,
                   _boot_id(), _process_start(pid))  # fmt: skip

    @classmethod
    def read(cls, path: Path) -> LockHolder:
        """The holder `path` names; `DamagedLock` (a ValueError naming the file and what is wrong)
        when it is not the JSON object mmrl writes: not JSON, not an object (`null`, a list, a
        string), or a pid that is no process id (not a whole number, 0, negative, past
        `PID_LIMIT`). mmrl writes the lock whole (`os.replace`), so a damaged one was never a live
        run's."""
        try:
            data = json.loads(path.read_text())
        except UnicodeDecodeError as exc:
            raise DamagedLock(f"{path} is damaged: not UTF-8 text ({exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise DamagedLock(f"{path} is damaged: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise DamagedLock(
                f"{path} is damaged: a JSON object naming host and pid is expected, not {_json_kind(data)}"
            )
        pid = data.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= PID_LIMIT:
            raise DamagedLock(
                f"{path} is damaged: field 'pid': {json.dumps(pid)[:40]} is not a process id "
                f"(a whole number from 1 to {PID_LIMIT})"
            )
        host = data.get("host")
        if not isinstance(host, str):
            raise DamagedLock(f"{path} is damaged: field 'host': {json.dumps(host)[:40]} is not a host name")
        pid_start = data.get("pid_start")
        boot_id = data.get("boot_id")
        return cls(
            host,
            pid,
            str(data.get("start")),
            str(data.get("command")),
            boot_id if isinstance(boot_id, str) else None,
            pid_start if isinstance(pid_start, int) and not isinstance(pid_start, bool) else None,
        )

    def describe(self) -> str:
        return f"{self.command} (pid {self.pid} on host {self.host}, started {self.start})"

    def is_running(self) -> bool | None:
        """True / False where this host can tell (same host), None for another host's process."""
        if self.host != socket.gethostname():
            return None
        if self.boot_id and _boot_id() and self.boot_id != _boot_id():
            return False  # the machine rebooted since
        if not _pid_alive(self.pid):
            return False
        started = _process_start(self.pid)
        return self.pid_start is None or started is None or started == self.pid_start


class RunDirLock:
    """The run directory's lock: `acquire` writes `run.lock` naming this process (host, pid,
    start time, command), or refuses at once with `RunDirInUse` naming the holder and the fix;
    a lock whose holder is gone (same host, pid not running, or the machine rebooted) is taken
    over with a warning. `release` removes it (only if it is still this process's).

    Creating, taking over and removing the lock happen under an exclusive `flock` of the folder
    (`_guard`), so two processes starting at once cannot both take it. The lock itself is a
    plain file, not a held `flock`: worker processes forked by the trainer inherit open files,
    and a flock would outlive a killed trainer for as long as they do."""

    def __init__(
        self,
        run_dir: Path | str,
        command: str,
        option: str = "trainer.run_dir",
        discard_unstarted: bool = False,
    ):
        self.run_dir = Path(run_dir)
        self.option = option  # what the user sets to choose another folder
        self.path = self.run_dir / LOCK_NAME
        self.command = command
        self.holder: LockHolder | None = None
        self.created = False
        """Whether `acquire` created the folder (`release` then removes it if nothing else was
        written there: a run refused after the lock leaves no empty folder behind)."""
        self.discard_unstarted = discard_unstarted
        """A training run's lock: when the block it guards raises (a refusal after the data or
        the model loaded, a crash) before the run logged a step or wrote a checkpoint, a folder
        that `acquire` created is removed with all it holds (config.yaml, an empty metrics.jsonl,
        tracker folders), so a refused run leaves no run folder behind."""
        self.handed_over = False
        """Taken by the command line for the trainer (`take_run_dir_first`): entering it again
        keeps it instead of taking it a second time."""

    @contextlib.contextmanager
    def _guard(self):
        """An exclusive `flock` of the run directory itself, held for a few file operations. A
        file system that cannot lock a directory (NFS takes only locks of files open for writing)
        gets a guard file beside the lock instead, which then stays in the folder."""
        fd = os.open(self.run_dir, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                with open(self.run_dir / f".{LOCK_NAME}.guard", "a") as guard:
                    fcntl.flock(guard, fcntl.LOCK_EX)
                    yield
                return
            yield
        finally:
            os.close(fd)  # and with it the flock

    def acquire(self) -> RunDirLock:
        with storage_errors("take the lock of", self.path):
            self.created = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with self._guard():
                if self.path.exists():
                    self._refuse_or_take_over()
                me = LockHolder.me(self.command)
                tmp = self.path.with_name(f".{LOCK_NAME}.{me.pid}")
                tmp.write_text(json.dumps(dataclasses.asdict(me)))
                os.replace(tmp, self.path)
                self.holder = me
        return self

    def _refuse_or_take_over(self) -> None:
        busy = self.in_use()
        if busy is not None:
            raise RunDirInUse(busy)
        log.warning("%s: taking over the lock of %s, which is no longer running", self.run_dir,
                    LockHolder.read(self.path).describe())  # fmt: skip

    def in_use(self) -> str | None:
        """Why `acquire` would refuse this folder now (a live holder, an unreadable lock), or
        None (no lock, or one whose holder is gone): a read-only look, also for checks that
        report every problem before anything starts."""
        if not self.path.exists():
            return None
        try:
            holder = LockHolder.read(self.path)
        except DamagedLock as exc:  # never a live run's: mmrl writes its lock whole
            return (
                f"{self.run_dir} has a lock that cannot be read: {exc}; no mmrl run writes such a "
                f"lock. If no run is using this folder, delete {self.path}, or choose another {self.option}"
            )
        except OSError as exc:
            return (
                f"{self.run_dir} is locked by {self.path}, which cannot be read ({exc}); if no run is using "
                f"this folder, delete {self.path}, or choose another {self.option}"
            )
        running = holder.is_running()
        if running is False:
            return None
        where = "" if running else f" (on another host: this one, {socket.gethostname()}, cannot see it)"
        return (
            f"{self.run_dir} is in use by {holder.describe()}{where}: one run writes a run directory at a "
            f"time. Wait for it to finish or stop it (then continue it with --resume auto), or choose "
            f"another {self.option}. If that process is gone, delete {self.path}."
        )

    def release(self, failed: bool = False) -> None:
        """Remove the lock if it is still this process's (and the folder, if `acquire` created
        it and it is empty now; with `failed` and `discard_unstarted`, also if the run never
        started: `run_started`)."""
        if self.handed_over:
            _handed_over.pop(_key(self.run_dir), None)
        if self.holder is None:
            return
        with contextlib.suppress(OSError), self._guard():
            with contextlib.suppress(OSError, ValueError, TypeError):
                if LockHolder.read(self.path) == self.holder:
                    self.path.unlink()
                    if self.created and failed and self.discard_unstarted and not run_started(self.run_dir):
                        log.info("%s: removed (the run stopped before its first step)", self.run_dir)
                        shutil.rmtree(self.run_dir, ignore_errors=True)
                    elif self.created:
                        with contextlib.suppress(OSError):  # not empty: the run wrote there
                            self.run_dir.rmdir()
        self.holder = None

    def __enter__(self) -> RunDirLock:
        if self.handed_over and self.holder is not None:
            return self  # taken first by the command line, kept (`take_run_dir_first`)
        return self.acquire()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release(failed=exc_type is not None)


def run_started(run_dir: Path) -> bool:
    """Whether a training run in `run_dir` got anywhere worth keeping: a line in `metrics.jsonl`
    (the step-0 evaluation writes the first) or anything under `checkpoints/`."""
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return True
    checkpoints = Path(run_dir) / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.iterdir())


_handed_over: dict[Path, RunDirLock] = {}
"""Locks that the command line took for a trainer of this process, by resolved folder."""


def _key(run_dir: Path | str) -> Path:
    return Path(run_dir).resolve()


def hold_run_dir(run_dir: Path | str, command: str) -> RunDirLock:
    """`with hold_run_dir(path, "mmrl train"):` the run directory's lock for the block: the one
    `take_run_dir_first` took for this folder and command, if it did, else a new one."""
    lock = _handed_over.get(_key(run_dir))
    if lock is not None and lock.command == command and lock.holder is not None:
        return lock
    return RunDirLock(run_dir, command, discard_unstarted=True)


def take_run_dir_first(run_dir: Path | str, command: str) -> RunDirLock:
    """The run directory's lock, taken now, before the trainer loads its data or model (a second
    trainer is refused at once, not after minutes of loading), and handed to the trainer: its
    `hold_run_dir` of the same folder and command, in this process, keeps this lock. Use it in
    a `with` block around the training call; the lock is released when either block ends."""
    lock = RunDirLock(run_dir, command, discard_unstarted=True).acquire()
    lock.handed_over = True
    _handed_over[_key(run_dir)] = lock
    return lock
