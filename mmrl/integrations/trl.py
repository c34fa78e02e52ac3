"""A TRL reward function backed by `mmrl serve` (TRL itself is not imported).

    from mmrl.integrations.trl import make_reward_function
    trainer = GRPOTrainer(..., reward_funcs=[make_reward_function("http://127.0.0.1:8000")])

TRL calls `reward_func(prompts=..., completions=..., **columns)`, where each extra dataset column
arrives as a list with one value per completion. The sample each completion answers comes from:

- a `reward_model` column (mmrl / V-Triune format: `{"ground_truth", "verifier",
  "verifier_params", "accuracy_ratio", "format_ratio"}`, or its JSON), plus `data_source` and
  `extra_info` columns when present; else
- the `ground_truth_key` column (default: the first of `ground_truth`, `solution`, `answer`)
  scored by `verifier`.

A dataset's struct columns (Arrow) give every row every key, a missing one as None: None
entries of `reward_model` and its `verifier_params` are dropped before sending.

Completions may be plain strings or conversations (the last message's text is scored). The
training step comes from the `trainer_state` TRL passes (its `global_step` and `max_steps`), so
step-dependent verifiers (the dynamic IoU threshold) advance with training. One request per
call; identical samples are sent once. A verifier error scores 0 and is logged; an
unreachable server raises `mmrl.server.client.RewardServiceError` after the client's retries.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from mmrl.server.client import RewardClient

log = logging.getLogger(__name__)

GROUND_TRUTH_KEYS = ("ground_truth", "solution", "answer")


def completion_text(completion: Any) -> str:
    """The text of a TRL completion: a string, or a list of chat messages (the last one's text)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, list) and completion:
        content = completion[-1].get("content", "") if isinstance(completion[-1], dict) else completion[-1]
        if isinstance(content, list):
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return str(content)
    raise TypeError(
        f"a completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )


def make_reward_function(
    url: str | None = None,
    token: str | None = None,
    *,
    client: RewardClient | None = None,
    verifier: str = "math",
    ground_truth_key: str | None = None,
    name: str = "mmrl_reward",
    **client_options: Any,
) -> Callable[..., list[float]]:
    """A TRL reward function `(prompts, completions, **kwargs) -> list[float]` scoring on the
    server at `url` (default $MMRL_REWARD_URL). `name` becomes its `__name__` (TRL logs rewards
    under it); `client_options` go to `RewardClient`."""
    client = client or RewardClient(url, token, **client_options)

    def reward(
        prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (), **kwargs: Any
    ) -> list[float]:
        texts = [completion_text(c) for c in completions]
        records = [_record(kwargs, i, verifier, ground_truth_key) for i in range(len(texts))]
        keys: dict[str, int] = {}
        unique: list[dict] = []
        index = []
        for record in records:
            key = json.dumps(record, sort_keys=True, default=str)
            if key not in keys:
                keys[key] = len(unique)
                unique.append(record)
            index.append(keys[key])
        context = trainer_context(kwargs.get("trainer_state"))
        results = client.score_records(unique, texts, context, sample_index=index) if texts else []
        failed = [r["error"] for r in results if r.get("error")]
        if failed:
            log.warning(
                "%d of %d completions had verifier errors (scored 0), e.g. %s",
                len(failed),
                len(texts),
                failed[0],
            )
        return [float(r["score"]) for r in results]

    reward.__name__ = name
    reward.__qualname__ = name
    reward.client = client  # type: ignore[attr-defined]
    return reward


def trainer_context(state: Any):
    """The verify context of a transformers `TrainerState` (None when TRL passed none)."""
    from mmrl.types import VerifyContext

    if state is None or getattr(state, "global_step", None) is None:
        return None
    total = int(getattr(state, "max_steps", 0) or 0)
    return VerifyContext(step=int(state.global_step), total_steps=max(total, int(state.global_step), 1))


def _without_nulls(reward: dict[str, Any]) -> dict[str, Any]:
    """A `reward_model` with the None entries of Arrow struct columns dropped: a struct column
    has every key any row has, so a key a row lacks comes as None (`{"options": None,
    "partial": True}`), which the verifiers would take for a parameter given as null. Dropped
    at the top level and inside `verifier_params` (nested objects too); the ground truth is
    kept as it is."""
    out = {k: v for k, v in reward.items() if v is not None}
    for key in ("verifier_params", "verifier_parm"):
        if isinstance(out.get(key), dict):
            out[key] = _drop_none(out[key])
    return out


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _record(columns: dict[str, Any], i: int, verifier: str, ground_truth_key: str | None) -> dict[str, Any]:
    def column(name: str) -> Any:
        values = columns.get(name)
        return None if values is None else values[i]

    record: dict[str, Any] = {}
    data_source = column("data_source")
    if data_source is not None:
        record["data_source"] = str(data_source)
    extra = column("extra_info")
    if isinstance(extra, dict) and extra.get("id") is not None:
        record["extra_info"] = {"id": str(extra["id"])}
    reward = column("reward_model")
    if reward is not None:
        reward = json.loads(reward) if isinstance(reward, str) else reward
        if isinstance(reward, dict):
            reward = _without_nulls(reward)
        record["reward_model"] = reward
        return record
    keys = [ground_truth_key] if ground_truth_key else [k for k in GROUND_TRUTH_KEYS if k in columns]
    if not keys or keys[0] not in columns:
        wanted = ground_truth_key or " / ".join(GROUND_TRUTH_KEYS)
        raise KeyError(
            f"the reward function needs a 'reward_model' or a '{wanted}' dataset column; TRL passed: "
            f"{sorted(columns)}"
        )
    record["reward_model"] = {"ground_truth": column(keys[0]), "verifier": verifier}
    return record
