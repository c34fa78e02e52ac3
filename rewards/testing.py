"""Tiny random reward-model checkpoints in the real on-disk formats, for tests and benchmarks.

Everything here is built offline from config (open_clip's bundled BPE vocabulary serves as the
tokenizer of both backends) and saved exactly as the real checkpoints are laid out, so the
loading code under test is the code that loads real weights.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

TINY_OPEN_CLIP_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
"""A 1-layer open_clip CLIP with 32-wide towers and a 32-d joint embedding (~1.6M parameters,
most of them the 49408-token embedding)."""

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def save_tiny_open_clip(folder: str | Path, seed: int = 0, safetensors: bool = False) -> Path:
    """A random tiny open_clip CLIP saved in the open_clip hub layout; returns the folder."""
    import open_clip

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "open_clip_config.json").write_text(
        json.dumps(
            {"model_cfg": TINY_OPEN_CLIP_CONFIG, "preprocess_cfg": {"mean": CLIP_MEAN, "std": CLIP_STD}}
        )
    )
    torch.manual_seed(seed)
    model = open_clip.create_model(f"local-dir:{folder}", load_weights=False, pretrained_text=False)
    # Random init leaves logit_scale at log(1/0.07); set a trained-like 100 as real checkpoints have.
    with torch.no_grad():
        model.logit_scale.fill_(torch.log(torch.tensor(100.0)))
    state = model.state_dict()
    if safetensors:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "open_clip_model.safetensors"))
    else:
        torch.save(state, folder / "open_clip_pytorch_model.bin")
    return folder


def write_clip_tokenizer_files(folder: str | Path) -> None:
    """vocab.json and merges.txt of the CLIP BPE tokenizer, made from open_clip's bundled vocab
    (the same ids as OpenAI CLIP's Hugging Face tokenizer)."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe

    merges = gzip.open(default_bpe()).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    folder = Path(folder)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def save_tiny_hf_clip(folder: str | Path, seed: int = 0) -> Path:
    """A random tiny transformers CLIPModel with its processor, saved with save_pretrained."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = CLIPConfig(
        text_config={
            "vocab_size": 49408,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 77,
            "bos_token_id": 49406,
            "eos_token_id": 49407,
            "pad_token_id": 49407,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=32,
    )
    torch.manual_seed(seed)
    model = CLIPModel(config)
    with torch.no_grad():
        model.logit_scale.fill_(torch.log(torch.tensor(100.0)))
    model.save_pretrained(folder)
    tok_dir = folder / "_tokenizer_src"
    tok_dir.mkdir(exist_ok=True)
    write_clip_tokenizer_files(tok_dir)
    tokenizer = CLIPTokenizer(str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"))
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def save_random_aesthetic_head(path: str | Path, input_dim: int, seed: int = 0) -> Path:
    """A random improved-aesthetic-predictor head state dict (`layers.{0,2,4,6,7}.*`) at `path`."""
    from mmrl.rewards.aesthetic import AestheticMLP

    torch.manual_seed(seed)
    head = AestheticMLP(input_dim)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(head.state_dict(), path)
    return path
