"""veRL custom reward function backed by `mmrl serve`.

In a veRL config:

    custom_reward_function:
      path: /path/to/site-packages/mmrl/integrations/verl.py   # or a file that imports it
      name: compute_score          # or compute_score_batch with reward_model.reward_manager=batch

with `MMRL_REWARD_URL=http://host:port` (and `MMRL_REWARD_TOKEN` if the server has a token) in the
workers' environment. veRL passes only `reward_model.ground_truth`, so the verifier is chosen from,
in order: `extra_info["reward_model"]` (a dict with the sample's reward_model fields: `verifier`,
`verifier_params`, ratios), `extra_info["verifier"]` (+ `extra_info["verifier_params"]`), the
factory's `verifiers_by_source[data_source]`, and finally the default verifier
($MMRL_REWARD_VERIFIER, else `math`).

**The training step.** veRL's `compute_score` functions are not given the global step, so a
step-dependent verifier (the dynamic IoU threshold) would score every step as step 0. Two ways
to pass it: put `step` (and `total_steps`) in `extra_info`, or, better, use this module's reward
manager, which reads veRL's `global_steps` from the batch's `meta_info` (the PPO trainer sets it;
where a veRL version does not carry it to the reward batch, the manager counts its calls, one
per training step) and `total_steps` from the reward kwargs or $MMRL_REWARD_TOTAL_STEPS:

    reward_model:
      reward_manager:
        source: importlib
        name: MMRLRewardManager
        module: {path: /path/to/site-packages/mmrl/integrations/verl.py}
      reward_kwargs: {total_steps: 1000}

The score is the verifier's final reward (a float); `make_compute_score(return_dict=True)` returns
veRL's dict form `{"score", "accuracy", "format", "error"}` instead (the same keys for every
sample, so veRL can log them). A verifier error scores 0 and is logged; an unreachable server
raises `mmrl.server.client.RewardServiceError` after the client's retries.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mmrl.server.client import RewardClient

log = logging.getLogger(__name__)

VERIFIER_ENV = "MMRL_REWARD_VERIFIER"
"""Environment variable naming the default verifier (else `math`)."""
TOTAL_STEPS_ENV = "MMRL_REWARD_TOTAL_STEPS"
"""Environment variable with the run's total training steps (for `MMRLRewardManager`)."""

_default: Callable[..., Any] | None = None
_default_lock = threading.Lock()


def _plain(value: Any) -> Any:
    """numpy arrays and scalars (as veRL's non-tensor batch holds them) as Python values."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def sample_record(
    data_source: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None,
    default_verifier: str,
    verifiers_by_source: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The mmrl sample record for one veRL reward call (see the module docstring)."""
    extra = _plain(dict(extra_info or {}))
    reward = extra.get("reward_model")
    if isinstance(reward, Mapping):
        reward = dict(reward)
        reward.setdefault("ground_truth", _plain(ground_truth))
    else:
        verifier = extra.get("verifier") or (verifiers_by_source or {}).get(data_source) or default_verifier
        reward = {"ground_truth": _plain(ground_truth), "verifier": verifier}
        if extra.get("verifier_params") is not None:
            reward["verifier_params"] = extra["verifier_params"]
    sample_id = extra.get("id", extra.get("index"))
    record: dict[str, Any] = {"data_source": str(data_source or "verl"), "reward_model": reward}
    if sample_id is not None:
        record["extra_info"] = {"id": str(sample_id)}
    return record


def make_compute_score(
    url: str | None = None,
    token: str | None = None,
    *,
    client: RewardClient | None = None,
    verifier: str | None = None,
    verifiers_by_source: Mapping[str, str] | None = None,
    return_dict: bool = False,
    **client_options: Any,
) -> Callable[..., Any]:
    """A veRL `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw)`
    scoring on the server at `url` (default $MMRL_REWARD_URL). `client_options` go to
    `RewardClient` (timeout_s, retries, ...)."""
    client = client or RewardClient(url, token, **client_options)
    default_verifier = verifier or os.environ.get(VERIFIER_ENV) or "math"

    def compute_score(
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: Mapping[str, Any] | None = None,
        **kw,
    ) -> float | dict[str, Any]:
        record = sample_record(data_source, ground_truth, extra_info, default_verifier, verifiers_by_source)
        (result,) = client.score_records([record], [solution_str], _context(extra_info))
        return _output(result, record, return_dict)

    def compute_score_batch(
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
        **kw,
    ) -> list[float | dict[str, Any]]:
        extras = list(extra_infos) if extra_infos is not None else [None] * len(solution_strs)
        records = [
            sample_record(ds, gt, ex, default_verifier, verifiers_by_source)
            for ds, gt, ex in zip(data_sources, ground_truths, extras)
        ]
        context = _context(extras[0] if extras else None)
        results = client.score_records(records, list(solution_strs), context)
        return [_output(r, rec, return_dict) for r, rec in zip(results, records)]

    compute_score.batch = compute_score_batch  # type: ignore[attr-defined]
    compute_score.client = client  # type: ignore[attr-defined]
    return compute_score


def _context(extra_info: Mapping[str, Any] | None):
    from mmrl.types import VerifyContext

    if not extra_info or "step" not in extra_info:
        return None
    return VerifyContext(step=int(extra_info["step"]), total_steps=int(extra_info.get("total_steps", 1) or 1))


class MMRLRewardManager:
    """A veRL reward manager (`reward_manager.source: importlib`) scoring on `mmrl serve` with
    the training step: `data.meta_info["global_steps"]` (else its own call count) over
    `total_steps`. Decodes each response up to its attention mask like veRL's naive manager and
    puts the score on the last response token."""

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int = 0,
        compute_score: Any = None,
        reward_fn_key: str = "data_source",
        *,
        total_steps: int | None = None,
        url: str | None = None,
        token: str | None = None,
        verifier: str | None = None,
        verifiers_by_source: Mapping[str, str] | None = None,
        client: RewardClient | None = None,
        **client_options: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.reward_fn_key = reward_fn_key
        self.total_steps = int(total_steps or os.environ.get(TOTAL_STEPS_ENV) or 0)
        self.client = client or RewardClient(url, token, **client_options)
        self.default_verifier = verifier or os.environ.get(VERIFIER_ENV) or "math"
        self.verifiers_by_source = verifiers_by_source
        self.calls = 0

    def step_context(self, meta_info: Mapping[str, Any] | None):
        from mmrl.types import VerifyContext

        step = (meta_info or {}).get("global_steps")
        step = self.calls if step is None else int(step)
        self.calls += 1
        return VerifyContext(step=step, total_steps=max(self.total_steps, step, 1))

    def __call__(self, data: Any, return_dict: bool = False) -> Any:
        import torch

        if "rm_scores" in data.batch.keys():
            return {"reward_tensor": data.batch["rm_scores"]} if return_dict else data.batch["rm_scores"]
        context = self.step_context(getattr(data, "meta_info", None))
        prompt_length = data.batch["prompts"].shape[-1]
        lengths = data.batch["attention_mask"][:, prompt_length:].sum(dim=-1).tolist()
        responses = data.batch["responses"]
        texts = [
            self.tokenizer.decode(responses[i][: int(n)], skip_special_tokens=True)
            for i, n in enumerate(lengths)
        ]
        nt = data.non_tensor_batch
        extras = nt.get("extra_info", [None] * len(texts))
        records = [
            sample_record(
                nt[self.reward_fn_key][i],
                nt["reward_model"][i]["ground_truth"],
                extras[i],
                self.default_verifier,
                self.verifiers_by_source,
            )
            for i in range(len(texts))
        ]
        results = self.client.score_records(records, texts, context)
        rewards = torch.zeros_like(responses, dtype=torch.float32)
        for i, (n, result) in enumerate(zip(lengths, results)):
            if int(n) > 0:
                rewards[i, int(n) - 1] = float(result["score"])
        outputs = [_output(r, rec, True) for r, rec in zip(results, records)]
        if not return_dict:
            return rewards
        extra = {key: [o[key] for o in outputs] for key in ("accuracy", "format", "error")}
        return {"reward_tensor": rewards, "reward_extra_info": extra}


def _output(result: dict[str, Any], record: dict[str, Any], return_dict: bool) -> float | dict[str, Any]:
    if result.get("error"):
        log.warning(
            "verifier %s failed on %s: %s",
            record["reward_model"].get("verifier"),
            record.get("extra_info", {}).get("id", record["data_source"]),
            result["error"],
        )
    score = float(result["score"])
    if not return_dict:
        return score
    components = result.get("components") or {}
    return {
        "score": score,
        "accuracy": float(components.get("accuracy", 0.0)),
        "format": float(components.get("format", 0.0)),
        "error": 0.0 if result.get("error") is None else 1.0,
    }


def _default_compute_score() -> Callable[..., Any]:
    global _default
    with _default_lock:
        if _default is None:
            _default = make_compute_score()
        return _default


def reset_default_client() -> None:
    """Forget the client made from the environment (the next call reads it again)."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.client.close()  # type: ignore[attr-defined]
        _default = None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """veRL's reward-function signature, scoring on the server at $MMRL_REWARD_URL."""
    return _default_compute_score()(data_source, solution_str, ground_truth, extra_info)


def compute_score_batch(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    **kwargs: Any,
) -> list[float]:
    """veRL's batched reward function (`reward_model.reward_manager=batch`): one request per call."""
    return _default_compute_score().batch(data_sources, solution_strs, ground_truths, extra_infos)  # type: ignore[attr-defined]
