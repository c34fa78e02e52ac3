"""The trainer's forward pass: per-token log-probs (and entropy) of responses.

The G responses of a group share one prompt (text and images), and the prompt is most of the
sequence (a 64x64 image and its question are ~160 tokens, a response ~10). So when rows share a
prompt, the prompt (vision tower included) goes through the model once per distinct prompt, and
its key/value cache is indexed out to the rows that share it; the responses then attend to it.
Gradients flow back through the cache into the shared prompt pass, so the log-probs, the loss and
the gradients are those of the plain full-sequence forward (to float rounding: tested). Where it
does not apply (the family adapter says so, `mmrl.models.families`, or gradient checkpointing is
on while training) the plain forward runs, and the log says so once.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from mmrl.algos.logprobs import chunk_positions, head_full_kl, head_logprobs, module_head_logprobs
from mmrl.models.families import family_of, mm_token_types, shares_prompts
from mmrl.train.batching import model_inputs, prompt_groups, select_rows
from mmrl.types import RolloutBatch

log = logging.getLogger(__name__)
_said: set[str] = set()


def _say_once(why: str) -> None:
    if why not in _said:
        _said.add(why)
        log.info("shared-prompt forward off, using the plain forward: %s", why)


def response_logprobs(
    model: PreTrainedModel,
    batch: RolloutBatch,
    blocked: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    share_prompts: bool = True,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, R] (float32) of the response tokens, and their entropy [N, R] if asked
    (differentiable only with `entropy_grad`, for an entropy bonus).

    The model runs up to its final hidden states; the LM head and the log-softmax then run over
    the response tokens only (never the prompt, never padding), a chunk of positions at a time,
    forward and backward (`mmrl.algos.logprobs.head_logprobs`): the [N, R, V] logits tensor
    never exists, so memory does not grow with vocabulary x length. With `share_prompts`, rows
    with the same prompt share one prompt pass (see the module docs). Masked positions hold 0.
    """

    logprobs, entropy, _ = _logprobs_pass(
        model, batch, blocked, temperature, with_entropy, entropy_grad, share_prompts, chunk, None
    )
    return logprobs, entropy


def response_logprobs_and_values(
    model: PreTrainedModel,
    batch: RolloutBatch,
    blocked: torch.Tensor,
    temperature: float,
    value_head: ValueHead,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    share_prompts: bool = True,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`response_logprobs` plus the critic's values [N, R] (float32, 0 off the response mask)
    from the same forward: `value_head` reads the final hidden state at each position that
    predicts a response token, the state before that token (veRL's critic layout), so the
    backbone runs once for both. Observation tokens and padding get no value."""
    return _logprobs_pass(
        model, batch, blocked, temperature, with_entropy, entropy_grad, share_prompts, chunk, value_head
    )


def _logprobs_pass(
    model: PreTrainedModel,
    batch: RolloutBatch,
    blocked: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    share_prompts: bool,
    chunk: int | None,
    value_head: ValueHead | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    def compute(root: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        h, y, mask = response_positions(root, batch, share_prompts)
        head, softcap = output_head(root)
        if plain_linear(head):
            token_logp, token_entropy = head_logprobs(
                h, head.weight, y, blocked, temperature, bias=head.bias, softcap=softcap, chunk=chunk
            )
        else:
            size = chunk or chunk_positions(head.weight.shape[0])
            token_logp, token_entropy = module_head_logprobs(h, head, y, blocked, temperature, softcap, size)
        logprobs = token_logp.new_zeros(mask.shape).masked_scatter(mask, token_logp)
        entropy = token_entropy.new_zeros(mask.shape).masked_scatter(mask, token_entropy)
        if value_head is None:
            return logprobs, entropy, None
        token_values = value_head(h)  # [T] float32
        return logprobs, entropy, token_values.new_zeros(mask.shape).masked_scatter(mask, token_values)

    logprobs, entropy, values = call_as_forward(model, compute)
    if not with_entropy:
        return logprobs, None, values
    if not (entropy_grad and torch.is_grad_enabled()):
        entropy = entropy.detach()
    return logprobs, entropy, values


class ValueHead(torch.nn.Module):
    """The critic: a linear value head (float32, zero-initialised: every value starts at 0) on
    the policy's final hidden state, V(s_t) = w . h_t + b. It reads the hidden states the
    log-prob pass already computed (`response_logprobs_and_values`) and computes in float32
    whatever the backbone's dtype, a chunk of positions at a time (`_Float32Dot`): no float32
    copy of the [T, H] hidden states is kept for the backward."""

    def __init__(self, hidden_size: int, device: torch.device | str | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32, device=device))
        self.bias = torch.nn.Parameter(torch.zeros((), dtype=torch.float32, device=device))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Values [T] (float32) of hidden states [T, H] (any float dtype)."""
        return _Float32Dot.apply(hidden, self.weight, self.bias)


def value_head_for(model: torch.nn.Module, device: torch.device | str) -> ValueHead:
    """A fresh `ValueHead` the width of `model`'s final hidden state, on `device`."""
    return ValueHead(_base(model).config.get_text_config().hidden_size, device=device)


class _Float32Dot(torch.autograd.Function):
    """h [T, H] . w [H] + b in float32, a chunk of positions at a time (each chunk's float32
    copy lives only while it is multiplied), autocast off; the backward likewise chunked: the
    gradient to h comes back in h's dtype."""

    CHUNK_BYTES = 64 * 2**20

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        size = max(1, _Float32Dot.CHUNK_BYTES // (4 * max(1, h.shape[-1])))
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for i in range(0, h.shape[0], size):
                out[i : i + size] = h[i : i + size].float() @ w + b
        ctx.save_for_backward(h, w)
        ctx.size = size
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, w = ctx.saved_tensors
        size = ctx.size
        grad_h = grad_w = grad_b = None
        with torch.autocast(h.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_h = torch.empty_like(h)
                for i in range(0, h.shape[0], size):
                    grad_h[i : i + size] = (grad[i : i + size].unsqueeze(1) * w).to(h.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = torch.zeros_like(w)
                for i in range(0, h.shape[0], size):
                    grad_w += grad[i : i + size] @ h[i : i + size].float()
            if ctx.needs_input_grad[2]:
                grad_b = grad.sum()
        return grad_h, grad_w, grad_b


def response_positions(
    model: torch.nn.Module, batch: RolloutBatch, share_prompts: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The final hidden states [T, H] of the T positions that predict response tokens (padding
    dropped, row-major), those tokens [T], and the [N, R] bool mask they came from."""
    hidden = shared_prompt_hidden(model, batch) if share_prompts else None
    if hidden is None:
        hidden = full_hidden(model, batch)
    mask = batch.response_mask.bool()
    return hidden[mask], batch.response_ids[mask], mask


@torch.no_grad()
def reference_hidden(
    reference: torch.nn.Module, batch: RolloutBatch, share_prompts: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The reference's final hidden states [T, H] at the response positions (as
    `response_positions` lays them out) and its LM head's weight and bias: what the exact KL
    (`response_logprobs_and_full_kl`) needs of it. No gradient."""
    h, _, _ = response_positions(reference, batch, share_prompts)
    head, _ = output_head(reference)
    if not plain_linear(head):
        raise ValueError(
            f"algo.kl_estimator=full needs a plain linear LM head on the reference, got {type(head).__name__}"
        )
    return h, head.weight, head.bias


def response_logprobs_and_full_kl(
    model: PreTrainedModel,
    batch: RolloutBatch,
    blocked: torch.Tensor,
    temperature: float,
    reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    entropy_grad: bool = False,
    share_prompts: bool = True,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`response_logprobs` (with entropy) plus the exact per-position KL(pi || pi_ref) [N, R]
    over the vocabulary (`mmrl.algos.logprobs.head_full_kl`), from one forward of the policy
    and the reference's hidden states (`reference_hidden` of the same batch). All three are
    float32 with 0 at masked positions; the log-probs and the KL carry gradients."""

    def compute(root: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, y, mask = response_positions(root, batch, share_prompts)
        head, softcap = output_head(root)
        if not plain_linear(head):
            raise ValueError(
                f"algo.kl_estimator=full needs a plain linear LM head on the policy, got {type(head).__name__}"
            )
        ref_h, ref_w, ref_b = reference
        if ref_h.shape[0] != h.shape[0]:
            raise ValueError(
                f"reference hidden states for {ref_h.shape[0]} positions, the batch has {h.shape[0]}"
            )
        token_logp, token_entropy = head_logprobs(
            h, head.weight, y, blocked, temperature, bias=head.bias, softcap=softcap, chunk=chunk
        )
        kl = head_full_kl(
            h, head.weight, ref_h, ref_w, blocked, temperature, bias=head.bias, ref_bias=ref_b, softcap=softcap,
            chunk=None if chunk is None else max(1, chunk // 2),
        )  # fmt: skip
        zeros = token_logp.new_zeros(mask.shape)
        return (
            zeros.masked_scatter(mask, token_logp),
            zeros.masked_scatter(mask, token_entropy),
            zeros.masked_scatter(mask, kl),
        )

    logprobs, entropy, kl = call_as_forward(model, compute)
    if not (entropy_grad and torch.is_grad_enabled()):
        entropy = entropy.detach()
    return logprobs, entropy, kl


def call_as_forward(model: torch.nn.Module, fn: Callable[[torch.nn.Module], Any]) -> Any:
    """`fn(model)` run as `model`'s forward, through `model(...)`: hooks that wrappers attach to
    the call (FSDP2 gathers the root's parameters, the LM head among them, in its pre-forward
    hook and reduces their gradients after the backward) see the whole pass. A wrapper with a
    `run_as_forward(fn)` method (a training group's loss share) is asked to run it instead."""
    run = getattr(model, "run_as_forward", None)
    if run is not None:
        return run(fn)
    previous = model.__dict__.get("forward")  # an instance attribute someone installed, if any
    model.forward = types.MethodType(lambda self: fn(self), model)  # this call only
    try:
        return model()
    finally:
        if previous is None:
            del model.forward
        else:
            model.forward = previous


def full_hidden(model: PreTrainedModel, batch: RolloutBatch) -> torch.Tensor:
    """Final hidden states [N, R, H] of the positions that predict each response token (position
    t predicts response token t), from one forward over prompt + response."""
    P, R = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    inputs = model_inputs(batch)
    if batch.observation_mask is not None and "mm_token_type_ids" in inputs:
        config = _base(model).config  # images inside the response: their token types too
        inputs["mm_token_type_ids"] = mm_token_types(
            inputs["input_ids"],
            getattr(config, "image_token_id", None),
            getattr(config, "video_token_id", None),
        )
    positions = family_of(model).position_ids(model, inputs)  # as generation lays them out
    out = decoder(model)(
        **inputs, use_cache=False, **({} if positions is None else {"position_ids": positions})
    )
    return out.last_hidden_state[:, P - 1 : P + R - 1]


def shared_prompt_hidden(model: PreTrainedModel, batch: RolloutBatch) -> torch.Tensor | None:
    """Final hidden states [N, R, H] predicting each response token, computing every distinct
    prompt once; None when no two rows share a prompt, or sharing does not apply to the model
    (its family adapter says so, or gradient checkpointing, which drops the cache, is on while
    training: logged once).

    1. a prompt pass over the distinct prompts (with their images) at the positions the model's
       own full forward gives them, keeping the cache; its last position predicts the first
       response token;
    2. the cache indexed out to every row ([U] -> [N], differentiable), and a pass over the
       responses (all but the last token) that attends to it. Response tokens are text: their
       positions continue the prompt's last one by 1 per token, as in the full forward (and in
       the rollout engine, `mmrl.rollout.hf`).
    """
    if not shares_prompts(model):
        return None
    if batch.observation_mask is not None:
        # Multi-turn responses hold images and observations: their positions are the model's
        # own layout over the whole sequence (M-RoPE), not the prompt's last one + 1 per token.
        _say_once("multi-turn responses (observations, images inside the response)")
        return None
    if model.training and gradient_checkpointing(model):
        _say_once("gradient checkpointing drops the key/value cache the shared prompt pass needs")
        return None
    groups = prompt_groups(batch)
    if groups is None:
        return None
    first, inverse = groups
    R = batch.response_ids.shape[1]
    core = decoder(model)
    prompts = select_rows(batch, first)
    inputs = {"input_ids": prompts.prompt_ids, "attention_mask": prompts.prompt_mask, **prompts.vision_inputs}
    positions = family_of(model).position_ids(model, inputs)  # [U, P] ([3, U, P] for mrope)
    out = core(**inputs, position_ids=positions, use_cache=True)
    head = out.last_hidden_state[:, -1:][inverse]  # [N, 1, H]: predicts response token 0
    if R == 1:
        return head
    cache = output_cache(out)
    cache.reorder_cache(inverse)  # index_select over rows: the prompt's gradient sums over its group
    steps = torch.arange(1, R, device=positions.device)
    out = core(
        input_ids=batch.response_ids[:, :-1],
        attention_mask=torch.cat([batch.prompt_mask, batch.response_mask[:, :-1]], dim=1),
        position_ids=positions[..., -1:].index_select(-2, inverse) + steps,  # [N, R-1] ([3, N, R-1])
        use_cache=True,
        **{cache_argument(core): cache},
    )
    return torch.cat([head, out.last_hidden_state], dim=1)


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The model without its LM head (`XForConditionalGeneration.model`: vision tower,
    connector and language model), returning `last_hidden_state`; LoRA layers included."""
    core = getattr(_base(model), "model", None)
    if core is None:
        raise TypeError(
            f"{type(_base(model)).__name__} has no `.model` (the decoder under the LM head); mmrl needs "
            "the Hugging Face `...ForConditionalGeneration` layout"
        )
    return core


def output_head(model: torch.nn.Module) -> tuple[torch.nn.Module, float | None]:
    """The LM head module and the final-logit soft-cap (Gemma) or None."""
    head = _base(model).get_output_embeddings()
    text_config = _base(model).config.get_text_config()
    return head, getattr(text_config, "final_logit_softcapping", None)


def plain_linear(head: torch.nn.Module) -> bool:
    """Whether the head is exactly `nn.Linear` with no hooks: the fused chunked path may then
    use its weight directly (LoRA on the head, or a hook, must run as a module). A sharding
    wrapper's hooks do not count when it gathers the head's weight for the model's whole forward
    and backward and says so (`head.gathered_by_model`: DeepSpeed ZeRO-3,
    `mmrl.distributed.deepspeed_group.register_head`)."""
    if type(head) is not torch.nn.Linear:
        return False
    return getattr(head, "gathered_by_model", False) or not (head._forward_hooks or head._forward_pre_hooks)


def gradient_checkpointing(model: torch.nn.Module) -> bool:
    """Whether the model recomputes activations in the backward (it then drops caches)."""
    base = _base(model)
    flag = getattr(type(base), "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(type(base), "is_gradient_checkpointing", None)
    return bool(flag.__get__(base)) if flag is not None else False


def cache_argument(model: torch.nn.Module) -> str:
    """The forward's keyword for a key/value cache (`cache` in recent transformers)."""
    return "cache" if "cache" in _signature(type(_base(model)).forward) else "past_key_values"


def output_cache(out) -> object:
    """The key/value cache a forward returned (`cache`, or `past_key_values` before transformers
    renamed it)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA (peft)


@functools.lru_cache(maxsize=64)
def _signature(function) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)
