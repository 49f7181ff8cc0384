"""Priority updates that ride the next draw request instead of a round trip of their own.

`ShardedReplay.update_priorities(..., defer=True)` checks the update at once (a refused one
queues nothing), then queues it per shard; the next draw's first request (the shards' masses,
`ShardHooks` ``info``) carries each shard's queue, which the shard applies, in order, before
reading its masses. So the update lands where it would have without ``defer`` (before the
next draw reads the priorities), minus one round trip per batch. A queue is flushed (sent on
its own) before any call that must see it: a priority update without ``defer``, `stats`,
`save` and `close`. A new global maximum priority reaches the other shards when the replies
come back, as with an update of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import lucid_replay.distributed.calls as calls
from lucid_replay.distributed.client_state import Client, Queued

__all__: list[str] = []  # internal module


def queue(replay: Client, id_values: np.ndarray, values: np.ndarray, shard_of: np.ndarray) -> int:
    """Queue a checked update per shard; returns how many distinct ids it holds."""
    with replay._lock:
        queues: list[Queued] = replay._state.deferred
        for k in np.unique(shard_of).tolist():
            mine = shard_of == k
            queues[k].append((id_values[mine], values[mine]))
    return int(np.unique(id_values).size)


def take(replay: Client) -> list[Queued | None]:
    """Each shard's queued updates (``None``: none), the queues emptied."""
    queues: list[Queued] = replay._state.deferred
    taken: list[Queued | None] = [queue or None for queue in queues]
    replay._state.deferred = [[] for _ in queues]
    return taken


def settle(replay: Client, infos: list[dict[str, Any]]) -> None:
    """Account for the updates that rode the requests answered by ``infos``."""
    replies = [reply for info in infos for reply in info.get("updated", ())]
    if replies:
        replay._transport_stats.updates_ridden += len(replies)
        settle_replies(replay, replies)


def settle_replies(replay: Client, replies: list[Any]) -> int:
    """Skipped ids counted, the maximum priority made global; returns how many applied."""
    applied = sum(reply[0] for reply in replies)
    replay._state.skipped += sum(reply[2] for reply in replies)
    largest = max((reply[1] for reply in replies if reply[1] is not None), default=None)
    if largest is not None and largest > replay._state.global_max:
        # Every shard's new episodes start at the global maximum once this returns.
        replay._state.global_max = largest
        calls.get([shard.raise_max_priority.remote(largest) for shard in replay._call_handles()])
    return int(applied)


def flush(replay: Client) -> None:
    """Send every queued update now, each shard's in order."""
    with replay._lock:
        queued = take(replay)
        replay._state.changes += any(queued)
        shards = replay._call_handles()
        futures = [
            shards[k].update.remote(ids, errors)
            for k, queue in enumerate(queued)
            for ids, errors in queue or ()
        ]
        if futures:
            settle_replies(replay, calls.get(futures))
