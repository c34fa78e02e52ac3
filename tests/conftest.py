"""Shared fixtures. Nothing here touches a model hub: every model is built from config."""

from __future__ import annotations

import gc
import os
from pathlib import Path

# The garbage collector stays off while the test process imports torch, transformers and every
# test module (its full passes over that growing heap were a third of the 10.6 CPU-seconds a
# collection took, measured), then the heap is frozen and it comes back on: `_settle_heap`.
gc.disable()

from mmrl.distributed import torch_extensions_dir  # noqa: E402
from mmrl.heap import freeze_heap  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DeepSpeed builds its C++ ops on first use (a communication op at its first `initialize`, ~50 s
# on the CPU): one folder per virtual environment (as the Makefile's), so every later test run,
# and every process of one, reuses them.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())

import pytest  # noqa: E402
import torch  # noqa: E402

from mmrl.models.loading import Policy, make_policy  # noqa: E402
from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm  # noqa: E402


@pytest.fixture(scope="session")
def mmrl_cache(tmp_path_factory) -> str:
    """One cache folder for built-in bases per test run (also seen by subprocesses). Under
    pytest-xdist the workers share it: the first to need a base builds it, the others wait for
    it (`mmrl.models.base.builtin_base` holds a file lock while it builds)."""
    path = os.environ.get("MMRL_TEST_CACHE")
    if not path:
        root = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            root = root.parent  # the run's folder, above each worker's own
        path = str(root / "mmrl-cache")
        os.makedirs(path, exist_ok=True)
    os.environ["MMRL_CACHE"] = path
    return path


@pytest.fixture()
def tiny_policy() -> Policy:
    """A random tiny Qwen2-VL (seeded)."""
    spec = TinyVLMSpec()
    return make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))


def bias_stop_token(policy: Policy, bias: float = 5.6) -> Policy:
    """The policy with an LM head bias on its stop token (in place): at 5.6 about half of a random
    tiny model's draws are the stop token, so its turns end within a few tokens (multi-turn
    tests); at 50 every greedy turn is the stop token alone."""
    old = policy.model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[policy.stop_token_ids[0]] = bias
    policy.model.lm_head = head
    return policy


def same_state(a, b, where: str = "") -> None:
    """Nested training states equal bit for bit (tensors with torch.equal and the same dtype,
    NumPy arrays by bytes, the rest with ==)."""
    import numpy as np

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def same_checkpoint_state(a, b, where: str = "") -> None:
    """Two checkpoint folders' training states equal bit for bit: `trainer_state.pt`, and the
    sharded weights and optimizer state where they have them (`mmrl.train.sharded`)."""
    from mmrl.train.checkpoint import load_trainer_state
    from mmrl.train.sharded import SHARDED, read_sharded

    same_state(load_trainer_state(a), load_trainer_state(b), where)
    assert (a / SHARDED).is_dir() == (b / SHARDED).is_dir(), where
    if (a / SHARDED).is_dir():
        same_state(read_sharded(a / SHARDED), read_sharded(b / SHARDED), f"{where}/{SHARDED}")


_THREADS = 0  # torch's thread count for every test; set in pytest_configure


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts from seed 0 and the process's thread count: a run with
    `trainer.threads=N` sets torch's threads for the whole process, and a later learning test's
    numbers would otherwise depend on which tests ran before it in the same worker."""
    torch.manual_seed(0)
    yield
    if torch.get_num_threads() != _THREADS:
        torch.set_num_threads(_THREADS)


# Under pytest-xdist (`make test` runs `pytest -n 2 --dist loadgroup`) tests are spread over the
# workers one by one, except these modules: each builds something costly once for all of its
# tests (a training run, a Ray cluster, a server process, DeepSpeed's saved steps), so all of a
# module's tests go to one worker instead of each worker building it again.
KEEP_TOGETHER = {
    "test_training.py",
    "test_trackers.py",
    "test_distributed_ray.py",
    "test_distributed_ray_cluster.py",
    "test_distributed_multistep.py",
    "test_deepspeed.py",
    "test_server.py",
    "test_server_guard.py",
    "test_flow_training.py",
    "test_cli.py",
    "test_eval_runner.py",
    "test_rewards_vlm_judge.py",
}


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown when xdist is not loaded (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` keeps each KEEP_TOGETHER module on one worker and spreads every other
    test on its own. xdist's own loadgroup reads an `xdist_group` mark into the node id by
    assigning `item._nodeid`, which pytest 9 no longer reads (the node id lives in `item._id`),
    so with these pins it grouped nothing: each worker built the modules' fixtures again (the
    80-step training run of test_training.py twice). Here the scheduler itself decides the
    groups from the node id's file."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class KeepTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return file if file.rsplit("/", 1)[-1] in KEEP_TOGETHER else nodeid

    return KeepTogether(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """Slow tests first (a stable sort: each file's order kept): xdist hands out single tests in
    collection order, so a learning run collected last (tests/test_vlm_families.py's) would start
    when the other workers are done and leave them idle; longest first balances the workers."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _settle_heap() -> None:
    """What is built by now (torch, transformers, every test module: about 560,000 objects)
    lives as long as the test process; frozen out of the garbage collector's view, the full
    passes that the tests' own garbage triggers walk only that garbage (`mmrl.heap`)."""
    freeze_heap()
    gc.enable()


def pytest_collection_finish(session) -> None:
    _settle_heap()


def pytest_configure(config) -> None:
    # Each xdist worker takes its share of the cores for torch (two workers on two cores: one
    # thread each), instead of every worker starting one thread per core.
    global _THREADS
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        # The processes a test starts (`mmrl train` runs, DeepSpeed and FSDP groups, Ray nodes)
        # take the same share: with torch's default of one thread per core, each spun on cores
        # the other worker held. Measured on the 2-core machine, the files of subprocess runs
        # (test_reliability, test_interrupts, test_flow_resume, test_faults_pool) on two
        # workers: 252 CPU-seconds and 145 s with two threads each, 220 and 127 with one.
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
    _THREADS = torch.get_num_threads()
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        _settle_heap()  # the xdist controller, which collects nothing: its imports are done


def assert_no_prompt_lost_or_trained_twice(run: Path, steps: int) -> dict[int, dict]:
    """An asynchronous run's lineage (`async_prompts.jsonl`, each step's last record: a resumed
    run redoes the steps after its checkpoint): every prompt drawn was trained, dropped or
    filtered exactly once, or is still in flight in the last checkpoint (step `steps`). Returns
    the records by step."""
    import json

    from mmrl.train.async_grpo import PROMPTS_LOG

    records = {}
    for line in (run / PROMPTS_LOG).read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    assert sorted(records) == list(range(1, steps + 1))
    used = [d for r in records.values() for d in r["trained"] + r["dropped"] + r["filtered"]]
    assert len(used) == len(set(used)), "a prompt was trained twice"
    final = torch.load(run / "checkpoints" / f"step_{steps:08d}" / "trainer_state.pt", weights_only=False)
    still = {k[0] for k in final["async_stream"]["in_flight"]}
    drawn = final["async_stream"]["sampler"]["drawn"]
    assert set(used) | still == set(range(drawn)) and not set(used) & still, "a prompt was lost"
    return records
