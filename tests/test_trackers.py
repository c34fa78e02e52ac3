"""Experiment trackers (`trainer.loggers`): a short GRPO run and a short flow-GRPO run log to
Weights & Biases (offline mode) and MLflow (a local SQLite database), and what they logged is read
back from the trackers' own files: every metric of `metrics.jsonl` under the same name, step
and value, the config as the run's parameters, the training-curve PNG and the flow-GRPO image
grids as media; a run resumed with `trainer.resume=auto` continues the same tracker runs.

W&B's offline run file (`run-<id>.wandb`) is read with wandb's own protobuf records
(`wandb.proto.wandb_internal_pb2.Record`) in the LevelDB-log framing wandb writes it in."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from collections import defaultdict
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.train.grpo import train
from mmrl.train.metrics_log import check_trackers_installed, mlflow_key, read_metrics

HAVE_MLFLOW = importlib.util.find_spec("mlflow") is not None
NO_MLFLOW = (
    "mlflow is not installed: the `mlflow` extra (mlflow-skinny 3.17) needs importlib_metadata<10 and "
    "something else in this environment requires a newer one (constraints.txt pins 9.1.0 for it)"
)
TRACKERS = ["wandb", "mlflow"] if HAVE_MLFLOW else ["wandb"]

SHORT = [
    "trainer.prompts_per_step=4",
    "rollout.group_size=2",
    "trainer.eval_size=8",
    "trainer.eval_every=2",
    "trainer.progress=false",
    "trainer.save_final=false",
    "trainer.threads=1",
    "trainer.checkpoint_every=1",
    "reward.num_workers=0",  # verifiers in this process: no worker to start (what is tested is logging)
]


@pytest.fixture(scope="module")
def tracker_env(tmp_path_factory):
    """wandb offline with its caches in a temporary folder; the MLflow store's folder."""
    home = tmp_path_factory.mktemp("tracker-home")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "wandb-config"),
        "WANDB_CACHE_DIR": str(home / "wandb-cache"),
        "WANDB_DATA_DIR": str(home / "wandb-data"),
    }
    (home / "mlflow").mkdir()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield home / "mlflow"
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _tracker_overrides(store: Path, experiment: str) -> list[str]:
    """W&B offline; MLflow in a local SQLite database (one for the module: creating one runs
    MLflow's migrations, which take a while), artifacts beside it."""
    return [
        f"trainer.loggers=[jsonl,tensorboard,{','.join(TRACKERS)}]",
        "trainer.wandb.mode=offline",
        "trainer.wandb.project=mmrl-test",
        f"trainer.mlflow.tracking_uri=sqlite:///{store}/mlflow.db",
        f"trainer.mlflow.experiment={experiment}",
        f"trainer.mlflow.artifact_location={store}/artifacts/{experiment}",
    ]


@pytest.fixture(scope="module")
def grpo_runs(mmrl_cache, tracker_env, tmp_path_factory):
    """A 1-step GRPO run, then the same run resumed (`trainer.resume=auto`) to 2 steps."""
    run_dir, store = tmp_path_factory.mktemp("tracked") / "run", tracker_env
    base = [*SHORT, *_tracker_overrides(store, "grpo"), f"trainer.run_dir={run_dir}"]
    train(load_config("vision_reasoning", overrides=[*base, "trainer.total_steps=1"]))
    first_ids = json.loads((run_dir / "trackers.json").read_text())
    train(load_config("vision_reasoning", overrides=[*base, "trainer.total_steps=2", "trainer.resume=auto"]))
    return run_dir, store, first_ids


# --- reading W&B's offline run files ---------------------------------------------------------
def _wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` file: a 7-byte header (`:W&B`, magic 0xBEE1, version
    0), then LevelDB-log blocks of 32 KiB holding chunks (crc32c, length, type: 1 full,
    2 first, 3 middle, 4 last) of serialized `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B run file"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    out = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        out.append(record)
    return out


def _wandb_run(offline_dir: Path) -> dict:
    """Run id, config and history rows ({step: {key: value}}) of one offline run folder."""
    (path,) = offline_dir.glob("run-*.wandb")
    assert path.stat().st_size > 0
    run = {"id": None, "config": {}, "history": defaultdict(dict)}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
            run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            run["history"][record.history.step.num].update(items)
    return run


def _jsonl_by_step(run_dir: Path) -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for record in read_metrics(run_dir / "metrics.jsonl"):
        by_step[record["step"]].update({k: v for k, v in record.items() if k != "step" and v is not None})
    return by_step


# --- W&B -------------------------------------------------------------------------------------
@pytest.mark.trains
def test_wandb_offline_holds_every_metric_the_config_and_the_curves_and_resumes_the_same_run(grpo_runs):
    run_dir, _, first_ids = grpo_runs
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids["wandb"]["id"] == first_ids["wandb"]["id"]
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2, folders  # the first run and its resumption
    first, resumed = (_wandb_run(f) for f in folders)
    assert first["id"] == resumed["id"] == ids["wandb"]["id"]
    # The config as the run's parameters; the resumed run's config is the resumed one.
    assert first["config"]["trainer"]["total_steps"] == 1
    assert resumed["config"]["trainer"]["total_steps"] == 2
    assert first["config"]["rollout"]["group_size"] == 2
    # Every metric under its own name at its step, with its value: steps 0-1, then 2.
    expected = _jsonl_by_step(run_dir)
    assert sorted(expected) == [0, 1, 2]
    history = {**first["history"], **resumed["history"]}
    assert sorted(first["history"]) == [0, 1] and sorted(resumed["history"]) == [2]
    for step, metrics in expected.items():
        row = history[step]
        missing = sorted(set(metrics) - set(row))
        assert not missing, f"step {step}: not in W&B: {missing}"
        for key, value in metrics.items():
            assert row[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (step, key)
    # The training-curve PNG as media, at the last step of each run, its file kept.
    for run, folder, step in ((first, folders[0], 1), (resumed, folders[1], 2)):
        row = run["history"][step]
        assert row["plots/training_curves/_type"] == "image-file"
        assert (folder / "files" / row["plots/training_curves/path"]).stat().st_size > 0


def _wandb_tables(offline_dir: Path) -> list[tuple[int, dict, dict[str, Path]]]:
    """(step, table, {path: file}) of every table an offline run logged. A table with images is
    a `run_table` artifact whose files (the table's JSON, the images) wait in wandb's staging
    folder for `wandb sync`; the run file's artifact records hold the manifest."""
    (path,) = offline_dir.glob("run-*.wandb")
    records = _wandb_records(path)
    steps = [
        r.history.step.num
        for r in records
        if r.WhichOneof("record_type") == "history"
        and any(
            "/".join(i.nested_key) == "eval/generations/_type" or i.key == "eval/generations/_type"
            for i in r.history.item
        )
    ]
    tables = []
    for r in records:
        if r.WhichOneof("record_type") == "artifact" and r.artifact.type == "run_table":
            files = {c.path: Path(c.local_path) for c in r.artifact.manifest.contents}
            tables.append((json.loads(files["eval/generations.table.json"].read_text()), files))
    assert len(steps) == len(tables), (steps, len(tables))
    return [(step, table, files) for step, (table, files) in zip(steps, tables)]


def test_wandb_offline_holds_a_generations_table_at_every_evaluation(grpo_runs):
    """veRL's / EasyR1's validation generations: `trainer.log_generations` (8) rows of prompt,
    image thumbnail, response, reward and each component, the same held-out samples each time."""
    run_dir, _, _ = grpo_runs
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    tables = [t for folder in folders for t in _wandb_tables(folder)]
    assert [step for step, _, _ in tables] == [0, 1, 2]  # step 0, the run's end, the resumed run's end
    ids = None
    for step, table, files in tables:
        columns = table["columns"]
        assert columns[:7] == ["data_source", "id", "prompt", "image", "response", "ground_truth", "reward"]
        assert "reward/accuracy" in columns and columns[-1] == "error"
        rows = [dict(zip(columns, values)) for values in table["data"]]
        assert len(rows) == 8
        for row in rows:
            assert row["image"]["_type"] == "image-file"
            assert files[row["image"]["path"]].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert max(row["image"]["width"], row["image"]["height"]) <= 128  # a thumbnail
            assert 0.0 <= row["reward"] <= 1.0 and row["reward/accuracy"] in (0.0, 1.0)
            assert "<image>" in row["prompt"] and isinstance(row["response"], str)
        ids = ids or [row["id"] for row in rows]
        assert [row["id"] for row in rows] == ids, step  # the same samples at every evaluation
    # eval_size is 8: the table holds every evaluated sample, so it reproduces the logged accuracy.
    expected = _jsonl_by_step(run_dir)
    for step, table, _ in tables:
        rows = [dict(zip(table["columns"], values)) for values in table["data"]]
        assert expected[step]["eval/accuracy"] == pytest.approx(sum(r["reward/accuracy"] for r in rows) / 8)


# --- MLflow ----------------------------------------------------------------------------------
@pytest.mark.trains
@pytest.mark.skipif(not HAVE_MLFLOW, reason=NO_MLFLOW)
def test_mlflow_holds_every_metric_the_params_and_the_curves_and_resumes_the_same_run(grpo_runs):
    from mlflow.tracking import MlflowClient

    run_dir, store, first_ids = grpo_runs
    ids = json.loads((run_dir / "trackers.json").read_text())
    run_id = ids["mlflow"]["id"]
    assert run_id == first_ids["mlflow"]["id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{store}/mlflow.db")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # resumed into, not a second run
    # Parameters: the flattened config, first values kept; the resumed config as an artifact.
    assert run.data.params["trainer.total_steps"] == "1"
    assert run.data.params["rollout.group_size"] == "2"
    assert json.loads(run.data.params["trainer.loggers"]) == ["jsonl", "tensorboard", *TRACKERS]
    expected = _jsonl_by_step(run_dir)
    names = {key for metrics in expected.values() for key in metrics}
    assert set(run.data.metrics) == {mlflow_key(k) for k in names}
    for key in ("reward/mean", "eval/accuracy", "actor/grad_norm", "time/step_s"):
        history = {m.step: m.value for m in client.get_metric_history(run_id, mlflow_key(key))}
        assert history == pytest.approx({s: m[key] for s, m in expected.items() if key in m}), key
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "plots"} <= artifacts
    config_text = Path(client.download_artifacts(run_id, "config.yaml", str(run_dir / "dl"))).read_text()
    assert "total_steps: 2" in config_text
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/training_curves.png"]


@pytest.mark.skipif(not HAVE_MLFLOW, reason=NO_MLFLOW)
def test_mlflow_holds_a_generations_table_at_every_evaluation(grpo_runs):
    from mlflow.tracking import MlflowClient

    run_dir, store, _ = grpo_runs
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{store}/mlflow.db")
    paths = [a.path for a in client.list_artifacts(run_id, "eval/generations")]
    assert paths == [f"eval/generations/step_{s:06d}.json" for s in (0, 1, 2)]
    table = json.loads(Path(client.download_artifacts(run_id, paths[0], str(run_dir / "dl-gen"))).read_text())
    columns = table["columns"]
    assert columns[:7] == ["data_source", "id", "prompt", "image", "response", "ground_truth", "reward"]
    rows = [dict(zip(columns, values)) for values in table["data"]]
    assert len(rows) == 8
    for row in rows:
        assert row["image"]["type"] == "image"
        image = client.download_artifacts(run_id, row["image"]["filepath"], str(run_dir / "dl-img"))
        assert Path(image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert 0.0 <= row["reward"] <= 1.0 and row["reward/accuracy"] in (0.0, 1.0)
    expected = _jsonl_by_step(run_dir)[0]["eval/accuracy"]
    assert expected == pytest.approx(sum(r["reward/accuracy"] for r in rows) / 8)


def test_mlflow_names_keep_their_meaning_within_mlflows_characters():
    assert mlflow_key("reward/precision@0.5") == "reward/precision_at_0.5"
    assert mlflow_key("reward/mean/geo3k") == "reward/mean/geo3k"
    assert mlflow_key("reward/mean/my source (v2)") == "reward/mean/my source _v2_"
    assert mlflow_key("reward/mean/../x//y") == "reward/mean/_/x/y"


# --- flow-GRPO: image grids ------------------------------------------------------------------
def test_flow_grpo_logs_its_evaluation_grids_and_curves_as_media(tracker_env, tmp_path):
    from mmrl.train.flow_config import load_flow_config
    from mmrl.train.flow_grpo import run_text_to_image

    run_dir, store = tmp_path / "flow", tracker_env
    tiny = [
        "sample.group_size=2",
        "sample.num_steps=2",
        "sample.eval_num_steps=2",
        "trainer.prompts_per_step=2",
        "trainer.mini_batches=1",
        "trainer.eval_size=2",
        "trainer.total_steps=1",
        "trainer.progress=false",
        "trainer.save_final=false",
        "trainer.threads=1",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"trainer.run_dir={run_dir}",
    ]
    run_text_to_image(
        load_flow_config("text_to_image_jpeg", overrides=[*tiny, *_tracker_overrides(store, "flow")])
    )
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    run = _wandb_run(folder)
    for step in (0, 1):  # the grid of the step-0 and the final evaluation
        row = run["history"][step]
        assert row["eval/images/_type"] == "image-file"
        assert (folder / "files" / row["eval/images/path"]).stat().st_size > 0
        assert row["eval/reward/mean"] == pytest.approx(_jsonl_by_step(run_dir)[step]["eval/reward/mean"])
    assert run["history"][1]["plots/training_curves/_type"] == "image-file"
    assert run["config"]["sample"]["group_size"] == 2
    if HAVE_MLFLOW:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{store}/mlflow.db")
        run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["id"]
        grids = [a.path for a in client.list_artifacts(run_id, "eval")]
        assert grids == ["eval/eval_step_00000.png", "eval/eval_step_00001.png"]
        assert client.get_run(run_id).data.params["sample.group_size"] == "2"


# --- configuration and errors ----------------------------------------------------------------
@pytest.mark.skipif(not HAVE_MLFLOW, reason=NO_MLFLOW)
def test_mlflows_file_store_is_refused_naming_why(tmp_path):
    from mmrl.config import MlflowConfig
    from mmrl.train.metrics_log import MlflowTracker

    with pytest.raises(ValueError, match="file store.*reward/mean/<data_source>.*sqlite"):
        MlflowTracker(tmp_path, MlflowConfig(tracking_uri=f"file:{tmp_path}/mlruns"), {}, None)


def test_logger_settings_are_checked_when_the_config_loads():
    with pytest.raises(ValueError, match=r"unknown logger\(s\) \['wandbb'\]"):
        load_config("vision_reasoning", overrides=["trainer.loggers=[jsonl,wandbb]"])
    with pytest.raises(ValueError, match="must include jsonl"):
        load_config("vision_reasoning", overrides=["trainer.loggers=[tensorboard]"])
    with pytest.raises(ValueError, match="trainer.wandb.mode"):
        load_config("vision_reasoning", overrides=["trainer.wandb.mode=sometimes"])
    assert load_config("vision_reasoning").trainer.loggers == ["jsonl", "tensorboard"]


def test_a_tracker_whose_library_is_missing_is_refused_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"pip install 'mmrl\[wandb\]'"):
        check_trackers_installed(["jsonl", "wandb"])
    check_trackers_installed(["jsonl", "tensorboard"])


def test_a_tracker_failing_mid_run_is_reported_and_dropped_while_jsonl_goes_on(monkeypatch, tmp_path, caplog):
    import logging

    import mmrl.train.metrics_log as metrics_log

    class Flaky(metrics_log.Tracker):
        name = "wandb"
        closed: list[str] = []

        def __init__(self, run_dir, settings, config, run_id):
            self.calls = 0

        def ids(self):
            return {"id": "flaky-1"}

        def describe(self):
            return "a test double"

        def log(self, step, metrics):
            if step == 2:
                raise ConnectionError("server went away")

        def close(self, status):
            Flaky.closed.append(status)

    monkeypatch.setitem(metrics_log.TRACKERS, "wandb", Flaky)
    with (
        caplog.at_level(logging.ERROR),
        metrics_log.MetricsLogger(tmp_path, loggers=["jsonl", "wandb"]) as out,
    ):
        for step in (1, 2, 3):
            out.log(step, {"reward/mean": step / 10})
        assert out.trackers == []
        out.status = "finished"
    assert "wandb: logging failed at step 2 (ConnectionError: server went away)" in caplog.text
    assert Flaky.closed == ["failed"]  # dropped at once, and not closed a second time
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"wandb": {"id": "flaky-1"}}


def test_a_resume_may_change_where_metrics_go_but_not_what_is_trained(tmp_path):
    from mmrl.config import config_to_yaml
    from mmrl.train.flow_checkpoint import check_config_unchanged
    from mmrl.train.flow_config import flow_config_to_yaml, load_flow_config
    from mmrl.train.preflight import check_resume_config

    (tmp_path / "config.yaml").write_text(config_to_yaml(load_config("vision_reasoning")))
    moved = [
        "trainer.loggers=[jsonl,wandb,mlflow]",
        "trainer.wandb.project=p2",
        "trainer.mlflow.experiment=e2",
    ]
    check_resume_config(load_config("vision_reasoning", overrides=moved), tmp_path)
    with pytest.raises(ValueError, match="optim.lr"):
        check_resume_config(load_config("vision_reasoning", overrides=[*moved, "optim.lr=1e-3"]), tmp_path)
    (tmp_path / "config.yaml").write_text(flow_config_to_yaml(load_flow_config("text_to_image_jpeg")))
    check_config_unchanged(load_flow_config("text_to_image_jpeg", overrides=moved), tmp_path)
    with pytest.raises(ValueError, match="optim.lr"):
        check_config_unchanged(
            load_flow_config("text_to_image_jpeg", overrides=[*moved, "optim.lr=1e-3"]), tmp_path
        )
