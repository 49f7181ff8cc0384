"""Routing of a sharded replay: adds round robin, priority updates and write-backs by id.

Adds go to the shards in turn, one call per shard per `extend`, after the limiter admitted
their transitions; what each shard stored counts towards what samplers wait on once it
replied, what a shard refused is given back. An `extend` over several shards tells each
where its episodes lie in the whole add, so that the add takes one range of the replay-wide
commit counter with its episodes in their order (`lucid_replay.distributed.commits`), as one buffer
commits them. Priority updates are checked whole, routed by
id, and the maximum priority is kept global. Under ``priority_unit="segment"`` the ids are
global segment ids, encoded, checked and routed as episode ids are, against each shard's
marks of its segment ids.

An update is refused, on every shard, if any id is one no shard issued: negative, of a shard
the replay does not have, of an incarnation that has not started, or outside what its
incarnation issued (``[start, next id)`` for the running one, the range it had issued when
it was replaced for an earlier one). The client knows each shard's marks from earlier
replies and asks again only for a shard whose marks an id falls outside. Ids a shard issued
but lost in a restart, or evicted, are skipped there.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import torch

import lucid_replay.distributed.calls as calls
import lucid_replay.distributed.coordination as coordination
import lucid_replay.distributed.deferred as deferred
import lucid_replay.distributed.ids as ids
import lucid_replay.distributed.transport as transport
from lucid_replay.batch import record_positions
from lucid_replay.checks import as_vector
from lucid_replay.distributed.client_state import Client, Mark
from lucid_replay.errors import must, wrong_kind
from lucid_replay.priorities import batch_errors, priorities_of
from lucid_replay.schema import Schema
from lucid_replay.store import check_episode

__all__: list[str] = []  # internal module


def update(replay: Client, indices: Any, errors: Any) -> int:
    """`ShardedReplay.update_priorities` (updates deferred before it are applied first)."""
    with replay._lock:  # one update at a time: marks, counters and the maximum
        id_values, values, shard_of = checked_update(replay, indices, errors)
        deferred.flush(replay)
        replay._state.changes += 1
        shards = replay._call_handles()
        futures = [
            shards[k].update.remote(id_values[shard_of == k], values[shard_of == k])
            for k in np.unique(shard_of).tolist()
        ]
        return deferred.settle_replies(replay, calls.get(futures))


def checked_update(replay: Client, indices: Any, errors: Any) -> tuple[Any, Any, np.ndarray]:
    """An update's ids and errors as numpy arrays, checked, and each id's shard."""
    cpu = torch.device("cpu")
    id_values = as_vector("indices", indices, torch.int64, cpu).numpy()
    values = as_vector("errors", errors, torch.float64, cpu).numpy()
    if id_values.shape != values.shape:
        raise must("errors", f"as long as indices ({id_values.size})", values.size)
    priorities_of(torch.from_numpy(values), replay.epsilon)  # the one buffer's refusals
    shard_of = check_issued(replay, id_values, segments=replay.priority_unit == "segment")
    return id_values, values, shard_of


def check_issued(replay: Client, global_ids: np.ndarray, *, segments: bool = False) -> np.ndarray:
    """Each id's shard, after refusing any id no shard has issued (marks refreshed once).

    ``segments``: the ids are segment ids (checked against the shards' segment marks).
    """
    marks = replay._state.issued_segments if segments else replay._state.issued
    shard, incarnation, local = ids.decode(global_ids)
    bad = _never_issued(marks, replay.num_shards, global_ids, shard, incarnation, local)
    if bad.any():  # marks may be stale: ask those shards once
        suspects = np.unique(shard[bad & (global_ids >= 0) & (shard < replay.num_shards)])
        shards = replay._call_handles()
        futures = [shards[k].issued.remote(segments) for k in suspects.tolist()]
        for k, mark in zip(suspects.tolist(), calls.get(futures), strict=True):
            marks[k] = mark
        bad = _never_issued(marks, replay.num_shards, global_ids, shard, incarnation, local)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        what = "segment" if segments else "episode"
        raise must(f"indices[{at}]", f"an issued {what} id of this replay", int(global_ids[at]))
    return shard


def _never_issued(
    marks: list[Mark | None],
    num_shards: int,
    global_ids: np.ndarray,
    shard: np.ndarray,
    incarnation: np.ndarray,
    local: np.ndarray,
) -> np.ndarray:
    bad: np.ndarray = (global_ids < 0) | (shard >= num_shards)
    for k in np.unique(shard[~bad]).tolist():
        mine = (shard == k) & ~bad
        mark: Mark | None = marks[k]
        if mark is None:
            bad |= mine
            continue
        current, next_id, starts, ranges = mark
        bounds = np.asarray([*ranges, [starts[current], next_id]], dtype=np.int64)
        inc, loc = incarnation[mine], local[mine]
        first, end = bounds[np.minimum(inc, current)].T
        bad[mine] = (inc > current) | (loc < first) | (loc >= end)
    return bad


def from_batch(
    replay: Client, batch: Any, errors: Any, *, eta: float, mask: Any, defer: bool = False
) -> int:
    """`ShardedReplay.update_priorities_from` (``defer``: ride the next draw request)."""
    by_segment = replay.priority_unit == "segment"
    anchor_ids, values, per_record = batch_errors(
        batch, errors, eta=eta, mask=mask, by_segment=by_segment
    )
    if per_record:
        anchor_ids, values = anchor_ids.cpu(), values.cpu()
    if defer:
        return defer_update(replay, anchor_ids, values)
    return update(replay, anchor_ids, values)


def defer_update(replay: Client, indices: Any, errors: Any) -> int:
    """Check an update now and queue it to ride the next draw request (`deferred`)."""
    with replay._lock:
        return deferred.queue(replay, *checked_update(replay, indices, errors))


def write_back(replay: Client, batch: Any, name: str, values: Any) -> int:
    """`ShardedReplay.write_back`: each shard writes the records of its own episodes."""
    episode_ids, steps, mask = (t.cpu().numpy() for t in record_positions(batch))
    if not isinstance(values, torch.Tensor):
        raise wrong_kind("values", "a tensor", type(values).__name__)
    host = values.detach().cpu().numpy()
    shard = ids.decode(episode_ids)[0]
    shards = replay._call_handles()
    futures = [
        shards[k].write_back.remote(name, episode_ids, steps, mask & (shard == k), host)
        for k in np.unique(shard[mask]).tolist()
        if 0 <= k < replay.num_shards
    ]
    return int(sum(calls.get(futures)))


def known_schema(replay: Client) -> Schema | None:
    """The replay's schema, asked of the control until the first stored steps fixed one."""
    if replay._state.schema is None:
        known = calls.get(replay._control.schema.remote())
        replay._state.schema = None if known is None else Schema.from_state(known)
    schema: Schema | None = replay._state.schema
    return schema


def agree_schema(replay: Client, schema: Schema) -> Schema:
    """Propose ``schema`` as the replay's (the first proposal wins); the replay's schema."""
    agreed = Schema.from_state(calls.get(replay._control.propose_schema.remote(schema.to_state())))
    replay._state.schema = agreed
    return agreed


def add(replay: Client, episodes: list[Any], timeout: float | None) -> list[int]:
    """`ShardedReplay.extend`: every episode checked, then one call per shard in parallel."""
    schema = known_schema(replay) if episodes else replay._state.schema
    declared = replay._config["schema"] is not None  # casts as a declared schema's buffer
    for episode in episodes:
        schema = check_episode(episode, schema, replay.shard_capacity, declared=declared)
    if not episodes:
        return []
    lengths = np.array([len(e) for e in episodes], dtype=np.int64)
    transitions = int(lengths.sum())
    coordination.acquire(replay, transitions, inserting=True, timeout=timeout)
    targets = (replay._state.cursor + np.arange(len(episodes))) % replay.num_shards
    shards = np.unique(targets).tolist()
    # An add over several shards takes one range of the replay's commit counter, its
    # episodes placed in their order here (`lucid_replay.distributed.commits`).
    token, places = (secrets.randbits(62), np.cumsum(lengths)) if len(shards) > 1 else (0, None)
    futures: dict[int, Any] = {}
    replies: dict[int, np.ndarray] = {}
    failure: BaseException | None = None
    handles = replay._call_handles()
    try:
        for k in shards:
            mine = np.flatnonzero(targets == k)
            packed = [transport.pack_episode(episodes[i]) for i in mine]
            if places is None:  # one shard: its episodes take their counters as they arrive
                futures[k] = handles[k].add.remote(packed)
            else:
                call = (token, transitions, len(shards), places[mine], lengths[mine])
                futures[k] = handles[k].add.remote(packed, call)
    except BaseException as error:
        failure = error
    for k, future in futures.items():  # each shard's reply, also when another one failed
        try:
            replies[k] = calls.get(future)
        except BaseException as error:
            failure = failure or error
    stored = sum(int(lengths[targets == k].sum()) for k in replies)
    coordination.settle(replay, stored, transitions - stored)
    if failure is not None:
        raise failure
    with replay._lock:
        replay._state.cursor += len(episodes)  # only once stored: a refused call routes nothing
    result = np.empty(len(episodes), dtype=np.int64)
    for k, global_ids in replies.items():
        result[targets == k] = global_ids
    return [int(i) for i in result]
