"""Crash-safe checkpoints and exact resume.

A checkpoint is a folder `<run_dir>/checkpoints/step_<n>/` holding:

    model/              the policy in Hugging Face format (LoRA: the adapters) + processor
    sharded/            the trained weights and the optimizer state, one shard per training
                        process (torch DCP, `mmrl.train.sharded`): resumable on another number
                        of processes (DeepSpeed groups and critic runs: in trainer_state.pt)
    trainer_state.pt    optimizer (unless sharded), scheduler, RNG states (Python, NumPy, torch), the prompt
                        sampler's position, step counters and the evaluation trackers (and
                        with a critic, `algo.advantage=gae` / `turn_gae`, its value head)
    config.yaml         the resolved config
    manifest.json       every file's size and SHA-256, written last

It is written to a temporary folder and renamed into place, so a crash never leaves a
half-written `step_<n>`; temporaries a crash left behind are removed on the next start
(`clean_stale_temporaries`). A failed write (full disk, read-only folder) raises `StorageError`
naming the path and the cause, removes its temporary folder and leaves earlier checkpoints
alone. On resume the newest checkpoint whose files all match their manifest is used; a damaged
one (no manifest, an empty or partial manifest, a missing, truncated or corrupted file) is
skipped with a warning naming what is wrong. Retention keeps the
`keep_last` newest and, with `keep_best`, the one with the best held-out accuracy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.train.storage import StorageError, storage_errors

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE = "trainer_state.pt"
TMP_PREFIX = ".tmp_step_"
OLD_PREFIX = ".old_step_"
PROGRESS_MIN_BYTES = 1 << 30
"""Checkpoints of models with at least this many bytes of parameters show a progress bar on a
terminal while they are written: the weights, the trainer state, the checksums, the sync."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    metric: float | None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    processor: Any,
    trainer_state: dict[str, Any],
    config_yaml: str,
    metric: float | None = None,
    write_more: Callable[[Path], Callable[[], None] | None] | None = None,
) -> Path:
    """Write checkpoint `step` atomically; returns its folder (`start_checkpoint`, waited for).

    A failed write (full disk, read-only folder, ...) removes the temporary folder and raises
    `StorageError` naming the path and the cause; the checkpoints already there are untouched."""
    return start_checkpoint(
        run_dir, step, model, processor, trainer_state, config_yaml, metric, write_more
    ).wait()


class PendingCheckpoint:
    """A checkpoint being sealed: its last part (`seal`: in the background, the model's weights
    first; waiting for the shards, the checksums, the manifest, the sync, the rename into place)
    runs on a background thread, or here at once when not `background`. `wait()` returns its
    folder or raises what went wrong."""

    def __init__(
        self, step: int, seal: Callable[[], Path], background: bool, weights_written: threading.Event
    ):
        self.step = step
        self.weights_written = weights_written
        """Set once the model's weights are on disk: until then the live weights must not change."""
        self._folder: Path | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, args=(seal,), name=f"mmrl-checkpoint-{step}", daemon=True
            )
            self._thread.start()
        else:
            self._folder = seal()

    def _run(self, seal: Callable[[], Path]) -> None:
        try:
            self._folder = seal()
        except BaseException as exc:  # noqa: BLE001 - handed to the loop in wait()
            self._error = exc

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait_for_weights(self) -> None:
        """Until the model's weights are written (the loop may then change them); raises what
        went wrong if the checkpoint failed before that."""
        while not self.weights_written.wait(timeout=0.1):
            if self.done():
                self.wait()  # raises the failure
                return

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._folder is not None
        return self._folder


def start_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    processor: Any,
    trainer_state: dict[str, Any],
    config_yaml: str,
    metric: float | None = None,
    write_more: Callable[[Path], Callable[[], None] | None] | None = None,
    background: bool = False,
    then: Callable[[Path], None] | None = None,
) -> PendingCheckpoint:
    """Write checkpoint `step`'s files into a temporary folder here (the weights in Hugging Face
    format, the trainer state, the config, and what `write_more(folder)` writes or starts: the
    sharded training state, `mmrl.train.sharded`; it may return a function that waits until its
    files are complete). Then seal it: wait for those files, checksum every file into the
    manifest, sync, rename the folder into place, call `then(folder)` (retention); with
    `background`, on a thread (`PendingCheckpoint`), so the loop goes on meanwhile, and the
    Hugging Face weights are written first on that thread, from the live model: the caller must
    not change them before `PendingCheckpoint.wait_for_weights()` returns. Until it is
    renamed, the checkpoint does not exist for a resume: a crash while sealing leaves the earlier
    checkpoints in use and a temporary folder that the next start removes.

    A failed write (full disk, read-only folder, ...) removes the temporary folder and raises
    `StorageError` naming the path and the cause (from `wait()` when in the background); the
    checkpoints already there are untouched."""
    from mmrl.progress import ProgressBar

    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f"{TMP_PREFIX}{step:08d}_{os.getpid()}"
    params = model.parameters() if hasattr(model, "parameters") else ()  # flow-GRPO saves a weights holder
    large = sum(p.numel() * p.element_size() for p in params) >= PROGRESS_MIN_BYTES
    # A large model's checkpoint takes minutes: a bar on a terminal (tqdm's None: only on a TTY);
    # none when another thread seals it (under the loop's own bar).
    bar = ProgressBar(total=4, desc=f"checkpoint step {step}", unit="part",
                      disable=None if large and not background else True, leave=False)  # fmt: skip

    @contextlib.contextmanager
    def removed_on_failure():
        try:
            with storage_errors(f"write checkpoint step {step} to", tmp):
                yield
        except StorageError as exc:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; never a half checkpoint
            bar.close()
            good = find_resume_checkpoint(run_dir, quiet=True)
            where = (
                f"the last good checkpoint {good.path} is intact" if good else "no earlier checkpoint exists"
            )
            raise StorageError(
                f"{exc}. The partial checkpoint was removed and {where}; free space (or fix the folder's "
                "permissions) and continue with --resume auto",
                exc.path,
                exc.cause,
            ) from exc.__cause__
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            bar.close()
            raise

    weights_written = threading.Event()

    def write_weights() -> None:
        bar.set_postfix_str("weights")
        model.save_pretrained(tmp / "model")
        processor.save_pretrained(tmp / "model")
        bar.update(1)
        weights_written.set()

    with removed_on_failure():
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "model").mkdir(parents=True)
        if not background:
            write_weights()
        bar.set_postfix_str("trainer state")
        torch.save({**trainer_state, "rng": rng_state(), "step": step}, tmp / STATE)
        (tmp / "config.yaml").write_text(config_yaml)
        more_done = write_more(tmp) if write_more is not None else None
        bar.update(1)

    def seal() -> Path:
        with removed_on_failure():
            if background:  # from the live model: the loop waits for it before changing them
                write_weights()
            if more_done is not None:
                more_done()
            bar.set_postfix_str("checksums")
            files = {
                str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            manifest = {"step": step, "metric": metric, "time": time.time(), "files": files}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            bar.update(1)
            bar.set_postfix_str("sync")
            for f in [*tmp.rglob("*"), tmp]:  # flush file contents before the rename makes them visible
                if f.is_file():
                    with f.open("rb") as fh:
                        os.fsync(fh.fileno())
            bar.update(1)
            old = None
            if final.exists():  # e.g. the final checkpoint after a periodic one at the same step
                old = root / f"{OLD_PREFIX}{step:08d}_{os.getpid()}"
                os.replace(final, old)  # moved aside, not deleted, until the new one is in place
            os.replace(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        bar.close()
        if then is not None:
            then(final)
        return final

    return PendingCheckpoint(step, seal, background, weights_written)


def clean_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove the temporary folders (`.tmp_step_*`, `.old_step_*`) a crash mid-checkpoint left in
    `<run_dir>/checkpoints` (each can be as large as a checkpoint: on a small disk the leftover
    alone can keep the disk full). Call on start, before the run writes anything; returns what
    was removed (each logged)."""
    root = Path(run_dir) / "checkpoints"
    removed = []
    if not root.is_dir():
        return removed
    for p in sorted([*root.glob(f"{TMP_PREFIX}*"), *root.glob(f"{OLD_PREFIX}*")]):
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0
        with storage_errors("remove the stale temporary checkpoint", p):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
        log.warning("removed %s, left by a checkpoint write that did not finish (%d bytes freed)", p, size)
        removed.append(p)
    return removed


def _required_files_problem(path: Path, names: set[str]) -> str | None:
    """What `save_checkpoint` always writes must be listed: the trainer state, the config and,
    when there is a `model/` folder, the files in it."""
    if STATE not in names:
        return f"the manifest does not list {STATE}"
    if "config.yaml" not in names:
        return "the manifest does not list config.yaml"
    if (path / "model").is_dir() and not any(n.startswith("model/") for n in names):
        return "the manifest lists no model files"
    return None


def verify_checkpoint(path: Path) -> str | None:
    """None if the checkpoint is complete and every file matches the manifest, else what is
    wrong. The manifest must list the trainer state, the config and the model weights, and
    every file in the folder must be listed (so a manifest that lists nothing verifies nothing)."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        return "not a folder"
    if not manifest_path.exists():
        return f"no {MANIFEST} (an incomplete checkpoint, or the manifest was deleted)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    except OSError as exc:
        return f"cannot read {MANIFEST}: {exc}"
    if not isinstance(manifest, dict):
        return f"{MANIFEST} is not a JSON object"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"{MANIFEST} has no 'files' table"
    if not files:
        return f"{MANIFEST} lists no files"
    if (problem := _required_files_problem(path, set(files))) is not None:
        return problem
    for name, info in files.items():
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("bytes"), int)
            or not isinstance(info.get("sha256"), str)
        ):
            return f"{MANIFEST}: entry {name!r} needs 'bytes' and 'sha256'"
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        if f.stat().st_size != info["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {info['bytes']} (truncated?)"
        if _sha256(f) != info["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    unlisted = sorted(
        str(p.relative_to(path))
        for p in path.rglob("*")
        if p.is_file()
        and p.name != MANIFEST
        and not p.name.startswith(".")  # .DS_Store, .nfs* and the like are not checkpoint files
        and str(p.relative_to(path)) not in files
    )
    if unlisted:
        return f"files not in the manifest: {', '.join(unlisted[:5])}"
    return None


def _step_of_folder(p: Path) -> int | None:
    try:
        return int(p.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return None


def _manifest_info(p: Path) -> tuple[int | None, float | None]:
    """(step, metric) from a checkpoint's manifest, falling back to the folder's name."""
    step, metric = _step_of_folder(p), None
    try:
        info = json.loads((p / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return step, None
    if isinstance(info, dict):
        if isinstance(info.get("step"), int):
            step = info["step"]
        if isinstance(info.get("metric"), (int, float)):
            metric = float(info["metric"])
    return step, metric


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete-looking checkpoints (a manifest exists), oldest first; temporary folders ignored."""
    return [c for c in list_checkpoint_folders(run_dir) if (c.path / MANIFEST).exists()]


def list_checkpoint_folders(run_dir: Path) -> list[Checkpoint]:
    """Every `step_*` folder (with or without a manifest), oldest first; temporary folders and
    names that carry no step number are ignored."""
    root = Path(run_dir) / "checkpoints"
    out = []
    for p in sorted(root.glob("step_*")) if root.is_dir() else []:
        if not p.is_dir():
            continue
        step, metric = _manifest_info(p)
        if step is None:
            log.warning("ignoring %s: its name carries no step number", p)
            continue
        out.append(Checkpoint(p, step, metric))
    return sorted(out, key=lambda c: c.step)


def damaged_checkpoints(run_dir: Path) -> list[tuple[Checkpoint, str]]:
    """Every checkpoint folder that does not verify, with what is wrong, oldest first."""
    out = []
    for ckpt in list_checkpoint_folders(run_dir):
        problem = verify_checkpoint(ckpt.path)
        if problem is not None:
            out.append((ckpt, problem))
    return out


def find_resume_checkpoint(run_dir: Path, quiet: bool = False) -> Checkpoint | None:
    """The newest checkpoint that verifies; damaged ones (a missing or empty manifest included)
    are skipped with a warning naming what is wrong."""
    for ckpt in reversed(list_checkpoint_folders(run_dir)):
        problem = verify_checkpoint(ckpt.path)
        if problem is None:
            return ckpt
        if not quiet:
            log.warning("skipping damaged checkpoint %s: %s", ckpt.path, problem)
    return None


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load weights saved by `save_pretrained` into `model` in place (full model or LoRA).

    A full model is read back through its own class's `from_pretrained`, which undoes any key
    renaming `save_pretrained` applied, then copied in with a strict `load_state_dict`."""
    folder = Path(folder)
    if (folder / "adapter_model.safetensors").exists():
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        return
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder}: neither a Hugging Face model folder nor LoRA adapters")
    dtype = next(model.parameters()).dtype
    saved = type(model).from_pretrained(folder, dtype=dtype, local_files_only=True)
    model.load_state_dict(saved.state_dict(), strict=True)
    del saved


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(Path(path) / STATE, weights_only=False)


def apply_retention(run_dir: Path, keep_last: int, keep_best: bool) -> None:
    """Delete all but the `keep_last` newest checkpoints (and the best one, with `keep_best`)."""
    checkpoints = list_checkpoints(run_dir)
    keep = {c.path for c in checkpoints[-keep_last:]} if keep_last > 0 else {c.path for c in checkpoints}
    if keep_best:
        scored = [c for c in checkpoints if c.metric is not None]
        if scored:
            keep.add(max(scored, key=lambda c: (c.metric, c.step)).path)
    for c in checkpoints:
        if c.path not in keep:
            shutil.rmtree(c.path, ignore_errors=True)
