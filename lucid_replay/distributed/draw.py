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
import torch

from lucid_replay import engine
from lucid_replay.checks import check_batch_size, check_int
from lucid_replay.errors import (
    empty_buffer,
    reuse_limit_reached,
    span_not_committed,
    span_too_long,
)
from lucid_replay.laws import Law, Uniform, checked_flag, importance_weights, priority_weights
from lucid_replay.mixtures import Mixture
from lucid_replay.window import MAX_RECORDS, Window, check_window

__all__: list[str] = []  # internal module


@attrs.frozen
class Spec:
    """One draw: ``batch_size`` anchors of ``window`` by ``law`` (every shard draws by it).

    ``chunks``: chunks of ``window.length`` steps; ``what`` names the argument of the span;
    ``weights``: the batch carries importance weights.
    """

    batch_size: int
    window: Window
    law: Law | Mixture
    chunks: bool
    what: str
    weights: bool = False


@attrs.define
class Pending:
    """A draw in flight: its round's labels and the shards' replies to come.

    ``laws``: what shards draw by (the law, or a mixture's components), with their
    ``shares``; ``log_masses[j, k]``: ``log`` of law ``j``'s total on shard ``k``; a
    position's label is ``component * S + shard``; ``totals[j]``: ``log`` of law ``j``'s
    total over every shard for the round.
    """

    spec: Spec
    laws: tuple[Any, ...]
    shares: np.ndarray
    log_masses: np.ndarray
    labels: np.ndarray = attrs.Factory(lambda: np.empty(0, np.int64))
    components: np.ndarray = attrs.Factory(lambda: np.empty(0, np.int64))
    totals: np.ndarray = attrs.Factory(lambda: np.empty(0))
    futures: dict[int, Any] = attrs.Factory(dict)
    pieces: list[dict[str, np.ndarray]] = attrs.Factory(list)
    destinations: list[np.ndarray] = attrs.Factory(list)
    priorities: list[np.ndarray] = attrs.Factory(list)
    probabilities: list[np.ndarray] = attrs.Factory(list)
    filled: int = 0
    exponent: float = 1.0  # alpha * beta when the draw started (its weights' exponent)
    beta: float = 1.0  # beta when the draw started (a mixture's weights' exponent)
    reuse_limit: int | None = None
    located: bool = False  # shards reply with where the records are (transport="shared")
    seconds: float = 0.0  # spent starting it (reading masses, sending the counts)
    # A stream's draw: every call also reports the shard's masses after it (`report`), the
    # last call to each shard of the first round carries its queued updates (`riding`,
    # applied after that draw); `infos[k]`: shard k's report after this draw's last call
    # to it (or the one the draw started from); `unsent[k]`: updates no call carried.
    report: bool = False
    riding: list[Any] | None = None
    infos: dict[int, dict[str, Any]] = attrs.Factory(dict)
    unsent: dict[int, Any] = attrs.Factory(dict)
    changes: int = (
        0  # the client's `ClientState.changes` at its start: its reports are current while equal
    )


def chunk_spec(batch_size: int, length: int, law: Law | Mixture, weights: bool) -> Spec:
    """A checked draw of chunks of ``length`` steps by ``law``."""
    check_batch_size(batch_size)
    check_int("length", length, minimum=1, maximum=MAX_RECORDS)
    return Spec(batch_size, Window(length), law, True, "length", weights)


def window_spec(
    batch_size: int, window: Window, prioritized: object, selector: Law | Mixture, alpha: float
) -> Spec:
    """A checked draw of windows (``prioritized=None``: by ``selector``, with weights)."""
    check_batch_size(batch_size)
    check_window(window)
    law, weights = checked_flag(prioritized, selector, alpha, buffer="ShardedReplay")
    what = "length" if window == Window(window.length) else "the window's anchor span"
    return Spec(batch_size, window, law, False, what, weights)


def plan(law: Law | Mixture, num_shards: int) -> tuple[tuple[Any, ...], np.ndarray]:
    """What shards draw by, and the shares: a mixture's components over several shards.

    A replay of one shard draws a mixture whole, as a single buffer does.
    """
    if isinstance(law, Mixture) and num_shards > 1:
        return law.selectors, np.asarray(law.shares, dtype=np.float64)
    return (law,), np.ones(1)


def check(infos: list[dict[str, Any]], spec: Spec, reuse_limit: int | None) -> None:
    """Refuse a draw the single buffer over every shard would refuse, with its message."""
    if sum(info["episodes"] for info in infos) == 0:
        raise empty_buffer()
    span = spec.window.anchor_span
    if all(info["log_mass"] == -math.inf for info in infos):
        longest = max(info["longest"] for info in infos)
        if longest < span:
            raise span_too_long(spec.what, span, longest)
        if not any(info.get("eligible", True) for info in infos):  # open episodes too short
            raise span_not_committed(spec.what, spec.window.open_anchor_span, longest)
    if reuse_limit is not None:
        left = sum(info["draws_left"] for info in infos)
        if left < spec.batch_size:
            raise reuse_limit_reached(reuse_limit, left, spec.batch_size)
    if all(info["log_mass"] == -math.inf for info in infos):  # defensive: no mass anywhere
        raise reuse_limit_reached(reuse_limit or 0, 0, spec.batch_size)


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
    shards: list[Any],
    rng: np.random.Generator,
    spec: Spec,
    log_masses: np.ndarray,
    reuse_limit: int | None = None,
    located: bool = False,
    *,
    report: bool = False,
    riding: list[Any] | None = None,
) -> Pending:
    """Label the ``batch_size`` positions and ask every labelled shard for its draws.

    ``log_masses``: ``[K, S]``, each law of `plan` on each shard. Positions of a mixture
    over several shards first pick their component by the fractions (one uniform each).
    ``located``: the shards reply with where the records are, not with the records.
    """
    laws, shares = plan(spec.law, len(shards))
    pending = Pending(spec, laws, shares, np.array(log_masses, dtype=np.float64))
    pending.reuse_limit = reuse_limit
    pending.located = located
    pending.report, pending.riding = report, riding
    count = spec.batch_size
    if len(laws) == 1:
        components = np.zeros(count, dtype=np.int64)
    else:  # component k when bounds[k - 1] <= u < bounds[k]
        bounds = np.cumsum(shares)[:-1]
        components = np.searchsorted(bounds, rng.random(count), side="right").astype(np.int64)
    _round(shards, rng, pending, components)
    return pending


def log_total(logs: np.ndarray) -> float:
    """``log sum exp(logs)`` (``-inf`` when every entry is); exact for a single entry."""
    top = float(np.max(logs))
    if top == -math.inf:
        return -math.inf
    return top + math.log(float(np.sum(np.exp(logs - top))))


def _round(
    shards: list[Any], rng: np.random.Generator, pending: Pending, components: np.ndarray
) -> None:
    spec, num_shards = pending.spec, len(shards)
    masses = pending.log_masses
    labelled = np.empty(components.size, dtype=np.int64)
    for j in range(len(pending.laws)):
        at = np.flatnonzero(components == j)
        if not at.size:
            continue
        if np.all(masses[j] == -math.inf):
            # Only when the reuse limit (or another caller) left this component nothing.
            raise reuse_limit_reached(pending.reuse_limit or 0, 0, spec.batch_size)
        labelled[at] = j * num_shards + labels(rng, list(masses[j]), at.size)
    pending.labels, pending.components = labelled, components
    pending.totals = np.array([log_total(row) for row in masses])
    counts = np.bincount(labelled, minlength=len(pending.laws) * num_shards)
    last = {g % num_shards: g for g, n in enumerate(counts.tolist()) if n}  # calls go in g order
    riding, pending.riding = pending.riding, None  # the first round's calls carry them
    if riding is not None:
        pending.unsent = {k: queued for k, queued in enumerate(riding) if queued and k not in last}
    extra: dict[int, dict[str, Any]] = {}
    if pending.report:
        for k, g in last.items():
            extra[g] = {"report": True, "updates": None if riding is None else riding[k]}
    pending.futures = {
        g: shards[g % num_shards].draw.remote(
            int(n),
            spec.window,
            pending.laws[g // num_shards],
            spec.chunks,
            pending.laws,
            pending.located,
            **extra.get(g, {}),
        )
        for g, n in enumerate(counts.tolist())
        if n
    }


def finish(
    shards: list[Any],
    rng: np.random.Generator,
    pending: Pending,
    get: Callable[[Any], Any],
) -> Pending:
    """Collect the replies; label the refused positions again until the batch is full.

    A refused position keeps its mixture component.
    """
    spec, num_shards = pending.spec, len(shards)
    while True:
        order = sorted(pending.futures)
        replies = get([pending.futures[g] for g in order])
        positions, parts = [], []
        kept_mask = np.zeros(pending.labels.size, dtype=bool)
        for g, reply in zip(order, replies, strict=True):
            pending.log_masses[:, g % num_shards] = reply["log_masses"]
            if "info" in reply:
                pending.infos[g % num_shards] = reply["info"]
            kept = np.flatnonzero(pending.labels == g)[reply["kept"]]
            kept_mask[kept] = True
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
                pending.probabilities.append(_probabilities(pending, part))
                if part["priorities"] is not None:
                    pending.priorities.append(part["priorities"])
            pending.filled += every.size
        if pending.filled == spec.batch_size:
            return pending
        if np.all(pending.log_masses == -math.inf):
            # Only when another caller drew or evicted between the check and this round.
            raise reuse_limit_reached(pending.reuse_limit or 0, 0, spec.batch_size)
        _round(shards, rng, pending, pending.components[~kept_mask])


def _probabilities(pending: Pending, reply: dict[str, Any]) -> np.ndarray:
    r"""Global ``P = sum_j f_j m_j / Z_j`` of a reply's kept anchors.

    The shard gives ``m_j / Z_j^k`` and ``log Z_j^k``; ``Z_j^k / Z_j`` is taken in log space
    (exactly 1 with one shard).
    """
    chances = reply["chances"]
    probability = np.zeros(chances.shape[1], dtype=np.float64)
    for j, (local, total) in enumerate(zip(reply["log_totals"], pending.totals, strict=True)):
        if local == -math.inf:
            continue
        probability += pending.shares[j] * math.exp(local - total) * chances[j]
    return probability


def _splits(positions: list[np.ndarray]) -> list[slice]:
    bounds = np.cumsum([0, *(p.size for p in positions)]).tolist()
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def merged(pending: Pending, parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    """Per-kept-anchor ``parts`` of every reply, in batch order."""
    out = np.empty(pending.spec.batch_size, dtype=dtype)
    for rows, part in zip(pending.destinations, parts, strict=True):
        out[rows] = part
    return out


def weights(pending: Pending, probabilities: np.ndarray) -> np.ndarray | None:
    """float32 importance weights over the merged batch, in batch order (``None``: none).

    By priority: ``(p_min / p) ** (alpha beta)`` from the drawn priorities; `Uniform`: all
    1; a mixture: ``(P_min / P) ** beta`` of the global probabilities.
    """
    law = pending.spec.law
    if not pending.spec.weights:
        return None
    if law.by_priority:
        drawn = merged(pending, pending.priorities, np.float64)
        result: np.ndarray = priority_weights(drawn, pending.exponent)
        return result
    if isinstance(law, Uniform):
        return np.ones(pending.spec.batch_size, dtype=np.float32)
    chances = importance_weights(engine.view(torch.from_numpy(probabilities)), pending.beta)
    return np.asarray(engine.tensor(chances).numpy())
