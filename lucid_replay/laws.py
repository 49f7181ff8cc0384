r"""Selection laws: which eligible anchors a draw favours, as values (`Uniform`, `Prioritized`).

The two laws are also the public selectors a buffer takes as ``selector=``, as are `Recency`
(`lucid_replay.recency`, a law of this protocol too) and `Mixture` (`lucid_replay.mixtures`,
drawn from its components' trees); `lucid_replay.selectors` resolves one for a buffer and
carries it in a checkpoint's configuration. What follows is how the sampler uses a law.

A law gives each table row a *mass* $m$, relative to a scale $s$ it picks when a tree is
built. The sampler's tree for the law (`lucid_replay.trees`) has one leaf per row,
$u_e m_e$, where $u_e$ is the row's *unit mass*: its eligible anchors for ``unit="chunk"``,
its share of its episode's one unit for ``unit="episode"``, 0 for a retired or evicted row.
A draw picks row $e$ with probability $u_e m_e / Z$ ($Z$ the tree's total) and a step
uniformly among its eligible anchors, so each drawn anchor (``unit="episode"``: each drawn
episode) has probability $P = m_e / Z$: the scale cancels. A law is a value: equal laws share
one cached tree, under their `Law.key` (also what a checkpoint saves of a tree).

Importance weights are $(N P_i)^{-\beta} / \max_j (N P_j)^{-\beta} = (P_{min} / P_i)^\beta$:
$N$ and the normaliser cancel (`importance_weights`). `Prioritized` takes them from the drawn
priorities instead, $(p_{min} / p_i)^{\alpha\beta}$ (`priority_weights`), which is the same
value computed exactly, without forming $P$.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import attrs
import numpy as np
import torch

from lucid_replay import engine
from lucid_replay.checks import check_float
from lucid_replay.engine import Array
from lucid_replay.errors import must, wrong_type
from lucid_replay.records import Anchors

if TYPE_CHECKING:
    from lucid_replay.table import EpisodeTable

__all__ = ["Prioritized", "Uniform"]

# `Law.key`: None for `Uniform`, alpha for `Prioritized`, a string for `Recency`
LawKey = float | str | None
L = TypeVar("L")


class Law(Protocol):
    """What the sampler needs of a selection law (see the module docstring).

    ``by_priority``: the masses follow the rows' priorities, so a priority update moves the
    law's leaves, the scale is the largest eligible priority (a tree whose total drifts out
    of range is rebuilt at a new one), and draws carry the drawn priorities (``Anchors``),
    from which a coordinator of several shards computes weights over a merged batch.
    """

    @property
    def key(self) -> LawKey:
        """The law's part of its tree's cache key (saved in checkpoints; `selectors.from_key`)."""

    @property
    def by_priority(self) -> bool:
        """Whether the masses follow the rows' priorities."""

    @property
    def rescales(self) -> bool:
        """Whether a tree whose total leaves ``[2**-700, 2**700]`` is rebuilt at a new scale."""

    def scale(self, table: EpisodeTable, rows: Array) -> float:
        """The scale of a new tree, from the table ``rows`` with an eligible anchor."""

    def masses(self, table: EpisodeTable, rows: Array, scale: float) -> Array | None:
        """float64 ``m`` of table ``rows`` at ``scale``; ``None`` when every mass is 1."""

    def log_scale(self, scale: float) -> float:
        """``log`` of the factor ``scale`` divides every mass by (0 when it divides none)."""

    def leaf_values(self, table: EpisodeTable, rows: Array, unit: Array, scale: float) -> Array:
        """The leaves ``unit * m`` of table ``rows`` whose unit masses are ``unit``."""

    def probability(
        self, table: EpisodeTable, rows: Array, scale: float, total: float | Array
    ) -> Array:
        """float64 ``P = m / total`` of anchors drawn from ``rows`` of a tree of ``total``.

        ``total``: the tree's total, or each anchor's (a draw in rounds, `AnchorSampler`).
        """

    def weights(self, anchors: Anchors, probability: Callable[[], Array], beta: float) -> Array:
        """float32 importance weights of drawn ``anchors`` (largest 1).

        ``probability`` gives their probabilities (`probability`), asked for only by a law
        without an exact shortcut.
        """


@attrs.frozen
class Uniform:
    r"""Selector: every eligible anchor (``unit="episode"``: eligible episode) equally likely.

    The law of `SequenceReplay` and of ``sample()``; pass ``selector=Uniform()`` to a
    `PrioritizedSequenceReplay` to make its `sample_prioritized`, `sample_windows` and
    `iterate` draw uniformly while it keeps its priorities (its batches keep their weights,
    all 1).

    Notes
    -----
    Each drawn anchor has probability $P = 1 / N$, ``N`` the eligible anchors (``unit="chunk"``)
    or the eligible episodes (``unit="episode"``), as ``batch.probabilities`` reports; every
    importance weight $(N P)^{-\beta} / \max$ is 1.

    Examples
    --------
    >>> import torch
    >>> from lucid_replay import Episode, PrioritizedSequenceReplay, Window
    >>> buffer = PrioritizedSequenceReplay(100, seed=0, selector=Uniform())
    >>> buffer.extend(Episode({"obs": torch.zeros(n)}) for n in (3, 5))
    [0, 1]
    >>> batch = buffer.sample_windows(4, Window(2))  # N = 2 + 4 anchors
    >>> batch.probabilities.unique().tolist(), batch.weights.unique().tolist()
    ([0.16666666666666666], [1.0])
    """

    @property
    def key(self) -> LawKey:
        """`Law.key`: ``None``."""
        return None

    @property
    def by_priority(self) -> bool:
        """`Law.by_priority`: False."""
        return False

    @property
    def rescales(self) -> bool:
        """`Law.rescales`: False (every mass is 1)."""
        return False

    def scale(self, table: EpisodeTable, rows: Array) -> float:
        """`Law.scale`: 1."""
        return 1.0

    def masses(self, table: EpisodeTable, rows: Array, scale: float) -> Array | None:
        """`Law.masses`: ``None`` (every mass is 1)."""
        return None

    def log_scale(self, scale: float) -> float:
        """`Law.log_scale`: 0."""
        return 0.0

    def leaf_values(self, table: EpisodeTable, rows: Array, unit: Array, scale: float) -> Array:
        """`Law.leaf_values`: the unit masses."""
        return unit

    def probability(
        self, table: EpisodeTable, rows: Array, scale: float, total: float | Array
    ) -> Array:
        """`Law.probability`: ``1 / total``."""
        return engine.full((int(rows.shape[0]),), 1.0, torch.float64, rows) / total

    def weights(self, anchors: Anchors, probability: Callable[[], Array], beta: float) -> Array:
        """`Law.weights`: all 1 (every anchor has the same mass)."""
        return engine.full((int(anchors.rows.shape[0]),), 1.0, torch.float32, anchors.rows)


def _alpha(alpha: object) -> float | None:
    """`Prioritized`'s ``alpha``, checked: ``None`` or a finite real ``>= 0``."""
    return None if alpha is None else check_float("alpha", alpha, minimum=0.0)


@attrs.frozen
class Prioritized:
    r"""Selector: anchors in proportion to their priority to the power ``alpha``.

    The law of `PrioritizedSequenceReplay` (its ``selector=None``); the formulas, the
    weights and their paper are documented there.

    Parameters
    ----------
    alpha
        ``None`` (default): the buffer's ``alpha``. A real ``>= 0``: this exponent, which
        then becomes the buffer's ``alpha`` (a buffer given another ``alpha`` too refuses
        the pair): a buffer has one ``alpha``, which ``prioritized=True`` draws by as well.

    Raises
    ------
    InvalidArgumentError
        If ``alpha`` is negative or not finite (`InvalidTypeError` if not a real number).

    Notes
    -----
    Each drawn anchor has probability $P = p^\alpha / \sum p^\alpha$ over the eligible anchors
    (``unit="episode"``: over the eligible episodes), as ``batch.probabilities`` reports.
    Inside, the masses are $m_e = (p_e / s)^\alpha$, $s$ the largest priority among the
    eligible rows when a tree was built: $m_e \le 1$ then, so no finite priority overflows
    float64 or underflows every mass to zero, and $s$ cancels in $P$.

    Examples
    --------
    >>> from lucid_replay import PrioritizedSequenceReplay
    >>> PrioritizedSequenceReplay(100, selector=Prioritized(alpha=0.7)).alpha
    0.7
    >>> PrioritizedSequenceReplay(100, alpha=0.5, selector=Prioritized()).selector
    Prioritized(alpha=0.5)
    """

    alpha: float | None = attrs.field(default=None, converter=_alpha)

    @property
    def key(self) -> LawKey:
        """`Law.key`: alpha."""
        return self.alpha

    @property
    def by_priority(self) -> bool:
        """`Law.by_priority`: True."""
        return True

    @property
    def rescales(self) -> bool:
        """`Law.rescales`: True (priorities may move far from the scale)."""
        return True

    def scale(self, table: EpisodeTable, rows: Array) -> float:
        """`Law.scale`: the largest priority of ``rows`` (1 for none)."""
        if rows.shape[0] == 0:
            return 1.0
        return float(table.arrays["priority"][rows].max())

    def masses(self, table: EpisodeTable, rows: Array, scale: float) -> Array:
        """``(p / scale) ** alpha`` of ``rows``; an overflow to inf is no error (it rescales)."""
        with np.errstate(over="ignore"):
            return (table.arrays["priority"][rows] / scale) ** self._exponent

    def log_scale(self, scale: float) -> float:
        """`Law.log_scale`: ``alpha * log(scale)``."""
        return self._exponent * math.log(scale)

    def leaf_values(self, table: EpisodeTable, rows: Array, unit: Array, scale: float) -> Array:
        """`Law.leaf_values`: ``unit * (p / scale) ** alpha``, 0 where ``unit`` is 0."""
        # A row that is not drawable (unit 0) gets 0, also where its mass overflowed (0 * inf).
        with np.errstate(over="ignore", invalid="ignore"):
            leaves = unit * self.masses(table, rows, scale)
        return engine.where(unit > 0, leaves, 0.0)

    def probability(
        self, table: EpisodeTable, rows: Array, scale: float, total: float | Array
    ) -> Array:
        """`Law.probability`: ``(p / scale) ** alpha / total``."""
        return self.masses(table, rows, scale) / total

    def weights(self, anchors: Anchors, probability: Callable[[], Array], beta: float) -> Array:
        """`Law.weights`: ``(p_min / p) ** (alpha beta)`` (`priority_weights`)."""
        return priority_weights(anchors.priorities, self._exponent * beta)

    @property
    def _exponent(self) -> float:
        assert self.alpha is not None  # a buffer's law: resolved by `selectors.checked_selector`
        return self.alpha


def of_flag(prioritized: bool, law: Law) -> Law:
    """The law of a public ``prioritized`` flag: ``law`` (the buffer's), `Uniform` for False."""
    return law if prioritized else Uniform()


def checked_flag(
    prioritized: object, selector: L, alpha: float | None, *, buffer: str
) -> tuple[L | Uniform | Prioritized, bool]:
    """The law of a draw's public ``prioritized`` flag, and whether its batch has weights.

    ``None``: the ``buffer``'s ``selector``; False: `Uniform`; True: `Prioritized` at the
    buffer's ``alpha`` (refused on a buffer without priorities, ``alpha`` None). A draw on a
    buffer with priorities has weights unless it is ``prioritized=False``.
    """
    if prioritized is not None and not isinstance(prioritized, bool):
        raise wrong_type("prioritized", "a bool or None", prioritized)
    if prioritized and alpha is None:
        raise must("prioritized", f"False or None on a {buffer}", prioritized)
    if prioritized is None:
        return selector, alpha is not None
    return (Prioritized(alpha) if prioritized else Uniform()), prioritized


def importance_weights(probabilities: Array, beta: float) -> Array:
    """float32 ``(P_min / P) ** beta`` of a batch's probabilities: ``(N P)^-beta / max``.

    The ratio is at most 1, so the power never overflows. Of the `engine` of its input.
    """
    ratio = probabilities.min() / probabilities
    return engine.cast(ratio**beta, torch.float32)


def priority_weights(drawn: Array, exponent: float) -> Array:
    """float32 ``(p_min / p) ** exponent`` of a batch's drawn priorities (``alpha * beta``).

    `importance_weights` of `Prioritized`, computed from the priorities: ``P ∝ p^alpha``, so
    the ratio of probabilities is that of priorities to the power ``alpha``, and no power of
    a raw priority is ever taken. Of the `engine` of ``drawn`` (or numpy).
    """
    ratio = drawn.min() / drawn
    return engine.cast(ratio**exponent, torch.float32)
