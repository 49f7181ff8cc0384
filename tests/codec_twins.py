"""Twins for the compressed-field tests: a buffer of raw fields and the same buffer with its
fields compressed (in memory, or in files with ``storage="memmap"``), fed the same episodes.

Shared by `test_codecs` and `test_codecs_memmap` (not a test module itself).
"""

from __future__ import annotations

import numpy as np
import torch
from conftest import comparable

from lucid_replay import Episode, Field, PrioritizedSequenceReplay, Window

WINDOWS = [
    Window(5, burn_in=3, bootstrap=2),
    Window(4, dilation=2, boundary="stop", allow_partial=True),
    Window(3, burn_in=2, boundary="include_reset", allow_partial=True),
]


def codec_schema(codec: str | None, stack: int = 3) -> dict[str, object]:
    return {
        "obs": Field((6, 5), torch.uint8, stack=stack, stack_pad="zeros", codec=codec),
        "reward": Field((), torch.float32, codec=codec),
        "action": ((), torch.int64),
    }


def twins(codec: str, kind=PrioritizedSequenceReplay, cache_bytes: int = 1000, **kwargs):
    """``(raw, compressed)``; ``kwargs`` go to both but ``storage`` and ``directory``, which
    go to the compressed one only."""
    where = {key: kwargs.pop(key) for key in ("storage", "directory") if key in kwargs}
    plain = kind(200, seed=1, schema=codec_schema(None), **kwargs)
    packed = kind(
        200, seed=1, schema=codec_schema(codec), cache_bytes=cache_bytes, **where, **kwargs
    )
    return plain, packed


def episodes(seed: int, lengths) -> list[Episode]:
    generator = torch.Generator().manual_seed(seed)
    return [
        Episode(
            {
                "obs": torch.randint(0, 4, (n, 6, 5), dtype=torch.uint8, generator=generator),
                "reward": torch.randn(n, generator=generator),
                "action": torch.arange(n),
            }
        )
        for n in lengths
    ]


def same(first: object, second: object) -> None:
    assert comparable(first) == comparable(second)


def data(batch) -> dict[str, torch.Tensor]:
    return dict(batch.data)


def stream_into_both(first, second, seed: int = 4) -> None:
    """Stream three interleaved episodes into both buffers at once (random pieces, left
    open), checking every tenth step that windows drawn from both are the same."""
    rng = np.random.default_rng(seed)
    streams = [(first.open_episode(), second.open_episode()) for _ in range(3)]
    for step in range(60):
        which = int(rng.integers(3))
        piece = episodes(step, [int(rng.integers(1, 9))])[0].steps
        for stream in streams[which]:
            stream.append(dict(piece))
        if step % 10 == 9:
            for window in WINDOWS[:2]:
                same(
                    data(first.sample_windows(12, window)), data(second.sample_windows(12, window))
                )
    assert first.open_episode_ids == second.open_episode_ids
