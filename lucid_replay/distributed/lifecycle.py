"""Parts of the `ShardedReplay` client: closing, ``with`` blocks, pickling; priorities."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

import lucid_replay.distributed.backends as backends
import lucid_replay.distributed.calls as calls
import lucid_replay.distributed.routing as routing
from lucid_replay.batch import Batch, WindowBatch
from lucid_replay.checks import check_bool
from lucid_replay.distributed.client_state import ClientState, client_of
from lucid_replay.errors import must
from lucid_replay.priorities import annealed_beta

__all__: list[str] = []  # internal module


class ClientLife:
    """`close`, the context manager and pickling of a sharded replay's client."""

    _closed: bool
    _config: dict[str, Any]
    _shards: list[Any]
    _control: Any
    _state: ClientState

    def close(self) -> None:
        """Stop the shards (Ray actors end); the client refuses calls afterwards.

        With ``transport="shared"`` the shards' files under ``/dev/shm`` are removed; a client
        dropped without ``close`` removes them when it is garbage-collected (or at exit).
        """
        if self._closed:
            return
        try:
            self._flush_updates()  # type: ignore[attr-defined]  # ClientTransport's
        finally:
            self._closed = True
            for handle in [*self._shards, self._control]:
                backends.kill(handle)
            self._release_shared()  # type: ignore[attr-defined]

    def _check_open(self) -> None:
        if self._closed:
            raise must("the replay", "open (not closed)", "closed")

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = backends.pickled(self._config["backend"], self.__dict__)
        return {**state, "_state": self._state.for_copy()}  # no generator state, no queues

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._state = self._state.for_copy()  # a copy draws its own labels
        self._init_transport(None)  # type: ignore[attr-defined]  # resolved again here


class ClientPriorities:
    """Priority updates routed to the shards, and beta annealed on every shard."""

    _config: dict[str, Any]
    _shards: list[Any]
    _call_handles: Callable[[], list[Any]]  # `ClientTransport._call_handles`
    _state: ClientState
    epsilon: float

    def _check_open(self) -> None:
        raise NotImplementedError  # `ClientLife._check_open`

    def update_priorities(self, indices: Any, errors: Any, *, defer: bool = False) -> int:
        """Set priorities of global ids ``indices`` to ``|errors| + epsilon``, routed by id.

        Episode ids, or segment ids under ``priority_unit="segment"`` (``batch.indices``).
        ``defer=True`` checks the update now and sends it with the next draw request (no
        round trip of its own; `lucid_replay.distributed.deferred`): it then returns how
        many distinct ids were queued. `stats`, `save`, `close` and an update without
        ``defer`` send the queued updates first.

        Evicted ids and ids lost with a shard's earlier incarnation are skipped (counted in
        ``stats()["priority_updates_skipped"]``); duplicates take the max. Returns how many
        distinct episodes were applied. The maximum priority stays global: new episodes on
        every shard start at the largest priority set anywhere.

        Raises
        ------
        InvalidArgumentError
            For lengths that differ, a NaN or infinite error, or an id no shard issued;
            nothing is updated on any shard then.
        """
        self._check_open()
        if check_bool("defer", defer):
            return routing.defer_update(client_of(self), indices, errors)
        return routing.update(client_of(self), indices, errors)

    def update_priorities_from(
        self,
        batch: WindowBatch,
        errors: Any,
        *,
        eta: float = 0.9,
        mask: Any = None,
        defer: bool = False,
    ) -> int:
        """R2D2's per-window priorities from per-record errors, routed to the shards.

        As `PrioritizedSequenceReplay.update_priorities_from` (``eta * max + (1 - eta) *
        mean`` over the counted records; ``[B]`` errors as they are). ``defer``: as in
        `update_priorities`.
        """
        self._check_open()
        defer = check_bool("defer", defer)
        return routing.from_batch(client_of(self), batch, errors, eta=eta, mask=mask, defer=defer)

    def write_back(self, batch: Batch | WindowBatch, name: str, values: torch.Tensor) -> int:
        """Write per-record ``values`` ``[B, W, ...]`` into stored field ``name``, per shard.

        As `SequenceReplay.write_back` (refreshed recurrent states): records of episodes
        evicted or lost since the draw are skipped. Returns how many records were written.
        """
        self._check_open()
        return routing.write_back(client_of(self), batch, name, values)

    def anneal_beta(self, fraction: float, final: float = 1.0) -> None:
        """``beta = beta0 + fraction * (final - beta0)`` on the client and every shard."""
        beta = annealed_beta(self._config["beta"], fraction, final)  # checks both first
        self._check_open()
        calls.get([s.anneal_beta.remote(fraction, final) for s in self._call_handles()])
        self._state.beta = beta
