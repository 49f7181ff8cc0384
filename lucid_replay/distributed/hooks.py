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

`draw_probed` also reports each kept anchor's probability in the shard under every law of
the draw (a mixture's components), with the trees' log totals, from which the coordinator
forms the global ``batch.probabilities`` (`lucid_replay.distributed.draw`).

Priority updates route by episode id; `update` reports the largest priority it applied, so
the coordinator can keep the maximum priority global (`raise_max_priority`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lucid_replay import engine
from lucid_replay.batch import Batch, WindowBatch
from lucid_replay.errors import wrong_kind
from lucid_replay.laws import Law
from lucid_replay.mixtures import Mixture
from lucid_replay.prioritized import PrioritizedSequenceReplay
from lucid_replay.records import Anchors
from lucid_replay.window import Window

__all__: list[str] = []  # internal module


class ShardHooks:
    """Coordinator operations on one `PrioritizedSequenceReplay` (a shard), under its lock."""

    def __init__(self, buffer: PrioritizedSequenceReplay) -> None:
        if not isinstance(buffer, PrioritizedSequenceReplay):
            raise wrong_kind("buffer", "a PrioritizedSequenceReplay", type(buffer).__name__)
        self.buffer = buffer

    def log_mass(self, window: Window, law: Law | Mixture) -> float:
        """``log`` of the mass a draw of ``window`` by ``law`` chooses from (``-inf``: nothing).

        A `Mixture`'s is its components' largest (what matters of it: whether it is -inf).
        """
        with self.buffer._lock:
            if isinstance(law, Mixture):
                return max(self.buffer._core.log_mass(window, part) for part in law.selectors)
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
            batch, drawn, kept, _ = buffer._core.draw_round(
                count, window, target, law, chunks=chunks
            )
        priorities = None if drawn is None else engine.tensor(drawn)
        return batch, priorities, kept

    def draw_probed(
        self,
        count: int,
        window: Window,
        law: Law | Mixture,
        laws: tuple[Any, ...],
        chunks: bool,
        locate: Callable[[Anchors], Any] | None = None,
        totals: list[float] | None = None,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor, np.ndarray, list[float]]:
        """`draw_round`, plus what the coordinator needs for the kept draws' probabilities.

        Also returns float64 ``[K, kept]``: each kept anchor's probability ``m_j / Z_j``
        under each of ``laws`` in this buffer, with its trees as the draw found them, and
        those trees' ``log`` totals ``[K]`` (`log_mass`). A `Mixture` ``law`` (a replay of
        one shard: ``laws`` is ``(law,)``) is drawn whole, as the buffer draws it, every
        draw kept, with its own probabilities. ``locate`` (windows): what it returns of the
        drawn anchors replaces the batch (`ReplayCore.draw_round`). ``totals``: the log
        totals of ``laws`` as the caller just read them (`log_mass`), not read again.
        """
        buffer = self.buffer
        target = buffer._batch_device(None)
        with buffer._lock:
            core = buffer._core
            if totals is None:
                totals = [self.log_mass(window, part) for part in laws]
            if isinstance(law, Mixture) and locate is not None:
                anchors = core.draw(count, window, law)
                result = locate(anchors)
                core.store.reclaim_retired()
                chances = engine.tensor(anchors.probabilities).double().cpu().numpy()[None]
                return result, None, torch.ones(count, dtype=torch.bool), chances, totals
            if isinstance(law, Mixture):
                drawn: Any = (
                    core.chunks(count, window.length, target, law)
                    if chunks
                    else core.windows(count, window, target, law)
                )
                assert drawn.probabilities is not None  # a drawn batch carries them
                chances = drawn.probabilities.double().cpu().numpy()[None]
                return drawn, None, torch.ones(count, dtype=torch.bool), chances, totals
            batch, priorities, kept, chances = core.draw_round(
                count,
                window,
                target,
                law,
                chunks=chunks,
                probe=_prober(core, window, laws),
                locate=locate,
            )
        drawn_priorities = None if priorities is None else engine.tensor(priorities)
        return batch, drawn_priorities, kept, chances, totals

    def update(self, ids: Any, errors: Any) -> tuple[int, float | None]:
        """`update_priorities` of ids this shard issued; also the largest priority applied.

        ``None`` when nothing was applied (every id evicted).
        """
        applied, largest = self.buffer._update_priorities(ids, errors)
        return (applied, largest) if applied else (0, None)

    def raise_max_priority(self, priority: float) -> None:
        """Raise the maximum priority (what new episodes get) to at least ``priority``."""
        self.buffer._raise_max_priority(priority)


def _prober(core: Any, window: Window, laws: tuple[Law, ...]) -> Any:
    """The probe of `ReplayCore.draw_round`: ``m_j / Z_j`` of drawn rows under each law.

    The trees' scales and totals are read now, before the draw (which may retire rows).
    """
    span, extra = window.anchor_span, window.open_anchor_span - window.anchor_span
    trees = [core.sampler.trees.cached(span, law, extra) for law in laws]
    fixed = [(tree.scale, tree.total()) for tree in trees]
    table = core.store.table

    def probe(rows: Any) -> np.ndarray:
        chances = np.zeros((len(laws), int(rows.shape[0])), dtype=np.float64)
        for j, (law, (scale, total)) in enumerate(zip(laws, fixed, strict=True)):
            if total > 0:
                chance = engine.tensor(law.probability(table, rows, scale, total))
                chances[j] = chance.cpu().numpy()
        return chances

    return probe
