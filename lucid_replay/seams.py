"""Windows across segment seams: an episode's stored segments read as one sequence.

On a segmented buffer an episode's steps lie in several segments, each a contiguous run of
the ring, in commit order among other episodes' segments. A window is expanded exactly as
on the same steps stored contiguously (`lucid_replay.window` states the rules): its records
clamp to the episode's first stored step and to its last committed step, ``stop`` shifts
the window back at most to the first stored step, and a record at the last step of a
terminated episode is terminal. Each record then finds the segment holding its step by
walking the episode's chain of segments from the anchor's (a window of ``S`` steps crosses
at most ``S / segment_length + 1`` seams). The gather reads a window as runs: with
``dilation == 1`` the compiled expansion lists them (the steps of segments committed back
to back, or records clamped to one step; `ring_copies.copy_runs` copies them), elsewhere
the records of the anchor's segment, and of segments committed back to back with it
(``add`` and a lone stream commit them so: their ``base`` is the anchor's), are one run and
the others are read one by one (`Records.exact`).
"""

from __future__ import annotations

import numpy as np
import torch

from lucid_replay import engine
from lucid_replay.engine import Array
from lucid_replay.records import Anchors, RecordArrays, Records
from lucid_replay.table import EpisodeTable

__all__: list[str] = []  # internal module


def expand_segments(
    table: EpisodeTable,
    anchors: Anchors,
    size: int,
    burn_in: int,
    dilation: int,
    stop_span: int | None,
    into: RecordArrays | None = None,
    learning: tuple[int, int] = (0, 0),
) -> Records:
    """The records of ``anchors`` (segment rows, episode ids, episode steps) on a segmented table.

    Windows of ``size`` records, record ``k`` targeting ``anchor + (k - burn_in) * dilation``;
    ``stop_span``: under ``boundary="stop"`` the steps from the anchor to the window's last
    record (``dilation * (length + bootstrap - 1)``), else ``None``. ``into``: the batch's
    per-record arrays to write into on CPU (with the learning region's records
    ``learning = (first, end)``), as `window.expand` does.
    """
    owners, column = table.owners(), table.arrays
    if engine.compiled(anchors.rows):
        return _expanded_by_loop(table, anchors, size, burn_in, dilation, stop_span, into, learning)
    rows = engine.tensor(anchors.rows)
    anchor = engine.tensor(anchors.steps)
    slot_of = engine.tensor(owners.slot)
    slots = slot_of[rows]
    first = engine.tensor(owners.first_stored)[slots]
    last = engine.tensor(owners.total)[slots] - 1
    ended = engine.tensor(owners.terminated)[slots] & ~engine.tensor(owners.opened)[slots]
    if stop_span is not None:
        overrun = (stop_span - (last - anchor)).clamp_min(0)
        anchor = anchor - torch.minimum(overrun, anchor - first)
    offset = (torch.arange(size, device=anchor.device) - burn_in) * dilation
    targets = anchor[:, None] + offset
    valid = (targets >= first[:, None]) & (targets <= last[:, None])
    steps = torch.minimum(torch.maximum(targets, first[:, None]), last[:, None])
    is_init = valid & (valid.cumsum(dim=1) == 1)  # one episode: its first valid record
    terminal = ended[:, None] & (steps == last[:, None])
    record_rows = segment_of(table, rows, steps)
    episode_ids = engine.tensor(anchors.episode_ids)[:, None].expand_as(steps)
    base = engine.tensor(column["base"])
    return Records(
        first_offsets=engine.view(base[rows] + targets[:, 0]),
        rows=engine.view(record_rows),
        episode_ids=engine.view(episode_ids.contiguous()),
        steps=engine.view(steps),
        valid=engine.view(valid),
        is_init=engine.view(is_init),
        terminal=engine.view(terminal),
        clamped=True,
        exact=engine.view(valid & (base[record_rows] == base[rows][:, None])),
    )


def rows_holding(table: EpisodeTable, rows: Array, steps: Array) -> Array:
    """Row of the segment holding each of ``steps`` ``[n]``, walking from ``rows`` ``[n]``.

    As `segment_of` for one step per row (`engine` arrays; compiled on CPU).
    """
    if engine.compiled(steps):
        column = table.arrays
        return rows_holding_loop(
            np.ascontiguousarray(rows),
            np.ascontiguousarray(steps),
            column["first_step"],
            column["length"],
            column["prev_key"],
            column["next_key"],
            table.row_count - 1,
        )
    found = segment_of(table, engine.tensor(rows), engine.tensor(steps)[:, None])[:, 0]
    return engine.view(found)


@engine.jit
def rows_holding_loop(
    rows: np.ndarray,
    steps: np.ndarray,
    first_step: np.ndarray,
    length: np.ndarray,
    prev_key: np.ndarray,
    next_key: np.ndarray,
    row_mask: int,
) -> np.ndarray:
    """`rows_holding`, compiled: each step's segment, walking its episode's chain."""
    found = np.empty(rows.shape[0], dtype=np.int64)
    for i in range(rows.shape[0]):
        current, step = rows[i], steps[i]
        while step < first_step[current]:
            current = prev_key[current] & row_mask
        while step >= first_step[current] + length[current]:
            current = next_key[current] & row_mask
        found[i] = current
    return found


def segment_of(table: EpisodeTable, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Row of the segment holding each of ``steps`` ``[B, W]``, walking from ``rows`` ``[B]``.

    ``steps`` are stored steps of the episodes whose segments include ``rows``; each record
    walks its episode's chain of segments from there.
    """
    column = table.arrays
    first_step = engine.tensor(column["first_step"])
    length = engine.tensor(column["length"])
    prev_key, next_key = engine.tensor(column["prev_key"]), engine.tensor(column["next_key"])
    mask = table.row_count - 1
    current = rows[:, None].expand_as(steps).clone()
    while True:
        starts = first_step[current]
        before = steps < starts
        after = steps >= starts + length[current]
        if not bool((before | after).any()):
            return current
        current = torch.where(before, prev_key[current] & mask, current)
        current = torch.where(after, next_key[current] & mask, current)


def _expanded_by_loop(
    table: EpisodeTable,
    anchors: Anchors,
    size: int,
    burn_in: int,
    dilation: int,
    stop_span: int | None,
    into: RecordArrays | None,
    learning: tuple[int, int],
) -> Records:
    """`expand_segments` by `expand_segments_loop` (the same records), on CPU arrays."""
    count = int(anchors.rows.shape[0])
    shape = (count, size)
    rows, exact, runs, run_windows, touched = _scratch(table, shape)
    if into is None:
        steps, record_ids = np.empty(shape, dtype=np.int64), np.empty(shape, dtype=np.int64)
        valid, is_init = np.empty(shape, dtype=np.bool_), np.empty(shape, dtype=np.bool_)
        terminal = np.empty(shape, dtype=np.bool_)
        learning_mask, sequence = _NO_MASK, _NO_SEQUENCE  # not written
    else:
        steps, record_ids, valid = into.steps, into.episode_ids, into.valid
        is_init, terminal = into.is_init, into.terminal
        learning_mask, sequence = into.learning, into.sequence
    first_offsets = np.empty(count, dtype=np.int64)
    owners, column = table.owners(), table.arrays
    # With `into` the batch is on the storage's CPU and the compiled gather copies the
    # listed runs (dilation 1): each record's segment and run flag are then not needed.
    per_record = into is None or dilation != 1
    expand_segments_loop(
        np.ascontiguousarray(anchors.rows),
        np.ascontiguousarray(anchors.steps),
        np.ascontiguousarray(anchors.episode_ids),
        burn_in,
        dilation,
        -1 if stop_span is None else stop_span,
        table.row_count - 1,
        column["first_step"],
        column["length"],
        column["prev_key"],
        column["next_key"],
        column["base"],
        owners.slot,
        owners.total,
        owners.first_stored,
        owners.opened,
        owners.terminated,
        steps,
        rows,
        record_ids,
        valid,
        exact,
        is_init,
        terminal,
        first_offsets,
        runs,
        run_windows,
        touched,
        learning_mask,
        sequence,
        *learning,
        per_record,
    )
    record_rows: np.ndarray = rows
    run_flags: np.ndarray | None = exact
    if not per_record:  # the run list is the gather's only input: no per-record entries
        record_rows, run_flags = np.ascontiguousarray(anchors.rows)[:, None], None
    return Records(
        first_offsets=first_offsets,
        rows=record_rows,
        episode_ids=record_ids,
        steps=steps,
        valid=valid,
        is_init=is_init,
        terminal=terminal,
        clamped=True,
        filled=into is not None,
        exact=run_flags,
        runs=None if dilation != 1 else (runs, run_windows, int(run_windows[-1])),
    )


_Scratch = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_NO_MASK = np.empty((0, 0), dtype=np.bool_)  # the loop's optional outputs, absent
_NO_SEQUENCE = np.empty((0, 0), dtype=np.int64)


def _scratch(table: EpisodeTable, shape: tuple[int, int]) -> _Scratch:
    """Record rows, run flags and the run list of ``shape`` records, kept on ``table``.

    Kept for the next draw of that shape: they live only until the gather of the draw that
    asked (under the buffer's lock); new arrays of a batch's size (~0.2 MB) would be fresh
    pages from the OS at every draw. The run list has room for a run per record; its
    windows' last entry holds the run count. The last array is the loop's sink for loads
    it makes only to have them in cache.
    """
    kept: dict[tuple[int, int], _Scratch] = table.__dict__.setdefault("_seam_scratch", {})
    if shape not in kept:
        if len(kept) >= 4:
            kept.clear()
        records = shape[0] * shape[1]
        kept[shape] = (
            np.empty(shape, dtype=np.int64),
            np.empty(shape, dtype=np.bool_),
            np.empty((4, records), dtype=np.int64),
            np.empty(records + 1, dtype=np.int64),
            np.empty(1, dtype=np.int64),
        )
    return kept[shape]


@engine.jit
def expand_segments_loop(
    anchor_rows: np.ndarray,
    anchor_steps: np.ndarray,
    episode_ids: np.ndarray,
    burn_in: int,
    dilation: int,
    stop_span: int,
    row_mask: int,
    first_step: np.ndarray,
    length: np.ndarray,
    prev_key: np.ndarray,
    next_key: np.ndarray,
    base: np.ndarray,
    slot: np.ndarray,
    total: np.ndarray,
    first_stored: np.ndarray,
    opened: np.ndarray,
    terminated: np.ndarray,
    steps: np.ndarray,
    rows: np.ndarray,
    record_ids: np.ndarray,
    valid: np.ndarray,
    exact: np.ndarray,
    is_init: np.ndarray,
    terminal: np.ndarray,
    first_offsets: np.ndarray,
    runs: np.ndarray,
    run_windows: np.ndarray,
    touched: np.ndarray,
    learning: np.ndarray,
    sequence: np.ndarray,
    learning_first: int,
    learning_end: int,
    per_record: bool,
) -> None:
    """`expand_segments`, compiled: the same records, one window at a time.

    A window's records target rising steps, so each record's segment is found by walking
    on from the previous record's (from the anchor's for the first), never back and forth.
    ``stop_span`` is -1 unless the boundary is ``stop``.

    Also lists each window's records as runs for the gather (`ring_copies.copy_runs`):
    columns of ``runs`` (global offset, first record, end record, kind 1: consecutive
    steps of segments committed back to back, kind 0: records clamped to one step), their window in
    ``run_windows``, and the run count in ``run_windows[-1]``. Only consecutive steps
    (``dilation == 1``) make runs longer than one record; the caller uses the list then.
    ``learning`` and ``sequence`` (unless they have no rows) receive the window's learning
    mask (records ``learning_first .. learning_end - 1``) and record index. Without
    ``per_record`` (the caller gathers by the run list) ``rows`` and ``exact`` are not
    written.
    """
    constants = learning.shape[0] > 0
    size, windows = steps.shape[1], anchor_rows.shape[0]
    count = 0
    # The windows' table and directory entries first, in a loop of independent loads: the
    # memory misses of a cold table overlap there, not one window after another below.
    firsts, lasts = np.empty(windows, dtype=np.int64), np.empty(windows, dtype=np.int64)
    ends, bases = np.empty(windows, dtype=np.bool_), np.empty(windows, dtype=np.int64)
    for b in range(windows):
        row = anchor_rows[b]
        owner = slot[row]
        firsts[b], lasts[b] = first_stored[owner], total[owner] - 1
        ends[b] = terminated[owner] and not opened[owner]
        bases[b] = base[row]
    # Then the segments beside the anchor's that a window reaches into, in another loop of
    # independent loads, so that the walks below find them in cache. What it reads ends in
    # `touched`, an output, so that the compiler keeps the loads.
    reach_before, reach_after = burn_in * dilation, (size - 1 - burn_in) * dilation
    sum_loaded = 0
    for b in range(windows):
        row, anchor = anchor_rows[b], anchor_steps[b]
        low = first_step[row]
        high = low + length[row]
        if anchor - reach_before < low and firsts[b] < low:
            near = prev_key[row] & row_mask
            sum_loaded += first_step[near] + length[near] + base[near]
        if anchor + reach_after >= high and lasts[b] >= high:
            near = next_key[row] & row_mask
            sum_loaded += first_step[near] + length[near] + base[near]
    touched[0] = sum_loaded
    for b in range(windows):
        row = anchor_rows[b]
        first, last, ended = firsts[b], lasts[b], ends[b]
        anchor = anchor_steps[b]
        if stop_span >= 0:
            overrun = max(stop_span - (last - anchor), 0)
            anchor -= min(overrun, anchor - first)
        first_target = anchor - burn_in * dilation
        first_offsets[b] = bases[b] + first_target
        # Records first_valid .. final_valid target stored steps (as in `expand_loop`).
        first_valid = max(0, -((first_target - first) // dilation))
        final_valid = min(size - 1, (last - first_target) // dilation)
        episode = episode_ids[b]
        for k in range(size):  # one pass without branches across records
            step = min(max(first_target + k * dilation, first), last)
            steps[b, k] = step
            valid[b, k] = first_valid <= k <= final_valid
            is_init[b, k] = k == first_valid
            terminal[b, k] = ended and step == last
            record_ids[b, k] = episode
        if constants:  # a pass of its own: tested in the pass above, the loop ran ~5% longer
            for k in range(size):
                learning[b, k] = learning_first <= k < learning_end
                sequence[b, k] = k
        if dilation == 1:  # the window's runs, walking its segments' bounds
            # Inline, not a call: a compiled call passing seven arrays cost about 0.1 us a
            # window. Records clamped before the episode repeat its first stored step (kind
            # 0), valid ones are consecutive steps of segments committed back to back (kind
            # 1: a new run at each seam into a segment stored elsewhere in the ring), records
            # clamped after it repeat its last step (kind 0). Segments are found by walking
            # the episode's chain from the anchor's row: a few hops, no per-record work.
            bounds = (0, first_valid, final_valid + 1, size)
            current = row
            for part in range(3):
                begin, end = bounds[part], bounds[part + 1]
                while begin < end:
                    step = first if part == 0 else (last if part == 2 else first_target + begin)
                    while step < first_step[current]:
                        current = prev_key[current] & row_mask
                    while step >= first_step[current] + length[current]:
                        current = next_key[current] & row_mask
                    stop = end
                    if part == 1:  # to the end of this segment or of those back to back
                        high = first_step[current] + length[current]
                        while high - first_target < end:
                            following = next_key[current] & row_mask
                            if base[following] != base[current]:
                                break
                            current = following
                            high = first_step[current] + length[current]
                        stop = min(end, high - first_target)
                    runs[0, count], runs[1, count] = base[current] + step, begin
                    runs[2, count], runs[3, count] = stop, 1 if part == 1 else 0
                    run_windows[count] = b
                    count += 1
                    begin = stop
            if not per_record:
                continue
        # Then each record's segment: steps rise with k, so the walk only moves forward
        # once it reached the first record's segment.
        current, run_base = row, base[row]
        while steps[b, 0] < first_step[current]:
            current = prev_key[current] & row_mask
        high = first_step[current] + length[current]
        same = base[current] == run_base
        for k in range(size):
            step = steps[b, k]
            if step >= high:
                while step >= high:
                    current = next_key[current] & row_mask
                    high = first_step[current] + length[current]
                same = base[current] == run_base
            rows[b, k] = current
            exact[b, k] = same and first_valid <= k <= final_valid
    run_windows[run_windows.shape[0] - 1] = count
