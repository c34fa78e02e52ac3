"""Loading a policy (model + processor) from a local folder or a hub id, and the tokens it may
not sample.

Models load exactly as transformers loads them (`from_pretrained`): a local folder saved with
`save_pretrained`, or a hub id (`Qwen/Qwen2.5-VL-3B-Instruct`) fetched into the standard cache
(`HF_HOME` / `HF_HUB_CACHE`) at an optional revision. `HF_HUB_OFFLINE=1` is honoured: then only
the cache is read, and an id that is not cached fails with a message saying so. Otherwise the hub
is asked once first (`mmrl.hub.ask_hub`, a short time-out): a hub that does not answer fails
fast with an error suggesting `HF_HUB_OFFLINE=1` or a local folder, instead of transformers'
retries file by file, unless the model is cached, which is then loaded from the cache.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, PreTrainedModel, ProcessorMixin

from mmrl.hub import HUB_ID, ask_hub, hub_cache_dir, hub_offline, is_cached, unreachable_message
from mmrl.models.families import blocked_token_ids
from mmrl.models.precision import Precision, model_device, precision_from

log = logging.getLogger(__name__)


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
    precision: Precision = field(
        default_factory=lambda: Precision(torch.device("cpu"), torch.float32, torch.float32)
    )
    """Device, compute dtype and master-weight dtype (`mmrl.models.precision`)."""

    @property
    def device(self) -> torch.device:
        return self.precision.device

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context every forward of this policy runs in (autocast under mixed precision)."""
        return self.precision.context()


class ModelNotFoundError(FileNotFoundError):
    """A model path that is neither a local model folder nor a hub id that can be loaded."""


def load_policy(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
    device: torch.device | str | None = None,
) -> Policy:
    """Any Hugging Face VLM with a processor and chat template (Auto classes), from a local
    folder or a hub id, in `dtype`, on `device` (default: where transformers puts it, the CPU)."""
    source = str(path)
    local = Path(source).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ModelNotFoundError(
                f"{local}: not a Hugging Face model folder (no config.json); pass a folder saved with "
                "save_pretrained (model + processor), or a hub id"
            )
        source = str(local)
    elif not HUB_ID.fullmatch(source):
        raise ModelNotFoundError(f"model {source!r}: no such local folder (and not a hub id like 'org/name')")
    cache_only = not local.is_dir() and cache_only_if_hub_silent(source, revision)
    # Only a silent hub adds local_files_only: otherwise the arguments reach transformers as given.
    offline = {"local_files_only": True} if cache_only else {}
    with hub_errors(source, revision):
        processor = AutoProcessor.from_pretrained(source, revision=revision, **offline)
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype, revision=revision, **offline)
    if getattr(processor, "chat_template", None) is None and processor.tokenizer.chat_template is None:
        raise ValueError(f"{source}: the processor has no chat template")
    if device is not None:
        model.to(device)
    return make_policy(model, processor)


def load_inference_policy(
    path: str | Path, device: str = "auto", dtype: str = "auto", revision: str | None = None
) -> Policy:
    """A policy that only generates (evaluation, a judge, a rollout worker): loaded in the
    compute dtype straight onto the device (`mmrl.models.precision`; `auto`: the accelerator,
    bfloat16 there), frozen, in eval mode."""
    precision = precision_from(device, dtype, dtype)
    policy = load_policy(path, dtype=precision.compute, revision=revision, device=precision.device)
    policy.model.eval().requires_grad_(False)
    policy.precision = precision
    return policy


def cache_only_if_hub_silent(source: str, revision: str | None = None) -> bool:
    """Ask the hub once about the model id `source` (not when `HF_HUB_OFFLINE=1`). True: the hub
    did not answer but the model is cached, so load it from the cache only. Raises
    `ModelNotFoundError` when the hub says there is no such model, or does not answer and the
    model is not cached (the message suggests `HF_HUB_OFFLINE=1` or a local folder)."""
    if hub_offline():
        return False
    answer = ask_hub(source, "model", revision)
    at = f" at revision {revision!r}" if revision else ""
    if answer.state == "found":
        return False
    if answer.state == "missing":
        raise ModelNotFoundError(
            f"model {source!r}{at}: no local folder of that name, and on the hub: {answer.detail}"
        )
    if is_cached(source, "model", revision):
        log.warning("model %s: the hub did not answer (%s); loading the cached copy", source, answer.detail)
        return True
    raise ModelNotFoundError(
        unreachable_message(
            f"model {source!r}{at} (no local folder of that name, not in the local cache)", answer
        )
    )


@contextlib.contextmanager
def hub_errors(source: str, revision: str | None = None):
    """Turn a loader's `OSError` for a model that is neither a local folder nor loadable from
    the hub into one message naming the id, the revision, and why (offline, not cached)."""
    try:
        yield
    except OSError as exc:
        if Path(source).expanduser().exists():
            raise
        at = f" at revision {revision!r}" if revision else ""
        if hub_offline():
            why = (
                f"the hub is unreachable: HF_HUB_OFFLINE=1 is set and {source!r}{at} is not in the local "
                f"cache ({hub_cache_dir()}). Download it where there is a network "
                f"(`hf download {source}`), or pass a local folder"
            )
        else:
            why = f"it could not be loaded from the hub{at}: {exc}"
        raise ModelNotFoundError(f"model {source!r}: no local folder of that name, and {why}") from exc


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
    blocked = torch.zeros(vocab, dtype=torch.bool, device=model.get_output_embeddings().weight.device)
    blocked[len(tokenizer) :] = True  # padded rows of the embedding matrix
    # The tokenizer's special tokens and the family's image / video tokens, never the stop tokens.
    for tid in set(tokenizer.all_special_ids) | blocked_token_ids(model, processor):
        if tid not in stop and tid < vocab:
            blocked[tid] = True
    dtype = next(model.parameters()).dtype
    precision = Precision(model_device(model), dtype, dtype)
    return Policy(model, processor, blocked, sorted(stop), pad, precision)
