"""Updates of the training group on saved steps, launched by `torchrun`.

Checks that a launch of the group computes what a single process computes on the same global
batches (and is how the tests do it):

    torchrun --nproc_per_node 2 -m mmrl.distributed.one_update \\
        --config run.yaml --model MODEL_DIR --step step1.pt [--step step2.pt ...] --out result.pt

Each `step.pt` holds `{"batch": RolloutBatch, "advantages": [N], "weights": [N, R] or None}`;
the steps are applied in order. At each, every process computes the old (and reference)
log-probs of its rows with the current weights, the group exchanges them, then runs
`GroupLearner.update`; rank 0 writes `{"steps": [{"state_dict", "metrics", "old_logprobs",
"ref_logprobs"} per step], **the last step's}` to `--out`. `--init FILE` (a torch file of
weights by name) sets the trained parameters first (`GroupLearner.load_state`), e.g. to the
single-process trainer's LoRA adapters. Several `--config` / `--out` pairs run one after the
other in the same processes (the DeepSpeed tests' updates share one launch).

Sharded checkpoints (FSDP2, `mmrl.train.sharded`), one option per `--config` when given:
`--save-after K:DIR` writes the group's sharded training state into DIR after step K (every
process its own shards); `--load K:DIR` starts from the state in DIR, written after step K by any
number of processes (or by the single-process trainer), and applies the steps after K only.
"""

from __future__ import annotations

import argparse

from mmrl.heap import imports_without_gc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, action="append",
                        help="the run's config (YAML, as in a run directory); repeat it (one --out each) to "
                        "run several updates in the same processes")  # fmt: skip
    parser.add_argument("--model", required=True, help="the policy's Hugging Face folder")
    parser.add_argument(
        "--step",
        required=True,
        action="append",
        help="torch file: batch, advantages, TIS weights; repeat it for more steps, in order",
    )
    parser.add_argument("--init", help="torch file of weights by name: the trained parameters' start")
    parser.add_argument("--out", required=True, action="append", help="where rank 0 writes the result")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--save-after", action="append",
                        help="K:DIR, one per --config (- for none): write the sharded state after step K")  # fmt: skip
    parser.add_argument("--load", action="append",
                        help="K:DIR, one per --config (- for none): start from the sharded state of step K")  # fmt: skip
    args = parser.parse_args(argv)
    if len(args.config) != len(args.out):
        parser.error(f"{len(args.config)} --config but {len(args.out)} --out: give one --out per --config")
    for name in ("save_after", "load"):
        given = getattr(args, name)
        if given is not None and len(given) != len(args.config):
            parser.error(
                f"{len(given)} --{name.replace('_', '-')} for {len(args.config)} --config: one each (- for none)"
            )
        setattr(args, name, [_step_and_dir(x) for x in given] if given else [None] * len(args.config))

    with imports_without_gc():  # torch, transformers and the strategies' libraries (mmrl.heap)
        import torch

        from mmrl.config import load_config
        from mmrl.distributed.learners import learner_class

        configs = [load_config(config_file=config) for config in args.config]
        classes = [learner_class(cfg) for cfg in configs]
    steps = [torch.load(path, weights_only=False) for path in args.step]
    init = None if args.init is None else torch.load(args.init, weights_only=False)
    for i, (cfg, cls, out) in enumerate(zip(configs, classes, args.out)):  # one process group for all
        learner = cls.from_env(cfg, args.model, threads=args.threads, dtype=getattr(torch, args.dtype))
        if init is not None:
            learner.load_state(init, None, 0)
        first = 0
        if args.load[i] is not None:
            first, folder = args.load[i]
            learner.load_sharded(folder, first)
        results = []
        for k, step in enumerate(steps[first:], start=first + 1):
            results.append(one_update(learner, step))
            if args.save_after[i] is not None and args.save_after[i][0] == k:
                learner.save_sharded(args.save_after[i][1])
        if learner.rank == 0:
            torch.save({"steps": results, **results[-1]}, out)
        learner.close(end_group=i == len(args.config) - 1)


def _step_and_dir(value: str) -> tuple[int, str] | None:
    """`K:DIR` -> (K, DIR); `-` -> None."""
    if value == "-":
        return None
    step, _, folder = value.partition(":")
    if not step.isdigit() or not folder:
        raise SystemExit(f"expected K:DIR or -, got {value!r}")
    return int(step), folder


def one_update(learner, step: dict) -> dict | None:
    """Old / reference log-probs of each process's rows, gathered; the group's update. Returns
    (on rank 0; None elsewhere) the weights after it, the merged metrics and the log-probs."""
    import torch
    import torch.distributed as dist

    from mmrl.distributed.training_group import merge_metrics

    batch = step["batch"]
    rows, old, ref = learner.old_and_ref_logprobs(batch)
    parts: list = [None] * learner.world_size
    dist.all_gather_object(parts, (rows, old, ref))
    N, R = batch.response_ids.shape
    old_all = torch.zeros(N, R, dtype=old.dtype)
    ref_all = None if ref is None else torch.zeros(N, R, dtype=ref.dtype)
    for part_rows, part_old, part_ref in parts:
        old_all[part_rows] = part_old
        if ref_all is not None:
            ref_all[part_rows] = part_ref
    metrics = learner.update(batch, step["advantages"], old_all, ref_all, step.get("weights"))
    all_metrics: list = [None] * learner.world_size
    dist.all_gather_object(all_metrics, metrics)
    state = learner.full_state_dict()
    if learner.rank != 0:
        return None
    return {"state_dict": state, "metrics": merge_metrics(all_metrics), "old_logprobs": old_all,
            "ref_logprobs": ref_all}  # fmt: skip


if __name__ == "__main__":
    main()
