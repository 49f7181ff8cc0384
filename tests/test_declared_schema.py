"""Declared schemas (``schema=``: fixed at construction, same-kind casts at ``add``) and
``num_eligible`` (what a draw of a window can choose from now)."""

from __future__ import annotations

import numpy as np
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

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic

SCHEMA = {
    "obs": ((2,), torch.float32),
    "reward": ((), torch.float32),
    "action": ((), torch.int64),
}


def _episode(length: int, **dtypes: torch.dtype) -> Episode:
    steps = {
        "obs": torch.arange(2 * length, dtype=torch.float64).reshape(length, 2),
        "reward": torch.linspace(0, 1, length, dtype=torch.float64),
        "action": torch.arange(length),
    }
    return Episode({name: t.to(dtypes.get(name, t.dtype)) for name, t in steps.items()})


@pytest.mark.parametrize("kind", [SequenceReplay, PrioritizedSequenceReplay])
def test_declared_schema_is_returned_before_any_add(kind):
    """``buffer.schema`` is the declared one from construction on, shapes as tuples."""
    buffer = kind(capacity=50, schema={**SCHEMA, "obs": ([2], torch.float32)})
    assert buffer.schema == SCHEMA
    assert len(buffer) == 0 and buffer.num_episodes == 0


def test_add_casts_same_kind_dtypes_to_the_declared_ones():
    """float64 rewards and observations become float32, bool and ints cast up; values kept."""
    buffer = SequenceReplay(capacity=50, schema=SCHEMA, seed=0)
    episode = _episode(5)  # obs, reward float64
    episode_id = buffer.add(episode)
    stored = buffer[episode_id]
    assert {name: t.dtype for name, t in stored.steps.items()} == {
        name: dtype for name, (_, dtype) in SCHEMA.items()
    }
    assert torch.equal(stored["reward"], episode["reward"].float())
    assert torch.equal(stored["obs"], episode["obs"].float())
    ints = buffer.add(_episode(4, obs=torch.int32, action=torch.int8))  # int -> float, up
    assert torch.equal(buffer[ints]["obs"], _episode(4)["obs"].float())
    assert buffer.sample(8, 3)["reward"].dtype == torch.float32


@pytest.mark.parametrize(
    "episode, error, match",
    [
        (_episode(3, action=torch.float32), SchemaDtypeError, "'action' must have a dtype"),
        (
            Episode(
                {
                    "obs": torch.zeros(3, 2, dtype=torch.complex64),
                    "reward": torch.zeros(3),
                    "action": torch.zeros(3, dtype=torch.int64),
                }
            ),
            SchemaDtypeError,
            "casts to torch.float32",
        ),
        (
            Episode(
                {
                    "obs": torch.zeros(3, 3),
                    "reward": torch.zeros(3),
                    "action": torch.zeros(3, dtype=torch.int64),
                }
            ),
            SchemaError,
            r"'obs' must have per-step shape \(2,\)",
        ),
        (Episode({"obs": torch.zeros(3, 2)}), SchemaError, "missing"),
    ],
    ids=["float-to-int", "complex-to-float", "shape", "missing-field"],
)
def test_casts_beyond_same_kind_shapes_and_fields_are_refused(episode, error, match):
    """Floats into int fields, complex into floats, other shapes or fields: refused, and
    the buffer is unchanged."""
    buffer = SequenceReplay(capacity=50, schema=SCHEMA, seed=0)
    buffer.add(_episode(4))
    assert_refused(buffer, lambda: buffer.add(episode), error, match)


NARROW = {
    "small": ((), torch.int8),
    "unsigned": ((), torch.uint8),
    "half": ((), torch.float16),
    "single": ((), torch.float32),
    "pair": ((), torch.complex64),
}


def _narrowing(**values: list) -> Episode:
    steps = {
        "small": torch.tensor([1, -2]),
        "unsigned": torch.tensor([0, 255], dtype=torch.uint16),
        "half": torch.tensor([1.5, -65504.0], dtype=torch.float64),
        "single": torch.tensor([1.0, 3.0e38], dtype=torch.float64),
        "pair": torch.tensor([1 + 1j, -3.0e38j], dtype=torch.complex128),
    }
    for name, given in values.items():
        steps[name] = torch.tensor(given, dtype=steps[name].dtype)
    return Episode(steps)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"small": [300, 1]}, r"steps\['small'\] must be in \[-128, 127\] .*int8, got 300"),
        ({"small": [1, -129]}, r"steps\['small'\] must be in \[-128, 127\] .*got -129"),
        ({"unsigned": [3, 256]}, r"steps\['unsigned'\] must be in \[0, 255\] .*got 256"),
        ({"half": [1e6, 0.0]}, r"steps\['half'\] must be finite values of magnitude <= 65504"),
        ({"half": [0.0, -70000.0]}, r"steps\['half'\] .*got 70000, which would become inf"),
        ({"single": [1e39, 0.0]}, r"steps\['single'\] .*float32, got 1e\+39"),
        ({"pair": [1e39j, 0]}, r"steps\['pair'\] .*complex64, got 1e\+39"),
    ],
    ids=[
        "int8-high",
        "int8-low",
        "uint16-to-uint8",
        "half",
        "half-int",
        "single",
        "complex",
    ],
)
def test_a_declared_cast_that_would_change_a_value_is_refused(values, match):
    """Narrowing casts keep every value or are refused, naming the field and the value: an
    integer out of the declared dtype's range (old: wrapped, 300 -> 44) or a finite number
    beyond its largest finite value (old: became inf); nothing is stored."""
    buffer = SequenceReplay(capacity=50, schema=NARROW, seed=0)
    buffer.add(_narrowing())
    assert_refused(buffer, lambda: buffer.add(_narrowing(**values)), ValueError, match)
    assert_refused(
        buffer, lambda: buffer.extend([_narrowing(), _narrowing(**values)]), ValueError, match
    )


def test_declared_casts_keep_values_that_fit_and_non_finite_ones():
    """Values inside the declared dtype's range cast as numpy would (floats rounded); NaN
    and infinities stay what they are."""
    buffer = SequenceReplay(capacity=50, schema=NARROW, seed=0)
    stored = buffer[buffer.add(_narrowing(half=[float("inf"), float("nan")]))]
    assert stored["small"].tolist() == [1, -2] and stored["unsigned"].tolist() == [0, 255]
    assert stored["half"][0].item() == float("inf") and stored["half"][1].isnan()
    assert stored["single"].tolist() == torch.tensor([1.0, 3.0e38]).tolist()
    assert stored["pair"].dtype == torch.complex64


@pytest.mark.parametrize(
    "schema, error, match",
    [
        ({}, TypeError, "non-empty mapping"),
        ({"obs": ((2,), "float32")}, TypeError, "torch.dtype"),
        ({"obs": ((-1,), torch.float32)}, ValueError, "ints >= 0"),
        ({"obs": ((True,), torch.float32)}, ValueError, "ints >= 0"),
        ({"obs": (2, torch.float32)}, TypeError, "pair"),
        ({"is_init": ((), torch.bool)}, SchemaError, "per-record entries"),
        ({"x": ((), torch.uint16)}, SchemaDtypeError, "store it as torch.int32"),
        ({1: ((), torch.float32)}, TypeError, "names must be str"),
    ],
)
def test_bad_declared_schemas_are_refused_at_construction(schema, error, match):
    """A declared schema is validated when the buffer is built, naming what is wrong."""
    with pytest.raises(error, match=match):
        SequenceReplay(capacity=10, schema=schema)


def test_declared_schema_survives_save_and_load(tmp_path):
    """A declared schema is part of the configuration: load restores and keeps casting."""
    buffer = PrioritizedSequenceReplay(capacity=50, schema=SCHEMA, seed=3)
    path = tmp_path / "declared.pt"
    buffer.save(path)  # nothing stored yet, but the schema is fixed
    loaded = SequenceReplay.load(path)
    assert loaded.schema == SCHEMA
    loaded.add(_episode(4))  # float64 still casts
    assert loaded[0]["reward"].dtype == torch.float32
    undeclared = PrioritizedSequenceReplay(capacity=50, seed=3)
    with pytest.raises(ValueError, match="configuration"):
        undeclared.load_state_dict(buffer.state_dict())


# ------------------------------------------------------------------------- num_eligible


def test_num_eligible_counts_anchors_or_episodes_as_a_draw_would():
    """Chunk unit: eligible anchors of the window; episode unit: episodes with one."""
    chunks = SequenceReplay(capacity=100, seed=0)
    episodes = SequenceReplay(capacity=100, unit="episode", seed=0)
    for buffer in (chunks, episodes):
        buffer.extend(make_episode(n) for n in (3, 6, 10))
    assert chunks.num_eligible(Window(4)) == 0 + 3 + 7
    assert chunks.num_eligible(Window(4, allow_partial=True)) == 19
    assert chunks.num_eligible(Window(2, burn_in=5, bootstrap=3)) == 2 + 5 + 9  # burn-in free
    assert chunks.num_eligible(Window(11)) == 0
    assert episodes.num_eligible(Window(4)) == 2
    assert SequenceReplay(capacity=10).num_eligible(Window(1)) == 0


def test_num_eligible_excludes_retired_episodes_and_follows_evictions():
    """Episodes at the reuse limit leave the count; so do evicted ones."""
    buffer = SequenceReplay(capacity=20, seed=0, max_times_sampled=1)
    buffer.extend(make_episode(5) for _ in range(3))
    assert buffer.num_eligible(Window(5)) == 3
    buffer.sample(2, 5)  # two episodes drawn once: retired
    assert buffer.num_eligible(Window(5)) == 1
    buffer.add(make_episode(5))  # the retired oldest are reclaimed to make room
    assert buffer.num_eligible(Window(5)) == 2


def test_num_eligible_refuses_a_non_window():
    """``num_eligible`` takes a `Window`."""
    with pytest.raises(TypeError, match="window must be a Window"):
        SequenceReplay(capacity=10).num_eligible(4)


def test_num_eligible_is_what_a_loop_waits_on():
    """A loop waiting for ``num_eligible > 0`` can then sample without an error."""
    buffer = PrioritizedSequenceReplay(capacity=100, seed=0)
    window = Window(8, burn_in=2)
    for length in np.arange(3, 12):
        if buffer.num_eligible(window):
            break
        buffer.add(make_episode(int(length)))
    assert buffer.sample_windows(4, window).batch_size == 4


@pytest.mark.parametrize("as_stored", [True, False])
def test_a_stream_stores_the_first_steps_of_a_declared_schema(as_stored: bool) -> None:
    """Steps streamed before any add allocate the declared storage (as stored or cast)."""
    buffer = SequenceReplay(50, schema={"obs": ((2,), torch.float32)}, segment_length=4)
    stream = buffer.open_episode()
    steps = torch.arange(12.0).view(6, 2)
    stream.append({"obs": steps if as_stored else steps.double()})
    stream.close(terminated=True)
    assert torch.equal(buffer[0]["obs"], steps)
