"""The default rollout engine: Hugging Face models sampled on the trainer's own module.

It shares the policy module with the trainer, so `load_weights` has nothing to copy; it exists
so that engines that hold their own copy (vLLM) fit the same interface.

The G responses of a prompt share the prompt, which is most of the sequence (a 64x64 image and
its question are ~160 tokens; a response ~10). On models whose positions the trainer lays out
itself (`mmrl.models.families.shares_prompts`), each distinct prompt is prefilled once,
its key/value cache indexed out to its G rows, and the responses are decoded by a plain sampling
loop over the tempered, blocked softmax (the distribution whose log-probs are recorded). Other
models, and single-response calls (greedy evaluation), go through Hugging Face `generate`.

The decode steps of that loop (`mmrl.rollout.decode`, `rollout.decode`) run eagerly over the
prefill's dynamic cache (the CPU default) or over a static cache of fixed shapes, captured once
per batch-size bucket as a CUDA graph and replayed (the CUDA default); rows that have finished
are compacted out of the running batch. With LoRA, the adapters can be merged into the weights
for the rollout (`rollout.lora_merge`, `mmrl.models.adapters.MergedAdapters`) and the weights
restored exactly afterwards; the trainer scores with the adapters unmerged, and the difference
shows in the `rollout/` mismatch metrics.

Multi-turn trajectories (`mmrl.rollout.multiturn`) take the same path on those models: the first
turn through the shared-prompt sampler, each later turn (`continue_rows`) a prefill then the same
decode loop. What a call keeps between its turns (`turn_cache()`, a `TurnCache`): each row's
key/value cache over the tokens it has seen, so a continuation prefills only its observation
(the tool messages and their images), and each image's processor output, so every image goes
through the image processor once. Positions are the model's own layout (M-RoPE over the images)
continued from the kept ones, +1 per decoded token; the trainer's full forward gives the same.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, ProcessorMixin
from transformers.generation.streamers import BaseStreamer

from mmrl.algos.logprobs import masked_logits, token_logprobs
from mmrl.config import RolloutConfig
from mmrl.models.adapters import MergedAdapters, resolve_lora_merge
from mmrl.models.families import mm_token_types, vision_layout
from mmrl.models.loading import Policy
from mmrl.models.precision import model_device
from mmrl.rollout import decode as dec
from mmrl.types import RolloutBatch, Sample, Trajectory


@dataclass
class SamplingParams:
    """How responses are sampled."""

    n: int = 1
    """Responses per prompt (G)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are those of the temperature-scaled distribution."""
    max_new_tokens: int = 16
    """Length limit of a response, stop token included."""
    greedy: bool = False
    """Argmax decoding (evaluation); no log-probs are recorded."""


class _BlockTokens(LogitsProcessor):
    """Sets blocked ids to -inf before sampling (the same mask the trainer applies)."""

    def __init__(self, blocked: torch.Tensor):
        self.blocked = blocked

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(self.blocked[: scores.shape[-1]], float("-inf"))


class _RecordLogprobs(LogitsProcessor):
    """Records log p(sampled token) under the tempered, blocked softmax of the raw logits, one
    step behind: each call sees, as the last input id, the token sampled from the previous
    call's scores. Only one step's [N, V] log-softmax is alive at a time (`output_logits` would
    keep every step's: [N, R, V])."""

    def __init__(self, blocked: torch.Tensor, temperature: float):
        self.blocked = blocked
        self.temperature = temperature
        self.previous: torch.Tensor | None = None
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.take(input_ids[:, -1])
        logits = masked_logits(scores, self.blocked[: scores.shape[-1]], self.temperature)
        self.previous = torch.log_softmax(logits, dim=-1)
        return scores

    def take(self, tokens: torch.Tensor) -> None:
        """Record the log-prob of `tokens` [N] under the last scores seen (if any)."""
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(-1, tokens[:, None]).squeeze(-1))
            self.previous = None


# Checkpoints ship sampling defaults (Qwen2.5-VL-Instruct: top_k=1, top_p=0.001,
# repetition_penalty=1.05) that `generate` would apply; the rollout must sample from the plain
# tempered softmax whose log-probs it records, so each of these is explicitly switched off.
_SAMPLING_SHAPERS = (
    "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress_tokens",
    "begin_suppress_tokens", "min_length", "min_new_tokens", "exponential_decay_length_penalty",
    "forced_bos_token_id", "forced_eos_token_id", "renormalize_logits", "watermarking_config",
)  # fmt: skip


class HFRolloutEngine:
    """Generates G responses per prompt with `model.generate`, recording per-token log-probs.

    Runs on the policy's device, in its precision (`Policy.autocast`); returns batches on that
    device. `decode` and `lora_merge` are `rollout.decode` and `rollout.lora_merge`."""

    def __init__(
        self,
        model: PreTrainedModel,
        processor: ProcessorMixin,
        blocked: torch.Tensor,
        stop_token_ids: list[int],
        pad_token_id: int,
        max_batch_rows: int = 256,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        decode: str = "eager",
        lora_merge: str = "unmerged",
    ):
        self.model = model
        self.processor = processor
        self.blocked = blocked
        self.stop_token_ids = stop_token_ids
        self.pad_token_id = pad_token_id
        self.max_batch_rows = max_batch_rows
        self.autocast = autocast
        self.decode = decode
        self.lora_merge = lora_merge
        dec.resolve_decode(decode, self.device)  # (validates the setting)
        resolve_lora_merge(lora_merge, self.device)  # (validates the setting)
        self.capture = dec.cuda_graph_capture
        """How the captured form captures a step (a stand-in replaces it in CPU tests)."""
        self._workspace: dec.DecodeWorkspace | None = None
        self._cast: dec.CastWeights | None = None
        self._fingerprint: tuple[int, ...] = ()
        self._merged = MergedAdapters(model)
        self._metrics: dict[str, float] = {}
        self._decode_stats = {"calls": 0, "seconds": 0.0, "kv_bytes": 0.0}

    @classmethod
    def from_policy(
        cls, policy: Policy, max_batch_rows: int | None = None, rollout: RolloutConfig | None = None
    ) -> HFRolloutEngine:
        """An engine on the policy's own module; `rollout` (default: the config's defaults) gives
        `max_batch_rows` (unless passed), `decode` and `lora_merge`."""
        r = rollout if rollout is not None else RolloutConfig()
        return cls(
            policy.model,
            policy.processor,
            policy.blocked,
            policy.stop_token_ids,
            policy.pad_token_id,
            max_batch_rows=max_batch_rows or r.max_batch_rows,
            autocast=policy.autocast,
            decode=r.decode,
            lora_merge=r.lora_merge,
        )

    @property
    def device(self) -> torch.device:
        """Where the model is now (a judge model may be moved between devices)."""
        return model_device(self.model)

    # The engine shares the trainer's module: nothing to sync. (`load_state_dict` copies in
    # place, so a captured decode step stays valid.)
    def load_weights(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        if state_dict is not None:
            self.model.load_state_dict(state_dict, strict=False)

    def sleep(self) -> None:
        """Free what the static decode step keeps between batches (its cache buffers, graphs
        and weight copies); the next batch rebuilds them."""
        self._workspace, self._cast, self._fingerprint = None, None, ()

    def wake(self) -> None:
        pass

    def rollout_metrics(self) -> dict[str, float]:
        """Facts about the last `generate` for the step's metrics: `rollout/lora_merged` (1: sampled
        with the adapters merged into the weights, so the `rollout/` mismatch metrics include
        the merge's rounding), `rollout/decode_captured` (1: captured static steps),
        `rollout/compactions` (times finished rows were compacted out), and for the decode loop
        (shared-prompt sampling) `time/decode_step_ms` (wall time per decode step, sampling
        included) and `rollout/decode_kv_mb` (the live key/value cache a step attends to, mean:
        running rows x their positions; with `decode_step_ms`, what the memory bound is taken of)."""
        out = dict(self._metrics)
        stats = self._decode_stats
        if stats["calls"]:
            out["time/decode_step_ms"] = 1000 * stats["seconds"] / stats["calls"]
            out["rollout/decode_kv_mb"] = stats["kv_bytes"] / stats["calls"] / 2**20
        return out

    @torch.no_grad()
    def generate(
        self,
        samples: list[Sample],
        params: SamplingParams,
        on_response: Callable[[int, str], None] | None = None,
        turns: TurnCache | None = None,
    ) -> RolloutBatch:
        """G = params.n responses per sample; rows are prompt-major ([B x G]).

        `on_response(row, text)` is called for each response the moment it is finished (its
        stop token sampled, or at the end for truncated ones), while the other rows are still
        being generated: the trainer starts scoring it right away.

        `turns` (a multi-turn call's `turn_cache()`): each row's key/value cache is kept in it
        (by row) for its next turn, where the shared-prompt sampler runs.
        """
        from mmrl.models.families import shares_prompts

        if self.blocked.device != self.device:  # the token mask follows the model
            self.blocked = self.blocked.to(self.device)
        # (A multi-turn call's first turn samples here too, its cache kept for the next turn.)
        shared = (params.n > 1 or (turns is not None and turns.keep_kv)) and shares_prompts(self.model)
        # Chunks of whole groups when prompts are shared, else of rows.
        units = samples if shared else [s for s in samples for _ in range(params.n)]
        per_unit = params.n if shared else 1
        step = max(1, self.max_batch_rows // per_unit)
        merge = resolve_lora_merge(self.lora_merge, self.device) and self._merged.applies
        self._metrics = {"rollout/lora_merged": float(merge), "rollout/compactions": 0.0}
        self._decode_stats = {"calls": 0, "seconds": 0.0, "kv_bytes": 0.0}
        chunks = []
        with self._merged.merged() if merge else contextlib.nullcontext():
            for start in range(0, len(units), step):
                streamer = None
                if on_response is not None:
                    streamer = _FinishedRows(
                        self.processor.tokenizer,
                        self.stop_token_ids,
                        lambda i, t, o=start * per_unit: on_response(o + i, t),
                    )
                part = units[start : start + step]
                with self.autocast():
                    if shared:
                        chunks.append(self._sample_shared(part, params, streamer, turns, start * per_unit))
                    else:
                        chunks.append(self._generate_rows(part, params, streamer))
        batch = chunks[0] if len(chunks) == 1 else concat_rollouts(chunks, self.pad_token_id)
        batch.group_size = params.n
        return batch

    def _generate_rows(
        self, rows: list[Sample], params: SamplingParams, streamer: BaseStreamer | None = None
    ) -> RolloutBatch:
        inputs = encode_prompts(self.processor, rows, self.device)
        response, response_mask, logprobs, truncated = self._generate_inputs(inputs, params, streamer)
        texts = self.processor.batch_decode(response, skip_special_tokens=True)
        vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        images_per_row = [len(s.images) for s in rows]
        return RolloutBatch(
            samples=rows,
            prompt_ids=inputs["input_ids"],
            prompt_mask=inputs["attention_mask"],
            response_ids=response,
            response_mask=response_mask,
            rollout_logprobs=logprobs,
            vision_inputs=vision,
            texts=texts,
            truncated=truncated,
            images_per_row=images_per_row,
            vision_layout=vision_layout(self.processor, inputs, images_per_row),
        )

    def _generate_inputs(
        self, inputs: dict[str, torch.Tensor], params: SamplingParams, streamer: BaseStreamer | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One `generate` over encoded, left-padded `inputs`: the response ids [N, R] (padding
        after the stop token), their mask, their log-probs (0 when greedy or masked) and
        whether each row was truncated [N]."""
        record = _RecordLogprobs(self.blocked, params.temperature)
        processors = [_BlockTokens(self.blocked)] + ([] if params.greedy else [record])
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                **inputs,
                do_sample=not params.greedy,
                temperature=params.temperature if not params.greedy else None,
                **dict.fromkeys(_SAMPLING_SHAPERS),  # see _SAMPLING_SHAPERS
                max_new_tokens=params.max_new_tokens,
                logits_processor=LogitsProcessorList(processors),
                eos_token_id=self.stop_token_ids,
                pad_token_id=self.pad_token_id,
                return_dict_in_generate=True,
                streamer=streamer,
            )
        finally:
            self.model.train(was_training)
        prompt_len = inputs["input_ids"].shape[1]
        response = out.sequences[:, prompt_len:]
        response_mask, truncated = response_mask_from_stops(response, self.stop_token_ids)
        if params.greedy:
            logprobs = torch.zeros(response.shape, dtype=torch.float32, device=response.device)
        else:
            record.take(response[:, -1])  # the last sampled token
            logprobs = torch.stack(record.logprobs, dim=1).masked_fill(response_mask == 0, 0.0)
        response = response.masked_fill(response_mask == 0, self.pad_token_id)
        return response, response_mask, logprobs, truncated

    def turn_cache(self) -> TurnCache:
        """What a multi-turn call (`mmrl.rollout.multiturn`) keeps between its turns: passed to
        `generate` (the first turn) and every `continue_rows`. Keys and values are kept on models
        whose decode loop runs here (`shares_prompts`) and whose layers all attend to the whole
        sequence (a sliding window's cache does not hold it)."""
        from mmrl.models.families import shares_prompts

        return TurnCache(keep_kv=shares_prompts(self.model) and _full_attention(self.model))

    @torch.no_grad()
    def continue_rows(
        self,
        ids: list[list[int]],
        images: list[list],
        params: SamplingParams,
        turns: TurnCache | None = None,
        keys: Sequence[int] | None = None,
    ) -> list[tuple[list[int], list[float], bool]]:
        """The next turn of multi-turn trajectories (`mmrl.rollout.multiturn`): each row's whole
        sequence so far as token ids (token-in: prompt, model turns and observations exactly
        as the model saw them, image tokens expanded) and every image it holds, in order; one
        response per row. Returns per row the new token ids (stop token included), their
        log-probs (0 when greedy), and whether the turn hit `params.max_new_tokens` without a
        stop token.

        On models whose positions mmrl lays out (`shares_prompts`) the turn is a prefill then the
        engine's own decode loop (`_decode`, as the shared-prompt sampler): positions are the
        model's own layout over the whole sequence (M-RoPE over every image), then +1 per decoded
        token. With `turns` (the call's `turn_cache()`) and `keys` (each row's trajectory row),
        a row whose key/value cache was kept from its last turn prefills only the tokens after
        it (the observation and its images), and each image goes through the image processor
        once per call. Otherwise the whole sequence is prefilled, through `generate` on other
        models."""
        from mmrl.models.families import shares_prompts

        if self.blocked.device != self.device:
            self.blocked = self.blocked.to(self.device)
        out: list[tuple[list[int], list[float], bool]] = []
        step = max(1, self.max_batch_rows)
        own_loop = shares_prompts(self.model)
        merge = resolve_lora_merge(self.lora_merge, self.device) and self._merged.applies
        image_cache = turns.images if turns is not None else None
        with self._merged.merged() if merge else contextlib.nullcontext():
            for start in range(0, len(ids), step):
                part_ids, part_images = ids[start : start + step], images[start : start + step]
                part_keys = list(keys[start : start + step]) if keys is not None else None
                with self.autocast():
                    if own_loop:
                        response, mask, logprobs, truncated = self._continue_shared(
                            part_ids, part_images, params, turns, part_keys
                        )
                    else:
                        inputs = token_inputs(
                            self.processor, part_ids, part_images, self.pad_token_id, self.device, image_cache
                        )
                        response, mask, logprobs, truncated = self._generate_inputs(inputs, params)
                for r in range(response.shape[0]):
                    keep = mask[r].bool()
                    out.append((response[r][keep].tolist(), logprobs[r][keep].tolist(), bool(truncated[r])))
        return out

    def _continue_shared(
        self,
        ids: list[list[int]],
        images: list[list],
        params: SamplingParams,
        turns: TurnCache | None,
        keys: list[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One turn of rows given as token ids: a prefill of what each row's kept cache does not
        hold (everything, without one), then the decode loop. Returns the response ids [N, R]
        (padding after the stop token), their mask, log-probs and truncated [N]."""
        from mmrl.train.forward import cache_argument, output_cache

        model = self.model
        kept: list[_KeptRow | None] = [None] * len(ids)
        if turns is not None and keys is not None:
            for r, key in enumerate(keys):
                entry = turns.rows.pop(key, None)  # (taken: the turn keeps a new one)
                if (
                    entry is not None
                    and len(entry.ids) < len(ids[r])
                    and entry.images <= len(images[r])
                    and ids[r][: len(entry.ids)] == entry.ids
                ):
                    kept[r] = entry
        inputs, past = continuation_inputs(
            self.processor, model, ids, images, kept, self.pad_token_id, self.device,
            turns.images if turns is not None else None,
        )  # fmt: skip
        mask, positions = inputs.pop("attention_mask"), inputs.pop("position_ids")
        form = self._decode_form()
        was_training = model.training
        model.eval()
        try:
            with self._weights_for(form):
                extra = {} if past is None else {cache_argument(model): past}
                out = model(
                    **inputs, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                    **extra,
                )  # fmt: skip
                del past, extra
                logits = out.logits[:, -1]  # [N, V]
                next_position = positions[..., -1:] + 1  # [N, 1]: text continues by 1
                cache = output_cache(out)
                per_position = kv_bytes_per_position(cache)
                index = torch.arange(len(ids), device=mask.device)
                steps = self._decode_steps(form, cache, index, mask, next_position, params.max_new_tokens)
                del out, cache
                keep = None
                if turns is not None and turns.keep_kv and keys is not None:
                    keep = self._keeper(
                        turns, keys, [list(row) for row in ids], [len(x) for x in images], mask, next_position
                    )
                response, logprobs = self._decode(
                    steps, logits, params, None, mask.shape[1], per_position, keep
                )
                if getattr(steps, "capture_failed", None):
                    self.decode = "static"
                    self._metrics["rollout/decode_captured"] = 0.0
        finally:
            model.train(was_training)
        response_mask, truncated = response_mask_from_stops(response, self.stop_token_ids)
        logprobs = logprobs.masked_fill(response_mask == 0, 0.0)
        return response.masked_fill(response_mask == 0, self.pad_token_id), response_mask, logprobs, truncated

    def _keeper(
        self,
        turns: TurnCache,
        keys: Sequence[int],
        prefixes: list[list[int]],
        images: list[int],
        prefill_mask: torch.Tensor,
        next_position: torch.Tensor,
    ) -> Callable:
        """What `_decode` calls for rows leaving the running batch (compacted out, or at the end):
        each row's keys and values over its real tokens (the prefill's unpadded columns, then
        the decoded tokens fed up to its stop token) go into `turns`, by `keys[row]`, with
        those tokens' ids (`prefixes[row]` and the fed ones) and the images they hold."""
        stop = set(self.stop_token_ids)
        P = prefill_mask.shape[1]
        columns = [m.nonzero().squeeze(1) for m in prefill_mask.bool()]
        first = next_position[..., 0].cpu()  # [N] or [3, N]: the first decoded token's position

        def keep(steps, rows: torch.Tensor, slots: torch.Tensor, fed: int, response: torch.Tensor) -> None:
            if rows.numel() == 0:
                return
            layers, at = steps.kv(slots)
            tokens = response[rows, :fed].tolist()
            for j, (r, row) in enumerate(zip(rows.tolist(), at.tolist())):
                n = next((i + 1 for i, t in enumerate(tokens[j]) if t in stop), fed)
                turns.rows[keys[r]] = _KeptRow(
                    ids=prefixes[r] + tokens[j][:n],
                    images=images[r],
                    layers=layers,
                    row=row,
                    columns=torch.cat([columns[r], torch.arange(P, P + n, device=columns[r].device)]),
                    last_position=(first[..., r] + n - 1).tolist(),
                )

        return keep

    def _sample_shared(
        self,
        samples: list[Sample],
        params: SamplingParams,
        streamer: BaseStreamer | None = None,
        turns: TurnCache | None = None,
        offset: int = 0,
    ) -> RolloutBatch:
        """G = params.n responses per sample, each prompt prefilled once (see the module docs).

        Decoding feeds one token per running row per step (`mmrl.rollout.decode`); rows that
        have sampled a stop token are fed padding (masked out afterwards), as `generate` does,
        until they are compacted out.
        """
        from mmrl.models.families import family_of
        from mmrl.train.batching import select_rows
        from mmrl.train.forward import output_cache

        G, model = params.n, self.model
        inputs = encode_prompts(self.processor, samples, self.device)
        prompts = prompt_batch(samples, inputs, self.processor)
        rows = [i for i in range(len(samples)) for _ in range(G)]
        index = torch.tensor(rows, dtype=torch.long, device=inputs["input_ids"].device)
        positions = family_of(model).position_ids(model, inputs)  # [B, P] ([3, B, P] for mrope)
        form = self._decode_form()
        was_training = model.training
        model.eval()
        try:
            with self._weights_for(form):
                out = model(**inputs, position_ids=positions, use_cache=True, logits_to_keep=1)
                logits = out.logits[:, -1][index]  # [N, V]
                next_position = positions[..., -1:].index_select(-2, index) + 1  # [N, 1]: text continues by 1
                if streamer is not None:
                    streamer.put(inputs["input_ids"][index].cpu())
                cache = output_cache(out)
                per_position = kv_bytes_per_position(cache)
                steps = self._decode_steps(form, cache, index, inputs["attention_mask"], next_position,
                                           params.max_new_tokens)  # fmt: skip
                del out, cache
                keep = None
                if turns is not None and turns.keep_kv:
                    mask = inputs["attention_mask"]
                    prompt_ids = [row[m.bool()].tolist() for row, m in zip(inputs["input_ids"], mask)]
                    keep = self._keeper(
                        turns, [offset + r for r in range(len(rows))], [prompt_ids[i] for i in rows],
                        [len(samples[i].images) for i in rows], mask[index], next_position,
                    )  # fmt: skip
                response, logprobs = self._decode(
                    steps, logits, params, streamer, positions.shape[-1], per_position, keep
                )
                if getattr(steps, "capture_failed", None):  # said once, as a warning; not tried again
                    self.decode = "static"
                    self._metrics["rollout/decode_captured"] = 0.0
            if streamer is not None:
                streamer.end()
        finally:
            model.train(was_training)
        batch = select_rows(prompts, rows)
        response_mask, truncated = response_mask_from_stops(response, self.stop_token_ids)
        batch.response_ids = response.masked_fill(response_mask == 0, self.pad_token_id)
        batch.response_mask = response_mask
        batch.truncated = truncated
        batch.rollout_logprobs = logprobs.masked_fill(response_mask == 0, 0.0)
        batch.texts = self.processor.batch_decode(batch.response_ids, skip_special_tokens=True)
        return batch

    def _decode(
        self,
        steps,
        logits: torch.Tensor,
        params: SamplingParams,
        streamer: BaseStreamer | None,
        prompt_len: int,
        kv_per_position: int,
        keep: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling loop: response ids [N, R] and their log-probs [N, R] (0 when greedy), R
        the steps run. `steps` holds the running rows' slots; `running[slot]` is the slot's row.
        `keep(steps, rows, slots, fed, response)` (`_keeper`), if given, is called for rows
        about to leave the running batch (compacted out, or at the end) while their cache is
        still there: `fed` steps have fed `response[:, :fed]`.

        The noise of the exponential race is drawn for all N rows at every step, so that what a
        row samples does not depend on which rows are still running (or on the decode form)."""
        N, V = logits.shape
        device = logits.device
        blocked = self.blocked[:V]
        temperature = 1.0 if params.greedy else params.temperature
        stop = torch.tensor(self.stop_token_ids, device=device)
        R = params.max_new_tokens
        response = torch.full((N, R), self.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((N, R), dtype=torch.float32, device=device)
        finished = torch.zeros(N, dtype=torch.bool, device=device)
        running = torch.arange(N, device=device)
        steps_run, calls, kv_positions, start = R, 0, 0, time.perf_counter()
        for t in range(R):
            scores = masked_logits(logits, blocked, temperature)  # [n, V]
            if params.greedy:
                token = scores.argmax(dim=-1)
            else:
                noise = torch.empty((N, V), dtype=torch.float32, device=device).exponential_()
                token = dec.exponential_race(torch.softmax(scores, dim=-1), noise[running])
                logprobs[running, t] = token_logprobs(scores, token)
            token = token.masked_fill(finished[running], self.pad_token_id)
            response[running, t] = token
            if streamer is not None:
                streamer.put(response[:, t].cpu())
            finished[running] |= torch.isin(token, stop)
            alive = ~finished[running]
            live = int(alive.sum())
            if live == 0 or t == R - 1:
                steps_run = t + 1
                if keep is not None:
                    keep(steps, running, torch.arange(running.shape[0], device=device), t, response)
                break
            if steps.wants(live):
                slots = alive.nonzero().squeeze(1)
                if keep is not None:
                    gone = (~alive).nonzero().squeeze(1)
                    keep(steps, running[gone], gone, t, response)
                steps.keep(slots)
                running, token = running[slots], token[slots]
                self._metrics["rollout/compactions"] = self._metrics.get("rollout/compactions", 0.0) + 1
            logits = steps.step(token)
            calls += 1
            kv_positions += live * (prompt_len + t + 1)  # the running rows attend to so many positions
        stats = self._decode_stats
        stats["calls"] += calls
        stats["seconds"] += time.perf_counter() - start  # (the loop waits for the device every step)
        stats["kv_bytes"] += kv_positions * kv_per_position
        return response[:, :steps_run], logprobs[:, :steps_run]

    # -- decode forms (mmrl.rollout.decode) -------------------------------------------------------

    def _decode_form(self) -> str:
        """`eager`, `static` or `captured` for this batch (`rollout.decode` on the model's
        device; a model the static step does not fit runs eagerly, said once)."""
        form = dec.resolve_decode(self.decode, self.device)
        if form == "captured" and self.device.type != "cuda" and self.capture is dec.cuda_graph_capture:
            raise ValueError(f"rollout.decode=captured needs a CUDA device; the policy is on {self.device}")
        if form != "eager":
            why = dec.static_unsupported(self.model)
            if why is not None:
                dec._say_once(f"rollout.decode={self.decode}: decoding eagerly instead, {why}")
                return "eager"
        self._metrics["rollout/decode_captured"] = float(form == "captured")
        return form

    @contextlib.contextmanager
    def _weights_for(self, form: str):
        """The captured form needs fixed weight addresses: drop what was captured if the weights
        moved, and under autocast swap in persistent compute-dtype copies of float32 linear
        weights (`decode.CastWeights`) for the batch."""
        if form != "captured":
            yield
            return
        fingerprint = dec.weights_fingerprint(self.model)
        if fingerprint != self._fingerprint:
            self.sleep()
            self._fingerprint = fingerprint
        device_type = self.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            if self._cast is None or self._cast.dtype != dtype:
                self._cast = dec.CastWeights(self.model, dtype)
            with self._cast.swapped():
                yield
        else:
            yield

    def _decode_steps(
        self,
        form: str,
        cache,
        index: torch.Tensor,
        prompt_mask: torch.Tensor,
        position: torch.Tensor,
        max_new_tokens: int,
    ):
        """The decode steps of the chosen form for the N = len(index) rows."""
        buckets = dec.decode_buckets(max(self.max_batch_rows, index.shape[0]))
        if form == "eager":
            identity = index.shape[0] == prompt_mask.shape[0] and bool(
                (index == torch.arange(index.shape[0], device=index.device)).all()
            )
            dec.grow_in_place(cache, max_new_tokens, None if identity else index)  # [B] -> [B x G] rows
            return dec.EagerSteps(self.model, cache, prompt_mask[index], position, buckets)
        length = prompt_mask.shape[1] + max_new_tokens
        rows = dec.bucket_for(index.shape[0], buckets)
        ws = self._workspace
        if ws is None or not ws.fits(rows, length, cache, self.device):
            self._workspace = None  # (its buffers go before the new ones are allocated)
            length = -(-length // _CACHE_LENGTH_STEP) * _CACHE_LENGTH_STEP
            ws = dec.DecodeWorkspace.allocate(cache, rows, length, self.device)
            if form == "captured" and self.device.type == "cuda":
                ws.pool = torch.cuda.graph_pool_handle()
            self._workspace = ws
        capture = self.capture if form == "captured" else None
        return dec.StaticSteps(self.model, ws, cache, index, prompt_mask, position, buckets, capture)


@dataclass
class _KeptRow:
    """A trajectory's key/value cache kept between its turns (`TurnCache`)."""

    ids: list[int]
    """The token ids it holds (a prefix of the row's sequence)."""
    images: int
    """The images among them (the row's first ones)."""
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer keys and values [rows, heads, columns, dim] that hold it (shared by the rows
    of a batch that left it together)..."""
    row: int
    """...in this row..."""
    columns: torch.Tensor
    """...at these columns, one per id."""
    last_position: int | list[int]
    """The position of its last token ([3] for M-RoPE). The tokens after it continue from it:
    a row's positions may be laid out with its left padding counted (text-only batches), which
    differs between turns; RoPE sees only differences within the row, so continuing from the
    kept positions keeps them right."""


class TurnCache:
    """What the HF engine keeps of one multi-turn call between its turns (`turn_cache()`): each
    image's processor output (`images`, an `ImageCache`: every image goes through the image
    processor once) and, with `keep_kv`, each trajectory's key/value cache over the tokens it
    has seen (`rows`, by the trajectory's row), so that its next turn prefills only the tokens
    after them. A row's entry is taken when its next turn starts and kept anew after it;
    `drop(row)` frees it once the trajectory ends. (The kept caches hold as much memory as the
    running batch's cache, between turns too.)"""

    def __init__(self, keep_kv: bool = True):
        self.images: ImageCache = {}
        self.rows: dict[int, _KeptRow] = {}
        self.keep_kv = keep_kv

    def drop(self, row: int) -> None:
        self.rows.pop(row, None)


def _full_attention(model: torch.nn.Module) -> bool:
    """Whether every layer of the model's decoder attends to the whole sequence."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config(decoder=True)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    return kinds == {"full_attention"} and not getattr(config, "use_sliding_window", False)


def continuation_inputs(
    processor: ProcessorMixin,
    model: torch.nn.Module,
    ids: list[list[int]],
    images: list[list],
    kept: Sequence[_KeptRow | None],
    pad_token_id: int,
    device: torch.device,
    image_cache: ImageCache | None = None,
) -> tuple[dict[str, torch.Tensor], object | None]:
    """A continuation's prefill: per row, the tokens after its kept cache (`kept[r]`, or all of
    them) and the images among them. Returns the model inputs (`input_ids` [N, C] left padded,
    `attention_mask` [N, K + C] over the kept columns and the new ones, `position_ids`: the
    model's own layout of the new tokens, continuing the kept cache's positions, which is its
    layout of the whole sequence sliced to them; the new
    images' `pixel_values` and `image_grid_thw`) and the kept caches as one dynamic cache of K
    columns, each row's right-aligned (None when no row has one)."""
    from transformers import DynamicCache

    from mmrl.models.families import family_of

    N = len(ids)
    held = [len(k.ids) if k is not None else 0 for k in kept]
    first_new = [k.images if k is not None else 0 for k in kept]
    K = max(held)
    new = [len(row) - h for row, h in zip(ids, held)]
    C = max(new)
    cache = image_cache if image_cache is not None else {}
    # Positions: the model's own layout over what each row prefills, preceded by the kept
    # cache's last token (a text token), then moved to continue from that token's kept position.
    # (The layout goes on from a text token the same way wherever it stands: text +1 per token,
    # an image from the position after it.) Grids of the images only; no pixels.
    laid = [row[h - 1 :] if h else row for row, h in zip(ids, held)]
    S = max(len(row) for row in laid)
    seqs = torch.full((N, S), pad_token_id, dtype=torch.long, device="cpu")
    seqs_mask = torch.zeros((N, S), dtype=torch.long, device="cpu")
    for r, row in enumerate(laid):
        seqs[r, S - len(row) :] = torch.tensor(row, dtype=torch.long, device="cpu")
        seqs_mask[r, S - len(row) :] = 1
    new_images = [row[i:] for row, i in zip(images, first_new)]
    _through_cache(processor, new_images, cache)
    grids = [[tuple(cache[id(image)][2][0].tolist()) for image in row] for row in new_images]
    types = mm_token_types(
        seqs, getattr(processor, "image_token_id", None), getattr(processor, "video_token_id", None)
    )
    # A row's layout depends only on its token types and its images' grids: it is computed
    # once per distinct (types, grids) and shared (the G rows of a group usually have one).
    distinct: dict[tuple, int] = {}
    which = [
        distinct.setdefault((tuple(t[S - len(row) :].tolist()), tuple(g)), r)
        for r, (t, row, g) in enumerate(zip(types, laid, grids))
    ]
    reps = sorted(set(which))
    slot = {r: i for i, r in enumerate(reps)}
    inverse = torch.tensor([slot[w] for w in which], device="cpu") if len(reps) < N else None
    position_inputs = {"input_ids": seqs[reps], "attention_mask": seqs_mask[reps]}
    if any(grids[r] for r in reps):
        position_inputs["image_grid_thw"] = torch.tensor(
            [g for r in reps for g in grids[r]], dtype=torch.long, device="cpu"
        )
        position_inputs["mm_token_type_ids"] = types[reps]
    positions = family_of(model).position_ids(model, position_inputs)  # [U, S] or [3, U, S]
    if inverse is not None:
        positions = positions.index_select(-2, inverse)
    chunk = torch.full((N, C), pad_token_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((N, K + C), dtype=torch.long, device="cpu")
    chunk_positions = positions.new_zeros((*positions.shape[:-1], C))
    for r in range(N):
        n = new[r]
        chunk[r, C - n :] = seqs[r, S - n :]
        mask[r, K - held[r] : K] = 1
        mask[r, K + C - n :] = 1
        chunk_positions[..., r, C - n :] = positions[..., r, S - n :]
        if held[r]:  # continue from the kept cache's own position (see `_KeptRow.last_position`)
            shift = torch.tensor(kept[r].last_position, device="cpu") - positions[..., r, S - n - 1]
            chunk_positions[..., r, C - n :] += shift[..., None]
    inputs = {"input_ids": chunk, "attention_mask": mask, "position_ids": chunk_positions}
    inputs.update(image_inputs(processor, new_images, cache, device))
    if "mm_token_type_ids" in getattr(processor, "model_input_names", ()):
        inputs["mm_token_type_ids"] = mm_token_types(
            chunk, getattr(processor, "image_token_id", None), getattr(processor, "video_token_id", None)
        )
    inputs = {k: v.to(device) for k, v in inputs.items()}
    if K == 0:
        return inputs, None
    # The kept caches, right-aligned in K columns: one gather per layer for the rows kept from
    # the same tensors. (A column left of a row's own is any of its columns: masked, but finite.)
    like = next(k for k in kept if k is not None).layers
    layers = [
        (k.new_zeros((N, k.shape[1], K, k.shape[3])), v.new_zeros((N, v.shape[1], K, v.shape[3])))
        for k, v in like
    ]
    groups: dict[int, list[int]] = {}
    for r, entry in enumerate(kept):
        if entry is not None:
            groups.setdefault(id(entry.layers), []).append(r)
    for members in groups.values():
        source = kept[members[0]].layers
        at = torch.tensor([kept[r].row for r in members], device=source[0][0].device)
        columns = torch.stack([_right_aligned(kept[r].columns, K) for r in members])  # [n, K]
        into = torch.tensor(members, device=layers[0][0].device)
        for (keys, values), (k, v) in zip(layers, source):
            keys[into] = k[at[:, None], :, columns].transpose(1, 2).to(keys.device)  # [n, heads, K, dim]
            values[into] = v[at[:, None], :, columns].transpose(1, 2).to(values.device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inputs, DynamicCache(ddp_cache_data=layers, config=base.config)


def _right_aligned(columns: torch.Tensor, width: int) -> torch.Tensor:
    """`columns` right-aligned in `width`, the first repeated on the left."""
    return torch.cat([columns[:1].expand(width - columns.shape[0]), columns])


_CACHE_LENGTH_STEP = 128
"""The static cache's length is the batch's prompt + response length rounded up to this, so
batches whose prompts differ a little reuse one workspace (and its captured graphs)."""


class _FinishedRows(BaseStreamer):
    """Receives each decoding step's tokens from `generate` and reports every row as soon as it
    samples a stop token (and the rest at the end, truncated)."""

    def __init__(self, tokenizer, stop_token_ids: list[int], on_finished: Callable[[int, str], None]):
        self.tokenizer = tokenizer
        self.stop = set(stop_token_ids)
        self.on_finished = on_finished
        self.tokens: list[list[int]] | None = None
        self.done: list[bool] = []
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:  # generate first streams the prompt ids
            self.seen_prompt = True
            return
        step = value.view(-1).tolist()
        if self.tokens is None:
            self.tokens = [[] for _ in step]
            self.done = [False] * len(step)
        for i, token in enumerate(step):
            if self.done[i]:
                continue
            self.tokens[i].append(token)
            if token in self.stop:
                self._finish(i)

    def end(self) -> None:
        for i in range(len(self.done)):
            if not self.done[i]:
                self._finish(i)

    def _finish(self, i: int) -> None:
        self.done[i] = True
        self.on_finished(i, self.tokenizer.decode(self.tokens[i], skip_special_tokens=True))


def kv_bytes_per_position(cache) -> int:
    """Bytes one row's key/value cache holds per position, over all layers."""
    return sum(
        layer.keys[0, :, 0].numel() * layer.keys.element_size()
        + layer.values[0, :, 0].numel() * layer.values.element_size()
        for layer in cache.layers
    )


def encode_prompts(
    processor: ProcessorMixin, rows: list[Sample], device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Chat template + images through the processor, left padded; on `device` if given. Images
    go in as one list per row (processors that lay images out per row need it)."""
    texts = [
        processor.apply_chat_template(
            s.chat_messages(), add_generation_prompt=True, tokenize=False, **tools_argument(s)
        )
        for s in rows
    ]
    images = [s.pil_images() for s in rows]
    processor.tokenizer.padding_side = "left"
    inputs = dict(
        processor(text=texts, images=images if any(images) else None, padding=True, return_tensors="pt")
    )
    if device is not None and device.type != "cpu":
        inputs = {k: v.to(device) for k, v in inputs.items()}
    return inputs


def tools_argument(sample: Sample) -> dict:
    """`{"tools": schemas}` for the chat template when the sample names tools (their JSON
    schemas, `mmrl.environments.tool_schemas`), else nothing: a template with a tool section
    lists them in its system preamble; one without ignores them."""
    if sample.agent is None or not sample.agent.tools:
        return {}
    from mmrl.environments import tool_schemas

    return {"tools": tool_schemas(sample.agent.tools)}


ImageCache = dict
"""Processor outputs of images, kept for one multi-turn call so each image goes through the image
processor once: `id(image) -> (image, its pixel_values rows, its image_grid_thw [1, 3])` (the
image itself is held, so its id is not reused while the cache lives)."""


def remember_images(cache: ImageCache, images: Sequence, outputs: Mapping[str, torch.Tensor]) -> None:
    """Keep each of `images`' rows of a processor output over exactly those images, in order
    (Qwen-VL's `pixel_values`: patches concatenated over the images, `image_grid_thw` per image)."""
    grid = outputs["image_grid_thw"]
    parts = torch.split(outputs["pixel_values"], grid.prod(dim=-1).tolist())
    for image, part, thw in zip(images, parts, grid):
        cache[id(image)] = (image, part, thw[None])


def image_inputs(
    processor: ProcessorMixin,
    images: list[list],
    cache: ImageCache | None = None,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """The processor's image inputs for rows that hold `images` (one list per row, in order),
    through its image processor once per row: Qwen-VL's `pixel_values` (patches of every image,
    concatenated over rows) and `image_grid_thw` (one row per image). Multi-turn trajectories,
    whose images sit inside their token ids, need a family that lays images out this way.

    With a `cache` (`ImageCache`), an image already in it is not processed again; the others
    go through the image processor once per row and are added. (The image processor treats
    each image on its own, so the result is the same, bit for bit.) Pieces from the cache are
    joined on `device` (default: where they are)."""
    flat = [image for row in images for image in row]
    if not flat:
        return {}
    if cache is None:
        outputs = [dict(processor.image_processor(images=row, return_tensors="pt")) for row in images if row]
        _check_grid(processor, outputs[0])
        return {key: torch.cat([o[key] for o in outputs]) for key in ("pixel_values", "image_grid_thw")}
    kept = _through_cache(processor, images, cache)
    device = device if device is not None else kept[0][1].device
    return {
        "pixel_values": torch.cat([k[1].to(device) for k in kept]),
        "image_grid_thw": torch.cat([k[2].to(device) for k in kept]),
    }


def _through_cache(processor: ProcessorMixin, images: list[list], cache: ImageCache) -> list[tuple]:
    """Every image's cache entry, in order; the images not in it go through the image processor
    first, once per row that holds any."""
    for row in images:
        todo = list({id(image): image for image in row if id(image) not in cache}.values())
        if todo:
            out = dict(processor.image_processor(images=todo, return_tensors="pt"))
            _check_grid(processor, out)
            remember_images(cache, todo, out)
    return [cache[id(image)] for row in images for image in row]


def _check_grid(processor: ProcessorMixin, outputs: Mapping[str, torch.Tensor]) -> None:
    if "image_grid_thw" not in outputs:
        raise ValueError(
            f"multi-turn trajectories with images need a Qwen-VL-style processor (image_grid_thw); "
            f"{type(processor).__name__} lays images out otherwise"
        )


def token_inputs(
    processor: ProcessorMixin,
    ids: list[list[int]],
    images: list[list],
    pad_token_id: int,
    device: torch.device | None = None,
    image_cache: ImageCache | None = None,
) -> dict[str, torch.Tensor]:
    """Model inputs for rows given as token ids (image tokens already expanded) and their images:
    ids left padded, and `image_inputs` of the images (through `image_cache` if given)."""
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), pad_token_id, dtype=torch.long, device="cpu")
    attention = torch.zeros((len(ids), width), dtype=torch.long, device="cpu")
    for r, row in enumerate(ids):
        input_ids[r, width - len(row) :] = torch.tensor(row, dtype=torch.long, device="cpu")
        attention[r, width - len(row) :] = 1
    vision = image_inputs(processor, images, image_cache, device or torch.device("cpu"))
    inputs = {"input_ids": input_ids, "attention_mask": attention, **vision}
    if "mm_token_type_ids" in getattr(processor, "model_input_names", ()):
        inputs["mm_token_type_ids"] = mm_token_types(
            input_ids, getattr(processor, "image_token_id", None), getattr(processor, "video_token_id", None)
        )
    if device is not None and device.type != "cpu":
        inputs = {k: v.to(device) for k, v in inputs.items()}
    return inputs


def prompt_batch(
    samples: Sequence[Sample], inputs: Mapping[str, torch.Tensor], processor: ProcessorMixin
) -> RolloutBatch:
    """One row per sample holding only its prompt (`processor`'s `inputs`), no response yet:
    what an engine indexes out to its G rows per prompt before filling in the responses."""
    images_per_row = [len(s.images) for s in samples]
    return RolloutBatch(
        samples=list(samples),
        prompt_ids=inputs["input_ids"],
        prompt_mask=inputs["attention_mask"],
        response_ids=inputs["input_ids"][:, :0],
        response_mask=inputs["attention_mask"][:, :0],
        rollout_logprobs=torch.zeros(len(samples), 0, device=inputs["input_ids"].device),
        vision_inputs={k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")},
        texts=[""] * len(samples),
        truncated=torch.zeros(len(samples), dtype=torch.bool, device=inputs["input_ids"].device),
        images_per_row=images_per_row,
        vision_layout=vision_layout(processor, dict(inputs), images_per_row),
    )


def response_mask_from_stops(
    response: torch.Tensor, stop_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask [N, R] of tokens up to and including the first stop token; truncated [N] where none."""
    is_stop = torch.zeros_like(response, dtype=torch.bool)
    for sid in stop_ids:
        is_stop |= response == sid
    # Tokens after the first stop: cumulative count of stops before this position > 0.
    stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    mask = (stops_before == 0).long()
    truncated = ~is_stop.any(dim=1)
    return mask, truncated


def concat_rollouts(chunks: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Join rollout chunks, re-padding prompts (left) and responses (right) to common widths."""
    from mmrl.train.batching import concat_vision_inputs, pad_left, pad_right

    P = max(c.prompt_ids.shape[1] for c in chunks)
    R = max(c.response_ids.shape[1] for c in chunks)
    multi = [c for c in chunks if c.observation_mask is not None]
    observation = None
    if multi:  # single-turn chunks have no observation tokens
        observation = torch.cat(
            [
                pad_right(
                    c.observation_mask
                    if c.observation_mask is not None
                    else torch.zeros_like(c.response_mask),
                    R,
                    0,
                )
                for c in chunks
            ]
        )
    vision, layout = concat_vision_inputs(
        [c.vision_inputs for c in chunks], [c.vision_layout for c in chunks], P
    )
    return RolloutBatch(
        samples=[s for c in chunks for s in c.samples],
        prompt_ids=torch.cat([pad_left(c.prompt_ids, P, pad_token_id) for c in chunks]),
        prompt_mask=torch.cat([pad_left(c.prompt_mask, P, 0) for c in chunks]),
        response_ids=torch.cat([pad_right(c.response_ids, R, pad_token_id) for c in chunks]),
        response_mask=torch.cat([pad_right(c.response_mask, R, 0) for c in chunks]),
        rollout_logprobs=torch.cat([pad_right(c.rollout_logprobs, R, 0.0) for c in chunks]),
        vision_inputs=vision,
        texts=[t for c in chunks for t in c.texts],
        truncated=torch.cat([c.truncated for c in chunks]),
        images_per_row=[n for c in chunks for n in c.images_per_row],
        vision_layout=layout,
        observation_mask=observation,
        trajectories=[t for c in chunks for t in (c.trajectories or [Trajectory()] * len(c))]
        if multi
        else None,
        token_versions=torch.cat([pad_right(c.token_versions, R, -1) for c in chunks])
        if all(c.token_versions is not None for c in chunks)
        else None,
    )
