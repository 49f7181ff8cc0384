"""A refused call changes nothing: every argument is checked before the first draw or write.

Each test takes a snapshot of the whole buffer state (stored data, episode table, counters,
RNG state, priorities) before the call and compares it after the refusal, so a check that
comes after a draw (moving the RNG, counting draws, retiring episodes) fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_refused, make_episode, snapshot

from lucid_replay import (
    Episode,
    InvalidTypeError,
    PrioritizedSequenceReplay,
    SchemaDtypeError,
    SequenceReplay,
    Window,
)
from lucid_replay.table import EpisodeTable

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic

_BAD_DEVICES = ["banana", "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda"])


def _buffer(**kwargs) -> PrioritizedSequenceReplay:
    buffer = PrioritizedSequenceReplay(capacity=100, seed=0, **kwargs)
    buffer.extend(make_episode(length) for length in (6, 7, 8))
    return buffer


_DRAWS = {
    "sample": lambda buffer, device: buffer.sample(4, 3, device=device),
    "sample_prioritized": lambda buffer, device: buffer.sample_prioritized(4, 3, device=device),
    "sample_windows": lambda buffer, device: buffer.sample_windows(4, Window(3), device=device),
    "iterate": lambda buffer, device: buffer.iterate(4, Window(3), device=device),
    "gather_windows": lambda buffer, device: buffer.gather_windows(
        [0], [0], Window(3), device=device
    ),
}


@pytest.mark.parametrize("device", _BAD_DEVICES)
@pytest.mark.parametrize("call", sorted(_DRAWS))
def test_bad_target_device_is_refused_before_the_draw(call, device):
    """A device the process cannot use is refused before the draw (fails on the old code)."""
    buffer = _buffer(max_times_sampled=1)
    assert_refused(buffer, lambda: _DRAWS[call](buffer, device), ValueError, "device must be")
    assert buffer.sample(3, 3).episode_ids.numel() == 3  # no episode was retired by it


@pytest.mark.parametrize("device", [*_BAD_DEVICES, 3.5, True])
def test_constructor_refuses_a_bad_storage_device_naming_it(device):
    """``SequenceReplay(device="banana")`` is our error naming ``device``, not torch's."""
    error = TypeError if isinstance(device, float | bool) else ValueError
    with pytest.raises(error, match="device must be"):
        SequenceReplay(device=device)


def test_failed_first_allocation_leaves_the_buffer_as_if_never_used():
    """A first add whose storage cannot be allocated fixes no schema (fails on the old code)."""
    buffer = SequenceReplay(capacity=2**50, seed=0)  # ~19 PB for these fields
    with pytest.raises(MemoryError, match="capacity"):
        buffer.add(make_episode(5))
    assert buffer.schema is None
    assert (len(buffer), buffer.num_episodes, list(buffer.episode_ids)) == (0, 0, [])
    assert buffer.stats()["episodes_added"] == 0
    with pytest.raises(ValueError, match="non-empty"):
        buffer.sample(1, 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(5, 2).to_sparse(),
        lambda: torch.zeros(5, 2, device="meta"),
    ],
    ids=["sparse", "meta"],
)
def test_episode_without_dense_data_is_refused(make):
    """A sparse or ``meta`` field is refused when the episode is built, so `add` never evicts
    for data it cannot copy (fails on the old code)."""
    with pytest.raises(SchemaDtypeError, match=r"steps\['obs'\] must be a dense tensor"):
        Episode({"obs": make(), "serial": torch.arange(5)})


def test_write_failure_leaves_no_phantom_episode(monkeypatch):
    """If copying an episode into storage fails, no table row claims it (fails on old code)."""
    buffer = SequenceReplay(capacity=12, seed=0)
    buffer.extend(make_episode(5) for _ in range(2))

    def broken_write(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(buffer._core.store.ring, "write", broken_write)
    with pytest.raises(RuntimeError, match="copy failed"):
        buffer.add(make_episode(5))  # evicts episode 0 first
    assert list(buffer.episode_ids) == [1]
    assert len(buffer) == 5
    assert buffer.stats()["episodes_added"] == 2


# --------------------------------------------------------------------------- ids and flags


def test_bool_is_never_an_episode_id():
    """``True`` is no id: membership is False and id arguments refuse bool (old: accepted)."""
    buffer = _buffer()
    assert True not in buffer and False not in buffer
    assert 1 in buffer
    assert_refused(buffer, lambda: buffer.update_priorities([True], [1.0]), TypeError, "indices")
    assert_refused(
        buffer, lambda: buffer.gather_windows([True], [0], Window(2)), TypeError, "episode_ids"
    )
    assert_refused(
        buffer, lambda: buffer.gather_windows([1], [True], Window(2)), TypeError, "anchor_steps"
    )
    with pytest.raises(TypeError, match="episode_id must be an int"):
        buffer[True]


@pytest.mark.parametrize("value", ["False", 0, 1, np.float64(1.0)])
def test_prioritized_flag_must_be_a_bool_or_none(value):
    """``prioritized="False"`` (or 0, 1) is refused, not read as true (fails on the old code)."""
    buffer = _buffer()
    assert_refused(
        buffer,
        lambda: buffer.sample_windows(2, Window(2), prioritized=value),
        TypeError,
        "prioritized must be a bool or None",
    )


def test_numpy_integer_window_counts_become_ints():
    """``Window(np.uint64(3))`` holds a Python int and samples (old: failed after the draw)."""
    window = Window(np.uint64(3), burn_in=np.int32(1), dilation=np.int64(2))
    assert (type(window.length), type(window.burn_in), type(window.dilation)) == (int, int, int)
    assert window == Window(3, burn_in=1, dilation=2)
    batch = _buffer().sample_windows(4, window)
    assert batch.validity_mask.shape == (4, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"length": 2, "dilation": 2**62}, "span"),
        ({"length": 1, "burn_in": 1, "dilation": 2**60}, "span"),
        ({"length": 2**62}, "length must be <="),
        ({"length": 1, "burn_in": 2**62}, "burn_in must be <="),
        ({"length": 1, "bootstrap": 2**40}, "bootstrap must be <="),
    ],
)
def test_window_refuses_counts_that_would_overflow_offsets(kwargs, match):
    """A window whose span would wrap int64 step offsets is refused (old: wrapped silently)."""
    with pytest.raises(ValueError, match=match):
        Window(**kwargs)


def test_complex_errors_are_refused():
    """A complex error is refused, not cut to its real part (fails on the old code)."""
    buffer = _buffer()
    for errors in ([1 + 1j], np.array([1 + 1j]), torch.tensor([1 + 1j])):
        assert_refused(
            buffer, lambda e=errors: buffer.update_priorities([0], e), TypeError, "errors must be"
        )


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda b: b.sample(1, 2**64), ValueError, "length must be <="),
        (lambda b: b.sample(2**64, 1), ValueError, "batch_size must be <="),
        (lambda b: b.sample_windows(2**64, Window(1)), ValueError, "batch_size must be <="),
        (lambda b: b.iterate(2, Window(1), prefetch=2**64), ValueError, "prefetch must be <="),
        (lambda b: b.update_priorities([2**64], [1.0]), TypeError, "indices"),
    ],
    ids=["length", "batch_size", "windows", "prefetch", "ids"],
)
def test_huge_ints_are_our_errors_naming_the_argument(call, error, match):
    """Ints beyond int64 are refused by name, not by a torch overflow (old: torch's error)."""
    buffer = _buffer()
    assert_refused(buffer, lambda: call(buffer), error, match)


@pytest.mark.parametrize("seed, error", [(2**64, ValueError), (-1, ValueError), (True, TypeError)])
def test_seed_out_of_range_is_refused_naming_it(seed, error):
    """``seed=2**64`` is our error naming ``seed`` (old: torch's RuntimeError)."""
    with pytest.raises(error, match="seed must be"):
        SequenceReplay(seed=seed)


def test_largest_seed_is_accepted():
    """Every seed torch accepts (up to 2**64 - 1) is accepted."""
    SequenceReplay(seed=2**64 - 1)


def test_locate_finds_episodes_with_ids_near_2_to_the_62():
    """The offset -> episode search does not overflow for huge ids (old: wrong episodes)."""
    table = EpisodeTable(torch.device("cpu"))
    table.first_id = table.next_id = 2**62 - 2
    for length in (3, 4, 5):
        table.append(length, False, 1.0)
    ids, steps = table.locate(torch.tensor([0, 2, 3, 6, 7, 11]))
    assert ids.tolist() == [2**62 - 2] * 2 + [2**62 - 1] * 2 + [2**62] * 2
    assert steps.tolist() == [0, 2, 0, 3, 0, 4]


@pytest.mark.parametrize(
    "next_id, ids, message",
    [
        (0, [0], r"indices\[0\] must be an issued episode id \(none issued yet\), got 0"),
        (1, [-1], r"indices\[0\] must be an issued episode id \(0 \.\. 0\), got -1"),
        (3, [1, 5], r"indices\[1\] must be an issued episode id \(0 \.\. 2\), got 5"),
    ],
)
def test_never_issued_id_message_states_the_issued_range(next_id, ids, message):
    """The refusal names the issued id range (old: "< 1, got -1" for a negative id)."""
    buffer = PrioritizedSequenceReplay(100, seed=0)
    buffer.extend(make_episode(4) for _ in range(next_id))
    assert_refused(
        buffer, lambda: buffer.update_priorities(ids, [1.0] * len(ids)), ValueError, message
    )


def test_snapshot_sees_a_draw():
    """The snapshot used above changes with a draw, so the tests in this module can fail."""
    buffer = _buffer()
    before = snapshot(buffer)
    buffer.sample(1, 1)
    assert snapshot(buffer) != before


_TYPE_REFUSALS = {
    "a float batch size": lambda b: b.sample(2.0, 3),
    "a bool length": lambda b: b.sample(2, True),
    "a window that is not a Window": lambda b: b.sample_windows(2, 3),
    "a string prioritized": lambda b: b.sample_windows(2, Window(3), prioritized="False"),
    "a float id": lambda b: b.update_priorities([0.5], [1.0]),
    "complex errors": lambda b: b.update_priorities([0], [1j]),
    "a bool episode id": lambda b: b[True],
    "write-back values that are not a tensor": lambda b: b.write_back(
        b.gather_windows([0, 1], [0, 0], Window(3)), "serial", [[1, 2, 3]] * 2
    ),
    "an episode that is not an Episode": lambda b: b.add({"serial": torch.zeros(3)}),
    "an out= of another kind": lambda b: b.sample(2, 3, out=object()),
    "a Window with a float length": lambda b: Window(2.5),
    "a schema that is not a mapping": lambda b: SequenceReplay(10, schema=[1]),
}


@pytest.mark.parametrize("case", sorted(_TYPE_REFUSALS))
def test_type_refusals_are_lucid_replay_errors_and_type_errors(case):
    """Every refusal of a wrong type or kind is an `InvalidTypeError`: `except
    LucidReplayError` catches it, `except TypeError` too, and nothing changes."""
    buffer = _buffer()
    assert_refused(buffer, lambda: _TYPE_REFUSALS[case](buffer), InvalidTypeError, "must be")
    with pytest.raises(TypeError):
        _TYPE_REFUSALS[case](buffer)
