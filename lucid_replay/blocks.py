"""Batch memory: one block per batch, reused once nothing refers to the batch any more.

A window batch of the reference size is a 7.5 MB block. A stock glibc allocator serves a
block that size from the top of its heap and, depending on what else the process allocated
in between, may give the freed block back to the kernel (trim) and fault its 1,800 pages
back in on the next call: about 1 ms a batch, in some runs and not others. `Blocks` keeps the
last few blocks it handed out and hands one out again only when no tensor, view or numpy
array refers to its memory any more (its storage's use count is back to what the pool alone
holds), so a loop that drops each batch before the next draw allocates nothing. A batch the
caller still holds is never reused.
"""

from __future__ import annotations

import torch

__all__: list[str] = []  # internal module

KEPT = 3  # blocks remembered per buffer: the batch being filled, one held, one in flight

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private API: checked for


class Blocks:
    """The last ``KEPT`` CPU blocks handed out, with the use count each has when unreferenced."""

    def __init__(self) -> None:
        self._kept: list[tuple[torch.Tensor, int]] = []

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 block of ``nbytes`` on ``device``: a free kept one if any, else a new one."""
        if device.type != "cpu" or _use_count is None:  # accelerators have caching allocators
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        for index, (block, unused) in enumerate(self._kept):
            if block.shape[0] == nbytes and _count(block) == unused:
                self._kept.append(self._kept.pop(index))  # most recently handed out last
                return block
        block = torch.empty(nbytes, dtype=torch.uint8)
        self._kept = [*self._kept[-(KEPT - 1) :], (block, _count(block))]
        return block


def _count(block: torch.Tensor) -> int:
    assert _use_count is not None
    count: int = _use_count(block.untyped_storage()._cdata)
    return count
