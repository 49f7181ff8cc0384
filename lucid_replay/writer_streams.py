"""How `EpisodeWriter` hands finished records to its buffer: whole episodes, or streams.

A whole-episode buffer gets each episode by ``add`` when it ends. A segmented buffer (one with
a ``segment_length`` ``L`` and ``open_episode``, see `SequenceReplay.open_episode`) gets every env's
episode through an `EpisodeStream`: `EnvStreams` keeps the open stream of each env, opened
when the episode first sends records, fed whole segments of ``L`` records while the episode
runs and its last records when it ends. `offer` is the one loop that stores the episodes a
writer call finished and reports what the buffer refused. This module imports only checks,
episode and errors from lucid_replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from lucid_replay.checks import check_int
from lucid_replay.episode import Episode
from lucid_replay.errors import EpisodesNotStoredError

__all__: list[str] = []  # internal module


def segment_length_of(buffer: Any) -> int | None:
    """``buffer.segment_length`` if ``buffer`` streams episodes (it has ``open_episode``).

    None for a buffer without either (a whole-episode `SequenceReplay`, a remote client, any
    object with ``add`` only): the writer then adds whole episodes.
    """
    length = getattr(buffer, "segment_length", None)
    if length is None or not callable(getattr(buffer, "open_episode", None)):
        return None
    return check_int("buffer.segment_length", length, minimum=1)


class WholeEpisodes:
    """Where an `EpisodeWriter` stores episodes on a buffer without streams: ``add``.

    The writer's one interface to its buffer (`EnvStreams` is the other kind): ``streamed[i]``
    counts the steps env ``i``'s open episode has stored already (always 0 here), `finish`
    stores an ended episode, `abandon` forgets envs' open episodes.
    """

    segment_length: int | None = None  # None: nothing is sent before an episode ends

    def __init__(self, buffer: Any, num_envs: int) -> None:
        self.buffer = buffer
        self.streamed = np.zeros(num_envs, dtype=np.int64)

    def finish(self, env: int, episode: Episode) -> Any:
        """Store env ``env``'s ended ``episode``; return the id the buffer issued."""
        return self.buffer.add(episode)

    def abandon(self, envs: Iterable[int]) -> None:
        """Forget the open episodes of ``envs``: nothing of them is stored yet."""


class EnvStreams(WholeEpisodes):
    """The open `EpisodeStream` of each env of an `EpisodeWriter`, on a segmented buffer.

    A stream is opened by the first `append` of its episode, so an episode that ends before
    sending any record costs no id, and a reset with no step opens nothing.
    """

    def __init__(self, buffer: Any, num_envs: int, segment_length: int) -> None:
        super().__init__(buffer, num_envs)
        self.segment_length: int = segment_length
        self.streams: list[Any] = [None] * num_envs

    def append(self, env: int, steps: Mapping[str, Any]) -> None:
        """Append ``steps`` (``[n, ...]`` each) to env ``env``'s stream, opened if needed.

        If the buffer refuses the append, a stream this call opened is kept (`abandon` it).
        """
        stream = self.streams[env]
        if stream is None:
            stream = self.buffer.open_episode()
            self.streams[env] = stream
        stream.append(steps)
        self.streamed[env] += int(next(iter(steps.values())).shape[0])

    def spill(
        self,
        envs: np.ndarray,
        counts: np.ndarray,
        parts: Mapping[str, Any],
        zeroed: set[str],
        finished: list[int],
        tally: dict[str, int],
    ) -> tuple[dict[int, Exception], dict[int, Episode]]:
        """Append records ``0 .. counts[k] - 1`` of ``parts`` to env ``envs[k]``'s stream.

        ``parts``: field -> ``[k, W, ...]`` records of the envs, ``W > max(counts)``, record
        ``counts[k]`` the observation env ``envs[k]`` reached. ``finished`` gains each env when
        done with (kept on an interrupt); ``tally`` (the writer's counts) the records stored.
        A refused env's episode is cut (see `abandon`); it is returned, by env, with its
        error: records ``0 .. counts[k]``, the fields ``zeroed`` zero in the last one.
        """
        refused: dict[int, Exception] = {}
        kept: dict[int, Episode] = {}
        for k, (env, count) in enumerate(zip(envs.tolist(), counts.tolist(), strict=True)):
            try:
                self.append(env, {name: part[k, :count] for name, part in parts.items()})
            except Exception as error:  # reported by the writer's call
                self.abandon([env])
                for name in zeroed:
                    parts[name][k, count] = 0  # a gathered copy: the slot held nothing yet
                refused[env] = error
                kept[env] = Episode({name: part[k, : count + 1] for name, part in parts.items()})
                tally["episodes_dropped"] += 1
            else:
                tally["records_added"] += count
            finished.append(env)
        return refused, kept

    def finish(self, env: int, episode: Episode) -> int:
        """Append ``episode`` (env ``env``'s last records) and close; return the episode id.

        If the buffer refuses either, env ``env``'s stream is `abandon`-ed before the error
        propagates: its committed segments stay, closed as truncated.
        """
        try:
            self.append(env, episode.steps)
            stream = self.streams[env]
            stream.close(terminated=episode.terminated)
        except BaseException:
            self.abandon([env])
            raise
        self.streams[env] = None
        self.streamed[env] = 0
        return int(stream.episode_id)

    def abandon(self, envs: Iterable[int]) -> None:
        """Forget the streams of ``envs``, closing those still open with ``terminated=False``.

        Their committed segments stay, as a truncated episode. Best effort (an error of that
        ``close`` is dropped): the caller is already reporting what cut the episode.
        """
        for env in envs:
            stream, self.streams[env] = self.streams[env], None
            self.streamed[env] = 0
            if stream is not None and not getattr(stream, "closed", False):
                with contextlib.suppress(Exception):
                    stream.close(terminated=False)


def offer(
    envs: np.ndarray,
    episodes: list[Episode],
    store: Callable[[int, Episode], int],
    counts: dict[str, int],
    *,
    flushed: bool,
    refused: dict[int, Exception] | None = None,
    kept: dict[int, Episode] | None = None,
) -> list[int]:
    """Store each episode (of env ``envs[k]``) by ``store(env, episode)``; return the ids.

    ``counts`` (the writer's) gains the episodes stored and refused; ``refused`` and ``kept``
    may hold refusals found earlier in the call. Raises `EpisodesNotStoredError` after the
    last episode if any was refused; a `BaseException` propagates at once, the episodes not
    yet offered counted as dropped.
    """
    ids: list[int] = []
    refused = {} if refused is None else refused
    kept = {} if kept is None else kept
    for index, (env, episode) in enumerate(zip(envs.tolist(), episodes, strict=True)):
        try:
            ids.append(store(env, episode))
        except Exception as error:  # reported below, with the stored ids
            refused[env], kept[env] = error, episode
            counts["episodes_dropped"] += 1
            continue
        except BaseException:
            counts["episodes_dropped"] += len(episodes) - index
            raise
        counts["episodes_added"] += 1
        counts["records_added"] += len(episode)
        counts["episodes_flushed"] += int(flushed)
    if refused:
        refused = dict(sorted(refused.items()))  # in env order, wherever they were found
        kept = {env: kept[env] for env in refused}
        failure = EpisodesNotStoredError.of(ids, refused, kept, label="env")
        raise failure from next(iter(refused.values()))
    return ids
