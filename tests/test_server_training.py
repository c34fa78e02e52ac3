"""mmrl's own trainer scoring on a remote reward server (`reward.remote_url`)."""

from __future__ import annotations

import json

import pytest

from mmrl.config import load_config
from mmrl.server.config import ServeConfig
from mmrl.server.process import start_server_process
from mmrl.train.grpo import train

pytestmark = pytest.mark.slow


def test_training_with_a_remote_reward_server_matches_local_scoring(mmrl_cache, tmp_path, monkeypatch):
    common = [
        "trainer.total_steps=2",
        "trainer.prompts_per_step=4",
        "rollout.group_size=2",
        "trainer.eval_size=8",
        "trainer.progress=false",
        "trainer.save_final=false",
    ]
    local = train(
        load_config("vision_reasoning", overrides=[*common, f"trainer.run_dir={tmp_path / 'local'}"])
    )
    with start_server_process(ServeConfig(port=0, workers=1, token="s3cret")) as server:
        monkeypatch.setenv("MMRL_REWARD_TOKEN", "s3cret")
        cfg = load_config(
            "vision_reasoning",
            overrides=[*common, f"reward.remote_url={server.url}", f"trainer.run_dir={tmp_path / 'remote'}"],
        )
        remote = train(cfg)

    def rows(run):
        out = []
        for line in (run.run_dir / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            out.append({k: v for k, v in record.items() if not k.startswith(("time/", "throughput/"))})
        return out

    # Same seed, same weights: the remote verifier gives every reward the local one gave.
    assert rows(remote) == rows(local)
    assert remote.final_accuracy == local.final_accuracy
