"""Shared fixtures. Nothing here touches a model hub: every model is built from config."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DeepSpeed builds its C++ ops on first use (a communication op at its first `initialize`, ~50 s
# on the CPU): one fixed folder, so every later test run, and every process of one, reuses them.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/mmrl/torch_extensions"))

import pytest  # noqa: E402
import torch  # noqa: E402

from mmrl.models.loading import Policy, make_policy  # noqa: E402
from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm  # noqa: E402


@pytest.fixture(scope="session")
def mmrl_cache(tmp_path_factory) -> str:
    """One cache folder for built-in bases per test session (also seen by subprocesses)."""
    path = os.environ.get("MMRL_TEST_CACHE") or str(tmp_path_factory.mktemp("mmrl-cache"))
    os.environ["MMRL_CACHE"] = path
    return path


@pytest.fixture()
def tiny_policy() -> Policy:
    """A random tiny Qwen2-VL (seeded)."""
    spec = TinyVLMSpec()
    return make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
