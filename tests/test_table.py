"""The episode table: priorities set by id, a repeated id taking its largest value, evicted ids
skipped, on every index engine (compiled kernels, numpy, torch)."""

from __future__ import annotations

import math

import pytest
import torch

from lucid_replay import engine
from lucid_replay.table import EpisodeTable

pytestmark = pytest.mark.usefixtures("index_engine")


def _table() -> EpisodeTable:
    """Ids 0..5 appended (priority 1), then 0 and 1 evicted: ids 2..5 stored."""
    table = EpisodeTable(torch.device("cpu"))
    for length in (3, 4, 5, 6, 7, 8):
        table.append(length, terminated=False, priority=1.0)
    table.evict_oldest(2)
    return table


def _assign(table: EpisodeTable, ids: list[int], values: list[float]):
    rows, distinct, largest = table.assign_priorities(
        engine.view(torch.tensor(ids)), engine.view(torch.tensor(values, dtype=torch.float64))
    )
    return engine.tensor(rows).tolist(), distinct, largest


def test_assign_priorities_takes_the_largest_value_of_a_repeated_id():
    """Ids 3 (twice), 5 and 3 again: 3 gets its largest value, rows come back one per id."""
    table = _table()
    rows, distinct, largest = _assign(table, [3, 5, 3, 3], [2.0, 0.5, 7.0, 4.0])
    assert (rows, distinct, largest) == ([3, 5, 3, 3], 2, 7.0)
    assert table.priority[[2, 3, 4, 5]].tolist() == [1.0, 7.0, 1.0, 0.5]


def test_assign_priorities_skips_ids_that_are_not_stored():
    """Evicted ids 0 and 1 and never-issued 6 touch nothing (id 6 would share row 6)."""
    table = _table()
    before = table.priority.clone()
    rows, distinct, largest = _assign(table, [0, 4, 1, 6], [9.0, 3.0, 9.0, 9.0])
    assert (rows, distinct, largest) == ([4], 1, 3.0)
    expected = before.clone()
    expected[4] = 3.0
    assert torch.equal(table.priority, expected)


def test_assign_priorities_of_no_stored_id_changes_nothing():
    """Only evicted ids: no row, zero distinct, largest -inf, priorities untouched."""
    table = _table()
    before = table.priority.clone()
    rows, distinct, largest = _assign(table, [0, 1, 0], [5.0, 6.0, 7.0])
    assert (rows, distinct, largest) == ([], 0, -math.inf)
    assert torch.equal(table.priority, before)


def test_assign_priorities_lowers_as_well_as_raises():
    """The value replaces the stored priority: a smaller one lowers it."""
    table = _table()
    _assign(table, [2], [9.0])
    _assign(table, [2, 2], [0.25, 0.125])
    assert float(table.priority[2]) == 0.25


@pytest.mark.parametrize(
    "ids, expected",
    [([2, 5, 0, 1], -1), ([3, 6, 4], 1), ([-1, 2], 0), ([5, 5, 9], 2), ([], -1)],
    ids=["evicted-are-issued", "next-id", "negative", "beyond", "empty"],
)
def test_first_unissued_names_the_first_id_the_table_never_issued(ids, expected):
    """Ids outside [0, next_id) were never issued (evicted ones were): the first one's position."""
    table = _table()
    assert table.first_unissued(engine.view(torch.tensor(ids, dtype=torch.int64))) == expected


@pytest.mark.parametrize("segmented", [False, True])
def test_a_rows_integers_lie_side_by_side_and_survive_growth(segmented):
    """The int64 columns are row-major: one row's integers (a segment's first step, length,
    links and base; an episode's total and first stored step) are adjacent in memory, also
    after the table grows, and each column still reads its own values."""
    table = EpisodeTable(torch.device("cpu"), segmented=segmented)
    for length in range(1, 1500):  # past the first 1024 rows: the table grows
        table.append(length, terminated=False, priority=1.0)
    matrices = [table.integers]
    if segmented:
        assert table.directory is not None
        matrices.append(table.directory.integers)
    assert table.row_count > 1024
    for matrix in matrices:
        assert matrix.stride() == (1, matrix.shape[0])
    assert table.length[:1499].tolist() == list(range(1, 1500))
    assert table.start[:1499].tolist() == [n * (n - 1) // 2 for n in range(1, 1500)]
