"""The built-in image base: a tiny SD3 given a short flow-matching warm-up on drawings, cached.

The diffusion counterpart of the VLM's built-in base (`mmrl.models.base`). flow-GRPO improves
what a generator can already sometimes do; a random tiny SD3 draws noise, and no reward a
person can check moves noise. So the base is made once: the tiny SD3 of `model.tiny` (by
default in the recipe: 32 x 32 pixels, the pixel "VAE", patch 4, width 128, 3 blocks, word-level
CLIP text encoders; ~1.7M transformer parameters) is trained with the rectified-flow loss of
SD3 (Esser et al., 2024) on procedurally drawn images of GenEval-style prompts
(`mmrl.datasets.geneval`): for a drawing x0, noise e and sigma from the logit-normal
distribution (shifted like the scheduler), x_t = (1 - sigma) x0 + sigma e, and the transformer's
velocity is regressed on e - x0; the text encoders train with it, and a share of the prompts is
replaced by the empty prompt (so classifier-free guidance is possible later). It draws only
training prompts (`geneval_prompts("train")`): no held-out prompt, so no withheld colour-shape
pair, is ever drawn. Every `eval_every` steps the deterministic ODE sampler draws the validation
prompts (a sample of the training prompts) and the `geneval` rules score them; the
warm-up stops at the first evaluation at or above `target_accuracy` (or after `max_steps`):
clearly imperfect, but following prompts sometimes. What is evaluated and saved is an EMA of the
weights (`ema_decay`).

The pipeline is saved with `save_pretrained` under a key of everything that determines it (the
architecture, the warm-up settings and seeds, the recipe version), with `warmup.json` (the
evaluation history and the wall time), so the same settings give the same base and later runs
load it from the cache. The global random generators are left as they were.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from mmrl.models.base_cache import cache_root, cached_base
from mmrl.models.tiny_diffusion import TinyDiffusionSpec, build_tiny_pipeline

log = logging.getLogger(__name__)

IMAGE_BASE_VERSION = 3
"""Part of the cache key: bump it when the warm-up recipe changes (2: the `geneval` verifier that
decides when the warm-up stops names shapes by moment-matched templates; 3: the warm-up draws no
prompt of a withheld colour-shape pair, and the rebuilt verifier decides when it stops)."""


@dataclass
class ImageWarmupConfig:
    """The supervised flow-matching warm-up that makes the built-in image base (`model.base=geneval`)."""

    max_steps: int = 1500
    """Give up (and keep the pipeline as it is) after this many steps."""
    batch_size: int = 32
    """Drawings per step."""
    lr: float = 1e-3
    """AdamW learning rate (constant; the transformer and both text encoders train)."""
    cond_dropout: float = 0.1
    """Share of the prompts replaced by the empty prompt (classifier-free guidance later)."""
    ema_decay: float = 0.99
    """Decay of the EMA of the weights that is evaluated and saved (warmed up as the trainer's:
    min(decay, (1 + n) / (10 + n)); the live weights at a constant learning rate draw speckled
    images)."""
    eval_every: int = 100
    """Steps between validation evaluations (deterministic ODE sampler, `geneval` rules)."""
    eval_size: int = 96
    """Validation images per evaluation (the training prompts with a fixed seed)."""
    eval_num_steps: int = 12
    """ODE steps of a validation evaluation."""
    target_accuracy: float = 0.3
    """Stop at the first evaluation whose strict GenEval accuracy reaches this."""
    kinds: list[str] = field(default_factory=lambda: ["single", "count", "position"])
    """Prompt kinds drawn (`mmrl.datasets.geneval.KINDS`; `text` needs more pixels than 32)."""
    seed: int = 0
    """Seed of the random initialisation, the drawings, the noise and the data order."""
    object_scale: float = 1.0
    """Size of the drawn shapes relative to `mmrl.datasets.geneval.draw`'s (capped where they
    would not fit): larger shapes span more of the patch-4 transformer's tokens, so a short
    warm-up draws outlines the verifier can tell apart."""


def image_base_key(spec: TinyDiffusionSpec, warmup: ImageWarmupConfig, max_sequence_length: int) -> str:
    """Hash of everything that determines the built-in image base."""
    warm = asdict(warmup)
    if warm["object_scale"] == 1.0:  # the drawings of before the field: the keys of before
        del warm["object_scale"]
    raw = {
        "version": IMAGE_BASE_VERSION,
        "tiny": asdict(spec),
        "warmup": warm,
        "max_sequence_length": max_sequence_length,
    }
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def builtin_image_base(
    spec: TinyDiffusionSpec,
    warmup: ImageWarmupConfig,
    cache_dir: str | None = None,
    device: str | torch.device = "cpu",
    max_sequence_length: int = 8,
    progress: bool = True,
) -> Path:
    """Path of the built-in image base, warming it up (on `device`, with a progress bar unless
    `progress` is off) first if it is not cached."""
    path = (
        cache_root(cache_dir)
        / "bases"
        / f"image-{spec.family}-{image_base_key(spec, warmup, max_sequence_length)}"
    )

    def build():
        pipe, report = warm_up_image_base(spec, warmup, device, max_sequence_length, progress)
        return (lambda folder: pipe.to("cpu").save_pretrained(folder)), report

    return cached_base(path, "the built-in image base (flow-matching warm-up)", build)


def drawings_to_latents(pipe, images: np.ndarray, device: torch.device) -> torch.Tensor:
    """[N, H, W, 3] uint8 drawings -> [N, C, h, w] scaled latents (the pipeline's convention:
    (encode(2x - 1) - shift) x scale)."""
    x = torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float() / 255.0
    vae = pipe.vae
    with torch.no_grad():
        out = vae.encode(x * 2 - 1)
        z = out.latents if hasattr(out, "latents") else out.latent_dist.mode()
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return (z - shift) * vae.config.scaling_factor


def flow_matching_loss(transformer, latents: torch.Tensor, cond, sigmas: torch.Tensor, noise: torch.Tensor):
    """SD3's rectified-flow loss: mean over elements of (v(x_t, sigma) - (noise - x0))^2 with
    x_t = (1 - sigma) x0 + sigma noise. latents, noise [N, C, h, w]; sigmas [N] in (0, 1)."""
    s = sigmas.view(-1, 1, 1, 1)
    x_t = (1 - s) * latents + s * noise
    v = transformer(
        hidden_states=x_t,
        timestep=sigmas * 1000,
        encoder_hidden_states=cond[0],
        pooled_projections=cond[1],
        return_dict=False,
    )[0]
    return (v.float() - (noise - latents)).square().mean()


def warm_up_image_base(
    spec: TinyDiffusionSpec,
    w: ImageWarmupConfig,
    device: str | torch.device = "cpu",
    max_sequence_length: int = 8,
    progress: bool = False,
):
    """The warm-up of the module docs, with a progress bar of its steps and an ETA to
    `max_steps` (`progress`); returns (pipeline in eval mode, report)."""
    from mmrl.datasets.geneval import KINDS, draw, geneval_prompts, parse_prompt
    from mmrl.progress import ProgressBar
    from mmrl.rollout.diffusion import FlowSampler
    from mmrl.verifiers.geneval import prompt_following

    if spec.family != "sd3":
        raise ValueError(f"the built-in image base is an SD3 pipeline: model.tiny.family={spec.family!r}")
    unknown = [k for k in w.kinds if k not in KINDS]
    if unknown or not w.kinds:
        raise ValueError(f"model.warmup.kinds: unknown kind(s) {unknown}: choose from {list(KINDS)}")
    device = torch.device(device)
    pipe = build_tiny_pipeline(spec, seed=w.seed).to(device)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer
    encoders = [pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in (transformer, *encoders) for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=w.lr, weight_decay=0.0)
    from mmrl.train.ema import EMA

    ema = EMA(params, w.ema_decay)
    sampler = FlowSampler(pipe, max_sequence_length=max_sequence_length)
    kinds = tuple(w.kinds)
    # the splits are the fixed ones (split seed 0) whatever the warm-up's seed: the held-out
    # prompts RL is judged on are never drawn here
    train = {k: geneval_prompts("train", (k,)) for k in kinds}
    validation = geneval_prompts("validation", kinds, n=w.eval_size)
    shift = float(pipe.scheduler.config.shift)
    rng = np.random.default_rng([w.seed, 1])
    gen = torch.Generator(device="cpu").manual_seed(w.seed)

    def evaluate() -> dict:
        for m in (transformer, *encoders):
            m.eval()
        with torch.no_grad(), ema.applied():
            traj = sampler.sample(
                validation,
                num_steps=w.eval_num_steps,
                height=spec.resolution,
                width=spec.resolution,
                generator=torch.Generator(device="cpu").manual_seed(w.seed + 1234),
                sde_steps=(),
            )
        for m in (transformer, *encoders):
            m.train()
        return prompt_following(traj.images, validation)

    start = time.monotonic()
    history: list[dict] = []
    reached = False
    step = 0
    for m in (transformer, *encoders):
        m.train()
    bar = ProgressBar(
        total=w.max_steps,
        desc=f"warm-up of the built-in image base (stops at {w.target_accuracy:.0%} validation accuracy)",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        for step in range(1, w.max_steps + 1):
            # 1. A batch of drawings of training prompts (kinds equally likely).
            picked = rng.choice(len(kinds), size=w.batch_size)
            prompts = [train[kinds[k]][rng.integers(len(train[kinds[k]]))] for k in picked]
            images = np.stack(
                [np.asarray(draw(parse_prompt(p), rng, spec.resolution, w.object_scale)) for p in prompts]
            )
            latents = drawings_to_latents(pipe, images, device)
            shown = ["" if rng.random() < w.cond_dropout else p for p in prompts]
            # 2. Rectified-flow loss at logit-normal sigmas, shifted as the scheduler shifts.
            embeds, _, pooled, _ = pipe.encode_prompt(
                prompt=shown,
                prompt_2=None,
                prompt_3=None,
                device=device,
                do_classifier_free_guidance=False,
                max_sequence_length=max_sequence_length,
            )
            u = torch.sigmoid(torch.randn(w.batch_size, generator=gen)).to(device)
            sigmas = shift * u / (1 + (shift - 1) * u)
            noise = torch.randn(latents.shape, generator=gen).to(device)
            loss = flow_matching_loss(transformer, latents, (embeds, pooled), sigmas, noise)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            ema.update()
            bar.update(1)
            # 3. Validation with the ODE sampler; stop once the target is reached.
            if step % w.eval_every == 0 or step == w.max_steps:
                metrics = evaluate()
                history.append({"step": step, "loss": round(loss.item(), 5), **metrics})
                level = logging.INFO if bar.disable else logging.DEBUG  # the bar shows them otherwise
                log.log(
                    level, "image warm-up step %d: loss %.4f, validation accuracy %.3f (score %.3f), %.0fs",
                    step, loss.item(), metrics["accuracy"], metrics["score"], time.monotonic() - start,
                )  # fmt: skip
                bar.set_postfix(loss=f"{loss.item():.4f}", acc=f"{metrics['accuracy']:.3f}")
                if metrics["accuracy"] >= w.target_accuracy:
                    reached = True
                    break
    finally:
        bar.close()
    with torch.no_grad():  # the base is the EMA weights (the ones evaluated)
        for average, p in zip(ema.shadow, params):
            p.copy_(average)
    for m in (transformer, *encoders):
        m.eval()
    report = {
        "steps": step,
        "reached_target": reached,
        "seconds": round(time.monotonic() - start, 1),
        "device": str(device),
        "history": history,
    }
    return pipe, report
