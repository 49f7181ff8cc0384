"""What every shard's buffer is made with: the selector, the declared schema, the storage.

`checked` validates ``selector=``, ``schema=``, ``storage=``, ``directory=`` and
``cache_bytes=`` of `ShardedReplay.create` as plain JSON-able values (they go into the
manifest, so `ShardedReplay.load` restores them): the selector as the single buffer's
checkpoints keep it (`lucid_replay.selectors.selector_state`), the schema as
`Schema.to_state`. `claim_check` refuses a memmap ``directory`` that is not new or empty, and
`clear` empties a restarted shard's own directory (see `lucid_replay.distributed.shards`).

``transport=`` and ``torn=`` (`checked_transport`) say how batches reach the client:
``"object"`` (gathered by the shard, through Ray's object store), ``"shared"`` (gathered by
the client from the shards' fields mapped read-only; `lucid_replay.distributed.sharing`),
``"auto"`` (shared where client and shard are on one node). Compressed fields cannot be
mapped: ``"shared"`` refuses them, ``"auto"`` sends their batches as objects.

`Recency` draws across shards too: its age counts the transitions added to the *whole*
replay after an anchor's commit, which the shards learn from the control with every commit
(`lucid_replay.distributed.shards`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from lucid_replay.blocks import checked_cache
from lucid_replay.errors import must, wrong_type
from lucid_replay.laws import Prioritized
from lucid_replay.mapped_files import STORAGES
from lucid_replay.prioritized import PrioritizedSequenceReplay
from lucid_replay.schema import Schema
from lucid_replay.selectors import Selector, checked_selector, selector_of_state, selector_state

__all__: list[str] = []  # internal module

TRANSPORTS = ("auto", "object", "shared")
TORN = ("redraw", "invalid")


def checked(arguments: dict[str, Any], alpha: float, unit: str) -> dict[str, Any]:
    """``selector``, ``schema``, ``storage``, ``directory``, ``cache_bytes`` as plain values.

    Every value is checked as `PrioritizedSequenceReplay` checks it (the directory's
    contents aside: `claim_check`).
    """
    law = checked_selector(
        arguments["selector"], alpha, PrioritizedSequenceReplay, unit, arguments["segment_length"]
    )
    schema = arguments["schema"]
    declared = None if schema is None else Schema.declared(schema)
    storage, directory = arguments["storage"], arguments["directory"]
    if storage not in STORAGES:
        raise must("storage", f"one of {STORAGES}", storage)
    if storage == "memory" and directory is not None:
        raise must("directory", "None with storage='memory'", directory)
    if storage == "memmap":
        if directory is None:
            raise must("directory", "a path with storage='memmap'", directory)
        if not isinstance(directory, str | os.PathLike) or isinstance(os.fspath(directory), bytes):
            raise wrong_type("directory", "a path (str or os.PathLike)", directory)
        directory = os.path.abspath(os.fspath(directory))
    codecs = {} if declared is None else dict(declared.codecs)
    cache = checked_cache(arguments["cache_bytes"], codecs, torch.device("cpu"))
    transport, torn = checked_transport(arguments["transport"], arguments["torn"], codecs)
    return {
        "transport": transport,
        "torn": torn,
        "selector": selector_state(law, Prioritized(alpha)),
        "schema": None if declared is None else declared.to_state(),
        "storage": storage,
        "directory": directory,
        "cache_bytes": cache,
    }


def of_state(config: dict[str, Any]) -> dict[str, Any]:
    """`checked`'s arguments again from a configuration's plain values (a manifest's)."""
    selector, schema = config["selector"], config["schema"]
    return {
        "selector": None if selector is None else selector_of_state(selector),
        "schema": None if schema is None else Schema.from_state(schema),
        "storage": config["storage"],
        "directory": config["directory"],
        "cache_bytes": config["cache_bytes"],
        "transport": config["transport"],
        "torn": config["torn"],
    }


def checked_transport(transport: object, torn: object, codecs: dict[str, Any]) -> tuple[str, str]:
    """``transport`` (one of `TRANSPORTS`) and ``torn`` (one of `TORN`), checked.

    ``"shared"`` is refused with compressed fields (``codecs``): their blocks cannot be
    gathered from a mapping.
    """
    if transport not in TRANSPORTS:
        raise must("transport", f"one of {TRANSPORTS}", transport)
    if torn not in TORN:
        raise must("torn", f"one of {TORN}", torn)
    if transport == "shared" and codecs:
        raise must(
            "transport",
            f"'object' or 'auto' with compressed fields ({sorted(codecs)} have a codec: "
            "their blocks cannot be mapped)",
            transport,
        )
    return str(transport), str(torn)


def shared_directory(config: dict[str, Any], index: int, root: str | None) -> str | None:
    """Where shard ``index`` keeps the fields clients map (None: ``transport="object"``).

    Its memmap directory, else ``root/shard_<index>`` (``root``: under ``/dev/shm``).
    """
    if config.get("transport", "object") == "object" or _has_codecs(config):
        return None
    if config.get("storage") == "memmap":
        return shard_directory(config, index)
    return None if root is None else str(Path(root) / f"shard_{index}")


def _has_codecs(config: dict[str, Any]) -> bool:
    schema = config.get("schema")
    return schema is not None and bool(Schema.from_state(schema).codecs)


def law_of(config: dict[str, Any]) -> Selector:
    """The resolved selector of a configuration (what the client draws by)."""
    state = config.get("selector")
    selector = None if state is None else selector_of_state(state)
    return checked_selector(
        selector,
        config["alpha"],
        PrioritizedSequenceReplay,
        config["unit"],
        config.get("segment_length"),
    )


def shard_directory(config: dict[str, Any], index: int) -> str | None:
    """Shard ``index``'s memmap directory, ``directory/shard_<index>`` (None in memory)."""
    directory = config.get("directory")
    return None if directory is None else str(Path(directory) / f"shard_{index}")


def claim_check(directory: str | None) -> None:
    """Refuse a memmap ``directory`` that exists and holds anything (before any shard starts)."""
    if directory is None:
        return
    path = Path(directory)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise must("directory", "a new or empty directory", directory)


def clear(directory: str | None) -> None:
    """Remove a restarted shard's own memmap directory, so it starts from fresh files."""
    if directory is not None and Path(directory).exists():
        shutil.rmtree(directory)


def checked_storage_directory(config: dict[str, Any], given: object) -> str | None:
    """Where a loaded memmap replay's shards keep their files: ``given``, else the saved one."""
    if given is None:
        directory: str | None = config["directory"]
        return directory
    if config["storage"] != "memmap":
        raise must("storage_directory", "None for a replay saved with storage='memory'", given)
    if not isinstance(given, str | os.PathLike) or isinstance(os.fspath(given), bytes):
        raise wrong_type("storage_directory", "a path (str or os.PathLike)", given)
    return os.path.abspath(os.fspath(given))
