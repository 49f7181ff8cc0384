"""`Control`: what the shards of one replay share: the rate limiter, the schema, incarnations.

One `Control` serves a sharded replay: in the client's process for ``backend="local"``, as
one Ray actor (threaded, so that a blocked insert never holds up a sample) for
``backend="ray"``. It keeps

* the rate limiter's counters and waits (`RateLimiter`);
* the schema the first stored episode fixed, so that every shard stores the same fields;
* per shard, the first local id of each incarnation (``starts``, which attribute stored ids
  to the incarnation that issued them), the range of local ids each replaced incarnation
  actually issued (``issued``: ``[first, end)``, its end being the ``next_id`` it had
  reported when it was replaced), and the highest id and transition counters the running
  incarnation reported, from which a restart counts what was lost;
* the same marks for each shard's segment ids (``segments``: its table's row keys, which a
  buffer with ``segment_length`` issues per committed segment), so that global segment ids
  are encoded, routed and refused exactly as episode ids (`lucid_replay.distributed.ids`);
* the replay-wide *commit counter* (``committed``): the transitions committed on every shard
  so far, in the order their commits reached the control (an add spread over several shards
  takes one range, its episodes in their order in the add). `commit` issues a shard's commit
  its range, atomically, in the report the shard makes anyway before an add (or a streamed
  append) returns: the shard keeps its rows' places in the range as their commit counters,
  which `Recency` ages them by (`lucid_replay.distributed.commits`).

Reports from shards (`note`) carry cumulative counters of one incarnation and are applied as
maxima, so they may arrive in any order.
"""

from __future__ import annotations

import threading
from typing import Any

import lucid_replay.distributed.ids as ids
from lucid_replay.distributed.limiter import RateLimiter, RateLimiterConfig
from lucid_replay.errors import InvalidArgumentError

__all__: list[str] = []  # internal module

# What a shard's stats add to its buffer's (not summed over shards).
SHARD_EXTRAS = ("incarnation", "next_local_id", "max_priority", "pid")
_MAX_CALLS = 1 << 16  # adds whose parts are still to report, at most (the oldest dropped)


class Control:
    """Shared state of the shards of one replay (thread-safe)."""

    def __init__(self, num_shards: int, limiter: RateLimiterConfig | None) -> None:
        self.limiter = RateLimiter(limiter)
        self._lock = threading.Lock()
        self._schema: dict[str, Any] | None = None
        self._starts: list[list[int]] = [[0] for _ in range(num_shards)]
        # Per shard, [first, end) of the local ids each replaced incarnation issued.
        self._issued: list[list[list[int]]] = [[] for _ in range(num_shards)]
        # Per shard, for its running incarnation: [next_id, transitions added, evicted].
        self._noted: list[list[int]] = [[0, 0, 0] for _ in range(num_shards)]
        self._lost = [{"episodes": 0, "transitions": 0} for _ in range(num_shards)]
        # Per shard, the segment ids' starts, replaced ranges and last reported next id.
        self._segments: list[dict[str, Any]] = [_segment_marks() for _ in range(num_shards)]
        self._committed = 0  # transitions committed on every shard (see `commit`)
        # Adds spread over several shards: token -> [their counter, parts yet to report].
        self._calls: dict[int, list[int]] = {}

    # ------------------------------------------------------------------------ limiter
    def try_acquire(self, n: int, inserting: bool, wait_s: float | None) -> bool:
        """`RateLimiter.try_acquire`."""
        return self.limiter.try_acquire(n, inserting=inserting, wait_s=wait_s)

    def commit_insert(self, stored: int, refused: int) -> None:
        """`RateLimiter.commit_insert`: an add's shards replied."""
        self.limiter.commit_insert(stored, refused)

    def release(self, samples: int = 0) -> None:
        """Undo the counted samples of a refused draw."""
        self.limiter.release(samples=samples)

    # ------------------------------------------------------------------------- schema
    def propose_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        """The replay's schema: the first one proposed (as ``Schema.to_state``)."""
        with self._lock:
            if self._schema is None:
                self._schema = schema
            return self._schema

    def schema(self) -> dict[str, Any] | None:
        """The replay's schema, ``None`` before the first stored episode."""
        return self._schema

    # ------------------------------------------------------------------ incarnations
    def join(
        self, shard: int, restarted: bool, counters: tuple[int, ...]
    ) -> tuple[int, list[int], list[list[int]], list[int], list[list[int]]]:
        """A shard (re)starting with ``counters`` = (next_id, added, evicted, next segment).

        Returns its incarnation, the starts of every incarnation and the issued ranges of
        the replaced ones, then the same two for its segment ids. A restart opens a new
        incarnation from the restored ``next_id`` (and next segment id), closes the previous
        one's range at the ``next_id`` it last reported (every id it handed out was reported
        first: `note`), and counts what the restored state lacks.
        """
        with self._lock:
            starts = self._starts[shard]
            if restarted:
                if len(starts) >= ids.MAX_INCARNATIONS:
                    raise InvalidArgumentError(
                        f"shard {shard} restarts must be < {ids.MAX_INCARNATIONS}, got "
                        f"{len(starts)}: its ids have no incarnation bits left"
                    )
                next_id, added, evicted = counters[:3]
                last_id, last_added, last_evicted = self._noted[shard]
                lost_episodes = max(last_id - next_id, 0)
                lost = (last_added - last_evicted) - (added - evicted)
                self._lost[shard]["episodes"] += lost_episodes
                self._lost[shard]["transitions"] += max(lost, 0)
                self.limiter.release(deletes=lost)
                _restart(starts, self._issued[shard], last_id, next_id)
                segments = self._segments[shard]  # the same marks for its segment ids
                _restart(segments["starts"], segments["issued"], segments["noted"], counters[3])
            segments = self._segments[shard]
            segments["noted"] = counters[3]
            self._noted[shard] = list(counters[:3])
            issued = [list(r) for r in self._issued[shard]]
            segment_ranges = [list(r) for r in segments["issued"]]
            return len(starts) - 1, list(starts), issued, list(segments["starts"]), segment_ranges

    def note(self, shard: int, incarnation: int, counters: tuple[int, ...]) -> None:
        """A shard's cumulative (next_id, added, evicted, next segment id).

        Evictions count as deletes. A shard reports new ids before it hands them out, so
        that the end of what an incarnation issued is known when it is replaced.
        """
        with self._lock:
            evicted = self._noted_locked(shard, incarnation, counters)
        if evicted > 0:
            self.limiter.release(deletes=evicted)

    def _noted_locked(self, shard: int, incarnation: int, counters: tuple[int, ...]) -> int:
        """`note` under the lock: the transitions evicted since the last report."""
        if incarnation != len(self._starts[shard]) - 1:
            return 0  # a report of an incarnation already replaced
        noted = self._noted[shard]
        evicted = counters[2] - noted[2]
        self._noted[shard] = [max(a, b) for a, b in zip(noted, counters[:3], strict=True)]
        segments = self._segments[shard]
        segments["noted"] = max(segments["noted"], counters[3])
        return evicted

    def commit(
        self,
        shard: int,
        incarnation: int,
        counters: tuple[int, ...],
        transitions: int,
        call: tuple[int, int, int] | None = None,
    ) -> int:
        """`note`, for a shard that just committed ``transitions``: the replay-wide counter before.

        The counter then grows by ``transitions``, in one step under the lock, so that every
        commit of every shard (whichever client or stream sent it) gets its own range of the
        replay's count, in the order the commits reach the control. A row committed ``t``
        transitions into the range has commit counter ``counter + t``.

        ``call``: ``(token, total, parts)`` of an add the client spread over ``parts``
        shards, ``total`` transitions in all. Its first part to report takes the range of
        the whole add; every part gets the same counter (each shard places its episodes in
        the range by their order in the add), and the token is forgotten once all
        ``parts`` reported.
        """
        with self._lock:
            if call is None:
                counter = self._committed
                self._committed += transitions
            else:
                token, total, parts = call
                entry = self._calls.get(token)
                if entry is None:
                    entry = self._calls[token] = [self._committed, parts]
                    self._committed += total
                    if len(self._calls) > _MAX_CALLS:  # parts of failed adds never report
                        del self._calls[next(iter(self._calls))]
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._calls[token]
                counter = entry[0]
            evicted = self._noted_locked(shard, incarnation, counters)
        if evicted > 0:
            self.limiter.release(deletes=evicted)
        return counter

    # ---------------------------------------------------------------------- reporting
    def state(self) -> dict[str, Any]:
        """Limiter counters, schema, incarnations and losses (for `stats` and checkpoints)."""
        with self._lock:
            return {
                "limiter": self.limiter.state(),
                "schema": self._schema,
                "starts": [list(s) for s in self._starts],
                "issued": [[list(r) for r in ranges] for ranges in self._issued],
                "noted": [list(n) for n in self._noted],
                "lost": [dict(lost) for lost in self._lost],
                "segments": [_segment_marks(**marks) for marks in self._segments],
                "committed": self._committed,
            }

    def restore(self, state: dict[str, Any]) -> None:
        """Adopt a `state` saved with a replay of as many shards (checked by the caller).

        A state saved before issued ranges were kept has none: each replaced incarnation is
        then taken to have issued every local id from its start on (its ids past the next
        start count as lost, never as refused). A state saved before segment marks were
        kept is of a replay without segments, whose segment ids are its episode ids. One
        saved before the commit counter was kept counts the transitions its shards added.
        """
        with self._lock:
            self.limiter.restore(state["limiter"])
            self._schema = state["schema"]
            self._starts = [list(s) for s in state["starts"]]
            if "issued" in state:
                self._issued = [[list(r) for r in ranges] for ranges in state["issued"]]
            else:
                unbounded = ids.MAX_LOCAL + 1
                self._issued = [[[s, unbounded] for s in starts[:-1]] for starts in self._starts]
            self._noted = [list(n) for n in state["noted"]]
            self._lost = [dict(lost) for lost in state["lost"]]
            if "segments" in state:
                self._segments = [_segment_marks(**marks) for marks in state["segments"]]
            else:
                self._segments = [
                    _segment_marks(starts, issued, noted[0])
                    for starts, issued, noted in zip(
                        self._starts, self._issued, self._noted, strict=True
                    )
                ]
            added = sum(noted[1] for noted in self._noted)
            self._committed = int(state.get("committed", added))


def _segment_marks(
    starts: list[int] | None = None, issued: list[list[int]] | None = None, noted: int = 0
) -> dict[str, Any]:
    """A shard's segment-id marks (copies): starts, replaced ranges, last reported next id."""
    return {
        "starts": [0] if starts is None else list(starts),
        "issued": [] if issued is None else [list(r) for r in issued],
        "noted": int(noted),
    }


def _restart(starts: list[int], issued: list[list[int]], last: int, restored: int) -> None:
    """Open an incarnation from ``restored``; close the last one's range at ``last``.

    Ids at or above ``restored`` were lost, whichever incarnation issued them: no start may
    lie past it (a restart from an older checkpoint than the last start).
    """
    issued.append([starts[-1], max(last, starts[-1])])
    starts[:] = [min(start, restored) for start in starts]
    starts.append(restored)


def summary(
    per_shard: list[dict[str, Any]], shared: dict[str, Any], skipped: int, *, limited: bool
) -> dict[str, Any]:
    """`ShardedReplay.stats`: the shards' counters summed, losses, per-shard detail."""
    keys = [k for k in per_shard[0] if k not in SHARD_EXTRAS]
    totals = {key: sum(s[key] for s in per_shard) for key in keys}
    return {
        **totals,
        "episodes_lost": sum(lost["episodes"] for lost in shared["lost"]),
        "transitions_lost": sum(lost["transitions"] for lost in shared["lost"]),
        "priority_updates_skipped": skipped,
        "shards": per_shard,
        "limiter": shared["limiter"] if limited else None,
    }
