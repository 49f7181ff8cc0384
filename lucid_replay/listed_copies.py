"""Copying windows listed as runs (windows across segment seams), large fields on every thread.

A window across a seam is gathered from runs listed by its expansion (`TransitionRing.gather_runs`
with ``listed=``): one compiled call copies every field's runs, on one thread. A whole-episode
buffer's gather copies its large fields with ``index_select``, which splits the copy over
torch's threads; with two threads the reference batch's 28 kB rows copied 1.35x faster that
way, so windows across seams fell behind by as much. Here, with several threads and a batch
whose listed runs cover every record (a buffer's own gather; a sharded client's gather of one
shard's piece covers only that shard's rows), the large fields are copied the same way: a
compiled loop writes each record's ring slot (`listed_slots`), and ``index_select`` copies
the records of those fields over torch's threads. The small fields, and every field with one
thread, stay in the single compiled call. The bytes copied are the same either way.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from lucid_replay import ring_copies

__all__: list[str] = []  # internal module


@ring_copies.jit
def listed_slots(
    runs: np.ndarray,
    windows: np.ndarray,
    count: int,
    size: int,
    capacity: int,
    base: int,
    slots: np.ndarray,
) -> None:
    """Each listed record's ring slot, at its place ``window * size + record`` in ``slots``.

    ``runs`` and ``base`` as `ring_copies.copy_runs` reads them: a run of kind 1 holds
    consecutive offsets (wrapping at the ring's end), one of kind 0 repeats one offset.
    """
    for r in range(count):
        slot = ring_copies.run_slot(runs[0, r], base, capacity)
        begin, end = runs[1, r], runs[2, r]
        # An unsigned position: numba then drops its check for negative indices, and the
        # loops below become vector stores (256 windows across seams: 20.5 -> 11.3 us).
        at = np.uint64(windows[r] * size + begin)
        if runs[3, r] != 1:
            for _ in range(begin, end):
                slots[at] = slot
                at += np.uint64(1)
            continue
        wrap = min(end, begin + capacity - slot)  # the first record past the ring's end
        for k in range(begin, wrap):
            slots[at] = slot + (k - begin)
            at += np.uint64(1)
        for k in range(wrap, end):
            slots[at] = slot + (k - begin) - capacity
            at += np.uint64(1)


def copy_listed(
    fields: dict[str, torch.Tensor],
    addresses: np.ndarray,
    row_bytes: np.ndarray,
    split: tuple[np.ndarray, tuple[str, ...]],
    out: Mapping[str, torch.Tensor],
    size: int,
    listed: tuple[np.ndarray, np.ndarray, int],
    capacity: int,
    base: int,
) -> None:
    """Copy the listed runs of the ring's ``fields`` into ``out`` (CPU, ``[B, size, ...]``).

    ``addresses`` and ``row_bytes``: each field's first byte and row bytes; ``split``: the
    fields the compiled call copies (positions) and those ``index_select`` may copy
    (`TransitionRing._copiers`); ``base``: the offset of slot 0 in the oldest stored lap.
    """
    runs, windows, count = listed
    serial, parallel = split
    batch = next(iter(out.values())).shape[0]
    if parallel and int((runs[2, :count] - runs[1, :count]).sum()) != batch * size:
        serial, parallel = np.arange(len(fields)), ()  # some rows are not this call's
    if serial.shape[0]:
        targets = np.array([out[name].data_ptr() for name in fields], dtype=np.int64)
        blocks = targets[serial], addresses[serial], row_bytes[serial]
        ring_copies.copy_runs(*blocks, size, runs, windows, count, capacity, base)
    if parallel:
        slots = np.empty(batch * size, dtype=np.int64)
        listed_slots(runs, windows, count, size, capacity, base, slots)
        where = torch.from_numpy(slots)
        for name in parallel:
            store = fields[name]
            torch.index_select(store, 0, where, out=out[name].view(-1, *store.shape[1:]))
