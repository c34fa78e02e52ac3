"""The decode steps of the HF engine's shared-prompt sampler (`mmrl.rollout.hf`), three ways.

After the prefill, every step feeds one token per running row and returns the next logits.
On a GPU that step is bounded by reading the weights and the key/value cache; in eager PyTorch
it is bounded instead by Python and kernel launches (tens of launches per layer), well above the
memory bound at the batch sizes of RL. So the step comes in three forms (`rollout.decode`):

    eager      the model's forward over the growing dynamic cache the prefill returned (the
               default on the CPU, where launches are cheap)
    static     the same forward over a `transformers.StaticCache` of fixed shape: rows padded to
               a batch-size bucket, the cache to a fixed length, and the 4-D attention mask
               built once per batch and updated one column per step. Everything a step reads
               is a fixed tensor, so...
    captured   ...the static step is captured once per bucket as a CUDA graph
               (`torch.cuda.CUDAGraph`) and replayed: one launch per step (the default on CUDA)

Why a raw CUDA graph and not `torch.compile(mode="reduce-overhead")`: the step is the model's
own eager code over library pieces (StaticCache, the mask functions); compiling it takes tens of
seconds per bucket for a 28-layer model and recompiles per bucket shape, while a capture takes
a few forwards. vLLM and SGLang capture their decode steps the same way.

Finished rows are compacted out: when the rows still running fit a smaller bucket, their cache
rows (and mask, positions) are gathered to the front and the smaller bucket's step runs (the
eager path keeps exactly the running rows). Sampling is outside the step and draws its noise for
every row of the batch, running or not (`exponential_race`), so which rows run in which slot
never changes what is sampled: the three forms give the same tokens (tested on the CPU, where
`captured` runs with a stand-in for the graph).

The captured step also needs fixed weight addresses across calls: under mixed precision the
float32 weights of linear layers are copied once per batch into persistent compute-dtype
buffers and swapped in for the batch (`CastWeights`: what autocast's cast cache does within one
call, kept across calls).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

log = logging.getLogger(__name__)

DECODE_MODES = ("auto", "eager", "static", "captured")
STATIC_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""Model types the static step is tested with (CPU equality tests); others decode eagerly."""
_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.info(message)


def resolve_decode(mode: str, device: torch.device) -> str:
    """The decode form for `rollout.decode` on `device`: `auto` is captured on CUDA, eager
    elsewhere. (`captured` off CUDA is the engine's to refuse: tests capture with a stand-in.)"""
    if mode not in DECODE_MODES:
        raise ValueError(f"rollout.decode={mode!r}: choose one of {', '.join(DECODE_MODES)}")
    if mode == "auto":
        return "captured" if device.type == "cuda" else "eager"
    return mode


def decode_buckets(max_rows: int) -> list[int]:
    """Batch sizes the static step runs at: 1, 2, 4, 8, then every 8 up to 64, every 16 up to
    256, every 64 beyond (vLLM's capture sizes follow the same idea), up to `max_rows` (itself
    included)."""
    sizes, n = [], 1
    while n < max_rows:
        sizes.append(n)
        n = n * 2 if n < 8 else n + (8 if n < 64 else 16 if n < 256 else 64)
    sizes.append(max_rows)
    return sizes


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `n` rows."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest decode bucket {buckets[-1]}")


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One sample per row of `probs` [n, V]: argmax(p / q) with q ~ Exp(1) i.i.d. [n, V] is
    distributed as Categorical(p) (the exponential race; vLLM samples this way). The noise is
    drawn by the caller for every row of the batch, so a row's sample does not depend on which
    other rows are still running."""
    return probs.div_(noise).argmax(dim=-1)


# ---------------------------------------------------------------------------------------------
# Eager: the dynamic cache of the prefill, growing one position per step
# ---------------------------------------------------------------------------------------------


class EagerSteps:
    """Decode steps with the model's forward over the prefill's dynamic cache.

    `step(tokens)` feeds `tokens` [n] (one per running slot) and returns the next logits [n, V];
    `wants(running)` says whether to compact, and `keep(slots)` drops every other slot. (The
    engine gives it a cache whose layers have room for the steps, `grow_in_place`.)"""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: Any,
        attention_mask: torch.Tensor,
        position: torch.Tensor,
        buckets: list[int],
    ):
        from mmrl.train.forward import cache_argument

        self.model, self.cache, self.buckets = model, cache, buckets
        self.attention_mask = attention_mask  # [n, P + t]
        self.position = position  # [n, 1] or [3, n, 1]: the position of the next token fed
        self.cache_kw = cache_argument(model)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        from mmrl.train.forward import output_cache

        n = tokens.shape[0]
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(n, 1)], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.attention_mask,
            position_ids=self.position,
            use_cache=True,
            **{self.cache_kw: self.cache},
        )
        self.cache = output_cache(out)
        self.position = self.position + 1
        return out.logits[:, -1]

    def wants(self, running: int) -> bool:
        """Whether to compact: the running rows fit a smaller bucket than the rows held."""
        return bucket_for(running, self.buckets) < bucket_for(self.attention_mask.shape[0], self.buckets)

    def kv(self, slots: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """The keys and values of `slots`, to keep past this batch: per layer (keys, values)
        [rows, heads, columns, dim], and the rows of `slots` in them. Column P + t holds what
        step t fed (P the prefill's columns). Here the cache's own tensors: a step writes only
        columns after the current one, and compaction makes new tensors."""
        return [(layer.keys, layer.values) for layer in self.cache.layers], slots

    def keep(self, slots: torch.Tensor) -> None:
        self.cache.reorder_cache(slots)
        self.attention_mask = self.attention_mask[slots]
        self.position = self.position.index_select(-2, slots)


def grow_in_place(cache: Any, room: int, rows: torch.Tensor | None = None) -> None:
    """Index a dynamic cache's rows (`rows`: which row each new row copies, as `reorder_cache`)
    and turn its plain layers into `GrowingLayer`s with `room` spare columns, so that a decode
    step writes its column in place where `DynamicLayer` copies the whole cache to append it.
    Layers of other kinds (a sliding window's) are only indexed."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            cache.layers[i] = GrowingLayer(layer.keys, layer.values, room, rows)
        elif rows is not None:
            layer.reorder_cache(rows)


class GrowingLayer(DynamicLayer):
    """A dynamic cache layer whose keys and values are views of buffers with spare columns:
    `update` writes the new columns in place (reallocating, doubled, only when they are full)
    where `DynamicLayer` copies the whole cache to append one column."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int, rows: torch.Tensor | None = None):
        super().__init__()
        if rows is not None:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)
        n, length = keys.shape[0], keys.shape[2]
        self._keys = keys.new_empty((n, keys.shape[1], length + room, keys.shape[3]))
        self._values = values.new_empty((n, values.shape[1], length + room, values.shape[3]))
        self._keys[:, :, :length].copy_(keys)
        self._values[:, :, :length].copy_(values)
        self.length = length
        self.device, self.is_initialized = keys.device, True
        self._view()

    def _view(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self._keys.shape[2]:
            self._keys, self._values = _widened(self._keys, end), _widened(self._values, end)
        self._keys[:, :, self.length : end].copy_(key_states)
        self._values[:, :, self.length : end].copy_(value_states)
        self.length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._keys = self._keys.index_select(0, beam_idx.to(self._keys.device))
        self._values = self._values.index_select(0, beam_idx.to(self._values.device))
        self._view()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._keys = self._keys.repeat_interleave(repeats, dim=0)
        self._values = self._values.repeat_interleave(repeats, dim=0)
        self._view()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            super().crop(tokens_to_remove)  # (refuses, as DynamicLayer does)
        self.length = max(0, self.length + tokens_to_remove)
        self._view()

    def reset(self) -> None:
        self.length = 0
        self._view()


def _widened(buffer: torch.Tensor, columns: int) -> torch.Tensor:
    """`buffer` [n, heads, L, dim] with at least `columns` columns (twice as many, at least)."""
    spare = max(columns, 2 * buffer.shape[2]) - buffer.shape[2]
    return torch.cat([buffer, buffer.new_empty((*buffer.shape[:2], spare, buffer.shape[3]))], dim=2)


# ---------------------------------------------------------------------------------------------
# Static: fixed-shape tensors per bucket, optionally captured
# ---------------------------------------------------------------------------------------------


def static_unsupported(model: torch.nn.Module) -> str | None:
    """Why the static step does not apply to `model` (None: it does)."""
    from transformers import StaticCache

    model_type = getattr(_base(model).config, "model_type", None)
    if model_type not in STATIC_MODEL_TYPES:
        return f"model type {model_type!r} (the static step is tested for {', '.join(STATIC_MODEL_TYPES)})"
    config = _text_config(model)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} (the static step builds sdpa/eager masks)"
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)} (the static step handles full attention only)"
    try:
        cache = StaticCache(config=_base(model).config, max_cache_len=2)
    except Exception as exc:  # noqa: BLE001 - any failure means: not this model
        return f"transformers.StaticCache cannot be built for it ({exc})"
    layer = cache.layers[0] if cache.layers else None
    if layer is None or not all(hasattr(layer, a) for a in ("max_cache_len", "cumulative_length", "keys")):
        return "this transformers' StaticCache layers lack the attributes mmrl fills in"
    return None


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _text_config(model: torch.nn.Module):
    return _base(model).config.get_text_config(decoder=True)


@dataclass
class _Bucket:
    """The fixed tensors of one batch size: the cache (views of the workspace's buffers), the
    step's inputs (token ids, positions, mask) and, once captured, the graph and its output."""

    rows: int
    cache: Any
    ids: torch.Tensor  # [b, 1]
    position: torch.Tensor  # [b, 1] or [3, b, 1]
    mask: torch.Tensor | None = None  # [b, 1, 1, L]: bool (sdpa) or additive float (eager)
    replay: Callable[[], None] | None = None
    logits: torch.Tensor | None = None  # the captured step's output [b, V]


@dataclass
class DecodeWorkspace:
    """What the static step keeps between batches (so graphs captured once are replayed by
    every later batch): the key/value buffers [capacity, heads, L, head_dim] per layer, the
    buckets' tensors and graphs, the compute-dtype weight copies of `CastWeights`.

    Rebuilt when a batch needs more rows or a longer cache than it holds, or the model's weights
    moved (a graph reads the addresses it was captured with)."""

    capacity: int
    max_len: int
    dtypes: tuple[torch.dtype, torch.dtype]  # keys', values' (under autocast they can differ)
    device: torch.device
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    weights_fingerprint: tuple[int, ...] = ()
    pool: Any = None
    cast: CastWeights | None = None

    def fits(self, rows: int, length: int, like: Any, device: torch.device) -> bool:
        """Whether it holds `rows` rows of `length` positions of the cache `like`'s dtypes."""
        return (
            rows <= self.capacity
            and length <= self.max_len
            and self.dtypes == cache_dtypes(like)
            and device == self.device
        )

    @classmethod
    def allocate(cls, like: Any, capacity: int, max_len: int, device: torch.device) -> DecodeWorkspace:
        """Buffers shaped like the layers of the prefill's dynamic cache `like` (and in its
        dtypes), for `capacity` rows and `max_len` positions."""
        keys, values = [], []
        for layer in like.layers:
            _, heads, _, k_dim = layer.keys.shape
            v_dim = layer.values.shape[-1]
            keys.append(torch.zeros(capacity, heads, max_len, k_dim, dtype=layer.keys.dtype, device=device))
            values.append(
                torch.zeros(capacity, heads, max_len, v_dim, dtype=layer.values.dtype, device=device)
            )
        return cls(capacity, max_len, cache_dtypes(like), device, keys, values)

    def bucket(self, model: torch.nn.Module, rows: int, position_like: torch.Tensor) -> _Bucket:
        """The bucket of `rows` rows (made on first use: a StaticCache whose layers are views of
        the first `rows` rows of the buffers)."""
        found = self.buckets.get(rows)
        if found is not None:
            return found
        from transformers import StaticCache

        cache = StaticCache(config=_base(model).config, max_cache_len=self.max_len)
        for layer, k, v in zip(cache.layers, self.keys, self.values):
            # What StaticLayer.lazy_initialization sets, on views of the shared buffers.
            layer.keys, layer.values = k[:rows], v[:rows]
            layer.device, layer.batch_size, layer.num_heads = k.device, rows, k.shape[1]
            layer.k_head_dim, layer.v_head_dim = k.shape[-1], v.shape[-1]
            layer.cumulative_length = torch.zeros((), dtype=torch.long, device=k.device)
            layer.is_initialized = True
        shape = list(position_like.shape)
        shape[-2] = rows
        made = _Bucket(
            rows=rows,
            cache=cache,
            ids=torch.zeros(rows, 1, dtype=torch.long, device=self.device),
            position=torch.zeros(shape, dtype=position_like.dtype, device=self.device),
        )
        self.buckets[rows] = made
        return made


def cache_dtypes(cache: Any) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes of a dynamic cache's keys and values (under autocast the rotary embedding
    can leave the keys in float32 and the values in bfloat16)."""
    return cache.layers[0].keys.dtype, cache.layers[0].values.dtype


def weights_fingerprint(model: torch.nn.Module) -> tuple[int, ...]:
    """Where every parameter's data lives: a captured graph is valid while this is unchanged."""
    return tuple(p.data_ptr() for p in model.parameters())


class CastWeights:
    """Persistent compute-dtype copies of the float32 weights (and biases) of linear layers,
    swapped into the parameters for the duration of a batch (`swapped`), refreshed from the
    float32 values on every entry.

    Under autocast a linear layer casts its float32 weight on every call; within one autocast
    region the cast is cached, but a CUDA graph replayed by later batches would read a cached
    copy freed at the end of the batch it was captured in. These copies stay at one address, so
    the graph reads them, and they hold exactly what autocast's cast gives (the same rounding).
    Only what autocast would cast is swapped (linear layers); norms and embeddings keep float32,
    and so does a weight a linear layer shares with another module (an LM head tied to the
    input embeddings: swapping it would embed in bfloat16). Such a weight is cast by autocast
    inside the graph, on every replay (the captured step runs with autocast's cache off).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        elsewhere = {
            id(p)
            for module in model.modules()
            if not isinstance(module, torch.nn.Linear)
            for p in module.parameters(recurse=False)
        }
        self.params: list[torch.nn.Parameter] = []
        seen: set[int] = set()
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                for p in (module.weight, module.bias):
                    if p is None or p.dtype != torch.float32 or id(p) in elsewhere or id(p) in seen:
                        continue
                    seen.add(id(p))
                    self.params.append(p)
        self.copies = [torch.empty_like(p, dtype=dtype) for p in self.params]

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        originals = [p.data for p in self.params]
        with torch.no_grad():
            for p, copy in zip(self.params, self.copies):
                copy.copy_(p.data)
                p.data = copy
        try:
            yield
        finally:
            for p, original in zip(self.params, originals):
                p.data = original


def cuda_graph_capture(
    step: Callable[[], torch.Tensor], device: torch.device, pool: Any, reads: Callable[[], list[torch.Tensor]]
):
    """Capture `step` as a CUDA graph. Returns (replay, output): `replay()` runs the graph, whose
    result is then in `output`. `reads()` lists the tensors the step reads as of the call: a
    graph reads them where they were at capture, so they must stay there (a test stand-in
    checks it before each replay; the graph itself cannot)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph.replay, output


class StaticSteps:
    """Decode steps over fixed-shape tensors (see the module docs); same interface as
    `EagerSteps`. `capture` (None: run the step eagerly) captures each bucket's step the first
    time it runs (`cuda_graph_capture`, or a stand-in in tests)."""

    def __init__(
        self,
        model: torch.nn.Module,
        workspace: DecodeWorkspace,
        prefill_cache: Any,
        index: torch.Tensor,
        prompt_mask: torch.Tensor,
        position: torch.Tensor,
        buckets: list[int],
        capture: Callable | None = None,
    ):
        from mmrl.train.forward import cache_argument

        self.model, self.ws, self.buckets, self.capture = model, workspace, buckets, capture
        self.capture_failed: str | None = None
        """Why capturing failed, if it did (the steps then run uncaptured)."""
        self.cache_kw = cache_argument(model)
        n, P = index.shape[0], prompt_mask.shape[1]
        self.prompt_len, self.t, self.n = P, 0, n
        # 1. The prefill's keys and values, indexed out to the rows, into the buffers.
        for layer, k, v in zip(prefill_cache.layers, workspace.keys, workspace.values):
            k[:n, :, :P].copy_(layer.keys.index_select(0, index))
            v[:n, :, :P].copy_(layer.values.index_select(0, index))
        # 2. The first bucket: positions, and the mask (the library's, for the first step).
        self.bucket = workspace.bucket(model, bucket_for(n, buckets), position)
        b = self.bucket.rows
        self._set_length(self.bucket, P)
        self.bucket.position.zero_()
        self.bucket.position.index_copy_(-2, torch.arange(n, device=position.device), position)
        padding = prompt_mask.new_ones(b, workspace.max_len)  # spare slots attend everything (no NaN)
        padding[:n, :P] = prompt_mask[index]
        mask = self._first_mask(padding)
        if (
            self.bucket.mask is None
            or self.bucket.mask.shape != mask.shape
            or self.bucket.mask.dtype != mask.dtype
        ):
            self.bucket.mask = mask  # (a bucket's first batch; its graph, if any, is captured after this)
        else:
            self.bucket.mask.copy_(mask)  # the tensor a captured graph reads

    # -- the mask ------------------------------------------------------------------------------

    def _first_mask(self, padding: torch.Tensor) -> torch.Tensor:
        """The 4-D mask of the first decode step (query at position P), as the model's own mask
        function builds it for this cache: padding [b, L] and causality. Later steps open one
        more column each (`_open`)."""
        from transformers.masking_utils import create_causal_mask

        b = padding.shape[0]
        config = _text_config(self.model)
        dtype = _base(self.model).get_input_embeddings().weight.dtype  # the hidden states' (float masks)
        embeds = torch.zeros(b, 1, 1, dtype=dtype, device=padding.device)
        mask = create_causal_mask(
            config=config,
            inputs_embeds=embeds,
            attention_mask=padding,
            cache=self.bucket.cache,
            position_ids=None,
        )
        if not isinstance(mask, torch.Tensor) or mask.shape != (b, 1, 1, self.ws.max_len):
            raise RuntimeError(f"unexpected decode mask from transformers: {type(mask).__name__}")
        return mask.contiguous()

    def _open(self, column: int) -> None:
        """Let every row attend to `column` (the position the next token is written at): copy
        the value of the prompt's last column, which every row attends to (bool True, or 0.0)."""
        mask = self.bucket.mask
        mask[..., column].copy_(mask[..., self.prompt_len - 1])

    def _set_length(self, bucket: _Bucket, length: int) -> None:
        for layer in bucket.cache.layers:
            layer.cumulative_length.fill_(length)

    # -- the step ------------------------------------------------------------------------------

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        """The model's forward on the bucket's fixed tensors; logits [b, V]. Captured, with
        autocast's cast cache off: a cast cached before the capture would be freed at the end
        of the batch while later replays still read it."""
        device_type = self.ws.device.type
        if self.capture is not None and torch.is_autocast_enabled(device_type):
            no_cache = torch.autocast(
                device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False
            )
        else:
            no_cache = contextlib.nullcontext()
        with no_cache:
            return self._model_step(bucket)

    def _model_step(self, bucket: _Bucket) -> torch.Tensor:
        out = self.model(
            input_ids=bucket.ids,
            attention_mask={"full_attention": bucket.mask},
            position_ids=bucket.position,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: bucket.cache},
        )
        return out.logits[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        bucket, n = self.bucket, tokens.shape[0]
        if self.t > 0:
            self._open(self.prompt_len + self.t)
        bucket.ids[:n, 0] = tokens
        if self.capture is not None and bucket.replay is None:
            try:
                self._capture(bucket)
            except RuntimeError as exc:  # e.g. a host sync in the model's code, which a graph cannot hold
                log.warning(
                    "rollout.decode=captured: capturing the decode step failed (%s); this engine decodes "
                    "uncaptured (static) from now on",
                    exc,
                )
                self.capture, self.capture_failed = None, str(exc)
        if self.capture is None:
            logits = self._forward(bucket)
        else:
            bucket.replay()
            logits = bucket.logits
        bucket.position.add_(1)
        self.t += 1
        return logits[:n]

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up (the allocator, cuBLAS), then capture. The warm-up runs the real step; its
        writes (the key/value at the current position, the cache length) are undone, and the
        replay that follows redoes them."""
        lengths = [layer.cumulative_length.clone() for layer in bucket.cache.layers]
        side = torch.cuda.Stream(self.ws.device) if self.ws.device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(self.ws.device))
            for _ in range(2):
                self._forward(bucket)
                for layer, length in zip(bucket.cache.layers, lengths):
                    layer.cumulative_length.copy_(length)
        if side is not None:
            torch.cuda.current_stream(self.ws.device).wait_stream(side)

        def reads() -> list[torch.Tensor]:  # what the step reads, as of now
            tensors = [bucket.ids, bucket.position, bucket.mask, *self.ws.keys, *self.ws.values]
            tensors += [layer.keys for layer in bucket.cache.layers] + [
                layer.values for layer in bucket.cache.layers
            ]
            return (
                tensors
                + [layer.cumulative_length for layer in bucket.cache.layers]
                + list(self.model.parameters())
            )

        try:
            bucket.replay, bucket.logits = self.capture(
                lambda: self._forward(bucket), self.ws.device, self.ws.pool, reads
            )
        finally:
            for layer, length in zip(bucket.cache.layers, lengths):  # (a capture records; a stand-in runs)
                layer.cumulative_length.copy_(length)
        log.info("decode step captured for %d rows (cache length %d)", bucket.rows, self.ws.max_len)

    def kv(self, slots: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """As `EagerSteps.kv`; copies out of the buffers, which the next batch reuses (columns
        past the current step hold stale values)."""
        end = self.prompt_len + self.t
        layers = [(k[:, :, :end].index_select(0, slots), v[:, :, :end].index_select(0, slots))
                  for k, v in zip(self.ws.keys, self.ws.values)]  # fmt: skip
        return layers, torch.arange(slots.shape[0], device=slots.device)

    # -- compaction ----------------------------------------------------------------------------

    def wants(self, running: int) -> bool:
        """Whether `running` rows fit a smaller bucket than the current one."""
        return bucket_for(running, self.buckets) < self.bucket.rows

    def keep(self, slots: torch.Tensor) -> None:
        """Gather the rows in `slots` to the front of the buffers and move to the smallest
        bucket that holds them (the current step's position and length carry over)."""
        k = slots.shape[0]
        old = self.bucket
        for keys, values in zip(self.ws.keys, self.ws.values):
            keys[:k] = keys.index_select(0, slots)
            values[:k] = values.index_select(0, slots)
        new = self.ws.bucket(self.model, bucket_for(k, self.buckets), old.position)
        if new.mask is None or new.mask.shape[-1] != old.mask.shape[-1]:
            new.mask = old.mask.new_empty(new.rows, *old.mask.shape[1:])
        new.mask[:k] = old.mask.index_select(0, slots)
        new.mask[k:] = old.mask[:1].expand_as(new.mask[k:])  # spare slots: any valid pattern
        new.position[..., :k, :] = old.position.index_select(-2, slots)
        for mine, theirs in zip(new.cache.layers, old.cache.layers):
            mine.cumulative_length.copy_(theirs.cumulative_length)
        self.bucket = new
