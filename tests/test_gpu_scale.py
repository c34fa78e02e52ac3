"""`benchmarks/gpu_scale.py --shape tiny --device cpu`: every path of the real-scale GPU benchmark
(copy bandwidth and matmul rate, mmrl's step full and LoRA with gradient checkpointing and its
step split, TRL's GRPOTrainer where installed, flow-GRPO LoRA and full with the decoder step
against its bound) runs to its table, so the script cannot rot between GPU measurements. The
figures at this shape on a CPU mean nothing; only that each is there and sensible is checked.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_benchmark_runs_every_path_at_tiny_shapes_on_the_cpu(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_scale.py"), "--shape", "tiny", "--device", "cpu",
         "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "copy bandwidth" in run.stdout
    assert "mmrl / TRL" in run.stdout or "TRL not installed" in run.stdout
    result = json.loads(out.read_text())
    assert result["bandwidth"] > 0 and result["matmul"] > 0
    rows = {r["run"]: r for r in result["rows"]}
    for name in ("mmrl tiny full FT", "mmrl tiny LoRA 8 + grad ckpt"):
        r = rows[name]
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
        assert math.isclose(sum(r["split"].values()), 1.0, abs_tol=1e-6)
        assert all(0 <= v <= 1 for k, v in r["split"].items() if k != "outside"), r["split"]
        assert r["decode_ms"] > 0 and r["bound_ms"] > 0 and r["ratio"] > 0
    trl = rows["TRL GRPOTrainer tiny, same settings"]
    assert (trl["tokens_per_s"] or 0) > 0 or importlib.util.find_spec("trl") is None
    for name in ("flow-GRPO tiny SD3 LoRA 32", "flow-GRPO tiny SD3 full"):
        assert rows[name]["images_per_s"] > 0
    decoder = rows["flow tiny SD3 decoder step, no grad"]
    assert decoder["decode_ms"] > 0 and decoder["bound_ms"] > 0
