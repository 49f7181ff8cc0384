"""The compiled listing of a located draw's records as runs (numba; imported only then).

`lucid_replay.distributed.sharing.list_runs` turns the arguments of
`TransitionRing.gather_runs` (each window's first offset, stride, which records are exact,
the clamped records' rows and steps) into the listed runs `ring_copies.copy_runs` copies.
The runs are built record by record with the ring's own `ring_copies._add_record`, on
global offsets instead of slots.
"""

from __future__ import annotations

import numpy as np

from lucid_replay import engine
from lucid_replay.ring_copies import _add_record

__all__: list[str] = []  # internal module


@engine.jit
def list_runs_loop(
    firsts: np.ndarray,
    stride: int,
    size: int,
    exact: np.ndarray,
    base: np.ndarray,
    rows: np.ndarray,
    steps: np.ndarray,
    runs: np.ndarray,
    windows: np.ndarray,
) -> int:
    """List window ``b``'s records into ``runs`` (``[4, B * size]``); returns the count.

    ``exact`` has no rows when every record is at its run offset.
    """
    checked = exact.shape[0] > 0
    count = 0
    for b in range(firsts.shape[0]):
        start = count
        listed = 0
        for k in range(size):
            if not checked or exact[b, k]:
                offset = firsts[b] + stride * k
            else:
                offset = base[rows[b, 0 if rows.shape[1] == 1 else k]] + steps[b, k]
            listed = _add_record(runs, start, listed, k, offset)
        count = start + listed
        windows[start:count] = b
    return count
