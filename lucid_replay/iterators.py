"""Iterators of batches: `iterate` (prefetched draws) and `epoch` (passes over the anchors).

An epoch yields every anchor eligible when it starts, once each, in uniformly random order:
a pass over the data, as offline RL (and supervised learning on a fixed data set) reads it,
rather than a draw by a law. `SequenceReplay.epoch` snapshots the eligible anchors when it
is called: for each table row holding eligible anchors (``unit="episode"``: for each
eligible episode), its episode id, its first eligible step and how many follow, then a
uniformly random permutation of the ``N`` positions from the buffer's generator. Memory is
O(E) for the rows plus the permutation, O(N): an anchor costs 8 bytes. Each batch maps its
positions back to ``(episode id, step)`` by a search over the rows' cumulative counts
(O(B log E)), drops the anchors no longer stored and expands the rest as
`SequenceReplay.gather_windows` would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from lucid_replay import engine
from lucid_replay.batch import WindowBatch
from lucid_replay.checks import check_batch_size, check_device, check_prefetch
from lucid_replay.core import ReplayCore, _SpanName
from lucid_replay.errors import empty_buffer, wrong_type
from lucid_replay.prefetch import Prefetcher, recycling
from lucid_replay.records import Anchors
from lucid_replay.trees import episode_anchors
from lucid_replay.window import Window, check_window
from lucid_replay.without_replacement import checked_replacement

__all__: list[str] = []  # internal module (the methods are `SequenceReplay`'s)


class Iterators:
    """The iterating methods of `SequenceReplay`: `iterate` and `epoch` (documented there)."""

    _lock: Any
    _core: ReplayCore
    _device: torch.device

    if TYPE_CHECKING:

        def sample_windows(
            self,
            batch_size: int,
            window: Window,
            *,
            prioritized: bool | None = None,
            device: torch.device | str | None = None,
            out: WindowBatch | None = None,
            replacement: bool = True,
        ) -> WindowBatch: ...

    def _target(self, device: object) -> torch.device:
        return self._device if device is None else check_device("device", device)

    def iterate(
        self,
        batch_size: int,
        window: Window,
        *,
        prefetch: int = 2,
        device: torch.device | str | None = None,
        recycle: bool = False,
        replacement: bool = True,
    ) -> Iterator[WindowBatch]:
        """Yield `sample_windows` batches prepared by a background thread, endlessly.

        Up to ``prefetch`` batches wait ready; each was drawn with the priorities of the
        moment it was drawn, so updates made meanwhile reach batches drawn after them.
        Prefetched batches are drawn when they are prepared, so they count towards
        max_times_sampled (and ``chunks_sampled``) even if the loop never consumes them.
        Closing the iterator (``close()``, or leaving a ``for`` loop or ``with`` block) stops
        and joins the thread; an iterator that is merely dropped stops its thread without
        waiting for it.

        ``recycle=True`` draws into a ring of ``prefetch + 2`` batches instead of allocating
        one per draw: a yielded batch then stays valid only until the iterator's next
        ``next()`` returns (copy what you keep longer); after that its memory receives a
        later draw. Without it (the default) every batch owns its memory. ``replacement``:
        as `sample_windows` (for each batch).
        """
        check_batch_size(batch_size)
        check_prefetch(prefetch)
        check_window(window, segmented=self._core.store.segments is not None)
        if not isinstance(recycle, bool):
            raise wrong_type("recycle", "a bool", recycle)
        target, asked = self._target(device), checked_replacement(replacement)

        def draw(out: WindowBatch | None = None) -> WindowBatch:
            return self.sample_windows(
                batch_size, window, device=target, out=out, replacement=asked
            )

        return Prefetcher(recycling(draw, prefetch + 2) if recycle else draw, prefetch)

    def epoch(
        self,
        batch_size: int,
        window: Window,
        *,
        drop_last: bool = False,
        device: torch.device | str | None = None,
    ) -> Iterator[WindowBatch]:
        r"""Batches of every anchor eligible now, each once, in uniformly random order.

        For offline RL (a fixed data set read in passes): ``unit="chunk"`` yields every
        anchor `num_eligible` counts (its eligible anchors, as `Window` and segmented
        buffers' open episodes define them), ``unit="episode"`` every eligible episode once,
        at an anchor drawn uniformly among its eligible ones when the epoch starts. The
        order is a uniformly random permutation from the buffer's generator (``seed=``
        makes epochs reproducible; the generator advances once per epoch, when it starts).

        The anchors are fixed when this is called: episodes added later join the next
        epoch; an anchor evicted before its batch is skipped (and counted in
        ``stats()["epoch_skipped"]``), and batches are filled up from the anchors after
        it, so every batch has ``batch_size`` windows but the last, which has the rest
        (``drop_last=True``: dropped). Retired episodes (``max_times_sampled``) are not
        eligible; an epoch is no draw: its batches count neither towards the reuse limit
        nor ``chunks_sampled``.

        Each batch's ``probabilities`` are $1/N$ for the ``N`` anchors (episodes) of the
        epoch, each position of a uniform order holding a given anchor with that
        probability; its ``weights`` are 1 on a `PrioritizedSequenceReplay` (as a
        `Uniform` selector's) and ``None`` otherwise.

        Parameters
        ----------
        batch_size
            Windows per batch (``>= 1``).
        window
            What each anchor expands to, and which anchors are eligible.
        drop_last
            Drop the final batch when it has fewer than ``batch_size`` windows.
        device
            Where batches go (default: the storage's device).

        Returns
        -------
        Iterator[WindowBatch]
            Each ``next`` takes the buffer's lock and gathers one batch, so adds and draws
            may run between batches.

        Raises
        ------
        InvalidArgumentError
            If the buffer is empty or nothing is eligible for ``window`` (as
            `sample_windows`), or ``batch_size`` is below 1.
        InvalidTypeError
            If ``batch_size`` is not an int or ``drop_last`` not a bool.

        Examples
        --------
        >>> import torch
        >>> from lucid_replay import Episode, SequenceReplay, Window
        >>> buffer = SequenceReplay(100, seed=0)
        >>> buffer.extend(Episode({"obs": torch.arange(n)}) for n in (3, 5))
        [0, 1]
        >>> batches = list(buffer.epoch(4, Window(2)))  # 2 + 4 anchors
        >>> [len(b.episode_ids) for b in batches]
        [4, 2]
        >>> sorted(
        ...     zip(
        ...         *(
        ...             torch.cat([getattr(b, n) for b in batches]).tolist()
        ...             for n in ("episode_ids", "anchor_steps")
        ...         )
        ...     )
        ... )
        [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)]
        """
        check_batch_size(batch_size)
        check_window(window, segmented=self._core.store.segments is not None)
        if not isinstance(drop_last, bool):
            raise wrong_type("drop_last", "a bool", drop_last)
        target = self._target(device)
        with self._lock:
            plan = _plan(self._core, batch_size, window)
        return _epoch(self, plan, batch_size, window, target, drop_last)


class _Plan:
    """An epoch's anchors and their order.

    Runs of ``counts`` steps from ``firsts`` of episodes ``ids`` (tensors by run, ``ends``
    their cumulative counts), and the ``order`` of the positions.
    """

    def __init__(self, ids: torch.Tensor, firsts: torch.Tensor, counts: torch.Tensor) -> None:
        self.ids, self.firsts, self.counts = ids, firsts, counts
        self.ends = torch.cumsum(counts, 0)
        self.size = int(self.ends[-1]) if counts.numel() else 0
        self.order = torch.empty(0, dtype=torch.int64, device=ids.device)

    def anchors(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The episode ids and steps at epoch ``positions`` (O(k log E))."""
        runs = torch.searchsorted(self.ends, positions, right=True)
        before = self.ends[runs] - self.counts[runs]
        return self.ids[runs], self.firsts[runs] + (positions - before)


def _plan(core: ReplayCore, batch_size: int, window: Window) -> _Plan:
    """The anchors eligible now and their random order (vectorised, O(E + N))."""
    sampler, table = core.sampler, core.store.table
    if table.num_episodes == 0:
        raise empty_buffer()
    span, extra = window.anchor_span, window.open_anchor_span - window.anchor_span
    extra = extra if table.segmented else 0
    owners, device = table.owners(), table.device
    episode_ids = engine.tensor(sampler.owner_ids())
    generator = core.generator
    if sampler.unit == "chunk":
        rows = torch.arange(table.row_count, device=device)
        counts = engine.tensor(sampler.trees.unit_masses(engine.view(rows), span, extra))
        rows = rows[counts > 0]
        counts = counts[rows].to(torch.int64)
        ids = episode_ids[engine.tensor(owners.slot)[rows]]
        plan = _Plan(ids, engine.tensor(owners.first_step)[rows], counts)
    else:
        slots = engine.tensor(table.stored_slots())
        counts = engine.tensor(episode_anchors(owners, engine.view(slots), span, extra))
        live = counts > 0
        if sampler.reuse_limit is not None:
            live &= engine.tensor(owners.times)[slots] < sampler.reuse_limit
        slots, counts = slots[live], counts[live]
        uniforms = torch.rand(
            slots.numel(), dtype=torch.float64, generator=generator, device=generator.device
        )
        offsets = torch.minimum((uniforms.to(device) * counts).to(torch.int64), counts - 1)
        firsts = engine.tensor(owners.first_stored)[slots] + offsets
        plan = _Plan(episode_ids[slots], firsts, torch.ones_like(counts))
    if plan.size == 0:
        raise sampler.nothing_eligible(span, _SpanName(window), batch_size, extra)
    plan.order = torch.randperm(plan.size, generator=generator, device=generator.device)
    plan.order = plan.order.to(device)
    return plan


def _epoch(
    buffer: Iterators,
    plan: _Plan,
    batch_size: int,
    window: Window,
    target: torch.device,
    drop_last: bool,
) -> Iterator[WindowBatch]:
    """Yield the batches of ``plan`` (see `SequenceReplay.epoch`)."""
    cursor, probability = 0, 1.0 / plan.size
    while cursor < plan.size:
        with buffer._lock:
            core = buffer._core
            ids, steps, cursor = _next_stored(core, plan, cursor, batch_size)
            if ids.numel() == 0 or (drop_last and ids.numel() < batch_size):
                return
            anchors = core.store.anchors(ids, steps)
            size = int(ids.numel())
            chances = torch.full((size,), probability, dtype=torch.float64, device=ids.device)
            weights = None
            if core.priorities is not None:  # a prioritized buffer's batches have weights
                weights = engine.view(torch.ones(size, dtype=torch.float32, device=ids.device))
            a = anchors
            anchors = Anchors(a.rows, a.episode_ids, a.steps, None, weights, engine.view(chances))
            batch = core.assemble(anchors, window, target)
        yield batch


def _next_stored(
    core: ReplayCore, plan: _Plan, cursor: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Up to ``batch_size`` anchors of ``plan`` from ``cursor`` on that are still stored.

    Skipped ones are counted in ``core.epoch_skipped``. Returns their ids, steps and the
    cursor after them.
    """
    kept_ids, kept_steps, kept = [], [], 0
    while kept < batch_size and cursor < plan.size:
        positions = plan.order[cursor : cursor + batch_size - kept]
        cursor += int(positions.numel())
        ids, steps = plan.anchors(positions)
        stored = _stored(core, ids, steps)
        core.epoch_skipped += int(positions.numel() - stored.sum())
        kept_ids.append(ids[stored])
        kept_steps.append(steps[stored])
        kept += int(stored.sum())
    return torch.cat(kept_ids), torch.cat(kept_steps), cursor


def _stored(core: ReplayCore, ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Bool: which anchors ``(ids, steps)`` are stored steps now.

    An evicted or reused row's are not: ids are never reused.
    """
    segments = core.store.segments
    if segments is None:
        return torch.as_tensor(engine.tensor(core.store.table.is_stored(engine.view(ids))))
    everything = torch.ones_like(ids, dtype=torch.bool)
    return segments.stored_records(ids, steps, everything)[0]
