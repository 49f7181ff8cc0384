"""Rows of streamed segments: windows across seams, ``append``, and an endless stream's memory.

A whole-episode buffer and a segmented one (``segment_length = L``) are filled with the same
reference episodes; ``add`` stores each as ``ceil(T / L)`` segments, so an episode longer than
``L`` has a seam at every multiple of ``L``. The seam rows gather the same windows, chosen to
cross a seam, from both. The append rows then stream into the segmented buffer, full and
evicting, beside a copy of the same bytes into ring memory. The memory row streams
``stream_capacities`` times ``capacity`` steps through a fresh segmented buffer and reads the
process's resident memory as it goes.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from benchmarks.config import Config
from benchmarks.data import Dataset
from benchmarks.floor import RingCopy
from benchmarks.lucid_rows import build, reference_window
from benchmarks.rows import Only, Row, release
from benchmarks.timing import measure_rounds
from lucid_replay import PrioritizedSequenceReplay, Window

ANCHOR_SETS = 64  # prepared anchor sets, cycled (as the floor's window sets)
INTERLEAVED_STREAMS = 16  # episodes streamed at once into the interleaved buffer
INTERLEAVED_PIECE = 64  # steps per append there
OTHER_EVERY = 8  # the memory row opens, fills and closes another stream every 8 appends


def segment_rows(config: Config, dataset: Dataset, only: Only) -> list[Row]:
    """The seam rows and the append rows (one pair of buffers), then the memory row."""
    rows: list[Row] = []
    if only("segments.gather") or only("segments.uniform") or only("segments.append"):
        segmented = build(config, dataset, segment_length=config.segment_length)
        if only("segments.gather") or only("segments.uniform"):
            whole = build(config, dataset)
            interleaved = build_interleaved(config, dataset)
            buffers = (whole, segmented, interleaved)
            rows += [r for r in seam_rows(config, dataset, *buffers) if only(r.id)]
            del whole, interleaved, buffers
            release()
        if only("segments.append"):
            rows += append_rows(config, segmented, dataset)
        del segmented
        release()
    if only("segments.memory"):
        rows.append(stream_memory_row(config, dataset))
    return rows


# ------------------------------------------------------------------------------- seams
def build_interleaved(config: Config, dataset: Dataset) -> PrioritizedSequenceReplay:
    """The reference episodes streamed ``INTERLEAVED_STREAMS`` at a time, round robin, in
    pieces of ``INTERLEAVED_PIECE`` steps: as many actors' streams commit them, no two
    segments of an episode are adjacent in the ring (their records cannot be read as one
    run). Episodes are opened in data set order, so ids match `build`'s."""
    buffer = PrioritizedSequenceReplay(
        config.transitions,
        alpha=config.alpha,
        beta=config.beta,
        seed=config.seed,
        segment_length=config.segment_length,
    )
    waiting = iter(range(len(dataset.lengths)))
    open_streams: list[tuple[Any, int, int]] = []  # (stream, episode index, next step)
    while True:
        while len(open_streams) < INTERLEAVED_STREAMS:
            index = next(waiting, None)
            if index is None:
                break
            open_streams.append((buffer.open_episode(), index, 0))
        if not open_streams:
            return buffer
        stream, index, step = open_streams.pop(0)
        steps, terminated = dataset.episode(index)
        end = min(step + INTERLEAVED_PIECE, dataset.lengths[index])
        stream.append({name: values[step:end] for name, values in steps.items()})
        if end == dataset.lengths[index]:
            stream.close(terminated=terminated)
        else:
            open_streams.append((stream, index, end))


def seam_anchors(
    config: Config,
    dataset: Dataset,
    whole: PrioritizedSequenceReplay,
    *segmented: PrioritizedSequenceReplay,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``ANCHOR_SETS`` sets of ``batch`` (episode ids, anchor steps) whose windows cross a
    seam of ``segmented``, in episodes stored whole in both buffers.

    A window of anchor ``a`` reads steps ``a - burn_in * dilation`` to ``a + (W - 1 -
    burn_in) * dilation``; it crosses the seam at step ``s`` (a multiple of ``L`` inside the
    episode) when the first is before ``s`` and the last at or after it. Each anchor picks a
    seam uniformly among all stored seams, then an anchor uniformly among those crossing it.
    """
    size, length = config.window_size, config.segment_length
    before, after = config.burn_in * config.dilation, (size - 1 - config.burn_in) * config.dilation
    candidates = []  # (episode id, seam step, episode length)
    for episode_id, steps in enumerate(dataset.lengths):
        if episode_id not in whole or any(episode_id not in buffer for buffer in segmented):
            continue
        infos = [buffer.episode_info(episode_id) for buffer in segmented]
        if all(info.first_step == 0 and info.stored_length == steps for info in infos):
            candidates += [(episode_id, seam, steps) for seam in range(length, steps, length)]
    if not candidates or before + after == 0:
        raise ValueError("no stored window crosses a seam: episodes must exceed segment_length")
    table = np.array(candidates, dtype=np.int64)
    rng = np.random.default_rng(config.seed + 11)
    sets = []
    for _ in range(ANCHOR_SETS):
        episode_id, seam, steps = table[rng.integers(0, len(table), config.batch)].T
        low = np.maximum(seam - after, 0)
        high = np.minimum(seam + before - 1, steps - 1)
        anchors = low + (rng.random(config.batch) * (high - low + 1)).astype(np.int64)
        sets.append((torch.from_numpy(episode_id.copy()), torch.from_numpy(anchors)))
    return sets


def _outside_share(
    config: Config, dataset: Dataset, sets: list[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    """Share of the records of ``sets`` that are valid and outside their anchor's segment
    (episodes stored from step 0): those a segmented buffer gathers one by one."""
    offset = (torch.arange(config.window_size) - config.burn_in) * config.dilation
    lengths = torch.tensor(dataset.lengths)
    outside = 0
    for episode_ids, anchors in sets:
        targets = anchors[:, None] + offset
        valid = (targets >= 0) & (targets < lengths[episode_ids][:, None])
        moved = targets // config.segment_length != anchors[:, None] // config.segment_length
        outside += int((valid & moved).sum())
    return outside / (len(sets) * config.batch * config.window_size)


def _same_windows(
    whole: PrioritizedSequenceReplay,
    segmented: PrioritizedSequenceReplay,
    anchors: tuple[torch.Tensor, torch.Tensor],
    window: Window,
) -> bool:
    a, b = whole.gather_windows(*anchors, window), segmented.gather_windows(*anchors, window)
    masks = ("validity_mask", "is_init", "terminal", "record_steps")
    return all(torch.equal(a.data[k], b.data[k]) for k in a.data) and all(
        torch.equal(getattr(a, k), getattr(b, k)) for k in masks
    )


def seam_rows(
    config: Config,
    dataset: Dataset,
    whole: PrioritizedSequenceReplay,
    segmented: PrioritizedSequenceReplay,
    interleaved: PrioritizedSequenceReplay,
) -> list[Row]:
    """``gather_windows`` of the same seam-crossing windows on the three buffers, and
    uniform ``sample_windows`` on two, all timed in rounds of one call each.

    ``segmented`` was filled by ``add`` (an episode's segments lie back to back, so its
    windows read as runs across seams); ``interleaved`` by interleaved streams (they do
    not: records past a seam are read one by one). The gathers cycle through the same
    ``ANCHOR_SETS`` anchor sets, so each call reads windows no recent call read, as the
    cold floor does.
    """
    window = reference_window(config)
    sets = seam_anchors(config, dataset, whole, segmented, interleaved)
    same = _same_windows(whole, segmented, sets[0], window) and _same_windows(
        whole, interleaved, sets[0], window
    )
    on_whole, on_segmented = itertools.cycle(sets), itertools.cycle(sets)
    on_interleaved = itertools.cycle(sets)
    batch = config.batch
    gathers: dict[str, Callable[[], object]] = {
        "segments.gather": lambda: interleaved.gather_windows(*next(on_interleaved), window),
        "segments.gather.adjacent": lambda: segmented.gather_windows(*next(on_segmented), window),
        "segments.gather.whole": lambda: whole.gather_windows(*next(on_whole), window),
    }
    uniform: dict[str, Callable[[], object]] = {
        "segments.uniform": lambda: segmented.sample_windows(batch, window, prioritized=False),
        "segments.uniform.whole": lambda: whole.sample_windows(batch, window, prioritized=False),
    }
    # Two groups of rounds: in one round of all five, a buffer that the uniform rows also
    # draw from would find its table warmer than the interleaved buffer, which they do not.
    # Here each gather's buffer was last read by its own gather, two calls before.
    timings = measure_rounds(gathers, reps=config.reps, warmup=config.warmup)
    timings |= measure_rounds(uniform, reps=config.reps, warmup=config.warmup)
    length, stats = config.segment_length, segmented.stats()
    seams = stats["segments_stored"] - stats["episodes_stored"]
    outside = _outside_share(config, dataset, sets)
    label = f"lucid_replay gather_windows of {batch} windows across a seam"
    extra = {"segment_length": length, "seams": seams, "outside": outside, "same_windows": same}
    return [
        Row.timed(
            "segments.gather",
            f"{label} (L = {length}; {outside:.0%} of their records outside the anchor's "
            f"segment), segmented buffer filled by {INTERLEAVED_STREAMS} interleaved streams"
            + ("" if same else " — **records differ**"),
            timings["segments.gather"],
            group="segments",
            extra=extra,
        ),
        Row.timed(
            "segments.gather.adjacent",
            f"{label}: the same windows, segmented buffer filled by add (an episode's "
            "segments back to back in the ring)",
            timings["segments.gather.adjacent"],
            group="segments",
        ),
        Row.timed(
            "segments.gather.whole",
            f"{label}: the same windows on a whole-episode buffer (same episodes)",
            timings["segments.gather.whole"],
            group="segments",
        ),
        Row.timed(
            "segments.uniform",
            f"lucid_replay uniform sample_windows, segmented buffer (L = {length}, {seams:,} "
            "seams)",
            timings["segments.uniform"],
            group="segments",
        ),
        Row.timed(
            "segments.uniform.whole",
            "lucid_replay uniform sample_windows, whole-episode buffer (same episodes)",
            timings["segments.uniform.whole"],
            group="segments",
        ),
    ]


# ------------------------------------------------------------------------------ append
def _open_steps(dataset: Dataset, begin: int, length: int) -> dict[str, torch.Tensor]:
    """``length`` steps of an episode that goes on: the data set's, with no end flagged."""
    steps = {k: v[begin : begin + length].clone() for k, v in dataset.fields.items()}
    for name in ("done", "terminated", "truncated"):
        steps[name] = torch.zeros(length, dtype=torch.bool)
    return steps


def append_rows(config: Config, buffer: PrioritizedSequenceReplay, dataset: Dataset) -> list[Row]:
    """``stream.append`` of ``L`` steps into the full segmented ``buffer`` (one segment
    committed, about one evicted, a call) beside copying the same bytes into ring memory.

    Timed as the ``add`` rows are (`lucid_rows.add_rows`): in alternating blocks of ten calls,
    ``add_reps`` calls each. Beside them, the same steps appended in four pieces, so three
    calls leave steps pending in the stream and the fourth commits the segment.
    """
    reps, warmup = max(config.add_reps, 50), config.warmup
    length = config.segment_length
    piece = _open_steps(dataset, 12_345, length)
    cuts = [0, length // 4, length // 2, 3 * length // 4, length]
    pieces = [{k: v[a:b] for k, v in piece.items()} for a, b in itertools.pairwise(cuts)]
    stream = buffer.open_episode()
    memcpy_ring = RingCopy(config, piece)

    def append_pieces() -> None:
        for part in pieces:
            stream.append(part)

    paired = measure_rounds(
        {"append": lambda: stream.append(piece), "pieces": append_pieces, "memcpy": memcpy_ring},
        reps=reps,
        warmup=warmup,
        block=10,
    )
    sizes = "/".join(str(b - a) for a, b in itertools.pairwise(cuts))
    return [
        Row.timed(
            "segments.append",
            f"lucid_replay stream.append of {length} steps (L = {length}, full buffer: one "
            "segment committed, the oldest evicted)",
            paired["append"],
            group="segments",
        ),
        Row.timed(
            "segments.append.pieces",
            f"lucid_replay stream.append of the same steps in four pieces ({sizes} steps)",
            paired["pieces"],
            group="segments",
        ),
        memcpy_ring.row("segments.memcpy", paired["memcpy"], group="segments"),
    ]


# ------------------------------------------------------------------------------ memory
def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``, Linux)."""
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pieces(dataset: Dataset) -> Iterator[dict[str, torch.Tensor]]:
    """Endless pieces of the data set's episode lengths, as views at successive offsets."""
    offset, span = 0, dataset.num_transitions
    for length in itertools.cycle(dataset.lengths):
        begin = offset % (span - length)
        yield {k: v[begin : begin + length] for k, v in dataset.fields.items()}
        offset += length


def stream_memory_row(config: Config, dataset: Dataset) -> Row:
    """Resident memory while one stream appends ``stream_capacities x capacity`` steps.

    Pieces have the data set's episode lengths (``min_len`` to ``max_len``), so most appends
    leave steps pending; every ``OTHER_EVERY`` appends another stream opens, appends one
    such piece and closes. The process's resident memory is read (after a garbage
    collection) each time the endless stream has appended another ``capacity`` steps. The
    bar charges its growth from the first reading (the storage written in full) to the last
    to the buffer, against the bytes the buffer held at the first (``memory_usage()``).
    Resident memory before the buffer is made is no baseline: a buffer of the quick
    configuration fits in memory the allocator kept from earlier rows, so the process may
    not grow at all when it is made.
    """
    release()
    capacity = config.transitions
    buffer = PrioritizedSequenceReplay(
        capacity,
        alpha=config.alpha,
        beta=config.beta,
        seed=config.seed,
        segment_length=config.segment_length,
    )
    endless, pieces = buffer.open_episode(), _pieces(dataset)
    readings: list[tuple[int, int]] = []  # (steps the endless stream appended, bytes)
    usage: list[dict[str, int]] = []
    appended, others, began = 0, 0, time.perf_counter()
    for turn in itertools.count(1):
        piece = next(pieces)
        endless.append(piece)
        appended += len(piece["obs"])
        if turn % OTHER_EVERY == 0:
            other = buffer.open_episode()
            other.append(next(pieces))
            other.close(terminated=bool(others % 2))
            others += 1
        if appended >= (len(readings) + 1) * capacity:
            gc.collect()
            readings.append((appended, resident_bytes()))
            usage.append(buffer.memory_usage())
            if len(readings) == config.stream_capacities:
                break
    seconds = time.perf_counter() - began
    stats = buffer.stats()
    (steps_1x, rss_1x), (steps_nx, rss_nx) = readings[0], readings[-1]
    held = sum(usage[0].values())
    largest = max(rss for _, rss in readings)
    table_1x, table_nx = usage[0]["table_bytes"], usage[-1]["table_bytes"]
    note = (
        f"process resident memory {rss_1x / 1e6:.1f} MB after {steps_1x:,} steps, "
        f"{rss_nx / 1e6:.1f} MB after {steps_nx:,} ({config.stream_capacities}x capacity; at "
        f"most {largest / 1e6:.1f} MB between): {(rss_nx - rss_1x) / 1e6:+.2f} MB against "
        f"the buffer's {held / 1e6:.1f} MB, {(rss_nx - rss_1x) / (steps_nx - steps_1x):+.2f} "
        f"B per step appended after 1x; table {table_1x:,} -> {table_nx:,} B; {others:,} other "
        f"streams opened and closed, {stats['segments_stored']:,} segments stored at the end; "
        f"{seconds:.0f} s"
    )
    del endless, buffer
    release()
    return Row(
        "segments.memory",
        f"lucid_replay resident memory over an endless stream of {config.stream_capacities}x "
        f"capacity (L = {config.segment_length})",
        "memory",
        note=note,
        extra={
            "readings": readings,
            "buffer_bytes": held,
            "capacity": capacity,
            "capacities": config.stream_capacities,
            "segment_length": config.segment_length,
            "table_bytes": [u["table_bytes"] for u in usage],
            "seconds": seconds,
        },
    )
