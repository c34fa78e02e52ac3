"""Sample sources by name: what an entry of `data.train_files` / `data.heldout_files` may be.

    train.jsonl | train.parquet                       an mmrl sample file (`mmrl.datasets.readers`)
    geo3k_train.parquet                               a file in another layout (detected, below)
    hiyouga/geometry3k@train                          a Hugging Face hub dataset id and its split
    org/name@train?config=default&revision=<sha>      ... with its config and revision
    org/name@train?streaming=true&max_samples=5000    ... read as a stream, the first 5000 rows
    /data/geo3k                                       a local copy of a hub repo (load_dataset)
    /data/geo3k_saved@test                            a folder written by `save_to_disk`
    parquet@train?data_files=/data/train-*.parquet    any `load_dataset` builder with its files

The form is `SOURCE[@SPLIT][?key=value&...]` (EasyR1's `name@split` habit); an existing local
path is always taken whole. A name that looks like a path (absolute, `./`, `~`, a `.jsonl` /
`.json` / `.parquet` suffix, more than one `/`, or a first part that is a local folder) is a local
path even when it does not exist: a mistyped file is reported as a missing file, naming the
folder a relative path was resolved from, never looked up on the hub. Only other names are hub
ids, and the hub is asked about them once, with a short time-out (`mmrl.hub`), before
`load_dataset` would retry it. Datasets are read through the `datasets` library (the `hub` extra),
images kept as their encoded bytes (never decoded into memory), then every row is mapped onto
mmrl's sample format from its column layout (`LAYOUTS`) and validated like any sample file:

- `mmrl`: mmrl's (= V-Triune's) sample format, `data_source`, `prompt`, `reward_model` (with a
  `verifier`), `extra_info`; read unchanged.
- `vtriune`: V-Triune's own spelling (Orsta-Data-47k): `reward_model.verifier_parm`, verifier
  names such as `mathverify` (`mmrl.datasets.converters.vtriune_record`).
- `verl`: veRL rows, `prompt` + `reward_model` `{style: rule, ground_truth}`, scored by `verifier`.
- `easyr1`: EasyR1 rows, `problem` / `answer` / `images` (other names via `prompt_key`,
  `answer_key`, `image_key`), scored by `verifier` (`converters.easyr1_record`); `data_source`
  defaults to the dataset's name.

A layout that is none of these is an error naming the columns, for a local sample file too (one
whose first record has a field of the sample format, `SAMPLE_FIELDS`, is read as mmrl samples, so
its error names the field that is wrong). Options after `?`: `split`,
`config`, `revision`, `streaming` (rows read as they arrive instead of downloading and caching
the whole dataset first; with `max_samples`, only a prefix is read), `max_samples`, `layout`
(`auto` or one of `LAYOUTS`), `data_files`, `data_source`, `verifier`, `prompt_key`,
`answer_key`, `image_key`. With `HF_HUB_OFFLINE=1` a hub id that is not in the local cache fails
at once with a message naming it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from mmrl.datasets.schema import MAX_PROMPT_CHARS, SampleError, sample_from_record
from mmrl.files import not_a_regular_file
from mmrl.types import Sample

log = logging.getLogger(__name__)

LAYOUTS = ("mmrl", "vtriune", "verl", "easyr1")
"""Column layouts rows are mapped from (see the module docstring)."""

SAMPLE_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
BUILDERS = ("json", "parquet", "csv", "arrow", "text", "webdataset", "imagefolder")
"""`load_dataset` builders that read local or remote files given as `data_files`."""


@dataclass
class SourceSpec:
    """One parsed `data.train_files` entry."""

    path: str
    """A hub dataset id, a local file or folder, or a `load_dataset` builder name."""
    split: str | None = None
    """The split to read; None: the only one there is (several: an error naming them)."""
    config: str | None = None
    """The dataset's config (`load_dataset`'s `name`)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit)."""
    streaming: bool = False
    """Read rows as they arrive (`load_dataset(..., streaming=True)`)."""
    max_samples: int | None = None
    """Read at most this many rows (the first ones)."""
    layout: str = "auto"
    """`auto` (from the columns) or one of `LAYOUTS`."""
    data_files: list[str] = field(default_factory=list)
    """Files for a builder (`parquet@train?data_files=a.parquet,b.parquet`)."""
    data_source: str | None = None
    """`data_source` of EasyR1 rows (they carry none; default: the dataset's name)."""
    verifier: str = "math"
    """Verifier of EasyR1 and veRL rows."""
    prompt_key: str = "problem"
    """EasyR1: the column with the question."""
    answer_key: str = "answer"
    """EasyR1: the column with the answer."""
    image_key: str = "images"
    """EasyR1 / veRL: the column with the images."""

    @property
    def name(self) -> str:
        """A short name for the dataset (the default `data_source` of EasyR1 rows)."""
        if self.path in BUILDERS and self.data_files:
            return Path(self.data_files[0]).stem.split("-")[0] or self.path
        path = Path(self.path.rstrip("/"))
        return (path.stem if path.suffix.lower() in SAMPLE_FILE_SUFFIXES else path.name) or self.path


_OPTIONS = {f.name for f in fields(SourceSpec)} - {"path"}


def parse_source(entry: str) -> SourceSpec:
    """`SOURCE[@SPLIT][?key=value&...]` as a `SourceSpec` (an existing path is taken whole)."""
    if Path(entry).exists():
        return SourceSpec(path=entry)
    head, _, query = entry.partition("?")
    path, at, split = head.rpartition("@")
    if not at:
        path, split = head, None
    if not path:
        raise ValueError(f"data source {entry!r}: no dataset before '@'")
    spec = SourceSpec(path=path, split=split or None)
    try:
        options = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(
            f"data source {entry!r}: options after '?' must be key=value pairs joined by '&'"
        ) from None
    for key, value in options:
        if key not in _OPTIONS:
            raise ValueError(
                f"data source {entry!r}: unknown option {key!r} (known: {', '.join(sorted(_OPTIONS))})"
            )
        if key == "streaming":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"data source {entry!r}: streaming must be true or false, got {value!r}")
            spec.streaming = value.lower() in ("true", "1")
        elif key == "max_samples":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(
                    f"data source {entry!r}: max_samples must be a positive integer, got {value!r}"
                )
            spec.max_samples = int(value)
        elif key == "data_files":
            spec.data_files = [f for f in value.split(",") if f]
        elif key == "layout":
            if value not in ("auto", *LAYOUTS):
                raise ValueError(f"data source {entry!r}: layout must be auto or one of {', '.join(LAYOUTS)}")
            spec.layout = value
        elif key in ("split", "config", "revision", "data_source"):
            setattr(spec, key, value or None)
        elif not value:
            raise ValueError(f"data source {entry!r}: option {key} needs a value")
        else:
            setattr(spec, key, value)
    return spec


def looks_local(path: str) -> bool:
    """Whether a source name is meant as a local path, existing or not (module docstring)."""
    if path.startswith(("/", ".", "~")) or "\\" in path:
        return True
    if Path(path).suffix.lower() in SAMPLE_FILE_SUFFIXES:
        return True
    parts = path.split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).expanduser().is_dir())


def local_path(path: str) -> Path | None:
    """The local file or folder a source's path names, or None for a hub id or a builder name."""
    candidate = Path(path).expanduser()
    if candidate.exists():
        return candidate
    if path in BUILDERS or not looks_local(path):
        return None
    return candidate


def missing_path_error(entry: str, path: str) -> FileNotFoundError:
    """A local source that does not exist: the path, and where a relative one was looked for."""
    where = Path(path).expanduser()
    resolved = where if where.is_absolute() else Path.cwd() / where
    folder = (
        "" if where.is_absolute() else f" (a relative path, resolved from the current folder {Path.cwd()})"
    )
    return FileNotFoundError(f"data source {entry!r}: no such file or folder: {resolved}{folder}")


@dataclass
class LoadedSource:
    """One entry's samples and how they were read (logged, and kept in the run's summary)."""

    entry: str
    """The entry as written in `data.train_files` / `data.heldout_files`."""
    samples: list[Sample]
    """Its validated samples."""
    layout: str
    """The column layout the rows were mapped from (`LAYOUTS`)."""
    origin: str
    """`file`, `folder` (a local dataset folder) or `hub`."""

    def summary(self) -> dict[str, Any]:
        return {"entry": self.entry, "rows": len(self.samples), "layout": self.layout, "origin": self.origin}


def read_source(
    entry: str, *, check_images: bool = True, max_prompt_chars: int = MAX_PROMPT_CHARS
) -> list[Sample]:
    """Every sample of one `data.train_files` entry, validated (see the module docstring).

    Errors name the entry and, for a bad row, the row, its id and the field (`SampleError`);
    an unknown layout names the columns; a local path that does not exist names it and the
    folder it was resolved from; an unreachable dataset names it and the cause."""
    return load_source(entry, check_images=check_images, max_prompt_chars=max_prompt_chars).samples


def load_source(
    entry: str, *, check_images: bool = True, max_prompt_chars: int = MAX_PROMPT_CHARS
) -> LoadedSource:
    """`read_source` with the layout it detected and where the rows came from; logs both and
    the row count."""
    spec = parse_source(entry)
    local = local_path(spec.path)
    if local is not None and not local.exists():
        raise missing_path_error(entry, spec.path)
    if local is not None and not local.is_dir() and (problem := not_a_regular_file(local)) is not None:
        raise ValueError(f"data source {entry!r}: {local} {problem}")  # opening a FIFO would block
    if (
        local is not None
        and local.is_file()
        and local.suffix.lower() in SAMPLE_FILE_SUFFIXES
        and not spec.data_files
    ):
        samples, layout = _read_sample_file(entry, spec, local, check_images, max_prompt_chars)
        origin = "file"
    else:
        rows, columns = _open_dataset(entry, spec)
        base_dir = local.resolve() if local is not None and local.is_dir() else None
        samples, layout = rows_to_samples(
            entry, spec, rows, columns, base_dir, check_images, max_prompt_chars
        )
        origin = "folder" if local is not None else "hub"
    log.info("data source %s: %d samples, %s layout (%s)", entry, len(samples), layout, origin)
    return LoadedSource(entry, samples, layout, origin)


SAMPLE_FIELDS = ("data_source", "reward_model", "extra_info")
"""Fields of mmrl's (V-Triune's, veRL's) sample format that no other layout has: a file whose
first record has one of them but fits no layout is read as mmrl samples, so the error names the
field that is wrong; a record with none of them is another layout, named by its columns."""


def _read_sample_file(entry, spec, path: Path, check_images, max_prompt_chars) -> tuple[list[Sample], str]:
    """A local `.jsonl` / `.json` / `.parquet` file: mmrl's own reader for mmrl samples (the
    default, also for a file whose first record fits no layout but has a field of the sample
    format, `SAMPLE_FIELDS`: its errors name the field), the converters' row mapping for
    V-Triune, veRL and EasyR1 files; a first record of none of these is `layout_error`, naming
    the file's columns, as for a folder or a hub dataset."""
    from mmrl.datasets import converters
    from mmrl.datasets.readers import read_samples

    layout = spec.layout
    if layout == "auto":
        first = _first_record(path)
        layout = detect_layout(first, spec) if first is not None else None
        if layout is None and first is not None and not any(name in first for name in SAMPLE_FIELDS):
            raise layout_error(entry, _columns(path, first), spec)
        layout = layout or "mmrl"
    if layout == "mmrl":
        return read_samples(path, check_images=check_images, max_prompt_chars=max_prompt_chars), layout
    pairs = converters.read_records(path)
    wheres = [where for where, _ in pairs]
    return rows_to_samples(
        entry, spec, (record for _, record in pairs), None, path.resolve().parent,
        check_images, max_prompt_chars, layout=layout, where_of=wheres.__getitem__, source_file=str(path),
    )  # fmt: skip


def _first_record(path: Path) -> dict[str, Any] | None:
    """The file's first record, or None when it cannot be read cheaply (the reader then reports
    what is wrong with the file)."""
    try:
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            batch = next(pq.ParquetFile(path).iter_batches(batch_size=1), None)
            return batch.to_pylist()[0] if batch is not None and batch.num_rows else None
        with path.open(encoding="utf-8") as f:
            head = f.read(1 << 20).lstrip()
        if path.suffix.lower() == ".json" and head.startswith("["):
            # The first element of a JSON array, if it ends within the head.
            start = len(head) - len(head[1:].lstrip())
            record = json.JSONDecoder().raw_decode(head, start)[0]
        else:
            line = head.splitlines()[0] if head else ""
            record = json.loads(line) if line else None
        return record if isinstance(record, dict) else None
    except Exception:  # noqa: BLE001 - any problem is reported by the reader itself
        return None


def _columns(path: Path, first: dict[str, Any]) -> list[str]:
    """A sample file's column names: a Parquet file's schema, else its first record's keys."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        with contextlib.suppress(Exception):
            return list(pq.ParquetFile(path).schema_arrow.names)
    return list(first)


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "data.train_files: reading a dataset by name needs the Hugging Face `datasets` library: "
            "pip install 'mmrl[hub]'"
        ) from None
    return datasets


def _open_dataset(entry: str, spec: SourceSpec) -> tuple[Iterator[dict[str, Any]], list[str] | None]:
    """The rows (plain dicts; images as `{"bytes", "path"}`) and the column names (None when a
    stream does not know them before its first row)."""
    datasets = _datasets()
    local = Path(spec.path)
    try:
        if local.is_dir() and _saved_to_disk(local):
            if spec.revision or spec.config or spec.data_files:
                raise ValueError(
                    f"data source {entry!r}: a save_to_disk folder takes no revision, config or data_files"
                )
            ds = datasets.load_from_disk(str(local))
            if spec.streaming:
                ds = _pick_split(entry, ds, spec.split)
                ds = ds.to_iterable_dataset()
        else:
            kwargs: dict[str, Any] = {"streaming": spec.streaming}
            if spec.config:
                kwargs["name"] = spec.config
            if spec.revision:
                kwargs["revision"] = spec.revision
            if spec.data_files:
                kwargs["data_files"] = spec.data_files
            if spec.split:
                kwargs["split"] = spec.split
            if not local.exists() and spec.path not in BUILDERS and not _looks_like_hub_id(spec.path):
                raise FileNotFoundError(
                    f"data source {entry!r}: {spec.path} is neither a local file or folder nor a hub dataset id "
                    "(org/name)"
                )
            if not local.exists() and spec.path not in BUILDERS:
                _ask_hub_first(entry, spec)
            ds = datasets.load_dataset(spec.path, **kwargs)
    except (ValueError, FileNotFoundError) as exc:
        if str(exc).startswith("data source"):
            raise
        raise _load_error(entry, spec, exc) from exc
    except Exception as exc:  # noqa: BLE001 - datasets and huggingface_hub raise many kinds
        raise _load_error(entry, spec, exc) from exc
    ds = _pick_split(entry, ds, spec.split)
    if spec.max_samples is not None:
        ds = ds.take(spec.max_samples) if spec.streaming else ds.select(range(min(spec.max_samples, len(ds))))
    columns = list(ds.column_names) if ds.column_names is not None else None
    return _rows(ds.with_format("arrow")), columns


def _ask_hub_first(entry: str, spec: SourceSpec) -> None:
    """One short request before `load_dataset` (which retries an unreachable hub for minutes):
    a dataset the hub does not have, or a hub that does not answer, is an error now. Not asked
    under `HF_HUB_OFFLINE=1` (then only the cache is read)."""
    from mmrl.hub import ask_hub, hub_offline, is_cached, unreachable_message

    if hub_offline():
        return
    answer = ask_hub(spec.path, "dataset", spec.revision)
    what = f"data source {entry!r}: hub dataset {spec.path!r}"
    if answer.state == "missing":
        raise ValueError(f"{what}: {answer.detail}")
    if answer.state == "unreachable":
        cached = (
            " (a copy is in the local cache: HF_HUB_OFFLINE=1 reads it)"
            if is_cached(spec.path, "dataset")
            else ""
        )
        raise ValueError(unreachable_message(what, answer) + cached)


def _rows(ds) -> Iterator[dict[str, Any]]:
    """Rows as plain Python values from Arrow batches: images stay encoded bytes."""
    for batch in ds.iter(batch_size=256):
        yield from batch.to_pylist()


def _saved_to_disk(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return 1 <= len(parts) <= 2 and all(p and not p.startswith(".") for p in parts) and "\\" not in path


def _pick_split(entry: str, ds, split: str | None):
    """The split of a dataset dict (`split`, or the only one); a single dataset as it is."""
    if not isinstance(ds, dict):  # DatasetDict and IterableDatasetDict are dicts
        return ds
    names = list(ds.keys())
    if split is None:
        if len(names) == 1:
            return ds[names[0]]
        raise ValueError(
            f"data source {entry!r} has the splits {', '.join(names)}: choose one with @SPLIT "
            f"(e.g. {entry.split('?')[0]}@{names[0]})"
        )
    if split not in names:
        raise ValueError(f"data source {entry!r}: no split {split!r} (there are {', '.join(names)})")
    return ds[split]


def _load_error(entry: str, spec: SourceSpec, exc: BaseException) -> ValueError:
    """A dataset that could not be opened, named, with the cause; offline, the hub's state said."""
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE or "OfflineModeIsEnabled" in f"{type(exc).__name__} {exc}"
    local = Path(spec.path).exists() or spec.path in BUILDERS
    what = f"hub dataset {spec.path!r}" + (f" at revision {spec.revision!r}" if spec.revision else "")
    if offline and not local:
        return ValueError(
            f"data source {entry!r}: {what} is not in the local Hugging Face cache and the hub is offline "
            "(HF_HUB_OFFLINE=1): download it once with the hub reachable (unset HF_HUB_OFFLINE), or point "
            "data.train_files at a local copy (a folder or Parquet files)"
        )
    cause = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return ValueError(f"data source {entry!r}: cannot open {what if not local else spec.path} ({cause})")


def detect_layout(row: dict[str, Any], spec: SourceSpec | None = None) -> str | None:
    """The layout of a row from its keys (`LAYOUTS`), or None when it matches none."""
    spec = spec or SourceSpec(path="")
    reward = row.get("reward_model")
    if isinstance(reward, str) and reward.strip().startswith("{"):
        try:
            reward = json.loads(reward)
        except json.JSONDecodeError:
            reward = None
    if isinstance(reward, dict) and "prompt" in row:
        from mmrl.datasets.converters import map_verifier_names

        if "verifier_parm" in reward or (
            reward.get("verifier") in map_verifier_names
            and map_verifier_names[reward["verifier"]] != reward["verifier"]
        ):
            return "vtriune"
        if reward.get("verifier"):
            return "mmrl"
        return "verl"
    if spec.prompt_key in row and spec.answer_key in row:
        return "easyr1"
    return None


def layout_error(entry: str, columns: list[str], spec: SourceSpec) -> ValueError:
    return ValueError(
        f"data source {entry!r}: unknown column layout (columns: {', '.join(columns)}). Known layouts: "
        "mmrl / V-Triune samples (data_source, prompt, reward_model with a verifier, extra_info), veRL "
        f"(data_source, prompt, reward_model with style and ground_truth), EasyR1 ({spec.prompt_key}, "
        f"{spec.answer_key}, {spec.image_key}; other column names with ?prompt_key=...&answer_key=..."
        "&image_key=...)"
    )


def rows_to_samples(
    entry: str,
    spec: SourceSpec,
    rows: Iterator[dict[str, Any]],
    columns: list[str] | None,
    base_dir: Path | None,
    check_images: bool = True,
    max_prompt_chars: int = MAX_PROMPT_CHARS,
    layout: str | None = None,
    where_of: Callable[[int], str] | None = None,
    source_file: str | None = None,
) -> tuple[list[Sample], str]:
    """Map every row onto the sample format by its layout (`layout`, else `spec.layout`, else
    detected from the first row) and validate it; ids must be unique. `where_of(i)` names row
    i in errors; `source_file` is recorded in converted rows' `extra_info`. Returns the samples
    and the layout they were mapped from."""
    from mmrl.datasets import converters

    where_of = where_of or (lambda i: f"{entry} row {i}")
    layout = layout or (None if spec.layout == "auto" else spec.layout)
    samples: list[Sample] = []
    seen: dict[str, int] = {}
    for index, row in enumerate(rows):
        where = where_of(index)
        if layout is None:
            layout = detect_layout(row, spec)
            if layout is None:
                raise layout_error(entry, columns or sorted(row), spec)
        if layout == "mmrl":
            record, rename = row, None
        elif layout == "vtriune":
            record = converters.vtriune_record(row, index, where=where, source_file=source_file)
            reward = row.get("reward_model")
            uses_parm = isinstance(reward, (dict, str)) and "verifier_params" not in reward
            rename = {"reward_model.verifier_params": "reward_model.verifier_parm"} if uses_parm else None
        else:  # easyr1 and verl rows: the converter tells them apart by `reward_model`
            if layout == "easyr1" and (spec.prompt_key not in row or spec.answer_key not in row):
                raise layout_error(entry, sorted(row), spec)
            record, rename = converters.easyr1_record(
                row,
                index,
                where=where,
                prompt_key=spec.prompt_key,
                answer_key=spec.answer_key,
                image_key=spec.image_key,
                data_source=spec.data_source or (spec.name if layout == "easyr1" else None),
                verifier=spec.verifier,
                source_file=source_file,
            )
        sample = _validate(record, where, base_dir, check_images, max_prompt_chars, rename)
        if sample.id in seen:
            raise SampleError(where, "extra_info.id", f"duplicate id (also row {seen[sample.id]})", sample.id)
        seen[sample.id] = index
        samples.append(sample)
    if not samples:
        raise SampleError(entry, "<dataset>", "no rows")
    return samples, layout


def _validate(record, where, base_dir, check_images, max_prompt_chars, rename) -> Sample:
    try:
        return sample_from_record(record, where, base_dir, check_images, max_prompt_chars)
    except SampleError as exc:
        if not rename:
            raise
        name = exc.field
        for ours, theirs in rename.items():
            if name == ours or name.startswith((ours + ".", ours + "[")):
                name = theirs + name[len(ours) :]
                break
        if name == exc.field:
            raise
        raise SampleError(exc.where, name, exc.problem, exc.record_id) from None
