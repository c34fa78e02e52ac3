"""The training-curve PNG of a run: reward, held-out accuracy, length, entropy, KL."""

from __future__ import annotations

from pathlib import Path

from mmrl.train.metrics_log import read_metrics

PANELS = [
    ("train reward", ["reward/mean"]),
    ("held-out accuracy (greedy)", ["eval/accuracy"]),
    ("response length (tokens)", ["response/length_mean"]),
    ("entropy (nats/token)", ["actor/entropy"]),
    ("KL", ["actor/ppo_kl", "actor/ref_kl"]),
]


def plot_training_curves(metrics_path: Path, out_path: Path) -> Path:
    """Draw one panel per curve group from `metrics.jsonl`; per-source eval curves are dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (title, keys) in zip(axes, PANELS):
        for key in keys:
            _line(ax, records, key, key.split("/")[-1], "-")
        if title.startswith("held-out"):
            sources = sorted({k for r in records for k in r if k.startswith("eval/accuracy/")})
            for key in sources:
                _line(ax, records, key, key.removeprefix("eval/accuracy/"), "--")
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(ax.get_lines()) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def _line(ax, records: list[dict], key: str, label: str, style: str) -> None:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, style, label=label, marker="o" if len(points) < 20 else None, markersize=3)
