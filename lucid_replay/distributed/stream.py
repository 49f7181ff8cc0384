"""`BatchStream`: what `ShardedReplay.iterate` returns, draws kept in flight.

Each draw reads the shards' masses, labels the batch (each shard its count), then collects
the replies. A stream chains its draws: every draw call also has its shard report its
masses as they stand *after* that draw (and after the priority updates that rode it), and
as soon as the replies of one draw are in (before its batch is put together), the next
draw is labelled from those reports and sent. So a batch costs one round trip to each
shard, not two, and the shards draw the next batch while this client gathers and the
learner computes. A shard runs one caller's calls in the order they were sent, so the
reported masses are exactly the ones the next draw meets, unless something else reached
the shards in between: this client's own adds, undeferred priority updates and other
draws are counted (`ClientState.changes`), and after any of them the next draw reads
the masses afresh (as does the first). Without other callers, the batches equal
successive `sample_windows` calls, but for the priority updates: queued ones
(``update_priorities(..., defer=True)``) ride the next draw call and apply after it, one
batch later than a call of their own would. One draw is in flight while the learner holds
a batch, whatever ``prefetch`` (a second one could not be labelled before the first
reports).
"""

from __future__ import annotations

import collections
from typing import Any

import lucid_replay.distributed.coordination as coordination
from lucid_replay.batch import WindowBatch
from lucid_replay.distributed.client_state import Client

__all__: list[str] = []  # internal module


class BatchStream:
    """An endless iterator of `WindowBatch` es, the next draw in flight (see the module).

    ``close()`` (also on leaving a ``with`` block or a ``for`` loop) drops the requests in
    flight; their draws still count (reuse limit, rate limiter, ``chunks_sampled``), as a
    single buffer's prefetched batches do.
    """

    def __init__(
        self,
        replay: Client,
        spec: Any,
        prefetch: int,
        device: Any,
        timeout: float | None,
    ) -> None:
        self._replay = replay
        self._spec = spec
        self._prefetch = prefetch
        self._device = device
        self._timeout = timeout
        self._pending: collections.deque[Any] = collections.deque()
        self._closed = False

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> WindowBatch:
        if self._closed:
            raise StopIteration
        replay = self._replay
        try:
            if not self._pending:
                self._pending.append(self._begin(self._timeout, None, optional=False))
            oldest = self._pending.popleft()
            batch = coordination.complete(replay, oldest, self._device, self._chain)
        except BaseException:
            self.close()
            raise
        assert isinstance(batch, WindowBatch)  # a stream draws windows
        return batch

    def _begin(self, timeout: float | None, reports: Any, *, optional: bool) -> Any:
        return coordination.begin(
            self._replay, self._spec, timeout, optional, stream=True, infos=reports
        )

    def _chain(self, done: Any) -> None:
        """A draw's replies are in: start the next draw, from its reports while current."""
        # Current while this client made no call since that may change the masses.
        current = done.changes == self._replay._state.changes
        reports = [done.infos[k] for k in range(len(done.infos))] if current else None
        ahead = self._begin(0.0, reports, optional=True)
        if ahead is not None:
            self._pending.append(ahead)

    def close(self) -> None:
        """Stop: forget the requests in flight (their draws were made and counted)."""
        self._closed = True
        self._pending.clear()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
