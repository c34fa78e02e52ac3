"""Rule-based verifiers (installed as `mmrl.verifiers`).

A verifier scores one response to one sample: `(response, sample, context) -> VerifierResult`.
Verifiers are registered by name; a sample names its own verifier in
`reward_model.verifier`. They are pure, picklable and CPU-only.
"""

# Importing the modules registers their verifiers. Python runs this file before any module of
# the package, so every import path to the registry (`mmrl.verifiers.registry`) sees them.
from mmrl.verifiers import detection as _detection  # noqa: F401
from mmrl.verifiers import env as _env  # noqa: F401
from mmrl.verifiers import geneval as _geneval  # noqa: F401
from mmrl.verifiers import math as _math  # noqa: F401
from mmrl.verifiers import text as _text  # noqa: F401
from mmrl.verifiers.registry import Verifier, get_verifier, register_verifier, verifier_names

__all__ = ["Verifier", "get_verifier", "register_verifier", "verifier_names"]
