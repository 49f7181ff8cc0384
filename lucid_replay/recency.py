r"""The `Recency` selector: anchors by the age of their episode, halving every ``half_life``.

An episode's (segment's) *commit counter* $c_e$ is the buffer's count of transitions ever
added when it was committed: the global offset just past its last step, ``start + length``
of its table row, which the table already keeps and never changes. The buffer's counter now
is $c$, so the age is $c - c_e$ and

$$P_e \propto 2^{-(c - c_e) / h} = 2^{(c_e - s) / h} \cdot 2^{(s - c) / h},$$

the last factor common to every row: it cancels in $P$. A tree's masses are
$m_e = 2^{(c_e - s) / h}$ at a reference $s$ (the law's *scale*: the newest eligible commit
counter when the tree was built), so an insert changes no other row's leaf and a draw stays
O(B log E). Later rows have masses above 1; once a tree's total leaves ``[2**-700, 2**700]``
(or overflows to ``inf``) it is rebuilt at the newest counter (`lucid_replay.trees`). The
counters are exact integers and the powers are taken afresh from them at every rebuild, so
nothing accumulates however many transitions pass (the offsets are exact in float64 below
``2**53``).

A table that keeps a ``commit`` column (`EpisodeTable.keep_commits`: a shard of a sharded
replay) gives the counters instead: there they count the transitions added to the whole
replay (`lucid_replay.distributed.shards`), so the masses of every shard share one reference
and the law is the single buffer's over the union of the shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from lucid_replay import engine
from lucid_replay.checks import check_float
from lucid_replay.engine import Array
from lucid_replay.errors import wrong_type
from lucid_replay.laws import LawKey, importance_weights
from lucid_replay.records import Anchors
from lucid_replay.table import COMMIT_COLUMN

if TYPE_CHECKING:
    from lucid_replay.table import EpisodeTable

__all__ = ["Recency"]

_KEY = "recency:"  # `Recency.key`: this, the half-life's repr, and ":episode" if by episode


def _half_life(value: object) -> float:
    """`Recency`'s ``half_life``, checked: a finite real ``> 0``."""
    return check_float("half_life", value, minimum=0.0, strict=True)


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise wrong_type("by_episode", "a bool", value)
    return value


@attrs.frozen
class Recency:
    r"""Selector: newer data more likely, the probability halving every ``half_life`` transitions.

    Favours what the agent did lately (IMPALA-style fresh data, or a share of a `Mixture`),
    while older data stays drawable with ever smaller probability.

    Parameters
    ----------
    half_life
        Transitions added to the buffer after which an anchor's probability halves: a finite
        real ``> 0``.
    by_episode
        Set by the buffer: True on a segmented buffer with ``unit="episode"``, whose episodes
        age from their newest committed segment (an episode has one probability there). Leave
        it False; it takes no part in equality.

    Raises
    ------
    InvalidArgumentError
        If ``half_life`` is not finite or not ``> 0`` (`InvalidTypeError` if it is not a real
        number, a bool included).

    Notes
    -----
    Each drawn anchor (``unit="episode"``: episode) has probability
    $P \propto 2^{-\mathrm{age} / h}$ over the eligible anchors (episodes), where the age
    counts the transitions added to the buffer after its episode (on a segmented buffer: its
    segment; its episode's newest one for ``unit="episode"``) was committed: the newest has age
    0. With ``unit="chunk"`` every anchor of an episode has its episode's mass, so a longer
    episode is proportionally more likely. Importance weights are $(N P)^{-\beta} / \max$.
    The cost of a draw is O(B log E): no weight is recomputed when data arrive (see
    `lucid_replay.recency`).

    Examples
    --------
    >>> import torch
    >>> from lucid_replay import Episode, SequenceReplay, Window
    >>> recent = Recency(half_life=4)
    >>> buffer = SequenceReplay(100, seed=1, unit="episode", selector=recent)
    >>> buffer.extend(Episode({"obs": torch.zeros(n)}) for n in (4, 4))
    [0, 1]
    >>> batch = buffer.sample_windows(4, Window(2))  # ages 4 and 0: P = 1/3 and 2/3
    >>> batch.episode_ids.tolist(), batch.probabilities.round(decimals=4).tolist()
    ([0, 0, 1, 1], [0.3333, 0.3333, 0.6667, 0.6667])
    """

    half_life: float = attrs.field(converter=_half_life)
    by_episode: bool = attrs.field(
        default=False, kw_only=True, eq=False, repr=False, converter=_flag
    )

    @property
    def key(self) -> LawKey:
        """`Law.key`: ``"recency:<half_life>"`` (``":episode"`` appended by episode)."""
        return f"{_KEY}{self.half_life!r}{':episode' if self.by_episode else ''}"

    @property
    def by_priority(self) -> bool:
        """`Law.by_priority`: False."""
        return False

    @property
    def rescales(self) -> bool:
        """`Law.rescales`: True (new rows' masses grow past the reference)."""
        return True

    def scale(self, table: EpisodeTable, rows: Array) -> float:
        """`Law.scale`: the largest commit counter of ``rows`` (1 for none)."""
        if rows.shape[0] == 0:
            return 1.0
        return float(self._commits(table, rows).max())

    def masses(self, table: EpisodeTable, rows: Array, scale: float) -> Array:
        """``2 ** ((c - scale) / half_life)`` of ``rows``; an overflow to inf rescales."""
        ages = engine.cast(self._commits(table, rows), torch.float64) - scale
        with np.errstate(over="ignore"):
            return 2.0 ** (ages / self.half_life)

    def log_scale(self, scale: float) -> float:
        """`Law.log_scale`: ``scale / half_life * log(2)``."""
        return scale / self.half_life * math.log(2.0)

    def leaf_values(self, table: EpisodeTable, rows: Array, unit: Array, scale: float) -> Array:
        """`Law.leaf_values`: ``unit * m``, 0 where ``unit`` is 0."""
        with np.errstate(over="ignore", invalid="ignore"):
            leaves = unit * self.masses(table, rows, scale)
        return engine.where(unit > 0, leaves, 0.0)

    def probability(
        self, table: EpisodeTable, rows: Array, scale: float, total: float | Array
    ) -> Array:
        """`Law.probability`: ``m / total``."""
        return self.masses(table, rows, scale) / total

    def weights(self, anchors: Anchors, probability: Callable[[], Array], beta: float) -> Array:
        """`Law.weights`: ``(P_min / P) ** beta`` of the drawn probabilities."""
        drawn = anchors.probabilities
        return importance_weights(probability() if drawn is None else drawn, beta)

    def _commits(self, table: EpisodeTable, rows: Array) -> Array:
        """The commit counters of table ``rows``: ``start + length`` (see the module)."""
        column, directory = table.arrays, table.directory
        if self.by_episode and directory is not None:  # the episode's newest segment
            newest = directory.arrays["last_key"][column["slot"][rows]]
            rows = newest & (table.row_count - 1)
        kept = column.get(COMMIT_COLUMN)  # a shard's replay-wide counters (`keep_commits`)
        return column["start"][rows] + column["length"][rows] if kept is None else kept[rows]


def of_key(key: str) -> Recency | None:
    """The `Recency` whose `Recency.key` is ``key``, or ``None`` if it is none's."""
    if not key.startswith(_KEY):
        return None
    text, _, flag = key[len(_KEY) :].partition(":")
    if flag not in ("", "episode"):
        return None
    try:
        return Recency(float(text), by_episode=flag == "episode")
    except ValueError:  # not a number, or not a valid half-life
        return None
