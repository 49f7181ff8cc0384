"""`BatchStream`: what `ShardedReplay.iterate` returns, ``prefetch`` draws kept in flight.

Each request is the two steps of a draw: (1) read the shards' masses and label the batch,
sending each shard its count, (2) collect and merge the replies. The stream starts requests
ahead, so the shards draw (and Ray moves their pieces) while the learner computes on the
batch it has. A shard runs one caller's calls in the order they were sent, so the masses of
a request are read after the previous request's draws on that shard: without other callers
and without a reuse limit, the batches equal successive `sample_windows` calls. Requests
ahead of the oldest are started only when the rate limiter allows them at once.
"""

from __future__ import annotations

import collections
from typing import Any

import lucid_replay.distributed.coordination as coordination
from lucid_replay.batch import WindowBatch

__all__: list[str] = []  # internal module


class BatchStream:
    """An endless iterator of `WindowBatch` es with up to ``prefetch`` draws in flight.

    ``close()`` (also on leaving a ``with`` block or a ``for`` loop) drops the requests in
    flight; their draws still count (reuse limit, rate limiter, ``chunks_sampled``), as a
    single buffer's prefetched batches do.
    """

    def __init__(
        self,
        replay: Any,
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
                self._pending.append(coordination.begin(replay, self._spec, self._timeout))
            while len(self._pending) < self._prefetch:
                ahead = coordination.begin(replay, self._spec, 0.0, optional=True)
                if ahead is None:
                    break
                self._pending.append(ahead)
            batch = coordination.complete(replay, self._pending.popleft(), self._device)
        except BaseException:
            self.close()
            raise
        assert isinstance(batch, WindowBatch)  # a stream draws windows
        return batch

    def close(self) -> None:
        """Stop: forget the requests in flight (their draws were made and counted)."""
        self._closed = True
        self._pending.clear()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
