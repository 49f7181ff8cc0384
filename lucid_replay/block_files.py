"""A compressed field's frames: the codec that makes them, where they are kept, their cache.

`Codec` compresses and decodes a block with one library; `BlockCache` keeps decoded blocks.
A `BlockField` (`lucid_replay.blocks`) reads and writes its compressed frames through a
*frame store*: ``has``, ``get`` and ``put`` a block's frame, the bytes held (``stored_bytes``)
and ``flush``. `MemoryFrames` keeps them in a list (``storage="memory"``). `MappedFrames`
keeps them in two files under a ``storage="memmap"`` directory, so that the frames take no
anonymous memory and may exceed RAM:

- ``field-<id>.blocks``, a sparse file of ``2 x blocks`` *slots* of the raw block size
  (rounded up to whole pages). Block ``b``'s frame is at slot ``2b`` or ``2b + 1``; the disk
  and the page cache hold only the pages of the frames written there. Frames are written
  with ``pwrite`` (a full disk is an ``OSError`` from the add, not a fault in a mapped
  page) and read through a shared mapping, uncopied (it writes nothing but frees pages).
- ``field-<id>.index``, a mapped int64 ``[blocks, 5]`` array: per block the slot in use
  (0: never written, 1 or 2), then each slot's frame length and CRC-32.

A block is never rewritten in place: its new frame goes to the slot not in use, then one
aligned 8-byte store makes it the slot in use, then the old slot's pages are freed
(``MADV_REMOVE`` punches them out of the file where the file system can). So a process that
dies at any point leaves every block's frame whole: the synced steps a block holds survive a
crash in the middle of writing its next frame. A crash of the machine may write the pages
back in another order; a frame that then fails its CRC is refused when it is read
(`CheckpointError`), never decoded into wrong bytes.
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import os
import threading
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path
from types import ModuleType
from typing import Final, Protocol

import numpy as np

from lucid_replay.errors import CheckpointError

__all__: list[str] = []  # internal module

CODECS: Final = ("zstd", "lz4")
_LIBRARIES: Final = {"zstd": "zstandard", "lz4": "lz4.block"}
_ZSTD_LEVEL: Final = 1  # fast; frames of pixels compress ~10x at any level
_INDEX_COLUMNS: Final = 5  # the slot in use (0: none, 1, 2), then each slot's length and crc32


def codec_module(codec: str) -> ModuleType:
    """The library of ``codec``, or an `ImportError` that names the extra to install."""
    name = _LIBRARIES[codec]
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(
            f"codec={codec!r} needs the {name.split('.')[0]!r} package: "
            "pip install 'lucid-replay[compress]'"
        ) from None


class Codec:
    """Compresses and decodes raw blocks of a known size with one library."""

    def __init__(self, codec: str) -> None:
        self.name = codec
        module = codec_module(codec)
        if codec == "zstd":
            self._compressor = module.ZstdCompressor(level=_ZSTD_LEVEL)
        self._module = module
        self._local = threading.local()  # a zstd decompressor is not thread safe: one each

    def compress(self, raw: np.ndarray) -> bytes:
        if self.name == "zstd":
            return bytes(self._compressor.compress(raw))
        return bytes(self._module.compress(raw, store_size=False))

    def decode(self, frame: bytes | memoryview, size: int) -> np.ndarray:
        if self.name == "zstd":
            decompressor = getattr(self._local, "decompressor", None)
            if decompressor is None:
                decompressor = self._local.decompressor = self._module.ZstdDecompressor()
            data = decompressor.decompress(frame, max_output_size=size)
        else:
            data = self._module.decompress(frame, uncompressed_size=size)
        return np.frombuffer(data, dtype=np.uint8)


class BlockCache:
    """Decoded blocks, least recently used dropped first, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def get(self, key: tuple[int, int]) -> np.ndarray | None:
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def put(self, key: tuple[int, int], block: np.ndarray) -> None:
        if block.nbytes > self.max_bytes:
            return  # never kept: it would push out everything else
        self.drop(key)
        self._blocks[key] = block
        self.nbytes += block.nbytes
        while self.nbytes > self.max_bytes:
            _, oldest = self._blocks.popitem(last=False)
            self.nbytes -= oldest.nbytes

    def drop(self, key: tuple[int, int]) -> None:
        block = self._blocks.pop(key, None)
        if block is not None:
            self.nbytes -= block.nbytes

    def owned_by(self, owner: int) -> int:
        """Bytes of the cached blocks of field ``owner``."""
        return sum(block.nbytes for (who, _), block in self._blocks.items() if who == owner)


def index_file(blocks_file: str) -> str:
    """The name of the index file beside compressed blocks file ``blocks_file``."""
    return blocks_file.removesuffix(".blocks") + ".index"


class FrameStore(Protocol):
    """One compressed field's frames, by block (see the module docstring)."""

    persistent: bool  # whether a reopened buffer reads them (files)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the frames held."""
        ...

    def has(self, block: int) -> bool:
        """Whether block ``block`` has a frame."""
        ...

    def get(self, block: int) -> bytes | memoryview:
        """Block ``block``'s frame (`has` must be true)."""
        ...

    def put(self, block: int, frame: bytes) -> None:
        """Make ``frame`` block ``block``'s frame."""
        ...

    def written(self) -> np.ndarray:
        """Whether each block has a frame (bool, ``[blocks]``)."""
        ...

    def flush(self) -> None:
        """Make the frames durable (files only)."""
        ...


class MemoryFrames:
    """Frames as a list of bytes, in memory."""

    persistent = False  # nothing outside the process reads them

    def __init__(self, blocks: int) -> None:
        self._frames: list[bytes | None] = [None] * blocks
        self.stored_bytes = 0

    def has(self, block: int) -> bool:
        return self._frames[block] is not None

    def get(self, block: int) -> bytes:
        frame = self._frames[block]
        assert frame is not None
        return frame

    def put(self, block: int, frame: bytes) -> None:
        old = self._frames[block]
        self.stored_bytes += len(frame) - (0 if old is None else len(old))
        self._frames[block] = frame

    def written(self) -> np.ndarray:
        return np.array([frame is not None for frame in self._frames], dtype=np.bool_)

    def flush(self) -> None:
        pass


class MappedFrames:
    """Frames in a sparse blocks file and its index file (see the module docstring).

    ``sizes``: each block's raw bytes (a frame is at most that long: one that would not be
    shorter compressed is kept raw). ``create``: new files; else existing ones, checked.

    Raises
    ------
    CheckpointError
        For existing files of other sizes, or an index entry no write could have left.
    """

    persistent = True  # `SequenceReplay.open` reads them

    def __init__(self, path: Path, sizes: np.ndarray, *, create: bool) -> None:
        self.path, self.sizes = path, sizes
        blocks = sizes.shape[0]
        page = mmap.PAGESIZE
        self.slot = -(-int(sizes.max(initial=0)) // page) * page
        index_path = path.with_name(index_file(path.name))
        index_bytes = blocks * _INDEX_COLUMNS * 8
        if create:
            _new_file(index_path, index_bytes, reserve=True)
            _new_file(path, 2 * blocks * self.slot, reserve=False)
        else:
            _check_size(index_path, index_bytes)
            _check_size(path, 2 * blocks * self.slot)
        self._descriptor = os.open(path, os.O_RDWR)  # kept open for pwrite, closed with self
        weakref.finalize(self, os.close, self._descriptor)
        self._frames = mmap.mmap(self._descriptor, 0) if self.slot and blocks else None
        with open(index_path, "r+b", buffering=0) as file:
            self._index_map = mmap.mmap(file.fileno(), index_bytes) if blocks else None
        self._index = (
            np.frombuffer(self._index_map, dtype=np.int64).reshape(blocks, _INDEX_COLUMNS)
            if self._index_map is not None
            else np.zeros((0, _INDEX_COLUMNS), dtype=np.int64)
        )
        if not create:
            self._check_index()

    @property
    def stored_bytes(self) -> int:
        use = self._index[:, 0]
        return int(np.where(use == 1, self._index[:, 1], self._index[:, 3] * (use == 2)).sum())

    def has(self, block: int) -> bool:
        return bool(self._index[block, 0])

    def get(self, block: int) -> bytes | memoryview:
        use, length_crc = self._entry(block)
        length, crc = length_crc
        if not length:
            return b""
        assert self._frames is not None
        start = (2 * block + use - 1) * self.slot
        frame = memoryview(self._frames)[start : start + length]
        if zlib.crc32(frame) != crc:
            raise CheckpointError(
                f"compressed block {block} of {self.path.name} must match its checksum, got "
                f"other bytes (the file changed outside the buffer)"
            )
        return frame

    def put(self, block: int, frame: bytes) -> None:
        entry = self._index[block]
        old = int(entry[0])
        use = 2 if old == 1 else 1  # the slot not in use
        start = (2 * block + use - 1) * self.slot
        written = 0
        while written < len(frame):
            written += os.pwrite(self._descriptor, frame[written:], start + written)
        entry[2 * use - 1], entry[2 * use] = len(frame), zlib.crc32(frame)
        entry[0] = use  # the flip: one aligned 8-byte store
        if old and self._frames is not None:  # free the old frame's pages
            stale = (2 * block + old - 1) * self.slot
            length = -(-int(entry[2 * old - 1]) // mmap.PAGESIZE) * mmap.PAGESIZE
            with contextlib.suppress(OSError, AttributeError, ValueError):
                self._frames.madvise(mmap.MADV_REMOVE, stale, length)

    def written(self) -> np.ndarray:
        written: np.ndarray = self._index[:, 0] != 0
        return written

    def flush(self) -> None:
        os.fsync(self._descriptor)
        if self._index_map is not None:
            self._index_map.flush()

    def _entry(self, block: int) -> tuple[int, tuple[int, int]]:
        entry = self._index[block]
        use = int(entry[0])
        return use, (int(entry[2 * use - 1]), int(entry[2 * use]))

    def _check_index(self) -> None:
        use = self._index[:, 0]
        picked = np.clip(use, 1, 2)[:, None] * 2 + np.array([-1, 0])
        length, crc = np.take_along_axis(self._index, picked, axis=1).T
        bad = (use < 0) | (use > 2)
        bad |= (use > 0) & ((length < 0) | (length > self.sizes) | (crc < 0) | (crc >> 32 != 0))
        bad |= (use > 0) & (length == 0) & (self.sizes > 0)
        if bad.any():
            block = int(np.flatnonzero(bad)[0])
            raise CheckpointError(
                f"compressed field index {self.path.name} must hold valid frame entries, got "
                f"{self._index[block].tolist()} for block {block}"
            )


def _new_file(path: Path, size: int, *, reserve: bool) -> None:
    """Create ``path`` of ``size`` bytes: its blocks reserved on the disk, or sparse."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        if reserve and size:
            os.posix_fallocate(descriptor, 0, size)
        else:
            os.ftruncate(descriptor, size)
    except OSError as error:
        os.close(descriptor)
        path.unlink(missing_ok=True)
        raise MemoryError(f"{size:,} bytes on disk for {path.name}: {error}") from None
    os.close(descriptor)


def _check_size(path: Path, size: int) -> None:
    try:
        got = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"compressed field file {path.name!r} must exist, got none") from None
    if got != size:
        raise CheckpointError(
            f"compressed field file {path.name!r} must hold {size} bytes, got {got}"
        )
