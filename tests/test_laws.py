"""Selection laws as values: keys, leaf values, probabilities, weights, and the draws they drive."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_episode
from stats import eligible_starts

from lucid_replay import PrioritizedSequenceReplay, SequenceReplay, Window, engine
from lucid_replay.laws import (
    Prioritized,
    Uniform,
    importance_weights,
    of_flag,
    priority_weights,
)
from lucid_replay.records import Anchors
from lucid_replay.selectors import from_key

LENGTHS = (3, 5, 8, 13, 4, 9)
ERRORS = (0.5, 3.0, 1.0, 0.25, 2.0, 1e-3)
WINDOW = Window(3, burn_in=2, bootstrap=1)


def _buffer(unit: str = "chunk", seed: int = 5) -> PrioritizedSequenceReplay:
    """Six episodes (``LENGTHS``) with priorities ``ERRORS`` (+ epsilon), alpha 0.7, beta 0.5."""
    buffer = PrioritizedSequenceReplay(capacity=200, alpha=0.7, beta=0.5, seed=seed, unit=unit)
    ids = buffer.extend(make_episode(n, first_serial=100 * n) for n in LENGTHS)
    buffer.update_priorities(ids, list(ERRORS))
    return buffer


def _all_rows(buffer: SequenceReplay):
    return engine.view(torch.arange(buffer._core.store.table.row_count))


def _by_row(buffer: SequenceReplay, values) -> np.ndarray:
    """Per-episode ``values`` (in `LENGTHS` order) placed at the episodes' table rows."""
    table = buffer._core.store.table
    rows = table.rows_of(torch.tensor(buffer.episode_ids)).numpy()
    placed = np.zeros(table.row_count)
    placed[rows] = values
    return placed


def test_laws_are_values_keyed_as_the_trees_are():
    """Equal laws are equal and hash alike; keys are None (uniform) or alpha, and map back."""
    assert Uniform() == Uniform() and hash(Uniform()) == hash(Uniform())
    assert Prioritized(0.7) == Prioritized(0.7) != Prioritized(0.6)
    assert Uniform().key is None and Prioritized(0.7).key == 0.7
    assert from_key(None) == Uniform() and from_key(0.7) == Prioritized(0.7)
    assert not Uniform().by_priority and Prioritized(0.7).by_priority
    assert of_flag(True, Prioritized(0.7)) == Prioritized(0.7)
    assert of_flag(False, Prioritized(0.7)) == Uniform()


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_leaf_values_are_eligible_units_times_priority_to_the_alpha(unit):
    """Uniform leaves are ``n_e`` (``[n_e > 0]`` by episode); prioritized ones times
    ``(p_e / s)^alpha``, with ``s`` the largest eligible priority; 0 for no eligible anchor."""
    buffer, span = _buffer(unit), WINDOW.anchor_span
    trees, table = buffer._core.sampler.trees, buffer._core.store.table
    counts = eligible_starts(list(LENGTHS), span)
    units = counts if unit == "chunk" else (counts > 0).astype(float)
    priorities = np.abs(ERRORS) + buffer.epsilon
    scale = priorities[counts > 0].max()
    rows = _all_rows(buffer)
    unit_masses = trees.unit_masses(rows, span)
    uniform = Uniform().leaf_values(table, rows, unit_masses, 1.0)
    np.testing.assert_array_equal(engine.tensor(uniform).numpy(), _by_row(buffer, units))
    law = Prioritized(0.7)
    assert law.scale(table, rows[unit_masses > 0]) == scale
    leaves = engine.tensor(law.leaf_values(table, rows, unit_masses, scale)).numpy()
    expected = _by_row(buffer, units * (priorities / scale) ** 0.7)
    np.testing.assert_allclose(leaves, expected, rtol=1e-15, atol=0)
    assert trees.cached(span, law).scale == scale  # the tree was built at the same scale
    np.testing.assert_array_equal(trees.leaf_values(rows, span, law, scale), leaves)


def test_masses_that_overflow_give_no_leaf_to_rows_without_an_eligible_anchor():
    """``(p / s)^alpha`` may overflow to inf; a row with unit mass 0 still gets leaf 0."""
    table = SimpleNamespace(arrays={"priority": np.array([1e300, 1e300, 1.0])})
    rows, units = np.arange(3), np.array([0, 2, 1])
    leaves = Prioritized(50.0).leaf_values(table, rows, units, 1.0)
    assert leaves[0] == 0.0 and leaves[1] == np.inf and leaves[2] == 1.0


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_probabilities_are_the_mass_over_the_total_mass(unit):
    """``P = p^alpha / sum_e n_e p_e^alpha`` per anchor (by episode: over eligible episodes),
    ``1 / N`` uniformly; the probabilities of every anchor (episode) sum to 1."""
    buffer, span = _buffer(unit), WINDOW.anchor_span
    core, table = buffer._core, buffer._core.store.table
    counts = eligible_starts(list(LENGTHS), span)
    units = counts if unit == "chunk" else (counts > 0).astype(float)
    powered = (np.abs(ERRORS) + buffer.epsilon) ** 0.7
    rows = table.rows_of(torch.tensor(buffer.episode_ids))
    anchors = Anchors(engine.view(rows), engine.view(rows), engine.view(rows))
    for law, masses in ((Prioritized(0.7), powered), (Uniform(), np.ones(len(LENGTHS)))):
        expected = np.where(units > 0, masses / (units * masses).sum(), 0.0)
        got = engine.tensor(core.probability(anchors, span, law)).numpy()
        got = np.where(units > 0, got, 0.0)  # rows without an anchor are never drawn
        np.testing.assert_allclose(got, expected, rtol=1e-13, atol=0)
        assert (units * got).sum() == pytest.approx(1.0, rel=1e-13)


def test_weights_from_probabilities_equal_the_exact_priority_shortcut():
    """``(P_min / P)^beta`` of the prioritized probabilities is ``(p_min / p)^(alpha beta)``;
    uniform probabilities give weights of 1."""
    priorities = np.array([2.0, 1.0, 4.0, 1.0, 1e-3])
    probabilities = priorities**0.7 / (priorities**0.7).sum()
    exact = priority_weights(priorities, 0.7 * 0.5)
    assert exact.dtype == np.float32 and exact.max() == 1.0
    np.testing.assert_allclose(importance_weights(probabilities, 0.5), exact, rtol=1e-6)
    rows = np.arange(5)
    anchors = Anchors(rows, rows, rows, priorities)
    shortcut = Prioritized(0.7).weights(anchors, lambda: probabilities[:0], 0.5)
    np.testing.assert_array_equal(shortcut, exact)  # never asks for the probabilities
    uniform = Uniform().weights(anchors, lambda: np.full(5, 0.2), 0.5)
    np.testing.assert_array_equal(uniform, np.ones(5, dtype=np.float32))


# Draws of `_buffer()` and of a uniform buffer by episode, as the code before laws drew them.
PRIORITIZED_WINDOWS = (
    [3, 2, 1, 2, 4, 2, 3, 1],
    [2, 1, 2, 4, 0, 1, 2, 0],
    [
        1.0,
        0.6155728697776794,
        0.4190705418586731,
        0.6155728697776794,
        0.4829687476158142,
        0.6155728697776794,
        1.0,
        0.4190705418586731,
    ],
)
UNIFORM_WINDOWS = ([3, 4, 3, 1, 5, 2, 3, 5], [4, 1, 4, 1, 1, 0, 9, 6])
PRIORITIZED_CHUNKS = (
    [1, 4, 2, 2, 3, 3],
    [0, 0, 3, 2, 5, 7],
    [0.4190705418586731, 0.4829687476158142, 0.6155728697776794, 0.6155728697776794, 1.0, 1.0],
)
EPISODE_CHUNKS = ([4, 2, 2, 3, 5, 2], [0, 1, 4, 7, 2, 1])


@pytest.mark.usefixtures("index_engine")
def test_draws_by_law_are_the_draws_before_laws():
    """Draws by `Prioritized` and `Uniform` (through the core and the public methods) are,
    with a fixed seed, those of the code that threaded a ``prioritized`` flag instead."""
    buffer = _buffer()
    core = buffer._core
    drawn = core.draw(8, WINDOW, Prioritized(0.7), weights=True)
    ids, steps = engine.tensor(drawn.episode_ids).tolist(), engine.tensor(drawn.steps).tolist()
    assert (ids, steps, engine.tensor(drawn.weights).tolist()) == PRIORITIZED_WINDOWS
    drawn = core.draw(8, WINDOW, Uniform())
    ids, steps = engine.tensor(drawn.episode_ids).tolist(), engine.tensor(drawn.steps).tolist()
    assert (ids, steps) == UNIFORM_WINDOWS and drawn.weights is None
    chunks = buffer.sample_prioritized(6, 4)
    got = (chunks.indices.tolist(), chunks.starts.tolist(), chunks.weights.tolist())
    assert got == PRIORITIZED_CHUNKS
    uniform = SequenceReplay(capacity=200, unit="episode", seed=5)
    uniform.extend(make_episode(n, first_serial=100 * n) for n in LENGTHS)
    assert uniform._core.law == Uniform()
    chunks = uniform.sample(6, 4)
    assert (chunks.episode_ids.tolist(), chunks.starts.tolist()) == EPISODE_CHUNKS
