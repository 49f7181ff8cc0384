"""Parts of the `ShardedReplay` client: its transport, ``transport_stats``, and the cleanup.

``transport="auto"`` is resolved on the client's first draw (and again in a copy unpickled
elsewhere): ``"shared"`` when every shard runs on the client's node (``backend="local"``
always does; on Ray the actors' node ids are compared with the client's) and no field is
compressed, else ``"object"``.
"""

from __future__ import annotations

import os
import shutil
import weakref
from typing import Any

import lucid_replay.distributed.backends as backends
import lucid_replay.distributed.calls as calls
import lucid_replay.distributed.deferred as deferred
import lucid_replay.distributed.options as options
from lucid_replay.batch_memory import Blocks
from lucid_replay.distributed.client_state import ClientState, TransportStats, client_of
from lucid_replay.distributed.lanes import Lane, LaneHandle
from lucid_replay.distributed.mapped import Mapped

__all__: list[str] = []  # internal module


def _remove_shared(root: str, creator: int) -> None:
    """Remove ``root``, in the process that created it only.

    A child forked from that process inherits the client and its finalizer, which the
    child's exit would run: it must not remove the files the parent's shards still use.
    """
    if os.getpid() == creator:
        shutil.rmtree(root, ignore_errors=True)


class ClientTransport:
    """How batches reach this client, what that cost, and what it leaves behind."""

    _config: dict[str, Any]
    _shards: list[Any]
    _lock: Any
    _root: str | None
    _resolved: str | None
    _mapped: dict[int, Mapped]
    _transport_stats: TransportStats
    _state: ClientState
    _blocks: Blocks

    def _init_transport(self, root: str | None) -> None:
        self._root = root
        # Shared files live in memory (/dev/shm) until removed: the client that made them
        # removes them on `close`, and also when it is dropped without one (or at exit).
        # A copy (root None) never does, nor does a forked child (see `_remove_shared`).
        self._cleanup = (
            None if root is None else weakref.finalize(self, _remove_shared, root, os.getpid())
        )
        self._resolved = None
        self._mapped = {}
        self._transport_stats = TransportStats()
        self._blocks = Blocks()  # the memory of gathered batches, reused once unreferenced
        self._lanes: list[Lane | None] = [None] * len(self._shards)
        self._lane_handles: list[Any] = []

    @property
    def transport(self) -> str:
        """How window batches reach this client: ``"shared"`` or ``"object"`` (resolved)."""
        if self._resolved is None:
            self._resolved = self._resolve()
            self._transport_stats.transport = self._resolved
        return self._resolved

    def _resolve(self) -> str:
        asked = self._config.get("transport", "object")
        if asked == "object" or options.shared_directory(self._config, 0, "-") is None:
            return "object"
        if asked == "shared":
            return "shared"
        here = backends.client_node(self._config["backend"])
        same = all(backends.node_of(shard) in (None, here) for shard in self._shards)
        return "shared" if same else "object"

    def _shared(self) -> bool:
        return self.transport == "shared"

    def _draw_handles(self) -> list[Any]:
        """The handles a draw calls: lanes to a shared Ray client's shards, else the shards.

        A lane is opened on the first draw, and again after it broke (`lanes`).
        """
        if self._config["backend"] != "ray" or not self._shared():
            return self._shards
        broken = [k for k, lane in enumerate(self._lanes) if lane is None or not lane.usable]
        if broken or not self._lane_handles:
            addresses = calls.get([self._shards[k].lane.remote() for k in broken])
            for k, (address, key) in zip(broken, addresses, strict=True):
                self._lanes[k] = Lane(address, key)
            self._lane_handles = [LaneHandle(lane) for lane in self._lanes if lane is not None]
        return self._lane_handles

    def _call_handles(self) -> list[Any]:
        """The shards' handles for any call but a draw.

        The replies of this client's draws in flight on lanes are read first: the shards
        ran them, and run this call after them, in the order this client sent them.
        """
        for lane in self._lanes:
            if lane is not None and lane.usable:
                lane.settle()
        return self._shards

    def transport_stats(self) -> dict[str, Any]:
        """What the transport cost: bytes copied, seconds, torn reads; cumulative and last.

        Keys: ``transport`` (``"shared"`` or ``"object"``), ``batches``; ``bytes_copied``
        (cumulative), ``bytes_copied_last``, ``bytes_copied_mean``: bytes written to make
        each batch, counting every copy of it: with ``"shared"`` the client's gather into
        the batch (each byte once; a redrawn window again); with ``"object"`` the shard's
        gather, Ray's copy into its object store (``backend="ray"``) and the client's merge;
        ``batch_bytes_last`` (the bytes of the last batch's tensors) and ``copy_ratio_last``
        (bytes copied / batch bytes); ``draw_seconds`` (cumulative), ``_last``, ``_mean``:
        the client's time starting draws and waiting for the shards' replies;
        ``gather_seconds`` (cumulative), ``_last``, ``_mean``: its time gathering or merging
        them into the batch; ``torn_reads`` (cumulative) and ``torn_reads_last``: windows
        found torn (records evicted or overwritten during the copy); ``windows_redrawn`` and
        ``windows_invalidated``: what ``torn=`` did with them; ``updates_ridden``: priority
        updates (``defer=True``) that rode a draw request.
        """
        self.transport  # noqa: B018  # resolved, so that the report names it
        return self._transport_stats.report()

    def _flush_updates(self) -> None:
        """Send the priority updates queued with ``defer=True`` now."""
        if any(self._state.deferred):
            deferred.flush(client_of(self))

    def _release_shared(self) -> None:
        """Forget the mappings; remove the shared files of ``storage="memory"`` shards."""
        self._mapped = {}
        lanes, self._lanes, self._lane_handles = self._lanes, [None] * len(self._shards), []
        for lane in lanes:
            if lane is not None:
                lane.close()
        if self._cleanup is not None:
            self._cleanup()  # once: a finalizer runs at most once
