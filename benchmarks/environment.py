"""What a run measures on: machine, versions, thread count and allocator.

The runner measures a stock user process by default: glibc's malloc as it comes and torch's
own thread count, besides one torch thread. `tune_malloc` is only applied on request
(``--tuned-malloc``); its numbers are reported beside the stock ones, never as the headline.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import platform
from typing import Any

import torch

STOCK = "stock"
TUNED = "tuned"

# The tuned allocator: glibc keeps freed batch memory for reuse instead of returning it.
_MMAP_THRESHOLD = 64 << 20
_TRIM_THRESHOLD = 512 << 20


def libc_name() -> str:
    """``glibc 2.36`` (or the C library Python reports)."""
    name, version = platform.libc_ver()
    return f"{name or 'libc'} {version}".strip()


def tune_malloc() -> str:
    """Fix glibc's ``mmap`` and trim thresholds (64 MiB, 512 MiB) for this process.

    With glibc's default, dynamic thresholds, a freed multi-MB batch at the top of the heap
    is now and then returned to the kernel, and the next batch faults its pages back in
    (about +2.5 ms for 7.5 MB on the 2-core reference machine); which calls pay depends on
    the order of allocations. The same setting is available to any process through
    ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` in the environment, and a
    caching allocator such as jemalloc has the same effect. Returns what was set.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        # mallopt(M_MMAP_THRESHOLD = -3), mallopt(M_TRIM_THRESHOLD = -1); 1 means success
        if libc.mallopt(-3, _MMAP_THRESHOLD) == 1 and libc.mallopt(-1, _TRIM_THRESHOLD) == 1:
            return (
                f"{libc_name()} tuned: mallopt mmap threshold {_MMAP_THRESHOLD >> 20} MiB, "
                f"trim threshold {_TRIM_THRESHOLD >> 20} MiB"
            )
    except OSError:
        pass
    return f"{libc_name()} stock (mallopt not available, nothing tuned)"


def stock_malloc() -> str:
    """The description of the untouched allocator (environment overrides included)."""
    overrides = sorted(k for k in os.environ if k.startswith("MALLOC_") or k == "LD_PRELOAD")
    text = f"{libc_name()} malloc, stock (no mallopt)"
    return text + (f"; environment sets {', '.join(overrides)}" if overrides else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as file:
            return round(int(file.readline().split()[1]) * 1024 / 2**30, 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def versions() -> dict[str, str]:
    """TorchRL's and tensordict's versions, or why they do not import."""
    try:
        import tensordict  # type: ignore[import-untyped]  # no py.typed
        import torchrl  # type: ignore[import-untyped]
    except ImportError as error:
        return {"torchrl": f"not importable: {error}"}
    return {"torchrl": str(torchrl.__version__), "tensordict": str(tensordict.__version__)}


def machine() -> dict[str, Any]:
    """The machine and software a pass runs on (its thread count is recorded per pass)."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "libc": libc_name(),
        **versions(),
    }


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
