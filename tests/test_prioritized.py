"""`PrioritizedSequenceReplay`: episodes drawn in proportion to ``n_e p_e^alpha`` (``unit="chunk"``,
``n_e`` eligible starts) or ``p_e^alpha`` (``unit="episode"``) with ``p = |error| + epsilon``,
starts uniform; importance weights; beta annealing; the maximum priority new episodes get; and
priorities set from errors (`update_priorities`, `update_priorities_from`).

Statistical tests draw ~20k chunks at a fixed seed and compare the (episode, start) frequencies
with those laws by chi-square (accepted at p > ACCEPT). Each also shows its power: the same
counts are rejected (p < REJECT) against a plausible wrong law, so the test could fail.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import scipy.stats
import torch
from conftest import (
    EPSILON,
    INF,
    NAN,
    ROUTING_ERRORS,
    ROUTING_IDS,
    ROUTING_STEPS,
    TABLE_WINDOW,
    assert_refused,
    make_episode,
    priorities_of,
    prioritized_buffer,
    standard_buffer,
)
from stats import (
    ACCEPT,
    DRAWS,
    REJECT,
    chi_square_pvalue,
    eligible_starts,
    episode_counts,
    expected_weights,
)

from lucid_replay import (
    InvalidArgumentError,
    PrioritizedBatch,
    PrioritizedSequenceReplay,
    SequenceReplay,
    Window,
)

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic

# A length-2 episode is not eligible for length 3 and holds the largest priority, so any
# leak of ineligible mass shows up strongly.
LENGTHS = [4, 2, 6, 9, 12]
ERRORS = [0.5, 8.0, 1.0, -2.0, 4.0]  # priorities |e| + EPSILON ~ [0.5, 8, 1, 2, 4]


# ------------------------------------------------------------------------------ helpers
def _buffer(
    unit: str = "chunk",
    alpha: float = 0.6,
    *,
    lengths: list[int] = LENGTHS,
    errors: list[float] | None = ERRORS,
    **kwargs: object,
) -> tuple[PrioritizedSequenceReplay, list[int]]:
    """`prioritized_buffer` of LENGTHS with priorities from ERRORS, unless told otherwise."""
    return prioritized_buffer(unit, alpha, lengths=lengths, errors=errors, **kwargs)


def _episode_probs(
    lengths: list[int], priorities: np.ndarray, length: int, alpha: float, unit: str
) -> np.ndarray:
    """The law of episodes: chunk ~ n_e p_e^alpha; episode ~ [n_e > 0] p_e^alpha."""
    counts = eligible_starts(lengths, length)
    scaled = np.asarray(priorities, dtype=np.float64) ** alpha
    mass = counts * scaled if unit == "chunk" else (counts > 0) * scaled
    return mass / mass.sum()


def _joint_probs(episode_probs: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """Cell (e, s) for each eligible start s of episode e: P(e) / n_e (start uniform)."""
    pairs = zip(episode_probs, anchors, strict=True)
    return np.concatenate([np.full(n, p / n) for p, n in pairs if n > 0])


def _joint_counts(batch, ids: list[int], anchors: np.ndarray) -> np.ndarray:
    """Counts of (episode, start) cells, cells laid out as in `_joint_probs`."""
    position = batch.episode_ids.numpy() - ids[0]
    starts = batch.starts.numpy()
    assert (starts >= 0).all() and (starts < anchors[position]).all()
    offsets = np.concatenate([[0], np.cumsum(anchors)])[:-1]
    return np.bincount(offsets[position] + starts, minlength=int(anchors.sum()))


# ------------------------------------------------------------------------- construction
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": -0.1}, r"alpha must be >= 0(\.0)? and finite, got -0\.1"),
        ({"alpha": float("nan")}, r"alpha must be >= 0(\.0)? and finite, got nan"),
        ({"beta": -1.0}, r"beta must be >= 0(\.0)? and finite, got -1\.0"),
        ({"epsilon": 0.0}, r"epsilon must be > 0(\.0)? and finite, got 0\.0"),
        ({"epsilon": -1e-6}, r"epsilon must be > 0(\.0)? and finite, got -1e-06"),
    ],
)
def test_constructor_refuses_bad_exponents(kwargs: dict[str, float], message: str) -> None:
    """alpha < 0, beta < 0 or epsilon <= 0 raise ValueError naming the parameter and value."""
    with pytest.raises(ValueError, match=message) as caught:
        PrioritizedSequenceReplay(100, **kwargs)
    assert isinstance(caught.value, InvalidArgumentError)


def test_properties_and_defaults() -> None:
    """alpha/beta/epsilon as given (defaults 0.6/0.4/1e-6); max priority starts at 1.0."""
    default = PrioritizedSequenceReplay(100)
    assert (default.alpha, default.beta, default.epsilon) == (0.6, 0.4, 1e-6)
    assert default.max_priority == 1.0
    assert default.unit == "chunk"
    assert isinstance(default, SequenceReplay)
    custom = PrioritizedSequenceReplay(
        100, alpha=0.0, beta=0.0, epsilon=0.5, unit="episode", max_times_sampled=3
    )
    assert (custom.alpha, custom.beta, custom.epsilon) == (0.0, 0.0, 0.5)
    assert (custom.unit, custom.max_times_sampled) == ("episode", 3)
    assert custom.priorities.shape == (0,)


def test_sample_prioritized_batch_fields() -> None:
    """A PrioritizedBatch: chunks of the drawn episodes, indices = episode ids, float32 [B]."""
    buffer, _ = _buffer(lengths=[5, 8], errors=None)
    batch = buffer.sample_prioritized(16, 3)
    assert isinstance(batch, PrioritizedBatch)
    assert torch.equal(batch.indices, batch.episode_ids)
    assert batch.indices.dtype == batch.starts.dtype == torch.int64
    assert batch.weights.dtype == torch.float32 and batch.weights.shape == (16,)
    assert batch["serial"].shape == (16, 3)
    for episode_id, start, serial in zip(batch.indices, batch.starts, batch["serial"], strict=True):
        expected = buffer[int(episode_id)]["serial"][int(start) : int(start) + 3]
        assert torch.equal(serial, expected)


def test_sample_prioritized_refuses_a_length_no_episode_has() -> None:
    """A length above every stored episode raises ValueError naming the longest length."""
    buffer, _ = _buffer(lengths=[4, 6], errors=None)
    with pytest.raises(ValueError, match=r"longest stored episode \(6 steps\), got 7"):
        buffer.sample_prioritized(4, 7)


# ------------------------------------------------------------------------ distributions
@pytest.mark.statistical
@pytest.mark.parametrize("unit", ["chunk", "episode"])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_prioritized_distribution_matches_the_law(unit: str, alpha: float) -> None:
    """Episodes are drawn ~ n_e p^a (chunk) or ~ p^a (episode), starts uniform (chi-square)."""
    buffer, ids = _buffer(unit, alpha, seed=11)
    batch = buffer.sample_prioritized(DRAWS, 3)
    anchors = eligible_starts(LENGTHS, 3)
    priorities = priorities_of(ERRORS)
    expected = _episode_probs(LENGTHS, priorities, 3, alpha, unit)
    episodes = episode_counts(batch, ids)
    joint = _joint_counts(batch, ids, anchors)
    assert chi_square_pvalue(episodes, expected) > ACCEPT
    assert chi_square_pvalue(joint, _joint_probs(expected, anchors)) > ACCEPT
    # Power: the other unit's formula, another alpha, and an off-by-one n_e are all rejected.
    other_unit = "episode" if unit == "chunk" else "chunk"
    other_alpha = {0.0: 0.6, 0.6: 1.0, 1.0: 0.6}[alpha]
    assert (
        chi_square_pvalue(episodes, _episode_probs(LENGTHS, priorities, 3, alpha, other_unit))
        < REJECT
    )
    assert (
        chi_square_pvalue(episodes, _episode_probs(LENGTHS, priorities, 3, other_alpha, unit))
        < REJECT
    )
    if unit == "chunk":
        off_by_one = _episode_probs(LENGTHS, priorities, 4, alpha, unit)  # n_e = T - L
        assert chi_square_pvalue(episodes, off_by_one) < REJECT


@pytest.mark.statistical
def test_start_within_an_episode_is_uniform() -> None:
    """Starts inside one episode are uniform over its T - L + 1 starts; a biased end is caught."""
    buffer, ids = _buffer("chunk", 1.0, lengths=[12, 4], errors=[4.0, 0.5], seed=5)
    batch = buffer.sample_prioritized(DRAWS, 3)
    starts = batch.starts.numpy()[batch.indices.numpy() == ids[0]]
    counts = np.bincount(starts, minlength=10)
    assert len(counts) == 10  # never past the last start T - L
    assert chi_square_pvalue(counts, np.full(10, 0.1)) > ACCEPT
    # Power: the last start at half or double the others' probability is rejected.
    assert chi_square_pvalue(counts, np.r_[np.full(9, 1.0), 0.5]) < REJECT
    assert chi_square_pvalue(counts, np.r_[np.full(9, 1.0), 2.0]) < REJECT


@pytest.mark.statistical
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_alpha_zero_is_the_uniform_buffers_distribution(unit: str) -> None:
    """alpha = 0 draws like SequenceReplay.sample of the same data (formula and homogeneity)."""
    prioritized, ids = _buffer(unit, 0.0, seed=21)
    uniform = SequenceReplay(1_000, unit=unit, seed=22)
    uniform.extend(make_episode(n) for n in LENGTHS)
    anchors = eligible_starts(LENGTHS, 3)
    by_priority = _joint_counts(prioritized.sample_prioritized(DRAWS, 3), ids, anchors)
    by_uniform = _joint_counts(uniform.sample(DRAWS, 3), ids, anchors)
    uniform_episode = anchors if unit == "chunk" else (anchors > 0).astype(float)
    uniform_joint = _joint_probs(uniform_episode / uniform_episode.sum(), anchors)
    assert chi_square_pvalue(by_priority, uniform_joint) > ACCEPT
    assert chi_square_pvalue(by_uniform, uniform_joint) > ACCEPT
    table = np.stack([by_priority, by_uniform])
    assert scipy.stats.chi2_contingency(table[:, table.sum(0) > 0]).pvalue > ACCEPT
    # Power: the priorities (which alpha = 0 must ignore) would be detected.
    weighted = _episode_probs(LENGTHS, priorities_of(ERRORS), 3, 1.0, unit)
    assert chi_square_pvalue(by_priority, _joint_probs(weighted, anchors)) < REJECT


@pytest.mark.statistical
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_sample_stays_uniform_on_a_prioritized_buffer(unit: str) -> None:
    """`sample` on a prioritized buffer ignores priorities (chi-square vs the uniform formula)."""
    buffer, ids = _buffer(unit, 1.0, seed=31)
    anchors = eligible_starts(LENGTHS, 3)
    batch = buffer.sample(DRAWS, 3)
    assert not isinstance(batch, PrioritizedBatch)
    joint = _joint_counts(batch, ids, anchors)
    uniform = anchors if unit == "chunk" else (anchors > 0).astype(float)
    assert chi_square_pvalue(joint, _joint_probs(uniform / uniform.sum(), anchors)) > ACCEPT
    weighted = _episode_probs(LENGTHS, priorities_of(ERRORS), 3, 1.0, unit)
    assert chi_square_pvalue(joint, _joint_probs(weighted, anchors)) < REJECT


@pytest.mark.statistical
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_distribution_stays_exact_across_lengths_and_updates(unit: str) -> None:
    """Lengths 3, 5, 3, 5 with updates and an add between: every phase matches the law."""
    alpha = 0.7
    buffer, ids = _buffer(unit, alpha, seed=41)
    lengths, priorities = list(LENGTHS), priorities_of(ERRORS)
    phases = [
        (3, None),
        (5, [4.0, 8.0, 2.0, 1.0, 0.5]),
        (3, [1.0, 0.125, 3.0, 0.25, 2.0]),  # then a new episode: every tree gets a dirty row
        (5, [0.25, 8.0, 0.25, 6.0, 1.0, 0.375]),
    ]
    for phase, (length, errors) in enumerate(phases):
        stale = priorities
        if errors is not None:
            assert buffer.update_priorities(ids, errors) == len(ids)
            priorities = priorities_of(errors)
        if phase == 2:
            ids.append(buffer.add(make_episode(7)))
            lengths.append(7)
            priorities = np.append(priorities, buffer.max_priority)
            stale = np.append(stale, buffer.max_priority)
        np.testing.assert_allclose(buffer.priorities.numpy(), priorities, rtol=1e-12)
        anchors = eligible_starts(lengths, length)
        expected = _episode_probs(lengths, priorities, length, alpha, unit)
        batch = buffer.sample_prioritized(DRAWS, length)
        joint = _joint_counts(batch, ids, anchors)
        assert chi_square_pvalue(joint, _joint_probs(expected, anchors)) > ACCEPT, f"phase {phase}"
        if errors is not None:
            # Power: a tree left at the previous priorities would be rejected.
            before = _episode_probs(lengths, stale, length, alpha, unit)
            assert chi_square_pvalue(episode_counts(batch, ids), before) < REJECT, f"phase {phase}"


# ------------------------------------------------------------------------------ weights
@pytest.mark.parametrize("unit", ["chunk", "episode"])
@pytest.mark.parametrize(("alpha", "beta"), [(0.6, 0.4), (1.0, 1.0), (0.5, 0.0), (0.0, 0.7)])
def test_weights_match_the_formula(unit: str, alpha: float, beta: float) -> None:
    """Weights are (N P_i)^-beta / max_j (N P_j)^-beta over each batch; the largest is exactly 1."""
    buffer, ids = _buffer(unit, alpha, beta=beta, seed=51)
    priorities = priorities_of(ERRORS)
    for batch_size in (1, 3, 7, 64):
        batch = buffer.sample_prioritized(batch_size, 3)
        assert batch.weights.dtype == torch.float32
        assert batch.weights.shape == (batch_size,)
        assert float(batch.weights.max()) == 1.0
        drawn = priorities[batch.indices.numpy() - ids[0]]
        expected = expected_weights(drawn, LENGTHS, priorities, 3, alpha, beta, unit)
        np.testing.assert_allclose(batch.weights.numpy(), expected, rtol=1e-6)


def test_weights_follow_anneal_beta() -> None:
    """After anneal_beta the weights use the annealed beta (and still peak at exactly 1)."""
    buffer, ids = _buffer("chunk", 0.8, beta=0.2, seed=52)
    priorities = priorities_of(ERRORS)
    for fraction, final in [(0.5, 1.0), (1.0, 1.0), (0.25, 3.0)]:
        buffer.anneal_beta(fraction, final)
        beta = 0.2 + fraction * (final - 0.2)
        batch = buffer.sample_prioritized(256, 3)
        drawn = priorities[batch.indices.numpy() - ids[0]]
        expected = expected_weights(drawn, LENGTHS, priorities, 3, 0.8, beta, "chunk")
        assert float(batch.weights.max()) == 1.0
        np.testing.assert_allclose(batch.weights.numpy(), expected, rtol=1e-6)
        # Power: the constructor's beta would give visibly different weights.
        stale = expected_weights(drawn, LENGTHS, priorities, 3, 0.8, 0.2, "chunk")
        assert not np.allclose(batch.weights.numpy(), stale, rtol=1e-3)


# ---------------------------------------------------------------------- anneal_beta
def test_anneal_beta_is_linear_from_the_constructors_beta() -> None:
    """beta = beta0 + fraction (final - beta0), from beta0 every time (calls do not compound)."""
    buffer = PrioritizedSequenceReplay(100, beta=0.4)
    buffer.anneal_beta(0.5)
    assert buffer.beta == pytest.approx(0.7, rel=1e-12)
    buffer.anneal_beta(0.5)
    assert buffer.beta == pytest.approx(0.7, rel=1e-12)
    buffer.anneal_beta(1.0)
    assert buffer.beta == 1.0
    buffer.anneal_beta(0.0)
    assert buffer.beta == 0.4
    buffer.anneal_beta(0.5, final=0.0)
    assert buffer.beta == pytest.approx(0.2, rel=1e-12)
    buffer.anneal_beta(0.25, final=2.0)
    assert buffer.beta == pytest.approx(0.8, rel=1e-12)


@pytest.mark.parametrize(
    ("fraction", "final", "message"),
    [
        (-0.1, 1.0, r"fraction must be .*got -0\.1"),
        (1.5, 1.0, r"fraction must be in \[0, 1\], got 1\.5"),
        (float("nan"), 1.0, r"fraction must be .*got nan"),
        (0.5, -1.0, r"final must be >= 0.*got -1\.0"),
    ],
)
def test_anneal_beta_refuses_bad_arguments(fraction: float, final: float, message: str) -> None:
    """A fraction outside [0, 1] (or a negative final) raises ValueError; beta is unchanged."""
    buffer = PrioritizedSequenceReplay(100, beta=0.4)
    buffer.anneal_beta(0.5)
    with pytest.raises(ValueError, match=message):
        buffer.anneal_beta(fraction, final)
    assert buffer.beta == pytest.approx(0.7, rel=1e-12)


# -------------------------------------------------------------------- max priority
def test_new_episode_gets_the_largest_priority_ever_set() -> None:
    """add uses the max priority: 1.0 at first, then the largest set, even once evicted."""
    buffer = PrioritizedSequenceReplay(8, epsilon=EPSILON)
    first = buffer.add(make_episode(4))
    assert buffer.priorities.tolist() == [1.0]
    second = buffer.add(make_episode(4))
    assert buffer.priorities.tolist() == [1.0, 1.0]
    buffer.update_priorities([first, second], [5.0, 0.25])
    top = 5.0 + EPSILON
    assert buffer.max_priority == top
    third = buffer.add(make_episode(4))  # evicts `first`, the max-priority episode
    assert first not in buffer
    assert list(buffer.episode_ids) == [second, third]
    assert buffer.priorities.tolist() == [0.25 + EPSILON, top]
    buffer.update_priorities([second, third], [0.125, 0.125])  # every stored one is now low
    fourth = buffer.add(make_episode(4))
    assert buffer.max_priority == top
    assert buffer.priorities.tolist() == [0.125 + EPSILON, top]
    assert buffer.update_priorities([fourth], [-7.0]) == 1  # |error|
    assert buffer.max_priority == 7.0 + EPSILON


def test_priorities_below_one_keep_the_initial_maximum() -> None:
    """The maximum starts at 1.0: lowering every priority does not lower what new episodes get."""
    buffer, _ = _buffer(lengths=[4, 4], errors=[0.125, 0.25])
    assert buffer.max_priority == 1.0
    buffer.add(make_episode(4))
    assert buffer.priorities[-1].item() == 1.0


def test_skipped_ids_do_not_raise_the_maximum() -> None:
    """An evicted id's error is skipped: it neither counts nor raises the max priority."""
    buffer = PrioritizedSequenceReplay(8, epsilon=EPSILON)
    gone = buffer.add(make_episode(4))
    kept = buffer.add(make_episode(4))
    newest = buffer.add(make_episode(4))
    assert gone not in buffer
    assert buffer.update_priorities([gone], [100.0]) == 0
    assert buffer.update_priorities([gone, kept], [100.0, 2.0]) == 1
    assert buffer.max_priority == 2.0 + EPSILON
    assert buffer.priorities.tolist() == [2.0 + EPSILON, 1.0]
    buffer.add(make_episode(4))  # evicts `kept`
    assert buffer.priorities.tolist() == [1.0, 2.0 + EPSILON]
    assert newest in buffer


# ---------------------------------------------------------------- update_priorities
@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda i, e: (list(i), list(e)), id="lists"),
        pytest.param(lambda i, e: (np.array(i), np.array(e)), id="numpy"),
        pytest.param(lambda i, e: (np.array(i, np.int32), np.array(e, np.float32)), id="np32"),
        pytest.param(lambda i, e: (torch.tensor(i), torch.tensor(e)), id="tensors"),
        pytest.param(
            lambda i, e: (torch.tensor(i, dtype=torch.int32), torch.tensor(e)), id="int32"
        ),
    ],
)
def test_update_priorities_accepts_lists_arrays_and_tensors(convert) -> None:
    """Lists, numpy arrays and tensors all set p = |error| + epsilon and return the count."""
    buffer, ids = _buffer(lengths=[4, 4, 4], errors=None)
    errors = [0.5, -2.0, 0.0]
    indices, values = convert([ids[2], ids[0], ids[1]], errors)
    assert buffer.update_priorities(indices, values) == 3
    as_float64 = np.asarray(values, dtype=np.float64)  # float32 inputs keep their rounding
    expected = np.abs(as_float64[[1, 2, 0]]) + EPSILON
    np.testing.assert_array_equal(buffer.priorities.numpy(), expected)
    assert buffer.priorities.dtype == torch.float64


@pytest.mark.parametrize("container", [list, tuple])
def test_update_priorities_keeps_python_floats_in_float64(container) -> None:
    """Python-float errors keep float64 precision: p = |error| + epsilon exactly."""
    buffer, ids = _buffer(lengths=[4, 4], errors=None)
    buffer.update_priorities(container(ids), container([0.1, -1 / 3]))
    assert buffer.priorities.tolist() == [0.1 + EPSILON, 1 / 3 + EPSILON]


def test_update_priorities_accepts_finite_errors_beyond_float32() -> None:
    """A finite error above float32's range (1e39) is a valid priority, not an infinite one."""
    buffer, ids = _buffer(lengths=[4, 4], errors=None)
    assert buffer.update_priorities([ids[0]], [1e39]) == 1
    assert buffer.priorities.tolist() == [1e39, 1.0]


def test_update_priorities_duplicates_reduce_with_max_and_count_once() -> None:
    """Duplicate ids take the largest |error|; the return value counts distinct ids."""
    buffer, ids = _buffer(lengths=[4, 4, 4], errors=None)
    applied = buffer.update_priorities(
        [ids[1], ids[0], ids[1], ids[1], ids[0]], [0.5, -0.25, -3.0, 2.0, 0.1]
    )
    assert applied == 2
    assert buffer.priorities.tolist() == [0.25 + EPSILON, 3.0 + EPSILON, 1.0]
    assert buffer.max_priority == 3.0 + EPSILON


def test_priorities_stay_aligned_with_episode_ids() -> None:
    """`priorities[i]` is the priority of `episode_ids[i]`, also after evictions."""
    buffer = PrioritizedSequenceReplay(12, epsilon=EPSILON)
    ids = buffer.extend(make_episode(3) for _ in range(4))
    buffer.update_priorities(ids, [0.0, 1.0, 2.0, 3.0])
    later = buffer.extend(make_episode(3) for _ in range(2))  # evicts ids[0], ids[1]
    buffer.update_priorities(later, [4.0, 5.0])
    assert list(buffer.episode_ids) == [*ids[2:], *later]
    assert buffer.priorities.tolist() == [e + EPSILON for e in (2.0, 3.0, 4.0, 5.0)]


@pytest.mark.statistical
def test_evicted_id_never_touches_the_episode_now_in_its_row() -> None:
    """After the table's rows wrap, an evicted id's update leaves its row's new tenant alone."""
    buffer = PrioritizedSequenceReplay(8, alpha=1.0, epsilon=EPSILON, seed=61)
    first = buffer.add(make_episode(4))
    buffer.sample_prioritized(8, 2)  # build the tree early: later changes are incremental
    rows = buffer._core.store.table.row_count
    for _ in range(rows):
        newest = buffer.add(make_episode(4))
    assert newest == first + rows
    assert buffer._core.store.table.row_of(newest) == buffer._core.store.table.row_of(
        first
    )  # same row, new tenant
    assert buffer._core.store.table.row_count == rows  # no growth: rows really are reused
    before = buffer.priorities.clone()
    assert buffer.update_priorities([first], [1_000.0]) == 0
    assert buffer.update_priorities([first, newest - 1], [1_000.0, 2.0]) == 1
    assert buffer.priorities.tolist() == [2.0 + EPSILON, before[1].item()]
    assert buffer.max_priority == 2.0 + EPSILON
    # The sum tree agrees: p = [2, 1] with alpha = 1, not [2, 1000].
    batch = buffer.sample_prioritized(4_000, 2)
    counts = episode_counts(batch, [newest - 1, newest])
    assert chi_square_pvalue(counts, [2 / 3, 1 / 3]) > ACCEPT
    assert chi_square_pvalue(counts, [2 / 1002, 1000 / 1002]) < REJECT


@pytest.mark.statistical
def test_evicting_one_or_several_episodes_per_add_keeps_draws_and_counts_exact() -> None:
    """Adds into a full buffer that evict one episode (the common case, a path of its own)
    or several leave both cached trees exact and count each never-drawn eviction once."""
    buffer = PrioritizedSequenceReplay(30, alpha=1.0, epsilon=EPSILON, seed=67)
    ids = buffer.extend(make_episode(n) for n in (6, 2, 7, 5, 2, 8))  # 30: full
    buffer.update_priorities(ids, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    drawn: set[int] = set()  # 2-step episodes hold no 3-step chunk: never drawn
    never_drawn_evicted = 0
    # (length, oldest episodes it evicts), from [6, 2, 7, 5, 2, 8]: 6 evicts the 6; 2 the
    # first 2-step one; 9 the 7 and the 5; 4 the second 2-step one; 17 the 8 and the 6 and
    # 2 added here.
    for length, evicts in ((6, 1), (2, 1), (9, 2), (4, 1), (17, 3)):
        for prioritized in (False, True):  # both trees exist before the add
            batch = buffer.sample_prioritized(64, 3) if prioritized else buffer.sample(64, 3)
            drawn.update(batch.episode_ids.tolist())
        before = list(buffer.episode_ids)
        buffer.add(make_episode(length))
        evicted = before[:evicts]
        assert list(buffer.episode_ids) == [*before[evicts:], before[-1] + 1]
        never_drawn_evicted += sum(i not in drawn for i in evicted)
        assert buffer.stats()["episodes_evicted_unsampled"] == never_drawn_evicted
        stored = list(buffer.episode_ids)
        lengths = [len(buffer[i]) for i in stored]
        buffer.update_priorities(stored, np.arange(1.0, len(stored) + 1))  # newest: largest
        priorities = buffer.priorities.numpy()
        uniform = buffer.sample(DRAWS, 3)
        weighted = buffer.sample_prioritized(DRAWS, 3)
        drawn.update(uniform.episode_ids.tolist() + weighted.episode_ids.tolist())
        for batch, law in (
            (uniform, _episode_probs(lengths, np.ones(len(stored)), 3, 1.0, "chunk")),
            (weighted, _episode_probs(lengths, priorities, 3, 1.0, "chunk")),
        ):
            assert set(batch.episode_ids.tolist()) <= set(stored)  # no evicted episode
            assert chi_square_pvalue(episode_counts(batch, stored), law) > ACCEPT, length
    assert never_drawn_evicted == 3  # the 2-step episodes: two evicted alone, one with others
    # Power: the prioritized counts of the last step reject the uniform law.
    uniform_law = _episode_probs(lengths, np.ones(len(stored)), 3, 1.0, "chunk")
    assert chi_square_pvalue(episode_counts(weighted, stored), uniform_law) < REJECT


def test_update_priorities_refuses_never_issued_ids_atomically() -> None:
    """An id never issued (or negative) raises ValueError and updates none of the others."""
    buffer, ids = _buffer(lengths=[4, 4], errors=None)
    for bad in (ids[-1] + 1, 99, -1):
        with pytest.raises(ValueError, match=rf"indices\[1\] must be an issued .*got {bad}"):
            buffer.update_priorities([ids[0], bad], [9.0, 9.0])
    assert buffer.priorities.tolist() == [1.0, 1.0]
    assert buffer.max_priority == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_update_priorities_refuses_non_finite_errors_atomically(bad: float) -> None:
    """A NaN or infinite error raises ValueError naming its position; nothing is updated."""
    buffer, ids = _buffer(lengths=[4, 4], errors=None)
    with pytest.raises(ValueError, match=r"errors\[1\] must be finite, got (nan|-?inf)"):
        buffer.update_priorities(ids, [9.0, bad])
    assert buffer.priorities.tolist() == [1.0, 1.0]
    assert buffer.max_priority == 1.0


@pytest.mark.parametrize(("count", "errors"), [(2, [1.0]), (1, [1.0, 2.0])])
def test_update_priorities_refuses_length_mismatch(count: int, errors: list[float]) -> None:
    """indices and errors of different lengths raise ValueError; nothing is updated."""
    buffer, ids = _buffer(lengths=[4, 4], errors=None)
    with pytest.raises(ValueError, match=rf"errors must be as long as indices \({count}\)"):
        buffer.update_priorities(ids[:count], errors)
    assert buffer.priorities.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "empty",
    [
        pytest.param(([], []), id="lists"),
        pytest.param((np.array([], np.int64), np.array([])), id="numpy"),
        pytest.param((torch.tensor([], dtype=torch.int64), torch.tensor([])), id="tensors"),
    ],
)
def test_update_priorities_with_nothing_applies_nothing(empty) -> None:
    """An empty update (e.g. no learning records this step) returns 0 and changes nothing."""
    buffer, _ = _buffer(lengths=[4, 4], errors=None)
    assert buffer.update_priorities(*empty) == 0
    assert buffer.priorities.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("shape", [(1, 2), ()])
def test_update_priorities_refuses_non_vectors(shape: tuple[int, ...]) -> None:
    """indices that are not one-dimensional raise ValueError naming the shape."""
    buffer, ids = _buffer(lengths=[4, 4], errors=None)
    indices = torch.tensor(ids[:2]).reshape(shape) if shape else torch.tensor(ids[0])
    errors = torch.ones(shape)
    with pytest.raises(
        ValueError, match=re.escape(f"indices must be one-dimensional, got {shape}")
    ):
        buffer.update_priorities(indices, errors)
    assert buffer.priorities.tolist() == [1.0, 1.0]


def test_update_priorities_refuses_float_ids() -> None:
    """Float ids are a dtype mismatch: TypeError, nothing updated."""
    buffer, ids = _buffer(lengths=[4, 4], errors=None)
    with pytest.raises(TypeError, match=r"indices must be integers, got dtype"):
        buffer.update_priorities([float(ids[0])], [3.0])
    assert buffer.priorities.tolist() == [1.0, 1.0]


def test_refused_update_leaves_draws_unchanged() -> None:
    """A refused update does not dirty the trees: draws equal an untouched twin's."""
    buffer, ids = _buffer(seed=71)
    twin, _ = _buffer(seed=71)
    buffer.sample_prioritized(4, 3)
    twin.sample_prioritized(4, 3)
    with pytest.raises(ValueError, match=r"must be finite"):
        buffer.update_priorities(ids, [100.0] * (len(ids) - 1) + [float("nan")])
    ours, theirs = buffer.sample_prioritized(256, 3), twin.sample_prioritized(256, 3)
    assert torch.equal(ours.indices, theirs.indices) and torch.equal(ours.starts, theirs.starts)
    assert torch.equal(ours.weights, theirs.weights)


# --------------------------------------------------------------- update_priorities_from
def _routing_buffer():
    """The standard buffer (epsilon 0.25) and its routing windows (see ROUTING_ERRORS)."""
    buffer = standard_buffer(PrioritizedSequenceReplay, epsilon=0.25, seed=0)
    window = Window(**TABLE_WINDOW, boundary="include_reset")
    batch = buffer.gather_windows(ROUTING_IDS, ROUTING_STEPS, window)
    return buffer, batch


def test_update_priorities_from_applies_the_r2d2_mix_over_counted_records():
    """eta*max|d| + (1-eta)*mean|d| over learning, valid, own-episode records; duplicates max."""
    buffer, batch = _routing_buffer()
    applied = buffer.update_priorities_from(batch, torch.tensor(ROUTING_ERRORS), eta=0.75)
    assert applied == 3
    # p = mix + epsilon: episode 0 -> 0.5, episode 1 -> 1.5, episode 2 -> max(4.0, 2.75).
    assert buffer.priorities.tolist() == [0.75, 1.75, 4.25]
    assert buffer.max_priority == 4.25


def test_update_priorities_from_default_eta_is_0_9():
    """The default eta is 0.9: max 3 and mean 2 give 0.9*3 + 0.1*2 = 2.9."""
    buffer, batch = _routing_buffer()
    errors = torch.tensor(ROUTING_ERRORS)
    errors[0, 2] = 0.0  # episode 2's other window now mixes to 0
    assert buffer.update_priorities_from(batch, errors) == 3
    assert buffer.priorities.tolist() == pytest.approx([0.75, 1.75, 3.15])


def test_update_priorities_from_non_finite_inside_the_mask_raises_and_updates_nothing():
    """A NaN or inf on a counted record raises ValueError; no priority changes."""
    for row, column, value in [(1, 2, NAN), (3, 3, INF), (0, 2, -INF)]:
        buffer, batch = _routing_buffer()
        errors = torch.tensor(ROUTING_ERRORS)
        errors[row, column] = value
        with pytest.raises(
            ValueError,
            match=r"^errors must be finite on valid learning records, got "
            r"a NaN or infinite value$",
        ):
            buffer.update_priorities_from(batch, errors, eta=0.75)
        assert buffer.priorities.tolist() == [1.0, 1.0, 1.0]
        assert buffer.max_priority == 1.0


def test_update_priorities_from_per_window_errors_are_used_as_they_are():
    """[B] errors become the windows' priorities directly (|e| + epsilon, duplicates max)."""
    buffer, batch = _routing_buffer()
    # Windows of episodes [2, 0, 1, 2].
    assert buffer.update_priorities_from(batch, [1.0, -2.0, 3.0, 0.5]) == 3
    assert buffer.priorities.tolist() == [2.25, 3.25, 1.25]


def test_update_priorities_from_never_routes_to_episodes_reached_through_include_reset():
    """Episodes only reached through include_reset records keep their priority."""
    buffer = standard_buffer(PrioritizedSequenceReplay, epsilon=0.25, seed=0)
    # Anchor (1, 0) reaches episodes 0 and 2 through its records; only episode 1 is updated.
    batch = buffer.gather_windows([1], [0], Window(**TABLE_WINDOW, boundary="include_reset"))
    assert batch.record_episode_ids.tolist() == [[0, 0, 1, 2, 2]]
    assert buffer.update_priorities_from(batch, [[50.0, 50.0, 2.0, 50.0, 50.0]]) == 1
    assert buffer.priorities.tolist() == [1.0, 2.25, 1.0]


def test_update_priorities_from_rejects_bad_shapes_and_batches():
    """Errors not [B, W] or [B] raise ValueError; a non-WindowBatch raises TypeError."""
    buffer, batch = _routing_buffer()
    with pytest.raises(
        ValueError, match=r"^errors must be of shape \(4, 5\) or \(4,\), got \(4, 4\)$"
    ):
        buffer.update_priorities_from(batch, torch.zeros(4, 4))
    with pytest.raises(
        ValueError, match=r"^errors must be of shape \(4, 5\) or \(4,\), got \(5,\)$"
    ):
        buffer.update_priorities_from(batch, torch.zeros(5))
    with pytest.raises(TypeError, match=r"^batch must be a WindowBatch, got PrioritizedBatch$"):
        buffer.update_priorities_from(buffer.sample_prioritized(4, 1), torch.zeros(4))
    assert buffer.priorities.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("eta", "error", "message"),
    [
        (-0.1, ValueError, r"^eta must be >= 0\.0 and finite, got -0\.1$"),
        (1.5, ValueError, r"^eta must be in \[0, 1\], got 1\.5$"),
        (float("nan"), ValueError, r"^eta must be >= 0\.0 and finite, got nan$"),
        ("0.5", TypeError, r"^eta must be a real number, got '0\.5'$"),
    ],
)
def test_update_priorities_from_validates_eta(eta, error, message):
    """eta outside [0, 1] (or not a real number) is refused and nothing is updated."""
    buffer, batch = _routing_buffer()
    with pytest.raises(error, match=message):
        buffer.update_priorities_from(batch, torch.tensor(ROUTING_ERRORS), eta=eta)
    assert buffer.priorities.tolist() == [1.0, 1.0, 1.0]


def test_update_priorities_from_accepts_eta_0_and_1():
    """eta=1 is the max alone, eta=0 the mean alone."""
    buffer, batch = _routing_buffer()
    buffer.update_priorities_from(batch, torch.tensor(ROUTING_ERRORS), eta=1.0)
    assert buffer.priorities.tolist() == [0.75, 1.75, 4.25]  # episode 2: max(4, 3)
    errors = torch.tensor(ROUTING_ERRORS)
    errors[0, 2] = 0.0
    buffer.update_priorities_from(batch, errors, eta=0.0)
    assert buffer.priorities.tolist() == [0.75, 1.75, 2.25]  # episode 2: mean(3, 1)


def test_update_priorities_from_skips_evicted_episodes():
    """Windows of episodes evicted since the draw are skipped and not counted."""
    buffer = standard_buffer(PrioritizedSequenceReplay, capacity=12, epsilon=0.25, seed=0)
    batch = buffer.gather_windows([0, 2], [0, 0], Window(1))
    buffer.add(make_episode(4))  # evicts episode 0; episode 3 reuses its ring slots
    assert list(buffer.episode_ids) == [1, 2, 3]
    assert buffer.update_priorities_from(batch, [[8.0], [2.0]]) == 1
    assert buffer.priorities.tolist() == [1.0, 2.25, 1.0]
    assert buffer.max_priority == 2.25


def test_update_priorities_from_takes_values_of_grad_requiring_errors():
    """TD errors that require grad set plain priorities: nothing of the graph is kept."""
    buffer, batch = _routing_buffer()
    scale = torch.tensor(1.0, requires_grad=True)
    applied = buffer.update_priorities_from(batch, torch.tensor(ROUTING_ERRORS) * scale, eta=0.75)
    assert applied == 3
    assert buffer.priorities.tolist() == [0.75, 1.75, 4.25]
    assert not buffer.priorities.requires_grad


def test_update_priorities_from_mask_narrows_the_counted_records():
    """mask= leaves out records without a TD error; a window left with none keeps its priority."""
    buffer = PrioritizedSequenceReplay(capacity=100, alpha=1.0, seed=0)
    first, second = buffer.add(make_episode(6)), buffer.add(make_episode(6))
    batch = buffer.gather_windows([first, second], [0, 0], Window(3))
    errors = torch.tensor([[1.0, 2.0, 8.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    applied = buffer.update_priorities_from(batch, errors, eta=0.5, mask=mask)
    assert applied == 1
    expected = 0.5 * 2.0 + 0.5 * 1.5 + buffer.epsilon
    assert buffer.priorities.tolist() == pytest.approx([expected, 1.0])
    with pytest.raises(ValueError, match=r"mask must be a bool tensor of shape \(2, 3\)"):
        buffer.update_priorities_from(batch, errors, mask=torch.ones(2, 3))


@pytest.mark.parametrize("form", ["per-window", "per-record"])
def test_update_priorities_from_refuses_a_batch_with_ids_never_issued_here(form):
    """A batch of another buffer whose anchors this buffer never issued is refused in both
    forms, with nothing updated (old: [B, W] errors applied the issued ids and skipped the
    rest silently)."""
    source = PrioritizedSequenceReplay(capacity=1000, seed=0)
    target = PrioritizedSequenceReplay(capacity=1000, seed=0)
    source.extend(make_episode(10) for _ in range(10))
    target.extend(make_episode(10) for _ in range(3))
    batch = source.sample_windows(32, Window(3))
    assert int(batch.episode_ids.max()) >= 3
    errors = torch.full((32,), 4.0) if form == "per-window" else torch.full((32, 3), 4.0)
    param = "indices" if form == "per-window" else "batch.episode_ids"
    match = rf"{re.escape(param)}\[\d+\] must be an issued episode id \(0 \.\. 2\)"
    assert_refused(target, lambda: target.update_priorities_from(batch, errors), ValueError, match)


def test_update_priorities_from_refuses_a_mask_with_per_window_errors():
    """``mask=`` selects records, which ``[B]`` errors do not have: refused, nothing updated
    (old: the mask was ignored)."""
    buffer = PrioritizedSequenceReplay(capacity=100, seed=0)
    first, second = buffer.add(make_episode(6)), buffer.add(make_episode(6))
    batch = buffer.gather_windows([first, second], [0, 0], Window(3))
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert_refused(
        buffer,
        lambda: buffer.update_priorities_from(batch, torch.tensor([1.0, 2.0]), mask=mask),
        ValueError,
        r"mask must be None with per-window errors \[B\]",
    )


# ------------------------------------------------------------------ extreme priorities


def test_weights_of_extreme_priorities_match_the_formula_in_the_log_domain():
    """``w = (p_min / p)^(alpha beta)`` over the batch, computed without overflow."""
    buffer = PrioritizedSequenceReplay(100, alpha=50.0, beta=0.5, seed=1)
    ids = buffer.extend(make_episode(5) for _ in range(2))
    buffer.update_priorities(ids, [1e7, 1.01e7])
    batch = buffer.sample_prioritized(256, 3)
    priorities = np.array([1e7, 1.01e7]) + EPSILON
    drawn = priorities[batch.indices.numpy() - ids[0]]
    expected = (drawn.min() / drawn) ** (50.0 * 0.5)
    np.testing.assert_allclose(batch.weights.numpy(), expected, rtol=1e-5)


def test_error_whose_priority_would_be_infinite_is_refused():
    """``|error| + epsilon`` beyond float64 is refused, nothing updated."""
    buffer = PrioritizedSequenceReplay(100, epsilon=1e308, seed=0)
    buffer.add(make_episode(4))
    assert_refused(buffer, lambda: buffer.update_priorities([0], [1.7e308]), ValueError, "epsilon")
