"""Files written whole or not at all, and digests of files read in chunks.

A reader of a path never sees half a file: `write_atomically` writes a temporary file beside
the target, flushes it to the disk, renames it over the target (the commit) and then flushes
the directory, so that after a crash or a power loss the path holds either the previous file
or the new one, never an empty or truncated one. Checkpoints of a buffer and the manifests of
a sharded replay are written through it; `link_atomically` gives a second name to a file in
one rename (a reader sees the old file or the new one), and `digest` reads a file of any size
in constant memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__: list[str] = []  # internal module

_CHUNK = 1 << 20  # bytes read at a time for a digest


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
