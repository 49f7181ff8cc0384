"""Batch memory: one block per batch, reused once nothing refers to the batch any more.

A window batch of the reference size is a 7.5 MB block. A stock glibc allocator serves a
block that size from the top of its heap and, depending on what else the process allocated
in between, may give the freed block back to the kernel (trim) and fault its 1,800 pages
back in on the next call: about 1 ms a batch, in some runs and not others. `Blocks` keeps the
last few blocks it handed out and hands one out again only when no tensor, view or numpy
array refers to its memory any more (its storage's use count is back to what the pool alone
holds), so a loop that drops each batch before the next draw allocates nothing. A batch the
caller still holds is never reused.

Each block also keeps what was built on it last (the batch, its tensors and their numpy
views), and the next draw of the same layout takes that again rather than building a
dozen views anew (about 40 us a draw once a gather has evicted the caches). The pool holds
those objects itself, so the use count alone no longer shows whether the caller holds the
batch, its data mapping or one of its tensors: a block counts as free only when, in
addition, the reference counts of those objects, and of the block's storage object (which a
caller holding ``tensor.untyped_storage()`` holds), are back to what they were when the pool
alone held them. Where reference counts are not exact (a free-threaded Python), no block is
reused.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Hashable

import torch

__all__: list[str] = []  # internal module

KEPT = 3  # blocks remembered per buffer: the batch being filled, one held, one in flight
_ALIGN = 64  # bytes: each tensor of a batch block starts on a cache line
_CPU = torch.device("cpu")

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private API: checked for
# Free-threaded builds defer and split reference counts; elsewhere they are exact.
_exact_refcounts = getattr(sys, "_is_gil_enabled", lambda: True)()

# What a build makes of a block: the objects to hand out (first the batch) and the objects
# whose references show whether anybody still holds part of it.
Built = tuple[tuple[object, ...], tuple[object, ...]]


class Blocks:
    """The last ``KEPT`` CPU blocks handed out, each with what was built on it last."""

    def __init__(self) -> None:
        self._kept: list[_Kept] = []

    def take(
        self,
        nbytes: int,
        device: torch.device,
        key: Hashable,
        build: Callable[[torch.Tensor], Built],
    ) -> tuple[object, ...]:
        """What ``build`` made of a uint8 block of ``nbytes`` on ``device``.

        A free kept block of that size is taken first; if what was built on it last was
        built for ``key``, that is returned as it is, else ``build`` runs on it again.
        Otherwise a new block is allocated (and kept, the oldest kept block forgotten).
        """
        if device.type != "cpu" or _use_count is None or not _exact_refcounts:
            # Accelerators have caching allocators; and where reference counts are not exact
            # (a free-threaded Python), a holder of the storage could not be seen: no reuse.
            return build(torch.empty(nbytes, dtype=torch.uint8, device=device))[0]
        for index, kept in enumerate(self._kept):
            if kept.block.shape[0] == nbytes and kept.free():
                self._kept.append(self._kept.pop(index))  # most recently handed out last
                return kept.built if kept.key == key else kept.rebuild(key, build)
        kept = _Kept(torch.empty(nbytes, dtype=torch.uint8))
        self._kept = [*self._kept[-(KEPT - 1) :], kept]
        return kept.rebuild(key, build)

    def built_with(self, first: object) -> tuple[object, ...] | None:
        """What was built together with ``first`` (a batch this pool handed out), or None."""
        for kept in self._kept:
            if kept.built and kept.built[0] is first:
                return kept.built
        return None


class _Kept:
    """A block, what was built on it last, and the counts that say it is free again."""

    def __init__(self, block: torch.Tensor) -> None:
        self.block = block
        self.key: Hashable = None
        self.built: tuple[object, ...] = ()
        self.watched: tuple[object, ...] = ()
        self.unused = self._counts()

    def rebuild(self, key: Hashable, build: Callable[[torch.Tensor], Built]) -> tuple[object, ...]:
        """Build on the block for ``key`` and keep the result, with the counts it leaves."""
        self.key, self.built, self.watched = None, (), ()  # let the old build go first
        # No local name may hold the build when the counts are taken: they must be what
        # the pool alone holds (a local would be gone by the next `free`).
        self.built, self.watched = build(self.block)
        self.key, self.unused = key, self._counts()
        return self.built

    def free(self) -> bool:
        """Whether nothing outside the pool refers to the block or what was built on it."""
        return self._counts() == self.unused

    def _counts(self) -> tuple[int, ...]:
        # A tensor or view of the block holds its storage (the use count); a caller holding
        # `tensor.untyped_storage()` holds the storage's one Python object instead, which
        # torch keeps alive while the storage lives: its reference count shows that holder.
        assert _use_count is not None
        storage = self.block.untyped_storage()
        held = (_use_count(storage._cdata), sys.getrefcount(storage))
        return (*held, *[sys.getrefcount(item) for item in self.watched])


Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)


def views(blocks: Blocks, shapes: Shapes, pin: bool) -> dict[str, torch.Tensor]:
    """Empty tensors of ``shapes``: views of one block of ``blocks`` (pinned tensors if ``pin``).

    The block is reused once nothing refers to the last batch built on it (nor to its views):
    a fresh 8 MB batch would fault its pages in again on every draw (about 1 ms). The views
    of the last batch of the same layout on a free block are taken again as they are
    (building a dozen views costs about 0.2 ms); the caller gets its own dict of them. A
    batch for an accelerator is put together in pinned memory instead.
    """
    if pin:
        return {k: torch.empty(s, dtype=d, pin_memory=True) for k, (s, d) in shapes.items()}
    offsets, total = {}, 0
    for key, (shape, dtype) in shapes.items():
        offsets[key] = total
        total += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN

    def build(block: torch.Tensor) -> Built:
        made = {
            key: block[offsets[key] : offsets[key] + math.prod(shape) * dtype.itemsize]
            .view(dtype)
            .view(shape)
            for key, (shape, dtype) in shapes.items()
        }
        return (made,), tuple(made.values())

    layout = tuple((key, shape, dtype) for key, (shape, dtype) in shapes.items())
    made = blocks.take(total, _CPU, layout, build)[0]
    assert isinstance(made, dict)
    return dict(made)
