"""What the buffer holds, changed after the fact: write-back into stored records, and retired
episodes reclaimed as soon as they are the oldest.

Write-back tests use the standard buffer (see `conftest.standard_buffer`): episodes [4, 2, 6]
whose steps carry serials ``100 * (id + 1) + step``, and the anchors of the hand-computed
window tables.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    ANCHOR_IDS,
    ANCHOR_STEPS,
    TABLE_WINDOW,
    make_episode,
    standard_buffer,
    stored,
    write_values,
)

from lucid_replay import InvalidArgumentError, SchemaDtypeError, SequenceReplay, Window

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic

# ------------------------------------------------------------------------- write_back

# pad records of the anchors (2, 1), (0, 3), (1, 0), (2, 4):
#   (2, 1): steps [0, 0, 1, 3, 5], valid [F, F, T, T, T]
#   (0, 3): steps [0, 1, 3, 3, 3], valid [F, T, T, F, F]
#   (1, 0): steps [0, 0, 0, 1, 1], valid [F, F, T, F, F]
#   (2, 4): steps [0, 2, 4, 5, 5], valid [T, T, T, F, F]
# values = 9000 + 5 b + k.


def test_write_back_writes_valid_records_only():
    """Values land at valid records' (episode, step); invalid (clamped) records are skipped."""
    buffer = standard_buffer()
    batch = buffer.gather_windows(ANCHOR_IDS, ANCHOR_STEPS, Window(**TABLE_WINDOW))
    obs_before = [buffer[e]["obs"].clone() for e in range(3)]
    assert buffer.write_back(batch, "serial", write_values()) == 9
    assert stored(buffer, 0) == [100, 9006, 102, 9007]
    assert stored(buffer, 1) == [9012, 201]  # step 1 only reached by invalid records
    assert stored(buffer, 2) == [9015, 9002, 9016, 9003, 9017, 9004]
    for e in range(3):
        assert torch.equal(buffer[e]["obs"], obs_before[e])


def test_write_back_with_include_reset_writes_records_of_neighbouring_episodes():
    """Valid include_reset records in other episodes are written at their own (episode, step)."""
    buffer = standard_buffer()
    # Anchor (1, 0): records ep 0 s0, ep 0 s2, ep 1 s0, ep 2 s0, ep 2 s2, all valid.
    batch = buffer.gather_windows([1], [0], Window(**TABLE_WINDOW, boundary="include_reset"))
    values = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [9.0, 10.0]]])
    assert buffer.write_back(batch, "obs", values) == 5
    assert buffer[0]["obs"].tolist() == [[1.0, 2.0], [101.0, -101.0], [3.0, 4.0], [103.0, -103.0]]
    assert buffer[1]["obs"].tolist() == [[5.0, 6.0], [201.0, -201.0]]
    assert buffer[2]["obs"][:3].tolist() == [[7.0, 8.0], [301.0, -301.0], [9.0, 10.0]]


def test_write_back_skips_episodes_evicted_since_the_draw():
    """Records of evicted episodes are skipped, uncounted; their slots' new owner is untouched."""
    buffer = standard_buffer(capacity=12)
    batch = buffer.gather_windows([0, 2], [1, 2], Window(2, burn_in=1))
    # (0, 1): steps 0, 1, 2 valid; (2, 2): steps 1, 2, 3 valid.
    newcomer = buffer.add(make_episode(4, first_serial=500))  # takes episode 0's ring slots
    assert list(buffer.episode_ids) == [1, 2, 3]
    values = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64)
    assert buffer.write_back(batch, "serial", values) == 3
    assert stored(buffer, newcomer) == [500, 501, 502, 503]
    assert stored(buffer, 2) == [300, 4, 5, 6, 304, 305]
    assert stored(buffer, 1) == [200, 201]


def test_write_back_stores_values_not_an_autograd_graph():
    """Values computed with grad are stored as data: later batches do not require grad."""
    buffer = standard_buffer(seed=0)
    batch = buffer.gather_windows(ANCHOR_IDS, ANCHOR_STEPS, Window(**TABLE_WINDOW))
    scale = torch.tensor(2.0, requires_grad=True)
    assert buffer.write_back(batch, "obs", batch["obs"] * scale) == 9
    assert buffer[0]["obs"][1].tolist() == [202.0, -202.0]
    assert not buffer[0]["obs"].requires_grad
    assert not buffer.sample(4, 2)["obs"].requires_grad


@pytest.mark.parametrize(
    ("name", "values", "error", "message"),
    [
        (
            "serial",
            torch.zeros(4, 5, dtype=torch.float32),
            SchemaDtypeError,
            r"^values must have dtype torch\.int64, got torch\.float32$",
        ),
        (
            "serial",
            torch.zeros(4, 4, dtype=torch.int64),
            InvalidArgumentError,
            r"^values must be of shape \(4, 5\), got \(4, 4\)$",
        ),
        (
            "obs",
            torch.zeros(4, 5, dtype=torch.float32),
            InvalidArgumentError,
            r"^values must be of shape \(4, 5, 2\), got \(4, 5\)$",
        ),
        (
            "hidden",
            torch.zeros(4, 5),
            InvalidArgumentError,
            r"^name must be a stored field \['done', 'obs', 'serial'\], got 'hidden'$",
        ),
        (
            "serial",
            [[0] * 5] * 4,
            TypeError,
            r"^values must be a torch\.Tensor, got list$",
        ),
    ],
)
def test_write_back_refuses_bad_values_and_changes_nothing(name, values, error, message):
    """Wrong dtype -> TypeError; wrong shape or unknown field -> ValueError; nothing written."""
    buffer = standard_buffer()
    batch = buffer.gather_windows(ANCHOR_IDS, ANCHOR_STEPS, Window(**TABLE_WINDOW))
    with pytest.raises(error, match=message) as caught:
        buffer.write_back(batch, name, values)
    builtin = TypeError if error in (SchemaDtypeError, TypeError) else ValueError
    assert isinstance(caught.value, builtin)
    assert stored(buffer, 0) == [100, 101, 102, 103]
    assert stored(buffer, 2) == [300, 301, 302, 303, 304, 305]


def test_write_back_into_a_chunk_batch():
    """`write_back` accepts a chunk `Batch`: every record is valid, evicted episodes are
    skipped (old: AttributeError)."""
    buffer = SequenceReplay(capacity=20, seed=0)
    buffer.extend(make_episode(8, first_serial=100 * i) for i in range(2))
    batch = buffer.sample(3, 4)
    values = torch.stack([-batch["serial"], batch["serial"]], dim=2).to(torch.float32)
    assert buffer.write_back(batch, "obs", values) == 12
    for row in range(3):
        episode = buffer[int(batch.episode_ids[row])]
        start = int(batch.starts[row])
        assert torch.equal(episode["obs"][start : start + 4], values[row])
    buffer.add(make_episode(8))  # evicts episode 0
    written = int((batch.episode_ids != 0).sum()) * 4
    assert buffer.write_back(batch, "obs", values) == written


def test_write_back_refuses_what_is_not_a_batch():
    """`write_back` of something that is not a batch is our `TypeError`."""
    buffer = SequenceReplay(capacity=20, seed=0)
    buffer.add(make_episode(8))
    with pytest.raises(TypeError, match="batch must be a Batch or WindowBatch"):
        buffer.write_back({"obs": torch.zeros(1)}, "obs", torch.zeros(1, 1, 2))


# --------------------------------------------------------------------- retired episodes


def test_retired_episodes_are_reclaimed_when_oldest():
    """Retired episodes at the front are evicted at once; one behind a live one stays."""
    buffer = SequenceReplay(40, seed=0, max_times_sampled=1)
    for length in (4, 1, 4):
        buffer.add(make_episode(length))
    batch = buffer.sample(2, 4)  # ids 0 and 2, once each: both retired
    assert sorted(batch.episode_ids.tolist()) == [0, 2]
    assert list(buffer.episode_ids) == [1, 2]  # id 0 reclaimed; id 1 (live) shields id 2
    assert (len(buffer), buffer.num_episodes) == (5, 2)
    stats = buffer.stats()
    assert stats["episodes_retired"] == 2
    assert stats["episodes_evicted_unsampled"] == 0


def test_all_retired_episodes_are_reclaimed():
    """When every stored episode retires, all storage is reclaimed; ids keep counting."""
    buffer = SequenceReplay(40, seed=0, max_times_sampled=1)
    for length in (4, 4, 4):
        buffer.add(make_episode(length))
    buffer.sample(3, 4)
    assert (len(buffer), buffer.num_episodes, list(buffer.episode_ids)) == (0, 0, [])
    assert buffer.stats()["transitions_stored"] == 0
    with pytest.raises(ValueError, match="non-empty"):
        buffer.sample(1, 1)
    assert buffer.add(make_episode(2)) == 3


def test_retired_episode_is_reclaimed_when_an_add_makes_it_oldest():
    """A retired episode that becomes the oldest through an eviction is reclaimed."""
    buffer = SequenceReplay(9, seed=0, max_times_sampled=1)
    for length in (4, 1, 4):
        buffer.add(make_episode(length))
    buffer.sample(2, 4)  # retires ids 0 (reclaimed) and 2 (behind live id 1)
    assert list(buffer.episode_ids) == [1, 2]
    buffer.add(make_episode(5))  # needs 5 of 9: evicts id 1 only, id 2 becomes the oldest
    assert 2 not in buffer
    assert list(buffer.episode_ids) == [3]
    assert len(buffer) == 5
