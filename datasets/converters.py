"""Converters from public data formats to mmrl's sample records (V-Triune's sample-level format).

- `coco_to_samples`: a COCO annotation file + image folder -> detection or grounding samples.
- `vtriune_to_samples`: V-Triune's own Parquet/JSONL records (their field and verifier names).
- `easyr1_to_samples`: EasyR1 rows (`problem`/`answer`/`images`) or veRL rows (`prompt`/`reward_model`).
- `convert`: any of the above, written to a `.jsonl` or `.parquet` file.

Every converter returns validated `Sample`s: each record goes through `sample_from_record`, so a
bad input fails with a `SampleError` naming the source file, the record (line, row or COCO
annotation) and the field. No record is dropped silently: a record that cannot be converted is an
error, except where an option documented below says to skip, and then the number skipped is
logged (logger `mmrl.datasets.converters`, level WARNING).

Inputs are `.jsonl` / `.json` (one object per line, or one JSON array) or `.parquet` files read
with pyarrow. Nested fields may be stored as nested values (Parquet structs and lists, or numpy
arrays when a row came through pandas) or as JSON strings; both are accepted.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mmrl.datasets.readers import read_in_pieces_hint, write_jsonl, write_parquet
from mmrl.datasets.schema import SampleError, sample_from_record
from mmrl.files import check_file, read_file
from mmrl.types import IMAGE_PLACEHOLDER, Sample

logger = logging.getLogger(__name__)

BOX_FORMAT = '{"bbox_2d": [x1, y1, x2, y2], "label": "<category>"}'

DETECTION_QUESTION = (
    "Detect all objects of the following categories in the image: {categories}. "
    "Answer with a JSON list with one entry per object, "
    + BOX_FORMAT
    + ", where (x1, y1) is the top-left and (x2, y2) the bottom-right corner in pixels."
)
"""Default COCO detection question; `{categories}` becomes the image's category names."""

GROUNDING_QUESTION = (
    "Locate the {category} in the image. "
    'Answer with a JSON list holding its box, [{"bbox_2d": [x1, y1, x2, y2], "label": "{category}"}], '
    "where (x1, y1) is the top-left and (x2, y2) the bottom-right corner in pixels."
)
"""Default COCO grounding question; `{category}` becomes the object's category name."""

map_verifier_names: dict[str, str] = {
    "mathverify": "math",
    "detection": "detection",
}
"""V-Triune verifier name -> mmrl verifier name. Names not listed are kept as they are, so a
verifier mmrl lacks fails validation with "unknown verifier" on `reward_model.verifier`."""

VTRIUNE_RUNTIME_PARAMS = frozenset(
    {"is_training", "step", "total_steps", "image_grid_thw", "image_path", "verifier_style"}
)
"""Keys V-Triune's trainer adds to `verifier_parm` at scoring time; dropped when converting
(mmrl passes the step through `VerifyContext` and scores with rule-based verifiers only)."""


# ---------------------------------------------------------------------------------------------
# Reading


def read_records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """Every record of a `.jsonl` / `.json` / `.parquet` file as `(where, record)` pairs.

    `where` is `"file:line"` for JSON lines, `"file record N"` for a JSON array and
    `"file row N"` (0-based) for Parquet, as in `mmrl.datasets.readers`. Records are returned as
    plain Python values (numpy arrays become lists); anything that is not an object is an error.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"input file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".jsonl", ".json"):
        check_file(path, hint=read_in_pieces_hint(path))  # a regular file, of a size to read whole
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        pairs = [(f"{path} row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    elif suffix in (".jsonl", ".json"):
        pairs = list(_json_records(path))
    else:
        raise ValueError(f"{path}: unsupported input file type {suffix!r} (use .jsonl, .json or .parquet)")
    out = []
    for where, record in pairs:
        if not isinstance(record, dict):
            raise SampleError(where, "<record>", f"expected an object, got {type(record).__name__}")
        out.append((where, _plain(record)))
    return out


def _json_records(path: Path):
    text = read_file(path).decode("utf-8")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SampleError(f"{path}:{exc.lineno}", "<record>", f"invalid JSON: {exc.msg}") from None
        for i, record in enumerate(records):
            yield f"{path} record {i + 1}", record
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise SampleError(f"{path}:{lineno}", "<record>", f"invalid JSON: {exc.msg}") from None


def _plain(value: Any) -> Any:
    """Numpy arrays and scalars (rows read through pandas) as plain lists, dicts and scalars."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes, bytearray)):
        return _plain(value.tolist())
    return value


def _json_field(value: Any, field: str, fail: Callable[[str, str], SampleError], kinds=(dict,)) -> Any:
    """A nested field that may be stored as a JSON string: parsed; other values unchanged."""
    if isinstance(value, str) and value.strip()[:1] in ("{", "["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise fail(field, f"not valid JSON: {exc}") from None
        if not isinstance(value, kinds):
            raise fail(field, f"must hold a JSON {' or '.join(k.__name__ for k in kinds)}")
    return _plain(value)


def _validate(
    record: dict[str, Any],
    where: str,
    base_dir: Path | None,
    check_images: bool,
    rename: Mapping[str, str] | None = None,
) -> Sample:
    """`sample_from_record`, with schema field names translated back to the source's names."""
    try:
        return sample_from_record(record, where, base_dir, check_images)
    except SampleError as exc:
        if not rename:
            raise
        field = exc.field
        for ours, theirs in rename.items():
            if field == ours or field.startswith(ours + ".") or field.startswith(ours + "["):
                field = theirs + field[len(ours) :]
                break
        if field == exc.field:
            raise
        raise SampleError(exc.where, field, exc.problem, exc.record_id) from None


def _check_unique_ids(samples: list[Sample], wheres: list[str]) -> None:
    seen: dict[str, int] = {}
    for i, sample in enumerate(samples):
        if sample.id in seen:
            raise SampleError(
                wheres[i], "extra_info.id", f"duplicate id (also {wheres[seen[sample.id]]})", sample.id
            )
        seen[sample.id] = i


def _failer(where: str, record_id: str | None) -> Callable[[str, str], SampleError]:
    def fail(field: str, problem: str) -> SampleError:
        return SampleError(where, field, problem, record_id)

    return fail


# ---------------------------------------------------------------------------------------------
# COCO


def coco_to_samples(
    annotation_file: str | Path,
    image_dir: str | Path,
    *,
    task: str = "detection",
    data_source: str = "coco",
    question: str | None = None,
    max_boxes: int | None = None,
    skip_crowd: bool = True,
    category_names: Mapping[int | str, str] | None = None,
    check_images: bool = True,
) -> list[Sample]:
    """Detection or grounding samples from a COCO annotation file (read with pycocotools).

    `task="detection"`: one sample per image that has at least one usable annotation. The prompt
    is `"<image>" + question`, the question asking for every object of the categories present in
    the image (`DETECTION_QUESTION`, `{categories}` replaced by their names, comma-separated, in
    category-id order). Ground truth: one `{"bbox_2d": [x1, y1, x2, y2], "label": name}` per
    annotation, in file order, the COCO box `[x, y, w, h]` turned into corners
    `[x, y, x + w, y + h]` (pixels of the original image). `extra_info` is
    `{"id": f"{data_source}/{image_id}", "image_id", "width", "height"}`.

    `task="grounding"`: one sample per annotation whose category occurs exactly once in its image
    (counting crowd annotations too): with two objects of a category, "Locate the <name>" has no
    single referent, so those annotations are not used. The question is `GROUNDING_QUESTION`
    (`{category}` replaced), the ground truth a list with the one box, and `extra_info` also holds
    `annotation_id`; the id is `f"{data_source}/{image_id}/{annotation_id}"`.

    Both use the `detection` verifier with `{"iou_threshold": "dynamic"}`; `ability` is the task.

    Args:
        annotation_file: COCO-format JSON (`images`, `annotations`, `categories`).
        image_dir: folder holding the images' `file_name`s; samples store the path under it.
        question: replaces the default question; `{categories}` / `{category}` in it are replaced
            (plain text replacement, so JSON braces in the question need no escaping).
        max_boxes: skip (and count in the log) detection images with more usable boxes than this.
        skip_crowd: leave `iscrowd` annotations out of the ground truth (they mark groups, not
            objects); with False they are ordinary boxes.
        category_names: category id -> label to use instead of the COCO category name.
        check_images: decode every image once; a missing file is then an error naming it.

    Images without usable annotations produce no sample (there is nothing to find); their count,
    and the count of annotations grounding cannot use, are logged.
    """
    if task not in ("detection", "grounding"):
        raise ValueError(f"task must be 'detection' or 'grounding', got {task!r}")
    if max_boxes is not None and max_boxes < 1:
        raise ValueError(f"max_boxes must be at least 1, got {max_boxes}")
    annotation_file = Path(annotation_file)
    image_dir = Path(image_dir).resolve()
    coco = _load_coco(annotation_file)
    renames = {str(k): v for k, v in (category_names or {}).items()}
    labels = {cid: renames.get(str(cid), cat.get("name")) for cid, cat in coco.cats.items()}
    for cid, label in labels.items():
        if not isinstance(label, str) or not label:
            raise SampleError(
                str(annotation_file), f"categories[id={cid}].name", "must be a non-empty string"
            )
    if question is None:
        question = DETECTION_QUESTION if task == "detection" else GROUNDING_QUESTION

    samples: list[Sample] = []
    wheres: list[str] = []
    skipped = Counter()
    for image_id, image in coco.imgs.items():
        image_where = f"{annotation_file} image {image_id}"
        file_name = image.get("file_name")
        if not isinstance(file_name, str) or not file_name:
            raise SampleError(image_where, "images.file_name", "missing")
        boxes = []  # (annotation id, category id, corner box, iscrowd)
        for ann in coco.imgToAnns.get(image_id, []):
            ann_where = f"{annotation_file} annotation {ann['id']} (image {image_id})"
            if ann["category_id"] not in coco.cats:
                raise SampleError(ann_where, "category_id", f"unknown category id {ann['category_id']!r}")
            crowd = bool(ann.get("iscrowd", 0))
            boxes.append((ann["id"], ann["category_id"], _corners(ann.get("bbox"), ann_where), crowd))
        usable = [b for b in boxes if not (skip_crowd and b[3])]
        if not usable:
            skipped["images without usable annotations"] += 1
            continue
        width, height = image.get("width"), image.get("height")
        base = {
            "data_source": data_source,
            "images": [str(image_dir / file_name)],
            "ability": task,
        }
        params = {"iou_threshold": "dynamic"}
        if task == "detection":
            if max_boxes is not None and len(usable) > max_boxes:
                skipped[f"images with more than max_boxes={max_boxes} boxes"] += 1
                continue
            names = [labels[cid] for cid in sorted({b[1] for b in usable})]
            text = question.replace("{categories}", ", ".join(names))
            record = {
                **base,
                "prompt": [{"role": "user", "content": IMAGE_PLACEHOLDER + text}],
                "reward_model": {
                    "ground_truth": [{"bbox_2d": box, "label": labels[cid]} for _, cid, box, _ in usable],
                    "verifier": "detection",
                    "verifier_params": params,
                },
                "extra_info": {
                    "id": f"{data_source}/{image_id}",
                    "image_id": image_id,
                    "width": width,
                    "height": height,
                },
            }
            samples.append(_validate(record, image_where, None, check_images))
            wheres.append(image_where)
            continue
        per_category = Counter(b[1] for b in boxes)
        check = check_images  # decode each image once, not once per annotation
        for ann_id, cid, box, _ in usable:
            if per_category[cid] != 1:
                skipped["annotations whose category occurs more than once in the image"] += 1
                continue
            text = question.replace("{category}", labels[cid])
            record = {
                **base,
                "prompt": [{"role": "user", "content": IMAGE_PLACEHOLDER + text}],
                "reward_model": {
                    "ground_truth": [{"bbox_2d": box, "label": labels[cid]}],
                    "verifier": "detection",
                    "verifier_params": params,
                },
                "extra_info": {
                    "id": f"{data_source}/{image_id}/{ann_id}",
                    "image_id": image_id,
                    "annotation_id": ann_id,
                    "width": width,
                    "height": height,
                },
            }
            where = f"{annotation_file} annotation {ann_id} (image {image_id})"
            samples.append(_validate(record, where, None, check))
            wheres.append(where)
            check = False
    _check_unique_ids(samples, wheres)
    _log_skipped(annotation_file, skipped)
    return samples


def _load_coco(annotation_file: Path):
    from pycocotools.coco import COCO

    if not annotation_file.exists():
        raise FileNotFoundError(f"COCO annotation file not found: {annotation_file}")
    where = str(annotation_file)
    try:
        data = json.loads(read_file(annotation_file).decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise SampleError(f"{where}:{exc.lineno}", "<file>", f"invalid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise SampleError(where, "<file>", "a COCO annotation file holds one JSON object")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise SampleError(where, key, "missing (must be a list)")
    required = {"images": ("id",), "annotations": ("id", "image_id", "category_id"), "categories": ("id",)}
    for key, fields in required.items():
        for i, item in enumerate(data[key]):
            for name in fields:
                if not isinstance(item, dict) or name not in item:
                    raise SampleError(f"{where} {key}[{i}]", f"{key}.{name}", "missing")
    image_ids = {img["id"] for img in data["images"]}
    for ann in data["annotations"]:
        if ann["image_id"] not in image_ids:
            raise SampleError(
                f"{where} annotation {ann['id']}", "image_id", f"no image with id {ann['image_id']!r}"
            )
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        coco.createIndex()
    return coco


def _corners(bbox: Any, where: str) -> list[float]:
    """COCO `[x, y, w, h]` -> `[x1, y1, x2, y2]` (sums rounded to 2 decimals against float noise)."""
    ok = (
        isinstance(bbox, (list, tuple))
        and len(bbox) == 4
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox)
    )
    if not ok:
        raise SampleError(where, "bbox", f"must be [x, y, width, height] (4 numbers), got {bbox!r}")
    x, y, w, h = bbox
    if w <= 0 or h <= 0:
        raise SampleError(where, "bbox", f"width and height must be positive, got {bbox!r}")
    return [x, y, round(x + w, 2), round(y + h, 2)]


def _log_skipped(source: Path, skipped: Counter) -> None:
    for reason, count in skipped.items():
        logger.warning("%s: skipped %d %s", source, count, reason)


# ---------------------------------------------------------------------------------------------
# V-Triune

_ANSWER_WRAP = re.compile(r"\s*<answer>(.*)</answer>\s*", re.DOTALL)


def vtriune_record(
    record: Mapping[str, Any], index: int, *, where: str, source_file: str | None = None
) -> dict[str, Any]:
    """One V-Triune record rewritten in mmrl's spelling (not yet validated).

    - `reward_model.verifier` is renamed with `map_verifier_names` (`mathverify` -> `math`);
      other names are kept, so an unknown one fails validation on `reward_model.verifier`.
    - `reward_model.verifier_parm` (a dict or JSON string) becomes `verifier_params`, without the
      runtime keys in `VTRIUNE_RUNTIME_PARAMS`. For `detection`, V-Triune's constructor options
      are renamed: `det_verifier_normalized` -> `normalized` (true needs an explicit
      `image_size`, which V-Triune took from the model input at scoring time), `det_reward_ratio`
      -> `completeness_weight` (its `iou_completeness`) and `weights` (the other entries). For
      `math`, `format` defaults to `"think_answer"`: V-Triune's mathverify format reward is the
      think/answer tag structure.
    - `accuracy_ratio` / `format_ratio` default to 1.0 / 0.0 when missing or null.
    - A ground truth wrapped as `<answer> ... </answer>` is unwrapped; a detection ground truth
      given as text (JSON, or the Python literal V-Triune writes) becomes a list of boxes.
    - `extra_info` without `id` gets `f"{data_source}/{index}"`; `source_file` is recorded.
    - V-Triune's `reward_model.answer` (the unformatted answer) is kept as `extra_info.answer`.

    `prompt`, `images`, `reward_model`, `extra_info` may be JSON strings or numpy arrays.
    """
    record = _plain(dict(record))
    extra = record.get("extra_info")
    fail = _failer(where, None)
    extra = _json_field(extra, "extra_info", fail) if extra is not None else {}
    if not isinstance(extra, dict):
        raise fail("extra_info", f"must be an object, got {type(extra).__name__}")
    extra = dict(extra)
    data_source = record.get("data_source")
    if extra.get("id") is None and isinstance(data_source, str) and data_source:
        extra["id"] = f"{data_source}/{index}"
    if source_file is not None:
        extra["source_file"] = source_file
    fail = _failer(where, None if extra.get("id") is None else str(extra["id"]))

    out = dict(record)
    out["extra_info"] = extra
    if "prompt" in out:
        out["prompt"] = _json_field(out["prompt"], "prompt", fail, kinds=(list,))
    if "images" in out and out["images"] is not None:
        out["images"] = _json_field(out["images"], "images", fail, kinds=(list,))
    reward = out.get("reward_model")
    if reward is None:
        return out  # validation reports the missing field
    reward = _json_field(reward, "reward_model", fail)
    if not isinstance(reward, dict):
        raise fail("reward_model", f"must be an object, got {type(reward).__name__}")
    reward = dict(reward)
    verifier = reward.get("verifier")
    if isinstance(verifier, str):
        verifier = map_verifier_names.get(verifier, verifier)
        reward["verifier"] = verifier

    params = reward.pop("verifier_parm", None)
    if reward.get("verifier_params") is not None:
        params = reward["verifier_params"]
    params = {} if params is None or (isinstance(params, str) and not params.strip()) else params
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except json.JSONDecodeError as exc:
            raise fail("reward_model.verifier_parm", f"not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise fail("reward_model.verifier_parm", f"must be an object, got {type(params).__name__}")
    reward["verifier_params"] = _vtriune_params(verifier, _plain(params), fail)

    for name, default in (("accuracy_ratio", 1.0), ("format_ratio", 0.0)):
        if reward.get(name) is None:
            reward[name] = default
    answer = reward.pop("answer", None)
    if answer is not None and "answer" not in extra:
        extra["answer"] = answer
    if "ground_truth" in reward:
        reward["ground_truth"] = _vtriune_ground_truth(reward["ground_truth"], verifier)
    out["reward_model"] = reward
    return out


def _vtriune_params(verifier: Any, params: dict[str, Any], fail) -> dict[str, Any]:
    # A null value is an absent one: a Parquet struct column (`verifier_parm` read as a struct
    # rather than a JSON string) gives every row every key, null where the row has none.
    params = {k: v for k, v in params.items() if k not in VTRIUNE_RUNTIME_PARAMS and v is not None}
    if verifier == "detection":
        if "det_verifier_normalized" in params:
            normalized = params.pop("det_verifier_normalized")
            params.setdefault("normalized", normalized)
            if normalized is True and params.get("image_size") is None:
                raise fail(
                    "reward_model.verifier_parm.det_verifier_normalized",
                    "V-Triune rescales predictions by the model input's size at scoring time; mmrl "
                    "needs it in the record: add verifier_params.image_size = [width, height] of the "
                    "image the model sees",
                )
        ratios = params.pop("det_reward_ratio", None)
        if isinstance(ratios, str):
            try:
                ratios = json.loads(ratios)
            except json.JSONDecodeError as exc:
                raise fail("reward_model.verifier_parm.det_reward_ratio", f"not valid JSON: {exc}") from None
        if ratios is not None:
            if not isinstance(ratios, dict):
                raise fail("reward_model.verifier_parm.det_reward_ratio", "must be an object")
            ratios = dict(ratios)
            if "iou_completeness" in ratios:
                params.setdefault("completeness_weight", ratios.pop("iou_completeness"))
            params.setdefault("weights", ratios)
    elif verifier == "math":
        params.setdefault("format", "think_answer")
    return params


def _vtriune_ground_truth(value: Any, verifier: Any) -> Any:
    if isinstance(value, str):
        match = _ANSWER_WRAP.fullmatch(value)
        if match:
            value = match.group(1).strip()
        if verifier == "detection" and value.strip()[:1] == "[":
            for parse in (json.loads, ast.literal_eval):
                try:
                    parsed = parse(value)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
                if isinstance(parsed, list):
                    return parsed
    return value  # anything else is for the verifier to judge


def vtriune_to_samples(path: str | Path, *, check_images: bool = True) -> list[Sample]:
    """Validated samples from a V-Triune Parquet / JSONL file (see `vtriune_record`).

    Relative image paths resolve against the file's folder. Ids default to
    `f"{data_source}/{index}"`, `index` being the record's 0-based position in the file.
    """
    path = Path(path)
    base_dir = path.resolve().parent
    rename = {"reward_model.verifier_params": "reward_model.verifier_parm"}
    samples, wheres = [], []
    for index, (where, record) in enumerate(read_records(path)):
        converted = vtriune_record(record, index, where=where, source_file=str(path))
        reward = record.get("reward_model")
        uses_parm = isinstance(reward, (dict, str)) and "verifier_params" not in reward
        samples.append(_validate(converted, where, base_dir, check_images, rename if uses_parm else None))
        wheres.append(where)
    _check_unique_ids(samples, wheres)
    return samples


# ---------------------------------------------------------------------------------------------
# EasyR1 / veRL


def easyr1_record(
    row: Mapping[str, Any],
    index: int,
    *,
    where: str,
    prompt_key: str = "problem",
    answer_key: str = "answer",
    image_key: str = "images",
    data_source: str | None = None,
    verifier: str = "math",
    source_file: str | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """One EasyR1 or veRL row as an mmrl record (not yet validated), and the field renames that
    translate schema field names back to the row's own (for error messages).

    Which layout a row has is decided by its keys: a row with `reward_model` is a veRL row,
    otherwise a row with `prompt_key` is an EasyR1 row; anything else is an error.

    - EasyR1: prompt `[{"role": "user", "content": row[prompt_key]}]` (its `<image>` placeholders
      must match `row[image_key]` one to one), ground truth `str(row[answer_key])`, verifier
      `verifier`, ability `verifier`, id `f"{data_source}/{index}"`. The rows name no source:
      `data_source` defaults to the stem of `source_file` (`"easyr1"` without one).
    - veRL (e.g. geo3k): `prompt`, `images`, `ability` and `extra_info` kept;
      `reward_model.style == "rule"` (or no style) means `verifier`; a `reward_model.verifier`
      is kept as it is. `data_source` is the row's own unless the caller passed one. Id:
      `f"{data_source}/{split}/{extra_info.index}"` (`split/` only when `extra_info.split` is
      set, since veRL numbers each split from 0), else `f"{data_source}/{index}"`.
    """
    row = _plain(dict(row))
    fail = _failer(where, None)
    if "reward_model" in row and row["reward_model"] is not None:
        return _verl_record(row, index, where, image_key, data_source, verifier, source_file)
    if prompt_key not in row:
        raise fail(
            "<record>",
            f"neither an EasyR1 row (needs {prompt_key!r} and {answer_key!r}) nor a veRL row "
            f"(needs 'prompt' and 'reward_model'); keys: {sorted(row)}",
        )
    if data_source is None:
        data_source = Path(source_file).stem if source_file else "easyr1"
    record_id = f"{data_source}/{index}"
    fail = _failer(where, record_id)
    problem = row[prompt_key]
    if not isinstance(problem, str) or not problem.strip():
        raise fail(prompt_key, "must be a non-empty string")
    if row.get(answer_key) is None:
        raise fail(answer_key, "missing")
    answer = row[answer_key]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise fail(answer_key, f"must be a string or number, got {type(answer).__name__}")
    images = row.get(image_key)
    images = [] if images is None else _json_field(images, image_key, fail, kinds=(list,))
    if isinstance(images, (str, dict)):
        images = [images]  # a single image
    extra = {"id": record_id, "index": index}
    if source_file is not None:
        extra["source_file"] = source_file
    record = {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": problem}],
        "images": images,
        "ability": verifier,
        "reward_model": {"ground_truth": str(answer), "verifier": verifier},
        "extra_info": extra,
    }
    rename = {
        "prompt[0].content": prompt_key,
        "prompt": prompt_key,
        "images": image_key,
        "reward_model.ground_truth": answer_key,
    }
    return record, rename


def _verl_record(row, index, where, image_key, data_source, verifier, source_file):
    fail = _failer(where, None)
    extra = row.get("extra_info")
    extra = {} if extra is None else _json_field(extra, "extra_info", fail)
    if not isinstance(extra, dict):
        raise fail("extra_info", f"must be an object, got {type(extra).__name__}")
    extra = dict(extra)
    source = data_source if data_source is not None else row.get("data_source")
    if not isinstance(source, str) or not source:
        raise fail("data_source", "missing (pass data_source= to name it)")
    if extra.get("id") is None:
        if extra.get("index") is not None:
            split = extra.get("split")
            extra["id"] = f"{source}/{split}/{extra['index']}" if split else f"{source}/{extra['index']}"
        else:
            extra["id"] = f"{source}/{index}"
    if source_file is not None:
        extra["source_file"] = source_file
    fail = _failer(where, str(extra["id"]))
    reward = _json_field(row["reward_model"], "reward_model", fail)
    if not isinstance(reward, dict):
        raise fail("reward_model", f"must be an object, got {type(reward).__name__}")
    reward = dict(reward)
    style = reward.pop("style", None)
    if not reward.get("verifier"):
        if style not in (None, "rule"):
            raise fail(
                "reward_model.style",
                f"only 'rule' (scored by the {verifier!r} verifier) is supported, got {style!r}",
            )
        reward["verifier"] = verifier
    if "prompt" not in row or row["prompt"] is None:
        raise fail("prompt", "missing")
    images = row.get(image_key)
    images = [] if images is None else _json_field(images, image_key, fail, kinds=(list,))
    record = {
        "data_source": source,
        "prompt": _json_field(row["prompt"], "prompt", fail, kinds=(list,)),
        "images": images,
        "ability": row.get("ability") or reward["verifier"],
        "reward_model": reward,
        "extra_info": extra,
    }
    return record, {"images": image_key} if image_key != "images" else {}


def easyr1_to_samples(
    path: str | Path,
    *,
    prompt_key: str = "problem",
    answer_key: str = "answer",
    image_key: str = "images",
    data_source: str | None = None,
    verifier: str = "math",
    check_images: bool = True,
) -> list[Sample]:
    """Validated samples from an EasyR1 or veRL Parquet / JSONL file (see `easyr1_record`).

    `data_source` defaults to the file's stem for EasyR1 rows (they carry none) and to each
    row's own `data_source` for veRL rows. Relative image paths resolve against the file's folder.
    """
    path = Path(path)
    base_dir = path.resolve().parent
    samples, wheres = [], []
    for index, (where, row) in enumerate(read_records(path)):
        record, rename = easyr1_record(
            row,
            index,
            where=where,
            prompt_key=prompt_key,
            answer_key=answer_key,
            image_key=image_key,
            data_source=data_source,
            verifier=verifier,
            source_file=str(path),
        )
        samples.append(_validate(record, where, base_dir, check_images, rename))
        wheres.append(where)
    _check_unique_ids(samples, wheres)
    return samples


# ---------------------------------------------------------------------------------------------
# Writing

CONVERTERS: dict[str, Callable[..., list[Sample]]] = {
    "coco": coco_to_samples,
    "vtriune": vtriune_to_samples,
    "easyr1": easyr1_to_samples,
}


def convert(kind: str, *inputs: str | Path, output_path: str | Path, **options: Any) -> int:
    """Convert `inputs` with the `kind` converter and write the samples; returns how many.

    Args:
        kind: `"coco"` (inputs: annotation file, image folder), `"vtriune"` or `"easyr1"`
            (inputs: one or more `.jsonl` / `.parquet` files, concatenated in order).
        output_path: `.jsonl` / `.json` (written with `write_jsonl`, images inline as base64
            unless they are paths) or `.parquet` (`write_parquet`).
        options: keyword options of the converter (`task=`, `max_boxes=`, `prompt_key=`, ...).

    Ids must be unique across all inputs. Nothing is written when any record fails, or when
    there is no sample at all (both raise).

    Example: `convert("coco", "instances_val2017.json", "val2017/", output_path="det.parquet")`.
    """
    if kind not in CONVERTERS:
        raise ValueError(f"unknown converter {kind!r} (known: {', '.join(CONVERTERS)})")
    output_path = Path(output_path)
    suffix = output_path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"{output_path}: output must end in .jsonl, .json or .parquet")
    if kind == "coco":
        if len(inputs) != 2:
            raise ValueError("coco takes two inputs: the annotation file and the image folder")
        samples = coco_to_samples(*inputs, **options)
        wheres = [s.id for s in samples]
    else:
        if not inputs:
            raise ValueError(f"{kind} takes one or more input files")
        samples, wheres = [], []
        for path in inputs:
            converted = CONVERTERS[kind](path, **options)
            samples.extend(converted)
            wheres.extend(f"{path} sample {s.id}" for s in converted)
    _check_unique_ids(samples, wheres)
    if not samples:
        raise ValueError(f"no samples converted from {', '.join(map(str, inputs))}")
    (write_parquet if suffix == ".parquet" else write_jsonl)(samples, output_path)
    return len(samples)
