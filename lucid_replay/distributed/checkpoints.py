"""Checkpoints of a sharded replay: a manifest and one atomic file per shard.

``save(directory)`` writes ``shard_<k>.lucid`` for every shard, then ``manifest.json``.
A shard file is the buffer's own checkpoint (the format `PrioritizedSequenceReplay.save`
writes, checksum included) with one more entry, ``shard``: its index, incarnation and the
first local id of each incarnation. The manifest holds the configuration, the backend, the
coordinator's random state, beta, the rate limiter's counters and what the shards share; it is
written last, through a temporary file and a rename, so a directory with a manifest has every
shard file it names. Restarts read the shard files a replay writes every
``checkpoint_every`` adds into its ``checkpoint_dir``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import lucid_replay.distributed.manifest as manifest_checks
from lucid_replay import checkpoint
from lucid_replay.distributed.calls import get
from lucid_replay.errors import CheckpointError
from lucid_replay.prioritized import PrioritizedSequenceReplay

__all__: list[str] = []  # internal module

MANIFEST = "manifest.json"
FORMAT = manifest_checks.FORMAT
VERSION = 1


def shard_path(directory: str | os.PathLike[str], index: int) -> Path:
    """Where shard ``index`` of a replay saved into ``directory`` lives."""
    return Path(directory) / f"shard_{index}.lucid"


def save_shard(buffer: PrioritizedSequenceReplay, path: Path, meta: dict[str, Any]) -> None:
    """Write ``buffer`` with the shard's ``meta`` to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write(path, {**buffer.state_dict(), "shard": meta})


def restore_shard(buffer: PrioritizedSequenceReplay, path: str | os.PathLike[str]) -> None:
    """Load the shard file at ``path`` into ``buffer`` (configured as when it was saved).

    Raises
    ------
    CheckpointError
        For a file that is not a shard file, is corrupt, or another configuration's.
    """
    state = checkpoint.read(path)
    if "shard" not in state:
        raise CheckpointError(f"path must be a shard file of a sharded replay, got {str(path)!r}")
    state.pop("shard")
    buffer.load_state_dict(state)


def _digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: str | os.PathLike[str], manifest: dict[str, Any]) -> None:
    """Write ``manifest`` (JSON, with its checksum) atomically into ``directory``."""
    target = Path(directory) / MANIFEST
    payload = {"format": FORMAT, "version": VERSION, **manifest}
    payload["checksum"] = _digest(payload)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{MANIFEST}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(payload, file, indent=1, sort_keys=True)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a replay saved into ``directory``, checked.

    Raises
    ------
    CheckpointError
        If there is no readable manifest of a known version, its checksum fails, an entry is
        missing or invalid (the message names it), or a shard file it names is missing.
    FileNotFoundError
        If ``directory`` has no manifest.
    """
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"directory must hold a sharded replay's manifest, got an unreadable "
            f"{str(path)!r} ({type(error).__name__})"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"manifest must be a {FORMAT!r} manifest, got {str(path)!r}")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"manifest version must be {VERSION}, got {manifest.get('version')!r}"
        )
    if manifest.get("checksum") != _digest(manifest):
        raise CheckpointError("manifest checksum must match its contents, got a mismatch")
    manifest_checks.check(manifest)
    for index in range(manifest["config"]["num_shards"]):
        if not shard_path(directory, index).exists():
            raise CheckpointError(
                f"directory must hold every shard file, got none for shard {index}"
            )
    return manifest


def adopt(replay: Any, manifest: dict[str, Any]) -> None:
    """Give a freshly started client the coordinator state of ``manifest``."""
    replay._rng.bit_generator.state = manifest["rng"]
    replay._beta = float(manifest["beta"])
    replay._cursor = int(manifest["cursor"])
    replay._global_max = float(manifest["max_priority"])
    replay._skipped = int(manifest["priority_updates_skipped"])


def save_replay(replay: Any, directory: str | os.PathLike[str]) -> None:
    """Every shard's file, then the manifest, into ``directory`` (created if needed)."""
    path = os.fspath(directory)
    os.makedirs(path, exist_ok=True)
    get([shard.save.remote(path) for shard in replay._shards])
    manifest = {
        "config": replay._config,
        "control": get(replay._control.state.remote()),
        "rng": replay._rng.bit_generator.state,
        "beta": replay._beta,
        "cursor": replay._cursor,
        "max_priority": replay._global_max,
        "priority_updates_skipped": replay._skipped,
    }
    write_manifest(path, manifest)
