"""Datasets by name (`mmrl.datasets.sources`): hub-layout datasets built here and saved locally
(`save_to_disk`, and Parquet files in a hub repo's `data/<split>-*.parquet` layout) in EasyR1's
and V-Triune's column layouts are read through the `datasets` library, mapped onto the sample
format and trained on for a few steps; a hub id under HF_HUB_OFFLINE=1 fails naming the id;
unknown layouts, ambiguous splits and bad rows fail naming the columns, splits and fields."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.schema import SampleError
from mmrl.datasets.sources import parse_source, read_source
from mmrl.train.grpo import train
from mmrl.train.metrics_log import read_metrics


def _easyr1_rows(split: str, n: int) -> list[dict]:
    """EasyR1's layout (hiyouga/geometry3k's): `images`, `problem`, `answer`."""
    return [
        {
            "images": [s.images[0]],
            "problem": s.prompt[0]["content"],
            "answer": s.reward_model.ground_truth,
        }
        for s in make_samples(["colour_code"], n, split)
    ]


def _vtriune_rows(split: str, n: int) -> list[dict]:
    """V-Triune's layout (Orsta-Data-47k's): their verifier names and `verifier_parm`."""
    return [
        {
            "data_source": "orsta_colour",
            "images": [s.images[0]],  # cast to the Image feature below: {"bytes", "path"}
            "prompt": s.prompt,
            "ability": "math",
            "reward_model": {
                "answer": s.reward_model.ground_truth,
                "ground_truth": s.reward_model.ground_truth,
                "accuracy_ratio": 1.0,
                "format_ratio": 0.0,
                "verifier": "mathverify",
                "verifier_parm": {"det_verifier_normalized": None, "det_reward_ratio": None},
            },
            "extra_info": {"id": f"orsta/{split}/{i}", "image_path": f"img_{i}.png"},
        }
        for i, s in enumerate(make_samples(["colour_code"], n, "heldout" if split == "test" else split))
    ]


def _pixels(sample) -> list[bytes]:
    return [image.convert("RGB").tobytes() for image in sample.pil_images()]


@pytest.fixture(scope="module")
def local_datasets(tmp_path_factory):
    """An EasyR1 dataset written with `save_to_disk` and a V-Triune one as a hub repo's Parquet
    files (train and test splits). Its `verifier_parm` is a struct column, so every row carries
    every key, null where it has none (the mapping reads null as absent)."""
    from datasets import Dataset, Features, Image, List, Value

    root = tmp_path_factory.mktemp("hub")
    image = List(Image())
    easyr1 = Features({"images": image, "problem": Value("string"), "answer": Value("string")})
    rows = _easyr1_rows("train", 24)
    columns = {key: [row[key] for row in rows] for key in easyr1}
    Dataset.from_dict(columns, features=easyr1).save_to_disk(str(root / "geo_disk"))
    (root / "orsta" / "data").mkdir(parents=True)
    for split, n in (("train", 24), ("test", 8)):
        ds = Dataset.from_list(_vtriune_rows(split, n))
        ds = ds.cast_column("images", image)
        ds.to_parquet(str(root / "orsta" / "data" / f"{split}-00000-of-00001.parquet"))
    return root


def test_easyr1_and_vtriune_layouts_map_onto_the_sample_format(local_datasets):
    easy = read_source(str(local_datasets / "geo_disk"))
    assert len(easy) == 24
    first, source = easy[0], make_samples(["colour_code"], 24, "train")[0]
    assert first.data_source == "geo_disk" and first.id == "geo_disk/0"  # EasyR1 rows name no source
    assert (
        first.reward_model.verifier == "math"
        and first.reward_model.ground_truth == source.reward_model.ground_truth
    )
    assert first.prompt == source.prompt
    assert isinstance(first.images[0], bytes)  # kept encoded, decoded only when used
    assert _pixels(first) == _pixels(source)
    orsta = read_source(f"{local_datasets / 'orsta'}@train")
    assert len(orsta) == 24 and orsta[3].id == "orsta/train/3" and orsta[3].data_source == "orsta_colour"
    assert orsta[3].reward_model.verifier == "math"  # V-Triune's mathverify
    assert orsta[3].reward_model.verifier_params == {"format": "think_answer"}  # V-Triune's math format
    assert orsta[3].extra_info["answer"] == orsta[3].reward_model.ground_truth
    assert _pixels(orsta[3]) == _pixels(make_samples(["colour_code"], 24, "train")[3])
    # Streaming reads a prefix without materialising the dataset first: the same first rows.
    streamed = read_source(f"{local_datasets / 'orsta'}@train?streaming=true&max_samples=5")
    assert [s.id for s in streamed] == [s.id for s in orsta[:5]]
    assert read_source(f"{local_datasets / 'geo_disk'}?max_samples=3&data_source=geo3k")[2].id == "geo3k/2"


def test_a_hub_layout_dataset_saved_locally_trains_for_a_few_steps(mmrl_cache, local_datasets, tmp_path):
    files = f"[{local_datasets / 'geo_disk'},{local_datasets / 'orsta'}@train]"
    cfg = load_config(
        "vision_reasoning",
        overrides=[
            f"data.train_files={files}",
            f"data.heldout_files=[{local_datasets / 'orsta'}@test]",
            "trainer.total_steps=2",
            "trainer.prompts_per_step=4",
            "rollout.group_size=2",
            "trainer.eval_every=2",
            "trainer.progress=false",
            "trainer.save_final=false",
            "trainer.threads=1",
            "reward.num_workers=0",  # verifiers in this process: no worker to start
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(cfg)
    assert result.steps == 2
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    seen = {k.removeprefix("reward/mean/") for r in steps for k in r if k.startswith("reward/mean/")}
    assert seen <= {"geo_disk", "orsta_colour"} and seen  # per-source metrics from both layouts
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]  # greedy held-out accuracy on the V-Triune test split


def test_a_hub_id_offline_fails_naming_it():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    with pytest.raises(
        ValueError, match=r"'hiyouga/geometry3k'.*not in the local Hugging Face cache.*HF_HUB_OFFLINE"
    ):
        read_source("hiyouga/geometry3k@train?revision=main")
    cfg = load_config(
        "vision_reasoning",
        overrides=[
            "data.train_files=[hiyouga/geometry3k@train]",
            "data.heldout_files=[hiyouga/geometry3k@test]",
        ],
    )
    from mmrl.train.data import load_data

    with pytest.raises(ValueError, match="hiyouga/geometry3k"):
        load_data(cfg)


def test_unknown_layouts_splits_and_options_are_errors_naming_them(local_datasets, tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"question": "2+2?", "solution": "4"}]).save_to_disk(str(tmp_path / "qa"))
    with pytest.raises(ValueError, match=r"unknown column layout \(columns: question, solution\)"):
        read_source(str(tmp_path / "qa"))
    # EasyR1's options rename the columns, as its data.prompt_key / answer_key do.
    (sample,) = read_source(f"{tmp_path / 'qa'}?prompt_key=question&answer_key=solution")
    assert sample.prompt == [{"role": "user", "content": "2+2?"}] and sample.reward_model.ground_truth == "4"
    with pytest.raises(ValueError, match=r"has the splits (train, test|test, train): choose one with @SPLIT"):
        read_source(str(local_datasets / "orsta"))
    with pytest.raises(ValueError, match=r"orsta@validation.*validation.*'train', 'test'"):
        read_source(f"{local_datasets / 'orsta'}@validation")
    with pytest.raises(ValueError, match=r"must be key=value pairs"):
        parse_source("org/name@train?streaming")
    with pytest.raises(ValueError, match=r"unknown option 'revison'"):
        parse_source("org/name@train?revison=main")
    spec = parse_source("org/name@train?config=default&revision=abc123&streaming=true&max_samples=10")
    assert (spec.path, spec.split, spec.config, spec.revision, spec.streaming, spec.max_samples) == (
        "org/name", "train", "default", "abc123", True, 10,
    )  # fmt: skip


def test_a_bad_row_names_the_source_row_and_field_in_its_own_spelling(tmp_path):
    from datasets import Dataset

    rows = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "What is 2+2?", "answer": None}]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(SampleError, match=r"bad row 1 \(id=bad/1\): field 'answer': missing"):
        read_source(str(tmp_path / "bad"))


def test_a_local_easyr1_parquet_file_is_recognised_by_its_columns(local_datasets, tmp_path):
    import pyarrow.parquet as pq

    table = pq.read_table(local_datasets / "orsta" / "data" / "test-00000-of-00001.parquet")
    pq.write_table(table, tmp_path / "orsta_test.parquet")
    samples = read_source(str(tmp_path / "orsta_test.parquet"))
    assert len(samples) == 8 and samples[0].reward_model.verifier == "math"
    from datasets import load_from_disk

    load_from_disk(str(local_datasets / "geo_disk")).to_parquet(str(tmp_path / "geo3k_train.parquet"))
    samples = read_source(str(tmp_path / "geo3k_train.parquet"))
    assert samples[0].data_source == "geo3k_train" and samples[0].id == "geo3k_train/0"
    assert Path(samples[0].extra_info["source_file"]).name == "geo3k_train.parquet"


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_a_local_file_of_an_unknown_layout_names_its_columns(suffix, tmp_path):
    """Issue 48, item 6: as for a folder or a hub dataset, not "field 'data_source': missing"."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "2+2?", "solution": "4"}, {"question": "3+3?", "solution": "6"}]
    path = tmp_path / f"qa{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows, indent=1))
    with pytest.raises(ValueError, match=r"unknown column layout \(columns: question, solution\)") as info:
        read_source(str(path))
    assert str(path) in str(info.value) and "prompt_key=" in str(info.value)
    # Renamed as EasyR1's options do, the same file reads.
    (first, _) = read_source(f"{path}?prompt_key=question&answer_key=solution")
    assert first.reward_model.ground_truth == "4"


def test_a_local_sample_file_with_a_mistake_still_names_the_field(tmp_path):
    """A record meant as an mmrl sample (it has a field of the format) keeps the reader's
    error naming the field, not the layout error."""
    path = tmp_path / "train.jsonl"
    path.write_text('{"data_source": "toy", "prompt": "hi", "extra_info": {"id": "a"}}\n')
    with pytest.raises(SampleError, match=r"train.jsonl:1 \(id=a\): field 'reward_model': missing"):
        read_source(str(path))


def test_a_hub_ids_split_config_revision_and_streaming_reach_load_dataset(local_datasets, monkeypatch):
    # What `datasets.load_dataset` is called with for a hub id and its options (the hub itself is
    # out of reach: the call returns the local EasyR1 rows, as a streamed split).
    import datasets

    calls = []

    def load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.load_from_disk(str(local_datasets / "geo_disk")).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    samples = read_source("hiyouga/geometry3k@train?config=geo&revision=abc123&streaming=true&max_samples=3")
    assert calls == [
        ("hiyouga/geometry3k", {"streaming": True, "name": "geo", "revision": "abc123", "split": "train"})
    ]
    assert len(samples) == 3


@pytest.mark.parametrize("offline", ["1", ""])
def test_a_mistyped_relative_path_names_the_missing_file_never_the_hub(offline, monkeypatch, tmp_path):
    """`nothere.jsonl` and `data/train.jsonl` are local paths that do not exist, offline and
    online: the error names the file and the folder it was resolved from, and the hub is never
    asked (it used to be taken for a hub dataset id: "not in the local cache" offline, minutes
    of retries and "cannot open hub dataset" online)."""
    import mmrl.hub

    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(mmrl.hub, "ask_hub", lambda *a, **k: pytest.fail("the hub was asked"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for entry, missing in (
        ("nothere.jsonl", "nothere.jsonl"),
        ("data/train.jsonl@train", "data/train.jsonl"),
    ):
        with pytest.raises(FileNotFoundError) as info:
            read_source(entry)
        assert str(info.value) == (
            f"data source {entry!r}: no such file or folder: {tmp_path / missing} (a relative path, resolved "
            f"from the current folder {tmp_path})"
        )


def test_loading_logs_each_sources_layout_and_row_count(local_datasets, caplog):
    import logging

    from mmrl.datasets.sources import load_source

    with caplog.at_level(logging.INFO, logger="mmrl.datasets.sources"):
        loaded = load_source(f"{local_datasets / 'orsta'}@test")
    assert (len(loaded.samples), loaded.layout, loaded.origin) == (8, "vtriune", "folder")
    assert f"data source {local_datasets / 'orsta'}@test: 8 samples, vtriune layout (folder)" in caplog.text


def test_hub_data_source_names_are_shortened_for_metric_names(tmp_path, monkeypatch):
    """veRL's geo3k rows carry `data_source: hiyouga/geometry3k`, which made names like
    `response/length_mean/correct/hiyouga/geometry3k`: read from the hub it becomes `geometry3k`
    (an alias when one is given; whole where shortening would merge two sources). A local file's
    sources keep their names unless aliased."""
    import datasets
    from mmrl.datasets.readers import write_jsonl
    from mmrl.train.data import load_data_report, short_source_names

    assert short_source_names({"hiyouga/geometry3k", "local"}, {}) == {
        "hiyouga/geometry3k": "geometry3k",
        "local": "local",
    }
    assert short_source_names({"hiyouga/geometry3k"}, {"hiyouga/geometry3k": "geo3k"}) == {
        "hiyouga/geometry3k": "geo3k"
    }
    assert short_source_names({"a/x", "b/x"}, {}) == {"a/x": "a/x", "b/x": "b/x"}
    verl_rows = [
        {
            "data_source": "hiyouga/geometry3k",
            "prompt": [{"role": "user", "content": s.prompt[0]["content"]}],
            "images": [{"bytes": _png(s), "path": None}],
            "reward_model": {"style": "rule", "ground_truth": s.reward_model.ground_truth},
            "extra_info": {"index": i},
        }
        for i, s in enumerate(make_samples(["colour_code"], 4, "train"))
    ]
    monkeypatch.setattr(datasets, "load_dataset", lambda path, **kw: datasets.Dataset.from_list(verl_rows))
    hub = ["data.train_files=[hiyouga/geometry3k@train]", "data.heldout_files=[hiyouga/geometry3k@test]"]
    train, heldout, report = load_data_report(load_config("vision_reasoning", overrides=hub))
    assert {s.data_source for s in train + heldout} == {"geometry3k"}
    assert report["source_names"] == [{"data_source": "hiyouga/geometry3k", "name": "geometry3k"}]
    assert report["train"] == [
        {"entry": "hiyouga/geometry3k@train", "rows": 4, "layout": "verl", "origin": "hub"}
    ]
    train, _, _ = load_data_report(
        load_config("vision_reasoning", overrides=[*hub, "data.source_aliases={hiyouga/geometry3k: geo3k}"])
    )
    assert {s.data_source for s in train} == {"geo3k"}
    samples = make_samples(["colour_code"], 4, "train")
    write_jsonl(samples, tmp_path / "local.jsonl")
    files = [
        f"data.train_files=[{tmp_path / 'local.jsonl'}]",
        f"data.heldout_files=[{tmp_path / 'local.jsonl'}]",
    ]
    train, _, report = load_data_report(load_config("vision_reasoning", overrides=files))
    assert {s.data_source for s in train} == {"vision_reasoning/colour_code"} and "source_names" not in report
    aliased = [*files, "data.source_aliases={vision_reasoning/colour_code: colours}"]
    train, _, _ = load_data_report(load_config("vision_reasoning", overrides=aliased))
    assert {s.data_source for s in train} == {"colours"}


def _png(sample) -> bytes:
    import io

    out = io.BytesIO()
    sample.pil_images()[0].save(out, format="PNG")
    return out.getvalue()


def test_built_in_sources_keep_their_names():
    from mmrl.train.data import load_data_report

    train, heldout, report = load_data_report(
        load_config("vision_reasoning", overrides=["data.num_train=8", "data.num_heldout=4"])
    )
    assert {s.data_source for s in train + heldout} == {"vision_reasoning/colour_code"}
    assert "source_names" not in report and len(train) == 8 and len(heldout) == 4
