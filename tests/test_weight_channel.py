"""The weight channel (`mmrl.distributed.weight_channel`): weights between the Ray roles over a
gloo group, packed in buckets of one dtype, converted to the receiver's dtypes; a sender that
fails tells its receiver instead of leaving it waiting."""

from __future__ import annotations

import threading

import pytest
import torch

from mmrl.distributed.weight_channel import ChannelEnd, free_address, layout_of

WAIT_S = 60.0


def _ends(world: int) -> list[ChannelEnd]:
    address = free_address()
    ends: dict[int, ChannelEnd] = {}
    threads = [threading.Thread(target=lambda r=r: ends.__setitem__(r, ChannelEnd(address, r, world, 30.0)))
               for r in range(world)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert len(ends) == world
    return [ends[r] for r in range(world)]


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(64, 32),
        "a.bias": torch.randn(64),
        "b.weight": torch.randn(16, 16).to(torch.bfloat16),
        "steps": torch.arange(7),
        "c.weight": torch.randn(128, 8),
    }


def test_a_state_dict_arrives_whole_in_several_buckets_of_one_dtype_each():
    sender, receiver = _ends(2)
    state = _state()
    layout = layout_of(state, bucket_bytes=4096)  # a.weight alone is 8 KiB: its own bucket
    assert len(layout.buckets) >= 4
    assert all(len({layout.dtypes[i] for i in b}) == 1 for b in layout.buckets)
    assert sorted(i for b in layout.buckets for i in b) == list(range(len(state)))
    got = {}
    t = threading.Thread(target=lambda: got.update(receiver.recv(layout, 0)))
    t.start()
    sender.send(state, 1, layout)
    t.join(WAIT_S)
    assert got.keys() == state.keys()
    for name, value in state.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def test_the_sender_converts_to_the_receivers_dtypes():
    """The driver's float32 copy to a layout in bfloat16 (what a receiver asks for)."""
    sender, receiver = _ends(2)
    state = {"w": torch.randn(10, 10), "v": torch.randn(3)}
    layout = layout_of({k: v.to(torch.bfloat16) for k, v in state.items()})
    got = {}
    t = threading.Thread(target=lambda: got.update(receiver.recv(layout, 0)))
    t.start()
    sender.send(state, 1, layout)
    t.join(WAIT_S)
    for name, value in state.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], value.to(torch.bfloat16))


@pytest.mark.parametrize("wrong", ["missing", "shape", "none"])
def test_a_sender_whose_weights_do_not_fit_tells_the_receiver_and_raises(wrong):
    sender, receiver = _ends(2)
    state = _state()
    layout = layout_of(state)
    if wrong == "missing":
        del state["a.bias"]
    elif wrong == "shape":
        state["a.bias"] = torch.zeros(65)
    else:
        state = None
    got = []
    t = threading.Thread(target=lambda: got.append(receiver.recv(layout, 0)))
    t.start()
    with pytest.raises(ValueError, match="not sending to rank 1"):
        sender.send(state, 1, layout)
    t.join(WAIT_S)
    assert got == [None]  # it stopped waiting


def test_fail_releases_a_waiting_receiver():
    """What the driver sends the workers still waiting after a send to another one failed."""
    sender, receiver = _ends(2)
    layout = layout_of(_state())
    got = []
    t = threading.Thread(target=lambda: got.append(receiver.recv(layout, 0)))
    t.start()
    sender.fail(1, "worker 0 died")
    t.join(WAIT_S)
    assert got == [None]


def test_point_to_point_between_three_ranks():
    """The driver (0) sends to a rollout worker (1) and receives from the trainer (2)."""
    driver, worker, trainer = _ends(3)
    state = _state()
    layout = layout_of(state)
    at_worker, at_driver = {}, {}
    threads = [
        threading.Thread(target=lambda: at_worker.update(worker.recv(layout, 0))),
        threading.Thread(target=lambda: trainer.send({k: v + 1 for k, v in state.items()}, 0, layout)),
    ]
    for t in threads:
        t.start()
    driver.send(state, 1, layout)
    at_driver.update(driver.recv(layout, 2))
    for t in threads:
        t.join(WAIT_S)
    assert all(torch.equal(at_worker[k], v) for k, v in state.items())
    assert all(torch.equal(at_driver[k], v + 1) for k, v in state.items())
