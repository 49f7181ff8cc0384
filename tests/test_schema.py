"""`Schema`: which dtypes and field names a buffer stores, and that every stored dtype works.

A dtype is accepted at `add` only if the buffer can store it, read it back, save it and gather
it across the ring's seam; every accepted dtype is exercised here through all of those paths.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_refused, make_episode

from lucid_replay import (
    Episode,
    PrioritizedSequenceReplay,
    SchemaDtypeError,
    SchemaError,
    SequenceReplay,
    Window,
)
from lucid_replay.schema import RESERVED_NAMES, SUPPORTED_DTYPES, Schema

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic


def _values(dtype: torch.dtype, length: int, first: int) -> torch.Tensor:
    """Distinct-ish per-step values ``[length, 2]`` of ``dtype``."""
    base = torch.arange(first, first + 2 * length).reshape(length, 2) % 120
    if dtype == torch.bool:
        return base % 2 == 0
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


def _episode(dtype: torch.dtype, length: int, first: int) -> Episode:
    serial = torch.arange(first, first + length)
    return Episode({"serial": serial, "x": _values(dtype, length, first)}, terminated=True)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_every_accepted_dtype_is_stored_read_gathered_across_the_seam_and_saved(dtype, tmp_path):
    """Each accepted dtype round-trips through add, lookup, chunk and window gathers across
    the ring's seam, write-back and save/load (old: uint16/32/64 failed some of these)."""
    buffer = PrioritizedSequenceReplay(capacity=20, seed=0)
    episodes = {buffer.add(_episode(dtype, 7, 7 * i)): _episode(dtype, 7, 7 * i) for i in range(4)}
    wrapped = buffer.episode_ids[0]  # ids 2 and 3 stored; id 2 wraps across the seam
    assert buffer.schema["x"] == ((2,), dtype)
    assert torch.equal(buffer[wrapped]["x"], episodes[wrapped]["x"])
    chunks = buffer.sample(64, 7)
    for row, episode_id in enumerate(chunks.episode_ids.tolist()):
        assert torch.equal(chunks["x"][row], episodes[episode_id]["x"])
    windows = buffer.gather_windows(
        [wrapped] * 3, [0, 3, 6], Window(3, burn_in=2, bootstrap=2, boundary="include_reset")
    )
    assert windows["x"].dtype == dtype
    values = _values(dtype, 3 * 7, 500).reshape(3, 7, 2)
    assert buffer.write_back(windows, "x", values) == int(windows.validity_mask.sum())
    path = tmp_path / "buffer.pt"
    buffer.save(path)
    loaded = SequenceReplay.load(path)
    for episode_id in buffer.episode_ids:
        assert torch.equal(loaded[episode_id]["x"], buffer[episode_id]["x"])


@pytest.mark.parametrize(
    "dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn], ids=str
)
def test_dtypes_the_buffer_cannot_gather_are_refused_at_add(dtype):
    """uint16/32/64 and float8 are refused at `add` with the reason (old: accepted, then
    failed to read back, save or gather across the seam)."""
    buffer = SequenceReplay(capacity=20, seed=0)
    buffer.add(make_episode(3))
    fresh = SequenceReplay(capacity=20, seed=0)
    episode = Episode({"x": torch.zeros(3, 2, dtype=dtype)})
    assert_refused(
        fresh, lambda: fresh.add(episode), SchemaDtypeError, "must have a dtype the buffer can"
    )
    assert fresh.schema is None


def test_unsigned_dtype_refusal_suggests_a_wider_signed_one():
    """The refusal of uint16 says which dtype to store instead."""
    with pytest.raises(SchemaDtypeError, match=r"store it as torch\.int32"):
        SequenceReplay(capacity=10).add(Episode({"x": torch.zeros(3, dtype=torch.uint16)}))


@pytest.mark.parametrize("name", RESERVED_NAMES)
def test_field_named_like_a_per_record_entry_is_refused_at_the_first_add(name):
    """A stored field named like a per-record entry (``is_init`` as TorchRL's InitTracker
    writes it) is refused, so `WindowBatch.flat` never replaces it (old: silently lost)."""
    buffer = SequenceReplay(capacity=20, seed=0)
    episode = Episode({"obs": torch.zeros(3, 2), name: torch.zeros(3, dtype=torch.bool)})
    assert_refused(buffer, lambda: buffer.add(episode), SchemaError, f"got '{name}': rename")


def test_flat_keeps_every_stored_field_beside_the_per_record_entries():
    """Every stored field survives `flat` unchanged: no per-record entry shares its name."""
    buffer = SequenceReplay(capacity=50, seed=0)
    buffer.add(make_episode(9))
    batch = buffer.sample_windows(4, Window(3, burn_in=1))
    flat = batch.flat()
    for name in batch.data:
        assert torch.equal(flat[name], batch[name].flatten(0, 1))
    assert set(RESERVED_NAMES) <= set(flat)


def test_schema_compares_equal_to_a_plain_mapping_in_any_order():
    """`Schema` is an immutable mapping equal to the dict with the same entries."""
    schema = Schema({"a": ((2,), torch.float32), "b": ((), torch.int64)})
    assert schema == {"b": ((), torch.int64), "a": ((2,), torch.float32)}
    assert hash(schema) == hash(Schema(dict(reversed(list(schema.items())))))
    with pytest.raises(TypeError):
        schema["c"] = ((), torch.bool)  # type: ignore[index]


def test_schema_state_round_trip_and_refusals():
    """`to_state`/`from_state` round-trip; unknown dtype names and bad shapes are refused."""
    schema = Schema({"a": ((2, 3), torch.bfloat16), "b": ((), torch.bool)})
    assert Schema.from_state(schema.to_state()) == schema
    with pytest.raises(ValueError, match="dtype"):
        Schema.from_state({"a": [[2], "torch.uint16"]})
    with pytest.raises(ValueError, match="shape"):
        Schema.from_state({"a": [[True], "torch.float32"]})
    with pytest.raises(TypeError):
        Schema.from_state([["a", [2], "torch.float32"]])


def test_a_field_with_no_elements_per_step_goes_through_every_path():
    """A field of shape ``(2, 0)`` is stored, gathered (runs, repairs, record by record
    across episodes), written back and restored (it failed to reshape before)."""
    buffer = PrioritizedSequenceReplay(capacity=50, seed=0)
    for _ in range(12):  # wraps the ring
        buffer.add(Episode({"x": torch.arange(7.0), "e": torch.zeros(7, 2, 0)}, terminated=True))
    assert buffer.sample(8, 3)["e"].shape == (8, 3, 2, 0)
    assert buffer.sample_windows(8, Window(3, burn_in=4, bootstrap=2))["e"].shape == (8, 9, 2, 0)
    across = buffer.sample_windows(8, Window(3, burn_in=2, bootstrap=2, boundary="include_reset"))
    assert across["e"].shape == (8, 7, 2, 0)
    assert buffer.write_back(across, "e", torch.zeros(8, 7, 2, 0)) > 0
    buffer.load_state_dict(buffer.state_dict())
    assert buffer[buffer.episode_ids[0]]["e"].shape == (7, 2, 0)


def test_a_schema_pickles_without_its_hash():
    """A schema's hash is cached, but not pickled: string hashes are salted per process, so
    a copy recomputes its own (and still equals and hashes like the original here)."""
    import pickle

    schema = Schema({"obs": ((3,), torch.float32), "done": ((), torch.bool)})
    hash(schema)  # cached now
    copy = pickle.loads(pickle.dumps(schema))
    assert copy._hash is None
    assert copy == schema and hash(copy) == hash(schema)
    assert {schema: 1}[copy] == 1
