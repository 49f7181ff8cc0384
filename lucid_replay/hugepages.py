"""Transparent huge pages for the transition ring's CPU tensors.

A sampled batch reads 256 windows at random places in the ring. With 4 KiB pages, each
window of each field starts on a page the TLB has not seen, and the page walk to find it
misses the cache too once the ring is larger than the TLB covers (a few MB). On the
reference machine, with one thread, sampling from a 10M-transition ring (2.7 GB) took 8%
less time with 2 MiB pages, and from a 1M-transition one 10% less. So, as numpy does for
its own arrays over 4 MB, a ring field asks the kernel for transparent huge pages
(``madvise(MADV_HUGEPAGE)``) over the part of its memory that spans whole huge pages, before
anything is written there, so that its first writes already fault in huge pages.

The advice alone does not move pages that are already faulted in, and a stock allocator
hands back such memory: glibc serves allocations below its mmap threshold from its heap,
whose pages stay mapped, and the threshold rises to the size of each mapped block freed (up
to 32 MiB). In one benchmark process, after larger rings were freed, four of a new ring's
six fields (4 to 16 MiB each) had no huge page at all. So the ring also asks for those to
be collapsed into huge pages now (``MADV_COLLAPSE``, Linux 6.1 and later), which on memory
never touched fails at once, as there is nothing to collapse, and changes nothing.

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
_ENABLED_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_DEFAULT_SIZE = 2 * 2**20
_MADV_COLLAPSE = 25  # <linux/mman.h>; Python's mmap module names it from 3.12 on only


@functools.cache
def _madvise() -> tuple[Callable[[int, int, int], int], int, int | None, int] | None:
    """The C library's ``madvise`` and its advice for huge pages (None: absent).

    That is ``(madvise, MADV_HUGEPAGE, MADV_COLLAPSE, huge page size)``, the collapse None
    where huge pages are turned off (it would override that).
    """
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
    try:
        with open(_ENABLED_FILE) as file:
            collapse = None if "[never]" in file.read() else _MADV_COLLAPSE
    except OSError:
        collapse = None
    return function, advice, collapse, size if size > 0 else _DEFAULT_SIZE


def advise(tensor: torch.Tensor) -> bool:
    """Ask for huge pages over the whole huge pages inside ``tensor``'s memory.

    Returns whether the kernel accepted the advice (False for a tensor not on the CPU, one
    smaller than a huge page, or where the advice is unavailable). Pages already faulted in
    are collapsed into huge pages now where the kernel can (best effort: a kernel before 6.1
    leaves them to its background collapse), so call it before the memory holds anything
    that must not be copied: the collapse copies it.
    """
    found = _madvise()
    if found is None or tensor.device.type != "cpu":
        return False
    function, advice, collapse, size = found
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    low, high = -(-start // size) * size, end // size * size
    if high <= low or function(low, high - low, advice) != 0:
        return False
    if collapse is not None:
        function(low, high - low, collapse)  # fails at once where nothing is faulted in
    return True
