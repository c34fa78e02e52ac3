"""The `mmrl` command line: `train`, `check`, `convert`, `serve` and `eval`.

Only the chosen command's arguments are built, and nothing heavy is imported before a command
has checked its input (`mmrl.check`): `--help`, a config error or `mmrl check` answer without
loading torch. Ctrl-C ends any command with one line and exit status 130; a training run that has
begun writes a checkpoint first, says how to resume, and exits 130 too (after SIGTERM, a
scheduler's stop, it exits 0).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

from mmrl.config import task_names

COMMANDS = ("train", "check", "convert", "serve", "eval")

INTERRUPTED = 130
"""The exit status of a command ended by Ctrl-C (SIGINT), as a shell reports one (128 + 2), so
`mmrl train ... && mmrl eval ...` stops there; a training run that had begun writes its
checkpoint first."""

TRAIN_EPILOG = """\
main options (any config field can be set as key=value, before or after the options; see configs/<task>.yaml):
  trainer.total_steps=N       RL steps
  trainer.prompts_per_step=B  prompts per step
  rollout.group_size=G        responses per prompt
  rollout.temperature=T       sampling temperature
  optim.lr=LR                 learning rate
  algo.kl_coef=C              KL penalty to the frozen reference (0: off)
  trainer.run_dir=DIR         where the run is written
  trainer.checkpoint_every=N  write a resumable checkpoint every N steps
  data.train_files=[a.jsonl]  train on sample files instead of the built-in task
  data.train_files=[hiyouga/geometry3k@train]   ... or on a hub dataset (split, ?config=, ?revision=)
  trainer.loggers=[jsonl,tensorboard,wandb]     also log to W&B (or mlflow)

examples:
  mmrl train --task vision_reasoning
  mmrl train --task vision_reasoning trainer.total_steps=50 rollout.group_size=4
  mmrl train --task vision_reasoning --model /path/to/Qwen2.5-VL-3B-Instruct
  mmrl train --task vision_reasoning --model Qwen/Qwen2.5-VL-3B-Instruct   # a hub id
  mmrl train --task qwen2_5_vl_3b_grpo_lora             # a real-model recipe (configs/)
  mmrl check --task qwen2_5_vl_3b_grpo_lora             # check it first: config, data, model, packages, GPU
"""

CHECK_EPILOG = """\
Checks, without starting anything: the config; the plugin modules and reward models; every data
path (a missing local file is named with the folder it was resolved from) and every sample; the
model folder or hub id (cached, or on a reachable hub); the optional packages the run needs, with
their install lines; MLflow's store; the run folder; the GPUs the run needs and their memory
against a rough estimate. Prints one line per problem (exit status 2) or `ready` and a summary.

examples:
  mmrl check --task qwen2_5_vl_3b_grpo_lora
  mmrl check --task vision_reasoning data.train_files=[train.jsonl] data.heldout_files=[test.jsonl]
"""


CONVERT_EPILOG = """\
examples:
  mmrl convert coco annotations/instances_val2017.json val2017/ -o coco_det.parquet
  mmrl convert coco annotations/instances_val2017.json val2017/ --task grounding -o coco_ground.jsonl
  mmrl convert vtriune orsta_train.parquet -o orsta.parquet
  mmrl convert easyr1 geometry3k_train.parquet -o geo3k.jsonl
"""


SERVE_EPILOG = """\
examples:
  mmrl serve --port 8000 --workers 2
  MMRL_SERVE_TOKEN=secret mmrl serve --host 0.0.0.0 --port 8000
  curl -s localhost:8000/get_reward -d '{"query": ["... \\\\boxed{3}"], "prompts": ["..."], "labels": ["3"]}'
"""

EVAL_EPILOG = """\
examples:
  mmrl eval --model runs/vision_reasoning-20261130-064200/final            # built-in mini-suite
  mmrl eval --suite megabench_core/ --model /models/Qwen2.5-VL-7B-Instruct --max-queries 20
  mmrl eval --model final/ --pass-k 8 --base ~/.cache/mmrl/bases/...       # pass@k vs the base
  mmrl eval --curves runs/a runs/b                                         # ScaleRL fits of runs
"""


def add_train_arguments(parser: argparse.ArgumentParser, tasks: list[str]) -> None:
    """`mmrl train`'s (and `mmrl check`'s) arguments."""
    parser.add_argument(  # the choices once, in the help (a `{...}` metavar would list them twice more)
        "--task",
        choices=tasks,
        default="vision_reasoning",
        metavar="TASK",
        help=f"task recipe (configs/<task>.yaml), one of: {', '.join(tasks)} (default: vision_reasoning)",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML config merged over the task recipe")
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="a Hugging Face VLM: a local folder or a hub id such as Qwen/Qwen2.5-VL-3B-Instruct "
        "(default: the built-in tiny base)",
    )
    parser.add_argument(
        "--resume",
        metavar="auto|CHECKPOINT",
        help="continue a run: `auto` picks the newest complete checkpoint in trainer.run_dir",
    )
    parser.add_argument(
        "--dump-steps",
        action="store_true",
        help="write every step's intermediate results to <run_dir>/dumps/",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand `argv` names (the first word that is not an option), or None."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser, with the arguments of `command` only (the others' would import their
    modules: `mmrl --help` and `mmrl train --help` stay light)."""
    parser = argparse.ArgumentParser(
        prog="mmrl",
        description="mmrl: RL post-training for multimodal models (GRPO on VLMs, V-Triune-style verifiers).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tasks = task_names()
    p_train = sub.add_parser(
        "train",
        help="train a policy with RL",
        description="Train a VLM with GRPO, or a diffusion model with flow-GRPO (text_to_image); --task picks the recipe.",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_check = sub.add_parser(
        "check",
        help="check a training run before starting it (config, data, model, packages, GPU)",
        description="Check a training run without starting it; the same arguments as `mmrl train`.",
        epilog=CHECK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if command in ("train", "check"):
        add_train_arguments(p_train if command == "train" else p_check, tasks)

    p_convert = sub.add_parser(
        "convert",
        help="convert COCO / V-Triune / EasyR1-veRL data to mmrl samples",
        description="Convert datasets to mmrl's sample format (every record validated).",
        epilog=CONVERT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if command == "convert":
        p_convert.add_argument("kind", choices=["coco", "vtriune", "easyr1"], help="input format")
        p_convert.add_argument(
            "inputs", nargs="+", help="coco: ANNOTATIONS.json IMAGE_DIR; others: record files"
        )
        p_convert.add_argument("-o", "--output", required=True, help="output .jsonl or .parquet")
        p_convert.add_argument(
            "--task", choices=["detection", "grounding"], help="coco: one sample per image or per object"
        )
        p_convert.add_argument("--data-source", help="data_source of the converted samples")

    p_serve = sub.add_parser(
        "serve",
        help="serve verifiers and reward models over HTTP for other trainers",
        description="A reward server (FastAPI + uvicorn, verifier worker processes): native /score, "
        "OpenRLHF /get_reward, V-Triune /judge, /health, /ready, /metrics. Binds to loopback by default; "
        "any other address needs a bearer token.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SERVE_EPILOG,
    )
    if command == "serve":
        from mmrl.server import add_serve_arguments

        add_serve_arguments(p_serve)

    p_eval = sub.add_parser(
        "eval",
        help="evaluate a model on a MEGA-Bench-style suite",
        description="Evaluate a VLM (a local folder or a hub id) on a MEGA-Bench-style suite (default: the "
        "built-in mini-suite); results as JSON, Markdown and PNG; resumable.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EVAL_EPILOG,
    )
    if command == "eval":
        from mmrl.eval.command import add_eval_arguments

        add_eval_arguments(p_eval)
    return parser


def is_override(word: str) -> bool:
    """A `key=value` config override (not an option such as `--config=FILE`)."""
    key, eq, _ = word.partition("=")
    return bool(eq) and bool(key) and not word.startswith("-")


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed, with `key=value` overrides taken in any position among the options (as
    veRL and EasyR1 take them): `mmrl check --task T --resume auto trainer.total_steps=2`.

    argparse gives a `nargs="*"` positional only its first run of words; the overrides after an
    option come back unrecognized, and are appended here in the order they were written (a later
    override of the same key wins). Anything else unrecognized is an error shown with the
    subcommand's own usage."""
    args, extras = parser.parse_known_args(argv)
    if hasattr(args, "overrides"):
        args.overrides = list(args.overrides) + [w for w in extras if is_override(w)]
        extras = [w for w in extras if not is_override(w)]
    if extras:
        _subcommand_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def _subcommand_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of `command` (for its usage line in errors); `parser` itself when none."""
    for action in parser._actions:  # noqa: SLF001 - argparse has no public way to reach them
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:  # noqa: SLF001
            return action.choices[command]
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(chosen_command(argv))
    args = parse_command_line(parser, argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(f"mmrl {args.command}: interrupted (Ctrl-C){_interrupt_note(args)}", file=sys.stderr)
        return INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    if args.command == "train":
        return _train(args)
    if args.command == "check":
        from mmrl.check import check_train

        return check_train(args.task, args.config, _train_overrides(args)).print("check")
    if args.command == "convert":
        return _convert(args)
    if args.command == "serve":
        from mmrl.check import check_serve

        report = check_serve(args.config)
        if report.problems:
            return report.print("serve")
        from mmrl.server import run_serve_command

        return run_serve_command(args)
    if args.command == "eval":
        from mmrl.eval.command import run_eval_command

        return run_eval_command(args)
    return 2


def _interrupt_note(args: argparse.Namespace) -> str:
    """What an interrupted command left behind, in a few words."""
    if args.command == "train":
        return "; stopped before training began, nothing to resume"
    if args.command == "eval":
        return "; finished queries are kept, rerun the same command to continue"
    return ""


def _train_overrides(args: argparse.Namespace) -> list[str]:
    """The `key=value` overrides, with `--model`, `--resume` and `--dump-steps` among them."""
    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.path={args.model}")
    if getattr(args, "resume", None):
        overrides.append(f"trainer.resume={args.resume}")
    if getattr(args, "dump_steps", False):
        overrides.append("trainer.dump_steps=true")
    return overrides


def _train_diffusion(args: argparse.Namespace, cfg) -> int:
    """flow-GRPO on a diffusion pipeline (`configs/<task>.yaml` with `kind: diffusion`)."""
    from mmrl.config import recipe_kind
    from mmrl.heap import imports_without_gc
    from mmrl.train.storage import StorageError

    try:
        if recipe_kind(args.task) == "decoupled":  # a planner in front of the pipeline
            with imports_without_gc():
                from mmrl.train.decoupled import run_decoupled

            with signals_received() as received:
                result = run_decoupled(cfg)
        else:
            with imports_without_gc():
                from mmrl.train.flow_grpo import run_text_to_image

            with signals_received() as received:
                result = run_text_to_image(cfg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mmrl train: error: {exc}", file=sys.stderr)
        return 2
    except (StorageError, OSError) as exc:  # a checkpoint write on a full or read-only disk (path named)
        print(f"mmrl train: stopped: {exc}", file=sys.stderr)
        return 1
    print(result.summary_line(args.task))
    return interrupted_status(received) if result.interrupted else 0


def _convert(args: argparse.Namespace) -> int:
    from mmrl.datasets.converters import convert
    from mmrl.datasets.schema import SampleError

    options = {}
    if args.task:
        if args.kind != "coco":
            print("mmrl convert: error: --task applies to coco only", file=sys.stderr)
            return 2
        options["task"] = args.task
    if args.data_source:
        if args.kind == "vtriune":
            print("mmrl convert: error: V-Triune records carry their own data_source", file=sys.stderr)
            return 2
        options["data_source"] = args.data_source
    try:
        n = convert(args.kind, *args.inputs, output_path=args.output, **options)
    except (SampleError, ValueError, FileNotFoundError) as exc:
        print(f"mmrl convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} samples to {args.output}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from mmrl.check import check_train

    overrides = _train_overrides(args)
    # Checked before anything heavy loads: the config, that the data and the model can be found,
    # the packages, the GPU memory (the data is read, and every record validated, by the trainer).
    report = check_train(args.task, args.config, overrides, read_data=False)
    if report.problems:
        return report.print("train")
    from mmrl.config import recipe_kind

    if recipe_kind(args.task) in ("diffusion", "decoupled"):
        return _train_diffusion(args, report.config)
    from mmrl.heap import imports_without_gc

    with imports_without_gc():  # torch, transformers and the trainer (mmrl.heap)
        from mmrl.compose import train
    from mmrl.datasets.schema import SampleError
    from mmrl.train.rundir import take_run_dir_first
    from mmrl.train.storage import StorageError

    run_dir = report.config.trainer.run_dir
    try:
        # A named run directory is locked before the data and the model load, so a second
        # trainer on it is refused at once (the trainer keeps this lock; a new timestamped
        # folder needs none yet).
        with (
            take_run_dir_first(run_dir, "mmrl train") if run_dir else contextlib.nullcontext(),
            signals_received() as received,
        ):
            result = train(report.config)
    except (SampleError, ValueError, FileNotFoundError) as exc:
        print(f"mmrl train: error: {exc}", file=sys.stderr)
        return 2
    except StorageError as exc:  # a full disk, a read-only run folder: path and cause named
        print(f"mmrl train: error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # e.g. too many non-finite steps in a row
        print(f"mmrl train: stopped: {exc}", file=sys.stderr)
        return 1
    if result.interrupted:
        print(
            f"interrupted at step {result.steps}; checkpoint written. Continue with: "
            f"mmrl train --task {args.task} trainer.run_dir={result.run_dir} --resume auto ..."
        )
        return interrupted_status(received)
    print(result.summary_line())
    return 0


@contextlib.contextmanager
def signals_received() -> Iterator[set[int]]:
    """The numbers of the signals that reached this process while the block ran, whichever
    Python handler took them (the trainers' own stop handler records no signal in their result).

    CPython writes each caught signal's number to the wakeup fd (`signal.set_wakeup_fd`); the
    set is filled when the block ends. Outside the main thread it stays empty."""
    received: set[int] = set()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    try:
        yield received
    finally:
        signal.set_wakeup_fd(previous)
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(read_end, 4096):
                received.update(chunk)
        os.close(read_end)
        os.close(write_end)


def interrupted_status(received: set[int]) -> int:
    """The exit status of a training run that stopped on a signal after writing its checkpoint:
    130 for Ctrl-C (SIGINT), 0 for SIGTERM (a scheduler's stop, continued with --resume auto)."""
    if signal.SIGINT in received or signal.SIGTERM not in received:
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
