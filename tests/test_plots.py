"""The VLM training-curve PNG: each panel named for what it holds, whole-number step ticks."""

from __future__ import annotations

from mmrl.train.plots import training_curves_figure


def _records(steps: int, with_reference: bool) -> list[dict]:
    records = [{"step": 0, "eval/accuracy": 0.4}]
    for step in range(1, steps + 1):
        record = {"step": step, "reward/mean": 0.1 * step, "actor/ppo_kl": 1e-3, "rollout/kl_k3": 2e-4}
        if with_reference:
            record["actor/ref_kl"] = 5e-3 * step
        records.append(record)
    return records


def test_the_kl_curves_have_their_own_named_panels_and_unlogged_ones_are_left_out():
    import matplotlib.pyplot as plt

    fig = training_curves_figure(_records(3, with_reference=False))
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    plt.close(fig)
    assert titles == [
        "train reward",
        "held-out accuracy (greedy)",
        "policy change per update (actor/ppo_kl)",
        "rollout vs trainer log-probs (rollout/kl_k3)",
    ]
    fig = training_curves_figure(_records(3, with_reference=True))
    by_title = {ax.get_title(): ax for ax in fig.axes}
    (line,) = by_title["KL to the reference (actor/ref_kl)"].get_lines()  # one curve: not mixed with ppo_kl
    assert list(line.get_ydata()) == [0.005, 0.01, 0.015]
    plt.close(fig)


def test_a_short_run_gets_whole_step_ticks():
    import matplotlib.pyplot as plt

    fig = training_curves_figure(_records(2, with_reference=False))
    fig.canvas.draw()
    for ax in fig.axes:
        if ax.get_title():
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    plt.close(fig)
