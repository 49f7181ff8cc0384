"""Copying windows listed as runs (windows across segment seams), on every thread.

A segmented buffer's gather reads each window from runs listed by its expansion
(`TransitionRing.gather_runs` with ``listed=``). Most windows lie in one place in the ring,
as a whole-episode buffer's do (an episode stored by ``add`` or by one stream at a time puts
its segments back to back), apart from records clamped at an episode's ends. Those are
copied as a whole-episode gather copies them: each window's ``size`` records as one block
read in place, from where its longest run lies (`block_plan`), then the window's other runs
over the block. That pays while fewer than a quarter of the records are copied twice
(`lucid_replay.records.blocks_pay`). Uniform ``sample_windows`` of 256 windows of 109
records (caches swept) took 9-11% less time from 10k transitions in segments and 12-13% less
from 10M with two threads than when every run was copied on its own; with one thread 3-4%
less from 10M, and up to 3% more from 10k.

A batch of windows across seams of interleaved streams lies in two or more places a window;
its runs are copied as they are. With one thread, one compiled call copies every field's
runs.

With several threads, the compiled copy runs on torch's own OpenMP team
(`lucid_replay.openmp_team`): every thread runs `copy_claimed`, which claims 32 runs (or 16
windows' blocks) at a time until none are left; blocks first, then, once every thread is
done, the runs over them. On two cores, 256 windows across seams of 16 interleaved streams
(10^6 transitions, caches cold) took 0.83x to 0.90x the time of the same windows on a
whole-episode buffer, against 1.02x to 1.09x when every record's ring slot was written
(`listed_slots`) and ``index_select`` copied the large fields record by record over
torch's threads while the small ones stayed on one. That way remains where torch runs on no
OpenMP team: there ``index_select`` copies the large fields' blocks, or records. A sharded
client's gather asks for one thread (the other cores are other processes'). The bytes
copied are the same every way.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lucid_replay import openmp_team, raw_memory, ring_copies
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
    team: int | None = None,
) -> None:
    """Copy the listed runs of the ring's ``fields`` into ``out`` (CPU, ``[B, size, ...]``).

    ``addresses`` and ``row_bytes``: each field's first byte and row bytes; ``split``: the
    fields the compiled call copies (positions) and those ``index_select`` may copy
    (`TransitionRing._copiers`); ``base``: the offset of slot 0 in the oldest stored lap;
    ``views``: each field as overlapping blocks of ``size`` records
    (`TransitionRing._run_views`), needed where ``split`` names fields for ``index_select``;
    ``team``: how many threads of torch's OpenMP team copy every field
    (`lucid_replay.openmp_team.threads`; None where torch has no such team).
    """
    runs, windows, count = listed
    serial, parallel = split
    batch = next(iter(out.values())).shape[0]
    slots = np.empty(batch, dtype=np.int64)
    left_records, records = block_plan(listed, size, capacity, base, slots)
    threads = 1 if team is None else team
    on_team = threads > 1
    if on_team or (parallel and records != batch * size):
        # The team copies every field; else some rows are not this call's.
        serial, parallel = np.arange(len(fields)), ()
    targets = np.array([out[name].data_ptr() for name in fields], dtype=np.int64)
    everything = targets, addresses, row_bytes
    if blocks_pay(left_records, batch * size) and (views is not None or not parallel):
        # As a whole-episode gather: blocks (on the team, or the large fields over torch's
        # threads), then the rest over them.
        if on_team:
            ring_copies.check_blocks(slots, size, capacity)
            blocks_at = (slots[None], slots, batch)
            _on_team(_team_arguments(_BLOCKS, everything, size, blocks_at, capacity, base), threads)
        else:
            if serial.shape[0]:
                blocks = targets[serial], addresses[serial], row_bytes[serial]
                ring_copies.copy_blocks(*blocks, slots, size, capacity)
            if parallel:
                assert views is not None
                where = torch.from_numpy(np.maximum(slots, 0))  # a window without: runs left
                for name in parallel:
                    torch.index_select(views[name], 0, where, out=out[name])
        left = np.empty((4, count), dtype=np.int64), np.empty(count, dtype=np.int64)
        kept = runs_left(listed, capacity, base, slots, left)
        if kept and on_team:
            left_at = (*left, kept)
            _on_team(_team_arguments(_RUNS, everything, size, left_at, capacity, base), threads)
        elif kept:
            ring_copies.copy_runs(*everything, size, *left, kept, capacity, base)
        return
    if on_team:
        if count:
            _on_team(_team_arguments(_RUNS, everything, size, listed, capacity, base), threads)
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


# ------------------------------------------------------------------ on torch's OpenMP team
_RUNS, _BLOCKS = 0, 1  # what a team copies: listed runs, or one block per window
_RUN_CHUNK = 32  # runs a thread claims at a time (256 windows across seams: about 20 claims)
_BLOCK_CHUNK = 16  # windows' blocks a thread claims at a time
_WORDS = 14  # the team's arguments, int64 words (`_team_arguments`)


def _on_team(arguments: np.ndarray, team: int) -> None:
    """`copy_claimed` of ``arguments`` on ``team`` threads of torch's OpenMP team.

    ``arguments``: `_team_arguments`, whose arrays the caller holds; returns when every
    thread is done.
    """
    openmp_team.run(_team_copy_function(), arguments.ctypes.data, team)


def _team_arguments(
    kind: int,
    fields_at: tuple[np.ndarray, np.ndarray, np.ndarray],
    size: int,
    work: tuple[np.ndarray, np.ndarray, int],
    capacity: int,
    base: int,
) -> np.ndarray:
    """The words `copy_claimed` reads: a claim counter, then every argument of the copy.

    ``fields_at``: the fields' targets, sources and row bytes; ``work``: for `_RUNS` the
    listed runs, their windows and their count (`copy_runs`), for `_BLOCKS` the block
    slots as one row, the slots again, and the batch size (`copy_blocks`). Arrays are passed
    by address: each must stay alive, int64 and C-contiguous, until the team has returned
    (the caller holds them).
    """
    table, windows, count = work
    arrays = (*fields_at, table, windows)
    for array in arrays:
        if array.dtype != np.int64 or not array.flags.c_contiguous:
            raise ValueError(
                "listed copies: the team reads int64 C-contiguous arrays, got "
                f"{array.dtype} of strides {array.strides}"
            )
    fields = {array.shape for array in fields_at}
    if len(fields) != 1 or len(next(iter(fields))) != 1:
        raise ValueError(f"listed copies: one entry per field in each of three, got {fields}")
    rows, columns = table.shape
    if kind not in (_RUNS, _BLOCKS) or rows != (4 if kind == _RUNS else 1):
        raise ValueError(f"listed copies: kind {kind} with a table of {rows} rows")
    if not 0 <= count <= min(columns, windows.shape[0]):
        raise ValueError(
            f"listed copies: {count} to copy, but {columns} columns and {windows.shape[0]} windows"
        )
    head = [0, kind, fields_at[0].shape[0], size, count, capacity, base, rows, columns]
    return np.array(head + [array.ctypes.data for array in arrays], dtype=np.int64)


@ring_copies.jit
def copy_claimed(address: int) -> None:
    """Copy the work whose arguments are the words at ``address`` (`_team_arguments`).

    A chunk at a time, each chunk claimed from the counter in the first word; every thread
    of a team runs it. The runs' offsets and the blocks' slots were checked before (`block_plan`,
    `ring_copies.check_blocks`): it raises nothing.
    """
    head = raw_memory.words(address, _WORDS)
    kind, fields, size, count, capacity, base = head[1], head[2], head[3], head[4], head[5], head[6]
    targets = raw_memory.words(head[9], fields)
    sources = raw_memory.words(head[10], fields)
    row_bytes = raw_memory.words(head[11], fields)
    table = raw_memory.words(head[12], head[7] * head[8]).reshape((head[7], head[8]))
    windows = raw_memory.words(head[13], count)
    chunk = _RUN_CHUNK if kind == _RUNS else _BLOCK_CHUNK
    while True:
        first = raw_memory.claim(address) * chunk
        if first >= count:
            return
        span = (first, min(first + chunk, count))
        if kind == _RUNS:
            fields_at = targets, sources, row_bytes
            ring_copies.copy_run_range(fields_at, size, (table, windows), span, capacity, base)
        else:
            ring_copies.copy_block_range(targets, sources, row_bytes, (table[0], size), span)


def _team_copy(data: int) -> None:
    """The C function the team runs (``void f(void *data)``): `copy_claimed` of ``data``."""
    copy_claimed(raw_memory.address_of(data))


_team_copy_compiled: Any = None  # numba's cfunc: its machine code lives as long as it does
_compile_lock = threading.Lock()


def _team_copy_function() -> int:
    """The address of `_team_copy` compiled as a C function (numba's ``cfunc``), once."""
    global _team_copy_compiled
    with _compile_lock:  # one compiled function: a second would free the first's code
        if _team_copy_compiled is None:
            import numba

            signature = numba.types.void(numba.types.voidptr)
            _team_copy_compiled = numba.cfunc(signature, cache=True)(_team_copy)
        return int(_team_copy_compiled.address)
