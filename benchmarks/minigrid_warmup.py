"""Can the tiny model's cold start act from what it sees in `minigrid`? The built-in base's
supervised warm-up on the expert's episodes, with the task's pictures or with the same rooms as
text, side by side, then greedy validation success, beside the random policy's.

    python benchmarks/minigrid_warmup.py [--steps 400] [--episodes 64] [--observe pixels text]

- `pixels`: the task as it is (`minigrid-goal`'s picture: the room centred on the agent, turned
  so that it faces up, no text);
- `text`: the same rooms, the observation the goal's place as text ("goal 1 ahead -2 right") and
  no picture: the same loop, demonstrations, warm-up and evaluation; only what the model reads
  differs.

Both arms warm up from the same random tiny model with the recipe's settings (`configs/minigrid.yaml`)
for `--steps` steps, then act greedily on `--episodes` validation rooms (never warmed up on).
Printed: success with its 95% interval, and how many distinct first actions the policy takes
over the rooms (1: the same opening whatever the room, an open-loop policy that does not look).
"""

from __future__ import annotations

import argparse
import time

from mmrl.config import load_config
from mmrl.datasets.minigrid import random_policy_success
from mmrl.datasets.procedural import make_samples
from mmrl.environments import Observation, register_env
from mmrl.environments.grid_goal import goal_observation, make_goal_env
from mmrl.models.base import warm_up
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.rollout.multiturn import env_succeeded, generate_trajectories
from mmrl.stats import mean_interval


def text_observation(env, obs, info) -> Observation:
    """The goal's place relative to the agent as text: cells ahead and to the right."""
    base = env.unwrapped
    ax, ay = (int(v) for v in base.agent_pos)
    gx, gy = next(
        (x, y)
        for x in range(base.grid.width)
        for y in range(base.grid.height)
        if (cell := base.grid.get(x, y)) is not None and cell.type == "goal"
    )
    fx, fy = [(1, 0), (0, 1), (-1, 0), (0, -1)][int(base.agent_dir)]
    ahead = (gx - ax) * fx + (gy - ay) * fy
    right = (gx - ax) * -fy + (gy - ay) * fx
    return Observation(text=f"goal {ahead} ahead {right} right", images=[])


def arm(observe: str, steps: int, episodes: int) -> dict:
    register_env(
        "minigrid-goal",
        make_goal_env,
        observation=goal_observation if observe == "pixels" else text_observation,
        replace=True,
    )
    overrides = [
        f"model.warmup.max_steps={steps}",
        f"model.warmup.eval_every={steps}",
        "model.warmup.target_accuracy=1.01",  # (never stops early: every arm gets its steps)
        "model.warmup.eval_size=8",
        "trainer.progress=false",
        "reward.num_workers=0",
    ]
    cfg = load_config("minigrid", overrides=overrides)
    start = time.monotonic()
    policy, _ = warm_up(cfg)
    seconds = time.monotonic() - start
    rooms = make_samples(["minigrid"], episodes, "validation")
    engine = HFRolloutEngine.from_policy(policy)
    params = SamplingParams(n=1, greedy=True, max_new_tokens=cfg.rollout.max_new_tokens)
    batch = generate_trajectories(engine, rooms, params, cfg.agent)
    wins = [float(env_succeeded(t)) for t in batch.trajectories]
    low, high = mean_interval(wins)
    return {
        "success": sum(wins) / len(wins),
        "low": low,
        "high": high,
        "openings": len({t.turn_texts[0] for t in batch.trajectories}),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--observe", nargs="+", default=["pixels", "text"], choices=["pixels", "text"])
    args = parser.parse_args()
    seeds = [s.agent.env.seed for s in make_samples(["minigrid"], args.episodes, "validation")]
    wins, n = random_policy_success(seeds)
    print(f"random policy: {wins / n:.3f} success over {n} validation rooms")
    for observe in args.observe:
        r = arm(observe, args.steps, args.episodes)
        print(
            f"{observe:>6}: {r['success']:.3f} [{r['low']:.3f}-{r['high']:.3f}] success over {args.episodes} "
            f"validation rooms after {args.steps} warm-up steps ({r['seconds']:.0f} s); "
            f"{r['openings']} distinct first actions"
        )


if __name__ == "__main__":
    main()
