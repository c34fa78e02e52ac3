"""The built-in base policy: a tiny VLM given a short supervised warm-up, cached on disk.

RL improves what a model can already sometimes do, as a pretrained checkpoint would. A random
tiny model cannot answer at all, so the built-in base is made once: a random tiny VLM (a
Qwen2-VL unless `model.tiny.architecture` names another family) is trained on the answer tokens
of the procedural task until its greedy accuracy on a validation split (not the held-out split
RL is judged on) reaches `target_accuracy` on `patience` evaluations in a row, then stopped:
clearly imperfect, but looking at the image.

The result is saved in Hugging Face format under a key of everything that determines it, so
the same settings give the same base (reproducible by seed) and later runs reuse it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from mmrl.config import Config
from mmrl.datasets.procedural import make_samples, reference_response
from mmrl.models.base_cache import cache_root, cached_base
from mmrl.models.families import vision_layout
from mmrl.models.loading import Policy, make_policy
from mmrl.models.tiny import build_processor, build_tiny_vlm
from mmrl.rollout.hf import HFRolloutEngine, encode_prompts
from mmrl.router import Router
from mmrl.train.evaluation import evaluate
from mmrl.train.forward import response_logprobs
from mmrl.types import RolloutBatch, Sample

log = logging.getLogger(__name__)

BASE_FORMAT_VERSION = 1
"""Bump when the warm-up recipe changes, so stale cached bases are not reused."""


def base_key(cfg: Config) -> str:
    """Hash of everything that determines the built-in base."""
    spec = {
        "version": BASE_FORMAT_VERSION,
        "tiny": asdict(cfg.model.tiny),
        "warmup": _warmup_key(cfg),
        "task": cfg.data.task,
        "kinds": list(cfg.data.kinds),
        "image_size": cfg.data.image_size,
        "data_seed": cfg.data.seed,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _warmup_key(cfg: Config) -> dict:
    """The warm-up settings that determine the base: `direct_fraction` only for tool tasks (so
    the other tasks' bases keep the keys, and the caches, they had before it existed)."""
    warm = asdict(cfg.model.warmup)
    if "visual_search" not in cfg.data.kinds:
        warm.pop("direct_fraction")
    return warm


def builtin_base(cfg: Config) -> Path:
    """Path of the built-in base for `cfg`, warming it up first if it is not cached (built once,
    the random generators left as they were: `mmrl.models.base_cache`)."""
    path = cache_root(cfg.model.cache_dir) / "bases" / f"{cfg.data.task}-{base_key(cfg)}"

    def build():
        policy, report = warm_up(cfg)

        def save(folder: Path) -> None:
            policy.model.save_pretrained(folder)
            policy.processor.save_pretrained(folder)

        return save, report

    return cached_base(path, "the built-in base model (supervised warm-up)", build)


def teacher_forced_batch(policy: Policy, samples: list[Sample], targets: list[str]) -> RolloutBatch:
    """Prompts with given target responses (stop token appended), laid out like a rollout."""
    inputs = encode_prompts(policy.processor, samples)
    tokenizer = policy.processor.tokenizer
    stop = policy.stop_token_ids[0]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [stop] for t in targets]
    width = max(len(x) for x in ids)
    images_per_row = [len(s.images) for s in samples]
    response = torch.full((len(ids), width), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        response[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    return RolloutBatch(
        samples=samples,
        prompt_ids=inputs["input_ids"],
        prompt_mask=inputs["attention_mask"],
        response_ids=response,
        response_mask=mask,
        rollout_logprobs=torch.zeros(response.shape),
        vision_inputs={k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")},
        texts=targets,
        truncated=torch.zeros(len(ids), dtype=torch.bool),
        images_per_row=images_per_row,
        vision_layout=vision_layout(policy.processor, inputs, images_per_row),
    )


def _demonstrations(
    cfg: Config, policy: Policy, samples: list[Sample], rng: np.random.Generator
) -> RolloutBatch:
    """One warm-up batch: each sample's reference answer, teacher-forced. Samples with a tool
    demonstration (`visual_search`) get a supervised cold start (Mini-o3, Chain-of-Focus): the
    whole trajectory (the call, the tool's real observation, the answer), except a share
    `model.warmup.direct_fraction` that answer directly with the tools switched off. Samples
    that act in an environment (`minigrid`) get their expert's episode: each action word a
    turn, each of the environment's observations between them."""
    if not any(k in s.extra_info for s in samples for k in ("tool_demonstration", "env_demonstration")):
        return teacher_forced_batch(policy, samples, [reference_response(s) for s in samples])
    from mmrl.datasets.visual_search import without_tools
    from mmrl.rollout.multiturn import demonstration_batch

    rows, turns = [], []
    for s in samples:
        if "env_demonstration" in s.extra_info:
            rows.append(s)
            turns.append(list(s.extra_info["env_demonstration"]))
        elif "tool_demonstration" in s.extra_info and rng.random() >= cfg.model.warmup.direct_fraction:
            rows.append(s)
            turns.append(list(s.extra_info["tool_demonstration"]))
        else:
            rows.append(without_tools(s) if "tool_demonstration" in s.extra_info else s)
            turns.append([reference_response(s)])
    return demonstration_batch(
        policy.processor, rows, turns, policy.stop_token_ids[0], policy.pad_token_id, cfg.agent
    )


def warm_up(cfg: Config) -> tuple[Policy, dict]:
    """Supervised warm-up of a random tiny model on the task's answers (see module docs), with a
    progress bar (`trainer.progress`). Ctrl-C stops it (`KeyboardInterrupt`, its verifier
    workers closed); nothing is cached, so the next run starts the warm-up again."""
    from mmrl.progress import ProgressBar

    wcfg = cfg.model.warmup
    torch.manual_seed(wcfg.seed)
    spec = cfg.model.tiny
    policy = make_policy(build_tiny_vlm(spec, seed=wcfg.seed), build_processor(spec))
    data_kw = dict(kinds_=cfg.data.kinds, seed=cfg.data.seed, image_size=cfg.data.image_size)
    train = make_samples(n=cfg.data.num_train, split="train", **data_kw)
    validation = make_samples(n=wcfg.eval_size, split="validation", **data_kw)
    engine = HFRolloutEngine.from_policy(policy)
    model = policy.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=wcfg.lr)
    rng = np.random.default_rng(wcfg.seed)
    start = time.monotonic()
    router = Router(cfg.reward.num_workers, cfg.reward.time_limit_s, cfg.reward.plugins)
    bar = ProgressBar(
        total=wcfg.max_steps,
        desc=f"warm-up of the built-in base (one-time; stops at {wcfg.target_accuracy:.0%} validation accuracy)",
        unit="step",
        disable=not cfg.trainer.progress,
        dynamic_ncols=True,
    )
    try:
        step, streak, history = _warm_up_steps(
            cfg, policy, engine, optimizer, router, train, validation, rng, bar
        )
    finally:
        bar.close()
        router.close()
    report = {
        "steps": step,
        "reached_target": streak >= wcfg.patience,
        "seconds": round(time.monotonic() - start, 1),
        "history": history,
    }
    model.eval()
    return policy, report


def _warm_up_steps(
    cfg, policy, engine, optimizer, router, train, validation, rng, bar
) -> tuple[int, int, list]:
    """The warm-up's loop: answer-token NLL steps, a greedy validation every `eval_every`."""
    wcfg, model = cfg.model.warmup, policy.model
    order = rng.permutation(len(train))
    cursor, streak, history, step = 0, 0, [], 0
    for step in range(1, wcfg.max_steps + 1):
        if cursor + wcfg.batch_size > len(order):
            order, cursor = rng.permutation(len(train)), 0
        batch_samples = [train[i] for i in order[cursor : cursor + wcfg.batch_size]]
        cursor += wcfg.batch_size
        batch = _demonstrations(cfg, policy, batch_samples, rng)
        model.train()
        logprobs, _ = response_logprobs(model, batch, policy.blocked, temperature=1.0)
        loss = -logprobs.sum() / batch.response_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        bar.update(1)
        if step % wcfg.eval_every == 0:
            acc = evaluate(engine, router, validation, cfg.rollout.max_new_tokens, agent=cfg.agent)[
                "eval/accuracy"
            ]
            history.append({"step": step, "loss": loss.item(), "accuracy": acc})
            level = logging.INFO if bar.disable else logging.DEBUG  # the bar shows them otherwise
            log.log(level, "warm-up step %d: loss %.3f, validation accuracy %.3f", step, loss.item(), acc)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}")
            streak = streak + 1 if acc >= wcfg.target_accuracy else 0
            if streak >= wcfg.patience:
                break
    return step, streak, history
