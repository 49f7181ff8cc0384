"""`EpisodeWriter`: episodes from the step stream of a gymnasium vector environment.

Whole episodes are added to a buffer when they end; a segmented buffer (``segment_length``)
gets them streamed, segment by segment (`lucid_replay.writer_streams`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lucid_replay.checks import check_int
from lucid_replay.episode import Episode
from lucid_replay.errors import must, wrong_kind
from lucid_replay.protocols import Adds
from lucid_replay.writer_pages import (
    Column,
    PageTable,
    as_batch,
    as_flags,
    autoreset_mode,
    check_fields,
    final_observations,
    observation_batches,
    per_env_spec,
)
from lucid_replay.writer_streams import EnvStreams, WholeEpisodes, offer, segment_length_of

__all__ = ["EpisodeWriter"]

_AWAITING, _OPEN, _PENDING = 0, 1, 2  # per-env states: no episode, collecting, autoreset next
_STEP_NAMES = ("action", "reward")
_PAGE_RECORDS = 64  # records per page of the pool holding open episodes (or L + 1, if fewer)


class EpisodeWriter:
    """Turn the step stream of a gymnasium vector environment into whole episodes in ``buffer``.

    Parameters
    ----------
    buffer
        Any object with ``add(episode) -> int``: a `SequenceReplay`, a
        `PrioritizedSequenceReplay`, or a client of a remote replay. One that also has a
        non-None ``segment_length`` and ``open_episode`` is streamed (see Notes).
    num_envs
        Number of sub-environments (the leading size of every array passed in).
    autoreset
        The vector environment's autoreset mode: ``"next_step"`` (gymnasium's default),
        ``"same_step"``, ``"disabled"``, or a ``gymnasium.vector.AutoresetMode`` member.

    Raises
    ------
    TypeError
        If ``buffer`` has no ``add`` method, ``num_envs`` is not an int (``bool`` included), or
        ``autoreset`` is neither a str nor an enum member.
    InvalidArgumentError
        (a ``ValueError``) if ``num_envs < 1`` or ``autoreset`` names no mode.

    Notes
    -----
    An episode of ``T`` environment steps is stored as ``T + 1`` records. Record ``t`` holds
    the observation the action was chosen from (field ``observation``, or one field per key of
    a dict observation), ``action``, the ``reward`` received after it, and every extra field
    passed to the ``step`` call that carried that action (the recurrent state entering the
    step, logits, ...). The last record holds the final observation, with ``action``,
    ``reward`` and the extra fields zero (of their dtype and shape): it is what a truncated
    episode bootstraps from. ``Episode.terminated`` is the last step's ``terminated``.

    The first ``reset`` fixes the observation fields, the first ``step`` the others; later
    calls must pass the same names, per-env shapes and dtypes. Dtypes are kept as given
    (gymnasium's rewards are ``float64``: cast them, or declare the buffer's schema, to store
    ``float32``). The calls that fix fields also check them against what a buffer stores, so
    that a layout no episode could be stored under is refused at once, not at every
    episode's end: a field named like a per-record entry of a window batch (``is_init``,
    ...) or of a dtype no buffer stores (``uint16``: `SchemaError`, `SchemaDtypeError`); and,
    when ``buffer`` has a non-None ``schema`` mapping (declared, or fixed by an earlier
    episode), a field it lacks, a field of it that no step passes, another per-step shape,
    or a dtype that does not cast to its dtype by numpy's ``same_kind`` rule. Whether a
    dtype must be exact or may be cast is left to the buffer's ``add``.

    Every call validates all of its input first: a refused call stores nothing and leaves
    the writer unchanged. Values are numpy arrays or tensors (lists of numbers are accepted
    too); tuples (gymnasium ``Tuple`` spaces), nested dicts, tensors without dense data
    (sparse, ``meta``, quantized, nested) and dtypes torch cannot hold are refused
    (``TypeError``), since an `Episode` could not be built from them.

    On a buffer with a non-None ``segment_length`` ``L`` and an ``open_episode`` method (a
    segmented `SequenceReplay`) every env's episode is streamed: the buffer stores exactly the
    records above, but the writer holds fewer than ``L`` of them per env (plus the observation
    the env's next action is chosen from). When an env's held records reach ``L`` they go to
    its episode's `EpisodeStream` as one segment, committed by that call; the episode's end
    appends the rest with the final record and closes the stream with ``terminated``. A
    stream is opened when its episode first sends records (its first ``L``, or its end), so
    ids are issued in that order, not in the order episodes end as on a whole-episode buffer:
    an env's ids still increase episode by episode, and each call returns the ids of the
    episodes it ended (closed), as everywhere. An episode a `flush`, `close` or `reset` cuts
    is closed with ``terminated=False``, as a whole-episode buffer stores it truncated.

    The buffer may still refuse an episode (another writer fixed other fields first, the
    episode is longer than its capacity, a remote buffer timed out, ...). Every episode the
    call finished is offered to it, in env order; if any ``add`` raised, the call then
    raises `EpisodesNotStoredError` (a ``ValueError``) ``from`` the first such error,
    carrying the ids that were stored and, by env, the buffer's errors and the refused
    episodes, which are counted in ``stats()["episodes_dropped"]``. The writer has then
    advanced as for a successful call: the envs keep collecting, and the call must not be
    repeated (its steps would be recorded twice). An exception that is not an ``Exception``
    (``KeyboardInterrupt``) propagates at once; the episodes not yet offered are dropped and
    counted. When streaming, a refused ``open_episode``, ``append`` or ``close`` of env ``i``
    is reported the same way and cuts its episode there: the segments committed stay, closed
    with ``terminated=False``; the refused `Episode` is what the writer held, ending at the
    observation reached, where the env's next episode starts (as after a refused `flush`).

    Open episodes are held in a pool of pages shared by the envs, so memory follows the
    records open; `flush` cuts episodes that never end (or stream them). One writer per
    collector thread.

    Examples
    --------
    >>> import numpy as np
    >>> from lucid_replay import SequenceReplay
    >>> buffer = SequenceReplay(capacity=100)
    >>> writer = EpisodeWriter(buffer, num_envs=2)
    >>> _ = writer.reset(np.array([[0.0], [10.0]]))
    >>> writer.step(
    ...     np.array([1, 1]),
    ...     np.array([1.0, 2.0]),
    ...     np.array([True, False]),
    ...     np.array([False, False]),
    ...     np.array([[1.0], [11.0]]),
    ... )
    [0]
    >>> buffer[0]["observation"].flatten().tolist(), buffer[0]["action"].tolist()
    ([0.0, 1.0], [1, 0])
    >>> writer.flush()
    [1]
    >>> buffer[1]["observation"].flatten().tolist(), buffer[1].terminated
    ([10.0, 11.0], False)
    """

    def __init__(self, buffer: Adds, num_envs: int, *, autoreset: Any = "next_step") -> None:
        if not callable(getattr(buffer, "add", None)):
            raise wrong_kind(
                "buffer", "an object with an add(episode) method", type(buffer).__name__
            )
        self._num_envs = check_int("num_envs", num_envs, minimum=1)
        self._mode = autoreset_mode(autoreset)
        self._buffer = buffer
        self._state = np.full(self._num_envs, _AWAITING, dtype=np.int8)
        self._length = np.zeros(self._num_envs, dtype=np.int64)  # steps of each open episode
        segment_length = segment_length_of(buffer)
        self._sink = (
            WholeEpisodes(buffer, self._num_envs)
            if segment_length is None
            else EnvStreams(buffer, self._num_envs, segment_length)
        )
        page = _PAGE_RECORDS if segment_length is None else min(_PAGE_RECORDS, segment_length + 1)
        self._pages = PageTable(self._num_envs, page)
        self._dict_obs = False
        self._obs: dict[str, Column] | None = None  # fixed by the first reset
        self._fields: dict[str, Column] | None = None  # fixed by the first step
        names = ("steps", "episodes_added", "records_added", "episodes_flushed", "episodes_dropped")
        self._counts = dict.fromkeys(names, 0)

    @property
    def num_envs(self) -> int:
        """Number of sub-environments."""
        return self._num_envs

    @property
    def autoreset(self) -> str:
        """The autoreset mode: ``"next_step"``, ``"same_step"`` or ``"disabled"``."""
        return self._mode

    def stats(self) -> dict[str, int]:
        """Counters since construction, and the open episodes now.

        ``steps`` (environment steps recorded), ``episodes_added`` / ``records_added``
        (accepted by the buffer), ``episodes_flushed`` (of those, cut by `flush`, `close` or a
        `reset` rather than ended by the environment), ``episodes_dropped`` (refused by the
        buffer), ``open_episodes`` and ``open_steps`` (held by the writer: not yet stored,
        nor streamed).
        """
        open_envs = self._state == _OPEN
        return {
            **self._counts,
            "open_episodes": int(open_envs.sum()),
            "open_steps": int(self._length[open_envs].sum()),
        }

    # ----------------------------------------------------------------------- the stream
    def reset(self, observation: Any, *, env_mask: Any = None) -> list[int]:
        """Start a new episode in every env of ``env_mask`` (all envs if ``None``).

        Call it with the observation of ``envs.reset()``, and under ``"disabled"`` after
        ``envs.reset(options={"reset_mask": mask})`` with the same mask (observations of envs
        outside the mask are ignored).

        Parameters
        ----------
        observation
            ``[num_envs, ...]`` array or tensor, or a dict of them (a gymnasium ``Dict`` space).
        env_mask
            bool ``[num_envs]``: which envs were reset.

        Returns
        -------
        list[int]
            Ids of episodes cut by this reset: an env reset while its episode was open (with
            at least one step) has that episode stored as truncated, its last record the
            observation it had reached. Usually empty.

        Raises
        ------
        TypeError, InvalidArgumentError
            For a non-bool mask or one not of shape ``[num_envs]``, an observation of another
            leading size, or one whose names, per-env shapes or dtypes differ from the first;
            a dict key named like another field (``action``, ``reward``, an extra field); a
            tuple, a nested dict, or a value an `Episode` cannot hold (see the class notes).
        SchemaError, SchemaDtypeError
            At the first reset, for observation fields no episode could be stored under.
        EpisodesNotStoredError
            If the buffer refused an episode this reset cut (see the class notes).
        """
        mask = (
            np.ones(self._num_envs, dtype=np.bool_)
            if env_mask is None
            else as_flags("env_mask", env_mask, self._num_envs)
        )
        obs = observation_batches(observation, self._num_envs, self._obs, self._dict_obs)
        for name in obs:
            if name in _STEP_NAMES or (self._fields is not None and name in self._fields):
                raise must("observation keys", "distinct from the other fields", name)
        if self._obs is None:
            specs = {name: per_env_spec(value) for name, value in obs.items()}
            check_fields(specs, self._buffer_schema(), complete=False)
        cut = np.flatnonzero(mask & (self._state == _OPEN) & (self._steps() > 0))
        episodes = [self._episode(int(i), terminated=False) for i in cut]
        if self._obs is None:
            self._dict_obs = isinstance(observation, Mapping)
            self._obs = {
                name: Column(name, value, self._pages.slots) for name, value in obs.items()
            }
        self._start(np.flatnonzero(mask), obs)
        return self._add(cut, episodes, flushed=True)

    def step(
        self,
        action: Any,
        reward: Any,
        terminated: Any,
        truncated: Any,
        observation: Any,
        *,
        info: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> list[int]:
        """Record one vector step: ``action`` and what ``envs.step(action)`` returned.

        Parameters
        ----------
        action
            ``[num_envs, ...]``: the actions passed to ``envs.step``.
        reward, terminated, truncated, observation, info
            What ``envs.step(action)`` returned (``terminated``, ``truncated``: bool
            ``[num_envs]``). ``info`` is read only under ``"same_step"``, for
            ``info["final_obs"]`` of the envs that ended.
        **fields
            Extra per-env fields stored with this step's records, ``[num_envs, ...]`` each:
            e.g. the recurrent state the policy entered the step with.

        Returns
        -------
        list[int]
            Ids of the episodes that ended in this call (in env order), as the buffer issued
            them (on a segmented buffer: the episodes this call closed).

        Raises
        ------
        TypeError, InvalidArgumentError
            Before any `reset`; for an env with no open episode (``"disabled"``: one that
            ended and was not reset); for any value of another leading size, a non-bool flag,
            a field name that collides with an observation field, a field set, per-env shape
            or dtype other than the first step's, or a missing ``info["final_obs"]``; a
            tuple, a nested dict, or a value an `Episode` cannot hold (see the class notes).
        SchemaError, SchemaDtypeError
            At the first step, for fields no episode could be stored under.
        EpisodesNotStoredError
            If the buffer refused an episode this step ended, or records it streamed (see the
            class notes).
        """
        columns = self._obs
        if columns is None:
            raise must("step", "called after a first reset(observation)", "no reset yet")
        if info is not None and not isinstance(info, Mapping):
            raise wrong_kind("info", "a dict or None", f"a {type(info).__name__}")
        given = {"action": action, "reward": reward, **fields}
        values = {name: as_batch(name, value, self._num_envs) for name, value in given.items()}
        terminal = as_flags("terminated", terminated, self._num_envs)
        ended = terminal | as_flags("truncated", truncated, self._num_envs)
        obs = observation_batches(observation, self._num_envs, self._obs, self._dict_obs)
        clash = sorted(set(fields) & set(columns))
        if clash:
            raise must("field names", "distinct from the observation fields", clash)
        if self._fields is not None:
            if set(values) != set(self._fields):
                rule = f"the first step's {sorted(self._fields)}"
                raise must("step fields", rule, sorted(values))
            values = {n: c.conform(n, values[n]) for n, c in self._fields.items()}
        waiting = np.flatnonzero(self._state == _AWAITING)
        if waiting.size:
            rule = "called only while every env has an open episode (reset it first)"
            raise must("step", rule, f"envs {waiting.tolist()} not reset")
        rows = np.flatnonzero(self._state == _OPEN)
        ended &= self._state == _OPEN
        finals = {}
        if self._mode == "same_step" and ended.any():
            finals = final_observations(columns, self._dict_obs, info, np.flatnonzero(ended))
        layout = self._fields
        if layout is None:
            specs = {name: per_env_spec(value) for name, value in {**obs, **values}.items()}
            check_fields(specs, self._buffer_schema(), complete=True)
            layout = {n: Column(n, v, self._pages.slots) for n, v in values.items()}
        # Everything is valid: from here on, the call changes state.
        steps = self._length[rows]
        if self._pages.reserve(rows, steps + 1):
            for column in [*columns.values(), *layout.values()]:
                column.grow(self._pages.slots)
        slots = self._pages.slot(rows, steps)
        for name, column in layout.items():
            column.write(slots, values[name], rows)
        self._fields = layout
        self._length[rows] += 1
        slots = self._pages.slot(rows, steps + 1)
        for name, column in columns.items():
            column.write(slots, obs[name], rows)
        for env, final in finals.items():
            slot = int(self._pages.slot(np.array([env]), self._length[[env]])[0])
            for name, column in columns.items():
                column.put(slot, final[name])
        self._counts["steps"] += int(rows.size)
        refused, kept = self._spill(rows, ended)
        done = np.flatnonzero(ended)
        episodes = [self._episode(int(i), terminated=bool(terminal[i])) for i in done]
        if self._mode == "same_step":
            self._start(done, obs)
        elif self._mode == "next_step":
            self._start(np.flatnonzero(self._state == _PENDING), obs)
            self._state[done] = _PENDING
        else:
            self._state[done] = _AWAITING
        return self._add(done, episodes, flushed=False, refused=refused, kept=kept)

    def flush(self) -> list[int]:
        """Store every open episode with at least one step as truncated; return their ids.

        Each is stored as ``T + 1`` records, the last holding the observation the env has
        reached, with ``terminated=False``. The env keeps collecting: its next episode starts
        at that observation (no step is lost or stored twice). Use it to end a collection
        phase or to cut episodes that would otherwise never end. Raises
        `EpisodesNotStoredError` if the buffer refused some of them (see the class notes).
        """
        rows = np.flatnonzero((self._state == _OPEN) & (self._steps() > 0))
        episodes = [self._episode(int(i), terminated=False) for i in rows]
        self._restart(rows)
        return self._add(rows, episodes, flushed=True)

    def close(self) -> list[int]:
        """`flush`, then end the stream: every env needs a `reset` before its next step.

        Returns the ids `flush` stored. A ``with EpisodeWriter(...) as writer:`` block
        closes the writer on exit.
        """
        try:
            return self.flush()
        finally:
            self._state[:] = _AWAITING
            self._length[:] = 0
            self._pages.release(np.arange(self._num_envs))
            self._sink.abandon(range(self._num_envs))  # none open unless flush was interrupted

    def __enter__(self) -> EpisodeWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------- internals
    def _start(self, rows: np.ndarray, obs: dict[str, Any]) -> None:
        """Open a new episode in envs ``rows`` at their observation in ``obs``."""
        self._pages.release(rows)
        first = self._pages.slot(rows, np.zeros_like(rows))
        for name, column in (self._obs or {}).items():
            column.write(first, obs[name], rows)
        self._length[rows] = 0
        self._state[rows] = _OPEN

    def _episode(self, env: int, *, terminated: bool) -> Episode:
        """Env ``env``'s open episode as an `Episode` (copies; the writer's state is kept)."""
        slots = self._pages.episode(env, int(self._length[env]))
        steps = {n: c.take(slots, zero_last=False) for n, c in (self._obs or {}).items()}
        for name, column in (self._fields or {}).items():
            steps[name] = column.take(slots, zero_last=True)
        return Episode(steps, terminated=terminated)

    def _buffer_schema(self) -> Any:
        """The buffer's ``schema`` mapping, if it has one now (else None)."""
        schema = getattr(self._buffer, "schema", None)
        return schema if isinstance(schema, Mapping) else None

    def _steps(self) -> np.ndarray:
        """Steps of each env's open episode: held, plus those streamed."""
        steps: np.ndarray = self._length + self._sink.streamed
        return steps

    def _restart(self, rows: np.ndarray) -> None:
        """Start envs ``rows``' next episode at the observation they reached."""
        first, current = (self._pages.slot(rows, s) for s in (0 * rows, self._length[rows]))
        for column in (self._obs or {}).values():
            column.move(first, current)
        self._pages.release(rows)
        self._length[rows] = 0

    def _spill(
        self, rows: np.ndarray, ended: np.ndarray
    ) -> tuple[dict[int, Exception], dict[int, Episode]]:
        """Stream the held records of the envs ``rows`` holding ``L`` that did not end.

        Gathered in one indexed read per field (with the observation reached, which each env
        then keeps alone); see `EnvStreams.spill`. Nothing to do on a whole-episode buffer.
        """
        sink = self._sink
        if not isinstance(sink, EnvStreams):
            return {}, {}
        rows = rows[~ended[rows]]
        full = rows[self._length[rows] >= sink.segment_length]
        if not full.size:
            return {}, {}
        counts = self._length[full]
        slots = self._pages.spans(full, counts + 1).reshape(-1)
        parts = {}
        for name, column in [*(self._obs or {}).items(), *(self._fields or {}).items()]:
            part = column.take(slots, zero_last=False)
            parts[name] = part.reshape((full.size, -1, *part.shape[1:]))
        finished: list[int] = []
        try:
            return sink.spill(full, counts, parts, set(self._fields or ()), finished, self._counts)
        finally:
            self._restart(np.array(finished, dtype=np.int64))

    def _add(
        self,
        envs: np.ndarray,
        episodes: list[Episode],
        *,
        flushed: bool,
        refused: dict[int, Exception] | None = None,
        kept: dict[int, Episode] | None = None,
    ) -> list[int]:
        """Store the episodes of envs ``envs`` that ended: by ``add``, or by their streams.

        Raises `EpisodesNotStoredError` after the last one if any was refused, here or
        earlier in the call (``refused``, ``kept``: see `offer`).
        """
        counts, sink = self._counts, self._sink
        try:
            return offer(
                envs, episodes, sink.finish, counts, flushed=flushed, refused=refused, kept=kept
            )
        finally:
            sink.abandon(envs.tolist())  # the streams an interrupt left open (else none)
