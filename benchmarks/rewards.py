"""Scoring throughput of each reward model (images/s) at batch sizes 1, 8 and 32 on this machine.

    python benchmarks/rewards.py                    # every model; tiny CLIPs / judge
    python benchmarks/rewards.py --models jpeg_compressibility ocr --batch-sizes 1 8
    python benchmarks/rewards.py --real-size        # + aesthetic/clip_score on a random ViT-L/14

Every model loads from files on disk as in training (tiny random checkpoints written to a
temporary folder by `mmrl.rewards.testing`; `--real-size` writes a random ViT-L/14 open_clip
checkpoint, 1.7 GB, for the real compute of the aesthetic predictor). Images are 256x256 and
look like generated images (smooth colour fields with detail); OCR images carry rendered text.
Each figure is the best of the calls repeated for `--min-time` seconds, after one untimed
warm-up call; the last column is the speed-up over batch size 1 (the baseline, measured side
by side). The machine is shared: take the best of calls, not the mean.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from mmrl.rewards import RewardModel, get_reward_model  # noqa: E402
from mmrl.rewards import testing as T  # noqa: E402

OCR_THREADS = -1
ALL = [
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "aesthetic",
    "clip_score",
    "pickscore",
    "ocr",
    "vlm_judge",
]


def make_images(n: int, size: int = 256, seed: int = 0, text: bool = False) -> list[Image.Image]:
    """Smooth colour gradients with some noise; with `text`, a rendered word on top."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    images = []
    for i in range(n):
        a, b, c = rng.random(3)
        base = np.stack([a * xx + (1 - a) * yy, b * yy, c * (1 - xx)], -1)
        arr = np.clip(base + 0.05 * rng.standard_normal(base.shape), 0, 1)
        image = Image.fromarray((arr * 255).astype(np.uint8))
        if text:
            ImageDraw.Draw(image).text(
                (16, size // 2 - 24), f"Sale {i % 10}0%", fill="white", font=ImageFont.load_default(size=40)
            )
        images.append(image)
    return images


def build(name: str, folder: Path, real_size: bool) -> RewardModel:
    if name in ("aesthetic", "clip_score"):
        clip = folder / ("vit_l" if real_size else "open_clip")
        if not clip.exists():
            if real_size:
                save_random_open_clip(clip, "ViT-L-14-quickgelu")
            else:
                T.save_tiny_open_clip(clip)
        if name == "clip_score":
            return get_reward_model("clip_score", clip_model=str(clip))
        embed = 768 if real_size else T.TINY_OPEN_CLIP_CONFIG["embed_dim"]
        head = T.save_random_aesthetic_head(folder / f"head{embed}.pth", embed)
        return get_reward_model("aesthetic", clip_model=str(clip), head_weights=head)
    if name == "pickscore":
        hf = folder / "hf_clip"
        if not hf.exists():
            T.save_tiny_hf_clip(hf)
        return get_reward_model("pickscore", clip_model=str(hf))
    if name == "vlm_judge":
        from mmrl.models.loading import make_policy
        from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm

        spec = TinyVLMSpec()
        policy = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
        return get_reward_model("vlm_judge", policy=policy, max_new_tokens=16)
    if name == "ocr":
        return get_reward_model("ocr", num_threads=OCR_THREADS)
    return get_reward_model(name)


def save_random_open_clip(folder: Path, model_name: str) -> None:
    """A random open_clip model of a real architecture, saved in the open_clip hub layout."""
    import json

    import open_clip

    folder.mkdir(parents=True, exist_ok=True)
    cfg = open_clip.get_model_config(model_name)
    (folder / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": cfg, "preprocess_cfg": {"mean": T.CLIP_MEAN, "std": T.CLIP_STD}})
    )
    model = open_clip.create_model(model_name, pretrained=None)
    torch.save(model.state_dict(), folder / "open_clip_pytorch_model.bin")


def measure(model: RewardModel, name: str, batch: int, min_time: float) -> float:
    """Images/s: the best of timed calls repeated for at least `min_time` seconds (at least one;
    the best call is the one least disturbed by other load on a shared machine)."""
    images = make_images(batch, text=(name == "ocr"))
    prompts = [f'a poster that says "Sale {i % 10}0%"' for i in range(batch)]
    kwargs: dict = {"images": images}
    if name in ("clip_score", "pickscore", "ocr", "vlm_judge"):
        kwargs["prompts"] = prompts
    best = float("inf")
    start_all = time.perf_counter()
    while time.perf_counter() - start_all < min_time or best == float("inf"):
        start = time.perf_counter()
        model.score(**kwargs)
        best = min(best, time.perf_counter() - start)
    return batch / best


def warm_up(model: RewardModel, name: str) -> None:
    """One call on one image first: lazy sessions, caches and allocator warm-up are not timed."""
    kwargs: dict = {"images": make_images(1, text=(name == "ocr"))}
    if name in ("clip_score", "pickscore", "ocr", "vlm_judge"):
        kwargs["prompts"] = ['a poster that says "Sale 0%"']
    model.score(**kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=ALL, choices=ALL)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--min-time", type=float, default=3.0, help="seconds of timed calls per figure")
    parser.add_argument("--real-size", action="store_true", help="aesthetic/clip_score on a random ViT-L/14")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch and onnxruntime threads (0: their defaults). On a 2-core machine shared with "
        "other jobs, 2 threads stall waiting for the busy core (a tiny CLIP call: 1.6 ms with 1 "
        "thread, 230 ms with 2, measured at load average 7)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global OCR_THREADS
    OCR_THREADS = args.threads or -1
    load = os.getloadavg()[0]
    print(f"torch threads: {torch.get_num_threads()}, cpu cores: {os.cpu_count()}, load average: {load:.1f}")
    header = f"{'reward model':<24}{'MB':>8}" + "".join(f"{'bs ' + str(b):>12}" for b in args.batch_sizes)
    print(header + f"{'x bs ' + str(args.batch_sizes[-1]) + '/1':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model = build(name, Path(tmp), args.real_size)
            warm_up(model, name)
            rates = [measure(model, name, b, args.min_time) for b in args.batch_sizes]
            label = name + (" (ViT-L/14)" if args.real_size and name in ("aesthetic", "clip_score") else "")
            cells = "".join(f"{r:>10.1f}/s" for r in rates)
            print(
                f"{label:<24}{model.memory_bytes() / 1e6:>8.1f}{cells}{rates[-1] / rates[0]:>12.2f}",
                flush=True,
            )
            del model


if __name__ == "__main__":
    main()
