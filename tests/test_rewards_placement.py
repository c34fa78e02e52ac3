"""Sharing the accelerator: reward models leave for the policy's update and come back to score.

On this CPU machine `accelerator="cpu", host="cpu"`: the same code paths (real `to()` calls)
with devices as configuration; on a GPU machine the cuda test runs the real move.
"""

from __future__ import annotations

import pytest
import torch

from mmrl.rewards import get_reward_model
from mmrl.rewards.placement import RewardPlacement
from mmrl.rewards.testing import TINY_OPEN_CLIP_CONFIG, save_random_aesthetic_head, save_tiny_open_clip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    return {
        "clip": save_tiny_open_clip(root / "clip"),
        "head": save_random_aesthetic_head(root / "head.pth", TINY_OPEN_CLIP_CONFIG["embed_dim"]),
    }


def _models(files, device="cpu"):
    return {
        "aesthetic": get_reward_model(
            "aesthetic", clip_model=str(files["clip"]), head_weights=files["head"], device=device
        ),
        "clip_score": get_reward_model("clip_score", clip_model=str(files["clip"]), device=device),
        "jpeg": get_reward_model("jpeg_compressibility"),
    }


def _scores(models, images, prompts):
    return {name: m.score(images=images, prompts=prompts) for name, m in models.items()}


def _update(policy: torch.nn.Module, device) -> None:
    """One AdamW step of a stand-in policy on the accelerator."""
    policy.to(device)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    loss = policy(torch.randn(4, 16, device=device)).pow(2).mean()
    loss.backward()
    opt.step()


def _run_update_cycle(files, accelerator):
    models = _models(files, accelerator)
    images = torch.rand(3, 3, 40, 40, generator=torch.Generator().manual_seed(0))
    prompts = ["a", "b", "c"]
    aesthetic_bytes = models["aesthetic"].memory_bytes()
    # Room for the aesthetic predictor only: clip_score must make way for the update.
    placement = RewardPlacement(models, accelerator=accelerator, host="cpu", budget_bytes=aesthetic_bytes)
    assert placement.resident == ["aesthetic"] and placement.offloaded == ["clip_score"]

    with placement.scoring():
        before = _scores(models, images, prompts)
    with placement.training():
        assert placement.location == {"aesthetic": "accelerator", "clip_score": "host", "jpeg": "host"}
        assert models["clip_score"].device == torch.device("cpu")
        assert models["aesthetic"].device.type == torch.device(accelerator).type
        _update(torch.nn.Linear(16, 16), accelerator)
    with placement.scoring():
        assert models["clip_score"].device.type == torch.device(accelerator).type
        after = _scores(models, images, prompts)
    assert after == before  # bit-identical: moving does not change the weights

    moves = [(e.model, e.src, e.dst, e.reason) for e in placement.events]
    assert moves == [
        ("aesthetic", "accelerator", "accelerator", "initial"),
        ("clip_score", "accelerator", "accelerator", "initial"),
        ("clip_score", "accelerator", "host", "update"),
        ("clip_score", "host", "accelerator", "scoring"),
    ]
    assert [e.bytes for e in placement.events[2:]] == [models["clip_score"].memory_bytes()] * 2
    return placement, models


def test_models_leave_and_return_around_an_update(files):
    placement, models = _run_update_cycle(files, "cpu")
    report = placement.report()
    assert report["clip_score"] == {
        "bytes": models["clip_score"].memory_bytes(),
        "device": "cpu",
        "location": "accelerator",
        "resident": False,
    }
    assert report["jpeg"]["bytes"] == 0 and report["jpeg"]["resident"]
    metrics = placement.metrics()
    assert (
        metrics["reward_models/resident/aesthetic"] == 1.0
        and metrics["reward_models/resident/clip_score"] == 0.0
    )
    assert metrics["reward_models/moves"] == 2.0
    assert metrics["reward_models/memory_mb/clip_score"] == pytest.approx(
        models["clip_score"].memory_bytes() / 1e6
    )
    # A second cycle moves again, in the same order.
    with placement.training():
        pass
    with placement.scoring():
        pass
    assert [(e.model, e.reason) for e in placement.events[4:]] == [
        ("clip_score", "update"),
        ("clip_score", "scoring"),
    ]


def test_memory_is_parameters_and_buffers(files):
    models = _models(files)
    clip = models["clip_score"].clip.module
    by_hand = sum(t.numel() * t.element_size() for t in [*clip.parameters(), *clip.buffers()])
    assert models["clip_score"].memory_bytes() == by_hand > 1_000_000
    assert models["aesthetic"].memory_bytes() == by_hand + sum(
        p.numel() * 4 for p in models["aesthetic"].head.parameters()
    )


def test_everything_stays_resident_when_memory_allows(files):
    models = _models(files)
    placement = RewardPlacement(models, budget_bytes=None)
    with placement.training():
        pass
    with placement.scoring():
        pass
    assert placement.offloaded == [] and all(e.reason == "initial" for e in placement.events)
    tight = RewardPlacement(models, budget_bytes=0)
    assert tight.resident == [] and tight.offloaded == ["aesthetic", "clip_score"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_models_leave_and_return_on_a_gpu(files):
    placement, models = _run_update_cycle(files, "cuda")
    assert models["clip_score"].device.type == "cuda"
    assert next(models["clip_score"].clip.module.parameters()).device.type == "cuda"
