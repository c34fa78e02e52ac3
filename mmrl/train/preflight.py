"""Checks a run passes before it writes anything: which checkpoint a resume continues from (a
run whose checkpoints are all damaged is refused, not started over), and whether the config
differs from the one the checkpoint was written with (only an allow-list may change)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mmrl.config import Config, config_to_dict
from mmrl.train.checkpoint import damaged_checkpoints, find_resume_checkpoint, verify_checkpoint
from mmrl.train.sharded import SHARDED

log = logging.getLogger(__name__)

RESUME_MAY_CHANGE: frozenset[str] = frozenset(
    {
        "trainer.total_steps",
        "trainer.resume",
        "trainer.run_dir",
        "trainer.progress",
        "trainer.threads",
        "trainer.checkpoint_every",
        "trainer.async_checkpoint",
        "trainer.keep_last",
        "trainer.keep_best",
        "trainer.dump_steps",
        "trainer.max_consecutive_skips",
        "reward.num_workers",
        "model.cache_dir",
        "trainer.loggers",
        "trainer.log_generations",
        "trainer.ray_address",  # a restarted cluster may have another head
    }
)
"""Config keys a resumed run may set differently from its checkpoint (each change is logged):
the run's length and bookkeeping, never what it learns from or how. Extending
`trainer.total_steps` also stretches the learning-rate schedule."""

RESHARDED_MAY_CHANGE: frozenset[str] = frozenset(
    {
        "trainer.backend",
        "trainer.train_workers",
        "trainer.rollout_workers",
        "trainer.reward_workers",
        "trainer.ray_cpus_per_actor",
        "trainer.ray_gpus_per_actor",
        "trainer.ray_reward_gpus",
    }
)
"""Config keys a resumed run may also change when its checkpoint holds the training state
sharded (`mmrl.train.sharded`: the single-process trainer's and FSDP2 groups' checkpoints) and
the run reads it with FSDP2: where the run is placed, never what it learns. Each training process
reads its own shards of the weights and optimizer state, so the number of training processes and
the backend (local <-> Ray) may change; the prompt sampler and the driver's generators do not
depend on either. Rollout workers whose generators the checkpoint does not hold (more workers, or a
checkpoint of the single-process trainer) are seeded from `trainer.seed` and the step, with a
warning."""

RESUME_MAY_CHANGE_PREFIXES: tuple[str, ...] = ("trainer.wandb.", "trainer.mlflow.")
"""Sections a resumed run may set differently too (where metrics are sent)."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def config_differences(saved_yaml: str, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """`{key: (saved, now)}` for every key whose value differs. A key the saved config does not
    have (a field added since) counts only when it is not at its default."""
    saved = flatten(OmegaConf.to_container(OmegaConf.create(saved_yaml), resolve=True) or {})
    now = flatten(config_to_dict(cfg))
    defaults = flatten(config_to_dict(Config()))
    diffs = {}
    for key, value in now.items():
        if key in saved:
            if saved[key] != value:
                diffs[key] = (saved[key], value)
        elif key in defaults and defaults[key] != value:
            diffs[key] = (defaults[key], value)
    return diffs


def check_resume_config(cfg: Config, checkpoint: Path) -> dict[str, tuple[Any, Any]]:
    """Refuse (ValueError listing the differences) a resume whose config differs from the
    checkpoint's outside `RESUME_MAY_CHANGE`; log the allowed differences and return them."""
    saved_path = Path(checkpoint) / "config.yaml"
    try:
        diffs = config_differences(saved_path.read_text(encoding="utf-8"), cfg)
    except Exception as exc:  # noqa: BLE001 - any unreadable config is a refusal, with its cause
        raise ValueError(f"trainer.resume: cannot read the checkpoint's config {saved_path}: {exc}") from None
    allowed = RESUME_MAY_CHANGE
    resharded = (Path(checkpoint) / SHARDED).is_dir() and cfg.trainer.strategy == "fsdp2"
    if resharded:
        allowed = allowed | RESHARDED_MAY_CHANGE
    refused = {
        k: v for k, v in diffs.items() if k not in allowed and not k.startswith(RESUME_MAY_CHANGE_PREFIXES)
    }
    lines = [f"  {k}: {old!r} -> {new!r}" for k, (old, new) in sorted(diffs.items())]
    if refused:
        why = ""
        placement = sorted(set(refused) & RESHARDED_MAY_CHANGE)
        if placement and not resharded:
            why = (
                f"\n{', '.join(placement)} may change only when the checkpoint holds the training state "
                f"sharded ({SHARDED}/: written by the single-process trainer or an FSDP2 group) and the run "
                "uses trainer.strategy=fsdp2 (a DeepSpeed group's checkpoint gathers its optimizer state into "
                "trainer_state.pt and resumes on the placement it was written with)."
            )
        raise ValueError(
            f"trainer.resume: the config differs from the one {checkpoint} was written with "
            f"({saved_path}):\n" + "\n".join(lines) + "\nA resumed run may change only "
            f"{', '.join(sorted(allowed))}.{why} Resume with the checkpoint's config, or start a "
            "new run (another trainer.run_dir) to train with this one."
        )
    for key, (old, new) in sorted(diffs.items()):
        if key not in ("trainer.resume", "trainer.run_dir"):
            log.warning("resuming with %s changed: %r -> %r", key, old, new)
    return diffs


def plan_resume(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint folder `trainer.resume` continues from (config checked against it), or
    None to start fresh (no resume asked, or `auto` in a run with no checkpoint at all). Refuses
    (ValueError) when every checkpoint of the run is damaged, or the one named is."""
    resume = cfg.trainer.resume
    if not resume:
        return None
    if resume == "auto":
        ckpt = find_resume_checkpoint(run_dir)
        if ckpt is None:
            damaged = damaged_checkpoints(run_dir)
            if damaged:
                what = "; ".join(f"{c.path.name}: {problem}" for c, problem in damaged)
                raise ValueError(
                    f"--resume auto: every checkpoint in {Path(run_dir) / 'checkpoints'} is damaged ({what}). "
                    "Nothing was changed. Restore a checkpoint from a backup, resume from one that verifies "
                    f"with --resume PATH, or, to start over, move away or delete {Path(run_dir) / 'checkpoints'} "
                    f"and {Path(run_dir) / 'metrics.jsonl'} (or choose another trainer.run_dir)."
                )
            log.info("resume=auto: no checkpoint in %s; starting fresh", run_dir)
            return None
        path = ckpt.path
    else:
        path = Path(resume)
        problem = verify_checkpoint(path)
        if problem is not None:
            raise ValueError(f"trainer.resume={path}: not a usable checkpoint: {problem}")
    check_resume_config(cfg, path)
    return path


def check_paths(cfg: Config) -> None:
    """Paths the run reads later must exist now (a missing one would stop the run after the
    step-0 evaluation, leaving a run folder that a rerun then refuses)."""
    suite = cfg.trainer.eval_suite
    if suite and suite != "builtin" and not Path(suite).exists():
        raise ValueError(f"trainer.eval_suite: {suite} does not exist (a suite folder or file, or `builtin`)")
