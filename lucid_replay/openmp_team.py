"""Compiled host work on torch's own OpenMP threads.

With several torch threads, torch's ops run on an OpenMP team whose threads spin for a few
milliseconds after each op before they sleep. Work split over threads of our own then runs
beside those spinning threads, more threads than cores: on two cores, a batch's listed runs
copied by two Python threads, half each, took 130 to 160 us longer than one thread's copy
plus ``index_select``, the caller's half twice as long as the other. So work that should use
every thread runs on that very team: `run` hands a C function and its data to the OpenMP
runtime's ``GOMP_parallel`` (the entry point of ``#pragma omp parallel`` in GNU libgomp,
which LLVM's and Intel's runtimes export too); every thread of the team, the caller's among
them, calls the function once, and the function shares its work out itself
(`lucid_replay.raw_memory.claim`).

The runtime is the one torch's parallel backend runs on: used where torch reports OpenMP and
exactly one loaded library (Linux: ``/proc/self/maps``) exports ``GOMP_parallel``. A forked
child has only the thread that forked, and GNU OpenMP's team does not survive the fork (a
parallel region there waits for the parent's threads for good, as torch's own ops do): in a
child the work stays on the calling thread.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterable

import torch

__all__: list[str] = []  # internal module

_RUNTIMES = ("libgomp", "libiomp", "libomp")  # GNU, Intel, LLVM: each exports GOMP_parallel
_lock = threading.Lock()
_forked = False
_parallel: Callable[[int, int, int, int], None] | None = None
_looked = False


def threads(wanted: int) -> int | None:
    """How many of the team's threads work that ``wanted`` threads may use.

    ``wanted`` where the team is there; 1 in a forked child of a process that has one (stay
    on this thread); None where torch runs on no OpenMP team (its own ops then split work
    over their threads, as before).
    """
    if _runtime() is None:
        return None
    return 1 if _forked else max(wanted, 1)


def run(function: int, data: int, count: int) -> None:
    """Call the C function at address ``function`` (``void f(void *data)``) with ``data``.

    On ``count`` threads of the team at once, the caller's among them; returns when every
    call has returned. Only where `threads` answered more than 1.
    """
    parallel = _runtime()
    if parallel is None or _forked:
        raise RuntimeError("openmp_team.run: no OpenMP team in this process")
    parallel(function, data, count, 0)


def _runtime() -> Callable[[int, int, int, int], None] | None:
    """``GOMP_parallel`` of the runtime torch uses, looked up once; None where there is none."""
    global _parallel, _looked
    if not _looked:
        with _lock:
            if not _looked:
                _parallel = _look_up()
                _looked = True
    return _parallel


def _look_up() -> Callable[[int, int, int, int], None] | None:
    """`_runtime`'s search: torch's parallel backend, the mapped runtime, its entry point."""
    if (
        sys.platform != "linux"
        or "parallel backend: OpenMP" not in torch.__config__.parallel_info()
    ):
        return None
    try:
        with open("/proc/self/maps") as maps:
            path = _runtime_path(maps)
    except OSError:
        return None
    if path is None:
        return None
    try:  # RTLD_NOLOAD: a handle to the library already loaded, never a new one
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        parallel = library.GOMP_parallel
    except (OSError, AttributeError):
        return None
    parallel.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
    parallel.restype = None
    return parallel


def _runtime_path(maps: Iterable[str]) -> str | None:
    """The one OpenMP runtime among the files mapped in ``maps`` (``/proc/self/maps`` lines).

    None if there is none, or several (which of them runs torch's team is unknown).
    """
    paths = {line.split(maxsplit=5)[-1].strip() for line in maps if ".so" in line}
    loaded = {path for path in paths if os.path.basename(path).startswith(_RUNTIMES)}
    return loaded.pop() if len(loaded) == 1 else None


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
