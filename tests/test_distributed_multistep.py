"""Several steps of the training group equal the single-process trainer at every step: the loss,
the gradient norm, every weight and each process's old and reference log-probs, for FSDP2 and
for DeepSpeed ZeRO-2 / ZeRO-3, with full fine-tuning and with LoRA (the KL reference then being
the base with the adapters disabled). The first step is the one-update check (a 2-process update
equals the 1-process one, to 2e-5 on the weights at lr 1e-3).

Three global batches of the tiny Qwen2-VL's own samples (4 prompts x 4 responses each, rows
left out of the loss so the two processes' loss shares are far from 1/2, 2 mini-batches of
micro-batches of 2 rows, a KL penalty) are applied in order, each step recomputing the old and
reference log-probs with the weights of the step before, as the trainer does. The single
process runs `make_trainee`'s update; the group runs in two processes launched by `torchrun`
(gloo on the CPU), starting from the single trainer's initial weights (LoRA: its adapters,
`--init`). One launch runs the FSDP2 configs, another the DeepSpeed ones.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mmrl.config import config_to_yaml, load_config
from mmrl.datasets.procedural import make_samples
from mmrl.models.loading import load_policy
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.train.grpo import make_trainee

pytestmark = pytest.mark.slow

STEPS = 3
COMMON = [
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "trainer.mini_batches=2",
    "trainer.micro_batch_rows=2",
    "algo.kl_coef=0.05",
    "reward.num_workers=0",
    "optim.schedule=linear",  # the schedule moves between steps: the group's must follow
    f"trainer.total_steps={STEPS}",
]
LR = {"full": 1e-3, "lora": 1e-2}  # LoRA's B starts at 0: a larger rate moves it as much
LAYOUTS = {
    "full": [f"optim.lr={LR['full']}"],
    "lora": ["model.lora_rank=4", f"optim.lr={LR['lora']}"],
}
# Tolerances, per step. Weights: 2% of one Adam step, 0.02 x the layout's rate (2e-5 at lr 1e-3):
# float32 rounding of the gradient, which Adam's early steps turn into up to a step's fraction on
# weights whose gradient is near 0 (g / (|g| + eps)), so it scales with the rate. A 2-core CI
# machine (other reduction orders) measured 4.4e-5 for ZeRO-3 LoRA at lr 1e-2, where the 2e-5 of
# full fine-tuning's rate had been applied to it. The loss, gradient norm and reference KL: 1e-5
# relative (float32 sums in another order). Measured over the 3 steps (December 2026): weights
# 1.0e-5 (FSDP2 full, ZeRO-2 full, ZeRO-3 LoRA), 8.1e-6 (ZeRO-3 full), 2.1e-6 (FSDP2 and ZeRO-2
# LoRA); the metrics at most 7.4e-7 relative. Giving each process a loss share of 1/2 instead
# (averaging the processes' losses, the usual data-parallel shortcut) moved the weights by 4e-3
# after one step (200x the full layout's tolerance; measured by the one-update FSDP2 test this
# file's first step replaced). Before the group's losses were merged per mini-batch, its
# `actor/pg_loss` was -0.056 where the single process's was 0.221 (shares that differ between
# mini-batches).
PARAM_ATOL = {layout: 0.02 * lr for layout, lr in LR.items()}
REL = 1e-5


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """The tiny model in a folder, three saved steps, and for each layout the single-process
    trainer's weights, loss and gradient norm after every step."""
    from mmrl.models.loading import make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm

    tmp = tmp_path_factory.mktemp("multistep")
    spec, model_dir = TinyVLMSpec(), tmp / "model"
    tiny = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
    tiny.model.save_pretrained(model_dir)
    tiny.processor.save_pretrained(model_dir)
    engine = HFRolloutEngine.from_policy(load_policy(model_dir))
    samples = make_samples(["colour_code"], 4 * STEPS, "train")
    paths = []
    for k in range(STEPS):
        torch.manual_seed(k)
        batch = engine.generate(samples[4 * k : 4 * k + 4], SamplingParams(n=4, max_new_tokens=8))
        batch.response_mask[4:6] = 0  # the second process's share of the first mini-batch
        batch.response_mask[6, 1:] = 0
        advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(10 + k))
        paths.append(tmp / f"step{k}.pt")
        torch.save({"batch": batch, "advantages": advantages, "weights": None}, paths[-1])

    single = {}
    for layout, extra in LAYOUTS.items():
        cfg = load_config("vision_reasoning", overrides=[*COMMON, *extra])
        torch.manual_seed(123)  # LoRA's A: whatever it is, the group starts from the same (--init)
        t = make_trainee(cfg, load_policy(model_dir))
        trained = {n for n, p in t.policy.model.named_parameters() if p.requires_grad}
        init = {k: v.detach().clone() for k, v in t.policy.model.state_dict().items() if k in trained}
        torch.save(init, tmp / f"init-{layout}.pt")
        history = []
        for path in paths:
            step = torch.load(path, weights_only=False)
            old, ref = t.old_and_ref_logprobs(cfg, step["batch"])
            metrics = t.update_policy(cfg, step["batch"], step["advantages"], old, ref, None)
            t.scheduler.step()
            state = {k: v.detach().clone() for k, v in t.policy.model.state_dict().items()}
            history.append(
                {"metrics": metrics, "state_dict": state, "old_logprobs": old, "ref_logprobs": ref}
            )
        t.close()
        single[layout] = {"history": history, "init": tmp / f"init-{layout}.pt", "trained": trained}
    return {"dir": model_dir, "paths": paths, "single": single, "tmp": tmp}


def _launch(steps, configs: dict[str, list[str]], init_layout: str | None = None) -> dict[str, dict]:
    """One torchrun launch of two processes running `configs` (name -> overrides) in turn."""
    tmp = steps["tmp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "mmrl.distributed.one_update", "--model", str(steps["dir"])]  # fmt: skip
    for path in steps["paths"]:
        cmd += ["--step", str(path)]
    if init_layout is not None:
        cmd += ["--init", str(steps["single"][init_layout]["init"])]
    for name, overrides in configs.items():
        (tmp / f"{name}.yaml").write_text(
            config_to_yaml(load_config("vision_reasoning", overrides=overrides))
        )
        cmd += ["--config", str(tmp / f"{name}.yaml"), "--out", str(tmp / f"{name}.pt")]
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in configs}


def _check_every_step(group: dict, single: dict, what: str) -> None:
    layout = what.rsplit("-", 1)[1]
    atol = PARAM_ATOL[layout]
    history = single["history"]
    assert len(group["steps"]) == len(history) == STEPS
    initial = torch.load(single["init"], weights_only=False)
    moved = max(float((history[0]["state_dict"][k] - initial[k]).abs().max()) for k in initial)
    # Adam's first step moves every weight with a gradient by about the rate
    assert moved > 0.5 * LR[layout], f"{what}: the first step moved the trained weights by only {moved:.1e}"
    for k, (g, s) in enumerate(zip(group["steps"], history), start=1):
        assert g["state_dict"].keys() == s["state_dict"].keys()
        worst = max(
            float((g["state_dict"][n].float() - s["state_dict"][n]).abs().max()) for n in s["state_dict"]
        )
        assert worst <= atol, f"{what}, step {k}: weights differ by up to {worst:.2e}"
        # Each process computed its rows' old and reference log-probs as the single process did
        # (ZeRO-3: its parameters gathered a module at a time): from the same weights at step 1,
        # 1e-6; later, from weights within the tolerance above, 1e-5.
        logprob_atol = 1e-6 if k == 1 else 1e-5
        for key in ("old_logprobs", "ref_logprobs"):
            torch.testing.assert_close(
                g[key], s[key], atol=logprob_atol, rtol=0, msg=f"{what}, step {k}: {key}"
            )
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/ref_kl"):
            got, want = g["metrics"][key], s["metrics"][key]
            assert got == pytest.approx(want, rel=REL, abs=1e-8), f"{what}, step {k}: {key} {got} vs {want}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdp2_group_equals_the_single_process_trainer_at_every_step(steps, layout):
    name = f"fsdp2-{layout}"
    group = _launch(steps, {name: [*COMMON, *LAYOUTS[layout]]}, init_layout=layout)
    _check_every_step(group[name], steps["single"][layout], name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_deepspeed_zero2_and_zero3_groups_equal_the_single_process_trainer_at_every_step(steps, layout):
    pytest.importorskip("deepspeed")
    configs = {
        f"zero{stage}-{layout}": [
            *COMMON,
            *LAYOUTS[layout],
            "trainer.strategy=deepspeed",
            "trainer.backend=ray",
            f"trainer.zero_stage={stage}",
        ]  # fmt: skip
        for stage in (2, 3)
    }
    group = _launch(steps, configs, init_layout=layout)
    for name in configs:
        _check_every_step(group[name], steps["single"][layout], name)
