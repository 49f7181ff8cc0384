"""Compiled loops for the CPU data path (optional extra ``fast``: numba).

On vectors of a few hundred elements, numpy spends most of its time in per-call dispatch:
a 20-level sum-tree descent is 80 array operations, the expansion of a window batch a few
dozen, the gather of a batch a dozen tensor calls plus its repairs. The loops do the same
work element by element in compiled code, with the same IEEE float64 operations in the same
order, so their results are bitwise those of the numpy and torch code they replace (the
tests run both). Without numba (or with ``LUCID_REPLAY_KERNELS=0`` in the environment) that
code runs instead.

They live in `lucid_replay.compiled`; each is compiled on first use (about a second, cached
on disk afterwards).
"""

from __future__ import annotations

import os
from typing import Any

__all__: list[str] = []  # internal module

enabled = os.environ.get("LUCID_REPLAY_KERNELS", "1") != "0"  # tests switch it too
_compiled: dict[str, Any] | None = None


def get() -> dict[str, Any] | None:
    """The compiled kernels by name, or ``None`` when switched off or numba is missing."""
    global _compiled, enabled
    if not enabled:
        return None
    if _compiled is None:
        try:
            from lucid_replay import compiled  # needs numba, the optional extra
        except ImportError:
            enabled = False
            return None
        _compiled = compiled.KERNELS
    return _compiled
