"""mmrl at real model shapes on one GPU: throughput, where a step's time goes, memory, and the
decode step against the memory bound; TRL's GRPOTrainer beside it; flow-GRPO at SD3.5-medium's
transformer shape. One table.

    python benchmarks/gpu_scale.py                               # the local GPU (~5 min on an H200)
    python benchmarks/gpu_scale.py --only bandwidth,2b,trl       # a subset
    python benchmarks/gpu_scale.py --shape tiny --device cpu     # every path at tiny shapes (CI)

Models are built from config with random weights (nothing is downloaded): Qwen2-VL with the
text decoder of Qwen2-VL-2B (hidden 1536, 28 layers, 12 heads / 2 key-value heads, MLP 8960,
tied embeddings) or -7B (3584, 28, 28 / 4, 18944), the 32-block vision tower of width 1280, and
a vocabulary of 151,936 (7B: 152,064); mmrl's built-in processor and byte tokenizer (patch 8,
merge 2: a 64 x 64 image is 16 tokens; ids past the tokenizer's are padded rows, blocked);
`layer_types` set to the layer count. Data: the built-in `vision_reasoning` task. A random model
seldom samples a stop token, so responses run to the length limit: the decode-heavy case.

Runs (`--only` names them):
    bandwidth  the device's copy bandwidth (read + write of a 2 GiB buffer) and bf16 matmul rate
    2b         mmrl's step at the 2B shape, full fine-tuning, bf16 autocast over float32 master
               weights, 16 prompts x 8 responses of <= 256 tokens, no KL (the settings TRL is
               matched on, as `benchmarks/trl_race.py` matches them)
    trl        TRL's GRPOTrainer at the same settings (bf16 mixed precision), if installed
    7b         mmrl's step at the 7B shape, LoRA rank 64 (adapters merged for the rollout),
               gradient checkpointing, the same batch
    flow       flow-GRPO on a transformer of SD3.5-medium's shape (24 blocks, width 1536, 13
               dual-attention blocks, RMS q/k norm; its text and pooled projections sized for the
               tiny text encoders, which with the tiny VAE are the only tiny parts), 512 px, the
               SD3.5 recipe's sampling (10 steps, guidance 4.5, a window of 3 SDE steps trained,
               KL 0.004), LoRA rank 32 and full fine-tuning, 2 prompts x 4 images

Columns: tokens/s (generated, stop token included; flow: images/s), seconds per step (median of
the timed steps, after one warm-up step), the step split (rollout = the engine's `generate`,
sampling and processor included; trainer forward and backward as timed around the model; the
rest, optimizer and bookkeeping, is `outside`), peak device memory, and the decode step: its
time (`time/decode_step_ms`) and the time to read once, at the measured bandwidth, the
decoder's weights in the compute dtype and the live key/value cache (`rollout/decode_kv_mb`),
and their ratio. For flow the step is one no-grad transformer forward at the sampler's batch,
against max(weights / bandwidth, FLOPs / the measured matmul rate).

Measured figures go to the README with this command and the date; none is claimed here.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trl_race, beside this file

from mmrl.config import Config, load_config  # noqa: E402
from mmrl.models.loading import Policy, make_policy  # noqa: E402
from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm  # noqa: E402
from mmrl.train.data import PromptSampler, load_data  # noqa: E402
from mmrl.train.grpo import grpo_step, make_trainee, seed_everything  # noqa: E402
from mmrl.types import VerifyContext  # noqa: E402

RUNS = ("bandwidth", "2b", "trl", "7b", "flow")

TEXT_SHAPES = {
    # Qwen2-VL-2B / -7B text decoders (config.json of the released checkpoints).
    "2b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
               intermediate_size=8960, vocab_size=151_936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18_944, vocab_size=152_064, tie_word_embeddings=False),
}  # fmt: skip
VISION_SHAPE = dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4)
"""Qwen2-VL's vision tower (both sizes); patch and merge sizes stay the built-in processor's."""


@dataclass
class Settings:
    """What one `--shape` runs."""

    prompts: int
    group: int
    max_new_tokens: int
    timed_steps: int
    lora_rank: int
    copy_bytes: int
    matmul: int
    flow_resolution: int
    flow_steps: int
    flow_window: int


SETTINGS = {
    "real": Settings(16, 8, 256, 2, 64, 2 * 2**30, 8192, 512, 10, 3),
    "tiny": Settings(4, 4, 8, 1, 8, 64 * 2**20, 256, 64, 3, 2),
}


@dataclass
class Row:
    """One line of the table."""

    run: str
    tokens_per_s: float | None = None
    images_per_s: float | None = None
    step_s: float | None = None
    split: dict[str, float] = field(default_factory=dict)
    peak_gib: float | None = None
    decode_ms: float | None = None
    bound_ms: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.decode_ms is None or not self.bound_ms else self.decode_ms / self.bound_ms


# ---------------------------------------------------------------------------------------------
# The device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of `dst.copy_(src)` (each copy reads and writes `nbytes`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def matmul_rate(device: torch.device, n: int, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in the compute dtype (bf16 on CUDA, float32 on the CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# ---------------------------------------------------------------------------------------------
# Models


def qwen2_vl(size: str, shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random Qwen2-VL at `size` (`2b`, `7b`; `--shape tiny`: the built-in tiny one) with the
    built-in processor, built on `device` in `dtype`: a `Policy`."""
    spec = TinyVLMSpec()
    processor = build_processor(spec)
    torch.manual_seed(seed)
    if shape == "tiny":
        model = build_tiny_vlm(spec, seed=seed).to(device=device, dtype=dtype)
        return make_policy(model, processor)
    from transformers import Qwen2VLForConditionalGeneration

    config = build_tiny_vlm(spec, seed=seed).config  # the built-in base's ids and layout
    text = config.get_text_config()
    for key, value in TEXT_SHAPES[size].items():
        setattr(text, key, value)
    text.layer_types = ["full_attention"] * text.num_hidden_layers
    text.rope_parameters["mrope_section"] = [16, 24, 24]  # head size 128, as released
    config.tie_word_embeddings = TEXT_SHAPES[size]["tie_word_embeddings"]
    for key, value in VISION_SHAPE.items():
        setattr(config.vision_config, key, value)
    config.vision_config.hidden_size = text.hidden_size  # the merger's output: the text width
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration._from_config(config, dtype=dtype)
    return make_policy(model, processor)


def decode_weight_bytes(policy: Policy, compute: torch.dtype) -> int:
    """What a decode step reads of the weights: the language model and the LM head (not the
    vision tower), each tensor once, in the compute dtype (LoRA adapters: merged away)."""
    from mmrl.models.adapters import part_of

    seen, total = set(), 0
    size = torch.finfo(compute).bits // 8
    for name, p in policy.model.named_parameters():
        if id(p) in seen or "lora_" in name or part_of(name, policy.model) != "language":
            continue
        seen.add(id(p))
        total += p.numel() * (size if p.is_floating_point() else p.element_size())
    return total


# ---------------------------------------------------------------------------------------------
# mmrl's step, timed by part


class StepClock:
    """Wall time of the engine's `generate`, of the policy's forward outside it (the trainer's
    passes) and of every `Tensor.backward`, each bracketed by device syncs."""

    PARTS = ("rollout", "trainer forward", "backward")

    def __init__(self, model: torch.nn.Module, engine, device: torch.device):
        self.model, self.engine, self.device = model, engine, device
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self._rollout = False

    def _timed(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            sync(self.device)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(self.device)
                self.seconds[part] += time.perf_counter() - start

        return timed

    @contextlib.contextmanager
    def installed(self):
        clock, started = self, []
        generate, backward = self.engine.generate, torch.Tensor.backward

        def rollout(*args, **kwargs):
            clock._rollout = True
            try:
                return clock._timed("rollout", generate)(*args, **kwargs)
            finally:
                clock._rollout = False

        def before(module, args):
            if not clock._rollout:
                sync(clock.device)
                started.append(time.perf_counter())

        def after(module, args, output):
            if not clock._rollout and started:
                sync(clock.device)
                clock.seconds["trainer forward"] += time.perf_counter() - started.pop()

        self.engine.generate = rollout
        hooks = [self.model.register_forward_pre_hook(before),
                 self.model.register_forward_hook(after, always_call=True)]  # fmt: skip
        torch.Tensor.backward = self._timed("backward", backward)
        try:
            yield self
        finally:
            del self.engine.generate
            for hook in hooks:
                hook.remove()
            torch.Tensor.backward = backward


def vlm_config(s: Settings, device: torch.device, shape: str, *extra: str) -> Config:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return load_config(
        "vision_reasoning",
        overrides=[
            f"trainer.device={device}", f"model.dtype={dtype}", "trainer.progress=false", "reward.num_workers=0",
            "optim.schedule=constant", f"trainer.prompts_per_step={s.prompts}", f"rollout.group_size={s.group}",
            f"rollout.max_new_tokens={s.max_new_tokens}", "algo.kl_coef=0.0", *extra,
        ],
    )  # fmt: skip


def run_mmrl(
    name: str, cfg: Config, policy: Policy, s: Settings, device: torch.device, bandwidth: float
) -> Row:
    """One warm-up step, then `s.timed_steps` timed ones."""
    seed_everything(cfg.trainer.seed)
    samples, _ = load_data(cfg)
    reset_peak(device)
    t = make_trainee(cfg, policy)
    sampler = PromptSampler(samples, cfg.trainer.seed)
    clock = StepClock(t.policy.model, t.engine, device)
    seconds, tokens, decode_ms, kv_mb = [], 0.0, [], []
    try:
        grpo_step(cfg, t, sampler, VerifyContext(0, s.timed_steps + 1), step=1)
        with clock.installed():
            for step in range(1, s.timed_steps + 1):
                sync(device)
                start = time.perf_counter()
                m = grpo_step(cfg, t, sampler, VerifyContext(step, s.timed_steps + 1), step=step + 1)
                sync(device)
                seconds.append(time.perf_counter() - start)
                tokens += m["throughput/generated_tokens_per_s"] * m["time/step_s"]
                if "time/decode_step_ms" in m:
                    decode_ms.append(m["time/decode_step_ms"])
                    kv_mb.append(m["rollout/decode_kv_mb"])
    finally:
        t.router.close()
    total = sum(seconds)
    split = {part: clock.seconds[part] / total for part in StepClock.PARTS}
    split["outside"] = 1 - sum(split.values())
    row = Row(name, tokens_per_s=tokens / total, step_s=statistics.median(seconds), split=split,
              peak_gib=peak_gib(device))  # fmt: skip
    if decode_ms:
        compute = t.policy.precision.compute
        read = decode_weight_bytes(t.policy, compute) + statistics.mean(kv_mb) * 2**20
        row.decode_ms, row.bound_ms = statistics.mean(decode_ms), 1000 * read / bandwidth
        facts = t.engine.rollout_metrics() if hasattr(t.engine, "rollout_metrics") else {}
        row.note = f"decode {'captured' if facts.get('rollout/decode_captured') else 'uncaptured'}"
        if facts.get("rollout/lora_merged"):
            row.note += ", LoRA merged"
    del t
    return row


def run_trl_race(cfg: Config, policy: Policy, s: Settings, device: torch.device, size: str) -> Row:
    from trl_race import check_same_prompts, run_trl, throughput, trl_dataset

    samples, _ = load_data(cfg)
    dataset = trl_dataset(samples)
    check_same_prompts(policy, samples, dataset)
    reset_peak(device)
    rows = run_trl(cfg, None, samples, dataset, s.timed_steps, policy=policy, bf16=device.type == "cuda")
    return Row(f"TRL GRPOTrainer {size}, same settings", tokens_per_s=throughput(rows),
               step_s=statistics.median(x for x, _ in rows), peak_gib=peak_gib(device),
               note=f"TRL {__import__('trl').__version__}, HF generate")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# flow-GRPO


def sd35_medium_transformer(spec, device: torch.device):
    """A random SD3Transformer2DModel of SD3.5-medium's shape for `spec`'s resolution, with its
    text and pooled projections sized for `spec`'s tiny CLIP encoders."""
    from diffusers import SD3Transformer2DModel

    with torch.device(device):
        return SD3Transformer2DModel(
            sample_size=spec.resolution // 8, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
            attention_head_dim=64, num_attention_heads=24, joint_attention_dim=2 * spec.text_width,
            caption_projection_dim=1536, pooled_projection_dim=2 * spec.text_width, pos_embed_max_size=384,
            qk_norm="rms_norm", dual_attention_layers=tuple(range(13)),
        )  # fmt: skip


def run_flow(s: Settings, shape: str, device: torch.device, bandwidth: float, rate: float) -> list[Row]:
    from torch.utils.flop_counter import FlopCounterMode

    from mmrl.models.tiny_diffusion import TinyDiffusionSpec, build_tiny_pipeline
    from mmrl.train.flow_config import load_flow_config
    from mmrl.train.flow_grpo import flow_grpo_step, make_flow_trainee
    from mmrl.train.flow_grpo import seed_everything as flow_seed

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    label = "tiny SD3" if shape == "tiny" else "SD3.5-m"
    rows = []
    for lora in (True, False):
        cfg = load_flow_config(
            "text_to_image_jpeg",
            overrides=[
                f"trainer.device={device}", f"model.dtype={dtype}", "trainer.progress=false",
                f"sample.resolution={s.flow_resolution}", f"model.tiny.resolution={s.flow_resolution}",
                f"sample.num_steps={s.flow_steps}", f"sample.sde_window_size={s.flow_window}",
                "sample.guidance_scale=4.5", "sample.group_size=4", "sample.batch_size=8",
                "trainer.prompts_per_step=2", "trainer.mini_batches=2", "algo.kl_coef=0.004",
                f"lora.enabled={str(lora).lower()}", "lora.rank=32", "lora.alpha=64",
            ],
        )  # fmt: skip
        flow_seed(cfg.trainer.seed)
        spec = TinyDiffusionSpec(resolution=s.flow_resolution)
        pipe = build_tiny_pipeline(spec, seed=0)
        if shape != "tiny":
            pipe.register_modules(transformer=sd35_medium_transformer(spec, device))
        reset_peak(device)
        t = make_flow_trainee(cfg, pipe)
        prompts = ["a red circle", "two blue squares"]
        calls: list[dict] = []

        def keep_first(module, args, kwargs, calls=calls):
            if not calls:
                calls.append(kwargs)

        hook = t.transformer.register_forward_pre_hook(keep_first, with_kwargs=True)
        flow_grpo_step(cfg, t, prompts, step=0)  # warm-up (and one transformer call's inputs)
        hook.remove()
        seconds, sampling, updating, images = [], [], [], 0
        for step in range(1, s.timed_steps + 1):
            sync(device)
            start = time.perf_counter()
            m = flow_grpo_step(cfg, t, prompts, step=step)
            sync(device)
            seconds.append(time.perf_counter() - start)
            sampling.append(m["time/rollout_s"])
            updating.append(m["time/update_s"])
            images += 2 * cfg.sample.group_size
        kind = "LoRA 32" if lora else "full"
        total = sum(seconds)
        split = {"rollout": sum(sampling) / total, "trainer forward": sum(updating) / total}
        split["outside"] = 1 - split["rollout"] - split["trainer forward"]
        rows.append(Row(f"flow-GRPO {label} {kind}", images_per_s=images / total,
                        step_s=statistics.median(seconds), peak_gib=peak_gib(device), split=split,
                        note=f"{cfg.sample.num_steps} steps, window {cfg.sample.sde_window_size}; fwd = the "
                             "update (forward + backward); outside = rewards, bookkeeping"))  # fmt: skip
        if lora:  # the decoder step once: the no-grad forward at the sampler's batch
            kwargs = {k: v for k, v in calls[0].items() if isinstance(v, torch.Tensor | bool | None)}
            with torch.no_grad(), t.sampler.autocast():
                with FlopCounterMode(display=False) as flops:
                    t.transformer(**kwargs)
                sync(device)
                start = time.perf_counter()
                for _ in range(3):
                    t.transformer(**kwargs)
                sync(device)
            step_ms = 1000 * (time.perf_counter() - start) / 3
            size = 2 if device.type == "cuda" else 4
            weights = sum(p.numel() for n, p in t.transformer.named_parameters() if "lora_" not in n) * size
            bound = 1000 * max(weights / bandwidth, flops.get_total_flops() / rate)
            rows.append(Row(f"flow {label} decoder step, no grad", step_s=sum(sampling) / len(sampling),
                            decode_ms=step_ms, bound_ms=bound,
                            note=f"{flops.get_total_flops() / 1e9:.3g} GFLOP, batch {kwargs['hidden_states'].shape[0]}; "
                                 "step s = a step's whole no-grad sampling"))  # fmt: skip
        del t, pipe
    return rows


# ---------------------------------------------------------------------------------------------


def table(rows: list[Row], bandwidth: float | None, rate: float | None) -> str:
    lines = []
    if bandwidth:
        lines.append(
            f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); matmul {rate / 1e9:.0f} GFLOP/s"
        )
    head = (f"{'run':<42} {'tok/s':>8} {'img/s':>6} {'step s':>7} {'rollout':>7} {'fwd':>5} {'bwd':>5} "
            f"{'outside':>7} {'peak GiB':>8} {'dec ms':>7} {'bound ms':>8} {'ratio':>5}  note")  # fmt: skip
    lines += [head, "-" * len(head)]

    def f(x, spec):
        return format(x, spec) if x is not None else "-".rjust(len(format(0, spec)))

    for r in rows:

        def pct(part, width, r=r):
            x = r.split.get(part)
            return f"{100 * x:{width - 1}.0f}%" if x is not None else "-".rjust(width)

        lines.append(
            f"{r.run:<42} {f(r.tokens_per_s, '8.0f')} {f(r.images_per_s, '6.2f')} {f(r.step_s, '7.2f')} "
            f"{pct('rollout', 7)} {pct('trainer forward', 5)} {pct('backward', 5)} {pct('outside', 7)} "
            f"{f(r.peak_gib, '8.1f')} {f(r.decode_ms, '7.2f')} {f(r.bound_ms, '8.2f')} {f(r.ratio, '5.1f')}  {r.note}"
        )  # fmt: skip
    return "\n".join(lines)


def quiet() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with contextlib.suppress(ImportError):
        import diffusers

        diffusers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    for name in ("trl", "accelerate", "DeepSpeed", "mmrl", "diffusers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=("real", "tiny"), default="real", help="real shapes, or tiny (CI)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --shape tiny)")
    parser.add_argument("--only", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    only = [r.strip() for r in args.only.split(",") if r.strip()]
    if unknown := sorted(set(only) - set(RUNS)):
        parser.error(f"--only: unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --shape tiny --device cpu)")
    if args.shape == "real" and device.type != "cuda":
        parser.error("--shape real needs a GPU (use --shape tiny --device cpu)")
    quiet()
    s = SETTINGS[args.shape]
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "host CPU"
    print(f"gpu_scale: --shape {args.shape} on {device} ({name}), torch {torch.__version__}", flush=True)
    bandwidth = copy_bandwidth(device, s.copy_bytes)
    rate = matmul_rate(device, s.matmul)
    rows: list[Row] = []
    dtype = torch.float32  # master weights (the compute dtype comes with model.dtype)
    size = {"2b": "2B", "7b": "7B"} if args.shape == "real" else {"2b": "tiny", "7b": "tiny"}
    if "2b" in only:
        cfg = vlm_config(s, device, args.shape)
        policy = qwen2_vl("2b", args.shape, device, dtype)
        rows.append(run_mmrl(f"mmrl {size['2b']} full FT", cfg, policy, s, device, bandwidth))
        del policy
        print(table(rows[-1:], None, None).splitlines()[-1], flush=True)
    if "trl" in only:
        try:
            import trl  # noqa: F401
        except ImportError:
            rows.append(
                Row(f"TRL GRPOTrainer {size['2b']}, same settings", note="TRL not installed (.[bench])")
            )
        else:
            cfg = vlm_config(s, device, args.shape)
            rows.append(run_trl_race(cfg, qwen2_vl("2b", args.shape, device, dtype), s, device, size["2b"]))
        print(table(rows[-1:], None, None).splitlines()[-1], flush=True)
    if "7b" in only:
        extra = (f"model.lora_rank={s.lora_rank}", "model.gradient_checkpointing=true")
        cfg = vlm_config(s, device, args.shape, *extra)
        lora_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the frozen base
        policy = qwen2_vl("7b", args.shape, device, lora_dtype)
        rows.append(
            run_mmrl(f"mmrl {size['7b']} LoRA {s.lora_rank} + grad ckpt", cfg, policy, s, device, bandwidth)
        )
        del policy
        print(table(rows[-1:], None, None).splitlines()[-1], flush=True)
    if "flow" in only:
        rows += run_flow(s, args.shape, device, bandwidth, rate)

    print()
    print(table(rows, bandwidth, rate))
    if len({"2b", "trl"} & set(only)) == 2 and rows[0].tokens_per_s and rows[1].tokens_per_s:
        print(
            f"mmrl / TRL at the {size['2b']} shape: {rows[0].tokens_per_s / rows[1].tokens_per_s:.2f}x generated tokens/s"
        )
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "shape": args.shape,
                    "device": name,
                    "bandwidth": bandwidth,
                    "matmul": rate,
                    "rows": [{**r.__dict__, "ratio": r.ratio} for r in rows],
                },
                indent=1,
            )  # fmt: skip
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
