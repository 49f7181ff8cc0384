"""Checkpoints: the versioned state-dict format behind `save`/`load`.

The state holds only what cannot be recomputed: the stored transitions (in offset order), the
episode table, counters, the RNG state and, for prioritized buffers, beta and the maximum
priority. Sum trees are caches of the table and are rebuilt on load; because every node is
recomputed from its children they come back bitwise identical, so draws after ``load`` equal
draws without the round trip.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from lucid_replay.errors import CheckpointError
from lucid_replay.storage import EpisodeTable, TransitionRing

if TYPE_CHECKING:
    from lucid_replay.replay import SequenceReplay

__all__: list[str] = []  # internal module

FORMAT = "lucid_replay.buffer"
VERSION = 1


def pack(buffer: SequenceReplay) -> dict[str, Any]:
    """The buffer's state as plain containers and CPU tensors."""
    table = buffer._table
    schema = buffer._schema or {}
    data = {}
    if buffer._schema is not None and len(buffer):
        data = {k: v.cpu() for k, v in buffer._ring.read(table.oldest_offset, len(buffer)).items()}
    return {
        "format": FORMAT,
        "version": VERSION,
        "class": type(buffer).__name__,
        "config": buffer._config(),
        "schema": {name: [list(shape), str(dtype)] for name, (shape, dtype) in schema.items()},
        "table": {
            "first_id": table.first_id,
            "next_id": table.next_id,
            "oldest_offset": table.oldest_offset,
            "next_offset": table.next_offset,
            "generation": table.generation,
            "columns": {k: v.cpu().clone() for k, v in table.columns.items()},
        },
        "data": data,
        "counts": dict(buffer._counts),
        "evicted_unsampled": int(buffer._evicted_unsampled),
        "episodes_retired": int(buffer._sampler.episodes_retired),
        "rng": buffer._generator.get_state(),
        "extra": buffer._extra_state(),
    }


def read(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """Load a checkpoint file, refusing anything that is not one."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise CheckpointError(
            f"path must be a lucid_replay checkpoint, got an unreadable file {str(path)!r} "
            f"({type(error).__name__})"
        ) from None
    check_header(state)
    return cast(Mapping[str, Any], state)


def check_header(state: object) -> None:
    """Refuse states of another format or version."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise CheckpointError(f"state must be a {FORMAT!r} checkpoint, got {_describe(state)}")
    if state.get("version") != VERSION:
        raise CheckpointError(f"checkpoint version must be {VERSION}, got {state.get('version')!r}")


def construct(state: Mapping[str, Any], device: torch.device | str | None) -> SequenceReplay:
    """A fresh buffer of the saved class and configuration (not yet loaded)."""
    from lucid_replay.prioritized import PrioritizedSequenceReplay
    from lucid_replay.replay import SequenceReplay

    classes = {c.__name__: c for c in (SequenceReplay, PrioritizedSequenceReplay)}
    check_header(state)
    if state.get("class") not in classes:
        raise CheckpointError(
            f"checkpoint class must be one of {sorted(classes)}, got {state.get('class')!r}"
        )
    config = dict(state["config"])
    if device is not None:
        config["device"] = device
    return classes[state["class"]](**config)


def wrong_class(expected: type, state: Mapping[str, Any]) -> CheckpointError:
    """The error for loading a checkpoint of one class through an unrelated one."""
    return CheckpointError(
        f"checkpoint class must be a {expected.__name__}, got {state.get('class')!r}"
    )


def unpack_into(buffer: SequenceReplay, state: Mapping[str, Any]) -> None:
    """Replace ``buffer``'s contents with ``state``; validate fully before touching anything."""
    check_header(state)
    if state.get("class") != type(buffer).__name__:
        raise wrong_class(type(buffer), state)
    try:
        schema = {
            name: (tuple(int(n) for n in shape), _dtype(dtype))
            for name, (shape, dtype) in state["schema"].items()
        }
        config, saved_table = dict(state["config"]), state["table"]
        capacity = int(config["capacity"])
        table = EpisodeTable(buffer.device)
        columns = saved_table["columns"]
        slots = int(columns["episode_id"].shape[0])
        table._allocate(slots)
        for name, column in table.columns.items():
            column.copy_(columns[name].to(device=buffer.device, dtype=column.dtype))
        if buffer.device.type != "cpu":
            table.host_start[:] = columns["start"].numpy()
            table.host_length[:] = columns["length"].numpy()
        table.first_id, table.next_id = int(saved_table["first_id"]), int(saved_table["next_id"])
        table.oldest_offset = int(saved_table["oldest_offset"])
        table.next_offset = int(saved_table["next_offset"])
        table.generation = int(saved_table["generation"])
        _check_table(table, capacity)
        ring = TransitionRing(capacity, buffer.device)
        stored = table.next_offset - table.oldest_offset
        if schema:
            ring.allocate(schema)
            if stored:
                data = state["data"]
                _check_data(data, schema, stored)
                ring.write(table.oldest_offset, data)
        counts = {k: int(state["counts"][k]) for k in buffer._counts}
        retired, evicted_unsampled = int(state["episodes_retired"]), int(state["evicted_unsampled"])
        extra = state["extra"]
        rng = state["rng"]
        if not isinstance(rng, torch.Tensor) or rng.shape != buffer._generator.get_state().shape:
            raise CheckpointError("checkpoint rng must be a state of this buffer's generator")
        buffer._check_config(config)
        buffer._check_extra_state(extra)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as error:
        raise CheckpointError(
            f"state must be a complete checkpoint, got one that fails with "
            f"{type(error).__name__}: {error}"
        ) from None
    # Nothing below can fail on a validated state: commit.
    buffer._capacity = capacity
    buffer._schema = schema or None
    buffer._ring = ring
    buffer._table = table
    buffer._sampler.table = table
    buffer._sampler.invalidate()
    buffer._sampler.episodes_retired.fill_(retired)
    buffer._counts = counts
    buffer._evicted_unsampled = evicted_unsampled
    buffer._generator.set_state(rng)
    buffer._load_extra_state(extra)


def _check_table(table: EpisodeTable, capacity: int) -> None:
    """Refuse a table whose id and offset ranges contradict each other or the capacity."""
    rows = table.row_count
    ids_ok = 0 <= table.first_id <= table.next_id and table.num_episodes <= rows
    offsets_ok = 0 <= table.oldest_offset <= table.next_offset
    if not (ids_ok and offsets_ok and rows & (rows - 1) == 0):
        raise CheckpointError("checkpoint table must hold consistent id and offset ranges")
    if table.num_transitions > capacity:
        raise CheckpointError(
            f"checkpoint transitions must fit its capacity ({capacity}), "
            f"got {table.num_transitions}"
        )
    stored = table.stored_rows()
    lengths = table.length[stored]
    if table.num_episodes and (
        int(lengths.sum()) != table.num_transitions
        or int(table.start[stored[0]]) != table.oldest_offset
        or not bool(
            (
                table.episode_id[stored]
                == torch.arange(table.first_id, table.next_id, device=table.device)
            ).all()
        )
    ):
        raise CheckpointError("checkpoint table rows must describe the stored transitions")
    if not table.num_episodes and table.num_transitions:
        raise CheckpointError("checkpoint table must hold episodes for its transitions")


def _check_data(data: Mapping[str, Any], schema: Mapping[str, Any], stored: int) -> None:
    """Refuse stored data whose fields, shapes or dtypes differ from the schema."""
    if set(data) != set(schema):
        raise CheckpointError(
            f"checkpoint data fields must be {sorted(schema)}, got {sorted(data)}"
        )
    for name, (shape, dtype) in schema.items():
        values = data[name]
        if not isinstance(values, torch.Tensor) or values.dtype != dtype:
            raise CheckpointError(f"checkpoint data {name!r} must be a {dtype} tensor")
        if tuple(values.shape) != (stored, *shape):
            raise CheckpointError(
                f"checkpoint data {name!r} must have shape {(stored, *shape)}, "
                f"got {tuple(values.shape)}"
            )


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"schema dtype must be a torch dtype, got {name!r}")
    return dtype


def _describe(state: object) -> str:
    if isinstance(state, Mapping):
        return f"a mapping with format {state.get('format')!r}"
    return f"a {type(state).__name__}"
