"""Windows listed as runs: blocks where they lie in place, large fields by ``index_select``.

The copies of `lucid_replay.listed_copies` must give the batch the single compiled call
gives, byte for byte, as blocks and as runs, with one thread and two, and leave alone the
rows of a call that lists only some of them. The compiled copies themselves (listed runs and
whole blocks) read what numpy reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from segmented_buffers import stream_interleaved

from lucid_replay import Episode, SequenceReplay, Window, engine, openmp_team, seams

pytest.importorskip("numba", reason="the listed runs are the compiled path's")
listed_copies = pytest.importorskip("lucid_replay.listed_copies")

WINDOW = Window(24, burn_in=8, bootstrap=2)  # 34 records of 256 B: index_select's size


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _interleaved(rng: np.random.Generator) -> SequenceReplay:
    """Eight episodes streamed at once in random pieces (seams every 16 steps), heads evicted."""
    buffer = SequenceReplay(capacity=2000, segment_length=16)

    def obs(serial: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(len(serial), 64, generator=torch.Generator().manual_seed(len(serial)))
        return noise + serial[:, None]

    options = {"streams": 8, "rounds": 400, "max_piece": 12, "serial_base": 10_000}
    streams = stream_interleaved(buffer, rng, obs=obs, **options)
    for which in range(0, 8, 2):
        streams[which].close(terminated=True)
    return buffer


def test_listed_slots_are_each_records_ring_slot():
    runs = np.array(
        [
            [105, 107, 108, 100],  # global offsets: slots 5, 7, 8, 0 (base 100, capacity 10)
            [0, 3, 0, 0],  # first record
            [3, 6, 4, 2],  # end record
            [1, 0, 1, 1],  # kind: consecutive, repeated, consecutive across the end, ...
        ],
        dtype=np.int64,
    )
    windows = np.array([0, 0, 1, 2], dtype=np.int64)
    slots = np.full(3 * 6, -1, dtype=np.int64)
    listed_copies.listed_slots(runs, windows, 4, 6, 10, 100, slots)
    expected = np.full(18, -1)
    expected[0:3] = [5, 6, 7]
    expected[3:6] = [7, 7, 7]
    expected[6:10] = [8, 9, 0, 1]
    expected[12:14] = [0, 1]
    assert slots.tolist() == expected.tolist()
    runs[0, 0] = 99  # below the oldest lap
    with pytest.raises(IndexError, match="outside the stored range"):
        listed_copies.listed_slots(runs, windows, 4, 6, 10, 100, slots)


_TEAM = openmp_team.threads(2) is not None  # torch runs on an OpenMP team here


@pytest.mark.skipif(not engine.available(), reason="needs numba")
@pytest.mark.parametrize(
    "team",
    [
        pytest.param(True, marks=pytest.mark.skipif(not _TEAM, reason="no OpenMP team")),
        False,
    ],
    ids=["openmp-team", "index_select"],
)
def test_two_threads_gather_the_one_thread_batch_and_the_contiguous_windows(monkeypatch, team):
    buffer = _interleaved(np.random.default_rng(3))
    ids = buffer.episode_ids
    infos = [buffer.episode_info(i) for i in ids]
    assert buffer.stats()["segments_evicted"] > 0 and max(i.num_segments for i in infos) > 4
    rng = np.random.default_rng(0)
    picks = rng.integers(len(ids), size=200)
    episodes = [ids[p] for p in picks]
    steps = [infos[p].first_step + int(rng.integers(infos[p].stored_length)) for p in picks]
    slot_calls, team_calls = [], []
    real_slots, real_run = listed_copies.listed_slots, openmp_team.run
    monkeypatch.setattr(
        listed_copies, "listed_slots", lambda *a: slot_calls.append(1) or real_slots(*a)
    )
    monkeypatch.setattr(openmp_team, "run", lambda *a: team_calls.append(a[2]) or real_run(*a))
    if not team:  # torch without an OpenMP team: index_select splits the large field's copy
        monkeypatch.setattr(openmp_team, "threads", lambda wanted: None)
    with _threads(1):
        one = buffer.gather_windows(episodes, steps, WINDOW)
    assert not slot_calls and not team_calls  # one thread: the single compiled call
    with _threads(2):
        two = buffer.gather_windows(episodes, steps, WINDOW)
    if team:  # every field's runs on the team's two threads
        assert team_calls == [2] and not slot_calls
    else:
        assert slot_calls and not team_calls
    for name in ("serial", "obs"):
        assert torch.equal(one[name], two[name]), name
    for p in sorted(set(picks.tolist())):  # and what the steps stored contiguously give
        whole = SequenceReplay(capacity=4000)
        whole.add(Episode(buffer[ids[p]].steps, terminated=infos[p].terminated))
        rows = np.flatnonzero(picks == p)
        local = [steps[r] - infos[p].first_step for r in rows]
        theirs = whole.gather_windows([0] * len(rows), local, WINDOW)
        for name in ("serial", "obs"):
            assert torch.equal(two[name][torch.from_numpy(rows)], theirs[name]), name


def test_a_call_listing_some_rows_leaves_the_others_alone():
    """A sharded client's piece covers only its shard's rows: the single call copies it."""
    store = torch.arange(40 * 64, dtype=torch.float32).view(40, 64)
    fields = {"obs": store}
    addresses = np.array([store.data_ptr()], dtype=np.int64)
    row_bytes = np.array([256], dtype=np.int64)
    split = (np.empty(0, dtype=np.int64), ("obs",))  # what two threads would choose
    out = {"obs": torch.full((3, 20, 64), -1.0)}
    runs = np.array([[3], [0], [20], [1]], dtype=np.int64)  # window 1 only: slots 3..22
    listed = (runs, np.array([1], dtype=np.int64), 1)
    listed_copies.copy_listed(fields, addresses, row_bytes, split, out, 20, listed, 40, 0)
    assert torch.equal(out["obs"][1], store[3:23])
    assert bool((out["obs"][[0, 2]] == -1).all())


def test_block_plan_reads_each_window_in_place_from_its_longest_run_and_leaves_the_rest():
    capacity, size, base = 20, 6, 100  # slot = offset - 100; a block must start at 0..14
    listed = [  # (offset, first record, end record, kind), window
        ((102, 0, 6, 1), 0),  # one run in place: block at slot 2, nothing left
        ((110, 0, 2, 0), 1),  # a clamped head (step 10 repeated), then steps 10.. from record 2
        ((110, 2, 6, 1), 1),
        ((117, 0, 3, 1), 2),  # slots 17-19 then 0-2: a block would cross the ring's end
        ((120, 3, 6, 1), 2),
        ((105, 0, 6, 0), 3),  # one step repeated: nothing to read in place
        ((101, 0, 2, 1), 4),  # across a seam into a segment stored elsewhere: the longer run
        ((111, 2, 6, 1), 4),
        ((100, 3, 6, 1), 5),  # its block would start before slot 0
    ]  # window 6: no runs in this call
    runs = np.ascontiguousarray(np.array([run for run, _ in listed], dtype=np.int64).T)
    windows = np.array([window for _, window in listed], dtype=np.int64)
    slots = np.full(7, 99, dtype=np.int64)
    planned = (runs, windows, len(listed)), size, capacity, base, slots
    assert listed_copies.block_plan(*planned) == (2 + 3 + 3 + 6 + 2 + 3, 6 * 5 + 3)
    assert slots.tolist() == [2, 8, -1, -1, 9, -1, -1]
    left = np.full((4, len(listed)), -7, dtype=np.int64), np.full(len(listed), -7)
    kept = [1, 3, 4, 5, 6, 8]  # every run but those in place in their window's block, in order
    assert listed_copies.runs_left(planned[0], capacity, base, slots, left) == len(kept)
    assert left[0][:, :6].tolist() == runs[:, kept].tolist()
    assert left[1][:6].tolist() == windows[kept].tolist()
    for run in (0, 5):  # a run below the oldest lap, of either kind: refused
        runs[0, run] = 99
        with pytest.raises(IndexError, match="outside the stored range"):
            listed_copies.block_plan(*planned)
        runs[0, run] = listed[run][0][0]


def _added(rng: np.random.Generator) -> SequenceReplay:
    """Episodes stored by ``add`` in segments of 16 steps, the ring lapped twice."""
    buffer = SequenceReplay(capacity=3000, segment_length=16)
    for _ in range(45):
        length = int(rng.integers(40, 200))
        steps = {
            "obs": torch.from_numpy(rng.standard_normal((length, 64), dtype=np.float32)),
            "action": torch.from_numpy(rng.integers(0, 1 << 40, length)),
            "reward": torch.from_numpy(rng.standard_normal(length, dtype=np.float32)),
            "flag": torch.from_numpy(rng.integers(0, 2, length).astype(bool)),
        }
        buffer.add(Episode(steps, terminated=bool(rng.integers(2))))
    return buffer


@pytest.mark.skipif(not engine.available(), reason="needs numba")
@pytest.mark.parametrize(
    ("threads", "team"),
    [
        (1, False),
        pytest.param(2, True, marks=pytest.mark.skipif(not _TEAM, reason="no OpenMP team")),
        (2, False),
    ],
    ids=["1", "2-openmp-team", "2-index_select"],
)
def test_windows_in_place_are_copied_as_blocks_and_equal_their_episodes_windows(
    threads, team, monkeypatch
):
    """Every stored step's window of an added episode: clamped at both ends, some across the
    ring's end, the oldest episode's head evicted. Blocks, then the clamped records over
    them, give the windows a buffer holding the steps contiguously gives: on one thread, on
    the OpenMP team's two (blocks, then the runs left), or by ``index_select``."""
    team_kinds = []
    real_on_team = listed_copies._on_team
    monkeypatch.setattr(
        listed_copies, "_on_team", lambda *a: team_kinds.append(int(a[0][1])) or real_on_team(*a)
    )
    if not team:
        monkeypatch.setattr(openmp_team, "threads", lambda wanted: None)
    buffer = _added(np.random.default_rng(1))
    ids = buffer.episode_ids
    infos = [buffer.episode_info(i) for i in ids]
    assert buffer.stats()["segments_evicted"] > 0 and infos[0].first_step > 0
    episodes = [i for i, info in zip(ids, infos, strict=True) for _ in range(info.stored_length)]
    steps = [info.first_step + k for info in infos for k in range(info.stored_length)]
    plans = []
    real = listed_copies.block_plan

    def spy(*args):
        plans.append((real(*args), args[4].copy()))
        return plans[-1][0]

    monkeypatch.setattr(listed_copies, "block_plan", spy)
    with _threads(threads):
        batch = buffer.gather_windows(episodes, steps, WINDOW)
    ((left_records, records), slots) = plans[-1]
    assert records == len(steps) * WINDOW.size and 0 < 4 * left_records < records  # blocks,
    assert (slots >= 0).mean() > 0.9 and (slots == -1).any()  # and runs over them
    runs, blocks = listed_copies._RUNS, listed_copies._BLOCKS
    assert team_kinds == ([blocks, runs] if team and threads > 1 else [])
    at = 0
    for episode, info in zip(ids, infos, strict=True):
        whole = SequenceReplay(capacity=4000)
        whole.add(Episode(buffer[episode].steps, terminated=info.terminated))
        theirs = whole.gather_windows([0] * info.stored_length, range(info.stored_length), WINDOW)
        for name in ("obs", "action", "reward", "flag"):
            assert torch.equal(batch[name][at : at + info.stored_length], theirs[name]), name
        at += info.stored_length


@pytest.mark.skipif(not engine.available(), reason="needs numba")
@pytest.mark.parametrize("threads", [1, 2])
def test_windows_longer_than_the_ring_are_copied_as_runs(threads):
    """No block of 69 records fits a ring of 64: every window is copied run by run."""
    steps = {"obs": torch.randn(60, 64, generator=torch.Generator().manual_seed(0))}
    segmented = SequenceReplay(capacity=64, segment_length=16)
    whole = SequenceReplay(capacity=64)
    for buffer in (segmented, whole):
        buffer.add(Episode(steps))
    window = Window(24, burn_in=40, bootstrap=5)
    with _threads(threads):
        ours = segmented.gather_windows([0, 0, 0], [0, 30, 59], window)
        theirs = whole.gather_windows([0, 0, 0], [0, 30, 59], window)
    assert torch.equal(ours["obs"], theirs["obs"])


@pytest.mark.skipif(not engine.available(), reason="needs numba")
def test_segments_committed_back_to_back_are_listed_as_one_run_and_interleaved_ones_split():
    """A window across seams of an episode stored by ``add`` reads one run, as on a
    whole-episode buffer; across seams into segments stored elsewhere, a run per segment."""
    adjacent = SequenceReplay(capacity=4000, segment_length=16)
    adjacent.add(Episode({"obs": torch.arange(200.0)}))
    interleaved = SequenceReplay(capacity=4000, segment_length=16)
    streams = [interleaved.open_episode() for _ in range(2)]
    for piece in range(0, 200, 16):  # the two streams' segments alternate in the ring
        for stream in streams:
            stream.append({"obs": torch.arange(piece, piece + 16.0)})
    for stream in streams:
        stream.close(terminated=True)
    anchors = torch.arange(20, 170, 10)  # windows of 34 records: two or three seams each
    for buffer, runs_per_window in ((adjacent, 1), (interleaved, None)):
        store = buffer._core.store
        first_id = buffer.episode_ids[0]
        found = store.anchors(torch.full_like(anchors, first_id), anchors)
        records = seams.expand_segments(store.table, found, WINDOW.size, 8, 1, None)
        assert records.runs is not None
        listed, windows, count = records.runs
        per_window = np.bincount(windows[:count], minlength=len(anchors))
        if runs_per_window is not None:
            assert per_window.tolist() == [1] * len(anchors)
            assert listed[3, :count].tolist() == [1] * count  # consecutive steps, no clamps
        else:  # a run from each segment the window reads
            reads = (anchors[:, None] + torch.arange(-8, 26)) // 16
            assert per_window.tolist() == [len(set(r.tolist())) for r in reads]
        batch = buffer.gather_windows(torch.full_like(anchors, first_id), anchors, WINDOW)
        expected = (anchors[:, None] + torch.arange(-8, 26)).float()
        assert torch.equal(batch["obs"], expected)


def _claimed(kind, targets, sources, row_bytes, size, work, threads):
    """`copy_claimed` of ``work`` on this thread alone, or on ``threads`` of the team; returns
    its arguments, whose first word counts the claims made."""
    plan = kind, (targets, sources, row_bytes), size, work, 50, 1000  # capacity, base
    arguments = listed_copies._team_arguments(*plan)
    if threads == 1:
        listed_copies.copy_claimed(arguments.ctypes.data)
    else:
        openmp_team.run(listed_copies._team_copy_function(), arguments.ctypes.data, threads)
    return arguments


@pytest.mark.skipif(not engine.available(), reason="needs numba")
@pytest.mark.parametrize("count", [1, 15, 16, 17, 40])
def test_the_kernels_copy_the_records_numpy_reads_for_small_and_large_fields(count):
    """`copy_runs` and `copy_blocks` against numpy, with runs of both kinds, runs across the
    ring's end, and fields small and large (a small field's blocks are prefetched whole,
    16 runs ahead; a large one's first line, 4 ahead): fewer runs than either distance,
    and more."""
    from lucid_replay import ring_copies

    rng = np.random.default_rng(count)
    capacity, size, base = 50, 12, 1000  # base: the offset of slot 0 in the oldest lap
    widths = {"flag": 1, "reward": 4, "action": 8, "obs": 512}  # 12 x 512 B > 4 kB: large
    ring = {
        name: rng.integers(0, 256, (capacity, width), dtype=np.uint8)
        for name, width in widths.items()
    }
    sources = np.array([a.ctypes.data for a in ring.values()], dtype=np.int64)
    row_bytes = np.array(list(widths.values()), dtype=np.int64)

    # Listed runs: window r % count gets run r; each window's runs tile its records.
    runs, windows, expected_slots = [], [], np.zeros((count, size), dtype=np.int64)
    for b in range(count):
        cut = int(rng.integers(1, size))
        for begin, end in ((0, cut), (cut, size)):
            slot, kind = int(rng.integers(0, capacity)), int(rng.integers(0, 2))
            runs.append((base + slot, begin, end, kind))
            windows.append(b)
            steps = np.arange(end - begin) if kind == 1 else np.zeros(end - begin, dtype=np.int64)
            expected_slots[b, begin:end] = (slot + steps) % capacity
    listed = np.ascontiguousarray(np.array(runs, dtype=np.int64).T)
    out = {name: np.zeros((count, size, w), dtype=np.uint8) for name, w in widths.items()}
    targets = np.array([a.ctypes.data for a in out.values()], dtype=np.int64)
    ring_copies.copy_runs(
        targets, sources, row_bytes, size, listed, np.array(windows), len(runs), capacity, base
    )
    for name in widths:
        assert np.array_equal(out[name], ring[name][expected_slots]), name

    # The team's copy of the same runs, on one thread (every chunk claimed inline) and on
    # the team's two: each thread claims until a claim finds no runs left, so the counter
    # ends at the chunk count plus the threads that ran.
    for threads in (1, 2) if _TEAM else (1,):
        claimed = {name: np.zeros((count, size, w), dtype=np.uint8) for name, w in widths.items()}
        targets = np.array([a.ctypes.data for a in claimed.values()], dtype=np.int64)
        work = (listed, np.array(windows), len(runs))
        arguments = _claimed(listed_copies._RUNS, targets, sources, row_bytes, size, work, threads)
        for name in widths:
            assert np.array_equal(claimed[name], ring[name][expected_slots]), (name, threads)
        assert arguments[0] == -(-len(runs) // listed_copies._RUN_CHUNK) + threads

    slots = rng.integers(0, capacity - size + 1, count)  # whole blocks inside the ring
    slots[::3] = -1  # no block: the row is left as it is
    blocks = {name: np.zeros((count, size, w), dtype=np.uint8) for name, w in widths.items()}
    targets = np.array([a.ctypes.data for a in blocks.values()], dtype=np.int64)
    ring_copies.copy_blocks(targets, sources, row_bytes, slots, size, capacity)
    for name in widths:
        expected = ring[name][slots[:, None] + np.arange(size)]
        expected[::3] = 0
        assert np.array_equal(blocks[name], expected), name
    for threads in (1, 2) if _TEAM else (1,):  # the team's copy of the same blocks
        claimed = {name: np.zeros((count, size, w), dtype=np.uint8) for name, w in widths.items()}
        targets = np.array([a.ctypes.data for a in claimed.values()], dtype=np.int64)
        work = (slots[None], slots, count)
        arguments = _claimed(
            listed_copies._BLOCKS, targets, sources, row_bytes, size, work, threads
        )
        for name in widths:
            assert np.array_equal(claimed[name], blocks[name]), (name, threads)
        assert arguments[0] == -(-count // listed_copies._BLOCK_CHUNK) + threads
        targets = np.array([a.ctypes.data for a in blocks.values()], dtype=np.int64)
    for bad in (-2, capacity - size + 1):  # a block outside the ring: refused, nothing copied
        for values in blocks.values():
            values[:] = 0
        slots[-1] = bad
        with pytest.raises(IndexError, match="outside the ring"):
            ring_copies.copy_blocks(targets, sources, row_bytes, slots, size, capacity)
        assert not any(values.any() for values in blocks.values())
