"""Compressed blocks: what a `BlockField` returns equals an uncompressed ring's bytes."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lucid_replay import engine
from lucid_replay.blocks import BLOCK_STEPS, BlockCache, BlockField

pytest.importorskip("zstandard")
pytest.importorskip("lz4")


@settings(max_examples=60, deadline=None)
@given(
    codec=st.sampled_from(["zstd", "lz4"]),
    capacity=st.integers(1, 3 * BLOCK_STEPS + 5),
    step_bytes=st.integers(1, 9),
    cache_blocks=st.integers(0, 3),
    calls=st.lists(
        st.tuples(st.booleans(), st.integers(1, 100), st.integers(0, 2**31)), max_size=25
    ),
)
def test_writes_and_gathers_match_a_plain_ring(codec, capacity, step_bytes, cache_blocks, calls):
    cache = BlockCache(cache_blocks * BLOCK_STEPS * step_bytes)
    field = BlockField(capacity, step_bytes, codec, cache, owner=0)
    reference = np.zeros((capacity, step_bytes), dtype=np.uint8)
    head, rng = 0, np.random.default_rng(0)
    for write, size, seed in calls:
        if write:  # the ring writes in slot order, split at its seam
            raw = np.random.default_rng(seed).integers(0, 3, (min(size, capacity), step_bytes))
            raw = raw.astype(np.uint8)
            first = min(raw.shape[0], capacity - head)
            field.write(head, raw[:first])
            reference[head : head + first] = raw[:first]
            if first < raw.shape[0]:
                field.write(0, raw[first:])
                reference[: raw.shape[0] - first] = raw[first:]
            head = (head + raw.shape[0]) % capacity
        else:
            slots = rng.integers(0, capacity, size).astype(np.int64)
            assert np.array_equal(field.gather(slots), reference[slots])
        assert cache.nbytes <= cache.max_bytes
    field.seal()
    everything = np.arange(capacity, dtype=np.int64)
    assert np.array_equal(field.gather(everything), reference)


def test_compression_shrinks_repetitive_frames():
    frame = np.zeros((BLOCK_STEPS * 4, 7056), dtype=np.uint8)
    frame[:, :100] = 7
    for codec in ("zstd", "lz4"):
        field = BlockField(frame.shape[0], 7056, codec, BlockCache(0), owner=0)
        field.write(0, frame)
        field.seal()
        assert field.stored_bytes * 10 < frame.nbytes


@settings(max_examples=40, deadline=None)
@given(
    codec=st.sampled_from(["zstd", "lz4"]),
    capacity=st.integers(1, 5 * BLOCK_STEPS + 7),
    step_bytes=st.integers(1, 9),
    arena_blocks=st.integers(0, 4),
    cache_blocks=st.integers(0, 2),
    seed=st.integers(0, 2**31),
    kernels=st.booleans(),
)
def test_gathers_through_arenas_of_any_size_into_out(
    codec, capacity, step_bytes, arena_blocks, cache_blocks, seed, kernels
):
    """Slots gathered in arenas of a few blocks at a time (or less than one), or by the
    compiled copy straight from the blocks, into a given output, equal the written bytes,
    in the slots' order and with repeats."""
    if kernels and not engine.available():
        return
    with engine.use("kernels" if kernels else "numpy"):
        _gather_and_compare(codec, capacity, step_bytes, arena_blocks, cache_blocks, seed)


def _gather_and_compare(codec, capacity, step_bytes, arena_blocks, cache_blocks, seed):
    rng = np.random.default_rng(seed)
    reference = rng.integers(0, 4, (capacity, step_bytes)).astype(np.uint8)
    field = BlockField(capacity, step_bytes, codec, BlockCache(cache_blocks * 32), owner=0)
    field.write(0, reference[: capacity - 3 if capacity > 3 else capacity])  # head stays raw
    if capacity > 3:
        field.write(capacity - 3, reference[capacity - 3 :])
    slots = rng.integers(0, capacity, 3 * capacity).astype(np.int64)
    arena = arena_blocks * BLOCK_STEPS * step_bytes
    with mock.patch("lucid_replay.blocks.ARENA_BYTES", arena):
        out = np.full((slots.shape[0], step_bytes), 255, dtype=np.uint8)
        assert field.gather(slots, out) is out
        assert np.array_equal(out, reference[slots])
        assert np.array_equal(field.gather(slots[::-1].copy()), reference[slots[::-1]])
        assert field.gather(slots[:0]).shape == (0, step_bytes)
