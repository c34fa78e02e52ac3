"""The aesthetic predictor, clip_score and PickScore: tiny random CLIPs saved in the real formats.

Each scorer loads its weights from disk and must reproduce, number for number, what the same
weights compute when run directly through open_clip / transformers; wrong files fail naming
the file and the layout expected.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from mmrl.rewards import WeightsFileError, get_reward_model
from mmrl.rewards.aesthetic import AestheticMLP
from mmrl.rewards.testing import (
    TINY_OPEN_CLIP_CONFIG,
    save_random_aesthetic_head,
    save_tiny_hf_clip,
    save_tiny_open_clip,
)

D = TINY_OPEN_CLIP_CONFIG["embed_dim"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip")
    return {
        "open_clip": save_tiny_open_clip(root / "open_clip", seed=0),
        "open_clip_st": save_tiny_open_clip(root / "open_clip_st", seed=0, safetensors=True),
        "open_clip_other": save_tiny_open_clip(root / "open_clip_other", seed=1),
        "hf": save_tiny_hf_clip(root / "hf", seed=0),
        "head": save_random_aesthetic_head(root / "head.pth", D, seed=0),
        "root": root,
    }


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(2, 3, 48, 48, generator=g)
    red = torch.zeros(1, 3, 48, 48)
    red[:, 0] = 1.0
    return torch.cat([noise, red])


def _open_clip_direct(folder):
    """The same checkpoint through open_clip's own loader (an independent path)."""
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}", pretrained_text=False)
    return model.eval(), preprocess, open_clip.get_tokenizer(f"local-dir:{folder}")


def _pil(images):
    from mmrl.rewards.base import as_pil_images

    return as_pil_images(images)


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def test_aesthetic_is_the_head_on_the_normalised_embedding(saved, images, tmp_path):
    """A hand-set head computing 5 + u . e/|e|, with u the unit embedding of image 0: image 0
    must score exactly 6, every other image 5 + its cosine with image 0."""
    model, preprocess, _ = _open_clip_direct(saved["open_clip"])
    with torch.no_grad():
        e = _unit(model.encode_image(torch.stack([preprocess(im) for im in _pil(images)])))
    head = AestheticMLP(D)
    state = {k: torch.zeros_like(v) for k, v in head.state_dict().items()}
    state["layers.0.weight"][0] = e[0]
    for key in ("layers.2.weight", "layers.4.weight", "layers.6.weight", "layers.7.weight"):
        state[key][0, 0] = 1.0
    state["layers.7.bias"][0] = 5.0
    torch.save(state, tmp_path / "hand.pth")

    scorer = get_reward_model(
        "aesthetic", clip_model=str(saved["open_clip"]), head_weights=tmp_path / "hand.pth"
    )
    out = scorer.score_with_components(images=images)
    assert out.scores[0] == pytest.approx(6.0, abs=1e-5)
    assert out.scores[1:] == pytest.approx((5.0 + e[1:] @ e[0]).tolist(), abs=1e-5)
    assert max(out.scores[1:]) < 6.0
    assert out.components == {"aesthetic": out.scores}


def test_aesthetic_reproduces_its_scores_from_disk(saved, images):
    a = get_reward_model("aesthetic", clip_model=str(saved["open_clip"]), head_weights=saved["head"])
    b = get_reward_model(
        "aesthetic", clip_model=str(saved["open_clip_st"]), head_weights=saved["head"], batch_size=2
    )
    assert a.score(images=images) == pytest.approx(b.score(images=images), abs=1e-6)
    # The head holds exactly the saved tensors; dropout is off (scores are deterministic).
    saved_state = torch.load(saved["head"], weights_only=True)
    assert all(torch.equal(a.head.state_dict()[k], v) for k, v in saved_state.items())
    assert a.score(images=images) == a.score(images=images)
    # Other CLIP weights give other scores: the file is really used.
    c = get_reward_model("aesthetic", clip_model=str(saved["open_clip_other"]), head_weights=saved["head"])
    assert c.score(images=images) != pytest.approx(a.score(images=images), abs=1e-4)
    # Memory: CLIP + head parameters and buffers, in fp32.
    n = sum(t.numel() for m in (a.clip.module, a.head) for t in [*m.parameters(), *m.buffers()])
    assert a.memory_bytes() == 4 * n


def test_aesthetic_through_transformers_clip(saved, images):
    scorer = get_reward_model(
        "aesthetic", clip_model=str(saved["hf"]), clip_backend="transformers", head_weights=saved["head"]
    )
    scores = scorer.score(images=images)
    assert len(scores) == 3 and len(set(scores)) == 3


def test_clip_score_is_the_cosine_open_clip_computes(saved, images):
    prompts = ["a photo of a cat", "noise", "a red square"]
    scorer = get_reward_model("clip_score", clip_model=str(saved["open_clip"]), scale=2.5)
    out = scorer.score_with_components(images=images, prompts=prompts)
    model, preprocess, tokenizer = _open_clip_direct(saved["open_clip"])
    with torch.no_grad():
        img = _unit(model.encode_image(torch.stack([preprocess(im) for im in _pil(images)])))
        txt = _unit(model.encode_text(tokenizer(prompts)))
    cos = (img * txt).sum(-1)
    assert out.components["clip_cosine"] == pytest.approx(cos.tolist(), abs=1e-5)
    assert out.scores == pytest.approx((2.5 * cos).tolist(), abs=1e-5)
    # A `texts` field overrides the prompts.
    swapped = scorer.score(images=images, prompts=prompts, texts=prompts[::-1])
    assert swapped[1] == pytest.approx(out.scores[1], abs=1e-6)
    assert swapped[0] != pytest.approx(out.scores[0], abs=1e-4)


def test_pickscore_equals_transformers_clip_logits(saved, images):
    """PickScore = logit_scale * cos: CLIPModel's own logits_per_image diagonal."""
    from transformers import CLIPModel, CLIPProcessor

    prompts = ["a cat", "a dog on a beach", "red"]
    scorer = get_reward_model("pickscore", clip_model=str(saved["hf"]))
    out = scorer.score_with_components(images=images, prompts=prompts)
    model = CLIPModel.from_pretrained(saved["hf"]).eval()
    processor = CLIPProcessor.from_pretrained(saved["hf"])
    inputs = processor(text=prompts, images=_pil(images), return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**inputs).logits_per_image.diagonal()
    assert out.scores == pytest.approx(logits.tolist(), abs=1e-4)
    assert out.components["pickscore_logit"] == out.scores
    assert out.scores == pytest.approx([100 * c for c in out.components["pickscore_cosine"]], abs=1e-4)
    scaled = get_reward_model("pickscore", clip_model=str(saved["hf"]), scale=1 / 26).score(
        images=images, prompts=prompts
    )
    assert scaled == pytest.approx([s / 26 for s in out.scores], abs=1e-5)


def test_pickscore_through_open_clip(saved, images):
    prompts = ["a", "b", "c"]
    ps = get_reward_model("pickscore", clip_model=str(saved["open_clip"]), clip_backend="open_clip")
    cs = get_reward_model("clip_score", clip_model=str(saved["open_clip"]))
    assert ps.score(images=images, prompts=prompts) == pytest.approx(
        [100 * c for c in cs.score(images=images, prompts=prompts)], abs=1e-4
    )


def test_a_missing_head_file_is_named(saved, tmp_path):
    with pytest.raises(WeightsFileError, match=r"nothere\.pth.*does not exist"):
        get_reward_model(
            "aesthetic", clip_model=str(saved["open_clip"]), head_weights=tmp_path / "nothere.pth"
        )


def test_a_head_for_another_clip_names_the_file_and_the_layout(saved, tmp_path):
    path = save_random_aesthetic_head(tmp_path / "vit_l_head.pth", 768)
    with pytest.raises(WeightsFileError) as err:
        get_reward_model("aesthetic", clip_model=str(saved["open_clip"]), head_weights=path)
    message = str(err.value)
    assert str(path) in message
    assert "layers.0.weight: expected [1024, 32], got [1024, 768]" in message
    assert "Expected layout" in message and "layers.7.weight: [1, 16]" in message


def test_a_head_with_wrong_keys_is_named(saved, tmp_path):
    torch.save({"mlp.0.weight": torch.zeros(2, 2)}, tmp_path / "bad.pth")
    with pytest.raises(
        WeightsFileError, match=r"missing keys \['layers.0.bias'.*unexpected keys \['mlp.0.weight'\]"
    ):
        get_reward_model("aesthetic", clip_model=str(saved["open_clip"]), head_weights=tmp_path / "bad.pth")
    (tmp_path / "garbage.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsFileError, match=r"cannot read weights file .*garbage\.pth"):
        get_reward_model(
            "aesthetic", clip_model=str(saved["open_clip"]), head_weights=tmp_path / "garbage.pth"
        )


def test_clip_weights_of_another_architecture_are_named(saved, tmp_path):
    folder = tmp_path / "wider"
    folder.mkdir()
    cfg = json.loads((saved["open_clip"] / "open_clip_config.json").read_text())
    cfg["model_cfg"]["embed_dim"] = 64
    (folder / "open_clip_config.json").write_text(json.dumps(cfg))
    weights = saved["open_clip"] / "open_clip_pytorch_model.bin"
    with pytest.raises(WeightsFileError) as err:
        get_reward_model("clip_score", clip_model=str(folder), clip_weights=weights)
    assert str(weights) in str(err.value)
    assert "text_projection: expected [32, 64], got [32, 32]" in str(err.value)


def test_missing_clip_files_are_named(saved, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsFileError, match="no open_clip_config.json"):
        get_reward_model("clip_score", clip_model=str(empty))
    (empty / "open_clip_config.json").write_text((saved["open_clip"] / "open_clip_config.json").read_text())
    with pytest.raises(WeightsFileError, match="holds no weights file.*open_clip_pytorch_model.bin"):
        get_reward_model("clip_score", clip_model=str(empty))
    with pytest.raises(WeightsFileError, match="needs weights=.*never downloads"):
        get_reward_model("clip_score", clip_model="ViT-B-32")
    with pytest.raises(WeightsFileError, match="not a transformers CLIP folder"):
        get_reward_model("pickscore", clip_model=str(empty))
    with pytest.raises(ValueError, match="neither a local open_clip folder nor a built-in"):
        get_reward_model("clip_score", clip_model=str(tmp_path / "nope"))
    # PickScore has no default model (its config's default is ""): the error says what to give.
    for missing in ({}, {"clip_model": ""}):
        with pytest.raises(ValueError, match="pickscore: clip_model=<a local CLIP folder.*> is required"):
            get_reward_model("pickscore", **missing)


def test_hf_clip_with_a_truncated_file_is_named(saved, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf_bad"
    shutil.copytree(saved["hf"], folder)
    state = load_file(str(folder / "model.safetensors"))
    state.pop("visual_projection.weight")
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(
        WeightsFileError, match=r"model\.safetensors.*missing keys \['visual_projection.weight'\]"
    ):
        get_reward_model("pickscore", clip_model=str(folder))


def test_image_inputs_as_pil(saved):
    scorer = get_reward_model("clip_score", clip_model=str(saved["open_clip"]))
    red = Image.new("RGB", (40, 40), (255, 0, 0))
    as_tensor = torch.zeros(1, 3, 40, 40)
    as_tensor[:, 0] = 1.0
    assert scorer.score(images=[red], prompts=["red"]) == pytest.approx(
        scorer.score(images=as_tensor, prompts=["red"]), abs=1e-6
    )
