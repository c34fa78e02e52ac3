"""Running veRL tools (`verl.tools.base_tool.BaseTool` subclasses) unchanged.

veRL's tool life cycle, per trajectory: `create` an instance (its id), `execute(instance_id,
parameters)` per call -> (response, step reward, metrics), `calc_reward(instance_id)` for the
reward accumulated so far, `release(instance_id)` at the end. The response is a str (older
veRL), a dict or a `ToolResponse` with `text` and `image` (a list of images). `create` returns
the id (older) or (id, ToolResponse) (newer), and reads its data from `create_kwargs` (newer)
or from keyword arguments such as `image` (older, e.g. the first image zoom-in tool).

Nothing here imports veRL: any object with these methods runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from mmrl.environments.tools import Observation, Tool, ToolContext, _rgb, add_tool


def _schema_dict(schema: Any) -> dict[str, Any]:
    """A veRL `OpenAIFunctionToolSchema` (pydantic) or a dict, as a plain dict."""
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump(exclude_none=True)
    if not isinstance(schema, dict) or "function" not in schema:
        raise TypeError(f"a veRL tool's schema must have a 'function' entry, got {type(schema).__name__}")
    schema = dict(schema)
    schema.setdefault("type", "function")
    return schema


def _field(response: Any, name: str) -> Any:
    if isinstance(response, dict):
        return response.get(name)
    return getattr(response, name, None)


def default_create_kwargs(context: ToolContext) -> dict[str, Any]:
    """What a veRL tool's `create` gets from the trajectory: its first image (veRL's zoom-in
    tool crops it) and all its images, and the sample id."""
    out: dict[str, Any] = {"sample_id": context.sample_id, "images": list(context.images)}
    if context.images:
        out["image"] = context.images[0]
    return out


class VerlToolAdapter(Tool):
    """A veRL `BaseTool` instance as an mmrl tool: created once per trajectory (its instance id
    kept in `ToolContext.state`), executed per call, released by `release(context)`.

    An observation's reward is the call's step reward plus what the tool's `calc_reward` gained
    over the call, so a trajectory's observation rewards add up to its step rewards and the
    tool's final accumulated reward, each counted once."""

    def __init__(
        self,
        tool: Any,
        name: str | None = None,
        create_kwargs: Callable[[ToolContext], dict[str, Any]] = default_create_kwargs,
    ):
        self.tool = tool
        self.schema = _schema_dict(tool.get_openai_tool_schema())
        self.name = name or self.schema["function"].get("name") or getattr(tool, "name", "")
        self.schema["function"]["name"] = self.name
        self.create_kwargs = create_kwargs

    @property
    def _key(self) -> str:
        return f"verl:{self.name}"

    async def _instance(self, context: ToolContext) -> dict[str, Any]:
        """This trajectory's instance record, creating the veRL instance on the first call."""
        record = context.state.get(self._key)
        if record is not None:
            return record
        create_kwargs = self.create_kwargs(context)
        kwargs: dict[str, Any] = {"create_kwargs": create_kwargs}
        # Older veRL tools take their data as named keyword arguments of `create` (`image`).
        try:
            parameters = dict(inspect.signature(self.tool.create).parameters)
        except (TypeError, ValueError):  # no signature to read: pass create_kwargs alone
            parameters = {}
        for key, value in create_kwargs.items():
            if key in parameters and key != "instance_id":
                kwargs[key] = value
        if parameters and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in parameters}
        created = await self.tool.create(None, **kwargs)
        instance_id = created[0] if isinstance(created, tuple) else created
        record = {"instance_id": instance_id, "reward": 0.0}
        context.state[self._key] = record
        return record

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> Observation:
        record = await self._instance(context)
        result = await self.tool.execute(record["instance_id"], arguments)
        if isinstance(result, tuple) and len(result) == 3:
            response, step_reward, metrics = result
        else:
            response, step_reward, metrics = result, 0.0, {}
        if isinstance(response, str) or response is None:
            text, images = response or "", []
        else:
            text = _field(response, "text") or ""
            images = _field(response, "image") or _field(response, "images") or []
            if not isinstance(images, (list, tuple)):
                images = [images]
        total = float(await self.tool.calc_reward(record["instance_id"]))
        gain, record["reward"] = total - record["reward"], total
        return Observation(
            text=str(text),
            images=[_rgb(im) for im in images],
            reward=float(step_reward or 0.0) + gain,
            metrics=dict(metrics) if isinstance(metrics, dict) else {},
        )

    async def release(self, context: ToolContext) -> float | None:
        """Release this trajectory's veRL instance, if one was created: its final calc_reward."""
        record = context.state.pop(self._key, None)
        if record is None:
            return None
        await self.tool.release(record["instance_id"])
        return record["reward"]


def register_verl_tool(
    tool: Any,
    name: str | None = None,
    create_kwargs: Callable[[ToolContext], dict[str, Any]] = default_create_kwargs,
    replace: bool = False,
) -> VerlToolAdapter:
    """Register a veRL tool instance (as built by veRL from its tool config) under `name`
    (default: its schema's function name); the adapter is returned."""
    adapter = VerlToolAdapter(tool, name=name, create_kwargs=create_kwargs)
    add_tool(adapter, replace=replace)
    return adapter
