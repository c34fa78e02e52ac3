"""mmrl vs TRL's GRPOTrainer, side by side in one process: generated tokens per second.

    pip install -c constraints.txt -e ".[bench]"     # TRL: a dependency of this benchmark only
    python benchmarks/trl_race.py [--steps N] [--repeats R] [--threads T] [key=value ...]

Both trainers run the default recipe's step on the same saved tiny VLM (the built-in base), the
same data (the built-in `vision_reasoning` training samples; TRL gets them as a `datasets.Dataset`
with a `prompt` column of chat messages and an `image` column, which its VLM path turns into the
same chat-template text and processor call as mmrl's), and the same reward (mmrl's math verifier,
called in this process by both: `reward.num_workers=0` for mmrl, a `Router(num_workers=0)` inside
TRL's reward function). Matched settings:

| | mmrl | TRL |
|---|---|---|
| prompts per step x group | `trainer.prompts_per_step` x `rollout.group_size` | `generation_batch_size` = B*G, `num_generations` = G |
| mini-batches per step | `trainer.mini_batches` | `steps_per_generation` = mini-batches, `per_device_train_batch_size` = B*G / mini-batches, no accumulation |
| generation | `rollout.max_new_tokens`, `rollout.temperature`, stop token(s) of the policy | `max_completion_length`, `temperature`, top-p 1, top-k 0; eos = the same stop token |
| blocked tokens | the policy's blocked ids when sampling | the same ids as `suppress_tokens` |
| old log-probs | a no-grad pass before the update (`algo.old_logprobs=recompute`) | the same (TRL computes them when generation spans several optimizer steps) |
| loss | token-mean PPO clip 0.2 / 0.28, no KL, one epoch | `loss_type=dapo` (token mean), `epsilon` 0.2, `epsilon_high` 0.28, `beta=0`, `num_iterations=1` |
| optimizer | AdamW, `optim.lr`, constant schedule, grad clip 1.0 | the same |

Differences that cannot be removed (they are how each trainer works): TRL computes log-probs
with its fused LM head over the whole vocabulary (mmrl masks blocked ids, so its rollout
log-probs equal the trainer's); mmrl also records the rollout's own log-probs during
generation; TRL shuffles the generation batch before splitting it into mini-batches; TRL runs
the processor twice per step (once for generation, once for the forward inputs) where mmrl keeps
the first call's outputs; TRL's `Trainer` adds its own bookkeeping (callbacks, logging).
Gradient checkpointing, which TRL's config turns on by default, is switched off: mmrl does not
use it and it only costs time on a model this small.

Each repeat builds both trainers afresh from the saved base, runs one untimed warm-up step, then
`--steps` timed steps (a step = one generation of B x G responses and its mini-batch updates);
the order alternates between repeats so neither side always runs first on a machine shared with
other work. Throughput = generated tokens (stop token included, as both count them) / wall time.
The figures printed are medians over repeats, and the ratio is the median of the per-repeat
ratios.

Finally one more mmrl run is instrumented: the policy's `generate`, its `forward` outside
`generate`, and `Tensor.backward` are timed, and the fraction of the step time outside them is
printed (the optimizer step, the processor, the verifier and all Python bookkeeping count as
outside).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from mmrl.config import Config, load_config  # noqa: E402
from mmrl.models.base import builtin_base  # noqa: E402
from mmrl.models.loading import load_policy  # noqa: E402
from mmrl.rollout.hf import encode_prompts  # noqa: E402
from mmrl.router import Router  # noqa: E402
from mmrl.train.data import PromptSampler, load_data  # noqa: E402
from mmrl.train.grpo import grpo_step, make_trainee, seed_everything  # noqa: E402
from mmrl.types import Sample, VerifyContext  # noqa: E402

# The recipe both sides run: the default one, scored in this process, at a constant learning
# rate (TRL's and mmrl's linear schedules count steps differently).
RACE_OVERRIDES = ["reward.num_workers=0", "optim.schedule=constant", "trainer.progress=false"]


# ---------------------------------------------------------------------------------------------
# mmrl


def run_mmrl(cfg: Config, base, samples: list[Sample], steps: int) -> list[tuple[float, float]]:
    """(seconds, generated tokens) of each timed step, after one untimed warm-up step."""
    seed_everything(cfg.trainer.seed)
    t = make_trainee(cfg, load_policy(base))
    sampler = PromptSampler(samples, cfg.trainer.seed)
    out = []
    try:
        for step in range(steps + 1):
            start = time.perf_counter()
            metrics = grpo_step(cfg, t, sampler, VerifyContext(step, steps + 1), step=step + 1)
            seconds = time.perf_counter() - start
            tokens = metrics["throughput/generated_tokens_per_s"] * metrics["time/step_s"]
            if step:
                out.append((seconds, round(tokens)))
    finally:
        t.router.close()
    return out


# ---------------------------------------------------------------------------------------------
# TRL


def trl_dataset(samples: list[Sample]):
    """TRL's VLM format: `prompt` (chat messages with the text) and `image` (one PIL image).

    TRL inserts `{"type": "image"}` before the text of the first user message, which is where
    the built-in task's `<image>` placeholder stands; `check_same_prompts` verifies the result.
    """
    from datasets import Dataset

    for s in samples:
        content = s.prompt[0]["content"]
        if len(s.prompt) != 1 or len(s.images) != 1 or not content.startswith("<image>"):
            raise ValueError(f"sample {s.id}: expected one user message starting with its one image")
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": s.prompt[0]["content"][len("<image>") :]}] for s in samples
            ],
            "image": [s.pil_images()[0] for s in samples],
            "row": list(range(len(samples))),
        }
    )


def check_same_prompts(policy, samples: list[Sample], dataset) -> None:
    """TRL's prompt token ids (its own chat templating and processor call) equal mmrl's."""
    from trl.data_utils import prepare_multimodal_messages

    mine = encode_prompts(policy.processor, samples[:4])
    for i in range(4):
        row = dataset[i]
        messages = prepare_multimodal_messages(row["prompt"], images=[row["image"]])
        theirs = policy.processor.apply_chat_template(
            conversation=[messages], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"][0]
        ours = mine["input_ids"][i][mine["attention_mask"][i].bool()].tolist()
        if list(theirs) != ours:
            raise RuntimeError(f"TRL's prompt for sample {samples[i].id} differs from mmrl's")


def run_trl(
    cfg: Config, base, samples: list[Sample], dataset, steps: int, policy=None, bf16: bool = False
) -> list[tuple[float, float]]:
    """(seconds, generated tokens) of each timed step (one generation and its mini-batch
    updates), after one untimed warm-up step. `policy`: a loaded policy to train instead of
    `base`'s; `bf16`: TRL's mixed precision (as mmrl's `model.dtype=bfloat16`)."""
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    B, G = cfg.trainer.prompts_per_step, cfg.rollout.group_size
    mb = cfg.trainer.mini_batches
    policy = policy if policy is not None else load_policy(base)
    router = Router(num_workers=0, time_limit_s=cfg.reward.time_limit_s)
    tokens: list[int] = []

    def math_reward(prompts, completions, completion_ids, row, **kwargs) -> list[float]:
        """mmrl's verifiers, in this process (the same call mmrl makes with num_workers=0)."""
        tokens.append(sum(len(c) for c in completion_ids))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rows = [samples[i] for i in row]
        return router.score(rows, texts, VerifyContext(len(tokens) - 1, steps + 1)).scores.tolist()

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % mb == 0:  # the last mini-batch of a generation
                ends.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "mmrl-trl-race"),
        per_device_train_batch_size=B * G // mb,
        gradient_accumulation_steps=1,
        steps_per_generation=mb,
        num_generations=G,
        num_iterations=cfg.trainer.ppo_epochs,
        max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=1.0,
        top_k=0,
        generation_kwargs={"suppress_tokens": policy.blocked.nonzero().flatten().tolist()},
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=cfg.algo.clip_low,
        epsilon_high=cfg.algo.clip_high,
        learning_rate=cfg.optim.lr,
        lr_scheduler_type="constant",
        weight_decay=cfg.optim.weight_decay,
        adam_beta1=cfg.optim.betas[0],
        adam_beta2=cfg.optim.betas[1],
        max_grad_norm=cfg.optim.grad_clip,
        max_steps=(steps + 1) * mb,
        gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
        bf16=bf16,
        seed=cfg.trainer.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=10**9,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=[math_reward],
        args=args,
        train_dataset=dataset,
        processing_class=policy.processor,
        callbacks=[Clock()],
    )
    trainer.remove_callback(PrinterCallback)  # its end-of-training line would interleave with ours
    if trainer.eos_token_ids != policy.stop_token_ids:
        raise RuntimeError(f"stop tokens differ: TRL {trainer.eos_token_ids}, mmrl {policy.stop_token_ids}")
    trainer.train()
    seconds = [b - a for a, b in zip(ends, ends[1:])]
    return list(zip(seconds, tokens))[1:]  # the first step is the warm-up


# ---------------------------------------------------------------------------------------------
# Where mmrl's step time goes


class ModelClock:
    """Times the model's work while installed: `generate` (Hugging Face's, if called), the
    policy's `forward` outside it (during rollouts: mmrl's prefill and decoding steps; else the
    trainer's log-prob passes), and every `Tensor.backward`."""

    PARTS = ("generate", "forward (rollout)", "forward (trainer)", "backward")

    def __init__(self, model: torch.nn.Module, engine):
        self.model, self.engine = model, engine
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self._in_generate = self._in_rollout = False

    @contextlib.contextmanager
    def installed(self):
        model, engine, clock = self.model, self.engine, self
        generate, backward = model.generate, torch.Tensor.backward
        rollout = engine.generate

        @functools.wraps(rollout)
        def timed_rollout(*args, **kwargs):
            clock._in_rollout = True
            try:
                return rollout(*args, **kwargs)
            finally:
                clock._in_rollout = False

        @functools.wraps(generate)
        def timed_generate(*args, **kwargs):
            start = time.perf_counter()
            clock._in_generate = True
            try:
                return generate(*args, **kwargs)
            finally:
                clock._in_generate = False
                clock.seconds["generate"] += time.perf_counter() - start

        # The forward is timed by hooks, not by replacing `model.forward`: the trainer's log-prob
        # pass runs its own function as the model's forward (`call_as_forward`), which the
        # hooks see like any call of the model.
        started: list[float] = []

        def before_forward(module, args):
            if not clock._in_generate:
                started.append(time.perf_counter())

        def after_forward(module, args, output):
            if not clock._in_generate and started:
                part = "forward (rollout)" if clock._in_rollout else "forward (trainer)"
                clock.seconds[part] += time.perf_counter() - started.pop()

        @functools.wraps(backward)
        def timed_backward(tensor, *args, **kwargs):
            start = time.perf_counter()
            try:
                return backward(tensor, *args, **kwargs)
            finally:
                clock.seconds["backward"] += time.perf_counter() - start

        engine.generate = timed_rollout
        model.generate = timed_generate
        hooks = [
            model.register_forward_pre_hook(before_forward),
            model.register_forward_hook(after_forward, always_call=True),
        ]
        torch.Tensor.backward = timed_backward
        try:
            yield self
        finally:
            del engine.generate, model.generate  # back to the classes' methods
            for hook in hooks:
                hook.remove()
            torch.Tensor.backward = backward


def mmrl_step_split(cfg: Config, base, samples: list[Sample], steps: int) -> dict[str, float]:
    """Seconds per part over `steps` timed steps (after a warm-up step) of an instrumented run."""
    seed_everything(cfg.trainer.seed)
    t = make_trainee(cfg, load_policy(base))
    sampler = PromptSampler(samples, cfg.trainer.seed)
    clock = ModelClock(t.policy.model, t.engine)
    total = 0.0
    try:
        grpo_step(cfg, t, sampler, VerifyContext(0, steps + 1))
        with clock.installed():
            for step in range(1, steps + 1):
                start = time.perf_counter()
                grpo_step(cfg, t, sampler, VerifyContext(step, steps + 1), step=step + 1)
                total += time.perf_counter() - start
    finally:
        t.router.close()
    return {"step": total, **clock.seconds}


# ---------------------------------------------------------------------------------------------


def throughput(rows: list[tuple[float, float]]) -> float:
    return sum(n for _, n in rows) / sum(s for s, _ in rows)


def quiet() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    for name in ("trl", "accelerate", "DeepSpeed", "mmrl"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each trainer, alternating")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--split-steps", type=int, default=0, help="steps of the instrumented run (0: --steps)"
    )
    parser.add_argument("overrides", nargs="*", help="mmrl config overrides (key=value), applied to both")
    args = parser.parse_args()
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config("vision_reasoning", overrides=RACE_OVERRIDES + args.overrides)
    if cfg.algo.kl_coef or cfg.algo.policy_loss != "ppo" or cfg.algo.old_logprobs != "recompute":
        raise SystemExit("the race compares the default objective: PPO clip, no KL, recomputed old log-probs")
    base = cfg.model.path or builtin_base(cfg)
    samples, _ = load_data(cfg)
    dataset = trl_dataset(samples)
    check_same_prompts(load_policy(base), samples, dataset)
    import trl

    B, G = cfg.trainer.prompts_per_step, cfg.rollout.group_size
    print(
        f"mmrl vs TRL {trl.__version__} GRPOTrainer: {B} prompts x {G} responses per step, "
        f"<= {cfg.rollout.max_new_tokens} new tokens, {cfg.trainer.mini_batches} mini-batches, "
        f"{args.steps} timed steps x {args.repeats} repeats, {torch.get_num_threads()} threads"
    )
    results: dict[str, list[float]] = {"mmrl": [], "trl": []}
    ratios = []
    for r in range(args.repeats):
        order = ["mmrl", "trl"] if r % 2 == 0 else ["trl", "mmrl"]
        this: dict[str, float] = {}
        for name in order:
            if name == "mmrl":
                rows = run_mmrl(cfg, base, samples, args.steps)
            else:
                rows = run_trl(cfg, base, samples, dataset, args.steps)
            this[name] = throughput(rows)
            results[name].append(this[name])
            step_s = statistics.median(s for s, _ in rows)
            print(
                f"  repeat {r + 1} {name:<4}: {this[name]:7.1f} generated tokens/s "
                f"(median step {step_s:.2f} s, {sum(n for _, n in rows) / len(rows) / (B * G):.2f} tokens/response)",
                flush=True,
            )
        ratios.append(this["mmrl"] / this["trl"])
    mmrl_tps, trl_tps = statistics.median(results["mmrl"]), statistics.median(results["trl"])
    ratio = statistics.median(ratios)
    print(f"mmrl  {mmrl_tps:8.1f} generated tokens/s (median of {args.repeats})")
    print(f"TRL   {trl_tps:8.1f} generated tokens/s (median of {args.repeats})")
    print(
        f"ratio {ratio:8.2f}x mmrl / TRL (per-repeat: {', '.join(f'{x:.2f}' for x in ratios)}; goal >= 1.5)"
    )

    split = mmrl_step_split(cfg, base, samples, args.split_steps or args.steps)
    model = sum(split[part] for part in ModelClock.PARTS)
    outside = 1 - model / split["step"]
    print(
        f"mmrl step time split (instrumented run, {args.split_steps or args.steps} steps, {split['step']:.1f} s):"
    )
    for part in ModelClock.PARTS:
        print(f"  {part:<17} {split[part]:7.2f} s ({100 * split[part] / split['step']:4.1f}%)")
    print(f"  {'outside the model':<17} {split['step'] - model:7.2f} s ({100 * outside:4.1f}%)  (goal < 20%)")


if __name__ == "__main__":
    main()
