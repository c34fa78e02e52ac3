"""Metrics sinks: `metrics.jsonl` and TensorBoard, always; names are `group/name[/data_source]`."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

from mmrl.train.storage import StorageError, storage_errors

log = logging.getLogger(__name__)

_AFTER = "The checkpoints already written are intact; free space and continue with --resume auto"


class MetricsLogger:
    """Appends to `metrics.jsonl` and TensorBoard. With `resume_after=k` (a resumed run), lines
    and events of steps after k (written by the run that crashed) are dropped first, so the
    files read as if the run had never stopped."""

    def __init__(self, run_dir: Path, resume_after: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        with storage_errors("write metrics to", self.path, _AFTER):
            if resume_after is not None and self.path.exists():
                kept = [
                    line
                    for line in self.path.read_text(encoding="utf-8").splitlines()
                    if _step_of(line) <= resume_after
                ]
                _rewrite(self.path, "".join(line + "\n" for line in kept))
            self._file = self.path.open("a", encoding="utf-8")
        purge = None if resume_after is None else resume_after + 1
        with storage_errors("write TensorBoard events to", run_dir / "tensorboard", _AFTER):
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step}
        for key, value in metrics.items():
            value = float(value)
            record[key] = value if math.isfinite(value) else None
            if math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        with storage_errors(f"write metrics of step {step} to", self.path, _AFTER):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close both sinks; a write that fails now (the disk still full) is logged, not raised,
        so it never hides the error that stopped the run."""
        try:
            with storage_errors("write metrics to", self.path):
                self._file.close()
        except StorageError as exc:
            log.error("%s", exc)
        with contextlib.suppress(Exception):
            self._tb.flush()
            self._tb.close()


def _rewrite(path: Path, text: str) -> None:
    """Replace `path`'s content atomically: a failed write (full disk) leaves the old file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")  # a torn last line of a killed run: dropped


def read_metrics(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
