"""Asynchronous reward routing vs scoring after generation, side by side.

    python benchmarks/async_rewards.py [--steps N] [--rounds R] [--kind sleep|cpu] [--workers W]

The default recipe's GRPO step on the built-in task, with a verifier made as costly as
generation (`benchmarks/slow_verifier.py`): the cost per response is set so that scoring a
step's responses one after another takes about as long as generating them. Three runs from the
same weights and seed: with a free verifier (generation + update alone), with rewards computed
after generation (`reward.overlap=false`), with each response scored the moment it is
generated (`reward.overlap=true`), and asynchronous RL one step ahead (`trainer.mode=async`).
The goal: the asynchronous (on-policy) step within 1.15x of generation + update alone.

A shared machine drifts over a minute, so the four runs are repeated in `--rounds` rounds (the
order rotated each round) and each ratio is taken within its round, against that round's
baseline; the medians over rounds are reported, with every round's ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # slow_verifier, also in workers

from mmrl.compose import composition
from mmrl.config import load_config  # noqa: E402
from mmrl.models.base import builtin_base  # noqa: E402
from mmrl.models.loading import load_policy  # noqa: E402
from mmrl.train.data import PromptSampler, load_data
from mmrl.train.grpo import seed_everything  # noqa: E402
from mmrl.types import VerifyContext  # noqa: E402


def run(cfg, policy, state, samples, steps: int) -> dict[str, float]:
    """`steps` timed steps after one untimed warm-up step, as `mmrl.train.grpo.train` runs them
    (the composition of `trainer.mode`); medians of the step timings."""
    policy.model.load_state_dict(state)
    seed_everything(cfg.trainer.seed)
    compose = composition(cfg)
    t = compose.make_trainee(cfg, policy, None)
    t.router.warm_up()
    sampler = PromptSampler(samples, cfg.trainer.seed)
    rows = []
    try:
        for step in range(1, steps + 2):
            m = compose.step(cfg, t, sampler, VerifyContext(step - 1, steps + 1), step=step)
            if step > 1:  # the first step is an untimed warm-up
                rows.append(m)
    finally:
        t.close()
    return {
        k: statistics.median(r[k] for r in rows)
        for k in ("time/step_s", "time/rollout_s", "time/reward_wait_s", "time/prep_s", "time/update_s")
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kind", choices=["sleep", "cpu"], default="sleep")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=3, help="repeats of the four runs (ratios within a round)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = parser.parse_args()
    base = [
        f"reward.num_workers={args.workers}",
        "reward.plugins=[slow_verifier]",
        f"trainer.total_steps={args.steps + 1}",
        *args.overrides,
    ]
    cfg = load_config("vision_reasoning", overrides=base)
    samples, _ = load_data(cfg)
    policy = load_policy(builtin_base(cfg))
    state = copy.deepcopy(policy.model.state_dict())

    def with_cost(cost_ms: float):
        out = []
        for s in samples:
            s = copy.copy(s)
            s.reward_model = copy.copy(s.reward_model)
            s.reward_model.verifier = "slow_math"
            s.reward_model.verifier_params = {"cost_ms": cost_ms, "cost_kind": args.kind}
            out.append(s)
        return out

    # The verifier's cost is set once, from a first run with a free verifier.
    probe = run(cfg, policy, state, with_cost(0.0), args.steps)
    n_rows = cfg.trainer.prompts_per_step * cfg.rollout.group_size
    cost_ms = 1000 * probe["time/rollout_s"] / n_rows * args.workers  # pool time ~ generation time
    costly = with_cost(cost_ms)
    # Asynchronous RL (trainer.mode=async, one step ahead): generation and scoring of step k+1
    # overlap the update of step k, so the verifier's cost also hides behind the update.
    ahead = [*base, "reward.overlap=true", "trainer.mode=async", "trainer.max_staleness=1", "algo.tis=token"]
    modes = {
        "alone": (cfg, with_cost(0.0)),
        "rewards after generation": (
            load_config("vision_reasoning", overrides=[*base, "reward.overlap=false"]),
            costly,
        ),
        "rewards during generation": (
            load_config("vision_reasoning", overrides=[*base, "reward.overlap=true"]),
            costly,
        ),
        "+ async RL, 1 step ahead": (load_config("vision_reasoning", overrides=ahead), costly),
    }
    names = list(modes)
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        timings = {}
        for name in order:
            mode_cfg, mode_samples = modes[name]
            timings[name] = run(mode_cfg, policy, state, mode_samples, args.steps)
        rounds.append(timings)

    def median(name: str, key: str) -> float:
        return statistics.median(rnd[name][key] for rnd in rounds)

    print(
        f"async reward routing: {args.rounds} rounds of {args.steps} steps per mode, {n_rows} responses per step, "
        f"{args.workers} verifier workers,"
    )
    print(
        f"verifier cost {cost_ms:.1f} ms per response ({args.kind}); serial scoring of a step's responses = "
        f"{cost_ms * n_rows / 1000:.2f} s vs generation {probe['time/rollout_s']:.2f} s (medians)"
    )
    print(
        f"  generation + update alone    {median('alone', 'time/step_s'):6.3f} s  (medians over rounds; "
        f"rollout {median('alone', 'time/rollout_s'):.3f}, "
        f"update {median('alone', 'time/prep_s') + median('alone', 'time/update_s'):.3f})"
    )
    for name in names[1:]:
        ratios = [rnd[name]["time/step_s"] / rnd["alone"]["time/step_s"] for rnd in rounds]
        print(
            f"  {name:<28} {median(name, 'time/step_s'):6.3f} s  (= {statistics.median(ratios):4.2f}x; rounds "
            f"{', '.join(f'{x:.2f}' for x in ratios)}; rollout {median(name, 'time/rollout_s'):.3f}, "
            f"reward wait {median(name, 'time/reward_wait_s'):.3f}, "
            f"update {median(name, 'time/prep_s') + median(name, 'time/update_s'):.3f})"
        )


if __name__ == "__main__":
    main()
