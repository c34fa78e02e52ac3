"""The Ray backend on a real two-node cluster on this machine: a head and a second node started
with `ray start` (each its own port and resources, 2 CPUs each), joined by `mmrl train` drivers
with `trainer.ray_address` as on a real cluster.

- A run whose rollout worker and training group are placed across both nodes trains with LoRA
  (adapters synced to the rollout worker) and a model reward scored in a reward worker.
- A driver SIGKILLed at three points (inside a step after the group's update, right after a
  checkpoint, while writing one) resumes with `--resume auto` to metrics and checkpoints equal
  bit for bit to an uninterrupted run's (weights, the group's sharded optimizer state, the
  rollout worker's and the driver's random generators); its last resume runs the group on one
  training process instead of two, from the two processes' shards, and its last step equals the
  uninterrupted run's within float32 rounding.

The cluster is shared by the module's tests; each driver is a separate `mmrl train` process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray")

from mmrl.train.checkpoint import list_checkpoints  # noqa: E402
from mmrl.train.sharded import read_sharded  # noqa: E402
from tests.conftest import same_checkpoint_state  # noqa: E402

pytestmark = pytest.mark.slow

PLUGINS = Path(__file__).parent / "plugins"
RAY = str(Path(sys.executable).parent / "ray")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONSAFEPATH="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        RAY_AUTH_MODE="disabled",  # a throw-away local cluster: no token to share between its nodes
        PYTHONPATH=os.pathsep.join([str(PLUGINS), *filter(None, [os.environ.get("PYTHONPATH")])]),
        **extra,
    )


def _wait_for_nodes(address: str, n: int, node: subprocess.Popen, failed) -> None:
    """Until `n` nodes of the cluster at `address` are alive, while `node` (the `ray start`
    process) runs (`failed()`: the message if it ends). One probe process joins the cluster and
    watches `ray.nodes()`; it is started again only if it could not join yet (each start imports
    Ray: a process per poll cost a CPU-second each). Two minutes at most: a node that runs but
    never joins fails the fixture instead of hanging the suite."""
    deadline = time.monotonic() + 120
    probe = (
        "import ray, time\nray.init(address=%r, logging_level='ERROR')\n"
        "while sum(x['Alive'] for x in ray.nodes()) < %d:\n    time.sleep(0.2)"
    )
    while True:
        watcher = subprocess.Popen([sys.executable, "-c", probe % (address, n)], env=_env(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            while watcher.poll() is None:
                assert node.poll() is None, failed()
                assert time.monotonic() < deadline, f"{n} node(s) not alive after 2 minutes: {failed()}"
                time.sleep(0.2)
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait()
        if watcher.returncode == 0:
            return
        assert node.poll() is None, failed()
        assert time.monotonic() < deadline, f"{n} node(s) not alive after 2 minutes: {failed()}"
        time.sleep(1)  # the node is not ready to be joined yet


@pytest.fixture(scope="module")
def cluster():
    """A head and a second node (2 CPUs each); yields the head's address. `ray start --block`
    stops its node's processes when it is terminated."""
    # Ray's sockets live under the temp dir and a Unix socket path has at most 107 bytes: pytest's
    # own folders (/tmp/pytest-of-<user>/pytest-<n>/popen-gw0/...) leave the second node's object
    # store too little, so the cluster gets a short folder of its own.
    temp = Path(tempfile.mkdtemp(prefix="mmrl-ray-", dir="/tmp"))
    port = _port()

    def own_ports() -> list[str]:
        # Every port a node listens on, free ones chosen here: two nodes on one machine (and any
        # other Ray a parallel test runs) would otherwise meet on Ray's fixed defaults.
        return [f"--dashboard-agent-listen-port={_port()}", f"--dashboard-agent-grpc-port={_port()}",
                f"--node-manager-port={_port()}", f"--object-manager-port={_port()}",
                f"--metrics-export-port={_port()}", f"--runtime-env-agent-port={_port()}"]  # fmt: skip

    common = ["--block", "--num-cpus=2", "--disable-usage-stats", "--object-store-memory=200000000"]
    head = [RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", f"--dashboard-port={_port()}",
            f"--ray-client-server-port={_port()}", f"--temp-dir={temp}", '--resources={"head_node": 1}',
            *common, *own_ports()]  # fmt: skip
    logs = [temp / "head.log", temp / "second.log"]

    def start(cmd: list[str], log) -> subprocess.Popen:
        with open(log, "w") as out:
            return subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT)

    def failed(k: int) -> str:
        return f"the Ray {('head', 'second node')[k]} did not start:\n{logs[k].read_text()[-3000:]}"

    nodes = [start(head, logs[0])]
    address = f"127.0.0.1:{port}"
    try:
        _wait_for_nodes(address, 1, nodes[0], lambda: failed(0))
        second = [RAY, "start", f"--address={address}", '--resources={"second_node": 1}',
                  *common, *own_ports()]  # fmt: skip
        nodes.append(start(second, logs[1]))
        _wait_for_nodes(address, 2, nodes[1], lambda: failed(1))
        yield address
    finally:
        for node in reversed(nodes):
            node.terminate()
            node.wait()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mmrl.models.loading import make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm

    spec, path = TinyVLMSpec(), tmp_path_factory.mktemp("model")
    policy = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
    policy.model.save_pretrained(path)
    policy.processor.save_pretrained(path)
    return path


# `mmrl train` (mmrl.cli.main) in a process that SIGKILLs itself at one point given by
# MMRL_TEST_KILL: `mid_step:<n>` (the group has updated step n's weights and the driver and rollout
# worker have them; nothing logged or saved), `after_checkpoint:<n>` (checkpoint n complete),
# `in_checkpoint:<n>` (checkpoint n's files written into its temporary folder, no manifest yet).
DRIVER = r"""
import os, signal, sys
from mmrl.heap import imports_without_gc
with imports_without_gc():  # as `mmrl train` imports the trainer
    import mmrl.distributed.ray_backend as rb
    import mmrl.train.checkpoint as ck
    import mmrl.train.grpo as grpo
    from mmrl.cli import main

kind, _, at = os.environ.get("MMRL_TEST_KILL", "none:0").partition(":")
at = int(at)

def die():
    os.kill(os.getpid(), signal.SIGKILL)

update_fn = rb.RayTrainee.update_policy
def update_policy(self, *a, **kw):
    out = update_fn(self, *a, **kw)
    if kind == "mid_step" and self.scheduler.last_epoch + 1 == at:  # the schedule steps after it
        die()
    return out
rb.RayTrainee.update_policy = update_policy

start_fn = grpo.start_write_checkpoint
def start_write_checkpoint(cfg, t, sampler, progress, run_dir, background=False):
    out = start_fn(cfg, t, sampler, progress, run_dir, background)
    if kind == "after_checkpoint" and progress.step == at:
        out.wait()
        die()
    return out
grpo.start_write_checkpoint = start_write_checkpoint

sha_fn = ck._sha256
def _sha256(path):
    if kind == "in_checkpoint" and f".tmp_step_{at:08d}" in str(path):
        die()
    return sha_fn(path)
ck._sha256 = _sha256

sys.exit(main(sys.argv[1:]))
"""


def _train(args: list[str], kill: str = "none:0") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", DRIVER, "-v", "train", *args],
        env=_env(MMRL_TEST_KILL=kill),
        capture_output=True,
        text=True,
    )


def _metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without wall-clock figures (the only thing that may differ)."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.append({k: v for k, v in record.items() if not k.startswith(("time/", "throughput/"))})
    return rows


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"weight {key} differs"
    # The schedule, the sampler, the counters, the driver's and the rollout worker's random
    # generators; the group's weights and optimizer state (sharded, each process's own).
    same_checkpoint_state(a, b, a.name)


def test_a_ray_run_resumes_exactly_after_sigkill_at_three_points_then_on_one_training_process(
    cluster, model_dir, tmp_path
):
    args = [
        f"model.path={model_dir}",
        f"trainer.ray_address={cluster}",
        "trainer.backend=ray",
        "trainer.train_workers=2",
        "trainer.ray_cpus_per_actor=0.5",
        "trainer.total_steps=3",
        "trainer.checkpoint_every=1",
        "trainer.keep_last=0",
        "trainer.prompts_per_step=4",
        "rollout.group_size=4",
        "trainer.eval_size=8",
        "trainer.eval_every=1",
        "trainer.progress=false",
        "trainer.save_final=false",
        "reward.num_workers=0",
        # OCR scores by edit distance: the random model's answers get rewards that differ within
        # a group, so every step has a gradient (and optimizer state to checkpoint).
        "data.kinds=[ocr]",
    ]
    whole = _train([*args, f"trainer.run_dir={tmp_path / 'whole'}"])
    assert whole.returncode == 0, whole.stderr[-3000:]

    run = tmp_path / "killed"
    args = [*args, f"trainer.run_dir={run}"]
    # 1. Killed inside step 2, after the group's update: checkpoint 1 exists, step 2 never logged.
    first = _train(args, kill="mid_step:2")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert [c.step for c in list_checkpoints(run)] == [1]
    assert max(r["step"] for r in _metrics(run)) == 1
    # 2. Resumed (taking over the dead driver's run-directory lock), killed right after checkpoint 2.
    second = _train(["--resume", "auto", *args], kill="after_checkpoint:2")
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "step_00000001" in second.stderr
    assert "no longer running" in second.stderr  # the lock of the killed driver was taken over
    assert [c.step for c in list_checkpoints(run)] == [1, 2]
    # 3. Resumed, killed while writing the last checkpoint (3): a temporary folder is left.
    third = _train(["--resume", "auto", *args], kill="in_checkpoint:3")
    assert third.returncode == -signal.SIGKILL, third.stderr[-3000:]
    assert "step_00000002" in third.stderr
    assert [c.step for c in list_checkpoints(run)] == [1, 2]
    assert list((run / "checkpoints").glob(".tmp_step_00000003_*"))
    # 4. Resumed to the end on ONE training process instead of two: it reads both processes'
    #    shards of checkpoint 2 (weights and optimizer state); the leftover is removed and step 3
    #    is computed again.
    last = _train(["--resume", "auto", *args, "trainer.train_workers=1"])
    assert last.returncode == 0, last.stderr[-3000:]
    assert "trainer.train_workers changed: 2 -> 1" in last.stderr
    assert [c.step for c in list_checkpoints(run)] == [1, 2, 3]

    got, want = _metrics(run), _metrics(tmp_path / "whole")
    assert [r["step"] for r in got] == [r["step"] for r in want]  # no line lost, none repeated
    assert [r for r in got if r["step"] < 3] == [r for r in want if r["step"] < 3]  # bit for bit
    assert [r["step"] for r in got if "reward/mean" in r] == [1, 2, 3]
    # Step 3 on one process (its update and evaluation): the same rollouts (the rollout worker's
    # weights and generator were restored exactly), and the loss, KL, gradient norm and everything
    # after them within float32 rounding of the two processes' (their sums run in another order).
    for a, b in zip(got, want):
        if a["step"] == 3:
            assert a.keys() == b.keys()
            for key, value in b.items():
                assert a[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    _assert_same_checkpoint(run / "checkpoints/step_00000002", tmp_path / "whole/checkpoints/step_00000002")
    a, b = run / "checkpoints/step_00000003", tmp_path / "whole/checkpoints/step_00000003"
    sa, sb = read_sharded(a / "sharded"), read_sharded(b / "sharded")
    assert sa["optimizer"]["state"].keys() == sb["optimizer"]["state"].keys() and sa["model"]
    for name, weight in sb["model"].items():
        torch.testing.assert_close(sa["model"][name], weight, rtol=0, atol=1e-6, msg=name)
        for moment in ("exp_avg", "exp_avg_sq"):
            want_m = sb["optimizer"]["state"][name][moment]
            torch.testing.assert_close(sa["optimizer"]["state"][name][moment], want_m, rtol=1e-3,
                                       atol=1e-3 * float(want_m.abs().max()) + 1e-12, msg=f"{name} {moment}")  # fmt: skip


def test_a_lora_run_with_a_model_reward_trains_across_two_nodes(cluster, model_dir, tmp_path):
    from mmrl.datasets.procedural import make_samples
    from mmrl.datasets.readers import write_jsonl

    samples = make_samples(["ocr"], 16, "train")
    for s in samples:
        s.reward_model.models = [{"name": "brevity", "weight": 0.5}]
    write_jsonl(samples, tmp_path / "train.jsonl")
    write_jsonl(samples[:4], tmp_path / "heldout.jsonl")
    run = tmp_path / "run"
    done = _train(
        [
            f"model.path={model_dir}",
            f"trainer.ray_address={cluster}",
            f"trainer.run_dir={run}",
            f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            f"data.heldout_files=[{tmp_path / 'heldout.jsonl'}]",
            "trainer.backend=ray",
            "trainer.train_workers=2",
            # 1 CPU each: the rollout worker and the two training processes (3 CPUs, packed) cannot
            # fit on one 2-CPU node; the reward worker takes the fourth CPU.
            "trainer.ray_cpus_per_actor=1",
            "trainer.total_steps=2",
            "trainer.checkpoint_every=1",
            "trainer.async_checkpoint=true",  # checkpoint 1 in the background (the last one is not)
            "trainer.prompts_per_step=4",
            "rollout.group_size=4",
            "trainer.eval_every=2",
            "trainer.progress=false",
            "reward.num_workers=0",
            "model.lora_rank=4",
            "optim.lr=1e-2",
            "algo.kl_coef=0.05",
            "reward.plugins=[text_rewards]",
            "reward.model_rewards.models=[{name: brevity, type: test_brevity_module}]",
            "reward.model_rewards.placement.budget_mb=0",  # offloaded around every update
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    placement = next(line for line in done.stderr.splitlines() if "placement:" in line)
    nodes = {part.rsplit("on node ", 1)[1] for part in placement.split("placement: ", 1)[1].split(", ")}
    group = {
        part.rsplit("on node ", 1)[1]
        for part in placement.split(", ")
        if "rollout" in part or "training" in part
    }
    assert len(nodes) == 2 and len(group) == 2, placement  # the run's groups span both nodes
    steps = [r for r in _metrics(run) if "reward/mean" in r]
    assert len(steps) == 2
    # The adapters reach the rollout worker after each update: its log-probs are the group's.
    assert all(abs(r["rollout/kl_k1"]) < 1e-5 for r in steps) and all(r["actor/grad_norm"] > 0 for r in steps)
    assert all(r["actor/ref_kl"] >= 0 for r in steps) and steps[1]["actor/ref_kl"] > 0  # base vs adapters
    # The model reward (scored in the reward worker: the driver holds no reward model on Ray) was
    # added to the reward, and its model moved to the host and back around each update.
    for r in steps:
        assert r["reward/model/brevity"] > 0 and r["reward/model/brevity/chars"] > 0
        assert r["reward/mean"] == pytest.approx(r["reward/accuracy"] + r["reward/model/total"], abs=1e-5)
        assert r["reward_models/resident/brevity"] == 0.0
    assert steps[1]["reward_models/moves"] > steps[0]["reward_models/moves"] > 0
    # Checkpoint 1, written in the background by the two processes on two nodes (each its own
    # shards, the collectives on a gloo group of their own) while step 2 ran: complete, and its
    # sharded adapters are the ones the driver saved in Hugging Face format at that step.
    from safetensors.torch import load_file

    from mmrl.train.checkpoint import verify_checkpoint

    assert [c.step for c in list_checkpoints(run)] == [1, 2]
    first = run / "checkpoints" / "step_00000001"
    assert verify_checkpoint(first) is None
    assert sorted(p.name for p in (first / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    sharded = read_sharded(first / "sharded")
    hf = load_file(first / "model" / "adapter_model.safetensors")
    assert len(sharded["model"]) == len(hf) > 0 and all(".lora_" in k for k in sharded["model"])
    for key, value in hf.items():
        name = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        )
        assert torch.equal(sharded["model"][name], value), key
    assert sharded["optimizer"]["state"].keys() == sharded["model"].keys()  # Adam moments of each adapter
    # LoRA's outputs: the adapters alone (a peft adapter folder) and the merged model, each loaded
    # the usual way: the base with the adapters merged by peft equals the merged export.
    from peft import PeftModel

    from mmrl.models.loading import load_policy

    merged = load_policy(run / "final").model.state_dict()
    by_peft = PeftModel.from_pretrained(
        load_policy(model_dir).model, run / "final_adapter"
    ).merge_and_unload()
    by_peft = by_peft.state_dict()
    assert by_peft.keys() == merged.keys()
    for key, value in merged.items():
        torch.testing.assert_close(by_peft[key], value, rtol=0, atol=1e-6, msg=key)
    assert (
        max(float((merged[k] - v).abs().max()) for k, v in load_policy(model_dir).model.state_dict().items())
        > 0
    )
