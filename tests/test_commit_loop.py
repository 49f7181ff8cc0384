"""The compiled segment commit stores exactly what the Python steps store.

On CPU with numba, ``unit="chunk"`` and no reuse limit, a segment commit runs as one compiled
loop (eviction, the copy, the row, the directory). These tests drive the same random streams
through that loop and through the array code (the ``numpy`` engine) and compare everything:
table columns, directory slots, the id index and free slots, counters, stored data and draws.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import comparable

from lucid_replay import Episode, PrioritizedSequenceReplay, Window, engine

pytestmark = pytest.mark.skipif(not engine.available(), reason="needs numba (the fast extra)")


def _drive(name: str, seed: int, priority_unit: str, capacity: int, pieces: list[int]) -> object:
    """Random streams (opens, appends, flushes, closes) with draws and priority updates."""
    rng, errors = random.Random(seed), torch.Generator().manual_seed(seed)
    with engine.use(name):
        buffer = PrioritizedSequenceReplay(
            capacity, segment_length=4, seed=1, priority_unit=priority_unit
        )
        streams, draws = [], []
        for turn in range(500):
            if not streams or rng.random() < 0.2:
                streams.append(buffer.open_episode())
            stream = rng.choice(streams)
            count = rng.choice(pieces)
            stream.append(
                {
                    "obs": torch.arange(count, dtype=torch.float32) + turn,
                    "action": torch.full((count,), turn),
                }
            )
            if rng.random() < 0.1:  # a whole episode, stored as ceil(T / L) segments
                size = rng.randint(1, 9)
                buffer.add(
                    Episode(
                        {
                            "obs": torch.full((size,), -1.0),
                            "action": torch.ones(size, dtype=torch.int64),
                        }
                    )
                )
            if rng.random() < 0.3:
                stream.flush()  # short segments: a commit may evict many
            if rng.random() < 0.1:
                stream.close(terminated=rng.random() < 0.5)
                streams.remove(stream)
            if turn % 5 == 0 and buffer.num_eligible(Window(3, bootstrap=1)):
                batch = buffer.sample_windows(8, Window(3, bootstrap=1))
                draws.append(comparable((dict(batch.data), batch.record_steps, batch.weights)))
                buffer.update_priorities_from(batch, torch.rand(8, generator=errors) + 0.1)
        table = buffer._core.store.table
        directory = table.directory
        ids, slots, size = directory.index()
        return comparable(
            {
                "state": buffer.state_dict(),
                "stats": buffer.stats(),
                "draws": draws,
                "table": dict(table.columns),
                "directory": dict(directory.columns),
                "index": (ids[:size].tolist(), slots[:size].tolist(), directory._free),
                "rows": (table.row_count, table.first_id, table.next_id, table.oldest_offset),
            }
        )


@pytest.mark.parametrize("priority_unit", ["episode", "segment"])
@pytest.mark.parametrize(
    ("capacity", "pieces"),
    [
        (60, [1, 2, 3, 4, 5, 9, 13]),  # full, short segments: commits evict up to 13 rows
        (5000, [1, 1, 2, 3]),  # not full: over 1,024 rows, so the table grows mid-commit
    ],
)
def test_compiled_commits_store_what_the_python_steps_store(priority_unit, capacity, pieces):
    for seed in range(2):
        compiled = _drive("kernels", seed, priority_unit, capacity, pieces)
        assert compiled == _drive("numpy", seed, priority_unit, capacity, pieces)


@pytest.mark.parametrize("view", ["strided", "negated", "conjugated"])
def test_steps_a_raw_copy_cannot_read_are_copied_as_they_read(view) -> None:
    """Strided steps and lazy negation or conjugation views go through the array copy."""
    base = torch.randn(8, 6, dtype=torch.complex64)
    if view == "strided":
        obs = torch.randn(8, 6)[:, ::2]
    elif view == "negated":
        obs = base.conj().imag[:, :3]  # float32 with the negative bit set
        assert obs.is_neg()
    else:
        obs = base[:, :3].conj()
        assert obs.is_conj()
    steps = {"obs": obs}
    buffer = PrioritizedSequenceReplay(40, segment_length=4, seed=0)
    with engine.use("kernels"):
        stream = buffer.open_episode()
        stream.append(steps)
        stream.close(terminated=True)
        stored = buffer[stream.episode_id]
    assert torch.equal(stored["obs"], obs.resolve_conj().resolve_neg())


def test_episodes_leave_in_the_order_their_last_segments_are_evicted() -> None:
    """On both paths, also where the array code evicts many rows at once."""
    results = []
    for name in ("kernels", "numpy"):
        with engine.use(name):
            buffer = PrioritizedSequenceReplay(12, segment_length=12, seed=0)
            streams = [buffer.open_episode() for _ in range(6)]  # slots 0 .. 5
            for stream in reversed(streams):  # stored last slot first: two steps each
                stream.append({"obs": torch.zeros(2)})
                stream.close(terminated=False)
            stream = buffer.open_episode()
            stream.append({"obs": torch.ones(12)})  # evicts all six at once
            directory = buffer._core.store.table.directory
            results.append((list(directory._free), buffer.stats()["episodes_evicted"]))
    assert results[0] == results[1]
    assert results[0][1] == 6
    assert results[0][0][-6:] == [5, 4, 3, 2, 1, 0]  # their slots, oldest segment first


def test_compiled_commits_reuse_their_index_space_and_grow_it_for_longer_segments() -> None:
    """The loop does not check its bounds: its lists must fit the longest commit so far."""
    buffer = PrioritizedSequenceReplay(20, segment_length=8, seed=0)
    segments = buffer._core.store.segments
    with engine.use("kernels"):
        stream = buffer.open_episode()
        stream.append({"obs": torch.zeros(2)})
        stream.flush()  # a segment of 2
        gone, dirty = segments.scratch
        assert gone.shape[0] >= 3 and dirty.shape[0] >= 2 + 3
        stream.append({"obs": torch.ones(2)})
        stream.flush()
        assert segments.scratch[0] is gone and segments.scratch[1] is dirty  # reused
        for value in range(4):  # segments of 8, the last two evicting the older ones
            stream.append({"obs": torch.full((8,), float(value))})
        longer, noted = segments.scratch
        assert longer.shape[0] >= 9 and noted.shape[0] >= 8 + 3
        stream.close(terminated=True)
        stored = buffer[stream.episode_id]
    assert stored["obs"].tolist() == [2.0] * 8 + [3.0] * 8
    assert buffer.episode_info(stream.episode_id).first_step == 20
