"""The sharded client applies the single buffer's rules, imported, not restated: the same
calls are refused with the same messages, and the same episodes are accepted."""

from __future__ import annotations

import pytest
import torch

from lucid_replay import (
    Episode,
    InvalidArgumentError,
    PrioritizedSequenceReplay,
    ReuseLimitError,
    Window,
)
from lucid_replay.distributed import ShardedReplay


def _episode(length: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> Episode:
    return Episode({"obs": (torch.arange(length * 2, dtype=dtype) * scale).view(length, 2)})


def _message(call, *args) -> tuple[type, str]:
    with pytest.raises(Exception) as caught:  # compared below, type and text
        call(*args)
    return type(caught.value), str(caught.value)


@pytest.fixture
def pair():
    """A single buffer and a 2-shard replay, built alike."""
    sharded = ShardedReplay.create(2, 200, backend="local", seed=0, max_times_sampled=1)
    yield PrioritizedSequenceReplay(100, seed=0, max_times_sampled=1), sharded
    sharded.close()


def test_draw_refusals_read_the_same(pair) -> None:
    one, sharded = pair
    calls = [
        lambda replay: replay.sample(2, 3),
        lambda replay: replay.sample_windows(2, Window(3)),
    ]
    for call in calls:
        assert _message(call, one) == _message(call, sharded)
    for replay in pair:
        replay.extend([_episode(4), _episode(4)])
    assert _message(lambda: one.sample_windows(2, Window(5))) == _message(
        lambda: sharded.sample_windows(2, Window(5))
    )
    kind, text = _message(lambda: one.sample_windows(9, Window(3)))
    assert kind is ReuseLimitError
    assert _message(lambda: sharded.sample_windows(9, Window(3))) == (kind, text)


@pytest.mark.parametrize("errors", [[1.0, float("nan")], [float("-inf"), 1.0], [1.0, 1.79e308]])
def test_priority_errors_are_refused_alike(errors) -> None:
    one = PrioritizedSequenceReplay(100, epsilon=1e307)
    sharded = ShardedReplay.create(2, 200, backend="local", epsilon=1e307)
    try:
        for replay in (one, sharded):
            replay.extend([_episode(3), _episode(3)])
        ids_one, ids_sharded = one.episode_ids, sharded.sample_prioritized(2, 2).indices
        kind, text = _message(lambda: one.update_priorities(ids_one, errors))
        assert kind is InvalidArgumentError and text.startswith("errors[")
        assert _message(lambda: sharded.update_priorities(ids_sharded, errors)) == (kind, text)
    finally:
        sharded.close()


def test_a_declared_schema_takes_the_same_kind_casts_one_buffer_takes() -> None:
    """float64 steps into a declared float32 field: cast and stored, on shards as in one
    buffer; a cast that would overflow is refused by both with one message."""
    schema = {"obs": ((2,), torch.float32)}
    one = PrioritizedSequenceReplay(100, schema=schema, seed=0)
    sharded = ShardedReplay.create(2, 200, backend="local", schema=schema, seed=0)
    try:
        for replay in (one, sharded):
            replay.add(_episode(5, torch.float64))
        batch = sharded.sample(4, 2)
        assert batch.data["obs"].dtype == torch.float32
        assert one.sample(4, 2).data["obs"].dtype == torch.float32
        lossy = _episode(3, torch.float64, scale=1e39)  # beyond float32: would become inf
        kind, text = _message(lambda: one.add(lossy))
        assert _message(lambda: sharded.add(lossy)) == (kind, text)
        assert sharded.stats()["episodes_added"] == 1  # the refused call stored nothing
    finally:
        sharded.close()
