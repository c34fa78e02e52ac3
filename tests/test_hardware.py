"""Real hardware without a GPU: memory that does not grow with vocabulary x length, device and
precision handling, models by hub id. What needs CUDA is at the end, skipped here.

What is covered where (see also the README, "What is tested where"):
- the chunked log-prob pass: values and gradients against the full softmax, and a record of
  every tensor the pass creates, forward and backward, showing none is vocabulary-sized beyond
  one chunk;
- device consistency: the loss path (LM head, log-softmax, policy loss, KL, TIS, advantages)
  runs forward and backward with its inputs on the `meta` device, where a tensor mmrl creates
  on another device raises; and every tensor factory call in the modules of a training step
  names its device (or is on the list of host-side bookkeeping). The model's own forward cannot
  run on `meta` (the Qwen-VL vision code reads image grids and masks as values), so the GPU
  test at the end is what covers it;
- precision: bfloat16 mixed precision on the CPU (placement of trainable and frozen weights,
  first-step log-probs against float32 within a stated tolerance, an update with bfloat16 master
  weights), gradient checkpointing (same gradients, layers recomputed), a reference kept on the
  host; tests/test_families.py (`bf16`) trains the built-in task in bfloat16 and asks that
  held-out accuracy rise as in float32.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmrl.algos.advantages import get_advantage_estimator
from mmrl.algos.kl import kl_in_loss
from mmrl.algos.logprobs import (
    entropy_from_logits,
    head_logprobs,
    masked_logits,
    module_head_logprobs,
    token_logprobs,
)
from mmrl.algos.losses import get_policy_loss
from mmrl.algos.tis import tis_weights
from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.models.loading import ModelNotFoundError, load_policy
from mmrl.models.precision import Precision, precision_from
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.train.forward import response_logprobs
from mmrl.train.grpo import prepare_policy
from mmrl.train.update import old_and_ref_logprobs

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the chunked log-prob pass


def _full_softmax(h, W, b, targets, blocked, temperature, softcap):
    z = torch.nn.functional.linear(h, W, b)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    s = masked_logits(z, blocked, temperature)
    return token_logprobs(s, targets), entropy_from_logits(s)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_head_equals_the_full_softmax_in_values_and_gradients(softcap, temperature, chunk):
    T, H, V = 23, 16, 50
    h = torch.randn(T, H, requires_grad=True)
    W = torch.randn(V, H, requires_grad=True)
    b = torch.randn(V, requires_grad=True)
    blocked = torch.zeros(V, dtype=torch.bool)
    blocked[[3, 7]] = True
    targets = torch.randint(0, V, (T,))
    targets[blocked[targets]] = 4  # blocked ids are never sampled
    c_logp, c_ent = torch.randn(T), torch.randn(T)  # an arbitrary loss of both outputs

    logp, ent = head_logprobs(h, W, targets, blocked, temperature, bias=b, softcap=softcap, chunk=chunk)
    (logp * c_logp + ent * c_ent).sum().backward()
    grads = [x.grad.clone() for x in (h, W, b)]
    for x in (h, W, b):
        x.grad = None
    ref_logp, ref_ent = _full_softmax(h, W, b, targets, blocked, temperature, softcap)
    (ref_logp * c_logp + ref_ent * c_ent).sum().backward()

    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    for got, x in zip(grads, (h, W, b)):
        torch.testing.assert_close(got, x.grad, atol=1e-5, rtol=1e-5)


def test_a_head_module_with_a_hook_runs_as_a_module_and_matches():
    T, H, V = 17, 8, 30
    head = torch.nn.Linear(H, V)
    head.register_forward_hook(lambda m, i, out: out * 0.5)  # e.g. a LoRA delta or a user's hook
    h = torch.randn(T, H, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    logp, ent = module_head_logprobs(h, head, targets, None, 0.9, chunk=4)
    (logp.sum() + ent.sum()).backward()
    got = h.grad.clone()
    h.grad = None
    ref_logp, ref_ent = _full_softmax(h, head.weight * 0.5, head.bias * 0.5, targets, None, 0.9, None)
    (ref_logp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, h.grad, atol=1e-5, rtol=1e-5)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op allocates (views allocate nothing: skipped)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = any(r.alias_info is not None for r in func._schema.returns)  # a view, or in place
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not aliases:
                self.shapes.append(tuple(t.shape))
                self.dtypes.append(t.dtype)
        return out


def test_the_log_prob_pass_never_creates_logits_beyond_one_chunk(tiny_policy):
    """Forward and backward of the trainer's pass: every tensor whose last dim is the vocabulary
    holds at most `chunk` positions. (The pass before this change built [N, R + 1, V] logits,
    then a masked copy and a log-softmax of the same size.)"""
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(make_samples(["colour_code"], 4, "train"), SamplingParams(n=4, max_new_tokens=10))
    V = tiny_policy.model.get_output_embeddings().weight.shape[0]
    chunk = 3
    assert batch.response_mask.sum() > 8 * chunk  # many chunks
    for share in (True, False):
        with _Shapes() as record:
            logp, ent = response_logprobs(
                tiny_policy.model, batch, tiny_policy.blocked, 0.8, with_entropy=True, entropy_grad=True,
                share_prompts=share, chunk=chunk,
            )  # fmt: skip
            (logp.sum() + 0.1 * ent.sum()).backward()
        vocab_sized = [s for s in record.shapes if s and s[-1] == V]
        assert vocab_sized, "the head must have run"
        biggest = max(torch.Size(s).numel() for s in vocab_sized)
        assert biggest <= chunk * V, (share, max(vocab_sized, key=lambda s: torch.Size(s).numel()))


class _LiveBytes(TorchDispatchMode):
    """A CPU stand-in for `torch.cuda.max_memory_allocated`: the bytes of every storage an op
    allocates (views and in-place results allocate nothing) are counted from its creation until
    it is freed (a finalizer on the storage, which lives as long as any tensor viewing it), and
    the peak of the running total is kept."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = 0, 0
        self._alive: set[int] = set()

    def _free(self, ptr: int, nbytes: int) -> None:
        self._alive.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr in self._alive or nbytes == 0:
                continue
            self._alive.add(ptr)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, ptr, nbytes)
        return out


def _mixed_precision_head(T: int, H: int, V: int):
    """The head as mixed-precision training runs it: a float32 master weight, bfloat16 hidden
    states, autocast to bfloat16 (as in the CUDA test at the end, on the CPU)."""
    torch.manual_seed(0)
    h = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    W = (0.1 * torch.randn(V, H)).requires_grad_()
    targets = torch.randint(0, V, (T,))
    return h, W, targets


def _head_pass(h, W, targets, chunk, entropy: bool = True):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = head_logprobs(h, W, targets, None, 1.0, chunk=chunk)
    (logp.sum() + (ent.sum() if entropy else 0.0)).backward()


@pytest.mark.parametrize("entropy", [True, False])
def test_the_log_prob_pass_peaks_at_a_few_chunks_beyond_its_gradients_on_the_cpu(entropy):
    """The CPU proxy of the CUDA test at the end, at its geometry (T / chunk = 18.6, so 1/8 of
    the full logits is 2.3 chunks): beyond the gradients it returns and autocast's bfloat16 copy
    of the weight, the pass holds under 2 chunks of float32 logits. (Before the backward freed its
    last chunk's probabilities and took the log-sum-exp in row blocks it held 3.3 chunks: the
    437 MB the CUDA test measured against its bound of 311 MB.)"""
    T, H, V, chunk = 520, 32, 4096, 28
    h, W, targets = _mixed_precision_head(T, H, V)
    with _LiveBytes() as memory:
        _head_pass(h, W, targets, chunk, entropy)
    unavoidable = W.numel() * 4 + h.numel() * 2 + W.numel() * 2  # W.grad, h.grad, bf16 copy of W
    one_chunk = chunk * V * 4
    assert W.grad.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
    extra = memory.peak - unavoidable
    assert extra < T * V * 4 / 8, (memory.peak, unavoidable, extra / one_chunk)
    assert extra < 2 * one_chunk, extra / one_chunk


def test_gradient_accumulation_adds_into_the_head_weights_grad_without_a_second_one():
    """A second micro-batch's backward adds into `W.grad` in place: no [V, H] float32 tensor is
    created (autograd would otherwise add a fresh one to the first: 1.16 GiB at a 2B model's
    vocabulary), and the sum is the two passes' gradients."""
    T, H, V, chunk = 64, 16, 512, 8
    h, W, targets = _mixed_precision_head(T, H, V)
    _head_pass(h[:32], W, targets[:32], chunk)
    first = W.grad.clone()
    grad_storage = W.grad.data_ptr()
    with _Shapes() as record:
        _head_pass(h[32:], W, targets[32:], chunk)
    made = list(zip(record.shapes, record.dtypes))
    assert ((V, H), torch.float32) not in made, "a [V, H] float32 gradient was materialised"
    assert made.count(((V, H), torch.bfloat16)) == 2  # autocast's copy of W, forward and backward
    assert W.grad.data_ptr() == grad_storage  # the same tensor, added to
    W.grad = None
    _head_pass(h[32:], W, targets[32:], chunk)
    second = W.grad.clone()
    W.grad = None
    _head_pass(h[:32], W, targets[:32], chunk)
    _head_pass(h[32:], W, targets[32:], chunk)
    torch.testing.assert_close(W.grad, first + second, atol=1e-6, rtol=1e-6)


def test_the_head_gradient_is_returned_to_autograd_where_the_accumulation_is_watched():
    """Where adding into `.grad` directly would bypass something, the gradient goes back through
    autograd as before: a post-accumulate hook (DeepSpeed ZeRO's) still fires with the whole
    gradient; `torch.autograd.grad` returns it and leaves `.grad` alone; a bfloat16 weight gets
    a bfloat16 gradient summed in float32."""
    T, H, V, chunk = 24, 8, 64, 5
    h, W, targets = _mixed_precision_head(T, H, V)
    _head_pass(h, W, targets, chunk)
    expected = W.grad.clone()

    W.grad = None
    seen = []
    handle = W.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    _head_pass(h, W, targets, chunk)
    handle.remove()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], expected)

    W.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = head_logprobs(h, W, targets, None, 1.0, chunk=chunk)
    (got,) = torch.autograd.grad(logp.sum() + ent.sum(), [W])
    assert W.grad is None
    torch.testing.assert_close(got, expected)

    W16 = W.detach().to(torch.bfloat16).requires_grad_()
    logp, ent = head_logprobs(h.detach(), W16, targets, None, 1.0, chunk=chunk)
    (logp.sum() + ent.sum()).backward()
    assert W16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(W16.grad.float(), expected, atol=0.05, rtol=0.05)


# ---------------------------------------------------------------------------- devices


class _MetaReads(TorchDispatchMode):
    """`meta` tensors have shapes but no values. Reading one (`.item()`, `float()`) gets a
    placeholder here, so code that logs metrics runs; every other op runs as meta, which raises
    when its tensors are on different devices (as CUDA does)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_meta = any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
        if on_meta and func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 1  # "no row is bad"; a count of 1
        if on_meta and func is torch.ops.aten.nonzero.default:  # "no row is bad"
            return torch.zeros((0, args[0].dim()), dtype=torch.long, device="meta")
        return func(*args, **kwargs)


def test_the_loss_path_creates_every_tensor_on_its_inputs_device(monkeypatch):
    """Forward and backward of the loss path with every input on `meta`: a tensor created on the
    CPU (the default device) and mixed in would raise."""
    import torch.fx.experimental._config as fx_config

    # Boolean indexing inside a meta kernel: every element taken.
    monkeypatch.setattr(fx_config, "meta_nonzero_assume_all_nonzero", True)
    with _MetaReads():
        _loss_path_on_meta()


def _loss_path_on_meta():
    meta = torch.device("meta")
    N, R, H, V, G = 8, 6, 16, 40, 4
    hidden = torch.randn(N * R, H, device=meta, requires_grad=True)
    weight = torch.randn(V, H, device=meta, requires_grad=True)
    targets = torch.zeros(N * R, dtype=torch.long, device=meta)
    blocked = torch.zeros(V, dtype=torch.bool, device=meta)
    logp, ent = head_logprobs(hidden, weight, targets, blocked, 0.9, chunk=7)
    logp, ent = logp.view(N, R), ent.view(N, R)
    mask = torch.ones(N, R, device=meta)
    old = torch.zeros(N, R, device=meta)
    ref = torch.zeros(N, R, device=meta)
    scores = torch.zeros(N, device=meta)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        advantages = get_advantage_estimator(name)(scores, G, eps=1e-6)
        assert advantages.device == meta, name
    weights, _ = tis_weights(old, old, mask, level="token", cap=2.0, mode="truncate")
    for name in ("ppo", "gspo", "cispo"):
        loss, _ = get_policy_loss(name)(
            logp, old, advantages, mask, clip_low=0.2, clip_high=0.28, clip_dual=None if name == "cispo" else 3.0,
            agg="token_mean", denom=float(N * R), max_len=R, weights=weights,
        )  # fmt: skip
        kl = kl_in_loss(logp, ref, mask, estimator="k3", agg="token_mean", denom=float(N * R), max_len=R)
        total = loss + 0.1 * kl - 0.01 * ent.mean()
        assert total.device == meta
        total.backward(retain_graph=True)
        assert hidden.grad.device == meta and weight.grad.device == meta


# Modules whose code runs in a training step. Each tensor factory call there must say where
# its tensor goes (`device=`), or create it from another tensor (`new_*`, `*_like`, `.to`).
STEP_MODULES = [
    "mmrl/train/grpo.py",
    "mmrl/train/update.py",
    "mmrl/train/forward.py",
    "mmrl/train/batching.py",
    "mmrl/rollout/hf.py",
    "mmrl/rollout/decode.py",
    "mmrl/algos/advantages.py",
    "mmrl/algos/losses.py",
    "mmrl/algos/kl.py",
    "mmrl/algos/tis.py",
    "mmrl/algos/dapo.py",
    "mmrl/algos/logprobs.py",
]
FACTORIES = {
    "zeros",
    "ones",
    "full",
    "empty",
    "arange",
    "tensor",
    "rand",
    "randn",
    "randint",
    "eye",
    "linspace",
}
HOST_SIDE: set[tuple[str, str]] = set()
"""(module, enclosing function) pairs allowed to create host tensors on purpose (none today)."""


def test_every_tensor_a_training_step_creates_names_its_device():
    missing = []
    for rel in STEP_MODULES:
        tree = ast.parse((ROOT / rel).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(fn):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                    continue
                owner = call.func.value
                if not (isinstance(owner, ast.Name) and owner.id == "torch" and call.func.attr in FACTORIES):
                    continue
                if any(k.arg == "device" for k in call.keywords) or (rel, fn.name) in HOST_SIDE:
                    continue
                missing.append(f"{rel}:{call.lineno} torch.{call.func.attr} in {fn.name}()")
    assert not missing, "tensors created without a device:\n" + "\n".join(missing)


def test_batches_follow_the_policy_to_its_device(tiny_policy):
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(make_samples(["colour_code"], 2, "train"), SamplingParams(n=2, max_new_tokens=4))
    assert batch.device == torch.device("cpu")
    meta = batch.to(torch.device("meta"))
    assert all(t.device.type == "meta" for t in (meta.prompt_ids, meta.response_mask, meta.rollout_logprobs))
    assert all(v.device.type == "meta" for v in meta.vision_inputs.values())
    assert batch.to(torch.device("cpu")) is batch


# ---------------------------------------------------------------------------- precision


def test_precision_defaults_on_the_cpu_are_float32_without_autocast():
    p = precision_from("auto", "auto", "auto")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the CPU defaults are not what auto picks")
    assert p == Precision(torch.device("cpu"), torch.float32, torch.float32)
    assert not p.autocast
    mixed = precision_from("cpu", "bfloat16", "auto")
    assert (mixed.compute, mixed.master, mixed.autocast) == (torch.bfloat16, torch.float32, True)
    assert "mixed precision" in mixed.describe()
    pure = precision_from("cpu", "bfloat16", "bfloat16")
    assert not pure.autocast
    with pytest.raises(ValueError, match="master weights are either"):
        precision_from("cpu", "bfloat16", "float16")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            precision_from("cuda", "auto", "auto")


def _bf16_cfg(*extra):
    return load_config(
        "vision_reasoning",
        overrides=["trainer.prompts_per_step=4", "rollout.group_size=4", "trainer.mini_batches=2", *extra],
    )


def test_mixed_precision_keeps_trainable_weights_float32_and_frozen_ones_in_the_compute_dtype(tiny_policy):
    cfg = _bf16_cfg("model.dtype=bfloat16", "model.freeze_vision=true", "algo.kl_coef=0.01")
    reference = prepare_policy(cfg, tiny_policy)
    dtypes = {
        (p.requires_grad, p.dtype)
        for n, p in tiny_policy.model.named_parameters()
        if "visual" not in n or "merger" in n
    }
    assert dtypes == {(True, torch.float32)}
    vision = {p.dtype for n, p in tiny_policy.model.named_parameters() if "visual.blocks" in n}
    assert vision == {torch.bfloat16}
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    assert tiny_policy.precision.autocast


def test_bfloat16_log_probs_agree_with_float32_within_tolerance(tiny_policy):
    """The same batch scored by the float32 policy and by its bfloat16 mixed-precision twin.
    Measured on random tiny models (seeds 0-2): mean |difference| 0.0009-0.0010 nats, max
    0.0035-0.0046 (bfloat16 keeps 8 mantissa bits); the bounds leave a factor of ~5."""
    import copy

    twin = dataclasses.replace(tiny_policy, model=copy.deepcopy(tiny_policy.model))
    prepare_policy(_bf16_cfg("model.dtype=bfloat16"), twin)
    prepare_policy(_bf16_cfg(), tiny_policy)
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(make_samples(["colour_code"], 4, "train"), SamplingParams(n=4, max_new_tokens=10))
    cfg = _bf16_cfg()
    fp32, _ = old_and_ref_logprobs(cfg, tiny_policy, None, batch)
    bf16, _ = old_and_ref_logprobs(cfg, twin, None, batch)
    assert fp32.dtype == bf16.dtype == torch.float32  # log-probs are float32 whatever the compute
    mask = batch.response_mask.bool()
    diff = (fp32 - bf16)[mask].abs()
    assert diff.mean() < 0.005 and diff.max() < 0.025, (float(diff.mean()), float(diff.max()))
    assert diff.max() > 0  # really computed in bfloat16


def _grads_of_one_pass(policy, cfg, batch):
    prepare_policy(cfg, policy)
    policy.model.zero_grad(set_to_none=True)
    with policy.autocast():
        logp, _ = response_logprobs(policy.model, batch, policy.blocked, 1.0)
    logp.sum().backward()
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_recomputes_the_layers_and_gives_the_same_gradients(tiny_policy):
    """model.gradient_checkpointing=true: every decoder layer runs again in the backward (its
    activations were not kept), and the gradients are those of the plain pass."""
    import copy

    twin = dataclasses.replace(tiny_policy, model=copy.deepcopy(tiny_policy.model))
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(make_samples(["colour_code"], 2, "train"), SamplingParams(n=2, max_new_tokens=6))
    plain = _grads_of_one_pass(tiny_policy, _bf16_cfg(), batch)
    # transformers checkpoints a layer's `forward` (its own hooks stay outside): count calls of
    # a module inside it, before it runs (the recomputation stops once it has what it needs).
    attention = twin.model.model.language_model.layers[0].self_attn
    calls = []
    attention.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    checkpointed = _grads_of_one_pass(twin, _bf16_cfg("model.gradient_checkpointing=true"), batch)
    assert twin.model.is_gradient_checkpointing and not tiny_policy.model.is_gradient_checkpointing
    assert len(calls) == 2  # the forward, then its recomputation in the backward
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_master_weights_in_bfloat16_train_in_bfloat16(tiny_policy):
    """model.master_dtype=bfloat16: the weights that train, their gradients and AdamW's state are
    bfloat16 (half the memory, rounded updates); log-probs and the loss stay float32."""
    from mmrl.train.grpo import make_trainee

    cfg = _bf16_cfg("model.dtype=bfloat16", "model.master_dtype=bfloat16", "optim.lr=1e-2")
    t = make_trainee(cfg, tiny_policy)
    try:
        assert {p.dtype for p in t.policy.model.parameters()} == {torch.bfloat16}
        batch = t.engine.generate(
            make_samples(["colour_code"], 2, "train"), SamplingParams(n=4, max_new_tokens=6)
        )
        old, _ = old_and_ref_logprobs(cfg, t.policy, None, batch)
        assert old.dtype == torch.float32
        before = [p.detach().clone() for p in t.policy.model.parameters()]
        advantages = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
        metrics = t.update_policy(cfg, batch, advantages, old, None, None, None)
        assert math.isfinite(metrics["actor/pg_loss"]) and metrics.get("actor/skipped_steps", 0) == 0
        assert any(not torch.equal(a, p) for a, p in zip(before, t.policy.model.parameters()))
        state = next(iter(t.optimizer.state.values()))
        assert state["exp_avg"].dtype == torch.bfloat16
    finally:
        t.router.close()


def test_a_reference_kept_on_the_host_gives_the_same_reference_log_probs(tiny_policy):
    """model.reference_on_cpu=true: the frozen reference stays on the host between its passes
    (moved to the policy's device only for them) and scores as the resident one does. On this
    CPU-only machine host and device are the same, so what is shown is that the path computes
    the same values and leaves the reference on the host; the move itself is the GPU test's."""
    import copy

    twin = dataclasses.replace(tiny_policy, model=copy.deepcopy(tiny_policy.model))
    resident_cfg = _bf16_cfg("algo.kl_coef=0.01")
    host_cfg = _bf16_cfg("algo.kl_coef=0.01", "model.reference_on_cpu=true")
    resident = prepare_policy(resident_cfg, tiny_policy)
    hosted = prepare_policy(host_cfg, twin)
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(make_samples(["colour_code"], 2, "train"), SamplingParams(n=2, max_new_tokens=6))
    _, ref_a = old_and_ref_logprobs(resident_cfg, tiny_policy, resident, batch)
    _, ref_b = old_and_ref_logprobs(host_cfg, twin, hosted, batch)
    torch.testing.assert_close(ref_a, ref_b, atol=0, rtol=0)
    assert {p.device.type for p in hosted.parameters()} == {"cpu"}


# ---------------------------------------------------------------------------- hub ids


def test_a_hub_id_reaches_from_pretrained_unchanged(monkeypatch, tiny_policy):
    import transformers

    calls = []

    def fake(kind, obj):
        def from_pretrained(source, **kw):
            calls.append((kind, source, kw.get("revision"), kw.get("local_files_only")))
            return obj

        return from_pretrained

    monkeypatch.setattr(
        transformers.AutoProcessor, "from_pretrained", fake("processor", tiny_policy.processor)
    )
    monkeypatch.setattr(
        transformers.AutoModelForImageTextToText, "from_pretrained", fake("model", tiny_policy.model)
    )
    policy = load_policy("Qwen/Qwen2.5-VL-3B-Instruct", revision="refs/pr/7")
    assert calls == [
        ("processor", "Qwen/Qwen2.5-VL-3B-Instruct", "refs/pr/7", None),
        ("model", "Qwen/Qwen2.5-VL-3B-Instruct", "refs/pr/7", None),
    ]
    assert policy.model is tiny_policy.model


def test_an_uncached_hub_id_offline_fails_naming_the_id_and_the_offline_mode(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as err:
        load_policy("mmrl-tests/no-such-model", revision="v1")
    message = str(err.value)
    assert "'mmrl-tests/no-such-model'" in message and "'v1'" in message
    assert "HF_HUB_OFFLINE=1" in message and "not in the local cache" in message


def test_a_missing_local_folder_is_not_mistaken_for_a_hub_id(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such local folder"):
        load_policy(tmp_path / "nope" / "model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_policy(tmp_path / "empty")


def test_a_local_folder_loads_as_before(tmp_path, tiny_policy):
    tiny_policy.model.save_pretrained(tmp_path)
    tiny_policy.processor.save_pretrained(tmp_path)
    policy = load_policy(tmp_path, dtype=torch.bfloat16)
    assert next(policy.model.parameters()).dtype == torch.bfloat16
    assert policy.blocked.tolist() == tiny_policy.blocked.tolist()


# ------------------------------------------------------------------- sampling defaults


def test_a_checkpoints_sampling_defaults_do_not_change_what_is_sampled(tiny_policy):
    """Qwen2.5-VL-Instruct ships top_k=1, top_p=0.001 and repetition_penalty=1.05: `generate`
    would apply them, and the recorded log-probs (of the plain tempered softmax) would be wrong.
    Single-response sampling goes through `generate`."""
    gen = tiny_policy.model.generation_config
    gen.top_k, gen.top_p, gen.repetition_penalty, gen.min_p = 1, 0.001, 1.5, 0.5
    engine = HFRolloutEngine.from_policy(tiny_policy)
    samples = make_samples(["colour_code"], 2, "train") * 6
    batch = engine.generate(samples, SamplingParams(n=1, temperature=1.0, max_new_tokens=8))
    with torch.no_grad():
        recomputed, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    torch.testing.assert_close(recomputed, batch.rollout_logprobs, atol=1e-5, rtol=0)
    # With top_k=1 applied, the 6 responses to each prompt would all be the greedy one.
    assert len(set(batch.texts[0::2])) > 1 and len(set(batch.texts[1::2])) > 1


# ------------------------------------------------------------------------- flow-GRPO pipeline

FLOW_FAST = [
    "sample.group_size=2",
    "sample.num_steps=2",
    "sample.eval_num_steps=2",
    "trainer.prompts_per_step=1",
    "trainer.mini_batches=1",
    "trainer.progress=false",
    "trainer.threads=1",
]


def _flow_trainee(cache: str, *overrides: str):
    from mmrl.models.tiny_diffusion import builtin_pipeline_path, load_flow_pipeline
    from mmrl.train.flow_config import load_flow_config
    from mmrl.train.flow_grpo import flow_precision, make_flow_trainee

    cfg = load_flow_config(
        "text_to_image_jpeg", overrides=[*FLOW_FAST, f"model.cache_dir={cache}", *overrides]
    )
    path = builtin_pipeline_path(cfg.model.tiny, cfg.model.seed, cfg.model.cache_dir)
    pipe = load_flow_pipeline(path, flow_precision(cfg).compute)
    return cfg, make_flow_trainee(cfg, pipe)


@pytest.mark.parametrize("lora", [True, False])
def test_the_flow_pipeline_trains_in_mixed_bfloat16_on_the_cpu(tmp_path, lora):
    """model.dtype=bfloat16: frozen parts (VAE, text encoders, the LoRA base, the KL reference)
    in bfloat16, trained weights and AdamW's state float32, the transformer under autocast; a
    step runs with finite float32 log-probs and changes the trained weights."""
    from mmrl.train.flow_grpo import flow_grpo_step

    cfg, t = _flow_trainee(
        str(tmp_path), "model.dtype=bfloat16", f"lora.enabled={str(lora).lower()}", "algo.kl_coef=0.01"
    )
    assert all(p.dtype == torch.float32 for p in t.params)
    frozen = [p for p in t.transformer.parameters() if not p.requires_grad]
    assert bool(frozen) == lora and all(p.dtype == torch.bfloat16 for p in frozen)
    for name in ("vae", "text_encoder", "text_encoder_2"):
        module = getattr(t.pipe, name, None)
        if module is not None:
            assert {p.dtype for p in module.parameters()} == {torch.bfloat16}, name
    if not lora:
        assert {p.dtype for p in t.reference.copy.parameters()} == {torch.bfloat16}
    assert t.sampler.autocast().fast_dtype == torch.bfloat16  # a real autocast context
    before = [p.detach().clone() for p in t.params]
    metrics = flow_grpo_step(cfg, t, ["a red circle"], step=1)
    assert all(math.isfinite(v) for k, v in metrics.items() if k.startswith("actor/"))
    assert any(not torch.equal(a, b) for a, b in zip(before, t.params))
    state = t.optimizer.state[t.params[0]]
    assert state["exp_avg"].dtype == torch.float32


def test_the_flow_pipeline_defaults_to_float32_on_the_cpu(tmp_path):
    from mmrl.train.flow_grpo import flow_precision

    cfg, t = _flow_trainee(str(tmp_path))
    precision = flow_precision(cfg)
    assert (precision.device.type, precision.compute, precision.autocast) == ("cpu", torch.float32, False)
    assert {p.dtype for p in t.pipe.transformer.parameters()} == {torch.float32}
    assert {p.device.type for p in t.pipe.transformer.parameters()} == {"cpu"}


def test_a_pipeline_hub_id_offline_fails_naming_the_id_and_the_offline_mode(monkeypatch, tmp_path):
    from mmrl.models.tiny_diffusion import load_flow_pipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as err:
        load_flow_pipeline("mmrl-tests/no-such-pipeline", revision="v2")
    message = str(err.value)
    assert "'mmrl-tests/no-such-pipeline'" in message and "'v2'" in message and "HF_HUB_OFFLINE=1" in message
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_flow_pipeline(tmp_path / "no" / "pipeline")


def test_a_pipeline_hub_id_reaches_diffusers_from_pretrained_unchanged(monkeypatch):
    import diffusers

    from mmrl.models.tiny_diffusion import load_flow_pipeline

    calls = []

    def from_pretrained(source, **kw):
        calls.append((source, kw.get("revision"), kw.get("dtype"), kw.get("local_files_only")))
        return "pipeline"

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", from_pretrained)
    out = load_flow_pipeline("stabilityai/stable-diffusion-3.5-medium", torch.bfloat16, revision="main")
    assert out == "pipeline"
    assert calls == [("stabilityai/stable-diffusion-3.5-medium", "main", torch.bfloat16, None)]


# ------------------------------------------------------------------------- CUDA only

# `pytest -m cuda` selects these on a GPU machine; elsewhere they are skipped with the reason.
_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def cuda(test):
    """Marks a test `cuda` and skips it, with the reason, where there is no CUDA GPU."""
    return pytest.mark.cuda(_no_cuda(test))


@cuda
def test_on_a_gpu_the_step_runs_in_bfloat16_on_the_device(tiny_policy):
    cfg = _bf16_cfg()
    prepare_policy(cfg, tiny_policy)
    assert tiny_policy.device.type == "cuda" and tiny_policy.precision.compute == torch.bfloat16
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(make_samples(["colour_code"], 4, "train"), SamplingParams(n=4, max_new_tokens=8))
    assert batch.device.type == "cuda"
    old, _ = old_and_ref_logprobs(cfg, tiny_policy, None, batch)
    assert old.device.type == "cuda" and old.dtype == torch.float32
    with torch.no_grad(), tiny_policy.autocast():
        recomputed, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    # The engine samples under the same autocast: the same bf16 numerics, within kernel noise.
    torch.testing.assert_close(recomputed, batch.rollout_logprobs, atol=2e-2, rtol=0)


@cuda
def test_on_a_gpu_a_host_reference_visits_the_device_only_for_its_pass(tiny_policy):
    cfg = _bf16_cfg("algo.kl_coef=0.01", "model.reference_on_cpu=true")
    reference = prepare_policy(cfg, tiny_policy)
    assert {p.device.type for p in reference.parameters()} == {"cpu"}
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(make_samples(["colour_code"], 2, "train"), SamplingParams(n=2, max_new_tokens=6))
    _, ref = old_and_ref_logprobs(cfg, tiny_policy, reference, batch)
    assert ref.device.type == "cuda" and torch.isfinite(ref).all()
    assert {p.device.type for p in reference.parameters()} == {"cpu"}


@cuda
def test_on_a_gpu_the_log_prob_pass_peaks_at_a_few_chunks():
    """The head as mixed-precision training runs it: float32 master weight, bfloat16 autocast.
    Beyond what any implementation must hold (the gradients it returns, and autocast's bfloat16
    copy of the weight, as the model's own head makes), the pass adds a few [chunk, V] buffers:
    under 1/8 of the full float32 logits [T, V]."""
    T, H, V = 4096, 1024, 151_936
    h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(V, H, device="cuda", dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, V, (T,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logp, ent = head_logprobs(h, W, targets, None, 1.0)
    (logp.sum() + ent.sum()).backward()
    peak = torch.cuda.max_memory_allocated() - base
    unavoidable = W.numel() * 4 + h.numel() * 2 + W.numel() * 2  # W.grad, h.grad, bf16 copy of W
    full = T * V * 4
    assert W.grad.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
    assert peak - unavoidable < full / 8, (peak, unavoidable, full)


@cuda
def test_on_a_gpu_a_second_micro_batch_adds_into_the_head_gradient():
    """Gradient accumulation: with `W.grad` already there, the next backward adds into it in
    place, so the peak above what is held already stays a few chunks (a fresh [V, H] float32
    gradient would alone be 622 MB here, twice the bound)."""
    T, H, V = 4096, 1024, 151_936
    h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(V, H, device="cuda", dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, V, (T,), device="cuda")
    for _ in range(2):  # two micro-batches; the second is measured
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # the second time: W.grad and h.grad included
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, ent = head_logprobs(h, W, targets, None, 1.0)
        (logp.sum() + ent.sum()).backward()
        peak = torch.cuda.max_memory_allocated() - base
    unavoidable = h.numel() * 2 + W.numel() * 2  # autograd's h gradient to add, bf16 copy of W
    assert peak - unavoidable < T * V * 4 / 8, (peak, unavoidable)


def test_the_optimizers_are_fused_where_torch_has_the_kernel(tmp_path):
    """AdamW's default implementations allocate temporaries the size of the optimizer state
    (the multi-tensor one, a GPU's default, for all parameters at once); the fused one does not."""
    from mmrl.models.precision import adamw

    linear = torch.nn.Linear(4, 4)
    assert adamw(linear.parameters(), lr=1e-3).defaults["fused"] is True
    assert adamw([{"params": list(linear.parameters()), "lr": 1e-3}], lr=1e-3).defaults["fused"] is True
    _, t = _flow_trainee(str(tmp_path))
    assert t.optimizer.defaults["fused"] is True


def test_flow_reward_models_are_built_on_the_pipelines_device(monkeypatch):
    """flow-GRPO's reward models go where the pipeline runs, unless a reward names its own."""
    import mmrl.rewards as rewards_pkg
    from mmrl.train.flow_config import load_flow_config
    from mmrl.train.flow_grpo import make_rewards

    calls = []
    monkeypatch.setattr(rewards_pkg, "get_reward_model", lambda name, **kw: calls.append((name, kw)) or name)
    cfg = load_flow_config(
        "text_to_image_jpeg",
        overrides=["reward.names=[jpeg_compressibility,aesthetic]", "reward.weights=[1.0,1.0]"],
    )
    cfg.reward.kwargs = {"aesthetic": {"device": "cpu", "dtype": "bfloat16"}}
    assert make_rewards(cfg, torch.device("cuda", 3)) == ["jpeg_compressibility", "aesthetic"]
    assert calls == [
        ("jpeg_compressibility", {"device": "cuda:3"}),
        ("aesthetic", {"device": "cpu", "dtype": "bfloat16"}),
    ]
