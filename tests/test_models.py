"""The tiny built-in models: real Qwen2-VL / Qwen2.5-VL architectures, offline, HF format."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrl.models.loading import load_policy
from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm
from mmrl.models.tokenizer import SPECIAL_TOKENS, build_byte_tokenizer


def test_byte_tokenizer_round_trips_any_text():
    tok = build_byte_tokenizer()
    text = "\\boxed{3} — naïve 数学 <answer>7</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(256, 256 + len(SPECIAL_TOKENS)))


def test_chat_template_places_vision_tokens():
    tok = build_byte_tokenizer()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("architecture", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_tiny_model_saves_and_reloads_offline_through_auto_classes(architecture, tmp_path):
    spec = TinyVLMSpec(architecture=architecture)
    model, processor = build_tiny_vlm(spec), build_processor(spec)
    n_params = sum(p.numel() for p in model.parameters())
    assert 300_000 < n_params < 1_000_000
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)

    policy = load_policy(tmp_path)
    assert isinstance(policy.processor, type(AutoProcessor.from_pretrained(tmp_path)))
    assert type(policy.model) is type(AutoModelForImageTextToText.from_pretrained(tmp_path))
    # A 64x64 image is (64 / 8 / 2)^2 = 16 language-model tokens.
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    text = policy.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = policy.processor(text=[text], images=[Image.new("RGB", (64, 64))], return_tensors="pt")
    image_id = policy.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == image_id).sum()) == 16
    with torch.no_grad():
        reloaded = policy.model(**inputs).logits
        original = model(**inputs).logits
    torch.testing.assert_close(reloaded, original)


def test_blocked_tokens_cover_vision_and_structural_specials_but_not_the_stop_token(tiny_policy):
    tok = tiny_policy.processor.tokenizer
    blocked = {i for i in range(len(tiny_policy.blocked)) if tiny_policy.blocked[i]}
    for name in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>"):
        assert tok.convert_tokens_to_ids(name) in blocked
    assert tok.convert_tokens_to_ids("<|im_end|>") in tiny_policy.stop_token_ids
    assert tok.convert_tokens_to_ids("<|im_end|>") not in blocked
    assert not any(i < 256 for i in blocked)  # every byte can be sampled


def test_load_policy_names_a_folder_that_is_not_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_policy(tmp_path)


@pytest.mark.parametrize("architecture", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_every_family_rolls_out_and_recomputes_the_same_logprobs_with_multi_image_prompts(architecture):
    """Any AutoModelForImageTextToText goes through the same rollout and log-prob code,
    including prompts with several images (and rows with different numbers of images)."""
    from mmrl.models.loading import make_policy
    from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
    from mmrl.train.batching import select_rows
    from mmrl.train.forward import response_logprobs
    from mmrl.types import RewardSpec, Sample

    spec = TinyVLMSpec(architecture=architecture)
    policy = make_policy(build_tiny_vlm(spec, seed=2), build_processor(spec))
    red, blue = Image.new("RGB", (64, 64), "red"), Image.new("RGB", (64, 64), "blue")

    def sample(i, images, text):
        return Sample(
            "multi",
            [{"role": "user", "content": text}],
            images,
            "math",
            RewardSpec("1", "math"),
            {"id": str(i)},
        )

    samples = [
        sample(0, [red, blue], "<image>first, <image>second: which is red?"),
        sample(1, [blue], "<image>colour?"),
        sample(2, [blue, red, red], "<image><image><image>count red"),
    ]
    engine = HFRolloutEngine.from_policy(policy)
    batch = engine.generate(samples, SamplingParams(n=2, max_new_tokens=6))
    assert batch.images_per_row == [2, 2, 1, 1, 3, 3]
    with torch.no_grad():
        full, _ = response_logprobs(policy.model, batch, policy.blocked, 1.0)
        part, _ = response_logprobs(policy.model, select_rows(batch, [4, 1]), policy.blocked, 1.0)
    torch.testing.assert_close(full, batch.rollout_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(part, batch.rollout_logprobs[[4, 1]], atol=1e-5, rtol=0)


def test_building_the_builtin_base_leaves_the_random_generators_as_they_were(
    tmp_path, monkeypatch, tiny_policy
):
    # The warm-up draws from the global generators; a run must sample the same whether its base
    # was built just now or found in the cache. (The warm-up itself is replaced by a quick one
    # that draws as the real one does.)
    import random

    import numpy as np

    from mmrl.config import load_config
    from mmrl.models import base

    def quick_warm_up(cfg):
        torch.rand(100), np.random.rand(10), random.random()
        return tiny_policy, {"validation_accuracy": 0.0}

    monkeypatch.setattr(base, "warm_up", quick_warm_up)
    cfg = load_config("vision_reasoning", overrides=[f"model.cache_dir={tmp_path}"])
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    path = base.builtin_base(cfg)  # built
    after_build = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    assert base.builtin_base(cfg) == path  # found in the cache
    after_cache = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(after_build[0], after_cache[0])
    assert np.array_equal(after_build[1], after_cache[1]) and after_build[2] == after_cache[2]


def test_processes_that_need_the_same_base_at_once_build_it_once(tmp_path, monkeypatch, tiny_policy):
    # Two callers (here threads; test workers or runs on one node in practice) ask for the same
    # missing base together: the file lock lets one warm up while the other waits, then finds it.
    import threading
    import time

    from mmrl.config import load_config
    from mmrl.models import base

    builds = []

    def slow_warm_up(cfg):
        builds.append(threading.get_ident())
        time.sleep(1.0)  # the other caller arrives while this one is still building
        return tiny_policy, {"validation_accuracy": 0.0}

    monkeypatch.setattr(base, "warm_up", slow_warm_up)
    cfg = load_config("vision_reasoning", overrides=[f"model.cache_dir={tmp_path}"])
    start = threading.Barrier(2)
    paths = []

    def ask():
        start.wait()
        paths.append(base.builtin_base(cfg))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert len(paths) == 2 and paths[0] == paths[1] and (paths[0] / "warmup.json").exists()


# --- saving without DeepSpeed (mmrl.models.saving) ------------------------------------------------
def test_a_training_process_saves_a_model_without_importing_deepspeed(tmp_path):
    """transformers' save_pretrained asks accelerate to unwrap the model, which imported DeepSpeed
    only to check for a DeepSpeedEngine (1.5 CPU-seconds and a console line at the first save of
    every run, measured). After the training entry points' call, a save leaves DeepSpeed out and
    the folder loads back."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from mmrl.models.saving import skip_unused_deepspeed_probe\n"
        "from mmrl.models.tiny import TinyVLMSpec, build_tiny_vlm\n"
        "skip_unused_deepspeed_probe()\n"
        f"build_tiny_vlm(TinyVLMSpec(), seed=0).save_pretrained({str(tmp_path / 'model')!r})\n"
        "print('deepspeed' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False"]  # and no DeepSpeed line (it prints to stdout)
    assert AutoModelForImageTextToText.from_pretrained(tmp_path / "model") is not None


def test_with_deepspeed_imported_accelerate_is_asked_as_before(monkeypatch):
    """A model can be a DeepSpeedEngine only once DeepSpeed is imported: then accelerate's own
    answer is used, so an engine is still unwrapped."""
    import importlib.machinery
    import importlib.util
    import sys
    import types

    from accelerate.utils import imports, other

    from mmrl.models.saving import skip_unused_deepspeed_probe

    installed = "deepspeed" in sys.modules or importlib.util.find_spec("deepspeed") is not None
    assert imports.is_deepspeed_available() is installed
    monkeypatch.setattr(other, "is_deepspeed_available", other.is_deepspeed_available)  # undone after
    skip_unused_deepspeed_probe()
    skip_unused_deepspeed_probe()  # idempotent: one wrapper, not two
    assert other.is_deepspeed_available.mmrl_imported_only
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    assert other.is_deepspeed_available() is False
    stub = types.ModuleType("deepspeed")  # as if imported (importing it costs 1.5 s)
    stub.__spec__ = importlib.util.find_spec("deepspeed") or importlib.machinery.ModuleSpec("deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed", stub)
    assert other.is_deepspeed_available() is installed


def test_the_base_warm_up_validations_change_nothing_it_learns(tmp_path):
    """Validating the base every 2 steps or only at its end gives the same weights, bit for bit
    (greedy validations draw from no generator the warm-up uses): what lets the LLaVA and
    detection learning tests pin their bases' warm-ups to the step their default ones stop at and
    validate once (tests/test_vlm_families.py, tests/test_detection_training.py)."""
    from mmrl.config import load_config
    from mmrl.models.base import warm_up

    states = []
    for every in (2, 6):
        cfg = load_config(
            "vision_reasoning",
            overrides=[
                "model.warmup.max_steps=6", f"model.warmup.eval_every={every}", "model.warmup.eval_size=8",
                "model.warmup.target_accuracy=1.1", "model.warmup.batch_size=8", "trainer.progress=false",
                "reward.num_workers=0",
            ],
        )  # fmt: skip
        policy, report = warm_up(cfg)
        assert [h["step"] for h in report["history"]] == list(range(every, 7, every))
        states.append(policy.model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
