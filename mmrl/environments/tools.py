"""Tool records, the `Tool` base class, function tools and the tool registry.

A tool is registered by name, like verifiers and reward models, and a sample names the tools it
may call. A plain function (or a class with `__call__`) becomes a tool whose schema is
transformers' `get_json_schema` of its signature and Google-style docstring: the same dict a
chat template's `tools=` takes, so the prompt, the argument check and the call all read one
description. A parameter named `context` receives the trajectory's `ToolContext` and is left
out of the schema (the model never fills it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

CONTEXT_PARAM = "context"
"""The parameter through which a function tool receives the trajectory's `ToolContext`."""


@dataclass
class ToolCall:
    """One call the model wrote, parsed: what to run and with which arguments."""

    name: str
    """The tool's name as the model wrote it (looked up in the registry when run)."""
    arguments: dict[str, Any]
    """The call's arguments, decoded from JSON (a JSON-string `arguments` is decoded too)."""
    raw: str
    """The call's text as the model wrote it, tags included (for logs and sample dumps)."""
    index: int = -1
    """Its position among the turn's `<tool_call>` blocks, well-formed or not (-1: built by hand)."""


@dataclass
class ParsedTurn:
    """Every tool call of one model turn: the well-formed ones and one error per malformed one."""

    calls: list[ToolCall]
    """The well-formed calls, in the order written."""
    errors: list[str]
    """One message per malformed call, e.g. "tool call 2: bad JSON (Expecting ',' delimiter ...)"."""
    error_kinds: list[str]
    """Parallel to `errors`: 'bad_json' | 'no_name' | 'bad_arguments'."""
    error_indices: list[int] = field(default_factory=list)
    """Parallel to `errors`: each malformed call's position among the turn's blocks (0-based)."""


@dataclass
class Observation:
    """What one tool call gives back to the model (or, on failure, what went wrong)."""

    text: str
    """What the model reads back; for an error, a short message naming what was wrong."""
    images: list[Image.Image] = field(default_factory=list)
    """The images returned, RGB, in order (appended to the trajectory's images by the caller)."""
    error: str | None = None
    """None if the call went fine, else its kind: 'bad_json', 'no_name', 'bad_arguments',
    'unknown_tool', 'tool_error', 'timeout', 'text_too_long', 'too_many_calls'."""
    reward: float = 0.0
    """The tool's own reward for this call (a veRL tool's step reward and calc_reward gain)."""
    seconds: float = 0.0
    """Wall time of the call, seconds (0 for calls that were never run)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The tool's own metrics for this call (a veRL tool's third return value), for logging."""


@dataclass
class ToolContext:
    """What a tool may see of its trajectory, and the trajectory's tool state."""

    images: list[Image.Image]
    """Every image of the trajectory so far: the prompt's first, then each observation's, in order."""
    sample_id: str = ""
    """The sample's id (`extra_info.id`), for logs and for tools that keep per-sample data."""
    state: dict[str, Any] = field(default_factory=dict)
    """Per-trajectory tool state (class and veRL tools keep their instance ids here)."""
    tools: list[str] | None = None
    """The tools this trajectory may call (the sample's tool names); None: every registered one."""
    sample: Any = None
    """The `Sample` this trajectory answers, where the caller passes it (None otherwise): a
    TRL-style environment's `reset(**row)` reads its fields (`mmrl.environments.trl_env`)."""

    def add_observations(self, observations: Sequence[Observation]) -> None:
        """Append the observations' images, in order: call once per turn, after its tools ran,
        so that image indices the model reads back match the order the processor sees them."""
        for obs in observations:
            self.images.extend(obs.images)


@dataclass
class ToolLimits:
    """The bounds every tool call runs under (a breach becomes an error observation)."""

    timeout_s: float = 10.0
    """Wall-clock limit of one call, seconds; past it the call's observation is a 'timeout'."""
    max_text_chars: int = 2000
    """Longer observation text is cut to this many characters ('text_too_long')."""
    max_image_pixels: int = 1_048_576
    """Larger images are downscaled, aspect kept, to at most this many pixels (noted in the text)."""
    max_images: int = 2
    """Images kept per call; extra ones are dropped (noted in the text)."""
    max_calls_per_turn: int = 4
    """Calls run per turn; later ones get a 'too_many_calls' observation and are not run."""


class ToolArgumentError(ValueError):
    """Raised by a tool for arguments it cannot use (a box outside the image, ...): the call's
    observation becomes a 'bad_arguments' error with this message, not a 'tool_error'."""


# ---------------------------------------------------------------------------------------------
# Argument checking against the schema


_JSON_TYPES = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "a boolean",
    "array": "an array",
    "object": "an object",
    "null": "null",
}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_type(value: Any, type_name: str) -> tuple[bool, Any]:
    """Whether `value` is of the JSON-schema type, and the value to pass (an integral float for
    an integer becomes an int: models write 10.0 for 10)."""
    if type_name == "integer":
        if isinstance(value, bool):
            return False, value
        if isinstance(value, int):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, value
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    if type_name == "string":
        return isinstance(value, str), value
    if type_name == "boolean":
        return isinstance(value, bool), value
    if type_name == "array":
        return isinstance(value, list), value
    if type_name == "object":
        return isinstance(value, dict), value
    if type_name == "null":
        return value is None, value
    return True, value  # a type this check does not know: the tool itself decides


def check_value(value: Any, schema: dict[str, Any], where: str) -> tuple[Any, list[str]]:
    """Check one argument against its JSON schema: the value to pass and the problems found
    (each naming `where`, e.g. "bbox_2d[1]")."""
    if value is None and schema.get("nullable"):
        return value, []
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            coerced, problems = check_value(value, option, where)
            if not problems:
                return coerced, []
        return value, [f"{where} matches none of the allowed forms (got {_show(value)})"]
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        for name in kinds:
            ok, coerced = _check_type(value, name)
            if ok:
                value = coerced
                break
        else:
            wanted = " or ".join(_JSON_TYPES.get(k, k) for k in kinds)
            return value, [f"{where} must be {wanted}, got {type(value).__name__} {_show(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        return value, [f"{where} must be one of {schema['enum']}, got {_show(value)}"]
    problems: list[str] = []
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            problems.append(f"{where} needs at least {schema['minItems']} items, got {len(value)}")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            problems.append(f"{where} takes at most {schema['maxItems']} items, got {len(value)}")
        items = schema.get("items")
        prefix = schema.get("prefixItems")
        out = []
        for i, item in enumerate(value):
            item_schema = prefix[i] if prefix and i < len(prefix) else items
            if isinstance(item_schema, dict):
                item, item_problems = check_value(item, item_schema, f"{where}[{i}]")
                problems += item_problems
            out.append(item)
        value = out
    return value, problems


def check_arguments(
    arguments: Any, parameters: dict[str, Any], tool: str
) -> tuple[dict[str, Any], list[str]]:
    """Check a call's arguments against the schema's `parameters`: the arguments to pass and the
    problems (missing required, unknown, or wrongly typed arguments), each in a few words."""
    if not isinstance(arguments, dict):
        return {}, [f"arguments must be a JSON object, got {type(arguments).__name__}"]
    properties: dict[str, Any] = parameters.get("properties") or {}
    required = parameters.get("required") or []
    problems = [f"missing required argument '{name}'" for name in required if name not in arguments]
    out: dict[str, Any] = {}
    for name, value in arguments.items():
        if name not in properties:
            known = ", ".join(properties) or "no arguments"
            problems.append(f"unknown argument '{name}' ({tool} takes: {known})")
            continue
        out[name], value_problems = check_value(value, properties[name], f"'{name}'")
        problems += value_problems
    return out, problems


# ---------------------------------------------------------------------------------------------
# Tool results


def _rgb(image: Any) -> Image.Image:
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise TypeError(f"a tool returned {type(image).__name__} where an image was expected")
    return image if image.mode == "RGB" else image.convert("RGB")


def to_observation(value: Any) -> Observation:
    """A tool's return value as an `Observation`: an Observation, a str, an image, a list of
    images, a (text, image or images) tuple, or a dict with "text" and "image"/"images"."""
    if isinstance(value, Observation):
        value.images = [_rgb(im) for im in value.images]
        return value
    if value is None:
        return Observation(text="")
    if isinstance(value, str):
        return Observation(text=value)
    if isinstance(value, (Image.Image, np.ndarray)):
        return Observation(text="", images=[_rgb(value)])
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        images = value[1] if isinstance(value[1], (list, tuple)) else [value[1]]
        return Observation(text=value[0], images=[_rgb(im) for im in images if im is not None])
    if isinstance(value, list) and all(isinstance(v, (Image.Image, np.ndarray)) for v in value):
        return Observation(text="", images=[_rgb(im) for im in value])
    if isinstance(value, dict):
        images = value.get("images", value.get("image")) or []
        if not isinstance(images, (list, tuple)):
            images = [images]
        return Observation(
            text=str(value.get("text") or ""),
            images=[_rgb(im) for im in images],
            reward=float(value.get("reward", 0.0)),
        )
    raise TypeError(f"a tool returned {type(value).__name__}, which is not an observation")


# ---------------------------------------------------------------------------------------------
# Running sync tools off the event loop


class _DaemonPool:
    """A bounded pool of daemon threads for sync tools.

    Not `asyncio.to_thread`: its executor's threads are joined at interpreter exit, so one hung
    tool would hold the process open for as long as it hangs. Daemon threads are not; a timed-out
    call's thread is abandoned (Python cannot kill a thread) and the pool grows up to
    `max_workers`, after which calls queue (and time out if every worker is hung)."""

    def __init__(self, max_workers: int):
        self.max_workers = max_workers
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = 0
        self._idle = 0  # workers waiting for a job
        self._queued = 0  # jobs no worker has taken yet

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._queued += 1
            if self._queued > self._idle and self._workers < self.max_workers:
                self._workers += 1
                threading.Thread(target=self._work, name="mmrl-tool", daemon=True).start()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            future, fn, args, kwargs = self._jobs.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except Exception as exc:  # noqa: BLE001 - handed to the awaiting call
                    future.set_exception(exc)
                except BaseException as exc:  # noqa: BLE001 - SystemExit in a tool must not end the loop
                    future.set_exception(RuntimeError(f"tool raised {type(exc).__name__}: {exc}"))
            del future, fn, args, kwargs  # drop the last job's images while waiting for the next


MAX_TOOL_THREADS = 64
"""Threads that run sync tools at once (hung ones included); later calls wait for a free one."""
_POOL = _DaemonPool(MAX_TOOL_THREADS)


async def _guarded(awaitable: Any) -> Any:
    """Await a tool's coroutine, turning SystemExit into an ordinary error (asyncio re-raises
    SystemExit and KeyboardInterrupt out of the loop, which would end every trajectory's tools)."""
    try:
        return await awaitable
    except (SystemExit, KeyboardInterrupt) as exc:
        raise RuntimeError(f"tool raised {type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Tools


class Tool:
    """A named tool: a schema the chat template shows the model and an async `call`.

    Subclasses implement `run`; `call` checks the arguments against the schema first, so `run`
    only sees arguments of the right names and types. Time limits, caps on the output and
    turning exceptions into error observations are the executor's (`run_tool_calls`)."""

    name: str = ""
    schema: dict[str, Any] = {}

    @property
    def parameters(self) -> dict[str, Any]:
        """The schema's JSON-schema `parameters` object."""
        return self.schema.get("function", {}).get("parameters") or {"type": "object", "properties": {}}

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> Observation:
        """Run the tool on one call's arguments ('bad_arguments' observation if they do not fit)."""
        checked, problems = check_arguments(arguments, self.parameters, self.name)
        if problems:
            return Observation(
                text=f"{self.name}: bad arguments: {'; '.join(problems)}.", error="bad_arguments"
            )
        try:
            return await self.run(checked, context)
        except ToolArgumentError as exc:
            return Observation(text=f"{self.name}: {exc}", error="bad_arguments")

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> Observation:
        raise NotImplementedError

    async def release(self, context: ToolContext) -> float | None:
        """Free this trajectory's per-trajectory state, if any; a tool's final reward or None."""
        return None


def _schema_of(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    """transformers' `get_json_schema` of `fn`, without its `context` parameter."""
    from transformers.utils import get_json_schema

    target = fn if inspect.isroutine(fn) else fn.__call__  # type: ignore[operator]
    signature = inspect.signature(target)
    annotations = dict(getattr(target, "__annotations__", {}))
    annotations.pop("return", None)
    annotations.pop(CONTEXT_PARAM, None)

    def proxy() -> None: ...

    # get_json_schema reads the signature, the type hints (resolved in fn's module through
    # __wrapped__) and the docstring: give it fn's, less `context` and the return value.
    proxy.__wrapped__ = target  # type: ignore[attr-defined]
    proxy.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for p in signature.parameters.values() if p.name != CONTEXT_PARAM],
        return_annotation=inspect.Signature.empty,
    )
    proxy.__annotations__ = annotations
    # A class tool's description and Args are on its `__call__`, or else on the class.
    proxy.__doc__ = inspect.getdoc(target) or (None if target is fn else inspect.getdoc(type(fn)))
    proxy.__name__ = name
    schema = get_json_schema(proxy)
    schema["function"].pop("return", None)
    return schema


class FunctionTool(Tool):
    """A tool made from a function, or from an object with `__call__` (a class tool's instance).

    Sync functions run in a daemon thread so that a slow or hung one never blocks the event loop;
    async ones are awaited on it. A parameter named `context` receives the `ToolContext`."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__
        self.schema = _schema_of(fn, self.name)
        target = fn if inspect.isroutine(fn) else fn.__call__  # type: ignore[operator]
        self.is_async = inspect.iscoroutinefunction(target)
        self.takes_context = CONTEXT_PARAM in inspect.signature(fn).parameters

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> Observation:
        kwargs = dict(arguments)
        if self.takes_context:
            kwargs[CONTEXT_PARAM] = context
        if self.is_async:
            value = await _guarded(self.fn(**kwargs))
        else:
            value = await asyncio.wrap_future(_POOL.submit(self.fn, **kwargs))
        return to_observation(value)

    async def release(self, context: ToolContext) -> float | None:
        """Call the class tool's own `release(context)` if it has one (sync or async)."""
        hook = getattr(self.fn, "release", None) if not inspect.isroutine(self.fn) else None
        if hook is None:
            return None
        value = hook(context)
        return await value if inspect.isawaitable(value) else value


# ---------------------------------------------------------------------------------------------
# Registry

_TOOLS: dict[str, Tool] = {}
F = TypeVar("F")


def add_tool(tool: Tool, replace: bool = False) -> Tool:
    """Register a built `Tool` under its `name` (ValueError if taken, unless `replace`)."""
    if not tool.name:
        raise ValueError("a tool needs a name")
    if tool.name in _TOOLS and not replace:
        raise ValueError(f"tool {tool.name!r} is already registered")
    _TOOLS[tool.name] = tool
    return tool


def register_tool(name: str | Callable[..., Any] | None = None, *, replace: bool = False) -> Any:
    """Decorator: register a function, a class with `__call__` (instantiated once, without
    arguments), or a `Tool` subclass, under `name` (default: its `__name__`). The object is
    returned unchanged, so a decorated function stays callable. `@register_tool` works too."""

    def wrap(obj: F) -> F:
        tool_name = name if isinstance(name, str) else None
        if inspect.isclass(obj):
            instance = obj()
            if isinstance(instance, Tool):
                instance.name = tool_name or instance.name or obj.__name__
                add_tool(instance, replace)
            else:
                add_tool(FunctionTool(instance, tool_name or obj.__name__), replace)
        else:
            add_tool(FunctionTool(obj, tool_name), replace)  # type: ignore[arg-type]
        return obj

    if callable(name):
        return wrap(name)
    return wrap


def unregister_tool(name: str) -> None:
    """Remove a tool from the registry (no error if it is not there); for tests and reloads."""
    _TOOLS.pop(name, None)


def get_tool(name: str) -> Tool:
    """The registered tool called `name` (KeyError naming the registered ones if unknown)."""
    try:
        return _TOOLS[name]
    except KeyError:
        raise KeyError(f"unknown tool {name!r}; registered: {', '.join(sorted(_TOOLS))}") from None


def tool_names() -> list[str]:
    """The registered tool names, sorted."""
    return sorted(_TOOLS)


def tool_schemas(names: list[str]) -> list[dict[str, Any]]:
    """The named tools' schemas, in order, for the chat template's `tools=` (copies: a template
    or a caller may edit them)."""
    return [copy.deepcopy(get_tool(name).schema) for name in names]
