"""`ShardStreams`: the open episodes a shard streams, for `ShardedEpisodeStream` clients.

A shard whose buffer has ``segment_length`` keeps one `EpisodeStream` per open episode it
issued, keyed by the episode's global id, with a *handle* (a number the shard issues) naming
the client stream allowed to write it: `resume_episode` gives the episode a new handle, so an
earlier client stream of it is refused, as the single buffer refuses a superseded stream. A
shard that restarts, and a replay that is loaded, keep the open episodes (their committed
steps) but no streams: a client resumes them by id.

Clients send whole segments (``k * segment_length`` steps) with `append_steps`, and a shorter
last piece only with ``flush`` or ``terminated``; so the shard's streams never hold pending
steps between calls, and the segments committed are those a single buffer commits for the
same steps in any pieces. Each call reports the shard's counters to the control before it
returns (new ids, evictions), as `ReplayShard.add` does, and its segments get replay-wide
commit counters as an add's episodes do (`lucid_replay.distributed.commits`).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

import numpy as np

import lucid_replay.distributed.commits as commits
import lucid_replay.distributed.ids as ids
import lucid_replay.distributed.transport as transport
from lucid_replay.distributed.shard_base import ShardBase
from lucid_replay.errors import InvalidArgumentError, UnknownEpisodeError, must
from lucid_replay.streams import EpisodeInfo, EpisodeStream

if TYPE_CHECKING:
    from lucid_replay.episode import Episode

__all__: list[str] = []  # internal module


class ShardStreams(ShardBase):
    """The streaming calls of `ReplayShard` (mixed in; see `ShardBase`)."""

    # ---------------------------------------------------------------------------- calls
    def open_episode(self) -> tuple[int, int]:
        """Open an episode: ``(its global id, the handle of the client stream writing it)``.

        Raises
        ------
        InvalidArgumentError
            On a buffer without ``segment_length``.
        """
        stream = self.buffer.open_episode()
        local = np.asarray(stream.episode_id, dtype=np.int64)
        episode_id = int(ids.encode(self.index, np.asarray(self.incarnation), local))
        self._report(wait=True)  # the control knows the id before anyone gets it
        return episode_id, self._keep(episode_id, stream)

    def resume_episode(self, episode_id: int) -> int:
        """Continue open episode ``episode_id`` (global): the new client stream's handle.

        Earlier client streams of the episode may no longer write.

        Raises
        ------
        UnknownEpisodeError
            For an id this shard's running state does not hold (evicted, lost with an
            earlier incarnation, never issued).
        InvalidArgumentError
            For a closed episode.
        """
        local = self._local(episode_id)
        stream = self.buffer.resume_episode(local)
        return self._keep(episode_id, stream)

    def _keep(self, episode_id: int, stream: EpisodeStream) -> int:
        # Random, not counted: a restarted shard must not hand out a handle again that a
        # client stream of its previous incarnation still holds.
        handle = secrets.randbits(62)
        self.streams[episode_id] = (handle, stream)
        return handle

    def append_steps(
        self,
        episode_id: int,
        handle: int,
        steps: dict[str, Any] | None,
        flush: bool,
        terminated: bool | None,
    ) -> np.ndarray:
        """Append ``steps`` to the episode, then flush, or close it (``terminated``).

        ``steps`` (name -> array ``[n, ...]``, or ``None``) are whole segments, or fewer
        than ``segment_length`` steps with ``flush`` or ``terminated``. Returns the global
        ids of the segments committed (not those a ``close`` commits). The steps are checked
        whole before anything is committed: a refused call changes nothing.

        Raises
        ------
        InvalidArgumentError
            If the handle is not the episode's (its stream was superseded by
            `resume_episode`, a restarted shard or a loaded replay), or for steps the
            replay's schema refuses.
        """
        kept = self.streams.get(episode_id)
        if kept is None or kept[0] != handle:
            raise InvalidArgumentError(
                f"the stream of episode {episode_id} must be the one writing it, got a stream "
                "superseded by resume_episode, by a restarted shard or by a loaded replay"
            )
        stream = kept[1]
        committed: list[int] = []
        episode = None if steps is None else transport.unpack_episode((steps, False))
        if episode is not None:
            self._agree_schema([episode])

        def work() -> None:
            if episode is not None:
                store = self.buffer._core.store
                store.checked_schema(episode, store.schema)
                committed.extend(self._commit(stream, episode))
            if flush:
                key = stream.flush()
                committed.extend([] if key is None else [key])
            if terminated is not None:
                stream.close(terminated=terminated)
                del self.streams[episode_id]

        commits.committing(self, work)  # reported, with the segments' commit counters
        if terminated is not None:
            self._stored(1)
        return self._global_segments(np.asarray(committed, dtype=np.int64))

    def _commit(self, stream: EpisodeStream, episode: Episode) -> list[int]:
        """Append checked steps in pieces of whole segments that fit the buffer at once."""
        length = self.buffer.segment_length
        assert length is not None  # streams exist on segmented buffers only
        piece = max(self.buffer.capacity // length, 1) * length
        committed: list[int] = []
        for begin in range(0, len(episode), piece):
            part = {name: t[begin : begin + piece] for name, t in episode.steps.items()}
            committed += stream.append(part)
        return committed

    # -------------------------------------------------------------------------- lookups
    def open_episode_ids(self) -> list[int]:
        """Global ids of the buffer's open episodes, in id order."""
        local = np.asarray(self.buffer.open_episode_ids, dtype=np.int64)
        return [int(i) for i in self._global(local)]

    def episode_info(self, episode_id: int) -> EpisodeInfo:
        """`SequenceReplay.episode_info` of global ``episode_id``."""
        return self.buffer.episode_info(self._local(episode_id))

    def _local(self, episode_id: int) -> int:
        """The local id of a live episode of this shard, else `UnknownEpisodeError`."""
        shard, incarnation, local = (int(v[0]) for v in ids.decode(np.asarray([episode_id])))
        live = shard == self.index and bool(
            ids.issued_by(
                np.asarray([incarnation]),
                np.asarray([local]),
                self.starts,
                self.buffer._next_episode_id,
            )[0]
        )
        segments = self.buffer._core.store.segments
        if segments is None:
            raise must("segment_length", "set (an int) to stream episodes", None)
        if not live or segments.directory.slot_of(local) < 0:
            raise UnknownEpisodeError(
                f"episode_id must be an open or stored episode of this replay, got "
                f"{episode_id}: it was evicted, lost with a restarted shard, or never issued"
            )
        return local
