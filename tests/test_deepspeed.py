"""DeepSpeed ZeRO as the training strategy (`trainer.strategy=deepspeed`): its config checks; on
the local backend the one-process engine's update equals the plain trainer's, a non-finite
loss is skipped without touching the weights, and a resumed run continues exactly; a short run on
the Ray backend. The 2-process ZeRO-2 and ZeRO-3 groups against the 1-process trainer, step by
step, are in tests/test_distributed_multistep.py.

DeepSpeed builds a communication op at its first `initialize` on the CPU (~50 s, once per
virtual environment): tests/conftest.py points TORCH_EXTENSIONS_DIR at a folder per virtual
environment under ~/.cache/mmrl/torch_extensions so every later run (and every process of a run)
reuses it.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from mmrl.compose import train
from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.models.loading import load_policy
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.train.grpo import make_trainee
from mmrl.train.preflight import plan_resume

# -- the config checks (no DeepSpeed needed) --------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.strategy=zero"], "trainer.strategy must be fsdp2 or deepspeed"),
        (["trainer.strategy=deepspeed", "trainer.zero_stage=1"], "trainer.zero_stage must be 2 or 3"),
        (["trainer.zero_offload_optimizer=true"], "set trainer.strategy=deepspeed"),
        (["trainer.backend=ray", "trainer.zero_stage=3"], "set trainer.strategy=deepspeed"),
        (
            ["trainer.strategy=deepspeed", "trainer.backend=ray", "trainer.zero_offload_params=true"],
            "zero_offload_params needs trainer.zero_stage=3",
        ),
        (
            ["trainer.strategy=deepspeed", "trainer.zero_stage=3"],
            "trainer.zero_stage=3 needs trainer.backend=ray",
        ),
        (
            ["trainer.strategy=deepspeed", "trainer.mode=async", "algo.tis=token"],
            "trainer.strategy=deepspeed runs with trainer.mode=sync",
        ),
        (
            ["trainer.strategy=deepspeed", "model.dtype=bfloat16", "model.master_dtype=bfloat16"],
            "model.master_dtype must be auto or float32",
        ),
        (["trainer.strategy=deepspeed", "model.dtype=float16"], "computes in float32 or bfloat16"),
        # the local DeepSpeed engine's loop has no vLLM path: refused, never silently the HF engine
        (
            ["trainer.strategy=deepspeed", "rollout.engine=vllm"],
            "rollout.engine=vllm beside a DeepSpeed engine",
        ),
        (
            [
                "trainer.strategy=deepspeed",
                "trainer.backend=ray",
                "trainer.zero_stage=3",
                "trainer.train_workers=4",
                "trainer.prompts_per_step=6",
                "trainer.mini_batches=1",
            ],  # fmt: skip
            "needs trainer.mini_batches * trainer.train_workers to divide trainer.prompts_per_step",
        ),
    ],
)
def test_deepspeed_options_are_checked_with_one_clear_line(overrides, message):
    with pytest.raises(ValueError) as info:
        load_config("vision_reasoning", overrides=overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_valid_deepspeed_layouts_load():
    for overrides in (
        ["trainer.strategy=deepspeed"],
        ["trainer.strategy=deepspeed", "trainer.zero_offload_optimizer=true"],
        [
            "trainer.strategy=deepspeed",
            "trainer.backend=ray",
            "trainer.zero_stage=3",
            "trainer.zero_offload_params=true",
        ],
    ):
        assert load_config("vision_reasoning", overrides=overrides).trainer.strategy == "deepspeed"


def test_the_deepspeed_config_carries_the_runs_optimizer_clipping_and_precision():
    from mmrl.distributed.deepspeed_group import deepspeed_config

    cfg = load_config(
        "vision_reasoning",
        overrides=[
            "trainer.strategy=deepspeed",
            "optim.grad_clip=0.5",
            "optim.weight_decay=0.1",
            "trainer.zero_offload_optimizer=true",
        ],  # fmt: skip
    )
    ds = deepspeed_config(cfg, world_size=4, bf16=True, pin_memory=True)
    assert ds["train_batch_size"] == 4 and ds["managed_gradient_accumulation"] is False
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}  # float32 accumulation of bf16 gradients
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    params = ds["optimizer"]["params"]
    assert ds["optimizer"]["type"] == "AdamW" and params["weight_decay"] == 0.1
    assert params["torch_adam"] is False  # offloaded: DeepSpeedCPUAdam steps on the host
    plain = deepspeed_config(
        load_config("vision_reasoning", overrides=["trainer.strategy=deepspeed"]), 1, False, False
    )
    assert plain["optimizer"]["params"]["torch_adam"] is True and "data_types" not in plain
    assert "offload_optimizer" not in plain["zero_optimization"]


# -- the updates ------------------------------------------------------------------------------

# The group tests' step (tests/test_distributed_multistep.py): 4 prompts x 4 responses, 2
# mini-batches (2 optimizer steps), micro-batches of 2 rows, a KL penalty to a frozen reference,
# and rows left out of the loss, so the processes' loss shares are far from 1/2.
OVERRIDES = [
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "trainer.mini_batches=2",
    "trainer.micro_batch_rows=2",
    "algo.kl_coef=0.05",
    "optim.lr=1e-3",
    "reward.num_workers=0",
]
# Tolerance on the parameters after the update: 2e-5, the group tests' (2% of one step at lr
# 1e-3), for the same reason: float32 rounding of the gradients, turned by Adam's first steps
# into up to ~5e-6 on weights whose gradient is near 0. Measured: ZeRO-2 in one process 1.6e-7;
# ZeRO-2 and ZeRO-3 in two processes 5.6e-6 (FSDP2 on the same step: 5.6e-6). Without the
# world-size factor on the loss shares (DeepSpeed averages the processes' gradients) the group
# steps on half the gradient: weights differ by 1.7e-4 (8x the tolerance), the norm is halved.
PARAM_ATOL = 2e-5


@pytest.fixture(scope="module")
def deepspeed():
    return pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def step_files(tmp_path_factory):
    """The tiny model in a folder, a saved step of its own samples, and the plain single-process
    trainer's update on it (built once for the module's tests)."""
    from mmrl.models.loading import make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm

    tmp_path = tmp_path_factory.mktemp("step")
    torch.manual_seed(0)
    spec, model_dir = TinyVLMSpec(), tmp_path / "model"
    tiny = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
    tiny.model.save_pretrained(model_dir)
    tiny.processor.save_pretrained(model_dir)
    cfg = load_config("vision_reasoning", overrides=OVERRIDES)
    policy = load_policy(model_dir)
    initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
    batch = HFRolloutEngine.from_policy(policy).generate(
        make_samples(["colour_code"], 4, "train"), SamplingParams(n=4, max_new_tokens=8)
    )
    batch.response_mask[4:6] = 0  # the second process's share of the first mini-batch
    batch.response_mask[6, 1:] = 0
    advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
    torch.save({"batch": batch, "advantages": advantages, "weights": None}, tmp_path / "step.pt")
    t = make_trainee(cfg, policy)
    old, ref = t.old_and_ref_logprobs(cfg, batch)
    metrics = t.update_policy(cfg, batch, advantages, old, ref, None)
    t.close()
    single = {k: v.detach().clone() for k, v in t.policy.model.state_dict().items()}
    return {"dir": model_dir, "step": tmp_path / "step.pt", "batch": batch, "advantages": advantages,
            "initial": initial, "single": single, "metrics": metrics, "old": old, "ref": ref}  # fmt: skip


def _worst(state: dict, single: dict) -> float:
    assert state.keys() == single.keys()
    return max(float((state[k].float() - single[k]).abs().max()) for k in single)


def _skips_then_updates(cfg, t, step_files, caplog, atol: float, left_to_update: bool = False) -> None:
    """On trainee `t`: a NaN advantage in each mini-batch (a non-finite loss), then a NaN gradient
    of one parameter: every step is skipped and no weight moves. The next update is then the
    first one (a skipped step leaves the optimizer as it was): the plain trainer's, within `atol`.
    `left_to_update`: `t` leaves the first mini-batch's old log-probs (NaN) to the update's first
    forward (`mmrl.train.update.old_from_update`), which fills them even when its loss is NaN."""
    batch, advantages = step_files["batch"], step_files["advantages"]
    old, ref = t.old_and_ref_logprobs(cfg, batch)
    first = len(batch) // cfg.trainer.mini_batches
    left = torch.isnan(old).all(dim=1)
    assert left.tolist() == [left_to_update] * first + [False] * (len(batch) - first)
    torch.testing.assert_close(old[~left], step_files["old"][~left], atol=1e-6, rtol=0)
    bad = advantages.clone()
    bad[[0, 8]] = float("nan")
    with caplog.at_level(logging.WARNING, logger="mmrl.train.update"):
        assert t.update_policy(cfg, batch, bad, old, ref, None)["actor/skipped_steps"] == 2
        torch.testing.assert_close(old, step_files["old"], atol=1e-6, rtol=0)
        param = next(p for p in t.policy.model.parameters() if p.requires_grad)
        handle = param.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        try:
            assert t.update_policy(cfg, batch, advantages, old, ref, None)["actor/skipped_steps"] == 2
        finally:
            handle.remove()
    assert "non-finite loss" in caplog.text and "non-finite gradient" in caplog.text
    assert _worst(t.policy.model.state_dict(), step_files["initial"]) == 0.0
    metrics = t.update_policy(cfg, batch, advantages, old, ref, None)
    assert metrics["actor/skipped_steps"] == 0
    assert metrics["actor/grad_norm"] == pytest.approx(step_files["metrics"]["actor/grad_norm"], rel=1e-5)
    worst = _worst(t.policy.model.state_dict(), step_files["single"])
    assert worst <= atol, f"parameters differ by up to {worst:.2e}"


def test_the_plain_trainer_skips_a_nan_loss_and_a_nan_gradient_without_touching_the_optimizer(
    step_files, caplog
):
    cfg = load_config("vision_reasoning", overrides=OVERRIDES)
    t = make_trainee(cfg, load_policy(step_files["dir"]))
    try:
        _skips_then_updates(cfg, t, step_files, caplog, atol=0.0, left_to_update=True)  # exact
    finally:
        t.close()


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True], ids=["adamw", "cpu-adam-offload"])
def test_the_local_one_process_engine_skips_non_finite_steps_and_updates_as_the_plain_trainer(
    deepspeed, step_files, caplog, offload
):
    """ZeRO-2 in one process, its AdamW on the partitions or, offloaded, DeepSpeedCPUAdam on the
    host (its op is built once, ~75 s, into the shared cache)."""
    from mmrl.distributed.deepspeed_group import make_deepspeed_trainee

    overrides = [*OVERRIDES, "trainer.strategy=deepspeed", f"trainer.zero_offload_optimizer={offload}"]
    cfg = load_config("vision_reasoning", overrides=overrides)
    t = make_deepspeed_trainee(cfg, load_policy(step_files["dir"]))
    try:
        optimizer = type(t.ds_engine.basic_optimizer).__name__
        assert optimizer == ("DeepSpeedCPUAdam" if offload else "AdamW")
        # The rollout engine, checkpoints and the final save read the module the engine trains.
        assert t.engine.model is t.policy.model and t.ds_engine.module is t.policy.model
        # DeepSpeed drops a skipped step's gradients in its own overflow skip (offloaded: on the
        # host, by another path).
        _skips_then_updates(cfg, t, step_files, caplog, atol=PARAM_ATOL)
        # The consolidated state goes back in unchanged (CPU Adam counts steps in ints).
        state = t.optimizer.state_dict()
        assert state["step"] == 2 and len(state["exp_avg"]) == len(state["master"])
        t.optimizer.load_state_dict(state)
        again = t.optimizer.state_dict()
        assert again["step"] == 2 and all(
            torch.equal(again[k][n], state[k][n])
            for k in ("master", "exp_avg", "exp_avg_sq")
            for n in state[k]
        )
    finally:
        t.close()


SMALL_RUN = [
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "trainer.eval_size=8",
    "trainer.eval_every=1",
    "trainer.progress=false",
    "trainer.save_final=false",
    "reward.num_workers=0",
    "optim.schedule=constant",
    # OCR scores by edit distance: even a random model's answers get rewards that differ within a
    # group, so every step has a gradient (and Adam moments to checkpoint).
    "data.kinds=[ocr]",
    "trainer.strategy=deepspeed",
]


def _metrics(run_dir) -> list[dict]:
    """metrics.jsonl without wall-clock figures."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]


@pytest.mark.slow
def test_a_local_deepspeed_run_resumes_exactly_from_its_consolidated_optimizer_state(
    deepspeed, tmp_path, step_files
):
    common = [
        *SMALL_RUN,
        f"model.path={step_files['dir']}",
        "trainer.checkpoint_every=1",
        "trainer.keep_last=0",
    ]
    whole = train(load_config("vision_reasoning", overrides=[*common, "trainer.total_steps=2",
                                                             f"trainer.run_dir={tmp_path / 'whole'}"]))  # fmt: skip
    part = [*common, f"trainer.run_dir={tmp_path / 'part'}"]
    train(load_config("vision_reasoning", overrides=[*part, "trainer.total_steps=1"]))
    state = torch.load(tmp_path / "part/checkpoints/step_00000001/trainer_state.pt", weights_only=False)
    optimizer = state["optimizer"]
    # The checkpoint holds DeepSpeed's state per parameter: float32 master weights, Adam moments
    # (non-zero: the step had a gradient), the step count (two mini-batches) and the learning rates.
    assert optimizer["step"] == 2 and optimizer["lr"] == [pytest.approx(3e-4)] * len(optimizer["lr"])
    assert optimizer["master"].keys() == optimizer["exp_avg"].keys() == optimizer["exp_avg_sq"].keys()
    assert max(float(v.abs().max()) for v in optimizer["exp_avg_sq"].values()) > 0
    # Another strategy cannot take it over: the resume is refused, naming the change.
    with pytest.raises(ValueError, match="trainer.strategy"):
        plan_resume(load_config("vision_reasoning", overrides=[*part, "trainer.strategy=fsdp2",
                                                               "trainer.resume=auto"]), tmp_path / "part")  # fmt: skip
    resumed = train(
        load_config("vision_reasoning", overrides=[*part, "trainer.total_steps=2", "trainer.resume=auto"])
    )
    assert resumed.steps == 2
    assert _metrics(tmp_path / "part") == _metrics(whole.run_dir)
    a = torch.load(tmp_path / "part/checkpoints/step_00000002/trainer_state.pt", weights_only=False)[
        "optimizer"
    ]
    b = torch.load(whole.run_dir / "checkpoints/step_00000002/trainer_state.pt", weights_only=False)[
        "optimizer"
    ]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(a[key][n], b[key][n]) for n in b[key]), key


@pytest.mark.slow
def test_a_short_ray_run_trains_with_a_two_process_zero3_group(
    deepspeed, tmp_path, tmp_path_factory, step_files
):
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.WARNING,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    try:
        result = train(
            load_config(
                "vision_reasoning",
                overrides=[
                    *SMALL_RUN,
                    f"model.path={step_files['dir']}",
                    f"trainer.run_dir={tmp_path / 'run'}",
                    "trainer.total_steps=2",
                    "trainer.eval_every=2",
                    "trainer.backend=ray",
                    "trainer.rollout_workers=1",
                    "trainer.train_workers=2",
                    "trainer.ray_cpus_per_actor=0.5",
                    "trainer.zero_stage=3",
                    "trainer.zero_offload_params=true",
                ],
            )  # fmt: skip
        )
    finally:
        ray.shutdown()
    assert result.steps == 2 and not result.interrupted
    steps = [r for r in _metrics(result.run_dir) if "rollout/kl_k1" in r]
    assert len(steps) == 2 and all(r["actor/grad_norm"] > 0 for r in steps)
    # After each update the group's gathered weights reach the rollout worker: its log-probs
    # equal the group's recomputation (a stale worker would differ by ~1e-3 at this lr).
    assert all(abs(r["rollout/kl_k1"]) < 1e-5 for r in steps)
    # The checkpoint holds the group's consolidated optimizer state.
    optimizer = torch.load(result.run_dir / "checkpoints/step_00000002/trainer_state.pt", weights_only=False)[
        "optimizer"
    ]
    assert optimizer["step"] == 4 and optimizer["master"].keys() == optimizer["exp_avg"].keys()


@pytest.mark.slow
def test_the_local_engine_trains_lora_adapters_as_the_plain_trainer(deepspeed, step_files):
    """LoRA under the local one-process engine (ZeRO-2): the same adapters (drawn from the same
    seed) take the plain LoRA trainer's update; the KL reference is the base model (the adapters
    disabled through the engine), whose log-probs are the untrained model's."""
    from mmrl.distributed.deepspeed_group import make_deepspeed_trainee

    lora = [*OVERRIDES, "model.lora_rank=4", "optim.lr=1e-2"]
    cfg = load_config("vision_reasoning", overrides=lora)
    ds_cfg = load_config("vision_reasoning", overrides=[*lora, "trainer.strategy=deepspeed"])
    batch, advantages = step_files["batch"], step_files["advantages"]
    results = []
    for make, c in ((make_trainee, cfg), (make_deepspeed_trainee, ds_cfg)):
        torch.manual_seed(5)  # the adapters' initial A
        t = make(c, load_policy(step_files["dir"]))
        try:
            old, ref = t.old_and_ref_logprobs(c, batch)
            metrics = t.update_policy(c, batch, advantages, old, ref, None)
            trained = {n: p.detach().clone() for n, p in t.policy.model.named_parameters() if p.requires_grad}
        finally:
            t.close()
        assert trained and all(".lora_" in n for n in trained)
        results.append((ref, metrics, trained))
    (ref, metrics, trained), (ds_ref, ds_metrics, ds_trained) = results
    torch.testing.assert_close(ref, step_files["old"], atol=1e-6, rtol=0)  # the base model's
    torch.testing.assert_close(ds_ref, ref, atol=1e-6, rtol=0)
    assert ds_metrics["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    assert ds_metrics["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"], rel=1e-5)
    assert trained.keys() == ds_trained.keys()
    # B starts at 0: how far the update moved the adapters.
    assert max(float(v.abs().max()) for n, v in trained.items() if "lora_B" in n) > 10 * LORA_ATOL
    worst = max(float((ds_trained[n] - trained[n]).abs().max()) for n in trained)
    assert worst <= LORA_ATOL, f"adapters differ by up to {worst:.2e}"


# PARAM_ATOL's bound (2% of one step) at LoRA's learning rate, 1e-2: 2e-4. Measured 2.4e-5.
LORA_ATOL = 2e-4


@pytest.mark.slow
def test_a_ray_run_with_a_zero3_lora_group_resumes_exactly(
    deepspeed, tmp_path, tmp_path_factory, step_files, caplog
):
    """The Ray backend's resume with DeepSpeed: each process of a new ZeRO-3 group gets the
    checkpoint's adapters and the consolidated optimizer state (`DeepSpeedLearner.load_state`);
    2 steps in one run, and the same run cut back to its first checkpoint (as if killed right
    after it: step 2's checkpoint gone, its metrics lines left behind) then resumed, give the
    same metrics and adapters."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))  # fmt: skip
    common = [*SMALL_RUN, f"model.path={step_files['dir']}", "trainer.checkpoint_every=1", "trainer.keep_last=0",
              "trainer.backend=ray", "trainer.train_workers=2", "trainer.ray_cpus_per_actor=0.5",
              "trainer.zero_stage=3", "model.lora_rank=4", "optim.lr=1e-2", "algo.kl_coef=0.05"]  # fmt: skip
    try:
        whole = train(load_config("vision_reasoning", overrides=[*common, "trainer.total_steps=2",
                                                                 f"trainer.run_dir={tmp_path / 'whole'}"]))  # fmt: skip
        # Checkpoint 1 of this deterministic run is the one a 1-step run writes (the comparison
        # below proves the runs equal); copying it saves starting the actors for that run.
        shutil.copytree(whole.run_dir, tmp_path / "part")
        shutil.rmtree(tmp_path / "part/checkpoints/step_00000002")
        part = [*common, f"trainer.run_dir={tmp_path / 'part'}"]
        with caplog.at_level(logging.INFO, logger="mmrl.train.grpo"):
            resumed = train(
                load_config(
                    "vision_reasoning", overrides=[*part, "trainer.total_steps=2", "trainer.resume=auto"]
                )
            )
    finally:
        ray.shutdown()
    assert resumed.steps == 2
    assert any(
        "resumed from" in r.getMessage() and "step_00000001 at step 1" in r.getMessage()
        for r in caplog.records
    )
    assert _metrics(tmp_path / "part") == _metrics(whole.run_dir)  # step 2's old lines dropped, not repeated
    steps = [r for r in _metrics(whole.run_dir) if "actor/grad_norm" in r]
    assert len(steps) == 2 and all(r["actor/grad_norm"] > 0 for r in steps)
    from safetensors.torch import load_file

    ckpt = "checkpoints/step_00000002/model/adapter_model.safetensors"
    a, b = load_file(tmp_path / "part" / ckpt), load_file(whole.run_dir / ckpt)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(tmp_path / "part/checkpoints/step_00000002/trainer_state.pt", weights_only=False)
    sb = torch.load(whole.run_dir / "checkpoints/step_00000002/trainer_state.pt", weights_only=False)
    assert sa["optimizer"]["step"] == sb["optimizer"]["step"] == 4  # 2 steps x 2 mini-batches
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert sa["optimizer"][key].keys() == sb["optimizer"][key].keys()
        assert all(
            torch.equal(sa["optimizer"][key][n], sb["optimizer"][key][n]) for n in sb["optimizer"][key]
        ), key
