"""Transparent huge pages for the transition ring's CPU tensors.

A sampled batch reads 256 windows at random places in the ring. With 4 KiB pages, each
window of each field starts on a page the TLB has not seen, and the page walk to find it
misses the cache too once the ring is larger than the TLB covers (a few MB). On the
reference machine, with one thread, sampling from a 10M-transition ring (2.7 GB) took 8%
less time with 2 MiB pages, and from a 1M-transition one 10% less. So, as numpy does for
its own arrays over 4 MB, a ring field asks the kernel for transparent huge pages
(``madvise(MADV_HUGEPAGE)``) over the part of its memory that spans whole huge pages, before
anything is written there, so that its first writes already fault in huge pages.

Linux only, and only advice: where the kernel has transparent huge pages turned off
(``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``never``), or runs elsewhere, the
call does nothing and nothing fails. The contents of the memory are never affected.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable

import torch

__all__: list[str] = []  # internal module

_SIZE_FILE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_DEFAULT_SIZE = 2 * 2**20


@functools.cache
def _madvise() -> tuple[Callable[[int, int, int], int], int, int] | None:
    """The C library's ``madvise``, ``MADV_HUGEPAGE`` and the huge page size (None: absent)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not sys.platform.startswith("linux") or advice is None:
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    try:
        with open(_SIZE_FILE) as file:
            size = int(file.read())
    except (OSError, ValueError):
        size = _DEFAULT_SIZE
    return function, advice, size if size > 0 else _DEFAULT_SIZE


def advise(tensor: torch.Tensor) -> bool:
    """Ask for huge pages over the whole huge pages inside ``tensor``'s memory.

    Returns whether the kernel accepted the advice (False for a tensor not on the CPU, one
    smaller than a huge page, or where the advice is unavailable). Call it before the memory
    is first written: pages already faulted in stay as they are until the kernel's background
    collapse gets to them.
    """
    found = _madvise()
    if found is None or tensor.device.type != "cpu":
        return False
    function, advice, size = found
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    low, high = -(-start // size) * size, end // size * size
    if high <= low:
        return False
    return function(low, high - low, advice) == 0
