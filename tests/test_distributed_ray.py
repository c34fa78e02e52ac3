"""The Ray backend on a local 2-CPU cluster: the built-in task trains with two rollout workers, two
reward workers and a two-process training group, with the local backend's metrics and run
directory; responses are spread over the reward workers and a killed one is replaced; a dead
rollout worker is reported by name."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from mmrl.compose import train  # noqa: E402
from mmrl.config import load_config  # noqa: E402
from mmrl.datasets.procedural import make_samples  # noqa: E402
from mmrl.distributed.ray_backend import RayCluster, RayRouter, RolloutPool, RolloutWorker  # noqa: E402
from mmrl.distributed.reward_worker import RewardWorker  # noqa: E402
from mmrl.rollout.hf import SamplingParams  # noqa: E402
from mmrl.router import Router  # noqa: E402
from mmrl.types import VerifyContext  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = [
    "trainer.total_steps=3",
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "trainer.eval_size=16",
    "trainer.eval_every=2",
    "trainer.checkpoint_every=2",
    "trainer.progress=false",
    "reward.num_workers=1",
    # OCR scores by edit distance, so even the random model's answers get rewards that differ
    # within a group: every step has a gradient and the weight sync below is really tested.
    "data.kinds=[ocr]",
]


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))  # fmt: skip
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2-VL in a folder (every actor loads the policy from its folder)."""
    from mmrl.models.loading import make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm

    spec, path = TinyVLMSpec(), tmp_path_factory.mktemp("model")
    policy = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
    policy.model.save_pretrained(path)
    policy.processor.save_pretrained(path)
    return path


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_builtin_task_trains_on_ray_with_the_local_backends_metrics_and_run_dir(
    local_ray, model_dir, tmp_path
):
    common = [*SMALL, f"model.path={model_dir}"]
    local = train(
        load_config("vision_reasoning", overrides=[*common, f"trainer.run_dir={tmp_path / 'local'}"])
    )
    on_ray = train(
        load_config(
            "vision_reasoning",
            overrides=[
                *common,
                f"trainer.run_dir={tmp_path / 'ray'}",
                "trainer.backend=ray",
                "trainer.rollout_workers=2",
                "trainer.train_workers=2",
                "trainer.reward_workers=2",
                "trainer.ray_cpus_per_actor=0.25",
            ],
        )  # fmt: skip
    )
    assert on_ray.steps == 3 and not on_ray.interrupted
    # The same files in the run directory, and the same metric names at every step.
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "training_curves.png", "final/config.json",
                 "tensorboard", "checkpoints/step_00000002/manifest.json"):  # fmt: skip
        assert (on_ray.run_dir / name).exists(), name
    ray_records, local_records = _records(on_ray.run_dir), _records(local.run_dir)
    assert [sorted(r) for r in ray_records] == [sorted(r) for r in local_records]
    # Weight sync: after every update the rollout workers sample with the group's new weights, so
    # their log-probs equal the group's recomputation (a stale worker would differ by ~1e-3 after
    # an update at this learning rate).
    steps = [r for r in ray_records if "rollout/kl_k1" in r]
    assert len(steps) == 3 and all(abs(r["rollout/kl_k1"]) < 1e-5 for r in steps)
    assert all(r["actor/grad_norm"] > 0 for r in steps)
    # The driver's copy (the saved final policy) moved away from the start.
    from mmrl.models.loading import load_policy

    start, final = (
        load_policy(model_dir).model.state_dict(),
        load_policy(on_ray.run_dir / "final").model.state_dict(),
    )
    assert max(float((final[k] - start[k]).abs().max()) for k in start) > 1e-4
    # The Hugging Face export (final/, from the driver's copy, loaded with from_pretrained) holds
    # the group's trained weights: those its two processes wrote as shards at the last step.
    from mmrl.train.sharded import read_sharded

    trained = read_sharded(on_ray.run_dir / "checkpoints" / "step_00000003" / "sharded")["model"]
    assert trained and trained.keys() <= final.keys()
    for key, value in trained.items():
        assert torch.equal(final[key].float(), value.float()), key


def _no_weights_through_the_object_store(monkeypatch) -> None:
    """`ray.put` of a dict of tensors (a state dict) fails the run: weights go over the channel."""
    put = ray.put

    def guarded(value, *args, **kwargs):
        if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
            raise AssertionError(f"a state dict went through Ray's object store: {sorted(value)[:3]}")
        return put(value, *args, **kwargs)

    monkeypatch.setattr(ray, "put", guarded)


def test_the_asynchronous_mode_runs_on_ray_one_step_ahead(local_ray, model_dir, tmp_path, monkeypatch):
    """`trainer.mode=async` on Ray (`max_staleness=1`): one generator thread per rollout worker has
    its worker generate and the reward workers score groups into the queue while the group trains
    on those that completed: every trained token is at most one version behind the policy it
    updates, and some are one behind. The group's recomputed (proximal) log-probs then differ
    from the workers' (stale) ones, and TIS corrects for it; at step 1 they agree. The weights
    travel over the weight channel (a gloo group), never through Ray's object store."""
    _no_weights_through_the_object_store(monkeypatch)
    result = train(
        load_config(
            "vision_reasoning",
            overrides=[
                *SMALL,
                f"model.path={model_dir}",
                f"trainer.run_dir={tmp_path}",
                "trainer.total_steps=4",
                "trainer.backend=ray",
                "trainer.mode=async",
                "trainer.max_staleness=1",
                "algo.tis=token",
                "trainer.rollout_workers=2",
                "trainer.async_call_prompts=1",
                "trainer.ray_cpus_per_actor=0.5",
            ],
        )
    )
    assert result.steps == 4 and not result.interrupted
    steps = [r for r in _records(result.run_dir) if "async/staleness" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # Measured on a quiet machine: versions 0, 0, 1, 2 (staleness 0, 1, 1, 1). Under load the
    # generator thread may be descheduled past an update, so the test asks for the bound and for
    # the overlap, not for that exact schedule.
    versions = [r["async/policy_version"] for r in steps]
    assert versions[0] == 0 and versions == sorted(versions)
    assert all(r["async/staleness"] in (0.0, 1.0) for r in steps)
    assert all(0 <= r["async/token_lag_max"] <= 1 for r in steps)  # every trained token
    assert all(r["async/token_lag_0"] + r["async/token_lag_1"] == pytest.approx(1.0) for r in steps)
    assert all(r["async/trainer_wait_s"] >= 0 and "async/dropped_total" in r for r in steps)
    assert all(v >= r["step"] - 2 for v, r in zip(versions, steps))  # the bound: at most 1 behind
    stale = [r for r in steps if r["async/staleness"] == 1.0]
    assert stale  # the generator ran ahead of the trainer
    assert abs(steps[0]["rollout/kl_k1"]) < 1e-5
    assert max(abs(r["rollout/kl_k1"]) for r in stale) > 1e-5  # one update behind: really stale
    assert all(r["actor/grad_norm"] > 0 for r in steps)
    # The held-out evaluations (at the start, steps 2 and 4) and the checkpoints ran beside the generator.
    assert [r["step"] for r in _records(result.run_dir) if "eval/accuracy" in r] == [0, 2, 4]
    assert (result.run_dir / "checkpoints" / "step_00000004" / "manifest.json").exists()


def _reward_worker(cfg):
    def start(name, slot):
        return ray.remote(RewardWorker).options(num_cpus=0.1, max_restarts=0).remote(cfg, 1)

    return start


def test_responses_are_spread_over_the_reward_workers_and_a_killed_one_is_replaced(local_ray, caplog):
    cfg = load_config("vision_reasoning", overrides=["reward.num_workers=0"])
    samples = make_samples(["colour_code"], 8, "train")
    texts = [
        f"\\boxed{{{s.reward_model.ground_truth}}}" if i % 2 else "no answer" for i, s in enumerate(samples)
    ]
    expected = Router(num_workers=0).score(samples, texts, VerifyContext()).scores
    router = RayRouter(ray, _reward_worker(cfg), time_limit_s=5.0, n_workers=2)
    router.warm_up()
    rewards = router.score(samples, texts, VerifyContext())  # split between the two
    torch.testing.assert_close(rewards.scores, expected)
    assert router.scored() == [4, 4]

    # A reward worker without model rewards runs verifiers only: it never loads torch or
    # transformers (importing them cost each actor 3.4 CPU-seconds and 840 MiB).
    def heavy_modules(actor) -> list[str]:  # a local function: sent by value, run in the actor
        import sys

        return [name for name in ("torch", "transformers") if name in sys.modules]

    heavy = [ray.get(a.__ray_call__.remote(heavy_modules)) for a in router.actors]
    assert heavy == [[], []], heavy
    pending = router.start(VerifyContext(), len(samples))
    for row, (sample, text) in enumerate(zip(samples, texts)):
        pending.add(row, sample, text)  # each to the worker with the fewest rows waiting
    assert router.waiting == [4, 4]
    os.kill(ray.get(router.actors[0].pid.remote()), signal.SIGKILL)  # dies with its rows half-scored
    with caplog.at_level(logging.WARNING, logger="mmrl.distributed.ray_backend"):
        rewards = pending.result(samples, texts)
    torch.testing.assert_close(rewards.scores, expected)
    assert router.replacements == 1 and router.waiting == [0, 0]
    assert "reward worker mmrl-reward-0 died" in caplog.text
    assert router.names == ["reward worker mmrl-reward-2", "reward worker mmrl-reward-1"]
    # The replacement goes on scoring beside the survivor: the dead one's 4 rows were scored
    # again, over both, and then a batch of 8 split in two.
    before = router.scored()
    torch.testing.assert_close(router.score(samples, texts, VerifyContext()).scores, expected)
    assert [a - b for a, b in zip(router.scored(), before)] == [4, 4]
    router.close()


def test_the_reward_workers_have_their_own_placement_group_spread_over_the_nodes(local_ray):
    from ray.util.placement_group import placement_group_table

    cfg = load_config(
        overrides=["trainer.backend=ray", "trainer.reward_workers=3", "trainer.ray_cpus_per_actor=0.1"]
    )
    cluster = RayCluster(cfg)
    try:
        table = placement_group_table(cluster.reward_pg)
        assert table["strategy"] == "SPREAD" and len(table["bundles"]) == 3
        assert all(b == {"CPU": 0.1} for b in table["bundles"].values())
        assert placement_group_table(cluster.pg)["strategy"] == "PACK"
    finally:
        cluster.shutdown()


def test_a_dead_rollout_worker_is_reported_by_name(local_ray, model_dir):
    cfg = load_config("vision_reasoning")
    workers = [
        ray.remote(RolloutWorker).options(num_cpus=0.1).remote(cfg, str(model_dir), k, 1) for k in range(2)
    ]
    names = ["rollout worker mmrl-rollout-0", "rollout worker mmrl-rollout-1"]
    pool = RolloutPool(ray, workers, names, pad_token_id=0)
    samples = make_samples(["colour_code"], 3, "train")
    batch = pool.generate(samples, SamplingParams(n=2, max_new_tokens=4))
    assert [s.id for s in batch.samples] == [s.id for s in samples for _ in range(2)]  # prompt-major
    ray.kill(workers[1], no_restart=True)
    with pytest.raises(RuntimeError, match="rollout worker mmrl-rollout-1 died"):
        pool.generate(samples, SamplingParams(n=2, max_new_tokens=4))
    ray.kill(workers[0], no_restart=True)


def test_tool_samples_train_on_ray_and_in_the_asynchronous_mode_with_the_agent_metrics(
    local_ray, tmp_path, monkeypatch
):
    """`visual_search` samples (they name `zoom_in`) and `minigrid` episodes (an environment) in
    one batch, on the Ray backend, their tools and environments run by the rollout workers, and
    in the local asynchronous mode, by the generator thread: both finish with every `agent/`
    metric, overall and per data source, the environments' included. The random model's turns
    are read as zoom calls (`agent.plugins`: a call format the workers import too), and its stop
    tokens are every printable byte, so its turns end within a few tokens (as actions, mostly
    invalid ones: counted, the episode goes on to its turn limit)."""
    from pathlib import Path

    from mmrl.models.loading import make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm

    plugins = str(Path(__file__).parent / "plugins")
    monkeypatch.syspath_prepend(plugins)
    monkeypatch.setenv("PYTHONPATH", plugins + os.pathsep + os.environ.get("PYTHONPATH", ""))
    spec, model_dir = TinyVLMSpec(), tmp_path / "model"
    policy = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
    policy.model.generation_config.eos_token_id = [policy.stop_token_ids[0], *range(32, 127)]
    policy.model.save_pretrained(model_dir)
    policy.processor.save_pretrained(model_dir)
    common = [
        "trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.group_size=2", "trainer.eval_size=4",
        "trainer.eval_every=2", "trainer.progress=false", "reward.num_workers=1", "rollout.max_new_tokens=8",
        "data.kinds=[visual_search,minigrid]", f"model.path={model_dir}", "agent.plugins=[multiturn_formats]",
        "agent.call_format=plugin_always_zoom", "agent.max_turns=2",
    ]  # fmt: skip
    on_ray = train(
        load_config(
            "vision_reasoning",
            overrides=[
                *common,
                f"trainer.run_dir={tmp_path / 'ray'}",
                "trainer.backend=ray",
                "trainer.rollout_workers=2",
                "trainer.reward_workers=1",
                "trainer.ray_cpus_per_actor=0.25",
            ],
        )  # fmt: skip
    )
    in_async = train(
        load_config(
            "vision_reasoning",
            overrides=[
                *common,
                f"trainer.run_dir={tmp_path / 'async'}",
                "trainer.mode=async",
                "algo.tis=token",
            ],
        )
    )
    for result in (on_ray, in_async):
        assert result.steps == 2 and not result.interrupted
    steps = {
        name: [r for r in _records(result.run_dir) if "agent/turns" in r]
        for name, result in (("ray", on_ray), ("async", in_async))
    }
    agent_keys = {
        name: [sorted(k for k in r if k.startswith("agent/")) for r in recs] for name, recs in steps.items()
    }
    assert len(steps["ray"]) == len(steps["async"]) == 2
    assert agent_keys["ray"] == agent_keys["async"]
    assert "agent/turns/visual_search/visual_search" in agent_keys["ray"][0]
    assert "agent/env_steps/minigrid/minigrid" in agent_keys["ray"][0]
    for recs in steps.values():
        assert all(r["agent/tool_calls"] > 0 and r["agent/observation_tokens"] > 0 for r in recs)
        assert all(r["agent/turns/minigrid/minigrid"] > 1 for r in recs)  # the episodes went on
        assert all(r["agent/end_env_error"] == 0 and r["agent/end_env_timeout"] == 0 for r in recs)


# A driver that starts its own Ray (no trainer.ray_address) through mmrl's RayCluster, prints the
# pids of every process under it once Ray's agents are up, then waits to be killed.
OWN_RAY_DRIVER = r"""
import json, time
import psutil
from mmrl.config import load_config
from mmrl.distributed.ray_backend import RayCluster
overrides = ["trainer.backend=ray", "trainer.ray_cpus_per_actor=0.25", "trainer.ray_address=local"]  # a new cluster
cluster = RayCluster(load_config("vision_reasoning", overrides=overrides))
names = lambda: {p.name() for p in psutil.Process().children(recursive=True)}
while not {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names():
    time.sleep(0.2)
time.sleep(2.5)  # the reaper has recorded them (it looks once a second)
print(json.dumps({p.pid: p.name() for p in psutil.Process().children(recursive=True)}), flush=True)
time.sleep(600)
"""


def test_a_sigkilled_driver_leaves_no_ray_process_of_its_own_cluster(tmp_path):
    """Issue 46: a driver that started its own Ray and was killed with SIGKILL left
    `ray::DashboardAgent` and `ray::RuntimeEnvAgent` running (about 100 MB each, deaf to
    SIGTERM). The reaper it starts with Ray removes every process the driver had started."""
    import subprocess
    import sys
    import time

    import psutil

    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    driver = subprocess.Popen([sys.executable, "-c", OWN_RAY_DRIVER], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path)  # fmt: skip
    line = driver.stdout.readline()
    assert line, driver.stderr.read()[-3000:]
    started = {int(pid): name for pid, name in json.loads(line).items()}
    assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent", "raylet", "gcs_server"} <= set(started.values())
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 120  # a hang guard, not a performance check
    alive = dict(started)

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while alive and time.monotonic() < deadline:
        alive = {pid: name for pid, name in alive.items() if running(pid)}
        time.sleep(0.5)
    assert not alive, f"left running after the driver was killed: {alive}"
    assert "mmrl: removed" in driver.stderr.read()  # the reaper says what it removed


def test_the_reaper_leaves_a_cleanly_ended_drivers_other_children_alone(tmp_path):
    """After `RayCluster.shutdown` says `done`, the reaper exits without killing anything: the
    driver may still need its other children (a tracker's process writing the last metrics).
    (A driver that dies: `test_a_sigkilled_driver_leaves_no_ray_process_of_its_own_cluster`.)"""
    import subprocess
    import sys

    import psutil

    driver = r"""
import subprocess, time
from mmrl.distributed.ray_backend import start_reaper
reaper = start_reaper()
child = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(2.5)  # recorded by the reaper
reaper.stdin.write(b"done\n"); reaper.stdin.close(); reaper.wait(timeout=60)
print(child.pid, flush=True)
"""
    done = subprocess.run([sys.executable, "-c", driver], env=dict(os.environ, PYTHONSAFEPATH="1"),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    child = psutil.Process(int(done.stdout.split()[0]))
    try:
        assert child.status() != psutil.STATUS_ZOMBIE and "removed" not in done.stderr
    finally:
        child.kill()


KILL_AN_ACTOR = '''
"""sitecustomize for every process the Ray cluster starts (on PYTHONPATH): the first rollout
worker (its next `generate`) or training process (its next call) to find its trigger file
SIGKILLs itself."""
import os, signal

TRIGGER = {trigger!r}


def _patch():
    from mmrl.distributed import actors

    def killing(method, role):
        def call(self, *args, **kwargs):
            try:
                os.remove(TRIGGER + "-" + role)  # only one process wins the file
            except FileNotFoundError:
                return method(self, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        return call

    actors.RolloutWorker.generate = killing(actors.RolloutWorker.generate, "rollout")
    actors.TrainWorker.call = killing(actors.TrainWorker.call, "train")


try:
    _patch()
except ImportError:  # (a process without mmrl)
    pass
'''


@pytest.mark.parametrize("role", ["rollout", "train"])
def test_an_async_run_whose_actor_is_killed_resumes_with_no_prompt_lost_or_trained_twice(
    role, model_dir, tmp_path
):
    """The asynchronous mode on Ray (`mmrl train` in a process of its own, with its own cluster),
    two rollout workers: a rollout worker or the training process is SIGKILLed after checkpoint 2.
    The run stops naming the dead actor; resumed, it re-issues the prompts that were in flight at
    checkpoint 2 (counted), and over the lineage every prompt drawn is trained exactly once or
    still in flight at the end."""
    import subprocess
    import sys
    import time

    from tests.conftest import assert_no_prompt_lost_or_trained_twice

    plugins, trigger = tmp_path / "plugins", tmp_path / "kill-now"
    plugins.mkdir()
    (plugins / "sitecustomize.py").write_text(KILL_AN_ACTOR.format(trigger=str(trigger)))
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(plugins) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    run = tmp_path / "run"
    args = [
        *SMALL, f"model.path={model_dir}", f"trainer.run_dir={run}", "trainer.total_steps=5",
        "trainer.checkpoint_every=1", "trainer.eval_every=5", "trainer.backend=ray", "trainer.mode=async",
        "trainer.max_staleness=1", "algo.tis=token", "trainer.rollout_workers=2",
        "trainer.async_call_prompts=1", "trainer.ray_cpus_per_actor=0.5",
    ]  # fmt: skip
    command = [sys.executable, "-m", "mmrl.cli", "train", *args]
    log = tmp_path / "first.log"
    with open(log, "w") as out:  # (a file, not a pipe: Ray's processes may outlive the driver's read)
        first = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        manifest = run / "checkpoints" / "step_00000002" / "manifest.json"
        start = time.monotonic()
        while not manifest.exists() and first.poll() is None and time.monotonic() - start < 600:  # hang guard
            time.sleep(0.05)
        assert manifest.exists(), log.read_text()[-3000:]
        Path(f"{trigger}-{role}").touch()
        code = first.wait(600)
    text = log.read_text()
    assert code != 0, f"the run went on without its {role} actor: {text[-3000:]}"
    named = "rollout worker" if role == "rollout" else "training process"
    assert named in text and "died" in text, text[-3000:]
    assert not Path(f"{trigger}-{role}").exists()  # an actor took it
    at_two = torch.load(run / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=False)
    in_flight_at_two = [k[0] for k in at_two["async_stream"]["in_flight"]]

    resumed = subprocess.run([*command, "--resume", "auto"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, timeout=900)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last = [r for r in _records(run) if r.get("step") == 5 and "async/reissued_total" in r][-1]
    assert last["async/reissued_total"] == len(in_flight_at_two) > 0
    assert_no_prompt_lost_or_trained_twice(run, steps=5)
