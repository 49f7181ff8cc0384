"""Files written whole or not at all, payloads sealed by a checksum, and digests of files.

A reader of a path never sees half a file: `write_atomically` writes a temporary file beside
the target, flushes it to the disk, renames it over the target (the commit) and then flushes
the directory, so that after a crash or a power loss the path holds either the previous file
or the new one, never an empty or truncated one. Checkpoints of a buffer and the manifests of
a sharded replay are written through it; `link_atomically` gives a second name to a file in
one rename (a reader sees the old file or the new one), and `digest` reads a file of any size
in constant memory.

Both kinds of file also carry a ``checksum`` entry (`sealed`): the SHA-256 of every other
entry of their payload, in a canonical encoding of its values, so that a flipped bit
anywhere is refused on reading (`seal_holds`). A checkpoint encodes its tensors and
containers with `feed_values`; a manifest, written as JSON, its JSON text (`feed_json`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__: list[str] = []  # internal module

_CHUNK = 1 << 20  # bytes read at a time for a digest
CHECKSUM = "checksum"  # the entry `sealed` adds to a payload
Encoding = Callable[[Any, object], None]  # feeds a value into a hashlib digest


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Have ``write`` fill a new file, then make it the file at ``path`` in one rename.

    If ``write`` (or anything before the rename) raises, the temporary file is removed and
    ``path`` is untouched.
    """
    target = Path(path)
    temporary = target.parent / f".{target.name}.{uuid.uuid4().hex}"
    # Not mkstemp, whose files are private (0600): a checkpoint gets the mode of any file the
    # user writes (0666 less the umask), so whoever the umask allows can load it.
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())  # the data on disk before the rename makes it visible
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    sync_directory(target.parent)


def link_atomically(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Make ``target`` the file ``source`` is, in one rename (a hard link, else a copy)."""
    target = Path(target)
    temporary = target.parent / f".{target.name}.{uuid.uuid4().hex}"
    try:
        try:
            os.link(source, temporary)
        except OSError:  # a file system without hard links
            shutil.copyfile(source, temporary)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def sync_directory(directory: str | os.PathLike[str]) -> None:
    """Flush ``directory``'s entries (a rename into it) to the disk, where the system allows."""
    with contextlib.suppress(OSError):  # some file systems refuse to open a directory
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def digest(path: str | os.PathLike[str]) -> tuple[str, int]:
    """SHA-256 (hex) and size in bytes of the file at ``path``, read in 1 MiB chunks."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size


# ---------------------------------------------------------------------------- checksums
def checksum(payload: Mapping[str, Any], encode: Encoding) -> str:
    """SHA-256 (hex) of every entry of ``payload`` but its ``checksum``, fed by ``encode``."""
    sha = hashlib.sha256()
    encode(sha, {key: value for key, value in payload.items() if key != CHECKSUM})
    return sha.hexdigest()


def sealed(payload: Mapping[str, Any], encode: Encoding) -> dict[str, Any]:
    """``payload`` with its ``checksum`` entry (see `checksum`)."""
    return {**payload, CHECKSUM: checksum(payload, encode)}


def seal_holds(payload: Mapping[str, Any], encode: Encoding) -> bool:
    """Whether ``payload``'s ``checksum`` entry is there and matches every other entry."""
    expected = payload.get(CHECKSUM)
    return isinstance(expected, str) and expected == checksum(payload, encode)


def feed_values(sha: Any, value: object) -> None:
    """Hash ``value`` with its type and structure, so equal digests mean equal values.

    Tensors (any device; one at a time on the host) by dtype, shape and bytes; mappings by
    their keys in sorted order; lists and tuples item by item; anything else by its repr.
    """
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        sha.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        sha.update(flat.view(torch.uint8).numpy().data)
    elif isinstance(value, Mapping):
        sha.update(f"M{len(value)}".encode())
        for key in sorted(value, key=repr):
            feed_values(sha, key)
            feed_values(sha, value[key])
    elif isinstance(value, list | tuple):
        sha.update(f"L{len(value)}".encode())
        for item in value:
            feed_values(sha, item)
    else:
        sha.update(f"{type(value).__name__}:{value!r};".encode())


def feed_json(sha: Any, value: object) -> None:
    """Hash ``value``'s JSON text, keys sorted (what a manifest's checksum covers)."""
    sha.update(json.dumps(value, sort_keys=True).encode())
