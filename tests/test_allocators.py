"""The storage seam: a ring's fields come from its allocator, the buffer's, at both places
that build a ring (the store, and a checkpoint's load), and an unusable tensor is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import comparable, make_episode

import lucid_replay.replay
from lucid_replay import PrioritizedSequenceReplay, SequenceReplay
from lucid_replay.allocators import MEMORY
from lucid_replay.ring import TransitionRing

_CPU = torch.device("cpu")


class Recording:
    """Allocates in memory, recording each request: (name, shape, dtype, device)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, tuple[int, ...], torch.dtype, torch.device]] = []

    def allocate(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        self.requests.append((name, shape, dtype, device))
        return MEMORY.allocate(name, shape, dtype, device)


class Returning:
    """Returns a fixed tensor, whatever is asked."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def allocate(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return self.tensor


_EXPECTED = [
    ("serial", (30,), torch.int64, _CPU),
    ("obs", (30, 2), torch.float32, _CPU),
    ("done", (30,), torch.bool, _CPU),
]


def test_a_ring_asks_its_allocator_for_each_fields_capacity_rows() -> None:
    """`allocate` asks for ``[capacity, *shape]`` of each field's dtype on the ring's device,
    in schema order, and keeps exactly the tensors it returns."""
    allocator = Recording()
    ring = TransitionRing(30, _CPU, allocator)
    ring.allocate({"serial": ((), torch.int64), "obs": ((2,), torch.float32)})
    assert allocator.requests == _EXPECTED[:2]
    assert [tuple(t.shape) for t in ring.fields.values()] == [(30,), (30, 2)]


@pytest.mark.parametrize("kind", [SequenceReplay, PrioritizedSequenceReplay])
def test_a_buffer_and_a_load_into_it_allocate_through_the_buffers_allocator(
    kind, tmp_path, monkeypatch
) -> None:
    """The store's ring and the ring a load builds both come from the buffer's allocator."""
    allocator = Recording()
    monkeypatch.setattr(lucid_replay.replay, "MEMORY", allocator)
    buffer = kind(capacity=30, seed=0)
    assert buffer._core.store.allocator is allocator
    buffer.add(make_episode(5))
    assert allocator.requests == _EXPECTED
    buffer.save(tmp_path / "buffer.pt")
    loaded = kind.load(tmp_path / "buffer.pt")
    assert allocator.requests == _EXPECTED * 2
    assert loaded._core.store.ring.allocator is allocator
    assert comparable(loaded.state_dict()) == comparable(buffer.state_dict())


@pytest.mark.parametrize(
    ("tensor", "got"),
    [
        (torch.zeros(30, 3), r"got a torch.float32 tensor of shape \(30, 3\) on cpu"),
        (torch.zeros(30, 2, dtype=torch.float64), "got a torch.float64 tensor"),
        (torch.zeros(2, 30).t(), r"got a non-contiguous torch.float32 tensor of shape \(30, 2\)"),
        (
            torch.zeros(30, 2, device="meta"),
            r"got a torch.float32 tensor of shape \(30, 2\) on meta",
        ),
    ],
    ids=["shape", "dtype", "strides", "device"],
)
def test_an_allocators_unusable_tensor_is_refused_and_the_ring_keeps_no_storage(
    tensor, got
) -> None:
    """The gathers copy raw rows: a tensor of another shape, dtype, layout or device is a
    ValueError naming the field and what was expected, and no field is kept."""
    ring = TransitionRing(30, _CPU, Returning(tensor))
    expected = (
        r"allocator must return a contiguous torch.float32 tensor of shape \(30, 2\) on cpu "
        rf"for field 'obs', {got}"
    )
    with pytest.raises(ValueError, match=expected):
        ring.allocate({"obs": ((2,), torch.float32)})
    assert ring.fields == {}


def test_an_allocator_out_of_memory_is_a_memory_error_naming_the_bytes() -> None:
    """An allocator's RuntimeError (torch's out of memory) is a MemoryError naming the bytes
    every field needs; the ring keeps no storage."""

    class Exhausted:
        def allocate(self, name, shape, dtype, device):
            raise RuntimeError("out of memory\nmore detail")

    ring = TransitionRing(10, _CPU, Exhausted())
    with pytest.raises(MemoryError, match=r"\(120 bytes on cpu\), got 10: out of memory$"):
        ring.allocate({"obs": ((2,), torch.float32), "serial": ((), torch.int32)})
    assert ring.fields == {}
