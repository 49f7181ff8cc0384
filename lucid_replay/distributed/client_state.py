"""What a `ShardedReplay` client keeps between calls, and the client its parts work on.

`ClientState` owns the coordinator's own state: the generator that labels batch positions
with shards, beta, the round-robin cursor, each shard's issued-id marks, the global maximum
priority, the count of skipped updates, the queued (deferred) updates, the change counter
streams compare, and the agreed schema. A checkpoint saves and adopts it (`saved`,
`adopt`); an unpickled copy starts from `for_copy`. `TransportStats` holds what the
transport cost. `Client` is the client as the free functions of `routing`, `deferred`,
`coordination`, `gathering`, `checkpoints` and the streams use it: typed, so that every
read and write of client state is checked.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, cast

import attrs
import numpy as np

from lucid_replay.batch_memory import Blocks
from lucid_replay.distributed.mapped import Mapped
from lucid_replay.schema import Schema

__all__: list[str] = []  # internal module

# A shard's issued-id marks: incarnation, next local id, starts of every incarnation,
# [first, end) of each replaced one (see `routing.check_issued`).
Mark = tuple[int, int, list[int], list[list[int]]]
# A shard's queued priority updates, each (ids, errors), in the order they were made.
Queued = list[tuple[np.ndarray, np.ndarray]]


def _unknown_marks(count: int) -> list[Mark | None]:
    return [None] * count


@attrs.define(eq=False)
class ClientState:
    """The coordinator state of one client (see the module's docstring).

    ``changes`` counts this client's calls that may change the shards' masses (adds,
    undeferred updates, draws other than a stream's): a stream reuses the masses its last
    draw reported only while it is unchanged (`coordination.begin`).
    """

    rng: np.random.Generator
    beta: float
    num_shards: int
    cursor: int = 0
    global_max: float = 1.0
    skipped: int = 0
    changes: int = 0
    schema: Schema | None = None
    issued: list[Mark | None] = attrs.field(init=False)
    issued_segments: list[Mark | None] = attrs.field(init=False)
    deferred: list[Queued] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.issued = _unknown_marks(self.num_shards)
        self.issued_segments = _unknown_marks(self.num_shards)
        self.deferred = [[] for _ in range(self.num_shards)]

    def for_copy(self) -> ClientState:
        """The state a copy of the client starts from.

        Beta, the maximum priority, the skipped count and the schema are kept; the copy gets
        its own generator and a random cursor (copies spread their adds), its marks are
        unknown and nothing is queued.
        """
        rng = np.random.default_rng()
        return ClientState(
            rng,
            self.beta,
            self.num_shards,
            cursor=int(rng.integers(self.num_shards)),
            global_max=self.global_max,
            skipped=self.skipped,
            schema=self.schema,
        )

    def saved(self) -> dict[str, Any]:
        """The entries a checkpoint's manifest keeps of this state."""
        return {
            "rng": self.rng.bit_generator.state,
            "beta": self.beta,
            "cursor": self.cursor,
            "max_priority": self.global_max,
            "priority_updates_skipped": self.skipped,
        }

    def adopt(self, manifest: dict[str, Any]) -> None:
        """Take the entries of `saved` from a (checked) manifest."""
        self.rng.bit_generator.state = manifest["rng"]
        self.beta = float(manifest["beta"])
        self.cursor = int(manifest["cursor"])
        self.global_max = float(manifest["max_priority"])
        self.skipped = int(manifest["priority_updates_skipped"])


@attrs.define
class TransportStats:
    """Cumulative and last values of a client's transport (see `ShardedReplay.transport_stats`)."""

    transport: str = "object"
    batches: int = 0
    bytes_copied: int = 0
    bytes_copied_last: int = 0
    batch_bytes_last: int = 0
    draw_seconds: float = 0.0
    draw_seconds_last: float = 0.0
    gather_seconds: float = 0.0
    gather_seconds_last: float = 0.0
    torn_reads: int = 0
    torn_reads_last: int = 0
    windows_redrawn: int = 0
    windows_invalidated: int = 0
    updates_ridden: int = 0

    def note(self, copied: int, size: int, drawing: float, gathering: float, torn: int) -> None:
        """One batch: bytes copied, its bytes, seconds drawing and gathering, torn windows."""
        self.batches += 1
        self.bytes_copied += copied
        self.bytes_copied_last, self.batch_bytes_last = copied, size
        self.draw_seconds += drawing
        self.draw_seconds_last = drawing
        self.gather_seconds += gathering
        self.gather_seconds_last = gathering
        self.torn_reads += torn
        self.torn_reads_last = torn

    def report(self) -> dict[str, Any]:
        """The values as a dict, with the means over every batch."""
        count = max(self.batches, 1)
        values = attrs.asdict(self)
        values["bytes_copied_mean"] = self.bytes_copied / count
        values["copy_ratio_last"] = self.bytes_copied_last / max(self.batch_bytes_last, 1)
        values["draw_seconds_mean"] = self.draw_seconds / count
        values["gather_seconds_mean"] = self.gather_seconds / count
        return values


class Client(Protocol):
    """A `ShardedReplay` as its parts see it: its state, handles, lock and settings."""

    _state: ClientState
    _config: dict[str, Any]
    _lock: threading.RLock
    _control: Any  # the control actor's handle
    _transport_stats: TransportStats
    _blocks: Blocks
    _mapped: dict[int, Mapped]

    @property
    def num_shards(self) -> int: ...
    @property
    def shard_capacity(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def alpha(self) -> float: ...
    @property
    def beta(self) -> float: ...
    @property
    def epsilon(self) -> float: ...
    @property
    def max_times_sampled(self) -> int | None: ...
    @property
    def priority_unit(self) -> str: ...
    @property
    def segment_length(self) -> int | None: ...

    def _check_open(self) -> None: ...
    def _shared(self) -> bool: ...
    def _draw_handles(self) -> list[Any]: ...
    def _call_handles(self) -> list[Any]: ...


def client_of(part: object) -> Client:
    """A part of `ShardedReplay` (its mixins) as the `Client` the whole class is.

    `lucid_replay.distributed.conformance` has mypy check that `ShardedReplay` conforms.
    """
    return cast(Client, part)
