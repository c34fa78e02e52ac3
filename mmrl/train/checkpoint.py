"""Crash-safe checkpoints and exact resume.

A checkpoint is a folder `<run_dir>/checkpoints/step_<n>/` holding:

    model/              the policy in Hugging Face format (LoRA: the adapters) + processor
    trainer_state.pt    optimizer, scheduler, RNG states (Python, NumPy, torch), the prompt
                        sampler's position, step counters and the evaluation trackers
    config.yaml         the resolved config
    manifest.json       every file's size and SHA-256, written last

It is written to a temporary folder and renamed into place, so a crash never leaves a
half-written `step_<n>`. On resume the newest checkpoint whose files all match their manifest
is used; a damaged one is skipped with a warning naming what is wrong. Retention keeps the
`keep_last` newest and, with `keep_best`, the one with the best held-out accuracy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE = "trainer_state.pt"


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
) -> Path:
    """Write checkpoint `step` atomically; returns its folder."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "model").mkdir(parents=True)
    model.save_pretrained(tmp / "model")
    processor.save_pretrained(tmp / "model")
    torch.save({**trainer_state, "rng": rng_state(), "step": step}, tmp / STATE)
    (tmp / "config.yaml").write_text(config_yaml)
    files = {
        str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    manifest = {"step": step, "metric": metric, "time": time.time(), "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for f in [*tmp.rglob("*"), tmp]:  # flush file contents before the rename makes them visible
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():  # e.g. the final checkpoint after a periodic one at the same step
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def verify_checkpoint(path: Path) -> str | None:
    """None if every file matches the manifest, else what is wrong."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return "no manifest (not a complete checkpoint)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        return f"unreadable manifest: {exc}"
    for name, info in manifest.get("files", {}).items():
        f = path / name
        if not f.exists():
            return f"missing file {name}"
        if f.stat().st_size != info["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {info['bytes']} (truncated?)"
        if _sha256(f) != info["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete-looking checkpoints (a manifest exists), oldest first; temporary folders ignored."""
    root = Path(run_dir) / "checkpoints"
    out = []
    for p in sorted(root.glob("step_*")) if root.exists() else []:
        manifest = p / MANIFEST
        if not manifest.exists():
            continue
        try:
            info = json.loads(manifest.read_text())
        except json.JSONDecodeError:
            info = {"step": int(p.name.split("_")[1]), "metric": None}
        out.append(Checkpoint(p, int(info["step"]), info.get("metric")))
    return sorted(out, key=lambda c: c.step)


def find_resume_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest checkpoint that verifies; damaged ones are skipped with a warning."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(ckpt.path)
        if problem is None:
            return ckpt
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
