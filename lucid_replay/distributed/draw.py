r"""The exact cross-shard draw: shard labels from the masses, anchors drawn inside each shard.

Shard ``k`` holds mass $Z_k = \sum_{e \in k} n_e m_e$ ($m_e = p_e^\alpha$, or 1 for a
uniform draw; ``n_e`` eligible anchors for ``unit="chunk"``, ``[n_e > 0]`` for
``unit="episode"``). The coordinator draws ``B`` iid labels $L_j \sim Z_k / Z$ with its own
generator; shard ``k`` draws its ``#{j: L_j = k}`` anchors from its own tree, episode ``e``
with probability $n_e m_e / Z_k$, and the coordinator puts them back at the positions
labelled ``k``, in order. Each position then holds episode ``e`` with probability
$n_e m_e / Z$ and a uniform eligible start: the single buffer's law over the union of the
shards, order included.

Under a reuse limit each shard keeps the draws within each episode's allowance and refuses
the rest without redrawing; the refused positions are labelled again from the masses after
the round (exhausted episodes then weigh 0) and appended after the kept ones, round after
round, which is the single buffer's own algorithm. Weights
$(N P_j)^{-\beta} / \max_i (N P_i)^{-\beta} = (\min_i p_i / p_j)^{\alpha \beta}$ need only
the drawn priorities (`lucid_replay.laws.priority_weights`), and are normalised over the
merged batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from lucid_replay.checks import check_int
from lucid_replay.errors import ReuseLimitError, must, must_have, wrong_type
from lucid_replay.laws import Law, Prioritized, of_flag, priority_weights
from lucid_replay.window import MAX_RECORDS, Window, check_window

__all__: list[str] = []  # internal module

MAX_BATCH = 2**31 - 1


@attrs.frozen
class Spec:
    """One draw: ``batch_size`` anchors of ``window`` by ``law`` (every shard draws by it).

    ``chunks``: chunks of ``window.length`` steps; ``what`` names the argument of the span.
    """

    batch_size: int
    window: Window
    law: Law
    chunks: bool
    what: str


@attrs.define
class Pending:
    """A draw in flight: its round's labels and the shards' replies to come."""

    spec: Spec
    labels: np.ndarray
    futures: dict[int, Any]
    log_masses: list[float]
    pieces: list[dict[str, np.ndarray]] = attrs.Factory(list)
    destinations: list[np.ndarray] = attrs.Factory(list)
    priorities: list[np.ndarray] = attrs.Factory(list)
    filled: int = 0
    exponent: float = 1.0  # alpha * beta when the draw started (its weights' exponent)


def chunk_spec(batch_size: int, length: int, prioritized: bool, alpha: float) -> Spec:
    """A checked draw of chunks of ``length`` steps (by `Prioritized` ``alpha``, or uniformly)."""
    check_int("batch_size", batch_size, minimum=1, maximum=MAX_BATCH)
    check_int("length", length, minimum=1, maximum=MAX_RECORDS)
    return Spec(
        batch_size, Window(length), of_flag(prioritized, Prioritized(alpha)), True, "length"
    )


def window_spec(batch_size: int, window: Window, prioritized: object, alpha: float) -> Spec:
    """A checked draw of windows (``prioritized=None``: by `Prioritized` ``alpha``)."""
    check_int("batch_size", batch_size, minimum=1, maximum=MAX_BATCH)
    check_window(window)
    if prioritized is not None and not isinstance(prioritized, bool):
        raise wrong_type("prioritized", "a bool or None", prioritized)
    what = "length" if window == Window(window.length) else "the window's anchor span"
    law = of_flag(prioritized is not False, Prioritized(alpha))
    return Spec(batch_size, window, law, False, what)


def check(infos: list[dict[str, Any]], spec: Spec, reuse_limit: int | None) -> None:
    """Refuse a draw the single buffer over every shard would refuse, with its message."""
    if sum(info["episodes"] for info in infos) == 0:
        raise must_have("the buffer", "non-empty to sample", "0 stored episodes")
    span = spec.window.anchor_span
    if all(info["log_mass"] == -math.inf for info in infos):
        longest = max(info["longest"] for info in infos)
        if longest < span:
            raise must(spec.what, f"<= the longest stored episode ({longest} steps)", span)
        if not any(info.get("eligible", True) for info in infos):  # open episodes too short
            need = spec.window.open_anchor_span
            raise must_have(
                spec.what,
                f"a span that open episodes' committed steps hold ({need} steps with the "
                "bootstrap records)",
                f"{longest} committed steps at most",
            )
    if reuse_limit is not None:
        left = sum(info["draws_left"] for info in infos)
        if left < spec.batch_size:
            raise reuse_limit_error(reuse_limit, left, spec.batch_size)
    if all(info["log_mass"] == -math.inf for info in infos):  # defensive: no mass anywhere
        raise reuse_limit_error(reuse_limit or 0, 0, spec.batch_size)


def reuse_limit_error(reuse_limit: int, left: int, batch_size: int) -> ReuseLimitError:
    """The single buffer's error for a draw beyond the reuse limit."""
    return ReuseLimitError(
        f"batch_size must be <= the draws left under max_times_sampled={reuse_limit} for "
        f"the eligible episodes ({left}), got {batch_size}"
    )


def labels(rng: np.random.Generator, log_masses: list[float], count: int) -> np.ndarray:
    """``count`` shard labels, shard ``k`` with probability ``Z_k / Z`` (log-space masses)."""
    logs = np.asarray(log_masses, dtype=np.float64)
    weights = np.exp(logs - logs.max())  # -inf (an empty shard) becomes exactly 0
    cumulative = np.cumsum(weights)
    drawn = rng.random(count) * cumulative[-1]
    # side="right": a shard of mass 0 shares its bound with the one before and is never hit.
    chosen = np.searchsorted(cumulative, drawn, side="right")
    return np.asarray(np.minimum(chosen, len(logs) - 1), dtype=np.int64)


def start(
    shards: list[Any], rng: np.random.Generator, spec: Spec, log_masses: list[float]
) -> Pending:
    """Label the ``batch_size`` positions and ask every labelled shard for its draws."""
    pending = Pending(spec, np.empty(0, np.int64), {}, list(log_masses))
    _round(shards, rng, pending, spec.batch_size)
    return pending


def _round(shards: list[Any], rng: np.random.Generator, pending: Pending, count: int) -> None:
    spec = pending.spec
    pending.labels = labels(rng, pending.log_masses, count)
    counts = np.bincount(pending.labels, minlength=len(shards))
    pending.futures = {
        k: shards[k].draw.remote(int(n), spec.window, spec.law, spec.chunks)
        for k, n in enumerate(counts.tolist())
        if n
    }


def finish(
    shards: list[Any],
    rng: np.random.Generator,
    pending: Pending,
    get: Callable[[Any], Any],
    reuse_limit: int | None,
) -> Pending:
    """Collect the replies; label the refused positions again until the batch is full."""
    spec = pending.spec
    while True:
        order = sorted(pending.futures)
        replies = get([pending.futures[k] for k in order])
        positions, parts = [], []
        for k, reply in zip(order, replies, strict=True):
            pending.log_masses[k] = reply["log_mass"]
            kept = np.flatnonzero(pending.labels == k)[reply["kept"]]
            if kept.size:
                positions.append(kept)
                parts.append(reply)
        if positions:
            every = np.concatenate(positions)
            rank = np.empty_like(every)
            rank[np.argsort(every, kind="stable")] = np.arange(every.size)
            rank += pending.filled
            for part, bounds in zip(parts, _splits(positions), strict=True):
                pending.pieces.append(part["batch"])
                pending.destinations.append(rank[bounds])
                if part["priorities"] is not None:
                    pending.priorities.append(part["priorities"])
            pending.filled += every.size
        refused = spec.batch_size - pending.filled
        if not refused:
            return pending
        if all(mass == -math.inf for mass in pending.log_masses):
            # Only when another caller drew or evicted between the check and this round.
            raise reuse_limit_error(reuse_limit or 0, 0, spec.batch_size)
        _round(shards, rng, pending, refused)


def _splits(positions: list[np.ndarray]) -> list[slice]:
    bounds = np.cumsum([0, *(p.size for p in positions)]).tolist()
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def weights(pending: Pending, exponent: float) -> np.ndarray | None:
    """float32 ``(p_min / p) ** (alpha beta)`` over the merged batch, in batch order."""
    if not pending.priorities:
        return None
    drawn = np.empty(pending.spec.batch_size, dtype=np.float64)
    for rows, part in zip(pending.destinations, pending.priorities, strict=True):
        drawn[rows] = part
    weights: np.ndarray = priority_weights(drawn, exponent)
    return weights
