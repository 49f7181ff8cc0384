"""The ring's compiled copies (numba): raw memory moves between the ring and a batch.

Imported by `lucid_replay.ring` on its compiled path only, so only where numba is there.
Module-level loops registered with `lucid_replay.engine.jit`, so that numba caches them on
disk; the array code they replace is `TransitionRing.gather_runs`. The raw memory access
they build on (copies, unaligned loads and stores, prefetches) is `lucid_replay.raw_memory`.
"""

from __future__ import annotations

import numpy as np

from lucid_replay import engine
from lucid_replay.raw_memory import (
    copy,
    load_byte,
    load_int,
    load_word,
    prefetch_read,
    prefetch_span,
    prefetch_write,
    store_byte,
    store_int,
    store_word,
)

__all__: list[str] = []  # internal module

engine.available()  # numba is here: the loops below are compiled as they are registered
jit = engine.jit


@jit
def copy_rows(
    target: int, width: int, sources: np.ndarray, owner: np.ndarray, within: np.ndarray
) -> None:
    """Row ``i`` of ``target`` from row ``within[i]`` of the block at ``sources[owner[i]]``.

    Rows are ``width`` bytes: a compressed field's gather from its decoded blocks.
    Consecutive rows of one block read consecutive bytes: they are copied as one run.
    """
    count, i = owner.shape[0], 0
    while i < count:
        j = i + 1
        while j < count and owner[j] == owner[i] and within[j] == within[j - 1] + 1:
            j += 1
        copy(target + i * width, sources[owner[i]] + within[i] * width, (j - i) * width)
        i = j


@jit
def write_steps(
    addresses: np.ndarray,
    row_bytes: np.ndarray,
    sources: np.ndarray,
    begin: int,
    count: int,
    capacity: int,
) -> None:
    """`TransitionRing.write`, compiled: ``count`` steps of each field into slots ``begin ..``.

    ``sources`` are the addresses of C-contiguous ``[count, ...]`` steps, one per field of
    the ring (its order); the steps past the ring's end wrap to slot 0.
    """
    first = min(count, capacity - begin)
    for field in range(addresses.shape[0]):
        width = row_bytes[field]
        copy(addresses[field] + begin * width, sources[field], first * width)
        if first < count:
            copy(addresses[field], sources[field] + first * width, (count - first) * width)


@jit
def _add_record(runs: np.ndarray, first: int, count: int, k: int, slot: int) -> int:
    """Add record ``k`` (at ``slot``) to ``count`` runs; returns the new count.

    The runs are stored from column ``first`` of ``runs``, whose rows are: slot, first
    record, end record, kind. A run's records are at consecutive slots (kind 1) or all at
    one slot (kind 0: records clamped to an episode's first or last step).
    """
    if count:
        r = first + count - 1
        length = runs[2, r] - runs[1, r]
        if runs[2, r] == k and length == 1 and 0 <= slot - runs[0, r] <= 1:
            runs[3, r], runs[2, r] = slot - runs[0, r], k + 1
            return count
        if runs[2, r] == k and length > 1 and slot == runs[0, r] + length * runs[3, r]:
            runs[2, r] = k + 1
            return count
    r = first + count
    runs[0, r], runs[1, r], runs[2, r], runs[3, r] = slot, k, k + 1, 1
    return count + 1


@jit
def _copy_run(into: int, source: int, width: int, run: np.ndarray) -> None:
    """Copy one run (a column of `_add_record`'s ``runs``) of ``width``-byte records."""
    slot, begin, end, kind = run[0], run[1], run[2], run[3]
    at = into + begin * width
    if kind == 1:
        copy(at, source + slot * width, (end - begin) * width)
        return
    length = end - begin
    if width == 8 or width == 4 or width == 1:  # a fill: one store per record
        _fill(at, source + slot * width, width, length)
        return
    copy(at, source + slot * width, width)  # one record, then doubling copies of it
    filled = 1
    while filled < length:
        more = min(filled, length - filled)
        copy(at + filled * width, at, more * width)
        filled += more


@jit
def _fill(at: int, source: int, width: int, count: int) -> None:
    """Write ``count`` copies of the ``width``-byte record at ``source`` (1, 4 or 8 bytes)."""
    if width == 8:
        word = load_word(source)
        for i in range(count):
            store_word(at + 8 * i, word)
    elif width == 4:
        half = load_int(source)
        for i in range(count):
            store_int(at + 4 * i, half)
    else:
        byte = load_byte(source)
        for i in range(count):
            store_byte(at + i, byte)


_ALL_TRUE = np.uint64(0x0101010101010101)  # eight of numpy's True (the byte 1); unsigned,
# as a signed literal would make numba compare the two as float64, which cannot tell them apart


@jit
def _all_exact(exact: np.ndarray, b: int, size: int) -> bool:
    """Whether row ``b`` of the C-contiguous bool ``exact`` is all True, 8 bytes a read."""
    row, k = exact.ctypes.data + b * size, 0
    while k + 8 <= size:
        if load_word(row + k) != _ALL_TRUE:
            return False
        k += 8
    while k < size:
        if load_byte(row + k) == 0:
            return False
        k += 1
    return True


@jit
def _slot(
    firsts: np.ndarray,
    stride: int,
    exact: bool,
    start: np.ndarray,
    rows: np.ndarray,
    steps: np.ndarray,
    capacity: int,
    base: int,
    b: int,
    k: int,
) -> int:
    """The ring slot of record ``k`` of window ``b`` (`gather_records`' arguments).

    Not exact: ``start[row] + steps[b, k]``, `EpisodeTable.offsets` compiled, the row being
    ``rows[b, k]`` (or ``rows[b, 0]`` for ``[B, 1]`` rows: one episode per window).
    """
    if exact:
        offset = firsts[b] + stride * k
    else:
        offset = start[rows[b, 0 if rows.shape[1] == 1 else k]] + steps[b, k]
    slot: int = offset - base
    return slot - capacity if slot >= capacity else slot


@jit
def _prefetch_reads(sources: np.ndarray, row_bytes: np.ndarray, slot: int, capacity: int) -> None:
    """Start the cache misses of ring ``slot`` in every field (none outside the ring)."""
    if 0 <= slot < capacity:
        for f in range(sources.shape[0]):
            prefetch_read(sources[f] + slot * row_bytes[f])


@jit
def _prefetch_writes(targets: np.ndarray, row_bytes: np.ndarray, b: int, size: int) -> None:
    """Start the cache misses of window ``b``'s batch rows where they span 16 lines at most.

    A larger field's rows are written by one long copy, which the hardware prefetches.
    """
    for f in range(targets.shape[0]):
        span = size * row_bytes[f]
        if span <= 1024:
            into = targets[f] + b * span
            for line in range(into - into % 64, into + span, 64):
                prefetch_write(line)


_AHEAD = 4  # windows between a prefetch and its copy
# A small field (a window's records span at most _SMALL_SPAN bytes) is read whole, a few
# lines a window from as many places: too short for the hardware to prefetch, so each
# block's every line is prefetched, _AHEAD_SMALL blocks on. Measured on two cores, caches
# swept: the five small fields of 256 windows across seams (608 runs) 0.17 -> 0.11 ms,
# of 256 whole windows 0.060 -> 0.046 ms; a large field's copy did not gain from it.
_SMALL_SPAN = 4096
_AHEAD_SMALL = 16


@jit
def _prefetch_run(
    source: int, width: int, runs: np.ndarray, r: int, base: int, capacity: int, whole: bool
) -> None:
    """Start the misses of listed run ``r`` of a field: every line if ``whole``, else its first.

    For a run across the ring's end the lines past the end are not the run's: a prefetch
    there is wasted, never a fault.
    """
    slot = runs[0, r] - base  # checked by `copy_runs` first: no `run_slot` guard here
    address = source + (slot - capacity if slot >= capacity else slot) * width
    if whole:
        prefetch_span(address, (runs[2, r] - runs[1, r] if runs[3, r] == 1 else 1) * width)
    else:
        prefetch_read(address)


@jit
def run_slot(offset: int, base: int, capacity: int) -> int:
    """The ring slot of a listed run's global ``offset`` (``base``: slot 0's, oldest lap)."""
    slot = offset - base
    if slot >= capacity:
        slot -= capacity
    if not 0 <= slot < capacity:  # a raw-memory guard, as in gather_records
        raise IndexError("listed runs: an offset outside the stored range")
    return slot


@jit
def copy_runs(
    targets: np.ndarray,
    sources: np.ndarray,
    row_bytes: np.ndarray,
    size: int,
    runs: np.ndarray,
    windows: np.ndarray,
    count: int,
    capacity: int,
    base: int,
) -> None:
    """Copy ``count`` listed runs of records into the batch rows ``windows`` of each field.

    ``runs`` columns are (global offset, first record, end record, kind); ``targets``,
    ``sources`` and ``row_bytes`` are `gather_records`' arguments. A run of kind 1 holds
    consecutive offsets (split where it crosses the ring's end), one of kind 0 repeats one
    offset (a window clamped to an episode's first or last step), as `_add_record`'s.
    ``base`` is the offset of slot 0 in the oldest stored lap.
    """
    for r in range(count):
        run_slot(runs[0, r], base, capacity)
    fields_at = targets, sources, row_bytes
    copy_run_range(fields_at, size, (runs, windows), (0, count), capacity, base)


@jit
def copy_run_range(
    fields_at: tuple[np.ndarray, np.ndarray, np.ndarray],
    size: int,
    listed: tuple[np.ndarray, np.ndarray],
    columns: tuple[int, int],
    capacity: int,
    base: int,
) -> None:
    """`copy_runs` of the runs in ``columns`` (``begin, end``), whose offsets were checked.

    ``fields_at``: its ``targets``, ``sources`` and ``row_bytes``; ``listed``: its ``runs``
    and ``windows``. Field by field, the run `_AHEAD` places on prefetched (a small field's
    whole, `_AHEAD_SMALL` places on), as `copy_blocks` does.
    """
    targets, sources, row_bytes = fields_at
    runs, windows = listed
    first_run, end_run = columns
    run = np.empty(4, dtype=np.int64)
    for f in range(targets.shape[0]):
        width = row_bytes[f]
        small = width * size <= _SMALL_SPAN
        ahead = _AHEAD_SMALL if small else _AHEAD
        for r in range(first_run, min(first_run + ahead, end_run) if small else first_run):
            _prefetch_run(sources[f], width, runs, r, base, capacity, True)
        for r in range(first_run, end_run):
            if r + ahead < end_run:  # as copy_blocks: the run `ahead` on is read from cold memory
                _prefetch_run(sources[f], width, runs, r + ahead, base, capacity, small)
            slot = runs[0, r] - base
            if slot >= capacity:
                slot -= capacity
            begin, end = runs[1, r], runs[2, r]
            into = targets[f] + windows[r] * size * width
            first = min(end - begin, capacity - slot) if runs[3, r] == 1 else end - begin
            run[0], run[1], run[2], run[3] = slot, begin, begin + first, runs[3, r]
            _copy_run(into, sources[f], width, run)
            if begin + first < end:  # the rest of a run across the ring's end
                run[0], run[1], run[2] = 0, begin + first, end
                _copy_run(into, sources[f], width, run)


@jit
def copy_blocks(
    targets: np.ndarray,
    sources: np.ndarray,
    row_bytes: np.ndarray,
    slots: np.ndarray,
    size: int,
    capacity: int,
) -> None:
    """Copy the ``size`` records from ring slot ``slots[b]`` on into batch row ``b``.

    For every field (`gather_records`' ``targets``, ``sources`` and ``row_bytes``): field by
    field, so that each field's blocks stream one after another, one block per window, with
    the block `_AHEAD` windows on prefetched (a small field's block whole, `_AHEAD_SMALL`
    windows on). A slot of ``-1`` leaves row ``b`` as it is.
    """
    check_blocks(slots, size, capacity)
    copy_block_range(targets, sources, row_bytes, (slots, size), (0, slots.shape[0]))


@jit
def check_blocks(slots: np.ndarray, size: int, capacity: int) -> None:
    """Refuse a block of ``size`` records that would read outside the ring (``-1``: none)."""
    for b in range(slots.shape[0]):
        if not -1 <= slots[b] <= capacity - size:  # a raw-memory guard, as in gather_records
            raise IndexError("copy_blocks: a block outside the ring")


@jit
def copy_block_range(
    targets: np.ndarray,
    sources: np.ndarray,
    row_bytes: np.ndarray,
    blocks: tuple[np.ndarray, int],
    rows: tuple[int, int],
) -> None:
    """`copy_blocks` of the batch rows in ``rows`` (``begin, end``).

    ``blocks`` holds its ``slots`` (checked by `check_blocks`) and ``size``.
    """
    slots, size = blocks
    first_row, end_row = rows
    for f in range(targets.shape[0]):
        block = size * row_bytes[f]
        small = block <= _SMALL_SPAN
        ahead = _AHEAD_SMALL if small else _AHEAD
        for b in range(first_row, min(first_row + ahead, end_row) if small else first_row):
            if slots[b] >= 0:
                prefetch_span(sources[f] + slots[b] * row_bytes[f], block)
        for b in range(first_row, end_row):
            if b + ahead < end_row and slots[b + ahead] >= 0:
                at = sources[f] + slots[b + ahead] * row_bytes[f]
                prefetch_span(at, block if small else 1)
            if slots[b] >= 0:
                copy(targets[f] + b * block, sources[f] + slots[b] * row_bytes[f], block)


@jit
def gather_records(
    targets: np.ndarray,
    sources: np.ndarray,
    row_bytes: np.ndarray,
    copied: bool,
    firsts: np.ndarray,
    stride: int,
    size: int,
    exact: np.ndarray,
    start: np.ndarray,
    rows: np.ndarray,
    steps: np.ndarray,
    capacity: int,
    base: int,
    runs: np.ndarray,
) -> None:
    """`TransitionRing.gather_runs` for every field at once.

    ``targets`` and ``sources`` are the addresses of the fields' contiguous batch and ring
    memory, ``row_bytes`` their bytes per record. Record ``k`` of window ``b`` reads the slot of
    offset ``firsts[b] + stride * k`` where it is ``exact`` (C-contiguous; every record is if
    ``exact`` has no rows), else that of step ``steps[b, k]`` of table row ``rows[b, k]``
    (``rows[b, 0]`` if ``rows`` has one column; ``start`` is the table's start column).
    Records at consecutive slots, or repeating one slot, are copied as one run. If
    ``copied``, every field already holds the run of every window whose run from slot
    ``firsts[b] % capacity`` lies inside the ring: of those windows only the records that
    are not exact are copied. ``runs`` is scratch
    memory, int64 ``[4, size]`` (allocating it here would put small blocks among the batches on
    the heap, which a stock allocator then trims and faults back in).

    When it copies every window (not ``copied``), it prefetches the ends of the window
    `_AHEAD` places on: short episodes' windows are mostly records clamped to a step read
    from cold memory, and without it each window's misses wait for the previous window's
    (10% of a prioritized sample + update at 100k and 1M episodes of 40 and 4 steps).
    """
    # Window b's runs, in the first columns of `runs`: those of the records it copies.
    checked = exact.shape[0] > 0
    windows = firsts.shape[0]
    for b in range(windows):
        if not copied:  # windows 0 .. _AHEAD first, then one _AHEAD places on per window
            for a in range(b + _AHEAD if b else 0, min(b + _AHEAD + 1, windows)):
                for k in (0, size - 1):  # the steps a short episode's clamped records repeat
                    exact_k = not checked or exact[a, k]
                    slot = _slot(firsts, stride, exact_k, start, rows, steps, capacity, base, a, k)
                    _prefetch_reads(sources, row_bytes, slot, capacity)
                _prefetch_writes(targets, row_bytes, a, size)
        whole = not checked or _all_exact(exact, b, size)
        first = firsts[b] % capacity  # the slot `copied` runs started at
        inside = first + stride * (size - 1) < capacity
        repair = copied and inside  # its run is in place: only its inexact records
        if repair and whole:
            continue
        count = 0
        if whole and inside and stride == 1:  # the common case: one block
            count = _add_record(runs, 0, 0, 0, first)
            runs[2, 0] = size
        else:
            for k in range(size):
                exact_k = whole or exact[b, k]
                if repair and exact_k:
                    continue
                slot = _slot(firsts, stride, exact_k, start, rows, steps, capacity, base, b, k)
                if not 0 <= slot < capacity:  # never for stored offsets: a raw-memory guard
                    raise IndexError("gather_records: an offset outside the stored range")
                count = _add_record(runs, 0, count, k, slot)
        for f in range(targets.shape[0]):
            width = row_bytes[f]
            into = targets[f] + b * size * width
            for r in range(count):
                _copy_run(into, sources[f], width, runs[:, r])
