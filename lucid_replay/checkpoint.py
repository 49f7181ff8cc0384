"""Checkpoints: the versioned state-dict format behind `save`/`load`, and its files.

The state holds only what cannot be recomputed: the stored transitions (in offset order), the
episode table, counters, the RNG state and, for prioritized buffers, beta and the maximum
priority. Sum trees are caches of the table and are rebuilt on load; because every node is
recomputed from its children they come back bitwise identical, so draws after ``load`` equal
draws without the round trip.

A state is a dict of plain containers and CPU tensors::

    format, version, class, config, schema, table {first_id, next_id, oldest_offset,
    next_offset, generation, columns[, episodes]}, data, counts, evicted_unsampled,
    episodes_retired, rng, extra[, trees]

``table.episodes`` is the episode directory of a buffer with ``segment_length``. ``trees``
lists the cached sum trees' keys and scales: a tree's leaves depend on the scale it was
built at, so the trees are rebuilt at those scales and draws after a load are bitwise the
saved buffer's (files without it load; their trees are rebuilt when first drawn from).

Files (version 2) add ``checksum``: the SHA-256 of every other entry in a canonical encoding,
so that a flipped bit anywhere in the payload is refused, and are written whole or not at all
(`lucid_replay.files`). Version 1 files, which predate the checksum, still load. This module
packs and unpacks `Snapshot` records and knows no buffer class: the buffers register themselves
by name.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs
import torch

from lucid_replay import files
from lucid_replay.errors import CheckpointError
from lucid_replay.ring import TransitionRing
from lucid_replay.schema import Schema
from lucid_replay.table import EpisodeTable

__all__: list[str] = []  # internal module

FORMAT = "lucid_replay.buffer"
VERSION = 2
READABLE_VERSIONS = (1, 2)
COUNTS = (
    "episodes_added",
    "transitions_added",
    "episodes_evicted",
    "transitions_evicted",
    "chunks_sampled",
)
_KEYS = (
    "format",
    "version",
    "class",
    "config",
    "schema",
    "table",
    "data",
    "counts",
    "evicted_unsampled",
    "episodes_retired",
    "rng",
    "extra",
)
_classes: dict[str, type] = {}
_T = TypeVar("_T")


def register(cls: type) -> None:
    """Make checkpoints of class ``cls`` loadable by its name."""
    _classes[cls.__name__] = cls


def saved_class(state: Mapping[str, Any]) -> type:
    """The registered class a checkpoint was saved from."""
    name = state.get("class")
    if not isinstance(name, str) or name not in _classes:
        raise CheckpointError(f"checkpoint class must be one of {sorted(_classes)}, got {name!r}")
    return _classes[name]


@attrs.frozen(eq=False)
class Snapshot:
    """Everything a buffer saves, as the objects it computes with."""

    class_name: str
    config: dict[str, Any]
    schema: Schema | None
    table: EpisodeTable
    ring: TransitionRing
    counts: dict[str, int]
    evicted_unsampled: int
    episodes_retired: int
    rng: torch.Tensor
    extra: dict[str, Any]
    trees: list[tuple[int, int, float | None, float]] = attrs.field(factory=list)


def pack(snapshot: Snapshot) -> dict[str, Any]:
    """The state of ``snapshot`` as plain containers and CPU tensors (copies)."""
    table, ring = snapshot.table, snapshot.ring
    stored = table.num_transitions
    columns, episodes = table.saved_columns()
    data = {}
    if snapshot.schema is not None and stored:
        data = {k: v.cpu() for k, v in ring.read(table.oldest_offset, stored).items()}
    return {
        "format": FORMAT,
        "version": VERSION,
        "class": snapshot.class_name,
        "config": dict(snapshot.config),
        "schema": {} if snapshot.schema is None else snapshot.schema.to_state(),
        "table": {
            "first_id": table.first_id,
            "next_id": table.next_id,
            "oldest_offset": table.oldest_offset,
            "next_offset": table.next_offset,
            "generation": table.generation,
            "columns": columns,
            **({} if episodes is None else {"episodes": episodes}),
        },
        "data": data,
        "counts": dict(snapshot.counts),
        "evicted_unsampled": snapshot.evicted_unsampled,
        "episodes_retired": snapshot.episodes_retired,
        "rng": snapshot.rng.clone(),
        "extra": dict(snapshot.extra),
        "trees": [list(key) for key in snapshot.trees],
    }


def unpack(state: Mapping[str, Any], *, device: torch.device, capacity: int) -> Snapshot:
    """A `Snapshot` of ``state`` on ``device``, every structural invariant checked.

    What depends on the buffer loading it (configuration, counters against the table, the
    RNG against its generator, priorities) is checked by the buffer.

    Raises
    ------
    CheckpointError
        For anything that is not a complete, consistent state of a readable version.
    """
    check_header(state)
    if "checksum" in state:
        verify(state)
    missing = [key for key in _KEYS if key not in state]
    if missing:
        raise CheckpointError(f"state must be a complete checkpoint, got one without {missing}")
    try:
        schema = Schema.from_state(state["schema"]) if state["schema"] else None
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint {error}") from None
    saved_table = state["table"]
    if not isinstance(saved_table, Mapping):
        raise CheckpointError(f"checkpoint table must be a mapping, got {saved_table!r}")
    table = EpisodeTable.from_columns(
        saved_table.get("columns", {}),
        saved_table,
        device=device,
        capacity=capacity,
        episodes=saved_table.get("episodes"),
    )
    ring = TransitionRing(capacity, device)
    if schema is None:
        if table.num_transitions or state["data"]:
            raise CheckpointError("checkpoint schema must describe its stored data, got none")
    else:
        ring.allocate(schema)
        if table.num_transitions:
            ring.write(table.oldest_offset, _checked_data(state["data"], schema, table))
        elif state["data"]:
            raise CheckpointError("checkpoint data must be empty with no stored transitions")
    counts = state["counts"]
    if not isinstance(counts, Mapping) or set(counts) != set(COUNTS):
        got = sorted(counts) if isinstance(counts, Mapping) else type(counts).__name__
        raise CheckpointError(f"checkpoint counts must be {sorted(COUNTS)}, got {got}")
    rng = state["rng"]
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.dim() != 1:
        raise CheckpointError(f"checkpoint rng must be a 1-d uint8 tensor, got {_describe(rng)}")
    extra = state["extra"]
    if not isinstance(extra, Mapping):
        raise CheckpointError(f"checkpoint extra state must be a mapping, got {_describe(extra)}")
    config = state["config"]
    if not isinstance(config, Mapping):
        raise CheckpointError(f"checkpoint configuration must be a mapping, got {config!r}")
    return Snapshot(
        class_name=str(state["class"]),
        config=dict(config),
        schema=schema,
        table=table,
        ring=ring,
        counts={name: _count(f"counts[{name!r}]", counts[name]) for name in COUNTS},
        evicted_unsampled=_count("evicted_unsampled", state["evicted_unsampled"]),
        episodes_retired=_count("episodes_retired", state["episodes_retired"]),
        rng=rng.clone(),
        extra=dict(extra),
        trees=_checked_trees(state.get("trees", [])),
    )


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


def construct(state: Mapping[str, Any], expected: type[_T], device: object) -> _T:
    """A fresh buffer of the class and configuration ``state`` was saved with.

    ``expected`` is the class ``load`` was called on: the saved class must derive from it.
    ``device`` (if not ``None``) replaces the saved storage device.
    """
    saved = saved_class(state)
    if not issubclass(saved, expected):
        raise CheckpointError(
            f"checkpoint class must be a {expected.__name__}, got {state.get('class')!r}"
        )
    config = state.get("config")  # a version-1 header may come without one
    if not isinstance(config, Mapping):
        raise CheckpointError(f"checkpoint configuration must be a mapping, got {config!r}")
    config = dict(config)
    if device is not None:
        config["device"] = device
    try:
        if config.get("schema") is not None:  # saved as plain containers
            config["schema"] = Schema.from_state(config["schema"])
        return saved(**config)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint configuration must be valid, got {error}") from None


def check_header(state: object, class_name: str | None = None) -> None:
    """Refuse a state of another format, an unreadable version, or (given one) another class."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise CheckpointError(f"state must be a {FORMAT!r} checkpoint, got {_describe(state)}")
    if state.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint version must be one of {READABLE_VERSIONS}, got {state.get('version')!r}"
        )
    if class_name is not None and state.get("class") != class_name:
        raise CheckpointError(
            f"checkpoint class must be a {class_name}, got {state.get('class')!r}"
        )


# ------------------------------------------------------------------------------ files
def write(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Write ``state`` with its checksum to ``path``, whole or not at all (see `files`)."""
    payload = {**state, "checksum": checksum(state)}
    files.write_atomically(path, lambda file: torch.save(payload, file))


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint file, refusing anything that is not one or whose checksum fails.

    Returns the state without its checksum.
    """
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
    if state["version"] >= 2:
        if "checksum" not in state:
            raise CheckpointError("checkpoint file must carry a checksum, got none")
        verify(state)
    return {key: value for key, value in state.items() if key != "checksum"}


def checksum(state: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of every entry but ``checksum``, in a canonical encoding."""
    digest = hashlib.sha256()
    _feed(digest, {key: value for key, value in state.items() if key != "checksum"})
    return digest.hexdigest()


def verify(state: Mapping[str, Any]) -> None:
    """Refuse ``state`` unless its ``checksum`` entry matches its contents."""
    expected = state.get("checksum")
    if not isinstance(expected, str) or expected != checksum(state):
        raise CheckpointError(
            "checkpoint checksum must match its payload, got a mismatch: the file is corrupt"
        )


def _feed(digest: Any, value: object) -> None:
    """Hash ``value`` with its type and structure, so equal digests mean equal states."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().data)
    elif isinstance(value, Mapping):
        digest.update(f"M{len(value)}".encode())
        for key in sorted(value, key=repr):
            _feed(digest, key)
            _feed(digest, value[key])
    elif isinstance(value, list | tuple):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def _checked_data(data: object, schema: Schema, table: EpisodeTable) -> dict[str, torch.Tensor]:
    """Stored data with exactly the schema's fields, dtypes and ``[stored, *shape]`` shapes."""
    if not isinstance(data, Mapping) or set(data) != set(schema):
        got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise CheckpointError(f"checkpoint data fields must be {sorted(schema)}, got {got}")
    stored = table.num_transitions
    for name, (shape, dtype) in schema.items():
        values = data[name]
        if not isinstance(values, torch.Tensor) or values.dtype != dtype:
            raise CheckpointError(
                f"checkpoint data {name!r} must be a {dtype} tensor, got {_describe(values)}"
            )
        if values.layout != torch.strided or tuple(values.shape) != (stored, *shape):
            raise CheckpointError(
                f"checkpoint data {name!r} must have shape {(stored, *shape)}, "
                f"got {tuple(values.shape)}"
            )
    return dict(data)


def _checked_trees(saved: object) -> list[tuple[int, int, float | None, float]]:
    """The saved trees' keys and scales: ``[span >= 1, extra >= 0, alpha, scale > 0]`` each.

    Files written before trees were saved have none (their trees are rebuilt as needed).
    """
    if not isinstance(saved, list | tuple):
        raise CheckpointError(f"checkpoint trees must be a list, got {_describe(saved)}")
    trees = []
    for entry in saved:
        ok = isinstance(entry, list | tuple) and len(entry) == 4
        span, extra, alpha, scale = entry if ok else (None, None, None, None)
        ints = all(type(v) is int and v >= low for v, low in ((span, 1), (extra, 0)))
        alpha_ok = alpha is None or (type(alpha) is float and math.isfinite(alpha) and alpha >= 0)
        scale_ok = type(scale) is float and math.isfinite(scale) and scale > 0
        if not (ok and ints and alpha_ok and scale_ok):
            raise CheckpointError(
                "checkpoint trees must be [span >= 1, extra >= 0, alpha, finite scale > 0] "
                f"entries, got {entry!r}"
            )
        trees.append((int(span), int(extra), alpha, float(scale)))  # type: ignore[arg-type]
    return trees


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"checkpoint {name} must be an int >= 0, got {value!r}")
    return value


def _describe(state: object) -> str:
    if isinstance(state, torch.Tensor):
        return f"a {state.dtype} tensor of shape {tuple(state.shape)}"
    if isinstance(state, Mapping):
        return f"a mapping with format {state.get('format')!r}"
    return f"a {type(state).__name__}"
