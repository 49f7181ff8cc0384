"""`Recency` on a `ShardedReplay`: replay-wide commit counters (backend="local").

A shard's rows carry the replay-wide count of transitions at their commit, which the control
issues in the report every commit makes anyway. These tests check the counters themselves
(an extend over several shards is one range in list order; concurrent adds get disjoint
ranges; streamed segments get theirs as they commit), that draws over several shards follow
the exact law of those counters (chi-square, probabilities at rtol 1e-12) and reject the
law of shard-local counters, that one shard draws what one buffer draws, and that
checkpoints, restarts and manifests keep the counters. The uneven-shard law tests of every
selector, `Recency` included, are in test_distributed_selectors.py.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import scipy.stats
import torch
from conftest import both_engines, make_episode

from lucid_replay import (
    CheckpointError,
    Episode,
    Mixture,
    Prioritized,
    PrioritizedSequenceReplay,
    Recency,
    Window,
)
from lucid_replay.distributed import ShardedReplay
from lucid_replay.distributed.calls import LocalHandle, get
from lucid_replay.distributed.shards import ReplayShard

ACCEPT = 1e-3
REJECT = 1e-6
WINDOW = Window(3)  # anchor span 3


def _local(num_shards: int, **kwargs: object) -> ShardedReplay:
    options = {"seed": 5, "backend": "local", **kwargs}
    return ShardedReplay.create(num_shards, 4000, **options)


def _rows(replay: ShardedReplay) -> dict[int, list[tuple[int, int]]]:
    """Global episode id -> (commit counter, length) of each of its stored rows, in row order."""
    found: dict[int, list[tuple[int, int]]] = {}
    for handle in replay._shards:
        shard = handle.target
        table = shard.buffer._core.store.table
        keys = np.arange(table.first_id, table.next_id)
        rows = keys & (table.row_count - 1)
        if table.directory is None:
            local = keys
        else:  # a segment's episode: its directory entry
            local = table.directory.arrays["episode_id"][table.arrays["slot"][rows]]
        episodes = shard._global(np.asarray(local, dtype=np.int64))
        for episode, row in zip(episodes.tolist(), rows.tolist(), strict=True):
            commit, length = int(table.commit[row]), int(table.length[row])
            found.setdefault(episode, []).append((commit, length))
    return found


def _counter(replay: ShardedReplay) -> int:
    return int(get(replay._control.state.remote())["committed"])


# ---------------------------------------------------------------------------- counters
def test_an_extend_over_shards_is_one_range_in_list_order():
    """Episodes spread round robin over 4 shards get the counters one buffer gives them:
    the running total of the call's lengths, in list order, after earlier calls."""
    replay = _local(4, selector=Recency(8))
    lengths = [5, 3, 8, 2, 7, 4, 6, 1]
    added = replay.extend(make_episode(n) for n in lengths[:6])
    added += replay.extend(make_episode(n) for n in lengths[6:])
    rows = _rows(replay)
    assert [rows[i] for i in added] == [
        [(int(c), n)] for c, n in zip(np.cumsum(lengths), lengths, strict=True)
    ]
    assert _counter(replay) == sum(lengths)
    with pytest.raises(ValueError, match="other"):  # refused: nothing counted
        replay.extend([make_episode(4), Episode({"other": torch.zeros(3)})])
    assert _counter(replay) == sum(lengths)
    replay.close()


def test_concurrent_adds_take_disjoint_ranges_that_tile_the_count():
    """Four threads extend at once: every call's episodes are consecutive in its range, and
    the rows' ranges (c - length, c] tile [0, total) without gaps or overlaps."""
    replay = _local(3, selector=Recency(50))
    calls: list[tuple[list[int], list[int]]] = []
    lock = threading.Lock()

    def add(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(15):
            lengths = rng.integers(1, 9, size=int(rng.integers(1, 6))).tolist()
            ids = replay.extend(make_episode(n) for n in lengths)
            with lock:
                calls.append((ids, lengths))

    threads = [threading.Thread(target=add, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rows = _rows(replay)
    total = sum(sum(lengths) for _, lengths in calls)
    for ids, lengths in calls:
        commits = [rows[i][0][0] for i in ids]
        assert np.diff(commits).tolist() == lengths[1:]
    spans = sorted((c - n, c) for episode in rows.values() for c, n in episode)
    assert spans[0][0] == 0 and spans[-1][1] == total == _counter(replay)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    replay.close()


def _stream_law(h: float, unit: str, local: bool = False) -> dict:
    """The calls of `_streamed` and the exact law of their segments' counters.

    Segment length 4, three episodes on three shards; ``local``: the law of shard-local
    counters instead (what each shard alone would count), which the draws must reject.
    """
    # (episode, steps committed by the call): A 8 (two segments), B 4, C 12, then the
    # closes: B's last step, A's last 3 steps.
    commits = [("a", 4), ("a", 4), ("b", 4), ("c", 4), ("c", 4), ("c", 4), ("b", 1), ("a", 3)]
    counters: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    count: dict[str, int] = {}
    for episode, n in commits:
        key = episode if local else "all"
        count[key] = count.get(key, 0) + n
        counters[episode].append(count[key])
    totals = {"a": 11, "b": 5, "c": 12}
    mass: dict[tuple[str, int], float] = {}
    for episode, total in totals.items():
        anchors = range(total - WINDOW.anchor_span + 1)
        for t in anchors:
            c = counters[episode][-1] if unit == "episode" else counters[episode][t // 4]
            mass[episode, t] = 2.0 ** ((c - 28) / h) / (len(anchors) if unit == "episode" else 1)
    z = sum(mass.values())
    return {cell: m / z for cell, m in mass.items()}


def _streamed(replay) -> dict[int, str]:
    """Three streams, interleaved: the calls `_stream_law` lists, in its order."""
    a, b, c = (replay.open_episode() for _ in range(3))
    a.append(make_episode(8, first_serial=1000).steps)
    b.append(make_episode(5, first_serial=2000).steps)
    c.append(make_episode(12, first_serial=3000).steps)
    a.append(make_episode(3, first_serial=1008).steps)
    b.close(terminated=True)
    a.close(terminated=False)
    c.close(terminated=True)
    return {a.episode_id: "a", b.episode_id: "b", c.episode_id: "c"}


@pytest.mark.statistical
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_streamed_segments_on_three_shards_follow_the_replay_wide_law(unit):
    """Segments take counters as they commit, on whichever shard: (episode, anchor) draws
    follow 2^(c/h) of the replay-wide counters (by the anchor's segment; unit="episode": the
    episode's newest), probabilities at rtol 1e-12, and reject shard-local counters."""
    h = 6.0
    replay = _local(3, selector=Recency(h), segment_length=4, unit=unit)
    names = _streamed(replay)
    assert {names[i]: [c for c, _ in r] for i, r in _rows(replay).items()} == {
        "a": [4, 8, 28],
        "b": [12, 25],
        "c": [16, 20, 24],
    }
    law = _stream_law(h, unit)
    cells = list(law)
    index = {cell: at for at, cell in enumerate(cells)}
    counts = np.zeros(len(cells))
    for _ in range(20):
        batch = replay.sample_windows(2_000, WINDOW)
        pairs = [
            (names[i], t)
            for i, t in zip(batch.episode_ids.tolist(), batch.anchor_steps.tolist(), strict=True)
        ]
        np.add.at(counts, [index[p] for p in pairs], 1)
        episode = {e: sum(p for (f, _), p in law.items() if f == e) for e in "abc"}
        expected = [law[p] if unit == "chunk" else episode[p[0]] for p in pairs]
        np.testing.assert_allclose(batch.probabilities.numpy(), expected, rtol=1e-12)
    probabilities = np.array([law[c] for c in cells])
    assert scipy.stats.chisquare(counts, counts.sum() * probabilities).pvalue > ACCEPT
    wrong = _stream_law(h, unit, local=True)
    assert (
        scipy.stats.chisquare(counts, counts.sum() * np.array([wrong[c] for c in cells])).pvalue
        < REJECT
    )
    replay.close()


@both_engines
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_one_streamed_shard_draws_what_one_buffer_draws(unit):
    """Segments, streams and Recency (by segment, or by episode): one shard and a buffer
    seeded alike draw the same anchors with the same probabilities and weights."""
    selector = Mixture({Prioritized(): 0.5, Recency(5): 0.5})
    options = {"seed": 7, "selector": selector, "segment_length": 4, "unit": unit}
    replay = ShardedReplay.create(1, 4000, backend="local", **options)
    buffer = PrioritizedSequenceReplay(4000, **options)
    _streamed(replay)
    _streamed(buffer)
    replay.extend(make_episode(n, first_serial=100 * n) for n in (6, 9))
    buffer.extend(make_episode(n, first_serial=100 * n) for n in (6, 9))
    for _ in range(3):
        got, expected = replay.sample_windows(16, WINDOW), buffer.sample_windows(16, WINDOW)
        assert torch.equal(got["serial"], expected["serial"])
        assert torch.equal(got.probabilities, expected.probabilities)
        assert torch.equal(got.weights, expected.weights)
    replay.close()


# -------------------------------------------------------------------------- persistence
def test_save_load_and_restarts_keep_the_counters(tmp_path):
    """A loaded replay has the saved rows' counters and the control's count, and draws and
    counts on exactly as the saved one; a restarted shard reloads its rows' counters while
    the replay's count goes on."""
    selector = Mixture({Prioritized(): 0.5, Recency(10): 0.5})
    replay = _local(3, selector=selector, checkpoint_dir=tmp_path / "restart")
    replay.extend(make_episode(n, first_serial=100 * n) for n in (4, 9, 6, 12, 3))
    replay.save(tmp_path / "saved")
    loaded = ShardedReplay.load(tmp_path / "saved")
    assert _rows(loaded) == _rows(replay) and _counter(loaded) == _counter(replay) == 34
    for target in (replay, loaded):
        target.extend(make_episode(n, first_serial=100 * n) for n in (5, 7))
    assert _rows(loaded) == _rows(replay)
    for _ in range(3):
        a, b = replay.sample_windows(16, WINDOW), loaded.sample_windows(16, WINDOW)
        assert torch.equal(a["serial"], b["serial"])
        assert torch.equal(a.probabilities, b.probabilities)
    loaded.close()

    replay.save(tmp_path / "restart")  # the restart files now hold every episode
    before = _rows(replay)
    settings = replay._shards[1].target.settings
    replay._shards[1] = LocalHandle(ReplayShard(1, settings, replay._control, restarted=True))
    assert _rows(replay) == before
    [new] = replay.extend([make_episode(4)])
    assert _rows(replay)[new] == [(34 + 12 + 4, 4)] and _counter(replay) == 50
    replay.close()


def test_a_manifest_count_is_checked_and_an_older_one_counts_the_shards_adds(tmp_path):
    from test_distributed_checkpoints import _drop, _rewrite, _set

    replay = _local(2, selector=Recency(10))
    replay.extend(make_episode(n) for n in (4, 6, 3))
    replay.save(tmp_path)
    _rewrite(tmp_path, _set("control", "committed", value=-1))
    with pytest.raises(CheckpointError, match=r"control\['committed'\] must be an int >= 0"):
        ShardedReplay.load(tmp_path)
    _rewrite(tmp_path, _drop("control", "committed"))
    loaded = ShardedReplay.load(tmp_path)
    assert _counter(loaded) == 13
    replay.close()
    loaded.close()


def test_a_table_whose_commit_counters_are_below_their_lengths_is_refused():
    """A checkpoint's commit column is kept when loaded, and checked: a counter smaller
    than its row's length is no count at a commit."""
    buffer = PrioritizedSequenceReplay(100, seed=0, selector=Recency(4))
    buffer.extend(make_episode(n) for n in (3, 5))
    buffer._core.store.table.keep_commits()
    state = buffer.state_dict()
    other = PrioritizedSequenceReplay(100, seed=0, selector=Recency(4))
    other.load_state_dict(state)
    assert other._core.store.table.commit[:2].tolist() == [3, 8]
    state["table"]["columns"]["commit"][1] = 4
    with pytest.raises(CheckpointError, match="commit counters >= their rows' lengths"):
        PrioritizedSequenceReplay(100, seed=0, selector=Recency(4)).load_state_dict(state)
