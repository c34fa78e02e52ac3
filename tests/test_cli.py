"""The `mmrl` command: help, a short end-to-end run, `--model PATH`, and bad data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mmrl.config import load_config
from mmrl.models.base import builtin_base
from mmrl.models.loading import load_policy
from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm


def mmrl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "mmrl.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=1800,
    )


SHORT = [
    "trainer.total_steps=2",
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "trainer.eval_every=1",
    "trainer.eval_size=16",
    "trainer.progress=false",
]


def test_help_lists_commands_tasks_and_main_options():
    out = mmrl("--help")
    assert out.returncode == 0 and "train" in out.stdout
    out = mmrl("train", "--help")
    assert out.returncode == 0
    for text in ("vision_reasoning", "--model PATH", "--config FILE", "key=value", "trainer.total_steps"):
        assert text in out.stdout


@pytest.fixture(scope="module")
def base_path(mmrl_cache) -> str:
    return str(builtin_base(load_config("vision_reasoning")))


def test_short_run_writes_a_complete_run_directory(base_path, tmp_path):
    run_dir = tmp_path / "run"
    out = mmrl("train", "--task", "vision_reasoning", f"trainer.run_dir={run_dir}", *SHORT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "greedy held-out accuracy" in out.stdout
    assert (run_dir / "config.yaml").read_text().count("total_steps: 2") == 1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 1, 2]
    for key in (
        "actor/pg_loss",
        "actor/entropy",
        "actor/ppo_kl",
        "actor/grad_norm",
        "response/length_mean",
        "reward/accuracy",
    ):
        assert key in steps[0]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model_path"] == base_path
    load_policy(run_dir / "final")  # the final checkpoint is a loadable HF folder


def test_model_flag_trains_any_local_hf_vlm_through_the_same_path(tmp_path):
    spec = TinyVLMSpec(architecture="qwen2_5_vl")
    build_tiny_vlm(spec, seed=1).save_pretrained(tmp_path / "model")
    build_processor(spec).save_pretrained(tmp_path / "model")
    run_dir = tmp_path / "run"
    out = mmrl("train", "--model", str(tmp_path / "model"), f"trainer.run_dir={run_dir}", *SHORT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["model_path"] == str(tmp_path / "model")


def test_bad_record_stops_the_run_before_training_with_file_line_id_and_field(tmp_path):
    from mmrl.datasets.procedural import make_samples
    from mmrl.datasets.readers import write_jsonl

    path = tmp_path / "train.jsonl"
    write_jsonl(make_samples(["colour_code"], 3, "train"), path)
    lines = path.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["reward_model"]["verifier"] = "mathh"
    lines[2] = json.dumps(bad)
    path.write_text("\n".join(lines) + "\n")
    out = mmrl(
        "train",
        f"data.train_files=[{path}]",
        f"data.heldout_files=[{path}]",
        f"trainer.run_dir={tmp_path / 'run'}",
    )
    assert out.returncode == 2
    assert (
        f"{path}:3 (id=vision_reasoning/colour_code/train/0/2): field 'reward_model.verifier': unknown verifier 'mathh'"
        in out.stderr
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_convert_coco_to_samples_that_train_can_read(tmp_path):
    from PIL import Image

    from mmrl.datasets import read_samples

    (tmp_path / "img").mkdir()
    Image.new("RGB", (40, 30), "white").save(tmp_path / "img" / "a.png")
    coco = {
        "images": [{"id": 7, "file_name": "a.png", "width": 40, "height": 30}],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
        "annotations": [
            {"id": 1, "image_id": 7, "category_id": 1, "bbox": [1, 2, 10, 5], "area": 50, "iscrowd": 0},
            {"id": 2, "image_id": 7, "category_id": 2, "bbox": [20, 10, 5, 5], "area": 25, "iscrowd": 0},
        ],
    }
    (tmp_path / "ann.json").write_text(json.dumps(coco))
    out = mmrl(
        "convert",
        "coco",
        str(tmp_path / "ann.json"),
        str(tmp_path / "img"),
        "-o",
        str(tmp_path / "det.jsonl"),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"wrote 1 samples to {tmp_path / 'det.jsonl'}"
    (sample,) = read_samples(tmp_path / "det.jsonl")
    assert sample.reward_model.verifier == "detection"
    assert sorted(b["bbox_2d"] for b in sample.reward_model.ground_truth) == [[1, 2, 11, 7], [20, 10, 25, 15]]
    bad = mmrl(
        "convert",
        "coco",
        str(tmp_path / "ann.json"),
        str(tmp_path / "nowhere"),
        "-o",
        str(tmp_path / "x.jsonl"),
    )
    assert bad.returncode == 2 and "a.png" in bad.stderr and not (tmp_path / "x.jsonl").exists()


def test_text_to_image_dispatches_to_flow_grpo(mmrl_cache, tmp_path):
    run_dir = tmp_path / "t2i"
    out = mmrl("train", "--task", "text_to_image_jpeg", "trainer.total_steps=2", f"trainer.run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval reward" in out.stdout
    assert (run_dir / "metrics.jsonl").exists() and list((run_dir / "images").glob("*.png"))
