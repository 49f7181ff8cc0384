r"""Draws without replacement: no anchor (``unit="episode"``: no episode) twice in a batch.

The law is *successive sampling*: each draw picks an anchor by the selector's $P$,
renormalised over the anchors not drawn yet in the batch. Drawing with replacement and
discarding repeats, keeping first occurrences in draw order, is exactly that law (whatever
the earlier draws, the next new anchor is drawn by $P$ restricted to the anchors still new),
so the draw runs the sampler's with-replacement draw in vectorised rounds:

1. draw the missing count (more when many of the tree's mass is already drawn, see
   `_round_size`): ``B`` rows by leaf mass and a uniform eligible step in each;
2. keep each new anchor's first occurrence, in draw order, up to the missing count
   (anchors are ``(row, step)``, told apart by their ring offset; ``unit="episode"``: the
   episode);
3. give the rows whose every eligible anchor is drawn (``unit="episode"``: every row of a
   drawn episode) leaf 0 in the tree, so later rounds never redraw them. The zeros are
   temporary: those rows are marked dirty and their leaves recomputed from the table at
   the tree's next use, bit for bit as they were.

A reuse limit (``max_times_sampled``) applies as well: an episode is drawn at most its
remaining allowance, also within the batch, so an episode that reaches it leaves the
rounds too (its rows get leaf 0) and the law is successive sampling over the anchors of
episodes not yet exhausted.

Each anchor's probability is its *unconditional* $P$ under the selector, $m / Z$ over
every eligible anchor when the call began (the first draw's law), whatever round drew it:
the weights use that $P$. A batch larger than the eligible anchors (episodes; under a reuse
limit, the anchors the episodes' allowances admit) is refused with nothing drawn: the
generator is rewound and the tree restored.
"""

from __future__ import annotations

import math

import torch

from lucid_replay import engine, sum_tree
from lucid_replay.errors import InvalidArgumentError, must, must_have, wrong_type
from lucid_replay.laws import Law
from lucid_replay.records import Anchors
from lucid_replay.sampling import AnchorSampler, _count_draws, _occurrence_rank
from lucid_replay.trees import anchors_in_rows, episode_anchors

__all__: list[str] = []  # internal module

_MIN_ROUND = 1 << 16  # a round may draw this many even for a few missing anchors


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
    law: Law,
    generator: torch.Generator,
    extra: int = 0,
) -> Anchors:
    """``batch_size`` distinct anchors (episodes) by ``law``, successive sampling (module doc).

    Refuses what `AnchorSampler.checked_draw` refuses (``str(what)`` names the span), and a
    ``batch_size`` beyond what the eligible anchors supply without a repeat. Counts the
    draws (reuse limit) once they succeed. Expected cost O(B log E) when ``B`` is small
    next to the eligible anchors; rounds grow as the batch exhausts them.
    """
    table = sampler.table
    if table.num_episodes == 0:
        raise must_have("the buffer", "non-empty to sample", "0 stored episodes")
    with sampler.trees.kept_if_refused():  # a checkpoint saves which trees are cached
        cached = sampler.trees.cached(span, law, extra)
        start_total = cached.total()
        if start_total <= 0:
            raise sampler.nothing_eligible(span, what, batch_size, extra)
        bound = table.num_transitions if sampler.unit == "chunk" else table.num_episodes
        if batch_size > bound:  # more than stored steps (episodes): refused before any draw
            raise _too_many(sampler, batch_size, span, extra)
        rows, steps = _rounds(sampler, cached, batch_size, (span, extra), law, generator)
    if sampler.reuse_limit is None:
        _count_draws(table.owners().times, table.owners().slot[engine.view(rows)])
    else:
        sampler._count_draws_within_limit(rows)
    rows_v, steps_v = engine.view(rows), engine.view(steps)
    chances = law.probability(table, rows_v, cached.scale, start_total)
    drawn = table.arrays["priority"][rows_v] if law.by_priority else None
    ids = sampler._owner_ids()[table.owners().slot[rows_v]]
    return Anchors(rows_v, ids, steps_v, drawn, None, chances)


def _rounds(
    sampler: AnchorSampler,
    cached: sum_tree.CachedTree,
    batch_size: int,
    need: tuple[int, int],
    law: Law,
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
    accept = 1.0  # the share of the tree's mass not drawn yet
    try:
        while rows.numel() < batch_size:
            total = cached.total()
            if total <= 0:  # every anchor left drawn: the batch cannot be filled
                generator.set_state(saved_state)
                raise _too_many(sampler, batch_size, *need)
            missing = batch_size - rows.numel()
            drawn = sampler._draw_rows(cached, _round_size(missing, accept), need, generator)
            every_rows = torch.cat([rows, engine.tensor(drawn[0])])
            every_steps = torch.cat([steps, engine.tensor(drawn[1])])
            slots = slot_of[every_rows]
            keys = base[every_rows] + every_steps if chunk else slots  # ring offset: unique
            keep = _occurrence_rank(keys) == 0
            if limit is not None:  # within each episode's allowance, counting kept ones
                allowance = limit - engine.tensor(owners.times)[slots]
                kept = keep.nonzero().flatten()
                keep[kept[_occurrence_rank(slots[kept]) >= allowance[kept]]] = False
            new = keep[rows.numel() :].nonzero().flatten()[:missing] + rows.numel()
            rows = torch.cat([rows, every_rows[new]])
            steps = torch.cat([steps, every_steps[new]])
            done = _used_up(sampler, rows, slot_of[rows], need)
            zeros = torch.zeros_like(done, dtype=cached.nodes.dtype)
            sum_tree.assign_leaves(cached.nodes, engine.view(done), engine.view(zeros))
            lowered.append(done)
            if chunk and rows.numel() < batch_size:
                accept = _undrawn_share(sampler, cached, rows, done, law)
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


def _undrawn_share(
    sampler: AnchorSampler,
    cached: sum_tree.CachedTree,
    rows: torch.Tensor,
    done: torch.Tensor,
    law: Law,
) -> float:
    """The share of ``cached``'s mass on anchors not drawn yet.

    Drawn anchors in rows not lowered still hold the mass ``m`` of their row each.
    """
    total = cached.total()
    if total <= 0:
        return 1.0
    live = ~torch.isin(rows, done)
    masses = law.masses(sampler.table, engine.view(rows[live]), cached.scale)
    drawn = float(live.sum()) if masses is None else float(engine.tensor(masses).sum())
    return min(max((total - drawn) / total, 0.0), 1.0)


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
