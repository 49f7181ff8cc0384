"""The replays conform to `lucid_replay.protocols`: checked by mypy, never run.

Each assignment below type-checks only while its class answers every call of its protocol
with compatible arguments and results, so a signature that drifts on one class (a keyword
renamed on the shards, a result type changed in process) fails ``mypy``, not a user.
`ShardedReplay` is also checked against the `Client` protocol its parts take
(`lucid_replay.distributed.client_state`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__: list[str] = []  # internal module

if TYPE_CHECKING:
    from lucid_replay.distributed.client import ShardedReplay
    from lucid_replay.distributed.client_state import Client
    from lucid_replay.prioritized import PrioritizedSequenceReplay
    from lucid_replay.protocols import PrioritizedReplayLike, ReplayLike
    from lucid_replay.replay import SequenceReplay

    def _conforms(
        uniform: SequenceReplay, prioritized: PrioritizedSequenceReplay, sharded: ShardedReplay
    ) -> tuple[ReplayLike, PrioritizedReplayLike, PrioritizedReplayLike]:
        return uniform, prioritized, sharded

    def _a_client(sharded: ShardedReplay) -> Client:  # what the client's parts work on
        return sharded
