"""`Episode`, one whole episode as per-step tensors: construction, conversion, immutability
and every refusal."""

from __future__ import annotations

import copy
import pickle

import attrs
import numpy as np
import pytest
import torch
from conftest import make_episode

from lucid_replay import Episode, InvalidArgumentError, SchemaDtypeError

# --------------------------------------------------------------------------- construction


def test_tensor_fields_are_kept_with_their_shape_and_dtype():
    """Tensor fields keep their values, shape and dtype; `len` is the leading length T."""
    obs = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    action = torch.tensor([1, 0, 2, 1], dtype=torch.int64)
    episode = Episode({"obs": obs, "action": action})
    assert len(episode) == 4
    assert torch.equal(episode["obs"], obs)
    assert episode["obs"].dtype == torch.float32
    assert torch.equal(episode["action"], action)
    assert episode["action"].dtype == torch.int64
    assert list(episode.keys()) == ["obs", "action"]
    assert episode.terminated is False


def test_numpy_field_shares_memory_with_a_c_contiguous_array():
    """A C-contiguous numpy array becomes a tensor without a copy (writes show through)."""
    array = np.arange(6, dtype=np.float32).reshape(3, 2)
    episode = Episode({"obs": array})
    field = episode["obs"]
    assert isinstance(field, torch.Tensor)
    assert field.dtype == torch.float32
    assert field.shape == (3, 2)
    assert np.shares_memory(field.numpy(), array)
    array[1, 1] = 42.0
    assert float(field[1, 1]) == 42.0


def test_numpy_field_with_negative_strides_is_converted():
    """A reversed (negative-stride) numpy view is accepted, with the right values."""
    array = np.arange(5, dtype=np.int64)[::-1]
    episode = Episode({"x": array})
    assert episode["x"].tolist() == [4, 3, 2, 1, 0]


def test_list_fields_become_tensors():
    """Nested Python sequences become tensors with torch's default dtypes."""
    episode = Episode({"reward": [1.0, 0.0, 2.0], "action": [[1, 2], [3, 4], [5, 6]]})
    assert len(episode) == 3
    assert episode["reward"].dtype == torch.float32
    assert episode["reward"].tolist() == [1.0, 0.0, 2.0]
    assert episode["action"].dtype == torch.int64
    assert episode["action"].shape == (3, 2)


def test_terminated_flag_is_stored():
    """`terminated=True` is kept; the default is False (truncated or stopped)."""
    assert Episode({"x": [1, 2]}, terminated=True).terminated is True
    assert Episode({"x": [1, 2]}).terminated is False


def test_single_step_episode_is_valid():
    """T == 1 is the smallest valid episode."""
    episode = Episode({"x": torch.zeros(1, 5)})
    assert len(episode) == 1


def test_conftest_helper_builds_consecutive_serials():
    """The `make_episode` helper gives consecutive int64 serials and a done flag at the end."""
    episode = make_episode(4, first_serial=70)
    assert episode["serial"].tolist() == [70, 71, 72, 73]
    assert episode["obs"][:, 1].tolist() == [-70.0, -71.0, -72.0, -73.0]
    assert episode["done"].tolist() == [False, False, False, True]


# ------------------------------------------------------------------------------- frozen


@pytest.mark.parametrize("attribute", ["steps", "terminated"])
def test_fields_cannot_be_rebound(attribute):
    """The episode is frozen: re-binding a field raises FrozenInstanceError."""
    episode = Episode({"x": [1.0, 2.0]})
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(episode, attribute, {"x": [3.0]} if attribute == "steps" else True)
    assert episode["x"].tolist() == [1.0, 2.0]
    assert episode.terminated is False


# ------------------------------------------------------------------------------- errors


def test_schema_states_per_step_shapes_and_dtypes():
    """An episode's schema maps each field to its per-step shape and dtype, read-only."""
    episode = Episode({"obs": torch.zeros(3, 4, 2), "done": [False, False, True]})
    assert dict(episode.schema) == {"obs": ((4, 2), torch.float32), "done": ((), torch.bool)}
    with pytest.raises(TypeError):
        episode.schema["obs"] = ((1,), torch.float32)  # type: ignore[index]


def test_host_views_exist_only_when_every_field_has_one():
    """Every field a CPU tensor numpy can view: views of the same memory; otherwise none."""
    obs = torch.zeros(3, 2)
    viewed = Episode({"obs": obs, "flag": [True, False, True]})
    assert viewed._host_steps is not None
    obs[0, 0] = 7.0
    assert viewed._host_steps["obs"][0, 0] == 7.0
    assert Episode({"obs": obs, "half": torch.zeros(3, dtype=torch.bfloat16)})._host_steps is None
    assert Episode({"obs": obs.clone().requires_grad_()})._host_steps is None


def test_pickles_and_copies_with_views_of_its_own_tensors():
    """A round trip (as through a multiprocessing queue) rebuilds views over the new tensors."""
    episode = Episode({"obs": torch.arange(6.0).reshape(3, 2), "done": [False, False, True]})
    for copied in (pickle.loads(pickle.dumps(episode)), copy.deepcopy(episode)):
        assert copied.terminated is episode.terminated and len(copied) == 3
        assert dict(copied.schema) == dict(episode.schema)
        assert torch.equal(copied["obs"], episode["obs"])
        copied["obs"][0, 0] = 42.0
        assert copied._host_steps is not None and copied._host_steps["obs"][0, 0] == 42.0
        assert episode["obs"][0, 0] == 0.0


def test_empty_mapping_is_refused():
    """An empty mapping raises ValueError saying it is empty."""
    with pytest.raises(ValueError, match="empty mapping"):
        Episode({})


def test_zero_length_is_refused():
    """T == 0 raises ValueError naming the fields and their lengths."""
    with pytest.raises(ValueError, match=r"T must be >= 1, got lengths \{'obs': 0, 'r': 0\}"):
        Episode({"obs": torch.zeros(0, 3), "r": []})


def test_mismatched_lengths_are_refused():
    """Fields with different leading lengths raise ValueError naming each field's length."""
    with pytest.raises(ValueError, match=r"'obs': 3, 'reward': 4") as info:
        Episode({"obs": torch.zeros(3, 2), "reward": torch.zeros(4)})
    assert isinstance(info.value, InvalidArgumentError)


@pytest.mark.parametrize("value", [torch.tensor(1.5), np.array(2.0)], ids=["tensor-0d", "numpy-0d"])
def test_zero_dimensional_value_is_refused(value):
    """A 0-d tensor or array raises ValueError naming the field."""
    with pytest.raises(ValueError, match=r"steps\['scalar'\] .*0-d"):
        Episode({"ok": [1.0], "scalar": value})


@pytest.mark.parametrize(
    ("value", "type_name"),
    [("abc", "str"), (b"abc", "bytes"), (object(), "object"), (None, "NoneType")],
    ids=["str", "bytes", "object", "none"],
)
def test_non_array_like_value_is_refused(value, type_name):
    """A value that is not array-like raises TypeError naming the field and the type seen."""
    with pytest.raises(TypeError, match=rf"steps\['bad'\] .*{type_name}") as info:
        Episode({"bad": value})
    assert isinstance(info.value, SchemaDtypeError)


def test_ragged_sequence_is_refused():
    """A ragged nested list is not array-like: TypeError naming the field."""
    with pytest.raises(TypeError, match=r"steps\['bad'\] must be array-like"):
        Episode({"bad": [[1, 2], [3]]})


def test_numpy_object_array_is_refused():
    """A numpy object array raises TypeError naming the field."""
    with pytest.raises(TypeError, match=r"steps\['bad'\] must be numeric"):
        Episode({"bad": np.array([object(), object()])})


def test_numpy_string_array_is_refused_naming_the_field():
    """A non-numeric numpy array (strings) raises TypeError naming the field."""
    with pytest.raises(TypeError, match=r"steps\['bad'\]"):
        Episode({"bad": np.array(["a", "b"])})


def test_non_mapping_steps_is_refused():
    """`steps` that is not a mapping raises TypeError."""
    with pytest.raises(TypeError, match="steps must be a mapping of field names, got list"):
        Episode([torch.zeros(3)])


# ----------------------------------------------------------------------- from_transitions


def test_from_transitions_stacks_steps():
    """`from_transitions` stacks per-step mappings along a new leading time dimension."""
    episode = Episode.from_transitions(
        [
            {"obs": torch.tensor([0.0, 1.0]), "action": 2},
            {"obs": torch.tensor([2.0, 3.0]), "action": 0},
            {"obs": torch.tensor([4.0, 5.0]), "action": 1},
        ],
        terminated=True,
    )
    assert len(episode) == 3
    assert episode.terminated is True
    assert episode["obs"].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert episode["action"].tolist() == [2, 0, 1]
    assert episode["action"].dtype == torch.int64


def test_from_transitions_refuses_an_empty_list():
    """`from_transitions([])` raises ValueError."""
    with pytest.raises(ValueError, match=r"transitions must hold at least one step, got \[\]"):
        Episode.from_transitions([])


def test_from_transitions_refuses_steps_with_other_fields():
    """A step with other field names raises ValueError naming the step and the fields."""
    with pytest.raises(ValueError, match=r"transitions\[1\] must have fields \['x'\], got \['y'\]"):
        Episode.from_transitions([{"x": 1.0}, {"y": 2.0}])


def test_any_mapping_is_accepted_tensordicts_included():
    """`Episode` takes a TensorDict or any object with ``keys`` and ``__getitem__`` (old:
    ``if not steps`` crashed on a TensorDict)."""
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"obs": torch.zeros(4, 3), "reward": torch.ones(4)}, batch_size=[4])
    episode = Episode(td, terminated=True)
    assert len(episode) == 4 and set(episode) == {"obs", "reward"}
    assert torch.equal(episode["obs"], td["obs"])

    class Steps:
        def keys(self):
            return ["x"]

        def __getitem__(self, name):
            return np.arange(3)

    assert Episode(Steps())["x"].tolist() == [0, 1, 2]
    with pytest.raises(InvalidArgumentError, match="at least one field"):
        Episode(tensordict.TensorDict({}, batch_size=[4]))
