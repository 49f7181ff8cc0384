"""Sampling: which anchors to draw, from the sum trees of `lucid_replay.trees`.

A draw picks ``B`` episode rows in proportion to their leaves (the leaf law, in `trees`), and
in each a step uniformly among its eligible anchors. Both steps take a pair of float64
uniforms per draw from the buffer's generator: row ``i`` is the leaf of target
``u[i, 0] * total``, its step ``min(int(u[i, 1] * anchors), anchors - 1)``. The draw is
spelled twice, a screen apart: `draw_rows` (array code) and `draw_rows_loop` (compiled;
`draw_loop` also counts the draws and looks up their ids in the same pass). Under a reuse
limit (``max_times_sampled``) draws come in rounds that never exceed an episode's remaining
allowance (`AnchorSampler._draw_within_limit`).
"""

from __future__ import annotations

import numpy as np
import torch

from lucid_replay import engine, sum_tree
from lucid_replay.engine import Array
from lucid_replay.errors import (
    ReuseLimitError,
    empty_buffer,
    reuse_limit_reached,
    span_not_committed,
    span_too_long,
)
from lucid_replay.laws import Law
from lucid_replay.records import Anchors
from lucid_replay.table import EpisodeTable
from lucid_replay.trees import (
    UNIFORM_TREE,
    TreeKeys,
    Trees,
    anchors_in_rows,
    episode_anchors,
)

__all__: list[str] = []  # internal module


class AnchorSampler:
    """Draws anchors from the `Trees` kept in step with an `EpisodeTable`.

    Parameters
    ----------
    table
        The episode table the trees index.
    unit
        ``"chunk"`` or ``"episode"`` (see `lucid_replay.trees`).
    reuse_limit
        ``max_times_sampled``: an episode drawn this many times is retired (leaf 0 for good).
    """

    def __init__(self, table: EpisodeTable, unit: str, reuse_limit: int | None) -> None:
        self.table = table
        self.unit = unit
        self.reuse_limit = reuse_limit
        self.trees = Trees(table, unit, reuse_limit)
        self.episodes_retired = torch.zeros((), dtype=torch.int64, device=table.device)
        self._kept_uniforms: torch.Tensor | None = None  # see `uniforms`
        self._kept_array: Array = None

    def adopt(self, table: EpisodeTable, episodes_retired: int, trees: TreeKeys = ()) -> None:
        """Follow a restored ``table``; ``trees``: the saved trees' keys and scales."""
        self.table = table
        self.trees.adopt(table, trees)
        self.episodes_retired.fill_(episodes_retired)

    # ------------------------------------------------------------------------- drawing
    def checked_draw(
        self,
        batch_size: int,
        span: int,
        *,
        what: object,
        law: Law,
        generator: torch.Generator,
        extra: int = 0,
    ) -> Anchors:
        """`draw`, after refusing a table with nothing eligible (``str(what)`` names the span)."""
        if self.table.num_episodes == 0:
            raise empty_buffer()
        cached = self.trees.cached(span, law, extra)
        if cached.total() <= 0:
            raise self.nothing_eligible(span, what, batch_size, extra)
        return self._draw_from(cached, batch_size, (span, extra), law, generator)

    def draw(
        self,
        batch_size: int,
        span: int,
        *,
        law: Law,
        generator: torch.Generator,
        extra: int = 0,
    ) -> Anchors:
        """Draw ``batch_size`` anchors by ``law``, with replacement (O(B log E)).

        The caller checks ``trees.mass(span, law) > 0`` first. Under a reuse limit no episode is
        drawn more than its remaining allowance, also within this call; if the eligible
        episodes cannot supply ``batch_size`` draws, `ReuseLimitError` is raised, the
        generator is rewound and nothing changes. ``extra``: see `anchors_in_rows`.
        """
        cached = self.trees.cached(span, law, extra)
        return self._draw_from(cached, batch_size, (span, extra), law, generator)

    def _draw_from(
        self,
        cached: sum_tree.CachedTree,
        batch_size: int,
        need: tuple[int, int],
        law: Law,
        generator: torch.Generator,
    ) -> Anchors:
        """`draw` from ``cached``, the up-to-date tree for ``(span, extra, law)``.

        The anchors carry their probabilities: ``m / Z`` of their rows' masses ``m`` and
        the total ``Z`` of the tree they were drawn from (of their round, under a reuse
        limit), O(B).
        """
        column, owners = self.table.arrays, self.table.owners()
        total: float | Array = cached.array[1]  # the tree's total (no host synchronisation)
        if self.reuse_limit is None and engine.compiled(cached.array):  # one compiled call
            rows, steps, ids, drawn = draw_loop(
                cached.array,
                cached.levels,
                self.uniforms(batch_size, generator),
                column["length"],
                *need,
                self.owner_ids(),
                column["priority"] if law.by_priority else UNIFORM_TREE,
                *owners,
            )
            chances = law.probability(self.table, rows, cached.scale, total)
            return Anchors(rows, ids, steps, drawn if law.by_priority else None, None, chances)
        if self.reuse_limit is None:
            rows, steps = self.draw_tree_rows(cached, batch_size, need, generator)
            count_draws(owners.times, owners.slot[rows])
        else:
            drawn_rows, drawn_steps, totals = self._draw_within_limit(
                cached, batch_size, need, generator
            )
            self.count_draws_within_limit(drawn_rows)
            rows, steps, total = (engine.view(t) for t in (drawn_rows, drawn_steps, totals))
        chances = law.probability(self.table, rows, cached.scale, total)
        return self._anchors(rows, steps, law, chances)

    def owner_ids(self) -> Array:
        """Episode ids by directory slot (by row for whole episodes)."""
        directory = self.table.directory
        return (
            self.table.arrays["episode_id"] if directory is None else directory.arrays["episode_id"]
        )

    def draw_round(
        self,
        count: int,
        span: int,
        *,
        law: Law,
        generator: torch.Generator,
        extra: int = 0,
    ) -> tuple[Anchors, torch.Tensor]:
        """One round of a draw coordinated across several samplers.

        ``count`` draws from the current masses; the ones within the reuse limit are kept
        (and counted), none is redrawn. Returns the kept anchors, in draw order, and which
        of the ``count`` draws were kept (bool ``[count]``, on the CPU). Repeating rounds
        for the refused ones from the masses of the moment reproduces `draw` draw for draw
        (a refused draw exhausted its episode, which then has mass 0). The caller checks
        that the mass is positive.
        """
        cached = self.trees.cached(span, law, extra)
        rows, steps = self.draw_tree_rows(cached, count, (span, extra), generator)
        owners = self.table.owners()
        if self.reuse_limit is None:
            count_draws(owners.times, owners.slot[rows])
            return self._anchors(rows, steps, law), torch.ones(count, dtype=torch.bool)
        rows, steps = engine.tensor(rows), engine.tensor(steps)
        slots = engine.tensor(owners.slot)[rows]
        allowance = self.reuse_limit - engine.tensor(owners.times)[slots]
        keep = occurrence_rank(slots) < allowance
        rows, steps = rows[keep], steps[keep]
        self.count_draws_within_limit(rows)
        return self._anchors(engine.view(rows), engine.view(steps), law), keep.cpu()

    def _anchors(self, rows: Array, steps: Array, law: Law, chances: Array = None) -> Anchors:
        owners = self.table.owners()
        drawn = self.table.arrays["priority"][rows] if law.by_priority else None
        return Anchors(rows, self.owner_ids()[owners.slot[rows]], steps, drawn, None, chances)

    def count_draws_within_limit(self, rows: torch.Tensor) -> None:
        """Count the draws of ``rows``' episodes; those reaching the limit retire (leaf 0)."""
        assert self.reuse_limit is not None
        owners = self.table.owners()
        times = engine.tensor(owners.times)
        slots = engine.tensor(owners.slot)[rows]
        before = times[slots]
        times.index_add_(0, slots, torch.ones_like(slots))
        after = times[slots]
        retiring = (
            (before < self.reuse_limit) & (after >= self.reuse_limit) & _first_occurrence(slots)
        )
        self.episodes_retired += retiring.sum()
        self.trees.mark_dirty(rows)
        if self.table.segmented and bool(retiring.any()):  # every segment of theirs: leaf 0
            self.trees.mark_dirty(self.table.segment_rows(slots[retiring]))

    def draw_tree_rows(
        self,
        cached: sum_tree.CachedTree,
        count: int,
        need: tuple[int, int],
        generator: torch.Generator,
    ) -> tuple[Array, Array]:
        """``count`` rows by leaf mass and a uniform eligible step in each (`draw_rows`)."""
        uniforms = self.uniforms(count, generator)
        return draw_rows(cached, self.table, uniforms, need)

    def uniforms(self, count: int, generator: torch.Generator) -> Array:
        """``[count, 2]`` float64 uniforms from ``generator``, an `engine` array.

        Drawn into a tensor kept for the next draw of the same size (what ``torch.rand``
        would draw, without its allocation); valid until the next call.
        """
        kept = self._kept_uniforms
        if kept is None or kept.shape[0] != count or kept.device != generator.device:
            kept = torch.empty((count, 2), dtype=torch.float64, device=generator.device)
            self._kept_uniforms = kept
            self._kept_array = engine.view(kept.to(self.table.device))
        kept.uniform_(generator=generator)
        if kept.device != self.table.device:
            return engine.view(kept.to(self.table.device))
        return self._kept_array

    def _draw_within_limit(
        self,
        cached: sum_tree.CachedTree,
        batch_size: int,
        need: tuple[int, int],
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draw in rounds that never exceed an episode's remaining allowance.

        Each round keeps every episode's first draws up to its allowance, gives the episodes
        that used it up zero mass in ``tree`` and redraws the rest, so each redraw comes from
        the renormalised remaining mass, as sequential draws would. Every round but the last
        exhausts at least one episode. Returns the rows, the steps and the tree's total of
        the round that drew each (float64).
        """
        assert self.reuse_limit is not None
        saved_state = generator.get_state()
        device = self.table.device
        rows = torch.empty(0, dtype=torch.int64, device=device)
        steps = torch.empty(0, dtype=torch.int64, device=device)
        totals = torch.empty(0, dtype=torch.float64, device=device)
        exhausted: list[torch.Tensor] = []
        owners = self.table.owners()
        slot_of, times = engine.tensor(owners.slot), engine.tensor(owners.times)
        try:
            while rows.numel() < batch_size:
                total = cached.total()
                if total <= 0:
                    generator.set_state(saved_state)
                    raise self.reuse_limit_error(need[0], batch_size, need[1])
                drawn = self.draw_tree_rows(cached, batch_size - rows.numel(), need, generator)
                new_rows, new_steps = engine.tensor(drawn[0]), engine.tensor(drawn[1])
                every = torch.cat([rows, new_rows])
                slots = slot_of[every]  # the allowance is its episode's
                rank = occurrence_rank(slots)
                allowance = self.reuse_limit - times[slots]
                keep = (rank < allowance)[rows.numel() :]
                rows = torch.cat([rows, new_rows[keep]])
                steps = torch.cat([steps, new_steps[keep]])
                drawn_at = torch.full_like(new_steps, total, dtype=torch.float64)
                totals = torch.cat([totals, drawn_at[keep]])
                used_up = torch.unique(slots[rank + 1 == allowance])
                if self.table.segmented:
                    used_up = engine.tensor(self.table.segment_rows(used_up))
                zeros = torch.zeros_like(used_up, dtype=cached.nodes.dtype)
                sum_tree.assign_leaves(cached.nodes, used_up, zeros)
                exhausted.append(used_up)
        finally:
            for used_up in exhausted:  # temporary zeros; leaves are recomputed from the table
                self.trees.mark_dirty(used_up)
        return rows, steps, totals

    def draws_left(self, span: int, extra: int = 0) -> int | None:
        """Draws the reuse limit still allows to episodes with an eligible anchor (O(E)).

        ``None`` without a reuse limit.
        """
        if self.reuse_limit is None:
            return None
        slots, owners = self.table.stored_slots(), self.table.owners()
        eligible = episode_anchors(owners, slots, span, extra) > 0
        left = self.reuse_limit - owners.times[slots]
        return int((left * (left > 0) * eligible).sum())

    def nothing_eligible(
        self, span: int, what: object, batch_size: int, extra: int = 0
    ) -> Exception:
        """The error for a draw of ``span`` from a non-empty table with zero mass.

        ``what`` names the argument that set the span (``"length"``, ...).
        """
        slots, owners = self.table.stored_slots(), self.table.owners()
        stored = owners.total[slots] - owners.first_stored[slots]
        longest = int(stored.max())
        if longest < span:
            return span_too_long(str(what), span, longest)
        if not bool((episode_anchors(owners, slots, span, extra) > 0).any()):
            return span_not_committed(str(what), span + extra, longest)
        return self.reuse_limit_error(span, batch_size, extra)

    def reuse_limit_error(self, span: int, batch_size: int, extra: int = 0) -> ReuseLimitError:
        """The error for asking ``batch_size`` draws of ``span`` beyond the reuse limit."""
        return reuse_limit_reached(self.reuse_limit, self.draws_left(span, extra), batch_size)


def count_draws(times: Array, slots: Array) -> None:
    """``times[slots] += 1``, a repeated slot counted once per draw."""
    if engine.compiled(slots):
        count_draws_loop(times, slots)  # np.add.at costs ~10 us for 256 rows
    else:
        engine.add_at(times, slots, 1)


def draw_rows(
    cached: sum_tree.CachedTree, table: EpisodeTable, uniforms: Array, need: tuple[int, int]
) -> tuple[Array, Array]:
    """Rows by leaf mass and a uniform eligible step in each: the draw (`engine` arrays).

    Row ``i`` is the leaf of target ``uniforms[i, 0] * total`` of the tree ``cached``; its
    step is its first step plus ``min(int(uniforms[i, 1] * anchors), anchors - 1)`` for the
    ``anchors`` eligible ones it holds (`anchors_in_rows` of ``need = (span, extra)``).
    Steps are episode steps.
    """
    lengths, owners = table.arrays["length"], table.owners()
    if engine.compiled(uniforms):  # the same arithmetic, one compiled call
        return draw_rows_loop(cached.array, cached.levels, uniforms, lengths, *need, *owners)
    tree = cached.nodes
    rows = sum_tree.search(tree, uniforms[:, 0] * engine.view(sum_tree.total(tree)))
    anchors = anchors_in_rows(owners, lengths, rows, *need)
    steps = engine.minimum(engine.cast(uniforms[:, 1] * anchors, torch.int64), anchors - 1)
    return rows, owners.first_step[rows] + steps


@engine.jit
def draw_rows_loop(
    tree: np.ndarray,
    levels: int,
    uniforms: np.ndarray,
    lengths: np.ndarray,
    span: int,
    extra: int,
    slot: np.ndarray,
    first_step: np.ndarray,
    total: np.ndarray,
    opened: np.ndarray,
    first_stored: np.ndarray,
    times: np.ndarray,
    terminated: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """`draw_rows`, compiled (the same float64 operations in the same order).

    The rows' table entries, then their episodes', are fetched in loops of their own, each
    a loop of independent misses, before the loop that reads them: 256 draws from a swept
    table of 10M transitions in segments, 48 -> 38 us (76 us before `descend_loop` also
    fetched ahead).
    """
    rows = sum_tree.descend_loop(tree, uniforms[:, 0] * tree[1], levels)
    for i in range(rows.shape[0]):
        engine.prefetch_entry(slot, rows[i])
        engine.prefetch_entry(first_step, rows[i])
    for i in range(rows.shape[0]):
        owner = slot[rows[i]]
        engine.prefetch_entry(total, owner)
        engine.prefetch_entry(opened, owner)
    steps = np.empty(rows.shape[0], dtype=np.int64)
    for i in range(rows.shape[0]):
        row = rows[i]
        owner = slot[row]
        need = span + extra * opened[owner]
        anchors = min(max(total[owner] - first_step[row] - (need - 1), 0), lengths[row])
        steps[i] = first_step[row] + min(np.int64(uniforms[i, 1] * anchors), anchors - 1)
    return rows, steps


@engine.jit
def count_draws_loop(times: np.ndarray, slots: np.ndarray) -> None:
    """`count_draws`, compiled: ``times[slots] += 1``, a repeated slot once per occurrence."""
    for i in range(slots.shape[0]):
        times[slots[i]] += 1


@engine.jit
def draw_loop(
    tree: np.ndarray,
    levels: int,
    uniforms: np.ndarray,
    lengths: np.ndarray,
    span: int,
    extra: int,
    episode_id: np.ndarray,
    priority: np.ndarray,
    slot: np.ndarray,
    first_step: np.ndarray,
    total: np.ndarray,
    opened: np.ndarray,
    first_stored: np.ndarray,
    times: np.ndarray,
    terminated: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`AnchorSampler._draw_from` without a reuse limit, compiled: draw, count, look up.

    ``episode_id`` is by directory slot, ``priority`` by row; the arrays after it are the
    table's `Owners`. Returns the rows, episode steps, episode ids and (if ``priority``
    has rows: a prioritized draw) priorities of the draws.
    """
    rows, steps = draw_rows_loop(
        tree,
        levels,
        uniforms,
        lengths,
        span,
        extra,
        slot,
        first_step,
        total,
        opened,
        first_stored,
        times,
        terminated,
    )
    ids = np.empty(rows.shape[0], dtype=np.int64)
    drawn = np.empty(rows.shape[0] if priority.shape[0] else 0, dtype=np.float64)
    for i in range(rows.shape[0]):
        owner = slot[rows[i]]
        times[owner] += 1
        ids[i] = episode_id[owner]
        if drawn.shape[0]:
            drawn[i] = priority[rows[i]]
    return rows, steps, ids, drawn


def occurrence_rank(values: torch.Tensor) -> torch.Tensor:
    """For each element, how many equal elements precede it (vectorised, stable)."""
    order = torch.argsort(values, stable=True)
    ordered = values[order]
    position = torch.arange(values.numel(), device=values.device)
    starts_group = torch.ones_like(ordered, dtype=torch.bool)
    starts_group[1:] = ordered[1:] != ordered[:-1]
    group_start = torch.where(starts_group, position, 0).cummax(dim=0).values
    rank = torch.empty_like(position)
    rank[order] = position - group_start
    return rank


def _first_occurrence(values: torch.Tensor) -> torch.Tensor:
    """Bool mask: the element is the first of its value."""
    return occurrence_rank(values) == 0
