"""The entries of a sharded replay's manifest, each checked before anything starts.

A manifest whose checksum holds may still carry a configuration or a state no replay could
have saved (written by hand, by another tool, or by a defect). `check` refuses every such
manifest with a `CheckpointError` that names the entry (``manifest config: alpha must be
>= 0.0 and finite, got -1.0``, ``manifest cursor must be an int >= 0, got 'x'``), so that
`ShardedReplay.load` never fails with a `TypeError` or `KeyError` halfway through, nor
starts a shard from a state it would refuse later.

Entries: ``config`` (what `ShardedReplay.create` checked; ``segment_length`` and
``priority_unit`` may be missing, from a manifest written before streamed segments: see
`with_defaults`), ``control`` (the rate limiter's counters, the schema, each shard's
incarnations, issued ranges, last reports and losses, and, where saved, the same marks of
its segment ids under ``segments`` and the replay-wide commit counter under ``committed``),
``rng`` (numpy PCG64 state), ``beta``, ``cursor``, ``max_priority``,
``priority_updates_skipped`` and, from version 2 on, ``generation`` and ``shards`` (each
shard file's name, SHA-256 and size).
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import numpy as np

import lucid_replay.distributed.ids as ids
import lucid_replay.distributed.options as options
import lucid_replay.distributed.settings as settings
from lucid_replay.blocks import CACHE_BYTES
from lucid_replay.checks import check_int
from lucid_replay.errors import CheckpointError
from lucid_replay.schema import Schema
from lucid_replay.table_checks import MAX_INDEX

__all__: list[str] = []  # internal module

FORMAT = "lucid_replay.sharded"
_COMMON = ("config", "control", "rng", "beta", "cursor", "max_priority")
ENTRIES = {
    1: (*_COMMON, "priority_updates_skipped"),
    2: (*_COMMON, "priority_updates_skipped", "generation", "shards"),
}
CONFIG_KEYS = (
    "num_shards",
    "shard_capacity",
    "alpha",
    "beta",
    "epsilon",
    "unit",
    "seed",
    "max_times_sampled",
    "rate_limiter",
    "backend",
    "checkpoint_dir",
    "checkpoint_every",
    "segment_length",
    "priority_unit",
    "selector",
    "schema",
    "storage",
    "directory",
    "cache_bytes",
    "transport",
    "torn",
)
# Keys an older manifest (before streamed segments, selectors, storage) lacks, as they were.
CONFIG_DEFAULTS = {
    "segment_length": None,
    "priority_unit": "episode",
    "selector": None,
    "schema": None,
    "storage": "memory",
    "directory": None,
    "cache_bytes": CACHE_BYTES,
    "transport": "object",
    "torn": "redraw",
}
_CONTROL_KEYS = ("limiter", "schema", "starts", "noted", "lost")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def check(manifest: dict[str, Any]) -> None:
    """Refuse a manifest (of a known version, checksum verified) with an invalid entry.

    Raises
    ------
    CheckpointError
        Naming the first entry that is missing or invalid.
    """
    version = manifest["version"]
    missing = [key for key in ENTRIES[version] if key not in manifest]
    if missing:
        raise CheckpointError(
            f"manifest must hold {list(ENTRIES[version])}, got none for {missing}"
        )
    num_shards = check_config(manifest["config"])
    check_control(manifest["control"], num_shards, version)
    check_rng(manifest["rng"])
    _real("beta", manifest["beta"], minimum=0.0)
    _count("cursor", manifest["cursor"])
    _real("max_priority", manifest["max_priority"], minimum=0.0, strict=True)
    _count("priority_updates_skipped", manifest["priority_updates_skipped"])
    if version >= 2:
        generation = _count("generation", manifest["generation"], minimum=1)
        check_shards(manifest["shards"], num_shards, generation)


def with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the keys an older manifest lacks, at the values they had then."""
    return {**CONFIG_DEFAULTS, **config}


def check_config(config: Any) -> int:
    """Refuse a configuration `ShardedReplay.create` would not have made; its shard count."""
    if not isinstance(config, dict):
        raise CheckpointError(f"manifest config must be a mapping, got {_shown(config)}")
    config = with_defaults(config)
    missing = [key for key in CONFIG_KEYS if key not in config]
    extra = sorted(set(config) - set(CONFIG_KEYS))
    if missing or extra:
        raise CheckpointError(
            f"manifest config must hold exactly {list(CONFIG_KEYS)}, got "
            f"{'none for ' + str(missing) if missing else 'also ' + str(extra)}"
        )
    try:
        num_shards = check_int(
            "num_shards", config["num_shards"], minimum=1, maximum=ids.MAX_SHARDS
        )
        per_shard = check_int("shard_capacity", config["shard_capacity"], minimum=1, maximum=2**62)
        arguments = {key: config[key] for key in CONFIG_KEYS if key != "shard_capacity"}
        arguments["capacity"] = num_shards * per_shard
        arguments["rate_limiter"] = settings.limiter_from(config["rate_limiter"])
        arguments.update(options.of_state(config))
        remade = settings.checked(**arguments)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError) as error:
        raise CheckpointError(f"manifest config: {_reason(error)}") from None
    different = [key for key in CONFIG_KEYS if remade[key] != config[key]]
    if different:
        key = different[0]
        raise CheckpointError(
            f"manifest config[{key!r}] must be {remade[key]!r} (as create makes it), got "
            f"{config[key]!r}"
        )
    return num_shards


def check_control(control: Any, num_shards: int, version: int) -> None:
    """Refuse a control state that no replay of ``num_shards`` shards could have saved."""
    keys = (*_CONTROL_KEYS, "issued") if version >= 2 else _CONTROL_KEYS
    if not isinstance(control, dict) or any(key not in control for key in keys):
        got = sorted(control) if isinstance(control, dict) else _shown(control)
        raise CheckpointError(f"manifest control must hold {list(keys)}, got {got}")
    limiter = control["limiter"]
    if not isinstance(limiter, dict):
        raise CheckpointError(
            f"manifest control['limiter'] must be a mapping, got {_shown(limiter)}"
        )
    for name in ("inserts", "deletes", "samples"):
        _count(f"control['limiter'][{name!r}]", limiter.get(name))
    if control["schema"] is not None:
        try:
            Schema.from_state(control["schema"])
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"manifest control['schema']: {_reason(error)}") from None
    starts = _per_shard(control, "starts", num_shards)
    noted = _per_shard(control, "noted", num_shards)
    lost = _per_shard(control, "lost", num_shards)
    ranges = version >= 2 or "issued" in control  # none in a manifest of the first version
    issued = _per_shard(control, "issued", num_shards) if ranges else None
    segments = _per_shard(control, "segments", num_shards) if "segments" in control else None
    if "committed" in control:  # the replay-wide commit counter (older manifests: none)
        _count("control['committed']", control["committed"], maximum=MAX_INDEX)
    for k in range(num_shards):
        _check_shard_control(k, starts[k], noted[k], lost[k], None if issued is None else issued[k])
        if segments is not None:
            _check_segment_marks(k, segments[k], len(starts[k]))


def _check_shard_control(
    k: int, starts: Any, noted: Any, lost: Any, issued: list[Any] | None
) -> None:
    values = _check_starts(f"control['starts'][{k}]", starts)
    name = f"control['noted'][{k}]"
    if not isinstance(noted, list) or len(noted) != 3:
        raise CheckpointError(
            f"manifest {name} must be [next_id, added, evicted], got {_shown(noted)}"
        )
    next_id, added, evicted = (_count(f"{name}[{i}]", v) for i, v in enumerate(noted))
    if next_id < values[-1] or evicted > added:
        raise CheckpointError(
            f"manifest {name} must have next_id >= {values[-1]} and evicted <= added, got {noted}"
        )
    name = f"control['lost'][{k}]"
    if not isinstance(lost, dict) or sorted(lost) != ["episodes", "transitions"]:
        raise CheckpointError(
            f"manifest {name} must hold 'episodes' and 'transitions', got {_shown(lost)}"
        )
    for key, value in lost.items():
        _count(f"{name}[{key!r}]", value)
    if issued is not None:
        _check_ranges(f"control['issued'][{k}]", issued, len(values) - 1)


def _check_segment_marks(k: int, marks: Any, incarnations: int) -> None:
    """A shard's segment-id marks: as many starts as incarnations, ranges, the last report."""
    name = f"control['segments'][{k}]"
    if not isinstance(marks, dict) or sorted(marks) != ["issued", "noted", "starts"]:
        raise CheckpointError(
            f"manifest {name} must hold 'starts', 'issued' and 'noted', got {_shown(marks)}"
        )
    values = _check_starts(f"{name}['starts']", marks["starts"])
    if len(values) != incarnations:
        raise CheckpointError(
            f"manifest {name}['starts'] must have one start per incarnation ({incarnations}), "
            f"got {values}"
        )
    _check_ranges(f"{name}['issued']", marks["issued"], incarnations - 1)
    noted = _count(f"{name}['noted']", marks["noted"])
    if noted < values[-1]:
        raise CheckpointError(f"manifest {name}['noted'] must be >= {values[-1]}, got {noted}")


def _check_starts(name: str, starts: Any) -> list[int]:
    """The first local id of each incarnation: from 0, never decreasing."""
    if not isinstance(starts, list) or not 1 <= len(starts) <= ids.MAX_INCARNATIONS:
        raise CheckpointError(
            f"manifest {name} must be a list of 1 to {ids.MAX_INCARNATIONS} ids, got "
            f"{_shown(starts)}"
        )
    values = [
        _count(f"{name}[{r}]", start, maximum=ids.MAX_LOCAL) for r, start in enumerate(starts)
    ]
    if values[0] != 0 or any(a > b for a, b in itertools.pairwise(values)):
        raise CheckpointError(f"manifest {name} must start at 0 and never decrease, got {values}")
    return values


def _check_ranges(name: str, issued: Any, replaced: int) -> None:
    """A ``[first, end]`` pair per replaced incarnation."""
    if not isinstance(issued, list) or len(issued) != replaced:
        raise CheckpointError(
            f"manifest {name} must hold a [first, end] pair per replaced incarnation "
            f"({replaced}), got {_shown(issued)}"
        )
    for r, pair in enumerate(issued):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CheckpointError(f"manifest {name}[{r}] must be a [first, end] pair, got {pair!r}")
        first, end = (_count(f"{name}[{r}]", v, maximum=ids.MAX_LOCAL + 1) for v in pair)
        if first > end:
            raise CheckpointError(f"manifest {name}[{r}] must have first <= end, got {pair}")


def check_rng(state: Any) -> None:
    """Refuse anything that is not a numpy PCG64 state."""
    try:
        np.random.PCG64().state = state
    except (TypeError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"manifest rng must be a numpy PCG64 state, got {_shown(state)} ({_reason(error)})"
        ) from None


def check_shards(shards: Any, num_shards: int, generation: int) -> None:
    """Refuse shard entries other than one per shard, in order, of ``generation``."""
    if not isinstance(shards, list) or len(shards) != num_shards:
        raise CheckpointError(
            f"manifest shards must be a list of {num_shards} entries, got {_shown(shards)}"
        )
    for k, bound in enumerate(shards):
        name = f"shards[{k}]"
        if not isinstance(bound, dict) or sorted(bound) != ["bytes", "file", "index", "sha256"]:
            raise CheckpointError(
                f"manifest {name} must hold 'index', 'file', 'sha256' and 'bytes', got "
                f"{_shown(bound)}"
            )
        if bound["index"] != k or isinstance(bound["index"], bool):
            raise CheckpointError(f"manifest {name}['index'] must be {k}, got {bound['index']!r}")
        expected = f"shard_{k}.g{generation}.lucid"
        if bound["file"] != expected:
            raise CheckpointError(
                f"manifest {name}['file'] must be {expected!r}, got {bound['file']!r}"
            )
        if not isinstance(bound["sha256"], str) or not _SHA256.fullmatch(bound["sha256"]):
            raise CheckpointError(
                f"manifest {name}['sha256'] must be 64 hex digits, got {bound['sha256']!r}"
            )
        _count(f"{name}['bytes']", bound["bytes"])


# ------------------------------------------------------------------------------ helpers
def _per_shard(control: dict[str, Any], key: str, num_shards: int) -> list[Any]:
    value = control[key]
    if not isinstance(value, list) or len(value) != num_shards:
        raise CheckpointError(
            f"manifest control[{key!r}] must be a list of {num_shards} entries (one per "
            f"shard), got {_shown(value)}"
        )
    return value


def _count(name: str, value: Any, *, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"manifest {name} must be an int >= {minimum}, got {_shown(value)}")
    if maximum is not None and value > maximum:
        raise CheckpointError(f"manifest {name} must be <= {maximum}, got {value!r}")
    return value


def _real(name: str, value: Any, *, minimum: float, strict: bool = False) -> float:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (
        number and math.isfinite(value) and (value > minimum or (not strict and value == minimum))
    ):
        rule = f"a finite number {'>' if strict else '>='} {minimum}"
        raise CheckpointError(f"manifest {name} must be {rule}, got {_shown(value)}")
    return float(value)


def _reason(error: BaseException) -> str:
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return text if isinstance(error, ValueError | TypeError) else f"missing {text!r}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"a {type(value).__name__}"
