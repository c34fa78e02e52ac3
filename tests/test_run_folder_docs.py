"""What a run writes is where the docs say (issue 48, item 9): the run-folder table names every
file and folder the trainer writes (`final_adapter/` was missing), W&B's generation images stay
in the run folder (they were staged under `~/.local/share/wandb`), MLflow's artifact location is
described as MLflow puts it, and `mmrl train --help` lists the `--task` choices once."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

WRITERS = ["grpo.py", "rundir.py", "metrics_log.py", "dumps.py", "checkpoint.py", "evaluation.py"]
"""The VLM trainer's modules that write into its run folder."""


def _run_folder_table() -> str:
    text = (ROOT / "docs" / "guide" / "vlm-grpo.md").read_text(encoding="utf-8")
    start = text.index("**The run directory**")
    return text[start : text.index("\n\n", text.index("| file | holds |", start))]


def test_the_run_folder_table_names_everything_the_trainer_writes_there():
    names = set()
    for module in WRITERS:
        source = (ROOT / "mmrl" / "train" / module).read_text(encoding="utf-8")
        names.update(re.findall(r'run_dir\)? / "([\w.]+)"', source))
    assert {"final", "final_adapter", "checkpoints", "metrics.jsonl"} <= names, names
    table = _run_folder_table()
    listed = set(re.findall(r"`([\w.]+)/?`", table))
    assert not names - listed, (
        f"the run-folder table in docs/guide/vlm-grpo.md misses {sorted(names - listed)}"
    )


def test_the_mlflow_artifact_location_is_described_as_mlflow_puts_it(tmp_path, monkeypatch):
    """With a local database elsewhere, MLflow keeps artifacts in ./mlruns of the current folder."""
    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("the mlflow extra is not installed")
    from mlflow.tracking import MlflowClient

    (tmp_path / "db").mkdir()
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}")
    experiment = client.create_experiment("where")
    location = client.get_experiment(experiment).artifact_location
    assert Path(location.removeprefix("file://")) == tmp_path / "mlruns" / experiment
    from mmrl.config import MlflowConfig

    doc = MlflowConfig.__doc__ or ""
    source = (ROOT / "mmrl" / "config.py").read_text(encoding="utf-8")
    assert "beside a local database" not in source + doc
    guide = (ROOT / "docs" / "guide" / "trackers.md").read_text(encoding="utf-8")
    assert "./mlruns/<experiment id>/<run id>/artifacts/" in guide and "not beside" in guide


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="the wandb extra is not installed")
def test_wandb_generation_images_stay_in_the_run_folder(tmp_path, monkeypatch):
    from PIL import Image

    from mmrl.config import WandbConfig
    from mmrl.train.metrics_log import WANDB_DATA_DIR, WandbTracker, generations_table

    home = tmp_path / "home"
    for name, value in {
        "HOME": home,
        "XDG_DATA_HOME": home / "data",
        "XDG_CACHE_HOME": home / "cache",
        "WANDB_CONFIG_DIR": home / "config",
        "WANDB_CACHE_DIR": home / "cache" / "wandb",
    }.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv(WANDB_DATA_DIR, raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tracker = WandbTracker(run_dir, WandbConfig(mode="offline", project="p"), {}, None)
    row = {
        "data_source": "s",
        "id": "0",
        "prompt": "<image>What colour?",
        "image": Image.new("RGB", (16, 16), (200, 30, 30)),
        "response": "red",
        "ground_truth": "red",
        "reward": 1.0,
        "components": {"accuracy": 1.0},
        "error": None,
    }
    tracker.log_table("eval/generations", generations_table([row]), step=1)
    tracker.close("finished")
    staged_out = [p for p in home.rglob("*") if p.is_file() and "staging" in p.parts]
    assert not staged_out, f"staged outside the run folder: {staged_out}"
    staged_in = [p for p in (run_dir / "wandb" / "data").rglob("*") if p.is_file()]
    assert any(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in staged_in), staged_in
    assert WANDB_DATA_DIR not in os.environ  # restored once the run is closed


def test_train_help_lists_the_task_choices_once():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "mmrl.cli", "train", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1", "COLUMNS": "200"},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    from mmrl.config import task_names

    task = task_names()[-1]
    assert out.stdout.count(task) == 1, out.stdout
