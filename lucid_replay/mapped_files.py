"""Fields in files mapped into memory: the allocator of ``storage="memmap"`` and its directory.

A buffer built with ``storage="memmap"`` claims a new or empty directory (`claim`) and keeps
each field's ring in a file of it, mapped shared into the process (`FileBacked`): the page
cache holds what is read, so the fields may exceed RAM, and what the ring writes is the
file's content. `sync` then makes the directory a checkpoint without copying the data: the
mapped pages are flushed, and the state that is not data (the episode table, counters, the
random stream, priorities) is written beside them as a checkpoint file, atomically.

The files are written in place after a sync, so a later add may overwrite steps that the
synced state still holds (once the ring has wrapped onto them). The ring reports the end of
every write (`FileBacked.written`); once a write reaches past ``synced oldest + capacity``,
its end is recorded in a small file first. `open` evicts, oldest first, the synced episodes
(segments) whose steps were overwritten so, and restores everything else exactly.

A compressed field (``Field(codec=...)``) keeps its blocks' frames in a sparse file and an
index beside it (`frame_store`; `lucid_replay.block_files`): `sync` first writes the one raw
block being written as a frame too. A block rewritten after a sync (the head block's next
steps, a lap, a ``write_back``) gets its new frame in a second slot before its index entry
flips to it, so the synced steps it holds are never half-written, and the guard covers the
overwritten steps as for raw fields.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import mmap
import os
import struct
import uuid
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lucid_replay import files
from lucid_replay.block_files import MappedFrames, index_file
from lucid_replay.errors import CheckpointError, must, wrong_type

__all__: list[str] = []  # internal module

STORAGES = ("memory", "memmap")
MARKER = "lucid_replay.json"  # claims the directory; names the format
STATE = "state.ckpt"  # the checkpoint `sync` writes (everything but the data)
GUARD = "overwritten"  # the end of the furthest write past the synced steps (8 bytes)
_FORMAT = {"format": "lucid_replay.memmap", "version": 1}
_reopening: contextvars.ContextVar[FileBacked | None] = contextvars.ContextVar(
    "lucid_replay_reopening", default=None
)


class FileBacked:
    """An `Allocator`: each field a file under ``directory``, mapped shared into memory.

    ``names``: field name -> file name of files that exist already (a directory being opened);
    other fields get new files. A new file has its blocks reserved on the disk up front, so a
    full disk refuses the allocation instead of failing a later write into the mapping.
    """

    def __init__(self, directory: Path, names: Mapping[str, str] | None = None) -> None:
        self.directory = directory
        self.names: dict[str, str] = {}  # the current ring's field files (set by `allocate`)
        self._existing = dict(names or {})
        self._maps: list[mmap.mmap] = []
        self._stores: weakref.WeakSet[MappedFrames] = weakref.WeakSet()  # the rings' own
        self.capacity = 0
        self.guard_from: int | None = None  # a write ending past this overwrites synced steps
        self.guarded = 0  # the end recorded in the guard file

    def allocate(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A tensor over field ``name``'s file (see `lucid_replay.allocators.Allocator`)."""
        if device.type != "cpu":  # refused when the buffer is configured; defensive here
            raise ValueError(f"device must be 'cpu' for storage='memmap', got {device}")
        count = math.prod(shape)
        size = count * torch.empty((), dtype=dtype).element_size()
        existing = self._existing.pop(name, None)
        if existing is not None and not existing.endswith(".bin"):
            raise CheckpointError(f"field file {existing!r} must be raw for field {name!r}")
        file = existing or f"field-{uuid.uuid4().hex[:12]}.bin"
        path = self.directory / file
        flags = os.O_RDWR if existing else os.O_RDWR | os.O_CREAT | os.O_EXCL
        descriptor = os.open(path, flags, 0o666)
        try:
            if existing and os.fstat(descriptor).st_size != size:
                raise CheckpointError(
                    f"field file {file!r} must hold {size} bytes for field {name!r}, "
                    f"got {os.fstat(descriptor).st_size}"
                )
            if not existing and size:
                try:
                    os.posix_fallocate(descriptor, 0, size)
                except OSError as error:
                    os.close(descriptor)
                    path.unlink(missing_ok=True)
                    raise MemoryError(f"{size:,} bytes on disk for {file}: {error}") from None
            self.capacity = shape[0]
            self.names[name] = file
            if not size:
                return torch.empty(shape, dtype=dtype)
            mapped = mmap.mmap(descriptor, size, access=mmap.ACCESS_WRITE)
        finally:
            with contextlib.suppress(OSError):
                os.close(descriptor)  # the mapping keeps the file open
        self._maps.append(mapped)
        return torch.frombuffer(mapped, dtype=dtype, count=count).view(shape)

    def frame_store(self, name: str, capacity: int, sizes: np.ndarray) -> MappedFrames:
        """Compressed field ``name``'s frames in its files.

        ``capacity`` slots in blocks of ``sizes`` raw bytes each.

        Raises
        ------
        CheckpointError
            For existing files that cannot be this field's (see `MappedFrames`).
        """
        existing = self._existing.pop(name, None)
        if existing is not None and not existing.endswith(".blocks"):
            raise CheckpointError(f"field file {existing!r} must be blocks for field {name!r}")
        file = existing or f"field-{uuid.uuid4().hex[:12]}.blocks"
        store = MappedFrames(self.directory / file, sizes, create=existing is None)
        self.capacity = capacity
        self.names[name] = file
        self._stores.add(store)
        return store

    def names_to_map(self) -> list[str]:
        """The fields whose existing files `allocate` will map (a directory being opened)."""
        return list(self._existing)

    def written(self, end: int) -> None:
        """The ring wrote transitions up to offset ``end``: record it if it overwrote synced ones.

        One 8-byte write, only once a sync exists and the ring laps onto its steps.
        """
        if self.guard_from is not None and end > self.guard_from and end > self.guarded:
            guard = self.directory / GUARD
            descriptor = os.open(guard, os.O_WRONLY | os.O_CREAT, 0o666)
            try:
                os.pwrite(descriptor, struct.pack("<q", end), 0)
            finally:
                os.close(descriptor)
            self.guarded = end

    def flush(self) -> None:
        """Write every mapped page that changed to the files (``msync``)."""
        for mapped in self._maps:
            if not mapped.closed:
                mapped.flush()
        for store in self._stores:
            store.flush()


def checked_storage(storage: object, directory: object, device: torch.device) -> FileBacked | None:
    """The allocator of ``storage=`` and ``directory=`` (None: memory), the directory claimed.

    Claiming creates ``directory`` if needed and writes its marker file: the last step of
    configuring a buffer, so that a refused configuration leaves nothing behind.
    """
    if storage not in STORAGES:
        raise must("storage", f"one of {STORAGES}", storage)
    if storage == "memory":
        if directory is not None:
            raise must("directory", "None with storage='memory'", directory)
        return None
    if directory is None:
        raise must("directory", "a path with storage='memmap'", directory)
    if not isinstance(directory, str | os.PathLike):
        raise wrong_type("directory", "a path (str or os.PathLike)", directory)
    if device.type != "cpu":
        raise must("device", "'cpu' with storage='memmap'", str(device))
    path = Path(directory)
    reopened = _reopening.get()
    if reopened is not None and reopened.directory == path:
        return reopened
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise must("directory", "a new or empty directory", str(directory))
    path.mkdir(parents=True, exist_ok=True)
    files.write_atomically(path / MARKER, lambda file: file.write(json.dumps(_FORMAT).encode()))
    return FileBacked(path)


def sync_state(allocator: FileBacked, state: dict[str, Any], oldest_offset: int) -> None:
    """Flush the mapped fields, then write ``state`` (no data) as the directory's checkpoint.

    ``oldest_offset``: the first stored offset of ``state``; from now on a write that laps
    onto it is recorded (`FileBacked.written`). Files no longer mapped are removed.
    """
    allocator.flush()
    state["files"] = dict(allocator.names)
    from lucid_replay import checkpoint  # a cycle otherwise: checkpoints build rings

    checkpoint.write(allocator.directory / STATE, state)
    allocator.guard_from = oldest_offset + allocator.capacity
    names = allocator.names.values()
    keep = {MARKER, STATE, GUARD, *names, *(index_file(name) for name in names)}
    for entry in allocator.directory.iterdir():
        if entry.name not in keep and entry.name.startswith("field-"):
            entry.unlink(missing_ok=True)  # a field file no ring maps any more


def read_state(directory: object) -> tuple[dict[str, Any], FileBacked, int]:
    """The checkpoint `sync_state` wrote in ``directory``, its allocator, and the guard's end.

    Raises
    ------
    CheckpointError
        When ``directory`` is not a synced buffer directory.
    """
    if not isinstance(directory, str | os.PathLike):
        raise wrong_type("directory", "a path (str or os.PathLike)", directory)
    path = Path(directory)
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        marker = None
    if marker != _FORMAT:
        raise CheckpointError(f"directory must be a buffer's storage='memmap' directory: {path}")
    if not (path / STATE).exists():
        raise CheckpointError(f"directory must have been synced (call sync()), got none: {path}")
    from lucid_replay import checkpoint  # a cycle otherwise: checkpoints build rings

    state = checkpoint.read(path / STATE)
    names = state.pop("files", None)
    if not isinstance(names, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v.startswith("field-") and "/" not in v
        for k, v in names.items()
    ):
        raise CheckpointError(f"checkpoint field files must map names to files, got {names!r}")
    guarded = 0
    with contextlib.suppress(FileNotFoundError):
        raw = (path / GUARD).read_bytes()
        if len(raw) != 8:
            raise CheckpointError(f"directory's {GUARD} file must hold 8 bytes, got {len(raw)}")
        guarded = struct.unpack("<q", raw)[0]
    allocator = FileBacked(path, names)
    allocator.guarded = guarded
    return state, allocator, guarded


@contextlib.contextmanager
def reopening(allocator: FileBacked) -> Iterator[None]:
    """While building the buffer `open` returns: its directory is ``allocator``'s, not claimed."""
    token = _reopening.set(allocator)
    try:
        yield
    finally:
        _reopening.reset(token)
