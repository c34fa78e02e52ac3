"""Crash-safe checkpoints, exact resume and step dumps for flow-GRPO (`mmrl.train.flow_grpo`).

A checkpoint is `<run_dir>/checkpoints/step_<n>/`, written by `mmrl.train.checkpoint.save_checkpoint`
(a temporary folder renamed into place, a manifest of every file's size and SHA-256 written last):

    model/trainable.safetensors   the trained weights by parameter name (LoRA adapters, or the
                                  whole transformer with full fine-tuning)
    model/ema.safetensors         the EMA of those weights (when `trainer.ema`)
    trainer_state.pt              optimizer state, EMA update count, optimizer-step count, the prompt
                                  order's position and NumPy generator, step and evaluation
                                  trackers, and the Python / NumPy / torch (CPU, CUDA) RNG states
    config.yaml                   the resolved config

The rollout's generator needs no saving: every step seeds its own from `trainer.seed` and the
step number, and evaluation seeds its own too. Resuming restores all of the above, so a resumed
run computes exactly what an uninterrupted one would have (tested bit for bit after SIGKILL).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from mmrl.train.checkpoint import (
    apply_retention,
    load_trainer_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)
from mmrl.train.preflight import RESUME_MAY_CHANGE, RESUME_MAY_CHANGE_PREFIXES, flatten

if TYPE_CHECKING:
    from mmrl.train.flow_config import FlowConfig
    from mmrl.train.flow_grpo import FlowTrainee, PromptOrder

log = logging.getLogger(__name__)

WEIGHTS = "trainable.safetensors"
EMA_WEIGHTS = "ema.safetensors"

RESUMABLE_CHANGES: frozenset[str] = RESUME_MAY_CHANGE | {
    "trainer.save_final",
    "trainer.wandb",
    "trainer.mlflow",
}
"""Config keys a resumed image run may change: the VLM trainer's bookkeeping keys
(`mmrl.train.preflight.RESUME_MAY_CHANGE`; none changes what a step computes, and `run_dir`: a
run folder may be moved or copied), whether the final pipeline is saved, and the trackers."""


@dataclass
class FlowProgress:
    """Counters a resumed run continues from."""

    step: int = 0
    start_reward: float = float("nan")
    best_reward: float = float("nan")
    final_reward: float = float("nan")
    start_accuracy: float | None = None
    """Held-out GenEval-style accuracy at step 0 (None: the prompts are not GenEval-style)."""
    final_accuracy: float | None = None
    start_eval: dict | None = None
    """The GenEval figures of step 0's evaluation (`mmrl.train.flow_grpo.eval_figures`)."""
    final_eval: dict | None = None


class _Weights:
    """What `save_checkpoint` calls `model`: writes the trained weights (and their EMA)."""

    def __init__(self, t: FlowTrainee):
        self.t = t

    def save_pretrained(self, folder: Path) -> None:
        from safetensors.torch import save_file

        names = trainable_names(self.t)
        save_file(
            {n: p.detach().cpu().contiguous() for n, p in zip(names, self.t.params)}, Path(folder) / WEIGHTS
        )
        if self.t.ema is not None:
            shadow = {n: s.detach().cpu().contiguous() for n, s in zip(names, self.t.ema.shadow)}
            save_file(shadow, Path(folder) / EMA_WEIGHTS)


class _NoProcessor:
    def save_pretrained(self, folder: Path) -> None:
        pass


def trainable_names(t: FlowTrainee) -> list[str]:
    """Names of `t.params`, in order."""
    ids = {id(p): n for n, p in t.transformer.named_parameters()}
    return [ids[id(p)] for p in t.params]


def write_flow_checkpoint(
    cfg: FlowConfig,
    t: FlowTrainee,
    order: PromptOrder,
    progress: FlowProgress,
    run_dir: Path,
    weights: Any = None,
    extra_state: dict | None = None,
) -> Path:
    """Checkpoint `progress.step` atomically, then keep the `trainer.keep_last` newest. A failed
    write (disk full, read-only folder) raises `OSError` naming the folder; the temporary is
    removed and the earlier checkpoints stay intact. `weights` (an object with
    `save_pretrained(folder)`; default the trained weights and EMA) and `extra_state` (merged
    into the trainer state) let another loop add what it trains (`mmrl.train.decoupled`)."""
    from mmrl.train.flow_config import flow_config_to_yaml

    state = {
        "optimizer": t.optimizer.state_dict(),
        "updates": t.updates,
        "ema_updates": t.ema.updates if t.ema is not None else None,
        "prompt_order": order.state_dict(),
        "progress": progress.__dict__.copy(),
        **(extra_state or {}),
    }
    metric = progress.final_reward if progress.final_reward == progress.final_reward else None
    # A failed write raises `StorageError` naming the folder, the cause and the last good
    # checkpoint, with its temporary folder removed (`mmrl.train.checkpoint.save_checkpoint`).
    path = save_checkpoint(
        run_dir,
        progress.step,
        weights if weights is not None else _Weights(t),
        _NoProcessor(),
        state,
        flow_config_to_yaml(cfg),
        metric=metric,
    )
    apply_retention(run_dir, cfg.trainer.keep_last, keep_best=False)
    return path


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete the `.tmp_step_*` folders a write that crashed left behind; returns them."""
    root = Path(run_dir) / "checkpoints"
    stale = sorted(root.glob(".tmp_step_*")) if root.exists() else []
    for p in stale:
        log.warning("removing %s, left by a checkpoint write that did not finish", p)
        shutil.rmtree(p, ignore_errors=True)
    return stale


def find_flow_checkpoint(cfg: FlowConfig, run_dir: Path) -> Path | None:
    """The checkpoint `trainer.resume` names: `auto` takes the newest one that verifies (None if
    the run has none yet). Refuses when checkpoints exist but every one is damaged."""
    if cfg.trainer.resume != "auto":
        path = Path(cfg.trainer.resume)
        problem = verify_checkpoint(path)
        if problem is not None:
            raise ValueError(f"trainer.resume={path}: not a usable checkpoint: {problem}")
        return path
    root = Path(run_dir) / "checkpoints"
    folders = sorted(root.glob("step_*")) if root.exists() else []
    damaged = []
    for folder in reversed(folders):
        problem = verify_checkpoint(folder)
        if problem is None:
            return folder
        log.warning("skipping damaged checkpoint %s: %s", folder, problem)
        damaged.append(f"{folder.name}: {problem}")
    if damaged:
        raise ValueError(
            f"resume=auto: every checkpoint in {root} is damaged ({'; '.join(damaged)}); nothing was "
            f"changed. To start over, remove {root} and {Path(run_dir) / 'metrics.jsonl'}, or choose another "
            "trainer.run_dir"
        )
    return None


def check_config_unchanged(cfg: FlowConfig, checkpoint: Path) -> None:
    """Refuse to resume with a config that differs from the checkpoint's, except in the keys of
    `RESUMABLE_CHANGES` (the differences are listed)."""
    saved_yaml = (checkpoint / "config.yaml").read_text()
    saved = OmegaConf.to_container(  # type(cfg): the decoupled loop's config is a subclass
        OmegaConf.merge(OmegaConf.structured(type(cfg)), OmegaConf.create(saved_yaml))
    )
    now = OmegaConf.to_container(OmegaConf.structured(cfg))
    diffs = [
        f"{key}: {a!r} -> {b!r}"
        for key, a, b in _differences(saved, now, "")
        if key not in RESUMABLE_CHANGES and not key.startswith(RESUME_MAY_CHANGE_PREFIXES)
    ]
    if diffs:
        flat = flatten(now)
        allowed = sorted(k for k in RESUMABLE_CHANGES if any(f == k or f.startswith(k + ".") for f in flat))
        raise ValueError(
            f"resume: the config differs from the one {checkpoint} was trained with: {'; '.join(diffs)}. "
            f"Only {', '.join(allowed)} may change on resume"
        )


def _differences(a: Any, b: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(key), b.get(key), f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
        return out
    return [] if a == b else [(prefix, a, b)]


def restore_flow_checkpoint(path: Path, t: FlowTrainee, order: PromptOrder, progress: FlowProgress) -> None:
    """Load weights, EMA, optimizer, prompt order, counters and RNG states from `path`."""
    from safetensors.torch import load_file

    weights = load_file(path / "model" / WEIGHTS)
    names = trainable_names(t)
    if sorted(weights) != sorted(names):
        missing, extra = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
        raise ValueError(
            f"{path / 'model' / WEIGHTS}: its weights do not match the trained ones "
            f"(missing {missing[:5]}, unexpected {extra[:5]}): was it written with another lora/model config?"
        )
    ema = load_file(path / "model" / EMA_WEIGHTS) if t.ema is not None else None
    state = load_trainer_state(path)
    with torch.no_grad():
        for i, (name, p) in enumerate(zip(names, t.params)):
            if weights[name].shape != p.shape:
                raise ValueError(
                    f"{path / 'model' / WEIGHTS}: {name} has shape {tuple(weights[name].shape)}, "
                    f"the model {tuple(p.shape)}"
                )
            p.copy_(weights[name])
            if ema is not None:
                t.ema.shadow[i].copy_(ema[name])
    if t.ema is not None:
        t.ema.updates = state["ema_updates"]
    t.optimizer.load_state_dict(state["optimizer"])
    t.updates = state["updates"]
    order.load_state_dict(state["prompt_order"])
    progress.__dict__.update(state["progress"])
    set_rng_state(state["rng"])


def write_flow_dump(
    run_dir: Path,
    step: int,
    prompts: list[str],
    images: torch.Tensor,
    scores: torch.Tensor,
    reward_names: list[str],
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    group_size: int,
) -> Path:
    """`<run_dir>/dumps/step_<n>.jsonl` (one line per image: prompt, group, each reward, the
    weighted reward, the advantage, the PNG's path) and the images under `dumps/step_<n>/`."""
    from PIL import Image

    folder = Path(run_dir) / "dumps" / f"step_{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder.with_suffix(".jsonl")
    with path.open("w", encoding="utf-8") as f:
        for i, prompt in enumerate(prompts):
            image = folder / f"row_{i:04d}.png"
            array = (
                (images[i].float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            )
            Image.fromarray(array).save(image)
            row = {
                "step": step,
                "row": i,
                "group": i // group_size,
                "prompt": prompt,
                "image": str(image.relative_to(run_dir)),
                "rewards": {n: float(scores[i, k]) for k, n in enumerate(reward_names)},
                "reward": float(rewards[i]),
                "advantage": float(advantages[i]),
            }
            f.write(json.dumps(row) + "\n")
    return path
