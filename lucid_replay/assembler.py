"""`TrajectoryAssembler`: whole episodes out of a TorchRL collector's stream of batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lucid_replay.episode import Episode
from lucid_replay.errors import EpisodesNotStoredError, must, wrong_kind, wrong_type
from lucid_replay.protocols import Adds
from lucid_replay.tensordict import (
    NestedKey,
    check_tensordict,
    require_tensordict,
)

if TYPE_CHECKING:
    # tensordict ships no type information (no py.typed): its names are Any to mypy.
    from tensordict import TensorDictBase  # type: ignore[import-untyped]

__all__ = ["TrajectoryAssembler"]

# One run of steps of one trajectory in a batch: its id, [start, stop) in the flat (row-major)
# steps, whether its last step is done, and (step, row) of that last step.
_Run = tuple[int, int, int, bool, tuple[int, int]]


class TrajectoryAssembler:
    """Assemble whole episodes from a TorchRL collector's batches and add them to a buffer.

    A collector cuts its stream every ``frames_per_batch`` steps, wherever episodes are. The
    assembler groups steps by trajectory id, carries each open trajectory over to the next
    batch, and stores a trajectory as one episode (`Episode.from_tensordict`: nested keys
    become ``"."``-joined field names) in the call that sees its done step.

    Parameters
    ----------
    buffer
        Where finished episodes go: any object with ``add(episode) -> id``, such as a
        `SequenceReplay`. When it also has ``extend(episodes) -> ids``, as the buffers here
        do, the episodes one call finishes go in through one ``extend``.
    traj_key
        The trajectory ids: integers, one per step.
    done_key
        The end-of-episode flags: bools, one per step. The stored episode's ``terminated`` is
        ``("next", "terminated")`` at its last step.
    exclude
        Keys (a sequence of them) left out of the stored episodes: by default the collector's
        bookkeeping, the ``"collector"`` sub-dict with the trajectory ids.

    Raises
    ------
    TypeError
        If ``buffer`` has no ``add`` method or a key is not a str or a tuple of str.

    Notes
    -----
    A batch has batch dims ``[T]`` (one environment) or ``[N, T]`` (a batched environment):
    each of the ``N`` rows is a time-ordered stream. A run of one id ends at a done step; the
    id may come back later, as a new trajectory. Within one call an id may not continue
    across rows, nor reappear without a done in between. Padded ``split_trajs=True`` batches
    are refused: use the default contiguous layout. The episodes one call finishes are stored
    in the order they finished (by step, then row).

    Open trajectories are kept as copies, and finished episodes own their memory too (a
    buffer that keeps the `Episode` objects, or a queue to another process, is safe), so the
    collector may reuse its output tensors; `flush` stores the open ones as truncated. A
    batch with no steps (batch dims ``[0]``, ``[N, 0]``, ``[0, T]``) is checked and changes
    nothing.

    A call whose input is refused, or whose episodes the buffer's ``extend`` refuses (it
    stores all or none), changes nothing: the call can be repeated. A buffer with ``add``
    only is offered every finished episode in turn; if any ``add`` raised, the call raises
    `EpisodesNotStoredError` (a ``ValueError``) after the last one, ``from`` the first such
    error, with the ids stored and, keyed by the episode's position in the call's order,
    the buffer's errors and the refused episodes. That call has been taken: its finished
    trajectories are closed and its open ones carried on as for a successful call, so pass
    the next batch, not this one again (that would store its episodes twice). An exception
    that is not an ``Exception`` (``KeyboardInterrupt``) propagates at once, with the
    episodes not yet offered lost. Not thread-safe: feed one assembler from one thread.

    Examples
    --------
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from lucid_replay import SequenceReplay
    >>> def steps(traj_ids, done):
    ...     n = len(traj_ids)
    ...     return TensorDict(
    ...         {
    ...             "obs": torch.zeros(n, 2),
    ...             ("collector", "traj_ids"): torch.tensor(traj_ids),
    ...             ("next", "done"): torch.tensor(done),
    ...             ("next", "terminated"): torch.tensor(done),
    ...         },
    ...         batch_size=[n],
    ...     )
    >>> buffer = SequenceReplay(capacity=100)
    >>> assembler = TrajectoryAssembler(buffer)
    >>> # trajectory 0 stays open
    >>> assembler.extend(steps([0, 0, 0], [False, False, False]))
    []
    >>> assembler.extend(steps([0, 1, 1], [True, False, False]))  # 0 ends; 1 opens
    [0]
    >>> assembler.num_open, assembler.flush()  # trajectory 1, stored as truncated
    (1, [1])
    >>> len(buffer[0]), buffer[0].terminated, sorted(buffer[0].keys())
    (4, True, ['next.done', 'next.terminated', 'obs'])
    """

    def __init__(
        self,
        buffer: Adds,
        *,
        traj_key: NestedKey = ("collector", "traj_ids"),
        done_key: NestedKey = ("next", "done"),
        exclude: Sequence[NestedKey] = ("collector",),
    ) -> None:
        if not callable(getattr(buffer, "add", None)):
            raise wrong_kind("buffer", "an object with an add method", type(buffer).__name__)
        self._buffer = buffer
        self._traj_key = _key("traj_key", traj_key)
        self._done_key = _key("done_key", done_key)
        if isinstance(exclude, str):
            exclude = (exclude,)
        self._exclude = [_key("exclude", key) for key in exclude]
        self._open: dict[int, list[TensorDictBase]] = {}  # id -> pieces, in first-seen order

    @property
    def num_open(self) -> int:
        """Trajectories seen but not finished yet (`flush` stores them)."""
        return len(self._open)

    def extend(self, td: TensorDictBase) -> list[int]:
        """Take one collector batch; store the trajectories it finishes and return their ids.

        Raises
        ------
        TypeError
            If ``td`` is not a TensorDict, or its ids or done flags have another dtype.
        InvalidArgumentError
            (a ``ValueError``) for batch dims other than ``[T]`` / ``[N, T]``, a missing key,
            an id continued across rows or back without a done, keys that differ from the
            earlier batches of a trajectory, or an episode `Episode.from_tensordict` refuses.
        EpisodesNotStoredError
            If a buffer without ``extend`` refused some of the episodes (see the class notes).
        """
        module = check_tensordict("td", td)
        flat, runs = self._runs(td)
        if flat is None:
            return []  # no steps
        still_open, opened = dict(self._open), set()
        finished: list[tuple[tuple[int, int], Episode]] = []
        for traj, start, stop, done, order in runs:
            if traj in opened:
                raise must(
                    f"td[{self._traj_key!r}]",
                    "ids that continue only within a row, or come back after a done",
                    f"trajectory {traj} again at flat step {start}",
                )
            piece = flat[start:stop].exclude(*self._exclude)
            pieces = [*still_open.get(traj, []), piece]
            if done:
                # one piece is a view of the batch: copy it, as `cat` copies several
                whole = [piece.clone()] if len(pieces) == 1 else pieces
                finished.append((order, _assemble(module, traj, whole, None)))
                still_open.pop(traj, None)
            else:
                still_open[traj] = [*pieces[:-1], piece.clone()]
                opened.add(traj)
        return self._store(
            [episode for _, episode in sorted(finished, key=lambda f: f[0])], still_open
        )

    def flush(self) -> list[int]:
        """Store every open trajectory as a truncated episode (``terminated=False``).

        As far as the stream shows they did not reach a terminal state, so a learner
        bootstraps from their last step. Returns the ids, in the order the trajectories were
        first seen. Raises as `extend`.
        """
        if not self._open:
            return []
        module = require_tensordict()
        episodes = [_assemble(module, t, pieces, False) for t, pieces in self._open.items()]
        return self._store(episodes, {})

    def _store(
        self, episodes: list[Episode], still_open: dict[int, list[TensorDictBase]]
    ) -> list[int]:
        """Store ``episodes``, then (or, without ``extend``, first) keep ``still_open``."""
        extend = getattr(self._buffer, "extend", None)
        if callable(extend):
            issued = list(extend(episodes)) if episodes else []
            self._open = still_open
            return issued
        self._open = still_open  # one add at a time cannot be undone: the call is taken
        stored: list[int] = []
        refused: dict[int, Exception] = {}
        for position, episode in enumerate(episodes):
            try:
                stored.append(self._buffer.add(episode))
            except Exception as error:  # reported below, with the stored ids
                refused[position] = error
        if refused:
            kept = {position: episodes[position] for position in refused}
            failure = EpisodesNotStoredError.of(stored, refused, kept, label="episode")
            raise failure from next(iter(refused.values()))
        return stored

    def _runs(self, td: TensorDictBase) -> tuple[TensorDictBase | None, list[_Run]]:
        """The flat (row-major) steps of ``td`` and their runs (see `_Run`), or None, [].

        None for a batch with no steps, after checking its keys.
        """
        if td.get(("collector", "mask"), None) is not None:
            raise must("td", "contiguous (split_trajs=False)", "a ('collector', 'mask') entry")
        if td.batch_dims not in (1, 2):
            raise must("td", "a batch of dims [T] or [N, T]", list(td.batch_size))
        shape = (1, *td.batch_size) if td.batch_dims == 1 else tuple(td.batch_size)
        ids = self._entry(td, self._traj_key, shape, ids=True)
        done = self._entry(td, self._done_key, shape, ids=False)
        if ids.numel() == 0:
            return None, []  # tensordict cannot reshape a batch of no steps
        flat = td.reshape(-1)
        new = torch.ones_like(done)
        new[1:] = (ids[1:] != ids[:-1]) | done[:-1]
        new[:: shape[1]] = True  # each row is a stream of its own
        starts = new.nonzero().flatten().tolist()
        stops = [*starts[1:], ids.numel()]
        lasts_done = done[torch.tensor(stops) - 1].tolist()
        width = shape[1]
        runs = [
            (traj, a, b, last_done, ((b - 1) % width, (b - 1) // width))
            for traj, a, b, last_done in zip(
                ids[starts].tolist(), starts, stops, lasts_done, strict=True
            )
        ]
        return flat, runs

    @staticmethod
    def _entry(
        td: TensorDictBase, key: NestedKey, shape: tuple[int, ...], *, ids: bool
    ) -> torch.Tensor:
        """The flat ids (integers) or done flags (bools) of ``td``, one per step."""
        value = td.get(key, None)
        if value is None:
            raise must("td", f"a batch with a {key!r} entry", sorted(td.keys()))
        integral = isinstance(value, torch.Tensor) and not (
            value.dtype == torch.bool or value.is_floating_point() or value.is_complex()
        )
        if not (integral if ids else isinstance(value, torch.Tensor) and value.dtype == torch.bool):
            kind = "integer" if ids else "bool"
            raise wrong_kind(f"td[{key!r}]", f"{kind}s", str(getattr(value, "dtype", value)))
        if value.numel() != shape[0] * shape[1]:
            raise must(f"td[{key!r}]", f"one value per step {list(shape)}", list(value.shape))
        flat: torch.Tensor = value.reshape(-1)
        return flat


def _key(name: str, key: object) -> NestedKey:
    if isinstance(key, str):
        return key
    if isinstance(key, tuple) and key and all(isinstance(part, str) for part in key):
        return key if len(key) > 1 else key[0]
    raise wrong_type(name, "a str or a tuple of str", key)


def _assemble(
    module: Any, traj: int, pieces: list[TensorDictBase], terminated: bool | None
) -> Episode:
    """One episode of the pieces of trajectory ``traj`` (validated by `Episode.from_tensordict`)."""
    keys = sorted(map(str, pieces[0].keys(True, True)))
    for piece in pieces[1:]:
        if sorted(map(str, piece.keys(True, True))) != keys:
            raise must(
                "td",
                f"the keys of the earlier batches of trajectory {traj} ({keys})",
                sorted(map(str, piece.keys(True, True))),
            )
    whole = pieces[0] if len(pieces) == 1 else module.cat(pieces, dim=0)
    return Episode.from_tensordict(whole, terminated=terminated)
