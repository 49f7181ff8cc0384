"""A checkpoint's fields out of the transition ring and back in, without copying them out.

`export` hands each field's stored transitions as tensors over the ring's own memory, whose
storages are exactly their bytes: `torch.save` then writes those bytes and no others (a slice
would share, and write, the field's whole storage). `fill` writes them back after a `load`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from lucid_replay.ring import TransitionRing

__all__: list[str] = []  # internal module


def export(
    ring: TransitionRing, offset: int, length: int
) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """Each field's ``length`` transitions from global ``offset`` on, in order, uncopied.

    A field is one piece, or two where they cross the ring's seam (up to the last slot, then
    on from slot 0). Valid until those slots are rewritten.
    """
    begin = offset % ring.capacity
    first = min(length, ring.capacity - begin)
    spans = [(begin, first)] if first == length else [(begin, first), (0, length - first)]
    for name, store in ring.fields.items():
        yield name, [_alias(store, start, count) for start, count in spans]
    if ring.compressed is not None:
        yield from ring.compressed.export(spans)


def fill(ring: TransitionRing, name: str, offset: int, pieces: Iterable[torch.Tensor]) -> None:
    """Write field ``name``'s transitions from global ``offset`` on: `export`'s inverse.

    Piece after piece, ``[T, ...]`` each, ``capacity`` transitions at most in all.
    """
    for piece in pieces:
        ring.write(offset, {name: piece})
        offset += piece.shape[0]


def _alias(store: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows ``start .. start+count-1`` of ``store``, over a storage of exactly their bytes.

    Not a slice of ``store``, which shares (and `torch.save` writes) its whole storage: a
    slice of the storage itself, which keeps ``store``'s memory alive.
    """
    row = math.prod(store.shape[1:]) * store.element_size()
    at = store.storage_offset() * store.element_size() + start * row
    storage = store.untyped_storage()[at : at + count * row]
    alias = torch.empty((0,), dtype=store.dtype, device=store.device)
    return alias.set_(storage, 0, (count, *store.shape[1:]), store.stride())
