"""The vLLM rollout engine (GPU only, the `vllm` extra): the HF engine's interface on a vLLM `LLM`.

    engine = VLLMRolloutEngine.from_policy(policy, cfg)     # its own copy of the weights, on GPU
    batch = engine.generate(samples, SamplingParams(n=8), on_response=score)  # a RolloutBatch
    engine.load_weights(policy.model.state_dict())           # after each update (full or LoRA)

Every loop takes it with `rollout.engine=vllm`: the synchronous loop colocates it with the
trainer (`mmrl.train.colocated`), the asynchronous mode's generator and the Ray rollout workers
hold one each. What it does, and where each piece lives (the pure pieces are tested on CPU
without vLLM):

    model          the policy's folder or hub id at `model.revision`, in `model.dtype` (`auto`:
                   what mmrl's auto is on a GPU), `rollout.vllm_tensor_parallel_size` GPUs
    prompts        `vllm_prompts`: `TokensPrompt`s of the policy processor's chat template (the
                   text the HF engine feeds, tokenized, one placeholder per image), with the
                   sample's PIL images as `multi_modal_data`; at most `rollout.vllm_max_images`
                   images per prompt (vLLM's `limit_mm_per_prompt`)
    multi-turn     `continue_rows` (what `mmrl.rollout.multiturn` calls for every turn after the
                   first): each row's token ids so far, image tokens expanded as the HF processor
                   expands them, with every image run collapsed back to one placeholder
                   (`collapse_image_tokens`, `continuation_prompts`) for vLLM to expand again;
                   one completion per row (`continuation_results`), the prompt vLLM expanded
                   checked equal to the row's ids
    sampling       `vllm_sampling_kwargs`: n, temperature, max tokens, the sampled token's
                   log-prob (`logprobs=0`), the policy's stop ids, and the blocked ids left out
                   (`allowed_token_ids`); the engine is built with
                   `logprobs_mode="processed_logprobs"` so the log-probs are those of the
                   tempered, blocked softmax, the distribution the trainer recomputes
    streaming      one request per prompt through vLLM's engine loop (`LLM.llm_engine`:
                   `add_request`, then `step` until done, what `LLM.generate` does inside); a
                   prompt's G responses go to `on_response` the step its request finishes, so
                   the router scores them while the other prompts are still generating
    the batch      `rollout_from_vllm`: prompt ids, masks and vision inputs from the HF processor
                   (what the trainer's forward needs; vLLM's own prompt ids are checked equal),
                   response ids right padded, masked after the first stop token, log-probs per
                   token: the same tensors the HF engine returns for the same tokens
    weight sync    `weights_to_sync`: full weights (HF names, which vLLM's loaders map), LoRA
                   adapters merged into full weights, or the adapters alone (served as a
                   `LoRARequest`, `max_lora_rank` rounded up to a rank vLLM builds). No weight
                   tensor ever goes through vLLM's RPC (its V1 engine core decodes RPC
                   arguments untyped: a tensor arrives as a list). `rollout.vllm_weight_sync`:
                   `inprocess` builds the engine in this process (V1 multiprocessing off, the
                   `external_launcher` executor, as TRL's colocate mode) and loads the weights
                   straight into its model; `nccl` (a separate engine, tensor parallelism)
                   sends only names, dtypes and shapes by `collective_rpc` to mmrl's worker
                   extension (`mmrl.rollout.vllm_worker`) and broadcasts the data over a NCCL
                   group from this process's GPU, as vLLM's RLHF example, veRL and OpenRLHF do.
                   Either way in buckets of `SYNC_BUCKET_BYTES`, in the engine's dtype; after
                   every sync the prefix cache and the encoder cache (image features computed
                   with the old weights) are reset
    memory         with `rollout.vllm_sleep_level` > 0 the engine sleeps after each batch
                   (weights offloaded or dropped, KV cache freed) so training can use the GPU,
                   wakes its weights alone to load new ones, and wakes fully to generate; after
                   a level-2 sleep with no sync since, the last synced weights are sent again.
                   Set 0 where the engine has its GPU to itself (separate rollout workers, the
                   asynchronous mode): sleeping there only costs time

What is not tested here: anything that runs vLLM itself (our machines have no GPU); the tests
drive this module against a stand-in `vllm` module shaped like vLLM's API, whose RPC
round-trips every message through msgpack as vLLM's engine core decodes it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import ProcessorMixin

from mmrl.models.loading import HUB_ID, Policy
from mmrl.models.precision import DTYPES, resolve_dtype
from mmrl.rollout.hf import SamplingParams, encode_prompts, prompt_batch, response_mask_from_stops
from mmrl.rollout.vllm_worker import EXTENSION, device_uuid
from mmrl.types import RolloutBatch, Sample

log = logging.getLogger(__name__)

INSTALL_HINT = "the vLLM rollout engine needs vLLM and a GPU: pip install 'mmrl[vllm]'"
MIN_VLLM = "0.16.0"
"""The oldest vLLM mmrl runs on: `logprobs_mode=processed_logprobs` (since 0.10.2) and
`LLM.reset_encoder_cache`, which every weight sync calls (vLLM PR #33452, merged January 30,
2026, the day after 0.15.0; 0.16.0 is the first release after it)."""
SYNC_BUCKET_BYTES = 512 * 2**20
"""A weight sync sends the weights in messages of about this many bytes (at least one tensor
each): the host holds one bucket at a time, not a copy of the model."""
RECEIVE_METHOD = "mmrl_receive_weights"
"""The worker-extension method (`mmrl.rollout.vllm_worker`) an NCCL sync calls by name."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM builds its LoRA buffers for (any other fails at start)."""
WEIGHT_SYNCS = ("auto", "inprocess", "nccl")


def import_vllm():
    """vLLM, imported on first use (never at module import: the engine is optional); an older
    vLLM than `MIN_VLLM` is refused here, naming both versions, before an engine starts."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} (rollout.engine=vllm)") from exc
    check_vllm_version(getattr(vllm, "__version__", "0"))
    return vllm


def check_vllm_version(version: str) -> None:
    """ImportError when `version`'s release number is below `MIN_VLLM`'s (a development or
    pre-release build of the floor, `0.16.0.dev12+g...`, passes)."""
    from packaging.version import InvalidVersion, Version

    try:
        old = Version(version).release < Version(MIN_VLLM).release
    except InvalidVersion:
        return  # a source build with an odd version string: the methods are checked as used
    if old:
        raise ImportError(
            f"vLLM {version} is installed; mmrl needs vllm>={MIN_VLLM} (LLM.reset_encoder_cache after "
            "every weight sync, processed log-probs): pip install -U 'mmrl[vllm]'"
        )


# ---------------------------------------------------------------------------------------------
# Pure pieces: prompts, sampling parameters, outputs -> RolloutBatch, which weights to sync
# ---------------------------------------------------------------------------------------------


def prompt_text(processor: ProcessorMixin, sample: Sample) -> str:
    """The templated prompt of one sample: the HF engine's `encode_prompts` text."""
    return processor.apply_chat_template(sample.chat_messages(), add_generation_prompt=True, tokenize=False)


def vllm_prompts(
    processor: ProcessorMixin, samples: Sequence[Sample], max_images: int
) -> list[dict[str, Any]]:
    """The fields of vLLM `TokensPrompt`s: `{"prompt_token_ids": ids, "multi_modal_data":
    {"image": [PIL, ...]}}` (the engine wraps each in `vllm.inputs.TokensPrompt`).

    The ids are the templated text as the processor's tokenizer reads it before it expands the
    image placeholders (one per image); vLLM's multimodal processor expands each to the image's
    tokens, as the HF processor does (`check_prompt_ids` verifies the expanded ids).
    """
    prompts = []
    for s in samples:
        if len(s.images) > max_images:
            raise ValueError(
                f"sample {s.id!r} has {len(s.images)} images; the vLLM engine takes at most "
                f"{max_images} per prompt (rollout.vllm_max_images)"
            )
        ids = processor.tokenizer(prompt_text(processor, s))["input_ids"]
        prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
        if s.images:
            prompt["multi_modal_data"] = {"image": s.pil_images()}
        prompts.append(prompt)
    return prompts


def image_token_id(processor: ProcessorMixin) -> int:
    """The id of the processor's image placeholder (Qwen-VL's `<|image_pad|>`), the token the HF
    processor repeats once per image patch group and vLLM expands from one."""
    found = getattr(processor, "image_token_id", None)
    if found is None:
        token = getattr(processor, "image_token", None) or "<|image_pad|>"
        found = processor.tokenizer.convert_tokens_to_ids(token)
    if found is None or found == getattr(processor.tokenizer, "unk_token_id", None):
        raise ValueError(f"{type(processor).__name__} names no image token id")
    return int(found)


def collapse_image_tokens(ids: list[int], image_token_id: int, n_images: int) -> list[int]:
    """`ids` with each run of consecutive image placeholder ids (one image's expanded tokens,
    between `<|vision_start|>` and `<|vision_end|>`) cut to one placeholder: the ids as the
    tokenizer reads the unexpanded template text (what `vllm_prompts` sends), which vLLM's
    multimodal processor expands again from the images. Raises ValueError unless there are
    exactly `n_images` runs."""
    out: list[int] = []
    runs = 0
    previous = None
    for token in ids:
        if token == image_token_id:
            if previous == image_token_id:
                continue
            runs += 1
        out.append(token)
        previous = token
    if runs != n_images:
        raise ValueError(
            f"image tokens and images out of step: {runs} runs of image token {image_token_id} "
            f"in the ids, {n_images} images"
        )
    return out


def continuation_prompts(
    ids: Sequence[Sequence[int]], images: Sequence[Sequence[Any]], image_token: int, max_images: int
) -> list[dict[str, Any]]:
    """The fields of vLLM `TokensPrompt`s for the next turn of multi-turn rows: each row's ids so
    far (image tokens expanded, as `continue_rows` gets them) collapsed to one placeholder per
    image (`collapse_image_tokens`), with the row's images, in order, as `multi_modal_data`
    (none for a row without images). A row with more than `max_images` images is an error
    before anything reaches vLLM."""
    if len(ids) != len(images):
        raise ValueError(f"{len(ids)} rows of ids but {len(images)} rows of images")
    prompts = []
    for r, (row, row_images) in enumerate(zip(ids, images)):
        if len(row_images) > max_images:
            raise ValueError(
                f"row {r} holds {len(row_images)} images, rollout.vllm_max_images is {max_images} "
                "(vLLM's limit_mm_per_prompt: the prompt's and the observations' images together)"
            )
        try:
            collapsed = collapse_image_tokens(list(row), image_token, len(row_images))
        except ValueError as exc:
            raise ValueError(f"row {r}: {exc}") from None
        prompt: dict[str, Any] = {"prompt_token_ids": collapsed}
        if row_images:
            prompt["multi_modal_data"] = {"image": list(row_images)}
        prompts.append(prompt)
    return prompts


def continuation_results(
    outputs: Sequence[Any],
    ids: Sequence[Sequence[int]],
    stop_token_ids: list[int],
    pad_token_id: int,
    greedy: bool,
) -> list[tuple[list[int], list[float], bool]]:
    """`continue_rows`' answer from vLLM's outputs (one completion per row): per row the new ids
    up to and including the stop token, their log-probs (`completion_tensors`: the sampled
    id's; 0.0 when greedy), and whether the turn ended without a stop token (its length
    limit). The prompt vLLM expanded must be the row's ids, the tokens the trainer scores."""
    if len(outputs) != len(ids):
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(ids)} rows")
    for r, (out, row) in enumerate(zip(outputs, ids)):
        seen = getattr(out, "prompt_token_ids", None)
        if seen is not None and list(seen) != list(row):
            raise ValueError(
                f"row {r}: vLLM expanded the images to a prompt of {len(seen)} tokens, the row has "
                f"{len(row)}; the trainer would score the turn after another sequence (check the "
                "image processor settings of the model folder)"
            )
    response, mask, logprobs, truncated = completion_tensors(outputs, 1, stop_token_ids, pad_token_id, greedy)
    results = []
    for r in range(response.shape[0]):
        keep = mask[r].bool()
        results.append((response[r][keep].tolist(), logprobs[r][keep].tolist(), bool(truncated[r])))
    return results


def allowed_token_ids(blocked: torch.Tensor, vocab_size: int) -> list[int]:
    """Ids that may be sampled: below the tokenizer's size and not blocked (`Policy.blocked`)."""
    allowed = ~blocked[:vocab_size]
    return torch.nonzero(allowed).flatten().tolist()


def vllm_sampling_kwargs(
    params: SamplingParams, stop_token_ids: list[int], allowed: list[int] | None
) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for mmrl's `SamplingParams`.

    Sampling is the plain tempered softmax over the allowed ids (top_p 1, no top_k, no
    penalties), the distribution whose log-probs the trainer recomputes; `logprobs=0` returns
    the sampled token's log-prob only. Greedy (evaluation): temperature 0, one response, no
    log-probs. The stop token is kept in the output ids (`skip_special_tokens` only touches
    text; mmrl decodes the ids itself).
    """
    kw: dict[str, Any] = {
        "n": 1 if params.greedy else params.n,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": 1.0,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": list(stop_token_ids),
        "logprobs": None if params.greedy else 0,
    }
    if allowed is not None:
        kw["allowed_token_ids"] = list(allowed)
    return kw


def _logprob_value(entry: Any) -> float:
    """A vLLM `Logprob` (has `.logprob`) or a bare float."""
    return float(getattr(entry, "logprob", entry))


def completion_tensors(
    outputs: Sequence[Any], n: int, stop_token_ids: list[int], pad_token_id: int, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Response ids, mask, log-probs [N, R] and truncated [N] from vLLM `RequestOutput`s.

    Rows are prompt-major ([B x G]: completion `index` order within each prompt); R is the
    longest completion (what HF `generate` pads to). A completion is its generated ids up to
    and including the stop token; `logprobs[t]` maps ids to the log-prob of position t, of which
    the sampled id's is taken.
    """
    completions = []
    for i, out in enumerate(outputs):
        comps = sorted(out.outputs, key=lambda c: c.index)
        if len(comps) != n:
            raise ValueError(f"vLLM returned {len(comps)} completions for prompt {i}, expected n={n}")
        for c in comps:
            if getattr(c, "finish_reason", None) == "abort":
                raise RuntimeError(f"vLLM aborted completion {c.index} of prompt {i}")
        completions.extend(comps)
    N = len(completions)
    R = max((len(c.token_ids) for c in completions), default=0)
    response = torch.full((N, R), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((N, R), dtype=torch.float32)
    for row, c in enumerate(completions):
        ids = list(c.token_ids)
        response[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        if greedy:
            continue
        if c.logprobs is None or len(c.logprobs) != len(ids):
            got = None if c.logprobs is None else len(c.logprobs)
            raise ValueError(f"row {row}: vLLM returned {got} log-prob positions for {len(ids)} tokens")
        for t, (token, position) in enumerate(zip(ids, c.logprobs)):
            if token not in position:
                raise ValueError(f"row {row}, token {t}: vLLM gave no log-prob for the sampled id {token}")
            logprobs[row, t] = _logprob_value(position[token])
    mask, truncated = response_mask_from_stops(response, stop_token_ids)
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long)
    for row, c in enumerate(completions):
        kept = int(mask[row].sum())
        if kept < int(lengths[row]):
            raise ValueError(
                f"row {row}: vLLM generated {int(lengths[row])} tokens but a stop token ends it after {kept}"
            )
        if getattr(c, "finish_reason", None) == "stop" and bool(truncated[row]):
            raise ValueError(
                f"row {row}: vLLM stopped it (stop_reason {getattr(c, 'stop_reason', None)!r}) without "
                "a stop token in the ids; mmrl stops on stop token ids only"
            )
    response = response.masked_fill(mask == 0, pad_token_id)
    logprobs = logprobs.masked_fill(mask == 0, 0.0)
    return response, mask, logprobs, truncated


def response_texts(processor: ProcessorMixin, response: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Each row's kept ids (up to and including its stop token) decoded without special tokens:
    the same text whether a row is decoded alone (streamed) or in the padded batch."""
    rows = [ids[m.bool()].tolist() for ids, m in zip(response, mask)]
    return processor.batch_decode(rows, skip_special_tokens=True)


def check_prompt_ids(
    outputs: Sequence[Any], inputs: dict[str, torch.Tensor], samples: Sequence[Sample]
) -> None:
    """vLLM must have seen exactly the tokens the trainer will score the responses after."""
    for i, (out, s) in enumerate(zip(outputs, samples)):
        seen = getattr(out, "prompt_token_ids", None)
        if seen is None:
            continue
        ours = inputs["input_ids"][i][inputs["attention_mask"][i].bool()].tolist()
        if list(seen) != ours:
            raise ValueError(
                f"sample {s.id!r}: vLLM's prompt ({len(seen)} tokens) differs from the HF processor's "
                f"({len(ours)} tokens); the trainer would score the responses after another prompt "
                "(check the image processor settings of the model folder)"
            )


def rollout_from_vllm(
    outputs: Sequence[Any],
    samples: Sequence[Sample],
    processor: ProcessorMixin,
    n: int,
    stop_token_ids: list[int],
    pad_token_id: int,
    greedy: bool = False,
) -> RolloutBatch:
    """The RolloutBatch the HF engine would return for these responses ([B x G] rows).

    Prompt ids, masks and vision inputs are the HF processor's for the B prompts, indexed out
    to their G rows (as the HF engine's shared-prompt path does); texts are decoded from the
    ids with the processor, as the HF engine decodes them. Greedy: vLLM is asked for one
    completion per prompt, repeated to the G identical rows the HF engine returns.
    """
    from mmrl.train.batching import select_rows

    if len(outputs) != len(samples):
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(samples)} prompts")
    group_size, n = n, 1 if greedy else n  # greedy: one completion, repeated to the G rows
    inputs = encode_prompts(processor, list(samples))
    check_prompt_ids(outputs, inputs, samples)
    prompts = prompt_batch(samples, inputs, processor)
    batch = select_rows(prompts, [i for i in range(len(samples)) for _ in range(n)])
    response, mask, logprobs, truncated = completion_tensors(outputs, n, stop_token_ids, pad_token_id, greedy)
    batch.response_ids, batch.response_mask, batch.rollout_logprobs = response, mask, logprobs
    batch.truncated = truncated
    batch.texts = response_texts(processor, response, mask)
    if group_size != n:
        batch = select_rows(batch, [i for i in range(len(samples)) for _ in range(group_size)])
    batch.group_size = group_size
    return batch


# -- which weights go to vLLM --

_PEFT_PREFIX = "base_model.model."


@dataclass
class LoraSpec:
    """What the engine needs to know of a PEFT LoRA policy."""

    scaling: dict[str, float]
    """Per LoRA module (PEFT module name): alpha / r (or its rsLoRA form)."""
    rank: int
    """The largest rank (vLLM's `max_lora_rank`)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The adapter's `adapter_config.json` (PEFT's config as a dict)."""
    adapter_name: str = "default"
    """PEFT's name of the trained adapter."""


def lora_spec(model: torch.nn.Module, adapter_name: str = "default") -> LoraSpec | None:
    """The LoRA facts of a PEFT model (None for a plain model)."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return None
    scaling = {
        name: float(m.scaling[adapter_name])
        for name, m in model.named_modules()
        if isinstance(getattr(m, "scaling", None), dict) and adapter_name in m.scaling
    }
    config = peft_config[adapter_name]
    as_dict = config.to_dict()
    as_dict = {k: (sorted(v) if isinstance(v, set) else v) for k, v in as_dict.items()}
    ranks = [int(config.r), *[int(r) for r in (getattr(config, "rank_pattern", None) or {}).values()]]
    return LoraSpec(scaling=scaling, rank=max(ranks), config=as_dict, adapter_name=adapter_name)


def only_adapters_train(model: torch.nn.Module) -> bool:
    """Whether every trainable parameter is a LoRA adapter's (the base weights never change)."""
    return all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)


def sync_mode(lora: LoraSpec | None, adapters_only: bool, prefer: str = "auto") -> str:
    """How weights reach vLLM after an update.

    `full`: a plain policy, its full weights. With LoRA, `adapter`: the adapters alone, served
    as a `LoRARequest` (megabytes, not gigabytes), possible only when nothing but the adapters
    trains; `merged`: the adapters merged into full weights (when other parts train too, or
    when asked). `prefer`: auto, adapter or merged.
    """
    if prefer not in ("auto", "adapter", "merged"):
        raise ValueError(f"LoRA sync must be auto, adapter or merged, got {prefer!r}")
    if lora is None:
        return "full"
    if prefer == "adapter" and not adapters_only:
        raise ValueError(
            "LoRA sync 'adapter' sends the adapters alone, but parts of the base model train too "
            "(model.freeze_vision / freeze_connector off?): use 'merged'"
        )
    if prefer == "merged" or not adapters_only:
        return "merged"
    return "adapter"


def _lora_key(key: str, adapter: str) -> tuple[str, str] | None:
    """(`module`, `A` or `B`) for a PEFT adapter weight key of `adapter`, else None."""
    for part in ("A", "B"):
        marker = f".lora_{part}.{adapter}.weight"
        if key.endswith(marker):
            return key[: -len(marker)], part
    return None


def merged_weights(state_dict: dict[str, torch.Tensor], lora: LoraSpec) -> dict[str, torch.Tensor]:
    """Full weights in the base model's (HF) names: W = W0 + scaling * B @ A for LoRA layers.

    The result is what `merge_and_unload()` would leave, without copying the model.
    """
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        hit = _lora_key(key, lora.adapter_name)
        if hit is not None:
            adapters.setdefault(hit[0], {})[hit[1]] = value
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if ".lora_" in key:
            continue
        name = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
        if ".base_layer." in key:
            module = key.split(".base_layer.")[0]
            name = name.replace(".base_layer.", ".")
            if key.endswith(".base_layer.weight") and module in adapters:
                ab = adapters[module]
                if module not in lora.scaling:
                    raise KeyError(f"no LoRA scaling known for {module}")
                delta = (ab["B"].float() @ ab["A"].float()) * lora.scaling[module]
                value = (value.float() + delta).to(value.dtype)
        out[name] = value
    return out


def adapter_weights(state_dict: dict[str, torch.Tensor], lora: LoraSpec) -> dict[str, torch.Tensor]:
    """The adapters alone, keyed as PEFT saves them (`...lora_A.weight`, no adapter name)."""
    out = {}
    for key, value in state_dict.items():
        hit = _lora_key(key, lora.adapter_name)
        if hit is not None:
            out[f"{hit[0]}.lora_{hit[1]}.weight"] = value
    if not out:
        raise KeyError(f"no LoRA weights of adapter {lora.adapter_name!r} in the state dict")
    return out


def weights_to_sync(
    state_dict: dict[str, torch.Tensor], mode: str, lora: LoraSpec | None
) -> dict[str, torch.Tensor]:
    """What `load_weights` pushes for a sync mode (see `sync_mode`)."""
    if mode == "full":
        return state_dict
    if lora is None:
        raise ValueError(f"sync mode {mode!r} needs a LoRA policy")
    if mode == "merged":
        return merged_weights(state_dict, lora)
    if mode == "adapter":
        return adapter_weights(state_dict, lora)
    raise ValueError(f"unknown sync mode {mode!r}")


def check_state_keys(state_dict: dict[str, torch.Tensor], expected: set[str]) -> None:
    """Every key of the policy, and nothing else: a partial sync would go unnoticed."""
    missing = expected - state_dict.keys()
    unexpected = state_dict.keys() - expected
    if missing or unexpected:
        raise KeyError(
            f"weights do not fit the rollout model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )


def vllm_lora_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for an adapter of rank `rank`: the smallest value vLLM accepts
    that holds it (a capacity bound, so a rank-4 adapter is served exactly under 8), logged
    when it differs. Above 512 vLLM serves no adapter: an error naming model.lora_rank."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            if allowed != rank:
                log.info(
                    "vLLM max_lora_rank %d for LoRA rank %d (vLLM accepts %s)", allowed, rank, VLLM_LORA_RANKS
                )
            return allowed
    raise ValueError(
        f"LoRA rank {rank} (model.lora_rank) is above 512, the largest max_lora_rank vLLM accepts: "
        "serve it merged (rollout.engine=hf, or a merged sync) or lower the rank"
    )


def weight_sync_mode(setting: str, tensor_parallel_size: int) -> str:
    """`inprocess` or `nccl` for `rollout.vllm_weight_sync` (auto: inprocess with one GPU per
    engine; tensor parallelism needs worker processes, hence nccl)."""
    if setting not in WEIGHT_SYNCS:
        raise ValueError(f"rollout.vllm_weight_sync={setting!r}: choose one of {', '.join(WEIGHT_SYNCS)}")
    if setting == "auto":
        return "inprocess" if tensor_parallel_size == 1 else "nccl"
    if setting == "inprocess" and tensor_parallel_size > 1:
        raise ValueError(
            "rollout.vllm_weight_sync=inprocess runs the engine in this process, one GPU; with "
            f"rollout.vllm_tensor_parallel_size={tensor_parallel_size} use nccl"
        )
    return setting


_PLAIN = (str, int, float, bool, type(None))


def plain(payload: Any, where: str = "the message") -> None:
    """Raise TypeError unless `payload` is made of str, int, float, bool, None, lists and dicts
    with str keys: what crosses vLLM's RPC unchanged (its engine core decodes msgpack untyped,
    so a tensor arrives as a `[dtype, shape, buffer]` list and a tuple as a list)."""
    if isinstance(payload, _PLAIN):
        return
    if isinstance(payload, list):
        for i, item in enumerate(payload):
            plain(item, f"{where}[{i}]")
        return
    if isinstance(payload, dict):
        for key, item in payload.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has a {type(key).__name__} key {key!r}; RPC messages take str keys")
            plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(payload).__name__}; vLLM's RPC decodes messages untyped, so only str, int, "
        "float, bool, None, lists and dicts arrive unchanged (weights go in-process or over NCCL)"
    )


def sync_message(bucket: list[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """What an NCCL sync tells the workers of a bucket: names, dtypes and shapes, in the order the
    tensors are broadcast."""
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


def inprocess_environment(device_index: int) -> dict[str, str]:
    """The environment an in-process engine needs: V1 multiprocessing off (the engine core in
    this process), and the torch.distributed variables vLLM's `external_launcher` executor reads
    (a one-process world unless the process is in one already)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for key, value in (("RANK", "0"), ("LOCAL_RANK", str(device_index)), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):  # fmt: skip
        env[key] = os.environ.get(key, value)
    env["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(_free_port())
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_dtype(spec: str) -> str:
    """vLLM's `dtype` for `model.dtype`: the named dtype; `auto` is what mmrl's `auto` gives on
    a GPU (bfloat16 where supported; vLLM's own `auto` would run a float32 checkpoint in
    float16). Without a GPU (where vLLM cannot run anyway) `auto` names bfloat16."""
    if spec != "auto":
        if spec not in DTYPES:
            raise ValueError(f"model.dtype={spec!r}: choose auto, {', '.join(DTYPES)}")
        return spec
    if not torch.cuda.is_available():
        return "bfloat16"
    names = {v: k for k, v in DTYPES.items()}
    return names[resolve_dtype("auto", torch.device("cuda"))]


def llm_kwargs(
    model_path: str,
    gpu_memory_utilization: float,
    sleep_level: int,
    max_images: int,
    seed: int,
    lora: LoraSpec | None,
    mode: str,
    dtype: str = "bfloat16",
    revision: str | None = None,
    tensor_parallel_size: int = 1,
    weight_sync: str = "inprocess",
    **overrides: Any,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` (`overrides` last: max_model_len, enforce_eager...)."""
    kw: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "revision": revision,
        "tokenizer_revision": revision,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enable_sleep_mode": sleep_level > 0,
        "limit_mm_per_prompt": {"image": max_images},
        "seed": seed,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": EXTENSION,
    }
    if weight_sync == "inprocess":
        kw["distributed_executor_backend"] = "external_launcher"
    if mode == "adapter" and lora is not None:
        kw.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora.rank), max_loras=1)
    kw.update(overrides)
    return kw


def weight_buckets(
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    max_bytes: int = SYNC_BUCKET_BYTES,
    device: torch.device | str | None = "cpu",
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`(name, tensor)` pairs in vLLM's dtype (floating-point ones cast, on their own device
    first, so a GPU policy copies half the bytes of float32 master weights), on `device` (None:
    where they are), grouped into lists of at most `max_bytes` (a larger tensor goes alone).
    One bucket is materialised at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        tensor = tensor.detach()
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if device is not None:
            tensor = tensor.to(device)
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


class VLLMRolloutEngine:
    """Generates G responses per prompt with vLLM, recording per-token log-probs (HF engine
    interface: `generate`, `continue_rows`, `load_weights`, `sleep`, `wake`)."""

    def __init__(
        self,
        model_path: str,
        processor: ProcessorMixin,
        blocked: torch.Tensor,
        stop_token_ids: list[int],
        pad_token_id: int,
        expected_keys: set[str],
        lora: LoraSpec | None = None,
        adapters_only: bool = True,
        lora_sync: str = "auto",
        gpu_memory_utilization: float = 0.5,
        sleep_level: int = 1,
        max_images: int = 8,
        seed: int = 0,
        dtype: str = "auto",
        revision: str | None = None,
        tensor_parallel_size: int = 1,
        weight_sync: str = "auto",
        **overrides: Any,
    ):
        vllm = import_vllm()
        self.processor = processor
        self.blocked = blocked
        self.stop_token_ids = list(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.expected_keys = set(expected_keys)
        self.lora = lora
        self.mode = sync_mode(lora, adapters_only, lora_sync)
        if sleep_level == 2 and self.mode == "adapter":
            raise ValueError(
                "rollout.vllm_sleep_level=2 drops vLLM's base weights, which LoRA adapter sync never "
                "sends again: use rollout.vllm_sleep_level=1"
            )
        if tensor_parallel_size < 1:
            raise ValueError(f"rollout.vllm_tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        self.sleep_level = sleep_level
        if max_images < 1:
            raise ValueError(f"rollout.vllm_max_images must be >= 1, got {max_images}")
        self.max_images = max_images
        self.dtype_name = vllm_dtype(dtype)
        self.dtype = DTYPES[self.dtype_name]
        self.allowed = allowed_token_ids(blocked, len(processor.tokenizer))
        self._lora_dir = None
        if self.mode == "adapter":
            self._lora_dir = Path(tempfile.mkdtemp(prefix="mmrl-vllm-lora-"))
            weakref.finalize(self, shutil.rmtree, self._lora_dir, True)
        self._lora_request = None
        self._version = 0
        self._requests = itertools.count()  # request ids, unique over the engine's life
        self._asleep: set[str] = set()  # the sleeping parts: "weights", "kv_cache"
        self._weights_lost = False  # level 2 discarded the weights; the last sync is sent again
        self._last_sync: list[list[tuple[str, torch.Tensor]]] | None = None
        self.weight_sync = weight_sync_mode(weight_sync, tensor_parallel_size)
        kwargs = llm_kwargs(
            model_path, gpu_memory_utilization, sleep_level, max_images, seed, lora, self.mode,
            dtype=self.dtype_name, revision=revision, tensor_parallel_size=tensor_parallel_size,
            weight_sync=self.weight_sync, **overrides,
        )  # fmt: skip
        if self.weight_sync == "inprocess":
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            os.environ.update(inprocess_environment(index))
        try:
            self.llm = vllm.LLM(**kwargs)
        except TypeError as exc:
            if "logprobs_mode" in str(exc) or "worker_extension_cls" in str(exc):
                raise ImportError(
                    f"mmrl needs vllm>={MIN_VLLM} (logprobs_mode=processed_logprobs: log-probs of the "
                    f"tempered distribution; worker_extension_cls: weight sync): pip install -U 'mmrl[vllm]'"
                ) from exc
            raise
        self._reset_encoder_cache = self._find("reset_encoder_cache")
        self._group = None  # the NCCL weight-sync group (nccl sync), made on the first sync
        self._sender: torch.device | None = None

    def _find(self, method: str) -> Any:
        """`LLM.<method>`, or its engine's (vLLM versions differ); an error naming the method."""
        for owner in (self.llm, getattr(self.llm, "llm_engine", None)):
            found = getattr(owner, method, None)
            if callable(found):
                return found
        raise ImportError(
            f"this vLLM has no LLM.{method} (mmrl calls it after every weight sync: cached image "
            "features of the old weights would be reused): pip install -U 'mmrl[vllm]'"
        )

    @classmethod
    def from_policy(cls, policy: Policy, cfg: Any = None, **overrides: Any) -> VLLMRolloutEngine:
        """An engine on the policy's model folder or hub id (vLLM loads its own copy;
        `load_weights` makes it the policy's). `cfg`: a `Config` (rollout.vllm_*, model.dtype,
        model.revision, trainer.seed), or None for defaults.
        """
        from mmrl.config import Config

        model = policy.model
        lora = lora_spec(model)
        base = model.get_base_model() if lora is not None else model
        model_path = str(getattr(base, "name_or_path", "") or "")
        local = Path(model_path).expanduser()
        if local.is_dir() and (local / "config.json").exists():
            model_path = str(local)
        elif local.exists() or not model_path or not HUB_ID.fullmatch(model_path):
            raise ValueError(
                f"vLLM loads the policy from its folder or hub id; {model_path!r} is neither (save the "
                "model and processor with save_pretrained and load them with mmrl.models.loading.load_policy)"
            )
        cfg = cfg if cfg is not None else Config()
        r = cfg.rollout
        return cls(
            model_path,
            policy.processor,
            policy.blocked,
            policy.stop_token_ids,
            policy.pad_token_id,
            expected_keys=set(model.state_dict().keys()),
            lora=lora,
            adapters_only=only_adapters_train(model),
            gpu_memory_utilization=r.vllm_gpu_memory_utilization,
            sleep_level=r.vllm_sleep_level,
            seed=cfg.trainer.seed,
            dtype=cfg.model.dtype,
            revision=cfg.model.revision,
            tensor_parallel_size=r.vllm_tensor_parallel_size,
            max_images=r.vllm_max_images,
            weight_sync=r.vllm_weight_sync,
            **overrides,
        )

    # -- memory --

    def sleep(self) -> None:
        """Free the GPU for training: level 1 offloads the weights to CPU, level 2 drops them
        (the next sync refills them); the KV cache is dropped either way."""
        if self.sleep_level == 0 or self._asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_lost = self.sleep_level == 2

    def wake(self, tags: list[str] | None = None) -> None:
        """Wake the given parts (`weights`, `kv_cache`), or all of them."""
        parts = set(tags) if tags is not None else set(self._asleep)
        parts &= self._asleep
        if not parts:
            return
        if parts == self._asleep:
            self.llm.wake_up()
        else:
            self.llm.wake_up(tags=sorted(parts))
        self._asleep -= parts

    @property
    def asleep(self) -> bool:
        """Whether any part (weights, KV cache) is asleep."""
        return bool(self._asleep)

    # -- weights --

    def load_weights(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Make vLLM's weights the trainer's (after each update). While asleep, only the weights
        wake (the KV cache stays free until the next batch). The prefix and encoder caches are
        reset after every sync: they hold keys, values and image features of the old weights."""
        if state_dict is None:
            return
        check_state_keys(state_dict, self.expected_keys)
        weights = weights_to_sync(state_dict, self.mode, self.lora)
        self._version += 1
        if self.mode == "adapter":
            self._publish_adapter(weights)
        else:
            self.wake(["weights"])
            kept = []
            for bucket in weight_buckets(weights.items(), self.dtype, device=self._bucket_device()):
                self._push(bucket)
                if self.sleep_level == 2:  # host copies, to refill the weights a sleep drops
                    kept.append([(name, t.to("cpu", copy=True)) for name, t in bucket])
            self._weights_lost = False
            self._last_sync = kept if self.sleep_level == 2 else None
        self._after_sync()

    def _after_sync(self) -> None:
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:  # cached prompt prefixes hold the old weights' keys and values
            reset()
        self._reset_encoder_cache()  # cached image features come from the old vision tower

    def _bucket_device(self) -> torch.device | None:
        """Where a bucket's tensors go: in-process, left where they are (vLLM's loaders copy from
        any device); over NCCL, this process's GPU."""
        if self.weight_sync == "inprocess":
            return None
        return self._sending_device()

    def _push(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket into the engine's model: in-process straight into it, else over NCCL to
        every worker (each tensor-parallel rank)."""
        if self.weight_sync == "inprocess":
            self._local_model().load_weights(weights=bucket)
        else:
            self._broadcast(bucket)

    # -- the in-process engine --

    _MODEL_PATHS = (
        "llm_engine.model_executor.driver_worker.worker.model_runner.model",
        "llm_engine.model_executor.driver_worker.model_runner.model",
        "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
        "llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner.model",
    )
    """Where an in-process vLLM keeps its model (the path moved between versions; TRL's colocate
    mode uses the second)."""

    def _local_model(self) -> Any:
        for path in self._MODEL_PATHS:
            found: Any = self.llm
            for attr in path.split("."):
                found = getattr(found, attr, None)
                if found is None:
                    break
            if found is not None:
                return found
        raise RuntimeError(
            "rollout.vllm_weight_sync=inprocess: this vLLM keeps its model at none of "
            f"{', '.join('llm.' + p for p in self._MODEL_PATHS)} (is VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "honoured?); use rollout.vllm_weight_sync=nccl"
        )

    # -- the separate engine: RPC for names, NCCL for data --

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """`collective_rpc(method, args)` on every worker, each argument checked to be a plain
        message first (`plain`): names, dtypes and shapes, never a tensor."""
        for i, arg in enumerate(args):
            plain(arg, f"argument {i} of {method}")
        return list(self.llm.collective_rpc(method, args=tuple(args)))

    def _rpc_beside(self, method: str, *args: Any) -> tuple[threading.Thread, dict]:
        """`_rpc` in a thread (it returns when the workers do, and they wait for this process's
        side of a collective): (the thread, a dict that gets `result` or `error`)."""
        out: dict[str, Any] = {}

        def call() -> None:
            try:
                out["result"] = self._rpc(method, *args)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
                out["error"] = exc

        thread = threading.Thread(target=call, name=f"mmrl-vllm-{method}", daemon=True)
        thread.start()
        return thread, out

    @staticmethod
    def _joined(thread: threading.Thread, out: dict) -> list[Any]:
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["result"]

    def _sending_device(self) -> torch.device:
        """This process's GPU, from which weights are broadcast (not one of the engine's)."""
        if self._sender is None:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "rollout.vllm_weight_sync=nccl broadcasts from this process's GPU; it has none"
                )
            self._sender = torch.device("cuda", torch.cuda.current_device())
        return self._sender

    def _weight_group(self) -> Any:
        """The NCCL group of this process (rank 0) and the engine's workers, made once with
        vLLM's own `StatelessProcessGroup` and `PyNcclCommunicator` (vLLM's RLHF example)."""
        if self._group is not None:
            return self._group
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        sender = self._sending_device()
        workers = self._rpc("mmrl_device_uuid")
        if device_uuid(sender) in workers:
            raise RuntimeError(
                f"rollout.vllm_weight_sync=nccl: this process's GPU ({sender}) is one of the vLLM engine's, and "
                "NCCL cannot connect two ranks on one GPU: give the engine other GPUs, or use "
                "rollout.vllm_weight_sync=inprocess"
            )
        # The workers are this LLM's local processes: the group meets on this host.
        spec = {"host": "127.0.0.1", "port": _free_port(), "world_size": 1 + len(workers), "rank_offset": 1}
        thread, out = self._rpc_beside("mmrl_init_weight_group", spec)
        group = StatelessProcessGroup.create(host=spec["host"], port=spec["port"], rank=0,
                                             world_size=spec["world_size"])  # fmt: skip
        self._group = PyNcclCommunicator(group, device=sender)
        ranks = self._joined(thread, out)
        if sorted(ranks) != list(range(1, spec["world_size"])):
            raise RuntimeError(f"vLLM workers joined the weight-sync group as ranks {ranks}")
        return self._group

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """The bucket's names, dtypes and shapes by RPC, its tensors by NCCL broadcast."""
        group = self._weight_group()
        sender = self._sending_device()
        thread, out = self._rpc_beside(RECEIVE_METHOD, sync_message(bucket))
        stream = torch.cuda.current_stream(sender) if sender.type == "cuda" else None
        for _, tensor in bucket:
            group.broadcast(tensor.to(sender), src=0, stream=stream)  # (host copies of a level-2 refill)
        if stream is not None:
            stream.synchronize()  # the bucket may be freed once the broadcasts are done
        counts = self._joined(thread, out)
        if any(c != len(bucket) for c in counts):
            raise RuntimeError(f"vLLM workers loaded {counts} tensors of a bucket of {len(bucket)}")

    def _publish_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        """Save the adapters as a PEFT folder and serve them under a new LoRA id."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        folder = self._lora_dir / f"v{self._version}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in weights.items()},
            folder / "adapter_model.safetensors",
        )
        (folder / "adapter_config.json").write_text(json.dumps(self.lora.config, default=str))
        old = self._lora_request
        self._lora_request = LoRARequest(f"mmrl-v{self._version}", self._version, str(folder))
        if old is not None:
            remove = getattr(getattr(self.llm, "llm_engine", None), "remove_lora", None)
            if remove is not None:
                remove(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    # -- generation --

    def generate(
        self,
        samples: list[Sample],
        params: SamplingParams,
        on_response: Callable[[int, str], None] | None = None,
    ) -> RolloutBatch:
        """G = params.n responses per sample; rows are prompt-major ([B x G]).

        `on_response(row, text)` is called for each of a prompt's G rows as soon as vLLM
        finishes that prompt's request, while the other prompts are still being generated.
        """
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(**p) for p in vllm_prompts(self.processor, samples, self.max_images)]
        sampling = self._sampling(vllm, params)
        self._ready()
        G, n = params.n, 1 if params.greedy else params.n

        def finished(i: int, output: Any) -> None:
            if on_response is None:
                return
            response, mask, _, _ = completion_tensors(
                [output], n, self.stop_token_ids, self.pad_token_id, params.greedy
            )
            texts = response_texts(self.processor, response, mask)
            for j in range(G):  # greedy: the one completion is each of the G rows
                on_response(i * G + j, texts[j if n == G else 0])

        try:
            outputs = self._run(prompts, sampling, finished)
        finally:
            self.sleep()
        return rollout_from_vllm(
            outputs, samples, self.processor, params.n, self.stop_token_ids, self.pad_token_id, params.greedy
        )

    def continue_rows(
        self, ids: list[list[int]], images: list[list], params: SamplingParams
    ) -> list[tuple[list[int], list[float], bool]]:
        """The next turn of multi-turn trajectories (`mmrl.rollout.multiturn`), the HF engine's
        contract: each row's whole sequence so far as token ids (image tokens expanded as the HF
        processor expands them) and every image it holds, in order; one response per row.
        Returns per row the new token ids (stop token included), their log-probs (0 when
        greedy), and whether the turn hit `params.max_new_tokens` without a stop token.

        vLLM expands each image placeholder itself, so each image's run of tokens goes to it as
        one placeholder (`continuation_prompts`). Like `generate`, it wakes the engine and puts it
        back to sleep after the turn."""
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        if not ids:
            return []
        prompts = [
            TokensPrompt(**p)
            for p in continuation_prompts(ids, images, image_token_id(self.processor), self.max_images)
        ]
        sampling = self._sampling(vllm, replace(params, n=1))
        self._ready()
        try:
            outputs = self._run(prompts, sampling, lambda i, output: None)
        finally:
            self.sleep()
        return continuation_results(outputs, ids, self.stop_token_ids, self.pad_token_id, params.greedy)

    def _sampling(self, vllm: Any, params: SamplingParams) -> Any:
        """vLLM's `SamplingParams` for mmrl's, one output per request once it is done."""
        from vllm.sampling_params import RequestOutputKind

        return vllm.SamplingParams(
            **vllm_sampling_kwargs(params, self.stop_token_ids, self.allowed),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _ready(self) -> None:
        """Weights in place and the engine awake, before requests go in."""
        if self._weights_lost:  # level-2 sleep and no sync since: send the last weights again
            if self._last_sync is None:
                raise RuntimeError(
                    "vLLM slept at level 2 (weights dropped) before any weights were loaded: call "
                    "load_weights first, or use rollout.vllm_sleep_level=1"
                )
            self.wake(["weights"])
            for bucket in self._last_sync:
                self._push(bucket)
            self._weights_lost = False
            self._after_sync()
        self.wake()

    def _run(
        self, prompts: list[dict[str, Any]], sampling: Any, finished: Callable[[int, Any], None]
    ) -> list[Any]:
        """vLLM's engine loop over one request per prompt (what `LLM.generate` runs inside),
        calling `finished(i, output)` the step prompt i's request finishes; the outputs in
        prompt order. On an error the requests still running are aborted."""
        engine = self.llm.llm_engine
        call = next(self._requests)
        ids = [f"mmrl-{call}-{i}" for i in range(len(prompts))]
        index = {rid: i for i, rid in enumerate(ids)}
        outputs: list[Any] = [None] * len(prompts)
        extra = {"lora_request": self._lora_request} if self._lora_request is not None else {}
        try:
            for rid, prompt in zip(ids, prompts):
                engine.add_request(rid, prompt, sampling, **extra)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    i = index.get(output.request_id)
                    if i is None or not output.finished:
                        continue
                    outputs[i] = output
                    finished(i, output)
        except BaseException:
            running = [rid for rid, out in zip(ids, outputs) if out is None]
            if running:
                engine.abort_request(running)
            raise
        missing = [i for i, out in enumerate(outputs) if out is None]
        if missing:
            raise RuntimeError(f"vLLM's engine stopped without an output for prompts {missing[:10]}")
        return outputs

    def close(self) -> None:
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
