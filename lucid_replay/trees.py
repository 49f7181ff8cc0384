"""The sampler's sum trees: the leaf law, and a tree per (span, law) kept as the table's cache.

An *anchor* is ``(episode, step)``. For a learning region spanning ``span`` steps, the eligible
anchors of an episode of length ``T`` are its steps ``0 .. T - span`` (``max(T - span + 1, 0)``
of them). The draw (`lucid_replay.sampling`) picks an episode row from a sum tree whose leaf
for each stored episode is (the *leaf law*)

* ``unit="chunk"``:   ``n_e * m_e`` (every eligible anchor equally likely, times its weight),
* ``unit="episode"``: ``[n_e > 0] * m_e`` (every episode with an eligible anchor equally likely),

where ``m_e`` is the selection law's mass (`lucid_replay.laws`: 1 for `Uniform`,
``(p_e / s) ** alpha`` for `Prioritized`, ``2 ** ((c_e - s) / h)`` for `Recency`), and then
a step uniformly among the episode's eligible anchors. The scale ``s`` is the law's, picked
when the tree was built; it cancels in every probability. A tree of a law that rescales
(`Prioritized`, `Recency`) whose total drifts out of ``[2**-700, 2**700]`` (priorities moved by
hundreds of orders of magnitude, or many half-lives of data arrived) is rebuilt with a new
scale. Retired
episodes (reuse limit reached) and evicted rows have leaf 0. The trees are caches of the
episode table: writers mark rows dirty, and the next draw recomputes exactly those leaves
(O(k log E)), so ``add`` stays O(1). The law is spelled twice, a screen apart: `leaf_values`
(array code) and `refresh_leaves_loop` (compiled, given the law's masses).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from lucid_replay import engine, sum_tree
from lucid_replay.directory import Owners
from lucid_replay.engine import Array
from lucid_replay.errors import InvalidArgumentError
from lucid_replay.laws import Law, LawKey
from lucid_replay.selectors import from_key
from lucid_replay.table import EpisodeTable

__all__: list[str] = []  # internal module

_MAX_TREES = 8  # distinct spans kept at once; the least recently used tree is dropped beyond
_TOTAL_RANGE = (2.0**-700, 2.0**700)  # leaves <= n_e <= 2**62 each after a rescale
UNIFORM_TREE = np.empty(0, dtype=np.float64)  # a loop's optional priority input, absent
# Cached trees as a checkpoint keeps them: (span, extra, law key, scale), least recent first.
TreeKeys = Sequence[tuple[int, int, LawKey, float]]


def eligible_anchors(lengths: Array, span: int) -> Array:
    """Number of anchors whose ``span``-step learning region fits in an episode, elementwise."""
    anchors = lengths - (span - 1)
    return anchors * (anchors > 0)  # max(anchors, 0) as numpy and torch both spell it


def anchors_in_rows(owners: Owners, lengths: Array, rows: Array, span: int, extra: int) -> Array:
    """Eligible anchors held by table ``rows``: the leaf law's ``n`` for one row.

    An anchor at episode step ``t`` needs ``span`` steps from ``t`` to its episode's last
    step, ``span + extra`` in an open episode (whose last committed step is no end: the
    bootstrap records must be committed too). A row holding steps ``a .. a + n - 1`` of an
    episode that committed ``total`` steps holds ``clip(total - a - need + 1, 0, n)`` of
    them; for a whole episode (``a = 0``, ``total = n``, never open) that is
    ``eligible_anchors(n, span)``.
    """
    slots = owners.slot[rows]
    need = span + extra * owners.opened[slots]
    anchors = owners.total[slots] - owners.first_step[rows] - (need - 1)
    return engine.minimum(anchors * (anchors > 0), lengths[rows])


def episode_anchors(owners: Owners, slots: Array, span: int, extra: int) -> Array:
    """Eligible anchors of the episodes in directory ``slots`` (over all their stored rows)."""
    need = span + extra * owners.opened[slots]
    anchors = owners.total[slots] - owners.first_stored[slots] - (need - 1)
    return anchors * (anchors > 0)


class Trees:
    """Sum trees over the rows of an `EpisodeTable`, one per ``(span, law)``, as caches.

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
        # Keyed by `Law.key`, not by the law: iterating an OrderedDict hashes its keys, and a
        # tuple of plain values hashes in C (a law's hash is a Python call, ~2% of an ``add``).
        self._trees: OrderedDict[tuple[int, int, LawKey], sum_tree.CachedTree] = OrderedDict()
        self._generation = table.generation

    # ------------------------------------------------------------------------ the cache
    def mark_dirty(self, rows: int | list[int] | torch.Tensor) -> None:
        """Note that the leaves of ``rows`` must be recomputed before their next draw."""
        for tree in self._trees.values():
            tree.note(rows, self.table.row_count)

    def mark_priorities_dirty(self, rows: torch.Tensor) -> None:
        """Note that only the priorities of ``rows`` changed (other laws' trees stay exact)."""
        for (_, _, key), tree in self._trees.items():
            if from_key(key).by_priority:
                tree.note(rows, self.table.row_count)

    def tree_bytes(self) -> int:
        """Memory held by the cached trees (for reporting)."""
        return sum(t.nodes.numel() * t.nodes.element_size() for t in self._trees.values())

    def adopt(self, table: EpisodeTable, saved: TreeKeys = ()) -> None:
        """Follow a restored ``table``, rebuilding the ``saved`` trees at their scales.

        A tree's leaves depend on its scale (the largest eligible priority when it was
        built, kept since): rebuilt at the saved scale, in the saved order, the trees and
        so the draws after a load are bitwise those of the buffer that was saved.
        """
        self.table = table
        self.invalidate()
        for span, extra, key, scale in saved:
            self._trees[(span, extra, key)] = self._build(span, extra, from_key(key), scale)

    def state(self) -> list[tuple[int, int, LawKey, float]]:
        """The cached trees' keys and scales, least recently used first (see `adopt`)."""
        return [
            (span, extra, key, tree.scale)
            for (span, extra, key), tree in self._trees.items()
            if not tree.stale
        ]

    @contextlib.contextmanager
    def kept_if_refused(self) -> Iterator[None]:
        """Trees first built inside the block are forgotten again if it raises a refusal.

        A refused call changes nothing, and a checkpoint saves which trees are cached.
        """
        kept, generation = OrderedDict(self._trees), self._generation
        try:
            yield
        except InvalidArgumentError:
            if self._generation == generation:  # else the table was reshaped: all rebuilt
                self._trees.clear()
                self._trees.update(kept)
            raise

    def invalidate(self) -> None:
        """Forget every tree (after the table was reshaped or reloaded)."""
        self._trees.clear()
        self._generation = self.table.generation

    def tree(self, span: int, law: Law, extra: int = 0) -> torch.Tensor:
        """The up-to-date tree for ``(span, law)``, built on first use."""
        return self.cached(span, law, extra).nodes

    def max_need(self) -> int:
        """The most steps any cached tree's anchors need after them (0 without trees)."""
        need = 0
        for span, extra, _ in self._trees:  # every commit asks: a loop, not a generator
            if span + extra > need:
                need = span + extra
        return need

    def cached(self, span: int, law: Law, extra: int = 0) -> sum_tree.CachedTree:
        """The up-to-date `CachedTree` for ``(span, law)``.

        Each tree refreshes only its own pending rows, and only when it is used, so adds and
        updates cost nothing for trees a training loop is not drawing from right now.
        ``extra``: the further steps an anchor of an *open* episode needs (see
        `anchors_in_rows`); ignored, and taken as 0, on a table of whole episodes.
        """
        if self._generation != self.table.generation:
            self.invalidate()
        extra = extra if self.table.segmented else 0
        key = (span, extra, law.key)
        cached = self._trees.get(key)
        if cached is not None and cached.pending and not cached.stale:
            total = self._refresh(cached, span, extra, law)
            low, high = _TOTAL_RANGE
            if law.rescales and not low <= total <= high:
                cached.stale = True  # masses moved far from the scale: rescale
        if cached is None or cached.stale:
            cached = self._build(span, extra, law)
            self._trees[key] = cached
            if len(self._trees) > _MAX_TREES:
                self._trees.popitem(last=False)
        self._trees.move_to_end(key)
        return cached

    def mass(self, span: int, law: Law, extra: int = 0) -> float:
        """Total leaf mass for ``(span, law)`` at its tree's scale; zero: nothing eligible.

        For the `Uniform` tree this is the number of eligible anchors (``unit="chunk"``) or
        episodes (``unit="episode"``), O(1) amortised.
        """
        return self.cached(span, law, extra).total()

    def log_mass(self, span: int, law: Law, extra: int = 0) -> float:
        """``log`` of the unscaled total mass (``-inf`` when nothing is eligible).

        Masses of several tables under the same law compare in this form whatever their
        trees' scales: ``log sum_e n_e p_e^alpha`` for chunks by priority.
        """
        cached = self.cached(span, law, extra)
        total = cached.total()
        if total <= 0:
            return -math.inf
        return math.log(total) + law.log_scale(cached.scale)

    def _build(
        self, span: int, extra: int, law: Law, scale: float | None = None
    ) -> sum_tree.CachedTree:
        """A tree over every row, at the law's scale for the eligible rows (O(E)).

        ``scale``: a given scale instead (a restored tree's).
        """
        rows = engine.view(torch.arange(self.table.row_count, device=self.table.device))
        unit = self.unit_masses(rows, span, extra)
        if scale is None:
            scale = law.scale(self.table, rows[unit > 0])
        leaves = engine.tensor(law.leaf_values(self.table, rows, unit, scale))
        return sum_tree.CachedTree(sum_tree.build(leaves), scale)

    # ------------------------------------------------------------------- the leaf law
    def _refresh(self, cached: sum_tree.CachedTree, span: int, extra: int, law: Law) -> float:
        """Recompute the leaves of ``cached``'s pending rows (O(k log E)); return its total."""
        rows = cached.take_pending(self.table.device)
        if not engine.compiled(rows):
            leaves = self.leaf_values(rows, span, law, cached.scale, extra)
            sum_tree.assign_leaves(cached.nodes, rows, leaves)
            return cached.total()
        table, column, owners = self.table, self.table.arrays, self.table.owners()
        masses = law.masses(table, rows, cached.scale)
        return float(
            refresh_leaves_loop(
                cached.array,
                cached.levels,
                rows,
                column["episode_id"],
                column["length"],
                table.first_id,
                table.next_id,
                -1 if self.reuse_limit is None else self.reuse_limit,
                span,
                extra,
                self.unit == "chunk",
                UNIFORM_TREE if masses is None else masses,
                *owners,
            )
        )

    def leaf_values(self, rows: Array, span: int, law: Law, scale: float, extra: int = 0) -> Array:
        """The leaf mass of table ``rows`` in the tree for ``(span, extra, law)`` at ``scale``.

        ``rows`` and the result are `engine` arrays; the mass is an integer, bool or float64
        array, exact when stored in the float64 tree.
        """
        return law.leaf_values(self.table, rows, self.unit_masses(rows, span, extra), scale)

    def unit_masses(self, rows: Array, span: int, extra: int = 0) -> Array:
        """The `Uniform` leaves of table ``rows``: each row's unit mass, 0 if not drawable.

        Its eligible anchors (``unit="chunk"``), else its share of its episode's one unit;
        0 for a dead or retired row. An integer, bool or float64 `engine` array.
        """
        column, owners = self.table.arrays, self.table.owners()
        slots = owners.slot[rows]
        live = self.table.is_stored(column["episode_id"][rows])
        if self.reuse_limit is not None:
            live = live & (owners.times[slots] < self.reuse_limit)
        count = anchors_in_rows(owners, column["length"], rows, span, extra)
        if self.unit == "chunk":
            mass = count
        elif not self.table.segmented:
            mass = count > 0
        else:  # an episode's rows share its unit mass in proportion to their anchors
            in_episode = episode_anchors(owners, slots, span, extra)
            with np.errstate(divide="ignore", invalid="ignore"):
                share = engine.cast(count, torch.float64) / (in_episode + (in_episode == 0))
                mass = engine.where(count > 0, share, 0.0)  # float64 (torch divides in float32)
        return mass * live


@engine.jit
def refresh_leaves_loop(
    tree: np.ndarray,
    levels: int,
    rows: np.ndarray,
    key: np.ndarray,
    length: np.ndarray,
    first_key: int,
    next_key: int,
    reuse_limit: int,
    span: int,
    extra: int,
    per_anchor: bool,
    masses: np.ndarray,
    slot: np.ndarray,
    first_step: np.ndarray,
    total: np.ndarray,
    opened: np.ndarray,
    first_stored: np.ndarray,
    times: np.ndarray,
    terminated: np.ndarray,
) -> float:
    """`Trees.leaf_values` of ``rows`` into their leaves, compiled; returns the new total.

    The leaves' ancestors are recomputed as `sum_tree.refresh` does. A row is live when its
    key (episode or segment id) is in ``[first_key, next_key)`` and, with a ``reuse_limit``
    (``-1``: none), its episode was drawn fewer times than that. Its mass is its count of
    eligible anchors (`anchors_in_rows`; the arrays after ``masses`` are the table's
    `Owners`) (``per_anchor``), else its share of its episode's unit mass: 1 if it has an
    anchor for a whole episode, ``count / episode count`` for a segment. A live row gets
    its mass, a dead one 0. ``masses[i]`` is the law's mass of ``rows[i]`` (`Law.masses`,
    computed by the caller with numpy, whose power this does not reproduce), and a live row
    with an eligible anchor gets ``mass * masses[i]``; ``masses`` is empty when every mass
    is 1 (`Uniform`).
    """
    leaf0 = tree.shape[0] // 2
    weighted = masses.shape[0] > 0
    for i in range(rows.shape[0]):
        row = rows[i]
        owner = slot[row]
        live = first_key <= key[row] < next_key  # a dead row's slot may be another's
        live = live and (reuse_limit < 0 or times[owner] < reuse_limit)
        if not live:
            tree[leaf0 + row] = 0.0
            continue
        need = span + extra * opened[owner]
        anchors = min(max(total[owner] - first_step[row] - (need - 1), 0), length[row])
        if per_anchor:
            mass = np.float64(anchors)
        elif anchors > 0:  # x / x == 1 exactly: a whole episode's row has mass 1
            mass = anchors / max(total[owner] - first_stored[owner] - (need - 1), 1)
        else:
            mass = 0.0
        if not weighted:
            tree[leaf0 + row] = mass
        else:
            tree[leaf0 + row] = mass * masses[i] if anchors > 0 else 0.0
    for i in range(rows.shape[0]):
        sum_tree.recompute_ancestors(tree, leaf0 + rows[i], levels)
    return float(tree[1])
