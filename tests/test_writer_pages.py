"""The paged pool behind `EpisodeWriter`: slots of open records never collide, pages are
reused after release, and the pool grows only when every page is in use."""

from __future__ import annotations

import numpy as np
import pytest

from lucid_replay.writer_pages import PageTable


@pytest.mark.parametrize("page_size", [1, 3, 64])
def test_open_records_have_distinct_slots_and_the_pool_stays_small(page_size):
    """Under random growth and release, every open record of every env has its own slot
    inside the pool, and the pool is at most twice the most pages ever in use at once."""
    rng = np.random.default_rng(0)
    num_envs = 5
    table = PageTable(num_envs, page_size)
    length = np.zeros(num_envs, dtype=np.int64)  # records 0..length[i] are open
    peak_pages = num_envs
    for _ in range(400):
        rows = np.flatnonzero(rng.random(num_envs) < 0.7)
        table.reserve(rows, length[rows] + 1)
        length[rows] += 1
        in_use = sum(-(-(int(n) + 1) // page_size) for n in length)
        peak_pages = max(peak_pages, in_use)
        slots = np.concatenate([table.episode(env, int(length[env])) for env in range(num_envs)])
        assert len(np.unique(slots)) == len(slots) == int((length + 1).sum())
        assert slots.max() < table.slots
        assert table.num_pages <= 2 * peak_pages
        done = np.flatnonzero(rng.random(num_envs) < 0.05)
        table.release(done)
        length[done] = 0


def test_slot_matches_the_page_table_formula():
    """slot(rows, steps) is table[row, step // size] * size + step % size, vectorised."""
    table = PageTable(2, 2)
    table.reserve(np.array([0, 1]), np.array([5, 2]))
    rows, steps = np.array([0, 0, 0, 1, 1, 0]), np.array([0, 1, 2, 2, 0, 5])
    naive = [int(table.table[r, s // 2]) * 2 + s % 2 for r, s in zip(rows, steps, strict=True)]
    assert table.slot(rows, steps).tolist() == naive
    expected = [int(table.table[0, t // 2]) * 2 + t % 2 for t in range(6)]
    assert table.episode(0, 5).tolist() == expected
    assert len(set(expected) | set(table.episode(1, 2).tolist())) == 6 + 3


def test_released_pages_are_reused_before_the_pool_grows():
    """Pages given back by one env serve the next env that needs pages, without growth."""
    table = PageTable(2, 2)
    assert table.reserve(np.array([0]), np.array([7]))  # env 0 needs 4 pages: the pool grows
    pages = table.num_pages
    table.release(np.array([0]))
    assert not table.reserve(np.array([1]), np.array([7]))
    assert table.num_pages == pages


def test_spans_match_the_records_of_each_env_padded_with_its_last():
    """spans(rows, counts) row k is slots of records 0 .. counts[k] - 1 of env rows[k], then
    its last slot repeated up to the longest count: one lookup for every env."""
    table = PageTable(3, 2)
    table.reserve(np.array([0, 1, 2]), np.array([4, 1, 6]))
    rows, counts = np.array([2, 0, 1]), np.array([7, 3, 1])
    spans = table.spans(rows, counts)
    assert spans.shape == (3, 7)
    for row, count, span in zip(rows, counts, spans, strict=True):
        own = table.episode(int(row), int(count) - 1).tolist()
        assert span.tolist() == own + own[-1:] * (7 - int(count))
