"""Environment classes in TRL's `environment_factory` style, run through the tool loop.

TRL's `GRPOTrainer(environment_factory=...)` contract (TRL's `grpo_trainer.py`): the factory
(a class, or any callable) is called without arguments for one instance per rollout; the
instance's `reset(**row)` is called with the dataset row; every public method (a name not
starting with `_`, other than `reset` and `get_reward`) is a tool, its schema read from its
signature and docstring; a call's return value is the tool's answer; an optional
`get_reward()` (sync or async) scores the finished rollout from the instance's state.

    class Guess:
        def reset(self, **row): self.target, self.tries = row["target"], 0
        def guess(self, n: int) -> str:
            '''Guess the number.

            Args:
                n: the guess
            '''
            self.tries += 1
            return "right" if n == self.target else ("higher" if n < self.target else "lower")
        def get_reward(self) -> float: ...

    env = register_environment_class(Guess)   # tools "guess": samples name them in agent.tools
    env.tool_names                             # ["guess"]

Here, per trajectory:

- the instance is made, and `reset(**row)` called, on the trajectory's first call of one of its
  methods, and kept in `ToolContext.state` (a trajectory that calls none gets none); the row is
  the sample's `extra_info` fields plus `prompt` (its chat messages), the columns of an mmrl
  record that TRL would pass (`reset` should take `**kwargs` for the ones it does not use).
  What `reset` returns is not added to the prompt (TRL appends it to the last user message):
  put the task's text in the sample's prompt;
- each call's return value is the observation (`to_observation`: text, a PIL image or a list
  of them, a (text, images) tuple); a method that raises gives a counted `tool_error`;
- `get_reward()` is read after each call and the change since the last reading is that call's
  `Observation.reward` (as veRL's `calc_reward`, `verl_adapter`), so a trajectory's
  `tool_reward` is `get_reward()` of its instance at its end; the score adds it times
  `agent.tool_reward_weight`. `release` (at the end of the rollout) drops the instance and
  returns that reward.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any

from mmrl.environments.tools import (
    _POOL,
    CONTEXT_PARAM,
    Observation,
    Tool,
    ToolContext,
    _guarded,
    _schema_of,
    add_tool,
    to_observation,
    unregister_tool,
)

log = logging.getLogger(__name__)

RESERVED = ("reset", "get_reward")
"""Public methods of an environment class that are not tools (TRL's own exclusions)."""


def environment_methods(instance: Any) -> list[str]:
    """The names of an environment instance's tool methods, as TRL finds them: its bound methods
    whose names do not start with `_`, less `reset` and `get_reward`; sorted."""
    return [
        name
        for name, _ in inspect.getmembers(instance, predicate=inspect.ismethod)
        if name not in RESERVED and not name.startswith("_")
    ]


def sample_row(context: ToolContext) -> dict[str, Any]:
    """What `reset(**row)` gets: the sample's `extra_info` fields and its `prompt` (the chat
    messages); without a sample in the context, only `id` (the sample id)."""
    sample = context.sample
    if sample is None:
        return {"id": context.sample_id}
    return {**dict(sample.extra_info), "prompt": sample.prompt}


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await an async callable on the tools' loop, or run a sync one in a tool thread."""
    if inspect.iscoroutinefunction(fn):
        return await _guarded(fn(*args, **kwargs))
    value = await asyncio.wrap_future(_POOL.submit(fn, *args, **kwargs))
    return await _guarded(value) if inspect.isawaitable(value) else value


class TrlEnvironment:
    """One registered environment class: its factory, its tools and each trajectory's instance."""

    def __init__(
        self,
        factory: Callable[[], Any],
        name: str | None = None,
        prefix: str = "",
        row: Callable[[ToolContext], dict[str, Any]] = sample_row,
    ):
        self.factory = factory
        self.name = name or getattr(factory, "__name__", None) or type(factory).__name__
        self.row = row
        probe = factory()  # (TRL probes one instance the same way to read its methods)
        if not callable(getattr(probe, "reset", None)):
            raise TypeError(f"environment {self.name!r} must define a callable `reset`")
        self.has_reward = callable(getattr(probe, "get_reward", None))
        self.methods = environment_methods(probe)
        if not self.methods:
            raise TypeError(f"environment {self.name!r} has no public method to offer as a tool")
        self.tools = [
            EnvMethodTool(self, method, prefix + method, getattr(probe, method)) for method in self.methods
        ]

    @property
    def tool_names(self) -> list[str]:
        """The registered tool names, one per public method (what a sample lists in `agent.tools`)."""
        return [tool.name for tool in self.tools]

    @property
    def _key(self) -> str:
        return f"trl_env:{self.name}"

    async def instance(self, context: ToolContext) -> dict[str, Any]:
        """This trajectory's record (`instance`, `reward`): made and reset on its first call."""
        record = context.state.get(self._key)
        if record is not None:
            return record
        instance = await _call(self.factory)
        await _call(instance.reset, **self.row(context))
        record = {"instance": instance, "reward": 0.0}
        context.state[self._key] = record  # only once reset went through: a failed one is retried
        return record

    async def reward_gain(self, record: dict[str, Any]) -> float:
        """`get_reward()` now, less its last reading (0 without `get_reward`)."""
        if not self.has_reward:
            return 0.0
        total = float(await _call(record["instance"].get_reward))
        gain, record["reward"] = total - record["reward"], total
        return gain

    def release(self, context: ToolContext) -> float | None:
        """Drop this trajectory's instance, if it made one: its last `get_reward()` reading."""
        record = context.state.pop(self._key, None)
        if record is None or not self.has_reward:
            return None
        return record["reward"]

    def unregister(self) -> None:
        """Remove its tools from the registry (for tests and reloads)."""
        for name in self.tool_names:
            unregister_tool(name)


class EnvMethodTool(Tool):
    """One public method of an environment class as a tool, called on the trajectory's instance."""

    def __init__(self, env: TrlEnvironment, method: str, name: str, bound: Callable[..., Any]):
        self.env = env
        self.method = method
        self.name = name
        self.schema = _schema_of(bound, name)  # `self` is not in a bound method's signature
        self.takes_context = CONTEXT_PARAM in inspect.signature(bound).parameters

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> Observation:
        record = await self.env.instance(context)
        kwargs = dict(arguments)
        if self.takes_context:
            kwargs[CONTEXT_PARAM] = context
        value = await _call(getattr(record["instance"], self.method), **kwargs)
        obs = to_observation(value)
        obs.reward += await self.env.reward_gain(record)
        return obs

    async def release(self, context: ToolContext) -> float | None:
        return self.env.release(context)  # the first of its tools to be released drops the instance


def register_environment_class(
    factory: Callable[[], Any],
    name: str | None = None,
    *,
    prefix: str = "",
    row: Callable[[ToolContext], dict[str, Any]] = sample_row,
    replace: bool = False,
) -> TrlEnvironment:
    """Register a TRL-style environment class (or any callable without arguments that returns
    an instance): each public method becomes a tool named `prefix + method name`, schema from
    its signature and docstring. `name` (default: the factory's `__name__`) keys its instances
    in `ToolContext.state`; `row(context)` builds what `reset(**row)` gets (default
    `sample_row`). A taken tool name raises ValueError unless `replace`; nothing is registered
    then."""
    env = TrlEnvironment(factory, name=name, prefix=prefix, row=row)
    if not replace:
        from mmrl.environments.tools import _TOOLS

        taken = [tool.name for tool in env.tools if tool.name in _TOOLS]
        if taken:
            raise ValueError(f"tool {taken[0]!r} is already registered")
    for tool in env.tools:
        add_tool(tool, replace=replace)
    return env
