"""Sharded checkpoints (torch DCP, `mmrl.train.sharded`) resume on another number of training
processes, and across the single-process trainer and an FSDP2 group, in both directions.

Two global batches of the tiny Qwen2-VL's own samples (as in `test_distributed_multistep.py`:
rows left out of the loss, 2 mini-batches, a KL penalty, a moving schedule). Each run applies
step 1, writes its sharded state, and goes on to step 2; each resumed run reads that state,
written by another number of processes, and applies step 2 alone. Its step 2 must equal the
uninterrupted run's: the old and reference log-probs (computed from the weights it read) to
1e-6, the loss, gradient norm and KL to float32 rounding (1e-5 relative), the weights after the
update within the group-vs-single tolerance of `test_distributed_multistep.py` (2% of one Adam
step: Adam turns rounding differences of gradients near 0 into fractions of a step).

Runs: a 2-process FSDP2 group and a 1-process one (`torchrun`, gloo on the CPU, launched by
`mmrl.distributed.one_update`) and the single-process trainer (`make_trainee`, no process
group, a plain module): 2 -> 1, 1 -> 2, 2 -> single process, single process -> 2.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmrl.config import config_to_yaml, load_config
from mmrl.datasets.procedural import make_samples
from mmrl.models.loading import load_policy
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.train.grpo import make_trainee
from mmrl.train.sharded import SHARDED, read_sharded

LR = 1e-3
COMMON = [
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "trainer.mini_batches=2",
    "trainer.micro_batch_rows=2",
    "algo.kl_coef=0.05",
    "reward.num_workers=0",
    "optim.schedule=linear",
    "trainer.total_steps=2",
    f"optim.lr={LR}",
]
PARAM_ATOL = 0.02 * LR
REL = 1e-5


def _cfg():
    return load_config("vision_reasoning", overrides=COMMON)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model in a folder and two saved global batches."""
    from mmrl.models.loading import make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm

    tmp = tmp_path_factory.mktemp("sharded")
    spec, model_dir = TinyVLMSpec(), tmp / "model"
    tiny = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
    tiny.model.save_pretrained(model_dir)
    tiny.processor.save_pretrained(model_dir)
    engine = HFRolloutEngine.from_policy(load_policy(model_dir))
    samples = make_samples(["colour_code"], 8, "train")
    paths = []
    for k in range(2):
        torch.manual_seed(k)
        batch = engine.generate(samples[4 * k : 4 * k + 4], SamplingParams(n=4, max_new_tokens=8))
        batch.response_mask[4:6] = 0
        batch.response_mask[6, 1:] = 0
        advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(10 + k))
        paths.append(tmp / f"step{k}.pt")
        torch.save({"batch": batch, "advantages": advantages, "weights": None}, paths[-1])
    (tmp / "run.yaml").write_text(config_to_yaml(_cfg()))
    return {"dir": model_dir, "paths": paths, "tmp": tmp}


def _launch(setup, nproc: int, runs: list[tuple[str, str, str]]) -> dict[str, dict]:
    """One `torchrun` launch of `nproc` processes; `runs`: (name, --load, --save-after) each."""
    tmp = setup["tmp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "mmrl.distributed.one_update", "--model", str(setup["dir"])]  # fmt: skip
    for path in setup["paths"]:
        cmd += ["--step", str(path)]
    for name, load, save in runs:
        cmd += ["--config", str(tmp / "run.yaml"), "--out", str(tmp / f"{name}.pt"), "--load", load,
                "--save-after", save]  # fmt: skip
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return {name: torch.load(tmp / f"{name}.pt", weights_only=False)["steps"] for name, _, _ in runs}


def _single(setup, save: Path | None = None, load: Path | None = None) -> list[dict]:
    """The single-process trainer: steps 1 and 2 (writing its sharded state after step 1 into
    `save`), or from `load` step 2 alone."""
    cfg = _cfg()
    t = make_trainee(cfg, load_policy(setup["dir"]))
    steps = [torch.load(p, weights_only=False) for p in setup["paths"]]
    if load is not None:
        t.load_sharded(load)
        t.scheduler.step()  # the schedule's position after step 1 (a checkpoint's scheduler state)
        steps = steps[1:]
    out = []
    for k, step in enumerate(steps):
        old, ref = t.old_and_ref_logprobs(cfg, step["batch"])
        metrics = t.update_policy(cfg, step["batch"], step["advantages"], old, ref, None)
        t.scheduler.step()
        state = {n: v.detach().clone() for n, v in t.policy.model.state_dict().items()}
        out.append({"metrics": metrics, "state_dict": state, "old_logprobs": old, "ref_logprobs": ref})
        if save is not None and k == 0:
            t.save_sharded(save)
    t.close()
    return out


def _same_step(got: dict, want: dict, what: str) -> None:
    for key in ("old_logprobs", "ref_logprobs"):
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=f"{what}: {key}")
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ref_kl"):
        a, b = got["metrics"][key], want["metrics"][key]
        assert a == pytest.approx(b, rel=REL, abs=1e-8), f"{what}: {key} {a} vs {b}"
    assert got["state_dict"].keys() == want["state_dict"].keys()
    worst = max(
        float((got["state_dict"][n].float() - want["state_dict"][n]).abs().max()) for n in want["state_dict"]
    )
    assert worst <= PARAM_ATOL, f"{what}: weights after step 2 differ by up to {worst:.2e}"


@pytest.mark.slow
def test_sharded_state_resumes_on_another_number_of_processes_and_across_backends(setup):
    tmp = setup["tmp"]
    single = _single(setup, save=tmp / "single")
    one = _launch(setup, 1, [("one", "-", f"1:{tmp / 'one'}")])["one"]
    two = _launch(setup, 2, [("two", "-", f"1:{tmp / 'two'}"), ("one_to_two", f"1:{tmp / 'one'}", "-"),
                             ("single_to_two", f"1:{tmp / 'single'}", "-")])  # fmt: skip
    two_to_one = _launch(setup, 1, [("two_to_one", f"1:{tmp / 'two'}", "-")])["two_to_one"]
    two_to_single = _single(setup, load=tmp / "two")

    # Each process wrote only its own shard: two files from the group of two, one from the others.
    assert sorted(p.name for p in (tmp / "two").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in (tmp / "one").glob("*.distcp")) == ["__0_0.distcp"]
    # The three writers' states of step 1 agree (the same update in 1 and 2 processes and alone).
    states = {name: read_sharded(tmp / name) for name in ("single", "one", "two")}
    moments = states["two"]["optimizer"]["state"]
    assert moments and all(float(m["exp_avg"].abs().max()) > 0 for m in moments.values())
    for name in ("single", "one"):
        assert states[name]["model"].keys() == states["two"]["model"].keys()
        for key, weight in states["two"]["model"].items():
            torch.testing.assert_close(states[name]["model"][key], weight, atol=PARAM_ATOL, rtol=0)

    _same_step(two_to_one[0], two["two"][1], "2 -> 1 processes")
    _same_step(two["one_to_two"][0], one[1], "1 -> 2 processes")
    _same_step(two["single_to_two"][0], single[1], "single process -> 2 processes")
    _same_step(two_to_single[0], two["two"][1], "2 processes -> single process")


def test_a_worker_count_change_is_allowed_for_a_sharded_checkpoint_and_refused_otherwise(tmp_path, caplog):
    """The resume guard: placement keys may change when the checkpoint holds the sharded state
    (and the run reads it with FSDP2); a checkpoint without it (a DeepSpeed group's, or one
    written before sharded checkpoints) keeps its placement, and the refusal says why."""
    from mmrl.train.checkpoint import save_checkpoint
    from mmrl.train.preflight import check_resume_config

    class Weights:
        def save_pretrained(self, folder: Path) -> None:
            (Path(folder) / "config.json").write_text("{}")

    def checkpoint(run: str, sharded: bool, *overrides: str) -> Path:
        cfg = load_config("vision_reasoning", overrides=["trainer.backend=ray", *overrides])

        def more(folder: Path) -> None:
            (folder / SHARDED).mkdir()
            (folder / SHARDED / ".metadata").write_bytes(b"x")

        return save_checkpoint(tmp_path / run, 1, Weights(), Weights(), {"progress": {}}, config_to_yaml(cfg),
                               write_more=more if sharded else None)  # fmt: skip

    moved = ["trainer.train_workers=2", "trainer.rollout_workers=2", "trainer.prompts_per_step=4"]
    sharded = checkpoint("sharded", True, "trainer.prompts_per_step=4")
    with caplog.at_level(logging.WARNING):
        diffs = check_resume_config(
            load_config("vision_reasoning", overrides=["trainer.backend=ray", *moved]), sharded
        )
    assert set(diffs) == {"trainer.train_workers", "trainer.rollout_workers"}
    assert "trainer.train_workers changed: 1 -> 2" in caplog.text
    # Ray -> local (the sharded state is the same files for both)
    assert set(check_resume_config(load_config("vision_reasoning", overrides=moved[2:]), sharded)) == {
        "trainer.backend"
    }
    # ... but not what the run learns, and not into a DeepSpeed group
    with pytest.raises(ValueError, match="optim.lr"):
        check_resume_config(load_config("vision_reasoning", overrides=["trainer.backend=ray", *moved, "optim.lr=1"]), sharded)  # fmt: skip
    deepspeed = ["trainer.backend=ray", "trainer.strategy=deepspeed", "trainer.prompts_per_step=4"]
    with pytest.raises(ValueError, match="trainer.strategy"):
        check_resume_config(load_config("vision_reasoning", overrides=deepspeed), sharded)

    gathered = checkpoint("gathered", False, "trainer.strategy=deepspeed", "trainer.prompts_per_step=4")
    with pytest.raises(ValueError) as info:
        check_resume_config(load_config("vision_reasoning", overrides=[*deepspeed, "trainer.train_workers=2"]), gathered)  # fmt: skip
    assert "trainer.train_workers: 1 -> 2" in str(info.value)
    assert "holds the training state sharded" in str(info.value) and "DeepSpeed" in str(info.value)


def test_a_background_checkpoint_exists_only_once_sealed_and_a_failed_one_leaves_the_last(tmp_path):
    """`start_checkpoint(background=True)` returns while the sharded files are still being
    written; the checkpoint is invisible (no step folder, no manifest, retention not run) until
    they are complete and it is sealed. A write that fails in the background is raised by
    `wait()` as a StorageError naming the cause, its temporary folder removed, the earlier
    checkpoint untouched."""
    import errno
    import threading

    from mmrl.train.checkpoint import find_resume_checkpoint, list_checkpoints, start_checkpoint
    from mmrl.train.storage import StorageError

    class Weights:
        def save_pretrained(self, folder: Path) -> None:
            (Path(folder) / "config.json").write_text("{}")

    release, sealed = threading.Event(), []

    def shards(folder: Path):
        (folder / SHARDED).mkdir()

        def written() -> None:
            assert release.wait(timeout=60)
            (folder / SHARDED / "__0_0.distcp").write_bytes(b"shard")

        return written

    config = config_to_yaml(_cfg())
    pending = start_checkpoint(tmp_path, 1, Weights(), Weights(), {"progress": {}}, config,
                               write_more=shards, background=True, then=sealed.append)  # fmt: skip
    assert not pending.done() and list_checkpoints(tmp_path) == [] and not sealed
    assert find_resume_checkpoint(tmp_path) is None
    release.set()
    folder = pending.wait()
    assert folder.name == "step_00000001" and sealed == [folder]
    assert find_resume_checkpoint(tmp_path).step == 1  # verifies: the shard is in the manifest

    def full_disk(folder: Path):
        def written() -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        return written

    failing = start_checkpoint(tmp_path, 2, Weights(), Weights(), {"progress": {}}, config,
                               write_more=full_disk, background=True)  # fmt: skip
    with pytest.raises(StorageError, match="disk is full") as info:
        failing.wait()
    assert "step_00000001 is intact" in str(info.value)
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]
    assert not list((tmp_path / "checkpoints").glob(".tmp_step_*"))


def test_a_full_disk_while_dcp_writes_is_raised_as_the_oserror_it_is(tmp_path, monkeypatch):
    """DCP wraps each rank's failure in its CheckpointException (a BaseException): a full disk
    while the shards are written is raised as the OSError it is, so the checkpoint writer names
    the path and the cause (StorageError) and keeps the earlier checkpoints."""
    import errno

    from mmrl.train.sharded import save_sharded

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()

    def full(obj, f, *args, **kwargs):  # DCP writes the optimizer's non-tensor state with torch.save
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError) as info:
        save_sharded(model, optimizer, tmp_path / "sharded")
    assert info.value.errno == errno.ENOSPC
