"""Every default of `mmrl eval` and of the evaluation curves, one documented field each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalConfig:
    """How a suite is evaluated (`mmrl eval`, `evaluate_suite`)."""

    suite: str | None = None
    """Suite folder or file (JSON/JSONL/Parquet, or a `datasets` export); None: the built-in mini-suite."""
    output_dir: str | None = None
    """Where results and the per-query cache go; None: no files (in-memory, as the trainer uses)."""
    max_queries: int | None = None
    """Evaluate at most this many queries per task (the first ones); None: all."""
    tasks: tuple[str, ...] = ()
    """Only these task names (empty: every task of the suite)."""
    max_new_tokens: int = 512
    """Length limit of a greedy response, stop token included."""
    batch_size: int = 8
    """Queries per `generate` call."""
    media_root: str | None = None
    """Folder that relative media paths are resolved against first (then the task file's folder)."""
    judge: str | None = None
    """`module:attr` of a judge callable `judge(prompt, response, reference) -> [0, 1]` for Open tasks."""
    judge_model: str | None = None
    """Local VLM folder used as the judge of Open tasks (`mmrl.rewards.vlm_judge.VLMJudge`)."""
    progress: bool = True
    """Show a tqdm progress bar over the queries still to run."""
    overwrite: bool = False
    """Discard the output folder's cached per-query records instead of resuming from them."""
    builtin_queries_per_task: int = 8
    """Queries per task of the built-in mini-suite."""
    builtin_seed: int = 0
    """Seed of the built-in mini-suite's procedural images."""
    builtin_image_size: int = 64
    """Side in pixels of the built-in mini-suite's images."""
    pass_k: int = 0
    """Samples per query for pass@k curves k = 1..pass_k (0: no pass@k)."""
    pass_temperature: float = 1.0
    """Sampling temperature of the pass@k samples."""
    pass_threshold: float = 1.0
    """A sample counts as correct for pass@k when its query score is at least this."""
    base_model: str | None = None
    """Base checkpoint whose pass@k curve is drawn beside the model's (does RL widen or sharpen?)."""
    tools: tuple[str, ...] = ()
    """Tools every query may call (registered names, e.g. `zoom_in`): each response is then a
    multi-turn trajectory (`mmrl.rollout.multiturn`) scored on its last turn, and the results
    add turn and tool figures per task (`agent`). Empty: one turn, no tools."""
    max_turns: int = 4
    """Most model turns per query when `tools` are given (a call in the last turn is not run)."""
    call_format: str = "hermes"
    """How tool calls are written (`agent.call_format`: Qwen's hermes `<tool_call>` by default)."""
    scoring: str = "megabench"
    """`megabench`: MEGA-Bench's own parsers, metrics and aggregation, quirks included (scores comparable
    to published ones); `corrected`: mmrl's fixes of those quirks (`mmrl.eval.metrics`)."""


@dataclass
class CurveConfig:
    """How a run's held-out reward is fitted against compute (ScaleRL's saturating sigmoid)."""

    metric: str = "eval/reward"
    """The `metrics.jsonl` key fitted (any eval key, e.g. `eval/accuracy` or `eval_suite/overall`)."""
    compute: str = "step"
    """Compute axis: `step`, `samples` (rollouts), `tokens` (generated) or `seconds` (step time)."""
    r0: float | None = None
    """Reward at zero compute, R_0 in ScaleRL; None: the evaluation at compute 0 if any, else 0."""
    a_max: float | None = 1.0
    """Upper bound of the asymptote A (rewards and accuracies are at most 1); None: unbounded."""
