r"""Draws without replacement: no anchor (``unit="episode"``: no episode) twice in a batch.

The law is *successive sampling*: each draw picks an anchor by the selector's $P$,
renormalised over the anchors not drawn yet in the batch. Drawing with replacement and
discarding repeats, keeping first occurrences in draw order, is exactly that law (whatever
the earlier draws, the next new anchor is drawn by $P$ restricted to the anchors still new),
and so is drawing by $P$ restricted to any set $S$ of anchors that holds every anchor still
new. The draw runs the sampler's with-replacement draw in vectorised rounds:

1. draw the missing count (more when many of the tree's mass is already drawn, see
   `_round_size`): ``B`` rows by leaf mass and a uniform eligible step in each;
2. keep each new anchor's first occurrence, in draw order, up to the missing count
   (anchors are ``(row, step)``, told apart by their ring offset; ``unit="episode"``: the
   episode);
3. give the rows whose every eligible anchor is drawn (``unit="episode"``: every row of a
   drawn episode) leaf 0 in the tree, so later rounds never redraw them: $S$ shrinks to
   the anchors of the rows left. The zeros are temporary: those rows are marked dirty and
   their leaves recomputed from the table at the tree's next use, bit for bit as they were.

A reuse limit (``max_times_sampled``) applies as well: an episode is drawn at most its
remaining allowance, also within the batch, so an episode that reaches it leaves the
rounds too (its rows get leaf 0) and the law is successive sampling over the anchors of
episodes not yet exhausted.

**Mixtures.** A `Mixture`'s $P(a) = \sum_k f_k m_k(a) / Z_k$, $m_k$ the masses of component
$k$'s tree and $Z_k$ its total when the call began, is drawn the same way from the
components' trees (`MixtureSource`); step 3 lowers the rows in *every* component's tree.
Restricted to the anchors $S$ of the rows not lowered, whose mass in tree $k$ is its
current total $T_k$,

$$P(a \mid S) = \frac{\sum_k f_k m_k(a) / Z_k}{\sum_j f_j T_j / Z_j}
= \sum_k \frac{f_k T_k / Z_k}{\sum_j f_j T_j / Z_j} \cdot \frac{m_k(a)}{T_k},$$

a mixture again: each position picks component $k$ with probability proportional to
$w_k = f_k T_k / Z_k$, then draws from $k$'s tree as it stands. In the first round
$T_k = Z_k$ and the weights are the fractions; a component whose rows are all lowered has
$T_k = 0$ and is never picked again, while the others keep the weights of their remaining
mass (renormalising each component on its own, $f_k m_k / T_k$, would be another law).
Keeping first occurrences of these draws is successive sampling by $P$, as above.

Each anchor's probability is its *unconditional* $P$ under the selector, $m / Z$ over
every eligible anchor when the call began (the first draw's law), whatever round drew it:
the weights use that $P$. A batch larger than the eligible anchors (episodes; under a reuse
limit, the anchors the episodes' allowances admit) is refused with nothing drawn: the
generator is rewound and the trees restored.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from lucid_replay import engine, sum_tree
from lucid_replay.engine import Array
from lucid_replay.errors import InvalidArgumentError, empty_buffer, must, wrong_type
from lucid_replay.laws import Law
from lucid_replay.mixture_draws import MixtureSource
from lucid_replay.mixtures import Mixture
from lucid_replay.records import Anchors
from lucid_replay.sampling import AnchorSampler, count_draws, occurrence_rank
from lucid_replay.trees import anchors_in_rows, episode_anchors

__all__: list[str] = []  # internal module

_MIN_ROUND = 1 << 16  # a round may draw this many even for a few missing anchors


class Source(Protocol):
    """What the rounds draw from: one law's tree (`LawSource`) or a mixture's (`MixtureSource`)."""

    empty: bool  # some tree had no mass when the call began: nothing eligible

    def total(self) -> float:
        """The mass left to draw from (0: nothing left)."""

    def draw(
        self,
        sampler: AnchorSampler,
        count: int,
        need: tuple[int, int],
        generator: torch.Generator,
    ) -> tuple[Array, Array]:
        """``count`` rows and steps by the mass left, with replacement."""

    def lower(self, rows: torch.Tensor) -> None:
        """Give ``rows`` leaf 0 in every tree (the caller marks them dirty)."""

    def undrawn_share(self, sampler: AnchorSampler, rows: torch.Tensor) -> float:
        """The share of the mass left on anchors other than the drawn ``rows`` (not lowered)."""

    def probabilities(self, sampler: AnchorSampler, rows: Array) -> Array:
        """float64 unconditional ``P`` of anchors of ``rows``, by the totals at the start."""


class LawSource:
    """A single law's tree, drawn exactly as `AnchorSampler.draw_tree_rows` draws it."""

    def __init__(self, cached: sum_tree.CachedTree, law: Law) -> None:
        self.cached, self.law = cached, law
        self.start = cached.total()
        self.empty = self.start <= 0

    def total(self) -> float:
        """`Source.total`: the tree's total."""
        return self.cached.total()

    def draw(
        self,
        sampler: AnchorSampler,
        count: int,
        need: tuple[int, int],
        generator: torch.Generator,
    ) -> tuple[Array, Array]:
        """`Source.draw`: from the tree."""
        return sampler.draw_tree_rows(self.cached, count, need, generator)

    def lower(self, rows: torch.Tensor) -> None:
        """`Source.lower`: leaf 0 in the tree."""
        zeros = torch.zeros_like(rows, dtype=self.cached.nodes.dtype)
        sum_tree.assign_leaves(self.cached.nodes, engine.view(rows), engine.view(zeros))

    def undrawn_share(self, sampler: AnchorSampler, rows: torch.Tensor) -> float:
        """`Source.undrawn_share`: each drawn anchor holds the mass ``m`` of its row."""
        total = self.cached.total()
        if total <= 0:
            return 1.0
        masses = self.law.masses(sampler.table, engine.view(rows), self.cached.scale)
        drawn = float(rows.numel()) if masses is None else float(engine.tensor(masses).sum())
        return min(max((total - drawn) / total, 0.0), 1.0)

    def probabilities(self, sampler: AnchorSampler, rows: Array) -> Array:
        """`Source.probabilities`: ``m / Z``."""
        return self.law.probability(sampler.table, rows, self.cached.scale, self.start)


def checked_replacement(replacement: object) -> bool:
    """A draw's ``replacement`` flag, checked: a bool."""
    if not isinstance(replacement, bool):
        raise wrong_type("replacement", "a bool", replacement)
    return replacement


def draw_distinct(
    sampler: AnchorSampler,
    batch_size: int,
    span: int,
    *,
    what: object,
    law: Law | Mixture,
    generator: torch.Generator,
    extra: int = 0,
) -> Anchors:
    """``batch_size`` distinct anchors (episodes) by ``law``, successive sampling (module doc).

    ``law`` is a single law or a `Mixture`. Refuses what `AnchorSampler.checked_draw`
    refuses (``str(what)`` names the span), and a ``batch_size`` beyond what the eligible
    anchors supply without a repeat. Counts the draws (reuse limit) once they succeed.
    Expected cost O(B log E) when ``B`` is small next to the eligible anchors; rounds grow
    as the batch exhausts them.
    """
    table = sampler.table
    if table.num_episodes == 0:
        raise empty_buffer()
    with sampler.trees.kept_if_refused():  # a checkpoint saves which trees are cached
        source: Source
        if isinstance(law, Mixture):
            trees = [sampler.trees.cached(span, part, extra) for part in law.selectors]
            source = MixtureSource(law, trees)
        else:
            source = LawSource(sampler.trees.cached(span, law, extra), law)
        if source.empty:
            raise sampler.nothing_eligible(span, what, batch_size, extra)
        bound = table.num_transitions if sampler.unit == "chunk" else table.num_episodes
        if batch_size > bound:  # more than stored steps (episodes): refused before any draw
            raise _too_many(sampler, batch_size, span, extra)
        rows, steps = _rounds(sampler, source, batch_size, (span, extra), generator)
    if sampler.reuse_limit is None:
        count_draws(table.owners().times, table.owners().slot[engine.view(rows)])
    else:
        sampler.count_draws_within_limit(rows)
    rows_v, steps_v = engine.view(rows), engine.view(steps)
    chances = source.probabilities(sampler, rows_v)
    drawn = table.arrays["priority"][rows_v] if law.by_priority else None
    ids = sampler.owner_ids()[table.owners().slot[rows_v]]
    return Anchors(rows_v, ids, steps_v, drawn, None, chances)


def _rounds(
    sampler: AnchorSampler,
    source: Source,
    batch_size: int,
    need: tuple[int, int],
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows and steps of ``batch_size`` distinct anchors, in draw order (tensors)."""
    table, limit, chunk = sampler.table, sampler.reuse_limit, sampler.unit == "chunk"
    saved_state = generator.get_state()
    device = table.device
    owners = table.owners()
    slot_of = engine.tensor(owners.slot)
    base = engine.tensor(table.arrays["base"])
    rows = torch.empty(0, dtype=torch.int64, device=device)
    steps = torch.empty(0, dtype=torch.int64, device=device)
    lowered: list[torch.Tensor] = []
    accept = 1.0  # the share of the mass left not drawn yet
    try:
        while rows.numel() < batch_size:
            if source.total() <= 0:  # every anchor left drawn: the batch cannot be filled
                generator.set_state(saved_state)
                raise _too_many(sampler, batch_size, *need)
            missing = batch_size - rows.numel()
            drawn = source.draw(sampler, _round_size(missing, accept), need, generator)
            every_rows = torch.cat([rows, engine.tensor(drawn[0])])
            every_steps = torch.cat([steps, engine.tensor(drawn[1])])
            slots = slot_of[every_rows]
            keys = base[every_rows] + every_steps if chunk else slots  # ring offset: unique
            keep = occurrence_rank(keys) == 0
            if limit is not None:  # within each episode's allowance, counting kept ones
                allowance = limit - engine.tensor(owners.times)[slots]
                kept = keep.nonzero().flatten()
                keep[kept[occurrence_rank(slots[kept]) >= allowance[kept]]] = False
            new = keep[rows.numel() :].nonzero().flatten()[:missing] + rows.numel()
            rows = torch.cat([rows, every_rows[new]])
            steps = torch.cat([steps, every_steps[new]])
            done = _used_up(sampler, rows, slot_of[rows], need)
            source.lower(done)
            lowered.append(done)
            if chunk and rows.numel() < batch_size:  # drawn anchors in rows not lowered
                accept = source.undrawn_share(sampler, rows[~torch.isin(rows, done)])
    finally:
        for done in lowered:  # temporary zeros; leaves are recomputed from the table
            sampler.trees.mark_dirty(done)
    return rows, steps


def _round_size(missing: int, accept: float) -> int:
    """Draws of a round: enough that ``missing`` new anchors are likely among them.

    ``accept`` is the share of the tree's mass on anchors not drawn yet; a round draws
    ``missing / accept`` (plus 10%), at most ``max(64 missing, 2**16)``.
    """
    if accept >= 1.0:
        return missing
    wanted = math.ceil(1.1 * missing / max(accept, 1e-12))
    return max(missing, min(wanted, max(64 * missing, _MIN_ROUND)))


def _used_up(
    sampler: AnchorSampler, rows: torch.Tensor, slots: torch.Tensor, need: tuple[int, int]
) -> torch.Tensor:
    """Rows no later round may draw: every eligible anchor drawn, or the episode exhausted.

    ``unit="episode"``: every row of a drawn episode. Under a reuse limit, every row of an
    episode whose allowance the kept draws used up.
    """
    table = sampler.table
    if sampler.unit == "episode":
        return engine.tensor(table.segment_rows(engine.view(torch.unique(slots))))
    owners = table.owners()
    drawn_rows, counts = torch.unique(rows, return_counts=True)
    lengths = table.arrays["length"]
    anchors = engine.tensor(anchors_in_rows(owners, lengths, engine.view(drawn_rows), *need))
    done: torch.Tensor = drawn_rows[counts >= anchors]
    if sampler.reuse_limit is not None:
        episodes, per_episode = torch.unique(slots, return_counts=True)
        left = sampler.reuse_limit - engine.tensor(owners.times)[episodes]
        exhausted = episodes[per_episode >= left]
        if exhausted.numel():
            done = torch.cat([done, engine.tensor(table.segment_rows(engine.view(exhausted)))])
    return done


def _too_many(
    sampler: AnchorSampler, batch_size: int, span: int, extra: int
) -> InvalidArgumentError:
    """The refusal of a batch beyond the distinct anchors (episodes) left (O(E))."""
    available, what = distinct_available(sampler, span, extra)
    limit = sampler.reuse_limit
    under = "" if limit is None else f" under max_times_sampled={limit}"
    rule = f"<= the eligible {what}{under} ({available}) to draw without replacement"
    return must("batch_size", rule, batch_size)


def distinct_available(sampler: AnchorSampler, span: int, extra: int = 0) -> tuple[int, str]:
    """How many distinct anchors (``unit="episode"``: episodes) a draw may take, and which.

    Eligible anchors, at most each episode's remaining allowance under a reuse limit
    (eligible episodes not retired). O(E).
    """
    table, limit = sampler.table, sampler.reuse_limit
    slots, owners = table.stored_slots(), table.owners()
    anchors = engine.tensor(episode_anchors(owners, slots, span, extra))
    times = engine.tensor(owners.times)[engine.tensor(slots)]
    if sampler.unit == "episode":
        live = anchors > 0 if limit is None else (anchors > 0) & (times < limit)
        return int(live.sum()), "episodes"
    left = anchors if limit is None else torch.clamp(limit - times, min=0)
    return int(torch.minimum(anchors, left).sum()), "anchors"
