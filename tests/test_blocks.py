"""Compressed blocks: what a `BlockField` returns equals an uncompressed ring's bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
