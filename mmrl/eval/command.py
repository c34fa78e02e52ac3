"""`mmrl eval`: its arguments and the command (the suite run, pass@k curves, ScaleRL fits).

Sits above `mmrl.eval.runner` and `mmrl.eval.curves`, which import neither it nor each other
in that direction.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmrl.eval.config import CurveConfig, EvalConfig
from mmrl.eval.runner import SCORING_MODES, _fmt, run_suite
from mmrl.eval.suite import SuiteError, load_suite
from mmrl.train.storage import StorageError


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mmrl eval` arguments (defaults from `EvalConfig` / `CurveConfig`)."""
    d, c = EvalConfig(), CurveConfig()
    parser.add_argument(
        "--suite", metavar="PATH", help="suite folder or file (default: the built-in mini-suite)"
    )
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="the VLM to evaluate: a local Hugging Face folder or a hub id (org/name)",
    )
    parser.add_argument("--output", metavar="DIR", help="output folder (default: eval-<model name>)")
    parser.add_argument("--max-queries", type=int, metavar="N", help="at most N queries per task")
    parser.add_argument("--tasks", nargs="+", metavar="NAME", default=[], help="only these tasks")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=d.max_new_tokens,
        help=f"response length limit (default {d.max_new_tokens})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help=f"queries per generate call (default {d.batch_size})",
    )
    parser.add_argument(
        "--media-root", metavar="DIR", help="folder relative media paths are resolved against"
    )
    parser.add_argument(
        "--judge", metavar="MODULE:ATTR", help="judge callable judge(prompt, response, reference) -> [0, 1]"
    )
    parser.add_argument(
        "--judge-model", metavar="PATH", help="local VLM folder used as the judge of Open tasks"
    )
    parser.add_argument(
        "--scoring",
        choices=SCORING_MODES,
        default=d.scoring,
        help="megabench: MEGA-Bench's own scoring, quirks included, comparable to published scores "
        "(default); corrected: mmrl's fixes of its quirks (see mmrl/eval/metrics.py), not comparable",
    )
    parser.add_argument(
        "--tools",
        nargs="+",
        metavar="NAME",
        default=[],
        help="tools every query may call (e.g. zoom_in): multi-turn responses, with turn and tool figures",
    )
    parser.add_argument(
        "--max-turns",
        type=int,
        default=d.max_turns,
        help=f"most model turns per query with --tools (default {d.max_turns})",
    )
    parser.add_argument(
        "--call-format",
        default=d.call_format,
        help=f"how the model writes tool calls with --tools (default {d.call_format})",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="discard cached results in the output folder"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--builtin-queries", type=int, default=d.builtin_queries_per_task, help="queries per built-in task"
    )
    parser.add_argument(
        "--pass-k", type=int, default=0, metavar="K", help="also sample K responses per query: pass@1..K"
    )
    parser.add_argument(
        "--temperature", type=float, default=d.pass_temperature, help="pass@k sampling temperature"
    )
    parser.add_argument("--base", metavar="PATH", help="base checkpoint for the pass@k comparison")
    parser.add_argument(
        "--curves",
        nargs="+",
        metavar="RUN_DIR",
        help="fit ScaleRL's curve to these run directories (no model needed)",
    )
    parser.add_argument(
        "--metric", default=c.metric, help=f"--curves: metrics.jsonl key (default {c.metric})"
    )
    parser.add_argument(
        "--compute",
        default=c.compute,
        choices=["step", "samples", "tokens", "seconds"],
        help="--curves: compute axis",
    )


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    output = args.output
    if output is None and args.model:
        output = f"eval-{Path(args.model).resolve().name}"
    return EvalConfig(
        suite=args.suite,
        output_dir=output,
        max_queries=args.max_queries,
        tasks=tuple(args.tasks),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        media_root=args.media_root,
        judge=args.judge,
        judge_model=args.judge_model,
        progress=not args.no_progress,
        overwrite=args.overwrite,
        builtin_queries_per_task=args.builtin_queries,
        pass_k=args.pass_k,
        pass_temperature=args.temperature,
        base_model=args.base,
        scoring=args.scoring,
        tools=tuple(args.tools),
        max_turns=args.max_turns,
        call_format=args.call_format,
    )


def run_eval_command(args: argparse.Namespace) -> int:
    """`mmrl eval`: 0 on success, 2 with a one-line error on bad input."""
    try:
        if args.curves:
            return _curves_command(args)
        if not args.model:
            print("mmrl eval: error: --model is required (or --curves RUN_DIR ...)", file=sys.stderr)
            return 2
        from mmrl.check import check_eval

        # The model (a folder, or a hub id asked about once), the suite, the judge: before loading
        # the model, every problem on its own line.
        report = check_eval(args.model, args.suite, args.judge_model, args.media_root, args.base)
        cfg = config_from_args(args)
        suite_path = cfg.suite
        if suite_path is None:
            from mmrl.eval.builtin import builtin_suite_path

            suite_path = str(
                builtin_suite_path(cfg.builtin_queries_per_task, cfg.builtin_seed, cfg.builtin_image_size)
            )
        suite = None
        if Path(suite_path).exists():
            try:
                suite = load_suite(suite_path, cfg.media_root)
            except SuiteError as exc:
                report.add("--suite", str(exc))
        # A folder another run is writing: said with the other problems, before the model loads.
        from mmrl.train.rundir import RunDirLock

        if cfg.output_dir and (busy := RunDirLock(cfg.output_dir, "mmrl eval", option="--output").in_use()):
            report.add("--output", busy)
        if cfg.tools:
            from mmrl.environments import tool_names

            for name in cfg.tools:
                if name not in tool_names():
                    report.add("--tools", f"unknown tool {name!r} (known: {', '.join(tool_names())})")
            from mmrl.environments import call_format_names

            if cfg.call_format not in call_format_names():
                report.add(
                    "--call-format",
                    f"unknown call format {cfg.call_format!r} (known: {', '.join(call_format_names())})",
                )
            if cfg.max_turns < 1:
                report.add("--max-turns", f"must be at least 1, got {cfg.max_turns}")
        if report.problems:
            return report.print("eval")
        result = run_suite(args.model, suite, cfg)
        s = result.summary
        print(
            f"overall {_fmt(s['overall'])}  Core {_fmt(s['core'])} ({s['num_tasks']['core']} tasks)  "
            f"Open {_fmt(s['open'])} ({s['num_tasks']['open']} tasks)  {s['num_queries']} queries scored, "
            f"{result.generated} generated this run, {sum(s['skipped'].values())} skipped; results in {cfg.output_dir}"
        )
        # A metric whose package is missing skips its queries: say so here, with the install line.
        missing: dict[str, int] = {}
        for skip in result.skipped_queries:
            if skip["reason"] == "unavailable_metric":
                missing[skip["error"]] = missing.get(skip["error"], 0) + 1
        for error, n in sorted(missing.items()):
            print(f"{n} queries skipped: {error}")
        if s.get("agent"):
            a = s["agent"]
            print(
                f"tools {', '.join(s['tools'])}: {a['turns']:.2f} turns and {a['tool_calls']:.2f} calls per query, "
                f"tool-call rate {_fmt(a['tool_call_rate'])}%, errors {_fmt(a['tool_error_rate'])}% of calls, "
                f"time-outs {_fmt(a['tool_timeout_rate'])}%, {a['observation_tokens']:.0f} observation tokens"
            )
        if cfg.pass_k > 0:
            from mmrl.eval.curves import pass_at_k_report

            pass_k = pass_at_k_report(
                args.model, suite, cfg, base=cfg.base_model, out_dir=Path(cfg.output_dir)
            )
            for label, curve in pass_k["curves"].items():
                print(
                    f"pass@k {label}: " + "  ".join(f"@{k}={100 * v:.1f}" for k, v in zip(pass_k["k"], curve))
                )
        return 0
    except (SuiteError, ValueError, FileNotFoundError, KeyError) as exc:
        print(f"mmrl eval: error: {exc}", file=sys.stderr)
        return 2
    except StorageError as exc:  # --output read-only or full: the file and the cause named
        print(f"mmrl eval: error: {exc}", file=sys.stderr)
        return 1


def _curves_command(args: argparse.Namespace) -> int:
    from mmrl.eval.curves import fit_run, plot_run_curves

    cfg = CurveConfig(metric=args.metric, compute=args.compute)
    out = Path(args.output or "curves")
    out.mkdir(parents=True, exist_ok=True)
    fits = {}
    for run_dir in args.curves:
        fit = fit_run(run_dir, cfg)
        fits[str(run_dir)] = fit
        print(
            f"{run_dir}: asymptote A={fit['A']:.3f}  midpoint C_mid={fit['C_mid']:.4g} {cfg.compute}  "
            f"slope B={fit['B']:.3f}  R0={fit['r0']:.3f}  rmse={fit['rmse']:.4f} ({fit['n_points']} points)"
        )
    (out / "curves.json").write_text(json.dumps(fits, indent=1), encoding="utf-8")
    plot_run_curves(args.curves, out / "curves.png", cfg)
    print(f"wrote {out / 'curves.json'} and {out / 'curves.png'}")
    return 0
