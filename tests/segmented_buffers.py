"""Shared by the segment tests: a small segmented buffer with every segment case, episodes
streamed at once in random pieces, the check that every engine draws the same batches, and
the check that a refused stream call changes nothing."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import comparable

from lucid_replay import Episode, EpisodeStream, PrioritizedSequenceReplay, Window, engine


def segmented_buffer(unit: str, alpha: float, **options: object) -> PrioritizedSequenceReplay:
    """Segments of 3 steps: an open episode whose head was evicted, closed episodes, distinct
    priorities (``options``: more constructor arguments, e.g. ``selector``)."""
    options = {"seed": 9, **options}
    buffer = PrioritizedSequenceReplay(20, alpha=alpha, segment_length=3, unit=unit, **options)
    stream = buffer.open_episode()
    stream.append({"x": torch.arange(7)})
    for length in (4, 5):
        buffer.add(Episode({"x": torch.arange(length)}))
    stream.append({"x": torch.arange(7, 13)})  # evicts heads: its own and others'
    ids = list(buffer.episode_ids)
    buffer.update_priorities(ids, np.linspace(0.5, 4.0, len(ids)))
    assert buffer.episode_info(0).first_step > 0 and buffer.open_episode_ids == [0]
    return buffer


def stream_interleaved(
    buffer: object,
    rng: np.random.Generator,
    *,
    streams: int,
    rounds: int,
    max_piece: int,
    serial_base: int,
    obs: Callable[[torch.Tensor], torch.Tensor],
    flush_chance: float | None = None,
) -> list[EpisodeStream]:
    """Open ``streams`` episodes on ``buffer`` and append to one chosen at random each round,
    ``1 .. max_piece - 1`` steps: ``serial`` (step + ``serial_base`` x stream) and
    ``obs(serial)``; with ``flush_chance``, that stream is flushed that often. Returns the
    streams, open."""
    opened = [buffer.open_episode() for _ in range(streams)]  # type: ignore[attr-defined]
    lengths = [0] * streams
    for _ in range(rounds):
        which = int(rng.integers(streams))
        size = int(rng.integers(1, max_piece))
        serial = torch.arange(lengths[which], lengths[which] + size) + serial_base * which
        opened[which].append({"serial": serial, "obs": obs(serial)})
        lengths[which] += size
        if flush_chance is not None and rng.random() < flush_chance:
            opened[which].flush()
    return opened


def refused_changes_nothing(
    buffer: object, stream: EpisodeStream, call: Callable[[], object], error: type, match: str
) -> None:
    """``call`` raises ``error`` (matching ``match``), the buffer and ``stream`` unchanged."""
    before = (comparable(buffer.state_dict()), buffer.stats(), stream.pending)  # type: ignore[attr-defined]
    with pytest.raises(error, match=match):
        call()
    assert (comparable(buffer.state_dict()), buffer.stats(), stream.pending) == before  # type: ignore[attr-defined]


def distinct_draws_on_every_engine(make: Callable[[str], list], window: object) -> None:
    """Each engine draws the same batches without replacement from ``make(unit)``'s buffers
    (sizes 1-3, both units; a segmented buffer with a shorter window), ids, steps, weights
    and probabilities equal."""
    drawn = []
    for name in engine.ENGINES:
        if name == "kernels" and not engine.available():
            continue
        with engine.use(name):
            batches = []
            for unit in ("chunk", "episode"):
                for buffer in make(unit):
                    shape = Window(2, burn_in=1, bootstrap=2) if buffer.segment_length else window
                    for size in (1, 2, 3):
                        batch = buffer.sample_windows(size, shape, replacement=False)
                        batches.append((batch.episode_ids, batch.anchor_steps, batch.weights))
                        batches.append((batch.probabilities,))
            drawn.append(batches)
    assert len(drawn) >= 2
    for other in drawn[1:]:
        for ours, theirs in zip(drawn[0], other, strict=True):
            for a, b in zip(ours, theirs, strict=True):
                assert torch.equal(a, b)
