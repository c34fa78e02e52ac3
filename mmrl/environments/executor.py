"""Running tool calls: asynchronously, under time limits, with every failure an observation.

A tool that raises, hangs, returns a wall of text or a giant image costs one error observation
(counted by its kind), never a crash of the rollout or a silent score. One trajectory's calls
run in the order written (a stateful tool sees them in order); trajectories run concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Coroutine
from typing import Any

from PIL import Image

from mmrl.environments.tools import (
    _POOL,
    _TOOLS,
    Observation,
    ToolCall,
    ToolContext,
    ToolLimits,
    get_tool,
    tool_names,
)

log = logging.getLogger(__name__)


def _consume(task: asyncio.Future) -> None:
    """Retrieve an abandoned call's outcome so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _error_text(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _downscale(image: Image.Image, max_pixels: int) -> Image.Image:
    """`image` shrunk, aspect kept, to at most `max_pixels` pixels."""
    width, height = image.size
    scale = math.sqrt(max_pixels / (width * height))
    new_w = max(1, math.floor(width * scale))
    new_h = max(1, math.floor(height * scale))
    while new_w * new_h > max_pixels and (new_w > 1 or new_h > 1):  # floor's rounding may still be over
        if new_w >= new_h:
            new_w -= 1
        else:
            new_h -= 1
    return image.resize((new_w, new_h), Image.Resampling.BICUBIC)


def apply_limits(obs: Observation, limits: ToolLimits) -> Observation:
    """Cap one observation: extra images dropped, large ones downscaled (both noted in its
    text), then its text cut to `max_text_chars` ('text_too_long' unless it already failed)."""
    notes: list[str] = []
    if len(obs.images) > limits.max_images:
        notes.append(f"[kept the first {limits.max_images} of {len(obs.images)} images]")
    obs.images = list(obs.images[: limits.max_images])  # a copy: the tool may keep its own list
    for i, image in enumerate(obs.images):
        width, height = image.size
        if width * height > limits.max_image_pixels:
            obs.images[i] = _downscale(image, limits.max_image_pixels)
            new_w, new_h = obs.images[i].size
            notes.append(f"[image {i + 1} downscaled from {width}x{height} to {new_w}x{new_h} pixels]")
    tail = "".join(f"\n{note}" for note in notes)
    budget = max(limits.max_text_chars - len(tail), 0)  # the notes are kept whole where they fit
    if len(obs.text) > budget:
        if obs.error is None and len(obs.text) > limits.max_text_chars:
            obs.error = "text_too_long"
        marker = f"... [cut: {len(obs.text)} characters in all]"
        obs.text = (obs.text[: max(budget - len(marker), 0)] + marker)[:budget]
    text = obs.text + tail if obs.text else tail.lstrip("\n")
    obs.text = text[: limits.max_text_chars]
    return obs


async def run_tool_call(call: ToolCall, context: ToolContext, limits: ToolLimits) -> Observation:
    """Run one call under the limits. Never raises for anything the tool or the call does."""
    start = time.perf_counter()
    allowed = context.tools if context.tools is not None else tool_names()
    if call.name not in _TOOLS or call.name not in allowed:
        names = ", ".join(sorted(n for n in allowed if n in _TOOLS)) or "none"
        return Observation(
            text=f"unknown tool {call.name!r}; available tools: {names}.", error="unknown_tool"
        )
    tool = get_tool(call.name)
    task = asyncio.ensure_future(tool.call(dict(call.arguments), context))
    try:
        # asyncio.wait, not wait_for: a timed-out call is abandoned at once, even one that
        # ignores its cancellation (wait_for would wait for it to finish cancelling).
        done, _ = await asyncio.wait({task}, timeout=limits.timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    seconds = time.perf_counter() - start
    if not done:
        task.cancel()
        task.add_done_callback(_consume)
        return Observation(
            text=f"{call.name} timed out after {limits.timeout_s:g} s.", error="timeout", seconds=seconds
        )
    try:
        obs = task.result()
        if not isinstance(obs, Observation):
            raise TypeError(f"{type(tool).__name__}.call returned {type(obs).__name__}, not an Observation")
        if any(im.width * im.height > limits.max_image_pixels for im in obs.images[: limits.max_images]):
            # Downscaling a giant image takes a while: off the loop, as the tools run.
            obs = await asyncio.wrap_future(_POOL.submit(apply_limits, obs, limits))
        else:
            obs = apply_limits(obs, limits)
    except Exception as exc:  # noqa: BLE001 - a tool's failure is an observation, never a crash
        log.debug("tool %s failed on %s", call.name, call.arguments, exc_info=True)
        return Observation(
            text=f"{call.name} failed: {_error_text(exc)}", error="tool_error", seconds=seconds
        )
    obs.seconds = seconds
    return obs


async def run_tool_calls(
    calls: list[ToolCall], context: ToolContext, limits: ToolLimits
) -> list[Observation]:
    """Run one trajectory's calls of one turn, in order: one observation per call.

    Calls past `limits.max_calls_per_turn` are not run ('too_many_calls'). The context's images
    are not changed: the caller appends the observations' images after the turn
    (`ToolContext.add_observations`). Never raises for tool misbehaviour."""
    out: list[Observation] = []
    for n, call in enumerate(calls):
        if n >= limits.max_calls_per_turn:
            out.append(
                Observation(
                    text=f"tool call {n + 1} ({call.name}) not run: at most "
                    f"{limits.max_calls_per_turn} tool calls per turn.",
                    error="too_many_calls",
                )
            )
            continue
        out.append(await run_tool_call(call, context, limits))
    return out


# ---------------------------------------------------------------------------------------------
# The sync entry: one private event loop in a daemon thread


class _LoopThread:
    """One event loop, in a daemon thread, that every sync entry submits to.

    A persistent loop (not `asyncio.run` per batch): a stateful tool's asyncio objects (locks,
    semaphores, clients) stay on the loop they were made on from one turn to the next, and the
    entry works from any thread, whether or not that thread runs a loop of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="mmrl-tool-loop", daemon=True).start()
                self._loop = loop
            return self._loop

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop()).result()


_LOOP = _LoopThread()


def run_tool_batches(
    per_trajectory: list[tuple[list[ToolCall], ToolContext]], limits: ToolLimits
) -> list[list[Observation]]:
    """Run every trajectory's calls of this turn concurrently; observations per trajectory.

    The sync entry for the rollout loop: it blocks until all are done (each call bounded by
    `limits.timeout_s`), from any thread."""

    async def run_all() -> list[list[Observation]]:
        return list(
            await asyncio.gather(*(run_tool_calls(calls, ctx, limits) for calls, ctx in per_trajectory))
        )

    return _LOOP.run(run_all())


async def release_all(context: ToolContext) -> dict[str, float]:
    """Release every tool's per-trajectory state (veRL instances, class tools' `release`) at the
    end of a trajectory: the final rewards the tools report, by tool name. Never raises."""
    rewards: dict[str, float] = {}
    for name in tool_names():
        try:
            reward = await get_tool(name).release(context)
        except Exception:  # noqa: BLE001 - a release failure must not end the rollout
            log.warning("releasing tool %s for sample %r failed", name, context.sample_id, exc_info=True)
            continue
        if reward is not None:
            rewards[name] = float(reward)
    return rewards


def release_batches(contexts: list[ToolContext]) -> list[dict[str, float]]:
    """`release_all` for each finished trajectory, from sync code (on the tools' loop)."""

    async def release_each() -> list[dict[str, float]]:
        return list(await asyncio.gather(*(release_all(ctx) for ctx in contexts)))

    return _LOOP.run(release_each())
