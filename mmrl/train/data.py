"""Training data for the VLM trainer: loading, the prompt sampler, the CoT prompt pool."""

from __future__ import annotations

import copy
import logging

import numpy as np

from mmrl.config import Config
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.sources import load_source
from mmrl.router import import_plugins
from mmrl.types import Sample

log = logging.getLogger(__name__)

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
    train, heldout, _ = load_data_report(cfg)
    return train, heldout


def load_data_report(cfg: Config) -> tuple[list[Sample], list[Sample], dict[str, list[dict]]]:
    """`load_data`, and what was loaded: `{"train": [...], "heldout": [...]}`, one entry per
    source with its row count, detected layout and origin (the run's `summary.json` keeps it)."""
    import_plugins(cfg.reward.plugins)  # verifier names are checked while loading
    import_plugins(cfg.agent.plugins)  # and tool names
    d = cfg.data
    kw = dict(kinds_=d.kinds, seed=d.seed, image_size=d.image_size)
    report: dict[str, list[dict]] = {"train": [], "heldout": []}
    from_hub: set[str] = set()

    def read(files: list[str], split: str) -> list[Sample]:
        loaded = [load_source(f, max_prompt_chars=d.max_prompt_chars) for f in files]
        report[split] = [source.summary() for source in loaded]
        from_hub.update(s.data_source for source in loaded if source.origin == "hub" for s in source.samples)
        return [s for source in loaded for s in source.samples]

    def generate(n: int, split: str) -> list[Sample]:
        samples = make_samples(n=n, split=split, **kw)
        kinds = ",".join(d.kinds)
        report[split] = [
            {"entry": f"{d.task}:{kinds}", "rows": len(samples), "layout": "procedural", "origin": "built-in"}
        ]
        return samples

    train = read(d.train_files, "train") if d.train_files else generate(d.num_train, "train")
    if d.heldout_files:
        heldout = read(d.heldout_files, "heldout")
    elif not d.train_files:
        heldout = generate(d.num_heldout, "heldout")
    else:
        raise ValueError("data.train_files is set: give data.heldout_files too")
    if not train:
        raise ValueError("no training samples")
    if not heldout:
        raise ValueError("no held-out samples (data.heldout_files or data.num_heldout)")
    # Sources of rows read from the hub named like a hub id (veRL's `hiyouga/geometry3k`) are
    # shortened; every other keeps its name (`vision_reasoning/colour_code`) unless aliased.
    names = short_source_names(from_hub, d.source_aliases)
    names.update(
        {s: d.source_aliases.get(s, s) for s in {x.data_source for x in train + heldout} - names.keys()}
    )
    if any(old != new for old, new in names.items()):
        for sample in train + heldout:
            sample.data_source = names[sample.data_source]
        report["source_names"] = [
            {"data_source": old, "name": new} for old, new in names.items() if old != new
        ]
    for split, sources in (("train", report["train"]), ("heldout", report["heldout"])):
        log.info(
            "%s data: %s",
            split,
            "; ".join(f"{s['entry']}: {s['rows']} samples, {s['layout']} layout" for s in sources),
        )
    return train, heldout, report


def short_source_names(sources: set[str], aliases: dict[str, str]) -> dict[str, str]:
    """`{data_source: name in metrics}`: `aliases` first; a `/` in any other name keeps only its
    last part (`hiyouga/geometry3k` -> `geometry3k`), unless that would give two sources one name."""
    names = {s: aliases.get(s) or s.rsplit("/", 1)[-1] or s for s in sources}
    taken: dict[str, list[str]] = {}
    for source, name in names.items():
        taken.setdefault(name, []).append(source)
    return {s: (n if len(taken[n]) == 1 else aliases.get(s, s)) for s, n in names.items()}


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
        self.drawn = 0
        """Prompts drawn so far, over all epochs (a draw's number names it: `draw`)."""

    def state_dict(self) -> dict:
        """Where the sampler is: its random generator, the epoch's order, the cursor and the
        number of draws."""
        return {
            "rng": self.rng.bit_generator.state,
            "order": self.order.tolist(),
            "cursor": self.cursor,
            "drawn": self.drawn,
        }

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order = np.asarray(state["order"])
        self.cursor = int(state["cursor"])
        self.drawn = int(state.get("drawn", 0))  # (checkpoints before draws were numbered: 0)

    def draw(self, n: int) -> list[tuple[int, int, int]]:
        """The next `n` prompts as keys `(draw number, sample index, CoT instruction index or
        -1)`: what `sample(key)` turns back into the prompt, on this run or a resumed one."""
        out = []
        while len(out) < n:
            if self.cursor == len(self.order):
                self.order, self.cursor = self.rng.permutation(len(self.samples)), 0
            index = int(self.order[self.cursor])
            self.cursor += 1
            cot = -1
            if self.cot_pool and self.samples[index].ability == "math":
                cot = int(self.rng.integers(len(self.cot_pool)))
            out.append((self.drawn, index, cot))
            self.drawn += 1
        return out

    def sample(self, key: tuple[int, int, int]) -> Sample:
        """The prompt a `draw` key names."""
        _, index, cot = key
        sample = self.samples[index]
        return sample if cot < 0 else with_instruction(sample, self.cot_pool[cot])

    def next(self, n: int) -> list[Sample]:
        return [self.sample(key) for key in self.draw(n)]


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
