"""Fault injection for the VLM trainer's run directory: crashes mid-checkpoint, full disks and
read-only folders (an injected `OSError` / torch's write error), damaged manifests, resumes
whose checkpoints are all damaged or whose config changed, and bad sample files (oversized
prompts, bytes that are not UTF-8, empty files). Each names the path and the cause and leaves
the last good checkpoint, the metrics and the config untouched."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import pathlib
from pathlib import Path

import pytest
import torch

from mmrl.config import config_to_yaml, load_config
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.readers import read_samples, write_jsonl
from mmrl.datasets.schema import SampleError
from mmrl.train.checkpoint import (
    find_resume_checkpoint,
    list_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from mmrl.train.data import load_data
from mmrl.train.grpo import train
from mmrl.train.metrics_log import MetricsLogger
from mmrl.train.preflight import plan_resume
from mmrl.train.rundir import create_run_dir
from mmrl.train.storage import StorageError

SMALL = ["data.num_train=8", "data.num_heldout=4", "trainer.progress=false"]


class _Weights:
    """Stands in for a model and a processor: `save_pretrained` writes a small weight file."""

    def __init__(self, payload: bytes = b"w" * 4096):
        self.payload = payload

    def save_pretrained(self, folder: Path) -> None:
        (Path(folder) / "model.safetensors").write_bytes(self.payload)
        (Path(folder) / "config.json").write_text("{}")


@pytest.fixture()
def no_model(monkeypatch):
    """A run that gets past its checks fails at once instead of building the base model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the run went on to load the model instead of refusing")

    monkeypatch.setattr("mmrl.train.grpo.builtin_base", refuse)


def _cfg(run_dir: Path, *overrides: str):
    return load_config("vision_reasoning", overrides=[*SMALL, f"trainer.run_dir={run_dir}", *overrides])


def _save(run_dir: Path, step: int, cfg=None) -> Path:
    cfg = cfg or _cfg(run_dir)
    state = {"optimizer": {}, "progress": {"step": step}}
    return save_checkpoint(run_dir, step, _Weights(), _Weights(), state, config_to_yaml(cfg), metric=0.5)


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# -- checkpoints and disks ------------------------------------------------------------------


def test_stale_checkpoint_temporaries_are_removed_on_start(tmp_path, caplog):
    run_dir = tmp_path / "run"
    _save(run_dir, 1)
    stale = run_dir / "checkpoints" / ".tmp_step_00000002_4242"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "model.safetensors").write_bytes(b"x" * 100_000)
    with caplog.at_level(logging.WARNING):
        create_run_dir(_cfg(run_dir, "trainer.resume=auto"))
    assert not stale.exists()
    assert ".tmp_step_00000002_4242" in caplog.text and "100000 bytes freed" in caplog.text
    assert [c.step for c in list_checkpoints(run_dir)] == [1]


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1536 vs 1436"),
    ],
    ids=["enospc", "torch-inline-container"],
)
def test_a_full_disk_during_torch_save_names_the_path_and_keeps_the_last_good_checkpoint(
    tmp_path, monkeypatch, failure
):
    run_dir = tmp_path / "run"
    good = _save(run_dir, 1)
    before = _digest(good)

    def full_disk(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"partial")  # what a full disk leaves behind
        raise failure

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(StorageError) as info:
        _save(run_dir, 2)
    message = str(info.value)
    assert str(run_dir / "checkpoints") in message and "step 2" in message
    if isinstance(failure, OSError):
        assert "disk is full" in message and "ENOSPC" in message
    else:
        assert "unexpected pos" in message and "free there" in message
    assert str(good) in message and "intact" in message
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]  # no temporary
    assert _digest(good) == before and verify_checkpoint(good) is None


def test_a_full_disk_while_safetensors_writes_the_weights_names_the_cause(tmp_path):
    from safetensors import SafetensorError

    class FullDiskWeights(_Weights):
        def save_pretrained(self, folder: Path) -> None:
            (Path(folder) / "model.safetensors").write_bytes(b"w" * 10)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    run_dir = tmp_path / "run"
    good = _save(run_dir, 1)
    state = {"optimizer": {}, "progress": {"step": 2}}
    with pytest.raises(StorageError, match="step 2 .*no space left on the device.*ENOSPC"):
        save_checkpoint(run_dir, 2, FullDiskWeights(), _Weights(), state, "a: 1\n")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]
    assert verify_checkpoint(good) is None


def test_a_read_only_run_folder_is_refused_before_anything_is_written(tmp_path, monkeypatch, no_model):
    run_dir = tmp_path / "run"
    real_open = pathlib.Path.open

    def read_only(self, *args, **kwargs):
        mode = args[0] if args else kwargs.get("mode", "r")
        if str(self).startswith(str(run_dir)) and any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", read_only)
    with pytest.raises(StorageError) as info:
        train(_cfg(run_dir))
    message = str(info.value)
    assert str(run_dir) in message and "read-only" in message and "EROFS" in message
    assert not (run_dir / "config.yaml").exists()


def test_a_full_disk_while_logging_metrics_names_the_file(tmp_path, caplog):
    logger = MetricsLogger(tmp_path)
    logger.log(1, {"reward/mean": 0.5})

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        close = flush

    logger._file = FullDisk()
    with pytest.raises(StorageError) as info:
        logger.log(2, {"reward/mean": 0.25})
    message = str(info.value)
    assert str(tmp_path / "metrics.jsonl") in message and "step 2" in message and "disk is full" in message
    with caplog.at_level(logging.ERROR):
        logger.close()  # does not raise a second time (it would hide the first error)
    assert "metrics.jsonl" in caplog.text
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_deleted_manifest_is_skipped_with_a_warning(tmp_path, caplog):
    run_dir = tmp_path / "run"
    _save(run_dir, 1)
    newest = _save(run_dir, 2)
    (newest / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert find_resume_checkpoint(run_dir).step == 1
    assert "skipping damaged checkpoint" in caplog.text and "step_00000002" in caplog.text
    assert "manifest.json" in caplog.text


def test_an_empty_manifest_is_damage_not_a_key_error(tmp_path, caplog):
    run_dir = tmp_path / "run"
    _save(run_dir, 1)
    newest = _save(run_dir, 2)
    (newest / "manifest.json").write_text("{}")
    assert "'files'" in verify_checkpoint(newest)
    with caplog.at_level(logging.WARNING):
        assert find_resume_checkpoint(run_dir).step == 1
    assert "step_00000002" in caplog.text


@pytest.mark.parametrize("manifest", [{"files": {}}, {"step": 2, "files": {"config.yaml": None}}])
def test_a_manifest_that_lists_nothing_does_not_vouch_for_corrupted_weights(tmp_path, manifest):
    newest = _save(tmp_path / "run", 2)
    weights = newest / "model" / "model.safetensors"
    weights.write_bytes(b"corrupted" + weights.read_bytes()[9:])
    (newest / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(newest) is not None
    assert find_resume_checkpoint(tmp_path / "run") is None


def test_a_file_missing_from_the_manifest_is_damage(tmp_path):
    newest = _save(tmp_path / "run", 2)
    manifest = json.loads((newest / "manifest.json").read_text())
    del manifest["files"]["model/model.safetensors"]
    (newest / "manifest.json").write_text(json.dumps(manifest))
    assert "model/model.safetensors" in verify_checkpoint(newest)


def test_resume_auto_refuses_when_every_checkpoint_is_damaged_and_changes_nothing(tmp_path, no_model):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in range(5))
    )
    first, second = _save(run_dir, 2, cfg), _save(run_dir, 4, cfg)
    (first / "manifest.json").unlink()
    state = second / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:10])
    before = _digest(run_dir)
    with pytest.raises(ValueError) as info:
        train(_cfg(run_dir, "trainer.resume=auto"))
    message = str(info.value)
    assert "every checkpoint" in message and "step_00000002" in message and "step_00000004" in message
    assert "trainer_state.pt" in message and "start over" in message
    assert _digest(run_dir) == before  # metrics, config and checkpoints untouched


def test_resuming_with_a_changed_config_is_refused_with_the_differences(tmp_path, no_model):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir)
    create_run_dir(cfg)
    _save(run_dir, 2, cfg)
    before = _digest(run_dir)
    with pytest.raises(ValueError) as info:
        train(_cfg(run_dir, "trainer.resume=auto", "optim.lr=0.001", "rollout.group_size=4"))
    message = str(info.value)
    assert "optim.lr: 0.0003 -> 0.001" in message and "rollout.group_size: 8 -> 4" in message
    assert "trainer.total_steps" in message  # says what may change
    assert _digest(run_dir) == before  # config.yaml not overwritten


def test_resuming_with_more_total_steps_is_allowed_and_logged(tmp_path, caplog):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir)
    checkpoint = _save(run_dir, 2, cfg)
    with caplog.at_level(logging.WARNING):
        assert (
            plan_resume(_cfg(run_dir, "trainer.resume=auto", "trainer.total_steps=400"), run_dir)
            == checkpoint
        )
    assert "trainer.total_steps changed: 200 -> 400" in caplog.text


# -- issue 36, point 9: each proven through the entry points a user reaches -----------------


def test_an_empty_files_table_is_refused_by_resume_auto_and_by_an_explicit_resume(tmp_path, no_model):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir)
    create_run_dir(cfg)
    only = _save(run_dir, 2, cfg)
    manifest = json.loads((only / "manifest.json").read_text())
    (only / "manifest.json").write_text(json.dumps({**manifest, "files": {}}))
    before = _digest(run_dir)
    with pytest.raises(ValueError, match="every checkpoint .*step_00000002: manifest.json lists no files"):
        train(_cfg(run_dir, "trainer.resume=auto"))
    with pytest.raises(
        ValueError, match=f"trainer.resume={only}: not a usable checkpoint: manifest.json lists no"
    ):
        train(_cfg(run_dir, f"trainer.resume={only}"))
    assert _digest(run_dir) == before  # refused, not loaded (no_model: nothing was built either)


def test_a_truncated_model_file_is_refused(tmp_path, no_model, caplog):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir)
    create_run_dir(cfg)
    older, newest = _save(run_dir, 2, cfg), _save(run_dir, 4, cfg)
    weights = newest / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a crash or a full disk mid-copy
    problem = verify_checkpoint(newest)
    assert problem == "model/model.safetensors has 1000 bytes, the manifest says 4096 (truncated?)"
    with caplog.at_level(logging.WARNING):
        assert plan_resume(_cfg(run_dir, "trainer.resume=auto"), run_dir) == older
    assert "skipping damaged checkpoint" in caplog.text and "model.safetensors" in caplog.text
    with pytest.raises(ValueError, match="not a usable checkpoint: model/model.safetensors has 1000 bytes"):
        train(_cfg(run_dir, f"trainer.resume={newest}"))


def test_a_run_folder_that_turns_read_only_during_a_checkpoint_write_is_named(tmp_path, monkeypatch):
    import os

    run_dir = tmp_path / "run"
    good = _save(run_dir, 1)
    before = _digest(good)
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(run_dir)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)  # the first thing a checkpoint write does
    with pytest.raises(StorageError) as info:
        _save(run_dir, 2)
    message = str(info.value)
    assert "cannot write checkpoint step 2 to" in message and str(run_dir / "checkpoints") in message
    assert "the file system is read-only (EROFS" in message
    assert f"the last good checkpoint {good} is intact" in message
    assert _digest(good) == before and [c.step for c in list_checkpoints(run_dir)] == [1]


def test_a_21_mb_prompt_is_refused_at_load_time_naming_file_line_and_id(tmp_path):
    path = _records(tmp_path)
    lines = path.read_text().splitlines()
    record = json.loads(lines[2])
    record["prompt"][-1]["content"] += "y" * (21 * 1024 * 1024)
    lines[2] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SampleError) as info:
        read_samples(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3") and f"id={record['extra_info']['id']}" in message
    assert "22,0" in message and "more than the limit of 200,000" in message


def test_a_ray_run_may_resume_on_a_cluster_at_another_address(tmp_path, caplog):
    """A restarted Ray cluster may have another head: the address is where the run goes on,
    not what it learns."""
    run_dir = tmp_path / "run"
    base = ["trainer.backend=ray", "trainer.ray_address=10.0.0.1:6379"]
    checkpoint = _save(run_dir, 2, _cfg(run_dir, *base))
    moved = _cfg(run_dir, *base, "trainer.resume=auto", "trainer.ray_address=10.0.0.2:6379")
    with caplog.at_level(logging.WARNING):
        assert plan_resume(moved, run_dir) == checkpoint
    assert "trainer.ray_address changed" in caplog.text


# -- sample files ---------------------------------------------------------------------------


def _records(tmp_path: Path, n: int = 3) -> Path:
    path = tmp_path / "train.jsonl"
    write_jsonl(make_samples(["colour_code"], n, "train", image_size=16), path)
    return path


def test_an_oversized_prompt_is_refused_at_load_time_with_file_line_and_id(tmp_path):
    path = _records(tmp_path)
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record["prompt"][-1]["content"] += "x" * 300_000
    lines[1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SampleError) as info:
        read_samples(path)
    message = str(info.value)
    assert f"{path}:2" in message and f"id={record['extra_info']['id']}" in message
    assert "'prompt'" in message and "200,000" in message
    assert len(read_samples(path, max_prompt_chars=400_000)) == 3


def test_data_max_prompt_chars_applies_to_the_trainers_files(tmp_path):
    path = _records(tmp_path)
    cfg = load_config(
        "vision_reasoning",
        overrides=[f"data.train_files=[{path}]", f"data.heldout_files=[{path}]", "data.max_prompt_chars=10"],
    )
    with pytest.raises(SampleError, match=r"train\.jsonl:1.*more than the limit of 10"):
        load_data(cfg)


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path):
    path = _records(tmp_path)
    data = path.read_bytes().splitlines(keepends=True)
    data[2] = data[2][:40] + b"\xff\xfe" + data[2][40:]
    path.write_bytes(b"".join(data))
    with pytest.raises(SampleError) as info:
        read_samples(path)
    assert f"{path}:3" in str(info.value) and "not UTF-8" in str(info.value) and "0xff" in str(info.value)


def test_an_empty_sample_file_is_an_error_naming_it_even_among_good_ones(tmp_path):
    good = _records(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SampleError, match="empty.jsonl.*no records"):
        read_samples(empty)
    cfg = load_config(
        "vision_reasoning", overrides=[f"data.train_files=[{good},{empty}]", f"data.heldout_files=[{good}]"]
    )
    with pytest.raises(SampleError, match="empty.jsonl"):
        load_data(cfg)


@pytest.mark.slow
def test_a_run_whose_disk_fills_during_a_checkpoint_stops_clearly_and_resumes(
    mmrl_cache, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    args = [
        "trainer.prompts_per_step=4",
        "rollout.group_size=2",
        "trainer.eval_size=8",
        "trainer.eval_every=3",
        "trainer.save_final=false",
        "trainer.threads=1",
        "trainer.total_steps=3",
        "trainer.checkpoint_every=1",
        "trainer.keep_last=0",
    ]
    real_save = torch.save

    def fills_at_the_second(obj, f, *a, **kw):  # the disk is full when checkpoint 2 is written
        if ".tmp_step_00000002" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", fills_at_the_second)
    with pytest.raises(StorageError, match="step 2 .*no space left.*step_00000001 is intact"):
        train(_cfg(run_dir, *args))
    assert [c.step for c in list_checkpoints(run_dir)] == [1]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]

    monkeypatch.setattr(torch, "save", real_save)
    result = train(_cfg(run_dir, *args, "trainer.resume=auto"))
    assert result.steps == 3
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s > 0] == [1, 2, 3, 3]  # step 3: the step's metrics and the evaluation
