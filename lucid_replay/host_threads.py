"""Host work split over the threads torch is given, for loops that release the GIL.

A compressed field's gather decodes blocks (the codec libraries release the GIL) and copies
rows (a compiled loop that releases it too). An uncompressed gather is one torch copy, which
runs on every thread of ``torch.get_num_threads()``; so that a compressed buffer keeps pace
on the same settings, its gather spreads over the same number of threads. With one thread
(or little work) everything runs inline on the caller's thread, with no pool at all.

The pool belongs to the process that made it: a forked child, which has only the thread
that forked, makes its own on first use.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__: list[str] = []  # internal module

_T = TypeVar("_T")
_R = TypeVar("_R")
_lock = threading.Lock()
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)


def workers() -> int:
    """How many threads host work may use: torch's intra-op thread count."""
    return max(torch.get_num_threads(), 1)


def run_split(work: Callable[[_T], _R], parts: Sequence[_T]) -> list[_R]:
    """``[work(part) for part in parts]``, the parts on up to `workers` threads at once.

    The caller's thread runs the first part itself, so one part never waits on a pool. An
    exception in any part is raised here, after every part has finished.
    """
    if len(parts) <= 1:
        return [work(part) for part in parts]
    futures = [_executor().submit(work, part) for part in parts[1:]]
    try:
        first = work(parts[0])
    finally:
        rest = [future.exception() for future in futures]  # waits for each
    for error in rest:
        if error is not None:
            raise error
    return [first, *(future.result() for future in futures)]


def chunks(count: int, minimum: int) -> list[tuple[int, int]]:
    """``[begin, end)`` ranges that cut ``range(count)`` into up to `workers` parts.

    A part is at least ``minimum`` long (below that a thread costs more than it saves).
    """
    parts = max(min(workers(), count // max(minimum, 1)), 1)
    bounds = [count * k // parts for k in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _executor() -> ThreadPoolExecutor:
    global _pool
    need = max(workers() - 1, 1)
    with _lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] != need:
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            _pool = (os.getpid(), need, ThreadPoolExecutor(need, "lucid-replay-host"))
        return _pool[2]
