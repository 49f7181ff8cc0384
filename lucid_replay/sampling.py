"""Sampling: which anchors to draw. One sum tree per (span, alpha) over episode rows.

An *anchor* is ``(episode, step)``. For a learning region spanning ``span`` steps, the eligible
anchors of an episode of length ``T`` are its steps ``0 .. T - span`` (``max(T - span + 1, 0)``
of them). The sampler draws an episode row from a sum tree whose leaf for each stored episode is

* ``unit="chunk"``:   ``n_e * m_e`` (every eligible anchor equally likely, times its weight),
* ``unit="episode"``: ``[n_e > 0] * m_e`` (every episode with an eligible anchor equally likely),

where ``m_e = (p_e / s) ** alpha`` for a prioritized draw (alpha a float) and 1 for a uniform one
(alpha ``None``), and then a step uniformly among the episode's eligible anchors. The scale
``s`` is the largest priority among the eligible episodes when the tree was built: it cancels
in every probability, and keeps ``m_e <= 1`` so that no finite priority overflows float64 or
underflows all masses to zero. A tree whose total drifts out of ``[2**-700, 2**700]`` (its
priorities moved by hundreds of orders of magnitude) is rebuilt with a new scale. Retired
episodes (reuse limit reached) and evicted rows have leaf 0. The trees are caches of the
episode table: writers mark rows dirty, and the next draw recomputes exactly those leaves
(O(k log E)), so ``add`` stays O(1).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import attrs
import numpy as np
import torch

from lucid_replay import arrays, kernels, sum_tree
from lucid_replay.arrays import Array
from lucid_replay.errors import ReuseLimitError, must, must_have
from lucid_replay.table import EpisodeTable

__all__: list[str] = []  # internal module

_MAX_TREES = 8  # distinct spans kept at once; the least recently used tree is dropped beyond
_TOTAL_RANGE = (2.0**-700, 2.0**700)  # leaves <= n_e <= 2**62 each after a rescale
_NO_VALUES = np.empty(0, dtype=np.float64)  # a kernel's optional input, absent (uniform)


def eligible_anchors(lengths: Array, span: int) -> Array:
    """Number of anchors whose ``span``-step learning region fits in an episode, elementwise."""
    anchors = lengths - (span - 1)
    return anchors * (anchors > 0)  # max(anchors, 0) as numpy and torch both spell it


@attrs.frozen(eq=False)
class Anchors:
    """Drawn anchors: table rows, episode ids and steps (int64 ``[B]``).

    ``priorities`` (float64 ``[B]``) are the drawn episodes' priorities for a prioritized
    draw, from which the caller computes importance weights over the whole batch; ``None``
    for a uniform draw. ``weights`` (float32 ``[B]``) are those weights once computed. All
    are arrays of the `arrays` engine (numpy on CPU): the stages of a draw pass them on
    without a conversion to tensors and back.
    """

    rows: Array
    episode_ids: Array
    steps: Array
    priorities: Array = None
    weights: Array = None


class AnchorSampler:
    """Draws anchors from sum trees kept in step with an `EpisodeTable`.

    Parameters
    ----------
    table
        The episode table the trees index (rows ``id & (slots - 1)``).
    unit
        ``"chunk"`` or ``"episode"`` (see the module docstring).
    reuse_limit
        ``max_times_sampled``: an episode drawn this many times gets leaf 0 for good.
    """

    def __init__(self, table: EpisodeTable, unit: str, reuse_limit: int | None) -> None:
        self.table = table
        self.unit = unit
        self.reuse_limit = reuse_limit
        self.episodes_retired = torch.zeros((), dtype=torch.int64, device=table.device)
        self._trees: OrderedDict[tuple[int, float | None], sum_tree.CachedTree] = OrderedDict()
        self._generation = table.generation
        self._kept_uniforms: torch.Tensor | None = None  # see `_uniforms`
        self._kept_engine: Array = None

    # ------------------------------------------------------------------------ the cache
    def mark_dirty(self, rows: int | torch.Tensor) -> None:
        """Note that the leaves of ``rows`` must be recomputed before their next draw."""
        for tree in self._trees.values():
            tree.note(rows, self.table.row_count)

    def mark_priorities_dirty(self, rows: torch.Tensor) -> None:
        """Note that only the priorities of ``rows`` changed (uniform trees stay exact)."""
        for (_, alpha), tree in self._trees.items():
            if alpha is not None:
                tree.note(rows, self.table.row_count)

    def tree_bytes(self) -> int:
        """Memory held by the cached trees (for reporting)."""
        return sum(t.nodes.numel() * t.nodes.element_size() for t in self._trees.values())

    def adopt(self, table: EpisodeTable, episodes_retired: int) -> None:
        """Follow a restored ``table`` (its trees are rebuilt on their next draw)."""
        self.table = table
        self.invalidate()
        self.episodes_retired.fill_(episodes_retired)

    def invalidate(self) -> None:
        """Forget every tree (after the table was reshaped or reloaded)."""
        self._trees.clear()
        self._generation = self.table.generation

    def leaf_values(self, rows: Array, span: int, alpha: float | None, scale: float) -> Array:
        """The leaf mass of table ``rows`` in the tree for ``(span, alpha)`` at ``scale``.

        ``rows`` and the result are of the table's `EpisodeTable.arrays` engine; the mass is an
        integer, bool or float64 array, exact when stored in the float64 tree.
        """
        column = self.table.arrays
        live = self.table.is_stored(column["episode_id"][rows])
        if self.reuse_limit is not None:
            live = live & (column["times_sampled"][rows] < self.reuse_limit)
        count = eligible_anchors(column["length"][rows], span)
        mass = count if self.unit == "chunk" else count > 0
        if alpha is None:
            return mass * live
        # An overflow to inf makes `_cached` rescale; rows that are not drawable (dead, or
        # without an eligible anchor: 0 * inf) are zeroed by the mask.
        with np.errstate(over="ignore", invalid="ignore"):
            mass = mass * self._powered(rows, alpha, scale)
        return arrays.where(live & (count > 0), mass, 0.0)

    def _powered(self, rows: Array, alpha: float, scale: float) -> Array:
        """``(p / scale) ** alpha`` of table ``rows`` (an overflow to inf is no error)."""
        with np.errstate(over="ignore"):
            return (self.table.arrays["priority"][rows] / scale) ** alpha

    def tree(self, span: int, alpha: float | None) -> torch.Tensor:
        """The up-to-date tree for ``(span, alpha)`` (``None``: uniform), built on first use.

        Each tree refreshes only its own pending rows, and only when it is drawn from, so
        adds and updates cost nothing for trees a training loop is not using right now.
        """
        return self._cached(span, alpha).nodes

    def _cached(self, span: int, alpha: float | None) -> sum_tree.CachedTree:
        if self._generation != self.table.generation:
            self.invalidate()
        key = (span, alpha)
        cached = self._trees.get(key)
        if cached is not None and cached.pending and not cached.stale:
            total = self._refresh(cached, span, alpha)
            low, high = _TOTAL_RANGE
            if alpha is not None and not low <= total <= high:
                cached.stale = True  # priorities moved far from the scale: rescale
        if cached is None or cached.stale:
            cached = self._build(span, alpha)
            self._trees[key] = cached
            if len(self._trees) > _MAX_TREES:
                self._trees.popitem(last=False)
        self._trees.move_to_end(key)
        return cached

    def _refresh(self, cached: sum_tree.CachedTree, span: int, alpha: float | None) -> float:
        """Recompute the leaves of ``cached``'s pending rows (O(k log E)); return its total."""
        rows = cached.take_pending(self.table.device)
        compiled = kernels.get() if isinstance(rows, np.ndarray) else None
        if compiled is None:
            sum_tree.assign_leaves(
                cached.nodes, rows, self.leaf_values(rows, span, alpha, cached.scale)
            )
            return cached.total()
        table, column = self.table, self.table.arrays
        return float(
            compiled["refresh_leaves"](
                cached.engine,
                cached.levels,
                rows,
                column["episode_id"],
                column["length"],
                column["times_sampled"],
                table.first_id,
                table.next_id,
                -1 if self.reuse_limit is None else self.reuse_limit,
                span,
                self.unit == "chunk",
                _NO_VALUES if alpha is None else self._powered(rows, alpha, cached.scale),
            )
        )

    def _build(self, span: int, alpha: float | None) -> sum_tree.CachedTree:
        """A tree over every row, scaled by the largest eligible priority (O(E))."""
        rows = arrays.engine(torch.arange(self.table.row_count, device=self.table.device))
        scale = 1.0
        if alpha is not None:
            eligible = self.leaf_values(rows, span, None, 1.0) > 0
            if bool(eligible.any()):
                scale = float(self.table.arrays["priority"][rows][eligible].max())
        leaves = arrays.tensor(self.leaf_values(rows, span, alpha, scale))
        return sum_tree.CachedTree(sum_tree.build(leaves), scale)

    def log_mass(self, span: int, alpha: float | None) -> float:
        """``log`` of the unscaled total mass (``-inf`` when nothing is eligible).

        Masses of several samplers with the same ``alpha`` compare in this form whatever their
        trees' scales: ``log sum_e n_e p_e^alpha`` for chunks.
        """
        cached = self._cached(span, alpha)
        total = cached.total()
        if total <= 0:
            return -math.inf
        return math.log(total) + (0.0 if alpha is None else alpha * math.log(cached.scale))

    # ------------------------------------------------------------------------- drawing
    def mass(self, span: int, alpha: float | None) -> float:
        """Total leaf mass for ``(span, alpha)`` at its tree's scale; zero: nothing eligible.

        For the uniform tree (``alpha=None``) this is the number of eligible anchors
        (``unit="chunk"``) or episodes (``unit="episode"``), O(1) amortised.
        """
        return self._cached(span, alpha).total()

    def checked_draw(
        self,
        batch_size: int,
        span: int,
        *,
        what: object,
        alpha: float | None,
        generator: torch.Generator,
    ) -> Anchors:
        """`draw`, after refusing a table with nothing eligible (``str(what)`` names the span)."""
        if self.table.num_episodes == 0:
            raise must_have("the buffer", "non-empty to sample", "0 stored episodes")
        cached = self._cached(span, alpha)
        if cached.total() <= 0:
            raise self.nothing_eligible(span, what, batch_size)
        return self._draw_from(cached, batch_size, span, alpha, generator)

    def draw(
        self,
        batch_size: int,
        span: int,
        *,
        alpha: float | None,
        generator: torch.Generator,
    ) -> Anchors:
        """Draw ``batch_size`` anchors with replacement (O(B log E)).

        The caller checks ``mass(span, alpha) > 0`` first. Under a reuse limit no episode is
        drawn more than its remaining allowance, also within this call; if the eligible
        episodes cannot supply ``batch_size`` draws, `ReuseLimitError` is raised, the
        generator is rewound and nothing changes.
        """
        return self._draw_from(self._cached(span, alpha), batch_size, span, alpha, generator)

    def _draw_from(
        self,
        cached: sum_tree.CachedTree,
        batch_size: int,
        span: int,
        alpha: float | None,
        generator: torch.Generator,
    ) -> Anchors:
        """`draw` from ``cached``, the up-to-date tree for ``(span, alpha)``."""
        column = self.table.arrays
        compiled = kernels.get() if isinstance(cached.engine, np.ndarray) else None
        if self.reuse_limit is None and compiled is not None:  # one compiled call
            rows, steps, ids, drawn = compiled["draw"](
                cached.engine,
                cached.levels,
                self._uniforms(batch_size, generator),
                column["length"],
                span,
                column["times_sampled"],
                column["episode_id"],
                _NO_VALUES if alpha is None else column["priority"],
            )
            return Anchors(rows, ids, steps, None if alpha is None else drawn)
        if self.reuse_limit is None:
            rows, steps = self._draw_rows(cached, batch_size, span, generator)
            _count_draws(column["times_sampled"], rows)
        else:
            drawn_rows, drawn_steps = self._draw_within_limit(cached, batch_size, span, generator)
            self._count_draws_within_limit(drawn_rows)
            rows, steps = arrays.engine(drawn_rows), arrays.engine(drawn_steps)
        return self._anchors(rows, steps, alpha)

    def draw_round(
        self, count: int, span: int, *, alpha: float | None, generator: torch.Generator
    ) -> tuple[Anchors, torch.Tensor]:
        """One round of a draw coordinated across several samplers.

        ``count`` draws from the current masses; the ones within the reuse limit are kept
        (and counted), none is redrawn. Returns the kept anchors, in draw order, and which
        of the ``count`` draws were kept (bool ``[count]``, on the CPU). Repeating rounds
        for the refused ones from the masses of the moment reproduces `draw` draw for draw
        (a refused draw exhausted its episode, which then has mass 0). The caller checks
        that the mass is positive.
        """
        rows, steps = self._draw_rows(self._cached(span, alpha), count, span, generator)
        if self.reuse_limit is None:
            _count_draws(self.table.arrays["times_sampled"], rows)
            return self._anchors(rows, steps, alpha), torch.ones(count, dtype=torch.bool)
        rows, steps = arrays.tensor(rows), arrays.tensor(steps)
        allowance = self.reuse_limit - self.table.times_sampled[rows]
        keep = _occurrence_rank(rows) < allowance
        rows, steps = rows[keep], steps[keep]
        self._count_draws_within_limit(rows)
        return self._anchors(arrays.engine(rows), arrays.engine(steps), alpha), keep.cpu()

    def _anchors(self, rows: Array, steps: Array, alpha: float | None) -> Anchors:
        column = self.table.arrays
        return Anchors(
            rows,
            column["episode_id"][rows],
            steps,
            None if alpha is None else column["priority"][rows],
        )

    def _count_draws_within_limit(self, rows: torch.Tensor) -> None:
        """Count the draws of ``rows``; episodes reaching the limit retire (leaf 0)."""
        assert self.reuse_limit is not None
        times_sampled = self.table.times_sampled
        before = times_sampled[rows]
        times_sampled.index_add_(0, rows, torch.ones_like(rows))
        after = times_sampled[rows]
        retiring = (before < self.reuse_limit) & (after >= self.reuse_limit)
        self.episodes_retired += (retiring & _first_occurrence(rows)).sum()
        self.mark_dirty(rows)

    def _draw_rows(
        self, cached: sum_tree.CachedTree, count: int, span: int, generator: torch.Generator
    ) -> tuple[Array, Array]:
        """``count`` rows by leaf mass and a uniform eligible step in each (`arrays` engine)."""
        drawn = self._uniforms(count, generator)
        compiled = kernels.get() if isinstance(drawn, np.ndarray) else None
        if compiled is not None:  # the same arithmetic, one compiled call
            lengths = self.table.arrays["length"]
            rows, steps = compiled["draw_rows"](cached.engine, cached.levels, drawn, lengths, span)
            return rows, steps
        tree = cached.nodes
        rows = sum_tree.search(tree, drawn[:, 0] * arrays.engine(sum_tree.total(tree)))
        anchors = eligible_anchors(self.table.arrays["length"][rows], span)
        steps = arrays.minimum(arrays.cast(drawn[:, 1] * anchors, torch.int64), anchors - 1)
        return rows, steps

    def _uniforms(self, count: int, generator: torch.Generator) -> Array:
        """``[count, 2]`` float64 uniforms from ``generator`` on the table's engine.

        Drawn into a tensor kept for the next draw of the same size (what ``torch.rand``
        would draw, without its allocation); valid until the next call.
        """
        kept = self._kept_uniforms
        if kept is None or kept.shape[0] != count or kept.device != generator.device:
            kept = torch.empty((count, 2), dtype=torch.float64, device=generator.device)
            self._kept_uniforms = kept
            self._kept_engine = arrays.engine(kept.to(self.table.device))
        kept.uniform_(generator=generator)
        if kept.device != self.table.device:
            return arrays.engine(kept.to(self.table.device))
        return self._kept_engine

    def _draw_within_limit(
        self, cached: sum_tree.CachedTree, batch_size: int, span: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw in rounds that never exceed an episode's remaining allowance.

        Each round keeps every episode's first draws up to its allowance, gives the episodes
        that used it up zero mass in ``tree`` and redraws the rest, so each redraw comes from
        the renormalised remaining mass, as sequential draws would. Every round but the last
        exhausts at least one episode.
        """
        assert self.reuse_limit is not None
        saved_state = generator.get_state()
        device = self.table.device
        rows = torch.empty(0, dtype=torch.int64, device=device)
        steps = torch.empty(0, dtype=torch.int64, device=device)
        exhausted: list[torch.Tensor] = []
        try:
            while rows.numel() < batch_size:
                if cached.total() <= 0:
                    generator.set_state(saved_state)
                    raise self.reuse_limit_error(span, batch_size)
                drawn = self._draw_rows(cached, batch_size - rows.numel(), span, generator)
                new_rows, new_steps = arrays.tensor(drawn[0]), arrays.tensor(drawn[1])
                every = torch.cat([rows, new_rows])
                rank = _occurrence_rank(every)
                allowance = self.reuse_limit - self.table.times_sampled[every]
                keep = (rank < allowance)[rows.numel() :]
                rows = torch.cat([rows, new_rows[keep]])
                steps = torch.cat([steps, new_steps[keep]])
                used_up = torch.unique(every[rank + 1 == allowance])
                zeros = torch.zeros_like(used_up, dtype=cached.nodes.dtype)
                sum_tree.assign_leaves(cached.nodes, used_up, zeros)
                exhausted.append(used_up)
        finally:
            for used_up in exhausted:  # temporary zeros; leaves are recomputed from the table
                self.mark_dirty(used_up)
        return rows, steps

    def draws_left(self, span: int) -> int | None:
        """Draws the reuse limit still allows to episodes with an eligible anchor (O(E)).

        ``None`` without a reuse limit.
        """
        if self.reuse_limit is None:
            return None
        table = self.table
        rows = table.stored_rows()
        eligible = eligible_anchors(table.length[rows], span) > 0
        left = (self.reuse_limit - table.times_sampled[rows]).clamp_min(0)
        return int((left * eligible).sum())

    def nothing_eligible(self, span: int, what: object, batch_size: int) -> Exception:
        """The error for a draw of ``span`` from a non-empty table with zero mass.

        ``what`` names the argument that set the span (``"length"``, ...).
        """
        table = self.table
        longest = int(table.length[table.stored_rows()].max())
        if longest < span:
            return must(str(what), f"<= the longest stored episode ({longest} steps)", span)
        return self.reuse_limit_error(span, batch_size)

    def reuse_limit_error(self, span: int, batch_size: int) -> ReuseLimitError:
        """The error for asking ``batch_size`` draws of ``span`` beyond the reuse limit."""
        return ReuseLimitError(
            f"batch_size must be <= the draws left under max_times_sampled="
            f"{self.reuse_limit} for the eligible episodes ({self.draws_left(span)}), "
            f"got {batch_size}"
        )


def _count_draws(times_sampled: Array, rows: Array) -> None:
    """``times_sampled[rows] += 1``, a repeated row counted once per draw."""
    compiled = kernels.get() if isinstance(rows, np.ndarray) else None
    if compiled is not None:
        compiled["count"](times_sampled, rows)  # np.add.at costs ~10 us for 256 rows
    else:
        arrays.add_at(times_sampled, rows, 1)


def _occurrence_rank(values: torch.Tensor) -> torch.Tensor:
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
    return _occurrence_rank(values) == 0
