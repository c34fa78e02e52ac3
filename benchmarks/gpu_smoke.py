"""A few GRPO steps of the default task on an accelerator: peak memory and tokens/s.

    python benchmarks/gpu_smoke.py                                   # built-in base, bf16, cuda
    python benchmarks/gpu_smoke.py --model Qwen/Qwen2.5-VL-3B-Instruct model.lora_rank=64 \\
        model.gradient_checkpointing=true rollout.max_new_tokens=512
    python benchmarks/gpu_smoke.py --device cpu model.dtype=bfloat16   # the same path on a CPU

The run is the trainer's own step (`make_trainee` + `grpo_step`) with `trainer.device` and
`model.dtype` set from the flags (defaults: `auto`, which means the local GPU and bfloat16), so
what it exercises is what `mmrl train` does: the policy and the KL reference placed on the device,
generation, rewards, the chunked log-prob pass, mixed-precision updates. It prints, per step, the
time, the generated tokens and the loss, then the median tokens/s over the steps after the first
(warm-up) and the median decode step time (`time/decode_step_ms`), the peak device memory
(`torch.cuda.max_memory_allocated`/`reserved`; on a CPU the process's peak resident set) and
where the parameters live and in which dtypes. It fails (exit 1)
when a loss is not finite, when a parameter is not on the requested device, or when the trainable
weights did not change.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from mmrl.config import load_config  # noqa: E402
from mmrl.models.base import builtin_base  # noqa: E402
from mmrl.train.data import PromptSampler, load_data  # noqa: E402
from mmrl.train.grpo import grpo_step, load_policy_for, make_trainee, seed_everything  # noqa: E402
from mmrl.types import VerifyContext  # noqa: E402


def _peak_host_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="a local folder or a hub id (default: the built-in base)"
    )
    parser.add_argument("--steps", type=int, default=4, help="steps in all; the first is the warm-up")
    parser.add_argument("--device", default="auto", help="trainer.device (default auto: the local GPU)")
    parser.add_argument("--dtype", default="auto", help="model.dtype (default auto: bfloat16 on a GPU)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (one warm-up step, then measured ones)")

    overrides = [
        f"trainer.device={args.device}",
        f"model.dtype={args.dtype}",
        "trainer.progress=false",
        "reward.num_workers=0",
        *args.overrides,
    ]
    cfg = load_config("vision_reasoning", overrides=overrides)
    seed_everything(cfg.trainer.seed)
    train_samples, _ = load_data(cfg)
    policy = load_policy_for(cfg, args.model or cfg.model.path or builtin_base(cfg))
    trainee = make_trainee(cfg, policy)
    device = policy.device
    cuda = device.type == "cuda"
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if cuda else 'host'}), {policy.precision.describe()}"
    )
    dtypes: dict[str, int] = {}
    for name, p in policy.model.named_parameters():
        if p.device != device:
            print(f"FAIL: parameter {name} is on {p.device}, not {device}")
            return 1
        key = f"{p.dtype}{' trainable' if p.requires_grad else ' frozen'}"
        dtypes[key] = dtypes.get(key, 0) + p.numel()
    for key, n in sorted(dtypes.items()):
        print(f"  parameters {key:<28} {n / 1e6:10.1f} M")
    before = {
        n: p.detach().float().cpu().clone() for n, p in policy.model.named_parameters() if p.requires_grad
    }
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    sampler = PromptSampler(train_samples, cfg.trainer.seed)
    tokens_per_s: list[float] = []
    decode_ms: list[float] = []
    try:
        trainee.router.warm_up()
        for step in range(args.steps):
            start = time.perf_counter()
            row = grpo_step(cfg, trainee, sampler, VerifyContext(step, args.steps))
            if cuda:
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - start
            tokens = row["throughput/generated_tokens_per_s"] * row["time/step_s"]
            loss = row["actor/pg_loss"]
            print(
                f"step {step}: {wall:7.2f} s, {tokens:8.0f} generated tokens, "
                f"reward {row.get('reward/mean', float('nan')):.3f}, loss {loss:.4f}"
                + ("  (warm-up)" if step == 0 else "")
            )
            if not torch.isfinite(torch.tensor(loss)):
                print("FAIL: the loss is not finite")
                return 1
            if step > 0:
                tokens_per_s.append(tokens / wall)
                if "time/decode_step_ms" in row:
                    decode_ms.append(row["time/decode_step_ms"])
    finally:
        trainee.router.close()

    changed = sum(
        not torch.equal(before[n], p.detach().float().cpu())
        for n, p in policy.model.named_parameters()
        if p.requires_grad
    )
    print(f"generated tokens/s (median of {len(tokens_per_s)} steps): {statistics.median(tokens_per_s):.1f}")
    if decode_ms:  # the shared-prompt sampler's decode loop (rollout.decode; captured on CUDA by default)
        print(f"decode step (median): {statistics.median(decode_ms):.2f} ms")
    if cuda:
        print(
            f"peak device memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated, "
            f"{torch.cuda.max_memory_reserved(device) / 2**30:.2f} GiB reserved"
        )
    print(f"peak host resident set: {_peak_host_gb():.2f} GiB")
    print(f"trainable tensors changed: {changed} of {len(before)}")
    if changed == 0:
        print("FAIL: no trainable weight changed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
