"""Copying windows listed as runs (windows across segment seams), large fields on every thread.

A segmented buffer's gather reads each window from runs listed by its expansion
(`TransitionRing.gather_runs` with ``listed=``). Most windows lie in one place in the ring,
as a whole-episode buffer's do (an episode stored by ``add`` or by one stream at a time puts
its segments back to back), apart from records clamped at an episode's ends. Those are
copied as a whole-episode gather copies them: each window's ``size`` records as one block
read in place, from where its longest run lies (`block_plan`), then the window's other runs
over the block. With several threads the large fields' blocks are copied by
``index_select``, which splits a copy across torch's threads. That pays while fewer than a
quarter of the records are copied twice (`lucid_replay.records.blocks_pay`). Uniform
``sample_windows`` of 256 windows of 109 records (caches swept) took 9-11% less time from
10k transitions in segments and 12-13% less from 10M with two threads than when every run
was copied on its own; with one thread 3-4% less from 10M, and up to 3% more from 10k.

A batch of windows across seams of interleaved streams lies in two or more places a window;
its runs are copied as they are. With one thread, one compiled call copies every field's
runs. With several, and a batch whose listed runs cover every record (a buffer's own gather;
a sharded client's gather of one shard's piece covers only that shard's rows), a compiled
loop writes each record's ring slot (`listed_slots`), and ``index_select`` copies the large
fields' records over torch's threads (with two threads the reference batch's 28 kB rows
copied 1.35x faster that way); the small fields stay in the single compiled call. The bytes
copied are the same either way.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from lucid_replay import ring_copies
from lucid_replay.records import blocks_pay

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


@ring_copies.jit
def block_plan(
    listed: tuple[np.ndarray, np.ndarray, int],
    size: int,
    capacity: int,
    base: int,
    slots: np.ndarray,
) -> tuple[int, int]:
    """Plan the ``listed`` windows as blocks of ``size`` records.

    ``listed`` holds the runs, their windows and their count, as `listed_slots` reads them.
    ``slots[b]`` becomes the ring slot at which window ``b``'s block starts: where its longest
    run of consecutive records lies in place, if the block lies inside the ring; ``-1`` where
    the window has no such block (no run of kind 1, or a block across the ring's start or
    end), or no runs in this call. A block also reads records the window does not hold (the
    neighbours of its run): the window's other runs are copied after it, over them
    (`runs_left`). Returns how many records those runs hold, and how many all listed runs
    hold. Every run's offset is checked here, before anything is copied.
    """
    runs, windows, count = listed
    batch = slots.shape[0]
    for b in range(batch):
        slots[b] = -1
    longest = np.zeros(batch, dtype=np.int64)
    records = 0
    for r in range(count):
        slot = ring_copies.run_slot(runs[0, r], base, capacity)
        length = runs[2, r] - runs[1, r]
        records += length
        if runs[3, r] == 1 and length > longest[windows[r]]:
            longest[windows[r]] = length
            start = slot - runs[1, r]
            slots[windows[r]] = start if 0 <= start <= capacity - size else -1
    in_blocks = 0
    for b in range(batch):
        if slots[b] >= 0:
            in_blocks += longest[b]
    return records - in_blocks, records


@ring_copies.jit
def runs_left(
    listed: tuple[np.ndarray, np.ndarray, int],
    capacity: int,
    base: int,
    slots: np.ndarray,
    left: tuple[np.ndarray, np.ndarray],
) -> int:
    """Write the ``listed`` runs that no block holds in place to the front of ``left``.

    The blocks start at ``slots`` (`block_plan`); ``left`` is a ``[4, count]`` array of runs
    and a ``[count]`` array of their windows, written in order. Returns how many runs are left.
    """
    runs, windows, count = listed
    left_runs, left_windows = left
    kept = 0
    for r in range(count):
        b = windows[r]
        start = ring_copies.run_slot(runs[0, r], base, capacity) - runs[1, r]
        if slots[b] >= 0 and runs[3, r] == 1 and start == slots[b]:
            continue  # its records lie in the block where the window reads them
        for i in range(4):
            left_runs[i, kept] = runs[i, r]
        left_windows[kept] = b
        kept += 1
    return kept


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
    views: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Copy the listed runs of the ring's ``fields`` into ``out`` (CPU, ``[B, size, ...]``).

    ``addresses`` and ``row_bytes``: each field's first byte and row bytes; ``split``: the
    fields the compiled call copies (positions) and those ``index_select`` may copy
    (`TransitionRing._copiers`); ``base``: the offset of slot 0 in the oldest stored lap;
    ``views``: each field as overlapping blocks of ``size`` records
    (`TransitionRing._run_views`), needed where ``split`` names fields for ``index_select``.
    """
    runs, windows, count = listed
    serial, parallel = split
    batch = next(iter(out.values())).shape[0]
    slots = np.empty(batch, dtype=np.int64)
    left_records, records = block_plan(listed, size, capacity, base, slots)
    if parallel and records != batch * size:
        serial, parallel = np.arange(len(fields)), ()  # some rows are not this call's
    targets = np.array([out[name].data_ptr() for name in fields], dtype=np.int64)
    if blocks_pay(left_records, batch * size) and (views is not None or not parallel):
        # As a whole-episode gather: blocks (over torch's threads for the large fields), then
        # the rest over them.
        if serial.shape[0]:
            blocks = targets[serial], addresses[serial], row_bytes[serial]
            ring_copies.copy_blocks(*blocks, slots, size, capacity)
        if parallel:
            assert views is not None
            where = torch.from_numpy(np.maximum(slots, 0))  # a window without: all runs left
            for name in parallel:
                torch.index_select(views[name], 0, where, out=out[name])
        left = np.empty((4, count), dtype=np.int64), np.empty(count, dtype=np.int64)
        kept = runs_left(listed, capacity, base, slots, left)
        if kept:
            ring_copies.copy_runs(targets, addresses, row_bytes, size, *left, kept, capacity, base)
        return
    if serial.shape[0]:
        blocks = targets[serial], addresses[serial], row_bytes[serial]
        ring_copies.copy_runs(*blocks, size, runs, windows, count, capacity, base)
    if parallel:
        record_slots = np.empty(batch * size, dtype=np.int64)
        listed_slots(runs, windows, count, size, capacity, base, record_slots)
        where = torch.from_numpy(record_slots)
        for name in parallel:
            store = fields[name]
            torch.index_select(store, 0, where, out=out[name].view(-1, *store.shape[1:]))
