"""Sampling: which anchors a draw picks, under the reuse limit and with leaf masses that stay
exact.

With ``max_times_sampled=K`` an episode is drawn at most K times in all, also within one batch,
and a call asking for more draws than are left is refused with nothing drawn. Each sum tree's
leaf is ``n_e * m_e`` (``unit="chunk"``) with ``m_e = (p_e / s) ** alpha``; the leaves follow
table growth and updates exactly, and the law ``P ∝ p^alpha`` holds where ``p^alpha`` itself
leaves float64's range.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from conftest import (
    EPSILON,
    assert_batches_equal,
    assert_chunks_match_storage,
    make_episode,
    priorities_of,
    prioritized_buffer,
)
from stats import (
    ACCEPT,
    DRAWS,
    chi_square_pvalue,
    eligible_starts,
    episode_counts,
    expected_weights,
)

from lucid_replay import (
    PrioritizedSequenceReplay,
    ReuseLimitError,
    SequenceReplay,
    Window,
    engine,
    sum_tree,
)
from lucid_replay.laws import Prioritized
from lucid_replay.selectors import from_key

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic


# ----------------------------------------------------------- reuse limit: uniform draws


@pytest.mark.parametrize("seed", range(5))
def test_reuse_limit_one_with_batch_of_all_eligible_draws_each_once(seed):
    """K=1 and batch_size == eligible episodes: each eligible episode exactly once."""
    buffer = SequenceReplay(40, seed=seed, max_times_sampled=1)
    for length in (4, 6, 2, 5):  # id 2 is too short for length 4
        buffer.add(make_episode(length))
    batch = buffer.sample(3, 4)
    assert sorted(batch.episode_ids.tolist()) == [0, 1, 3]
    assert buffer.stats()["episodes_retired"] == 3


@pytest.mark.parametrize("seed", range(3))
def test_reuse_limit_within_one_batch(seed):
    """K=2 and batch_size == 2 * eligible: each eligible episode drawn exactly twice."""
    buffer = SequenceReplay(40, seed=seed, max_times_sampled=2)
    for length in (1, 3, 9, 4):  # id 0 never eligible; it also blocks reclamation
        buffer.add(make_episode(length))
    batch = buffer.sample(6, 3)
    assert Counter(batch.episode_ids.tolist()) == {1: 2, 2: 2, 3: 2}
    assert_chunks_match_storage(buffer, batch, 3)


def test_reuse_limit_is_never_exceeded_across_batches():
    """No episode is drawn more than K times in total; then sampling is refused."""
    buffer = SequenceReplay(40, seed=4, max_times_sampled=3)
    for length in (1, 5, 6, 7, 8):  # id 0 (too short) keeps the retired ones stored
        buffer.add(make_episode(length))
    drawn: Counter[int] = Counter()
    for _ in range(6):  # 4 eligible episodes x 3 = 12 draws
        drawn.update(buffer.sample(2, 2).episode_ids.tolist())
        assert max(drawn.values()) <= 3
    assert drawn == {1: 3, 2: 3, 3: 3, 4: 3}
    assert buffer.stats()["episodes_retired"] == 4
    assert list(buffer.episode_ids) == [0, 1, 2, 3, 4]  # retired, still stored
    assert len(buffer[3]) == 7
    with pytest.raises(ValueError, match="draws left under max_times_sampled=3") as info:
        buffer.sample(1, 2)
    assert isinstance(info.value, ReuseLimitError)


def test_asking_for_more_draws_than_left_changes_nothing():
    """Too many draws: ReuseLimitError, nothing drawn, stats and RNG untouched."""
    made = []
    for _ in range(2):
        buffer = SequenceReplay(40, seed=21, max_times_sampled=2)
        for length in (1, 3, 4, 5):
            buffer.add(make_episode(length, first_serial=100 * length))
        buffer.sample(2, 3)  # 6 draws allowed in total, 4 left
        made.append(buffer)
    failing, twin = made
    before = failing.stats()
    with pytest.raises(
        ValueError,
        match=r"batch_size must be <= the draws left under max_times_sampled=2 "
        r"for the eligible episodes \(4\), got 5",
    ) as info:
        failing.sample(5, 3)
    assert isinstance(info.value, ReuseLimitError)
    assert failing.stats() == before
    # The RNG and the counts are as if the call never happened: the twin agrees, and the
    # 4 remaining draws are all still available.
    assert_batches_equal(failing.sample(4, 3), twin.sample(4, 3))
    assert failing.stats() == twin.stats()


def test_gather_windows_does_not_count_towards_the_reuse_limit():
    """`gather_windows` draws nothing: a K=1 episode can still be sampled afterwards."""
    buffer = SequenceReplay(40, seed=0, max_times_sampled=1)
    buffer.add(make_episode(5))
    buffer.add(make_episode(1))
    for _ in range(3):
        buffer.gather_windows([0], [1], Window(2))
    assert buffer.stats()["episodes_retired"] == 0
    assert buffer.sample(1, 2).episode_ids.tolist() == [0]
    assert buffer.stats()["episodes_retired"] == 1


# ------------------------------------------------------- reuse limit: prioritized draws


def test_reuse_limit_caps_draws_also_within_one_batch() -> None:
    """With max_times_sampled=K a favourite is drawn at most K times, then never again."""
    buffer, ids = prioritized_buffer(
        "chunk", 1.0, lengths=[5, 5, 5, 5], errors=[1.0, 1.0, 1_000.0, 1.0], max_times_sampled=2
    )
    first = buffer.sample_prioritized(5, 3)
    counts = episode_counts(first, ids)
    assert counts.max() <= 2
    assert counts[2] == 2  # ~99.7% of the mass: it fills its allowance within the batch
    # Weights are those at the start of the call, from the priorities alone.
    priorities = priorities_of([1.0, 1.0, 1_000.0, 1.0])
    drawn = priorities[first.indices.numpy() - ids[0]]
    expected = expected_weights(drawn, [5] * 4, priorities, 3, 1.0, 0.4, "chunk")
    np.testing.assert_allclose(first.weights.numpy(), expected, rtol=1e-6)
    second = buffer.sample_prioritized(3, 3)
    total = counts + episode_counts(second, ids)
    assert total[2] == 2, "a retired episode was drawn again"
    assert total.max() <= 2 and total.sum() == 8
    assert buffer.stats()["episodes_retired"] == 4


def test_reuse_limit_exhaustion_raises_and_draws_nothing() -> None:
    """Asking for more draws than are left raises ReuseLimitError; counters and RNG untouched."""
    kwargs = {"lengths": [5, 2, 6, 7], "errors": [1.0, 1.0, 3.0, 0.5], "max_times_sampled": 2}
    buffer, ids = prioritized_buffer("episode", 0.6, seed=81, **kwargs)
    twin, _ = prioritized_buffer("episode", 0.6, seed=81, **kwargs)
    stats = buffer.stats()
    # The length-2 episode is not eligible for length 3: 3 episodes x 2 draws are left.
    with pytest.raises(ReuseLimitError, match=r"max_times_sampled=2 .*\(6\), got 7") as caught:
        buffer.sample_prioritized(7, 3)
    assert isinstance(caught.value, ValueError)
    assert buffer.stats() == stats
    ours, theirs = buffer.sample_prioritized(6, 3), twin.sample_prioritized(6, 3)
    assert torch.equal(ours.indices, theirs.indices) and torch.equal(ours.starts, theirs.starts)
    assert np.bincount(ours.indices.numpy() - ids[0], minlength=4).tolist() == [2, 0, 2, 2]
    with pytest.raises(ValueError, match=r"max_times_sampled=2|non-empty"):
        buffer.sample_prioritized(1, 3)


# -------------------------------------------------------------------------- leaf masses


def test_trees_stay_exact_through_table_growth_and_many_updates() -> None:
    """Thousands of episodes (table growth, evictions, two spans): trees match the model's leaves.

    A smoke check of the incremental path at scale, not a timing test.
    """
    rng = np.random.default_rng(101)
    alpha = 0.6
    buffer = PrioritizedSequenceReplay(12_000, alpha=alpha, epsilon=EPSILON, seed=101)
    lengths: dict[int, int] = {}
    for round_ in range(6):
        new = rng.integers(1, 9, size=700)
        ids = buffer.extend(make_episode(int(n), first_serial=0) for n in new)
        lengths.update(zip(ids, new.tolist(), strict=True))
        for span in (3, 6):
            batch = buffer.sample_prioritized(128, span)
            errors = rng.exponential(size=128) * (round_ + 1)
            buffer.update_priorities(batch.indices, errors)
    assert buffer._core.store.table.row_count > 1_024  # the table grew at least once
    assert buffer.stats()["episodes_evicted"] > 0
    stored = list(buffer.episode_ids)
    priorities = buffer.priorities.numpy()
    rows = buffer._core.store.table.rows_of(torch.tensor(stored)).numpy()
    for span in (3, 6):
        tree = buffer._core.sampler.trees.tree(span, Prioritized(alpha))
        scale = (
            buffer._core.sampler.trees.cached(span, Prioritized(alpha)).scale ** alpha
        )  # cancels in every P
        counts = eligible_starts([lengths[i] for i in stored], span)
        expected = np.zeros(buffer._core.store.table.row_count)
        expected[rows] = counts * priorities**alpha
        leaves = sum_tree.leaves(tree).numpy() * scale
        np.testing.assert_allclose(leaves, expected, rtol=1e-12)
        assert float(sum_tree.total(tree)) * scale == pytest.approx(expected.sum(), rel=1e-12)


def test_trees_refresh_changed_rows_until_more_are_pending_than_rows() -> None:
    """Updates of a quarter of the rows at a time refresh the cached tree in place (exact
    leaves, same scale); only more pending rows than the table has make a draw rebuild it."""
    rng = np.random.default_rng(7)
    alpha, span, batch = 0.6, 3, 256
    buffer = PrioritizedSequenceReplay(8_000, alpha=alpha, epsilon=EPSILON, seed=7)
    lengths = rng.integers(3, 9, 1_000).tolist()
    ids = buffer.extend(make_episode(n, first_serial=0) for n in lengths)
    sampler = buffer._core.sampler
    rows_total = buffer._core.store.table.row_count
    assert rows_total == 1_024

    def some(start: int) -> list[int]:
        return [ids[(start + j) % len(ids)] for j in range(batch)]

    buffer.sample_prioritized(8, span)
    cached = sampler.trees.cached(span, Prioritized(alpha))
    for start in range(0, rows_total, batch):  # a quarter of the rows pending at each draw
        buffer.update_priorities(some(start), rng.exponential(size=batch) * 5)
        buffer.sample_prioritized(8, span)
        assert sampler.trees.cached(span, Prioritized(alpha)) is cached
    assert list(buffer.episode_ids) == ids  # nothing evicted: priorities in this order
    rows = buffer._core.store.table.rows_of(torch.tensor(ids)).numpy()
    expected = np.zeros(rows_total)
    masses = (buffer.priorities.numpy() / cached.scale) ** alpha
    expected[rows] = eligible_starts(lengths, span) * masses
    np.testing.assert_allclose(sum_tree.leaves(cached.nodes).numpy(), expected, rtol=1e-12)
    for start in range(0, rows_total + 1, batch):  # more pending than rows, no draw between
        buffer.update_priorities(some(start), np.ones(batch))
    buffer.sample_prioritized(8, span)
    assert sampler.trees.cached(span, Prioritized(alpha)) is not cached


@pytest.mark.parametrize(
    ("unit", "limit", "alpha"),
    [("chunk", None, 0.6), ("episode", 3, 0.6), ("chunk", 2, None), ("episode", None, None)],
)
def test_refreshed_trees_are_bitwise_the_trees_built_from_the_table(
    unit, limit, alpha, index_engine
):
    """After adds, evictions, updates and retirements, each cached tree (refreshed row by
    row) equals the tree built from scratch over the table at its scale, to the last bit.

    On tensors, torch's vectorised power can round ``(p / s) ** alpha`` one unit in the last
    place differently by the value's position in the vector: there, to 2 ulp."""
    rng = np.random.default_rng(11)
    buffer = PrioritizedSequenceReplay(
        600, alpha=0.6, epsilon=EPSILON, seed=11, unit=unit, max_times_sampled=limit
    )
    sampler = buffer._core.sampler
    for _ in range(30):
        buffer.extend(make_episode(int(n)) for n in rng.integers(1, 12, 5))
        try:
            batch = buffer.sample_prioritized(8, 3) if alpha else buffer.sample(8, 3)
        except ReuseLimitError:
            continue
        buffer.update_priorities(batch.episode_ids, rng.exponential(size=8) * 3)
    assert buffer.stats()["episodes_evicted"] > 0
    assert limit is None or buffer.stats()["episodes_retired"] > 0
    law = from_key(alpha)
    sampler.trees.tree(3, law)
    cached = sampler.trees.cached(3, law)
    rows = torch.arange(buffer._core.store.table.row_count)
    leaves = sampler.trees.leaf_values(engine.view(rows), 3, law, cached.scale)
    built = sum_tree.build(engine.tensor(engine.cast(leaves, torch.float64)))
    if index_engine == "torch" and alpha is not None:
        torch.testing.assert_close(cached.nodes, built, rtol=4.5e-16, atol=0.0)
    else:
        assert torch.equal(cached.nodes, built)


def _two_episode_pvalue(buffer, ids, probs, draws=DRAWS) -> float:
    """Chi-square p-value of ``draws`` prioritized chunks' episodes against ``probs``."""
    batch = buffer.sample_prioritized(draws, 3)
    return chi_square_pvalue(episode_counts(batch, ids), probs)


@pytest.mark.statistical
@pytest.mark.parametrize(
    "alpha, errors",
    [
        (1.0, [1e308, 1e308]),  # p^alpha sums past float64's largest value
        (1.0, [1e308, 0.5e308]),
        (50.0, [1e7, 1.01e7]),  # p^alpha = 1e350 overflows
        (60.0, [0.0, 0.0]),  # p^alpha = 1e-360 underflows to zero
        (8.0, [1e-60, 2e-60]),  # epsilon 1e-300 keeps them apart; p^alpha underflows
    ],
)
def test_exact_law_for_priorities_whose_power_overflows_or_underflows(alpha, errors):
    """``P ∝ p^alpha`` holds and weights stay finite when ``p^alpha`` leaves float64's range
    (old: one episode only, NaN weights, or a `ReuseLimitError` on a buffer with no limit)."""
    buffer = PrioritizedSequenceReplay(100, alpha=alpha, beta=0.7, epsilon=1e-300, seed=5)
    ids = buffer.extend(make_episode(5) for _ in range(2))
    buffer.update_priorities(ids, errors)
    logs = alpha * np.log(np.abs(np.asarray(errors, dtype=np.float64)) + 1e-300)
    probs = np.exp(logs - logs.max())
    probs /= probs.sum()
    assert _two_episode_pvalue(buffer, ids, probs) > ACCEPT
    weights = buffer.sample_prioritized(64, 3).weights
    assert bool(torch.isfinite(weights).all()) and float(weights.max()) == 1.0
