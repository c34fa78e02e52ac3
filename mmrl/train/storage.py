"""Disk problems as clear errors: a full disk, a read-only folder or a missing permission while
the trainer writes its run directory, checkpoints or metrics become a `StorageError` naming the
path and the cause, instead of a raw `OSError` (or torch's `inline_container.cc ... unexpected
pos`, which is what `torch.save` raises on a full disk)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

_CAUSES = {
    errno.ENOSPC: "no space left on the device (the disk is full)",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for the file system",
    errno.EIO: "input/output error (failing disk or lost network file system)",
}


class StorageError(RuntimeError):
    """Writing to the run directory failed; the message names the path and the cause."""

    def __init__(self, message: str, path: Path | str | None = None, cause: str = ""):
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.cause = cause


def free_bytes(path: Path | str) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing parent); None if unknown."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def describe_cause(exc: BaseException, path: Path | str) -> str:
    """A short cause for a failed write: the errno's meaning (with the free space for a full
    disk), or for other errors their text and the free space left."""
    free = free_bytes(path)
    free_text = f"{_human(free)} free there" if free is not None else "free space unknown"
    if isinstance(exc, OSError) and exc.errno is not None:
        cause = _CAUSES.get(exc.errno) or exc.strerror or str(exc)
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        filename = f" at {exc.filename}" if exc.filename else ""
        extra = f"; {free_text}" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return f"{cause} ({name}{filename}){extra}"
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    hint = " (a full disk?)" if free is not None and free < 64 << 20 else ""
    return f"{type(exc).__name__}: {text}{hint}; {free_text}"


@contextlib.contextmanager
def storage_errors(what: str, path: Path | str, after: str = "") -> Iterator[None]:
    """Turn an `OSError` (or, with torch, the `RuntimeError` a failed write becomes) raised
    inside into a `StorageError`: "cannot <what> <path>: <cause>. <after>"."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        if not isinstance(exc, OSError) and not _is_write_failure(exc):
            raise
        cause = describe_cause(_as_os_error(exc), path)
        message = f"cannot {what} {path}: {cause}"
        if after:
            message += f". {after}"
        raise StorageError(message, path, cause) from exc


_RUST_IO = re.compile(r"\(os error (\d+)\)")


def _is_write_failure(exc: BaseException) -> bool:
    """torch.save's writer reports a failed write as a RuntimeError from its C++ stream;
    safetensors (Rust) as a `SafetensorError` carrying "(os error N)"."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and any(
        marker in text
        for marker in ("inline_container", "unexpected pos", "file write failed", "PytorchStreamWriter")
    ):
        return True
    return _RUST_IO.search(text) is not None


def _as_os_error(exc: BaseException) -> BaseException:
    """An `OSError` with the errno a Rust I/O error names ("(os error 28)"), else `exc`."""
    if isinstance(exc, OSError):
        return exc
    match = _RUST_IO.search(str(exc))
    if match is None:
        return exc
    code = int(match.group(1))
    return OSError(code, os.strerror(code))


def check_writable(folder: Path | str) -> None:
    """Create `folder` if needed and prove a file can be written there (before anything else is
    written), else raise `StorageError` naming the folder and the cause."""
    folder = Path(folder)
    probe = folder / f".write_probe_{os.getpid()}"
    with storage_errors("write to the run directory", folder):
        folder.mkdir(parents=True, exist_ok=True)
        try:
            with probe.open("wb") as f:
                f.write(b"ok")
                f.flush()
                os.fsync(f.fileno())
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
