"""Test-only verifiers for the verifier pool's fault tests: they report their worker's pid, wait,
die, ignore time-outs the way libraries do, or hang in C code. A response selects the behaviour:

- `"pid:<file>"`: write this process's pid to `<file>`, then wait until `<file>.go` exists
  (a test kills or signals the worker meanwhile), then score 1;
- `"die"`: the worker kills itself with SIGKILL (like the OOM killer);
- `"swallow"` / `"swallow_all"`: sleep past the time limit inside `try/except Exception` (as
  math-verify and SymPy do) / a bare `except:`, then claim a correct answer;
- `"hang"`: hang with the timer signal blocked (as if stuck in C code);
- `"modules"`: score 1, with components saying whether torch / transformers are loaded here;
- anything else: score 1.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.math import MathVerifier
from mmrl.verifiers.registry import Verifier, register_verifier


def _ok() -> VerifierResult:
    return VerifierResult(score=1.0, components={"accuracy": 1.0})


@register_verifier("fault")
class Fault(Verifier):
    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        if response.startswith("pid:"):
            path = Path(response[4:])
            path.write_text(str(os.getpid()))
            go = Path(str(path) + ".go")
            while not go.exists():
                time.sleep(0.01)
            return _ok()
        if response == "modules":
            loaded = {name: float(name in sys.modules) for name in ("torch", "transformers")}
            return VerifierResult(score=1.0, components=loaded)
        if response == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if response == "swallow":
            try:
                time.sleep(60)
            except Exception:  # noqa: BLE001 - what math-verify does around SymPy
                pass
            return _ok()
        if response == "swallow_all":
            try:
                time.sleep(60)
            except:  # noqa: E722 - a library that catches everything
                pass
            return _ok()
        if response == "hang":
            # Like SymPy stuck in C code: the verifier's timer signal never gets through.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)
        return _ok()


@register_verifier("die_on_marked")
class DieOnMarked(MathVerifier):
    """The math verifier, except that its worker process is SIGKILLed (like the OOM killer
    would) on samples with `extra_info["die"]`."""

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        if sample.extra_info.get("die"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().score(response, sample, context)


if os.environ.get("MMRL_TEST_FAIL_IN_WORKERS") == "1":
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        raise ImportError("this plugin fails to import in verifier workers (test)")
