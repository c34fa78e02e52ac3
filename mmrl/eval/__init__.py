"""Evaluation on MEGA-Bench-style suites (`mmrl eval`) and the curves that compare runs.

- `suite`: the task format and loading (JSON/JSONL/Parquet folders, `datasets` exports);
- `parsers`: from a response to per-field answers (`answer_string`, `json`, raw);
- `metrics`: field scoring functions by MEGA-Bench name, the model-as-judge metric included;
- `aggregate`: query, task, Core / Open / overall scores and keyword breakdowns;
- `runner`: greedy evaluation through the rollout engine, resumable, JSON + Markdown + PNG
  outputs; `evaluate_suite` for the trainer; the `mmrl eval` arguments and command;
- `curves`: ScaleRL's saturating fit of reward vs compute, pass@k curves;
- `builtin`: the built-in mini-suite from the procedural kinds.
"""

from mmrl.eval.command import add_eval_arguments, run_eval_command
from mmrl.eval.config import CurveConfig, EvalConfig
from mmrl.eval.runner import evaluate_suite, run_suite
from mmrl.eval.suite import Suite, SuiteError, Task, load_suite

__all__ = [
    "CurveConfig",
    "EvalConfig",
    "Suite",
    "SuiteError",
    "Task",
    "add_eval_arguments",
    "evaluate_suite",
    "load_suite",
    "run_eval_command",
    "run_suite",
]
