"""`ShardBase`: what `ReplayShard` provides to the parts of it that live in other modules.

`ReplayShard` is put together from mixins, one concern each: streaming open episodes
(`lucid_replay.distributed.shard_streams`) and drawing for a coordinator
(`lucid_replay.distributed.shard_draws`). Each mixin reads the shard's attributes and calls
a few of its methods; this class declares them once, for the type checker and the reader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from lucid_replay.distributed.hooks import ShardHooks
    from lucid_replay.episode import Episode
    from lucid_replay.prioritized import PrioritizedSequenceReplay
    from lucid_replay.streams import EpisodeStream

__all__: list[str] = []  # internal module


class ShardBase:
    """The attributes and methods of `ReplayShard` that its mixins use."""

    buffer: PrioritizedSequenceReplay
    hooks: ShardHooks
    shared: Any  # transport="shared": the allocator of the fields clients map, else None
    index: int
    incarnation: int
    starts: list[int]
    streams: dict[int, tuple[int, EpisodeStream]]

    def _report(self, *, wait: bool = False) -> None:
        raise NotImplementedError  # `ReplayShard._report`

    def _agree_schema(self, episodes: list[Episode]) -> None:
        raise NotImplementedError  # `ReplayShard._agree_schema`

    def _stored(self, episodes: int) -> None:
        raise NotImplementedError  # `ReplayShard._stored`

    def _counters(self) -> tuple[int, int, int, int]:
        raise NotImplementedError  # `ReplayShard._counters`

    def _global(self, local: np.ndarray) -> np.ndarray:
        raise NotImplementedError  # `ReplayShard._global`

    def _global_segments(self, local: np.ndarray) -> np.ndarray:
        raise NotImplementedError  # `ReplayShard._global_segments`

    def update(self, global_ids: np.ndarray, errors: np.ndarray) -> tuple[int, float | None, int]:
        raise NotImplementedError  # `ReplayShard.update`
