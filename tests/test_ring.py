"""The transition ring and episode table seen through `SequenceReplay`: at most ``capacity``
transitions, in whole episodes, evicted oldest first.

Capacity, wrap-around across the ring's seam (by each copy path of `add`), eviction, ids,
lookups, the schema the first episode fixes, atomic `extend`, and copy semantics (no aliasing
between the caller's tensors, stored data and sampled batches).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import make_episode
from hypothesis import given, settings
from hypothesis import strategies as st

from lucid_replay import (
    Episode,
    SchemaDtypeError,
    SchemaError,
    SequenceReplay,
    UnknownEpisodeError,
    engine,
)
from lucid_replay.allocators import MEMORY
from lucid_replay.ring import TransitionRing
from lucid_replay.table import EpisodeTable

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic


def _snapshot(buffer: SequenceReplay) -> tuple:
    """Everything a refused call must leave unchanged."""
    return (
        len(buffer),
        buffer.num_episodes,
        list(buffer.episode_ids),
        buffer.stats(),
        buffer.schema,
        {i: buffer[i]["serial"].tolist() for i in buffer.episode_ids},
    )


def _assert_matches(buffer: SequenceReplay, model: dict[int, Episode]) -> None:
    """The buffer stores exactly the model's episodes, field by field, oldest first."""
    assert list(buffer.episode_ids) == list(model)
    assert buffer.num_episodes == len(model)
    assert len(buffer) == sum(len(e) for e in model.values())
    for episode_id, expected in model.items():
        assert episode_id in buffer
        stored = buffer[episode_id]
        assert len(stored) == len(expected)
        assert stored.terminated == expected.terminated
        for name in ("serial", "obs", "done"):
            assert torch.equal(stored[name], expected[name]), (episode_id, name)


# ---------------------------------------------------------------------- ring and eviction


def test_wraparound_keeps_every_stored_episode_intact():
    """Many adds of varied lengths into capacity 37: contents, ids and eviction order hold."""
    capacity = 37
    buffer = SequenceReplay(capacity, seed=0)
    rng = random.Random(1234)
    model: dict[int, Episode] = {}
    wrapped = 0
    for issued in range(120):
        length = rng.choice([1, 2, 3, 5, 7, 11, 13, 17, 23, 36])
        episode = make_episode(length, terminated=rng.random() < 0.5)
        offset_before = buffer.stats()["transitions_added"]
        episode_id = buffer.add(episode)
        assert episode_id == issued  # ids 0, 1, 2, ... never reused or renumbered
        if offset_before // capacity != (offset_before + length - 1) // capacity:
            wrapped += 1  # this episode straddles the ring's seam
        model[episode_id] = episode
        # Oldest-first whole-episode eviction: drop from the front until it fits.
        while sum(len(e) for e in model.values()) > capacity:
            del model[next(iter(model))]
        assert len(buffer) <= capacity
        _assert_matches(buffer, model)
        ids = list(buffer.episode_ids)
        assert ids == list(range(ids[0], issued + 1))  # contiguous, newest is the last issued
    assert wrapped >= 10  # the seam really was crossed many times


def test_eviction_is_oldest_first_and_minimal():
    """Exactly as many oldest episodes go as needed for the new one to fit, no more."""
    buffer = SequenceReplay(10, seed=0)
    for length in (3, 3, 3):
        buffer.add(make_episode(length))
    assert len(buffer) == 9
    buffer.add(make_episode(1))  # fits exactly: nothing evicted
    assert list(buffer.episode_ids) == [0, 1, 2, 3]
    assert len(buffer) == 10
    buffer.add(make_episode(4))  # needs 4: evicts ids 0 and 1 (3 + 3 >= 4, 3 < 4)
    assert list(buffer.episode_ids) == [2, 3, 4]
    assert len(buffer) == 8
    stats = buffer.stats()
    assert stats["episodes_evicted"] == 2
    assert stats["transitions_evicted"] == 6


def test_episode_of_exactly_capacity_evicts_everything_else():
    """An episode of `capacity` steps fits alone, evicting every other episode."""
    buffer = SequenceReplay(12, seed=0)
    for length in (5, 4, 2):
        buffer.add(make_episode(length))
    whole = make_episode(12)
    episode_id = buffer.add(whole)
    assert episode_id == 3
    assert list(buffer.episode_ids) == [3]
    assert len(buffer) == 12
    assert torch.equal(buffer[3]["serial"], whole["serial"])
    for gone in (0, 1, 2):
        assert gone not in buffer


def test_episode_longer_than_capacity_is_refused_and_nothing_is_evicted():
    """An episode longer than capacity raises ValueError and leaves the buffer unchanged."""
    buffer = SequenceReplay(12, seed=0)
    for length in (5, 4):
        buffer.add(make_episode(length))
    before = _snapshot(buffer)
    with pytest.raises(ValueError, match=r"episode length must be <= capacity \(12\), got 13"):
        buffer.add(make_episode(13))
    assert _snapshot(buffer) == before
    assert buffer.add(make_episode(1)) == 2  # the refused episode consumed no id


def test_refused_first_episode_does_not_fix_the_schema():
    """A too-long first episode is refused without fixing the schema."""
    buffer = SequenceReplay(4, seed=0)
    with pytest.raises(ValueError, match="capacity"):
        buffer.add(Episode({"x": torch.zeros(5)}))
    assert buffer.schema is None
    assert buffer.add(Episode({"y": torch.zeros(2, dtype=torch.int64)})) == 0
    assert set(buffer.schema) == {"y"}


def test_capacity_counts_transitions():
    """`capacity` is in steps: many short episodes fill it, and `len` counts steps."""
    buffer = SequenceReplay(6, seed=0)
    assert buffer.capacity == 6
    assert len(buffer) == 0
    assert buffer.num_episodes == 0
    assert list(buffer.episode_ids) == []
    ids = [buffer.add(make_episode(1)) for _ in range(6)]
    assert ids == [0, 1, 2, 3, 4, 5]
    assert (len(buffer), buffer.num_episodes) == (6, 6)
    buffer.add(make_episode(2))
    assert list(buffer.episode_ids) == [2, 3, 4, 5, 6]
    assert (len(buffer), buffer.num_episodes) == (6, 5)


@pytest.mark.parametrize(
    "values",
    [
        torch.arange(7, dtype=torch.bfloat16),  # no numpy view: copied with Tensor.copy_
        torch.arange(7, dtype=torch.float32).requires_grad_(),  # neither
        torch.arange(7, dtype=torch.float32),  # copied through numpy views
    ],
    ids=["bfloat16", "requires_grad", "float32"],
)
def test_add_stores_every_kind_of_field_exactly_across_the_seam(values):
    """Both copy paths of `add` store the steps, also when an episode wraps the ring's seam."""
    buffer = SequenceReplay(capacity=10, seed=0)
    buffer.add(Episode({"x": values[:5].detach().clone()}))
    wrapped = buffer.add(Episode({"x": values}))
    assert buffer.episode_ids == range(1, 2)
    stored = buffer[wrapped]["x"]
    assert stored.dtype == values.dtype and not stored.requires_grad
    assert torch.equal(stored, values.detach())


# ---------------------------------------------------------------------------- lookups


def test_lookup_of_evicted_id_raises_key_error():
    """An evicted id raises KeyError saying it was evicted; `in` is False."""
    buffer = SequenceReplay(5, seed=0)
    buffer.add(make_episode(3))
    buffer.add(make_episode(3))
    assert 0 not in buffer
    with pytest.raises(KeyError, match="got 0: it was evicted") as info:
        buffer[0]
    assert isinstance(info.value, UnknownEpisodeError)


@pytest.mark.parametrize("episode_id", [2, 3, 100, -1])
def test_lookup_of_never_issued_id_raises_key_error(episode_id):
    """An id never issued (or negative) raises KeyError saying so; `in` is False."""
    buffer = SequenceReplay(10, seed=0)
    buffer.add(make_episode(3))
    buffer.add(make_episode(3))
    assert episode_id not in buffer
    with pytest.raises(KeyError, match=rf"got {episode_id}: it was never issued"):
        buffer[episode_id]


def test_lookup_in_empty_buffer_raises_key_error():
    """Any id in an empty buffer raises KeyError."""
    buffer = SequenceReplay(10, seed=0)
    assert 0 not in buffer
    with pytest.raises(KeyError, match="never issued"):
        buffer[0]


def test_lookup_returns_the_episode_with_its_terminated_flag():
    """`buffer[id]` returns the stored fields and the episode's `terminated` flag."""
    buffer = SequenceReplay(20, seed=0)
    first = make_episode(4, terminated=True)
    second = make_episode(3, terminated=False)
    buffer.extend([first, second])
    assert buffer[0].terminated is True
    assert buffer[1].terminated is False
    assert torch.equal(buffer[0]["obs"], first["obs"])
    assert torch.equal(buffer[1]["done"], second["done"])


# ----------------------------------------------------------------------------- schema


def _schema_variants() -> dict[str, tuple[type[Exception], str, Episode]]:
    serial = torch.arange(4, dtype=torch.int64)
    obs = torch.zeros(4, 2)
    done = torch.zeros(4, dtype=torch.bool)
    return {
        "missing": (
            SchemaError,
            r"got missing \['done'\], extra \[\]",
            Episode({"serial": serial, "obs": obs}),
        ),
        "extra": (
            SchemaError,
            r"got missing \[\], extra \['reward'\]",
            Episode({"serial": serial, "obs": obs, "done": done, "reward": torch.zeros(4)}),
        ),
        "renamed": (
            SchemaError,
            r"got missing \['done'\], extra \['terminal'\]",
            Episode({"serial": serial, "obs": obs, "terminal": done}),
        ),
        "shape": (
            SchemaError,
            r"field 'obs' must have per-step shape \(2,\), got \(3,\)",
            Episode({"serial": serial, "obs": torch.zeros(4, 3), "done": done}),
        ),
        "rank": (
            SchemaError,
            r"field 'obs' must have per-step shape \(2,\), got \(2, 1\)",
            Episode({"serial": serial, "obs": torch.zeros(4, 2, 1), "done": done}),
        ),
        "dtype": (
            SchemaDtypeError,
            r"field 'obs' must have dtype torch.float32, got torch.float64",
            Episode({"serial": serial, "obs": obs.double(), "done": done}),
        ),
        "dtype-int": (
            SchemaDtypeError,
            r"field 'serial' must have dtype torch.int64, got torch.int32",
            Episode({"serial": serial.int(), "obs": obs, "done": done}),
        ),
    }


@pytest.mark.parametrize("variant", list(_schema_variants()))
def test_schema_mismatch_is_refused_and_buffer_unchanged(variant):
    """Another field set or shape (ValueError) or dtype (TypeError) is refused, no change."""
    error, message, bad = _schema_variants()[variant]
    buffer = SequenceReplay(10, seed=0)
    buffer.add(make_episode(6))
    buffer.add(make_episode(3))
    before = _snapshot(buffer)
    expected_builtin = TypeError if error is SchemaDtypeError else ValueError
    with pytest.raises(expected_builtin, match=message) as info:
        buffer.add(bad)
    assert isinstance(info.value, error)
    assert _snapshot(buffer) == before
    # The refused 4-step episode would have evicted id 0; it is still there.
    assert 0 in buffer
    assert buffer.add(make_episode(1)) == 2


def test_schema_is_fixed_by_the_first_episode():
    """`schema` is None before the first add, then field -> (per-step shape, dtype)."""
    buffer = SequenceReplay(10, seed=0)
    assert buffer.schema is None
    buffer.add(make_episode(2))
    assert buffer.schema == {
        "serial": ((), torch.int64),
        "obs": ((2,), torch.float32),
        "done": ((), torch.bool),
    }


def test_field_order_does_not_matter_for_the_schema():
    """The same fields in another insertion order match the schema."""
    buffer = SequenceReplay(10, seed=0)
    episode = make_episode(3)
    buffer.add(episode)
    reordered = Episode({name: episode[name] for name in ("done", "obs", "serial")})
    assert buffer.add(reordered) == 1
    assert torch.equal(buffer[1]["obs"], episode["obs"])


def test_extend_with_one_bad_episode_adds_none():
    """`extend` validates every episode first: one bad episode means nothing is added."""
    buffer = SequenceReplay(20, seed=0)
    buffer.add(make_episode(5))
    before = _snapshot(buffer)
    bad = Episode({"serial": torch.arange(2), "obs": torch.zeros(2, 2, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"missing \['done'\]"):
        buffer.extend([make_episode(3), make_episode(4), bad, make_episode(2)])
    assert _snapshot(buffer) == before
    too_long = make_episode(21)
    with pytest.raises(ValueError, match=r"<= capacity \(20\), got 21"):
        buffer.extend([make_episode(15), too_long])
    assert _snapshot(buffer) == before  # the 15-step episode would have evicted id 0


def test_extend_into_empty_buffer_checks_later_episodes_against_the_first():
    """In an empty buffer, `extend`'s first episode fixes the schema for the rest; a
    conflicting later one refuses the whole call and leaves the schema unset."""
    buffer = SequenceReplay(20, seed=0)
    conflicting = Episode({"serial": torch.arange(3, dtype=torch.int32)})
    with pytest.raises(TypeError, match=r"field 'serial' must have dtype torch\.int64"):
        buffer.extend([Episode({"serial": torch.arange(3)}), conflicting])
    assert buffer.schema is None
    assert len(buffer) == 0
    assert buffer.stats()["episodes_added"] == 0


def test_extend_returns_ids_in_order():
    """`extend` returns one id per episode, in order, continuing the sequence."""
    buffer = SequenceReplay(30, seed=0)
    buffer.add(make_episode(2))
    episodes = [make_episode(n) for n in (3, 1, 4)]
    assert buffer.extend(episodes) == [1, 2, 3]
    assert buffer.extend([]) == []
    for episode_id, episode in zip([1, 2, 3], episodes, strict=True):
        assert torch.equal(buffer[episode_id]["serial"], episode["serial"])


def test_add_refuses_a_non_episode():
    """`add` of something that is not an Episode raises TypeError."""
    buffer = SequenceReplay(10, seed=0)
    with pytest.raises(TypeError, match="episode must be an Episode, got dict"):
        buffer.add({"x": torch.zeros(3)})
    assert len(buffer) == 0


# ---------------------------------------------------------------------------- aliasing


def test_mutating_the_added_tensor_does_not_change_stored_data():
    """`add` copies: writing to the caller's tensor afterwards leaves storage unchanged."""
    buffer = SequenceReplay(10, seed=0)
    episode = make_episode(4)
    expected = episode["obs"].clone()
    buffer.add(episode)
    episode["obs"].fill_(-1.0)
    episode["serial"].zero_()
    assert torch.equal(buffer[0]["obs"], expected)
    assert buffer.sample(8, 4)["obs"].eq(expected).all()


def test_mutating_the_added_numpy_array_does_not_change_stored_data():
    """An episode wrapping a numpy array is copied on `add`; later array writes stay out."""
    array = np.arange(8, dtype=np.float32).reshape(4, 2)
    buffer = SequenceReplay(10, seed=0)
    buffer.add(Episode({"obs": array}))
    array[:] = 0.0
    assert buffer[0]["obs"].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]


def test_mutating_a_sampled_batch_does_not_change_storage():
    """A sampled batch owns its data: writing to it leaves storage (and later draws) intact."""
    buffer = SequenceReplay(10, seed=0)
    episode = make_episode(5)
    buffer.add(episode)
    batch = buffer.sample(4, 5)
    for tensor in batch.data.values():
        tensor.zero_()
    assert torch.equal(buffer[0]["serial"], episode["serial"])
    assert torch.equal(buffer.sample(2, 5)["serial"][0], episode["serial"])


def test_mutating_a_looked_up_episode_does_not_change_storage():
    """`buffer[id]` returns a copy: writing to it leaves storage intact."""
    buffer = SequenceReplay(10, seed=0)
    episode = make_episode(3)
    buffer.add(episode)
    buffer[0]["serial"].zero_()
    assert torch.equal(buffer[0]["serial"], episode["serial"])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    capacity=st.integers(1, 24),
    size=st.integers(1, 8),
    stride=st.integers(1, 3),
    data=st.data(),
)
def test_gather_runs_equals_a_per_record_gather(capacity, size, stride, data):
    """Block reads of runs (with seam and clamp repairs) equal gathering every record's slot."""
    ring = TransitionRing(capacity, torch.device("cpu"), MEMORY)
    # "wide" records are 2 kB: runs of 2 or more are 4 kB blocks, which index_select copies
    # when torch has several threads (the kernel copies the smaller ones).
    ring.allocate(
        {"x": ((2,), torch.float32), "flag": ((), torch.bool), "wide": ((512,), torch.float32)}
    )
    ring.fields["x"].copy_(torch.arange(2 * capacity, dtype=torch.float32).view(capacity, 2))
    ring.fields["flag"].copy_(torch.arange(capacity) % 3 == 0)
    ring.fields["wide"].copy_(
        torch.randn(capacity, 512, generator=torch.Generator().manual_seed(0))
    )
    oldest = data.draw(st.integers(0, 3 * capacity), label="oldest")
    batch = data.draw(st.integers(1, 5), label="batch")
    firsts = torch.tensor(
        data.draw(
            st.lists(st.integers(oldest - 10, oldest + capacity), min_size=batch, max_size=batch)
        )
    )
    wanted = firsts.unsqueeze(1) + stride * torch.arange(size)
    # Clamp into the stored range like a boundary policy would; clamped records are inexact.
    offsets = wanted.clamp(oldest, oldest + capacity - 1)
    exact = offsets == wanted

    # One table row whose episode starts at offset 0: record (row 0, step s) is at offset s.
    table = EpisodeTable(torch.device("cpu"))
    table.oldest_offset = oldest
    records = (engine.view(torch.zeros_like(offsets)), engine.view(offsets))
    expected = ring.gather(ring.slots(offsets, oldest))
    threads = torch.get_num_threads()
    # Into new tensors, and into preallocated ones (the compiled gather: runs copied by a
    # kernel with one thread and stride 1, else by index_select, then repaired by a kernel;
    # or every run by the kernel when most records are clamped or a run is longer than the
    # ring) with one thread and with two.
    for into, count in ((False, 1), (True, 1), (True, 2)):
        out = {k: torch.full_like(v, 7) for k, v in expected.items()} if into else None
        torch.set_num_threads(count)
        try:
            got = ring.gather_runs(
                table, engine.view(firsts), size, stride, records, engine.view(exact), out
            )
        finally:
            torch.set_num_threads(threads)
        for name in ("x", "flag", "wide"):
            assert torch.equal(got[name], expected[name]), (into, count, name)


def test_compiled_gather_refuses_an_offset_outside_the_ring(index_engine):
    """The compiled gather copies raw memory: an offset it was never meant to see raises
    instead of reading outside the ring (no caller passes one)."""
    if index_engine != "kernels":
        pytest.skip("the guard is the compiled gather's")
    ring = TransitionRing(10, torch.device("cpu"), MEMORY)
    ring.allocate({"x": ((3,), torch.float32)})
    table = EpisodeTable(torch.device("cpu"))
    exact = np.array([[True, False]])
    records = (np.zeros((1, 2), dtype=np.int64), np.array([[0, -50]]))
    out = {"x": torch.empty(1, 2, 3)}
    with pytest.raises(IndexError, match="outside the stored range"):
        ring.gather_runs(table, np.array([0]), 2, 1, records, exact, out)


def test_compiled_block_copy_refuses_a_block_outside_the_ring(index_engine):
    """The kernel that copies whole runs checks every block before it writes a byte."""
    if index_engine != "kernels":
        pytest.skip("the guard is the compiled gather's")
    from lucid_replay.ring_copies import copy_blocks

    ring = torch.arange(10, dtype=torch.float32)
    out = torch.zeros(2, 4)
    addresses = (np.array([out.data_ptr()]), np.array([ring.data_ptr()]), np.array([4]))
    copy_blocks(*addresses, np.array([6, 2]), 4, 10)  # the last block that fits: slots 6-9
    assert out.tolist() == [[6, 7, 8, 9], [2, 3, 4, 5]]
    out.fill_(-5.0)
    copy_blocks(*addresses, np.array([-1, 2]), 4, 10)  # -1: no block, the row left as it is
    assert out.tolist() == [[-5, -5, -5, -5], [2, 3, 4, 5]]
    for slots in ([0, 7], [-2, 0]):
        out.zero_()
        with pytest.raises(IndexError, match="outside the ring"):
            copy_blocks(*addresses, np.array(slots), 4, 10)
        assert not out.any()  # refused before the first copy
