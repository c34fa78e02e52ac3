"""Where metrics go (`trainer.loggers`), one implementation for both trainers.

`metrics.jsonl` always (the run's own record: resume, plots and summaries read it), TensorBoard,
and the experiment trackers Weights & Biases and MLflow through their own libraries (the
`wandb` / `mlflow` extras, imported only when asked for). Every sink gets the same metric names,
`group/name[/data_source]` (MLflow allows fewer characters in a name: see `mlflow_key`). The
trackers also get the resolved config as the run's parameters and images as media (the
training-curve PNG; flow-GRPO's evaluation grids), and at every held-out evaluation a table of
sample generations (`trainer.log_generations` rows: prompt, image thumbnail, response, reward and
each component), as veRL's and EasyR1's validation generations. Their run ids are kept in
`<run_dir>/trackers.json`, so a run resumed from a checkpoint logs into the same tracker run.

    log = open_metrics_log(run_dir, cfg.trainer, config_to_dict(cfg), resume_after=None)
    with log:                      # closes every sink; "failed" when the block raises
        log.log(1, {"reward/mean": 0.5})
        log.log_image("plots/training_curves", run_dir / "training_curves.png", step=1)
        log.status = "finished"
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import posixpath
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mmrl.train.storage import StorageError, storage_errors

log = logging.getLogger(__name__)

_AFTER = "The checkpoints already written are intact; free space and continue with --resume auto"

TRACKER_IDS = "trackers.json"
"""File in the run directory with each tracker's run id (read back on resume)."""

STATUSES = ("finished", "interrupted", "failed")
"""How a run ends, as the trackers are told: interrupted runs (SIGINT / SIGTERM, a checkpoint
written) are resumable; MLflow marks them KILLED, W&B as finished."""


class MetricsLogger:
    """Appends to `metrics.jsonl` and, as asked, TensorBoard, W&B and MLflow. With
    `resume_after=k` (a resumed run), lines and events of steps after k (written by the run that
    crashed) are dropped first, so the files read as if the run had never stopped, and for
    k >= 0 the trackers reopen the runs named in `trackers.json`."""

    def __init__(
        self,
        run_dir: Path,
        resume_after: int | None = None,
        *,
        loggers: list[str] | tuple[str, ...] = ("jsonl", "tensorboard"),
        config: dict[str, Any] | None = None,
        wandb: Any = None,
        mlflow: Any = None,
    ):
        run_dir = Path(run_dir)
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.status = "failed"
        """How the run ended, for `close` through the context manager; set it before leaving."""
        self._closed = False
        with storage_errors("write metrics to", self.path, _AFTER):
            if resume_after is not None and self.path.exists():
                kept = [
                    line
                    for line in self.path.read_text(encoding="utf-8").splitlines()
                    if _step_of(line) <= resume_after
                ]
                _rewrite(self.path, "".join(line + "\n" for line in kept))
            self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_after is None else resume_after + 1
            with storage_errors("write TensorBoard events to", run_dir / "tensorboard", _AFTER):
                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        self.trackers: list[Tracker] = []
        wanted = [name for name in loggers if name in TRACKERS]
        if wanted:
            self._open_trackers(wanted, config or {}, wandb, mlflow, resume_after)

    def _open_trackers(self, wanted, config, wandb_cfg, mlflow_cfg, resume_after) -> None:
        ids_path = self.run_dir / TRACKER_IDS
        recorded = {}
        resuming = resume_after is not None and resume_after >= 0
        if resuming and ids_path.exists():
            try:
                recorded = json.loads(ids_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                log.warning("%s is unreadable (%s); the trackers start new runs", ids_path, exc)
        settings = {"wandb": wandb_cfg, "mlflow": mlflow_cfg}
        try:
            for name in wanted:
                run_id = recorded.get(name, {}).get("id") if resuming else None
                if resuming and run_id is None:
                    log.warning("%s: no run recorded in %s; the resumed run starts a new one", name, ids_path)
                self.trackers.append(TRACKERS[name](self.run_dir, settings[name], config, run_id))
        except BaseException:
            self.close("failed")
            raise
        ids = {tracker.name: tracker.ids() for tracker in self.trackers}
        with storage_errors("write the tracker run ids to", ids_path, _AFTER):
            _rewrite(ids_path, json.dumps(ids, indent=2) + "\n")
        for tracker in self.trackers:
            log.info("%s: logging to %s", tracker.name, tracker.describe())

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step}
        finite = {}
        for key, value in metrics.items():
            value = float(value)
            record[key] = value if math.isfinite(value) else None
            if math.isfinite(value):
                finite[key] = value
                if self._tb is not None:
                    self._tb.add_scalar(key, value, step)
        with storage_errors(f"write metrics of step {step} to", self.path, _AFTER):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        self._to_trackers("log", step, finite)

    def log_image(self, key: str, path: Path, step: int) -> None:
        """An image file (a PNG in the run directory) as media `key` at `step`: W&B shows it in
        the run's media panel, MLflow keeps it as an artifact under `key`'s folder."""
        self._to_trackers("log_image", step, key, Path(path))

    def log_generations(self, step: int, rows: list[dict[str, Any]], key: str = "eval/generations") -> None:
        """A table of sample generations (`mmrl.train.evaluation.generation_row`) at `step`: a
        W&B table (images as thumbnails) and an MLflow table artifact `<key>/step_<n>.json`."""
        if rows and self.trackers:
            self._to_trackers("log_table", step, key, generations_table(rows))

    def _to_trackers(self, method: str, step: int, *args: Any) -> None:
        """A tracker that fails mid-run (a server gone away) is reported and dropped; the run
        goes on, `metrics.jsonl` keeps everything."""
        for tracker in list(self.trackers):
            try:
                if method == "log":
                    tracker.log(step, *args)
                elif method == "log_table":
                    tracker.log_table(args[0], args[1], step)
                else:
                    tracker.log_image(args[0], args[1], step)
            except Exception as exc:  # noqa: BLE001 - any failure of a third-party client
                log.error(
                    "%s: logging failed at step %d (%s: %s); continuing without it (metrics.jsonl has every "
                    "metric)",
                    tracker.name, step, type(exc).__name__, exc,
                )  # fmt: skip
                self.trackers.remove(tracker)
                with contextlib.suppress(Exception):
                    tracker.close("failed")

    def close(self, status: str | None = None) -> None:
        """Close every sink (once); the trackers are told how the run ended (`STATUSES`). A
        write that fails now (the disk still full) is logged, not raised, so it never hides the
        error that stopped the run."""
        if self._closed:
            return
        self._closed = True
        status = status or self.status
        try:
            with storage_errors("write metrics to", self.path):
                self._file.close()
        except StorageError as exc:
            log.error("%s", exc)
        if self._tb is not None:
            with contextlib.suppress(Exception):
                self._tb.flush()
                self._tb.close()
        for tracker in self.trackers:
            try:
                tracker.close(status)
            except Exception as exc:  # noqa: BLE001 - reported, never hiding the run's own error
                log.error("%s: closing the run failed (%s: %s)", tracker.name, type(exc).__name__, exc)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("failed" if exc_type is not None else self.status)


def open_metrics_log(
    run_dir: Path, trainer: Any, config: dict[str, Any], resume_after: int | None
) -> MetricsLogger:
    """The sinks `trainer.loggers` names (`trainer`: either trainer's `trainer` config section),
    with `config` (the resolved config as a dict) as the trackers' run parameters."""
    return MetricsLogger(
        run_dir,
        resume_after,
        loggers=list(trainer.loggers),
        config=config,
        wandb=trainer.wandb,
        mlflow=trainer.mlflow,
    )


def check_trackers_installed(loggers: list[str]) -> None:
    """Refuse (ImportError naming the extra) a tracker whose library is missing, before the run
    writes anything."""
    import importlib.util

    for name in loggers:
        if name in TRACKERS and importlib.util.find_spec(name) is None:
            raise _missing(name, name)


class Tracker:
    """An experiment tracker's run: metrics, parameters and media, reopened by id on resume."""

    name = ""

    def ids(self) -> dict[str, str]:
        """What `trackers.json` keeps to reopen this run (`id` at least)."""
        raise NotImplementedError

    def describe(self) -> str:
        """Where the run is, for the log."""
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_image(self, key: str, path: Path, step: int) -> None:
        raise NotImplementedError

    def log_table(self, key: str, table: dict[str, list], step: int) -> None:
        """A table (`{column: values}`; an `image` column holds PIL thumbnails) at `step`."""
        raise NotImplementedError

    def close(self, status: str) -> None:
        raise NotImplementedError


THUMBNAIL_PX = 128
"""Longest side of the image thumbnails in the generations table."""


def generations_table(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Generation rows as columns: data_source, id, prompt, image (a thumbnail; the column is
    left out when a row has no image), response, ground_truth, reward, one column per reward
    component (None where a row's verifier did not report it) and error."""
    components = sorted({name for row in rows for name in row["components"]})
    table: dict[str, list] = {name: [row[name] for row in rows] for name in ("data_source", "id", "prompt")}
    if all(row["image"] is not None for row in rows):
        table["image"] = [_thumbnail(row["image"]) for row in rows]
    for name in ("response", "ground_truth", "reward"):
        table[name] = [row[name] for row in rows]
    for name in components:
        table[f"reward/{name}"] = [row["components"].get(name) for row in rows]
    table["error"] = [row["error"] for row in rows]
    return table


def _thumbnail(image):
    image = image.convert("RGB")
    image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
    return image


class TrackerNotInstalled(ImportError, ValueError):
    """`trainer.loggers` names a tracker whose library is missing (a config error too, so the
    CLI reports it on one line)."""


def _missing(name: str, extra: str) -> TrackerNotInstalled:
    return TrackerNotInstalled(
        f"trainer.loggers names {name}, but the {name} library is not installed: pip install 'mmrl[{extra}]'"
    )


WANDB_DATA_DIR = "WANDB_DATA_DIR"
"""wandb's data folder, where it stages the files of the artifacts a run logs (a generations
table's images) until they are uploaded; default `~/.local/share/wandb`, outside the run."""


class WandbTracker(Tracker):
    """Weights & Biases through `wandb`; its files go under `<run_dir>/wandb/`. Offline mode
    (`trainer.wandb.mode=offline` or `WANDB_MODE=offline`) writes `offline-run-*/run-<id>.wandb`
    there for `wandb sync`; a resumed run is another such folder with the same run id, which
    `wandb sync` appends to the same run. The staged files of the generations tables (their
    images) go to `<run_dir>/wandb/data/` too, unless `WANDB_DATA_DIR` names another folder:
    `$WANDB_DATA_DIR` is set to it while the run is open."""

    name = "wandb"

    def __init__(self, run_dir: Path, settings: Any, config: dict[str, Any], run_id: str | None):
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb") from None
        self._wandb = wandb
        import os

        self._set_data_dir = not os.environ.get(WANDB_DATA_DIR)
        if self._set_data_dir:  # read by wandb whenever it stages a file (wandb.env.get_data_dir)
            os.environ[WANDB_DATA_DIR] = str(Path(run_dir).resolve() / "wandb" / "data")
        try:
            self.run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                name=settings.name or Path(run_dir).resolve().name,
                group=settings.group,
                tags=list(settings.tags) or None,
                mode=settings.mode,
                dir=str(run_dir),
                config=config,
                id=run_id,
                resume="allow" if run_id else None,
            )
        except Exception as exc:  # noqa: BLE001 - wandb raises many kinds (auth, network, usage)
            self._restore_data_dir()
            raise ValueError(
                f"trainer.loggers: wandb could not start a run ({type(exc).__name__}: {exc}). Log in "
                "(`wandb login`, WANDB_API_KEY) or log offline (trainer.wandb.mode=offline)"
            ) from exc
        if run_id:  # the resumed config may differ in the keys a resume may change
            self.run.config.update(config, allow_val_change=True)

    def ids(self) -> dict[str, str]:
        return {"id": self.run.id, "project": self.run.project or ""}

    def describe(self) -> str:
        return f"run {self.run.id} ({self.run.settings.mode}) in {self.run.dir}"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self._wandb.Image(str(path), caption=path.name)}, step=step)

    def log_table(self, key: str, table: dict[str, list], step: int) -> None:
        columns = list(table)
        data = [
            [self._wandb.Image(v) if c == "image" else v for c, v in zip(columns, values)]
            for values in zip(*table.values())
        ]
        self.run.log({key: self._wandb.Table(columns=columns, data=data)}, step=step)

    def close(self, status: str) -> None:
        try:
            self.run.finish(exit_code=1 if status == "failed" else 0)
        finally:
            self._restore_data_dir()

    def _restore_data_dir(self) -> None:
        """Unset `WANDB_DATA_DIR` if this tracker set it."""
        import os

        if self._set_data_dir:
            os.environ.pop(WANDB_DATA_DIR, None)
            self._set_data_dir = False


_MLFLOW_NAME = re.compile(r"[^/\w.\- :]")
MLFLOW_PARAM_CHARS = 6000
"""MLflow's limit on a parameter value; longer config values are cut (the whole config is the
run's `config.yaml` artifact)."""


def mlflow_key(name: str) -> str:
    """A metric name as MLflow accepts it: MLflow allows letters, digits, `_ - . : / ` and
    spaces, and no empty or `.`/`..` path parts; `@` becomes `_at_`
    (`reward/precision@0.5` -> `reward/precision_at_0.5`), any other character `_`."""
    name = _MLFLOW_NAME.sub("_", name.replace("@", "_at_"))
    parts = [("_" if p in (".", "..") else p) for p in name.split("/") if p]
    return "/".join(parts) or "_"


def mlflow_tracking_uri(settings: Any) -> str:
    """The tracking URI a run logs to: `trainer.mlflow.tracking_uri`, else MLflow's own default
    (`MLFLOW_TRACKING_URI`, else `sqlite:///mlflow.db` in the current folder since MLflow 3).
    Imports mlflow only when neither is set."""
    import os

    uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return str(uri)
    import mlflow

    return str(mlflow.get_tracking_uri())


def mlflow_store_problem(uri: str) -> str | None:
    """Why a run cannot log to `uri` (MLflow's file store: a path or `file:` URI), or None."""
    if urlparse(str(uri)).scheme in ("", "file"):
        return (
            f"{uri} is MLflow's file store, which keeps each metric name as a path, and mmrl's names nest "
            "(reward/mean and reward/mean/<data_source>): use a database (sqlite:///mlflow.db) or a tracking "
            "server (http://host:5000)"
        )
    return None


class MlflowTracker(Tracker):
    """MLflow through its own client (`MlflowClient`, no global active run): one run in
    `trainer.mlflow.experiment`, the config flattened into parameters (`trainer.total_steps`)
    plus the whole resolved `config.yaml` as an artifact, metrics by step, images as artifacts."""

    name = "mlflow"

    def __init__(self, run_dir: Path, settings: Any, config: dict[str, Any], run_id: str | None):
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow", "mlflow") from None
        from mlflow.entities import Metric

        from mmrl.train.preflight import flatten

        self._metric = Metric
        import mlflow

        self.uri = settings.tracking_uri or mlflow.get_tracking_uri()
        problem = mlflow_store_problem(self.uri)
        if problem:
            raise ValueError(f"trainer.mlflow.tracking_uri: {problem}")
        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id:
            try:
                run = self.client.get_run(run_id)
            except Exception as exc:  # noqa: BLE001 - MlflowException and transport errors alike
                raise ValueError(
                    f"trainer.mlflow: cannot reopen MLflow run {run_id} (recorded in "
                    f"{Path(run_dir) / TRACKER_IDS}) at tracking URI {self.uri}: {exc}"
                ) from exc
            self.client.update_run(run_id, status="RUNNING")
            logged = dict(run.data.params)
        else:
            try:
                experiment = self.client.get_experiment_by_name(settings.experiment)
                experiment_id = (
                    experiment.experiment_id
                    if experiment is not None
                    else self.client.create_experiment(
                        settings.experiment, artifact_location=settings.artifact_location
                    )
                )
                tags = {**settings.tags, "mmrl.run_dir": str(Path(run_dir).resolve())}
                run = self.client.create_run(
                    experiment_id, run_name=settings.run_name or Path(run_dir).resolve().name, tags=tags
                )
            except Exception as exc:  # noqa: BLE001
                raise ValueError(
                    f"trainer.loggers: MLflow could not start a run at tracking URI {self.uri} "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            logged = {}
        self.run_id = run.info.run_id
        params = {k: _param_value(v) for k, v in flatten(config).items()}
        changed = sorted(k for k in params if k in logged and logged[k] != params[k])
        if changed:
            log.warning(
                "mlflow: a run's parameters cannot change; the resumed run keeps the first values of %s "
                "(its config.yaml artifact is the resumed config)",
                ", ".join(changed),
            )
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        self.client.log_batch(self.run_id, params=new)
        if (Path(run_dir) / "config.yaml").exists():
            self.client.log_artifact(self.run_id, str(Path(run_dir) / "config.yaml"))

    def ids(self) -> dict[str, str]:
        return {"id": self.run_id, "tracking_uri": str(self.uri)}

    def describe(self) -> str:
        return f"run {self.run_id} at {self.uri}"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(mlflow_key(k), v, now, step) for k, v in metrics.items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_image(self, key: str, path: Path, step: int) -> None:
        folder = posixpath.dirname(mlflow_key(key)) or None
        self.client.log_artifact(self.run_id, str(path), artifact_path=folder)

    def log_table(self, key: str, table: dict[str, list], step: int) -> None:
        # MLflow's own table artifact (the UI's table view; images saved beside it); pandas needed.
        self.client.log_table(
            self.run_id, data=table, artifact_file=f"{mlflow_key(key)}/step_{step:06d}.json"
        )

    def close(self, status: str) -> None:
        mlflow_status = {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, status=mlflow_status)


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= MLFLOW_PARAM_CHARS else text[: MLFLOW_PARAM_CHARS - 3] + "..."


TRACKERS: dict[str, type[Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}
"""The experiment trackers `trainer.loggers` may name, besides `jsonl` and `tensorboard`."""


def _rewrite(path: Path, text: str) -> None:
    """Replace `path`'s content atomically: a failed write (full disk) leaves the old file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")  # a torn last line of a killed run: dropped


def read_metrics(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
