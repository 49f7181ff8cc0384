"""Epochs: ``buffer.epoch(B, window)`` yields every anchor eligible at its start once."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from conftest import assert_refused, make_episode
from stats import ACCEPT, REJECT, chi_square_pvalue

from lucid_replay import (
    Episode,
    InvalidArgumentError,
    InvalidTypeError,
    PrioritizedSequenceReplay,
    SequenceReplay,
    Window,
    engine,
)

LENGTHS = [3, 6, 2, 4, 1]
WINDOW = Window(2, burn_in=1, bootstrap=1)  # anchor span 2: the 1-step episode has none


def _buffer(kind=SequenceReplay, unit: str = "chunk", **kwargs: object) -> SequenceReplay:
    buffer = kind(100, unit=unit, seed=5, **kwargs)
    buffer.extend(make_episode(n, first_serial=100 * k) for k, n in enumerate(LENGTHS))
    return buffer


def _segmented(unit: str = "chunk") -> PrioritizedSequenceReplay:
    """Segments of 3 steps: an open episode whose head was evicted and closed episodes."""
    buffer = PrioritizedSequenceReplay(20, segment_length=3, seed=9, unit=unit)
    stream = buffer.open_episode()
    stream.append({"x": torch.arange(7)})
    for length in (4, 5):
        buffer.add(Episode({"x": torch.arange(length)}))
    stream.append({"x": torch.arange(7, 13)})
    assert buffer.episode_info(0).first_step > 0 and buffer.open_episode_ids == [0]
    return buffer


def _eligible(buffer: SequenceReplay, window: Window) -> dict[int, range]:
    """Eligible anchor steps by episode id (section 4; an open episode's need its bootstrap)."""
    anchors = {}
    for episode_id in buffer.episode_ids:
        info = buffer.episode_info(episode_id)
        need = window.open_anchor_span if info.is_open else window.anchor_span
        steps = range(info.first_step, info.total_length - need + 1)
        if len(steps):
            anchors[episode_id] = steps
    return anchors


def _cells(batches) -> list[tuple[int, int]]:
    return [
        (e, s)
        for b in batches
        for e, s in zip(b.episode_ids.tolist(), b.anchor_steps.tolist(), strict=True)
    ]


# --------------------------------------------------------------------------- coverage


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("segmented", [False, True])
def test_every_eligible_anchor_exactly_once(segmented):
    """``unit="chunk"``: the epoch's anchors are the eligible ones, each once, as many as
    ``num_eligible`` counts; batches of ``B`` but the last."""
    buffer = _segmented() if segmented else _buffer()
    window = Window(2, burn_in=1, bootstrap=2) if segmented else WINDOW
    batches = list(buffer.epoch(4, window))
    cells = _cells(batches)
    expected = sorted((e, s) for e, steps in _eligible(buffer, window).items() for s in steps)
    assert sorted(cells) == expected and len(cells) == buffer.num_eligible(window)
    sizes = [b.episode_ids.numel() for b in batches]
    assert sizes[:-1] == [4] * (len(sizes) - 1) and 1 <= sizes[-1] <= 4
    for batch in batches:  # the windows are those gather_windows expands
        again = buffer.gather_windows(batch.episode_ids, batch.anchor_steps, window)
        for name, value in again.data.items():
            assert torch.equal(batch.data[name], value)
        assert torch.equal(batch.validity_mask, again.validity_mask)


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("segmented", [False, True])
def test_episode_unit_yields_every_eligible_episode_once_at_an_eligible_anchor(segmented):
    """``unit="episode"``: each eligible episode once, at one of its eligible anchors."""
    buffer = _segmented("episode") if segmented else _buffer(unit="episode")
    window = Window(2, burn_in=1, bootstrap=2) if segmented else WINDOW
    eligible = _eligible(buffer, window)
    cells = _cells(buffer.epoch(2, window))
    assert sorted(e for e, _ in cells) == sorted(eligible)
    assert all(s in eligible[e] for e, s in cells)


def test_drop_last_drops_the_short_final_batch():
    """11 anchors in batches of 4: 4, 4, 3, or 4, 4 with ``drop_last``; 11 in batches of 11:
    one batch either way."""
    buffer = _buffer()
    assert [b.episode_ids.numel() for b in buffer.epoch(4, WINDOW)] == [4, 4, 3]
    assert [b.episode_ids.numel() for b in buffer.epoch(4, WINDOW, drop_last=True)] == [4, 4]
    assert [b.episode_ids.numel() for b in buffer.epoch(11, WINDOW, drop_last=True)] == [11]
    assert list(buffer.epoch(12, WINDOW, drop_last=True)) == []


# ------------------------------------------------------------------------------- order


@pytest.mark.statistical
def test_the_order_is_uniformly_random():
    """Over 6,600 epochs each of the 11 anchors comes first equally often, and each of the
    11 x 10 ordered first pairs too; a law by episode length is rejected."""
    buffer = _buffer()
    anchors = sorted((e, s) for e, steps in _eligible(buffer, WINDOW).items() for s in steps)
    first, pairs = Counter(), Counter()
    for _ in range(6_600):
        batch = next(iter(buffer.epoch(2, WINDOW)))
        cells = _cells([batch])
        first[cells[0]] += 1
        pairs[tuple(cells)] += 1
    observed = [first[a] for a in anchors]
    assert chi_square_pvalue(observed, np.ones(len(anchors))) > ACCEPT
    ordered = [(a, b) for a in anchors for b in anchors if a != b]
    assert set(pairs) <= set(ordered)
    assert chi_square_pvalue([pairs[p] for p in ordered], np.ones(len(ordered))) > ACCEPT
    by_length = [1.0 / len(_eligible(buffer, WINDOW)[e]) for e, _ in anchors]
    assert chi_square_pvalue(observed, by_length) < REJECT


def test_a_seed_reproduces_the_epochs_and_each_epoch_is_a_new_order():
    """Same seed, same calls: the same epochs; the next epoch is another permutation."""
    one, other = _buffer(), _buffer()
    first = [_cells(one.epoch(3, WINDOW)) for _ in range(3)]
    assert first == [_cells(other.epoch(3, WINDOW)) for _ in range(3)]
    assert first[0] != first[1] and sorted(first[0]) == sorted(first[1])


def test_engines_give_the_same_epochs():
    """The compiled loops, numpy views and tensors give the same epochs, both units."""
    runs = []
    for name in engine.ENGINES:
        if name == "kernels" and not engine.available():
            continue
        with engine.use(name):
            runs.append(
                [
                    _cells(buffer.epoch(3, window))
                    for buffer, window in (
                        (_buffer(), WINDOW),
                        (_buffer(unit="episode"), WINDOW),
                        (_segmented(), Window(2, bootstrap=2)),
                        (_segmented("episode"), Window(2, bootstrap=2)),
                    )
                ]
            )
    assert len(runs) >= 2 and all(run == runs[0] for run in runs)


# ------------------------------------------------------------------ a buffer that moves


@pytest.mark.usefixtures("index_engine")
def test_evicted_anchors_are_skipped_and_counted_and_new_ones_wait_for_the_next_epoch():
    """Episodes added during an epoch evict the oldest: their anchors not yet yielded are
    skipped (``stats()["epoch_skipped"]``, cumulative), batches stay full, the new episodes
    join the next epoch only."""
    buffer = SequenceReplay(20, seed=2)
    buffer.extend(make_episode(n, first_serial=100 * k) for k, n in enumerate([5, 4, 6, 5]))
    assert buffer.stats()["epoch_skipped"] == 0
    epoch = buffer.epoch(3, WINDOW)
    seen = _cells([next(epoch)])
    new = buffer.add(make_episode(8, first_serial=900))  # evicts episodes 0 and 1
    assert list(buffer.episode_ids) == [2, 3, 4]
    rest = list(epoch)
    later = _cells(rest)
    assert all(e in (2, 3) for e, _ in later)  # nothing evicted, nothing new
    assert [b.episode_ids.numel() for b in rest][:-1] == [3] * (len(rest) - 1)
    evicted_left = sum(1 for e, _ in seen if e in (0, 1))
    skipped = (4 + 3) - evicted_left  # the evicted episodes' anchors not yet yielded
    assert buffer.stats()["epoch_skipped"] == skipped
    assert sorted(seen + later) == sorted(
        [c for c in seen if c[0] in (0, 1)]
        + [(e, s) for e, n in ((2, 6), (3, 5)) for s in range(n - 1)]
    )
    following = _cells(buffer.epoch(3, WINDOW))
    assert sorted(following) == sorted(
        [(e, s) for e, n in ((2, 6), (3, 5), (new, 8)) for s in range(n - 1)]
    )
    assert buffer.stats()["epoch_skipped"] == skipped  # cumulative: nothing skipped since


def test_a_segmented_epoch_skips_an_evicted_head_and_waits_on_new_steps():
    """An open episode's head evicted during the epoch: those anchors are skipped; steps
    committed meanwhile (anchors eligible only now) join the next epoch."""
    buffer = PrioritizedSequenceReplay(12, segment_length=3, seed=1)
    stream = buffer.open_episode()
    stream.append({"x": torch.arange(9)})
    window = Window(1)
    epoch = buffer.epoch(2, window)
    at_start = _eligible(buffer, window)[0]
    stream.append({"x": torch.arange(9, 15)})  # evicts steps 0..2 (12 committed at most)
    cells = _cells(epoch)
    assert sorted(cells) == [(0, s) for s in at_start if s >= 3]
    assert buffer.stats()["epoch_skipped"] == 3
    assert sorted(_cells(buffer.epoch(4, window))) == [(0, s) for s in range(3, 15)]


def test_an_epoch_is_no_draw():
    """Epoch batches count neither towards ``chunks_sampled`` nor the reuse limit; retired
    episodes are not eligible."""
    buffer = _buffer(max_times_sampled=1)
    buffer.sample_windows(1, Window(6))  # retires the only episode of 6 steps (id 1)
    before = buffer.stats()
    cells = _cells(buffer.epoch(4, WINDOW))
    assert {e for e, _ in cells} == {0, 2, 3}
    assert len(cells) == buffer.num_eligible(WINDOW)
    after = buffer.stats()
    assert after["chunks_sampled"] == before["chunks_sampled"]
    assert after["episodes_retired"] == before["episodes_retired"]


@pytest.mark.parametrize("kind", [SequenceReplay, PrioritizedSequenceReplay])
def test_probabilities_are_one_over_n_and_weights_one(kind):
    """Each batch reports ``1 / N`` (N anchors in the epoch) and, on a prioritized buffer,
    weights of 1 (None on a uniform one)."""
    buffer = _buffer(kind)
    for batch in buffer.epoch(4, WINDOW):
        assert torch.equal(
            batch.probabilities,
            torch.full((batch.episode_ids.numel(),), 1 / 11, dtype=torch.float64),
        )
        if kind is SequenceReplay:
            assert batch.weights is None
        else:
            assert torch.equal(batch.weights, torch.ones(batch.episode_ids.numel()))


# -------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda b: b.epoch(0, WINDOW), InvalidArgumentError, r"^batch_size must be >= 1, got 0$"),
        (
            lambda b: b.epoch(True, WINDOW),
            InvalidTypeError,
            r"^batch_size must be an int, got True$",
        ),
        (
            lambda b: b.epoch(2.0, WINDOW),
            InvalidTypeError,
            r"^batch_size must be an int, got 2\.0$",
        ),
        (
            lambda b: b.epoch(2, WINDOW, drop_last=1),
            InvalidTypeError,
            r"^drop_last must be a bool, got 1$",
        ),
        (lambda b: b.epoch(2, 3), InvalidTypeError, r"^window must be a Window"),
        (lambda b: b.epoch(2, Window(7)), InvalidArgumentError, r"^length must be <= the longest"),
        (lambda b: b.epoch(2, WINDOW, device="nowhere"), InvalidArgumentError, r"^device must be"),
    ],
)
def test_refusals_name_the_argument_and_change_nothing(call, error, match):
    """Refused when called (not at the first ``next``), nothing drawn, RNG untouched."""
    buffer = _buffer()
    assert_refused(buffer, lambda: call(buffer), error, match)


def test_an_empty_buffer_refuses_an_epoch():
    """As ``sample_windows``: there is nothing to read."""
    buffer = SequenceReplay(10)
    assert_refused(
        buffer,
        lambda: buffer.epoch(2, WINDOW),
        InvalidArgumentError,
        r"^the buffer must be non-empty",
    )


def test_stats_have_epoch_skipped_from_the_start():
    """Every buffer reports ``epoch_skipped``, 0 before any epoch."""
    assert SequenceReplay(10).stats()["epoch_skipped"] == 0
    assert PrioritizedSequenceReplay(10, segment_length=2).stats()["epoch_skipped"] == 0
