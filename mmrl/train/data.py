"""Training data for the VLM trainer: loading, the prompt sampler, the CoT prompt pool."""

from __future__ import annotations

import copy

import numpy as np

from mmrl.config import Config
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.sources import read_source
from mmrl.router import import_plugins
from mmrl.types import Sample

DEFAULT_COT_PROMPTS: tuple[str, ...] = (
    " Think step by step, then give the final answer in \\boxed{}.",
    " Reason carefully before answering; put the final answer in \\boxed{}.",
    " First explain your reasoning, then write the answer as \\boxed{answer}.",
    " Work it out step by step and end with \\boxed{} around the answer.",
    " Show your reasoning briefly, then state the final answer inside \\boxed{}.",
)
"""V-Triune-style chain-of-thought instructions, drawn at random per prompt for math samples."""


def load_data(cfg: Config) -> tuple[list[Sample], list[Sample]]:
    """Training and held-out samples: from files or datasets by name when given
    (`mmrl.datasets.sources`: sample files, hub ids, `load_dataset` / `load_from_disk` sources),
    else procedural kinds. Every record is validated here, before anything trains."""
    import_plugins(cfg.reward.plugins)  # verifier names are checked while loading
    d = cfg.data
    kw = dict(kinds_=d.kinds, seed=d.seed, image_size=d.image_size)
    if d.train_files:
        train = [s for f in d.train_files for s in read_source(f, max_prompt_chars=d.max_prompt_chars)]
    else:
        train = make_samples(n=d.num_train, split="train", **kw)
    if d.heldout_files:
        heldout = [s for f in d.heldout_files for s in read_source(f, max_prompt_chars=d.max_prompt_chars)]
    elif not d.train_files:
        heldout = make_samples(n=d.num_heldout, split="heldout", **kw)
    else:
        raise ValueError("data.train_files is set: give data.heldout_files too")
    if not train:
        raise ValueError("no training samples")
    if not heldout:
        raise ValueError("no held-out samples (data.heldout_files or data.num_heldout)")
    return train, heldout


class PromptSampler:
    """Shuffled passes over the training samples; deterministic by seed.

    With a CoT pool, every math-ability sample drawn gets one instruction from the pool
    appended to its last user message (a copy: the dataset itself is never changed).
    """

    def __init__(self, samples: list[Sample], seed: int, cot_pool: list[str] | tuple[str, ...] = ()):
        self.samples = samples
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(len(samples))
        self.cursor = 0
        self.cot_pool = tuple(cot_pool)

    def state_dict(self) -> dict:
        """Where the sampler is: its random generator, the epoch's order and the cursor."""
        return {"rng": self.rng.bit_generator.state, "order": self.order.tolist(), "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order = np.asarray(state["order"])
        self.cursor = int(state["cursor"])

    def next(self, n: int) -> list[Sample]:
        out = []
        while len(out) < n:
            if self.cursor == len(self.order):
                self.order, self.cursor = self.rng.permutation(len(self.samples)), 0
            sample = self.samples[self.order[self.cursor]]
            self.cursor += 1
            if self.cot_pool and sample.ability == "math":
                sample = with_instruction(sample, self.cot_pool[int(self.rng.integers(len(self.cot_pool)))])
            out.append(sample)
        return out


def cot_pool(cfg: Config) -> tuple[str, ...]:
    if not cfg.data.cot_prompts:
        return ()
    return tuple(cfg.data.cot_prompt_pool) or DEFAULT_COT_PROMPTS


def with_instruction(sample: Sample, instruction: str) -> Sample:
    """A copy of `sample` with `instruction` appended to its last user message."""
    prompt = copy.deepcopy(sample.prompt)
    for message in reversed(prompt):
        if message["role"] == "user":
            if isinstance(message["content"], str):
                message["content"] += instruction
            else:
                message["content"].append({"type": "text", "text": instruction})
            break
    out = copy.copy(sample)
    out.prompt = prompt
    return out
