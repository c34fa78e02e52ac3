"""The reward server's wire formats, and converters from them to mmrl samples.

Three request shapes become the same unit of work, a `WireItem` (one response to one sample),
and every check here raises `RequestError(status, message)` naming the field that is wrong
(`samples[3].reward_model.verifier: unknown verifier 'mathh' (known: ...)`).

**Native** `POST /score` (mmrl samples; one sample may be shared by several responses):

    {"samples": [<sample record>, ...],          # mmrl / V-Triune records, see below
     "responses": ["...", ...],
     "sample_index": [0, 0, 1, ...],             # optional: responses[i] answers samples[sample_index[i]]
     "context": {"step": 0, "total_steps": 1},   # optional
     "timeout_s": 30}                            # optional, capped by the server's request_timeout_s
    -> {"results": [{"id": ..., "score": 1.0, "components": {...}, "error": null,
                     "extracted": "3"}, ...],
        "errors": 0}

Any other key (a misspelt `sampels`) is a 400 naming it, with the closest known key.

A sample record is mmrl's (V-Triune's) sample format; only `reward_model` is required here:
`{"data_source", "prompt", "images", "ability", "reward_model": {"ground_truth", "verifier",
"verifier_params" (or V-Triune's "verifier_parm", an object or a JSON string; a parameter
given as null is taken as not given), "accuracy_ratio", "format_ratio"}, "extra_info": {"id"}}`.
Images may be local paths (on the server's disk), base64 strings, `data:image/...;base64,...`
URLs or `{"bytes": <base64>}` / `{"path": ...}` objects; rule-based verifiers never read pixels,
so they are decoded only with `ServeConfig.check_images`.
Without `sample_index`, `samples` and `responses` pair up one to one.

**OpenRLHF** `POST /get_reward`: `{"query": [...], "prompts": [...], "labels": [...], "step": 120,
"total_steps": 1000}` (`step` / `total_steps` optional, also as `"context": {...}`; without them
every query is scored at step 0 of 1, so the dynamic IoU threshold never advances) ->
`{"rewards": [...], "scores": [...], "extra_logs": {"accuracy": [...], "format": [...],
"verifier_error": [...]}}`. `query[i]` is prompt + response; when it starts with `prompts[i]` the
prompt is cut off, so a `\\boxed{}` in the prompt is never taken for the answer. How a label picks
its verifier is `ServeConfig.label_mode`. Empty lists give empty lists.

**V-Triune** `POST /judge`: their payload `{"response", "prompt", "answer", "solution",
"data_source", "reward_verifier", "reward_verifier_parm" (JSON string), "format_ratio"
(or "fmt_ratio"), "accuracy_ratio"}` -> `{"rewards": {...V-Triune's keys...}, "error": null}`,
always with status 200: V-Triune's trainer reads every answer's `rewards` and stops on a 4xx, so
a sample that cannot be scored gets every key at 0.0 and `error` saying why (the server counts
and logs it). The keys are exactly V-Triune's for the verifier (`judge_keys`). As in their
server, `final_reward = (a * accuracy + f * format) / (a + f)` with `a` = accuracy_ratio
(default 1.0) and `f` = format_ratio (default `ServeConfig.judge_format_ratio`, theirs: 0.1);
`mathverify` and `detection` are scored in V-Triune's style (see `parse_judge`), and the runtime
keys they add to `reward_verifier_parm` (`step`, `total_steps`, `image_grid_thw`, ...) become
the verify context (`image_grid_thw` supplies the size for normalised detection).

Response text is data: it is handed to the verifiers as a string and never evaluated.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmrl.types import RewardSpec, Sample, VerifierResult, VerifyContext

SampleFields = tuple
"""(verifier, ground_truth, verifier_params, accuracy_ratio, format_ratio, data_source, sample_id,
prompt): what a worker needs of a sample."""

WireItem = tuple
"""(sample fields, response, step, total_steps, native): what a worker process needs to score
one response; `native` asks for the answer as `/score` sends it (see `WireResult`). The
responses to one sample share one `SampleFields` tuple, which pickling keeps shared, so a
worker builds and checks each sample once per message."""

WireResult = tuple | str
"""A worker's answer for one item: `(score, components, error, extracted, invalid)`, where
`invalid` is `(field, problem)` when the verifier's `check_sample` rejected the sample, else
None; or, for a `native` item scored without error, the fields of its `/score` result as JSON
text (`render_fields`), so the server only has to add the id."""


class RequestError(Exception):
    """A request the server rejects: HTTP `status` and a message naming the problem."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def bad(where: str, problem: str) -> RequestError:
    """422 naming the offending field."""
    return RequestError(422, f"{where}: {problem}" if where else problem)


MAX_JSON_DEPTH = 64
"""Deepest nesting accepted in a sample's JSON values (`ground_truth`, `verifier_params` or
`verifier_parm`, `prompt`, `extra_info`, a label, `/judge`'s `solution`, `answer` and
`reward_verifier_parm`), given as JSON or as a string of JSON: no verifier needs more, and
deeper values would only reach recursion limits further on (pickling them for a worker). A body
too deep for the JSON parser itself is refused the same way, naming where it gets too deep."""


class MalformedJSON(RequestError):
    """The text is not JSON at all (as opposed to JSON holding something unusable)."""


class _NonFinite(ValueError):
    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(text)
    return value


def _no_constant(name: str) -> Any:
    raise _NonFinite(name)


def loads(text: str | bytes, where: str = "") -> Any:
    """JSON text as Python objects, refusing what would fail later or mean nothing: `NaN`,
    `Infinity`, a number too large for a float (`1e400`), an integer literal of more than
    4,300 digits (Python's limit for int <-> str), nesting deeper than the parser's recursion
    limit. Raises `RequestError`: 400 for malformed text of the body (`where` = ""), else 422
    naming `where` (and, for an unusable number, the path to it inside the text)."""
    status, prefix = (400, "malformed JSON: ") if not where else (422, f"{where}: not valid JSON: ")
    try:
        return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise MalformedJSON(status, f"{prefix}the body is not UTF-8 ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise MalformedJSON(status, f"{prefix}{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except _NonFinite as exc:
        problem = (
            f"non-finite number {exc.text[:40]!r}: numbers must be finite (NaN, Infinity and "
            "values beyond the float range are refused)"
        )
    except RecursionError:  # past the parser's own limit (about 1,000 levels): say where
        path = _deep_path(text, MAX_JSON_DEPTH)
        if not path or path.startswith("["):  # the body itself an array, or no path found
            place = (where or "body") + path
        else:
            place = f"{where}.{path}" if where else path
        raise RequestError(
            422, f"{place}: nested more than {MAX_JSON_DEPTH} levels deep (this server's limit)"
        ) from None
    except ValueError as exc:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        if "digits" not in str(exc):
            raise
        problem = f"an integer literal of more than {_max_digits()} digits (Python's limit for integers)"
    path = _bad_number_path(text)
    place = f"{where}.{path}" if where and path else where or path or "body"
    raise RequestError(422, f"{place}: {problem}")


_JSON_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:,]')
"""A JSON string, or one structural character (everything else is skipped by the search)."""


def _deep_path(text: str | bytes, limit: int) -> str:
    """Where `text` (JSON) first nests deeper than `limit` levels: `samples[0].reward_model.
    ground_truth[0][0]...` (the first eight steps of the path), or "" if it never does. Stops
    there, so it reads only as far as the first excess."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    stack: list[list] = []  # [opener, current key or index]
    last_string = '""'
    for found in _JSON_STRUCTURE.finditer(text):
        token = found.group()
        if token[0] == '"':
            last_string = token
        elif token in "[{":
            if len(stack) >= limit:
                steps = [f".{key}" if opener == "{" else f"[{key}]" for opener, key in stack]
                path = "".join(steps[:8]).lstrip(".") + ("..." if len(steps) > 8 else "")
                return path
            stack.append([token, 0 if token == "[" else ""])
        elif token in "]}":
            if stack:
                stack.pop()
        elif token == ":" and stack and stack[-1][0] == "{":
            try:
                stack[-1][1] = json.loads(last_string)
            except ValueError:
                stack[-1][1] = last_string.strip('"')
        elif token == "," and stack and stack[-1][0] == "[":
            stack[-1][1] += 1
    return ""


def check_depth(value: Any, where: str) -> None:
    """422 naming `where` if `value` nests more than `MAX_JSON_DEPTH` levels."""
    if isinstance(value, (dict, list)) and _depth_exceeds(value, MAX_JSON_DEPTH):
        raise bad(where, f"nested more than {MAX_JSON_DEPTH} levels deep (this server's limit)")


class _BadNumber:
    """Stands for an unusable number while `_bad_number_path` looks for it."""


def _max_digits() -> int:
    getter = getattr(sys, "get_int_max_str_digits", None)
    return getter() if getter is not None else 4300


def _bad_number_path(text: str | bytes) -> str:
    """Where the first unusable number of `text` (valid JSON otherwise) sits: `a.b[3]`, or ""."""
    marker = _BadNumber()
    limit = _max_digits()

    def number(kind: Callable[[str], Any]) -> Callable[[str], Any]:
        def parse(token: str) -> Any:
            if kind is int and limit and len(token.lstrip("-")) > limit:
                return marker
            value = kind(token)
            return value if kind is int or math.isfinite(value) else marker

        return parse

    try:
        value = json.loads(
            text, parse_float=number(float), parse_int=number(int), parse_constant=lambda _: marker
        )
    except (ValueError, RecursionError):
        return ""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if item is marker:
            return path
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return ""


def parse_json(body: bytes) -> Any:
    """The request body as JSON, or 400 saying where it stops being JSON (422 for a number
    that cannot be used: see `loads`)."""
    if not body:
        raise RequestError(400, "malformed JSON: the request body is empty")
    return loads(body)


def _depth_exceeds(value: Any, limit: int) -> bool:
    """True if `value` nests objects/arrays more than `limit` levels deep (iterative)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def loads_field(text: str, where: str) -> Any:
    """JSON given as a string field: as `loads`, and at most `MAX_JSON_DEPTH` levels deep;
    every problem is a 422 naming `where`."""
    value = loads(text, where)
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise bad(where, f"not valid JSON: nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _object(value: Any, where: str, *, json_string: bool = False) -> dict:
    if json_string and isinstance(value, str):
        value = loads_field(value, where) if value.strip() else {}
    if not isinstance(value, dict):
        raise bad(where, f"must be an object, got {_type_name(value)}")
    return value


def _array(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise bad(where, f"must be an array, got {_type_name(value)}")
    return value


def _string(value: Any, where: str, *, empty_ok: bool = True) -> str:
    if not isinstance(value, str):
        raise bad(where, f"must be a string, got {_type_name(value)}")
    if not empty_ok and not value:
        raise bad(where, "must be a non-empty string")
    return value


def _ratio(value: Any, where: str, default: float, upper: float | None = 1.0) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(where, f"must be a number, got {_type_name(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise bad(where, "must be a finite number")
    if not (number >= 0 and (upper is None or number <= upper)):
        raise bad(where, f"must be a number in [0, {upper if upper is not None else 'inf'}], got {value!r}")
    return number


MAX_INT = 2**63 - 1
"""Largest step / total_steps accepted."""


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(where, f"must be an integer, got {_type_name(value)}")
    if value < minimum:
        raise bad(where, f"must be >= {minimum}, got {value}")
    if value > MAX_INT:
        raise bad(where, f"must be at most 2^63 - 1, got an integer of {len(str(value))} digits")
    return value


def _verifier(value: Any, where: str, known: frozenset[str]) -> str:
    if not isinstance(value, str) or not value:
        raise bad(where, "missing (the name of the verifier that scores this sample)")
    if value not in known:
        raise bad(where, f"unknown verifier {value!r} (known: {', '.join(sorted(known))})")
    return value


def _reward_fields(reward: dict, where: str, known: frozenset[str]) -> tuple[str, Any, dict, float, float]:
    """(verifier, ground_truth, params, accuracy_ratio, format_ratio) of a reward_model object."""
    verifier = _verifier(reward.get("verifier"), f"{where}.verifier", known)
    if reward.get("ground_truth") is None:
        raise bad(f"{where}.ground_truth", "missing")
    check_depth(reward["ground_truth"], f"{where}.ground_truth")
    params = reward.get("verifier_params")
    key = "verifier_params"
    if params is None and reward.get("verifier_parm") is not None:
        params, key = reward["verifier_parm"], "verifier_parm"
    params = {} if params is None else _object(params, f"{where}.{key}", json_string=True)
    check_depth(params, f"{where}.{key}")
    if None in params.values():  # null means "not given" (Arrow struct columns send missing keys so)
        params = {k: v for k, v in params.items() if v is not None}
    accuracy = _ratio(reward.get("accuracy_ratio"), f"{where}.accuracy_ratio", 1.0)
    fmt = _ratio(reward.get("format_ratio"), f"{where}.format_ratio", 0.0)
    return verifier, reward["ground_truth"], params, accuracy, fmt


def parse_context(value: Any, where: str = "context") -> VerifyContext:
    """`{"step": int, "total_steps": int}` (both optional)."""
    if value is None:
        return VerifyContext()
    value = _object(value, where)
    step = _int(value.get("step", 0), f"{where}.step", 0)
    total = _int(value.get("total_steps", 1), f"{where}.total_steps", 1)
    return VerifyContext(step=step, total_steps=total)


# ---------------------------------------------------------------------------------------------
# Native /score


class PixelBudget:
    """The pixels one request's images may hold in all (`ServeConfig.max_request_pixels`),
    charged from each image's header before it is decoded."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def charge(self, width: int, height: int, where: str) -> None:
        """Count an image of `width` x `height`; a 413 naming `where` once the total passes the limit."""
        self.used += width * height
        if self.used > self.limit:
            raise RequestError(
                413,
                f"{where}: the request's images hold more than {self.limit:,} pixels in all (this "
                f"server's max_request_pixels); send fewer or smaller images per request",
            )


def parse_record(
    record: Any,
    where: str,
    known: frozenset[str],
    check_images: bool = False,
    image_root: str | Path | None = None,
    budget: PixelBudget | None = None,
) -> tuple[str, Any, dict, float, float, str, str, Any]:
    """One sample record -> (verifier, ground_truth, params, accuracy_ratio, format_ratio,
    data_source, sample_id, prompt). Raises 422 naming `where.<field>` (413 past `budget`)."""
    record = _object(record, where)
    if record.get("reward_model") is None:
        raise bad(f"{where}.reward_model", "missing")
    reward = _object(record["reward_model"], f"{where}.reward_model", json_string=True)
    verifier, gt, params, accuracy, fmt = _reward_fields(reward, f"{where}.reward_model", known)
    data_source = record.get("data_source")
    data_source = (
        "unknown" if data_source is None else _string(data_source, f"{where}.data_source", empty_ok=False)
    )
    extra = record.get("extra_info")
    extra = {} if extra is None else _object(extra, f"{where}.extra_info", json_string=True)
    check_depth(extra, f"{where}.extra_info")
    sample_id = str(extra["id"]) if extra.get("id") is not None else where
    prompt = record.get("prompt")
    if prompt is not None and not isinstance(prompt, (str, list)):
        raise bad(
            f"{where}.prompt", f"must be a string or an array of chat messages, got {_type_name(prompt)}"
        )
    if isinstance(prompt, list):
        check_depth(prompt, f"{where}.prompt")
        for i, message in enumerate(prompt):
            if not isinstance(message, dict) or "content" not in message:
                raise bad(f"{where}.prompt[{i}]", "must be an object with 'role' and 'content'")
    if record.get("ability") is not None:
        _string(record["ability"], f"{where}.ability")
    images = record.get("images")
    if images is not None:
        for i, image in enumerate(_array(images, f"{where}.images")):
            check_image(image, f"{where}.images[{i}]", check_images, image_root, budget)
    return verifier, gt, params, accuracy, fmt, data_source, sample_id, prompt


IMAGE_PATH_REFUSED = (
    "not base64, and not an image path this server reads (a path must be relative to the "
    "server's image_root and stay inside it: no absolute path, no '..', no link leading out)"
)
"""The one answer for every refused image path, whether or not a file is there: a client must
not learn from the server which files exist outside its image root."""


def resolve_image_path(text: str, root: str | Path | None) -> Path | None:
    """The file an image path names under `root`, or None if the path is refused: no root
    configured, an absolute path (or `~`), a `..` component, or a path that leaves the root once
    its links are resolved. Decided before the file system is asked whether anything exists."""
    if not root or not text or len(text) > 4096 or "\x00" in text:
        return None
    relative = Path(text)
    if relative.is_absolute() or text.startswith("~") or ".." in relative.parts or relative.drive:
        return None
    try:
        base = Path(root).resolve()
        full = (base / relative).resolve()
    except (OSError, RuntimeError, ValueError):  # a link loop, a name the OS refuses
        return None
    return full if full.is_relative_to(base) else None


def check_image(
    item: Any,
    where: str,
    decode: bool,
    image_root: str | Path | None = None,
    budget: PixelBudget | None = None,
) -> None:
    """Type-check one image source; with `decode`, prove it is a readable image of at most
    `mmrl.types.MAX_IMAGE_PIXELS` (the limit data loading applies; checked from the header,
    before decoding) in one of `mmrl.types.ALLOWED_IMAGE_FORMATS`, charged to `budget` (also
    before decoding). Paths are read only under `image_root` (`resolve_image_path`); a refused
    path gets `IMAGE_PATH_REFUSED` whether or not a file is there. Decoding takes time: the
    server calls this off its event loop."""
    path_only = False
    if isinstance(item, dict):
        if item.get("bytes"):
            item = item["bytes"]
        elif item.get("path"):
            item, path_only = item["path"], True
        else:
            raise bad(where, "an image object needs 'bytes' (base64) or 'path'")
    if not isinstance(item, str):
        raise bad(where, f"must be a path, a base64 string or {{'bytes'|'path'}}, got {_type_name(item)}")
    if not decode:
        return
    from mmrl.files import not_a_regular_file
    from mmrl.types import ImageError, load_image

    source: bytes | Path
    if item.startswith("data:image/") and ";base64," in item and not path_only:
        source = _b64(item.split(";base64,", 1)[1], where)
    else:
        path = resolve_image_path(item, image_root)
        if path is not None and path.exists() and (problem := not_a_regular_file(path)) is not None:
            raise bad(where, f"{item[:200]} {problem} under the server's image_root")  # a FIFO would block
        if path is not None and path.is_file():
            source = path
        else:
            data = None
            if not path_only:
                try:
                    data = base64.b64decode(item, validate=True)
                except (binascii.Error, ValueError):
                    data = None
            if data is None:
                if path is None:
                    raise bad(where, IMAGE_PATH_REFUSED)
                raise bad(where, f"image file not found under the server's image_root: {item[:200]}")
            source = data
    what = f"{len(source)} bytes" if isinstance(source, bytes) else item[:200]
    try:
        charge = None if budget is None else (lambda width, height: budget.charge(width, height, where))
        load_image(source, before_decode=charge).close()
    except ImageError as exc:
        problem = str(exc)
        if isinstance(source, Path):  # name the path as the client gave it, not where it resolved
            problem = problem.replace(str(source), what, 1)
        raise bad(where, f"unreadable image: {problem}") from None


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad(where, "not valid base64 after 'data:image/...;base64,'") from None


@dataclass
class ParsedBatch:
    """A request turned into work: one item per response, in response order."""

    items: list[WireItem]
    ids: list[str]
    """The sample id of each response (echoed in the results)."""
    wheres: list[str]
    """Where each response's sample came from in the request (for error messages)."""
    timeout_s: float | None = None
    """The request's own time limit, if it set one (the server's `request_timeout_s` caps it)."""


SCORE_KEYS = ("samples", "responses", "sample_index", "context", "timeout_s")
"""The keys of a `POST /score` body (mmrl's own format, so a misspelt one is refused; `/get_reward`
and `/judge` take other trainers' payloads, whose versions add keys of their own, as they are)."""


def unknown_keys(data: dict, known: Sequence[str], endpoint: str) -> None:
    """A 400 naming the first key of `data` that is not in `known`, with the closest known key."""
    import difflib

    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RequestError(
                400, f"{key[:100]!r}: unknown key of a {endpoint} request (known: {', '.join(known)}){hint}"
            )


def parse_score_request(
    data: Any,
    known: frozenset[str],
    max_batch: int,
    check_images: bool = False,
    image_root: str | Path | None = None,
    max_pixels: int | None = None,
) -> ParsedBatch:
    """The body of `POST /score`; a key it does not know (`sampels`) is a 400 naming it. With
    `check_images` its images are decoded (slow: the server runs this off its event loop), at
    most `max_pixels` pixels in all (413 beyond)."""
    data = _object(data, "body")
    unknown_keys(data, SCORE_KEYS, "/score")
    samples = _array(data.get("samples"), "samples") if "samples" in data else None
    responses = _array(data.get("responses"), "responses") if "responses" in data else None
    if samples is None:
        raise bad("samples", "missing (an array of sample records)")
    if responses is None:
        raise bad("responses", "missing (an array of response strings)")
    if len(responses) > max_batch:
        raise RequestError(
            413, f"responses: {len(responses)} responses exceed this server's limit of {max_batch}"
        )
    index = data.get("sample_index")
    if index is None:
        if len(samples) != len(responses):
            raise bad(
                "samples",
                f"{len(samples)} samples but {len(responses)} responses (pair them one to one, or give "
                "sample_index)",
            )
        index = range(len(responses))
    else:
        index = _array(index, "sample_index")
        if len(index) != len(responses):
            raise bad("sample_index", f"has {len(index)} entries for {len(responses)} responses")
        for i, j in enumerate(index):
            if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < len(samples):
                raise bad(f"sample_index[{i}]", f"must be an integer in [0, {len(samples)}), got {j!r}")
    context = parse_context(data.get("context"))
    timeout_s = data.get("timeout_s")
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise bad("timeout_s", f"must be a number of seconds > 0, got {timeout_s!r}")
        try:
            timeout_s = float(timeout_s)
        except OverflowError:  # an integer beyond the float range: no limit beyond the server's
            timeout_s = math.inf
    parsed: dict[int, tuple] = {}
    budget = PixelBudget(max_pixels) if check_images and max_pixels is not None else None
    tail = (context.step, context.total_steps, True)
    items, ids, wheres = [], [], []
    for i, (j, response) in enumerate(zip(index, responses)):
        if not isinstance(response, str):
            raise bad(f"responses[{i}]", f"must be a string, got {_type_name(response)}")
        known_sample = parsed.get(j)
        if known_sample is None:
            where = f"samples[{j}]"
            fields = parse_record(samples[j], where, known, check_images, image_root, budget)
            known_sample = parsed[j] = (fields, fields[6], where)
        fields, sample_id, where = known_sample
        items.append((fields, response, *tail))
        ids.append(sample_id)
        wheres.append(where)
    return ParsedBatch(items, ids, wheres, timeout_s)


def has_images(data: Any) -> bool:
    """Whether a `/score` body (parsed JSON) has a sample with images (which `check_images`
    decodes); a malformed body is False (parsing it then says what is wrong)."""
    samples = data.get("samples") if isinstance(data, dict) else None
    return isinstance(samples, list) and any(isinstance(s, dict) and s.get("images") for s in samples)


def result_json(sample_id: str, result: tuple) -> dict[str, Any]:
    score, components, error, extracted, _ = result
    return {"id": sample_id, "score": score, "components": components, "error": error, "extracted": extracted}


_json_string = json.encoder.encode_basestring_ascii
"""A str as JSON text, escaped as `json.dumps` escapes it (its C implementation)."""


def _json_float(value: float) -> str:
    """A finite float as `json.dumps` writes it; ValueError for NaN and infinities, which are
    not JSON (a verifier that returns one has a bug: the sample gets an error result)."""
    if value - value != 0.0:  # NaN or an infinity
        raise ValueError(f"the verifier returned a non-finite score ({value!r})")
    return float.__repr__(value)


def _json_number(key: str, value: Any) -> str:
    """A component value as the finite float JSON number the results carry (ValueError if it
    is not a finite number)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(
            f"the verifier returned component {key!r} that is not a number ({str(value)[:60]!r})"
        ) from None
    if number - number != 0.0:
        raise ValueError(f"the verifier returned a non-finite component {key!r} ({number!r})")
    return float.__repr__(number)


def unusable_result(result: tuple) -> str | None:
    """Why a worker's `(score, components, ...)` result cannot be sent (a non-finite score or
    component: NaN is not JSON), or None."""
    try:
        _json_float(float(result[0]))
        for key, value in result[1].items():
            _json_number(str(key), value)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


_COMPONENTS_TEXT: dict[tuple, str] = {}
"""Rendered components (all keys str) by their items: verifiers repeat a few combinations
({accuracy: 1.0, format: 1.0}, ...). Values equal as numbers share a text, so -0.0 may come
out as 0.0."""


def render_fields(score: float, components: dict[str, Any], extracted: Any) -> str:
    """A `/score` result without error, less its id, as JSON text: what
    `json.dumps(result_json(id, result))` writes after `{"id":...,` (component keys as str,
    values as floats, `extracted` as str). Written by the verifier workers, so the server's
    event loop only joins the texts. ValueError for a non-finite score or component (the
    worker makes that the sample's error result)."""
    try:
        key: tuple | None = tuple(components.items())
        # Only texts of all-str keys are stored, and no tuple with a key of another type
        # equals one of those: 1 and True (equal keys, different names) never share a text.
        parts = _COMPONENTS_TEXT.get(key)
    except TypeError:  # an unhashable value
        key, parts = None, None
    if parts is None:
        if not all(type(k) is str for k in components):
            key = None  # named as the result tuple names them (1 and "1" are one key, the last wins)
            components = {str(k): v for k, v in components.items()}
        parts = ",".join([_json_string(k) + ":" + _json_number(k, v) for k, v in components.items()])
        if key is not None:
            if len(_COMPONENTS_TEXT) >= 1024:
                _COMPONENTS_TEXT.clear()
            _COMPONENTS_TEXT[key] = parts
    text = "null" if extracted is None else _json_string(str(extracted))
    return f'"score":{_json_float(score)},"components":{{{parts}}},"error":null,"extracted":{text}}}'


def score_response_json(ids: Sequence[str], results: Sequence[WireResult]) -> bytes:
    """The body of a `/score` answer: `{"results": [...], "errors": n}` as
    `json.dumps(..., separators=(",", ":"))` writes it."""
    parts = []
    errors = 0
    id_text: dict[str, str] = {}
    for sample_id, result in zip(ids, results):
        if type(result) is str:
            head = id_text.get(sample_id)
            if head is None:
                head = id_text[sample_id] = '{"id":' + _json_string(sample_id) + ","
            parts.append(head + result)
        else:
            errors += result[2] is not None
            parts.append(json.dumps(result_json(sample_id, result), separators=(",", ":")))
    return ('{"results":[' + ",".join(parts) + '],"errors":' + str(errors) + "}").encode()


# ---------------------------------------------------------------------------------------------
# OpenRLHF /get_reward


def parse_get_reward(
    data: Any, known: frozenset[str], max_batch: int, label_mode: str, default_verifier: str
) -> ParsedBatch:
    """The body of OpenRLHF's `POST /get_reward`."""
    data = _object(data, "body")
    if "query" not in data:
        raise bad("query", "missing (an array of prompt + response strings)")
    queries = _array(data["query"], "query")
    n = len(queries)
    if n > max_batch:
        raise RequestError(413, f"query: {n} queries exceed this server's limit of {max_batch}")
    prompts = data.get("prompts")
    if prompts is not None:
        prompts = _array(prompts, "prompts")
        if len(prompts) != n:
            raise bad("prompts", f"has {len(prompts)} entries for {n} queries")
    labels = data.get("labels")
    if labels is None:
        if n:
            raise bad("labels", "missing (one label per query: its ground truth or reward_model JSON)")
        labels = []
    labels = _array(labels, "labels")
    if len(labels) != n:
        raise bad("labels", f"has {len(labels)} entries for {n} queries")
    # OpenRLHF sends no step; a trainer that knows its global step adds "step" / "total_steps"
    # (or a "context" object) so that step-dependent verifiers (the dynamic IoU threshold) advance.
    context = parse_context(data.get("context")) if data.get("context") is not None else None
    step = _int(data["step"], "step", 0) if data.get("step") is not None else (context.step if context else 0)
    total = (
        _int(data["total_steps"], "total_steps", 1)
        if data.get("total_steps") is not None
        else (context.total_steps if context else 1)
    )
    items, ids, wheres = [], [], []
    for i, (query, label) in enumerate(zip(queries, labels)):
        query = _string(query, f"query[{i}]")
        response = query
        if prompts is not None:
            prompt = _string(prompts[i], f"prompts[{i}]")
            if prompt and query.startswith(prompt):
                response = query[len(prompt) :]
        fields = (*_label(label, f"labels[{i}]", known, label_mode, default_verifier), None)
        sample_id = fields[6]
        items.append((fields, response, step, total, False))
        ids.append(sample_id)
        wheres.append(f"labels[{i}]")
    return ParsedBatch(items, ids, wheres)


def _label(label: Any, where: str, known: frozenset[str], mode: str, default_verifier: str) -> tuple:
    as_object = None
    if mode != "ground_truth":
        if isinstance(label, dict):
            as_object = label
        elif isinstance(label, str) and label.lstrip().startswith("{"):
            try:
                decoded = loads_field(label, where)
            except MalformedJSON:
                if mode == "reward_model":
                    raise
                decoded = None  # auto: text that merely starts with "{" is a ground truth
            as_object = decoded if isinstance(decoded, dict) else None
        if (
            mode == "auto"
            and as_object is not None
            and "verifier" not in as_object
            and "reward_model" not in as_object
        ):
            as_object = None
        if mode == "reward_model" and as_object is None:
            raise bad(where, f"must be a reward_model object (or its JSON), got {_type_name(label)}")
    if as_object is None:
        if label is None or isinstance(label, (dict, list)):
            raise bad(
                where, f"must be the ground truth for verifier {default_verifier!r}, got {_type_name(label)}"
            )
        verifier = _verifier(default_verifier, "default_verifier", known)
        return verifier, label, {}, 1.0, 0.0, "openrlhf", where
    if "reward_model" in as_object:  # a whole sample record
        verifier, gt, params, accuracy, fmt, data_source, sample_id, _ = parse_record(as_object, where, known)
        return verifier, gt, params, accuracy, fmt, data_source, sample_id
    verifier, gt, params, accuracy, fmt = _reward_fields(as_object, where, known)
    data_source = as_object.get("data_source", "openrlhf")
    data_source = _string(data_source, f"{where}.data_source", empty_ok=False)
    sample_id = str(as_object["id"]) if as_object.get("id") is not None else where
    return verifier, gt, params, accuracy, fmt, data_source, sample_id


def get_reward_json(results: Sequence[WireResult]) -> dict[str, Any]:
    rewards = [r[0] for r in results]
    return {
        "rewards": rewards,
        "scores": rewards,
        "extra_logs": {
            "accuracy": [float(r[1].get("accuracy", 0.0)) for r in results],
            "format": [float(r[1].get("format", 0.0)) for r in results],
            "verifier_error": [0.0 if r[2] is None else 1.0 for r in results],
        }
        if results
        else {},
    }


# ---------------------------------------------------------------------------------------------
# V-Triune /judge

JUDGE_FIELD_NAMES = {"reward_model.ground_truth": "solution", "reward_model.verifier": "reward_verifier"}


def judge_field(field: str) -> str:
    """An mmrl record field named as in V-Triune's payload."""
    if field in JUDGE_FIELD_NAMES:
        return JUDGE_FIELD_NAMES[field]
    if field.startswith("reward_model.verifier_params"):
        return "reward_verifier_parm" + field[len("reward_model.verifier_params") :]
    return field


VTRIUNE_DET_RATIO_KEYS = (
    "iou_max_label_first",
    "iou_max_iou_first",
    "iou_completeness",
    "map",
    "map50",
    "map75",
)
"""The keys of V-Triune's `det_reward_ratio` (a missing one is 0, one outside [0, 1] is reset to 0)."""
JUDGE_BASE_KEYS = ("format_reward", "accuracy_reward", "reflection_reward", "final_reward")


def judge_keys(verifier: Any) -> tuple[str, ...]:
    """The `rewards` keys V-Triune's server returns for a verifier (its trainer logs each one)."""
    from mmrl.verifiers.detection import VTRIUNE_COMPONENTS

    if verifier == "detection":
        return (*JUDGE_BASE_KEYS, *(f"{k}_reward" for k in VTRIUNE_COMPONENTS))
    return JUDGE_BASE_KEYS


def _det_ratios(value: Any) -> dict[str, float]:
    """V-Triune's `det_reward_ratio` as its DetectionVerifier reads it (reset, not rejected)."""
    ratios = (
        _object(value, "reward_verifier_parm.det_reward_ratio", json_string=True) if value is not None else {}
    )
    out = {}
    for key in VTRIUNE_DET_RATIO_KEYS:
        ratio = ratios.get(key, 0.0)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise bad(
                f"reward_verifier_parm.det_reward_ratio.{key}", f"must be a number, got {_type_name(ratio)}"
            )
        out[key] = float(ratio) if 0 <= ratio <= 1 else 0.0
    return out


JUDGE_MATH_STYLES = ("vtriune", "mmrl")
"""How `/judge` scores V-Triune's `mathverify` (`ServeConfig.judge_math`)."""


def parse_judge(
    data: Any,
    known: frozenset[str],
    default_format_ratio: float,
    iou_threshold: str | float = "average",
    math_style: str = "vtriune",
) -> ParsedBatch:
    """V-Triune's `/judge` payload -> one item (their verifier names and params mapped).

    `mathverify` is scored with `style: "vtriune"` (V-Triune's own math-verify settings; with
    `math_style="mmrl"`, mmrl's own math verifier, and a second item scores it V-Triune's way
    for comparison: `judge_math_comparison`) and
    `detection` with V-Triune's parsing, format reward and components (`style: "vtriune"`):
    its constructor options `det_verifier_normalized` (predictions rescaled by
    `image_grid_thw`'s width and height onto the 0-1000 grid, truncated to integers; no grid:
    unscaled) and `det_reward_ratio` (missing keys 0, values outside [0, 1] reset to 0) become
    mmrl's `normalized` / `image_size`, `weights` and `completeness_weight`. The IoU threshold
    mode is the server's `iou_threshold` (V-Triune reads it from $DET_IOU_THRESHOLD, whose
    effective default is "average"). The runtime keys (`step`, `total_steps`, ...) become the
    verify context, so the dynamic threshold advances with V-Triune's trainer."""
    from mmrl.datasets.converters import VTRIUNE_RUNTIME_PARAMS, vtriune_record
    from mmrl.datasets.schema import SampleError

    data = _object(data, "body")
    for name in ("response", "solution", "reward_verifier"):
        if data.get(name) is None:
            raise bad(name, "missing")
    response = _string(data["response"], "response")
    _string(data["reward_verifier"], "reward_verifier", empty_ok=False)
    parm = data.get("reward_verifier_parm")
    parm = {} if parm is None else dict(_object(parm, "reward_verifier_parm", json_string=True))
    for name, value in (
        ("solution", data["solution"]),
        ("answer", data.get("answer")),
        ("reward_verifier_parm", parm),
    ):
        check_depth(value, name)
    step = _int(parm.get("step", 0), "reward_verifier_parm.step", 0)
    total = _int(parm.get("total_steps", 1) or 1, "reward_verifier_parm.total_steps", 1)
    if data["reward_verifier"] == "detection":
        grid = parm.get("image_grid_thw")
        normalized = parm.pop("det_verifier_normalized", False)
        if not isinstance(normalized, bool):
            raise bad(
                "reward_verifier_parm.det_verifier_normalized", f"must be true or false, got {normalized!r}"
            )
        ratios = _det_ratios(parm.pop("det_reward_ratio", None))
        parm.update(
            style="vtriune",
            normalized=normalized,
            iou_threshold=iou_threshold if iou_threshold in ("average", "dynamic") else float(iou_threshold),
            completeness_weight=ratios.pop("iou_completeness"),
            weights=ratios,
        )
        if normalized and grid:
            # V-Triune rescales boxes by the model input's size: (t, height, width) in pixels.
            try:
                parm["image_size"] = [float(grid[0][2]), float(grid[0][1])]
            except (TypeError, ValueError, IndexError, KeyError):
                raise bad(
                    "reward_verifier_parm.image_grid_thw", f"expected [[t, height, width], ...], got {grid!r}"
                ) from None
    elif data["reward_verifier"] == "mathverify" and math_style == "vtriune":
        parm["style"] = "vtriune"
    accuracy = _ratio(data.get("accuracy_ratio"), "accuracy_ratio", 1.0, upper=None)
    fmt_key = "format_ratio" if data.get("format_ratio") is not None else "fmt_ratio"
    fmt = _ratio(data.get(fmt_key), fmt_key, default_format_ratio, upper=None)
    scale = max(accuracy, fmt)
    if scale <= 0:
        raise bad("accuracy_ratio", "accuracy_ratio + format_ratio must be > 0")
    # Normalised by the larger one first: 1e308 + 1e308 would overflow to inf (and give 0, 0).
    accuracy, fmt = accuracy / scale, fmt / scale
    data_source = data.get("data_source") or "vtriune"
    data_source = _string(data_source, "data_source")
    prompt = data.get("prompt")
    if prompt is not None:
        prompt = _string(prompt, "prompt")
    record = {
        "data_source": data_source,
        "prompt": prompt,
        "reward_model": {
            "ground_truth": data["solution"],
            "verifier": data["reward_verifier"],
            "verifier_parm": {k: v for k, v in parm.items() if k not in VTRIUNE_RUNTIME_PARAMS},
            "accuracy_ratio": accuracy / (accuracy + fmt),
            "format_ratio": fmt / (accuracy + fmt),
        },
        "extra_info": {"id": "judge"},
    }
    if data.get("answer") is not None:
        record["reward_model"]["answer"] = data["answer"]
    try:
        converted = vtriune_record(record, 0, where="")
    except SampleError as exc:
        raise bad(judge_field(exc.field), exc.problem) from None
    reward = converted["reward_model"]
    verifier = reward["verifier"]
    if verifier not in known:
        raise bad(
            "reward_verifier",
            f"unknown verifier {data['reward_verifier']!r} (known: {', '.join(sorted(known))}; V-Triune's "
            "'mathverify' is mmrl's 'math')",
        )
    fields = (
        verifier,
        reward["ground_truth"],
        reward["verifier_params"],
        reward["accuracy_ratio"],
        reward["format_ratio"],
        data_source,
        "judge",
        prompt,
    )
    item = (fields, response, step, total, False)
    if data["reward_verifier"] == "mathverify" and math_style == "mmrl":
        vtriune = (*fields[:2], {**fields[2], "style": "vtriune"}, *fields[3:])
        return ParsedBatch([item, (vtriune, response, step, total, False)], ["judge", "judge"], ["", ""])
    return ParsedBatch([item], ["judge"], [""])


def judge_math_disagreement(results: Sequence[WireResult]) -> bool | None:
    """With `math_style="mmrl"`: whether mmrl's math verifier (`results[0]`) and V-Triune's
    settings (`results[1]`) disagree on the accuracy; None when either could not score."""
    if len(results) < 2 or any(type(r) is not tuple or r[2] is not None for r in results[:2]):
        return None
    return results[0][1].get("accuracy") != results[1][1].get("accuracy")


def judge_json(result: WireResult, verifier: Any = None) -> dict[str, Any]:
    """V-Triune's answer: `rewards` with exactly its keys for the verifier (`accuracy_reward`,
    `format_reward`, `reflection_reward`, `final_reward`, and detection's components as
    `<name>_reward`), plus `error` (null, or why this sample could not be scored: then every
    reward is 0.0, and the error is counted and logged by the server, never a silent zero)."""
    score, components, error, _, _ = result
    rewards = dict.fromkeys(judge_keys(verifier), 0.0)
    if error is None:
        rewards["format_reward"] = float(components.get("format", 0.0))
        rewards["accuracy_reward"] = float(components.get("accuracy", 0.0))
        rewards["final_reward"] = float(score)
        for key in rewards:
            name = key[: -len("_reward")]
            if name in components and key not in JUDGE_BASE_KEYS:
                rewards[key] = float(components[name])
    return {"rewards": rewards, "error": error}


def judge_failure_json(data: Any, message: str) -> dict[str, Any]:
    """The 200 answer for a `/judge` request that cannot be scored at all (V-Triune's trainer
    reads `rewards` of every answer, and stops on a 4xx): zeros and the reason."""
    verifier = data.get("reward_verifier") if isinstance(data, dict) else None
    return {"rewards": dict.fromkeys(judge_keys(verifier), 0.0), "error": message}


# ---------------------------------------------------------------------------------------------
# Client side: mmrl objects <-> wire


def sample_to_record(sample: Sample) -> dict[str, Any]:
    """What the server needs of a sample to score responses to it (no prompt, no pixels: the
    rule-based verifiers use neither)."""
    rm = sample.reward_model
    return {
        "data_source": sample.data_source,
        "reward_model": {
            "ground_truth": rm.ground_truth,
            "verifier": rm.verifier,
            "verifier_params": rm.verifier_params,
            "accuracy_ratio": rm.accuracy_ratio,
            "format_ratio": rm.format_ratio,
        },
        "extra_info": {"id": sample.id},
    }


def result_from_json(value: dict[str, Any]) -> VerifierResult:
    return VerifierResult(
        score=float(value["score"]),
        components=dict(value.get("components") or {}),
        error=value.get("error"),
        extracted=value.get("extracted"),
    )


def fields_sample(fields: SampleFields) -> Sample:
    """The `Sample` a worker scores (images are never sent to workers)."""
    verifier, gt, params, accuracy, fmt, data_source, sample_id, prompt = fields
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return Sample(
        data_source=data_source,
        prompt=prompt or [],
        images=[],
        ability="",
        reward_model=RewardSpec(gt, verifier, params, accuracy, fmt),
        extra_info={"id": sample_id},
    )
