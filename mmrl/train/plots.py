"""The training-curve PNG of a run: reward, held-out accuracy, length, entropy, KL, and the
reward of every data source."""

from __future__ import annotations

from pathlib import Path

from mmrl.train.metrics_log import read_metrics

PANELS = [
    ("train reward", ["reward/mean"]),
    ("held-out accuracy (greedy)", ["eval/accuracy"]),
    ("response length (tokens)", ["response/length_mean"]),
    ("entropy (nats/token)", ["actor/entropy"]),
    ("KL", ["actor/ppo_kl", "actor/ref_kl", "rollout/kl_k3"]),
]


def data_sources(records: list[dict]) -> list[str]:
    """Data sources that have per-source reward curves."""
    return sorted(
        {k.removeprefix("reward/mean/") for r in records for k in r if k.startswith("reward/mean/")}
    )


def plot_training_curves(metrics_path: Path, out_path: Path) -> Path:
    """One panel per curve group from `metrics.jsonl`, plus one per data source (train reward
    and, dashed, greedy held-out accuracy of that source)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    sources = data_sources(records)
    if len(sources) < 2:  # one source: its panel would repeat the overall curves
        sources = []
    n = len(PANELS) + len(sources)
    cols = min(n, 5)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    panels = PANELS + [(f"source: {s}", [f"reward/mean/{s}"]) for s in sources]
    for ax, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            _line(
                ax,
                records,
                key,
                "train reward" if key.startswith("reward/mean/") else key.split("/")[-1],
                "-",
            )
        if title.startswith("source: "):
            _line(ax, records, f"eval/accuracy/{title.removeprefix('source: ')}", "held-out accuracy", "--")
            ax.set_ylim(-0.02, 1.02)
        if title.startswith("held-out"):
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(ax.get_lines()) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def _line(ax, records: list[dict], key: str, label: str, style: str) -> None:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, style, label=label, marker="o" if len(points) < 20 else None, markersize=3)
