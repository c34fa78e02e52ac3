"""Loading a policy (model + processor) from a local folder, and the tokens it may not sample."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, PreTrainedModel, ProcessorMixin


@dataclass
class Policy:
    """A VLM and what rollout and training need to know about its vocabulary."""

    model: PreTrainedModel
    processor: ProcessorMixin
    blocked: torch.Tensor
    """[V] bool: ids never sampled nor scored (vision/structural specials, padded vocab rows)."""
    stop_token_ids: list[int]
    """Ids that end a response."""
    pad_token_id: int


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32) -> Policy:
    """Any local Hugging Face VLM folder with a processor and chat template (Auto classes)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path}: not a Hugging Face model folder (no config.json). Pass a local folder saved "
            "with save_pretrained (model + processor); mmrl never downloads from a hub."
        )
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    if getattr(processor, "chat_template", None) is None and processor.tokenizer.chat_template is None:
        raise ValueError(f"{path}: the processor has no chat template")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, local_files_only=True)
    return make_policy(model, processor)


def make_policy(model: PreTrainedModel, processor: ProcessorMixin) -> Policy:
    tokenizer = processor.tokenizer
    stop = set()
    for source in (tokenizer.eos_token_id, model.generation_config.eos_token_id):
        if source is None:
            continue
        stop.update(source if isinstance(source, list) else [source])
    if not stop:
        raise ValueError("the model has no eos token: set generation_config.eos_token_id")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop)
    vocab = model.get_output_embeddings().weight.shape[0]
    blocked = torch.zeros(vocab, dtype=torch.bool)
    blocked[len(tokenizer) :] = True  # padded rows of the embedding matrix
    for tid in tokenizer.all_special_ids:
        if tid not in stop and tid < vocab:
            blocked[tid] = True
    return Policy(model, processor, blocked, sorted(stop), pad)
