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
    prompts        `vllm_prompts`: the policy processor's chat template, exactly the text the HF
                   engine feeds, with the sample's PIL images as `multi_modal_data`
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
                   `LoRARequest`); full weights go to every vLLM worker (each tensor-parallel
                   rank) by `collective_rpc("mmrl_load_weights", ...)`, a method of mmrl's
                   worker extension (`mmrl.rollout.vllm_worker`, vLLM's `worker_extension_cls`)
                   called by name with CPU tensors in the engine's dtype, in buckets of
                   `SYNC_BUCKET_BYTES` (no pickled code: vLLM V1 needs no
                   VLLM_ALLOW_INSECURE_SERIALIZATION)
    memory         with `rollout.vllm_sleep_level` > 0 the engine sleeps after each batch
                   (weights offloaded or dropped, KV cache freed) so training can use the GPU,
                   wakes its weights alone to load new ones, and wakes fully to generate; after
                   a level-2 sleep with no sync since, the last synced weights are sent again.
                   Set 0 where the engine has its GPU to itself (separate rollout workers, the
                   asynchronous mode): sleeping there only costs time

What is not tested here: anything that runs vLLM itself (our machines have no GPU); the tests
drive this module against a stand-in `vllm` module shaped like vLLM's API.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import ProcessorMixin

from mmrl.models.loading import HUB_ID, Policy
from mmrl.models.precision import DTYPES, resolve_dtype
from mmrl.rollout.hf import SamplingParams, encode_prompts, prompt_batch, response_mask_from_stops
from mmrl.rollout.vllm_worker import EXTENSION
from mmrl.types import RolloutBatch, Sample

INSTALL_HINT = "the vLLM rollout engine needs vLLM and a GPU: pip install 'mmrl[vllm]'"
MIN_VLLM = "0.10.2"
"""The first vLLM whose `logprobs_mode` has `processed_logprobs`."""
SYNC_BUCKET_BYTES = 512 * 2**20
"""A weight sync sends the weights in messages of about this many bytes (at least one tensor
each): the host holds one bucket at a time, not a copy of the model."""
LOAD_METHOD = "mmrl_load_weights"
"""The worker-extension method (`mmrl.rollout.vllm_worker`) a sync calls by name."""


def import_vllm():
    """vLLM, imported on first use (never at module import: the engine is optional)."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} (rollout.engine=vllm)") from exc
    return vllm


# ---------------------------------------------------------------------------------------------
# Pure pieces: prompts, sampling parameters, outputs -> RolloutBatch, which weights to sync
# ---------------------------------------------------------------------------------------------


def prompt_text(processor: ProcessorMixin, sample: Sample) -> str:
    """The templated prompt of one sample: the HF engine's `encode_prompts` text."""
    return processor.apply_chat_template(sample.chat_messages(), add_generation_prompt=True, tokenize=False)


def vllm_prompts(
    processor: ProcessorMixin, samples: Sequence[Sample], max_images: int
) -> list[dict[str, Any]]:
    """vLLM prompt dicts: `{"prompt": text, "multi_modal_data": {"image": [PIL, ...]}}`.

    The text keeps the processor's image placeholders (one per image); vLLM's multimodal
    processor expands each to the image's tokens, as the HF processor does.
    """
    prompts = []
    for s in samples:
        if len(s.images) > max_images:
            raise ValueError(
                f"sample {s.id!r} has {len(s.images)} images; the vLLM engine was built for at most "
                f"{max_images} per prompt (VLLMRolloutEngine(max_images=...))"
            )
        prompt: dict[str, Any] = {"prompt": prompt_text(processor, s)}
        if s.images:
            prompt["multi_modal_data"] = {"image": s.pil_images()}
        prompts.append(prompt)
    return prompts


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
    if mode == "adapter" and lora is not None:
        kw.update(enable_lora=True, max_lora_rank=lora.rank, max_loras=1)
    kw.update(overrides)
    return kw


def weight_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, max_bytes: int = SYNC_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`(name, tensor)` pairs as host tensors in vLLM's dtype (floating-point ones cast, on their
    own device first, so a GPU policy copies half the bytes of float32 master weights), grouped
    into lists of at most `max_bytes` (a larger tensor goes alone). One bucket is materialised
    at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        tensor = tensor.detach()
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        tensor = tensor.to("cpu").contiguous()
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
    interface: `generate`, `load_weights`, `sleep`, `wake`)."""

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
        max_images: int = 4,
        seed: int = 0,
        dtype: str = "auto",
        revision: str | None = None,
        tensor_parallel_size: int = 1,
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
        kwargs = llm_kwargs(
            model_path, gpu_memory_utilization, sleep_level, max_images, seed, lora, self.mode,
            dtype=self.dtype_name, revision=revision, tensor_parallel_size=tensor_parallel_size,
            **overrides,
        )  # fmt: skip
        try:
            self.llm = vllm.LLM(**kwargs)
        except TypeError as exc:
            if "logprobs_mode" in str(exc) or "worker_extension_cls" in str(exc):
                raise ImportError(
                    f"mmrl needs vllm>={MIN_VLLM} (logprobs_mode=processed_logprobs: log-probs of the "
                    f"tempered distribution; worker_extension_cls: weight sync): pip install -U 'mmrl[vllm]'"
                ) from exc
            raise

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
        wake (the KV cache stays free until the next batch)."""
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
            for bucket in weight_buckets(weights.items(), self.dtype):
                self._push(bucket)
                if self.sleep_level == 2:  # host copies, to refill the weights a sleep drops
                    kept.append(bucket)
            self._weights_lost = False
            self._last_sync = kept if self.sleep_level == 2 else None
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:  # cached prompt prefixes hold the old weights' keys and values
            reset()

    def _push(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket into every worker, through the worker extension's method (by name)."""
        counts = list(self.llm.collective_rpc(LOAD_METHOD, args=(bucket,)))
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
        from vllm.sampling_params import RequestOutputKind

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
        self.wake()
        prompts = vllm_prompts(self.processor, samples, self.max_images)
        sampling = vllm.SamplingParams(
            **vllm_sampling_kwargs(params, self.stop_token_ids, self.allowed),
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, once it is done
        )
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
