"""The default rollout engine: Hugging Face models sampled on the trainer's own module.

It shares the policy module with the trainer, so `load_weights` has nothing to copy; it exists
so that engines that hold their own copy (vLLM) fit the same interface.

The G responses of a prompt share the prompt, which is most of the sequence (a 64x64 image and
its question are ~160 tokens; a response ~10). On models whose positions the trainer lays out
itself (`mmrl.models.families.shares_prompts`), each distinct prompt is prefilled once,
its key/value cache indexed out to its G rows, and the responses are decoded by a plain sampling
loop over the tempered, blocked softmax (the distribution whose log-probs are recorded). Other
models, and single-response calls (greedy evaluation), go through Hugging Face `generate`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, ProcessorMixin
from transformers.generation.streamers import BaseStreamer

from mmrl.algos.logprobs import masked_logits, token_logprobs
from mmrl.models.families import vision_layout
from mmrl.models.loading import Policy
from mmrl.models.precision import model_device
from mmrl.types import RolloutBatch, Sample


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
    device."""

    def __init__(
        self,
        model: PreTrainedModel,
        processor: ProcessorMixin,
        blocked: torch.Tensor,
        stop_token_ids: list[int],
        pad_token_id: int,
        max_batch_rows: int = 256,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.model = model
        self.processor = processor
        self.blocked = blocked
        self.stop_token_ids = stop_token_ids
        self.pad_token_id = pad_token_id
        self.max_batch_rows = max_batch_rows
        self.autocast = autocast

    @classmethod
    def from_policy(cls, policy: Policy, max_batch_rows: int = 256) -> HFRolloutEngine:
        return cls(
            policy.model,
            policy.processor,
            policy.blocked,
            policy.stop_token_ids,
            policy.pad_token_id,
            max_batch_rows=max_batch_rows,
            autocast=policy.autocast,
        )

    @property
    def device(self) -> torch.device:
        """Where the model is now (a judge model may be moved between devices)."""
        return model_device(self.model)

    # The engine shares the trainer's module: nothing to sync, nothing to offload.
    def load_weights(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        if state_dict is not None:
            self.model.load_state_dict(state_dict, strict=False)

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    @torch.no_grad()
    def generate(
        self,
        samples: list[Sample],
        params: SamplingParams,
        on_response: Callable[[int, str], None] | None = None,
    ) -> RolloutBatch:
        """G = params.n responses per sample; rows are prompt-major ([B x G]).

        `on_response(row, text)` is called for each response the moment it is finished (its
        stop token sampled, or at the end for truncated ones), while the other rows are still
        being generated: the trainer starts scoring it right away.
        """
        from mmrl.models.families import shares_prompts

        if self.blocked.device != self.device:  # the token mask follows the model
            self.blocked = self.blocked.to(self.device)
        shared = params.n > 1 and shares_prompts(self.model)
        # Chunks of whole groups when prompts are shared, else of rows.
        units = samples if shared else [s for s in samples for _ in range(params.n)]
        per_unit = params.n if shared else 1
        step = max(1, self.max_batch_rows // per_unit)
        chunks = []
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
                    chunks.append(self._sample_shared(part, params, streamer))
                else:
                    chunks.append(self._generate_rows(part, params, streamer))
        batch = chunks[0] if len(chunks) == 1 else concat_rollouts(chunks, self.pad_token_id)
        batch.group_size = params.n
        return batch

    def _generate_rows(
        self, rows: list[Sample], params: SamplingParams, streamer: BaseStreamer | None = None
    ) -> RolloutBatch:
        inputs = encode_prompts(self.processor, rows, self.device)
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
        texts = self.processor.batch_decode(
            response.masked_fill(response_mask == 0, self.pad_token_id), skip_special_tokens=True
        )
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

    def _sample_shared(
        self, samples: list[Sample], params: SamplingParams, streamer: BaseStreamer | None = None
    ) -> RolloutBatch:
        """G = params.n responses per sample, each prompt prefilled once (see the module docs).

        Decoding feeds one token per row per step with the cache; rows that have sampled a stop
        token are fed padding (masked out afterwards), as `generate` does.
        """
        from mmrl.models.families import family_of
        from mmrl.train.batching import select_rows
        from mmrl.train.forward import cache_argument, output_cache

        G, model = params.n, self.model
        inputs = encode_prompts(self.processor, samples, self.device)
        prompts = prompt_batch(samples, inputs, self.processor)
        rows = [i for i in range(len(samples)) for _ in range(G)]
        index = torch.tensor(rows, dtype=torch.long, device=inputs["input_ids"].device)
        positions = family_of(model).position_ids(model, inputs)  # [B, P] ([3, B, P] for mrope)
        blocked = self.blocked
        stop = torch.tensor(self.stop_token_ids, device=index.device)
        was_training = model.training
        model.eval()
        try:
            out = model(**inputs, position_ids=positions, use_cache=True, logits_to_keep=1)
            cache = output_cache(out)
            cache.reorder_cache(index)  # [B] -> [B x G] rows
            logits = out.logits[:, -1][index]  # [N, V]
            next_position = positions[..., -1:].index_select(-2, index) + 1  # [N, 1]: text continues by 1
            attention_mask = inputs["attention_mask"][index]
            if streamer is not None:
                streamer.put(inputs["input_ids"][index].cpu())
            finished = torch.zeros(len(rows), dtype=torch.bool, device=index.device)
            tokens, logprobs = [], []
            for t in range(params.max_new_tokens):
                scores = masked_logits(
                    logits, blocked[: logits.shape[-1]], 1.0 if params.greedy else params.temperature
                )
                if params.greedy:
                    token = scores.argmax(dim=-1)
                else:
                    token = torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)
                    logprobs.append(token_logprobs(scores, token))
                token = token.masked_fill(finished, self.pad_token_id)
                tokens.append(token)
                if streamer is not None:
                    streamer.put(token.cpu())
                finished |= torch.isin(token, stop)
                if bool(finished.all()) or t == params.max_new_tokens - 1:
                    break
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
                out = model(
                    input_ids=token[:, None],
                    attention_mask=attention_mask,
                    position_ids=next_position,
                    use_cache=True,
                    **{cache_argument(model): cache},
                )
                cache = output_cache(out)
                logits = out.logits[:, -1]
                next_position = next_position + 1
            if streamer is not None:
                streamer.end()
        finally:
            model.train(was_training)
        batch = select_rows(prompts, rows)
        response = torch.stack(tokens, dim=1)
        response_mask, truncated = response_mask_from_stops(response, self.stop_token_ids)
        batch.response_ids = response.masked_fill(response_mask == 0, self.pad_token_id)
        batch.response_mask = response_mask
        batch.truncated = truncated
        if params.greedy:
            batch.rollout_logprobs = torch.zeros(response.shape, dtype=torch.float32, device=response.device)
        else:
            batch.rollout_logprobs = torch.stack(logprobs, dim=1).masked_fill(response_mask == 0, 0.0)
        batch.texts = self.processor.batch_decode(batch.response_ids, skip_special_tokens=True)
        return batch


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


def encode_prompts(
    processor: ProcessorMixin, rows: list[Sample], device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Chat template + images through the processor, left padded; on `device` if given. Images
    go in as one list per row (processors that lay images out per row need it)."""
    texts = [
        processor.apply_chat_template(s.chat_messages(), add_generation_prompt=True, tokenize=False)
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
    )
