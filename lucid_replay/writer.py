"""`EpisodeWriter`: whole episodes from the step stream of a gymnasium vector environment."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import numpy as np

from lucid_replay.checks import check_int
from lucid_replay.episode import Episode
from lucid_replay.errors import EpisodesNotStoredError, must, wrong_kind, wrong_type
from lucid_replay.writer_pages import (
    Column,
    PageTable,
    as_batch,
    as_flags,
    check_fields,
    per_env_spec,
)

__all__ = ["EpisodeWriter"]

# The mode names of this package, and gymnasium's `AutoresetMode` values, to the mode.
_MODES = {"next_step": "next_step", "same_step": "same_step", "disabled": "disabled"}
_MODES.update({"NextStep": "next_step", "SameStep": "same_step", "Disabled": "disabled"})
_AWAITING, _OPEN, _PENDING = 0, 1, 2  # per-env states: no episode, collecting, autoreset next
_STEP_NAMES = ("action", "reward")
_PAGE_RECORDS = 64  # records per page of the pool holding open episodes


def _mode(autoreset: Any) -> str:
    """The mode named by a string or by an enum member (gymnasium's `AutoresetMode`)."""
    value = autoreset.value if isinstance(autoreset, enum.Enum) else autoreset
    if not isinstance(value, str):
        raise wrong_type("autoreset", "a str or an AutoresetMode", autoreset)
    if value not in _MODES:
        raise must("autoreset", "'next_step', 'same_step', 'disabled' or an AutoresetMode", value)
    return _MODES[value]


class EpisodeWriter:
    """Turn the step stream of a gymnasium vector environment into whole episodes in ``buffer``.

    Parameters
    ----------
    buffer
        Any object with ``add(episode) -> int``: a `SequenceReplay`, a
        `PrioritizedSequenceReplay`, or a client of a remote replay.
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

    The buffer may still refuse an episode (another writer fixed other fields first, the
    episode is longer than its capacity, a remote buffer timed out, ...). Every episode the
    call finished is offered to it, in env order; if any ``add`` raised, the call then
    raises `EpisodesNotStoredError` (a ``ValueError``) ``from`` the first such error,
    carrying the ids that were stored and, by env, the buffer's errors and the refused
    episodes, which are counted in ``stats()["episodes_dropped"]``. The writer has then
    advanced as for a successful call: the envs keep collecting, and the call must not be
    repeated (its steps would be recorded twice). An exception that is not an ``Exception``
    (``KeyboardInterrupt``) propagates at once; the episodes not yet offered are dropped and
    counted.

    Open episodes are held in a pool of pages shared by the envs, so memory follows the
    records open; `flush` cuts episodes that never end. One writer per collector thread.

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

    def __init__(self, buffer: Any, num_envs: int, *, autoreset: Any = "next_step") -> None:
        if not callable(getattr(buffer, "add", None)):
            raise wrong_kind(
                "buffer", "an object with an add(episode) method", type(buffer).__name__
            )
        self._num_envs = check_int("num_envs", num_envs, minimum=1)
        self._mode = _mode(autoreset)
        self._buffer = buffer
        self._state = np.full(self._num_envs, _AWAITING, dtype=np.int8)
        self._length = np.zeros(self._num_envs, dtype=np.int64)  # steps of each open episode
        self._pages = PageTable(self._num_envs, _PAGE_RECORDS)
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
        buffer), ``open_episodes`` and ``open_steps`` (held, not yet stored).
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
        obs = self._observation(observation)
        for name in obs:
            if name in _STEP_NAMES or (self._fields is not None and name in self._fields):
                raise must("observation keys", "distinct from the other fields", name)
        if self._obs is None:
            specs = {name: per_env_spec(value) for name, value in obs.items()}
            check_fields(specs, self._buffer_schema(), complete=False)
        cut = np.flatnonzero(mask & (self._state == _OPEN) & (self._length > 0))
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
            them.

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
            If the buffer refused an episode this step ended (see the class notes).
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
        obs = self._observation(observation)
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
        finals = self._final_observations(columns, info, np.flatnonzero(ended))
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
        done = np.flatnonzero(ended)
        episodes = [self._episode(int(i), terminated=bool(terminal[i])) for i in done]
        if self._mode == "same_step":
            self._start(done, obs)
        elif self._mode == "next_step":
            self._start(np.flatnonzero(self._state == _PENDING), obs)
            self._state[done] = _PENDING
        else:
            self._state[done] = _AWAITING
        return self._add(done, episodes, flushed=False)

    def flush(self) -> list[int]:
        """Store every open episode with at least one step as truncated; return their ids.

        Each is stored as ``T + 1`` records, the last holding the observation the env has
        reached, with ``terminated=False``. The env keeps collecting: its next episode starts
        at that observation (no step is lost or stored twice). Use it to end a collection
        phase or to cut episodes that would otherwise never end. Raises
        `EpisodesNotStoredError` if the buffer refused some of them (see the class notes).
        """
        rows = np.flatnonzero((self._state == _OPEN) & (self._length > 0))
        episodes = [self._episode(int(i), terminated=False) for i in rows]
        first, current = (self._pages.slot(rows, s) for s in (0 * rows, self._length[rows]))
        for column in (self._obs or {}).values():
            column.move(first, current)
        self._pages.release(rows)
        self._length[rows] = 0
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

    def __enter__(self) -> EpisodeWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------- internals
    def _observation(self, observation: Any) -> dict[str, Any]:
        """Field name -> ``[num_envs, ...]`` batch, checked against the fixed layout."""
        if isinstance(observation, Mapping):
            obs = {}
            for key, value in observation.items():
                if not isinstance(key, str):
                    raise wrong_type("observation keys", "str", key)
                obs[key] = as_batch(f"observation[{key!r}]", value, self._num_envs)
        else:
            obs = {"observation": as_batch("observation", observation, self._num_envs)}
        if self._obs is None:
            return obs
        if isinstance(observation, Mapping) != self._dict_obs or set(obs) != set(self._obs):
            raise must("observation", f"of the first reset's fields {list(self._obs)}", list(obs))
        return {
            name: column.conform(f"observation[{name!r}]" if self._dict_obs else name, obs[name])
            for name, column in self._obs.items()
        }

    def _final_observations(
        self, columns: dict[str, Column], info: Mapping[str, Any] | None, ended: np.ndarray
    ) -> dict[int, dict[str, Any]]:
        """Under ``"same_step"``: env -> its final observation, from ``info["final_obs"]``."""
        if self._mode != "same_step" or not ended.size:
            return {}
        final = None if info is None else info.get("final_obs")
        present = None if info is None else info.get("_final_obs")
        finals: dict[int, dict[str, Any]] = {}
        for env in ended.tolist():
            entry = None
            if final is not None and (present is None or bool(present[env])):
                entry = final[env]
            if entry is None:
                rule = "holding info['final_obs'][i] for every env i that ended"
                raise must("info", rule, f"none for env {env}")
            param = f"info['final_obs'][{env}]"
            got = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
            if self._dict_obs != isinstance(entry, Mapping) or (
                self._dict_obs and set(entry) != set(columns)
            ):
                raise must(param, f"one env's observation of fields {list(columns)}", got)
            parts = entry if self._dict_obs else {"observation": entry}
            finals[env] = {
                name: column.conform(param, parts[name], per_env=True)
                for name, column in columns.items()
            }
        return finals

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

    def _add(self, envs: np.ndarray, episodes: list[Episode], *, flushed: bool) -> list[int]:
        """Offer each episode (of env ``envs[k]``) to the buffer; count stored and dropped.

        Raises `EpisodesNotStoredError` after the last one if any ``add`` raised.
        """
        ids: list[int] = []
        refused: dict[int, Exception] = {}
        kept: dict[int, Episode] = {}
        for index, (env, episode) in enumerate(zip(envs.tolist(), episodes, strict=True)):
            try:
                ids.append(self._buffer.add(episode))
            except Exception as error:  # reported below, with the stored ids
                refused[env], kept[env] = error, episode
                self._counts["episodes_dropped"] += 1
                continue
            except BaseException:
                self._counts["episodes_dropped"] += len(episodes) - index
                raise
            self._counts["episodes_added"] += 1
            self._counts["records_added"] += len(episode)
            self._counts["episodes_flushed"] += int(flushed)
        if refused:
            failure = EpisodesNotStoredError.of(ids, refused, kept, label="env")
            raise failure from next(iter(refused.values()))
        return ids
