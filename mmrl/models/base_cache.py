"""The cache of built-in bases (the VLM's, `mmrl.models.base`, and the image base,
`mmrl.models.image_base`): one folder per key under `<cache>/bases/`, built once.

A base is warmed up into a temporary folder and renamed into place, so a half-written one is
never picked up; processes that need the same missing base at once (test workers, several runs
on one node) build it once: the first holds a file lock while it builds, the others wait and
then find it. The random generators are left as they were: a warm-up draws from them, and a
caller must sample the same whether its base was built or found in the cache.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

SaveFn = Callable[[Path], None]


def cache_root(cache_dir: str | None = None) -> Path:
    """`cache_dir`, else `$MMRL_CACHE`, else `~/.cache/mmrl`."""
    return Path(cache_dir or os.environ.get("MMRL_CACHE") or Path.home() / ".cache" / "mmrl")


def cached_base(path: Path, what: str, warm_up: Callable[[], tuple[SaveFn, dict]]) -> Path:
    """`path` if it holds a finished base; else build it: `warm_up()` returns a function that
    saves the base into a folder and the warm-up's report (written as `warmup.json`, the marker
    of a finished base)."""
    if (path / "warmup.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if (path / "warmup.json").exists():
            return path  # another process built it while this one waited
        log.info("building %s once, in %s (later runs load it from there)", what, path)
        from mmrl.train.checkpoint import rng_state, set_rng_state

        state = rng_state()
        try:
            save, report = warm_up()
        finally:
            set_rng_state(state)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        save(tmp)
        (tmp / "warmup.json").write_text(json.dumps(report, indent=2))
        try:
            tmp.rename(path)  # atomic: a half-written base is never picked up
        except OSError:  # a filesystem without working locks: another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return path
