"""What a replay is, as types: the calls one buffer and a sharded replay both answer.

`SequenceReplay`, `PrioritizedSequenceReplay` and `lucid_replay.distributed.ShardedReplay`
conform to these protocols (the test suite checks each, statically and at run time), so
code written against them (a learner loop, `EpisodeWriter`, `TrajectoryAssembler`) runs on
one process or on shards without a change. A call listed here takes the same positional
arguments and keywords on each class and returns the same kinds of values; a class may take
keywords of its own besides (``out=`` in process, ``timeout=`` on shards).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from lucid_replay.batch import Batch, PrioritizedBatch, WindowBatch
from lucid_replay.episode import Episode
from lucid_replay.window import Window

__all__ = ["Adds", "PrioritizedReplayLike", "ReplayLike"]


@runtime_checkable
class Adds(Protocol):
    """Takes whole episodes: what `EpisodeWriter` and `TrajectoryAssembler` store into.

    Only `add` is needed; the assembler calls ``extend`` where the object has one, and the
    writer streams into ``open_episode`` where it has ``segment_length`` set.

    Examples
    --------
    >>> from lucid_replay import Adds, SequenceReplay
    >>> isinstance(SequenceReplay(100), Adds)
    True
    """

    def add(self, episode: Episode, /) -> int:
        """Store one episode; returns its id."""
        ...


@runtime_checkable
class ReplayLike(Adds, Protocol):
    """A replay of episodes drawn as chunks or windows: uniform, or by a selector.

    Examples
    --------
    >>> from lucid_replay import ReplayLike, SequenceReplay
    >>> isinstance(SequenceReplay(100), ReplayLike)
    True
    """

    def extend(self, episodes: Iterable[Episode], /) -> list[int]:
        """Store episodes in order; returns their ids."""
        ...

    @property
    def capacity(self) -> int:
        """The most transitions stored at once."""
        ...

    @property
    def unit(self) -> str:
        """What a draw picks first: ``"chunk"`` or ``"episode"``."""
        ...

    @property
    def max_times_sampled(self) -> int | None:
        """The reuse limit per episode (None: none)."""
        ...

    def __len__(self) -> int:
        """Transitions stored now."""
        ...

    def sample(
        self, batch_size: int, length: int, /, *, device: torch.device | str | None = None
    ) -> Batch:
        """``batch_size`` uniform chunks of ``length`` steps."""
        ...

    def sample_windows(
        self,
        batch_size: int,
        window: Window,
        /,
        *,
        prioritized: bool | None = None,
        device: torch.device | str | None = None,
    ) -> WindowBatch:
        """``batch_size`` windows of ``window``, by the replay's selector."""
        ...

    def iterate(
        self,
        batch_size: int,
        window: Window,
        /,
        *,
        prefetch: int = 2,
        device: torch.device | str | None = None,
    ) -> Iterator[WindowBatch]:
        """Batches of windows without end, drawn ahead on a background thread."""
        ...

    def write_back(self, batch: Batch | WindowBatch, name: str, values: torch.Tensor, /) -> int:
        """Overwrite field ``name`` of the records of ``batch`` still stored."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters of what was added, evicted and drawn."""
        ...

    def save(self, path: str | os.PathLike[str], /) -> None:
        """Write a checkpoint the class's ``load`` reads back."""
        ...


@runtime_checkable
class PrioritizedReplayLike(ReplayLike, Protocol):
    """A `ReplayLike` with priorities: prioritized draws, importance weights, updates.

    Examples
    --------
    >>> from lucid_replay import PrioritizedReplayLike as Like
    >>> from lucid_replay import PrioritizedSequenceReplay, SequenceReplay
    >>> isinstance(PrioritizedSequenceReplay(100), Like)
    True
    >>> isinstance(SequenceReplay(100), Like)
    False
    """

    @property
    def alpha(self) -> float:
        """The priority exponent."""
        ...

    @property
    def beta(self) -> float:
        """The importance-weight exponent now."""
        ...

    @property
    def epsilon(self) -> float:
        """Added to each error's magnitude to make its priority."""
        ...

    def sample_prioritized(
        self, batch_size: int, length: int, /, *, device: torch.device | str | None = None
    ) -> PrioritizedBatch:
        """``batch_size`` chunks by priority, with importance weights."""
        ...

    def update_priorities(self, indices: Any, errors: Any, /) -> int:
        """Set the priorities of ``indices`` from ``errors``; returns how many were stored."""
        ...

    def update_priorities_from(
        self, batch: WindowBatch, errors: Any, /, *, eta: float = 0.9, mask: Any = None
    ) -> int:
        """Route per-record ``errors`` of a window batch to the priority unit (R2D2's mix)."""
        ...

    def anneal_beta(self, fraction: float, final: float = 1.0, /) -> None:
        """Move beta linearly from its initial value toward ``final``."""
        ...
