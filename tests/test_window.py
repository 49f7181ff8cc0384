"""`Window` and what an anchor expands to: validation, hand-computed record tables for every
boundary policy, `gather_windows` errors, and `sample_windows` eligibility, equivalence with
`sample` / `sample_prioritized`, and sampled frequencies.

The record tables are written out by hand from the rule that record ``k`` of an anchor
``(e, t)`` targets step ``t + (k - burn_in) * dilation``, never recomputed with the formula.
Every step carries a ``serial``: episode ``e`` of the standard buffer
(`conftest.standard_buffer`) stores serials ``100 * (e + 1) + step``.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
from conftest import ANCHOR_IDS, ANCHOR_STEPS, TABLE_WINDOW, F, T, make_episode, standard_buffer
from scipy import stats

from lucid_replay import (
    InvalidArgumentError,
    PrioritizedSequenceReplay,
    SequenceReplay,
    UnknownEpisodeError,
    Window,
    WindowBatch,
)

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic


def _assert_data_is_stored_values(buffer, batch):
    """Every record's data equals the stored value at (record episode, record step)."""
    for b in range(batch.batch_size):
        for k in range(batch.window_size):
            episode = buffer[int(batch.record_episode_ids[b, k])]
            step = int(batch.record_steps[b, k])
            for name in episode:
                assert torch.equal(batch[name][b, k], episode[name][step]), (name, b, k)


# ----------------------------------------------------------------------------- Window


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"length": 0}, r"^length must be >= 1, got 0$"),
        ({"length": -3}, r"^length must be >= 1, got -3$"),
        ({"length": 2, "burn_in": -1}, r"^burn_in must be >= 0, got -1$"),
        ({"length": 2, "bootstrap": -1}, r"^bootstrap must be >= 0, got -1$"),
        ({"length": 2, "dilation": 0}, r"^dilation must be >= 1, got 0$"),
        (
            {"length": 2, "boundary": "wrap"},
            r"^boundary must be one of \('pad', 'stop', 'include_reset'\), got 'wrap'$",
        ),
        (
            {"length": 2, "boundary": "PAD"},
            r"^boundary must be one of \('pad', 'stop', 'include_reset'\), got 'PAD'$",
        ),
    ],
)
def test_window_rejects_values_outside_their_ranges(kwargs, message):
    """Window raises ValueError (InvalidArgumentError) naming the parameter, rule and value."""
    with pytest.raises(InvalidArgumentError, match=message) as caught:
        Window(**kwargs)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"length": 2.0}, r"^length must be an int, got 2\.0$"),
        ({"length": True}, r"^length must be an int, got True$"),
        ({"length": 2, "dilation": 1.5}, r"^dilation must be an int, got 1\.5$"),
    ],
)
def test_window_rejects_non_integer_counts(kwargs, message):
    """Window refuses floats and bools for its counts with a TypeError."""
    with pytest.raises(TypeError, match=message):
        Window(**kwargs)


def test_window_accepts_the_boundaries_of_the_ranges():
    """length=1, burn_in=0, bootstrap=0, dilation=1 and every boundary policy are accepted."""
    for boundary in ("pad", "stop", "include_reset"):
        window = Window(1, burn_in=0, bootstrap=0, dilation=1, boundary=boundary)
        assert window.boundary == boundary
    default = Window(3)
    assert (default.burn_in, default.bootstrap, default.dilation) == (0, 0, 1)
    assert (default.boundary, default.allow_partial) == ("pad", False)


def test_window_is_frozen_and_compares_by_value():
    """Window is a frozen value: fields cannot be re-bound; equal fields mean equal, same hash."""
    window = Window(3, burn_in=1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        window.length = 4
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        window.boundary = "stop"
    assert window == Window(3, burn_in=1)
    assert hash(window) == hash(Window(3, burn_in=1))
    assert window != Window(3, burn_in=1, dilation=2)


@pytest.mark.parametrize(
    ("window", "size", "span", "anchor_span", "learning"),
    [
        (Window(1), 1, 1, 1, [T]),
        (Window(3), 3, 3, 3, [T, T, T]),
        (Window(3, dilation=2), 3, 5, 5, [T, T, T]),
        (Window(3, dilation=2, allow_partial=True), 3, 5, 1, [T, T, T]),
        (Window(2, burn_in=2, bootstrap=1, dilation=2), 5, 9, 3, [F, F, T, T, F]),
        (Window(4, burn_in=2, bootstrap=1, dilation=2), 7, 13, 7, [F, F, T, T, T, T, F]),
        (Window(1, burn_in=3, bootstrap=2, dilation=3), 6, 16, 1, [F, F, F, T, F, F]),
        (Window(2, burn_in=1, bootstrap=1, boundary="stop"), 4, 4, 2, [F, T, T, F]),
    ],
)
def test_window_size_span_anchor_span_and_learning_mask(window, size, span, anchor_span, learning):
    """size = burn_in+length+bootstrap, span = 1+dilation*(size-1), mask = learning records."""
    assert window.size == size
    assert window.span == span
    assert window.anchor_span == anchor_span
    mask = window.learning_mask
    assert mask.dtype == torch.bool
    assert mask.tolist() == learning


# ------------------------------------------------------------------- hand-computed tables

TABLES = {
    "pad": {
        "record_episode_ids": [[2, 2, 2, 2, 2], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [2, 2, 2, 2, 2]],
        "record_steps": [[0, 0, 1, 3, 5], [0, 1, 3, 3, 3], [0, 0, 0, 1, 1], [0, 2, 4, 5, 5]],
        "validity_mask": [[F, F, T, T, T], [F, T, T, F, F], [F, F, T, F, F], [T, T, T, F, F]],
        "is_init": [[F, F, T, F, F], [F, T, F, F, F], [F, F, T, F, F], [T, F, F, F, F]],
        "terminal": [[F, F, F, F, F], [F, F, F, F, F], [F, F, F, T, T], [F, F, F, F, F]],
        "serial": [
            [300, 300, 301, 303, 305],
            [100, 101, 103, 103, 103],
            [200, 200, 200, 201, 201],
            [300, 302, 304, 305, 305],
        ],
    },
    # Shifts clamp(2 * (2 + 1 - 1) - (T - 1 - t), 0, t): (2, 1) -> 0, (0, 3) -> 3 (4 clamped to
    # t), (1, 0) -> 0 (3 clamped to t), (2, 4) -> 3.
    "stop": {
        "record_episode_ids": [[2, 2, 2, 2, 2], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [2, 2, 2, 2, 2]],
        "record_steps": [[0, 0, 1, 3, 5], [0, 0, 0, 2, 3], [0, 0, 0, 1, 1], [0, 0, 1, 3, 5]],
        "validity_mask": [[F, F, T, T, T], [F, F, T, T, F], [F, F, T, F, F], [F, F, T, T, T]],
        "is_init": [[F, F, T, F, F], [F, F, T, F, F], [F, F, T, F, F], [F, F, T, F, F]],
        "terminal": [[F, F, F, F, F], [F, F, F, F, F], [F, F, F, T, T], [F, F, F, F, F]],
        "serial": [
            [300, 300, 301, 303, 305],
            [100, 100, 100, 102, 103],
            [200, 200, 200, 201, 201],
            [300, 300, 301, 303, 305],
        ],
    },
    # Stored offsets 0..11; offsets -1 and 12, 14 clamp to 0 and 11 and are invalid.
    "include_reset": {
        "record_episode_ids": [[0, 1, 2, 2, 2], [0, 0, 0, 1, 2], [0, 0, 1, 2, 2], [2, 2, 2, 2, 2]],
        "record_steps": [[3, 1, 1, 3, 5], [0, 1, 3, 1, 1], [0, 2, 0, 0, 2], [0, 2, 4, 5, 5]],
        "validity_mask": [[T, T, T, T, T], [F, T, T, T, T], [T, T, T, T, T], [T, T, T, F, F]],
        "is_init": [[T, F, F, F, F], [F, T, F, F, F], [T, F, T, T, F], [T, F, F, F, F]],
        "terminal": [[F, T, F, F, F], [F, F, F, T, F], [F, F, F, F, F], [F, F, F, F, F]],
        "serial": [
            [103, 201, 301, 303, 305],
            [100, 101, 103, 201, 301],
            [100, 102, 200, 300, 302],
            [300, 302, 304, 305, 305],
        ],
    },
}


@pytest.mark.parametrize("boundary", ["pad", "stop", "include_reset"])
def test_gather_windows_matches_the_hand_computed_table(boundary):
    """Records, masks, is_init, terminal and data equal the hand-computed table for the policy."""
    buffer = standard_buffer()
    window = Window(**TABLE_WINDOW, boundary=boundary)
    batch = buffer.gather_windows(ANCHOR_IDS, ANCHOR_STEPS, window)
    expected = TABLES[boundary]

    assert isinstance(batch, WindowBatch)
    assert batch.record_episode_ids.tolist() == expected["record_episode_ids"]
    assert batch.record_steps.tolist() == expected["record_steps"]
    assert batch.validity_mask.tolist() == expected["validity_mask"]
    assert batch.is_init.tolist() == expected["is_init"]
    assert batch.terminal.tolist() == expected["terminal"]
    assert batch["serial"].tolist() == expected["serial"]
    assert batch.learning_mask.tolist() == [[F, F, T, T, F]] * 4
    assert batch.step_in_sequence.tolist() == [[0, 1, 2, 3, 4]] * 4
    # The reported anchor is always the one asked for (also after a `stop` shift).
    assert batch.episode_ids.tolist() == ANCHOR_IDS
    assert batch.anchor_steps.tolist() == ANCHOR_STEPS
    assert batch.weights is None
    _assert_data_is_stored_values(buffer, batch)


@pytest.mark.parametrize("boundary", ["pad", "stop", "include_reset"])
def test_gather_windows_dtypes_and_shapes(boundary):
    """Per-record entries are bool / int64 [B, W]; anchors int64 [B]; data [B, W, *shape]."""
    buffer = standard_buffer()
    batch = buffer.gather_windows(ANCHOR_IDS, ANCHOR_STEPS, Window(**TABLE_WINDOW))
    for name in ("learning_mask", "validity_mask", "is_init", "terminal"):
        value = getattr(batch, name)
        assert (value.dtype, tuple(value.shape)) == (torch.bool, (4, 5)), name
    for name in ("record_episode_ids", "record_steps", "step_in_sequence"):
        value = getattr(batch, name)
        assert (value.dtype, tuple(value.shape)) == (torch.int64, (4, 5)), name
    for name in ("episode_ids", "anchor_steps"):
        value = getattr(batch, name)
        assert (value.dtype, tuple(value.shape)) == (torch.int64, (4,)), name
    assert tuple(batch["obs"].shape) == (4, 5, 2)
    assert batch["obs"].dtype == torch.float32
    assert tuple(batch["serial"].shape) == (4, 5)
    assert (batch.batch_size, batch.window_size) == (4, 5)


def test_burn_in_never_shifts_the_anchor():
    """Records before the episode start clamp to step 0 invalid; the learning region stays put."""
    buffer = standard_buffer()
    window = Window(2, burn_in=3)  # records target t-3 .. t+1
    batch = buffer.gather_windows([2, 2], [0, 4], window)
    assert batch.record_steps.tolist() == [[0, 0, 0, 0, 1], [1, 2, 3, 4, 5]]
    assert batch.validity_mask.tolist() == [[F, F, F, T, T], [T, T, T, T, T]]
    assert batch.is_init.tolist() == [[F, F, F, T, F], [T, F, F, F, F]]
    assert batch.anchor_steps.tolist() == [0, 4]


def test_stop_shift_moves_the_learning_region_before_the_drawn_anchor():
    """Under stop the shift may start the learning region before the anchor; anchor is reported."""
    buffer = standard_buffer()
    # Window(3, bootstrap=1, stop) at (episode 2, t=4): shift clamp(3 - 1, 0, 4) = 2.
    batch = buffer.gather_windows([2, 2], [4, 5], Window(3, bootstrap=1, boundary="stop"))
    assert batch.record_steps.tolist() == [[2, 3, 4, 5], [2, 3, 4, 5]]
    assert batch.validity_mask.tolist() == [[T, T, T, T], [T, T, T, T]]
    assert batch.anchor_steps.tolist() == [4, 5]
    # The same anchors under pad keep the learning region at the anchor and pad the overrun.
    padded = buffer.gather_windows([2, 2], [4, 5], Window(3, bootstrap=1, boundary="pad"))
    assert padded.record_steps.tolist() == [[4, 5, 5, 5], [5, 5, 5, 5]]
    assert padded.validity_mask.tolist() == [[T, T, F, F], [T, F, F, F]]


def test_include_reset_on_a_wrapped_ring_after_evictions():
    """include_reset crosses episodes across the ring seam and clamps at the oldest/newest step."""
    # capacity 10: A(4) and B(3) are evicted; C (id 2, 5 steps, terminated) holds offsets 7..11
    # (ring slots 7, 8, 9, 0, 1) and D (id 3, 4 steps) offsets 12..15 (slots 2..5).
    buffer = SequenceReplay(capacity=10)
    buffer.add(make_episode(4, first_serial=100))
    buffer.add(make_episode(3, first_serial=200))
    buffer.add(make_episode(5, terminated=True, first_serial=300))
    buffer.add(make_episode(4, first_serial=400))
    assert list(buffer.episode_ids) == [2, 3], "precondition: the two oldest were evicted"

    window = Window(**TABLE_WINDOW, boundary="include_reset")
    batch = buffer.gather_windows([3, 2, 2], [0, 1, 4], window)
    assert batch.record_episode_ids.tolist() == [[2, 2, 3, 3, 3], [2, 2, 2, 2, 3], [2, 2, 2, 3, 3]]
    assert batch.record_steps.tolist() == [[1, 3, 0, 2, 3], [0, 0, 1, 3, 0], [0, 2, 4, 1, 3]]
    assert batch.validity_mask.tolist() == [[T, T, T, T, F], [F, F, T, T, T], [T, T, T, T, T]]
    assert batch.is_init.tolist() == [[T, F, T, F, F], [F, F, T, F, T], [T, F, F, F, F]]
    assert batch.terminal.tolist() == [[F, F, F, F, F], [F, F, F, F, F], [F, F, T, F, F]]
    assert batch["serial"].tolist() == [
        [301, 303, 400, 402, 403],
        [300, 300, 301, 303, 400],
        [300, 302, 304, 401, 403],
    ]
    assert batch.episode_ids.tolist() == [3, 2, 2]
    assert batch.anchor_steps.tolist() == [0, 1, 4]
    _assert_data_is_stored_values(buffer, batch)


def test_include_reset_clamped_records_carry_the_clamped_step_terminal_included():
    """Clamped include_reset records carry the oldest/newest step's episode, step and terminal."""
    buffer = SequenceReplay(capacity=100)
    buffer.add(make_episode(4, first_serial=100))
    buffer.add(make_episode(2, terminated=True, first_serial=200))  # the newest, terminated
    window = Window(1, burn_in=1, bootstrap=2, boundary="include_reset")  # targets t-1 .. t+2
    batch = buffer.gather_windows([1, 0], [1, 0], window)
    assert batch.record_episode_ids.tolist() == [[1, 1, 1, 1], [0, 0, 0, 0]]
    assert batch.record_steps.tolist() == [[0, 1, 1, 1], [0, 0, 1, 2]]
    assert batch.validity_mask.tolist() == [[T, T, F, F], [F, T, T, T]]
    assert batch.terminal.tolist() == [[F, T, T, T], [F, F, F, F]]
    assert batch.is_init.tolist() == [[T, F, F, F], [F, T, F, F]]
    assert batch["serial"].tolist() == [[200, 201, 201, 201], [100, 100, 101, 102]]


def test_gather_windows_accepts_lists_numpy_and_tensors():
    """Anchors may be lists, numpy arrays or tensors; the result is the same."""
    buffer = standard_buffer()
    window = Window(**TABLE_WINDOW)
    reference = buffer.gather_windows(ANCHOR_IDS, ANCHOR_STEPS, window)
    for ids, steps in [
        (np.array(ANCHOR_IDS), np.array(ANCHOR_STEPS)),
        (torch.tensor(ANCHOR_IDS), torch.tensor(ANCHOR_STEPS)),
    ]:
        batch = buffer.gather_windows(ids, steps, window)
        assert torch.equal(batch.record_steps, reference.record_steps)
        assert torch.equal(batch["serial"], reference["serial"])


# ------------------------------------------------------------------ gather_windows errors


def test_gather_windows_unknown_or_evicted_id_raises_key_error():
    """An id never issued or already evicted raises KeyError (UnknownEpisodeError)."""
    buffer = SequenceReplay(capacity=6)
    buffer.add(make_episode(4))
    buffer.add(make_episode(4))  # evicts episode 0
    with pytest.raises(UnknownEpisodeError, match=r"got 0: it was evicted$") as caught:
        buffer.gather_windows([1, 0], [0, 0], Window(1))
    assert isinstance(caught.value, KeyError)
    with pytest.raises(KeyError, match=r"got 7: it was never issued$"):
        buffer.gather_windows([7], [0], Window(1))


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([0, 2], r"^anchor_steps\[1\] must be a step of episode 1 \(0 \.\. 1\), got 2$"),
        ([-1, 0], r"^anchor_steps\[0\] must be a step of episode 1 \(0 \.\. 1\), got -1$"),
    ],
)
def test_gather_windows_step_outside_the_episode_raises_value_error(steps, message):
    """An anchor step outside its episode raises ValueError naming the step and its range."""
    buffer = standard_buffer()
    with pytest.raises(ValueError, match=message):
        buffer.gather_windows([1, 1], steps, Window(1))


def test_gather_windows_mismatched_lengths_raise_value_error():
    """episode_ids and anchor_steps of different lengths raise ValueError."""
    buffer = standard_buffer()
    with pytest.raises(
        ValueError, match=r"^anchor_steps must be as long as episode_ids \(2\), got 3$"
    ):
        buffer.gather_windows([0, 1], [0, 0, 0], Window(1))


def test_gather_windows_rejects_a_non_window():
    """gather_windows refuses anything but a Window with a TypeError."""
    buffer = standard_buffer()
    with pytest.raises(TypeError, match=r"^window must be a Window, got int$"):
        buffer.gather_windows([0], [0], 3)


def test_gather_windows_is_not_counted_by_the_reuse_limit():
    """gather_windows leaves stats and max_times_sampled allowances untouched; weights None."""
    buffer = standard_buffer(max_times_sampled=1, seed=0)
    window = Window(2, burn_in=1, boundary="include_reset")
    for _ in range(3):
        batch = buffer.gather_windows([0, 1, 2, 2], [0, 1, 5, 0], window)
        assert batch.weights is None
    before = buffer.stats()
    assert before["chunks_sampled"] == 0
    assert before["episodes_retired"] == 0
    # Each of the three episodes still has its one allowed draw: a batch of 3 takes all three.
    drawn = buffer.sample_windows(3, Window(1))
    assert sorted(drawn.episode_ids.tolist()) == [0, 1, 2]
    assert buffer.stats()["episodes_retired"] == 3


def test_gather_windows_on_a_prioritized_buffer_has_no_weights():
    """gather_windows returns weights=None also on a PrioritizedSequenceReplay."""
    buffer = standard_buffer(PrioritizedSequenceReplay, seed=0)
    batch = buffer.gather_windows([0, 2], [1, 1], Window(2))
    assert batch.weights is None


# ----------------------------------------------------------------- sample_windows basics


def test_sample_windows_rejects_bad_arguments():
    """batch_size < 1, a non-Window, an empty buffer, or a too-long anchor span are refused."""
    empty = SequenceReplay(capacity=10, seed=0)
    with pytest.raises(ValueError, match=r"^the buffer must be non-empty to sample"):
        empty.sample_windows(2, Window(1))
    buffer = SequenceReplay(capacity=20, seed=0)
    buffer.add(make_episode(3))
    buffer.add(make_episode(4))
    with pytest.raises(ValueError, match=r"^batch_size must be >= 1, got 0$"):
        buffer.sample_windows(0, Window(1))
    with pytest.raises(TypeError, match=r"^window must be a Window, got int$"):
        buffer.sample_windows(2, 3)
    with pytest.raises(
        ValueError,
        match=r"^the window's anchor span must be <= the longest stored episode \(4 steps\), "
        r"got 5$",
    ):
        buffer.sample_windows(2, Window(3, dilation=2))
    with pytest.raises(
        ValueError, match=r"^length must be <= the longest stored episode \(4 steps\), got 5$"
    ):
        buffer.sample_windows(2, Window(5))


def test_sample_windows_prioritized_true_on_a_uniform_buffer_raises():
    """prioritized=True on a SequenceReplay raises ValueError and draws nothing."""
    buffer = standard_buffer(seed=0)
    with pytest.raises(
        ValueError, match=r"^prioritized must be False or None on a SequenceReplay, got True$"
    ):
        buffer.sample_windows(2, Window(1), prioritized=True)
    assert buffer.stats()["chunks_sampled"] == 0
    assert buffer.sample_windows(2, Window(1), prioritized=False).weights is None


def test_sample_windows_batch_is_consistent_with_gather_windows():
    """A sampled batch equals gather_windows at its own anchors (records, masks, data)."""
    buffer = standard_buffer(seed=5)
    window = Window(2, burn_in=2, bootstrap=1, dilation=2, boundary="include_reset")
    sampled = buffer.sample_windows(64, window)
    gathered = buffer.gather_windows(sampled.episode_ids, sampled.anchor_steps, window)
    for name in (
        "record_episode_ids",
        "record_steps",
        "validity_mask",
        "learning_mask",
        "is_init",
        "terminal",
        "step_in_sequence",
    ):
        assert torch.equal(getattr(sampled, name), getattr(gathered, name)), name
    for name in ("serial", "obs", "done"):
        assert torch.equal(sampled[name], gathered[name]), name


# ----------------------------------------------------------------------- eligibility


def _eligibility_buffer(buffer_type=SequenceReplay, **kwargs):
    """Episodes of lengths [3, 5, 6, 8] (ids 0..3)."""
    buffer = buffer_type(capacity=100, **kwargs)
    for length in (3, 5, 6, 8):
        buffer.add(make_episode(length))
    return buffer


def _anchor_counts(batch, cells):
    """Counts of each (episode id, anchor step) in ``cells``; asserts nothing falls outside."""
    pairs = list(zip(batch.episode_ids.tolist(), batch.anchor_steps.tolist(), strict=True))
    outside = {pair for pair in pairs if pair not in set(cells)}
    assert not outside, f"anchors outside the eligible set: {sorted(outside)[:10]}"
    index = {cell: i for i, cell in enumerate(cells)}
    counts = np.zeros(len(cells), dtype=np.int64)
    for pair in pairs:
        counts[index[pair]] += 1
    return counts


# Window(3, dilation=2): learning region t, t+2, t+4, so t <= T - 5.
# T = 3 -> none, T = 5 -> {0}, T = 6 -> {0, 1}, T = 8 -> {0, 1, 2, 3}.
STRICT_CELLS = [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (3, 3)]
PARTIAL_CELLS = [(e, t) for e, length in enumerate((3, 5, 6, 8)) for t in range(length)]


@pytest.mark.statistical
@pytest.mark.parametrize("boundary", ["pad", "stop", "include_reset"])
def test_uniform_windows_draw_every_eligible_anchor_equally_often(boundary):
    """allow_partial=False: only anchors t <= T-5 of Window(3, dilation=2), uniformly (chunk)."""
    buffer = _eligibility_buffer(seed=11)
    draws = 14_000
    batch = buffer.sample_windows(draws, Window(3, dilation=2, boundary=boundary))
    counts = _anchor_counts(batch, STRICT_CELLS)
    assert counts.sum() == draws
    _, p_value = stats.chisquare(counts, np.full(len(STRICT_CELLS), draws / 7))
    assert p_value > 1e-3, counts
    # Power: the same counts are far from "episode uniform, then anchor uniform" (1/3 per
    # eligible episode), the distribution of the other unit.
    episode_unit = np.array([4, 2, 2, 1, 1, 1, 1]) / 12 * draws
    assert stats.chisquare(counts, episode_unit).pvalue < 1e-9


@pytest.mark.statistical
def test_uniform_windows_episode_unit_draws_eligible_episodes_equally_often():
    """unit='episode': an eligible episode uniformly (T=3 never), then an anchor uniformly."""
    buffer = _eligibility_buffer(unit="episode", seed=12)
    draws = 12_000
    batch = buffer.sample_windows(draws, Window(3, dilation=2))
    counts = _anchor_counts(batch, STRICT_CELLS)
    expected = np.array([4, 2, 2, 1, 1, 1, 1]) / 12 * draws
    assert stats.chisquare(counts, expected).pvalue > 1e-3, counts
    assert stats.chisquare(counts, np.full(7, draws / 7)).pvalue < 1e-9


@pytest.mark.statistical
def test_allow_partial_windows_draw_every_stored_step_equally_often():
    """allow_partial=True: every stored step (also of the 3-step episode) is an equal anchor."""
    buffer = _eligibility_buffer(seed=13)
    draws = 22_000
    batch = buffer.sample_windows(draws, Window(3, dilation=2, allow_partial=True))
    counts = _anchor_counts(batch, PARTIAL_CELLS)
    _, p_value = stats.chisquare(counts, np.full(len(PARTIAL_CELLS), draws / 22))
    assert p_value > 1e-3, counts
    # Anchors near the end pad their learning region; the records say so.
    late = batch.anchor_steps > (torch.tensor([3, 5, 6, 8])[batch.episode_ids] - 5)
    assert bool(late.any())
    assert not bool(batch.validity_mask[late][:, 1:].all())


def test_short_episodes_are_never_drawn_without_allow_partial():
    """An episode shorter than the anchor span is never drawn; allow_partial draws it."""
    buffer = _eligibility_buffer(seed=14)
    strict = buffer.sample_windows(2_000, Window(3, dilation=2))
    assert 0 not in strict.episode_ids.tolist()
    lengths = torch.tensor([3, 5, 6, 8])[strict.episode_ids]
    assert bool((strict.anchor_steps <= lengths - 5).all())
    assert bool(strict.validity_mask.all())
    partial = buffer.sample_windows(2_000, Window(3, dilation=2, allow_partial=True))
    assert 0 in partial.episode_ids.tolist()


# ------------------------------------------------------ equivalence with sample / prioritized

EQUIVALENCE_LENGTHS = (3, 7, 1, 5, 9, 2)


def _seeded(buffer_type, **kwargs):
    """A buffer seeded 1234 holding the same EQUIVALENCE_LENGTHS episodes every time."""
    buffer = buffer_type(capacity=200, seed=1234, **kwargs)
    buffer.extend(
        make_episode(length, first_serial=1_000 * (i + 1))
        for i, length in enumerate(EQUIVALENCE_LENGTHS)
    )
    return buffer


def _twins(buffer_type, **kwargs):
    return _seeded(buffer_type, **kwargs), _seeded(buffer_type, **kwargs)


@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_default_window_reproduces_sample_draw_for_draw(unit):
    """sample_windows(B, Window(L)) equals sample(B, L) under the same seed, call after call."""
    chunks, windows = _twins(SequenceReplay, unit=unit)
    for batch_size, length in [(16, 3), (5, 1), (32, 5), (16, 3)]:
        expected = chunks.sample(batch_size, length)
        got = windows.sample_windows(batch_size, Window(length))
        assert torch.equal(got.episode_ids, expected.episode_ids)
        assert torch.equal(got.anchor_steps, expected.starts)
        for name in ("serial", "obs", "done"):
            assert torch.equal(got[name], expected[name]), name
        assert bool(got.validity_mask.all())
        assert bool(got.learning_mask.all())
        assert got.weights is None


def _skewed_priorities(buffer):
    buffer.update_priorities(list(range(len(EQUIVALENCE_LENGTHS))), [0.1, 3.0, 9.0, 0.5, 1.0, 2.0])


@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_default_window_reproduces_sample_prioritized_draw_for_draw(unit):
    """Prioritized: sample_windows(B, Window(L)) equals sample_prioritized, weights included."""
    chunks, windows = _twins(PrioritizedSequenceReplay, alpha=0.8, beta=0.5, unit=unit)
    for buffer in (chunks, windows):
        _skewed_priorities(buffer)
    for batch_size, length in [(16, 3), (32, 5), (8, 1)]:
        expected = chunks.sample_prioritized(batch_size, length)
        got = windows.sample_windows(batch_size, Window(length))
        assert torch.equal(got.episode_ids, expected.indices)
        assert torch.equal(got.anchor_steps, expected.starts)
        assert got.weights is not None
        assert got.weights.dtype == torch.float32
        assert torch.equal(got.weights, expected.weights)
        for name in ("serial", "obs", "done"):
            assert torch.equal(got[name], expected[name]), name


def test_prioritized_false_on_a_prioritized_buffer_is_the_uniform_draw():
    """prioritized=False on a PrioritizedSequenceReplay draws as a uniform buffer, weights None."""
    window = Window(2, burn_in=1, bootstrap=1, dilation=2)
    uniform = _seeded(SequenceReplay)
    prioritized = _seeded(PrioritizedSequenceReplay, alpha=1.0)
    _skewed_priorities(prioritized)
    for _ in range(3):
        expected = uniform.sample_windows(32, window)
        got = prioritized.sample_windows(32, window, prioritized=False)
        assert got.weights is None
        assert torch.equal(got.episode_ids, expected.episode_ids)
        assert torch.equal(got.anchor_steps, expected.anchor_steps)
        assert torch.equal(got["serial"], expected["serial"])


def test_prioritized_none_means_prioritized_on_a_prioritized_buffer():
    """prioritized=None and prioritized=True give the same draw on a PrioritizedSequenceReplay."""
    window = Window(2, burn_in=1, dilation=2)
    first, second = _twins(PrioritizedSequenceReplay, alpha=0.7)
    for buffer in (first, second):
        _skewed_priorities(buffer)
    default = first.sample_windows(32, window)
    explicit = second.sample_windows(32, window, prioritized=True)
    assert torch.equal(default.episode_ids, explicit.episode_ids)
    assert torch.equal(default.anchor_steps, explicit.anchor_steps)
    assert default.weights is not None
    assert torch.equal(default.weights, explicit.weights)


# ------------------------------------------------------------ prioritized frequencies

# Episodes [3, 5, 8, 10] with priorities p = |error| + 0.5 = [1, 2, 1, 4] and alpha = 0.5:
# p^alpha = [1, sqrt 2, 1, 2]. Window(2, burn_in=3, bootstrap=1, dilation=3) has anchor span 4,
# so n_e = T - 3 = [0, 2, 5, 7] eligible anchors (t <= T - 4).
PRIORITY_LENGTHS = (3, 5, 8, 10)
PRIORITY_CELLS = [(e, t) for e, n in enumerate((0, 2, 5, 7)) for t in range(n)]
ROOT2 = 2**0.5


def _priority_buffer(**kwargs):
    buffer = PrioritizedSequenceReplay(capacity=100, alpha=0.5, beta=0.4, epsilon=0.5, **kwargs)
    for length in PRIORITY_LENGTHS:
        buffer.add(make_episode(length))
    assert buffer.update_priorities([0, 1, 2, 3], [0.5, -1.5, 0.5, 3.5]) == 4
    assert buffer.priorities.tolist() == [1.0, 2.0, 1.0, 4.0]
    return buffer


@pytest.mark.statistical
@pytest.mark.parametrize("boundary", ["pad", "stop"])
def test_prioritized_windows_draw_anchors_in_proportion_to_priority(boundary):
    """unit='chunk': each eligible anchor has probability p_e^alpha / sum of n_e p_e^alpha."""
    buffer = _priority_buffer(seed=21)
    window = Window(2, burn_in=3, bootstrap=1, dilation=3, boundary=boundary)
    draws = 20_000
    batch = buffer.sample_windows(draws, window)
    counts = _anchor_counts(batch, PRIORITY_CELLS)
    per_anchor = {1: ROOT2, 2: 1.0, 3: 2.0}  # p_e^alpha
    total = 2 * ROOT2 + 5 * 1.0 + 7 * 2.0
    expected = np.array([per_anchor[e] / total for e, _ in PRIORITY_CELLS]) * draws
    assert stats.chisquare(counts, expected).pvalue > 1e-3, counts
    # Power: uniform over eligible anchors would be rejected.
    assert stats.chisquare(counts, np.full(len(PRIORITY_CELLS), draws / 14)).pvalue < 1e-9

    # w = (N P)^-beta / max over the batch; P is proportional to p^alpha, the batch minimum of
    # p^alpha is 1 (episode 2), so w = (1 / p_e^alpha)^0.4: episode 1 -> 2^-0.2, 3 -> 2^-0.4.
    expected_weight = {1: 2**-0.2, 2: 1.0, 3: 2**-0.4}
    weights = torch.tensor([expected_weight[e] for e in batch.episode_ids.tolist()])
    assert batch.weights is not None
    assert torch.allclose(batch.weights.double(), weights.double(), rtol=1e-6)
    assert float(batch.weights.max()) == 1.0


@pytest.mark.statistical
def test_prioritized_windows_episode_unit_draw_episodes_by_priority():
    """unit='episode': eligible episodes by p^alpha (T=3 never), then an anchor uniformly."""
    buffer = _priority_buffer(unit="episode", seed=22)
    window = Window(2, burn_in=3, bootstrap=1, dilation=3)
    draws = 20_000
    batch = buffer.sample_windows(draws, window)
    counts = _anchor_counts(batch, PRIORITY_CELLS)
    episode_probability = {1: ROOT2 / (ROOT2 + 3), 2: 1 / (ROOT2 + 3), 3: 2 / (ROOT2 + 3)}
    anchors = {1: 2, 2: 5, 3: 7}
    expected = np.array([episode_probability[e] / anchors[e] for e, _ in PRIORITY_CELLS]) * draws
    assert stats.chisquare(counts, expected).pvalue > 1e-3, counts
    chunk_unit = np.array([{1: ROOT2, 2: 1.0, 3: 2.0}[e] for e, _ in PRIORITY_CELLS])
    assert stats.chisquare(counts, chunk_unit / chunk_unit.sum() * draws).pvalue < 1e-9
