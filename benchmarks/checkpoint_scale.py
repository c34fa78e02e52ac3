"""Host memory and time of a checkpoint save on the Ray backend, sharded against gathered, at
several model sizes.

    sharded    each training process writes its own shards of the trained weights and optimizer
               state (torch DCP, `mmrl.train.sharded`); the driver writes its copy of the policy
               in Hugging Face format and the trainer state (the default for FSDP2 groups)
    gathered   the optimizer state gathered by parameter name on training rank 0, sent through
               Ray's object store to the driver and written into trainer_state.pt (mmrl before
               sharded checkpoints; DeepSpeed groups still save this way)

    background the sharded save with `trainer.async_checkpoint=true`: the training processes
               copy their shards and write them in a thread; the driver checksums, syncs and
               renames the folder on another; the loop waits only for the copy and for the
               driver's Hugging Face weights and trainer state

    python benchmarks/checkpoint_scale.py [--sizes 128x2 512x4 1024x4] [--repeats 2]

Each size is a tiny Qwen2-VL built from config (`HIDDENxLAYERS`, MLP 2.75x wide), trained for one
step on a Ray group of 2 FSDP2 processes (1 rollout worker, 0.5 CPU per actor) so the optimizer
has state, then checkpointed in the three ways, in turn, `--repeats` times each. Printed per save:
the peak host memory above the resident set before the save (the kernel's high-water mark,
`VmHWM`, reset with `/proc/self/clear_refs`) of the driver and of each training process, and the
save's wall time: until the loop may go on (`loop stall`) and until the checkpoint is
sealed. Figures are the median over the repeats. Ray's object store (shared memory
held by the raylet) is not counted in any of them: the gathered save also holds the optimizer
state there on its way to the driver.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

MiB = 2**20
MODES = ("gathered", "sharded", "background")


def _size(text: str) -> tuple[int, int]:
    hidden, _, layers = text.partition("x")
    return int(hidden), int(layers)


def measure(hidden: int, layers: int, repeats: int, root: Path) -> list[dict]:
    from mmrl.compose import composition
    from mmrl.config import load_config
    from mmrl.distributed.actors import host_memory
    from mmrl.distributed.ray_backend import _get
    from mmrl.models.loading import load_policy, make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm
    from mmrl.train.data import PromptSampler, load_data
    from mmrl.train.grpo import RunProgress, seed_everything, start_write_checkpoint
    from mmrl.types import VerifyContext

    spec = TinyVLMSpec(hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=4,
                       intermediate_size=int(2.75 * hidden))  # fmt: skip
    model_dir = root / f"model-{hidden}x{layers}"
    tiny = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
    n_params = sum(p.numel() for p in tiny.model.parameters())
    tiny.model.save_pretrained(model_dir)
    tiny.processor.save_pretrained(model_dir)
    del tiny
    cfg = load_config("vision_reasoning", overrides=[
        f"model.path={model_dir}", "trainer.backend=ray", "trainer.train_workers=2", "trainer.rollout_workers=1",
        "trainer.ray_cpus_per_actor=0.5", "trainer.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=16", "reward.num_workers=0", "trainer.total_steps=1", "trainer.keep_last=0",
        "data.kinds=[ocr]",
    ])  # fmt: skip
    compose = composition(cfg)
    seed_everything(cfg.trainer.seed)
    train_samples, _ = load_data(cfg)
    sampler = PromptSampler(train_samples, seed=cfg.trainer.seed)
    t = compose.make_trainee(cfg, load_policy(model_dir), None)
    rows = []
    try:
        compose.step(cfg, t, sampler, VerifyContext(0, 1), step=1)
        group = t.group
        progress = RunProgress()
        progress.step = 1
        for k in range(repeats):
            for mode in MODES:
                t.fsdp2 = mode != "gathered"  # False: the gathered save (GroupOptimizerState)
                run_dir = root / f"run-{hidden}x{layers}-{mode}-{k}"
                before = host_memory(reset_peak=True)
                workers = _get(group.ray, [w.host_memory.remote(True) for w in group.workers], group.names)
                start = time.perf_counter()
                pending = start_write_checkpoint(
                    cfg, t, sampler, progress, run_dir, background=mode == "background"
                )
                stall = time.perf_counter() - start
                pending.wait()
                seconds = time.perf_counter() - start
                after = host_memory()
                peaks = _get(group.ray, [w.host_memory.remote() for w in group.workers], group.names)
                rows.append({
                    "size": f"{hidden}x{layers}", "params": n_params, "mode": mode, "seconds": seconds, "stall": stall,
                    "driver": (after["peak"] - before["rss"]) / MiB,
                    **{f"rank {r}": (p["peak"] - w["rss"]) / MiB for r, (w, p) in enumerate(zip(workers, peaks))},
                })  # fmt: skip
        t.fsdp2 = True
    finally:
        t.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["128x2", "512x4", "1024x4"], help="HIDDENxLAYERS each")
    parser.add_argument("--repeats", type=int, default=2, help="saves of each kind per size")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            rows += measure(*_size(size), args.repeats, Path(tmp))
    print("\n| model | parameters | float32 weights | save | driver peak | rank 0 peak | rank 1 peak "
          "| loop stall | until complete |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    keys = ("driver", "rank 0", "rank 1", "stall", "seconds")
    ratios = []
    for size in dict.fromkeys(r["size"] for r in rows):
        med = {}
        for mode in MODES:
            mine = [r for r in rows if r["size"] == size and r["mode"] == mode]
            med[mode] = m = {k: statistics.median(r[k] for r in mine) for k in keys}
            params = mine[0]["params"]
            print(f"| {size} | {params / 1e6:.1f}M | {params * 4 / MiB:.0f} MiB | {mode} | {m['driver']:.0f} MiB "
                  f"| {m['rank 0']:.0f} MiB | {m['rank 1']:.0f} MiB | {m['stall']:.2f} s | {m['seconds']:.2f} s |")  # fmt: skip
        ratios.append(f"{size}: background stall / sharded save {med['background']['stall'] / med['sharded']['stall']:.2f}, "
                      f"sharded / gathered save {med['sharded']['seconds'] / med['gathered']['seconds']:.2f}")  # fmt: skip
    print("\n" + "\n".join(ratios))
    print("\npeak: the high-water mark of the process's resident set during the save, above its resident "
          f"set before it (median of {args.repeats}); Ray's object store not included. loop stall: until "
          "the training loop may go on; until complete: until the checkpoint is sealed and in place")  # fmt: skip


if __name__ == "__main__":
    main()
