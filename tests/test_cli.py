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


@pytest.mark.trains
def test_a_run_without_the_start_evaluation_trains_at_once_and_says_so(base_path, tmp_path):
    """`trainer.eval_at_start=false`: no step-0 evaluation; the start accuracy is NaN (never a
    made-up figure), the best is the evaluations that ran, and the last line says why."""
    import math

    from mmrl.train.grpo import train

    overrides = [*SHORT, "trainer.eval_every=2", "trainer.eval_at_start=false", "trainer.save_final=false"]
    result = train(load_config("vision_reasoning", overrides=[*overrides, f"trainer.run_dir={tmp_path}"]))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [2]
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]
    assert math.isnan(result.start_accuracy) and result.best_accuracy == result.final_accuracy >= 0
    line = result.summary_line()
    assert "the start was not evaluated: trainer.eval_at_start=false" in line and "nan" not in line


@pytest.mark.trains
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
    assert summary["data"]["train"] == [
        {"entry": "vision_reasoning:colour_code", "rows": 4096, "layout": "procedural", "origin": "built-in"}
    ]
    assert "train data: vision_reasoning:colour_code: 4096 samples, procedural layout" in out.stderr
    load_policy(run_dir / "final")  # the final checkpoint is a loadable HF folder


@pytest.mark.trains
def test_model_flag_trains_any_local_hf_vlm_through_the_same_path(tmp_path):
    spec = TinyVLMSpec(architecture="qwen2_5_vl")
    build_tiny_vlm(spec, seed=1).save_pretrained(tmp_path / "model")
    build_processor(spec).save_pretrained(tmp_path / "model")
    run_dir = tmp_path / "run"
    out = mmrl("train", "--model", str(tmp_path / "model"), f"trainer.run_dir={run_dir}", *SHORT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["model_path"] == str(tmp_path / "model")


@pytest.mark.trains
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


@pytest.mark.trains
def test_text_to_image_dispatches_to_flow_grpo(mmrl_cache, tmp_path):
    run_dir = tmp_path / "t2i"
    out = mmrl("train", "--task", "text_to_image_jpeg", "trainer.total_steps=2", f"trainer.run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval reward" in out.stdout
    assert (run_dir / "metrics.jsonl").exists() and list((run_dir / "images").glob("*.png"))


# --- light imports: `--help`, config errors and `mmrl check` answer before torch loads -----------
def _modules_after(code: str) -> set[str]:
    """The top-level modules a fresh interpreter has loaded after running `code`."""
    probe = f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(out.stdout.splitlines()[-1].split())


# mmrl.config: every `--help` and config error; the reward worker: each Ray reward worker's actor
# (and its verifier processes) import only this, unless the run has model rewards; the rollout
# and training actors' module, so that their constructors import torch with the collector paused.
@pytest.mark.parametrize(
    "module", ["mmrl.config", "mmrl.distributed.reward_worker", "mmrl.distributed.actors"]
)
def test_importing_a_light_module_leaves_torch_and_transformers_out(module):
    loaded = _modules_after(f"import {module}")
    assert "mmrl" in loaded
    assert not loaded & {"torch", "transformers"}, loaded & {"torch", "transformers"}


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["train", "--help"], ["check", "--help"], ["train", "trainer.mini_batches=abc"]],
)
def test_help_and_a_config_type_error_do_not_import_torch(argv):
    code = (
        "import sys\nfrom mmrl.cli import main\n"
        f"try:\n    status = main({argv!r})\nexcept SystemExit as exc:\n    status = exc.code\n"
        "print('status', status, file=sys.stderr)"
    )
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    probe = code + "\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    loaded = set(out.stdout.splitlines()[-1].split())
    assert not loaded & {"torch", "transformers"}, (argv, loaded & {"torch", "transformers"})
    if argv[-1] == "trainer.mini_batches=abc":
        assert "status 2" in out.stderr
        assert "trainer.mini_batches" in out.stderr and "abc" in out.stderr
    else:
        assert "status 0" in out.stderr


# --- mmrl check ------------------------------------------------------------------------------
def test_check_says_ready_with_what_will_run_where_and_on_which_data(tmp_path):
    from mmrl.datasets.procedural import make_samples
    from mmrl.datasets.readers import write_jsonl

    write_jsonl(make_samples(["colour_code"], 5, "train"), tmp_path / "train.jsonl")
    write_jsonl(make_samples(["colour_code"], 3, "heldout"), tmp_path / "test.jsonl")
    out = mmrl("check", "data.train_files=[train.jsonl]", "data.heldout_files=[test.jsonl]", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ready: GRPO-family training (grpo advantages, ppo loss) for 200 steps")
    assert "train: train.jsonl: 5 samples, mmrl layout (file)" in out.stdout
    assert "heldout: test.jsonl: 3 samples, mmrl layout (file)" in out.stdout
    assert "model: the built-in tiny base" in out.stdout and "where: CPU" in out.stdout
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_check_names_one_problem_per_line_with_exit_status_2(tmp_path):
    (tmp_path / "data").mkdir()
    out = mmrl(
        "check",
        "--model",
        "./no_model_here",
        "data.train_files=[nothere.jsonl]",
        "data.heldout_files=[data/test.jsonl]",
        cwd=tmp_path,
    )
    assert out.returncode == 2
    problems = out.stderr.strip().splitlines()
    assert problems == [
        f"mmrl check: data.train_files[0]: data source 'nothere.jsonl': no such file or folder: "
        f"{tmp_path / 'nothere.jsonl'} (a relative path, resolved from the current folder {tmp_path})",
        f"mmrl check: data.heldout_files[0]: data source 'data/test.jsonl': no such file or folder: "
        f"{tmp_path / 'data' / 'test.jsonl'} (a relative path, resolved from the current folder {tmp_path})",
        f"mmrl check: model.path: no such model folder: {tmp_path / 'no_model_here'} (and not a hub id like "
        "org/name)",
    ]
    assert out.stdout == ""


def test_check_reports_a_config_error_on_one_line():
    out = mmrl("check", "algo.kl_coef=-1")
    assert out.returncode == 2
    assert out.stderr.strip() == "mmrl check: config: algo.kl_coef must be >= 0, got -1.0"


def test_check_names_a_missing_package_with_its_install_line(monkeypatch):
    import importlib.util

    from mmrl.check import check_train

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    report = check_train("vision_reasoning", None, ["trainer.backend=ray"], online=False)
    assert [p.line() for p in report.problems] == [
        "package ray: needed (trainer.backend=ray) but not installed: pip install 'mmrl[distributed]'"
    ]


def test_check_names_a_hub_id_that_is_not_cached_offline():
    from mmrl.check import check_train

    report = check_train(
        "vision_reasoning",
        None,
        [
            "model.path=no-such-org/no-such-model",
            "data.train_files=[no-such-org/data@train]",
            "data.heldout_files=[no-such-org/data@test]",
        ],
    )
    lines = [p.line() for p in report.problems]
    assert len(lines) == 3, lines
    assert lines[0].startswith("data.train_files[0]: data source 'no-such-org/data@train': hub dataset")
    assert "not in the local cache and HF_HUB_OFFLINE=1 is set" in lines[0]
    assert lines[2].startswith("model.path: no-such-org/no-such-model: not in the local cache")


def test_check_compares_gpu_memory_with_a_rough_estimate(monkeypatch, tmp_path):
    """A fake `nvidia-smi` reports one 24 GiB GPU; a 7.6B-parameter bf16 checkpoint (an index
    with its total size) trained in full needs far more (16 B per trained parameter), with LoRA
    it fits."""
    import mmrl.check as check

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    index = {"metadata": {"total_size": 2 * 7_600_000_000}, "weight_map": {}}
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    monkeypatch.setattr(
        check,
        "visible_gpus",
        lambda: [{"index": "0", "name": "FakeGPU", "total_mib": 24576.0, "free_mib": 24000.0}],
    )
    full = check.check_train("vision_reasoning", None, [f"model.path={tmp_path / 'model'}"], online=False)
    (problem,) = full.problems
    assert problem.where == "gpu" and "7.6B parameters" in problem.message and "24 GiB" in problem.message
    lora = check.check_train(
        "vision_reasoning", None, [f"model.path={tmp_path / 'model'}", "model.lora_rank=64"], online=False
    )
    assert not lora.problems
    assert any("1 x FakeGPU (24 GiB); rough need" in line for line in lora.summary)


def test_the_light_name_lists_agree_with_the_builders():
    from mmrl.config import DTYPE_NAMES
    from mmrl.models.precision import DTYPES
    from mmrl.models.tiny_families import ARCHITECTURES
    from mmrl.models.tiny_spec import FAMILY_ARCHITECTURES

    assert ARCHITECTURES == FAMILY_ARCHITECTURES
    assert ("auto", *DTYPES) == DTYPE_NAMES


def test_check_reads_gpus_from_nvidia_smi_restricted_to_cuda_visible_devices(tmp_path, monkeypatch):
    """`nvidia-smi`'s CSV (a stand-in script on PATH), and only the GPUs CUDA_VISIBLE_DEVICES names."""
    from mmrl.check import visible_gpus

    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\necho '0, NVIDIA H200, 143771, 140000'\necho '1, NVIDIA H200, 143771, 100000'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [g["index"] for g in visible_gpus()] == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    (gpu,) = visible_gpus()
    assert gpu == {"index": "1", "name": "NVIDIA H200", "total_mib": 143771.0, "free_mib": 100000.0}
