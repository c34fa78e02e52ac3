"""Built-in text-to-image prompts: short compositional captions, deterministic train / eval split.

    from mmrl.datasets.prompts_t2i import builtin_prompts
    train, heldout = builtin_prompts("train"), builtin_prompts("eval")

Every prompt is "<a|two> <colour> <object> <setting>"; the held-out split is a fixed
disjoint sample of the same space (seeded), so evaluation prompts are never trained on.
"""

from __future__ import annotations

import random

COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")
OBJECTS = ("cat", "dog", "car", "apple", "house", "bird", "chair", "flower", "boat", "cup")
SETTINGS = (
    "on a table",
    "in a field",
    "at night",
    "on the beach",
    "in the snow",
    "in a city street",
)
NUMBERS = ("a", "two")
NUM_EVAL = 32
"""Prompts held out for evaluation."""


def _all_prompts() -> list[str]:
    out = []
    for n in NUMBERS:
        for c in COLOURS:
            for o in OBJECTS:
                for s in SETTINGS:
                    obj = o + ("s" if n == "two" else "")
                    out.append(f"{n} {c} {obj} {s}")
    return out


def builtin_prompts(split: str = "train", seed: int = 0) -> list[str]:
    """The built-in prompts of `split` (`train` or `eval`), in a fixed shuffled order."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown prompt split {split!r}: choose train or eval")
    prompts = _all_prompts()
    random.Random(seed).shuffle(prompts)
    return prompts[:NUM_EVAL] if split == "eval" else prompts[NUM_EVAL:]


def read_prompt_file(path: str) -> list[str]:
    """Prompts from a text file, one per line; blank lines and `#` comments are skipped."""
    from pathlib import Path

    from mmrl.files import read_file

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"prompt file not found: {p}")
    prompts = []
    for line in read_file(p).decode("utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{p}: no prompts (one per line expected)")
    return prompts
