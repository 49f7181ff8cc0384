"""`ReplayCore`: a buffer's state and its data path, behind validation and the lock.

The public buffers (`lucid_replay.replay`, `lucid_replay.prioritized`) check every argument,
take their lock, and call one method here. Each method reads as the data path it runs::

    batch = batcher.reserve(...)  # memory first (see batching.new_batch)
    anchors = draw(batch_size, window, law)  # sampling: which anchors, by which law
    records = expand(table, anchors, window, into=...)  # window: what each expands to
    batcher.fill_windows(batch, ring, table, anchors, records, window)  # the gather

Shards of a distributed replay draw through `draw_round`, which runs the same stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lucid_replay import checkpoint, engine, mixture_draws, snapshot_checks
from lucid_replay.allocators import Allocator
from lucid_replay.batch import Batch, PrioritizedBatch, WindowBatch
from lucid_replay.batching import Batcher
from lucid_replay.blocks import CACHE_BYTES
from lucid_replay.engine import Array
from lucid_replay.episode import Episode
from lucid_replay.errors import CheckpointError
from lucid_replay.laws import Law, Uniform
from lucid_replay.mixtures import Mixture
from lucid_replay.priorities import Priorities
from lucid_replay.records import Anchors
from lucid_replay.sampling import AnchorSampler
from lucid_replay.schema import Schema
from lucid_replay.store import EpisodeStore
from lucid_replay.window import Window, expand
from lucid_replay.without_replacement import draw_distinct

__all__: list[str] = []  # internal module


class _SpanName:
    """Names the argument that set a window's anchor span, in a refusal (built lazily)."""

    def __init__(self, window: Window) -> None:
        self.window = window

    def __str__(self) -> str:
        window = self.window
        return "length" if window == Window(window.length) else "the window's anchor span"


def _extra(window: Window) -> int:
    """Steps beyond ``window.anchor_span`` an anchor of an open episode needs."""
    return window.open_anchor_span - window.anchor_span


class ReplayCore:
    """Stored episodes, the sampler over them, the random stream, and priorities (or None).

    ``law`` is the buffer's selector (set by the buffer; `Uniform` until then); the draws
    take a law each (`lucid_replay.laws.checked_flag` maps the public flags).
    Methods assume validated arguments and a held lock.
    """

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        unit: str,
        reuse_limit: int | None,
        generator: torch.Generator,
        schema: Schema | None = None,
        *,
        segment_length: int | None = None,
        priority_unit: str = "episode",
        allocator: Allocator,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.store = EpisodeStore(
            capacity,
            device,
            reuse_limit,
            schema,
            segment_length=segment_length,
            priority_unit=priority_unit,
            unit=unit,
            allocator=allocator,
            cache_bytes=cache_bytes,
        )
        self.sampler = AnchorSampler(self.store.table, unit, reuse_limit)
        self.store.on_change = self.sampler.trees.mark_dirty
        if self.store.segments is not None:
            self.store.segments.need_of_trees = self.sampler.trees.max_need
        self.generator = generator
        self.priorities: Priorities | None = None
        self.law: Law | Mixture = Uniform()
        self.chunks_sampled = 0
        self.epoch_skipped = 0  # anchors epochs skipped (evicted); not in checkpoints
        self.batcher = Batcher()

    def prioritize(self, priorities: Priorities) -> None:
        """Keep ``priorities`` (the buffer's ``law`` is set apart: its selector)."""
        self.priorities = priorities

    # ---------------------------------------------------------------------------- adding
    def add(self, episode: Episode, schema: Schema) -> int:
        """Store a checked episode at the largest priority ever set (1 without priorities)."""
        return self.store.add(episode, schema, self.max_priority)

    def max_priority(self) -> float:
        """What a new episode (or segment) gets: the largest priority ever set, else 1."""
        return 1.0 if self.priorities is None else self.priorities.max_priority

    @property
    def priority_unit(self) -> str | None:
        """``"episode"`` or ``"segment"`` on a segmented buffer, else ``None``."""
        segments = self.store.segments
        return None if segments is None else segments.priority_unit

    # --------------------------------------------------------------------------- drawing
    def draw(
        self,
        batch_size: int,
        window: Window,
        law: Law | Mixture,
        weights: bool = False,
        replacement: bool = True,
    ) -> Anchors:
        """Draw fitting anchors (distinct unless ``replacement``), weighted if ``weights``."""
        span, extra = window.anchor_span, _extra(window)
        generator, what, sampler = self.generator, _SpanName(window), self.sampler
        if not replacement:  # a single law or a mixture: successive sampling
            anchors = draw_distinct(
                sampler, batch_size, span, what=what, law=law, generator=generator, extra=extra
            )
        elif isinstance(law, Mixture):  # no tree of its own: from its components' trees
            anchors = mixture_draws.draw(
                sampler, law, batch_size, span, what=what, generator=generator, extra=extra
            )
        else:
            anchors = sampler.checked_draw(
                batch_size, span, what=what, law=law, generator=generator, extra=extra
            )
        if weights:
            assert self.priorities is not None  # only a prioritized buffer's draws have them
            drawn = self.priorities.weights(law, anchors, lambda: anchors.probabilities)
            a = anchors  # the same anchors, with weights
            anchors = Anchors(a.rows, a.episode_ids, a.steps, a.priorities, drawn, a.probabilities)
        self.chunks_sampled += batch_size
        return anchors

    def probability(self, anchors: Anchors, span: int, law: Law, extra: int = 0) -> Array:
        """float64 `Law.probability` of ``anchors`` in the tree of ``(span, law)`` now."""
        cached = self.sampler.trees.cached(span, law, extra)
        return law.probability(self.store.table, anchors.rows, cached.scale, cached.total())

    def log_mass(self, window: Window, law: Law) -> float:
        """``log`` of the total mass a draw of ``window`` chooses from (``-inf``: none)."""
        return self.sampler.trees.log_mass(window.anchor_span, law, _extra(window))

    def chunks(
        self,
        batch_size: int,
        length: int,
        target: torch.device,
        law: Law | Mixture,
        out: Batch | None = None,
        weights: bool = False,
        replacement: bool = True,
    ) -> Batch:
        """Draw chunks of ``length`` steps by ``law`` onto ``target`` (into ``out``, if given).

        ``weights``: a `PrioritizedBatch` with importance weights, else a `Batch`;
        ``replacement``: see `draw`.
        """
        kind = PrioritizedBatch if weights else Batch
        shape = (batch_size, length)
        out = self.batcher.reserve(
            kind,
            shape,
            self.store.schema,
            target,
            weights=weights,
            out=out,
            segments=self.priority_unit,
        )
        anchors = self.draw(batch_size, Window(length), law, weights, replacement)
        assert out is not None  # the draw refused an empty buffer (no schema yet)
        batch = self.batcher.fill_chunks(out, self.store.ring, self.store.table, anchors, length)
        self.store.reclaim_retired()  # only once the batch no longer needs their rows
        return batch

    def windows(
        self,
        batch_size: int,
        window: Window,
        target: torch.device,
        law: Law | Mixture,
        out: WindowBatch | None = None,
        *,
        weights: bool = False,
        replacement: bool = True,
    ) -> WindowBatch:
        """Draw anchors by ``law`` and expand each into ``window`` onto ``target`` (or ``out``).

        ``weights``: the batch carries importance weights. ``replacement``: see `draw`.
        """
        out = self._reserve(batch_size, window, target, weights, out)
        anchors = self.draw(batch_size, window, law, weights, replacement)  # sampling
        batch = self.assemble(anchors, window, target, out)  # window, then batch
        self.store.reclaim_retired()  # only once the batch no longer needs their rows
        return batch

    def assemble(
        self,
        anchors: Anchors,
        window: Window,
        target: torch.device,
        out: WindowBatch | None = None,
    ) -> WindowBatch:
        """The `WindowBatch` of stored ``anchors`` expanded into ``window``, on ``target``."""
        size, drawn = int(anchors.rows.shape[0]), anchors.probabilities is not None
        out = self._reserve(size, window, target, anchors.weights is not None, out, drawn)
        assert out is not None  # anchors are stored steps: there is a schema
        table = self.store.table
        records = expand(table, anchors, window, into=self.batcher.record_arrays(out, table.device))
        return self.batcher.fill_windows(out, self.store.ring, table, anchors, records, window)

    def _reserve(
        self,
        batch_size: int,
        window: Window,
        target: torch.device,
        weights: bool,
        out: WindowBatch | None,
        drawn: bool = True,
    ) -> WindowBatch | None:
        shape, schema = (batch_size, window.size), self.store.schema
        return self.batcher.reserve(
            WindowBatch,
            shape,
            schema,
            target,
            weights=weights,
            out=out,
            segments=self.priority_unit,
            drawn=drawn,
        )

    def draw_round(
        self,
        count: int,
        window: Window,
        target: torch.device,
        law: Law,
        *,
        chunks: bool,
        probe: Callable[[Array], Any] | None = None,
        locate: Callable[[Anchors], Any] | None = None,
    ) -> tuple[Any, Array, torch.Tensor, Any]:
        """One round of a draw coordinated across several buffers (see `AnchorSampler.draw_round`).

        ``count`` draws of ``window`` (or of chunks of ``window.length`` steps), the ones the
        reuse limit refuses dropped without a redraw. Returns the batch of the kept draws
        (no weights: the coordinator computes them over the merged batch), their priorities
        (an `engine` array, ``None`` unless ``law`` is by priority) and which of the draws
        were kept (bool ``[count]``, on the CPU), and what ``probe`` returns of the kept
        rows (called before retired rows are reclaimed; ``None`` without one). ``locate``
        (windows only): what it returns of the kept anchors replaces the batch (a located
        draw: the records are gathered elsewhere). The caller checks that the mass is
        positive.
        """
        anchors, kept = self.sampler.draw_round(
            count,
            window.anchor_span,
            law=law,
            generator=self.generator,
            extra=_extra(window),
        )
        probed = None if probe is None else probe(anchors.rows)
        drawn = int(anchors.steps.shape[0])
        self.chunks_sampled += drawn
        batch: Any
        if chunks:
            shape, schema = (drawn, window.length), self.store.schema
            out = self.batcher.reserve(
                Batch,
                shape,
                schema,
                target,
                weights=False,
                segments=self.priority_unit,
                drawn=False,  # the coordinator's draw: no probabilities of one shard's
            )
            assert out is not None  # a positive mass means stored episodes
            store = self.store
            batch = self.batcher.fill_chunks(out, store.ring, store.table, anchors, window.length)
        elif locate is not None:
            batch = locate(anchors)
        else:
            batch = self.assemble(anchors, window, target)
        self.store.reclaim_retired()
        return batch, anchors.priorities, kept, probed

    def num_eligible(self, window: Window) -> int:
        """Anchors (or episodes) a uniform draw of ``window`` chooses from now."""
        return round(self.sampler.trees.mass(window.anchor_span, Uniform(), _extra(window)))

    # ------------------------------------------------------------------------ priorities
    def apply_priorities(self, ids: torch.Tensor, priorities: torch.Tensor) -> tuple[int, float]:
        """Set ``priorities`` of issued ``ids`` (checked); skip evicted ids.

        Duplicates keep their largest priority. Returns how many distinct ids were applied
        and the largest priority set (``-inf`` if none).
        """
        assert self.priorities is not None  # only prioritized buffers call this
        table = self.store.table
        if self.priority_unit == "episode":  # ids are episodes: every segment of theirs
            assert self.store.segments is not None
            rows, applied, largest = self.store.segments.assign_priorities(ids, priorities)
        else:
            rows, applied, largest = table.assign_priorities(
                engine.view(ids), engine.view(priorities)
            )
        if applied:
            self.priorities.raise_max(largest)
            self.sampler.trees.mark_priorities_dirty(engine.tensor(rows))
        return applied, largest

    def first_unissued(self, ids: torch.Tensor) -> int:
        """Position of the first id in ``ids`` this buffer never issued, else -1.

        Episode ids, or segment ids under ``priority_unit="segment"``.
        """
        if self.priority_unit == "episode":
            assert self.store.segments is not None
            issued = self.store.segments.directory.next_episode_id
            bad = (ids < 0) | (ids >= issued)
            return int(bad.nonzero()[0]) if bool(bad.any()) else -1
        return self.store.table.first_unissued(engine.view(ids))

    def issued_ids(self) -> int:
        """How many ids of the priority unit were issued (for messages)."""
        if self.priority_unit == "episode":
            assert self.store.segments is not None
            return self.store.segments.directory.next_episode_id
        return self.store.table.next_id

    def stored_priorities(self) -> torch.Tensor:
        """float64: stored episodes' priorities, oldest first.

        On a buffer with ``priority_unit="segment"``: the stored segments', in id order.
        """
        segments = self.store.segments
        if segments is not None and segments.priority_unit == "episode":
            return segments.stored_priorities()
        table = self.store.table
        priorities: torch.Tensor = table.priority[table.stored_rows()]
        return priorities

    # -------------------------------------------------------------------------- reporting
    def stats(self) -> dict[str, int]:
        """The buffer's counters (see `SequenceReplay.stats`)."""
        store = self.store
        return {
            **store.counts,
            "chunks_sampled": self.chunks_sampled,
            "epoch_skipped": self.epoch_skipped,
            "episodes_evicted_unsampled": int(store.evicted_unsampled),
            "episodes_retired": int(self.sampler.episodes_retired),
            "episodes_stored": store.table.num_episodes,
            "transitions_stored": store.table.num_transitions,
            **({} if store.segments is None else store.segments.counts()),
        }

    # ----------------------------------------------------------------------- persistence
    def snapshot(self, class_name: str, config: dict[str, Any]) -> checkpoint.Snapshot:
        """What a checkpoint of this state holds (shared, not copied: pack it at once)."""
        store = self.store
        return checkpoint.Snapshot(
            class_name=class_name,
            config=config,
            schema=store.schema,
            table=store.table,
            ring=store.ring,
            counts={**store.counts, "chunks_sampled": self.chunks_sampled},
            evicted_unsampled=int(store.evicted_unsampled),
            episodes_retired=int(self.sampler.episodes_retired),
            rng=self.generator.get_state(),
            extra={} if self.priorities is None else self.priorities.state(),
            trees=self.sampler.trees.state(),
        )

    def restore(self, snapshot: checkpoint.Snapshot, config: dict[str, Any]) -> None:
        """Check ``snapshot`` against this state's ``config``, then adopt it whole."""
        device = self.store.table.device
        if snapshot.table.segmented != (self.store.segments is not None):
            raise CheckpointError(
                "checkpoint table must have segment rows exactly when segment_length is set, "
                f"got segment rows: {snapshot.table.segmented}"
            )
        snapshot_checks.check_adoptable(
            snapshot,
            config,
            reuse_limit=self.sampler.reuse_limit,
            prioritized=self.priorities is not None,
            device=device,
        )
        priorities = None
        if self.priorities is not None:
            table = snapshot.table
            stored = table.priority[table.stored_rows()]
            priorities = self.priorities.with_state(snapshot.extra, stored)
        # Nothing below can fail on a checked snapshot: commit.
        self.store.adopt(snapshot)
        self.sampler.adopt(snapshot.table, snapshot.episodes_retired, snapshot.trees)
        self.chunks_sampled = snapshot.counts["chunks_sampled"]
        self.generator.set_state(snapshot.rng)
        self.priorities = priorities
