"""Multi-turn rollout throughput: `visual_search` rollouts with tool calls against single-turn
rollouts of the same length, side by side in one process.

    python benchmarks/multiturn.py [--prompts 8] [--group 8] [--rounds 3] [--turns 3]
                                   [--turn-tokens 32] [--model PATH] [--threads 1]

Arms, run interleaved in every round (after one untimed warm-up round), medians over rounds:

- `single`: the task's samples without tools (`visual_search.without_tools`), one response of
  exactly turns x turn-tokens model tokens each (`engine.generate`, the single-turn path);
- `fast tool`: the same samples with a tool, `--turns` model turns of exactly `--turn-tokens`
  tokens each (`mmrl.rollout.multiturn.generate_trajectories`) and a tool call between turns
  that sleeps one decode step (the engine's measured `time/decode_step_ms` of the single arm),
  then returns a `zoom_in` crop (an observation with one image);
- `slow tool`: the same with a tool that sleeps 10 decode steps.

Both arms generate the same number of model tokens; tokens/s counts those alone (the tool's
observation tokens are prefilled, never generated, so they are not counted). The ratio is the
median over rounds of multi-turn tokens/s over the same round's single-turn tokens/s. Goal (the
issue): >= 0.8x with the fast tool, >= 0.6x with the slow one.

How turns get a fixed length. The random policy writes no tool calls, so the benchmark registers
a call format (`bench_always_<tool>`) that reads any turn as one call to the arm's tool. The loop
ends a trajectory whose turn was cut by the length limit (`length`), so turns must end on the
stop token, and at the same length in both arms, which neither a constant LM-head bias (a
geometric length) nor `max_new_tokens` alone gives. A forward hook on the policy does it: it
counts the tokens of the turn being generated (a forward over more than one new position is a
prefill and starts a turn: the first turn's shared prefill and every `continue_rows` prefill) and
sets the stop token's logit to -1e4 before the turn's last token and to +1e4 at it. Every row
thus samples its own tokens and then its stop token as token `--turn-tokens` (the single arm: as
token turns x turn-tokens); the model's compute is unchanged (one [rows, V] write per step).
The last turn's call is not run (`max_turns`), so a trajectory holds turns - 1 tool calls.

The same hook times the model's forwards, split into prefills and decode steps; with timers on
the loop's parts it shows where the multi-turn arm's time goes. Timings depend on the machine
(and on its load): run it where you compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from mmrl.config import AgentConfig
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.visual_search import quarter_box, without_tools
from mmrl.environments import (
    Observation,
    ParsedTurn,
    ToolCall,
    ToolContext,
    register_call_format,
    register_tool,
)
from mmrl.environments.builtin import zoom_in
from mmrl.rollout import hf, multiturn
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams, encode_prompts
from mmrl.types import AgentSpec

GOALS = {"fast tool": 0.8, "slow tool": 0.6}
"""The issue's goals: multi-turn tokens/s over single-turn tokens/s."""
SLOW_FACTOR = 10
"""The slow tool takes this many decode steps."""
TOOL_SECONDS = {"bench_fast_zoom": 0.0, "bench_slow_zoom": 0.0}
"""How long each benchmark tool sleeps (set from the measured decode step)."""
ZOOM_BOX = quarter_box(0, 256)
"""The box every call zooms into (the top left quarter's, on the 256x256 task image)."""


def _slept_zoom(name: str) -> None:
    """Register `name`: `zoom_in` (its signature and docstring, hence its schema) after sleeping
    `TOOL_SECONDS[name]`."""

    def tool(
        bbox_2d: list[int], label: str = "", image_index: int = 0, *, context: ToolContext
    ) -> Observation:
        time.sleep(TOOL_SECONDS[name])
        return zoom_in(bbox_2d, label, image_index, context=context)

    tool.__doc__ = zoom_in.__doc__
    register_tool(name)(tool)


for _name in TOOL_SECONDS:
    _slept_zoom(_name)


def _always_calls(tool: str):
    def parse(text: str) -> ParsedTurn:
        return ParsedTurn(
            calls=[ToolCall(tool, {"bbox_2d": list(ZOOM_BOX)}, text, index=0)], errors=[], error_kinds=[]
        )

    return parse


for _tool in TOOL_SECONDS:
    register_call_format(f"bench_always_{_tool}")(_always_calls(_tool))


class FixedTurns:
    """Forward hooks on the policy: every turn ends on its stop token as token `length` (see the
    module docs), and the forwards' wall time, prefills and decode steps apart."""

    def __init__(self, model: torch.nn.Module, stop_token_ids: list[int]):
        self.stop = stop_token_ids[0]
        self.others = list(stop_token_ids[1:])
        self.length = 1
        self.produced = 0
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._start = 0.0
        self._prefill = False
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after, with_kwargs=True)
        vision = next(
            (
                m
                for n, m in model.named_modules()
                if n.rsplit(".", 1)[-1] in ("visual", "vision_tower", "vision_model")
            ),
            None,
        )
        if vision is not None:  # the vision encoder's share of the prefills
            vision.register_forward_pre_hook(self._vision_before)
            vision.register_forward_hook(self._vision_after)
        self._vision_start = 0.0

    def _before(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._prefill = ids is None or ids.shape[-1] > 1
        self._start = time.perf_counter()

    def _after(self, module, args, kwargs, out) -> None:
        self.produced = 1 if self._prefill else self.produced + 1
        logits = out.logits[:, -1]
        logits[:, self.stop] = 1e4 if self.produced >= self.length else -1e4
        if self.others:  # a model's other stop tokens never end a turn early
            logits[:, self.others] = -1e4
        kind = "prefill" if self._prefill else "decode"
        self.seconds[kind] += time.perf_counter() - self._start
        self.counts[kind] += 1

    def _vision_before(self, module, args) -> None:
        self._vision_start = time.perf_counter()

    def _vision_after(self, module, args, out) -> None:
        self.seconds["vision"] += time.perf_counter() - self._vision_start


class Timers:
    """Wall time of the engine's calls and the loop's parts, by name (patched in place)."""

    def __init__(self, engine: HFRolloutEngine, hooks: FixedTurns):
        self.seconds: dict[str, float] = defaultdict(float)
        self.hooks = hooks
        engine.generate = self._timed("first turn", engine.generate)
        engine.continue_rows = self._timed("continuation turns", engine.continue_rows)
        # continue_rows' inputs: `continuation_inputs` (the engine's own loop), `token_inputs` (generate)
        hf.continuation_inputs = self._timed("token_inputs", hf.continuation_inputs)
        hf.token_inputs = self._timed("token_inputs", hf.token_inputs)
        multiturn._run_tools = self._timed("tools", multiturn._run_tools)
        multiturn.observation_batch = self._timed("observation tokens", multiturn.observation_batch)
        multiturn.assemble = self._timed("assemble", multiturn.assemble)

    def _timed(self, name: str, fn):
        def run(*args, **kwargs):
            forwards = dict(self.hooks.seconds)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                for kind, value in list(self.hooks.seconds.items()):
                    self.seconds[f"{name}/{kind}"] += value - forwards.get(kind, 0.0)

        return run

    def reset(self) -> None:
        self.seconds.clear()


def build_policy(path: str | None) -> Any:
    if path:
        from mmrl.models.loading import load_policy

        return load_policy(path)
    from mmrl.models.loading import make_policy
    from mmrl.models.tiny import build_processor, build_tiny_vlm
    from mmrl.models.tiny_spec import TinyVLMSpec

    spec = TinyVLMSpec()
    return make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="responses per prompt (G)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--turns", type=int, default=3, help="model turns per trajectory (turns - 1 tool calls)"
    )
    parser.add_argument(
        "--turn-tokens", type=int, default=32, help="model tokens per turn, stop token included"
    )
    parser.add_argument(
        "--model", default=None, help="a local Hugging Face model folder (default: the tiny Qwen2-VL)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    if args.turns < 2 or args.turn_tokens < 1:
        parser.error("--turns must be at least 2 and --turn-tokens at least 1")
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    torch.manual_seed(0)

    policy = build_policy(args.model)
    engine = HFRolloutEngine.from_policy(policy)
    hooks = FixedTurns(policy.model, policy.stop_token_ids)
    timers = Timers(engine, hooks)
    T, K, G = args.turn_tokens, args.turns, args.group
    total = K * T
    samples = make_samples(["visual_search"], args.prompts, "train")
    plain = [without_tools(s) for s in samples]
    tooled = {
        tool: [
            dataclasses.replace(
                s, agent=AgentSpec(tools=[tool], max_turns=K, max_tokens=1 << 20, max_images=K)
            )
            for s in samples
        ]
        for tool in TOOL_SECONDS
    }
    agents = {tool: AgentConfig(call_format=f"bench_always_{tool}", max_turns=K) for tool in TOOL_SECONDS}
    single_params = SamplingParams(n=G, max_new_tokens=total)
    turn_params = SamplingParams(n=G, max_new_tokens=T)

    def single() -> tuple[Any, float]:
        hooks.length = total
        start = time.perf_counter()
        batch = multiturn.generate_trajectories(engine, plain, single_params, AgentConfig())
        return batch, time.perf_counter() - start

    def multi(tool: str) -> tuple[Any, float]:
        hooks.length = T
        start = time.perf_counter()
        batch = multiturn.generate_trajectories(engine, tooled[tool], turn_params, agents[tool])
        return batch, time.perf_counter() - start

    # The decode step the tools are timed by: the single arm's, warm.
    single()
    single()
    step_s = engine.rollout_metrics()["time/decode_step_ms"] / 1000
    TOOL_SECONDS["bench_fast_zoom"] = step_s
    TOOL_SECONDS["bench_slow_zoom"] = SLOW_FACTOR * step_s
    arms = {
        "single": single,
        "fast tool": lambda: multi("bench_fast_zoom"),
        "slow tool": lambda: multi("bench_slow_zoom"),
    }

    rates: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, list[dict[str, float]]] = defaultdict(list)
    walls: dict[str, list[float]] = defaultdict(list)
    facts: dict[str, dict[str, Any]] = {}
    for r in range(-1, args.rounds):  # round -1: warm-up, untimed
        order = list(arms)
        order = order[r % len(order) :] + order[: r % len(order)]  # each arm leads in turn
        for name in order:
            timers.reset()
            batch, wall = arms[name]()
            tokens = int(batch.response_mask.sum())
            facts[name] = _facts(batch, tokens)
            _check(facts, len(samples) * G, K, total)
            if r < 0:
                continue
            rates[name].append(tokens / wall)
            walls[name].append(wall)
            parts[name].append(dict(timers.seconds))

    ratios = {
        name: statistics.median(m / s for m, s in zip(rates[name], rates["single"]))
        for name in ("fast tool", "slow tool")
    }
    prompt = {
        "single": encode_prompts(policy.processor, plain[:1])["input_ids"].shape[1],
        "tools": encode_prompts(policy.processor, tooled["bench_fast_zoom"][:1])["input_ids"].shape[1],
    }
    load = os.getloadavg()[0]

    print(
        f"Multi-turn rollout throughput on visual_search: {args.prompts} prompts x {G} responses = "
        f"{len(samples) * G} rows, {args.rounds} rounds (median), {args.model or 'tiny Qwen2-VL (random)'}, "
        f"{args.threads} thread(s)"
    )
    print(
        f"  multi-turn: {K} turns x {T} model tokens, {K - 1} tool calls; single-turn: 1 turn x {total} tokens; "
        f"model tokens per row {facts['single']['tokens_per_row']:.0f} (single) / "
        f"{facts['fast tool']['tokens_per_row']:.0f} (multi)"
    )
    print(
        f"  prompt tokens: {prompt['single']} (single, no tool schema) / {prompt['tools']} (with the tool schema); "
        f"observation tokens per call {facts['fast tool']['observation_per_call']:.0f} (not generated, not counted)"
    )
    print(
        f"  decode step {1000 * step_s:.2f} ms (single arm, {len(samples) * G} rows); tool sleeps "
        f"{TOOL_SECONDS['bench_fast_zoom']:.4f} s (fast) / {TOOL_SECONDS['bench_slow_zoom']:.4f} s (slow) per call"
    )
    print(
        f"  load average (1 min): {load_start:.2f} at the start, {load:.2f} at the end, on {os.cpu_count()} CPUs"
    )
    print()
    print(f"  {'arm':<10} {'tokens/s':>9} {'wall s':>7} {'vs single':>10} {'goal':>6}  met")
    for name in arms:
        rate, wall = statistics.median(rates[name]), statistics.median(walls[name])
        if name == "single":
            print(f"  {name:<10} {rate:9.1f} {wall:7.3f} {'1.00x':>10} {'':>6}")
            continue
        ratio, goal = ratios[name], GOALS[name]
        met = (
            "yes"
            if ratio >= goal
            else f"no: {goal - ratio:.2f}x short ({100 * (goal / ratio - 1):.0f}% faster needed)"
        )
        print(f"  {name:<10} {rate:9.1f} {wall:7.3f} {ratio:9.2f}x {goal:5.1f}x  {met}")
    print("  per round (multi / single):", ", ".join(
        f"{name} " + " ".join(f"{m / s:.2f}" for m, s in zip(rates[name], rates["single"])) for name in GOALS
    ))  # fmt: skip
    print()
    print("  where the time goes (median seconds per batch, share of the arm's wall time):")
    print(f"    {'part':<34}" + "".join(f"{arm:>20}" for arm in arms))
    for label, key in BREAKDOWN:
        cells = []
        for arm in arms:
            value = statistics.median(_part(p, w, key) for p, w in zip(parts[arm], walls[arm]))
            share = value / statistics.median(walls[arm])
            cells.append(f"{value:7.3f} s ({100 * share:4.1f}%)" if abs(value) > 5e-4 else "-")
        print(f"    {label:<34}" + "".join(f"{c:>20}" for c in cells))


BREAKDOWN = [
    ("first turn (engine.generate)", "first turn"),
    ("  prefill forwards", "first turn/prefill"),
    ("    of which the vision encoder", "first turn/vision"),
    ("  decode forwards", "first turn/decode"),
    ("  sampling, rest", "first turn/rest"),
    ("tools (run_tool_batches)", "tools"),
    ("observation tokens (processor)", "observation tokens"),
    ("continuation turns (continue_rows)", "continuation turns"),
    ("  inputs (positions, images, cache)", "token_inputs"),
    ("  prefill forwards", "continuation turns/prefill"),
    ("    of which the vision encoder", "continuation turns/vision"),
    ("  decode forwards", "continuation turns/decode"),
    ("  sampling, rest", "continuation turns/rest"),
    ("assemble (images of every row)", "assemble"),
    ("rest of the loop", "rest"),
]
"""The rows of the time table: (label, key of the timers' seconds)."""


def _part(seconds: dict[str, float], wall: float, key: str) -> float:
    """One part's seconds; `<part>/rest` is the part less its timed pieces, `rest` the wall time
    less every top-level part."""
    if key == "rest":
        top = [k for _, k in BREAKDOWN if "/" not in k and k not in ("token_inputs", "rest")]
        return wall - sum(seconds.get(k, 0.0) for k in top)
    if key.endswith("/rest"):
        part = key[: -len("/rest")]
        inputs = seconds.get("token_inputs", 0.0) if part == "continuation turns" else 0.0
        return (
            seconds.get(part, 0.0)
            - inputs
            - sum(seconds.get(f"{part}/{p}", 0.0) for p in ("prefill", "decode"))
        )
    return seconds.get(key, 0.0)


def _facts(batch: Any, tokens: int) -> dict[str, Any]:
    rows = len(batch)
    out: dict[str, Any] = {"rows": rows, "tokens_per_row": tokens / rows}
    if batch.trajectories is not None:
        trajs = batch.trajectories
        calls = sum(t.tool_calls for t in trajs)
        out.update(
            turns={t.turns for t in trajs},
            ends={t.termination for t in trajs},
            errors=sum(sum(t.tool_errors.values()) for t in trajs),
            calls_per_row=calls / rows,
            observation_per_call=sum(t.observation_tokens for t in trajs) / max(calls, 1),
        )
    return out


def _check(facts: dict[str, dict[str, Any]], rows: int, turns: int, total: int) -> None:
    """The arms did what the benchmark says: every row generated `total` model tokens, and the
    multi-turn rows ran `turns` turns with a clean tool call between each two."""
    for name, f in facts.items():
        problems = []
        if f["rows"] != rows or f["tokens_per_row"] != total:
            problems.append(
                f"{f['rows']} rows of {f['tokens_per_row']:.1f} model tokens, not {rows} of {total}"
            )
        if name != "single" and (
            f["turns"] != {turns}
            or f["ends"] != {"max_turns"}
            or f["errors"]
            or f["calls_per_row"] != turns - 1
        ):
            problems.append(
                f"turns {f['turns']}, ends {f['ends']}, {f['errors']} tool errors, {f['calls_per_row']} calls/row"
            )
        if problems:
            raise SystemExit(f"benchmark arm {name!r} is not what it should be: {'; '.join(problems)}")


if __name__ == "__main__":
    main()
