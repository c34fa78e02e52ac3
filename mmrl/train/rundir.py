"""The run directory: resolved config, metrics, TensorBoard events, plots, checkpoints."""

from __future__ import annotations

import time
from pathlib import Path

from mmrl.config import Config, config_to_yaml


def create_run_dir(cfg: Config) -> Path:
    if cfg.trainer.run_dir:
        path = Path(cfg.trainer.run_dir)
    else:
        path = Path("runs") / f"{cfg.data.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    metrics = path / "metrics.jsonl"
    if not cfg.trainer.resume and metrics.exists() and metrics.stat().st_size > 0:
        raise ValueError(
            f"{path} already holds a run (metrics.jsonl): continue it with --resume auto, or choose another "
            "trainer.run_dir"
        )
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(config_to_yaml(cfg))
    return path
