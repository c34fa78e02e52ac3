"""Weights between the Ray roles over a `torch.distributed` group, never in an RPC payload or
Ray's object store (the design page's rule for weight tensors).

One gloo group per run: the driver is rank 0 (it hosts the group's TCP store), rollout worker k
is rank 1 + k and the training group's rank 0 is the last rank. A transfer is point to point:
its message (`Layout`: names, dtypes and shapes, packed into buckets of one dtype of at most
`BUCKET_BYTES`) goes in the Ray call that asks the receiver to receive; the tensors go over the
group, a one-element status first (so a sender that fails tells its receiver, which then stops
instead of waiting for tensors that never come) and then one flat tensor per bucket.

Gloo carries CPU tensors (the driver's copy and the training group's gathered weights are on the
CPU already); a receiver's engine moves them to its own device and dtype as it loads them.
"""

from __future__ import annotations

import datetime
import math
import socket
from dataclasses import dataclass, field

import torch

BUCKET_BYTES = 256 << 20
"""The most bytes packed into one message tensor (a bucket of tensors of one dtype)."""
TIMEOUT_S = 600.0
"""How long a send or receive waits for its peer (a dead peer fails sooner: its connection closes)."""
OK, FAILED = 1, 0


@dataclass
class Layout:
    """What a transfer holds: names, shapes and dtypes in order, and which go in each bucket."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    buckets: list[list[int]] = field(default_factory=list)
    """Indices into `names`, one list per bucket (all of one dtype)."""


def layout_of(state_dict: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> Layout:
    """The layout of `state_dict` as it is (its own dtypes), in bucket order."""
    names = list(state_dict)
    layout = Layout(
        names, [tuple(state_dict[n].shape) for n in names], [_dtype_name(state_dict[n].dtype) for n in names]
    )
    open_buckets: dict[str, tuple[list[int], int]] = {}
    for i, name in enumerate(names):
        t = state_dict[name]
        size = t.numel() * t.element_size()
        indices, used = open_buckets.get(layout.dtypes[i], ([], 0))
        if indices and used + size > bucket_bytes:
            layout.buckets.append(indices)
            indices, used = [], 0
        open_buckets[layout.dtypes[i]] = (indices + [i], used + size)
    layout.buckets += [indices for indices, _ in open_buckets.values() if indices]
    return layout


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def free_address() -> str:
    """`host:port` for rank 0's store, on this node's address (as Ray sees it when it runs)."""
    try:
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except ImportError:
        host = "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{host}:{port}"


class ChannelEnd:
    """One rank of the weight channel. Every rank constructs its end at the same time (the
    constructor waits for all of them); rank 0 hosts the store at `address`."""

    def __init__(self, address: str, rank: int, world: int, timeout_s: float = TIMEOUT_S):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        host, port = address.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world = rank, world
        self.store = TCPStore(host, int(port), world, rank == 0, timeout=timeout)
        self.group = ProcessGroupGloo(PrefixStore("mmrl-weights", self.store), rank, world, timeout)

    def send(
        self, state_dict: dict[str, torch.Tensor] | None, dst: int, layout: Layout, error: str = ""
    ) -> None:
        """`state_dict` (every name of `layout`, each converted to its dtype) to rank `dst`; None
        (or names or shapes that differ from `layout`) sends a failure status and raises."""
        problem = error or _mismatch(state_dict, layout)
        self._status(dst, FAILED if problem else OK)
        if problem:
            raise ValueError(f"weight channel: not sending to rank {dst}: {problem}")
        for indices in layout.buckets:
            dtype = _dtype(layout.dtypes[indices[0]])
            flat = torch.cat(
                [state_dict[layout.names[i]].detach().reshape(-1).to("cpu", dtype) for i in indices]
            )
            self.group.send([flat], dst, 0).wait()

    def recv(self, layout: Layout, src: int) -> dict[str, torch.Tensor] | None:
        """The tensors of `layout` from rank `src` (views into one buffer per bucket); None when
        the sender reported a failure (its Ray call says what)."""
        status = torch.zeros(1, dtype=torch.int64)
        self.group.recv([status], src, 0).wait()
        if int(status) != OK:
            return None
        out: dict[str, torch.Tensor] = {}
        for indices in layout.buckets:
            numels = [math.prod(layout.shapes[i]) for i in indices]
            flat = torch.empty(sum(numels), dtype=_dtype(layout.dtypes[indices[0]]))
            self.group.recv([flat], src, 0).wait()
            for i, piece in zip(indices, flat.split(numels)):
                out[layout.names[i]] = piece.view(layout.shapes[i])
        return out

    def fail(self, dst: int, why: str) -> None:
        """Tell rank `dst`, waiting in `recv`, that nothing comes (it returns None)."""
        self._status(dst, FAILED)

    def _status(self, dst: int, status: int) -> None:
        self.group.send([torch.tensor([status], dtype=torch.int64)], dst, 0).wait()


def _mismatch(state_dict: dict[str, torch.Tensor] | None, layout: Layout) -> str:
    """What differs between `state_dict` and `layout` (names or shapes), or ''."""
    if state_dict is None:
        return "no weights"
    missing = [n for n in layout.names if n not in state_dict]
    extra = [n for n in state_dict if n not in set(layout.names)]
    if missing or extra:
        return f"names differ: missing {missing[:5]}, unexpected {extra[:5]}"
    bad = [n for n, s in zip(layout.names, layout.shapes) if tuple(state_dict[n].shape) != tuple(s)]
    return f"shapes differ: {bad[:5]}" if bad else ""
