"""Step dumps: everything one step computed, per response, for debugging after the fact.

`<run_dir>/dumps/step_<n>.jsonl`, one line per response: sample id, data source, the prompt
messages, the response text and token ids, rollout / recomputed ("old") / reference log-probs
per token, the reward, every reward component, the verifier error, the advantage, and whether
the response hit the length limit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmrl.router import RewardBatch
from mmrl.types import RolloutBatch


def write_step_dump(
    run_dir: Path,
    step: int,
    batch: RolloutBatch,
    rewards: RewardBatch,
    scores: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
) -> Path:
    path = Path(run_dir) / "dumps" / f"step_{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i, sample in enumerate(batch.samples):
            n = int(batch.response_mask[i].sum())
            result = rewards.results[i]
            row = {
                "step": step,
                "row": i,
                "id": sample.id,
                "data_source": sample.data_source,
                "prompt": sample.prompt,
                "response": batch.texts[i],
                "response_ids": batch.response_ids[i, :n].tolist(),
                "rollout_logprobs": batch.rollout_logprobs[i, :n].tolist(),
                "old_logprobs": old_logprobs[i, :n].tolist(),
                "ref_logprobs": None if ref_logprobs is None else ref_logprobs[i, :n].tolist(),
                # asynchronous mode: the policy version that sampled each token
                "versions": None if batch.token_versions is None else batch.token_versions[i, :n].tolist(),
                "verifier_score": result.score,
                "reward": float(scores[i]),
                "components": result.components,
                "error": result.error,
                "extracted": result.extracted,
                "advantage": float(advantages[i]),
                "truncated": bool(batch.truncated[i]),
            }
            f.write(json.dumps(row) + "\n")
    return path
