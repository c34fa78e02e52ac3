"""Keeping Python's cyclic garbage collector off the long-lived heap.

A process that imports torch and transformers holds ~440,000 objects that live as long as it
does (modules, classes, functions, their tables). The collector's full passes walk all of them
every time the heap has grown by a quarter, so while those libraries import it runs about seven
full passes over a growing heap: 0.8 of the 3.5 CPU-seconds that importing the trainer takes, and
a 2-step `mmrl train` uses 7.0 CPU-seconds with the pause against 9.1 without (measured on the
2-core machine, `benchmarks/startup_gc.py`). None of it is garbage. This module
pauses the collector while a process imports what it needs, then freezes what was built (moves it
out of the collector's view, `gc.freeze`), so later full passes walk only what the run allocates.
Reference counting frees memory as usual throughout; only cycles wait for the collector. The
cycles the imports themselves leave behind (about 13,000 objects, 8 MiB, for the trainer) are
frozen with the rest: a one-time cost per process, not a growing one, where collecting them
first would take another full pass.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_heap() -> None:
    """Move everything allocated so far (modules, verifiers' caches) out of the garbage
    collector's view: the full collections that the per-request garbage triggers would
    otherwise walk that whole heap again and again."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def imports_without_gc() -> Iterator[None]:
    """The collector paused inside the block (a process's heavy imports), then everything built
    so far frozen, and the collector back as it was. Nested blocks leave it to the outermost."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.enable()
