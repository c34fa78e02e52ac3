"""Curves that compare runs: ScaleRL's saturating fit of reward vs compute, and pass@k.

**ScaleRL** (Khatri et al., 2025) models held-out reward against training compute C as

    R(C) = R_0 + (A - R_0) / (1 + (C_mid / C)^B)

A is the asymptote (the predicted ceiling), C_mid the compute at which half of the gain A - R_0
is reached, B the slope (how sharply it gets there). With R_0 = 0 this is y = A / (1 + (C_mid/C)^B).
Runs are compared by A and B, not only by where they stopped. The fit is least squares with
scipy's `curve_fit` when scipy is installed, else a numpy grid search over (C_mid, B), A solved
in closed form per grid point, refined by Levenberg-Marquardt.

**pass@k** with Chen et al. (2021)'s unbiased estimator over n samples of which c are correct,
1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i) (no huge binomials). A
checkpoint's curve k = 1..K against its base's shows whether RL widened what the model can
solve (the curves stay apart at large k) or only sharpened it (they meet).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.eval.config import CurveConfig, EvalConfig

# --------------------------------------------------------------------------- ScaleRL fit

_B_RANGE = (1e-2, 50.0)


def saturating_curve(c: Any, A: float, c_mid: float, B: float, r0: float = 0.0) -> np.ndarray:
    """R_0 + (A - R_0) / (1 + (C_mid / C)^B), for C > 0 (computed as a logistic in log C)."""
    c = np.asarray(c, dtype=float)
    z = B * (np.log(c) - math.log(c_mid))
    return r0 + (A - r0) / (1.0 + np.exp(-z))


def _sig(logc: np.ndarray, log_cmid: float, B: float) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(B * (logc - log_cmid), -500, 500)))


def _grid_start(logc, y, r0, a_lo, a_hi):
    """Best (A, log C_mid, B) on a grid; A is linear given the others: closed-form least squares."""
    lo, hi = logc.min(), logc.max()
    span = max(hi - lo, 1.0)
    log_cmids = np.linspace(lo - span, hi + 2 * span, 121)
    Bs = np.geomspace(0.05, 20.0, 81)
    s = 1.0 / (
        1.0
        + np.exp(-np.clip(Bs[None, :, None] * (logc[None, None, :] - log_cmids[:, None, None]), -500, 500))
    )
    num = (s * (y - r0)).sum(-1)
    den = (s * s).sum(-1)
    gain = np.clip(num / np.maximum(den, 1e-300), a_lo - r0, a_hi - r0)
    sse = (((r0 + gain[..., None] * s) - y) ** 2).sum(-1)
    i, j = np.unravel_index(np.argmin(sse), sse.shape)
    return float(r0 + gain[i, j]), float(log_cmids[i]), float(Bs[j])


def _lm_refine(logc, y, r0, theta, a_lo, a_hi, iters: int = 200):
    """Levenberg-Marquardt on (A, log C_mid, log B) with the analytic Jacobian."""

    def residual(t):
        return r0 + (t[0] - r0) * _sig(logc, t[1], math.exp(t[2])) - y

    t = np.array([theta[0], theta[1], math.log(theta[2])], dtype=float)
    r = residual(t)
    sse, lam = float(r @ r), 1e-3
    for _ in range(iters):
        B = math.exp(t[2])
        s = _sig(logc, t[1], B)
        z = B * (logc - t[1])
        ds = s * (1 - s)
        J = np.stack([s, (t[0] - r0) * ds * (-B), (t[0] - r0) * ds * z], axis=1)
        g = J.T @ r
        H = J.T @ J
        improved = False
        for _ in range(10):
            step = np.linalg.solve(H + lam * np.diag(np.diag(H) + 1e-12), -g)
            cand = t + step
            cand[0] = min(max(cand[0], a_lo), a_hi)
            cand[2] = min(max(cand[2], math.log(_B_RANGE[0])), math.log(_B_RANGE[1]))
            rc = residual(cand)
            if float(rc @ rc) < sse:
                t, r, sse, lam, improved = cand, rc, float(rc @ rc), lam / 3, True
                break
            lam *= 3
        if not improved or np.abs(step).max() < 1e-10:
            break
    return float(t[0]), float(t[1]), float(math.exp(t[2]))


def fit_saturating_curve(
    compute: Sequence[float], values: Sequence[float], r0: float = 0.0, a_max: float | None = 1.0
) -> dict[str, Any]:
    """Fit A, C_mid, B of `saturating_curve` to points with compute > 0 (at least 3).

    Returns `{"A", "C_mid", "B", "r0", "rmse", "n_points", "method"}`; A is kept in
    [min(r0, min(values)), a_max].
    """
    c = np.asarray(compute, dtype=float)
    y = np.asarray(values, dtype=float)
    keep = np.isfinite(c) & np.isfinite(y) & (c > 0)
    c, y = c[keep], y[keep]
    if len(c) < 3:
        raise ValueError(f"need at least 3 points with compute > 0 to fit A, C_mid and B, got {len(c)}")
    logc = np.log(c)
    a_lo = min(r0, float(y.min()))
    a_hi = float("inf") if a_max is None else max(a_max, a_lo)
    A, log_cmid, B = _grid_start(logc, y, r0, a_lo, a_hi)
    method = "numpy"
    try:
        from scipy.optimize import curve_fit
    except ImportError:
        A, log_cmid, B = _lm_refine(logc, y, r0, (A, log_cmid, B), a_lo, a_hi)
    else:

        def f(lc, a, lcm, lb):
            return r0 + (a - r0) * _sig(lc, lcm, math.exp(lb))

        eps = 1e-9
        p0 = [min(max(A, a_lo + eps), a_hi - eps) if math.isfinite(a_hi) else A, log_cmid, math.log(B)]
        bounds = ([a_lo, -np.inf, math.log(_B_RANGE[0])], [a_hi, np.inf, math.log(_B_RANGE[1])])
        try:
            (A, log_cmid, lb), _ = curve_fit(f, logc, y, p0=p0, bounds=bounds, maxfev=20000)
            B, method = math.exp(lb), "scipy"
        except (RuntimeError, ValueError):
            A, log_cmid, B = _lm_refine(logc, y, r0, (A, log_cmid, B), a_lo, a_hi)
    pred = r0 + (A - r0) * _sig(logc, log_cmid, B)
    return {
        "A": float(A),
        "C_mid": float(math.exp(log_cmid)),
        "B": float(B),
        "r0": float(r0),
        "rmse": float(np.sqrt(np.mean((pred - y) ** 2))),
        "n_points": int(len(c)),
        "method": method,
    }


def run_curve_data(
    run_dir: str | Path, metric: str = "eval/reward", compute: str = "step"
) -> tuple[np.ndarray, np.ndarray]:
    """(compute, value) at each evaluation in a run's `metrics.jsonl`.

    Compute is the step, or the running total over training steps of rollouts
    (`throughput/samples_per_s * time/step_s`), generated tokens
    (`throughput/generated_tokens_per_s * time/step_s`) or step seconds (`time/step_s`).
    """
    from mmrl.train.metrics_log import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a run directory)")
    rate = {
        "samples": "throughput/samples_per_s",
        "tokens": "throughput/generated_tokens_per_s",
        "seconds": None,
    }
    if compute not in ("step", *rate):
        raise ValueError(f"unknown compute axis {compute!r} (step, samples, tokens, seconds)")
    total, xs, ys = 0.0, [], []
    for rec in read_metrics(path):
        if compute != "step" and rec.get("time/step_s") is not None:
            key = rate[compute]
            if key is not None and rec.get(key) is None:
                raise ValueError(f"{path}: step {rec.get('step')} has time/step_s but no {key}")
            total += rec["time/step_s"] * (rec[key] if key else 1.0)
        if rec.get(metric) is not None:
            xs.append(float(rec["step"]) if compute == "step" else total)
            ys.append(float(rec[metric]))
    if not ys:
        raise ValueError(f"{path}: no records with {metric!r}")
    return np.asarray(xs), np.asarray(ys)


def fit_run(run_dir: str | Path, cfg: CurveConfig | None = None) -> dict[str, Any]:
    """ScaleRL fit of one run; R_0 is `cfg.r0`, else the evaluation at compute 0, else 0."""
    cfg = cfg or CurveConfig()
    c, y = run_curve_data(run_dir, cfg.metric, cfg.compute)
    r0 = cfg.r0
    if r0 is None:
        r0 = float(y[c <= 0][0]) if (c <= 0).any() else 0.0
    fit = fit_saturating_curve(c, y, r0=r0, a_max=cfg.a_max)
    return {**fit, "metric": cfg.metric, "compute": cfg.compute}


def plot_run_curves(run_dirs: Sequence[str | Path], out: str | Path, cfg: CurveConfig | None = None) -> Path:
    """Data points, fitted curve and asymptote (dashed) of each run, compute on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = cfg or CurveConfig()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, run_dir in enumerate(run_dirs):
        colour = f"C{i}"
        c, y = run_curve_data(run_dir, cfg.metric, cfg.compute)
        fit = fit_run(run_dir, cfg)
        pos = c > 0
        ax.plot(c[pos], y[pos], "o", color=colour, markersize=4)
        grid = np.geomspace(c[pos].min(), c[pos].max() * 10, 200)
        label = f"{Path(run_dir).name}: A={fit['A']:.3f} C_mid={fit['C_mid']:.3g} B={fit['B']:.2f}"
        ax.plot(
            grid,
            saturating_curve(grid, fit["A"], fit["C_mid"], fit["B"], fit["r0"]),
            "-",
            color=colour,
            label=label,
        )
        ax.axhline(fit["A"], color=colour, linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(f"compute ({cfg.compute})")
    ax.set_ylabel(cfg.metric)
    ax.set_title("ScaleRL fit: R0 + (A - R0) / (1 + (C_mid / C)^B)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------- pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), computed stably."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_curve(correct: Sequence[int], n: int) -> list[float]:
    """Mean pass@k over queries (each with `correct[i]` of n right), for k = 1..n."""
    if not correct:
        return [float("nan")] * n
    return [float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in range(1, n + 1)]


def sample_correct_counts(model: Any, suite, cfg: EvalConfig, judge=None) -> dict[str, list[int]]:
    """Per task, for each runnable query: how many of `cfg.pass_k` samples score >= the threshold."""
    from mmrl.eval.runner import (
        as_engine,
        check_scoring,
        load_judge,
        media_problem,
        query_sample,
        score_response,
        select_queries,
    )
    from mmrl.rollout.hf import SamplingParams

    n = cfg.pass_k
    if n < 1:
        raise ValueError(f"pass@k needs at least one sample per query, got {n}")
    judge = judge if judge is not None else load_judge(cfg)
    engine = as_engine(model, cfg.batch_size * n)
    params = SamplingParams(n=n, temperature=cfg.pass_temperature, max_new_tokens=cfg.max_new_tokens)
    counts: dict[str, list[int]] = {}
    selected = select_queries(suite, cfg.max_queries, cfg.tasks)
    check_scoring(suite, selected, cfg.scoring)
    for task, queries in selected:
        if task.unsupported_metrics() or (task.eval_type == "open" and judge is None):
            continue
        runnable = [q for q in queries if media_problem(task, q) is None]
        counts[task.name] = []
        for start in range(0, len(runnable), max(cfg.batch_size, 1)):
            chunk = runnable[start : start + cfg.batch_size]
            texts = engine.generate([query_sample(task, q) for q in chunk], params).texts
            for i, q in enumerate(chunk):
                scores = [
                    score_response(task, q, t, judge, cfg.scoring)["score"]
                    for t in texts[i * n : (i + 1) * n]
                ]
                counts[task.name].append(sum(1 for s in scores if s >= cfg.pass_threshold))
    return counts


def pass_at_k_summary(counts: dict[str, list[int]], n: int) -> dict[str, Any]:
    """Per-task curves and their macro mean over tasks (tasks without queries left out)."""
    per_task = {t: pass_at_k_curve(c, n) for t, c in counts.items() if c}
    curve = [
        float(np.mean([v[k] for v in per_task.values()])) if per_task else float("nan") for k in range(n)
    ]
    return {"curve": curve, "per_task": per_task}


def pass_at_k_report(
    model: Any, suite, cfg: EvalConfig, base: Any = None, out_dir: str | Path | None = None, judge=None
) -> dict[str, Any]:
    """pass@1..K of `model` (and of `base`), written to `pass_at_k.json` / `.png` in `out_dir`."""
    models = {"model": model, **({"base": base} if base is not None else {})}
    report: dict[str, Any] = {"k": list(range(1, cfg.pass_k + 1)), "curves": {}, "per_task": {}, "models": {}}
    for label, m in models.items():
        summary = pass_at_k_summary(sample_correct_counts(m, suite, cfg, judge), cfg.pass_k)
        report["curves"][label] = summary["curve"]
        report["per_task"][label] = summary["per_task"]
        report["models"][label] = str(m) if isinstance(m, (str, Path)) else type(m).__name__
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "pass_at_k.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
        plot_pass_at_k(report, out_dir / "pass_at_k.png")
    return report


def plot_pass_at_k(report: dict[str, Any], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, curve in report["curves"].items():
        ax.plot(
            report["k"],
            [100 * v for v in curve],
            "o-",
            label=f"{label} ({report['models'][label]})",
            markersize=3,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("pass@k (unbiased estimator), macro mean over tasks", fontsize=9)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
