"""pass@k (unbiased estimator) and ScaleRL's saturating fit of reward against compute."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from mmrl.eval.command import add_eval_arguments, run_eval_command
from mmrl.eval.config import CurveConfig, EvalConfig
from mmrl.eval.curves import (
    fit_run,
    fit_saturating_curve,
    pass_at_k,
    pass_at_k_curve,
    pass_at_k_report,
    run_curve_data,
    saturating_curve,
)
from mmrl.eval.suite import SuiteError, load_suite

# --------------------------------------------------------------------------- pass@k


def test_pass_at_k_hand_worked():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2) / C(5,2)
    assert [pass_at_k(4, 1, k) for k in (1, 2, 3, 4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong samples: some draw of k has a right one
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_pass_at_k_is_stable_where_binomials_are_huge():
    n, c, k = 200, 5, 100
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert pass_at_k_curve([1, 3], 4) == pytest.approx(
        [(0.25 + 0.75) / 2, (0.5 + 1.0) / 2, (0.75 + 1) / 2, 1.0]
    )


class FirstSampleRight:
    """Per query, the first of n samples is right and the others wrong (or all wrong)."""

    def __init__(self, right: bool = True):
        self.right = right

    def generate(self, samples, params):
        texts = [
            "Answer: green" if (self.right and j == 0) else "Answer: red"
            for _ in samples
            for j in range(params.n)
        ]
        return SimpleNamespace(texts=texts)


def test_pass_at_k_report_compares_a_checkpoint_with_its_base(tmp_path):
    Image.new("RGB", (8, 8), (0, 200, 0)).save(tmp_path / "g.png")
    task = {
        "task_name": "colour",
        "query_response": [
            {
                "query_idx": i,
                "query_text": "<image>Colour?",
                "query_media": ["g.png"],
                "correct_answer": {"Answer": "green"},
            }
            for i in range(2)
        ],
        "metric_info": {"field_score_function": {"Answer": "exact_str_match"}},
    }
    (tmp_path / "colour.json").write_text(json.dumps(task))
    cfg = EvalConfig(pass_k=4, progress=False)
    # MEGA-Bench's own scoring (the default) cannot aggregate a field without a weight: refused
    # up front, naming the task, instead of every sample scoring -1 (pass@k 0) in silence.
    with pytest.raises(SuiteError, match="colour.*no field weight|no weight.*Answer"):
        pass_at_k_report(FirstSampleRight(), load_suite(tmp_path), cfg)
    task["metric_info"]["aggregation"] = {"function": "mean", "field_weights": {"Answer": 1}}
    (tmp_path / "colour.json").write_text(json.dumps(task))
    suite = load_suite(tmp_path)
    report = pass_at_k_report(
        FirstSampleRight(), suite, cfg, base=FirstSampleRight(False), out_dir=tmp_path / "out"
    )
    assert report["k"] == [1, 2, 3, 4]
    assert report["curves"]["model"] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # c = 1 of n = 4
    assert report["curves"]["base"] == pytest.approx([0.0, 0.0, 0.0, 0.0])
    assert (tmp_path / "out" / "pass_at_k.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "out" / "pass_at_k.json").read_text())["curves"] == report["curves"]


# --------------------------------------------------------------------------- ScaleRL fit


def test_saturating_curve_has_its_named_parameters():
    # At C = C_mid the curve is halfway from R0 to A; far beyond it approaches A.
    assert saturating_curve(100.0, 0.8, 100.0, 2.0, r0=0.2) == pytest.approx(0.5)
    assert saturating_curve(1e9, 0.8, 100.0, 2.0) == pytest.approx(0.8, abs=1e-6)
    assert saturating_curve(100.0, 0.8, 100.0, 2.0) == pytest.approx(0.4)  # R0 = 0: A / 2


@pytest.mark.parametrize("r0", [0.0, 0.2])
def test_fit_recovers_the_parameters_of_noise_free_data(r0):
    c = np.geomspace(5, 5000, 25)
    y = saturating_curve(c, 0.8, 120.0, 1.5, r0=r0)
    fit = fit_saturating_curve(c, y, r0=r0)
    assert fit["A"] == pytest.approx(0.8, abs=1e-3)
    assert fit["C_mid"] == pytest.approx(120.0, rel=1e-2)
    assert fit["B"] == pytest.approx(1.5, rel=1e-2)
    assert fit["rmse"] < 1e-4 and fit["n_points"] == 25


def test_fit_with_noise_predicts_the_ceiling_and_respects_the_bound():
    rng = np.random.default_rng(0)
    c = np.geomspace(10, 2000, 40)
    y = saturating_curve(c, 0.9, 300.0, 1.2, r0=0.1) + rng.normal(0, 0.01, size=c.shape)
    fit = fit_saturating_curve(c, y, r0=0.1)
    assert fit["A"] == pytest.approx(0.9, abs=0.05)
    # A reward never exceeds 1: a curve still climbing at the last point is capped at a_max.
    rising = saturating_curve(c, 3.0, 1e4, 1.0)
    assert fit_saturating_curve(c, rising, a_max=1.0)["A"] <= 1.0
    with pytest.raises(ValueError, match="at least 3 points"):
        fit_saturating_curve([0, 1, 2], [0.1, 0.2, 0.3])


def test_the_scipy_path_agrees_when_scipy_is_installed():
    pytest.importorskip("scipy")
    c = np.geomspace(5, 5000, 25)
    fit = fit_saturating_curve(c, saturating_curve(c, 0.8, 120.0, 1.5))
    assert fit["method"] == "scipy" and fit["A"] == pytest.approx(0.8, abs=1e-3)


def _fake_run(folder: Path, A: float = 0.9, c_mid: float = 40.0, B: float = 1.3, r0: float = 0.3) -> Path:
    """metrics.jsonl as the trainer writes it: step records, and evaluations every 10 steps."""
    folder.mkdir(parents=True)
    lines = [{"step": 0, "eval/reward": r0, "eval/accuracy": r0}]
    for step in range(1, 201):
        lines.append({"step": step, "time/step_s": 0.5, "throughput/samples_per_s": 64.0, "reward/mean": 0.5})
        if step % 10 == 0:
            value = float(saturating_curve(step, A, c_mid, B, r0=r0))
            lines.append({"step": step, "eval/reward": value, "eval/accuracy": value})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return folder


def test_fit_of_a_run_directory_uses_its_step_zero_evaluation_as_r0(tmp_path):
    run = _fake_run(tmp_path / "run")
    fit = fit_run(run, CurveConfig(metric="eval/reward", compute="step"))
    assert fit["r0"] == pytest.approx(0.3)
    assert fit["A"] == pytest.approx(0.9, abs=1e-3) and fit["C_mid"] == pytest.approx(40.0, rel=1e-2)
    # Samples: 0.5 s x 64 samples/s = 32 rollouts per step; the midpoint moves by that factor.
    c, _ = run_curve_data(run, "eval/reward", "samples")
    assert c[:3] == pytest.approx([0.0, 320.0, 640.0])
    assert fit_run(run, CurveConfig(compute="samples"))["C_mid"] == pytest.approx(40.0 * 32, rel=1e-2)
    with pytest.raises(ValueError, match="no records with 'eval/nothing'"):
        run_curve_data(run, "eval/nothing")


def test_curves_command_fits_and_plots_several_runs(tmp_path, capsys):
    a = _fake_run(tmp_path / "a")
    b = _fake_run(tmp_path / "b", A=0.7, c_mid=20.0)
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    args = parser.parse_args(["--curves", str(a), str(b), "--output", str(tmp_path / "cmp")])
    assert run_eval_command(args) == 0
    fits = json.loads((tmp_path / "cmp" / "curves.json").read_text())
    assert fits[str(a)]["A"] == pytest.approx(0.9, abs=1e-3) and fits[str(b)]["A"] == pytest.approx(
        0.7, abs=1e-3
    )
    assert (tmp_path / "cmp" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "asymptote A=0.900" in capsys.readouterr().out
