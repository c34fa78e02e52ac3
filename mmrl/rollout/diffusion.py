"""The flow-GRPO sampler over a diffusers pipeline's components (SD3 / SD3.5, FLUX).

    sampler = FlowSampler(pipe)
    cond = sampler.encode(prompts, guidance_scale=4.5)
    traj = sampler.sample(cond, num_steps=10, height=512, width=512, guidance_scale=4.5,
                          generator=g, noise_level=0.7, sde_steps=range(10))
    traj.latents [N, S+1, ...], traj.log_probs [N, S], traj.images [N, 3, H, W]

It uses the pipeline's own prompt encoding, latent preparation, timestep schedule, transformer
call and VAE decoding, and replaces only the scheduler step: the flow-GRPO SDE step
(`mmrl.algos.sde`) at the chosen steps (all of them, or a window as in Flow-GRPO-Fast) and the
plain Euler ODE step elsewhere. With no SDE step it is the pipeline's own sampler (tested to
reproduce `pipe(...)` for the same seed), which is the evaluation mode (train with few steps,
evaluate with many).

`step_log_prob` recomputes one step's log-density from a stored trajectory with any transformer
(the policy being trained, or the frozen reference): the trainer and the sampler share it, so
the rollout's log-probs and the trainer's are the same computation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from mmrl.algos.sde import SDEStep, ode_step, sde_step_with_logprob
from mmrl.models.tiny_diffusion import pipeline_family


@dataclass
class Conditioning:
    """Encoded prompts, one row per image (N rows)."""

    prompt_embeds: torch.Tensor
    """[N, L, D] text tokens for the transformer."""
    pooled: torch.Tensor
    """[N, P] pooled text embedding."""
    neg_prompt_embeds: torch.Tensor | None = None
    """[N, L, D] the negative prompt's tokens (present when guidance is on)."""
    neg_pooled: torch.Tensor | None = None
    """[N, P] the negative prompt's pooled embedding."""
    text_ids: torch.Tensor | None = None
    """FLUX: [L, 3] text position ids (shared by every row)."""

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def select(self, rows: torch.Tensor | Sequence[int]) -> Conditioning:
        """The conditioning of the given rows (also used to repeat rows: `[0, 0, 1, 1]`)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.prompt_embeds.device)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, idx)

        return replace(
            self,
            prompt_embeds=pick(self.prompt_embeds),
            pooled=pick(self.pooled),
            neg_prompt_embeds=pick(self.neg_prompt_embeds),
            neg_pooled=pick(self.neg_pooled),
        )


@dataclass
class Trajectory:
    """One batch of sampled images with everything the policy update needs."""

    latents: torch.Tensor
    """[N, S+1, ...] float32: the initial noise, then the latent after each step."""
    log_probs: torch.Tensor
    """[N, S] log-density of latents[:, j+1] given latents[:, j] at the SDE steps; NaN elsewhere."""
    timesteps: torch.Tensor
    """[S] the transformer's timesteps (0..1000)."""
    sigmas: torch.Tensor
    """[S+1] the schedule's sigmas (1 = noise ... 0 = data)."""
    sde_steps: list[int]
    """Indices j of the steps taken with the SDE (the trainable ones)."""
    images: torch.Tensor | list | None
    """Decoded images ([N, 3, H, W] in [0, 1] for output_type `pt`), None for `latent`."""
    cond: Conditioning
    """The conditioning the images were sampled with."""


def choose_sde_steps(
    num_steps: int,
    window_size: int = 0,
    window_range: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Steps that use the SDE: all of them (window_size 0, flow-GRPO) or a window of
    `window_size` consecutive steps placed uniformly at random inside `window_range` = [lo, hi)
    (Flow-GRPO-Fast: ODE elsewhere, only the window is trained)."""
    if window_size <= 0:
        return list(range(num_steps))
    lo, hi = (0, num_steps) if not window_range else (int(window_range[0]), int(window_range[1]))
    hi = min(hi, num_steps)
    if not 0 <= lo < hi or hi - lo < window_size:
        raise ValueError(
            f"sde window of {window_size} steps does not fit in range [{lo}, {hi}) of {num_steps} steps"
        )
    start = lo + int(torch.randint(0, hi - lo - window_size + 1, (1,), generator=generator))
    return list(range(start, start + window_size))


class FlowSampler:
    """Sampling with per-step log-probs over a StableDiffusion3Pipeline or FluxPipeline."""

    def __init__(
        self,
        pipe,
        max_sequence_length: int = 256,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        """`autocast`: the context each transformer call runs in (mixed precision: the trainer
        passes `Precision.context`)."""
        self.pipe = pipe
        self.autocast = autocast
        self.family = pipeline_family(pipe)
        self.max_sequence_length = max_sequence_length
        self._image_ids: dict[tuple[int, int], torch.Tensor] = {}
        self._dtype = pipe.transformer.dtype  # looked up once: ModelMixin.dtype walks the parameters

    @property
    def device(self) -> torch.device:
        return self.pipe.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pipe.transformer.dtype

    # --- prompts -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], guidance: bool, negative_prompt: str = "") -> Conditioning:
        """Encode N prompts (and the negative prompt for classifier-free guidance)."""
        prompts = list(prompts)
        msl = self.max_sequence_length
        if self.family == "sd3":
            pe, npe, pooled, npooled = self.pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                prompt_3=None,
                device=self.device,
                do_classifier_free_guidance=guidance,
                negative_prompt=[negative_prompt] * len(prompts) if guidance else None,
                max_sequence_length=msl,
            )
            return Conditioning(pe, pooled, npe if guidance else None, npooled if guidance else None)
        pe, pooled, text_ids = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=msl
        )
        cond = Conditioning(pe, pooled, text_ids=text_ids)
        if guidance:
            npe, npooled, _ = self.pipe.encode_prompt(
                prompt=[negative_prompt] * len(prompts),
                prompt_2=None,
                device=self.device,
                max_sequence_length=msl,
            )
            cond.neg_prompt_embeds, cond.neg_pooled = npe, npooled
        return cond

    # --- latents and schedule ------------------------------------------------------------
    def initial_latents(
        self, n: int, height: int, width: int, generator: torch.Generator | list[torch.Generator] | None
    ) -> torch.Tensor:
        """Initial noise exactly as the pipeline draws it (FLUX: packed 2x2 patches)."""
        pipe = self.pipe
        if self.family == "sd3":
            return pipe.prepare_latents(
                n, pipe.transformer.config.in_channels, height, width, self.dtype, self.device, generator
            )
        latents, image_ids = pipe.prepare_latents(
            n, pipe.transformer.config.in_channels // 4, height, width, self.dtype, self.device, generator
        )
        self._image_ids[(height, width)] = image_ids
        return latents

    def schedule(self, num_steps: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps [S], sigmas [S+1]) as the pipeline sets them for this size."""
        sched = self.pipe.scheduler
        kwargs: dict = {}
        if self.family == "sd3":
            sigmas = None
            if sched.config.get("use_dynamic_shifting", None):
                from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

                p = self.pipe.transformer.config.patch_size
                f = self.pipe.vae_scale_factor
                seq = (height // f // p) * (width // f // p)
                kwargs["mu"] = calculate_shift(
                    seq,
                    sched.config.get("base_image_seq_len", 256),
                    sched.config.get("max_image_seq_len", 4096),
                    sched.config.get("base_shift", 0.5),
                    sched.config.get("max_shift", 1.16),
                )
        else:
            from diffusers.pipelines.flux.pipeline_flux import calculate_shift

            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
            if getattr(sched.config, "use_flow_sigmas", False):
                sigmas = None
            f = self.pipe.vae_scale_factor
            seq = (height // (2 * f)) * (width // (2 * f))
            kwargs["mu"] = calculate_shift(
                seq,
                sched.config.get("base_image_seq_len", 256),
                sched.config.get("max_image_seq_len", 4096),
                sched.config.get("base_shift", 0.5),
                sched.config.get("max_shift", 1.15),
            )
        if sigmas is None:
            sched.set_timesteps(num_steps, device=self.device, **kwargs)
        else:
            sched.set_timesteps(sigmas=sigmas, device=self.device, **kwargs)
        return sched.timesteps.clone(), sched.sigmas.clone().float()

    # --- the model -----------------------------------------------------------------------
    def velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float,
        height: int | None = None,
        width: int | None = None,
    ) -> torch.Tensor:
        """`_velocity` in the sampler's autocast context (see `__init__`)."""
        with self.autocast():
            return self._velocity(transformer, latents, timestep, cond, guidance_scale, height, width)

    def _velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float,
        height: int | None = None,
        width: int | None = None,
    ) -> torch.Tensor:
        """The (guided) velocity at `latents` [N, ...] and scalar `timestep`, as the pipeline
        computes it. Classifier-free guidance runs when `cond` has a negative prompt and the
        scale is > 1 (SD3: one doubled batch; FLUX: true CFG, or the distilled guidance
        embedding when the transformer has one)."""
        n = latents.shape[0]
        x = latents.to(self._dtype)
        guide = guidance_scale > 1.0 and cond.neg_prompt_embeds is not None
        if self.family == "sd3":
            if guide:
                out = transformer(
                    hidden_states=torch.cat([x, x]),
                    timestep=timestep.expand(2 * n),
                    encoder_hidden_states=torch.cat([cond.neg_prompt_embeds, cond.prompt_embeds]),
                    pooled_projections=torch.cat([cond.neg_pooled, cond.pooled]),
                    return_dict=False,
                )[0]
                uncond, text = out.chunk(2)
                return uncond + guidance_scale * (text - uncond)
            return transformer(
                hidden_states=x,
                timestep=timestep.expand(n),
                encoder_hidden_states=cond.prompt_embeds,
                pooled_projections=cond.pooled,
                return_dict=False,
            )[0]
        image_ids = self._flux_image_ids(height, width)
        t = timestep.expand(n).to(x.dtype) / 1000
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full([n], guidance_scale, device=x.device, dtype=torch.float32)
            guide = False
        kw = dict(hidden_states=x, timestep=t, guidance=guidance, img_ids=image_ids, return_dict=False)
        v = transformer(
            pooled_projections=cond.pooled,
            encoder_hidden_states=cond.prompt_embeds,
            txt_ids=cond.text_ids,
            **kw,
        )[0]
        if guide:
            neg = transformer(
                pooled_projections=cond.neg_pooled,
                encoder_hidden_states=cond.neg_prompt_embeds,
                txt_ids=cond.text_ids,
                **kw,
            )[0]
            v = neg + guidance_scale * (v - neg)
        return v

    def _flux_image_ids(self, height: int | None, width: int | None) -> torch.Tensor:
        if height is None or width is None:
            if len(self._image_ids) != 1:
                raise ValueError("FLUX velocity needs the image height and width")
            return next(iter(self._image_ids.values()))
        if (height, width) not in self._image_ids:
            f = self.pipe.vae_scale_factor
            self._image_ids[(height, width)] = self.pipe._prepare_latent_image_ids(
                1, height // (2 * f), width // (2 * f), self.device, self.dtype
            )
        return self._image_ids[(height, width)]

    # --- sampling ------------------------------------------------------------------------
    @torch.no_grad()
    def sample(
        self,
        cond: Conditioning | Sequence[str],
        num_steps: int,
        height: int,
        width: int,
        guidance_scale: float = 1.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        noise_level: float = 0.7,
        sde_steps: Iterable[int] | None = None,
        sde_type: str = "sde",
        output_type: str = "pt",
        negative_prompt: str = "",
        transformer: torch.nn.Module | None = None,
    ) -> Trajectory:
        """Sample N images, recording latents and the SDE steps' log-probs.

        Args:
            cond: encoded prompts, or N prompt strings (encoded here, with the negative prompt
                when guidance_scale > 1).
            num_steps: S denoising steps.
            height, width: image size in pixels.
            guidance_scale: classifier-free guidance scale (1: none).
            generator: seeds the initial noise (as the pipeline does) and then the SDE noise;
                a list gives one generator per image.
            latents: [N, ...] initial noise to use instead of drawing it.
            noise_level: a of the SDE step.
            sde_steps: steps taken with the SDE; None: all S; empty: the ODE sampler (evaluation,
                identical to the pipeline's own).
            sde_type: `sde` or `cps`.
            output_type: the pipeline's image post-processing (`pt`, `pil`, `np`, `latent`).
            transformer: the network to sample with (default the pipeline's).
        """
        if not isinstance(cond, Conditioning):
            cond = self.encode(cond, guidance=guidance_scale > 1.0, negative_prompt=negative_prompt)
        net = transformer if transformer is not None else self.pipe.transformer
        self._dtype = self.dtype
        if guidance_scale > 1.0 and cond.neg_prompt_embeds is None and not _guidance_embedded(net):
            raise ValueError(
                f"guidance_scale {guidance_scale} needs a negative prompt: encode with guidance=True"
            )
        n = len(cond)
        if latents is None:
            latents = self.initial_latents(n, height, width, generator)
        elif self.family == "flux":
            self._flux_image_ids(height, width)
        timesteps, sigmas = self.schedule(num_steps, height, width)
        sde = set(range(num_steps)) if sde_steps is None else set(sde_steps)
        sig = sigmas.tolist()
        gen = generator[0] if isinstance(generator, list) else generator
        noise_gen = generator if isinstance(generator, list) else gen

        x = latents
        trail = [latents.float()]
        log_probs = torch.full((n, num_steps), float("nan"), device=latents.device)
        for j in range(num_steps):
            v = self.velocity(net, x, timesteps[j], cond, guidance_scale, height, width)
            if j in sde:
                step = sde_step_with_logprob(
                    v, x, sig[j], sig[j + 1], noise_level, generator=noise_gen, sde_type=sde_type
                )
                x = step.prev_sample
                log_probs[:, j] = step.log_prob
            else:
                x = ode_step(v, x, sig[j], sig[j + 1])
            trail.append(x.float())
        images = None if output_type == "latent" else self.decode(x, height, width, output_type)
        return Trajectory(
            latents=torch.stack(trail, dim=1),
            log_probs=log_probs,
            timesteps=timesteps,
            sigmas=sigmas,
            sde_steps=sorted(sde),
            images=images,
            cond=cond,
        )

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int, output_type: str = "pt"):
        """Latents -> images through the VAE, as the pipeline post-processes them."""
        pipe = self.pipe
        if self.family == "flux":
            latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type=output_type)

    def step_log_prob(
        self,
        transformer: torch.nn.Module,
        traj: Trajectory,
        rows: torch.Tensor | Sequence[int],
        j: int,
        cond: Conditioning,
        guidance_scale: float,
        noise_level: float,
        sde_type: str = "sde",
        height: int | None = None,
        width: int | None = None,
    ) -> SDEStep:
        """Recompute step j for the given rows from the stored trajectory: the log-density of
        the stored next latent under `transformer` (with grad if enabled by the caller).
        `cond` holds the rows' conditioning (`traj.cond.select(rows)`)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=traj.latents.device)
        x_j = traj.latents[:, j].index_select(0, idx)
        x_next = traj.latents[:, j + 1].index_select(0, idx)
        v = self.velocity(transformer, x_j, traj.timesteps[j], cond, guidance_scale, height, width)
        s = traj.sigmas
        return sde_step_with_logprob(
            v, x_j, float(s[j]), float(s[j + 1]), noise_level, prev_sample=x_next, sde_type=sde_type
        )


def _guidance_embedded(transformer: torch.nn.Module) -> bool:
    """FLUX-dev style guidance distillation: the scale is an input, no negative pass."""
    return bool(getattr(getattr(transformer, "config", None), "guidance_embeds", False))
