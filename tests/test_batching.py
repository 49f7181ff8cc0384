"""Gathering into a batch the caller owns (``out=``) and recycling prefetch rings.

A draw into ``out`` must equal a fresh draw of a twin buffer with the same seed, write
nothing new (the same tensors come back), and refuse an ``out`` it cannot fill before it
draws anything.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_batches_equal, assert_refused, make_episode

from lucid_replay import (
    Batch,
    PrioritizedBatch,
    PrioritizedSequenceReplay,
    SequenceReplay,
    Window,
    WindowBatch,
)

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic

WINDOWS = [
    Window(4, burn_in=3, bootstrap=2),
    Window(3, burn_in=2, bootstrap=1, boundary="stop"),
    Window(3, burn_in=2, bootstrap=2, boundary="include_reset", allow_partial=True),
    Window(2, burn_in=1, dilation=2),
]


def _twins(kind=PrioritizedSequenceReplay):
    buffers = []
    for _ in range(2):
        buffer = kind(capacity=60, seed=11)
        buffer.extend(make_episode(n, first_serial=100 * n) for n in (5, 9, 3, 12, 7, 8, 6))
        buffers.append(buffer)
    return buffers


def _tensors(batch) -> dict[str, torch.Tensor]:
    values = {f"data.{k}": v for k, v in batch.data.items()}
    for name in dir(batch):
        value = getattr(batch, name, None)
        if isinstance(value, torch.Tensor):
            values[name] = value
    return values


def _assert_window_batches_equal(got: WindowBatch, expected: WindowBatch) -> None:
    for name, value in _tensors(expected).items():
        assert torch.equal(_tensors(got)[name], value), name
    assert (got.weights is None) == (expected.weights is None)


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"{w.boundary}-{w.size}")
@pytest.mark.parametrize("prioritized", [True, False])
def test_windows_drawn_into_out_equal_fresh_draws_in_the_same_tensors(window, prioritized):
    """Draws into ``out`` equal a twin's fresh draws and reuse ``out``'s memory."""
    buffer, twin = _twins()
    batch = buffer.sample_windows(8, window, prioritized=prioritized)
    twin.sample_windows(8, window, prioritized=prioritized)
    addresses = {name: t.data_ptr() for name, t in _tensors(batch).items()}
    for _ in range(4):
        batch.learning_mask[:, 0] = True  # edits are overwritten, not kept
        batch.step_in_sequence[0, 0] = 99
        again = buffer.sample_windows(8, window, prioritized=prioritized, out=batch)
        assert again is batch
        _assert_window_batches_equal(batch, twin.sample_windows(8, window, prioritized=prioritized))
        assert {name: t.data_ptr() for name, t in _tensors(batch).items()} == addresses
    assert buffer.stats() == twin.stats()


def test_chunks_drawn_into_out_equal_fresh_draws():
    """``sample(out=)`` and ``sample_prioritized(out=)`` fill the batches they are given."""
    buffer, twin = _twins()
    chunks = buffer.sample(6, 3)
    prioritized = buffer.sample_prioritized(6, 3)
    twin.sample(6, 3)
    twin.sample_prioritized(6, 3)
    for _ in range(3):
        assert buffer.sample(6, 3, out=chunks) is chunks
        assert_batches_equal(chunks, twin.sample(6, 3))
        assert buffer.sample_prioritized(6, 3, out=prioritized) is prioritized
        expected = twin.sample_prioritized(6, 3)
        assert_batches_equal(prioritized, expected)
        assert torch.equal(prioritized.weights, expected.weights)
        assert torch.equal(prioritized.indices, expected.indices)


def _shrunk(batch: WindowBatch) -> WindowBatch:
    import attrs

    return attrs.evolve(batch, validity_mask=batch.validity_mask[:, :-1].contiguous())


@pytest.mark.parametrize(
    "make_out, error, match",
    [
        (lambda b: {"obs": torch.zeros(1)}, TypeError, "out must be a WindowBatch"),
        (lambda b: b.sample(4, 3), TypeError, "out must be a WindowBatch"),
        (lambda b: b.sample_windows(5, Window(3)), ValueError, "of shape"),
        (lambda b: b.sample_windows(4, Window(4)), ValueError, "of shape"),
        (lambda b: b.sample_windows(4, Window(3), prioritized=False), ValueError, "weights"),
        (lambda b: b.sample_windows(4, Window(3)).to("meta"), ValueError, "on cpu"),
        (lambda b: _shrunk(b.sample_windows(4, Window(3))), ValueError, "validity_mask"),
    ],
    ids=["dict", "chunk-batch", "batch-size", "window-size", "no-weights", "device", "shape"],
)
def test_an_out_the_draw_cannot_fill_is_refused_before_drawing(make_out, error, match):
    """A wrong kind, shape, device or weights is refused and the buffer is unchanged."""
    buffer = _twins()[0]
    out = make_out(buffer)
    draw = lambda: buffer.sample_windows(4, Window(3), device="cpu", out=out)  # noqa: E731
    assert_refused(buffer, draw, error, match)


def test_chunk_out_of_the_wrong_kind_is_refused():
    """``sample`` wants a plain `Batch`, ``sample_prioritized`` a `PrioritizedBatch`."""
    buffer = _twins()[0]
    prioritized = buffer.sample_prioritized(4, 3)
    plain = buffer.sample(4, 3)
    assert isinstance(prioritized, PrioritizedBatch) and type(plain) is Batch
    assert_refused(buffer, lambda: buffer.sample(4, 3, out=prioritized), TypeError, "out must")
    assert_refused(
        buffer, lambda: buffer.sample_prioritized(4, 3, out=plain), TypeError, "out must"
    )
    uniform = _twins(SequenceReplay)[0]
    ids = torch.zeros(4, dtype=torch.long)
    other_fields = Batch({"x": torch.zeros(4, 3)}, ids, ids.clone())
    assert_refused(uniform, lambda: uniform.sample(4, 3, out=other_fields), ValueError, "fields")


def test_recycling_iterator_yields_the_draws_of_a_fresh_one_in_a_ring_of_batches():
    """``iterate(recycle=True)`` draws what ``iterate()`` draws, into prefetch + 2 batches."""
    buffer, twin = _twins()
    window = Window(3, burn_in=1, bootstrap=1)
    seen = set()
    with (
        buffer.iterate(8, window, prefetch=2, recycle=True) as recycled,
        twin.iterate(8, window, prefetch=2) as fresh,
    ):
        for _ in range(12):
            batch, expected = next(recycled), next(fresh)
            _assert_window_batches_equal(batch, expected)
            seen.add(batch["obs"].data_ptr())
    assert len(seen) <= 4


def test_recycle_must_be_a_bool():
    """``recycle`` is a flag."""
    buffer = _twins()[0]
    with pytest.raises(TypeError, match="recycle must be a bool"):
        buffer.iterate(4, Window(2), recycle=1)
