"""Priorities without a buffer: R2D2's per-window mix of per-record errors, and the
`Priorities` value (errors to priorities, importance weights, beta annealing, saved state).

`window_priorities` counts a record when it is in the learning region, valid, in the anchor's
own episode and in ``mask``; each window with a counted record gets
``eta * max |d| + (1 - eta) * mean |d|`` over them, and a window without one is dropped.
The tables below are written out by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import INF, NAN, F, T

from lucid_replay import CheckpointError, InvalidArgumentError, engine
from lucid_replay.laws import Prioritized
from lucid_replay.priorities import Priorities, window_priorities
from lucid_replay.records import Anchors

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic

# Three windows of W = 4 records whose learning region is k = 1, 2. Every value of 9.0 lies
# outside the counted records, so a leak of any of them shows as a maximum of 9.
LEARNING = [[F, T, T, F]] * 3
VALID = [
    [T, T, T, T],
    [F, T, F, T],  # k = 2 is padding
    [T, T, T, T],
]
RECORD_IDS = [
    [5, 5, 5, 5],
    [6, 6, 6, 6],
    [7, 7, 8, 8],  # k = 2 reached episode 8 (include_reset)
]
EPISODE_IDS = [5, 6, 7]
ERRORS = [
    [9.0, 1.0, -3.0, 9.0],  # counted k = 1, 2: max 3, mean 2
    [9.0, -2.0, 9.0, 9.0],  # counted k = 1: max 2, mean 2
    [9.0, 4.0, 9.0, 9.0],  # counted k = 1: max 4, mean 4
]


def _mix(
    errors=ERRORS,
    *,
    eta=0.5,
    learning=LEARNING,
    valid=VALID,
    records=RECORD_IDS,
    episodes=EPISODE_IDS,
    mask=None,
):
    """`window_priorities` of the table (or of the parts given), as two lists."""
    ids, mixed = window_priorities(
        torch.tensor(learning),
        torch.tensor(valid),
        torch.tensor(records),
        torch.tensor(episodes),
        errors,
        eta=eta,
        mask=mask,
    )
    return ids.tolist(), mixed.tolist()


# -------------------------------------------------------------------- window_priorities


@pytest.mark.parametrize(
    ("eta", "expected"),
    [
        (0.0, [2.0, 2.0, 4.0]),
        (0.5, [2.5, 2.0, 4.0]),
        (0.9, [2.9, 2.0, 4.0]),
        (1.0, [3.0, 2.0, 4.0]),
    ],
)
def test_mix_of_max_and_mean_over_counted_records(eta, expected):
    """eta = 0 is the mean alone, eta = 1 the max alone; learning, valid, own-episode count."""
    ids, mixed = _mix(eta=eta)
    assert ids == [5, 6, 7]
    assert mixed == pytest.approx(expected, rel=1e-12)


def test_non_finite_values_outside_the_counted_records_are_ignored():
    """NaN and infinities on burn-in, bootstrap, padding or other-episode records change nothing."""
    errors = [
        [NAN, 1.0, -3.0, INF],
        [-INF, -2.0, NAN, NAN],
        [INF, 4.0, NAN, -INF],
    ]
    assert _mix(errors) == ([5, 6, 7], [2.5, 2.0, 4.0])


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize(("row", "column"), [(0, 1), (0, 2), (1, 1), (2, 1)])
def test_non_finite_value_on_a_counted_record_is_refused(row, column, value):
    """A NaN or infinite error on a counted record is an `InvalidArgumentError`."""
    errors = [list(values) for values in ERRORS]
    errors[row][column] = value
    with pytest.raises(
        InvalidArgumentError,
        match=r"^errors must be finite on valid learning records, got a NaN or infinite value$",
    ):
        _mix(errors)


def test_finite_errors_whose_sum_overflows_are_refused():
    """Two counted errors of 1e308 are finite, but their sum (and so their mean) is not."""
    errors = [list(values) for values in ERRORS]
    errors[0][1], errors[0][2] = 1e308, -1e308
    with pytest.raises(InvalidArgumentError, match=r"^errors must be finite on valid learning"):
        _mix(errors)
    errors[0][2] = 0.0  # one of them alone mixes to a finite priority
    assert _mix(errors, eta=0.5)[1][0] == 0.5 * 1e308 + 0.5 * (1e308 / 2)


def test_windows_without_a_counted_record_are_dropped():
    """A window whose learning records are all invalid (row 1) or all of another episode
    (row 2) has no priority to give: its episode is left out of the result."""
    valid = [[T, T, T, T], [T, F, F, T], [T, T, T, T]]
    records = [[5, 5, 5, 5], [6, 6, 6, 6], [7, 8, 8, 7]]
    assert _mix(valid=valid, records=records) == ([5], [2.5])


def test_mask_narrows_the_counted_records():
    """``mask`` leaves records out: row 0 keeps k = 2 alone, row 2 (all masked) is dropped."""
    mask = torch.tensor([[T, F, T, T], [T, T, T, T], [F, F, F, F]])
    assert _mix(mask=mask) == ([5, 6], [3.0, 2.0])


def test_rows_with_their_own_learning_regions_mix_their_own_records():
    """Learning masks that differ by row count each row's own region (no shared columns)."""
    learning = [[F, T, T, F], [F, T, T, T], [T, T, F, F]]
    ids, mixed = _mix(learning=learning)
    # Row 1: k = 1 and k = 3 (k = 2 is padding): |d| = 2, 9. Row 2: k = 0, 1: |d| = 9, 4.
    assert ids == [5, 6, 7]
    assert mixed == [2.5, 0.5 * 9 + 0.5 * 5.5, 0.5 * 9 + 0.5 * 6.5]


def test_a_row_of_another_learning_region_leaves_the_others_unchanged():
    """The table's rows mix alike whether or not every row shares one learning region."""
    learning = [*LEARNING, [T, F, F, F]]
    valid = [*VALID, [T, T, T, T]]
    records = [*RECORD_IDS, [9, 9, 9, 9]]
    errors = [*ERRORS, [0.5, 9.0, 9.0, 9.0]]
    episodes = [*EPISODE_IDS, 9]
    assert _mix(errors, learning=learning, valid=valid, records=records, episodes=episodes) == (
        [5, 6, 7, 9],
        [2.5, 2.0, 4.0, 0.5],
    )


def test_integer_errors_are_mixed_as_floats():
    """Integer errors are converted: the mean of 1 and 3 is 2.0, not an integer division."""
    errors = [[9, 1, -3, 9], [9, -2, 9, 9], [9, 4, 9, 9]]
    assert _mix(errors) == ([5, 6, 7], [2.5, 2.0, 4.0])


def test_results_are_tensors_on_the_masks_device(index_engine):
    """Ids and mixes come back as tensors (float64 mixes) on either index engine."""
    ids, mixed = window_priorities(
        torch.tensor(LEARNING),
        torch.tensor(VALID),
        torch.tensor(RECORD_IDS),
        torch.tensor(EPISODE_IDS),
        ERRORS,
        eta=0.5,
    )
    assert isinstance(ids, torch.Tensor) and isinstance(mixed, torch.Tensor)
    assert mixed.dtype == torch.float64 and ids.device == mixed.device


@pytest.mark.parametrize(
    ("errors", "mask", "message"),
    [
        (torch.zeros(3, 5), None, r"^errors must be of shape \(3, 4\) or \(3,\), got \(3, 5\)$"),
        (
            ERRORS,
            torch.ones(3, 4),
            r"^mask must be a bool tensor of shape \(3, 4\), got torch\.float32 \(3, 4\)$",
        ),
        (
            ERRORS,
            torch.ones(3, 5, dtype=torch.bool),
            r"^mask must be a bool tensor of shape \(3, 4\), got torch\.bool \(3, 5\)$",
        ),
    ],
)
def test_errors_or_mask_of_another_shape_are_refused(errors, mask, message):
    """Errors not [B, W], or a mask not a bool [B, W], are an `InvalidArgumentError`."""
    with pytest.raises(InvalidArgumentError, match=message):
        _mix(errors, mask=mask)


# ---------------------------------------------------------------------------- Priorities


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((-0.1, 0.4, 1e-6), InvalidArgumentError, r"^alpha must be >= 0\.0 and finite, got -0\.1$"),
        ((0.6, -1.0, 1e-6), InvalidArgumentError, r"^beta must be >= 0\.0 and finite, got -1\.0$"),
        ((0.6, 0.4, 0.0), InvalidArgumentError, r"^epsilon must be > 0\.0 and finite, got 0\.0$"),
        ((True, 0.4, 1e-6), TypeError, r"^alpha must be a real number, got True$"),
    ],
)
def test_constructor_validates_alpha_beta_and_epsilon(args, error, message):
    """alpha, beta >= 0 and epsilon > 0, all finite real numbers (a bool is not one)."""
    with pytest.raises(error, match=message):
        Priorities(*args)


def test_of_errors_is_the_magnitude_plus_epsilon_in_float64():
    """``|error| + epsilon``, float64, for every sign and for zero."""
    priorities = Priorities(0.6, 0.4, 0.25)
    values = priorities.of_errors(torch.tensor([0.5, -2.0, 0.0], dtype=torch.float64))
    assert values.dtype == torch.float64
    assert values.tolist() == [0.75, 2.25, 0.25]


def test_of_errors_refuses_a_priority_beyond_float64():
    """An error whose ``|error| + epsilon`` overflows is refused, naming its position."""
    priorities = Priorities(0.6, 0.4, 1e308)
    with pytest.raises(
        InvalidArgumentError,
        match=r"^errors\[1\] must be at most 7\.97693e\+307 so that \|error\| \+ epsilon stays "
        r"finite, got 1\.7e\+308$",
    ):
        priorities.of_errors(torch.tensor([1.0, 1.7e308], dtype=torch.float64))


def _weights(priorities: Priorities, drawn: list[float]):
    """`Priorities.weights` of a prioritized draw of priorities ``drawn`` (the fast path)."""
    values = engine.view(torch.tensor(drawn, dtype=torch.float64))
    rows = engine.view(torch.arange(len(drawn)))
    anchors = Anchors(rows, rows, rows, values)

    def probability():
        raise AssertionError("the exact fast path needs no probabilities")

    return priorities.weights(Prioritized(priorities.alpha), anchors, probability)


def test_weights_are_the_priority_ratio_to_the_power_alpha_beta():
    """``w = (p_min / p)^(alpha beta)``: float32, [B], exactly 1 for the smallest priority."""
    priorities = Priorities(0.5, 0.4, 1e-6)
    weights = engine.tensor(_weights(priorities, [2.0, 1.0, 4.0, 1.0]))
    assert weights.dtype == torch.float32
    assert weights.shape == (4,) and float(weights.max()) == 1.0
    expected = [2**-0.2, 1.0, 4**-0.2, 1.0]
    assert weights.tolist() == pytest.approx(expected, rel=1e-6)
    # The same as (N P)^-beta / max with P = p^alpha / sum of p^alpha over the draws.
    p = np.array([2.0, 1.0, 4.0, 1.0])
    raw = (4 * p**0.5 / (p**0.5).sum()) ** -0.4
    np.testing.assert_allclose(weights.numpy(), raw / raw.max(), rtol=1e-6)


def test_weights_are_finite_where_the_priority_power_overflows():
    """Priorities whose ``p^alpha`` overflows float64 still give finite weights."""
    priorities = Priorities(50.0, 1.0, 1e-6)
    weights = _weights(priorities, [1e7, 1.01e7])
    assert weights.tolist() == pytest.approx([1.0, (1 / 1.01) ** 50], rel=1e-6)


def test_weights_with_beta_zero_are_all_one():
    """beta = 0 gives no correction: every weight is 1."""
    priorities = Priorities(0.6, 0.0, 1e-6)
    weights = _weights(priorities, [0.5, 8.0])
    assert weights.tolist() == [1.0, 1.0]


def test_anneal_is_linear_from_the_initial_beta_and_does_not_compound():
    """``beta = beta0 + fraction (final - beta0)``, from beta0 every time."""
    priorities = Priorities(0.6, 0.4, 1e-6)
    priorities.anneal(0.5, 1.0)
    assert priorities.beta == pytest.approx(0.7, rel=1e-12)
    priorities.anneal(0.5, 1.0)
    assert priorities.beta == pytest.approx(0.7, rel=1e-12)
    priorities.anneal(1.0, 0.0)
    assert priorities.beta == 0.0
    assert priorities.initial_beta == 0.4


@pytest.mark.parametrize(
    ("fraction", "final", "error", "message"),
    [
        (1.5, 1.0, InvalidArgumentError, r"^fraction must be in \[0, 1\], got 1\.5$"),
        (0.5, -1.0, InvalidArgumentError, r"^final must be >= 0\.0 and finite, got -1\.0$"),
        (True, 1.0, TypeError, r"^fraction must be a real number, got True$"),
    ],
)
def test_anneal_refuses_bad_arguments_and_keeps_beta(fraction, final, error, message):
    """A refused anneal leaves beta as it was."""
    priorities = Priorities(0.6, 0.4, 1e-6)
    priorities.anneal(0.5, 1.0)
    with pytest.raises(error, match=message):
        priorities.anneal(fraction, final)
    assert priorities.beta == pytest.approx(0.7, rel=1e-12)


def test_max_priority_starts_at_one_and_only_rises():
    """The largest priority ever set starts at 1.0 and never falls."""
    priorities = Priorities(0.6, 0.4, 1e-6)
    assert priorities.max_priority == 1.0
    priorities.raise_max(0.5)
    assert priorities.max_priority == 1.0
    priorities.raise_max(3.0)
    priorities.raise_max(2.0)
    assert priorities.max_priority == 3.0


def test_config_is_the_constructor_and_state_what_changed_since():
    """``config`` holds alpha, the initial beta and epsilon; ``state`` beta and the maximum."""
    priorities = Priorities(0.7, 0.3, 1e-3)
    priorities.anneal(0.5, 1.0)
    priorities.raise_max(5.0)
    assert priorities.config() == {"alpha": 0.7, "beta": 0.3, "epsilon": 1e-3}
    assert priorities.state() == {"beta": pytest.approx(0.65, rel=1e-12), "max_priority": 5.0}


def test_with_state_returns_a_restored_copy():
    """``with_state`` gives a new value with the saved beta and maximum; the original stays."""
    priorities = Priorities(0.7, 0.3, 1e-3)
    restored = priorities.with_state(
        {"beta": 0.5, "max_priority": 4.0}, torch.tensor([1.0, 3.0], dtype=torch.float64)
    )
    assert restored is not priorities
    assert (restored.beta, restored.max_priority, restored.initial_beta) == (0.5, 4.0, 0.3)
    assert restored.config() == priorities.config()
    assert priorities.state() == {"beta": 0.3, "max_priority": 1.0}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([0.5, 4.0], r"^checkpoint extra state must hold exactly beta and max_priority, got list$"),
        (
            {"beta": 0.5},
            r"^checkpoint extra state must hold exactly beta and max_priority, got \['beta'\]$",
        ),
        (
            {"beta": 0.5, "max_priority": 4.0, "alpha": 0.6},
            r"^checkpoint extra state must hold exactly beta and max_priority, "
            r"got \['alpha', 'beta', 'max_priority'\]$",
        ),
        ({"beta": -0.5, "max_priority": 4.0}, r"^checkpoint beta must be >= 0\.0 and finite"),
        ({"beta": "0.5", "max_priority": 4.0}, r"^checkpoint beta must be a real number"),
        ({"beta": 0.5, "max_priority": 0.5}, r"^checkpoint max_priority must be >= 1\.0"),
        ({"beta": 0.5, "max_priority": math.nan}, r"^checkpoint max_priority must be >= 1\.0"),
        (
            {"beta": 0.5, "max_priority": 2.0},
            r"^checkpoint max_priority must be >= every stored priority \(3\.0\), got 2\.0$",
        ),
    ],
    ids=[
        "not-a-mapping",
        "missing",
        "extra-key",
        "negative-beta",
        "string-beta",
        "below-one",
        "nan-max",
        "below-stored",
    ],
)
def test_with_state_refuses_a_state_it_cannot_hold(state, message):
    """A saved priority state of other keys, bad values or a maximum below a stored priority is
    a `CheckpointError`; the value it was called on is unchanged."""
    priorities = Priorities(0.7, 0.3, 1e-3)
    with pytest.raises(CheckpointError, match=message):
        priorities.with_state(state, torch.tensor([1.0, 3.0], dtype=torch.float64))
    assert priorities.state() == {"beta": 0.3, "max_priority": 1.0}
