"""Tiny SD3 and FLUX pipelines built from config: the real diffusers architectures, offline.

    pipe = build_tiny_pipeline(TinyDiffusionSpec(family="sd3"), seed=0)
    pipe.save_pretrained(path)                                    # ~1 MB
    pipe = StableDiffusion3Pipeline.from_pretrained(path)         # or load_flow_pipeline(path)

SD3: `SD3Transformer2DModel` (patch 2), `AutoencoderKL` with 16 latent channels, two small
`CLIPTextModelWithProjection` encoders over the byte tokenizer (or a word-level one over the
GenEval prompt vocabulary, `tokenizer="words"`), no T5 (`text_encoder_3=None`: the
pipeline then appends `max_sequence_length` zero tokens), `FlowMatchEulerDiscreteScheduler`
with shift 3. `vae="pixel"` makes the latent space the image itself: an `AutoencoderTiny`
with one block whose weights are set by hand to an exact pixel <-> latent map (3 channels, no
compression; the built-in image base, `mmrl.models.image_base`, uses it at 32 x 32). FLUX: `FluxTransformer2DModel` over 2x2-packed latents, a `CLIPTextModel` (pooled)
and a small `T5EncoderModel`, the dynamically shifted scheduler FLUX uses.

Rules the shapes must follow (diffusers checks some, others fail deep inside): SD3's
joint_attention_dim >= the sum of the CLIP widths and pooled_projection_dim = the sum of the
CLIP projection sizes; the image side must be divisible by 8 * patch (SD3) or 16 (FLUX); FLUX's
rotary axes must sum to the head size.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mmrl.models.tokenizer import build_byte_tokenizer

FAMILIES = ("sd3", "flux")
VAES = ("tiny", "kl", "pixel")
TOKENIZERS = ("bytes", "words")
BUILDER_VERSION = 3
"""Part of the built-in pipeline's cache key: bump it when `build_tiny_pipeline` changes."""


@dataclass
class TinyDiffusionSpec:
    """Shape of a tiny built-in text-to-image pipeline (random weights, seconds on a CPU)."""

    family: str = "sd3"
    """`sd3` (StableDiffusion3Pipeline) or `flux` (FluxPipeline)."""
    resolution: int = 64
    """Default image side in pixels (the transformer's sample size is resolution / the VAE's factor:
8 with four VAE blocks, 1 with `vae=pixel`)."""
    num_layers: int = 2
    """Transformer blocks (FLUX: double-stream blocks)."""
    num_single_layers: int = 1
    """FLUX only: single-stream blocks."""
    num_heads: int = 2
    """Attention heads of the transformer."""
    head_dim: int = 16
    """Size of each attention head (transformer width = num_heads * head_dim)."""
    text_width: int = 32
    """Hidden size of each CLIP text encoder (and of the tiny T5 for FLUX)."""
    text_layers: int = 1
    """Layers of each text encoder."""
    text_max_length: int = 40
    """Token length prompts are padded / truncated to (bytes: one token per character)."""
    vae_channels: list[int] = field(default_factory=lambda: [16, 16, 16, 16])
    """VAE block widths; four blocks give the usual 8x spatial compression (`tiny`: all equal;
    `pixel`: ignored)."""
    latent_channels: int = 16
    """VAE latent channels (16 for both SD3 and FLUX; `pixel`: must be 3)."""
    patch_size: int = 2
    """SD3 only: the transformer's patch size (latent pixels per token side)."""
    tokenizer: str = "bytes"
    """`bytes`: the byte tokenizer (any prompt); `words`: one token per word of the GenEval prompt
    vocabulary (`mmrl.datasets.geneval.VOCABULARY`; other words are `[unk]`)."""
    vae: str = "tiny"
    """`tiny`: `AutoencoderTiny` (TAESD's architecture, as SD3's TAESD3: no normalisation, so a
    random one draws images whose detail follows the latent's amplitude and rewards can be
    learned in minutes); `kl`: `AutoencoderKL` (SD3's own; a random one's GroupNorms make the
    image nearly invariant to the latent's scale); `pixel`: the identity map between an image
    and a 3-channel latent of its size (pixel-space diffusion in the latent pipeline)."""
    shift: float = 3.0
    """SD3: the scheduler's static timestep shift."""


def build_tiny_pipeline(spec: TinyDiffusionSpec, seed: int = 0):
    """A randomly initialised tiny pipeline of `spec.family`, deterministic in `seed`."""
    if spec.family not in FAMILIES:
        raise ValueError(f"tiny pipeline: unknown family {spec.family!r} (choose from {', '.join(FAMILIES)})")
    if spec.vae not in VAES:
        raise ValueError(f"tiny pipeline: unknown vae {spec.vae!r} (choose from {', '.join(VAES)})")
    if spec.tokenizer not in TOKENIZERS:
        raise ValueError(
            f"tiny pipeline: unknown tokenizer {spec.tokenizer!r} (choose from {', '.join(TOKENIZERS)})"
        )
    if spec.vae == "pixel" and spec.latent_channels != 3:
        raise ValueError(f"tiny pipeline: the pixel vae needs latent_channels=3, got {spec.latent_channels}")
    if spec.vae != "pixel" and not 2 <= len(spec.vae_channels) <= 4:
        raise ValueError(f"tiny pipeline: vae_channels needs 2 to 4 widths, got {spec.vae_channels}")
    if spec.family == "flux" and (spec.vae == "pixel" or spec.patch_size != 2):
        raise ValueError("tiny FLUX: vae=pixel and patch_size other than 2 are SD3-only")
    factor = vae_factor(spec)
    patch = spec.patch_size if spec.family == "sd3" else 2
    if spec.patch_size < 1 or spec.resolution % (patch * factor):
        raise ValueError(
            f"tiny pipeline: resolution {spec.resolution} must be a multiple of {patch * factor} "
            f"(VAE factor {factor} x patch {patch})"
        )
    torch.manual_seed(seed)
    return _build_sd3(spec) if spec.family == "sd3" else _build_flux(spec)


def vae_factor(spec: TinyDiffusionSpec) -> int:
    """Image pixels per latent pixel (per side)."""
    return 1 if spec.vae == "pixel" else 2 ** (len(spec.vae_channels) - 1)


def build_word_tokenizer():
    """A word-level tokenizer over `mmrl.datasets.geneval.VOCABULARY` (lower-cased, split on
    whitespace and punctuation; pad = end of text = id 0, unknown words `[unk]`)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mmrl.datasets.geneval import VOCABULARY

    vocab = {w: i for i, w in enumerate(dict.fromkeys(["[pad]", "[unk]", *VOCABULARY]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[unk]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[pad]", unk_token="[unk]")


def _tokenizer(spec: TinyDiffusionSpec):
    tok = build_byte_tokenizer() if spec.tokenizer == "bytes" else build_word_tokenizer()
    tok.padding_side = "right"  # the pooled output is read at the first end-of-text token
    tok.model_max_length = spec.text_max_length
    return tok


def _pixel_vae():
    """`AutoencoderTiny` with one block, its weights set so that decode(encode(x)) = x on [-1, 1]
    images: the encoder's two 3x3 convolutions pass each channel through (centre tap 1, then 0.1:
    latent = 0.1 x image, which the scaling factor 20 and shift 0.05 of the pipeline turn into a
    latent of std ~0.6 on the drawings); the decoder's first convolution splits each channel
    into its positive and negative parts (x 10, then ReLU) and the last recombines them. The
    tanh(x / 3) x 3 clamp the decoder applies first is the identity up to 0.04% on this range."""
    from diffusers import AutoencoderTiny

    vae = AutoencoderTiny(
        encoder_block_out_channels=(3,),
        decoder_block_out_channels=(6,),
        latent_channels=3,
        num_encoder_blocks=(0,),
        num_decoder_blocks=(0,),
        scaling_factor=20.0,
        shift_factor=0.05,
    )
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        enc_in, enc_out = vae.encoder.layers[0], vae.encoder.layers[1]
        dec_in, dec_out = vae.decoder.layers[0], vae.decoder.layers[2]
        for c in range(3):
            enc_in.weight[c, c, 1, 1] = 1.0
            enc_out.weight[c, c, 1, 1] = 0.1
            dec_in.weight[c, c, 1, 1] = 10.0
            dec_in.weight[c + 3, c, 1, 1] = -10.0
            dec_out.weight[c, c, 1, 1] = 1.0
            dec_out.weight[c, c + 3, 1, 1] = -1.0
    return vae


def _vae(spec: TinyDiffusionSpec, scaling: float, shift: float):
    from diffusers import AutoencoderKL, AutoencoderTiny

    if spec.vae == "pixel":
        return _pixel_vae()
    if spec.vae == "tiny":
        n = len(spec.vae_channels)
        if len(set(spec.vae_channels)) != 1:
            raise ValueError(f"tiny pipeline: the tiny VAE needs equal vae_channels, got {spec.vae_channels}")
        vae = AutoencoderTiny(
            encoder_block_out_channels=tuple(spec.vae_channels),
            decoder_block_out_channels=tuple(spec.vae_channels),
            latent_channels=spec.latent_channels,
            num_encoder_blocks=(1,) * n,
            num_decoder_blocks=(1,) * n,
            scaling_factor=scaling,
            shift_factor=shift,
        )
        with torch.no_grad():  # mid-grey images with visible detail (the decoder maps [0, 1] to [-1, 1])
            vae.decoder.layers[-1].bias.fill_(0.5)
            vae.decoder.layers[-1].weight.mul_(4.0)
        return vae
    if spec.vae != "kl":
        raise ValueError(f"tiny pipeline: unknown vae {spec.vae!r} (choose tiny or kl)")
    groups = min(spec.vae_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(spec.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(spec.vae_channels),
        block_out_channels=tuple(spec.vae_channels),
        layers_per_block=1,
        latent_channels=spec.latent_channels,
        norm_num_groups=groups,
        sample_size=spec.resolution,
        scaling_factor=scaling,
        shift_factor=shift,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )


def _clip_config(spec: TinyDiffusionSpec, tokenizer, projection: int):
    from transformers import CLIPTextConfig

    pad = tokenizer.pad_token_id
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_width,
        intermediate_size=2 * spec.text_width,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=2,
        max_position_embeddings=spec.text_max_length,
        projection_dim=projection,
        pad_token_id=pad,
        bos_token_id=pad,
        eos_token_id=pad,
    )


def _build_sd3(spec: TinyDiffusionSpec):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    factor = vae_factor(spec)
    tokenizer = _tokenizer(spec)
    enc1 = CLIPTextModelWithProjection(_clip_config(spec, tokenizer, spec.text_width)).eval()
    enc2 = CLIPTextModelWithProjection(_clip_config(spec, tokenizer, spec.text_width)).eval()
    width = spec.num_heads * spec.head_dim
    transformer = SD3Transformer2DModel(
        sample_size=spec.resolution // factor,
        patch_size=spec.patch_size,
        in_channels=spec.latent_channels,
        out_channels=spec.latent_channels,
        num_layers=spec.num_layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.num_heads,
        joint_attention_dim=2 * spec.text_width,
        caption_projection_dim=width,
        pooled_projection_dim=2 * spec.text_width,
        pos_embed_max_size=max(16, spec.resolution // factor // spec.patch_size),
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=spec.shift),
        vae=_vae(spec, scaling=1.5305, shift=0.0609).eval(),
        text_encoder=enc1,
        tokenizer=tokenizer,
        text_encoder_2=enc2,
        tokenizer_2=_tokenizer(spec),
        text_encoder_3=None,
        tokenizer_3=None,
    )


def _build_flux(spec: TinyDiffusionSpec):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    if spec.head_dim % 4:
        raise ValueError(f"tiny FLUX: head_dim must be a multiple of 4 (rotary axes), got {spec.head_dim}")
    tokenizer = _tokenizer(spec)
    clip = CLIPTextModel(_clip_config(spec, tokenizer, spec.text_width)).eval()
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=spec.text_width,
            d_kv=spec.text_width // 2,
            d_ff=2 * spec.text_width,
            num_layers=spec.text_layers,
            num_heads=2,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.pad_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    side = (spec.head_dim * 3 // 8) // 2 * 2  # rotary axes (id, row, column), even, summing to head_dim
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * spec.latent_channels,
        num_layers=spec.num_layers,
        num_single_layers=spec.num_single_layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.num_heads,
        joint_attention_dim=spec.text_width,
        pooled_projection_dim=spec.text_width,
        guidance_embeds=False,
        axes_dims_rope=(spec.head_dim - 2 * side, side, side),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=_vae(spec, scaling=0.3611, shift=0.1159).eval(),
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=_tokenizer(spec),
        transformer=transformer,
    )


def load_flow_pipeline(path: str | Path, dtype: torch.dtype | None = None, revision: str | None = None):
    """A diffusers pipeline (SD3 / SD3.5 / FLUX, tiny or real) from a local folder or a hub id,
    through diffusers' own `from_pretrained` (the standard cache, `revision`, `HF_HUB_OFFLINE`
    honoured; offline and not cached: `ModelNotFoundError` saying so). The class comes from the
    pipeline's `model_index.json`."""
    from diffusers import DiffusionPipeline

    from mmrl.models.loading import HUB_ID, ModelNotFoundError, hub_errors

    source = str(path)
    local = Path(source).expanduser()
    kwargs: dict = {"revision": revision}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if not local.is_dir():
        if local.exists() or not HUB_ID.fullmatch(source):
            raise FileNotFoundError(
                f"not a diffusers pipeline folder (no model_index.json): {source} is no such folder, "
                "nor a hub id like 'org/name'"
            )
        with hub_errors(source, revision):
            return DiffusionPipeline.from_pretrained(source, **kwargs)
    if not (local / "model_index.json").is_file():
        raise ModelNotFoundError(f"not a diffusers pipeline folder (no model_index.json): {local}")
    index = json.loads((local / "model_index.json").read_text())
    # Components saved as None (SD3 without T5) must be passed as None again.
    kwargs.update({k: None for k, v in index.items() if isinstance(v, list) and v[0] is None})
    if index.get("vae", [None, None])[1] != "AutoencoderTiny":
        return DiffusionPipeline.from_pretrained(str(local), **kwargs)
    # A tiny VAE in an SD3 / FLUX pipeline is supported (TAESD3 is used so) but diffusers warns
    # that the type hint says AutoencoderKL and that `block_out_channels` is unused: expected.
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        return DiffusionPipeline.from_pretrained(str(local), **kwargs)
    finally:
        diffusers_logging.set_verbosity(level)


def pipeline_family(pipe) -> str:
    """`sd3` or `flux`, from the pipeline's class; anything else is a clear error."""
    name = type(pipe).__name__
    if name.startswith("StableDiffusion3"):
        return "sd3"
    if name.startswith("Flux"):
        return "flux"
    raise ValueError(
        f"unsupported pipeline {name}: flow-GRPO supports StableDiffusion3Pipeline and FluxPipeline"
    )


def builtin_pipeline_path(spec: TinyDiffusionSpec, seed: int = 0, cache_dir: str | None = None) -> Path:
    """The built-in tiny pipeline saved under the cache (built once, keyed by spec and seed)."""
    key = hashlib.sha256(
        json.dumps({"spec": asdict(spec), "seed": seed, "v": BUILDER_VERSION}, sort_keys=True).encode()
    ).hexdigest()
    root = Path(cache_dir or os.environ.get("MMRL_CACHE") or Path.home() / ".cache" / "mmrl")
    path = root / f"tiny-{spec.family}-{key[:12]}"
    if not (path / "model_index.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        build_tiny_pipeline(spec, seed).save_pretrained(tmp)
        tmp.replace(path) if not path.exists() else None
    return path
