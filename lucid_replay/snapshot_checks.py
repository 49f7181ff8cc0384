"""What a checkpoint's `Snapshot` must satisfy before a buffer of a given configuration adopts it.

`lucid_replay.checkpoint` checks that a state is well formed (its table, data, counters and
RNG state each sound); these checks tie the parts to each other and to the buffer loading
them: the configuration must match, counters must match the table, draw counts the reuse
limit, and the RNG state must be one the buffer's generator accepts. Priorities are checked
by the buffer's `Priorities`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from lucid_replay.errors import CheckpointError

if TYPE_CHECKING:
    from lucid_replay.checkpoint import Snapshot

__all__: list[str] = []  # internal module


def check_adoptable(
    snapshot: Snapshot,
    config: Mapping[str, Any],
    *,
    reuse_limit: int | None,
    prioritized: bool,
    device: torch.device,
) -> None:
    """Refuse a snapshot a buffer of ``config`` cannot adopt (all but its priority state).

    The configuration must match (the storage device aside), counters must match the table,
    draw counts the reuse limit, and the RNG state must be one torch accepts on ``device``.
    A uniform buffer's priorities are all 1 and it has no extra state.
    """
    mine = {k: v for k, v in config.items() if k != "device"}
    theirs = {"schema": None, **{k: v for k, v in snapshot.config.items() if k != "device"}}
    if mine != theirs:
        raise CheckpointError(f"checkpoint configuration must be {mine}, got {theirs}")
    _check_consistent(snapshot, reuse_limit, device)
    if not prioritized:
        table = snapshot.table
        stored = table.priority[table.stored_rows()]
        if snapshot.extra:
            raise CheckpointError(f"checkpoint extra state must be empty, got {snapshot.extra}")
        if not bool((stored == 1.0).all()):
            raise CheckpointError(
                "checkpoint priority of every episode of a uniform buffer must be 1, got "
                f"{sorted(set(stored.tolist()) - {1.0})[:3]}"
            )


def _check_consistent(snapshot: Snapshot, reuse_limit: int | None, device: torch.device) -> None:
    """Refuse a snapshot whose parts contradict each other.

    Counters must match the table they were saved with, draw counts the reuse limit, and
    the RNG state must be one torch accepts for a generator on ``device``.
    """
    table, counts = snapshot.table, snapshot.counts
    stored = table.stored_rows()
    times = table.times_sampled[stored]
    added, evicted = table.next_id, table.first_id
    if table.directory is not None:  # episodes are not rows: bounds, not equalities
        directory = table.directory
        times = directory.columns["times"][torch.from_numpy(directory.live_slots().copy())]
        added, evicted = counts["episodes_added"], counts["episodes_evicted"]
        if not evicted <= added <= directory.next_episode_id:
            raise CheckpointError(
                "checkpoint counts must have episodes_evicted <= episodes_added <= "
                f"next_episode_id ({directory.next_episode_id}), got {evicted} and {added}"
            )
    expected = {
        "episodes_added": added,
        "episodes_evicted": evicted,
        "transitions_added": table.next_offset,
        "transitions_evicted": table.oldest_offset,
    }
    for name, value in expected.items():
        if counts[name] != value:
            raise CheckpointError(
                f"checkpoint counts[{name!r}] must equal the table's {value}, got {counts[name]}"
            )
    if snapshot.evicted_unsampled > evicted:
        raise CheckpointError(
            f"checkpoint evicted_unsampled must be <= episodes_evicted ({evicted}), "
            f"got {snapshot.evicted_unsampled}"
        )
    if reuse_limit is not None and bool((times > reuse_limit).any()):
        raise CheckpointError(
            f"checkpoint times_sampled must be <= max_times_sampled={reuse_limit}, "
            f"got {int(times.max())}"
        )
    if int(times.sum()) > counts["chunks_sampled"]:
        raise CheckpointError(
            f"checkpoint chunks_sampled must be >= the draws of stored episodes "
            f"({int(times.sum())}), got {counts['chunks_sampled']}"
        )
    retired = 0 if reuse_limit is None else int((times >= reuse_limit).sum())
    if not retired <= snapshot.episodes_retired <= added:
        raise CheckpointError(
            f"checkpoint episodes_retired must be in [{retired}, {added}] for its "
            f"table, got {snapshot.episodes_retired}"
        )
    try:  # on a scratch generator, so that the buffer's own stays untouched
        torch.Generator(device=device).set_state(snapshot.rng)
    except (RuntimeError, TypeError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint rng must be a state of this buffer's generator, got one torch "
            f"refuses ({str(error).splitlines()[0]})"
        ) from None
