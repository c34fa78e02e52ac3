"""The before/after pictures of the docs, from a run directory's evaluation grids.

    python benchmarks/eval_composite.py RUN_DIR OUT.png [--rows 3] [--steps 0 80]

Takes the first `--rows` rows of `images/eval_step_<n>.png` for each step (the same evaluation
prompts and noise at every evaluation), stacked top to bottom with a white gap between steps,
and prints which grids it used. `docs/images/geneval_before_after.png` is
`python benchmarks/eval_composite.py <run of mmrl train --task text_to_image> docs/images/geneval_before_after.png`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image


def composite(run_dir: Path, steps: list[int] | None, rows: int, tile: int = 32, gap: int = 4) -> np.ndarray:
    grids = sorted((run_dir / "images").glob("eval_step_*.png"))
    if not grids:
        raise SystemExit(f"{run_dir}/images: no eval_step_*.png (was the run evaluated?)")
    by_step = {int(p.stem.rsplit("_", 1)[1]): p for p in grids}
    chosen = steps if steps else [min(by_step), max(by_step)]
    missing = [s for s in chosen if s not in by_step]
    if missing:
        raise SystemExit(f"{run_dir}/images: no grid for steps {missing} (have {sorted(by_step)})")
    parts = []
    for k, step in enumerate(chosen):
        image = np.asarray(Image.open(by_step[step]).convert("RGB"))[: rows * tile]
        if k:
            parts.append(np.full((gap, image.shape[1], 3), 255, np.uint8))
        parts.append(image)
        print(f"step {step}: {by_step[step]} (first {rows} rows)")
    return np.concatenate(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--tile", type=int, default=32, help="pixels per image (sample.resolution)")
    parser.add_argument("--steps", type=int, nargs="*", help="evaluation steps (default: the first and last)")
    args = parser.parse_args()
    Image.fromarray(composite(args.run_dir, args.steps, args.rows, args.tile)).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
