"""Looking up episodes and anchors on a segmented buffer: every engine finds the same slots and
segment rows, and refuses the same anchors with the same error, changing nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import comparable

from lucid_replay import Episode, SequenceReplay, Window, engine
from lucid_replay.errors import UnknownEpisodeError

ENGINES = [name for name in engine.ENGINES if name != "kernels" or engine.available()]


def _buffer() -> SequenceReplay:
    """Segments of 3 steps: an evicted episode (id 0, a tombstone in the id index), two
    episodes streamed at once (their segments interleaved in the ring), one of them open
    with its head evicted (id 1), one open with nothing stored (id 6), closed ones."""
    buffer = SequenceReplay(capacity=40, segment_length=3, seed=5)
    buffer.add(Episode({"x": torch.arange(5)}))  # id 0: evicted below
    head, other = buffer.open_episode(), buffer.open_episode()  # ids 1 and 2
    for begin in range(0, 15, 3):
        head.append({"x": torch.arange(begin, begin + 3)})
        other.append({"x": torch.arange(begin, begin + 3)})
    other.close(terminated=True)
    for length in (4, 2, 5):  # ids 3-5; id 0 and id 1's first segment are evicted
        buffer.add(Episode({"x": torch.arange(length)}))
    empty = buffer.open_episode()  # id 6: nothing committed
    assert empty.episode_id == 6 and 6 not in buffer and 0 not in buffer
    assert buffer.episode_info(1).first_step > 0 and buffer.episode_info(1).num_segments >= 2
    assert buffer.episode_info(2).num_segments >= 2
    return buffer


def test_every_engine_finds_the_same_slots_for_live_evicted_and_unissued_ids() -> None:
    buffer = _buffer()
    directory = buffer._core.store.segments.directory
    live = {int(directory.host["episode_id"][slot]): slot for slot in directory.live_slots()}
    wanted = np.random.default_rng(3).permutation(np.repeat(np.arange(-3, 14), 3))
    found = {}
    for name in ENGINES:
        with engine.use(name):
            found[name] = directory.slots_of(wanted)
            assert directory.slots_of(wanted[:0]).shape == (0,)
            assert directory.slots_of(wanted.reshape(3, -1)).shape == (3, wanted.shape[0] // 3)
    expected = np.array([live.get(int(i), -1) for i in wanted])
    assert 0 not in live and 12 not in live  # an evicted id (a tombstone) and an unissued one
    for slots in found.values():
        assert np.array_equal(slots, expected)
    empty = SequenceReplay(capacity=10, segment_length=2)._core.store.segments.directory
    for name in ENGINES:
        with engine.use(name):
            assert np.array_equal(empty.slots_of(np.array([0, 1])), [-1, -1])


def test_every_engine_finds_the_segment_holding_each_anchor() -> None:
    buffer = _buffer()
    table = buffer._core.store.table
    pairs = [
        (episode_id, step)
        for episode_id in buffer.episode_ids
        for step in range(buffer.episode_info(episode_id).first_step, len(buffer[episode_id]))
    ]
    ids, steps = (torch.tensor(values) for values in zip(*pairs, strict=True))
    rows = {}
    for name in ENGINES:
        with engine.use(name):
            anchors = buffer._core.store.anchors(ids, steps)
            rows[name] = torch.as_tensor(anchors.rows).cpu()
            assert torch.equal(torch.as_tensor(anchors.steps).cpu(), steps)
            assert torch.equal(torch.as_tensor(anchors.episode_ids).cpu(), ids)
    first_step = torch.as_tensor(table.arrays["first_step"]).cpu()
    length = torch.as_tensor(table.arrays["length"]).cpu()
    for found in rows.values():
        assert torch.equal(found, rows[ENGINES[0]])
        begin = first_step[found]
        assert bool(((begin <= steps) & (steps < begin + length[found])).all())
    owners = torch.as_tensor(table.owners().slot).cpu()[rows[ENGINES[0]]]
    directory = buffer._core.store.segments.directory
    assert torch.equal(torch.from_numpy(directory.host["episode_id"][owners.numpy()]), ids)


REFUSED = [
    pytest.param([12], [0], UnknownEpisodeError, r"got 12: it was never issued", id="unissued"),
    pytest.param([0], [0], UnknownEpisodeError, r"got 0: it was evicted", id="evicted"),
    pytest.param([6], [0], UnknownEpisodeError, r"got 6: it is open with no stored", id="empty"),
    pytest.param([5, 1], [0, 0], ValueError, r"anchor_steps\[1\] must be a stored step", id="head"),
    pytest.param([1], [15], ValueError, r"anchor_steps\[0\] must be a stored step", id="past-end"),
    pytest.param([4], [-1], ValueError, r"anchor_steps\[0\] must be a stored step", id="negative"),
    # every id is checked before any step: the unknown id at 1 wins over the step at 0
    pytest.param([5, 0], [99, 0], UnknownEpisodeError, r"got 0: it was evicted", id="ids-first"),
]


@pytest.mark.parametrize(("ids", "steps", "error", "match"), REFUSED)
def test_refused_anchors_raise_the_same_error_on_every_engine_and_change_nothing(
    ids: list[int], steps: list[int], error: type, match: str
) -> None:
    buffer = _buffer()
    generator = buffer._core.generator
    for name in ENGINES:
        with engine.use(name):
            before = comparable(buffer.state_dict()), buffer.stats(), generator.get_state()
            with pytest.raises(error, match=match):
                buffer.gather_windows(ids, steps, Window(2, burn_in=1))
            after = comparable(buffer.state_dict()), buffer.stats(), generator.get_state()
            assert after[0] == before[0] and after[1] == before[1]
            assert torch.equal(after[2], before[2])
