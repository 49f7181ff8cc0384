"""The gather floor: the cost every sampler of ``B x W`` records pays, measured once, here.

Every bar and every scaling row that compares with "the floor" uses `GatherFloor`. It holds
its own preallocated contiguous tensors, one per field, of ``capacity`` records each: the
size of the buffer's storage it stands beside (``memory_usage()["data_bytes"]``), filled
with the same data. Each call gathers ``B`` windows of ``W`` records (``burn_in + length +
bootstrap``, ``dilation`` apart) with one ``index_select`` per field, at FRESH random
window positions: 64 index sets are prepared up front and cycled, so a call reads memory that
no recent call touched, as a sampler does (the "cold floor"), rather than the few MB the
previous call left in cache.

``huge_pages=True`` asks the kernel for transparent huge pages for the storage before it is
filled, as lucid_replay's ring does for its own fields: the page shows that floor beside the
bars' floor, which is plain torch memory, as a user's own tensors are.

Two variants share the storage and the index cycle (so neither re-reads what the other just
read):

- `GatherFloor.__call__` allocates its outputs on every call, as ``sample_windows`` does: this
  is the floor the bars divide by;
- `GatherFloor.into_preallocated` writes into outputs allocated once (``out=``), shown beside
  it: the difference is what allocating (and, with a stock allocator, page-faulting) a fresh
  multi-MB batch per call costs.

Its counterpart for writes is `RingCopy`: the bytes that an ``add`` or a stream's ``append``
stores, copied as one block into the next slots of a ring as large as the buffer's storage
(memory out of cache, as the buffer's destination is). The ``add`` and ``append`` bars divide
by it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import torch

from benchmarks.config import Config
from benchmarks.data import record_bytes
from benchmarks.rows import Row
from benchmarks.timing import Timing
from lucid_replay import hugepages

INDEX_SETS = 64  # prepared window sets, cycled: each holds B windows at random positions


class GatherFloor:
    """``index_select`` of ``config.batch x config.window_size`` records from ``capacity``
    preallocated records per field, laid out like ``source`` (``[N, ...]`` tensors)."""

    def __init__(
        self,
        config: Config,
        source: Mapping[str, torch.Tensor],
        capacity: int,
        *,
        device: str | torch.device = "cpu",
        huge_pages: bool = False,
    ) -> None:
        span = 1 + config.dilation * (config.window_size - 1)
        if capacity < span:
            raise ValueError(f"capacity must be at least one window ({span}), got {capacity}")
        self.storage = {
            name: _filled(values, capacity, device, huge_pages) for name, values in source.items()
        }
        generator = torch.Generator().manual_seed(config.seed + 7)
        record = torch.arange(config.window_size) * config.dilation
        starts = torch.randint(
            0, capacity - span + 1, (INDEX_SETS, config.batch, 1), generator=generator
        )
        self.indices: list[torch.Tensor] = [
            (starts[i] + record).reshape(-1).to(device) for i in range(INDEX_SETS)
        ]
        self._turn = itertools.count()
        self.records = config.batch * config.window_size

    @property
    def storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage.values())

    @property
    def gathered_bytes(self) -> int:
        """Bytes one call moves into its outputs."""
        return sum(self.records * t[0].numel() * t.element_size() for t in self.storage.values())

    def _index(self) -> torch.Tensor:
        return self.indices[next(self._turn) % len(self.indices)]

    def __call__(self) -> dict[str, torch.Tensor]:
        """One gather into freshly allocated outputs (the floor the bars use)."""
        index = self._index()
        return {name: values.index_select(0, index) for name, values in self.storage.items()}

    def into_preallocated(self) -> Callable[[], dict[str, torch.Tensor]]:
        """The same gather into outputs allocated once, here (``index_select(..., out=)``)."""
        outputs = {
            name: torch.empty(
                (self.records, *values.shape[1:]), dtype=values.dtype, device=values.device
            )
            for name, values in self.storage.items()
        }

        def gather() -> dict[str, torch.Tensor]:
            index = self._index()
            for name, values in self.storage.items():
                torch.index_select(values, 0, index, out=outputs[name])
            return outputs

        return gather


def _filled(
    values: torch.Tensor, capacity: int, device: str | torch.device, huge_pages: bool
) -> torch.Tensor:
    """``capacity`` records shaped like ``values``'s, filled with its records (tiled), so every
    page is written once before timing and no call pays a first-touch fault."""
    storage = torch.empty((capacity, *values.shape[1:]), dtype=values.dtype, device=device)
    if huge_pages:
        hugepages.advise(storage)
    count = int(values.shape[0])
    for begin in range(0, capacity, count):
        size = min(count, capacity - begin)
        storage[begin : begin + size].copy_(values[:size])
    return storage


class RingCopy:
    """The bytes of ``steps`` copied into the next slots of a ring as large as the buffer's
    storage (one contiguous ``copy_`` a call): the baseline of the ``add`` and ``append``
    bars, whose destination is memory out of cache, as a buffer's is."""

    def __init__(self, config: Config, steps: Mapping[str, torch.Tensor]) -> None:
        self.nbytes = sum(t.numel() * t.element_size() for t in steps.values())
        self.source = torch.empty(self.nbytes, dtype=torch.uint8)
        ring_bytes = config.transitions * record_bytes(dict(steps))
        # touched (filled with ones) before timing: no page faults
        self.ring = torch.ones(ring_bytes // self.nbytes * self.nbytes, dtype=torch.uint8)
        self._position = itertools.cycle(range(0, self.ring.numel(), self.nbytes))

    def __call__(self) -> None:
        begin = next(self._position)
        self.ring[begin : begin + self.nbytes].copy_(self.source)

    def row(self, id: str, timing: Timing, *, group: str) -> Row:
        return Row.timed(
            id,
            f"memcpy of its {self.nbytes / 1e3:.1f} kB into the next slots of a "
            f"{self.ring.numel() / 1e6:.0f} MB ring (one contiguous copy_)",
            timing,
            group=group,
            extra={"bytes": self.nbytes, "ring_bytes": self.ring.numel()},
        )
