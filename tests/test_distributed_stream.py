"""`ShardedReplay.iterate`: each draw starts from the masses the previous one reported.

One round trip per batch once the stream runs; the batches still equal successive
`sample_windows` calls of a twin replay, also when adds and priority updates come between.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_episode

from lucid_replay import Window
from lucid_replay.distributed import ShardedReplay

WINDOW = Window(3, burn_in=1, bootstrap=1)


def _replay(transport: str, **options) -> ShardedReplay:
    replay = ShardedReplay.create(3, 600, seed=5, backend="local", transport=transport, **options)
    replay.extend(make_episode(n, first_serial=100 * n) for n in (4, 6, 9, 5, 7, 8))
    return replay


class _Counted:
    """A shard handle that counts the client's mass reads (``info`` requests)."""

    def __init__(self, handle, counts: list[int], index: int) -> None:
        self._handle, self._counts, self._index = handle, counts, index

    def __getattr__(self, name: str):
        if name == "info":
            self._counts[self._index] += 1
        return getattr(self._handle, name)


def _counting_reads(replay: ShardedReplay) -> list[int]:
    """Counts each shard's mass reads requested by the client."""
    counts = [0] * len(replay._shards)
    replay._shards = [_Counted(handle, counts, k) for k, handle in enumerate(replay._shards)]
    return counts


def _same(first, second) -> None:
    for key in ("episode_ids", "anchor_steps", "weights", "probabilities"):
        assert torch.equal(getattr(first, key), getattr(second, key)), key
    for name in first.data:
        assert torch.equal(first.data[name], second.data[name]), name


@pytest.mark.parametrize("transport", ["shared", "object"])
def test_a_running_stream_reads_no_masses_and_draws_what_calls_draw(transport) -> None:
    replay, twin = _replay(transport), _replay(transport)
    reads = _counting_reads(replay)
    with replay.iterate(16, WINDOW) as stream:
        batches = [next(stream) for _ in range(6)]
    assert reads == [1, 1, 1]  # the first draw only
    for batch in batches:
        _same(batch, twin.sample_windows(16, WINDOW))
    assert replay.stats()["chunks_sampled"] == 16 * 7  # one draw in flight at close


@pytest.mark.parametrize("transport", ["shared", "object"])
def test_adds_and_updates_between_batches_are_read_afresh(transport) -> None:
    """After an add or an undeferred update the next draw reads the masses again, and the
    batches equal a twin's calls made in the order the stream's draws met them."""
    replay, twin = _replay(transport), _replay(transport)
    reads = _counting_reads(replay)
    errors = np.linspace(0.1, 3.0, 16)
    stream = replay.iterate(16, WINDOW)
    streamed = [next(stream)]  # the second draw is in flight: drawn before what follows
    expected = [twin.sample_windows(16, WINDOW), twin.sample_windows(16, WINDOW)]
    for target in (replay, twin):
        target.add(make_episode(11, first_serial=5000))
    streamed.append(next(stream))  # starts the third draw, after the add
    expected.append(twin.sample_windows(16, WINDOW))
    replay.update_priorities(streamed[0].episode_ids, errors)
    twin.update_priorities(expected[0].episode_ids, errors)
    streamed += [next(stream), next(stream)]  # the fourth drawn after the update
    expected.append(twin.sample_windows(16, WINDOW))
    stream.close()
    for batch, wanted in zip(streamed, expected, strict=True):
        _same(batch, wanted)
    assert reads == [3, 3, 3]  # the first draw, after the add, after the update


def test_deferred_updates_ride_the_draw_calls_and_apply_after_the_draw() -> None:
    replay = _replay("shared")
    reads = _counting_reads(replay)
    stream = replay.iterate(16, WINDOW)
    batch = next(stream)
    before = replay.transport_stats()["updates_ridden"]
    replay.update_priorities(batch.episode_ids, np.full(16, 7.0), defer=True)
    next(stream)  # its draw was in flight: the update rides the next draw call
    next(stream)
    assert replay.transport_stats()["updates_ridden"] > before
    assert reads == [1, 1, 1]  # a deferred update costs no extra round trip
    stream.close()
    largest = max(shard["max_priority"] for shard in replay.stats()["shards"])
    assert largest == pytest.approx(7.0 + replay.epsilon)


@pytest.mark.parametrize("transport", ["shared", "object"])
def test_a_stream_after_a_deferred_update_draws_what_calls_after_that_update_draw(transport):
    """The update rides the draw in flight's successor and applies after it; the draw after
    that starts from the masses the shards reported then: the updated ones."""
    replay, twin = _replay(transport), _replay(transport)
    errors = np.linspace(0.1, 40.0, 16)
    stream = replay.iterate(16, WINDOW)
    streamed = [next(stream)]
    replay.update_priorities(streamed[0].episode_ids, errors, defer=True)
    streamed += [next(stream), next(stream), next(stream)]
    stream.close()
    expected = [twin.sample_windows(16, WINDOW) for _ in range(3)]
    twin.update_priorities(expected[0].episode_ids, errors)
    expected.append(twin.sample_windows(16, WINDOW))
    for batch, wanted in zip(streamed, expected, strict=True):
        _same(batch, wanted)


@pytest.mark.parametrize("refusal", ["empty", "spent component"])
def test_a_refused_stream_draw_keeps_the_queued_updates(refusal) -> None:
    """A draw refused before any call is sent (by the check, or while labelling a mixture
    component with no mass left) leaves the deferred updates queued, in order."""
    from lucid_replay import Mixture, Prioritized, Uniform
    from lucid_replay.distributed import coordination, draw

    replay = _replay("shared", selector=Mixture({Prioritized(): 0.5, Uniform(): 0.5}))
    batch = replay.sample_windows(16, WINDOW)
    replay.update_priorities(batch.episode_ids, np.full(16, 2.0), defer=True)
    queued = [[ids.tolist() for ids, _ in queue] for queue in replay._state.deferred]
    assert any(queued)
    spec = draw.window_spec(16, WINDOW, None, replay._law, replay.alpha)
    empty = refusal == "empty"
    report = {"log_masses": [float("-inf") if empty else 0.0, float("-inf")],
              "log_mass": float("-inf") if empty else 0.0, "draws_left": None,
              "episodes": 0 if empty else 6, "longest": 9, "eligible": not empty,
              "updated": []}  # fmt: skip
    with pytest.raises(ValueError, match="non-empty to sample" if empty else "draws left"):
        coordination.begin(replay, spec, None, stream=True, infos=[report] * 3)
    assert [[ids.tolist() for ids, _ in queue] for queue in replay._state.deferred] == queued
