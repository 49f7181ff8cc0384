"""`sum_tree`: build, search and batched updates against a naive numpy prefix-sum model.

The naive model is a Python loop over nodes (`_naive_tree`) and ``np.cumsum`` +
``np.searchsorted`` for the search. Sums are float64; the hazards the module docstring names
(rounding walking the search into zero-mass leaves or past the end, deltas drifting) are
probed with targets placed exactly on interval boundaries and at the total.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lucid_replay import engine, sum_tree

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic

SETTINGS = settings(max_examples=80, deadline=None)

# Leaf values: many exact zeros (zero-mass subtrees), small integers (ties on boundaries),
# decimals that are not exactly representable, and widely spread magnitudes (rounding).
_LEAF = st.one_of(
    st.just(0.0),
    st.integers(1, 8).map(float),
    st.sampled_from([0.1, 0.2, 0.3, 0.7, 1e-3, 1e-9]),
    st.floats(min_value=1e-12, max_value=1e9, allow_nan=False, allow_infinity=False),
)


@st.composite
def leaf_arrays(draw: st.DrawFn, max_log2: int = 7) -> np.ndarray:
    """float64 leaves of a power-of-two length 1 .. 2**max_log2."""
    count = 2 ** draw(st.integers(0, max_log2))
    return np.array(draw(st.lists(_LEAF, min_size=count, max_size=count)), dtype=np.float64)


def _naive_tree(leaves: np.ndarray) -> np.ndarray:
    """Node i = node 2i + node 2i+1, one node at a time (node 0 unused, zero)."""
    count = len(leaves)
    tree = np.zeros(2 * count, dtype=np.float64)
    tree[count:] = leaves
    for node in range(count - 1, 0, -1):
        tree[node] = tree[2 * node] + tree[2 * node + 1]
    return tree


def _tensor(values: np.ndarray | list[float]) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.float64), dtype=torch.float64)


def _search(tree: torch.Tensor, targets: np.ndarray | list[float]) -> np.ndarray:
    return sum_tree.search(tree, _tensor(targets)).numpy()


# ------------------------------------------------------------------------------- build
@SETTINGS
@given(leaf_arrays())
def test_build_matches_naive_tree_bitwise(leaves: np.ndarray) -> None:
    """`build` gives every internal node exactly left + right, as a node-by-node loop does."""
    tree = sum_tree.build(_tensor(leaves))
    assert tree.dtype == torch.float64
    assert tree.shape == (2 * len(leaves),)
    np.testing.assert_array_equal(tree.numpy()[1:], _naive_tree(leaves)[1:])


@SETTINGS
@given(leaf_arrays())
def test_total_and_leaves_accessors(leaves: np.ndarray) -> None:
    """`total` is the root (0-d, = the leaf sum), `leaves` a view of the leaves, `leaf_count` n."""
    tree = sum_tree.build(_tensor(leaves))
    root = sum_tree.total(tree)
    assert root.dim() == 0
    assert float(root) == pytest.approx(math.fsum(leaves), rel=1e-12, abs=0.0)
    assert sum_tree.leaf_count(tree) == len(leaves)
    view = sum_tree.leaves(tree)
    np.testing.assert_array_equal(view.numpy(), leaves)
    assert view.data_ptr() == tree[len(leaves) :].data_ptr()


def test_build_converts_float32_leaves_to_a_float64_tree() -> None:
    """Leaves of another dtype give a float64 tree (float32 sums drift)."""
    tree = sum_tree.build(torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float32))
    assert tree.dtype == torch.float64
    assert float(sum_tree.total(tree)) == pytest.approx(1.0, rel=1e-7)


@pytest.mark.parametrize("count", [0, 3, 5, 6, 12, 1000])
def test_build_refuses_non_power_of_two_lengths(count: int) -> None:
    """`build` raises ValueError naming the length for a non-power-of-two (or empty) input."""
    with pytest.raises(ValueError, match=rf"power-of-two length, got {count}$"):
        sum_tree.build(torch.ones(count, dtype=torch.float64))


def test_build_hand_computed_tree() -> None:
    """A hand-computed 4-leaf tree: root 10, level [3, 7], leaves [1, 2, 3, 4]."""
    tree = sum_tree.build(_tensor([1, 2, 3, 4]))
    assert tree[1:].tolist() == [10.0, 3.0, 7.0, 1.0, 2.0, 3.0, 4.0]


# ------------------------------------------------------------------------------ search
@SETTINGS
@given(leaf_arrays(), st.lists(st.floats(0.02, 0.98), min_size=1, max_size=8))
def test_search_matches_searchsorted_inside_intervals(
    leaves: np.ndarray, fractions: list[float]
) -> None:
    """Targets strictly inside leaf j's interval give j, as searchsorted(cumsum, side=right)."""
    total = math.fsum(leaves)
    assume(total > 0)
    prefix = np.concatenate([[0.0], np.cumsum(leaves)])
    # Leaves too light for the rounding gap between pairwise and sequential sums to be
    # negligible are skipped: "strictly inside" must survive either summation order.
    heavy = np.flatnonzero(leaves > 1e-9 * total)
    targets, expected = [], []
    for j in heavy:
        for fraction in fractions:
            targets.append(prefix[j] + fraction * leaves[j])
            expected.append(j)
    naive = np.searchsorted(np.cumsum(leaves), targets, side="right")
    np.testing.assert_array_equal(naive, expected)  # the model agrees with itself
    np.testing.assert_array_equal(_search(sum_tree.build(_tensor(leaves)), targets), expected)


@SETTINGS
@given(leaf_arrays(), st.integers(0, 2**32 - 1))
def test_search_never_returns_a_zero_mass_leaf(leaves: np.ndarray, seed: int) -> None:
    """Targets on every boundary, at the total and uniform in [0, total) hit positive leaves."""
    assume(leaves.sum() > 0)
    tree = sum_tree.build(_tensor(leaves))
    total = float(sum_tree.total(tree))
    naive = _naive_tree(leaves)
    # The tree's own prefix sums (pairwise) and numpy's (sequential) both, and their neighbours.
    boundaries = np.concatenate([np.cumsum(leaves), _tree_prefix_sums(naive)])
    neighbours = np.concatenate(
        [np.nextafter(boundaries, np.inf), np.nextafter(boundaries, -np.inf)]
    )
    uniform = np.random.default_rng(seed).random(64) * total
    targets = np.concatenate(
        [boundaries, neighbours, uniform, [0.0, total, np.nextafter(total, 0.0)]]
    )
    targets = targets[(targets >= 0) & (targets <= total)]
    found = _search(tree, targets)
    assert ((found >= 0) & (found < len(leaves))).all()
    assert (leaves[found] > 0).all(), targets[leaves[found] <= 0]


def _tree_prefix_sums(naive: np.ndarray) -> np.ndarray:
    """The prefix sums as the tree sees them: the sum of the left siblings on each leaf's path."""
    count = len(naive) // 2
    sums = []
    for leaf in range(count):
        node, prefix = leaf + count, 0.0
        while node > 1:
            if node % 2 == 1:
                prefix += naive[node - 1]
            node //= 2
        sums.append(prefix)
    return np.array(sums)


@pytest.mark.parametrize(
    ("leaves", "target", "expected"),
    [
        # 0.1 + 0.2 rounds up to 0.30000000000000004; the trailing zeros must not be entered.
        ([0.1, 0.2, 0.0, 0.0], 0.30000000000000004, 1),
        ([0.1, 0.2, 0.0, 0.0], 0.3, 1),
        # The root rounds the right subtree away: 1e16 + 1 == 1e16 in float64.
        ([1e16, 0.0, 1.0, 0.0], 1e16, 2),
        ([1e16, 0.0, 0.0, 0.0], 1e16, 0),
        # Exactly on an interior boundary: the interval is half-open, [1, 3) is leaf 2.
        ([1.0, 0.0, 2.0, 0.0], 1.0, 2),
        ([0.0, 0.0, 0.0, 5.0], 0.0, 3),
        ([0.0, 0.0, 0.0, 5.0], 5.0, 3),
        ([2.0], 2.0, 0),
    ],
)
def test_search_rounding_hazards(leaves: list[float], target: float, expected: int) -> None:
    """Hand-picked float64 rounding hazards at boundaries and at the total."""
    assert _search(sum_tree.build(_tensor(leaves)), [target]).tolist() == [expected]


@pytest.mark.statistical
def test_search_with_uniform_targets_hits_leaves_in_proportion() -> None:
    """Uniform targets on [0, total) hit each leaf with probability leaf / total (chi-square)."""
    leaves = np.array([1.0, 0.0, 3.0, 0.5, 0.0, 2.0, 6.0, 0.25])
    tree = sum_tree.build(_tensor(leaves))
    targets = np.random.default_rng(7).random(40_000) * leaves.sum()
    counts = np.bincount(_search(tree, targets), minlength=len(leaves))
    assert counts[leaves == 0].sum() == 0
    positive = leaves > 0
    expected = leaves[positive] / leaves.sum() * counts.sum()
    assert scipy.stats.chisquare(counts[positive], expected).pvalue > 1e-3
    # Power: a flat distribution over the positive leaves is rejected outright.
    flat = np.full(positive.sum(), counts.sum() / positive.sum())
    assert scipy.stats.chisquare(counts[positive], flat).pvalue < 1e-6


def test_search_keeps_target_shape() -> None:
    """A batch of targets of any shape gives int64 leaves of the same shape."""
    tree = sum_tree.build(_tensor([1, 1, 1, 1]))
    found = sum_tree.search(tree, _tensor([[0.5, 1.5, 2.5], [3.5, 0.0, 3.0]]))
    assert found.dtype == torch.int64
    assert found.tolist() == [[0, 1, 2], [3, 0, 3]]


# ---------------------------------------------------------------------- updates: refresh
def _set_leaves(tree: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Leaves ``indices`` set to ``values`` (a repeated index: its largest), then refreshed."""
    engine.assign_max(sum_tree.leaves(tree), indices, values.to(tree.dtype))
    sum_tree.refresh(tree, indices)


@st.composite
def update_batches(draw: st.DrawFn, count: int) -> tuple[list[int], list[float]]:
    """One batch of updates: indices (duplicates allowed) and values."""
    indices = draw(st.lists(st.integers(0, count - 1), min_size=0, max_size=2 * count + 2))
    values = draw(st.lists(_LEAF, min_size=len(indices), max_size=len(indices)))
    return indices, values


@SETTINGS
@given(st.data())
def test_refreshed_leaves_matches_rebuild_bitwise(data: st.DataObject) -> None:
    """Any sequence of batched updates leaves the tree bitwise equal to `build` of the leaves."""
    leaves = data.draw(leaf_arrays(max_log2=5))
    tree = sum_tree.build(_tensor(leaves))
    model = leaves.copy()
    for _ in range(data.draw(st.integers(1, 4))):
        indices, values = data.draw(update_batches(len(leaves)))
        # Naive: duplicates reduce with max, then plain assignment.
        reduced: dict[int, float] = {}
        for index, value in zip(indices, values, strict=True):
            reduced[index] = max(reduced.get(index, -math.inf), value)
        for index, value in reduced.items():
            model[index] = value
        _set_leaves(tree, torch.tensor(indices, dtype=torch.int64), _tensor(values))
        np.testing.assert_array_equal(tree.numpy()[1:], _naive_tree(model)[1:])
        np.testing.assert_array_equal(tree.numpy(), sum_tree.build(_tensor(model)).numpy())


def test_refreshed_leaves_duplicate_indices_reduce_with_max() -> None:
    """Duplicate indices in one call keep the largest value, whatever their order."""
    tree = sum_tree.build(_tensor([1, 1, 1, 1]))
    _set_leaves(tree, torch.tensor([2, 0, 2, 2, 0]), _tensor([5, 0.5, 9, 7, 0.25]))
    assert sum_tree.leaves(tree).tolist() == [0.5, 1.0, 9.0, 1.0]
    assert float(sum_tree.total(tree)) == 11.5


def test_refreshed_leaves_zeroed_subtree_sums_to_exact_zero() -> None:
    """Zeroing inexact leaves leaves their subtree exactly 0.0 (recomputed, not delta-adjusted)."""
    tree = sum_tree.build(_tensor([0.1, 0.2, 0.3, 0.7]))
    _set_leaves(tree, torch.tensor([0, 1]), _tensor([0.0, 0.0]))
    assert float(tree[2]) == 0.0
    assert float(sum_tree.total(tree)) == float(tree[3]) == 0.3 + 0.7
    assert _search(tree, [0.0]).tolist() == [2]


def test_refreshed_leaves_with_no_indices_changes_nothing() -> None:
    """An empty update is a no-op."""
    tree = sum_tree.build(_tensor([1, 2, 3, 4]))
    before = tree.clone()
    _set_leaves(tree, torch.empty(0, dtype=torch.int64), _tensor([]))
    assert torch.equal(tree, before)


def test_refreshed_leaves_distinct_unsorted_indices() -> None:
    """Distinct indices in any order set exactly their own values."""
    tree = sum_tree.build(_tensor([0, 0, 0, 0]))
    _set_leaves(tree, torch.tensor([3, 1]), _tensor([10.0, 20.0]))
    assert sum_tree.leaves(tree).tolist() == [0.0, 20.0, 0.0, 10.0]
