"""`mmrl check`: what a run needs, checked before anything heavy loads.

    mmrl check --task qwen2_5_vl_3b_grpo_lora            # the same arguments as `mmrl train`
    mmrl check --task vision_reasoning data.train_files=[train.jsonl] data.heldout_files=[test.jsonl]

Checked, in order: the config; the plugin modules (imported); the reward models (type,
keywords, names); every data path (a local file that does not exist is named with the folder it
was resolved from; only a name that is not a local path is a hub id), the procedural kinds, and,
read, every sample (its images, the reward models it asks for); the model (a local folder, or a
hub id that is cached or that the hub has); the optional packages the run needs, each with its
install line; MLflow's tracking URI; a named run folder in use or finished; the number of GPUs
the run places work on; and, where a GPU is visible, the GPU memory against a rough estimate of
the run's needs. Whatever `mmrl train` would refuse after loading, this refuses first. The answer is one line per problem and exit status 2, or `ready`
with a summary: what will run, where, and how many samples of which layout.

`mmrl train` runs the same checks first (without reading the data, which training then reads
anyway), and `mmrl eval` and `mmrl serve` check their model, paths and packages. Nothing here
imports torch: a check answers in about a second (`nvidia-smi` is asked about GPUs).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGES: dict[str, str] = {
    "ray": "pip install 'mmrl[distributed]'",
    "deepspeed": "pip install 'mmrl[distributed]'",
    "vllm": "pip install 'mmrl[vllm]'",
    "wandb": "pip install 'mmrl[wandb]'",
    "mlflow": "pip install 'mmrl[mlflow]'",
    "tensorboard": "pip install tensorboard",
    "datasets": "pip install 'mmrl[hub]'",
    "open_clip": "pip install 'mmrl[rewards]'",
    "rapidocr": "pip install 'mmrl[rewards]'",
    "lpips": "pip install 'mmrl[rewards]'",
    "diffusers": "pip install 'mmrl[diffusion]'",
    "fastapi": "pip install 'mmrl[serve]'",
    "uvicorn": "pip install 'mmrl[serve]'",
}
"""What a run may need, by the module to find: the line that installs it."""

REWARD_PACKAGES: dict[str, tuple[str, ...]] = {
    "aesthetic": ("open_clip",),
    "clip_score": ("open_clip",),
    "pickscore": ("open_clip",),
    "ocr": ("rapidocr",),
    "perceptual": ("lpips",),
}
"""Packages each model-based reward needs (open_clip for the CLIP family, rapidocr for OCR)."""


@dataclass
class Problem:
    """One thing that would stop the run."""

    where: str
    """What is wrong: a config key (`data.train_files[0]`), `model`, `package ray`, `gpu`."""
    message: str
    """Why, and what to do."""

    def line(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Report:
    """The outcome of the checks."""

    problems: list[Problem] = field(default_factory=list)
    """Everything that would stop the run (empty: ready)."""
    summary: list[str] = field(default_factory=list)
    """What will run, where, and on which data (printed after `ready`)."""
    config: Any = None
    """The loaded config (None when it did not load)."""

    def add(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))

    def print(self, command: str) -> int:
        """One line per problem (stderr) and 2, or `ready` and the summary (stdout) and 0."""
        if self.problems:
            for problem in self.problems:
                print(f"mmrl {command}: {problem.line()}", file=sys.stderr)
            return 2
        print("ready: " + (self.summary[0] if self.summary else "nothing to run"))
        for line in self.summary[1:]:
            print(f"  {line}")
        return 0


# --------------------------------------------------------------------------- train


def check_train(
    task: str, config_file: str | None, overrides: list[str], *, read_data: bool = True, online: bool = True
) -> Report:
    """Every check of a training run (`mmrl check`); `read_data=False` only checks that the data
    can be found (`mmrl train` reads it right after), `online=False` never asks the hub."""
    from mmrl.config import recipe_kind

    report = Report()
    if recipe_kind(task) in ("diffusion", "decoupled"):
        return _check_diffusion(report, task, config_file, overrides, online)
    from mmrl.config import load_config

    try:
        cfg = load_config(task=task, config_file=config_file, overrides=overrides)
    except (ValueError, FileNotFoundError) as exc:
        report.add("config", str(exc).removeprefix("invalid config: "))
        return report
    report.config = cfg
    plugins_ok = _check_plugins(report, cfg.reward.plugins, "reward.plugins")
    plugins_ok &= _check_plugins(report, cfg.agent.plugins, "agent.plugins")
    _check_reward_models(report, cfg, plugins_ok)
    data = _check_data(report, cfg, read_data and plugins_ok, online)
    model = _check_model(report, cfg.model.path, cfg.model.revision, "model.path", online)
    _check_packages(report, _train_packages(cfg))
    _check_mlflow_store(report, cfg.trainer)
    if read_data:  # `mmrl train` takes the lock itself right after these checks
        _check_run_dir(report, cfg)
    if cfg.trainer.eval_suite not in (None, "builtin") and not Path(cfg.trainer.eval_suite).exists():
        report.add(
            "trainer.eval_suite",
            f"{cfg.trainer.eval_suite} does not exist (a suite folder or file, or builtin)",
        )
    gpu = _check_gpu(report, cfg, model)
    _check_gpu_count(report, cfg)
    if not report.problems:
        t = cfg.trainer
        where = f"backend {t.backend}" + (
            f", {t.train_workers} training + {t.rollout_workers} rollout workers"
            if t.backend == "ray"
            else ""
        )
        report.summary = [
            f"GRPO-family training ({cfg.algo.advantage} advantages, {cfg.algo.policy_loss} loss) for "
            f"{t.total_steps} steps of {t.prompts_per_step} prompts x {cfg.rollout.group_size} responses",
            f"model: {model}",
            f"where: {gpu}; {where}; rollout engine {cfg.rollout.engine}",
            *data,
            f"run folder: {t.run_dir or f'runs/{cfg.data.task}-<timestamp>'}",
        ]
        rows = _training_rows(cfg, data)
        if rows is not None and rows < t.prompts_per_step:
            report.summary.append(
                f"note: {rows} training samples, fewer than trainer.prompts_per_step={t.prompts_per_step}: "
                "every step draws some prompts more than once (their groups are then not independent); "
                "lower trainer.prompts_per_step or add samples"
            )
    return report


def _training_rows(cfg, data_lines: list[str]) -> int | None:
    """How many training samples the run has: `data.num_train` for built-in data, else the
    rows counted while reading the files (None when they were not read)."""
    if not cfg.data.train_files:
        return cfg.data.num_train
    counted = [line for line in data_lines if line.startswith("train: ")]
    if len(counted) != len(cfg.data.train_files):
        return None
    return sum(int(line.rsplit(": ", 2)[-1].split(" samples", 1)[0]) for line in counted)


def _check_plugins(report: Report, modules: list[str], key: str) -> bool:
    """Whether every module of `reward.plugins` / `agent.plugins` imports (each one that does not
    is a problem naming it and why). A plugin registers verifiers or tools when imported, so it is
    imported here, as the run would."""
    import importlib

    ok = True
    for i, name in enumerate(modules):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            ok = False
            hint = ""
            if exc.name in (name, name.split(".")[0]):  # the module itself, not one it imports
                hint = "; is its folder on PYTHONPATH?" + (
                    " (PYTHONSAFEPATH=1 leaves the current folder off the path)"
                    if sys.flags.safe_path
                    else ""
                )
            report.add(f"{key}[{i}]", f"cannot import module {name!r}: {exc}{hint}")
        except Exception as exc:  # noqa: BLE001 - the plugin's own code failed while importing
            ok = False
            report.add(f"{key}[{i}]", f"importing module {name!r} failed: {type(exc).__name__}: {exc}")
    return ok


def _check_reward_models(report: Report, cfg, plugins_ok: bool) -> None:
    """`reward.model_rewards.models`: each has a name (once), a registered type, and only the
    constructor arguments its type takes, as `mmrl.rewards.catalog.build_reward_models` will
    require when the run builds them."""
    import dataclasses

    from mmrl.rewards.config import TYPED_CONFIGS

    seen: set[str] = set()
    registered: list[str] | None = None
    for i, model_cfg in enumerate(cfg.reward.model_rewards.models):
        where = f"reward.model_rewards.models[{i}]"
        if not model_cfg.name:
            report.add(f"{where}.name", "missing (the name samples ask for in reward_model.models)")
        elif model_cfg.name in seen:
            report.add(f"{where}.name", f"{model_cfg.name!r} is configured twice")
        seen.add(model_cfg.name)
        model_type = model_cfg.type or model_cfg.name
        if not model_type:
            continue
        typed = TYPED_CONFIGS.get(model_type)
        if typed is None:
            if registered is None:
                if not plugins_ok:
                    return  # a plugin may register it: the plugin's problem is reported
                from mmrl.rewards.catalog import reward_model_names  # imports the built-in models

                registered = reward_model_names()
            if model_type not in registered:
                key = f"{where}.type" if model_cfg.type else f"{where}.name"
                report.add(
                    key,
                    f"unknown reward model type {model_type!r} (known: {', '.join(registered)}; others "
                    "register from a module named in reward.plugins)",
                )
            continue
        known = sorted(f.name for f in dataclasses.fields(typed))
        unknown = sorted(set(model_cfg.kwargs) - set(known))
        if unknown:
            report.add(
                f"{where}.kwargs",
                f"unknown key(s) {unknown} for reward model type {model_type!r} (known: {', '.join(known)})",
            )


def _check_mlflow_store(report: Report, trainer) -> None:
    """With `mlflow` in `trainer.loggers`: the tracking URI is not MLflow's file store, which
    the run refuses when it opens its trackers (`mmrl.train.metrics_log.MlflowTracker`)."""
    if "mlflow" not in trainer.loggers or importlib.util.find_spec("mlflow") is None:
        return  # a missing mlflow is reported with the packages
    from mmrl.train.metrics_log import mlflow_store_problem, mlflow_tracking_uri

    problem = mlflow_store_problem(mlflow_tracking_uri(trainer.mlflow))
    if problem:
        report.add("trainer.mlflow.tracking_uri", problem)


def _check_run_dir(report: Report, cfg) -> None:
    """A named run folder that another run holds (`run.lock`), or that holds a finished run
    and is not resumed: what the run would refuse after loading its data."""
    if not cfg.trainer.run_dir:
        return
    from mmrl.train.rundir import RunDirLock

    run_dir = Path(cfg.trainer.run_dir)
    busy = RunDirLock(run_dir, "mmrl train").in_use()
    if busy:
        report.add("trainer.run_dir", busy)
    metrics = run_dir / "metrics.jsonl"
    if not cfg.trainer.resume and metrics.is_file() and metrics.stat().st_size > 0:
        report.add(
            "trainer.run_dir",
            f"{run_dir} already holds a run (metrics.jsonl): continue it with --resume auto, or choose another "
            "trainer.run_dir",
        )


def gpus_needed(cfg) -> tuple[int, str] | None:
    """How many GPUs this machine must have for `cfg`, and why; None when it needs none here
    (CPU runs, or a Ray cluster joined by `trainer.ray_address`, whose GPUs may be elsewhere)."""
    import math

    t = cfg.trainer
    if t.backend == "ray":
        if t.ray_address:
            return None
        per_actor = t.ray_gpus_per_actor
        total = per_actor * (t.train_workers + t.rollout_workers) + t.ray_reward_gpus * t.reward_workers
        if total <= 0:
            return None
        why = (
            f"trainer.backend=ray with trainer.ray_gpus_per_actor={per_actor:g} for {t.train_workers} training + "
            f"{t.rollout_workers} rollout workers"
        )
        if t.ray_reward_gpus:
            why += f" and trainer.ray_reward_gpus={t.ray_reward_gpus:g} for {t.reward_workers} reward workers"
        return math.ceil(total - 1e-9), why
    if t.device.startswith("cuda"):
        index = t.device.partition(":")[2]
        return (int(index) + 1 if index.isdigit() else 1), f"trainer.device={t.device}"
    if cfg.rollout.engine == "vllm":
        return 1, "rollout.engine=vllm"
    return None


def _check_gpu_count(report: Report, cfg) -> None:
    """Enough visible GPUs for what `cfg` places on them (`gpus_needed`)."""
    need = gpus_needed(cfg)
    if need is None:
        return
    count, why = need
    gpus = visible_gpus()
    have = 0 if gpus is None else len(gpus)
    if have < count:
        seen = "no GPU is visible (nvidia-smi)" if not have else f"{have} GPU(s) are visible"
        report.add(
            "gpu",
            f"{why} needs {count} GPU(s), but {seen}: run it on a machine with them, join a Ray cluster that "
            "has them (trainer.ray_address), or ask for fewer",
        )


def _train_packages(cfg) -> list[tuple[str, str]]:
    """(module, why) for every optional package the run needs."""
    t = cfg.trainer
    needs = [
        (name, f"trainer.loggers has {name}")
        for name in t.loggers
        if name in ("wandb", "mlflow", "tensorboard")
    ]
    if t.backend == "ray":
        needs.append(("ray", "trainer.backend=ray"))
    if t.strategy == "deepspeed":
        needs.append(("deepspeed", "trainer.strategy=deepspeed"))
    if cfg.rollout.engine == "vllm":
        needs.append(("vllm", "rollout.engine=vllm"))
    if any(_is_hub_source(entry) for entry in [*cfg.data.train_files, *cfg.data.heldout_files]):
        needs.append(("datasets", "data.train_files / heldout_files read a dataset by name"))
    for i, model_cfg in enumerate(cfg.reward.model_rewards.models):
        for name in REWARD_PACKAGES.get(model_cfg.type or model_cfg.name, ()):
            needs.append((name, f"reward.model_rewards.models[{i}] is {model_cfg.type or model_cfg.name}"))
    return needs


def _is_hub_source(entry: str) -> bool:
    """Whether an entry is read through the `datasets` library (anything but a sample file)."""
    from mmrl.datasets.sources import SAMPLE_FILE_SUFFIXES, local_path, parse_source

    try:
        spec = parse_source(entry)
    except ValueError:
        return False
    local = local_path(spec.path)
    return not (local is not None and local.suffix.lower() in SAMPLE_FILE_SUFFIXES and not spec.data_files)


def _check_sample_models(report: Report, where: str, entry: str, samples: list, cfg) -> None:
    """The first sample of a source that asks (`reward_model.models`) for a reward model the run
    does not configure (`reward.model_rewards.models`), as the trainer refuses it."""
    configured = {m.name for m in cfg.reward.model_rewards.models}
    for sample in samples:
        for asked in sample.reward_model.models:
            name = asked.get("name") if isinstance(asked, dict) else None
            if name not in configured:
                report.add(
                    where,
                    f"{entry}: sample {sample.id}: field 'reward_model.models': reward model {name!r} is not "
                    f"configured (reward.model_rewards.models: {sorted(configured) or 'none'})",
                )
                return


def _check_data(report: Report, cfg, read_data: bool, online: bool) -> list[str]:
    """Every data source exists (or the hub has it); with `read_data`, read and count them."""
    d = cfg.data
    if not d.train_files:
        from mmrl.datasets.procedural import kinds as known_kinds

        known = known_kinds()
        unknown = [k for k in d.kinds if k not in known]
        if unknown or not d.kinds:
            report.add(
                "data.kinds", f"unknown procedural kind(s) {unknown}: choose from {', '.join(sorted(known))}"
            )
        kinds = ", ".join(d.kinds)
        return [
            f"data: built-in {d.task} ({kinds}): {d.num_train} training, {d.num_heldout} held-out samples"
        ]
    if not d.heldout_files:
        report.add("data.heldout_files", "data.train_files is set: give data.heldout_files too")
    lines = []
    for key, files in (("data.train_files", d.train_files), ("data.heldout_files", d.heldout_files)):
        for i, entry in enumerate(files):
            where = f"{key}[{i}]"
            if not _find_source(report, where, entry, online):
                continue
            if not read_data:
                continue
            from mmrl.datasets.schema import SampleError
            from mmrl.datasets.sources import load_source

            try:  # the plugins were imported by `_check_plugins`: their verifier names are known
                loaded = load_source(entry, max_prompt_chars=d.max_prompt_chars)
            except (SampleError, ValueError, OSError, ImportError) as exc:
                report.add(where, str(exc))
                continue
            _check_sample_models(report, where, entry, loaded.samples, cfg)
            lines.append(
                f"{key.split('.')[1].removesuffix('_files')}: {entry}: {len(loaded.samples)} samples, {loaded.layout} layout ({loaded.origin})"
            )
    return lines


def _find_source(report: Report, where: str, entry: str, online: bool) -> bool:
    """Whether `entry` can be found: a local path that exists, a builder whose files exist, or a
    hub id that is cached or that the hub has (one short request). Adds the problem if not."""
    from mmrl.datasets.sources import BUILDERS, local_path, missing_path_error, parse_source
    from mmrl.hub import HUB_ID, ask_hub, hub_offline, is_cached, unreachable_message

    try:
        spec = parse_source(entry)
    except ValueError as exc:
        report.add(where, str(exc))
        return False
    local = local_path(spec.path)
    if local is not None:
        if not local.exists():
            report.add(where, str(missing_path_error(entry, spec.path)))
            return False
        return True
    if spec.path in BUILDERS:
        missing = [f for f in spec.data_files if "*" not in f and "://" not in f and not Path(f).exists()]
        if missing:
            report.add(where, f"data source {entry!r}: no such file(s): {', '.join(missing)}")
        return not missing
    if not HUB_ID.fullmatch(spec.path):
        report.add(
            where,
            f"data source {entry!r}: {spec.path} is neither a local file or folder nor a hub id (org/name)",
        )
        return False
    if importlib.util.find_spec("datasets") is None:
        return False  # reported with the packages
    cached = is_cached(spec.path, "dataset")
    if hub_offline():
        if not cached:
            report.add(
                where,
                f"data source {entry!r}: hub dataset {spec.path!r} is not in the local cache and HF_HUB_OFFLINE=1 is "
                "set: download it once with the hub reachable, or point at a local copy",
            )
        return cached
    if not online:
        return True
    answer = ask_hub(spec.path, "dataset", spec.revision)
    if answer.state == "missing":
        report.add(where, f"data source {entry!r}: hub dataset {spec.path!r}: {answer.detail}")
    elif answer.state == "unreachable":
        extra = " (a copy is in the local cache: HF_HUB_OFFLINE=1 reads it)" if cached else ""
        report.add(where, unreachable_message(f"data source {entry!r}", answer) + extra)
    return answer.state == "found"


def _check_model(
    report: Report, path: str | None, revision: str | None, key: str, online: bool, builtin: str = ""
) -> str:
    """A local model folder, or a hub id that is cached or that the hub has. Returns a line
    describing it."""
    from mmrl.hub import HUB_ID, ask_hub, hub_cache_dir, hub_offline, is_cached, unreachable_message

    if path is None:
        return builtin or "the built-in tiny base (built once by a short warm-up, then cached)"
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists() and not (local / "model_index.json").exists():
            report.add(
                key,
                f"{local}: not a Hugging Face model folder (no config.json); save one with save_pretrained",
            )
        return f"{local} (local folder)"
    if local.exists() or not HUB_ID.fullmatch(path) or path.startswith((".", "/", "~")):
        resolved = local if local.is_absolute() else Path.cwd() / local
        report.add(key, f"no such model folder: {resolved} (and not a hub id like org/name)")
        return path
    at = f" at revision {revision!r}" if revision else ""
    kind = "model"
    cached = is_cached(path, kind, revision) or _cached_pipeline(path)
    if hub_offline():
        if not cached:
            report.add(
                key,
                f"{path}{at}: not in the local cache ({hub_cache_dir()}) and HF_HUB_OFFLINE=1 is set: download it "
                f"where there is a network (`hf download {path}`), or pass a local folder",
            )
        return f"{path} (hub id, cached)"
    if not online:
        return f"{path} (hub id)"
    answer = ask_hub(path, kind, revision)
    if answer.state == "missing":
        report.add(key, f"{path}{at}: {answer.detail}")
    elif answer.state == "unreachable" and not cached:
        report.add(key, unreachable_message(f"{path}{at} (not in the local cache)", answer))
    return f"{path} (hub id, {'cached' if cached else 'will be downloaded into ' + hub_cache_dir()})"


def _cached_pipeline(repo_id: str) -> bool:
    """A diffusers pipeline in the hub cache (it has `model_index.json`, not `config.json`)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "model_index.json"), str)


def _check_packages(report: Report, needs: list[tuple[str, str]]) -> None:
    """A problem, with its install line, for every needed package that is not installed."""
    seen = set()
    for module, why in needs:
        if module in seen:
            continue
        seen.add(module)
        if importlib.util.find_spec(module) is None:
            install = PACKAGES.get(module, f"pip install {module}")
            report.add(f"package {module}", f"needed ({why}) but not installed: {install}")


# --------------------------------------------------------------------------- GPU


def visible_gpus() -> list[dict[str, Any]] | None:
    """`[{"index", "name", "total_mib", "free_mib"}]` of the GPUs `nvidia-smi` lists (restricted
    to `CUDA_VISIBLE_DEVICES` when it names indices), or None when there is no NVIDIA GPU."""
    import os

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,name,memory.total,memory.free",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    gpus = []
    for line in out.stdout.strip().splitlines():
        index, name, total, free = (part.strip() for part in line.split(","))
        gpus.append({"index": index, "name": name, "total_mib": float(total), "free_mib": float(free)})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and all(v.strip().isdigit() for v in visible.split(",") if v.strip()):
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        gpus = [g for i in wanted for g in gpus if g["index"] == i]
    return gpus or None


def model_parameters(path: str | None, revision: str | None = None) -> tuple[float, int] | None:
    """(parameters, bytes per parameter on disk) from a local folder's or the hub cache's
    safetensors (the index's `total_size`, else the files' sizes), or None when unknown."""
    if path is None:
        return None
    folder = Path(path).expanduser()
    if not folder.is_dir():
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(path, "config.json", revision=revision)
        if not isinstance(found, str):
            return None
        folder = Path(found).parent
    config = folder / "config.json"
    dtype = "bfloat16"
    if config.exists():
        conf = json.loads(config.read_text(encoding="utf-8"))
        dtype = (
            conf.get("torch_dtype")
            or conf.get("dtype")
            or (conf.get("text_config") or {}).get("dtype")
            or dtype
        )
    width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(dtype), 2)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        total = json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
        if total:
            return total / width, width
    files = list(folder.glob("*.safetensors"))
    if not files:
        return None
    return sum(f.stat().st_size for f in files) / width, width


def estimate_train_gib(cfg, parameters: float) -> tuple[float, str]:
    """A rough peak of one training GPU's memory (GiB) and how it was made up: weights in the
    compute dtype, float32 master weights, gradients and AdamW moments of what trains (16 B per
    trained parameter, sharded over `train_workers`, moved to the host by ZeRO offload), the
    KL reference, a colocated vLLM engine's share, and a flat 20% for activations and
    fragmentation; a colocated vLLM engine's share is taken off the GPU by the caller. Not a
    measurement: the peak memory a run logs is."""
    t, m = cfg.trainer, cfg.model
    compute = 2 if m.dtype in ("auto", "bfloat16", "float16") else 4
    lora = m.lora_rank > 0
    trained = parameters * (0.02 if lora else 1.0)  # LoRA adapters: ~1-2% of the weights at rank 64
    shards = t.train_workers if t.backend == "ray" else 1
    parts = {"weights": parameters * compute}
    state = trained * 16 / shards
    if t.strategy == "deepspeed" and t.zero_offload_optimizer:
        state = trained * 4 / shards  # gradients stay; master weights and moments live on the host
    parts["trained state"] = state
    if cfg.algo.kl_coef > 0 and not lora and not m.reference_on_cpu:
        parts["KL reference"] = parameters * compute
    how = ", ".join(f"{k} {v / 2**30:.0f}" for k, v in parts.items())
    return sum(parts.values()) / 2**30 * 1.2, how


def _check_gpu(report: Report, cfg, model_line: str) -> str:
    """Where the run will compute; with a GPU, its memory against `estimate_train_gib`."""
    gpus = visible_gpus()
    if gpus is None:
        return "CPU (no GPU visible)"
    smallest = min(g["total_mib"] for g in gpus) / 1024
    where = f"{len(gpus)} x {gpus[0]['name']} ({smallest:.0f} GiB)"
    if cfg.trainer.device == "cpu":
        return "CPU (trainer.device=cpu)"
    counted = model_parameters(cfg.model.path, cfg.model.revision)
    if counted is None:
        return where + "; memory not estimated (the model's weights are not on this machine yet)"
    need, how = estimate_train_gib(cfg, counted[0])
    available = smallest
    if cfg.rollout.engine == "vllm" and cfg.trainer.backend == "local":
        available = smallest * (1 - cfg.rollout.vllm_gpu_memory_utilization)
    if need > available:
        report.add(
            "gpu",
            f"a rough estimate of {need:.0f} GiB per training GPU ({how}, +20%; {counted[0] / 1e9:.1f}B parameters) "
            f"exceeds the {available:.0f} GiB available on {where}: use LoRA (model.lora_rank), "
            "model.gradient_checkpointing, trainer.strategy=deepspeed with trainer.zero_offload_optimizer, or more GPUs",
        )
    return f"{where}; rough need {need:.0f} GiB per training GPU"


# --------------------------------------------------------------------------- diffusion, eval, serve


def _check_diffusion(
    report: Report, task: str, config_file: str | None, overrides: list[str], online: bool
) -> Report:
    """flow-GRPO recipes: the config, the model, the prompt file, the rewards' packages and files."""
    from mmrl.config import recipe_kind

    try:
        from mmrl.train.flow_config import load_flow_config

        cfg = load_flow_config(task, config_file, overrides)
    except (ValueError, FileNotFoundError) as exc:
        report.add("config", str(exc).removeprefix("invalid config: "))
        return report
    report.config = cfg
    model = _check_model(
        report,
        cfg.model.path,
        cfg.model.revision,
        "model.path",
        online,
        builtin="the built-in tiny diffusion model",
    )
    if cfg.data.prompt_file and not Path(cfg.data.prompt_file).exists():
        report.add("data.prompt_file", f"no such file: {Path(cfg.data.prompt_file).resolve()}")
    needs = [("diffusers", "a diffusion recipe")]
    needs += [
        (p, f"reward.names has {name}") for name in cfg.reward.names for p in REWARD_PACKAGES.get(name, ())
    ]
    needs += [
        (n, f"trainer.loggers has {n}")
        for n in cfg.trainer.loggers
        if n in ("wandb", "mlflow", "tensorboard")
    ]
    _check_packages(report, needs)
    _check_mlflow_store(report, cfg.trainer)
    for name, kwargs in cfg.reward.kwargs.items():
        for key, value in kwargs.items():
            if key.endswith(("_weights", "_path")) and isinstance(value, str) and not Path(value).exists():
                report.add(f"reward.kwargs.{name}.{key}", f"no such file: {value}")
    if not report.problems:
        gpus = visible_gpus()
        where = "CPU (no GPU visible)" if gpus is None else f"{len(gpus)} x {gpus[0]['name']}"
        prompts = cfg.data.prompt_file or f"built-in {cfg.data.builtin} prompts"
        report.summary = [
            f"flow-GRPO ({recipe_kind(task)}) for {cfg.trainer.total_steps} steps of {cfg.trainer.prompts_per_step} "
            f"prompts x {cfg.sample.group_size} images, rewards {', '.join(cfg.reward.names)}",
            f"model: {model}",
            f"where: {where}",
            f"prompts: {prompts}",
        ]
    return report


def check_eval(
    model: str, suite: str | None, judge_model: str | None, media_root: str | None, base: str | None = None
) -> Report:
    """`mmrl eval`'s model (local folder or hub id), suite, judge, media folder and pass@k base."""
    report = Report()
    line = _check_model(report, model, None, "--model", online=True)
    if base is not None:
        _check_model(report, base, None, "--base", online=True)
    if suite is not None and not Path(suite).exists():
        report.add("--suite", f"no such suite folder or file: {Path(suite).resolve()}")
    if judge_model is not None:
        _check_model(report, judge_model, None, "--judge-model", online=True)
    if media_root is not None and not Path(media_root).is_dir():
        report.add("--media-root", f"no such folder: {Path(media_root).resolve()}")
    report.summary = [f"evaluate {line} on {suite or 'the built-in mini-suite'}"]
    return report


def check_serve(config_file: str | None = None) -> Report:
    """`mmrl serve`'s packages (the `serve` extra), and the modules its config's `plugins` names
    (`config_file`: the `--config` YAML; a file that does not load is left to `mmrl serve`, which
    reports it)."""
    report = Report()
    _check_packages(report, [("fastapi", "mmrl serve"), ("uvicorn", "mmrl serve")])
    if config_file is not None and not report.problems:
        from mmrl.server.config import load_serve_config

        try:
            plugins = load_serve_config(config_file).plugins
        except Exception:  # noqa: BLE001 - reported by `mmrl serve` itself, with its own wording
            return report
        _check_plugins(report, plugins, "plugins")
    return report
