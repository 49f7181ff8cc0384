"""Checkpoints: round trips continue exactly, the layout is fixed key by key, and a state that
loads is sound or is refused with `CheckpointError`.

A restored buffer draws what an unsaved twin draws. The state's keys, types and dtypes are
pinned, and a state written out literally loads into the episodes it spells out. Crafted states
break one invariant each (of the episode table, the data, the counters, the RNG state or the
priority state); files are written atomically and carry a checksum of their payload.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from conftest import (
    DRIVE_CONFIG_IDS,
    DRIVE_CONFIGS,
    assert_batches_equal,
    both_engines,
    comparable,
    drive,
    filled_buffer,
    make_episode,
    seeded_twins,
    snapshot,
)

from lucid_replay import CheckpointError, Episode, PrioritizedSequenceReplay, SequenceReplay
from lucid_replay.laws import Prioritized

# Tests that draw after a load, or compare a buffer with a twin, run on both engines of the
# index arithmetic (`both_engines`); checks of a state alone run once.


def _source(kind: type[SequenceReplay] = PrioritizedSequenceReplay, **kwargs) -> SequenceReplay:
    """A buffer that has wrapped its ring, evicted, been sampled and (if prioritized) updated."""
    buffer = kind(capacity=30, seed=3, **kwargs)
    buffer.extend(make_episode(length) for length in (6, 7, 8, 9, 5, 6))
    buffer.sample(4, 2)
    if isinstance(buffer, PrioritizedSequenceReplay):
        buffer.update_priorities(list(buffer.episode_ids), [0.5, 2.0, 0.25, 1.5])
        buffer.anneal_beta(0.5)
    return buffer


def _target(kind: type[SequenceReplay] = PrioritizedSequenceReplay, **kwargs) -> SequenceReplay:
    """A buffer of the same configuration, with other contents, that a refusal must keep."""
    buffer = kind(capacity=30, seed=9, **kwargs)
    buffer.extend(make_episode(length) for length in (4, 5))
    buffer.sample(2, 2)
    return buffer


# -------------------------------------------------------------------------- round trips


@both_engines
@pytest.mark.parametrize("config", DRIVE_CONFIGS, ids=DRIVE_CONFIG_IDS)
def test_save_and_load_mid_stream_continue_like_an_unsaved_twin(tmp_path, config):
    """After save/load the restored buffer draws exactly what an un-saved twin draws."""
    saved, twin = seeded_twins(**config)
    drive(saved, rounds=1)
    drive(twin, rounds=1)
    saved.save(tmp_path / "buffer.pt")
    restored = SequenceReplay.load(tmp_path / "buffer.pt")
    for one, two in zip(drive(restored), drive(twin), strict=True):
        assert_batches_equal(one, two)
    assert restored.stats() == twin.stats()
    assert list(restored.episode_ids) == list(twin.episode_ids)


@both_engines
@pytest.mark.parametrize("config", DRIVE_CONFIGS, ids=DRIVE_CONFIG_IDS)
def test_state_dict_round_trip_continues_like_an_unsaved_twin(config):
    """`load_state_dict` into a fresh buffer (another seed) continues like the twin."""
    source, twin = seeded_twins(**config)
    drive(source, rounds=1)
    drive(twin, rounds=1)
    fresh = SequenceReplay(40, **{**config, "seed": 99})
    fresh.load_state_dict(source.state_dict())
    for one, two in zip(drive(fresh), drive(twin), strict=True):
        assert_batches_equal(one, two)


@both_engines
def test_state_dict_is_a_snapshot():
    """A state dict taken earlier restores that moment, whatever the buffer did since."""
    buffer, twin = seeded_twins()
    state = buffer.state_dict()
    drive(buffer)  # samples and adds (with evictions) after the snapshot
    buffer.load_state_dict(state)
    for one, two in zip(drive(buffer), drive(twin), strict=True):
        assert_batches_equal(one, two)


def _assert_same_buffer(restored: SequenceReplay, original: SequenceReplay) -> None:
    """Both buffers have one class, configuration, schema, stats and the same stored episodes."""
    assert type(restored) is type(original)
    assert restored.capacity == original.capacity
    assert restored.unit == original.unit
    assert restored.max_times_sampled == original.max_times_sampled
    assert len(restored) == len(original)
    assert restored.num_episodes == original.num_episodes
    assert list(restored.episode_ids) == list(original.episode_ids)
    assert restored.schema == original.schema
    assert restored.stats() == original.stats()
    for episode_id in original.episode_ids:
        mine, theirs = restored[episode_id], original[episode_id]
        assert mine.terminated == theirs.terminated
        for name in theirs:
            assert torch.equal(mine[name], theirs[name])
            assert mine[name].dtype == theirs[name].dtype


@both_engines
def test_save_load_round_trips_everything(tmp_path):
    """Data, ids, counters, stats, schema and configuration survive save/load."""
    buffer = filled_buffer(capacity=30, unit="episode", max_times_sampled=5)
    buffer.sample(8, 2)
    buffer.add(make_episode(11))  # evicts, so counters and the seam are non-trivial
    assert buffer.stats()["episodes_evicted"] > 0
    buffer.save(tmp_path / "buffer.pt")
    restored = SequenceReplay.load(tmp_path / "buffer.pt")
    _assert_same_buffer(restored, buffer)
    assert restored.add(make_episode(3)) == buffer.episode_ids.stop  # ids continue


@both_engines
def test_save_load_of_an_empty_buffer(tmp_path):
    """An empty buffer round-trips; its schema is still unset afterwards."""
    SequenceReplay(9, seed=0).save(tmp_path / "empty.pt")
    restored = SequenceReplay.load(tmp_path / "empty.pt")
    assert (len(restored), restored.num_episodes, restored.schema) == (0, 0, None)
    assert restored.capacity == 9
    assert restored.add(make_episode(4)) == 0
    assert restored.sample(2, 4)["serial"].shape == (2, 4)


@both_engines
def test_load_of_a_prioritized_file_returns_a_prioritized_buffer(tmp_path):
    """`SequenceReplay.load` of a prioritized file gives a PrioritizedSequenceReplay back."""
    buffer = PrioritizedSequenceReplay(30, alpha=0.7, beta=0.5, seed=3)
    for length in (4, 6, 5):
        buffer.add(make_episode(length))
    batch = buffer.sample_prioritized(4, 3)
    buffer.update_priorities(batch.indices, torch.linspace(0.5, 2.0, 4))
    buffer.anneal_beta(0.5)
    buffer.save(tmp_path / "prioritized.pt")
    restored = SequenceReplay.load(tmp_path / "prioritized.pt")
    assert isinstance(restored, PrioritizedSequenceReplay)
    _assert_same_buffer(restored, buffer)
    assert (restored.alpha, restored.beta) == (buffer.alpha, buffer.beta)
    assert restored.max_priority == buffer.max_priority
    assert torch.equal(restored.priorities, buffer.priorities)
    one, two = restored.sample_prioritized(6, 2), buffer.sample_prioritized(6, 2)
    assert_batches_equal(one, two)
    assert torch.equal(one.weights, two.weights)


@both_engines
def test_save_load_round_trips_priorities_and_draws(tmp_path) -> None:
    """load restores priorities, max priority, alpha/beta/epsilon; next draws equal a twin's."""

    def build() -> PrioritizedSequenceReplay:
        buffer = PrioritizedSequenceReplay(
            40, alpha=0.7, beta=0.3, epsilon=1e-3, unit="chunk", seed=91
        )
        ids = buffer.extend(make_episode(n, first_serial=1_000 * n) for n in [9, 4, 8, 6, 10])
        buffer.update_priorities(ids, [12.0, 0.5, 3.0, 2.0, 0.25])  # 12 is the max...
        buffer.sample_prioritized(32, 3)
        buffer.sample_prioritized(32, 5)  # a second tree, kept current incrementally
        buffer.update_priorities(ids[2:], [0.1, 5.0, 1.5])
        ids.append(buffer.add(make_episode(7, first_serial=99_000)))  # ...evicted here
        assert ids[0] not in buffer
        buffer.anneal_beta(0.25, final=0.9)
        return buffer

    original = build()
    twin = build()
    path = tmp_path / "buffer.pt"
    original.save(path)
    loaded = SequenceReplay.load(path)
    assert type(loaded) is PrioritizedSequenceReplay
    assert (loaded.alpha, loaded.epsilon, loaded.unit) == (0.7, 1e-3, "chunk")
    assert loaded.beta == original.beta == pytest.approx(0.3 + 0.25 * 0.6, rel=1e-12)
    assert loaded.max_priority == original.max_priority == 12.0 + 1e-3
    assert list(loaded.episode_ids) == list(original.episode_ids)
    assert torch.equal(loaded.priorities, original.priorities)
    for length in (3, 5, 3):
        ours, theirs = loaded.sample_prioritized(64, length), twin.sample_prioritized(64, length)
        assert torch.equal(ours.indices, theirs.indices)
        assert torch.equal(ours.starts, theirs.starts)
        assert torch.equal(ours.weights, theirs.weights)
        assert torch.equal(ours["serial"], theirs["serial"])
        plain_ours, plain_theirs = loaded.sample(16, length), twin.sample(16, length)
        assert torch.equal(plain_ours.episode_ids, plain_theirs.episode_ids)
        for buffer in (loaded, twin):
            buffer.update_priorities(ours.indices, ours.starts.double())
    assert loaded.add(make_episode(4)) == twin.add(make_episode(4))
    assert torch.equal(loaded.priorities, twin.priorities)
    loaded.anneal_beta(0.0)  # beta0 survives the round trip: no compounding from the save
    assert loaded.beta == 0.3


# ------------------------------------------------------------------------------- layout

_COLUMN_DTYPES = {
    "episode_id": torch.int64,
    "start": torch.int64,
    "length": torch.int64,
    "terminated": torch.bool,
    "times_sampled": torch.int64,
    "priority": torch.float64,
}


@pytest.mark.parametrize("kind", [SequenceReplay, PrioritizedSequenceReplay])
def test_state_dict_layout_is_pinned_key_by_key(kind):
    """A state holds exactly these keys, at every level, with these types and dtypes."""
    state = _source(kind).state_dict()  # lengths 6, 7, 8, 9, 5, 6 into 30: ids 0, 1 evicted
    assert set(state) == {
        "format",
        "version",
        "class",
        "config",
        "schema",
        "table",
        "data",
        "counts",
        "evicted_unsampled",
        "episodes_retired",
        "rng",
        "extra",
        "trees",
    }
    assert state["trees"] == [[2, 0, None, 1.0]]  # span, extra, alpha, scale of each tree
    assert (state["format"], state["version"], state["class"]) == (
        "lucid_replay.buffer",
        3,
        kind.__name__,
    )
    config = {
        "capacity": 30,
        "device": "cpu",
        "unit": "chunk",
        "max_times_sampled": None,
        "schema": None,  # none declared: the first episode fixed it
    }
    if kind is PrioritizedSequenceReplay:
        config |= {"alpha": 0.6, "beta": 0.4, "epsilon": 1e-6}  # beta as constructed
    assert state["config"] == config
    assert state["schema"] == {
        "serial": [[], "torch.int64"],
        "obs": [[2], "torch.float32"],
        "done": [[], "torch.bool"],
    }

    table = state["table"]
    assert set(table) == {
        "first_id",
        "next_id",
        "oldest_offset",
        "next_offset",
        "generation",
        "columns",
    }
    ranges = {key: value for key, value in table.items() if key != "columns"}
    assert ranges == {
        "first_id": 2,
        "next_id": 6,
        "oldest_offset": 13,
        "next_offset": 41,
        "generation": 0,
    }
    columns = table["columns"]
    assert {name: column.dtype for name, column in columns.items()} == _COLUMN_DTYPES
    rows = columns["episode_id"].shape[0]
    assert rows >= 4 and rows & (rows - 1) == 0  # a power of two holding the 4 stored ids
    for column in columns.values():
        assert column.shape == (rows,) and column.device.type == "cpu"

    data = {name: (values.dtype, tuple(values.shape)) for name, values in state["data"].items()}
    assert data == {  # the 28 stored transitions, oldest first
        "serial": (torch.int64, (28,)),
        "obs": (torch.float32, (28, 2)),
        "done": (torch.bool, (28,)),
    }
    assert state["counts"] == {
        "episodes_added": 6,
        "transitions_added": 41,
        "episodes_evicted": 2,
        "transitions_evicted": 13,
        "chunks_sampled": 4,
    }
    assert (state["evicted_unsampled"], state["episodes_retired"]) == (2, 0)
    assert state["rng"].dtype == torch.uint8 and state["rng"].dim() == 1
    if kind is PrioritizedSequenceReplay:
        # beta annealed halfway to 1; the largest priority set is 2 + epsilon.
        assert state["extra"] == {"beta": pytest.approx(0.7), "max_priority": 2.0 + 1e-6}
    else:
        assert state["extra"] == {}


def test_declared_schema_is_saved_in_the_configuration():
    """A declared schema is saved in ``config["schema"]`` as ``[shape list, dtype name]`` per
    field, as the top-level ``schema`` is, before any episode is added."""
    buffer = SequenceReplay(8, schema={"obs": ((2,), torch.float32), "serial": ((), torch.int64)})
    state = buffer.state_dict()
    declared = {"obs": [[2], "torch.float32"], "serial": [[], "torch.int64"]}
    assert state["config"]["schema"] == state["schema"] == declared
    assert state["data"] == {}


@pytest.mark.parametrize("kind", [SequenceReplay, PrioritizedSequenceReplay])
def test_saved_file_is_the_state_plus_exactly_a_checksum(tmp_path, kind):
    """A file holds the state dict's entries and one more, a SHA-256 ``checksum``; a field's
    data are the state's, in the two pieces either side of the ring's seam where they cross it."""
    buffer = _source(kind)
    path = tmp_path / "buffer.pt"
    buffer.save(path)
    saved = torch.load(path, weights_only=True)
    state = buffer.state_dict()
    assert set(saved) == set(state) | {"checksum"}
    assert re.fullmatch(r"[0-9a-f]{64}", saved.pop("checksum"))
    assert all(len(pieces) == 2 for pieces in saved["data"].values())  # the ring has wrapped
    saved["data"] = {name: torch.cat(pieces) for name, pieces in saved["data"].items()}
    assert comparable(saved) == comparable(state)


def _literal_state(version: int) -> dict:
    """A uniform buffer of capacity 8 written out by hand: episode 0 has 3 steps and
    terminated, episode 1 has 2 and did not; nothing evicted, one chunk drawn from episode 1."""
    return {
        "format": "lucid_replay.buffer",
        "version": version,
        "class": "SequenceReplay",
        # A configuration without "schema" (from before declared schemas) means none declared.
        "config": {"capacity": 8, "device": "cpu", "unit": "chunk", "max_times_sampled": None},
        "schema": {"serial": [[], "torch.int64"], "obs": [[2], "torch.float32"]},
        "table": {
            "first_id": 0,
            "next_id": 2,
            "oldest_offset": 0,
            "next_offset": 5,
            "generation": 0,
            "columns": {
                "episode_id": torch.tensor([0, 1]),
                "start": torch.tensor([0, 3]),
                "length": torch.tensor([3, 2]),
                "terminated": torch.tensor([True, False]),
                "times_sampled": torch.tensor([0, 1]),
                "priority": torch.tensor([1.0, 1.0], dtype=torch.float64),
            },
        },
        "data": {
            "serial": torch.tensor([100, 101, 102, 200, 201]),
            "obs": torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]),
        },
        "counts": {
            "episodes_added": 2,
            "transitions_added": 5,
            "episodes_evicted": 0,
            "transitions_evicted": 0,
            "chunks_sampled": 1,
        },
        "evicted_unsampled": 0,
        "episodes_retired": 0,
        "rng": torch.Generator().manual_seed(0).get_state(),  # opaque: torch's own layout
        "extra": {},
    }


@pytest.mark.parametrize("version", [1, 2, 3])
def test_hand_written_state_loads_with_the_contents_it_spells_out(tmp_path, version):
    """A literal two-episode state (no checksum) loads into exactly the episodes, counters
    and configuration it names; as a version 1 file it loads too."""
    buffer = SequenceReplay(capacity=8, seed=5)
    buffer.load_state_dict(_literal_state(version))
    if version == 1:
        torch.save(_literal_state(version), tmp_path / "old.pt")
        assert comparable(SequenceReplay.load(tmp_path / "old.pt").state_dict()) == comparable(
            buffer.state_dict()
        )
    assert (buffer.capacity, buffer.unit, buffer.max_times_sampled) == (8, "chunk", None)
    assert list(buffer.episode_ids) == [0, 1]
    assert (len(buffer), buffer.num_episodes) == (5, 2)
    assert buffer.schema == {"serial": ((), torch.int64), "obs": ((2,), torch.float32)}
    first, second = buffer[0], buffer[1]
    assert (first.terminated, second.terminated) == (True, False)
    assert first["serial"].tolist() == [100, 101, 102]
    assert second["serial"].tolist() == [200, 201]
    assert first["obs"].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert second["obs"].tolist() == [[6.0, 7.0], [8.0, 9.0]]
    stats = buffer.stats()
    assert (stats["episodes_added"], stats["transitions_added"], stats["chunks_sampled"]) == (
        2,
        5,
        1,
    )
    # The RNG is the one spelled out: the next draw is that of a generator seeded 0.
    twin = SequenceReplay(capacity=8, seed=0)
    twin.add(Episode({"serial": torch.tensor([100, 101, 102]), "obs": first["obs"]}))
    twin.add(Episode({"serial": torch.tensor([200, 201]), "obs": second["obs"]}))
    assert buffer.sample(16, 2).starts.tolist() == twin.sample(16, 2).starts.tolist()
    # The two-row table grows when a third episode arrives.
    assert buffer.add(Episode({"serial": torch.tensor([300]), "obs": torch.zeros(1, 2)})) == 2
    assert buffer[2]["serial"].tolist() == [300]


# ------------------------------------------------------------- refused files and states


@both_engines
def test_prioritized_load_of_a_uniform_file_is_refused(tmp_path):
    """`PrioritizedSequenceReplay.load` of a uniform buffer's file raises ValueError."""
    filled_buffer().save(tmp_path / "uniform.pt")
    with pytest.raises(ValueError, match="must be a PrioritizedSequenceReplay"):
        PrioritizedSequenceReplay.load(tmp_path / "uniform.pt")


def _write_bad_file(kind: str, path, good) -> None:
    """Write to ``path`` a file of ``kind`` that is not a loadable buffer (``good`` is one)."""
    if kind == "foreign-dict":
        torch.save({"weights": torch.zeros(3), "step": 5}, path)
    elif kind == "tensor":
        torch.save(torch.arange(4), path)
    elif kind == "random-bytes":
        path.write_bytes(random.Random(0).randbytes(4096))
    elif kind == "empty-file":
        path.write_bytes(b"")
    elif kind == "truncated":
        data = good.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "other-version":
        state = torch.load(good, weights_only=True)
        state["version"] = 4
        torch.save(state, path)
    else:  # pragma: no cover
        raise AssertionError(kind)


@both_engines
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("foreign-dict", r"must be a 'lucid_replay.buffer' checkpoint, got a mapping"),
        ("tensor", r"must be a 'lucid_replay.buffer' checkpoint, got a torch.int64 tensor"),
        ("random-bytes", r"must be a lucid_replay checkpoint, got an unreadable file"),
        ("empty-file", r"must be a lucid_replay checkpoint, got an unreadable file"),
        ("truncated", r"must be a lucid_replay checkpoint, got an unreadable file"),
        ("other-version", r"checkpoint version must be one of \(1, 2, 3\), got 4"),
    ],
)
def test_load_refuses_a_file_that_is_not_a_buffer(tmp_path, kind, message):
    """Foreign, corrupt, truncated or other-version files raise ValueError (CheckpointError)."""
    good = tmp_path / "good.pt"
    filled_buffer().save(good)
    bad = tmp_path / "bad.pt"
    _write_bad_file(kind, bad, good)
    with pytest.raises(ValueError, match=message) as info:
        SequenceReplay.load(bad)
    assert isinstance(info.value, CheckpointError)


_COMPLETE = r"state must be a complete checkpoint, got one without \['{}'\]"


def _broken_states() -> dict[str, tuple[object, str, str | None]]:
    """State dicts `load_state_dict` must refuse: case -> (state, message, known-bug reason)."""
    source = filled_buffer(capacity=40, lengths=(5, 6, 7))
    source.sample(3, 2)

    def edited(edit):
        state = source.state_dict()
        edit(state)
        return state

    def set_key(key, value):
        return edited(lambda state: state.__setitem__(key, value))

    def delete_key(key):
        return edited(lambda state: state.pop(key))

    def edit_data(name, change):
        return edited(lambda state: state["data"].__setitem__(name, change(state["data"][name])))

    schema = source.state_dict()["schema"]
    config = source.state_dict()["config"]
    cases: dict[str, tuple[object, str, str | None]] = {
        "not-a-mapping": ([1, 2, 3], "checkpoint, got a list", None),
        "other-format": (
            set_key("format", "something.else"),
            "got a mapping with format 'something.else'",
            None,
        ),
        "other-version": (
            set_key("version", 7),
            r"checkpoint version must be one of \(1, 2, 3\), got 7",
            None,
        ),
        "other-class": (
            set_key("class", "PrioritizedSequenceReplay"),
            "checkpoint class must be a SequenceReplay, got 'PrioritizedSequenceReplay'",
            None,
        ),
        "other-capacity": (
            set_key("config", {**config, "capacity": 41}),
            "checkpoint configuration must be .*'capacity': 41",
            None,
        ),
        "other-unit": (
            set_key("config", {**config, "unit": "episode"}),
            "checkpoint configuration must be .*'unit': 'episode'",
            None,
        ),
        "short-data": (
            edit_data("obs", lambda v: v[:-1]),
            r"checkpoint data 'obs' must have shape \(18, 2\), got \(17, 2\)",
            None,
        ),
        "bad-rng": (
            set_key("rng", torch.zeros(3, dtype=torch.uint8)),
            "checkpoint rng must be a state of this buffer's generator",
            None,
        ),
        "bad-dtype-name": (
            set_key("schema", {**schema, "obs": [[2], "float99"]}),
            r"schema\['obs'\] dtype must be a storable torch dtype, got 'float99'",
            None,
        ),
        "missing-format": (delete_key("format"), "got a mapping with format None", None),
        "missing-version": (
            delete_key("version"),
            r"version must be one of \(1, 2, 3\), got None",
            None,
        ),
        "missing-class": (delete_key("class"), "must be a SequenceReplay, got None", None),
        "retired-not-int": (set_key("episodes_retired", "x"), "checkpoint", None),
        "data-other-per-step-shape": (
            edit_data("obs", lambda v: v[:, :1]),  # [T, 1] would broadcast into [T, 2]
            "checkpoint",
            None,
        ),
        "counts-without-keys": (
            set_key("counts", {}),
            "checkpoint",
            None,
        ),
        "table-first-id-after-next-id": (
            edited(lambda state: state["table"].__setitem__("first_id", 5)),
            "checkpoint",
            None,
        ),
    }
    for key in source.state_dict():
        if key == "trees":  # optional: files written before it load (trees rebuilt)
            continue
        if f"missing-{key}" not in cases:
            cases[f"missing-{key}"] = (delete_key(key), _COMPLETE.format(key), None)
    return cases


_BROKEN = _broken_states()


@both_engines
@pytest.mark.parametrize(
    "case",
    [case for case in _BROKEN],
)
def test_failed_load_state_dict_leaves_the_buffer_unchanged(case):
    """A refused state raises ValueError (CheckpointError) and changes nothing, RNG included."""
    state, message, _ = _BROKEN[case]
    target, twin = seeded_twins()
    target.sample(2, 2)
    twin.sample(2, 2)
    with pytest.raises(CheckpointError, match=message) as info:
        target.load_state_dict(state)
    assert isinstance(info.value, ValueError)
    _assert_same_buffer(target, twin)
    assert_batches_equal(target.sample(6, 3), twin.sample(6, 3))


# ----------------------------------------------------------------------- crafted states


def _stored_rows(state) -> list[int]:
    table = state["table"]
    slots = table["columns"]["episode_id"].shape[0]
    return [i % slots for i in range(table["first_id"], table["next_id"])]


def _edit_column(name, row_index, value):
    def edit(state):
        state["table"]["columns"][name][_stored_rows(state)[row_index]] = value

    return edit


def _set(path, value):
    def edit(state):
        *parents, last = path
        node = state
        for key in parents:
            node = node[key]
        node[last] = value

    return edit


def _retype_column(name, dtype):
    def edit(state):
        columns = state["table"]["columns"]
        columns[name] = columns[name].to(dtype)

    return edit


def _overlapping_start(state):
    rows = _stored_rows(state)
    state["table"]["columns"]["start"][rows[1]] -= 1


def _start_past_the_newest_offset(state):
    rows = _stored_rows(state)
    state["table"]["columns"]["start"][rows[2]] = state["table"]["next_offset"] + 5


def _move_length(new_length):
    """Give row 2 ``new_length`` steps and row 1 the difference, so the total still fits."""

    def edit(state):
        rows, lengths = _stored_rows(state), state["table"]["columns"]["length"]
        lengths[rows[1]] += lengths[rows[2]] - new_length
        lengths[rows[2]] = new_length

    return edit


def _free_row_claims_a_stored_id(state):
    stored = set(_stored_rows(state))
    free = next(
        row for row in range(len(state["table"]["columns"]["episode_id"])) if row not in stored
    )
    state["table"]["columns"]["episode_id"][free] = state["table"]["first_id"]


def _shift_ids(shift):
    """Add ``shift`` to every id and id counter: consistent, only the ids are huge."""

    def edit(state):
        table, counts = state["table"], state["counts"]
        rows = _stored_rows(state)
        table["first_id"] += shift
        table["next_id"] += shift
        table["columns"]["episode_id"][rows] += shift
        counts["episodes_added"] += shift
        counts["episodes_evicted"] += shift

    return edit


_CRAFTED = {
    "overlapping-starts": _overlapping_start,
    "start-before-the-oldest-offset": _edit_column("start", 0, 0),
    "start-past-the-newest-offset": _start_past_the_newest_offset,
    "zero-length": _move_length(0),
    "negative-length": _move_length(-4),
    "row-claims-another-id": _edit_column("episode_id", 1, 0),
    "free-row-claims-a-stored-id": _free_row_claims_a_stored_id,
    "empty-schema-with-data": _set(("schema",), {}),
    "float-start-column": _retype_column("start", torch.float64),
    "float32-priority-column": _retype_column("priority", torch.float32),
    "int32-length-column": _retype_column("length", torch.int32),
    "negative-counter": _set(("counts", "episodes_added"), -1),
    "bool-counter": _set(("counts", "chunks_sampled"), True),
    "float-counter": _set(("counts", "chunks_sampled"), 4.0),
    "counters-contradict-ids": _set(("counts", "episodes_added"), 99),
    "negative-retired": _set(("episodes_retired",), -1),
    "negative-times-sampled": _edit_column("times_sampled", 0, -5),
    "nan-priority": _edit_column("priority", 0, math.nan),
    "inf-priority": _edit_column("priority", 1, math.inf),
    "negative-priority": _edit_column("priority", 2, -1.0),
    "zero-priority": _edit_column("priority", 3, 0.0),
    "nan-max-priority": _set(("extra", "max_priority"), math.nan),
    "max-priority-below-a-stored-priority": _set(("extra", "max_priority"), 1.0),
    "negative-beta": _set(("extra", "beta"), -0.5),
    "string-beta": _set(("extra", "beta"), "0.5"),
    "negative-generation": _set(("table", "generation"), -1),
    "ids-near-the-int64-limit": _set(("table", "next_id"), 2**63 - 1),
    "ids-beyond-2-to-the-62": _shift_ids(2**62),
    "zeroed-rng": lambda state: state.__setitem__("rng", torch.zeros_like(state["rng"])),
    "float-rng": lambda state: state.__setitem__("rng", state["rng"].float()),
    "data-of-another-dtype": lambda state: state["data"].__setitem__(
        "obs", state["data"]["obs"].double()
    ),
}


@pytest.mark.parametrize("case", sorted(_CRAFTED))
def test_crafted_state_is_refused_and_changes_nothing(case):
    """A state breaking one invariant is a `CheckpointError`; the buffer is unchanged
    (each case loaded, or raised another error after a partial commit, on the old code)."""
    state = _source().state_dict()
    _CRAFTED[case](state)
    target = _target()
    before = snapshot(target)
    with pytest.raises(CheckpointError):
        target.load_state_dict(state)
    assert snapshot(target) == before


def test_zero_row_table_is_refused():
    """An empty buffer's state with a table of no rows is refused (old: loaded, then the
    first add could never grow the table)."""
    state = PrioritizedSequenceReplay(capacity=30).state_dict()
    state["table"]["columns"] = {k: v[:0] for k, v in state["table"]["columns"].items()}
    target = PrioritizedSequenceReplay(capacity=30)
    with pytest.raises(CheckpointError, match="rows"):
        target.load_state_dict(state)
    target.add(make_episode(3))


def test_times_sampled_beyond_the_reuse_limit_is_refused():
    """A count above ``max_times_sampled`` contradicts the reuse limit (old: loaded)."""
    state = _source(max_times_sampled=3).state_dict()
    _edit_column("times_sampled", 0, 7)(state)
    target = _target(max_times_sampled=3)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match="times_sampled"):
        target.load_state_dict(state)
    assert snapshot(target) == before


def test_uniform_buffer_state_with_a_priority_other_than_one_is_refused():
    """A uniform buffer's priorities are all 1; another value is a crafted state."""
    state = _source(SequenceReplay).state_dict()
    _edit_column("priority", 0, 2.0)(state)
    with pytest.raises(CheckpointError, match="priority"):
        _target(SequenceReplay).load_state_dict(state)


def test_every_flipped_rng_bit_is_a_checkpoint_error_or_loads_whole():
    """Flipped RNG bits are refused with `CheckpointError` before anything is replaced, never
    a torch `RuntimeError` after it (old: RuntimeError with the buffer half replaced)."""
    source = _source()
    refused = 0
    for bit in range(0, 5056 * 8, 41):
        state = source.state_dict()
        state["rng"][bit // 8] ^= 1 << (bit % 8)
        target = _target()
        before = snapshot(target)
        try:
            target.load_state_dict(state)
        except CheckpointError:
            refused += 1
            assert snapshot(target) == before
    assert refused > 0  # torch refuses some of these states, so the path above ran


def test_valid_state_loads_after_refusals():
    """The checks refuse nothing a real buffer produces: a round trip continues exactly."""
    source = _source(max_times_sampled=5)
    target = _target(max_times_sampled=5)
    target.load_state_dict(source.state_dict())
    assert snapshot(target) == snapshot(source)


# ------------------------------------------------------------------------------- files


def _write(path, state) -> None:
    torch.save(state, path)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda config: config.pop("capacity"), "configuration"),
        (lambda config: config.__setitem__("capacity", "30"), "configuration"),
        (lambda config: config.__setitem__("alpha", None), "configuration"),
        (lambda config: config.__setitem__("colour", "red"), "configuration"),
        (lambda config: config.__setitem__("unit", "window"), "configuration"),
    ],
    ids=["missing", "string-capacity", "none-alpha", "unknown-key", "bad-unit"],
)
def test_header_valid_file_with_a_bad_configuration_is_a_checkpoint_error(tmp_path, edit, match):
    """A bad configuration in a valid header is a `CheckpointError` (old: KeyError, TypeError)."""
    path = tmp_path / "buffer.pt"
    _source().save(path)
    state = torch.load(path, weights_only=True)
    edit(state["config"])
    state.pop("checksum", None)
    state["version"] = 1  # no checksum to recompute
    _write(path, state)
    with pytest.raises(CheckpointError, match=match):
        SequenceReplay.load(path)


@pytest.mark.parametrize("config", ["absent", None, "a string", 3])
def test_version_1_header_without_a_configuration_is_a_checkpoint_error(tmp_path, config):
    """A version-1 file whose header holds no configuration mapping is a `CheckpointError`
    naming the configuration (old: KeyError('config') for a missing one)."""
    for cls in (SequenceReplay, PrioritizedSequenceReplay):
        state = {"format": "lucid_replay.buffer", "version": 1, "class": cls.__name__}
        if config != "absent":
            state["config"] = config
        _write(tmp_path / "v1.pt", state)
        with pytest.raises(CheckpointError, match="checkpoint configuration must be a mapping"):
            cls.load(tmp_path / "v1.pt")


def test_flipped_data_bit_in_a_file_is_refused(tmp_path):
    """A bit flipped inside stored data fails the checksum (old: loaded the flipped value)."""
    source = _source()
    path = tmp_path / "buffer.pt"
    source.save(path)
    raw = bytearray(path.read_bytes())
    needle = source[source.episode_ids[1]]["serial"].numpy().tobytes()
    at = raw.find(needle)
    assert at > 0
    raw[at + 3] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum"):
        SequenceReplay.load(path)


def test_file_carries_a_checksum_of_its_payload(tmp_path):
    """A saved file is version 3 with a ``checksum`` entry; without it, it is refused."""
    path = tmp_path / "buffer.pt"
    _source().save(path)
    state = torch.load(path, weights_only=True)
    assert state["version"] == 3
    assert isinstance(state["checksum"], str) and len(state["checksum"]) == 64
    del state["checksum"]
    _write(path, state)
    with pytest.raises(CheckpointError, match="checksum"):
        SequenceReplay.load(path)


def test_version_1_file_still_loads(tmp_path):
    """A file in the format before checksums (version 1) loads and continues exactly."""
    source = _source()
    state = source.state_dict()
    state["version"] = 1
    path = tmp_path / "old.pt"
    _write(path, state)
    loaded = SequenceReplay.load(path)
    assert type(loaded) is PrioritizedSequenceReplay
    assert torch.equal(loaded.sample(8, 2).starts, source.sample(8, 2).starts)


@both_engines
def test_save_is_atomic_and_leaves_no_temporary_file(tmp_path):
    """`save` writes through a temporary file that is renamed: only the target remains."""
    buffer = filled_buffer()
    buffer.save(tmp_path / "buffer.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffer.pt"]
    buffer.add(make_episode(3))
    buffer.save(tmp_path / "buffer.pt")  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffer.pt"]
    assert SequenceReplay.load(tmp_path / "buffer.pt").stats() == buffer.stats()


@both_engines
def test_failed_save_keeps_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    """A save that fails mid-write leaves the previous file intact and no temporary file."""
    buffer = filled_buffer()
    path = tmp_path / "buffer.pt"
    buffer.save(path)
    before = path.read_bytes()
    buffer.add(make_episode(3))

    def failing_save(obj, file, *args, **kwargs):
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        buffer.save(path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffer.pt"]
    assert path.read_bytes() == before


@pytest.mark.parametrize("segment_length", [None, 3])
def test_a_load_rebuilds_the_sum_trees_bitwise_at_their_saved_scales(segment_length) -> None:
    """A tree's leaves are ``(p / scale) ** alpha``: rebuilt at another scale (the largest
    priority at load time) they would differ in their last bits, and so could draws."""
    from lucid_replay import Episode, PrioritizedSequenceReplay

    buffer = PrioritizedSequenceReplay(
        capacity=100, alpha=0.7, seed=0, segment_length=segment_length
    )
    for length in (5, 7, 9):
        buffer.add(Episode({"x": torch.arange(length)}))
    buffer.sample_prioritized(4, 2)  # builds the tree at scale 1 (every priority is 1)
    buffer.update_priorities(list(buffer.episode_ids), [0.3, 0.1, 0.7])
    live = buffer._core.sampler.trees.cached(2, Prioritized(0.7))
    loaded = PrioritizedSequenceReplay(capacity=100, alpha=0.7, segment_length=segment_length)
    loaded.load_state_dict(buffer.state_dict())
    rebuilt = loaded._core.sampler.trees.cached(2, Prioritized(0.7))
    assert rebuilt.scale == live.scale == 1.0
    assert torch.equal(rebuilt.nodes, live.nodes)
    fresh = loaded._core.sampler.trees._build(2, 0, Prioritized(0.7))  # what a load rebuilt before
    assert fresh.scale != live.scale and not torch.equal(fresh.nodes, live.nodes)
