"""`ShardHooks`: what the coordinator of a sharded replay needs from each shard's buffer.

A sharded replay draws exactly what one buffer over the union of its shards would draw:

1. it reads each shard's total mass (`log_mass`: ``log sum_e n_e p_e^alpha``, comparable
   across shards whatever their trees' scales),
2. draws a shard label per batch position from those masses with its own generator,
3. asks each shard for its count of draws (`draw_round`) from the shard's own tree and
   generator, kept within the reuse limit without local redraws (the refused positions are
   labelled again from the masses of the moment, round after round),
4. normalises importance weights over the merged batch from the drawn episodes'
   priorities: ``(p_min / p) ** (alpha beta)`` needs neither ``N`` nor the total mass.

Priority updates route by episode id; `update` reports the largest priority it applied, so
the coordinator can keep the maximum priority global (`raise_max_priority`).
"""

from __future__ import annotations

from typing import Any

import torch

from lucid_replay import engine
from lucid_replay.batch import Batch, WindowBatch
from lucid_replay.errors import wrong_kind
from lucid_replay.laws import Law
from lucid_replay.prioritized import PrioritizedSequenceReplay
from lucid_replay.window import Window

__all__: list[str] = []  # internal module


class ShardHooks:
    """Coordinator operations on one `PrioritizedSequenceReplay` (a shard), under its lock."""

    def __init__(self, buffer: PrioritizedSequenceReplay) -> None:
        if not isinstance(buffer, PrioritizedSequenceReplay):
            raise wrong_kind("buffer", "a PrioritizedSequenceReplay", type(buffer).__name__)
        self.buffer = buffer

    def log_mass(self, window: Window, law: Law) -> float:
        """``log`` of the mass a draw of ``window`` by ``law`` chooses from (``-inf``: nothing)."""
        with self.buffer._lock:
            return self.buffer._core.log_mass(window, law)

    def draws_left(self, window: Window) -> int | None:
        """Draws the reuse limit still allows for ``window``; ``None`` without a limit."""
        with self.buffer._lock:
            return self.buffer._core.sampler.draws_left(window.anchor_span)

    def draw_round(
        self,
        count: int,
        window: Window,
        law: Law,
        *,
        chunks: bool = False,
        device: torch.device | str | None = None,
    ) -> tuple[Batch | WindowBatch, torch.Tensor | None, torch.Tensor]:
        """``count`` draws of ``window`` (or of chunks of ``window.length`` steps).

        Returns the batch of the draws kept (no weights), their priorities (float64, for a
        law by priority) and which of the ``count`` draws the reuse limit kept (bool
        ``[count]``): a coordinator of several shards puts each shard's kept draws back at
        the batch positions it labelled with that shard, in draw order. The caller makes
        sure the mass is positive (`log_mass`).
        """
        buffer = self.buffer
        target = buffer._batch_device(device)
        with buffer._lock:
            batch, drawn, kept = buffer._core.draw_round(count, window, target, law, chunks=chunks)
        priorities = None if drawn is None else engine.tensor(drawn)
        return batch, priorities, kept

    def update(self, ids: Any, errors: Any) -> tuple[int, float | None]:
        """`update_priorities` of ids this shard issued; also the largest priority applied.

        ``None`` when nothing was applied (every id evicted).
        """
        applied, largest = self.buffer._update_priorities(ids, errors)
        return (applied, largest) if applied else (0, None)

    def raise_max_priority(self, priority: float) -> None:
        """Raise the maximum priority (what new episodes get) to at least ``priority``."""
        self.buffer._raise_max_priority(priority)
