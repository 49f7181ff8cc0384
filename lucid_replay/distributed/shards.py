"""`ReplayShard`: one shard of a sharded replay, a `PrioritizedSequenceReplay` behind hooks.

The same class runs in-process (``backend="local"``) and as a Ray actor (``backend="ray"``).
Everything it returns is plain data (numpy arrays, ints, floats), with episode ids already
global (`lucid_replay.distributed.ids`). A shard draws only what its coordinator asks for
(`ShardHooks.draw_probed`), from its own tree and its own random stream: its drawing calls
are in `lucid_replay.distributed.shard_draws`, what those and its other parts read of it is
declared in `lucid_replay.distributed.shard_base`.

A shard starts in two steps: its constructor builds an empty buffer, and `open` loads the
file `ShardedReplay.load` gave it (checked: it must be this shard's) and joins the control;
`first_checkpoint` writes its restart file only once every shard of the replay opened, so
a refused load writes nothing. The constructor also runs when Ray restarts a dead shard: it
then reloads its own restart file (or the file it was loaded from) and joins as a new
incarnation at once, so the ids it issues from then on differ from those of the episodes lost
with the previous incarnation. A shard with ``storage="memmap"`` keeps its fields under its
own directory (``directory/shard_<k>``); a restart first removes that directory, then
reloads its restart file into fresh files: the files of the dead incarnation are never
read back (they may hold steps of episodes lost since the restart file was written).

A shard whose buffer has ``segment_length`` also keeps the streams of its open episodes
(`lucid_replay.distributed.shard_streams`), and its segment ids are global too: encoded as
episode ids are, from the starts of its segment ids' incarnations. Its table keeps its rows'
replay-wide commit counters (`lucid_replay.distributed.commits`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

import lucid_replay.distributed.calls as calls
import lucid_replay.distributed.checkpoints as checkpoints
import lucid_replay.distributed.commits as commits
import lucid_replay.distributed.ids as ids
import lucid_replay.distributed.lanes as lanes
import lucid_replay.distributed.options as options
import lucid_replay.distributed.sharing as sharing
import lucid_replay.distributed.transport as transport
from lucid_replay import files, selectors
from lucid_replay.blocks import CACHE_BYTES
from lucid_replay.distributed.hooks import ShardHooks
from lucid_replay.distributed.shard_draws import ShardDraws
from lucid_replay.distributed.shard_streams import ShardStreams
from lucid_replay.episode import Episode
from lucid_replay.prioritized import PrioritizedSequenceReplay
from lucid_replay.schema import Schema
from lucid_replay.streams import EpisodeStream

__all__: list[str] = []  # internal module


class ReplayShard(ShardStreams, ShardDraws):
    """Shard ``index`` of a replay configured by ``settings`` (see `ShardedReplay.create`).

    Parameters
    ----------
    index
        The shard's number, ``0 .. num_shards - 1``.
    settings
        ``capacity`` (of this shard), ``alpha``, ``beta``, ``epsilon``, ``unit``, ``seed``,
        ``max_times_sampled``, ``checkpoint_dir``, ``checkpoint_every``,
        ``segment_length``, ``priority_unit``, ``selector`` and ``schema`` (as checkpoints
        keep them), ``storage``, ``directory`` (this shard's own), ``cache_bytes`` and
        ``replay`` (the running replay's identity, written into its restart files).
    control
        Handle of the replay's `Control`, or the name of its Ray actor.
    restore_path
        A shard file to start from (`ShardedReplay.load`), loaded by `open`.
    restarted
        Whether this is a restart (which reloads and joins at once); ``None`` asks Ray.
    """

    def __init__(
        self,
        index: int,
        settings: dict[str, Any],
        control: Any,
        *,
        restore_path: str | None = None,
        restarted: bool | None = None,
    ) -> None:
        self.index = index
        if isinstance(control, str):  # a Ray shard finds its control by name
            control = calls.named_actor(control)
        self.control = control
        self.settings = settings
        if restarted is None:
            restarted = calls.restarted_actor()
        if restarted:  # its files from before: gone; its restart file refills fresh ones
            options.clear(settings.get("directory"))
        selector, schema = settings.get("selector"), settings.get("schema")
        self.buffer = PrioritizedSequenceReplay(
            settings["capacity"],
            settings["alpha"],
            settings["beta"],
            settings["epsilon"],
            unit=settings["unit"],
            seed=settings["seed"],
            max_times_sampled=settings["max_times_sampled"],
            segment_length=settings.get("segment_length"),
            priority_unit=settings.get("priority_unit", "episode"),
            selector=None if selector is None else selectors.selector_of_state(selector),
            schema=None if schema is None else Schema.from_state(schema),
            storage=settings.get("storage", "memory"),
            directory=settings.get("directory"),
            cache_bytes=settings.get("cache_bytes", CACHE_BYTES),
        )
        self.buffer._core.store.table.keep_commits()  # replay-wide: see `commits`
        self.shared = None  # transport="shared": the allocator of the fields clients map
        if settings.get("shared") is not None:
            if restarted:
                options.clear(settings["shared"])  # fresh files: clients map them anew
            self.shared = sharing.install(self.buffer, settings["shared"])
        self.hooks = ShardHooks(self.buffer)
        self.restore_path = restore_path
        self.incarnation, self.starts = 0, [0]
        self.ranges: list[list[int]] = []  # [first, end) issued by each replaced incarnation
        self.segment_starts: list[int] = [0]  # the same two for its segment ids
        self.segment_ranges: list[list[int]] = []
        self.streams: dict[int, tuple[int, EpisodeStream]] = {}  # open: see ShardStreams
        self.adds_since_checkpoint = 0
        self.lane_server: lanes.LaneServer | None = None  # started by a client's `lane`
        if restarted:
            self._reload()
            self._join(restarted=True)

    def open(self) -> None:
        """First start: load the file of `ShardedReplay.load` (if any), then join.

        Raises
        ------
        CheckpointError
            If that file is not a readable shard file of this shard and configuration.
        """
        if self.restore_path is not None:
            checkpoints.restore_shard(self.buffer, self.restore_path, self.index)
        self._join(restarted=False)

    def first_checkpoint(self) -> None:
        """Write the restart file of a replay just started (with a ``checkpoint_dir``).

        So that a restart never reloads another replay's file.
        """
        if self.settings["checkpoint_dir"] is not None:
            self.checkpoint()

    def _reload(self) -> None:
        """A restart's state: its own restart file, else the file it was loaded from.

        A restart file another replay wrote is never reloaded; the file of `load` is gone
        once a later save into its directory replaced it. Without either, it starts empty.
        """
        own = self._restart_path()
        replay = self.settings["replay"]
        if own is not None and checkpoints.restore_shard(self.buffer, own, self.index, replay):
            return
        if self.restore_path is not None and Path(self.restore_path).is_file():
            checkpoints.restore_shard(self.buffer, self.restore_path, self.index)

    def _join(self, *, restarted: bool) -> None:
        joined = calls.get(self.control.join.remote(self.index, restarted, self._counters()))
        self.incarnation, self.starts, self.ranges, self.segment_starts, self.segment_ranges = (
            joined
        )

    # ------------------------------------------------------------------------ helpers
    def _restart_path(self) -> Path | None:
        directory = self.settings["checkpoint_dir"]
        return None if directory is None else checkpoints.restart_path(directory, self.index)

    def _counters(self) -> tuple[int, int, int, int]:
        """``(next episode id, transitions added, evicted, next segment id)``."""
        buffer = self.buffer
        with buffer._lock:
            store = buffer._core.store
            counts = store.counts
            next_id, next_segment = buffer._next_episode_id, store.table.next_id
            return next_id, counts["transitions_added"], counts["transitions_evicted"], next_segment

    def _global(self, local: np.ndarray) -> np.ndarray:
        return ids.encode(self.index, ids.incarnation_of(local, self.starts), local)

    def _global_segments(self, local: np.ndarray) -> np.ndarray:
        return ids.encode(self.index, ids.incarnation_of(local, self.segment_starts), local)

    def _agree_schema(self, episodes: list[Episode]) -> None:
        """Refuse what the replay's schema refuses; the first episode proposes it."""
        store = self.buffer._core.store
        if store.schema is None and episodes:
            for episode in episodes:  # refuse what the replay's schema refuses
                store.checked_schema(episode, None)
            proposed = episodes[0].schema.to_state()
            agreed = calls.get(self.control.propose_schema.remote(proposed))
            schema = Schema.from_state(agreed)
            for episode in episodes:
                store.checked_schema(episode, schema)

    def _report(self, *, wait: bool = False) -> None:
        """Tell the control about new ids and evictions (``wait``: for its reply)."""
        future = self.control.note.remote(self.index, self.incarnation, self._counters())
        if wait:
            calls.get(future)

    # -------------------------------------------------------------------------- adding
    def add(
        self, packed: list[tuple[dict[str, Any], bool]], call: commits.Call | None = None
    ) -> np.ndarray:
        """Store episodes (all checked first, also against the replay's schema); global ids.

        ``call``: their places in an add over several shards (`commits.committing`).
        """
        episodes = [transport.unpack_episode(p) for p in packed]
        self._agree_schema(episodes)
        # Reported before it returns: the control knows every id before anyone gets one.
        stored = commits.committing(self, lambda: self.buffer.extend(episodes), call)
        local = np.asarray(stored, dtype=np.int64)
        self._stored(len(episodes))
        return ids.encode(self.index, np.full_like(local, self.incarnation), local)

    def _stored(self, episodes: int) -> None:
        """Count ``episodes`` stored (added, or streamed and closed) towards a checkpoint."""
        self.adds_since_checkpoint += episodes
        every = self.settings["checkpoint_every"]
        if every is not None and self.adds_since_checkpoint >= every:
            self.checkpoint()

    # ---------------------------------------------------------------------- priorities
    def update(self, global_ids: np.ndarray, errors: np.ndarray) -> tuple[int, float | None, int]:
        """Route checked ids of this shard: ``(applied, largest priority, skipped entries)``.

        Ids of episodes (segments, under ``priority_unit="segment"``) lost with an earlier
        incarnation, or evicted, are skipped.
        """
        _, incarnation, local = ids.decode(global_ids)
        with self.buffer._lock:
            store = self.buffer._core.store
            if self.buffer._core.priority_unit == "segment":
                starts, next_id = self.segment_starts, store.table.next_id
            else:
                starts, next_id = self.starts, self.buffer._next_episode_id
            live = ids.issued_by(incarnation, local, starts, next_id)
            if store.segments is not None and self.buffer._core.priority_unit == "episode":
                stored = live & (store.segments.directory.slots_of(local) >= 0)
            else:
                stored = live & store.table.is_stored(local)
            applied, largest = self.hooks.update(local[live], errors[live])
        return applied, largest, int((~stored).sum())

    def write_back(
        self,
        name: str,
        global_ids: np.ndarray,
        steps: np.ndarray,
        mask: np.ndarray,
        values: np.ndarray,
    ) -> int:
        """`SequenceReplay.write_back` of the records of this shard's live episodes."""
        shard, incarnation, local = ids.decode(global_ids)
        next_id = self.buffer._next_episode_id
        live = (
            mask & (shard == self.index) & ids.issued_by(incarnation, local, self.starts, next_id)
        )
        values = np.require(values, requirements="W")  # Ray hands over read-only arrays
        with self.buffer._lock:
            if self.shared is not None:
                self.shared.bump()  # a write out of FIFO order: locations handed out are stale
            return self.buffer._core.store.write_records(
                name,
                torch.from_numpy(np.where(live, local, 0)),
                torch.from_numpy(np.asarray(steps, dtype=np.int64)),
                torch.from_numpy(live),
                torch.from_numpy(values),
            )

    def raise_max_priority(self, priority: float) -> None:
        """`ShardHooks.raise_max_priority`."""
        self.hooks.raise_max_priority(priority)

    def max_priority(self) -> float:
        """The largest priority this shard has set or been told."""
        return self.buffer.max_priority

    def anneal_beta(self, fraction: float, final: float) -> None:
        """`PrioritizedSequenceReplay.anneal_beta` (kept with the shard's checkpoints)."""
        self.buffer.anneal_beta(fraction, final)

    # ----------------------------------------------------------------------- reporting
    def issued(self, segments: bool = False) -> tuple[int, int, list[int], list[list[int]]]:
        """``(incarnation, next local id, starts, issued ranges of replaced incarnations)``.

        Of its episode ids, or of its segment ids (``segments``).
        """
        if segments:
            ranges = [list(r) for r in self.segment_ranges]
            next_id = self._counters()[3]
            return self.incarnation, next_id, list(self.segment_starts), ranges
        ranges = [list(r) for r in self.ranges]
        return self.incarnation, self.buffer._next_episode_id, list(self.starts), ranges

    def lane(self) -> tuple[str, bytes]:
        """The address and key of this process's `LaneServer` (started on the first call)."""
        if self.lane_server is None:
            self.lane_server = lanes.LaneServer(self)
        return self.lane_server.address, self.lane_server.key

    def node(self) -> str:
        """The Ray node this shard runs on (for ``transport="auto"``)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def stats(self) -> dict[str, Any]:
        """The buffer's counters plus this shard's incarnation and process."""
        return {
            **self.buffer.stats(),
            "incarnation": self.incarnation,
            "next_local_id": self.buffer._next_episode_id,
            "max_priority": self.buffer.max_priority,
            "pid": calls.process_id(),
        }

    def memory_report(self) -> dict[str, Any]:
        """The shard buffer's `SequenceReplay.memory_report`."""
        return self.buffer.memory_report()

    # --------------------------------------------------------------------- persistence
    def _meta(self, generation: int | None) -> dict[str, Any]:
        return {
            "index": self.index,
            "incarnation": self.incarnation,
            "starts": list(self.starts),
            "issued": [list(r) for r in self.ranges],
            "segment_starts": list(self.segment_starts),
            "segment_issued": [list(r) for r in self.segment_ranges],
            "replay": self.settings["replay"],
            "generation": generation,
        }

    def save(self, directory: str, generation: int) -> dict[str, Any]:
        """Write this shard's file of save ``generation`` into ``directory``; its entry.

        The entry (index, file name, SHA-256 and size) is what the manifest binds. Into the
        ``checkpoint_dir``, the file also becomes the restart file (a hard link, or a copy).
        """
        path = Path(directory) / checkpoints.shard_file(self.index, generation)
        checkpoints.save_shard(self.buffer, path, self._meta(generation))
        entry = checkpoints.entry(path, self.index)
        own = self._restart_path()
        if own is not None and own.parent == path.parent:
            files.link_atomically(path, own)
            self.adds_since_checkpoint = 0  # what a restart reloads is this state now
        return entry

    def checkpoint(self) -> None:
        """Write this shard's restart file into its ``checkpoint_dir`` (what a restart reloads).

        Never a file a manifest binds: restart files have names of their own.
        """
        own = self._restart_path()
        assert own is not None  # only called with a checkpoint_dir
        checkpoints.save_shard(self.buffer, own, self._meta(None))
        self.adds_since_checkpoint = 0
