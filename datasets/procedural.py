"""Procedural data: kinds of drawn images with questions, turned into samples.

A *kind* is a function `(rng, image_size) -> Drawn` registered with `register_kind`
(`mmrl.datasets.kinds`). The built-in kinds live in `vision_reasoning.py` (numeric questions,
math verifier) and `perception.py` (detection, grounding, OCR, counting). `make_samples` is deterministic in its arguments; the
`train`, `validation` and `heldout` splits draw from independent random streams.
"""

from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image

from mmrl.datasets import minigrid, perception, vision_reasoning, visual_search  # noqa: F401 - the built-in kinds register
from mmrl.datasets.kinds import Drawn, Kind, register_kind, registered_kinds
from mmrl.types import AgentSpec, EnvSpec, RewardSpec, Sample

__all__ = [
    "SPLITS",
    "Drawn",
    "Kind",
    "image_digest",
    "kinds",
    "make_samples",
    "reference_response",
    "register_kind",
]

SPLITS = {"train": 0, "heldout": 1, "validation": 2}


def kinds() -> dict[str, Kind]:
    """Every registered kind by name."""
    return registered_kinds()


def make_samples(
    kinds_: list[str] | tuple[str, ...],
    n: int,
    split: str,
    seed: int = 0,
    image_size: int = 64,
) -> list[Sample]:
    """`n` samples cycling through `kinds_`, deterministic in all arguments."""
    known = kinds()
    unknown = [k for k in kinds_ if k not in known]
    if unknown or not kinds_:
        raise ValueError(f"unknown procedural kind(s) {unknown}: choose from {sorted(known)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: choose from {list(SPLITS)}")
    samples = []
    for i in range(n):
        kind = known[kinds_[i % len(kinds_)]]
        rng = np.random.default_rng([seed, SPLITS[split], kind.stream, i])
        drawn = kind.draw(rng, image_size, split) if kind.takes_split else kind.draw(rng, image_size)
        samples.append(
            Sample(
                data_source=f"{kind.task}/{kind.name}",
                prompt=[
                    {
                        "role": "user",
                        "content": ("<image>" if drawn.image is not None else "") + drawn.question,
                    }
                ],
                images=[drawn.image] if drawn.image is not None else [],
                ability=drawn.ability,
                reward_model=RewardSpec(
                    ground_truth=drawn.ground_truth,
                    verifier=drawn.verifier,
                    verifier_params=dict(drawn.verifier_params),
                ),
                extra_info={
                    "id": f"{kind.task}/{kind.name}/{split}/{seed}/{i}",
                    "reference": drawn.reference,
                    "demonstration": drawn.reference,  # a reference solution (`algo.demo_loss`)
                    **drawn.details,
                },
                agent=_agent_spec(drawn.agent),
            )
        )
    return samples


def _agent_spec(agent: dict | None) -> AgentSpec | None:
    if agent is None:
        return None
    env = agent.get("env")
    return AgentSpec(**{**agent, "env": EnvSpec(**env) if isinstance(env, dict) else env})


def reference_response(sample: Sample) -> str:
    """The ideal response of a procedural sample (KeyError for other data)."""
    return sample.extra_info["reference"]


def image_digest(image: Image.Image) -> str:
    """A content hash, used to show that the splits share no image."""
    return hashlib.sha1(image.tobytes()).hexdigest()
