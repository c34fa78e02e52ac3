"""The vLLM rollout engine without vLLM: everything around the `LLM` calls.

vLLM needs a GPU and is not installed on our machines, so these tests pin down what can run
without it: the prompts equal the HF engine's, vLLM-shaped outputs become exactly the batch the
HF engine returns for the same tokens, the weights to sync (full, LoRA merged, LoRA adapters),
the engine's calls into a stand-in `vllm` module (sleep / wake, weight sync through the worker
extension, streamed request outputs, LoRA requests), and `rollout.engine=vllm` in the
synchronous training loop. What vLLM itself does with those calls is untested here.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmrl.config import Config, load_config
from mmrl.datasets.procedural import make_samples
from mmrl.models.loading import Policy, load_policy, make_policy
from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm
from mmrl.rollout import vllm as engine_module
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams, encode_prompts
from mmrl.rollout.vllm import (
    VLLMRolloutEngine,
    adapter_weights,
    allowed_token_ids,
    completion_tensors,
    lora_spec,
    merged_weights,
    rollout_from_vllm,
    sync_mode,
    vllm_prompts,
    vllm_sampling_kwargs,
    weights_to_sync,
)
from mmrl.train.forward import response_logprobs
from mmrl.types import RewardSpec, Sample

# ---------------------------------------------------------------------------------------------
# Stand-ins shaped like vLLM's RequestOutput / CompletionOutput / Logprob
# ---------------------------------------------------------------------------------------------


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""


@dataclass
class RequestOutput:
    outputs: list[Completion]
    prompt_token_ids: list[int] | None = None
    request_id: str = "0"
    finished: bool = True


def _sample(i: int, images: list, text: str) -> Sample:
    return Sample(
        "multi", [{"role": "user", "content": text}], images, "math", RewardSpec("1", "math"), {"id": str(i)}
    )


def _multi_image_samples() -> list[Sample]:
    red, blue = Image.new("RGB", (64, 64), "red"), Image.new("RGB", (64, 64), "blue")
    return [
        _sample(0, [red, blue], "<image>first, <image>second: which is red?"),
        _sample(1, [blue], "<image>colour?"),
        _sample(2, [blue, red, red], "<image><image><image>count red"),
    ]


def _as_vllm_outputs(batch, n: int, stop_ids: list[int], shuffle: bool = True) -> list[RequestOutput]:
    """What vLLM would return for the HF batch's tokens: each completion its ids up to and
    including the stop token, the sampled id's log-prob among others, completions out of order."""
    outputs = []
    B = len(batch) // n
    for i in range(B):
        comps = []
        for j in range(n):
            row = i * n + j
            length = int(batch.response_mask[row].sum())
            ids = batch.response_ids[row, :length].tolist()
            lps = batch.rollout_logprobs[row, :length].tolist()
            positions = [
                {tok: Logprob(lp, rank=1), (tok + 1) % 50: Logprob(-30.0)} for tok, lp in zip(ids, lps)
            ]
            finish = "length" if bool(batch.truncated[row]) else "stop"
            comps.append(Completion(j, ids, positions, finish, ids[-1] if finish == "stop" else None))
        if shuffle:
            comps.reverse()
        prompt = batch.prompt_ids[i * n][batch.prompt_mask[i * n].bool()].tolist()
        outputs.append(RequestOutput(comps, prompt))
    return outputs


# ---------------------------------------------------------------------------------------------
# Import and construction
# ---------------------------------------------------------------------------------------------


def test_importing_the_engine_and_the_loops_that_use_it_never_imports_vllm(tmp_path):
    """A poisoned `vllm` package first on the path: importing mmrl's modules must not touch it."""
    poisoned = tmp_path / "vllm"
    poisoned.mkdir()
    (poisoned / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    code = (
        "import sys\n"
        "import mmrl.rollout.vllm_worker\n"  # what vLLM's workers import: light
        "assert 'transformers' not in sys.modules\n"
        "import mmrl.rollout.vllm, mmrl.train.async_grpo, mmrl.train.colocated, mmrl.distributed.ray_backend\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if 'vllm' in m)\n"
        "print('ok')\n"
    )
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


@pytest.fixture()
def saved_policy(tmp_path) -> Policy:
    """A tiny Qwen2-VL loaded from its folder (vLLM loads policies by path)."""
    spec = TinyVLMSpec()
    build_tiny_vlm(spec, seed=0).save_pretrained(tmp_path / "policy")
    build_processor(spec).save_pretrained(tmp_path / "policy")
    return load_policy(tmp_path / "policy")


def test_without_vllm_the_engine_names_the_extra_to_install(saved_policy, monkeypatch):
    from mmrl.train.async_grpo import make_rollout_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'mmrl\[vllm\]'"):
        VLLMRolloutEngine.from_policy(saved_policy)
    cfg = load_config(overrides=["rollout.engine=vllm"])
    with pytest.raises(ImportError, match=r"pip install 'mmrl\[vllm\]'"):
        make_rollout_engine(cfg, saved_policy)


# ---------------------------------------------------------------------------------------------
# Prompts and sampling parameters
# ---------------------------------------------------------------------------------------------


def test_prompts_are_the_text_and_images_the_hf_engine_feeds(tiny_policy):
    samples = _multi_image_samples() + make_samples(["colour_code"], 1, "train")
    prompts = vllm_prompts(tiny_policy.processor, samples, max_images=4)
    hf = encode_prompts(tiny_policy.processor, samples)
    tokenizer = tiny_policy.processor.tokenizer
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for i, (p, s) in enumerate(zip(prompts, samples)):
        assert set(p) <= {"prompt_token_ids", "multi_modal_data"}  # a TokensPrompt's fields, no text
        images = p.get("multi_modal_data", {}).get("image", [])
        assert [im.tobytes() for im in images] == [im.tobytes() for im in s.pil_images()]
        ids = p["prompt_token_ids"]
        assert ids.count(image_pad) == len(s.images)  # one placeholder per image, unexpanded
        assert ids == tokenizer(engine_module.prompt_text(tiny_policy.processor, s))["input_ids"]
        # The processor on these ids' text gives the HF engine's (unpadded, expanded) prompt tokens.
        alone = tiny_policy.processor(
            text=[tokenizer.decode(ids)], images=images or None, return_tensors="pt"
        )
        assert alone["input_ids"][0].tolist() == hf["input_ids"][i][hf["attention_mask"][i].bool()].tolist()


def test_a_text_only_prompt_has_no_multimodal_data_and_too_many_images_name_the_sample(tiny_policy):
    text_only = _sample(7, [], "What is 2 + 3?")
    (prompt,) = vllm_prompts(tiny_policy.processor, [text_only], max_images=4)
    assert set(prompt) == {"prompt_token_ids"}
    assert "2 + 3" in tiny_policy.processor.tokenizer.decode(prompt["prompt_token_ids"])
    with pytest.raises(ValueError, match=r"sample '2' has 3 images.*at most 2"):
        vllm_prompts(tiny_policy.processor, _multi_image_samples(), max_images=2)


def test_sampling_is_the_plain_tempered_softmax_over_the_allowed_ids(tiny_policy):
    tok = tiny_policy.processor.tokenizer
    allowed = allowed_token_ids(tiny_policy.blocked, len(tok))
    assert tok.convert_tokens_to_ids("<|image_pad|>") not in allowed
    assert tok.convert_tokens_to_ids("<|vision_start|>") not in allowed
    assert set(tiny_policy.stop_token_ids) <= set(allowed)
    assert len(allowed) == int((~tiny_policy.blocked[: len(tok)]).sum())
    assert max(allowed) < len(tok)

    kw = vllm_sampling_kwargs(SamplingParams(n=8, temperature=0.7, max_new_tokens=12), [5, 9], allowed)
    assert kw == {
        "n": 8,
        "temperature": 0.7,
        "top_p": 1.0,
        "max_tokens": 12,
        "stop_token_ids": [5, 9],
        "logprobs": 0,  # the sampled token's log-prob only
        "allowed_token_ids": allowed,
    }
    greedy = vllm_sampling_kwargs(SamplingParams(n=8, greedy=True, max_new_tokens=4), [5], None)
    assert (greedy["n"], greedy["temperature"], greedy["logprobs"]) == (1, 0.0, None)
    assert "allowed_token_ids" not in greedy


# ---------------------------------------------------------------------------------------------
# vLLM outputs -> RolloutBatch
# ---------------------------------------------------------------------------------------------


def test_outputs_become_the_batch_the_hf_engine_returns_for_the_same_tokens(tiny_policy):
    """The HF engine samples; the same tokens and log-probs, shaped as vLLM returns them, go
    through the conversion; every tensor of the batch must come out identical."""
    policy = tiny_policy
    stop = policy.stop_token_ids[0]
    # Raise the stop token's logit so that some rows stop and others hit the length limit.
    head = policy.model.get_output_embeddings()
    hook = head.register_forward_hook(
        lambda m, i, out: out.index_add(-1, torch.tensor([stop]), torch.full((*out.shape[:-1], 1), 2.5))
    )
    try:
        torch.manual_seed(3)
        samples = _multi_image_samples()
        n, T = 3, 0.7
        hf = HFRolloutEngine.from_policy(policy).generate(
            samples, SamplingParams(n=n, temperature=T, max_new_tokens=8)
        )
        assert hf.truncated.any() and not hf.truncated.all()  # both kinds of rows are exercised
        assert (hf.response_mask.sum(1) < hf.response_ids.shape[1]).any()  # some rows are padded

        ours = rollout_from_vllm(
            _as_vllm_outputs(hf, n, policy.stop_token_ids), samples, policy.processor, n,
            policy.stop_token_ids, policy.pad_token_id,
        )  # fmt: skip
        assert [s.id for s in ours.samples] == [s.id for s in hf.samples]
        for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated"):
            assert torch.equal(getattr(ours, name), getattr(hf, name)), name
        torch.testing.assert_close(ours.rollout_logprobs, hf.rollout_logprobs, atol=0, rtol=0)
        assert ours.vision_inputs.keys() == hf.vision_inputs.keys()
        for key in hf.vision_inputs:
            assert torch.equal(ours.vision_inputs[key], hf.vision_inputs[key]), key
        assert ours.texts == hf.texts
        assert (ours.images_per_row, ours.group_size) == (hf.images_per_row, hf.group_size)
        # The trainer recomputes the same log-probs on the converted batch.
        with torch.no_grad():
            recomputed, _ = response_logprobs(policy.model, ours, policy.blocked, T)
        torch.testing.assert_close(recomputed, ours.rollout_logprobs, atol=1e-5, rtol=0)
    finally:
        hook.remove()


def test_completion_tensors_by_hand():
    """Stop id 9, pad 0; two prompts, two completions each (given out of order)."""

    def comp(index, ids, lps, finish):
        return Completion(index, ids, [{t: Logprob(lp)} for t, lp in zip(ids, lps)], finish)

    outputs = [
        RequestOutput(
            [comp(1, [5, 6, 7], [-0.5, -0.6, -0.7], "length"), comp(0, [5, 9], [-0.1, -0.2], "stop")]
        ),
        RequestOutput([comp(0, [9], [-0.3], "stop"), comp(1, [4, 4, 9], [-1.0, -1.5, -2.0], "length")]),
    ]
    ids, mask, lps, truncated = completion_tensors(outputs, 2, [9], 0, greedy=False)
    assert ids.tolist() == [[5, 9, 0], [5, 6, 7], [9, 0, 0], [4, 4, 9]]
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    torch.testing.assert_close(
        lps, torch.tensor([[-0.1, -0.2, 0.0], [-0.5, -0.6, -0.7], [-0.3, 0.0, 0.0], [-1.0, -1.5, -2.0]])
    )
    # A stop token sampled at the length limit is a stop, as in the HF engine (vLLM says "length").
    assert truncated.tolist() == [False, True, False, False]


def test_greedy_outputs_are_the_hf_engines_greedy_batch(tiny_policy):
    """Greedy asks vLLM for one completion per prompt; the batch repeats it to G rows with zero
    log-probs, as the HF engine's greedy batch has."""
    samples = _multi_image_samples()
    hf = HFRolloutEngine.from_policy(tiny_policy).generate(
        samples, SamplingParams(n=2, greedy=True, max_new_tokens=5)
    )
    outputs = []
    for i in range(len(samples)):
        length = int(hf.response_mask[2 * i].sum())
        outputs.append(
            RequestOutput([Completion(0, hf.response_ids[2 * i, :length].tolist(), None, "length")])
        )
    ours = rollout_from_vllm(
        outputs,
        samples,
        tiny_policy.processor,
        2,
        tiny_policy.stop_token_ids,
        tiny_policy.pad_token_id,
        greedy=True,
    )
    for name in (
        "prompt_ids",
        "prompt_mask",
        "response_ids",
        "response_mask",
        "truncated",
        "rollout_logprobs",
    ):
        assert torch.equal(getattr(ours, name), getattr(hf, name)), name
    assert ours.texts == hf.texts and ours.group_size == 2 and not ours.rollout_logprobs.any()
    for key in hf.vision_inputs:
        assert torch.equal(ours.vision_inputs[key], hf.vision_inputs[key]), key


def test_greedy_outputs_have_zero_logprobs():
    outputs = [RequestOutput([Completion(0, [3, 9], None, "stop")])]
    ids, mask, lps, truncated = completion_tensors(outputs, 1, [9], 0, greedy=True)
    assert ids.tolist() == [[3, 9]] and mask.tolist() == [[1, 1]]
    assert lps.tolist() == [[0.0, 0.0]] and truncated.tolist() == [False]


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        ([RequestOutput([Completion(0, [3, 9], [{3: Logprob(-1.0)}, {9: Logprob(-1.0)}], "stop")])], "1 completions"),
        ([RequestOutput([Completion(0, [3], [{4: Logprob(-1.0)}], "length")] * 2)], "no log-prob for the sampled id 3"),
        ([RequestOutput([Completion(0, [3, 4], [{3: Logprob(-1.0)}], "length")] * 2)], "1 log-prob positions for 2"),
        ([RequestOutput([Completion(0, [9, 4], [{9: Logprob(-1.0)}, {4: Logprob(-1.0)}], "length")] * 2)], "ends it after 1"),
        ([RequestOutput([Completion(0, [3, 4], [{3: Logprob(-1.0)}, {4: Logprob(-1.0)}], "stop", "\n")] * 2)], "without a stop token"),
        ([RequestOutput([Completion(0, [3], [{3: Logprob(-1.0)}], "abort")] * 2)], "aborted"),
    ],
)  # fmt: skip
def test_outputs_that_do_not_fit_the_batch_are_errors(outputs, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        completion_tensors(outputs, 2, [9], 0, greedy=False)


def test_a_prompt_vllm_tokenized_differently_names_the_sample(tiny_policy):
    samples = _multi_image_samples()[:1]
    out = RequestOutput([Completion(0, [9], [{9: Logprob(-1.0)}], "stop")], prompt_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match=r"sample '0': vLLM's prompt \(3 tokens\) differs"):
        rollout_from_vllm([out], samples, tiny_policy.processor, 1, [9], 0)


# ---------------------------------------------------------------------------------------------
# Which weights are synced
# ---------------------------------------------------------------------------------------------


def _lora_model(rank: int = 4, alpha: float = 8.0):
    from mmrl.models.adapters import apply_lora

    cfg = Config()
    cfg.model.lora_rank, cfg.model.lora_alpha = rank, alpha
    model = apply_lora(build_tiny_vlm(TinyVLMSpec(), seed=0), cfg)
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_merged_lora_weights_equal_peft_merge_and_unload():
    model = _lora_model()
    spec = lora_spec(model)
    assert spec.rank == 4 and set(spec.scaling.values()) == {2.0}  # alpha / r
    merged = merged_weights(model.state_dict(), spec)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(merged[key], reference[key], atol=1e-6, rtol=0, msg=key)
    # The merge really changed the adapted layers (else the comparison proves little).
    base = build_tiny_vlm(TinyVLMSpec(), seed=0).state_dict()
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                        "gate_proj.weight", "up_proj.weight", "down_proj.weight")) for k in changed)  # fmt: skip


def test_adapter_weights_are_the_adapter_peft_saves():
    from peft import get_peft_model_state_dict

    model = _lora_model()
    ours = adapter_weights(model.state_dict(), lora_spec(model))
    peft = get_peft_model_state_dict(model)
    assert ours.keys() == peft.keys()
    for key in peft:
        assert torch.equal(ours[key], peft[key]), key


def test_sync_mode_picks_full_adapter_or_merged():
    plain = build_tiny_vlm(TinyVLMSpec(), seed=0)
    assert lora_spec(plain) is None
    assert sync_mode(None, True) == "full"
    assert weights_to_sync(plain.state_dict(), "full", None).keys() == plain.state_dict().keys()

    model = _lora_model()
    spec = lora_spec(model)
    assert engine_module.only_adapters_train(model)
    assert sync_mode(spec, True) == "adapter"
    assert sync_mode(spec, True, prefer="merged") == "merged"
    # A base part that trains too (the vision tower here) changes weights the adapter cannot carry.
    for name, p in model.named_parameters():
        if ".visual." in name:
            p.requires_grad_(True)
    assert not engine_module.only_adapters_train(model)
    assert sync_mode(spec, False) == "merged"
    with pytest.raises(ValueError, match="use 'merged'"):
        sync_mode(spec, False, prefer="adapter")


# ---------------------------------------------------------------------------------------------
# The engine's calls into vLLM, against a stand-in `vllm` module
# ---------------------------------------------------------------------------------------------


class RefusesCode(TypeError):
    """What vLLM V1 raises for a function passed to `collective_rpc` (msgpack, no pickle)."""


class TensorInRpc(AssertionError):
    """A tensor in an RPC message: vLLM's engine core would hand the worker a list instead."""


class ChangedInRpc(AssertionError):
    """Something in an RPC message that msgpack does not give back as it was (a tuple, ...)."""


def vllm_rpc_roundtrip(args: tuple) -> list:
    """An RPC's arguments as vLLM V1's engine core hands them to the workers: encoded with
    msgpack (msgspec, as vLLM's `MsgpackEncoder`; without VLLM_ALLOW_INSECURE_SERIALIZATION
    anything msgpack cannot write is refused) and decoded by an untyped decoder (vLLM's
    `MsgpackDecoder()` without a type: nothing is rebuilt, so a tensor would arrive as its
    `[dtype, shape, buffer]` list and a tuple as a list). Stricter than vLLM in one way: a
    tensor is an error here instead of arriving mangled, and so is anything that arrives
    changed."""
    import msgspec
    import numpy as np

    def enc_hook(obj):
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            raise TensorInRpc(f"a {type(obj).__name__} {tuple(obj.shape)} in an RPC message")
        if callable(obj):
            raise RefusesCode("a function in collective_rpc needs VLLM_ALLOW_INSECURE_SERIALIZATION=1")
        raise TypeError(f"Object of type {type(obj)} is not serializable")

    encoded = msgspec.msgpack.Encoder(enc_hook=enc_hook).encode(list(args))
    decoded = msgspec.msgpack.Decoder().decode(encoded)
    _same(list(args), decoded, "args")
    return decoded


def _same(sent, got, where: str) -> None:
    if type(sent) is not type(got):
        raise ChangedInRpc(f"{where}: sent a {type(sent).__name__}, the worker got a {type(got).__name__}")
    if isinstance(sent, list):
        if len(sent) != len(got):
            raise ChangedInRpc(f"{where}: {len(sent)} items sent, {len(got)} arrived")
        for i, (a, b) in enumerate(zip(sent, got)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(sent, dict):
        if list(sent) != list(got):
            raise ChangedInRpc(f"{where}: keys {list(sent)} sent, {list(got)} arrived")
        for key in sent:
            _same(sent[key], got[key], f"{where}[{key!r}]")
    elif sent != got:
        raise ChangedInRpc(f"{where}: {sent!r} sent, {got!r} arrived")


class FakeVllmModel:
    """vLLM's model inside a worker: `load_weights(weights=[(name, tensor), ...])`, here into an
    HF copy; records what it was given."""

    def __init__(self, hf: torch.nn.Module, dtype: torch.dtype, events: list):
        self.hf, self.dtype, self.loaded, self.events = hf, dtype, [], events

    def load_weights(self, weights):
        self.events.append(("load_weights", len(weights)))
        params = self.hf.state_dict()
        for name, tensor in weights:
            assert isinstance(tensor, torch.Tensor), (name, type(tensor))  # not an RPC-mangled list
            assert not tensor.is_floating_point() or tensor.dtype == self.dtype, (name, tensor.dtype)
            params[name].copy_(tensor)
            self.loaded.append(name)
        return {name for name, _ in weights}


class FakeNcclChannel:
    """The NCCL groups of a test: a broadcast from rank 0 reaches every other rank's queue."""

    def __init__(self):
        import queue
        import threading

        self.queues: dict[tuple[int, int], queue.Queue] = {}
        self.lock = threading.Lock()
        self.sent: list[tuple[int, torch.Size, torch.dtype]] = []  # (port, shape, dtype) of each

    def queue(self, port: int, rank: int):
        import queue

        with self.lock:
            return self.queues.setdefault((port, rank), queue.Queue())


class FakeStatelessProcessGroup:
    """`vllm.distributed.utils.StatelessProcessGroup`: who is who (no rendezvous needed here)."""

    def __init__(self, host, port, rank, world_size):
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int):
        assert isinstance(port, int) and isinstance(rank, int) and isinstance(world_size, int)
        return cls(host, port, rank, world_size)


def fake_pynccl(channel: FakeNcclChannel):
    class FakePyNcclCommunicator:
        """`PyNcclCommunicator.broadcast`: rank 0's tensor copied into every other rank's."""

        def __init__(self, group, device):
            self.group, self.device = group, device

        def broadcast(self, tensor, src, stream=None):
            g = self.group
            if g.rank == src:
                channel.sent.append((g.port, tensor.shape, tensor.dtype))
                for rank in range(g.world_size):
                    if rank != src:
                        channel.queue(g.port, rank).put(tensor.detach().clone())
            else:
                tensor.copy_(channel.queue(g.port, g.rank).get(timeout=60))

    return FakePyNcclCommunicator


class FakeEngine:
    """vLLM's `LLMEngine` loop: requests are added, and each `step` finishes one of them, the
    last added first (so outputs arrive out of prompt order, as vLLM's do)."""

    def __init__(self, llm: FakeLLM):
        self.llm, self.queue, self.position = llm, [], 0

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.llm.check_awake("add_request", {"weights", "kv_cache"})
        assert params.output_kind == RequestOutputKind.FINAL_ONLY
        assert isinstance(prompt, TokensPrompt) and "prompt" not in prompt, prompt.keys()  # no raw text dicts
        if not self.queue:
            self.position = 0
        self.queue.append((request_id, self.position, prompt, params, lora_request))
        self.llm.requests.append((prompt, params, lora_request))
        self.llm.events.append(("add_request", request_id))
        self.position += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.queue)

    def step(self):
        request_id, position, prompt, params, lora = self.queue.pop()
        self.llm.events.append(("step", request_id))
        out = self.llm.complete(position, prompt, params)
        out.request_id = request_id
        return [out]

    def abort_request(self, request_ids):
        self.llm.events.append(("abort", tuple(request_ids)))
        self.queue = [q for q in self.queue if q[0] not in request_ids]

    def remove_lora(self, lora_id):
        self.llm.events.append(("remove_lora", lora_id))


class FakeLLM:
    """Records the engine's calls. Its workers are built as vLLM builds them, with the class
    named by `worker_extension_cls` mixed in; they hold an HF copy of the model from the folder
    vLLM was given, which (without a scripted `reply`) samples the responses itself from the
    tempered softmax over the allowed ids, recording each token's log-prob.

    In-process (`distributed_executor_backend="external_launcher"`, which needs
    VLLM_ENABLE_V1_MULTIPROCESSING=0 when the LLM is built) its one worker's model is where an
    in-process vLLM keeps it. Every `collective_rpc` passes its arguments through
    `vllm_rpc_roundtrip`, as vLLM's engine core process receives them: never by reference."""

    def __init__(self, kwargs: dict):
        import importlib

        self.kwargs, self.events, self.requests, self.reply = kwargs, [], [], None
        self.rpc_methods: list[str] = []
        self.asleep: set[str] = set()
        self.inprocess = kwargs.get("distributed_executor_backend") == "external_launcher"
        if self.inprocess:
            assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", (
                "in-process needs V1 multiprocessing off"
            )
            assert kwargs["tensor_parallel_size"] == 1
            assert os.environ.get("RANK") and os.environ.get("WORLD_SIZE") and os.environ.get("MASTER_PORT")
        self.llm_engine = FakeEngine(self)
        self.policy = load_policy(kwargs["model"])  # the weights vLLM loads from the folder
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[kwargs["dtype"]]
        module, name = kwargs["worker_extension_cls"].rsplit(".", 1)
        extension = getattr(importlib.import_module(module), name)
        worker_cls = type("FakeWorker", (extension,), {})  # vLLM: the extension as a base class
        self.workers = []
        for rank in range(kwargs["tensor_parallel_size"]):
            worker = worker_cls()
            worker.rank, worker.device = rank, torch.device("cpu")
            model = FakeVllmModel(self.policy.model, self.dtype, self.events)
            worker.model_runner = types.SimpleNamespace(model=model)
            self.workers.append(worker)
        if self.inprocess:  # where an in-process vLLM keeps its model (TRL's colocate mode reads it)
            self.llm_engine.model_executor = types.SimpleNamespace(
                driver_worker=types.SimpleNamespace(model_runner=self.workers[0].model_runner)
            )

    def check_awake(self, what: str, parts: set[str]) -> None:
        if self.asleep & parts:
            raise AssertionError(f"{what} while {sorted(self.asleep & parts)} asleep")

    def sleep(self, level: int = 1) -> None:
        self.events.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}
        if level == 2:  # the weights are dropped
            with torch.no_grad():
                for p in self.policy.model.parameters():
                    p.zero_()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.events.append(("wake_up", tags))
        self.asleep -= set(tags) if tags is not None else set(self.asleep)

    def reset_prefix_cache(self) -> None:
        self.events.append(("reset_prefix_cache",))

    def reset_encoder_cache(self) -> None:
        self.events.append(("reset_encoder_cache",))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if not isinstance(method, str):
            raise RefusesCode("a function in collective_rpc needs VLLM_ALLOW_INSECURE_SERIALIZATION=1")
        assert not kwargs, "mmrl passes RPC arguments positionally"
        received = vllm_rpc_roundtrip(tuple(args))
        if method == "mmrl_receive_weights" or method == "mmrl_init_weight_group":
            self.check_awake("collective_rpc", {"weights"} if method == "mmrl_receive_weights" else set())
        self.events.append(("collective_rpc", method))
        self.rpc_methods.append(method)
        # Each worker gets its own decoded copy, as each worker process would.
        return [getattr(w, method)(*copy.deepcopy(received)) for w in self.workers]

    def complete(self, position: int, prompt: dict, params) -> RequestOutput:
        if self.reply is not None:
            return copy.deepcopy(self.reply[position])
        return self._sample(prompt, params)

    @torch.no_grad()
    def _sample(self, prompt: dict, params) -> RequestOutput:
        """n completions of one prompt with HF `generate` (only the temperature and the blocked
        ids shape the distribution, as in mmrl's HF engine); each sampled token's log-prob is
        computed from the raw logits as the trainer computes it."""
        from transformers import LogitsProcessorList

        from mmrl.algos.logprobs import masked_logits, token_logprobs
        from mmrl.rollout.hf import _SAMPLING_SHAPERS, _BlockTokens

        model, processor = self.policy.model, self.policy.processor
        images = prompt.get("multi_modal_data", {}).get("image")
        text = processor.tokenizer.decode(prompt["prompt_token_ids"])  # (vLLM expands the ids itself)
        inputs = processor(text=[text], images=images, return_tensors="pt")
        vocab = model.get_output_embeddings().weight.shape[0]
        blocked = torch.ones(vocab, dtype=torch.bool)
        blocked[params.allowed_token_ids] = False
        greedy = params.temperature == 0
        out = model.generate(
            **inputs, do_sample=not greedy, temperature=None if greedy else params.temperature,
            **dict.fromkeys(_SAMPLING_SHAPERS), num_return_sequences=params.n,
            max_new_tokens=params.max_tokens, logits_processor=LogitsProcessorList([_BlockTokens(blocked)]),
            eos_token_id=params.stop_token_ids, pad_token_id=self.policy.pad_token_id,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
        tokens = out.sequences[:, inputs["input_ids"].shape[1] :]  # [n, T]
        raw = torch.stack(out.logits, dim=1)  # [n, T, V]
        lps = token_logprobs(masked_logits(raw, blocked, 1.0 if greedy else params.temperature), tokens)
        completions = []
        for index in range(params.n):
            ids, finish = tokens[index].tolist(), "length"
            stops = [t for t, tok in enumerate(ids) if tok in params.stop_token_ids]
            if stops:
                ids, finish = ids[: stops[0] + 1], "stop"
            positions = None
            if params.logprobs is not None:
                positions = [{tok: Logprob(float(lps[index, t]))} for t, tok in enumerate(ids)]
            completions.append(
                Completion(index, ids, positions, finish, ids[-1] if finish == "stop" else None)
            )
        return RequestOutput(completions, inputs["input_ids"][0].tolist())


class RequestOutputKind:
    CUMULATIVE, DELTA, FINAL_ONLY = 0, 1, 2


class TokensPrompt(dict):
    """vLLM's `TokensPrompt` (a TypedDict: a dict with `prompt_token_ids`, `multi_modal_data`)."""


class Made(list):
    """The LLMs a test made, and the fake NCCL channel their weights went through."""

    channel: FakeNcclChannel


@pytest.fixture()
def fake_vllm(monkeypatch):
    """A `vllm` module with LLM, SamplingParams, TokensPrompt, LoRARequest and the NCCL pieces
    of weight sync, recording what they get. This process stands in for the trainer's GPU
    process; its "GPU" is not one of the workers'."""
    made = Made()
    vllm = types.ModuleType("vllm")

    def LLM(**kwargs):
        llm = FakeLLM(kwargs)
        made.append(llm)
        return llm

    vllm.LLM = LLM
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    sampling_params = types.ModuleType("vllm.sampling_params")
    sampling_params.RequestOutputKind = RequestOutputKind
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = TokensPrompt
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")

    @dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str

    request.LoRARequest = LoRARequest
    vllm.__version__ = engine_module.MIN_VLLM
    channel = FakeNcclChannel()
    utils = types.ModuleType("vllm.distributed.utils")
    utils.StatelessProcessGroup = FakeStatelessProcessGroup
    pynccl = types.ModuleType("vllm.distributed.device_communicators.pynccl")
    pynccl.PyNcclCommunicator = fake_pynccl(channel)
    modules = {"vllm": vllm, "vllm.sampling_params": sampling_params, "vllm.inputs": inputs, "vllm.lora": lora,
               "vllm.lora.request": request, "vllm.distributed": types.ModuleType("vllm.distributed"),
               "vllm.distributed.utils": utils,
               "vllm.distributed.device_communicators": types.ModuleType("vllm.distributed.device_communicators"),
               "vllm.distributed.device_communicators.pynccl": pynccl}  # fmt: skip
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    for var in (
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.delenv(var, raising=False)  # (the engine sets them; restored after the test)
    monkeypatch.setattr(VLLMRolloutEngine, "_sending_device", lambda self: torch.device("cpu"))
    monkeypatch.setattr(engine_module, "device_uuid", lambda device: "GPU-of-the-trainer")
    made.channel = channel
    return made


def _reply(policy: Policy, samples: list[Sample], n: int) -> list[RequestOutput]:
    stop = policy.stop_token_ids[0]
    outputs = []
    for s in samples:
        inputs = encode_prompts(policy.processor, [s])
        comps = [
            Completion(j, [40 + j, stop], [{40 + j: Logprob(-1.0)}, {stop: Logprob(-0.5)}], "stop")
            for j in range(n)
        ]
        outputs.append(RequestOutput(comps, inputs["input_ids"][0].tolist()))
    return outputs


def _kinds(events) -> list[str]:
    return [e[0] for e in events]


def test_a_separate_engine_sleeps_after_each_batch_and_syncs_over_nccl(saved_policy, fake_vllm):
    """Tensor parallelism: the engine's workers are other processes. A sync tells them names,
    dtypes and shapes through the worker extension (by method name: a function would need vLLM
    V1's insecure serialisation) and broadcasts the tensors over NCCL."""
    cfg = load_config(overrides=["rollout.engine=vllm", "rollout.vllm_sleep_level=1", "rollout.vllm_gpu_memory_utilization=0.3",
                                 "trainer.seed=5", "model.dtype=float32", "rollout.vllm_tensor_parallel_size=2"])  # fmt: skip
    from mmrl.train.async_grpo import make_rollout_engine

    engine = make_rollout_engine(cfg, saved_policy)
    assert isinstance(engine, VLLMRolloutEngine) and engine.mode == "full"
    (llm,) = fake_vllm
    kw = llm.kwargs
    assert kw["model"] == str(saved_policy.model.name_or_path)
    assert (kw["gpu_memory_utilization"], kw["enable_sleep_mode"], kw["seed"]) == (0.3, True, 5)
    assert (kw["dtype"], kw["tensor_parallel_size"], kw["revision"]) == ("float32", 2, None)
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["worker_extension_cls"] == "mmrl.rollout.vllm_worker.WeightSyncExtension"
    assert "enable_lora" not in kw and "distributed_executor_backend" not in kw  # worker processes
    assert engine.weight_sync == "nccl"

    samples = make_samples(["colour_code"], 2, "train")
    llm.reply = _reply(saved_policy, samples, 2)
    seen = []
    batch = engine.generate(
        samples, SamplingParams(n=2, max_new_tokens=4), on_response=lambda r, t: seen.append(r)
    )
    assert batch.response_ids.shape == (4, 2) and batch.group_size == 2
    assert batch.rollout_logprobs.tolist() == [[-1.0, -0.5]] * 4
    assert sorted(seen) == [0, 1, 2, 3]
    prompts = [r[0] for r in llm.requests]
    assert len(prompts) == 2 and "multi_modal_data" in prompts[0]
    sampling, lora_request = llm.requests[0][1], llm.requests[0][2]
    assert lora_request is None
    assert (sampling.n, sampling.logprobs, sampling.max_tokens) == (2, 0, 4)

    # After the update: the trainer's new weights go into every worker's model.
    trained = {k: v + 0.01 for k, v in saved_policy.model.state_dict().items()}
    engine.load_weights(trained)
    for k, v in llm.policy.model.state_dict().items():
        assert torch.equal(v, trained[k]), k
    for worker in llm.workers:  # each tensor-parallel rank got every tensor, once
        assert sorted(worker.model_runner.model.loaded) == sorted(trained)
    assert len(fake_vllm.channel.sent) == len(trained)  # each broadcast once, over NCCL
    assert llm.rpc_methods[:2] == ["mmrl_device_uuid", "mmrl_init_weight_group"]  # the group, once
    llm.events.clear()
    engine.generate(samples, SamplingParams(n=2, max_new_tokens=4))
    engine.load_weights(trained)
    assert llm.events == [
        ("wake_up", None),  # the KV cache (the weights woke for the sync) for the next batch
        ("add_request", "mmrl-1-0"),
        ("add_request", "mmrl-1-1"),
        ("step", "mmrl-1-1"),
        ("step", "mmrl-1-0"),
        ("sleep", 1),  # the GPU is the trainer's while it updates
        ("wake_up", ["weights"]),  # weights back (KV cache still free) to take the new ones
        ("collective_rpc", "mmrl_receive_weights"),  # one bucket: its names, dtypes, shapes
        ("load_weights", len(trained)),  # worker 0 received the bucket and loaded it
        ("load_weights", len(trained)),  # worker 1
        ("reset_prefix_cache",),  # cached prefixes were computed with the old weights
        ("reset_encoder_cache",),  # so were cached image features
    ]
    with pytest.raises(KeyError, match="missing"):
        engine.load_weights({k: v for k, v in trained.items() if "lm_head" not in k})


def test_weights_go_in_buckets_of_host_tensors_in_the_engines_dtype():
    weights = {"a": torch.ones(4, 4), "b": torch.ones(2, dtype=torch.float64), "c": torch.arange(3),
               "d": torch.ones(8, 8)}  # fmt: skip
    buckets = list(engine_module.weight_buckets(weights.items(), torch.bfloat16, max_bytes=40))
    # a: 16 bf16 = 32 bytes; b: 4 bytes (fits beside a); c: int64 kept, 24 bytes (a new bucket);
    # d: 128 bytes, larger than a bucket: alone.
    assert [[name for name, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    dtypes = {name: t.dtype for b in buckets for name, t in b}
    assert dtypes == {"a": torch.bfloat16, "b": torch.bfloat16, "c": torch.int64, "d": torch.bfloat16}
    assert all(t.device.type == "cpu" and t.is_contiguous() for b in buckets for _, t in b)
    assert torch.equal(buckets[1][0][1], torch.arange(3))


def test_a_prompts_responses_reach_the_router_the_step_vllm_finishes_it(saved_policy, fake_vllm):
    """Streaming: each request's G responses go to `on_response` the step it finishes, before
    vLLM has finished the other prompts (so scoring overlaps generation); the texts are the
    batch's."""
    engine = VLLMRolloutEngine.from_policy(saved_policy, load_config(overrides=["model.dtype=float32"]))
    (llm,) = fake_vllm
    samples = make_samples(["colour_code"], 3, "train")
    llm.reply = _reply(saved_policy, samples, 2)
    texts = {}

    def on_response(row, text):
        llm.events.append(("on_response", row))
        texts[row] = text

    batch = engine.generate(samples, SamplingParams(n=2, max_new_tokens=4), on_response=on_response)
    order = [e for e in llm.events if e[0] in ("step", "on_response")]
    assert order == [
        ("step", "mmrl-0-2"), ("on_response", 4), ("on_response", 5),  # prompt 2 finishes first
        ("step", "mmrl-0-1"), ("on_response", 2), ("on_response", 3),
        ("step", "mmrl-0-0"), ("on_response", 0), ("on_response", 1),
    ]  # fmt: skip
    assert [texts[r] for r in range(6)] == batch.texts
    # Greedy (evaluation): one completion a prompt, handed over as each of its G rows.
    llm.reply = [
        RequestOutput([out.outputs[0]], out.prompt_token_ids) for out in _reply(saved_policy, samples, 1)
    ]
    rows = []
    greedy = engine.generate(samples, SamplingParams(n=2, greedy=True, max_new_tokens=4),
                             on_response=lambda r, t: rows.append((r, t)))  # fmt: skip
    assert sorted(rows) == sorted(enumerate(greedy.texts)) and len(rows) == 6


def test_a_failing_request_aborts_the_others_and_the_engine_sleeps(saved_policy, fake_vllm):
    engine = VLLMRolloutEngine.from_policy(saved_policy, load_config(overrides=["model.dtype=float32"]))
    (llm,) = fake_vllm
    samples = make_samples(["colour_code"], 3, "train")
    llm.reply = _reply(saved_policy, samples, 2)
    llm.reply[2].outputs[0].finish_reason = "abort"  # the first request to finish
    with pytest.raises(RuntimeError, match="aborted completion 0 of prompt 0"):
        engine.generate(samples, SamplingParams(n=2, max_new_tokens=4), on_response=lambda r, t: None)
    assert ("abort", ("mmrl-0-0", "mmrl-0-1")) in llm.events
    assert llm.events[-1] == ("sleep", 1) and not llm.llm_engine.queue


def test_a_function_sent_to_the_workers_is_refused_by_the_stand_in(saved_policy, fake_vllm):
    """The stand-in refuses pickled code as vLLM V1 does, so the sync tests above would fail if
    the engine sent a function instead of the extension method's name."""
    VLLMRolloutEngine.from_policy(saved_policy)
    (llm,) = fake_vllm
    with pytest.raises(RefusesCode):
        llm.collective_rpc(lambda worker: None)


def test_sleep_level_zero_never_sleeps(saved_policy, fake_vllm):
    cfg = load_config(overrides=["rollout.vllm_sleep_level=0", "model.dtype=float32"])
    engine = VLLMRolloutEngine.from_policy(saved_policy, cfg)
    (llm,) = fake_vllm
    assert llm.kwargs["enable_sleep_mode"] is False
    samples = make_samples(["colour_code"], 1, "train")
    llm.reply = _reply(saved_policy, samples, 1)
    engine.generate(samples, SamplingParams(n=1, max_new_tokens=4))
    engine.load_weights(saved_policy.model.state_dict())
    # In-process: straight into the model; never asleep, so the encoder cache would otherwise
    # serve image features of the old weights.
    assert _kinds(llm.events) == [
        "add_request",
        "step",
        "load_weights",
        "reset_prefix_cache",
        "reset_encoder_cache",
    ]


def test_sleep_level_two_sends_the_last_weights_again_before_generating(saved_policy, fake_vllm):
    """Level 2 drops the weights: a batch generated without a sync in between (the asynchronous
    generator reuses a version) must first get the last synced weights back."""
    cfg = load_config(overrides=["rollout.vllm_sleep_level=2", "model.dtype=float32"])
    engine = VLLMRolloutEngine.from_policy(saved_policy, cfg)
    (llm,) = fake_vllm
    samples = make_samples(["colour_code"], 1, "train")
    llm.reply = _reply(saved_policy, samples, 1)
    params = SamplingParams(n=1, max_new_tokens=4)
    engine.generate(samples, params)  # the weights vLLM loaded from the folder
    with pytest.raises(RuntimeError, match="before any weights were loaded"):
        engine.generate(samples, params)
    trained = {k: v + 0.01 for k, v in saved_policy.model.state_dict().items()}
    engine.load_weights(trained)
    engine.generate(samples, params)  # the fake's level-2 sleep zeroes the weights after it
    llm.events.clear()
    engine.generate(samples, params)
    assert _kinds(llm.events) == [
        "wake_up", "load_weights", "reset_prefix_cache", "reset_encoder_cache", "wake_up", "add_request", "step",
        "sleep",
    ]  # fmt: skip
    llm.wake_up()
    engine.load_weights(trained)  # (to read the weights back, awake)
    assert all(torch.equal(v, trained[k]) for k, v in llm.policy.model.state_dict().items())


def test_a_hub_id_is_passed_to_vllm_with_its_revision(saved_policy, fake_vllm, monkeypatch):
    """vLLM loads a hub id itself (at `model.revision`); only a name that is neither a folder
    nor a hub id is refused."""
    folder = str(saved_policy.model.name_or_path)
    monkeypatch.setattr(FakeLLM, "__init__", lambda self, kwargs: setattr(self, "kwargs", kwargs))
    saved_policy.model.name_or_path = "Qwen/Qwen2.5-VL-3B-Instruct"
    cfg = load_config(overrides=["model.revision=abc123", "model.dtype=bfloat16"])
    VLLMRolloutEngine.from_policy(saved_policy, cfg)
    kw = fake_vllm[-1].kwargs
    assert (kw["model"], kw["tokenizer"], kw["revision"], kw["tokenizer_revision"], kw["dtype"]) == (
        "Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct", "abc123", "abc123", "bfloat16",
    )  # fmt: skip
    for bad in ("", "not a/valid/id", folder + "/missing"):
        saved_policy.model.name_or_path = bad
        with pytest.raises(ValueError, match="neither"):
            VLLMRolloutEngine.from_policy(saved_policy, cfg)


def test_a_lora_policy_syncs_its_adapters_as_a_new_lora_request(tmp_path, fake_vllm):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from mmrl.models.adapters import apply_lora

    spec = TinyVLMSpec()
    build_tiny_vlm(spec, seed=0).save_pretrained(tmp_path / "base")
    build_processor(spec).save_pretrained(tmp_path / "base")
    policy = load_policy(tmp_path / "base")
    cfg = Config()
    cfg.model.lora_rank = 4
    policy = make_policy(apply_lora(policy.model, cfg), policy.processor)
    cfg.rollout.vllm_sleep_level = 2
    with pytest.raises(ValueError, match="use rollout.vllm_sleep_level=1"):
        VLLMRolloutEngine.from_policy(policy, cfg)
    cfg.rollout.vllm_sleep_level = 1
    engine = VLLMRolloutEngine.from_policy(policy, cfg)
    (llm,) = fake_vllm
    assert engine.mode == "adapter"
    assert (llm.kwargs["enable_lora"], llm.kwargs["max_lora_rank"]) == (True, 8)  # rank 4, rounded up

    samples = make_samples(["colour_code"], 1, "train")
    llm.reply = _reply(policy, samples, 1)
    folders = []
    for version in (1, 2):
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        engine.load_weights(policy.model.state_dict())
        engine.generate(samples, SamplingParams(n=1, max_new_tokens=4))
        request = llm.requests[-1][2]
        assert (request.lora_int_id, request.lora_name) == (version, f"mmrl-v{version}")
        folder = Path(request.lora_path)
        saved = load_file(folder / "adapter_model.safetensors")
        expected = get_peft_model_state_dict(policy.model)
        assert saved.keys() == expected.keys()
        assert all(torch.equal(saved[k], expected[k]) for k in expected)
        assert (folder / "adapter_config.json").exists()
        folders.append(folder)
    assert not folders[0].exists()  # the previous adapter is gone
    assert ("remove_lora", 1) in llm.events  # vLLM forgets the previous adapter
    assert "collective_rpc" not in _kinds(llm.events) and "load_weights" not in _kinds(
        llm.events
    )  # adapters only
    assert _kinds(llm.events).count("reset_encoder_cache") == 2  # after each adapter sync too
    engine.close()
    assert not folders[1].exists()


def _state_with_buffers(policy) -> dict[str, torch.Tensor]:
    """The policy's weights, plus an int64 and a bool tensor (buffers of other models)."""
    return {**policy.model.state_dict(), "counts": torch.arange(3), "flags": torch.tensor([True, False])}


def test_every_rpc_message_mmrl_sends_arrives_unchanged_through_vllms_msgpack(saved_policy, fake_vllm):
    """Both weight syncs, driven end to end against the stand-in whose every `collective_rpc`
    goes through `vllm_rpc_roundtrip` (msgpack, decoded untyped as vLLM's engine core does):
    each message arrives unchanged and none holds a tensor; every method of the worker
    extension was called that way; the tensors went over the (fake) NCCL group, not the RPC."""
    from mmrl.rollout.vllm_worker import WeightSyncExtension

    samples = make_samples(["colour_code"], 1, "train")
    trained = {k: v + 0.01 for k, v in saved_policy.model.state_dict().items()}
    for tp in (2, 1):
        cfg = load_config(overrides=["model.dtype=float32", f"rollout.vllm_tensor_parallel_size={tp}"])
        engine = VLLMRolloutEngine.from_policy(saved_policy, cfg)
        llm = fake_vllm[-1]
        llm.reply = _reply(saved_policy, samples, 1)
        for _ in range(2):
            engine.generate(samples, SamplingParams(n=1, max_new_tokens=4))
            engine.load_weights(trained)
        assert all(torch.equal(v, trained[k]) for k, v in llm.policy.model.state_dict().items())
        if tp == 2:
            methods = {m for m in vars(WeightSyncExtension) if m.startswith("mmrl_")}
            assert set(llm.rpc_methods) == methods, llm.rpc_methods
            assert llm.rpc_methods.count("mmrl_init_weight_group") == 1  # the group is made once
            assert len(fake_vllm.channel.sent) == 2 * len(trained)
        else:
            assert llm.rpc_methods == []  # in-process: no RPC at all
    # The messages themselves, with every dtype a state dict holds.
    for bucket in engine_module.weight_buckets(
        _state_with_buffers(saved_policy).items(), torch.bfloat16, 4096
    ):
        message = engine_module.sync_message(bucket)
        assert vllm_rpc_roundtrip((message,)) == [message]
        assert message["dtypes"][0] in ("bfloat16", "int64", "bool")


def test_the_round_trip_refuses_tensors_and_flags_what_msgpack_changes():
    """What the previous sync sent (name, tensor pairs) fails the round trip, as it failed in
    vLLM; so would a tuple (it arrives as a list) or a function; `plain` refuses them before
    anything is sent."""
    old_payload = [("lm_head.weight", torch.ones(2, 2))]
    with pytest.raises(TensorInRpc):
        vllm_rpc_roundtrip((old_payload,))
    with pytest.raises(ChangedInRpc, match="sent a tuple, the worker got a list"):
        vllm_rpc_roundtrip(({"shapes": [(2, 3)]},))
    with pytest.raises(RefusesCode):
        vllm_rpc_roundtrip((lambda worker: None,))
    assert vllm_rpc_roundtrip(({"names": ["a"], "shapes": [[2, 3]], "n": 1.5, "x": None},))
    with pytest.raises(TypeError, match=r"argument 0 of m\[0\]\[1\] is a Tensor"):
        engine_module.plain([["lm_head.weight", torch.ones(2)]], "argument 0 of m")
    with pytest.raises(TypeError, match=r"m\[0\] is a tuple"):
        engine_module.plain(old_payload, "m")
    with pytest.raises(TypeError, match="is a tuple"):
        engine_module.plain({"shape": (1, 2)})
    with pytest.raises(TypeError, match="int key"):
        engine_module.plain({1: "a"})


def test_an_inprocess_engine_is_built_in_this_process_and_loads_weights_into_its_model(
    saved_policy, fake_vllm
):
    engine = VLLMRolloutEngine.from_policy(saved_policy, load_config(overrides=["model.dtype=float32"]))
    (llm,) = fake_vllm
    assert engine.weight_sync == "inprocess" and llm.inprocess
    assert llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["WORLD_SIZE"] == "1"
    trained = {k: v - 0.02 for k, v in saved_policy.model.state_dict().items()}
    engine.load_weights(trained)
    assert all(torch.equal(v, trained[k]) for k, v in llm.policy.model.state_dict().items())
    assert llm.rpc_methods == [] and _kinds(llm.events)[-2:] == ["reset_prefix_cache", "reset_encoder_cache"]


def test_nccl_sync_refuses_a_gpu_the_engine_uses(saved_policy, fake_vllm, monkeypatch):
    monkeypatch.setattr(engine_module, "device_uuid", lambda device: "")  # the workers' "GPU" (the CPU)
    cfg = load_config(overrides=["model.dtype=float32", "rollout.vllm_weight_sync=nccl"])
    engine = VLLMRolloutEngine.from_policy(saved_policy, cfg)
    with pytest.raises(RuntimeError, match="NCCL cannot connect two ranks on one GPU"):
        engine.load_weights(saved_policy.model.state_dict())


def test_an_engine_without_reset_encoder_cache_is_refused(saved_policy, fake_vllm, monkeypatch):
    monkeypatch.delattr(FakeLLM, "reset_encoder_cache")
    with pytest.raises(ImportError, match="no LLM.reset_encoder_cache"):
        VLLMRolloutEngine.from_policy(saved_policy, load_config(overrides=["model.dtype=float32"]))


def test_lora_ranks_round_up_to_what_vllm_builds(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="mmrl.rollout.vllm"):
        got = [engine_module.vllm_lora_rank(r) for r in (1, 4, 8, 64, 65, 300, 320, 512)]
    assert got == [1, 8, 8, 64, 128, 320, 320, 512]
    assert "max_lora_rank 8 for LoRA rank 4" in caplog.text and "for LoRA rank 64" not in caplog.text
    with pytest.raises(ValueError, match="LoRA rank 513 .* above 512"):
        engine_module.vllm_lora_rank(513)
    with pytest.raises(ValueError, match="model.lora_rank=600 with rollout.engine=vllm"):
        load_config(overrides=["rollout.engine=vllm", "model.lora_rank=600"])
    assert load_config(overrides=["model.lora_rank=600"]).model.lora_rank == 600  # the HF engine merges


def test_weight_sync_settings():
    assert engine_module.weight_sync_mode("auto", 1) == "inprocess"
    assert engine_module.weight_sync_mode("auto", 2) == "nccl"
    assert engine_module.weight_sync_mode("nccl", 1) == "nccl"
    with pytest.raises(ValueError, match="tensor_parallel_size=2 use nccl"):
        engine_module.weight_sync_mode("inprocess", 2)
    with pytest.raises(ValueError, match="rollout.vllm_weight_sync must be auto, inprocess or nccl"):
        load_config(overrides=["rollout.vllm_weight_sync=rpc"])


# ---------------------------------------------------------------------------------------------
# Multi-turn: later turns from token ids (continue_rows)
# ---------------------------------------------------------------------------------------------


def _content(text: str) -> list[dict]:
    """Chat message parts of a text with `<image>` placeholders."""
    parts: list[dict] = []
    for i, piece in enumerate(text.split("<image>")):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _expanded_row(processor, images: list, turns: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """A multi-turn row as `continue_rows` gets it: (the ids with image tokens expanded by the HF
    processor, the ids of the same text unexpanded). `turns` are (role, text) with `<image>`
    placeholders; the generation prompt follows them."""
    messages = [{"role": role, "content": _content(text)} for role, text in turns]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expanded = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    return expanded["input_ids"][0].tolist(), processor.tokenizer(text)["input_ids"]


def test_collapsing_image_tokens_gives_one_placeholder_per_image_and_nothing_else_changes():
    """The tiny Qwen2-VL's processor expands each 64x64 image to 16 `<|image_pad|>`; collapsed,
    the ids are the template text's as the tokenizer reads it (what `vllm_prompts` sends)."""
    processor = build_processor(TinyVLMSpec())
    pad = engine_module.image_token_id(processor)
    assert pad == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    images = [Image.new("RGB", (64, 64), "red"), Image.new("RGB", (64, 64), "blue")]
    ids, unexpanded = _expanded_row(processor, images, [("user", "<image>first, <image>second")])
    assert ids.count(pad) == 32
    collapsed = engine_module.collapse_image_tokens(ids, pad, 2)
    assert collapsed.count(pad) == 2
    assert collapsed == unexpanded
    assert [t for t in collapsed if t != pad] == [t for t in ids if t != pad]  # the rest unchanged
    start, end = (
        processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>")
    )
    at = [i for i, t in enumerate(collapsed) if t == pad]
    assert all(collapsed[i - 1] == start and collapsed[i + 1] == end for i in at)
    text_only = [5, 6, 7]
    assert engine_module.collapse_image_tokens(text_only, pad, 0) == text_only
    for wrong in (1, 3):
        with pytest.raises(
            ValueError, match=rf"image tokens and images out of step: 2 runs .* {wrong} images"
        ):
            engine_module.collapse_image_tokens(ids, pad, wrong)
    with pytest.raises(ValueError, match="out of step: 0 runs .* 1 images"):
        engine_module.collapse_image_tokens(text_only, pad, 1)


def test_too_many_images_in_a_row_is_an_error_naming_the_setting():
    red = Image.new("RGB", (8, 8), "red")
    with pytest.raises(ValueError, match=r"row 1 holds 3 images, rollout\.vllm_max_images is 2"):
        engine_module.continuation_prompts([[1, 9, 2], [9, 3, 9, 4, 9]], [[red], [red] * 3], 9, 2)
    with pytest.raises(ValueError, match=r"row 0: image tokens and images out of step: 1 runs .* 2 images"):
        engine_module.continuation_prompts([[1, 9, 9, 2]], [[red, red]], 9, 2)
    (prompt,) = engine_module.continuation_prompts([[1, 2]], [[]], 9, 2)
    assert prompt == {"prompt_token_ids": [1, 2]}  # no multi_modal_data without images
    with pytest.raises(ValueError, match="must be >= 1"):
        load_config(overrides=["rollout.vllm_max_images=0"])


def _rows(processor) -> tuple[list[list[int]], list[list], list[list[int]]]:
    """Three rows after a tool call: two images in the prompt and one from the observation; text
    only; one image. (ids expanded, images, the same ids unexpanded)"""
    red, blue, green = (Image.new("RGB", (64, 64), c) for c in ("red", "blue", "green"))
    chats = [
        ([red, blue, green], [("user", "<image>first, <image>second: zoom?"), ("assistant", "zoom"),
                              ("user", "<image>the crop")]),
        ([], [("user", "What is 2 + 3?"), ("assistant", "calc"), ("user", "5")]),
        ([blue], [("user", "<image>colour?"), ("assistant", "look"), ("user", "blue")]),
    ]  # fmt: skip
    rows = [_expanded_row(processor, images, turns) for images, turns in chats]
    return [r[0] for r in rows], [images for images, _ in chats], [r[1] for r in rows]


def test_continue_rows_sends_one_placeholder_per_image_and_parses_each_rows_turn(saved_policy, fake_vllm):
    """What reaches vLLM for a later turn: per row one `TokensPrompt` (one completion), its ids
    with each image's run of tokens collapsed to one placeholder, its images in order; the
    scripted outputs come back as (new ids up to the stop token, their log-probs, truncated)."""
    cfg = load_config(overrides=["model.dtype=float32", "rollout.vllm_max_images=3"])
    engine = VLLMRolloutEngine.from_policy(saved_policy, cfg)
    (llm,) = fake_vllm
    assert llm.kwargs["limit_mm_per_prompt"] == {"image": 3}
    processor, stop = saved_policy.processor, saved_policy.stop_token_ids[0]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids, images, unexpanded = _rows(processor)
    llm.reply = [  # by the order the requests are added; vLLM finishes them out of order
        RequestOutput([Completion(0, [40, stop], [{40: Logprob(-1.0), 41: Logprob(-4.0)}, {stop: Logprob(-0.5)}],
                                  "stop", stop)], ids[0]),
        RequestOutput([Completion(0, [41, 42, 43], [{41: Logprob(-0.125)}, {42: Logprob(-0.25)}, {43: Logprob(-0.375)}],
                                  "length")], ids[1]),
        RequestOutput([Completion(0, [stop], [{stop: Logprob(-0.0625)}], "stop", stop)], None),
    ]  # fmt: skip
    out = engine.continue_rows(ids, images, SamplingParams(n=4, temperature=0.7, max_new_tokens=3))
    assert out == [
        ([40, stop], [-1.0, -0.5], False),
        ([41, 42, 43], [-0.125, -0.25, -0.375], True),  # (float32: exact in binary)
        ([stop], [-0.0625], False),
    ]
    prompts = [p for p, _, _ in llm.requests]
    for prompt, row, row_images, want in zip(prompts, ids, images, unexpanded):
        assert isinstance(prompt, TokensPrompt)
        assert prompt["prompt_token_ids"] == want  # the template text's ids: one placeholder an image
        assert row.count(pad) == 16 * len(row_images)  # (what vLLM would get without the collapse)
        assert prompt["prompt_token_ids"].count(pad) == len(row_images)
        if row_images:
            assert set(prompt) == {"prompt_token_ids", "multi_modal_data"}
            assert prompt["multi_modal_data"]["image"] == row_images  # the same images, in order
            assert all(a is b for a, b in zip(prompt["multi_modal_data"]["image"], row_images))
        else:
            assert set(prompt) == {"prompt_token_ids"}
    sampling = llm.requests[0][1]
    assert (sampling.n, sampling.temperature, sampling.max_tokens, sampling.logprobs) == (1, 0.7, 3, 0)
    assert sampling.stop_token_ids == saved_policy.stop_token_ids
    assert _kinds(llm.events) == ["add_request"] * 3 + ["step"] * 3 + ["sleep"]  # (vLLM starts awake)
    # vLLM must have expanded the images to the row's own ids (the trainer scores those).
    llm.reply[0].prompt_token_ids = ids[0][:-1]
    with pytest.raises(ValueError, match="row 0: vLLM expanded the images to a prompt of"):
        engine.continue_rows(ids, images, SamplingParams(max_new_tokens=3))


def test_continue_rows_refuses_a_row_over_the_image_limit_before_vllm_sees_it(saved_policy, fake_vllm):
    cfg = load_config(overrides=["model.dtype=float32", "rollout.vllm_max_images=2"])
    engine = VLLMRolloutEngine.from_policy(saved_policy, cfg)
    (llm,) = fake_vllm
    ids, images, _ = _rows(saved_policy.processor)
    llm.events.clear()
    with pytest.raises(ValueError, match=r"row 0 holds 3 images, rollout\.vllm_max_images is 2"):
        engine.continue_rows(ids, images, SamplingParams(max_new_tokens=3))
    assert llm.requests == [] and llm.events == []  # nothing woke, nothing was sent


def test_continue_rows_under_the_stand_in_is_the_hf_engines_greedy_turn(saved_policy, fake_vllm):
    """Unscripted, the stand-in decodes the collapsed ids, lets the HF processor expand them with
    the images (as vLLM's multimodal processor does) and generates; greedy, each row's turn is
    the HF engine's `continue_rows` for the same ids, and vLLM's expanded prompt is the row's."""
    engine = VLLMRolloutEngine.from_policy(saved_policy, load_config(overrides=["model.dtype=float32"]))
    hf = HFRolloutEngine.from_policy(saved_policy)
    ids, images, _ = _rows(saved_policy.processor)
    params = SamplingParams(greedy=True, max_new_tokens=4)
    for row, row_images in zip(ids, images):  # one row at a time: no padding between the two
        (ours,) = engine.continue_rows([row], [row_images], params)
        (theirs,) = hf.continue_rows([row], [row_images], params)
        assert ours == theirs and len(ours[0]) >= 1 and ours[1] == [0.0] * len(ours[0])


# ---------------------------------------------------------------------------------------------
# rollout.engine=vllm in the synchronous loop
# ---------------------------------------------------------------------------------------------


def test_the_synchronous_loop_generates_with_vllm_asleep_during_each_update(saved_policy, fake_vllm, tmp_path,
                                                                            monkeypatch):  # fmt: skip
    """`rollout.engine=vllm` with the default loop: every rollout and evaluation comes from the
    (stand-in) vLLM engine, in this process, which sleeps through each update and gets the new
    weights loaded into its model after it. The stand-in samples with the weights it was sent, so its
    log-probs equal the trainer's recomputation only if every sync arrived (a missed one after
    an update at this learning rate differs by ~1e-3)."""
    import mmrl.train.grpo as grpo

    updates = []
    real_update = grpo.update_policy

    def update_policy(*args, **kwargs):
        (llm,) = fake_vllm
        llm.events.append(("update",))
        updates.append(set(llm.asleep))  # what of vLLM sleeps while the trainer updates
        return real_update(*args, **kwargs)

    monkeypatch.setattr(grpo, "update_policy", update_policy)
    model_dir = Path(saved_policy.model.name_or_path)
    cfg = load_config(
        "vision_reasoning",
        overrides=[
            f"model.path={model_dir}", "model.dtype=float32", "rollout.engine=vllm",
            "trainer.total_steps=2", "trainer.prompts_per_step=2", "rollout.group_size=4",
            "rollout.max_new_tokens=16", "trainer.eval_size=2", "trainer.eval_every=2",
            "trainer.progress=false", "trainer.save_final=false", "reward.num_workers=0",
            "data.kinds=[ocr]", "data.num_train=8", "data.num_heldout=2", "optim.lr=1e-3",
            f"trainer.run_dir={tmp_path / 'run'}", "trainer.dump_steps=true",
        ],
    )  # fmt: skip
    from mmrl import compose

    assert compose.composition(cfg).make_trainee.__module__ == "mmrl.train.colocated"
    result = compose.train(cfg)
    assert result.steps == 2
    (llm,) = fake_vllm
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/kl_k1" in r]
    # Step 1's update changed the weights; step 2 sampled with them (the last sync left them in
    # vLLM's workers too).
    assert len(steps) == 2 and steps[0]["actor/grad_norm"] > 0
    assert all(abs(r["rollout/kl_k1"]) < 1e-5 for r in steps), [r["rollout/kl_k1"] for r in steps]
    start = load_policy(model_dir).model.state_dict()
    synced = llm.policy.model.state_dict()
    assert max(float((synced[k] - start[k]).abs().max()) for k in start) > 1e-4
    assert all(r["time/weight_sync_s"] >= 0 for r in steps)
    # Every update ran with all of vLLM asleep.
    assert len(updates) == 2 and all(u == {"weights", "kv_cache"} for u in updates)
    # The order within a step: generate (awake), sleep, update, wake the weights, sync.
    wake, wake_weights = ("wake_up", None), ("wake_up", ["weights"])
    events = [e[:2] if e[0] == "wake_up" else e[:1] for e in llm.events if e[0] in ("wake_up", "sleep", "update",
                                                                                  "load_weights")]  # fmt: skip
    sleep, update, sync = ("sleep",), ("update",), ("load_weights",)  # in-process: straight into the model
    step = [wake, sleep, update, wake_weights, sync]  # generate awake, sleep, update, new weights
    assert events == [
        sleep,  # the evaluation at step 0 (vLLM starts awake), then asleep
        wake_weights, sync,  # the weights the run starts from (a resumed run's)
        *step, *step,
        wake, sleep,  # the final evaluation, with the weights of the last sync
    ], events  # fmt: skip


def test_a_tensor_parallel_engine_needs_as_many_gpus_per_rollout_worker():
    # On Ray each rollout worker holds one vLLM engine on its own GPUs: TP 2 on 1 GPU is refused
    # before anything starts; TP 2 on 2 GPUs loads.
    ray_vllm = ["trainer.backend=ray", "rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=2"]
    with pytest.raises(ValueError, match="ray_gpus_per_actor must be >= rollout.vllm_tensor_parallel_size"):
        load_config(overrides=[*ray_vllm, "trainer.ray_gpus_per_actor=1"])
    assert (
        load_config(overrides=[*ray_vllm, "trainer.ray_gpus_per_actor=2"]).rollout.vllm_tensor_parallel_size
        == 2
    )


def test_a_vllm_older_than_the_floor_is_refused_naming_both_versions(monkeypatch):
    """pyproject declared vllm>=0.10.2 while every weight sync calls LLM.reset_encoder_cache
    (vLLM 0.16.0 on): an older vLLM is refused at import, before an engine starts."""
    from mmrl.rollout.vllm import MIN_VLLM, check_vllm_version, import_vllm

    assert MIN_VLLM == "0.16.0"
    for version in ("0.10.2", "0.15.1", "0.15.2.dev3+gabc"):
        with pytest.raises(
            ImportError, match=re.escape(f"vLLM {version} is installed; mmrl needs vllm>=0.16.0")
        ):
            check_vllm_version(version)
    for version in ("0.16.0", "0.16.0.dev7+gabc", "0.26.0"):
        check_vllm_version(version)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.12.0"))
    with pytest.raises(ImportError, match="0.12.0"):
        import_vllm()
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f'vllm = ["vllm>={MIN_VLLM}"]' in pyproject
