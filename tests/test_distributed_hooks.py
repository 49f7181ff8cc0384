"""Shard hooks: a coordinator over one shard draws what the buffer itself draws.

The coordinator here is the smallest one: one shard, rounds of `draw_round` for the draws
the reuse limit refused, weights ``(p_min / p)^(alpha beta)`` over the merged batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_episode

from lucid_replay import PrioritizedSequenceReplay, Window
from lucid_replay.distributed.hooks import ShardHooks
from lucid_replay.laws import Prioritized, Uniform

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic

WINDOW = Window(3, burn_in=2, bootstrap=1)


def _twins(**kwargs) -> tuple[PrioritizedSequenceReplay, PrioritizedSequenceReplay]:
    buffers = []
    for _ in range(2):
        buffer = PrioritizedSequenceReplay(capacity=200, alpha=0.7, beta=0.5, seed=4, **kwargs)
        ids = buffer.extend(make_episode(n, first_serial=1000 * n) for n in (3, 5, 8, 13, 4))
        buffer.update_priorities(ids, [0.5, 3.0, 1.0, 0.25, 2.0])
        buffers.append(buffer)
    return buffers[0], buffers[1]


def _coordinated(
    hooks: ShardHooks, batch_size: int, window: Window, *, prioritized: bool, chunks: bool = False
):
    """Rounds of draws for the refused positions, merged in round order."""
    pieces, needed = [], batch_size
    while needed:
        law = Prioritized(hooks.buffer.alpha) if prioritized else Uniform()
        batch, priorities, kept = hooks.draw_round(needed, window, law, chunks=chunks)
        pieces.append((batch, priorities))
        needed = int((~kept).sum())
    ids = torch.cat([batch.episode_ids for batch, _ in pieces])
    weights = None
    if prioritized:
        drawn = torch.cat([p for _, p in pieces])
        exponent = hooks.buffer.alpha * hooks.buffer.beta
        weights = ((drawn.min() / drawn) ** exponent).to(torch.float32)
    return pieces, ids, weights


@pytest.mark.parametrize("reuse_limit", [None, 8])  # 8: 40 draws, 36 taken
@pytest.mark.parametrize("prioritized", [True, False])
def test_one_shard_coordinated_draws_equal_the_buffers_draw_for_draw(reuse_limit, prioritized):
    """Rounds of `draw_round` reproduce `sample_windows` exactly, weights included."""
    buffer, twin = _twins(max_times_sampled=reuse_limit)
    hooks = ShardHooks(buffer)
    for _ in range(3):
        expected = twin.sample_windows(12, WINDOW, prioritized=prioritized)
        pieces, ids, weights = _coordinated(hooks, 12, WINDOW, prioritized=prioritized)
        assert torch.equal(ids, expected.episode_ids)
        steps = torch.cat([batch.anchor_steps for batch, _ in pieces])
        assert torch.equal(steps, expected.anchor_steps)
        serials = torch.cat([batch["serial"] for batch, _ in pieces])
        assert torch.equal(serials, expected["serial"])
        if prioritized:
            torch.testing.assert_close(weights, expected.weights, rtol=0, atol=0)
    assert buffer.stats() == twin.stats()


def test_one_shard_chunk_draws_equal_sample_prioritized():
    """Chunk rounds reproduce `sample_prioritized` (starts and data)."""
    buffer, twin = _twins()
    expected = twin.sample_prioritized(10, 3)
    pieces, ids, weights = _coordinated(
        ShardHooks(buffer), 10, Window(3), prioritized=True, chunks=True
    )
    assert torch.equal(ids, expected.indices)
    assert torch.equal(pieces[0][0].starts, expected.starts)
    assert torch.equal(pieces[0][0]["serial"], expected["serial"])
    torch.testing.assert_close(weights, expected.weights, rtol=0, atol=0)


def test_draw_round_under_the_limit_refuses_without_redrawing():
    """A round keeps draws within each episode's allowance and reports the rest."""
    buffer = PrioritizedSequenceReplay(capacity=50, seed=0, max_times_sampled=1)
    buffer.extend(make_episode(4) for _ in range(2))
    hooks = ShardHooks(buffer)
    batch, _, kept = hooks.draw_round(6, Window(4), Prioritized(buffer.alpha))
    assert kept.dtype == torch.bool and kept.shape == (6,)
    assert batch.batch_size == int(kept.sum()) < 6
    assert batch.batch_size == len(set(batch.episode_ids.tolist()))  # each at most once
    assert hooks.draws_left(Window(4)) == 2 - batch.batch_size
    assert buffer.stats()["chunks_sampled"] == batch.batch_size


def test_log_mass_is_the_unscaled_total_mass():
    """``log sum_e n_e p_e^alpha`` (chunks), also after priorities moved far from the scale."""
    buffer, _ = _twins()
    hooks = ShardHooks(buffer)
    lengths = np.array([3, 5, 8, 13, 4])
    for errors in ([0.5, 3.0, 1.0, 0.25, 2.0], [1e200, 3.0, 1e-100, 0.25, 2.0]):
        buffer.update_priorities(list(buffer.episode_ids), errors)
        priorities = np.abs(errors) + buffer.epsilon
        counts = np.maximum(lengths - WINDOW.anchor_span + 1, 0)
        logs = np.log(counts[counts > 0]) + 0.7 * np.log(priorities[counts > 0])
        expected = logs.max() + np.log(np.exp(logs - logs.max()).sum())
        assert hooks.log_mass(WINDOW, Prioritized(0.7)) == pytest.approx(expected, rel=1e-12)
    assert hooks.log_mass(WINDOW, Uniform()) == pytest.approx(math.log(counts.sum()))
    assert hooks.log_mass(Window(14), Prioritized(0.7)) == -math.inf


def test_update_reports_the_largest_applied_priority_and_skips_evicted_ids():
    """Evicted ids neither apply nor count towards the reported maximum."""
    buffer = PrioritizedSequenceReplay(capacity=10, seed=0)
    buffer.extend(make_episode(5) for _ in range(3))  # id 0 evicted
    hooks = ShardHooks(buffer)
    assert hooks.update([0, 1, 2, 2], [100.0, 2.0, 0.5, 3.0]) == (2, 3.0 + buffer.epsilon)
    assert hooks.update([0], [7.0]) == (0, None)
    with pytest.raises(ValueError, match="issued episode id"):
        hooks.update([5], [1.0])


def test_raise_max_priority_reaches_new_episodes():
    """A maximum raised from outside is what the next episode gets; it never falls."""
    buffer = PrioritizedSequenceReplay(capacity=50, seed=0)
    hooks = ShardHooks(buffer)
    hooks.raise_max_priority(7.5)
    hooks.raise_max_priority(2.0)
    buffer.add(make_episode(4))
    assert buffer.priorities.tolist() == [7.5]
    with pytest.raises(ValueError, match="priority must be"):
        hooks.raise_max_priority(float("nan"))


def test_hooks_need_a_prioritized_buffer():
    """The hooks wrap a `PrioritizedSequenceReplay` only."""
    with pytest.raises(TypeError, match="PrioritizedSequenceReplay"):
        ShardHooks(object())  # type: ignore[arg-type]
