"""The run directory: resolved config, metrics, TensorBoard events, plots, checkpoints."""

from __future__ import annotations

import time
from pathlib import Path

from mmrl.config import Config, config_to_yaml
from mmrl.train.checkpoint import clean_stale_temporaries
from mmrl.train.storage import check_writable, storage_errors


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
