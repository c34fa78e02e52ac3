"""Peak memory of the log-prob pass and of a GRPO step at a real vocabulary, on the CPU.

    python benchmarks/memory.py                                  # the issue's shape: 8 x 8 x 512
    python benchmarks/memory.py --prompts 2 --group 4 --length 512 --variants pass-plain pass-chunked
    python benchmarks/memory.py --micro-rows 8 --variants pass-chunked     # rows 8 at a time
    pip install -c constraints.txt -e ".[bench]"                 # TRL, for the step-trl variant

The model is a Qwen2.5-VL built from config with the real 151,936-token vocabulary and the 3B
model's text shape (hidden 2048, MLP 11008, 16 heads, 2 key/value heads, tied embeddings) but
two layers and a tiny vision tower, float32, randomly initialised (about 0.5B parameters, almost
all of them the embedding). Prompts are the built-in task's (one 64x64 image each), through the
built-in processor (a byte tokenizer: the ids above it are blocked, as padded vocabulary rows
are, so sampling never produces them; the LM head still computes all 151,936 logits).

Each variant runs in a fresh process (`--variant`) that builds the model, then resets the
kernel's high-water mark of its resident set (`/proc/self/clear_refs`) and measures the peak
(`VmHWM`) of what follows, above the resident set before it:

- `pass-plain`: the no-grad log-prob pass computed the plain way, as mmrl did before and as most
  code does: the model's full logits [N, R, V] in float32, blocked ids masked, log-softmax,
  gather.
- `pass-chunked`: mmrl's pass (`mmrl.train.forward.response_logprobs`, the LM head and the
  log-softmax run a chunk of positions at a time, `trainer.logits_chunk_mb`).
- `step-chunked` / `step-plain`: one whole GRPO step of mmrl's trainer (`make_trainee`, then
  generation of B x G responses of exactly `--length` tokens, the old log-prob pass, and
  `trainer.mini_batches` AdamW updates), with mmrl's chunked pass or with the plain pass patched
  in everywhere the trainer computes log-probs. The rewards are random 0/1 (so every group has
  non-zero advantages); the stop token is never sampled, so every response is `--length` tokens.
- `step-trl`: the same step in TRL's `GRPOTrainer` (its own fused, chunked LM head), on the same
  model object, prompts, group size, mini-batches (`steps_per_generation`), response length
  (`min_new_tokens` = `max_completion_length`) and random 0/1 rewards, `beta=0`, float32 on the CPU.

`--micro-rows` is `trainer.micro_batch_rows` (rows per forward and backward; the no-grad pass
runs in the same row chunks) and, for TRL, its per-device batch with gradient accumulation up to
the same mini-batch; `--logits-chunk-mb` is `trainer.logits_chunk_mb`. The model's own
activations grow with rows x length (an MLP intermediate of 11,008 per token is 7% of a
151,936-logit row), so bounding the pass takes both: few rows a forward, small logit chunks.

Prints, per variant, the peak above the model and the ratio to the full float32 logits tensor
[N, R, V] (the goal for the pass: at most 1/8), and the step's peak against TRL's (the goal: at
most 0.5x). Figures depend on the allocator; run where you compare.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 151_936
VARIANTS = ("pass-plain", "pass-chunked", "step-plain", "step-chunked", "step-trl")
GiB = 2**30


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Resets the resident set's high-water mark to the current size; returns that size."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def build_model(layers: int):
    """The benchmark's Qwen2.5-VL (see the module docs) and its policy wrapper."""
    import torch

    from mmrl.models.loading import make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm

    spec = TinyVLMSpec(
        architecture="qwen2_5_vl",
        hidden_size=2048,
        num_layers=layers,
        num_heads=16,
        num_kv_heads=2,
        intermediate_size=11008,
    )
    torch.manual_seed(0)
    model = build_tiny_vlm(spec)
    model.config.tie_word_embeddings = True
    model.config.get_text_config().tie_word_embeddings = True
    model.resize_token_embeddings(VOCAB, mean_resizing=False)
    model.tie_weights()
    assert model.get_output_embeddings().weight.shape == (VOCAB, 2048)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    return make_policy(model, build_processor(spec))


def plain_response_logprobs(model, batch, blocked, temperature, with_entropy=False, **_):
    """The plain pass: full logits [N, R, V] in float32, masked, log-softmax, gather."""
    import torch

    from mmrl.train.batching import model_inputs

    P, R = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logits = model(**model_inputs(batch), use_cache=False).logits[:, P - 1 : P + R - 1].float()
    logits = logits.masked_fill(blocked, float("-inf")) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    logp = logp * batch.response_mask
    entropy = None
    if with_entropy:
        p = logp_all.exp()
        entropy = -(p * logp_all.nan_to_num(neginf=0.0)).sum(-1).detach()
    return logp, entropy


def _config(args):
    from mmrl.config import load_config

    return load_config(
        "vision_reasoning",
        overrides=[
            f"trainer.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.group}",
            f"rollout.max_new_tokens={args.length}",
            f"trainer.mini_batches={args.mini_batches}",
            f"trainer.micro_batch_rows={args.micro_rows}",
            f"trainer.logits_chunk_mb={args.logits_chunk_mb}",
            "algo.kl_coef=0",
            "trainer.device=cpu",
            "model.dtype=float32",
            "reward.num_workers=0",
            "trainer.progress=false",
        ],
    )


def _samples(cfg, count: int):
    from mmrl.train.data import load_data

    train, _ = load_data(cfg)
    return train[:count]


def run_variant(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    cfg = _config(args)
    policy = build_model(args.layers)
    samples = _samples(cfg, args.prompts)
    N, R = args.prompts * args.group, args.length
    rng = random.Random(0)
    out: dict = {"variant": args.variant, "rows": N, "length": R}

    if args.variant.startswith("pass-"):
        from mmrl.models.base import teacher_forced_batch
        from mmrl.train.forward import response_logprobs
        from mmrl.train.update import logits_chunk

        rows = [s for s in samples for _ in range(args.group)]
        targets = ["".join(rng.choice("abcdefghij0123456789 ") for _ in range(R - 1)) for _ in rows]
        batch = teacher_forced_batch(policy, rows, targets)
        assert batch.response_ids.shape == (N, R), batch.response_ids.shape
        fn = plain_response_logprobs if args.variant == "pass-plain" else response_logprobs
        kwargs = {} if args.variant == "pass-plain" else {"chunk": logits_chunk(cfg, policy)}
        policy.model.eval()
        # As the trainer runs it (mmrl.train.update.old_and_ref_logprobs): rows in micro-batches
        # of `trainer.micro_batch_rows` (0: all at once), each through the pass.
        from mmrl.train.batching import select_rows
        from mmrl.train.update import row_chunks

        subs = [select_rows(batch, rows) for rows in row_chunks(cfg, N)]
        base = reset_peak()
        start = time.perf_counter()
        with torch.no_grad():
            logp = torch.cat([fn(policy.model, sub, policy.blocked, 1.0, **kwargs)[0] for sub in subs])
        out["seconds"] = time.perf_counter() - start
        out["peak_above_model"] = _status("VmHWM") - base
        out["checksum"] = float(logp.sum())
        return out

    if args.variant == "step-trl":
        return run_trl(args, cfg, policy, samples, out)

    import mmrl.train.update as update
    from mmrl.rollout.hf import SamplingParams
    from mmrl.router import RewardBatch
    from mmrl.train.grpo import learn_from_rollouts, make_trainee
    from mmrl.types import VerifierResult

    if args.variant == "step-plain":
        update.response_logprobs = plain_response_logprobs  # every log-prob pass of the trainer
    # The stop token is never sampled: every response is exactly `--length` tokens.
    never = int(policy.blocked.nonzero()[-1])
    policy.stop_token_ids = [never]
    t = make_trainee(cfg, policy)
    base = reset_peak()
    start = time.perf_counter()
    batch = t.engine.generate(
        samples, SamplingParams(n=args.group, temperature=cfg.rollout.temperature, max_new_tokens=R)
    )
    assert int(batch.response_mask.sum()) == N * R, "a response stopped early"
    gen = random.Random(1)
    scores = [float(gen.random() < 0.5) for _ in range(N)]
    rows = [s for s in samples for _ in range(args.group)]
    rewards = RewardBatch.of([VerifierResult(score=x) for x in scores], rows)
    metrics = learn_from_rollouts(cfg, t, batch, rewards, {}, 1, time.monotonic())
    out["seconds"] = time.perf_counter() - start
    out["peak_above_model"] = _status("VmHWM") - base
    out["grad_norm"] = metrics.get("actor/grad_norm")
    t.router.close()
    return out


def run_trl(args, cfg, policy, samples, out: dict) -> dict:
    """One TRL GRPOTrainer step (one generation, `mini_batches` optimizer steps)."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from datasets import Dataset

    B, G, R, mb = args.prompts, args.group, args.length, args.mini_batches
    micro = args.micro_rows or B * G // mb  # rows per forward/backward, as mmrl's micro-batches
    accumulate = B * G // mb // micro
    dataset = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": s.prompt[0]["content"][len("<image>") :]}] for s in samples
            ],
            "image": [s.pil_images()[0] for s in samples],
        }
    )
    gen = random.Random(1)

    def random_reward(prompts, completions, **kwargs) -> list[float]:
        return [float(gen.random() < 0.5) for _ in completions]

    marks: dict[str, float] = {}

    class Peak(TrainerCallback):
        def on_train_begin(self, a, state, control, **kwargs):
            marks["base"] = reset_peak()
            marks["start"] = time.perf_counter()

        def on_train_end(self, a, state, control, **kwargs):
            marks["peak"] = _status("VmHWM")
            marks["end"] = time.perf_counter()

    trl_args = GRPOConfig(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "mmrl-memory-trl"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulate,
        # one generation of B x G, then `mb` optimizer steps of `accumulate` micro-batches each
        steps_per_generation=mb * accumulate,
        num_generations=G,
        max_completion_length=R,
        temperature=cfg.rollout.temperature,
        top_p=1.0,
        top_k=0,
        generation_kwargs={
            "suppress_tokens": policy.blocked.nonzero().flatten().tolist(),
            "min_new_tokens": R,
        },
        beta=0.0,
        loss_type="dapo",
        epsilon=cfg.algo.clip_low,
        epsilon_high=cfg.algo.clip_high,
        learning_rate=cfg.optim.lr,
        max_steps=mb,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        seed=0,
        report_to="none",
        save_strategy="no",
        logging_steps=10**9,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=[random_reward],
        args=trl_args,
        train_dataset=dataset,
        processing_class=policy.processor,
        callbacks=[Peak()],
    )
    torch.set_num_threads(args.threads)
    trainer.train()
    out["seconds"] = marks["end"] - marks["start"]
    out["peak_above_model"] = marks["peak"] - marks["base"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8, help="B, prompts per step")
    parser.add_argument("--group", type=int, default=8, help="G, responses per prompt")
    parser.add_argument("--length", type=int, default=512, help="R, tokens per response")
    parser.add_argument("--mini-batches", type=int, default=2)
    parser.add_argument(
        "--micro-rows",
        type=int,
        default=0,
        help="rows per forward/backward (trainer.micro_batch_rows; TRL: per-device batch with "
        "gradient accumulation); 0: a whole mini-batch at once",
    )
    parser.add_argument(
        "--logits-chunk-mb",
        type=int,
        default=128,
        help="trainer.logits_chunk_mb: float32 logits per chunk of the chunked LM head",
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one, in this process
    args = parser.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return

    N, R = args.prompts * args.group, args.length
    full = N * R * VOCAB * 4
    print(f"Qwen2.5-VL-shaped, vocab {VOCAB}, hidden 2048, {args.layers} layers, float32, CPU")
    print(
        f"{args.prompts} prompts x {args.group} responses x {R} tokens ({N} rows, "
        f"{args.micro_rows or 'all'} a forward, chunks of {args.logits_chunk_mb} MB); "
        f"full float32 logits [N, R, V] = {full / GiB:.2f} GiB"
    )
    results: dict[str, dict] = {}
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--variant", variant] + [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k
            in (
                "prompts",
                "group",
                "length",
                "mini_batches",
                "micro_rows",
                "logits_chunk_mb",
                "layers",
                "threads",
            )
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            print(f"  {variant:<13} failed (exit {proc.returncode}): {' | '.join(tail)}")
            continue
        r = results[variant] = json.loads(lines[-1][len("RESULT ") :])
        print(
            f"  {variant:<13} peak above the model {r['peak_above_model'] / GiB:6.2f} GiB "
            f"({r['peak_above_model'] / full:5.3f} x the full logits), {r['seconds']:7.1f} s",
            flush=True,
        )
    if "pass-chunked" in results and "pass-plain" in results:
        a, b = results["pass-chunked"], results["pass-plain"]
        print(
            f"pass: chunked / plain = {a['peak_above_model'] / b['peak_above_model']:.3f}; "
            f"chunked / full logits = {a['peak_above_model'] / full:.3f} (goal <= 0.125); "
            f"log-prob sums {a['checksum']:.1f} vs {b['checksum']:.1f}"
        )
    for other in ("step-plain", "step-trl"):
        if "step-chunked" in results and other in results:
            ratio = results["step-chunked"]["peak_above_model"] / results[other]["peak_above_model"]
            goal = " (goal <= 0.5)" if other == "step-trl" else ""
            print(f"step: mmrl chunked / {other} = {ratio:.3f}{goal}")


if __name__ == "__main__":
    main()
