"""Saving Hugging Face models and pipelines without importing DeepSpeed for nothing.

transformers' `save_pretrained` first unwraps the model with accelerate's
`extract_model_from_parallel`, and that function imports DeepSpeed (installed with mmrl's
`distributed` extra) only to ask whether the model is a `DeepSpeedEngine`. In a run that does
not use DeepSpeed, the first checkpoint, base or final save of every process paid for that
import: 1.5 CPU-seconds on the 2-core machine (measured), and a line on the console ("Setting
accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.").

A model can only be a `DeepSpeedEngine` once DeepSpeed has been imported, so
`skip_unused_deepspeed_probe` makes that one check answer from what is imported: with DeepSpeed
imported it asks accelerate as before, without it the answer is no. Nothing else in accelerate
changes (its other modules hold their own reference to `is_deepspeed_available`). The training
entry points call it (`mmrl.train.grpo.train`, and `holding_the_run_dir` for flow-GRPO and the
decoupled generator). Tested in `tests/test_models.py`.
"""

from __future__ import annotations

import sys


def skip_unused_deepspeed_probe() -> None:
    """Make accelerate's unwrapping ask about DeepSpeed only when it is imported (idempotent)."""
    try:
        from accelerate.utils import other
    except ImportError:  # no accelerate: transformers unwraps without it
        return
    asks = other.is_deepspeed_available
    if getattr(asks, "mmrl_imported_only", False):
        return

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and asks()

    is_deepspeed_available.mmrl_imported_only = True  # type: ignore[attr-defined]
    other.is_deepspeed_available = is_deepspeed_available
