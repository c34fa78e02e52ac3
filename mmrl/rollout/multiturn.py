"""The multi-turn rollout loop: a response is a sequence of turns, with tool calls between them.

Per trajectory, until a final answer or a limit:

1. the engine generates a turn (the first from the prompt, as a single-turn rollout does; later
   ones from the token ids the model has seen so far, `engine.continue_rows`; the HF engine keeps
   each row's key/value cache between turns, `turn_cache()`, and prefills only the new tokens);
2. the turn's tool calls are parsed in the model's format (`agent.call_format`);
3. the tools run on this side, every trajectory's calls concurrently, under time limits
   (`mmrl.environments.run_tool_batches`); a failure is an error observation, counted;
4. the observation (tool messages: text and images) is tokenized on its own and appended.

Token-in/token-out: the model's tokens are kept exactly as generated and only the new
observation messages are tokenized (`mmrl.models.chat_templates.observation_text`), so the
trainer scores exactly the sequence the model sampled from; re-tokenizing the final
conversation (`rollout.tokenization_check`) is a check, never the source of the ids.

A batch whose samples name no tools is the one-turn case: the engine's `generate` output as is.
The result is a `RolloutBatch` whose response holds model and observation tokens interleaved,
`response_mask` 1 on the model's, `observation_mask` 1 on the observations', the rollout
log-probs of the model's tokens, and every image of each trajectory (the prompt's, then the
observations') in order. Each image goes through the image processor once per call: the prompt's
in the first turn, an observation's when it is tokenized; their outputs are kept
(`mmrl.rollout.hf.ImageCache`) for the continuations and the batch.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from mmrl.config import AgentConfig
from mmrl.models.chat_templates import ensure_tool_template
from mmrl.types import RolloutBatch, Sample, Trajectory

LIMIT_ENDS = ("length", "max_turns", "token_budget", "image_budget")
"""Terminations on a limit (`agent.over_limit` decides whether they are scored or masked)."""
ENV_ENDS = ("env_done", "env_truncated", "env_error", "env_timeout")
"""Terminations by an environment (`Trajectory.termination`)."""
ENV_TURN = object()
"""What `_next_calls` returns for a trajectory whose next step is an environment action."""


@dataclass
class _Row:
    """One trajectory being built."""

    sample: Sample
    prompt_ids: list[int]
    images: list[Image.Image]
    max_turns: int
    max_tokens: int
    max_images: int
    ids: list[int] = field(default_factory=list)
    """Response ids so far: model and observation tokens interleaved."""
    model: list[int] = field(default_factory=list)
    """1 where `ids` holds a model token, 0 where an observation token."""
    logprobs: list[float] = field(default_factory=list)
    info: Trajectory = field(default_factory=Trajectory)
    done: bool = False
    truncated: bool = False
    state: dict[str, Any] = field(default_factory=dict)
    session: Any = None
    """The trajectory's own environment instance (`mmrl.environments.EnvSession`), if it acts in one."""
    versions: list[int] = field(default_factory=list)
    """Per token of `ids`: the policy version that sampled it (-1 on observations); partial
    rollouts only (`Interrupt`)."""
    turn_ids: list[int] = field(default_factory=list)
    """The current model turn's tokens so far (a partial rollout continues a turn in chunks)."""

    def add_turn(self, ids: list[int], logprobs: list[float], text: str, version: int = -1) -> None:
        self.ids += ids
        self.model += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += [version] * len(ids)
        self.turn_ids = list(ids)
        self.info.turn_texts.append(text)
        self.info.messages.append({"role": "assistant", "content": text})

    def extend_turn(self, ids: list[int], logprobs: list[float], text: str, version: int) -> None:
        """The next chunk of the current turn (a partial rollout: sampled after a weight update);
        `text` is the whole turn's."""
        self.ids += ids
        self.model += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += [version] * len(ids)
        self.turn_ids += ids
        self.info.turn_texts[-1] = text
        self.info.messages[-1]["content"] = text

    def add_observation(self, ids: list[int], images: list[Image.Image], messages: list[dict]) -> None:
        self.ids += ids
        self.model += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.images += images
        self.info.images += images
        self.info.observation_tokens += len(ids)
        self.info.messages += messages

    def end(self, reason: str) -> None:
        self.done = True
        self.info.termination = reason


@dataclass
class Interrupt:
    """Partial rollouts (asynchronous mode, `trainer.partial_rollout`): each model turn is
    generated in chunks of `chunk` tokens; between chunks `refresh()` loads the newest published
    weights into the engine (if newer) and returns the version it holds, and the unfinished turns
    go on from their tokens so far with those weights (their kept key/value caches dropped, so
    the prefix is recomputed by the new weights). Every token records the version that sampled
    it and its log-prob under that version (`RolloutBatch.token_versions`, `rollout_logprobs`)."""

    chunk: int
    refresh: Callable[[], int]


def uses_tools(samples: list[Sample]) -> bool:
    """Whether any sample names tools or an environment (the batch then runs the multi-turn loop)."""
    return any(s.agent is not None and (s.agent.tools or s.agent.env is not None) for s in samples)


def acts_in_env(sample: Sample) -> bool:
    """Whether the sample's trajectory acts in an environment (`agent.env`)."""
    return sample.agent is not None and sample.agent.env is not None


def generate_trajectories(
    engine: Any,
    samples: list[Sample],
    params: Any,
    agent: AgentConfig,
    on_response: Callable[[int, str], None] | None = None,
    interrupt: Interrupt | None = None,
) -> RolloutBatch:
    """G = params.n trajectories per sample, prompt-major rows as `engine.generate` lays them out.

    `params.max_new_tokens` bounds each model turn, `agent` (and each sample's own `agent`
    field) the trajectory. `on_response(row, final_text)` is called as each trajectory ends, so
    its verifier can start while the others go on. `interrupt`: partial rollouts (single-turn
    samples too then go through this loop, one turn in several chunks)."""
    tools = uses_tools(samples)
    if interrupt is None and (not tools or getattr(engine, "runs_trajectories", False)):
        return engine.generate(samples, params, on_response=on_response)  # (Ray: each worker loops)
    if interrupt is not None and getattr(engine, "runs_trajectories", False):
        raise ValueError("partial rollouts need the engine in this process (not the Ray rollout workers)")
    processor = engine.processor
    if any(s.agent is not None and s.agent.tools for s in samples):
        ensure_tool_template(processor)  # (a Qwen2-VL checkpoint's own template has no tool section)
    # What the engine keeps between turns (the HF engine: key/value caches and every image's
    # processor output); each image goes through the image processor once per call either way.
    turns = engine.turn_cache() if callable(getattr(engine, "turn_cache", None)) else None
    seen: dict = turns.images if turns is not None else {}
    # Each environment trajectory gets its own env instance, reset with its sample's seed (the
    # same across its group); the reset's observation joins the prompt as its last user turn.
    sessions = open_sessions(samples, params.n, agent)
    if sessions is not None:
        samples = sessions.samples
    # turn 1: the single-turn path, prompts shared (with `interrupt`, its first chunk)
    version = interrupt.refresh() if interrupt is not None else -1
    first_params = (
        params
        if interrupt is None
        else _with_max_new_tokens(params, min(interrupt.chunk, params.max_new_tokens))
    )
    first = (
        engine.generate(samples, first_params, turns=turns)
        if turns is not None
        else engine.generate(samples, first_params)
    )
    rows = [_start_row(first, r, agent, None if tools else params.max_new_tokens) for r in range(len(first))]
    if sessions is not None:
        for row, failed in sessions.attach(rows):
            row.info.env_errors[failed] = (
                1  # its reset failed: the trajectory is its first turn, scored as is
            )
            row.end(failed)
    remember_prompt_images(first, rows, seen)
    limits = _limits(agent)
    for r, row in enumerate(rows):
        seg = first.response_mask[r].bool()
        row.add_turn(
            first.response_ids[r][seg].tolist(),
            first.rollout_logprobs[r][seg].tolist(),
            first.texts[r],
            version,
        )
        row.truncated = bool(first.truncated[r])
        if row.done:
            _finish(row, r, on_response, turns)
    while True:
        # a. Which trajectories go on: a turn that ended on its stop token with a tool call, or
        # (partial rollouts) a turn cut at its chunk with tokens left, which goes on as it is.
        pending: list[tuple[int, Any]] = []  # (row, its last turn's parsed calls)
        resumed: list[int] = []
        for r, row in enumerate(rows):
            if row.done:
                continue
            if interrupt is not None and row.truncated and _turn_room(row, params) > 0:
                resumed.append(r)
                continue
            turn = _next_calls(row, agent)
            if turn is None:
                _finish(row, r, on_response, turns)
            else:
                pending.append((r, turn))
        if not pending and not resumed:
            break
        # b. The tools, every trajectory's calls at once, and the environments' steps, every
        # trajectory's at once (on this side, under time limits). An environment that ended
        # gives no observation: its trajectory ends on the model's last action.
        tool_rows = [(r, turn) for r, turn in pending if turn is not ENV_TURN]
        env_rows = [r for r, turn in pending if turn is ENV_TURN]
        observed = dict(zip([r for r, _ in tool_rows], _run_tools(rows, tool_rows, limits)))
        for r, obs in zip(env_rows, _step_envs(rows, env_rows, agent)):
            if obs is None:
                _finish(rows[r], r, on_response, turns)
            else:
                observed[r] = obs
        pending = [(r, turn) for r, turn in pending if r in observed]
        # c. Each observation tokenized on its own and appended, if the budgets allow.
        going = []
        roles = ["user" if turn is ENV_TURN else "tool" for _, turn in pending]
        encoded = observation_batch(processor, [observed[r] for r, _ in pending], seen, roles)
        for (r, _), (ids, images, messages) in zip(pending, encoded):
            row = rows[r]
            if len(row.info.images) + len(images) > row.max_images:
                row.end("image_budget")
            elif len(row.ids) + len(ids) + 1 > row.max_tokens:
                row.end("token_budget")
            else:
                row.add_observation(ids, images, messages)
                going.append(r)
            if row.done:
                _finish(row, r, on_response, turns)
        if not going and not resumed:
            continue
        # d. The next model turn of every trajectory that goes on (prefilled from its ids), and
        # the next chunk of each cut turn, after the newest weights are loaded.
        if interrupt is not None:
            newer = interrupt.refresh()
            if newer != version and turns is not None:
                for r in resumed + going:  # kept caches hold the old weights' keys and values
                    turns.drop(r)
            version = newer
        chunk = interrupt.chunk if interrupt is not None else params.max_new_tokens
        allowed = {r: min(chunk, params.max_new_tokens, rows[r].max_tokens - len(rows[r].ids)) for r in going}
        allowed.update({r: min(chunk, _turn_room(rows[r], params)) for r in resumed})
        continuing = resumed + going
        turn_params = _with_max_new_tokens(params, max(allowed.values()))
        kept = {"turns": turns, "keys": continuing} if turns is not None else {}
        outs = engine.continue_rows(
            [rows[r].prompt_ids + rows[r].ids for r in continuing], [rows[r].images for r in continuing],
            turn_params, **kept,
        )  # fmt: skip
        for r, (ids, logprobs, truncated) in zip(continuing, outs):
            row = rows[r]
            cut = len(ids) > allowed[r]
            ids, logprobs = ids[: allowed[r]], logprobs[: allowed[r]]
            if r in resumed:
                whole = row.turn_ids + ids
                row.extend_turn(
                    ids, logprobs, processor.tokenizer.decode(whole, skip_special_tokens=True), version
                )
            else:
                row.add_turn(
                    ids, logprobs, processor.tokenizer.decode(ids, skip_special_tokens=True), version
                )
                row.info.turns += 1
            row.truncated = truncated or cut
    _release(rows)
    if sessions is not None:
        sessions.close()
    # (single-turn responses cut at the length limit are scored as the one-turn path scores them)
    shaped = agent if tools else dataclasses.replace(agent, over_limit="score")
    batch = assemble(first, rows, processor, engine.pad_token_id, shaped, seen)
    batch.group_size = params.n
    if interrupt is not None:  # each model token's version (observations -1)
        batch.token_versions = _versions(rows, batch.response_ids.shape[1]).to(batch.device)
    if interrupt is not None and not tools:  # single-turn responses: no observations, no trajectories
        batch.observation_mask, batch.trajectories = None, None
    return batch


def _turn_room(row: _Row, params: Any) -> int:
    """Tokens the current model turn may still take (a partial rollout's cut turn goes on)."""
    return min(params.max_new_tokens - len(row.turn_ids), row.max_tokens - len(row.ids))


def _start_row(
    first: RolloutBatch, r: int, agent: AgentConfig, single_turn_tokens: int | None = None
) -> _Row:
    """The trajectory of row `r`; `single_turn_tokens`: a batch without tools (partial rollouts),
    one turn of at most that many tokens."""
    sample = first.samples[r]
    spec = sample.agent

    def limit(name: str) -> int:
        own = getattr(spec, name) if spec is not None else None
        return own if own is not None else getattr(agent, name)

    single = single_turn_tokens is not None
    return _Row(
        sample=sample,
        prompt_ids=first.prompt_ids[r][first.prompt_mask[r].bool()].tolist(),
        images=sample.pil_images(),
        max_turns=1 if single else limit("max_turns"),
        max_tokens=single_turn_tokens if single else limit("max_tokens"),
        max_images=0 if single else limit("max_images"),
    )


def _next_calls(row: _Row, agent: AgentConfig) -> Any:
    """The last turn's parsed calls if the trajectory goes on, else None (ended: the reason set)."""
    from mmrl.environments import parse_tool_calls

    if row.truncated:
        row.end("length")
        return None
    if row.session is not None:  # every turn is an action, until the env or a limit ends it
        if row.info.turns >= row.max_turns:
            row.end("max_turns")
            return None
        return ENV_TURN
    if row.sample.agent is None or not row.sample.agent.tools:
        row.end("answer")
        return None
    parsed = parse_tool_calls(row.info.turn_texts[-1], agent.call_format)
    if not parsed.calls and not parsed.errors:
        row.end("answer")
        return None
    if row.info.turns >= row.max_turns:
        row.end("max_turns")
        return None
    return parsed


def _run_tools(rows: list[_Row], pending: list[tuple[int, Any]], limits: Any) -> list[list]:
    """Every pending trajectory's calls run at once (`mmrl.environments.run_tool_batches`); a
    malformed call gets its error observation in its place, without running anything. Returns
    per trajectory one observation per call written, in order."""
    from mmrl.environments import ToolContext, merge_observations, run_tool_batches

    contexts = []
    for r, _ in pending:
        row = rows[r]
        contexts.append(
            ToolContext(
                images=list(row.images),
                sample_id=row.sample.id,
                state=row.state,
                tools=list(row.sample.agent.tools),
                sample=row.sample,
            )
        )
    results = run_tool_batches([(parsed.calls, c) for (_, parsed), c in zip(pending, contexts)], limits)
    out = []
    for (r, parsed), observations in zip(pending, results):
        row = rows[r]
        obs = merge_observations(parsed, observations)
        row.info.tool_calls += len(obs)
        for o in obs:
            row.info.tool_reward += float(o.reward)
            if o.error is not None:
                row.info.tool_errors[o.error] = row.info.tool_errors.get(o.error, 0) + 1
        out.append(obs)
    return out


@dataclass
class _Sessions:
    """The environment instances of one `generate_trajectories` call: one per row (None for a
    row whose sample acts in no environment), the samples with each reset's observation in
    their prompts, and per row the reset's error kind if it failed."""

    rows: list[Any]
    samples: list[Sample]
    failed: list[str | None]

    def attach(self, rows: list[_Row]) -> list[tuple[_Row, str]]:
        """Give each row its session (and its trajectory the env's id); returns the rows whose
        reset failed, with the error kind."""
        failed = []
        for row, session, error in zip(rows, self.rows, self.failed):
            row.session = session
            if session is not None:
                row.info.env_id = row.sample.agent.env.id
            if error is not None:
                failed.append((row, error))
        return failed

    def close(self) -> None:
        for session in self.rows:
            if session is not None:
                session.close()


def env_seed(sample: Sample) -> int:
    """The seed of a sample's episode: its `agent.env.seed`, else one derived from its id (the
    same for every trajectory of its group, and on a resumed run)."""
    spec = sample.agent.env
    return spec.seed if spec.seed is not None else zlib.crc32(sample.id.encode()) & 0x7FFFFFFF


def with_observation(sample: Sample, text: str, images: list[Image.Image]) -> Sample:
    """The sample with an environment's first observation (images, then text) appended to its
    prompt's last user message (a new user message if the prompt ends otherwise)."""
    from mmrl.types import IMAGE_PLACEHOLDER

    prompt = [dict(m) for m in sample.prompt]
    if prompt and prompt[-1]["role"] == "user" and isinstance(prompt[-1]["content"], str):
        head = prompt[-1]["content"]
        prompt[-1]["content"] = head + ("\n" if head else "") + IMAGE_PLACEHOLDER * len(images) + text
    elif prompt and prompt[-1]["role"] == "user":
        parts = list(prompt[-1]["content"]) + [{"type": "image"} for _ in images]
        prompt[-1]["content"] = parts + [{"type": "text", "text": text}]
    else:
        prompt.append({"role": "user", "content": IMAGE_PLACEHOLDER * len(images) + text})
    return dataclasses.replace(sample, prompt=prompt, images=list(sample.images) + list(images))


def _env_limits(agent: AgentConfig) -> Any:
    from mmrl.environments import ToolLimits

    return ToolLimits(timeout_s=agent.env_timeout_s, max_text_chars=agent.max_tool_text_chars)


def open_sessions(samples: list[Sample], n: int, agent: AgentConfig) -> _Sessions | None:
    """One environment instance per trajectory of each sample that acts in one (n per sample,
    reset with `env_seed(sample)`), all reset at once under `agent.env_timeout_s`; None if no
    sample does. A sample whose first reset fails keeps its prompt and its rows end at once."""
    if not any(acts_in_env(s) for s in samples):
        return None
    from mmrl.environments import EnvSession, reset_sessions

    rows: list[Any] = []
    for s in samples:
        rows += [EnvSession(s.agent.env) if acts_in_env(s) else None for _ in range(n)]
    live = [i for i, x in enumerate(rows) if x is not None]
    seeds = [env_seed(samples[i // n]) for i in live]
    resets = dict(zip(live, reset_sessions([rows[i] for i in live], seeds, _env_limits(agent))))
    failed: list[str | None] = [None] * len(rows)
    out = []
    for k, s in enumerate(samples):
        first = resets.get(k * n)
        for i in range(k * n, (k + 1) * n):
            if i in resets and resets[i].error is not None:
                failed[i] = resets[i].error
        if first is None or first.error is not None:
            out.append(s)
        else:
            out.append(with_observation(s, first.text, first.images))
    return _Sessions(rows=rows, samples=out, failed=failed)


def _step_envs(rows: list[_Row], which: list[int], agent: AgentConfig) -> list[list | None]:
    """Each trajectory's last turn as its environment's action, every one at once
    (`mmrl.environments.step_sessions`): per trajectory its observation (a list of one), or None
    when the environment ended it (the reason set). An invalid action steps nothing: its error
    observation comes back, counted, and the trajectory goes on."""
    if not which:
        return []
    from mmrl.environments import step_sessions

    steps = step_sessions(
        [rows[r].session for r in which], [rows[r].info.turn_texts[-1] for r in which], _env_limits(agent)
    )
    out: list[list | None] = []
    for r, step in zip(which, steps):
        info = rows[r].info
        info.env_return += agent.turn_discount ** len(info.turn_rewards) * float(step.reward)
        info.turn_rewards.append(float(step.reward))
        if step.error is not None:
            info.env_errors[step.error] = info.env_errors.get(step.error, 0) + 1
        if step.error in ("env_error", "env_timeout"):
            rows[r].end(step.error)
        elif step.error not in ("bad_action", "episode_over"):  # stepped (text_too_long: capped)
            info.env_steps += 1
            if step.terminated:
                rows[r].end("env_done")
            elif step.truncated:
                rows[r].end("env_truncated")
        out.append(None if rows[r].done else [step.observation])
    return out


def observation_tokens(
    processor: Any, observations: list, image_cache: dict | None = None
) -> tuple[list[int], list[Image.Image], list[dict]]:
    """The token ids of one turn's observations (tool messages rendered by the chat template
    after an assistant turn, the next generation prompt included, image tokens expanded by the
    processor), their images and the tool messages. With `image_cache`
    (`mmrl.rollout.hf.ImageCache`), the images' processor outputs are kept in it."""
    return observation_batch(processor, [observations], image_cache)[0]


def observation_batch(
    processor: Any, observations: list[list], image_cache: dict | None = None, roles: list[str] | None = None
) -> list[tuple[list[int], list[Image.Image], list[dict]]]:
    """`observation_tokens` for many trajectories' turns at once (`observations[i]`: one
    turn's observations, as messages of `roles[i]`: `tool` by default, `user` for an
    environment's): one processor call for the turns with images and one for those without,
    each row's ids exactly what a call of its own gives (no truncation; the padding dropped)."""
    from mmrl.models.chat_templates import observation_text

    out: list[Any] = []
    for k, turn in enumerate(observations):
        role = roles[k] if roles is not None else "tool"
        messages = []
        images: list[Image.Image] = []
        for o in turn:
            parts: list[dict[str, Any]] = [{"type": "image"} for _ in o.images]
            parts.append({"type": "text", "text": o.text})
            messages.append({"role": role, "content": parts})
            images += list(o.images)
        out.append([observation_text(processor, messages), images, messages])
    for with_images in (True, False):
        which = [i for i, (_, images, _) in enumerate(out) if bool(images) == with_images]
        if not which:
            continue
        texts = [out[i][0] for i in which]
        if with_images:
            images = [out[i][1] for i in which]
            encoded = processor(text=texts, images=images, padding=True, return_tensors="pt")
            if image_cache is not None and "image_grid_thw" in encoded:
                from mmrl.rollout.hf import remember_images

                remember_images(image_cache, [image for row in images for image in row], encoded)
        else:
            encoded = processor(text=texts, padding=True, return_tensors="pt")
        for i, ids, mask in zip(which, encoded["input_ids"], encoded["attention_mask"]):
            out[i][0] = ids[mask.bool()].tolist()
    return [tuple(o) for o in out]


def _release(rows: list[_Row]) -> None:
    """Let stateful tools (class and veRL tools) release each trajectory's instance. (Their
    rewards are already in the observations: each call's step reward and its rise in
    `calc_reward`, `mmrl.environments.verl_adapter`.)"""
    from mmrl.environments import ToolContext, release_batches

    used = [row for row in rows if row.state]
    if not used:
        return
    contexts = [ToolContext(images=row.images, sample_id=row.sample.id, state=row.state) for row in used]
    release_batches(contexts)


def remember_prompt_images(first: RolloutBatch, rows: list[_Row], cache: dict) -> None:
    """Put each row's prompt images in `cache` (`mmrl.rollout.hf.ImageCache`) from the first
    turn's own processor outputs (Qwen-VL's: per row its patches and one grid per image), so
    they do not go through the image processor again."""
    from mmrl.rollout.hf import remember_images

    vision, extents = first.vision_inputs, first.vision_layout.extents if first.vision_layout else {}
    if "image_grid_thw" not in vision or "pixel_values" not in vision or "pixel_values" not in extents:
        return
    grids, pixels = extents.get("image_grid_thw"), extents["pixel_values"]
    if grids is None or len(grids) != len(rows):
        return
    g0, p0 = 0, 0
    for r, row in enumerate(rows):
        g1, p1 = g0 + grids[r], p0 + pixels[r]
        if grids[r] == len(row.images) and grids[r]:
            remember_images(
                cache,
                row.images,
                {
                    "image_grid_thw": vision["image_grid_thw"][g0:g1],
                    "pixel_values": vision["pixel_values"][p0:p1],
                },
            )
        g0, p0 = g1, p1


def _finish(row: _Row, r: int, on_response: Callable[[int, str], None] | None, turns: Any = None) -> None:
    if turns is not None:
        turns.drop(r)  # (its kept cache)
    if on_response is not None:
        on_response(r, row.info.turn_texts[-1] if row.info.turn_texts else "")


def _with_max_new_tokens(params: Any, n: int) -> Any:
    return dataclasses.replace(params, max_new_tokens=max(1, n))


def assemble(
    first: RolloutBatch,
    rows: list[_Row],
    processor: Any,
    pad_token_id: int,
    agent: AgentConfig,
    image_cache: dict | None = None,
) -> RolloutBatch:
    """The trajectories as one `RolloutBatch` (prompts as the first turn encoded them); images
    already in `image_cache` (`mmrl.rollout.hf.ImageCache`) are not processed again."""
    from mmrl.models.families import vision_layout
    from mmrl.rollout.hf import image_inputs

    N = len(rows)
    R = max(1, max(len(row.ids) for row in rows))
    device = first.prompt_ids.device
    response = torch.full((N, R), pad_token_id, dtype=torch.long)
    mask = torch.zeros((N, R), dtype=torch.long)
    observation = torch.zeros((N, R), dtype=torch.long)
    logprobs = torch.zeros((N, R), dtype=torch.float32)
    for r, row in enumerate(rows):
        n = len(row.ids)
        response[r, :n] = torch.tensor(row.ids, dtype=torch.long)
        model = torch.tensor(row.model, dtype=torch.long)
        mask[r, :n] = model
        observation[r, :n] = 1 - model
        logprobs[r, :n] = torch.tensor(row.logprobs, dtype=torch.float32)
        if agent.over_limit == "mask" and row.info.termination in LIMIT_ENDS:
            mask[r] = 0  # out of the loss; the observations stay attended, so positions hold
            logprobs[r] = 0.0
    images = [row.images for row in rows]
    vision = image_inputs(processor, images, image_cache, device if image_cache is not None else None)
    images_per_row = [len(x) for x in images]
    vision = {k: v.to(device) for k, v in vision.items()}
    # Inputs aligned with the prompt's tokens (Qwen-VL's `mm_token_type_ids`) stay the prompt's;
    # the trainer's forward derives the response's own from its ids.
    for key in first.vision_layout.per_token:
        if key in first.vision_inputs:
            vision[key] = first.vision_inputs[key]
    return RolloutBatch(
        samples=first.samples,
        prompt_ids=first.prompt_ids,
        prompt_mask=first.prompt_mask,
        response_ids=response.to(device),
        response_mask=mask.to(device),
        rollout_logprobs=logprobs.to(device),
        vision_inputs=vision,
        texts=[row.info.turn_texts[-1] if row.info.turn_texts else "" for row in rows],
        truncated=torch.tensor([row.truncated for row in rows], dtype=torch.bool, device=device),
        images_per_row=images_per_row,
        group_size=first.group_size,
        vision_layout=vision_layout(processor, vision, images_per_row),
        observation_mask=observation.to(device),
        trajectories=[row.info for row in rows],
    )


def _versions(rows: list[_Row], width: int) -> torch.Tensor:
    """[N, width] each token's sampling version (-1 on observations and padding)."""
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        if row.versions:
            out[r, : len(row.versions)] = torch.tensor(row.versions, dtype=torch.long)
    return out


# -- rewards and metrics ------------------------------------------------------------------------


def agent_reward(trajectory: Trajectory, accuracy: float, agent: AgentConfig) -> dict[str, float]:
    """What the trajectory's tools add to its verifier score, as named components: `tool_reward`
    (the tools' own rewards x `agent.tool_reward_weight`) or, with `agent.reward=deepeyes`,
    `tool_bonus` (DeepEyes: the bonus only when the answer is correct and a tool was called
    without error); for a trajectory in an environment also `env_return` (its return x
    `agent.env_reward_weight`). Their sum is added to the score."""
    env = {"env_return": agent.env_reward_weight * trajectory.env_return} if trajectory.env_id else {}
    if agent.reward == "deepeyes":
        clean_call = trajectory.tool_calls > sum(trajectory.tool_errors.values())
        return {"tool_bonus": agent.tool_bonus if accuracy > 0 and clean_call else 0.0, **env}
    return {"tool_reward": agent.tool_reward_weight * trajectory.tool_reward, **env}


def env_succeeded(trajectory: Trajectory) -> bool:
    """The environment ended the episode (terminated, not cut) with a positive return: MiniGrid
    rewards only reaching the goal."""
    return trajectory.termination == "env_done" and trajectory.env_return > 0


def shape_results(results: list, trajectories: list[Trajectory], agent: AgentConfig) -> list:
    """The verifier results with the tools' part added (`agent_reward`) as new objects (the
    router's own results are shared between calls and are not changed). A verifier error
    stays as it is: nothing is added to an error result. A trajectory in an environment whose
    verifier has no `accuracy` (the `env` verifier) gets its success (`env_succeeded`) as one."""
    out = []
    for result, trajectory in zip(results, trajectories):
        if result.error is not None:
            out.append(result)
            continue
        parts = agent_reward(trajectory, result.components.get("accuracy", result.score), agent)
        components = {**result.components, **parts}
        if trajectory.env_id and "accuracy" not in result.components:  # (`env`: success is the accuracy)
            components["accuracy"] = float(env_succeeded(trajectory))
        out.append(
            dataclasses.replace(result, score=result.score + sum(parts.values()), components=components)
        )
    return out


def trajectory_summary(trajectories: list[Trajectory]) -> dict[str, float]:
    """Turn and tool figures of a set of trajectories (the `agent/*` metrics of training and
    the `agent` block of `mmrl eval`): turns, tool calls and observation tokens per trajectory,
    tool error and time-out rates (per call), termination reasons (fractions) and the tool-call
    rate (trajectories with a call); when some acted in an environment, over those: its mean
    return, success (terminated with a positive return, as MiniGrid rewards reaching the goal),
    steps and invalid-action rate (per turn), and the environment's terminations."""
    n = max(1, len(trajectories))
    calls = sum(t.tool_calls for t in trajectories)
    errors: Counter = Counter()
    for t in trajectories:
        errors.update(t.tool_errors)
    out = {
        "turns": sum(t.turns for t in trajectories) / n,
        "tool_calls": calls / n,
        "tool_call_rate": sum(t.tool_calls > 0 for t in trajectories) / n,
        "observation_tokens": sum(t.observation_tokens for t in trajectories) / n,
        "tool_error_rate": sum(errors.values()) / calls if calls else 0.0,
        "tool_timeout_rate": errors.get("timeout", 0) / calls if calls else 0.0,
    }
    ends = Counter(t.termination for t in trajectories)
    for reason in ("answer",) + LIMIT_ENDS:
        out[f"end_{reason}"] = ends.get(reason, 0) / n
    in_env = [t for t in trajectories if t.env_id]
    if in_env:  # environment figures over the trajectories that acted in one
        m = len(in_env)
        steps = sum(t.env_steps for t in in_env)
        turns = sum(len(t.turn_rewards) for t in in_env)
        env_errors: Counter = Counter()
        for t in in_env:
            env_errors.update(t.env_errors)
        out["env_return"] = sum(t.env_return for t in in_env) / m
        out["env_success"] = sum(env_succeeded(t) for t in in_env) / m
        out["env_steps"] = steps / m
        out["env_bad_action_rate"] = env_errors.get("bad_action", 0) / turns if turns else 0.0
        for reason in ENV_ENDS:
            out[f"end_{reason}"] = ends.get(reason, 0) / n
    return out


def trajectory_metrics(batch: RolloutBatch, group_size: int) -> dict[str, float]:
    """`agent/` metrics of a multi-turn batch, overall and per data source
    (`trajectory_summary`), and the groups' lowest tool-call rate
    (`agent/group_tool_call_rate_min`: a collapse to zero shows here first)."""
    if batch.trajectories is None:
        return {}
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(batch.samples):
        by_source[s.data_source].append(i)
    out: dict[str, float] = {}
    for suffix, rows in [("", list(range(len(batch))))] + [
        (f"/{k}", v) for k, v in sorted(by_source.items())
    ]:
        summary = trajectory_summary([batch.trajectories[i] for i in rows])
        out.update({f"agent/{k}{suffix}": v for k, v in summary.items()})
    G = max(1, group_size)
    rates = [
        sum(t.tool_calls > 0 for t in batch.trajectories[g : g + G]) / len(batch.trajectories[g : g + G])
        for g in range(0, len(batch), G)
    ]
    out["agent/group_tool_call_rate_min"] = min(rates)
    return out


def row_drifts(batch: RolloutBatch, processor: Any) -> list[int]:
    """Per row, the tokens from the first difference to the end between the ids the model saw
    and the chat template re-applied to its final conversation (0: the same ids). Runs of
    image tokens count as one token on both sides (`mmrl.models.chat_templates.tokenization_drift`)."""
    from mmrl.models.chat_templates import tokenization_drift as drift_of
    from mmrl.rollout.hf import tools_argument

    tokenizer = getattr(processor, "tokenizer", processor)
    drifts = []
    for r, (sample, traj) in enumerate(zip(batch.samples, batch.trajectories or [])):
        prompt = batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist()
        response = batch.response_ids[r][batch.response_attention()[r].bool()].tolist()
        messages = sample.chat_messages() + traj.messages
        result = drift_of(
            tokenizer, prompt, response, messages, tools_argument(sample).get("tools"),
            stopped=not bool(batch.truncated[r]),
        )  # fmt: skip
        drifts.append(int(result["drift_tokens"]))
    return drifts


def tokenization_drift(batch: RolloutBatch, processor: Any) -> dict[str, float]:
    """`rollout.tokenization_check`: the chat template re-applied to each final conversation,
    tokenized, against the ids the model saw (`agent/tokenization_drift`: mean positions from
    the first difference to the end, `row_drifts`; `agent/tokenization_drift_rows`: the
    fraction of rows that differ at all). A model turn whose bytes are not valid UTF-8 decodes
    lossily and drifts too: that is what the check is for. A check only: training always uses
    the ids as generated."""
    if batch.trajectories is None:
        return {}
    start = time.perf_counter()
    drifts = row_drifts(batch, processor)
    return {
        "agent/tokenization_drift": sum(drifts) / len(drifts),
        "agent/tokenization_drift_rows": sum(d > 0 for d in drifts) / len(drifts),
        "time/tokenization_check_s": time.perf_counter() - start,
    }


# -- demonstrations -----------------------------------------------------------------------------


def demonstration_batch(
    processor: Any,
    samples: list[Sample],
    turns: list[list[str]],
    stop_token_id: int,
    pad_token_id: int,
    agent: AgentConfig | None = None,
) -> RolloutBatch:
    """Teacher-forced trajectories (a supervised cold start's batch): per sample the model turns
    to force, `turns[i]`. Each turn is tokenized alone with the stop token appended; the calls of
    every turn but the last really run, and their observations are appended as in a rollout, so
    the batch is laid out exactly as the loop would lay out the same turns. A sample that acts in
    an environment gets its own env instance, reset with its seed as in a rollout (the first
    observation in its prompt), and every turn but the last steps it with that turn's action
    (the demonstration must be valid: an env that ends early, or an invalid action, raises
    ValueError naming the sample). A one-turn row is a single-turn demonstration. Log-probs are 0."""
    from mmrl.environments import parse_tool_calls
    from mmrl.rollout.hf import encode_prompts, prompt_batch

    agent = agent or AgentConfig()
    sessions = open_sessions(samples, 1, agent)
    if sessions is not None:
        samples = sessions.samples
    inputs = encode_prompts(processor, samples)
    first = prompt_batch(samples, inputs, processor)
    limits = _limits(agent)
    rows = [_start_row(first, r, agent) for r in range(len(samples))]
    if sessions is not None:
        failed = sessions.attach(rows)
        if failed:
            row, error = failed[0]
            raise ValueError(f"sample {row.sample.id}: its environment's reset failed ({error})")
    tokenizer = processor.tokenizer
    depth = max(len(t) for t in turns)
    for k in range(depth):
        for row, texts in zip(rows, turns):
            if k < len(texts):
                ids = tokenizer(texts[k], add_special_tokens=False)["input_ids"] + [stop_token_id]
                row.add_turn(ids, [0.0] * len(ids), texts[k])
                row.info.turns = k + 1
        going = [r for r, texts in enumerate(turns) if k + 1 < len(texts)]
        tool_rows = [
            (r, parse_tool_calls(turns[r][k], agent.call_format)) for r in going if rows[r].session is None
        ]
        env_rows = [r for r in going if rows[r].session is not None]
        observed = dict(zip([r for r, _ in tool_rows], _run_tools(rows, tool_rows, limits)))
        for r, obs in zip(env_rows, _step_envs(rows, env_rows, agent)):
            if obs is None or rows[r].info.env_errors:
                raise ValueError(
                    f"sample {rows[r].sample.id}: demonstration turn {k + 1} ({turns[r][k]!r}) "
                    f"{'ended the episode early' if obs is None else 'is not a valid action'} "
                    f"({rows[r].info.termination if obs is None else obs[0].text})"
                )
            observed[r] = obs
        if going:  # every row's observation of this turn tokenized at once, as the loop does
            roles = ["tool" if rows[r].session is None else "user" for r in going]
            encoded = observation_batch(processor, [observed[r] for r in going], None, roles)
            for r, (ids, images, messages) in zip(going, encoded):
                rows[r].add_observation(ids, images, messages)
    env_rows = [r for r, row in enumerate(rows) if row.session is not None]
    for r, obs in zip(env_rows, _step_envs(rows, env_rows, agent)):  # (the last action: its reward)
        if obs is not None:
            rows[r].end("max_turns")
    for row in rows:
        if not row.done:
            row.end("answer")
    if sessions is not None:
        sessions.close()
    return assemble(first, rows, processor, pad_token_id, agent)


def _limits(agent: AgentConfig) -> Any:
    from mmrl.environments import ToolLimits

    return ToolLimits(
        timeout_s=agent.tool_timeout_s,
        max_text_chars=agent.max_tool_text_chars,
        max_calls_per_turn=agent.max_calls_per_turn,
    )
