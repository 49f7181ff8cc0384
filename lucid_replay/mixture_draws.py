r"""Drawing by a `Mixture`: a component for each position, then each component's positions.

A batch of ``B`` draws takes ``B`` float64 uniforms from the buffer's generator, one per
position: position ``i`` belongs to component ``k`` when ``u_i`` falls in the ``k``-th
interval of the fractions' cumulative sums. Then one ``[B, 2]`` block of uniforms is drawn
and, component by component (in the mixture's order), the positions of component ``k`` take
its next rows and are drawn together from ``k``'s sum tree, exactly as a draw by that law
alone (`lucid_replay.sampling.draw_rows`), and put back at their positions. Compiled, the
whole draw is one call (`mixture_draw_loop`, the same arithmetic). The positions are
independent, so every draw follows $\sum_k f_k P_k$, and the batch's order reveals nothing
but the independent choices.

Each drawn anchor's $P = \sum_k f_k m_k / Z_k$ takes O(K) per anchor from the components'
masses of its row and their trees' totals. Under a reuse limit the draw goes in rounds, as
`AnchorSampler._draw_within_limit` does for one law: each round draws every pending position
from its component's tree, keeps the first draws of each episode up to its allowance, gives
the episodes that used it up zero mass in *every* component's tree and redraws the rest from
their own components; each draw's $P$ uses the totals of the round that drew it.

Draws without replacement (`lucid_replay.without_replacement`) draw from `MixtureSource`: the
components' trees as the rounds lower them, each position's component picked by the weight
of the mass left in its tree (the law is derived there).
"""

from __future__ import annotations

import numpy as np
import torch

from lucid_replay import engine, sampling, sum_tree
from lucid_replay.engine import Array
from lucid_replay.errors import empty_buffer
from lucid_replay.mixtures import Mixture
from lucid_replay.records import Anchors
from lucid_replay.sampling import AnchorSampler, count_draws, draw_rows, occurrence_rank

__all__: list[str] = []  # internal module


def draw(
    sampler: AnchorSampler,
    mixture: Mixture,
    batch_size: int,
    span: int,
    *,
    what: object,
    generator: torch.Generator,
    extra: int = 0,
) -> Anchors:
    """`AnchorSampler.checked_draw` by ``mixture`` (see the module docstring)."""
    table = sampler.table
    if table.num_episodes == 0:
        raise empty_buffer()
    trees = [sampler.trees.cached(span, law, extra) for law in mixture.selectors]
    if any(tree.total() <= 0 for tree in trees):
        raise sampler.nothing_eligible(span, what, batch_size, extra)
    saved_state = generator.get_state()  # a refused draw rewinds it (reuse limit)
    picks = torch.empty(batch_size, dtype=torch.float64, device=generator.device)
    picks.uniform_(generator=generator)  # one uniform per position: its component
    bounds = np.cumsum(mixture.shares)[:-1]
    need = (span, extra)
    owners = table.owners()
    if sampler.reuse_limit is None and engine.compiled(trees[0].array):  # one compiled call
        assert all(tree.levels == trees[0].levels for tree in trees)  # trees of one table
        rows, steps, ids = mixture_draw_loop(
            tuple(tree.array for tree in trees),
            trees[0].levels,
            picks.numpy(),
            bounds,
            sampler.uniforms(batch_size, generator),
            table.arrays["length"],
            *need,
            sampler.owner_ids(),
            *owners,
        )
        chances = probabilities(sampler, mixture, trees, rows, [t.total() for t in trees])
        return Anchors(rows, ids, steps, None, None, chances)
    # component k when bounds[k - 1] <= u < bounds[k]: how many bounds u reached
    labels = (picks[:, None] >= torch.from_numpy(bounds).to(picks.device)).sum(dim=1)
    labels = labels.to(table.device)
    if sampler.reuse_limit is None:
        rows, steps = draw_positions(sampler, trees, labels, need, generator)
        count_draws(owners.times, owners.slot[rows])
        totals = [tree.total() for tree in trees]
        chances = probabilities(sampler, mixture, trees, rows, totals)
    else:
        rows, steps, by_round = _draw_within_limit(
            sampler, trees, labels, need, (generator, saved_state)
        )
        sampler.count_draws_within_limit(engine.tensor(rows))
        chances = probabilities(sampler, mixture, trees, rows, list(by_round))
    return Anchors(rows, sampler.owner_ids()[owners.slot[rows]], steps, None, None, chances)


def draw_positions(
    sampler: AnchorSampler,
    trees: list[sum_tree.CachedTree],
    labels: torch.Tensor,
    need: tuple[int, int],
    generator: torch.Generator,
) -> tuple[Array, Array]:
    """Rows and steps of each position from its component's tree (`engine` arrays).

    One ``[B, 2]`` block of uniforms: the positions of component 0 (in order) take its first
    rows, then those of component 1, ... (`mixture_draw_loop` does the same).
    """
    rows = torch.empty_like(labels)
    steps = torch.empty_like(labels)
    uniforms = sampler.uniforms(int(labels.numel()), generator)
    order = torch.argsort(labels, stable=True)  # positions by component, in order within
    counts = torch.bincount(labels, minlength=len(trees)).tolist()
    start = 0
    for tree, count in zip(trees, counts, strict=True):
        if count == 0:
            continue
        at = order[start : start + count]
        drawn, drawn_steps = draw_rows(tree, sampler.table, uniforms[start : start + count], need)
        rows[at], steps[at] = engine.tensor(drawn), engine.tensor(drawn_steps)
        start += count
    return engine.view(rows), engine.view(steps)


def probabilities(
    sampler: AnchorSampler,
    mixture: Mixture,
    trees: list[sum_tree.CachedTree],
    rows: Array,
    totals: list[float] | list[Array],
) -> Array:
    """``sum_k f_k m_k / Z_k`` of each drawn row, ``totals[k]`` the ``Z_k`` (or each anchor's)."""
    table, chances = sampler.table, None
    laws, shares = mixture.selectors, mixture.shares
    for law, fraction, tree, total in zip(laws, shares, trees, totals, strict=True):
        term = fraction * law.probability(table, rows, tree.scale, total)
        chances = term if chances is None else chances + term
    return chances


def _draw_within_limit(
    sampler: AnchorSampler,
    trees: list[sum_tree.CachedTree],
    labels: torch.Tensor,
    need: tuple[int, int],
    rng: tuple[torch.Generator, torch.Tensor],
) -> tuple[Array, Array, Array]:
    """Draw in rounds within the reuse limit; rows, steps and each component's round totals.

    The totals are float64 ``[K, B]``: ``Z_k`` of the round that drew each position.
    ``rng``: the generator, and its state before the draw (restored if it is refused).
    """
    limit = sampler.reuse_limit
    assert limit is not None
    generator, saved_state = rng
    table = sampler.table
    owners = table.owners()
    slot_of, times = engine.tensor(owners.slot), engine.tensor(owners.times)
    batch_size = int(labels.numel())
    rows, steps = torch.empty_like(labels), torch.empty_like(labels)
    totals = torch.empty((len(trees), batch_size), dtype=torch.float64, device=labels.device)
    kept = torch.empty(0, dtype=torch.int64, device=labels.device)  # in the order kept
    pending = torch.arange(batch_size, device=labels.device)
    exhausted: list[torch.Tensor] = []
    try:
        while pending.numel():
            round_totals = [tree.total() for tree in trees]
            if any(round_totals[k] <= 0 for k in torch.unique(labels[pending]).tolist()):
                generator.set_state(saved_state)  # a component has no episode left to draw
                raise sampler.reuse_limit_error(need[0], batch_size, need[1])
            drawn = draw_positions(sampler, trees, labels[pending], need, generator)
            drawn_rows, drawn_steps = engine.tensor(drawn[0]), engine.tensor(drawn[1])
            every = torch.cat([kept, drawn_rows])
            slots = slot_of[every]
            rank = occurrence_rank(slots)
            keep = (rank < limit - times[slots])[kept.numel() :]
            at = pending[keep]
            rows[at], steps[at] = drawn_rows[keep], drawn_steps[keep]
            drawn_at = torch.tensor(round_totals, dtype=torch.float64, device=labels.device)
            totals[:, at] = drawn_at[:, None]
            kept = torch.cat([kept, drawn_rows[keep]])
            used_up = torch.unique(slots[rank + 1 == limit - times[slots]])
            if table.segmented:
                used_up = engine.tensor(table.segment_rows(used_up))
            for tree in trees:
                zeros = torch.zeros_like(used_up, dtype=tree.nodes.dtype)
                sum_tree.assign_leaves(tree.nodes, used_up, zeros)
            exhausted.append(used_up)
            pending = pending[~keep]
    finally:
        for used_up in exhausted:  # temporary zeros; leaves are recomputed from the table
            sampler.trees.mark_dirty(used_up)
    return engine.view(rows), engine.view(steps), engine.view(totals)


class MixtureSource:
    r"""A `Mixture`'s trees as draws without replacement take them (a `Source` there).

    Every draw picks a component for each position by $w_k = f_k T_k / Z_k$, $T_k$ the
    component tree's total now and $Z_k$ its total when the call began, then draws each
    component's positions from its tree (`draw_positions`): the mixture's $P$ restricted to
    the rows not lowered (the derivation is `lucid_replay.without_replacement`'s).
    """

    def __init__(self, mixture: Mixture, trees: list[sum_tree.CachedTree]) -> None:
        self.mixture, self.trees = mixture, trees
        self.starts = [tree.total() for tree in trees]
        self.empty = any(start <= 0 for start in self.starts)

    def _weights(self) -> np.ndarray:
        """float64 ``[K]`` weights ``f_k T_k / Z_k`` (the fractions while nothing is lowered)."""
        now = [tree.total() for tree in self.trees]
        pairs = zip(self.mixture.shares, now, self.starts, strict=True)
        return np.array([f * (t / z) for f, t, z in pairs])

    def total(self) -> float:
        """`Source.total`: the mixture's mass left, ``sum_k w_k`` (1 while nothing is lowered)."""
        return float(self._weights().sum())

    def draw(
        self,
        sampler: AnchorSampler,
        count: int,
        need: tuple[int, int],
        generator: torch.Generator,
    ) -> tuple[Array, Array]:
        """`Source.draw`: ``count`` uniforms pick the components, then `draw_positions`."""
        cumulative = np.cumsum(self._weights())
        bounds = torch.from_numpy(cumulative[:-1] / cumulative[-1])  # a spent last part: 1.0
        picks = torch.empty(count, dtype=torch.float64, device=generator.device)
        picks.uniform_(generator=generator)
        labels = (picks[:, None] >= bounds.to(picks.device)).sum(dim=1)
        return draw_positions(sampler, self.trees, labels.to(sampler.table.device), need, generator)

    def lower(self, rows: torch.Tensor) -> None:
        """`Source.lower`: leaf 0 in every component's tree."""
        for tree in self.trees:
            zeros = torch.zeros_like(rows, dtype=tree.nodes.dtype)
            sum_tree.assign_leaves(tree.nodes, engine.view(rows), engine.view(zeros))

    def undrawn_share(self, sampler: AnchorSampler, rows: torch.Tensor) -> float:
        """`Source.undrawn_share`: ``1 - P(drawn) / sum_k w_k`` for anchors of ``rows``."""
        total = self.total()
        if total <= 0:
            return 1.0
        drawn = self.probabilities(sampler, engine.view(rows))
        return min(max((total - float(engine.tensor(drawn).sum())) / total, 0.0), 1.0)

    def probabilities(self, sampler: AnchorSampler, rows: Array) -> Array:
        """`Source.probabilities`: ``sum_k f_k m_k / Z_k`` by the starting totals."""
        return probabilities(sampler, self.mixture, self.trees, rows, list(self.starts))


@engine.jit
def mixture_draw_loop(
    trees: tuple[np.ndarray, ...],
    levels: int,
    picks: np.ndarray,
    bounds: np.ndarray,
    uniforms: np.ndarray,
    lengths: np.ndarray,
    span: int,
    extra: int,
    episode_id: np.ndarray,
    slot: np.ndarray,
    first_step: np.ndarray,
    total: np.ndarray,
    opened: np.ndarray,
    first_stored: np.ndarray,
    times: np.ndarray,
    terminated: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`draw_positions` without a reuse limit, compiled: draw, count, look up the ids.

    ``trees`` are the components' tree arrays (of one table: the same ``levels``); position
    ``i`` is of component ``k``, the number of ``bounds`` (the fractions' cumulative sums)
    at most ``picks[i]``, as `draw` computes it; the arrays after ``episode_id`` (by directory
    slot) are the table's `Owners`. Returns the rows, episode steps and episode ids.
    """
    count = picks.shape[0]
    labels = np.zeros(count, dtype=np.int64)
    for i in range(count):
        for bound in bounds:
            labels[i] += picks[i] >= bound
    starts = np.zeros(len(trees) + 1, dtype=np.int64)
    for i in range(count):
        starts[labels[i] + 1] += 1
    for k in range(len(trees)):
        starts[k + 1] += starts[k]
    order = np.empty(count, dtype=np.int64)  # positions by component, in order within
    filled = starts[:-1].copy()
    for i in range(count):
        order[filled[labels[i]]] = i
        filled[labels[i]] += 1
    rows = np.empty(count, dtype=np.int64)
    steps = np.empty(count, dtype=np.int64)
    for k in range(len(trees)):
        a, b = starts[k], starts[k + 1]
        if b == a:
            continue
        drawn, drawn_steps = sampling.draw_rows_loop(
            trees[k],
            levels,
            uniforms[a:b],
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
        for j in range(a, b):
            rows[order[j]] = drawn[j - a]
            steps[order[j]] = drawn_steps[j - a]
    ids = np.empty(count, dtype=np.int64)
    for i in range(count):
        owner = slot[rows[i]]
        times[owner] += 1
        ids[i] = episode_id[owner]
    return rows, steps, ids
