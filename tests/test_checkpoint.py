"""Checkpoints: a state that loads is sound, or it is refused with `CheckpointError`.

Crafted states break one invariant each (of the episode table, the data, the counters, the RNG
state or the priority state); files carry a checksum of their payload.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_episode, snapshot

from lucid_replay import CheckpointError, PrioritizedSequenceReplay, SequenceReplay


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
    """A saved file is version 2 with a ``checksum`` entry; without it, it is refused."""
    path = tmp_path / "buffer.pt"
    _source().save(path)
    state = torch.load(path, weights_only=True)
    assert state["version"] == 2
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
