"""Shared by the draw-without-replacement tests: a small segmented buffer with every segment
case, and the check that every engine draws the same batches."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from lucid_replay import Episode, PrioritizedSequenceReplay, Window, engine


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
