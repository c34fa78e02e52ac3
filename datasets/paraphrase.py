"""Requests in other words: the built-in task of decoupled text-to-image RL (`text_to_image_decoupled`).

A request names a GenEval-style single object with a synonym for its colour and one for its
shape ("a crimson disc", "a teal wedge"); its *target* is the canonical prompt the image base was
warmed up on ("a red circle", "a cyan triangle", `mmrl.datasets.geneval`). The image base has
never seen a synonym (its word tokenizer maps them to `[unk]`), so a request only comes out
right when the autoregressive planner rewrites it into the decoder's words and the decoder then
renders that plan well: both halves matter, and each can be checked by looking at the picture.

Splits are fixed (seed 0): for every (colour, shape) pair, 3 of its 9 synonym combinations are
held out (`heldout`, what evaluation reports); the other 6 are `train`. Every synonym occurs in
training, so the held-out requests test whether the planner composes what it learnt;
`validation` (what the planner's warm-up stops on) is a sample of `train`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmrl.datasets.geneval import SHAPES
from mmrl.datasets.vision_reasoning import COLOURS

COLOUR_SYNONYMS: dict[str, tuple[str, ...]] = {
    "red": ("crimson", "scarlet", "ruby"),
    "green": ("emerald", "jade", "lime"),
    "blue": ("azure", "navy", "cobalt"),
    "yellow": ("golden", "lemon", "amber"),
    "purple": ("violet", "lilac", "plum"),
    "cyan": ("teal", "turquoise", "aqua"),
}
SHAPE_SYNONYMS: dict[str, tuple[str, ...]] = {
    "circle": ("disc", "dot", "coin"),
    "square": ("box", "tile", "block"),
    "triangle": ("wedge", "pyramid", "arrowhead"),
}
HELDOUT_PER_PAIR = 3
"""Synonym combinations held out per (colour, shape) pair (of 9)."""

assert tuple(COLOUR_SYNONYMS) == tuple(COLOURS) and tuple(SHAPE_SYNONYMS) == tuple(SHAPES)

REQUEST_VOCABULARY: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            "a",
            *(w for ws in COLOUR_SYNONYMS.values() for w in ws),
            *(w for ws in SHAPE_SYNONYMS.values() for w in ws),
        ]
    )
)
"""Every word of a built-in request."""
PLAN_VOCABULARY: tuple[str, ...] = ("a", *COLOURS, *SHAPES)
"""Every word of a plan the decoder understands (the canonical single-object prompt)."""


@dataclass(frozen=True)
class Request:
    """A request and the canonical prompt it means."""

    request: str
    """What the user asked for ("a crimson disc")."""
    target: str
    """The GenEval-style prompt it means ("a red circle"): what the semantic reward checks."""


def all_requests() -> list[Request]:
    """All 162 requests (6 colours x 3 synonyms x 3 shapes x 3 synonyms), in a fixed order."""
    return [
        Request(f"a {cw} {sw}", f"a {colour} {shape}")
        for colour, cws in COLOUR_SYNONYMS.items()
        for shape, sws in SHAPE_SYNONYMS.items()
        for cw in cws
        for sw in sws
    ]


def paraphrase_requests(split: str, n: int | None = None, seed: int = 0) -> list[Request]:
    """The requests of `split` (`train`, `validation` or `heldout`), deterministic; `n` keeps the
    first n (`validation` and `heldout` cycle when n exceeds them: a repeat is drawn with other
    noise, so it is another image)."""
    if split not in ("train", "validation", "heldout"):
        raise ValueError(f"unknown request split {split!r}: choose train, validation or heldout")
    everything = all_requests()
    train, heldout = [], []
    for pair in range(len(everything) // 9):  # 9 synonym combinations per (colour, shape) pair
        block = everything[pair * 9 : (pair + 1) * 9]
        order = np.random.default_rng([seed, pair, 3]).permutation(9)
        heldout += [block[i] for i in order[:HELDOUT_PER_PAIR]]
        train += [block[i] for i in order[HELDOUT_PER_PAIR:]]
    if split == "train":
        return train[:n] if n is not None else train
    if split == "validation":
        pool = [train[i] for i in np.random.default_rng([seed, 11]).permutation(len(train))]
    else:
        pool = [heldout[i] for i in np.random.default_rng([seed, 13]).permutation(len(heldout))]
    n = len(pool) if n is None else n
    return [pool[i % len(pool)] for i in range(n)]
