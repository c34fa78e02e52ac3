"""LoRA on the Ray backend: what to send the rollout workers after each update, measured.

    python benchmarks/lora_sync.py [--repeats R] [--rank 16] [--sizes tiny,wide]

`trainer.lora_sync=adapters` sends the adapter weights only (the workers run them unmerged, an
extra low-rank product per adapted layer at every decode step); `merged` sends the whole model
with the adapters merged in (the driver merges, `mmrl.models.adapters.merged_state_dict`).
For each model size and mode, one Ray rollout worker (the HF engine) and the driver's LoRA
copy: the sync (build the payload on the driver, one copy into Ray's object store, the worker
loads it) and one rollout of the default recipe's batch (16 prompts x 8 responses, at most 16
new tokens), each the median of R repeats. Printed: payload MB, sync ms, rollout ms, and their
sum per step, per mode.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

SIZES = {
    "tiny": {},  # the built-in tiny Qwen2-VL (~0.5M parameters)
    "wide": {
        "hidden_size": 512,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 4,
        "intermediate_size": 1536,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--sizes", default="tiny,wide")
    args = parser.parse_args()

    import ray

    from mmrl.config import load_config
    from mmrl.datasets.procedural import make_samples
    from mmrl.distributed.ray_backend import RolloutPool, RolloutWorker
    from mmrl.models.adapters import apply_lora, merged_state_dict
    from mmrl.models.loading import load_policy, make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm
    from mmrl.rollout.hf import SamplingParams

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    samples = make_samples(["colour_code"], 16, "train")
    params = SamplingParams(n=8, max_new_tokens=16)
    rows = []
    for size in args.sizes.split(","):
        spec = TinyVLMSpec(**SIZES[size])
        folder = Path(tempfile.mkdtemp()) / "model"
        tiny = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
        tiny.model.save_pretrained(folder)
        tiny.processor.save_pretrained(folder)
        n_params = sum(p.numel() for p in tiny.model.parameters())
        for mode in ("adapters", "merged"):
            cfg = load_config("vision_reasoning", overrides=[f"model.lora_rank={args.rank}",
                                                             f"trainer.lora_sync={mode}"])  # fmt: skip
            driver = load_policy(folder)
            torch.manual_seed(0)
            driver.model = apply_lora(driver.model, cfg)
            for name, p in driver.model.named_parameters():  # trained adapters: B no longer 0
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.02)
            worker = ray.remote(RolloutWorker).options(num_cpus=1).remote(cfg, str(folder), 1, 1)
            pool = RolloutPool(ray, [worker], ["rollout worker 0"], tiny.pad_token_id)

            def payload(model=driver.model, mode=mode):
                if mode == "adapters":
                    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}
                return merged_state_dict(model)

            syncs, rollouts, mb = [], [], 0.0
            pool.generate(samples[:2], SamplingParams(n=2, max_new_tokens=4))  # warm-up
            for _ in range(args.repeats):
                start = time.perf_counter()
                weights = payload()
                pool.load_weights(weights, adapters=mode == "adapters")
                syncs.append(time.perf_counter() - start)
                mb = sum(v.numel() * v.element_size() for v in weights.values()) / 1e6
                start = time.perf_counter()
                pool.generate(samples, params)
                rollouts.append(time.perf_counter() - start)
            ray.kill(worker)
            sync, rollout = statistics.median(syncs) * 1e3, statistics.median(rollouts) * 1e3
            rows.append((size, n_params, mode, mb, sync, rollout))
    ray.shutdown()
    print(
        f"{'model':6} {'params':>9} {'mode':9} {'payload MB':>10} {'sync ms':>8} {'rollout ms':>10} {'sum ms':>8}"
    )
    for size, n, mode, mb, sync, rollout in rows:
        print(f"{size:6} {n:9,d} {mode:9} {mb:10.2f} {sync:8.1f} {rollout:10.1f} {sync + rollout:8.1f}")


if __name__ == "__main__":
    main()
