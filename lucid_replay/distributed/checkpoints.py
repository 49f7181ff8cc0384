"""Checkpoints of a sharded replay: one file per shard and a manifest that binds them.

``save(directory)`` is atomic as a whole. It picks the next save *generation* ``g``, has
every shard write ``shard_<k>.g<g>.lucid`` (the buffer's own checkpoint format, checksum
included, with one more entry, ``shard``: its index, incarnations, the replay it belongs to
and ``g``), then writes ``manifest.json`` through a temporary file and a rename: that rename
is the commit. The manifest binds each shard file by name, SHA-256 and size, and holds the
configuration, the coordinator's random state, beta, the rate limiter's counters and what the
shards share. Only after the commit are the previous generation's files removed; a save that
fails before it removes the files it wrote, so the directory still holds the previous save.

The restart files a replay writes into its ``checkpoint_dir`` (every ``checkpoint_every``
adds, and once as it starts) are named ``restart_<k>.lucid``: they never replace a file a
manifest binds. A `save` into the ``checkpoint_dir`` also makes each new shard file the
shard's restart file (a hard link: the next restart checkpoint replaces the link, never the
bound file).

`load` checks, before any actor starts: the manifest (`lucid_replay.distributed.manifest`),
then every shard file's size and SHA-256 (read in chunks: memory stays flat) and the index it
records (read through a memory map, without loading its data). Manifests of version 1 (which
named ``shard_<k>.lucid`` and bound nothing) still load; see `legacy_files`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

import lucid_replay.distributed.manifest as manifest_checks
from lucid_replay import checkpoint, files, saving
from lucid_replay.distributed.calls import get
from lucid_replay.distributed.client_state import Client
from lucid_replay.errors import CheckpointError
from lucid_replay.prioritized import PrioritizedSequenceReplay

__all__: list[str] = []  # internal module

MANIFEST = "manifest.json"
FORMAT = manifest_checks.FORMAT
VERSION = 2
_GENERATION_FILE = re.compile(r"shard_(\d+)\.g(\d+)\.lucid")
_LEGACY_FILE = re.compile(r"shard_(\d+)\.lucid")


# ------------------------------------------------------------------------------ names
def shard_file(index: int, generation: int) -> str:
    """The name of shard ``index``'s file in save ``generation``."""
    return f"shard_{index}.g{generation}.lucid"


def legacy_path(directory: str | os.PathLike[str], index: int) -> Path:
    """Where a version-1 save put shard ``index``."""
    return Path(directory) / f"shard_{index}.lucid"


def restart_path(directory: str | os.PathLike[str], index: int) -> Path:
    """The restart file of shard ``index`` in a ``checkpoint_dir``."""
    return Path(directory) / f"restart_{index}.lucid"


# ---------------------------------------------------------------------------- shard files
def save_shard(buffer: PrioritizedSequenceReplay, path: Path, meta: dict[str, Any]) -> None:
    """Write ``buffer`` with the shard's ``meta`` to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    saving.write(buffer, path, {"shard": meta})


def entry(path: Path, index: int) -> dict[str, Any]:
    """The manifest's entry for shard ``index``'s file at ``path`` (on disk: `files`)."""
    sha, size = files.digest(path)
    return {"index": index, "file": path.name, "sha256": sha, "bytes": size}


def restore_shard(
    buffer: PrioritizedSequenceReplay,
    path: str | os.PathLike[str],
    index: int,
    replay: str | None = None,
) -> bool:
    """Load shard ``index``'s file at ``path`` into ``buffer`` (configured as when saved).

    With ``replay`` (a restart), a missing file or one another replay wrote is left alone:
    returns False and ``buffer`` is unchanged. The loaded table keeps its rows' commit
    counters (`lucid_replay.distributed.commits`).

    Raises
    ------
    CheckpointError
        For a file that is not a shard file, is corrupt, is another shard's, or another
        configuration's.
    """
    if replay is not None and not Path(path).is_file():
        return False
    state = checkpoint.read(path)
    meta = state.pop("shard", None)
    if not isinstance(meta, dict):
        raise CheckpointError(f"path must be a shard file of a sharded replay, got {str(path)!r}")
    if replay is not None and meta.get("replay") != replay:
        return False
    if meta.get("index") != index:
        raise CheckpointError(
            f"shard file {str(path)!r} must hold shard {index}, got shard {meta.get('index')!r}"
        )
    buffer.load_state_dict(state)
    buffer._core.store.table.keep_commits()  # a file without commit counters: its own counts
    return True


def _peek(path: Path) -> dict[str, Any]:
    """The ``shard`` entry and table of a shard file, through a memory map (data unread)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise CheckpointError(
            f"shard file {str(path)!r} must be a lucid_replay checkpoint, got an unreadable "
            f"file ({type(error).__name__})"
        ) from None
    meta = state.get("shard") if isinstance(state, dict) else None
    table = state.get("table") if isinstance(state, dict) else None
    if not isinstance(meta, dict) or not isinstance(table, dict):
        raise CheckpointError(
            f"shard file {str(path)!r} must be a shard file of a sharded replay, got another file"
        )
    return {"meta": meta, "next_id": table.get("next_id")}


def bound_files(directory: str | os.PathLike[str], manifest: dict[str, Any]) -> list[str]:
    """The shard files ``manifest`` names, each checked; their paths in shard order.

    Raises
    ------
    CheckpointError
        For a file that is missing, has another size or digest than the manifest binds, or
        records another shard's index.
    """
    if manifest["version"] == 1:
        return legacy_files(directory, manifest)
    paths = []
    for index, bound in enumerate(manifest["shards"]):
        path = Path(directory) / bound["file"]
        if not path.is_file():
            raise CheckpointError(
                f"directory must hold every shard file its manifest names, got none at "
                f"{str(path)!r} (shard {index})"
            )
        sha, size = files.digest(path)
        if (sha, size) != (bound["sha256"], bound["bytes"]):
            raise CheckpointError(
                f"shard file {str(path)!r} must be the file its manifest binds to shard "
                f"{index} ({bound['bytes']} bytes, sha256 {bound['sha256'][:16]}...), got "
                f"{size} bytes, sha256 {sha[:16]}...: another save's, another replay's, or "
                f"damaged"
            )
        _check_index(path, index)
        paths.append(str(path))
    return paths


def legacy_files(directory: str | os.PathLike[str], manifest: dict[str, Any]) -> list[str]:
    """The shard files of a version-1 manifest, checked as far as that format allows.

    Version 1 bound no file to its manifest. Each file must record its shard's index, and
    must not be newer than the manifest (hold an id the manifest's control never saw
    issued), which is what an interrupted re-save or a restart checkpoint written over a
    saved file leaves. A file replaced by an older save's cannot be told apart.
    """
    paths = []
    for index in range(manifest["config"]["num_shards"]):
        path = legacy_path(directory, index)
        if not path.is_file():
            raise CheckpointError(
                f"directory must hold every shard file, got none at {str(path)!r} (shard {index})"
            )
        peeked = _check_index(path, index)
        noted = manifest["control"]["noted"][index][0]
        if not isinstance(peeked["next_id"], int) or peeked["next_id"] > noted:
            raise CheckpointError(
                f"shard file {str(path)!r} must be the state its manifest saved (ids up to "
                f"{noted}), got one with next id {peeked['next_id']!r}: a later save or "
                f"restart checkpoint replaced it"
            )
        paths.append(str(path))
    return paths


def _check_index(path: Path, index: int) -> dict[str, Any]:
    peeked = _peek(path)
    recorded = peeked["meta"].get("index")
    if recorded != index:
        raise CheckpointError(
            f"shard file {str(path)!r} must hold shard {index}, got shard {recorded!r}"
        )
    return peeked


# ---------------------------------------------------------------------------- manifest
def write_manifest(directory: str | os.PathLike[str], manifest: dict[str, Any]) -> None:
    """Write ``manifest`` (JSON, with its checksum) into ``directory``: the save's commit."""
    payload = files.sealed({"format": FORMAT, "version": VERSION, **manifest}, files.feed_json)
    text = json.dumps(payload, indent=1, sort_keys=True).encode("utf-8")
    files.write_atomically(Path(directory) / MANIFEST, lambda file: file.write(text))


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a replay saved into ``directory``, every entry checked.

    Raises
    ------
    CheckpointError
        If the manifest is unreadable, of an unknown format or version, fails its checksum,
        or has an entry that is missing or invalid (the message names it).
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
    if manifest.get("version") not in (1, VERSION):
        raise CheckpointError(
            f"manifest version must be 1 or {VERSION}, got {manifest.get('version')!r}"
        )
    if not files.seal_holds(manifest, files.feed_json):
        raise CheckpointError("manifest checksum must match its contents, got a mismatch")
    manifest_checks.check(manifest)
    manifest["config"] = manifest_checks.with_defaults(manifest["config"])
    return manifest


def _previous(directory: str) -> dict[str, Any] | None:
    """The manifest a save replaces, if it is readable; None otherwise."""
    try:
        return read_manifest(directory)
    except (OSError, CheckpointError):
        return None


def _generation(directory: str, previous: dict[str, Any] | None) -> int:
    """One more than any generation the directory's manifest or file names hold."""
    found = [int(previous.get("generation", 0))] if previous is not None else [0]
    for name in os.listdir(directory):
        match = _GENERATION_FILE.fullmatch(name)
        if match:
            found.append(int(match.group(2)))
    return max(found) + 1


def _remove(directory: str, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):  # the save is committed: a leftover is harmless
            (Path(directory) / name).unlink(missing_ok=True)


def adopt(replay: Client, manifest: dict[str, Any]) -> None:
    """Give a freshly started client the coordinator state of ``manifest``."""
    replay._state.adopt(manifest)


def save_replay(replay: Client, directory: str | os.PathLike[str]) -> None:
    """A new generation's shard files, then the manifest (the commit), then cleanup."""
    path = os.path.abspath(os.fspath(directory))
    os.makedirs(path, exist_ok=True)
    previous = _previous(path)
    generation = _generation(path, previous)
    futures = [shard.save.remote(path, generation) for shard in replay._call_handles()]
    entries, failure = [], None
    for future in futures:  # every shard has finished writing before anything is removed
        try:
            entries.append(get(future))
        except BaseException as error:
            failure = failure or error
    written = [shard_file(k, generation) for k in range(len(futures))]
    try:
        if failure is not None:
            raise failure
        write_manifest(
            path,
            {
                "generation": generation,
                "shards": entries,
                "config": replay._config,
                "control": get(replay._control.state.remote()),
                **replay._state.saved(),
            },
        )
    except BaseException:
        _remove(path, written)
        raise
    stale = [
        name
        for name in os.listdir(path)
        if _GENERATION_FILE.fullmatch(name) and name not in written
    ]
    if previous is not None and previous["version"] == 1:
        stale += [name for name in os.listdir(path) if _LEGACY_FILE.fullmatch(name)]
    _remove(path, stale)
