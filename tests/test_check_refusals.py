"""`mmrl check` refuses first what `mmrl train` would refuse or crash on, naming the field
(issue 48, items 5 and 15), and a training run refused after it created its folder leaves no
run folder behind."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import mmrl.check as check
from mmrl.check import check_train
from mmrl.cli import main
from mmrl.train.rundir import hold_run_dir


def _lines(report) -> list[str]:
    return [p.line() for p in report.problems]


@pytest.fixture()
def no_gpu(monkeypatch):
    monkeypatch.setattr(check, "visible_gpus", lambda: None)


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="the mlflow extra is not installed")
def test_mlflow_s_file_store_is_refused_by_check(no_gpu):
    """`train` refused it only when it opened its trackers, after the data and the model loaded."""
    report = check_train(
        "vision_reasoning",
        None,
        ["trainer.loggers=[jsonl,mlflow]", "trainer.mlflow.tracking_uri=file:./mlruns"],
        online=False,
    )
    (line,) = _lines(report)
    assert line.startswith("trainer.mlflow.tracking_uri: file:./mlruns is MLflow's file store")
    assert "sqlite:///mlflow.db" in line
    fine = check_train(
        "vision_reasoning",
        None,
        ["trainer.loggers=[jsonl,mlflow]", "trainer.mlflow.tracking_uri=sqlite:///mlflow.db"],
        online=False,
    )
    assert not fine.problems


def test_an_8_gpu_recipe_on_a_machine_without_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(check, "visible_gpus", lambda: None)
    report = check_train("qwen2_5_vl_7b_vtriune", None, [], online=False)
    gpu = [p.message for p in report.problems if p.where == "gpu"]
    assert gpu == [
        "trainer.backend=ray with trainer.ray_gpus_per_actor=1 for 4 training + 4 rollout workers needs 8 GPU(s), "
        "but no GPU is visible (nvidia-smi): run it on a machine with them, join a Ray cluster that has them "
        "(trainer.ray_address), or ask for fewer"
    ]
    four = [{"index": str(i), "name": "FakeGPU", "total_mib": 81920.0, "free_mib": 81000.0} for i in range(4)]
    monkeypatch.setattr(check, "visible_gpus", lambda: four)
    report = check_train("qwen2_5_vl_7b_vtriune", None, [], online=False)
    assert any(p.where == "gpu" and "4 GPU(s) are visible" in p.message for p in report.problems)
    # A cluster joined by address has its GPUs elsewhere; a CPU run needs none.
    monkeypatch.setattr(check, "visible_gpus", lambda: None)
    joined = check_train("qwen2_5_vl_7b_vtriune", None, ["trainer.ray_address=auto"], online=False)
    assert not [p for p in joined.problems if p.where == "gpu"]
    assert check.gpus_needed(check_train("vision_reasoning", None, [], online=False).config) is None
    cuda = check_train("vision_reasoning", None, ["trainer.device=cuda:1"], online=False)
    assert [p.message.split(":")[0] for p in cuda.problems if p.where == "gpu"] == ["trainer.device=cuda"]


def test_fewer_training_rows_than_prompts_per_step_are_said(no_gpu, tmp_path):
    """Measured: the trainer runs such a config (the sampler cycles), so `check` says it, beside
    `ready`, rather than refusing a run that works."""
    report = check_train(
        "vision_reasoning", None, ["data.num_train=2", "trainer.prompts_per_step=4"], online=False
    )
    assert not report.problems
    assert any(
        line.startswith("note: 2 training samples, fewer than trainer.prompts_per_step=4")
        for line in report.summary
    )
    files = _sample_files(tmp_path, 3)
    report = check_train("vision_reasoning", None, [*files, "trainer.prompts_per_step=4"], online=False)
    assert any(line.startswith("note: 3 training samples") for line in report.summary), report.summary
    report = check_train("vision_reasoning", None, [*files, "trainer.prompts_per_step=3"], online=False)
    assert not any(line.startswith("note:") for line in report.summary)


def test_a_missing_plugin_module_and_an_unknown_kind_are_refused(no_gpu):
    report = check_train("vision_reasoning", None, ["reward.plugins=[no_such_module]"], online=False)
    (line,) = _lines(report)
    assert line.startswith("reward.plugins[0]: cannot import module 'no_such_module'")
    report = check_train("vision_reasoning", None, ["data.kinds=[colour_code,no_such_kind]"], online=False)
    (line,) = _lines(report)
    assert line.startswith("data.kinds: unknown procedural kind(s) ['no_such_kind']: choose from ")
    assert "colour_code" in line


def test_unknown_reward_model_types_and_keywords_are_refused(no_gpu, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "reward:\n  model_rewards:\n    models:\n"
        "      - {name: a, type: no_such_type}\n"
        "      - {name: b, type: jpeg_compressibility, kwargs: {qualityy: 90}}\n"
        "      - {name: b, type: geneval}\n"
        "      - {name: c, type: jpeg_compressibility, kwargs: {quality: 90}}\n"
    )
    report = check_train("vision_reasoning", str(config), [], online=False)
    lines = _lines(report)
    assert len(lines) == 3, lines
    assert lines[0].startswith(
        "reward.model_rewards.models[0].type: unknown reward model type 'no_such_type'"
    )
    assert lines[1] == (
        "reward.model_rewards.models[1].kwargs: unknown key(s) ['qualityy'] for reward model type "
        "'jpeg_compressibility' (known: quality)"
    )
    assert lines[2] == "reward.model_rewards.models[2].name: 'b' is configured twice"


def _sample_files(tmp_path: Path, n: int, edit=None) -> list[str]:
    from mmrl.datasets.procedural import make_samples
    from mmrl.datasets.readers import write_jsonl

    train = tmp_path / "train.jsonl"
    write_jsonl(make_samples(["colour_code"], n, "train"), train)
    write_jsonl(make_samples(["colour_code"], 2, "heldout"), tmp_path / "test.jsonl")
    if edit is not None:
        lines = train.read_text().splitlines()
        record = json.loads(lines[0])
        edit(record)
        lines[0] = json.dumps(record)
        train.write_text("\n".join(lines) + "\n")
    return [f"data.train_files=[{train}]", f"data.heldout_files=[{tmp_path / 'test.jsonl'}]"]


def test_a_sample_asking_for_a_reward_model_the_run_does_not_configure_is_refused(no_gpu, tmp_path):
    def ask(record):
        record["reward_model"]["models"] = [{"name": "aesthetic"}]

    files = _sample_files(tmp_path, 4, ask)
    report = check_train("vision_reasoning", None, [*files, "trainer.prompts_per_step=4"], online=False)
    (line,) = _lines(report)
    assert line.startswith(
        f"data.train_files[0]: {tmp_path / 'train.jsonl'}: sample vision_reasoning/colour_code/"
    )
    assert "field 'reward_model.models': reward model 'aesthetic' is not configured" in line


def test_a_1_by_60_million_image_is_refused(no_gpu, tmp_path):
    from PIL import Image

    Image.new("L", (1, 60_000_000)).save(tmp_path / "tall.png")

    def tall(record):
        record["images"] = [str(tmp_path / "tall.png")]

    files = _sample_files(tmp_path, 4, tall)
    report = check_train("vision_reasoning", None, [*files, "trainer.prompts_per_step=4"], online=False)
    (line,) = _lines(report)
    assert line.startswith("data.train_files[0]: ") and "tall.png: 1x60000000 pixels" in line


def test_check_names_a_run_folder_in_use_or_finished(no_gpu, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.lock").write_text("null")
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    report = check_train("vision_reasoning", None, [f"trainer.run_dir={run_dir}"], online=False)
    lines = _lines(report)
    assert len(lines) == 2 and all(line.startswith("trainer.run_dir: ") for line in lines), lines
    assert "damaged" in lines[0] and "already holds a run" in lines[1]


# --- no run folder left behind ---------------------------------------------------------------
def test_a_training_lock_removes_the_folder_it_created_when_the_run_stops_before_its_first_step(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="refused"), hold_run_dir(run_dir, "mmrl train"):
        (run_dir / "config.yaml").write_text("x: 1\n")
        (run_dir / "metrics.jsonl").write_text("")
        (run_dir / "tensorboard").mkdir()
        raise ValueError("refused")
    assert not run_dir.exists()
    # A run that logged a step keeps its folder; so does a folder that existed before.
    with pytest.raises(RuntimeError), hold_run_dir(run_dir, "mmrl train"):
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
        raise RuntimeError("crash")
    assert (run_dir / "metrics.jsonl").exists()
    (run_dir / "metrics.jsonl").unlink()
    with pytest.raises(ValueError), hold_run_dir(run_dir, "mmrl train"):
        raise ValueError("refused")
    assert run_dir.is_dir()


def test_train_refused_after_loading_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    """What `trainer.mlflow.tracking_uri=file:./mlruns` did before `check` caught it: a refusal
    after the data loaded and config.yaml and metrics.jsonl were written."""

    def refuse(*args, **kwargs):
        raise ValueError("refused after loading")

    monkeypatch.setattr("mmrl.train.grpo.builtin_base", refuse)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    args = ["train", "data.num_train=8", "data.num_heldout=4", "trainer.progress=false"]
    assert main([*args, f"trainer.run_dir={run_dir}"]) == 2
    assert "refused after loading" in capsys.readouterr().err
    assert not run_dir.exists()
    assert main(args) == 2  # the default, timestamped folder under runs/
    assert not list((tmp_path / "runs").iterdir())
