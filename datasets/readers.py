"""Readers for sample files: JSONL and Parquet, every record validated on load."""

from __future__ import annotations

import json
from pathlib import Path

from mmrl.datasets.schema import MAX_PROMPT_CHARS, SampleError, sample_from_record
from mmrl.files import check_file, read_file
from mmrl.types import Sample


def read_samples(
    path: str | Path, check_images: bool = True, max_prompt_chars: int = MAX_PROMPT_CHARS
) -> list[Sample]:
    """Read and validate every sample in a `.jsonl` / `.json` / `.parquet` file.

    Relative image paths are resolved against the file's folder. Only a regular file of at most
    `mmrl.files.MAX_DATA_FILE_BYTES` is read (it is read whole). The first bad record stops
    the read with a `SampleError` naming the file, line (or row), id and field; so do bytes
    that are not UTF-8 and a file with no records at all. Duplicate ids are an error too:
    metrics, dumps and resumption all key on them. Prompts longer than `max_prompt_chars`
    characters are refused.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"sample file not found: {path}")
    if path.is_dir():
        raise ValueError(f"{path}: is a folder, not a sample file")
    check_file(path, hint=read_in_pieces_hint(path))  # a regular file, of a size to read whole
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        samples = list(_read_parquet(path, check_images, max_prompt_chars))
    elif suffix in (".jsonl", ".json"):
        samples = list(_read_jsonl(path, check_images, max_prompt_chars))
    else:
        raise ValueError(f"{path}: unsupported sample file type {suffix!r} (use .jsonl or .parquet)")
    if not samples:
        raise SampleError(str(path), "<file>", "no records (an empty file)")
    seen: dict[str, int] = {}
    for i, sample in enumerate(samples):
        if sample.id in seen:
            raise SampleError(
                f"{path} record {i + 1}",
                "extra_info.id",
                f"duplicate id (also record {seen[sample.id] + 1})",
                sample.id,
            )
        seen[sample.id] = i
    return samples


def read_in_pieces_hint(path: Path) -> str:
    """How to read a sample file too large to read whole: through the `datasets` library, whose
    Arrow tables are memory-mapped (`mmrl.datasets.sources`)."""
    builder = "parquet" if path.suffix.lower() == ".parquet" else "json"
    return f"; read it through the datasets library instead: data.train_files=[{builder}@train?data_files={path}]"


def _decode(path: Path) -> str:
    """The file's text; bytes that are not UTF-8 are a `SampleError` naming the line."""
    data = read_file(path, hint=read_in_pieces_hint(path))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SampleError(
            f"{path}:{lineno}",
            "<record>",
            f"not UTF-8 text: byte 0x{data[exc.start]:02x} at column {column} (byte offset {exc.start})",
        ) from None


def _read_jsonl(path: Path, check_images: bool, max_prompt_chars: int = MAX_PROMPT_CHARS):
    text = _decode(path)
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SampleError(f"{path}:{exc.lineno}", "<record>", f"invalid JSON: {exc.msg}") from None
        for i, record in enumerate(records):
            yield sample_from_record(
                record, f"{path} record {i + 1}", path.parent, check_images, max_prompt_chars
            )
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SampleError(f"{path}:{lineno}", "<record>", f"invalid JSON: {exc.msg}") from None
        except RecursionError:
            raise SampleError(f"{path}:{lineno}", "<record>", "invalid JSON: nested too deeply") from None
        yield sample_from_record(record, f"{path}:{lineno}", path.parent, check_images, max_prompt_chars)


def _read_parquet(path: Path, check_images: bool, max_prompt_chars: int = MAX_PROMPT_CHARS):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise SampleError(str(path), "<file>", f"not a readable Parquet file ({exc})") from None
    for i, record in enumerate(table.to_pylist()):
        yield sample_from_record(record, f"{path} row {i}", path.parent, check_images, max_prompt_chars)


def write_jsonl(samples: list[Sample], path: str | Path) -> None:
    """Write samples as JSONL, images base64-encoded inline (`data:image/png;base64,...`)."""
    import base64

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for sample in samples:
            record = sample.to_record()
            record["images"] = [
                "data:image/png;base64," + base64.b64encode(im).decode() if isinstance(im, bytes) else im
                for im in record["images"]
            ]
            f.write(json.dumps(record) + "\n")


def write_parquet(samples: list[Sample], path: str | Path) -> None:
    """Write samples as Parquet, images as `{"bytes": ..., "path": ...}` (the HF datasets layout)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for sample in samples:
        record = sample.to_record()
        record["images"] = [
            {"bytes": im, "path": None} if isinstance(im, bytes) else {"bytes": None, "path": im}
            for im in record["images"]
        ]
        # Parquet wants one type per column: free-form fields go in as JSON strings, which the
        # reader (and every verifier, as V-Triune's data does) accepts.
        rm = record["reward_model"]
        if not isinstance(rm["ground_truth"], str):
            rm["ground_truth"] = json.dumps(rm["ground_truth"])
        rm["verifier_params"] = json.dumps(rm["verifier_params"])
        record["extra_info"] = json.dumps(record["extra_info"])
        record["agent"] = json.dumps(record["agent"]) if "agent" in record else None
        rows.append(record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
