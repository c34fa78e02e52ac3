"""Token log-probabilities and entropy from logits, shared by the rollout engine and the trainer.

Both sides must compute the same distribution for the rollout log-probs to equal the trainer's
recomputed ones: logits with blocked tokens set to -inf, divided by the sampling temperature.
"""

from __future__ import annotations

import contextlib

import torch


def masked_logits(logits: torch.Tensor, blocked: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Logits of the sampling distribution: blocked ids removed, then scaled by 1/temperature.

    Args:
        logits: [..., V] raw model logits.
        blocked: [V] bool, True for ids that may never be sampled (vision/structural tokens,
            padded vocabulary rows); None blocks nothing.
        temperature: > 0.
    """
    logits = logits.float()
    if blocked is not None:
        logits = logits.masked_fill(blocked, float("-inf"))
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under softmax(logits). logits [N, T, V], tokens [N, T] -> [N, T]."""
    logz = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - logz


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim; -inf logits contribute 0. [N, T, V] -> [N, T]."""
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    return -(p * logp.nan_to_num(neginf=0.0)).sum(-1)


# ---------------------------------------------------------------------------------------------
# The LM head and log-softmax in chunks: the full [N, R, V] logits tensor never exists.
#
# With a real vocabulary (151,936 for Qwen-VL) float32 logits are 0.6 MB per token, so 64
# responses of 1,024 tokens would need 40 GB before the softmax's own copies. The trainer only
# needs, per response token, log p(token) and (for metrics or a bonus) the entropy. So the head
# runs over a chunk of positions at a time; the backward recomputes each chunk's logits instead
# of keeping them (as fused linear-cross-entropy kernels do), so memory is bounded by one chunk.
#
# Within a chunk everything is done in the one [chunk, V] float32 buffer of its logits: the
# log-sum-exp, the exponentials and the gradient's elementwise parts run over a quarter of the
# chunk's rows at a time (`_ROW_BLOCKS`), so their temporaries are a quarter of a chunk. The head
# weight's gradient is added straight into `weight.grad` where that is safe (`_grad_in_place`):
# no [V, H] float32 gradient is materialised per micro-batch beside the accumulated one.
# ---------------------------------------------------------------------------------------------


DEFAULT_CHUNK_BYTES = 128 * 2**20
"""Float32 logits of one chunk of positions (the pass holds about 1.5 such tensors at a time)."""

_ROW_BLOCKS = 4
"""Elementwise work over a chunk runs over 1/_ROW_BLOCKS of its rows at a time (temporaries)."""


def chunk_positions(vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Positions per chunk so that one chunk's float32 logits take at most `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab))


def _row_blocks(rows: int) -> list[slice]:
    """`rows` split into _ROW_BLOCKS slices (fewer when there are fewer rows)."""
    step = max(1, -(-rows // _ROW_BLOCKS))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


@torch.no_grad()
def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Raw float32 logits [T, V] of hidden [T, H]: the matmul in `weight`'s dtype (the compute
    dtype, as the model's own LM head runs it), then float32."""
    return torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()


def _softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma's final-logit soft-capping, `cap * tanh(logits / cap)` (None: none)."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _chunk_log_softmax(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    blocked: torch.Tensor,
    temperature: float,
    softcap: float | None,
    softcap_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(mask(softcap(h w^T + b)) / T) of one chunk, [c, V] float32, computed in one
    buffer (in place; the log-sum-exp a row block at a time); with `softcap_grad` also
    d softcap(z) / dz = 1 - tanh^2 (another [c, V])."""
    z = _head_logits(h, w, b)
    factor = None
    if softcap is not None:
        z.div_(softcap).tanh_()
        if softcap_grad:
            factor = 1.0 - z * z
        z.mul_(softcap)
    z.masked_fill_(blocked, float("-inf"))
    if temperature != 1.0:
        z.div_(temperature)
    for s in _row_blocks(z.shape[0]):
        block = z[s]
        block.sub_(torch.logsumexp(block, dim=-1, keepdim=True))
    return z, factor


def _entropy_(log_p: torch.Tensor) -> torch.Tensor:
    """Entropy [c] of each row of log-probs [c, V] (a row block at a time; -inf entries, the
    blocked ids, contribute 0 * -inf = nan, counted as 0)."""
    out = log_p.new_empty(log_p.shape[0])
    for s in _row_blocks(log_p.shape[0]):
        out[s] = log_p[s].exp().mul_(log_p[s]).nan_to_num_(nan=0.0).sum(-1).neg_()
    return out


def _grad_in_place(weight: torch.Tensor) -> bool:
    """Whether this backward may add the head weight's gradient straight into `weight.grad`
    (and return None for it) instead of returning a fresh [V, H] tensor for autograd to add.

    Only where that is exactly what autograd would do, and nothing watches the accumulation: a
    float32 leaf (a plain tensor, not a subclass such as a sharded DTensor) whose `.grad` is
    absent or a dense float32 tensor of its shape, without gradient hooks (DeepSpeed's ZeRO
    registers post-accumulate hooks; they would not fire), in a `backward()` that accumulates
    into it (not `torch.autograd.grad`, which returns gradients instead of accumulating them).
    """
    if not (weight.is_leaf and weight.requires_grad and weight.dtype == torch.float32):
        return False
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or weight.layout != torch.strided:
        return False
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return False
    grad = weight.grad
    if grad is not None and not (
        type(grad) is torch.Tensor
        and grad.dtype == torch.float32
        and grad.shape == weight.shape
        and grad.layout == torch.strided
        and grad.is_contiguous()
        and not grad.requires_grad
    ):
        return False
    try:  # does the engine run this leaf's AccumulateGrad in this pass?
        node = torch.autograd.graph.get_gradient_edge(weight).node
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):  # autograd.grad (or an older torch): return it
        return False


class _HeadGrad:
    """Where a backward accumulates the head's gradients over its chunks: straight into
    `weight.grad` (`_grad_in_place`), or float32 buffers returned to autograd at the end (a
    bfloat16 running sum would round)."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, need_w: bool, need_b: bool):
        self.weight = weight
        self.in_place = need_w and weight is not None and _grad_in_place(weight)
        self.w = None
        if need_w:
            if self.in_place:
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
                self.w = weight.grad
            else:
                self.w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        self.b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None

    def add(self, g: torch.Tensor, h: torch.Tensor) -> None:
        """Add one chunk's d/d(logits) g [c, V] (float32) with its hidden states h [c, H]."""
        if self.w is not None:
            self.w.addmm_(g.t(), h.to(torch.float32))
        if self.b is not None:
            self.b += g.sum(0)

    def results(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """(weight gradient, bias gradient) to return from the backward."""
        grad_w = None if self.w is None or self.in_place else self.w.to(weight.dtype)
        grad_b = None if self.b is None else self.b.to(bias.dtype)
        return grad_w, grad_b


def _hidden_grad_(grad_h: torch.Tensor, start: int, g: torch.Tensor, w: torch.Tensor) -> None:
    """grad_h[start : start + c] = g w (g [c, V] float32, w [V, H] in the compute dtype), a row
    block at a time (g's copy in the compute dtype is a block, not a chunk)."""
    for s in _row_blocks(g.shape[0]):
        grad_h[start + s.start : start + s.stop] = (g[s].to(w.dtype) @ w).to(grad_h.dtype)


def _chunk_backward_(
    g: torch.Tensor,
    factor: torch.Tensor | None,
    h: torch.Tensor,
    start: int,
    w: torch.Tensor,
    grad_h: torch.Tensor | None,
    head: _HeadGrad,
) -> None:
    """Back from one chunk's d/d(capped logits) g [c, V] (float32, changed in place): through the
    soft-cap (`factor`, its derivative, or None), then into the hidden states' gradient rows
    `start:start + c` (unless `grad_h` is None) and the head's gradients (`head`)."""
    if factor is not None:
        g.mul_(factor)
    if grad_h is not None:
        _hidden_grad_(grad_h, start, g, w)
    head.add(g, h)


def _logprob_grad_(
    log_p: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None, ent: torch.Tensor
) -> torch.Tensor:
    """d loss / d s for one chunk, in `log_p`'s buffer ([c, V], float32), without the one-hot
    term of the targets: with s = logits / T and p = softmax(s),

        d log p_y / d s_j = 1[j = y] - p_j,     d H / d s_j = -p_j (log p_j + H),

    so this is -p_j (g_logp + g_ent (log p_j + H)). Blocked ids (log p = -inf, p = 0) give 0.
    A row block at a time: the only temporary is a block's p (none without an entropy term)."""
    for s in _row_blocks(log_p.shape[0]):
        lp = log_p[s]
        if g_ent is None:
            lp.exp_().mul_(-g_logp[s, None])
        else:
            p = lp.exp()
            lp.add_(ent[s, None]).mul_(g_ent[s, None]).add_(g_logp[s, None]).mul_(p).neg_()
            lp.nan_to_num_(nan=0.0)  # blocked: (-inf) * g_ent * 0
            del p
    return log_p


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """log p(target) [T] and entropy [T] of softmax(mask(head(hidden)) / temperature), chunked.

    Forward keeps only the inputs; backward recomputes each chunk's logits and returns the exact
    gradients of `logprobs` and `entropy` with respect to `hidden` and the head's weight/bias
    (the weight's added straight into `weight.grad` where `_grad_in_place` allows). Each chunk
    works in one [chunk, V] float32 buffer plus row-block temporaries (another with soft-capping).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, blocked, temperature, softcap, chunk, compute_dtype):
        ctx.set_materialize_grads(False)  # an unused output (often the entropy) costs nothing
        T = hidden.shape[0]
        logp = torch.empty(T, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(T, dtype=torch.float32, device=hidden.device)
        w, b = _cast(weight, compute_dtype), _cast(bias, compute_dtype)
        for start in range(0, T, chunk):
            end = min(start + chunk, T)
            log_p, _ = _chunk_log_softmax(hidden[start:end], w, b, blocked, temperature, softcap)
            logp[start:end] = log_p.gather(-1, targets[start:end, None]).squeeze(-1)
            ent[start:end] = _entropy_(log_p)
            del log_p
        ctx.save_for_backward(hidden, weight, bias, targets, blocked, ent)
        ctx.temperature, ctx.softcap, ctx.chunk = temperature, softcap, chunk
        ctx.compute_dtype = compute_dtype
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, targets, blocked, ent = ctx.saved_tensors
        temperature, softcap, chunk = ctx.temperature, ctx.softcap, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w, b = _cast(weight, ctx.compute_dtype), _cast(bias, ctx.compute_dtype)
        grad_h = torch.zeros_like(hidden) if need_h else None
        head = _HeadGrad(weight, bias, need_w, need_b)
        if grad_logp is None:
            grad_logp = torch.zeros_like(ent)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            g_logp = grad_logp[start:end]
            log_p, factor = _chunk_log_softmax(h, w, b, blocked, temperature, softcap, softcap_grad=True)
            g = _logprob_grad_(
                log_p, g_logp, None if grad_ent is None else grad_ent[start:end], ent[start:end]
            )
            del log_p  # (g is its buffer)
            g.scatter_add_(-1, targets[start:end, None], g_logp[:, None])
            g.div_(temperature)  # blocked entries have p = 0, hence g = 0
            _chunk_backward_(g, factor, h, start, w, grad_h, head)
            del g, factor  # (before the next chunk's buffers exist)
        grad_w, grad_b = head.results(weight, bias)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _head_setup(
    weight: torch.Tensor, blocked: torch.Tensor | None
) -> tuple[torch.Tensor, torch.dtype, contextlib.AbstractContextManager]:
    """What a chunked head pass needs besides its inputs: the [V] bool `blocked` ids on the
    head's device (none blocked for None), the dtype its matmuls run in, and a context that
    turns autocast off inside the pass.

    Under autocast the model's own head would multiply in the autocast dtype: so does the pass,
    with autocast itself off inside (the backward then recomputes exactly what the forward saw).
    """
    V = weight.shape[0]
    if blocked is None:
        blocked = torch.zeros(V, dtype=torch.bool, device=weight.device)
    device_type = weight.device.type
    compute_dtype = weight.dtype
    if device_type in ("cuda", "cpu", "xpu", "mps") and torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    off = torch.autocast(device_type, enabled=False) if device_type != "meta" else contextlib.nullcontext()
    return blocked[:V].to(weight.device), compute_dtype, off


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    blocked: torch.Tensor | None,
    temperature: float,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of `targets` under the LM head applied to `hidden`, in chunks.

    Args:
        hidden: [T, H] final hidden states of the positions that predict `targets`.
        weight: [V, H] the LM head (bias [V] optional); its dtype is the matmul's, as in the model.
        targets: [T] token ids.
        blocked: [V] bool ids removed from the distribution (as `masked_logits`), or None.
        temperature: > 0, the distribution is softmax(logits / temperature).
        softcap: Gemma-style final-logit soft-capping (`cap * tanh(logits / cap)`), or None.
        chunk: positions per chunk; default `chunk_positions(V)`.

    Returns:
        (log-probs [T], entropy [T]), float32, differentiable in `hidden`, `weight` and `bias`.
        Peak memory is a few [chunk, V] float32 tensors, forward and backward.
    """
    blocked, compute_dtype, autocast_off = _head_setup(weight, blocked)
    chunk = chunk or chunk_positions(weight.shape[0])
    with autocast_off:
        return _ChunkedHeadLogprobs.apply(
            hidden, weight, bias, targets, blocked, float(temperature), softcap, chunk, compute_dtype
        )


def module_head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    blocked: torch.Tensor | None,
    temperature: float,
    softcap: float | None = None,
    chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_logprobs` for an LM head that is not a plain linear layer (LoRA on the head, forward
    hooks, a custom module): the head runs as a module over each chunk, and each chunk is
    checkpointed, so the backward recomputes one chunk's logits at a time. Same contract."""
    from torch.utils.checkpoint import checkpoint

    def one_chunk(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _softcapped(head(h).float(), softcap)
        s = masked_logits(logits, None if blocked is None else blocked[: logits.shape[-1]], temperature)
        log_p = torch.log_softmax(s, dim=-1)
        entropy = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)
        return log_p.gather(-1, y[:, None]).squeeze(-1), entropy

    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled():
            lp, ent = checkpoint(one_chunk, h, y, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, y)
        logps.append(lp)
        entropies.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)


# ---------------------------------------------------------------------------------------------
# The exact per-position KL(pi || pi_ref) over the vocabulary, chunked like the log-probs.


class _ChunkedHeadFullKL(torch.autograd.Function):
    """KL(pi || pi_ref) [T] at each position, pi = softmax(mask(head(hidden)) / T) and pi_ref the
    same of the reference's hidden states and head; gradients flow to the policy only.

    Forward keeps the inputs; backward recomputes each chunk's two distributions, with
    d KL / d s_j = p_j (log p_j - log q_j - KL) for the tempered policy logits s.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, ref_hidden, ref_weight, ref_bias, blocked, temperature, softcap, chunk,
        compute_dtype,
    ):  # fmt: skip
        T = hidden.shape[0]
        kl = torch.empty(T, dtype=torch.float32, device=hidden.device)
        w, b = _cast(weight, compute_dtype), _cast(bias, compute_dtype)
        rw, rb = _cast(ref_weight, compute_dtype), _cast(ref_bias, compute_dtype)
        for start in range(0, T, chunk):
            end = min(start + chunk, T)
            log_p, _ = _chunk_log_softmax(hidden[start:end], w, b, blocked, temperature, softcap)
            log_q, _ = _chunk_log_softmax(ref_hidden[start:end], rw, rb, blocked, temperature, softcap)
            # p (log p - log q) in log q's buffer. Blocked ids have p = q = 0 and log p = log q =
            # -inf: (-inf) - (-inf) = nan, times p = 0, set to 0.
            kl[start:end] = log_q.neg_().add_(log_p).mul_(log_p.exp_()).nan_to_num_(nan=0.0).sum(-1)
            del log_p, log_q
        ctx.save_for_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, blocked, kl)
        ctx.temperature, ctx.softcap, ctx.chunk, ctx.compute_dtype = (
            temperature,
            softcap,
            chunk,
            compute_dtype,
        )
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias, blocked, kl = ctx.saved_tensors
        temperature, softcap, chunk = ctx.temperature, ctx.softcap, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w, b = _cast(weight, ctx.compute_dtype), _cast(bias, ctx.compute_dtype)
        rw, rb = _cast(ref_weight, ctx.compute_dtype), _cast(ref_bias, ctx.compute_dtype)
        grad_h = torch.zeros_like(hidden) if need_h else None
        head = _HeadGrad(weight, bias, need_w, need_b)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            log_p, factor = _chunk_log_softmax(h, w, b, blocked, temperature, softcap, softcap_grad=True)
            g, _ = _chunk_log_softmax(ref_hidden[start:end], rw, rb, blocked, temperature, softcap)
            # g = p (log p - log q - KL) * grad / T, built in log q's buffer; blocked ids give
            # 0 * nan there, set to 0.
            g.neg_().add_(log_p).sub_(kl[start:end, None]).mul_(log_p.exp_()).nan_to_num_(nan=0.0)
            del log_p
            g.mul_(grad_kl[start:end, None]).div_(temperature)
            _chunk_backward_(g, factor, h, start, w, grad_h, head)
            del g, factor  # (before the next chunk's buffers exist)
        grad_w, grad_b = head.results(weight, bias)
        return (grad_h, grad_w, grad_b, *([None] * 8))


def head_full_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    blocked: torch.Tensor | None,
    temperature: float,
    bias: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The exact KL(pi || pi_ref) at each position, summed over the whole vocabulary, in chunks.

        KL_t = sum_v pi_t(v) (log pi_t(v) - log pi_ref,t(v))

    with pi_t = softmax(mask(softcap(hidden_t W^T + b)) / temperature) and pi_ref,t the same of
    the reference's `ref_hidden` and head (same mask and temperature). This is veRL's `full`
    KL mode, which it leaves unimplemented because it would need the [N, R, V] logits of both
    models; here neither exists: one chunk of positions is computed at a time, forward and
    backward (about four [chunk, V] float32 tensors at a time).

    Args:
        hidden: [T, H] the policy's final hidden states at the positions (with grad).
        weight: [V, H] the policy's LM head (bias [V] optional).
        ref_hidden: [T, H] the reference's hidden states at the same positions (no grad).
        ref_weight: [V, H] the reference's LM head (ref_bias [V] optional).
        blocked: [V] bool ids removed from both distributions, or None.
        temperature: > 0.
        softcap: final-logit soft-capping (both models), or None.
        chunk: positions per chunk; default half of `chunk_positions(V)` (two distributions).

    Returns:
        [T] float32 >= 0 (to rounding), differentiable in `hidden`, `weight` and `bias` only.
    """
    if hidden.shape != ref_hidden.shape:
        raise ValueError(f"hidden {list(hidden.shape)} and ref_hidden {list(ref_hidden.shape)} must match")
    V = weight.shape[0]
    if ref_weight.shape[0] != V:
        raise ValueError(
            f"policy and reference heads have different vocabularies ({V} vs {ref_weight.shape[0]})"
        )
    blocked, compute_dtype, autocast_off = _head_setup(weight, blocked)
    chunk = chunk or max(1, chunk_positions(V) // 2)
    with autocast_off:
        return _ChunkedHeadFullKL.apply(
            hidden, weight, bias, ref_hidden.detach(), ref_weight.detach(),
            None if ref_bias is None else ref_bias.detach(), blocked, float(temperature), softcap, chunk,
            compute_dtype,
        )  # fmt: skip
