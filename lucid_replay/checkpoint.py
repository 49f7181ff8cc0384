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

``data`` holds each field's stored transitions in offset order: one ``[stored, *shape]``
tensor, or a list of pieces in order, ``[n, *shape]`` each (files from version 3 on): a file
is written straight from the ring's memory (`ring_export.export`), which holds a field's
transitions in two pieces where they cross the ring's seam. `state_dict` always joins them.

Files add ``checksum`` (from version 2): the SHA-256 of every other entry in a canonical
encoding, so that a flipped bit anywhere in the payload is refused, and are written whole or
not at all (`lucid_replay.files`). They are read through a memory map, and the data copied
into the ring field by field, so a load never holds a second copy of the data in the
process's own memory. Version 1 files, which predate the checksum, and version 2 files,
whose fields are one tensor each, still load. This module packs and unpacks `Snapshot`
records and knows no buffer class: the buffers register themselves by name.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs
import torch

from lucid_replay import files, ring_export
from lucid_replay.allocators import Allocator
from lucid_replay.blocks import CACHE_BYTES
from lucid_replay.errors import CheckpointError
from lucid_replay.laws import LawKey
from lucid_replay.ring import TransitionRing
from lucid_replay.schema import Schema
from lucid_replay.selectors import from_key, selector_of_state
from lucid_replay.table import EpisodeTable

__all__: list[str] = []  # internal module

FORMAT = "lucid_replay.buffer"
VERSION = 3  # 3: a field's data may be a list of pieces
READABLE_VERSIONS = (1, 2, 3)
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
    trees: list[tuple[int, int, LawKey, float]] = attrs.field(factory=list)


def pack(snapshot: Snapshot, *, copy: bool = True) -> dict[str, Any]:
    """The state of ``snapshot`` as plain containers and tensors.

    With ``copy`` (`state_dict`), every tensor is a CPU copy and each field's data one
    ``[stored, *shape]`` tensor. Without it, the data are the ring's own memory, uncopied
    (`ring_export.export`): a field is one tensor, or a list of two where its transitions
    cross the ring's seam, on the ring's device. Write such a state out before the ring
    changes (`write`, under the buffer's lock).
    """
    table, ring = snapshot.table, snapshot.ring
    stored = table.num_transitions
    columns, episodes = table.saved_columns()
    data: dict[str, Any] = {}
    if snapshot.schema is not None and stored:
        for name, pieces in ring_export.export(ring, table.oldest_offset, stored):
            if copy:
                data[name] = torch.cat(pieces).cpu()  # a copy on the ring's device, if not CPU
            else:
                data[name] = pieces[0] if len(pieces) == 1 else pieces
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


def unpack(
    state: Mapping[str, Any],
    *,
    device: torch.device,
    capacity: int,
    allocator: Allocator,
    in_place: bool = False,
    cache_bytes: int = CACHE_BYTES,
) -> Snapshot:
    """A `Snapshot` of ``state`` on ``device``, every structural invariant checked.

    Its ring's storage comes from ``allocator`` (the loading buffer's); the data are copied
    into it one field at a time. ``in_place``: the state has no data, ``allocator`` maps the
    storage that already holds them (a synced ``storage="memmap"`` directory).

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
    ring = TransitionRing(capacity, device, allocator, cache_bytes)
    if schema is None:
        if table.num_transitions or state["data"]:
            raise CheckpointError("checkpoint schema must describe its stored data, got none")
    elif in_place:
        if state["data"]:
            raise CheckpointError("checkpoint data must be in the directory's files, got data")
        ring.allocate(schema)
    elif table.num_transitions:
        data = _checked_data(state["data"], schema, table)
        ring.allocate(schema)
        for name, pieces in data.items():
            ring_export.fill(ring, name, table.oldest_offset, pieces)
    elif state["data"]:
        raise CheckpointError("checkpoint data must be empty with no stored transitions")
    else:
        ring.allocate(schema)
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
    _check_declared(schema, config.get("schema"))
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


def _check_declared(schema: Schema | None, declared: Any) -> None:
    """Refuse stored data whose schema is not the declared one (frame stacks included).

    Only a declared schema has stacked fields: a buffer stores under its declared schema.
    """
    try:
        wanted = None if declared is None else Schema.from_state(declared)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint configuration must be valid, got {error}") from None
    if wanted is None and schema is not None and schema.stacks:
        raise CheckpointError(
            f"checkpoint schema must have no stacked fields without a declared schema, got "
            f"{sorted(schema.stacks)}"
        )
    if wanted is not None and schema is not None and wanted != schema:
        raise CheckpointError(
            f"checkpoint schema must be the declared schema {wanted!r}, got {schema!r}"
        )


def construct(
    state: Mapping[str, Any],
    expected: type[_T],
    device: object,
    overrides: Mapping[str, Any] | None = None,
) -> _T:
    """A fresh buffer of the class and configuration ``state`` was saved with.

    ``expected`` is the class ``load`` was called on: the saved class must derive from it.
    ``device`` (if not ``None``) replaces the saved storage device; ``overrides`` are
    constructor arguments a checkpoint does not keep (where the storage is).
    """
    saved = saved_class(state)
    if not issubclass(saved, expected):
        raise CheckpointError(
            f"checkpoint class must be a {expected.__name__}, got {state.get('class')!r}"
        )
    config = state.get("config")  # a version-1 header may come without one
    if not isinstance(config, Mapping):
        raise CheckpointError(f"checkpoint configuration must be a mapping, got {config!r}")
    config = {**config, **(overrides or {})}
    if device is not None:
        config["device"] = device
    try:
        if config.get("schema") is not None:  # saved as plain containers
            config["schema"] = Schema.from_state(config["schema"])
        if "selector" in config:  # saved by name
            config["selector"] = selector_of_state(config["selector"])
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
    """Write ``state`` with its checksum to ``path``, whole or not at all (see `files`).

    Each tensor is written from its own memory (`torch.save` copies one on a device to the
    host, one at a time): a state packed without copies adds no copy of the data.
    """
    payload = files.sealed(state, files.feed_values)
    files.write_atomically(path, lambda file: torch.save(payload, file))


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint file, refusing anything that is not one or whose checksum fails.

    Returns the state without its checksum. Its tensors are mapped from the file, not read
    into the process's memory: pages of the file's cache until they are copied out.
    """
    try:
        mapped = zipfile.is_zipfile(path)  # torch's legacy format (no zip) cannot be mapped
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise CheckpointError(
            f"path must be a lucid_replay checkpoint, got an unreadable file {str(path)!r} "
            f"({type(error).__name__})"
        ) from None
    check_header(state)
    if state["version"] >= 2:
        if files.CHECKSUM not in state:
            raise CheckpointError("checkpoint file must carry a checksum, got none")
        verify(state)
    return {key: value for key, value in state.items() if key != files.CHECKSUM}


def verify(state: Mapping[str, Any]) -> None:
    """Refuse ``state`` unless its ``checksum`` entry matches its contents."""
    if not files.seal_holds(state, files.feed_values):
        raise CheckpointError(
            "checkpoint checksum must match its payload, got a mismatch: the file is corrupt"
        )


def _checked_data(
    data: object, schema: Schema, table: EpisodeTable
) -> dict[str, list[torch.Tensor]]:
    """Each field's stored data as its pieces in offset order, every one checked.

    The fields must be the schema's; a field is a ``[stored, *shape]`` tensor of its dtype,
    or a list of ``[n, *shape]`` ones whose lengths add up to ``stored``.
    """
    if not isinstance(data, Mapping) or set(data) != set(schema):
        got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise CheckpointError(f"checkpoint data fields must be {sorted(schema)}, got {got}")
    stored = table.num_transitions
    checked = {}
    for name, (shape, dtype) in schema.items():
        values = data[name]
        parts = list(values) if isinstance(values, list | tuple) and values else [values]
        for part in parts:
            if not isinstance(part, torch.Tensor) or part.dtype != dtype:
                raise CheckpointError(
                    f"checkpoint data {name!r} must be a {dtype} tensor, got {_describe(part)}"
                )
        shapes = [tuple(part.shape) for part in parts]
        fits = all(part.layout == torch.strided for part in parts) and all(
            len(got) == len(shape) + 1 and got[1:] == shape for got in shapes
        )
        if not fits or sum(got[0] for got in shapes) != stored:
            raise CheckpointError(
                f"checkpoint data {name!r} must have shape {(stored, *shape)}, "
                f"got {' + '.join(str(got) for got in shapes)}"
            )
        checked[name] = parts
    return checked


def _checked_trees(saved: object) -> list[tuple[int, int, LawKey, float]]:
    """The saved trees' keys and scales: ``[span >= 1, extra >= 0, key, scale > 0]`` each.

    ``key``: a law's (`Law.key`): ``None``, an alpha ``>= 0`` or a `Recency` key.

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
        alpha_ok = alpha_ok or (type(alpha) is str and _law_key_ok(alpha))
        scale_ok = type(scale) is float and math.isfinite(scale) and scale > 0
        if not (ok and ints and alpha_ok and scale_ok):
            raise CheckpointError(
                "checkpoint trees must be [span >= 1, extra >= 0, law key, finite scale > 0] "
                f"entries, got {entry!r}"
            )
        trees.append((int(span), int(extra), alpha, float(scale)))  # type: ignore[arg-type]
    return trees


def _law_key_ok(key: str) -> bool:
    try:
        from_key(key)
    except ValueError:
        return False
    return True


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
