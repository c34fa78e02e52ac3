"""Bounded, non-blocking looks at files named by users (configs, sample files, image paths):
only regular files are opened, since opening a FIFO blocks until a writer appears and reading a
device such as `/dev/zero` never ends."""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_DATA_FILE_BYTES = 4 << 30
"""Largest data file (sample file, prompt file, annotation file) that is read whole into memory
(4 GiB). A larger one is refused with a message saying how to read it in pieces instead."""

_KINDS = (
    (stat.S_ISREG, "regular file"),
    (stat.S_ISDIR, "folder"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def file_kind(path: str | Path) -> str:
    """What `path` is, in words (`regular file`, `folder`, `FIFO (named pipe)`, `character
    device`, `block device`, `socket`), from `os.stat`, which never blocks. A missing path is
    `FileNotFoundError`."""
    mode = os.stat(path).st_mode
    for test, name in _KINDS:
        if test(mode):
            return name
    return "special file"


def not_a_regular_file(path: str | Path) -> str | None:
    """`"is a FIFO (named pipe), not a regular file"` for an existing path that is not a regular
    file (symbolic links followed), else None (a regular file, or nothing there: the caller's
    open reports that)."""
    try:
        kind = file_kind(path)
    except OSError:
        return None
    return None if kind == "regular file" else f"is a {kind}, not a regular file"


def size_in_words(n: int) -> str:
    """`3.2 GiB`, `12 MiB`, `512 KiB`: a byte count for messages."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.1f} {unit}" if value < 10 and value != int(value) else f"{value:.0f} {unit}"
    return f"{n} bytes"


def check_file(path: str | Path, limit: int | None = None, hint: str = "") -> int:
    """The size of `path`, a regular file of at most `limit` bytes (default
    `MAX_DATA_FILE_BYTES`) that is about to be read whole; otherwise a `ValueError` naming the
    path and what it is (a FIFO, a device, ...) or its size, followed by `hint` (how else to
    read it). Missing: `FileNotFoundError`."""
    limit = MAX_DATA_FILE_BYTES if limit is None else limit
    problem = not_a_regular_file(path)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    size = os.stat(path).st_size
    if size > limit:
        raise ValueError(
            f"{path}: {size_in_words(size)}, more than the {size_in_words(limit)} a file read whole may have{hint}"
        )
    return size


def read_file(path: str | Path, limit: int | None = None, hint: str = "") -> bytes:
    """The bytes of `path`, checked by `check_file` first and read no further than `limit` (a
    file that grows meanwhile, or one whose size the kernel reports as 0, such as those under
    /proc, is refused past it)."""
    limit = MAX_DATA_FILE_BYTES if limit is None else limit
    check_file(path, limit, hint)
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: more than the {size_in_words(limit)} a file read whole may have{hint}")
    return data
