"""A shard's storage as a same-node client maps it: its field files read-only, as a ring.

With ``transport="shared"`` a shard describes its storage (`lucid_replay.distributed.sharing`:
each field's file, shape and dtype, and the file of its published head and epoch); the client
maps each file read-only and reads it through a `TransitionRing` whose allocator hands out the
mappings, so the ring's own gathers copy the records straight into the batch.
"""

from __future__ import annotations

import math
import mmap
import os
import warnings
from typing import Any

import numpy as np
import torch

from lucid_replay.ring import TransitionRing

__all__: list[str] = []  # internal module

_CPU = torch.device("cpu")


class _Mappings:
    """An `Allocator` handing out read-only mappings of a shard's field files."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths
        self.maps: list[mmap.mmap] = []

    def allocate(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        count = math.prod(shape)
        size = count * torch.empty((), dtype=dtype).element_size()
        if not size:
            return torch.empty(shape, dtype=dtype)
        descriptor = os.open(self.paths[name], os.O_RDONLY)
        try:
            mapped = mmap.mmap(descriptor, size, prot=mmap.PROT_READ)
        finally:
            os.close(descriptor)
        self.maps.append(mapped)
        with warnings.catch_warnings():  # read-only by design: nothing writes through it
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mapped, dtype=dtype, count=count).view(shape)


class Mapped:
    """One shard's fields mapped read-only (as a `TransitionRing`), and its published header."""

    def __init__(self, descriptor: dict[str, Any]) -> None:
        fields = descriptor["fields"]
        self.key = key_of(descriptor)
        self.allocator = _Mappings({name: spec[0] for name, spec in fields.items()})
        schema = {name: (tuple(spec[1]), dtype_named(spec[2])) for name, spec in fields.items()}
        self.ring = TransitionRing(descriptor["capacity"], _CPU, self.allocator)
        self.ring.allocate(schema)
        header = os.open(descriptor["header"], os.O_RDONLY)
        try:
            self._header_map = mmap.mmap(header, 64, prot=mmap.PROT_READ)
        finally:
            os.close(header)
        self.header = np.frombuffer(self._header_map, dtype=np.int64, count=2)

    def published(self) -> tuple[int, int]:
        """``(head, epoch)`` as the shard published them now."""
        return int(self.header[0]), int(self.header[1])


def key_of(descriptor: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a shard's mapped storage (new files after a restart or a load)."""
    fields = descriptor["fields"]
    return (descriptor["header"], *sorted((name, spec[0]) for name, spec in fields.items()))


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype
