"""The trainer's forward pass: per-token log-probs (and entropy) of responses."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from mmrl.algos.logprobs import entropy_from_logits, masked_logits, token_logprobs
from mmrl.train.batching import model_inputs
from mmrl.types import RolloutBatch


def response_logprobs(
    model: PreTrainedModel,
    batch: RolloutBatch,
    blocked: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, R] of the response tokens, and their entropy [N, R] if asked
    (differentiable only with `entropy_grad`, for an entropy bonus).

    Only the last R+1 positions go through the LM head (`logits_to_keep`): the prompt's logits
    are never needed. Masked positions hold 0.
    """
    inputs = model_inputs(batch)
    R = batch.response_ids.shape[1]
    out = model(**inputs, logits_to_keep=R + 1, use_cache=False)
    logits = out.logits[:, :-1]  # position t predicts response token t
    logits = masked_logits(logits, blocked[: logits.shape[-1]], temperature)
    mask = batch.response_mask
    logprobs = token_logprobs(logits, batch.response_ids).masked_fill(mask == 0, 0.0)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits).masked_fill(mask == 0, 0.0)
    return logprobs, entropy
