"""`n_step_returns` against a plain-Python per-record model, hand-computed cases, refusals.

The model follows the definition record by record: record k links to k + 1 when that is the
valid next step of the same episode; under ``values_of="record"`` a transition out of k needs
that link (the extra final record owns none), under ``"next"`` every valid record owns one.
Random buffers mix terminated and truncated episodes of lengths 1..8; windows cover every
boundary policy, so windows clamped at episode ends and windows running into neighbouring
episodes (``include_reset``) are both drawn.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lucid_replay import (
    Episode,
    InvalidArgumentError,
    PrioritizedSequenceReplay,
    SequenceReplay,
    Window,
    n_step_returns,
)


def _model(batch, rewards, values, n, discount, values_of):
    """Targets and mask, one record at a time, straight from the definition."""
    valid = batch.validity_mask.tolist()
    ids, steps = batch.record_episode_ids.tolist(), batch.record_steps.tolist()
    learning, terminal = batch.learning_mask.tolist(), batch.terminal.tolist()
    rewards, values = rewards.tolist(), values.tolist()
    width = len(valid[0])
    targets, mask = [], []
    for b in range(len(valid)):

        def links(p, b=b):
            return (
                p + 1 < width
                and valid[b][p]
                and valid[b][p + 1]
                and ids[b][p] == ids[b][p + 1]
                and steps[b][p + 1] == steps[b][p] + 1
            )

        row_targets, row_mask = [], []
        for k in range(width):
            m = 0
            if learning[b][k] and valid[b][k]:
                if values_of == "record":
                    while m < n and links(k + m):
                        m += 1
                    last = k + m
                else:
                    m = 1
                    while m < n and links(k + m - 1):
                        m += 1
                    last = k + m - 1
            if m == 0:
                row_targets.append(0.0)
                row_mask.append(False)
                continue
            target = sum(discount**i * rewards[b][k + i] for i in range(m))
            if not terminal[b][last]:
                target += discount**m * values[b][last]
            row_targets.append(target)
            row_mask.append(True)
        targets.append(row_targets)
        mask.append(row_mask)
    return torch.tensor(targets, dtype=torch.float64), torch.tensor(mask)


@st.composite
def _cases(draw):
    lengths = draw(st.lists(st.integers(1, 8), min_size=1, max_size=5))
    terminated = draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    window = Window(
        draw(st.integers(1, 4)),
        burn_in=draw(st.integers(0, 2)),
        bootstrap=draw(st.integers(0, 4)),
        boundary=draw(st.sampled_from(["pad", "stop", "include_reset"])),
        allow_partial=True,
    )
    n = draw(st.integers(1, 5))
    discount = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    values_of = draw(st.sampled_from(["record", "next"]))
    seed = draw(st.integers(0, 2**16))
    return lengths, terminated, window, n, discount, values_of, seed


@settings(max_examples=150, deadline=None, derandomize=True)
@given(_cases())
def test_n_step_returns_equal_the_per_record_model_on_random_batches(case):
    """On random buffers and windows (pad, stop, include_reset), targets and mask equal the
    per-record model: returns stop at padding, episode ends and the window end, never take
    another episode's records, and bootstrap except from terminal records."""
    lengths, terminated, window, n, discount, values_of, seed = case
    generator = torch.Generator().manual_seed(seed)
    buffer = SequenceReplay(capacity=100, seed=seed)
    for length, flag in zip(lengths, terminated, strict=True):
        buffer.add(Episode({"reward": torch.rand(length, generator=generator)}, terminated=flag))
    batch = buffer.sample_windows(6, window)
    values = torch.randn(batch.validity_mask.shape, generator=generator, dtype=torch.float64)
    rewards = batch["reward"].double()
    targets, mask = n_step_returns(
        batch, rewards, values, n=n, discount=discount, values_of=values_of
    )
    expected_targets, expected_mask = _model(batch, rewards, values, n, discount, values_of)
    assert torch.equal(mask, expected_mask)
    torch.testing.assert_close(targets, expected_targets, rtol=1e-12, atol=1e-12)


def _buffer(*episodes):
    buffer = SequenceReplay(capacity=100)
    for rewards, terminated in episodes:
        buffer.add(Episode({"reward": torch.tensor(rewards)}, terminated=terminated))
    return buffer


def test_a_truncated_episode_bootstraps_from_its_final_record():
    """Truncated: the last transition bootstraps from the extra final record's value; the
    final record itself owns no transition."""
    buffer = _buffer(([1.0, 2.0, 0.0], False))
    batch = buffer.gather_windows([0], [0], Window(3))
    values = torch.tensor([[10.0, 20.0, 30.0]])
    targets, mask = n_step_returns(batch, batch["reward"], values, n=3, discount=0.5)
    assert mask.tolist() == [[True, True, False]]
    assert targets.tolist() == [[1.0 + 0.5 * 2.0 + 0.25 * 30.0, 2.0 + 0.5 * 30.0, 0.0]]


def test_a_terminated_episode_counts_its_terminal_value_as_zero_even_if_nan():
    """Terminated: the final record's value is not used, so a NaN there reaches no target."""
    buffer = _buffer(([1.0, 2.0, 0.0], True))
    batch = buffer.gather_windows([0], [0], Window(3))
    values = torch.tensor([[10.0, 20.0, math.nan]])
    targets, mask = n_step_returns(batch, batch["reward"], values, n=1, discount=0.5)
    assert targets.tolist() == [[1.0 + 0.5 * 20.0, 2.0, 0.0]]
    assert mask.tolist() == [[True, True, False]]


@pytest.mark.parametrize("values_of", ["record", "next"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_discount_zero_gives_the_rewards_whatever_the_bootstrap_values_hold(values_of, bad):
    """With discount 0 a target is its first reward: an infinite or NaN bootstrap value,
    weighted by 0**m, never reaches it (old: 0 * inf made the target NaN)."""
    buffer = _buffer(([1.0, 2.0, 4.0, 0.0], False))
    batch = buffer.gather_windows([0], [0], Window(3, bootstrap=1))
    values = torch.full((1, 4), bad)
    targets, mask = n_step_returns(
        batch, batch["reward"], values, n=2, discount=0.0, values_of=values_of
    )
    assert mask[0, :3].all()
    assert targets[0, :3].tolist() == [1.0, 2.0, 4.0]


def test_include_reset_records_of_the_next_episode_never_enter_a_return():
    """A window running from episode 0 into episode 1 (include_reset) stops at episode 0's
    final record: episode 1's rewards and values, here NaN, are never read."""
    buffer = _buffer(([1.0, 0.0], False), ([5.0, 6.0, 0.0], True))
    window = Window(2, bootstrap=2, boundary="include_reset")
    batch = buffer.gather_windows([0], [0], window)
    assert batch.record_episode_ids.tolist() == [[0, 0, 1, 1]]
    rewards = torch.tensor([[1.0, math.nan, math.nan, math.nan]])
    values = torch.tensor([[10.0, 20.0, math.nan, math.nan]])
    targets, mask = n_step_returns(batch, rewards, values, n=3, discount=0.5)
    assert targets.tolist() == [[1.0 + 0.5 * 20.0, 0.0, 0.0, 0.0]]
    assert mask.tolist() == [[True, False, False, False]]


def test_pad_records_past_the_end_stop_the_return():
    """Under pad, the window past the episode end is padding: the return stops there."""
    buffer = _buffer(([1.0, 2.0, 0.0], False))
    batch = buffer.gather_windows([0], [1], Window(2, bootstrap=3))
    assert batch.validity_mask.tolist() == [[True, True, False, False, False]]
    values = torch.arange(5.0).reshape(1, 5) + 10
    targets, mask = n_step_returns(batch, batch["reward"], values, n=4, discount=1.0)
    assert targets.tolist() == [[2.0 + 11.0, 0.0, 0.0, 0.0, 0.0]]
    assert mask.tolist() == [[True, False, False, False, False]]


def test_values_of_next_uses_every_valid_record_and_its_next_value():
    """values_of="next" (TorchRL's layout): the last step owns a transition and bootstraps from
    its next value, or from nothing when the episode terminated."""
    buffer = _buffer(([1.0, 2.0, 4.0], True), ([1.0, 2.0], False))
    batch = buffer.gather_windows([0, 1], [0, 0], Window(3))
    values = torch.tensor([[10.0, 20.0, 30.0], [10.0, 20.0, 30.0]])
    targets, mask = n_step_returns(
        batch, batch["reward"], values, n=2, discount=0.5, values_of="next"
    )
    assert mask.tolist() == [[True, True, True], [True, True, False]]
    assert targets.tolist() == [
        [1.0 + 0.5 * 2.0 + 0.25 * 20.0, 2.0 + 0.5 * 4.0, 4.0],
        [1.0 + 0.5 * 2.0 + 0.25 * 20.0, 2.0 + 0.5 * 20.0, 0.0],
    ]


def test_only_learning_records_are_in_the_mask():
    """Burn-in and bootstrap records get no target, even where they own a transition."""
    buffer = _buffer(([1.0] * 8, False))
    batch = buffer.gather_windows([0], [2], Window(2, burn_in=2, bootstrap=2))
    values = torch.zeros(1, 6)
    _, mask = n_step_returns(batch, batch["reward"], values, n=1, discount=0.9)
    assert mask.tolist() == [[False, False, True, True, False, False]]


def test_targets_keep_the_promoted_dtype_and_the_batch_device():
    """float32 rewards and float64 values give float64 targets, on the batch's device."""
    buffer = _buffer(([1.0, 2.0, 0.0], False))
    batch = buffer.gather_windows([0], [0], Window(3))
    targets, mask = n_step_returns(
        batch, batch["reward"], torch.zeros(1, 3, dtype=torch.float64), n=2, discount=0.9
    )
    assert targets.dtype == torch.float64
    assert targets.device == mask.device == batch.validity_mask.device


def test_a_prioritized_batch_and_update_priorities_from_accept_the_mask():
    """The mask is what update_priorities_from takes as mask=: windows keep their order."""
    buffer = PrioritizedSequenceReplay(capacity=100, seed=0)
    buffer.add(Episode({"reward": torch.ones(6)}))
    batch = buffer.sample_windows(4, Window(2, bootstrap=1))
    targets, mask = n_step_returns(batch, batch["reward"], torch.zeros(4, 3), n=1, discount=0.9)
    assert buffer.update_priorities_from(batch, targets, mask=mask) == 1


@pytest.fixture
def batch():
    """A window batch of 2 windows of 3 records."""
    return _buffer(([1.0, 2.0, 3.0, 0.0], False)).gather_windows([0, 0], [0, 1], Window(3))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"n": 0}, InvalidArgumentError, r"^n must be >= 1, got 0$"),
        ({"n": True}, TypeError, r"^n must be an int, got True$"),
        ({"n": 2.0}, TypeError, r"^n must be an int, got 2\.0$"),
        ({"discount": 1.5}, InvalidArgumentError, r"^discount must be in \[0, 1\], got 1\.5$"),
        ({"discount": -0.1}, InvalidArgumentError, r"^discount must be >= 0\.0 and finite"),
        ({"discount": "0.9"}, TypeError, r"^discount must be a real number, got '0\.9'$"),
        (
            {"values_of": "final"},
            InvalidArgumentError,
            r"^values_of must be one of \('record', 'next'\), got 'final'$",
        ),
        (
            {"rewards": torch.zeros(2, 4)},
            InvalidArgumentError,
            r"^rewards must be of the batch's shape \[2, 3\], got \[2, 4\]$",
        ),
        (
            {"bootstrap_values": torch.zeros(2, 3, 1)},
            InvalidArgumentError,
            r"^bootstrap_values must be of the batch's shape \[2, 3\], got \[2, 3, 1\]$",
        ),
        (
            {"rewards": torch.zeros(2, 3, dtype=torch.int64)},
            TypeError,
            r"^rewards must be a floating-point tensor, got torch\.int64$",
        ),
        (
            {"bootstrap_values": [[0.0] * 3] * 2},
            TypeError,
            r"^bootstrap_values must be a floating-point tensor, got list$",
        ),
        (
            {"rewards": torch.zeros(2, 3, device="meta")},
            InvalidArgumentError,
            r"^rewards must be on the batch's device \(cpu\), got 'meta'$",
        ),
    ],
)
def test_n_step_returns_refuses_bad_arguments_naming_them(batch, change, error, message):
    """Each refused argument is named in the error, with the rule and the value."""
    arguments = {
        "rewards": torch.zeros(2, 3),
        "bootstrap_values": torch.zeros(2, 3),
        "n": 2,
        "discount": 0.9,
        **change,
    }
    rewards, values = arguments.pop("rewards"), arguments.pop("bootstrap_values")
    with pytest.raises(error, match=message):
        n_step_returns(batch, rewards, values, **arguments)


def test_n_step_returns_refuses_a_batch_that_is_not_a_window_batch():
    """A chunk Batch has no masks: TypeError naming batch."""
    chunks = _buffer(([1.0, 2.0], False)).sample(1, 2)
    with pytest.raises(TypeError, match=r"^batch must be a WindowBatch, got Batch$"):
        n_step_returns(chunks, torch.zeros(1, 2), torch.zeros(1, 2), n=1, discount=0.9)


def test_n_step_returns_refuses_dilated_windows():
    """Records two steps apart lack the rewards between them: refused, naming the dilation."""
    dilated = _buffer(([1.0] * 6, False)).gather_windows([0], [0], Window(2, dilation=2))
    with pytest.raises(InvalidArgumentError, match=r"^batch must be drawn with dilation=1"):
        n_step_returns(dilated, torch.zeros(1, 2), torch.zeros(1, 2), n=1, discount=0.9)
    # Under "next" a one-step return reads no neighbouring record, so any dilation will do.
    targets, mask = n_step_returns(
        dilated, torch.ones(1, 2), torch.zeros(1, 2), n=1, discount=0.9, values_of="next"
    )
    assert mask.tolist() == [[True, True]]
    assert targets.tolist() == [[1.0, 1.0]]
