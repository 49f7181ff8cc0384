"""Where a transition ring's storage comes from: the one seam between the ring and its memory.

A `TransitionRing` asks its `Allocator` for each field's ``[capacity, *field_shape]`` tensor
once the schema is known, and from then on reads and writes only through those tensors (and,
on CPU, their addresses). So what holds the data (the device's memory, or files mapped into
memory that let a buffer's fields exceed RAM) is decided by the allocator alone; nothing
else in the ring, the gathers or the checkpoints changes with it.

A buffer chooses its allocator when it is configured and hands the same one to both places
that build a ring: its store, and the loading of a checkpoint into it. `MEMORY`, the one
allocator today, allocates in the device's memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final, Protocol

import torch

from lucid_replay import hugepages

__all__: list[str] = []  # internal module


class Allocator(Protocol):
    """Allocates the storage of one field of a transition ring."""

    def allocate(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A new tensor of ``shape`` (``[capacity, *field_shape]``) for field ``name``.

        Contiguous, of ``dtype``, on ``device``; its contents may be anything.

        Raises
        ------
        MemoryError or RuntimeError
            When there is no room for it (torch reports an allocation failure as either).
        """
        ...


class InMemory:
    """Fields in the device's memory; on CPU advised into transparent huge pages."""

    def allocate(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised tensor (see `Allocator.allocate`)."""
        storage = torch.empty(shape, dtype=dtype, device=device)
        hugepages.advise(storage)  # before its first write; see that module
        return storage


MEMORY: Final = InMemory()


def allocate_fields(
    allocator: Allocator,
    capacity: int,
    schema: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Each field of ``schema`` (name -> (per-step shape, dtype)) as a ``[capacity, ...]`` tensor.

    All or nothing: where one cannot be allocated, the ones before it are dropped.

    Raises
    ------
    MemoryError
        Naming the bytes all fields need, where one does not fit.
    ValueError
        Where ``allocator`` returns a tensor the ring cannot use: its gathers copy raw rows,
        so each must be contiguous, of the field's shape and dtype, on ``device``.
    """
    fields = {}
    for name, (shape, dtype) in schema.items():
        size = (capacity, *shape)
        try:
            store = allocator.allocate(name, size, dtype, device)
        except (RuntimeError, MemoryError) as error:  # torch reports OOM as RuntimeError
            needed = sum(
                capacity * math.prod(s) * torch.empty((), dtype=d).element_size()
                for s, d in schema.values()
            )
            reason = str(error).splitlines()[0]
            raise MemoryError(
                f"capacity must fit this device's memory for these fields ({needed:,} "
                f"bytes on {device}), got {capacity}: {reason}"
            ) from None
        placed = store.device.type == device.type and device.index in (None, store.device.index)
        usable = tuple(store.shape) == size and store.dtype == dtype and store.is_contiguous()
        if not (usable and placed):
            layout = "" if store.is_contiguous() else "non-contiguous "
            raise ValueError(
                f"allocator must return a contiguous {dtype} tensor of shape {size} on "
                f"{device} for field {name!r}, got a {layout}{store.dtype} tensor of shape "
                f"{tuple(store.shape)} on {store.device}"
            )
        fields[name] = store
    return fields
