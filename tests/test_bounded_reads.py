"""Bounded reads (issue 48, item 18): a config or data path that names a device, a FIFO or a file
too large to read whole is refused at once with its path, never read until memory runs out or
opened to block forever.

A FIFO that the code under test opens by mistake blocks until a writer appears: each FIFO here
has a hang guard that opens it for writing after a while (so a regression fails, not hangs)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mmrl.config import ConfigError, load_config

HANG_GUARD_S = 30  # a hang guard, not a performance check


@contextlib.contextmanager
def fifo(path: Path):
    """A FIFO at `path`, released (opened for writing, then closed: the reader sees its end) if
    something still blocks on it after `HANG_GUARD_S`."""
    os.mkfifo(path)

    def release():
        with contextlib.suppress(OSError):  # ENXIO: nobody is reading, nothing to release
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(HANG_GUARD_S, release)
    timer.start()
    try:
        yield path
    finally:
        timer.cancel()


def _limited_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # an unbounded read fails here


def test_config_dev_zero_is_refused_naming_it():
    out = subprocess.run(
        [sys.executable, "-m", "mmrl.cli", "check", "--config", "/dev/zero"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1"),
        preexec_fn=_limited_memory,
        timeout=300,  # a hang guard
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "/dev/zero: is a character device, not a regular file" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_config_fifo_or_a_config_too_large_is_refused_naming_it(tmp_path):
    with fifo(tmp_path / "cfg.yaml") as path, pytest.raises(ConfigError, match="is a FIFO") as info:
        load_config("vision_reasoning", path)
    assert str(path) in str(info.value)
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)  # 2 MB of valid YAML
    with pytest.raises(ConfigError, match=r"big.yaml: more than 1 MiB, too large for a config file"):
        load_config("vision_reasoning", big)


def _record(image: str) -> dict:
    return {
        "data_source": "toy",
        "prompt": [{"role": "user", "content": "<image>What is it?"}],
        "images": [image],
        "reward_model": {"ground_truth": "1", "verifier": "math"},
        "extra_info": {"id": "a"},
    }


def test_a_fifo_named_as_an_image_path_is_refused_naming_the_record(tmp_path):
    from mmrl.datasets.readers import read_samples
    from mmrl.datasets.schema import SampleError

    (tmp_path / "train.jsonl").write_text(json.dumps(_record("pipe.png")) + "\n")
    with fifo(tmp_path / "pipe.png"):
        # Without decoding too: training would open it later, and hang there.
        with pytest.raises(
            SampleError, match=r"train.jsonl:1 \(id=a\): field 'images\[0\]'.*pipe.png is a FIFO"
        ):
            read_samples(tmp_path / "train.jsonl", check_images=False)


@pytest.mark.parametrize("name", ["train.jsonl", "train.parquet"])
def test_a_fifo_named_as_a_sample_file_is_refused_naming_it(name, tmp_path):
    from mmrl.datasets.converters import read_records
    from mmrl.datasets.readers import read_samples
    from mmrl.datasets.sources import read_source

    with fifo(tmp_path / name) as path:
        with pytest.raises(ValueError, match=f"{path} is a FIFO"):
            read_source(str(path))
        with pytest.raises(ValueError, match=f"{path}: is a FIFO"):
            read_samples(path)
        with pytest.raises(ValueError, match=f"{path}: is a FIFO"):
            read_records(path)  # mmrl convert


def test_a_sample_file_too_large_to_read_whole_says_how_to_read_it(tmp_path, monkeypatch):
    from mmrl.datasets.readers import read_samples

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(_record("a.png")) + "\n")
    monkeypatch.setattr("mmrl.files.MAX_DATA_FILE_BYTES", 100)
    with pytest.raises(ValueError, match=r"more than the 100 bytes a file read whole may have") as info:
        read_samples(path)
    assert f"data.train_files=[json@train?data_files={path}]" in str(info.value)


def test_a_prompt_file_fifo_is_refused_naming_it(tmp_path):
    from mmrl.datasets.prompts_t2i import read_prompt_file

    with fifo(tmp_path / "prompts.txt") as path, pytest.raises(ValueError, match=f"{path}: is a FIFO"):
        read_prompt_file(str(path))


def test_the_server_refuses_a_fifo_under_its_image_root(tmp_path):
    from mmrl.server.protocol import RequestError, check_image

    with fifo(tmp_path / "pipe.png"), pytest.raises(RequestError, match="pipe.png is a FIFO") as info:
        check_image({"path": "pipe.png"}, "samples[0].images[0]", decode=True, image_root=tmp_path)
    assert info.value.status == 422 and "samples[0].images[0]" in info.value.message
