r"""Selection laws: which eligible anchors a draw favours, as values (`Uniform`, `Prioritized`).

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
from typing import TYPE_CHECKING, Protocol

import attrs
import numpy as np
import torch

from lucid_replay import engine
from lucid_replay.engine import Array
from lucid_replay.records import Anchors

if TYPE_CHECKING:
    from lucid_replay.table import EpisodeTable

__all__: list[str] = []  # internal module

LawKey = float | None  # `Law.key`: None for `Uniform`, alpha for `Prioritized`


class Law(Protocol):
    """What the sampler needs of a selection law (see the module docstring).

    ``by_priority``: the masses follow the rows' priorities, so a priority update moves the
    law's leaves, the scale is the largest eligible priority (a tree whose total drifts out
    of range is rebuilt at a new one), and draws carry the drawn priorities (``Anchors``),
    from which a coordinator of several shards computes weights over a merged batch.
    """

    @property
    def key(self) -> LawKey:
        """The law's part of its tree's cache key (saved in checkpoints; see `from_key`)."""

    @property
    def by_priority(self) -> bool:
        """Whether the masses follow the rows' priorities."""

    def scale(self, table: EpisodeTable, rows: Array) -> float:
        """The scale of a new tree, from the table ``rows`` with an eligible anchor."""

    def masses(self, table: EpisodeTable, rows: Array, scale: float) -> Array | None:
        """float64 ``m`` of table ``rows`` at ``scale``; ``None`` when every mass is 1."""

    def log_scale(self, scale: float) -> float:
        """``log`` of the factor ``scale`` divides every mass by (0 when it divides none)."""

    def leaf_values(self, table: EpisodeTable, rows: Array, unit: Array, scale: float) -> Array:
        """The leaves ``unit * m`` of table ``rows`` whose unit masses are ``unit``."""

    def probability(self, table: EpisodeTable, rows: Array, scale: float, total: float) -> Array:
        """float64 ``P = m / total`` of anchors drawn from ``rows`` of a tree of ``total``."""

    def weights(self, anchors: Anchors, probability: Callable[[], Array], beta: float) -> Array:
        """float32 importance weights of drawn ``anchors`` (largest 1).

        ``probability`` gives their probabilities (`probability`), asked for only by a law
        without an exact shortcut.
        """


@attrs.frozen
class Uniform:
    """Every eligible anchor (``unit="episode"``: every eligible episode) equally likely.

    $m = 1$, so $P = 1 / N$ for the $N$ eligible anchors (episodes), and every weight is 1.
    """

    @property
    def key(self) -> LawKey:
        return None

    @property
    def by_priority(self) -> bool:
        return False

    def scale(self, table: EpisodeTable, rows: Array) -> float:
        return 1.0

    def masses(self, table: EpisodeTable, rows: Array, scale: float) -> Array | None:
        return None

    def log_scale(self, scale: float) -> float:
        return 0.0

    def leaf_values(self, table: EpisodeTable, rows: Array, unit: Array, scale: float) -> Array:
        return unit

    def probability(self, table: EpisodeTable, rows: Array, scale: float, total: float) -> Array:
        return engine.full((int(rows.shape[0]),), 1.0 / total, torch.float64, rows)

    def weights(self, anchors: Anchors, probability: Callable[[], Array], beta: float) -> Array:
        return importance_weights(probability(), beta)


@attrs.frozen
class Prioritized:
    r"""Anchors in proportion to their episode's priority to the power ``alpha``.

    $m_e = (p_e / s)^\alpha$ with $s$ the largest priority among the eligible rows when the
    tree was built: $m_e \le 1$ then, so no finite priority overflows float64 or underflows
    every mass to zero. The formulas and their paper are on
    `lucid_replay.PrioritizedSequenceReplay`.
    """

    alpha: float

    @property
    def key(self) -> LawKey:
        return self.alpha

    @property
    def by_priority(self) -> bool:
        return True

    def scale(self, table: EpisodeTable, rows: Array) -> float:
        if rows.shape[0] == 0:
            return 1.0
        return float(table.arrays["priority"][rows].max())

    def masses(self, table: EpisodeTable, rows: Array, scale: float) -> Array:
        """``(p / scale) ** alpha`` of ``rows``; an overflow to inf is no error (it rescales)."""
        with np.errstate(over="ignore"):
            return (table.arrays["priority"][rows] / scale) ** self.alpha

    def log_scale(self, scale: float) -> float:
        return self.alpha * math.log(scale)

    def leaf_values(self, table: EpisodeTable, rows: Array, unit: Array, scale: float) -> Array:
        # A row that is not drawable (unit 0) gets 0, also where its mass overflowed (0 * inf).
        with np.errstate(over="ignore", invalid="ignore"):
            leaves = unit * self.masses(table, rows, scale)
        return engine.where(unit > 0, leaves, 0.0)

    def probability(self, table: EpisodeTable, rows: Array, scale: float, total: float) -> Array:
        return self.masses(table, rows, scale) / total

    def weights(self, anchors: Anchors, probability: Callable[[], Array], beta: float) -> Array:
        return priority_weights(anchors.priorities, self.alpha * beta)


def of_flag(prioritized: bool, law: Law) -> Law:
    """The law of a public ``prioritized`` flag: ``law`` (the buffer's), `Uniform` for False."""
    return law if prioritized else Uniform()


def from_key(key: LawKey) -> Law:
    """The law whose `Law.key` is ``key`` (a checkpoint's saved tree)."""
    return Uniform() if key is None else Prioritized(key)


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
