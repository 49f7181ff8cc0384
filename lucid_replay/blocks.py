"""Compressed fields: a field's ring slots kept as compressed blocks of steps, decoded on demand.

A field with ``codec="zstd"`` or ``"lz4"`` has no ``[capacity, *shape]`` tensor. Its slots
are cut into blocks of `BLOCK_STEPS` consecutive slots, each kept as one compressed frame
of its raw bytes (`BlockField`). The ring writes slots in order, so exactly one block is
being written at a time: it stays raw (the *head*) until the writes move on, and is then
compressed. A gather decodes only the blocks its slots fall in, through the buffer's one
`BlockCache` of decoded blocks (at most ``cache_bytes``), and copies every slot from its
decoded block straight into the batch: the bytes are the ones written, so a batch is
bit-identical to an uncompressed buffer's.

Where the frames are kept is a *frame store* (`lucid_replay.block_files`): a list in memory,
or, with ``storage="memmap"``, a sparse file of the buffer's directory and its index, which
`sync` completes by writing the head block's frame too (`BlockField.persist`). The logic
here is the same for both.

Both libraries release the GIL while they compress and decode, and so does the compiled copy:
a gather spreads its decodes and its copy over torch's thread count (`host_threads`), as an
uncompressed gather's one torch copy does, and a background thread (``iterate``'s prefetch)
decodes while the learner's thread runs. The codecs are the extra ``compress`` (``pip
install lucid-replay[compress]``): `block_files.codec_module` names it when a library is
missing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Final

import numpy as np
import torch

from lucid_replay import engine, host_threads
from lucid_replay.block_files import BlockCache, Codec, FrameStore, MemoryFrames

__all__: list[str] = []  # internal module

BLOCK_STEPS: Final = 32  # slots per compressed block: the unit a gather decodes
CACHE_BYTES: Final = 256 << 20  # a buffer's decoded blocks, by default
ARENA_BYTES: Final = 256 << 20  # the most decoded blocks a gather lays side by side at once
_SPLIT_BYTES: Final = 1 << 20  # below this much copying per thread, one thread copies
_SPLIT_BLOCKS: Final = 4  # below this many blocks to decode per thread, one thread decodes


def checked_cache(cache_bytes: object, codecs: Mapping[str, str], device: torch.device) -> int:
    """``cache_bytes`` (an int ``>= 0``); compressed fields only on the CPU, which decodes them."""
    from lucid_replay.checks import check_int  # checks imports torch only; kept local
    from lucid_replay.errors import must

    cache = check_int("cache_bytes", cache_bytes, minimum=0)
    if codecs and device.type != "cpu":
        raise must("device", "'cpu' with compressed fields (Field codec=...)", str(device))
    return cache


class BlockField:
    """One field's ``capacity`` slots of ``step_bytes`` bytes each, as compressed blocks.

    ``owner``: this field's key in ``cache``; ``frames``: where the frames are kept (a
    `lucid_replay.block_files` store, in memory if None). Slots never written read as zeros.
    A frame that would not be shorter than its raw block is kept raw (its length says so).
    """

    def __init__(
        self,
        capacity: int,
        step_bytes: int,
        codec: str,
        cache: BlockCache,
        owner: int,
        frames: FrameStore | None = None,
    ) -> None:
        self.capacity, self.step_bytes = capacity, step_bytes
        self.codec, self.cache, self.owner = Codec(codec), cache, owner
        self.frames = MemoryFrames(block_count(capacity)) if frames is None else frames
        self.head = -1  # the block being written, raw in `staging`
        self.staging = np.zeros((BLOCK_STEPS, step_bytes), dtype=np.uint8)

    @property
    def stored_bytes(self) -> int:
        """Compressed frames plus the raw head block (not also the head's frame, if any)."""
        if self.head < 0:
            return self.frames.stored_bytes
        held = self.frames.has(self.head) and len(self.frames.get(self.head))
        return self.frames.stored_bytes - held + self.staging.nbytes

    def write(self, slot: int, raw: np.ndarray) -> None:
        """Copy ``raw`` (``[n, step_bytes]`` uint8) to slots ``slot .. slot + n - 1``."""
        end = slot + raw.shape[0]
        assert end <= self.capacity  # the ring splits a write at its seam
        while slot < end:
            block, within = divmod(slot, BLOCK_STEPS)
            count = min(end - slot, self._block_size(block) - within)
            if block != self.head:
                whole = within == 0 and count == self._block_size(block)
                self._move_head(block, keep_old=not whole)
            self.staging[within : within + count] = raw[:count]
            raw, slot = raw[count:], slot + count

    def gather(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The bytes of ring ``slots`` (flat int64): ``[len(slots), step_bytes]`` uint8.

        Into ``out`` (C-contiguous, of that shape) where given. The blocks touched are
        decoded (or found in the cache); with the compiled kernels one loop then copies each
        slot's bytes from its block to its place (`ring_copies.copy_rows`). Otherwise they
        are laid side by side in an arena of at most `ARENA_BYTES`, from which one
        ``index_select`` copies every slot to its place. Either way one pass over the
        output, whatever order the slots come in.
        """
        if out is None:
            out = np.empty((slots.shape[0], self.step_bytes), dtype=np.uint8)
        if not slots.shape[0]:
            return out
        blocks = slots // BLOCK_STEPS
        touched, inverse = np.unique(blocks, return_inverse=True)
        if engine.compiled(slots) and out.flags.c_contiguous:  # straight from the blocks
            held = self._decoded_blocks(touched.tolist())  # alive for the copy
            sources = np.array([block.ctypes.data for block in held], dtype=np.int64)
            owner, within_rows = inverse.reshape(-1), slots - blocks * BLOCK_STEPS
            copy_rows, width, address = _ring_copies().copy_rows, self.step_bytes, out.ctypes.data

            def copy(part: tuple[int, int]) -> None:
                begin, end = part
                copy_rows(
                    address + begin * width,
                    width,
                    sources,
                    owner[begin:end],
                    within_rows[begin:end],
                )

            host_threads.run_split(copy, host_threads.chunks(slots.shape[0], _SPLIT_BYTES // width))
            return out
        within = torch.from_numpy(slots - blocks * BLOCK_STEPS)
        inverse_t, target = torch.from_numpy(inverse.reshape(-1)), torch.from_numpy(out)
        per = max(ARENA_BYTES // (BLOCK_STEPS * self.step_bytes), 1)  # blocks an arena holds
        arena = np.empty((min(per, touched.shape[0]) * BLOCK_STEPS, self.step_bytes), np.uint8)
        for first in range(0, touched.shape[0], per):
            for i, block in enumerate(touched[first : first + per].tolist()):
                decoded = self._decoded(block)
                arena[i * BLOCK_STEPS : i * BLOCK_STEPS + decoded.shape[0]] = decoded
            index = (inverse_t - first) * BLOCK_STEPS + within
            source = torch.from_numpy(arena)
            if first == 0 and touched.shape[0] <= per:  # every slot: straight into `out`
                torch.index_select(source, 0, index, out=target)
                break
            picked = torch.nonzero((inverse_t >= first) & (inverse_t < first + per)).view(-1)
            target.index_copy_(0, picked, source.index_select(0, index[picked]))
        return out

    def scatter(self, slots: np.ndarray, raw: np.ndarray) -> None:
        """Write ``raw[i]`` (``[n, step_bytes]`` uint8) to slot ``slots[i]``, in any order.

        Each block touched is decoded, changed and compressed again (the head in place, and
        in its file too where the frames are files: as a raw field's file, they then hold
        the values written back).
        """
        blocks = slots // BLOCK_STEPS
        for block in np.unique(blocks).tolist():
            picked = blocks == block
            within = slots[picked] - block * BLOCK_STEPS
            if block == self.head:
                self.staging[within] = raw[picked]
                if self.frames.persistent:
                    self.persist()
                continue
            decoded = self._decoded(block).copy()
            decoded[within] = raw[picked]
            self.frames.put(block, self._pack(decoded))
            self.cache.drop((self.owner, block))

    def seal(self) -> None:
        """Compress the head block: no block is then kept raw."""
        if self.head >= 0:
            self._move_head(-1, keep_old=False)

    def persist(self) -> None:
        """Write the head block's frame too (`sync`); it stays the head, raw, as before."""
        if self.head >= 0:
            self.frames.put(self.head, self._pack(self.staging[: self._block_size(self.head)]))

    def missing(self, first: int, count: int) -> bool:
        """Whether a block holding one of ``count`` slots from ``first`` (wrapping) has no frame."""
        start, count = first % self.capacity, min(count, self.capacity)
        end, written = start + count, self.frames.written()
        if self.head >= 0:
            written[self.head] = True
        runs = [(start, min(end, self.capacity)), (0, max(end - self.capacity, 0))]
        held = [written[a // BLOCK_STEPS : -(-b // BLOCK_STEPS)] for a, b in runs if b > a]
        return not all(bool(part.all()) for part in held)

    # --------------------------------------------------------------------------- inside
    def _block_size(self, block: int) -> int:
        return min(BLOCK_STEPS, self.capacity - block * BLOCK_STEPS)

    def _move_head(self, block: int, *, keep_old: bool) -> None:
        """Compress the head block and make ``block`` the head (its slots kept if ``keep_old``)."""
        if self.head >= 0:
            self.frames.put(self.head, self._pack(self.staging[: self._block_size(self.head)]))
            self.cache.drop((self.owner, self.head))  # decoded before it was rewritten
        if block >= 0 and keep_old:
            self.staging[: self._block_size(block)] = self._decoded(block)
        self.head = block

    def _decoded_blocks(self, blocks: list[int]) -> list[np.ndarray]:
        """`_decoded` of each of ``blocks``; the misses decoded on `host_threads` at once."""
        held: list[np.ndarray | None] = [None] * len(blocks)
        missing: list[int] = []
        for i, block in enumerate(blocks):
            if block == self.head or not self.frames.has(block):
                held[i] = self._decoded(block)
            else:
                held[i] = self.cache.get((self.owner, block))
                if held[i] is None:
                    missing.append(i)
        if missing:
            parts = host_threads.chunks(len(missing), _SPLIT_BLOCKS)

            def decode(part: tuple[int, int]) -> list[np.ndarray]:
                return [self._decode(blocks[i]) for i in missing[part[0] : part[1]]]

            decoded = [array for done in host_threads.run_split(decode, parts) for array in done]
            for i, array in zip(missing, decoded, strict=True):
                self.cache.put((self.owner, blocks[i]), array)
                held[i] = array
        return held  # type: ignore[return-value]  # every entry is set above

    def _decode(self, block: int) -> np.ndarray:
        """Block ``block``'s compressed frame, decoded (``[block size, step_bytes]``)."""
        size, frame = self._block_size(block), self.frames.get(block)
        if len(frame) == size * self.step_bytes:  # kept raw
            kept: np.ndarray = np.frombuffer(frame, dtype=np.uint8).copy()
            return kept.reshape(size, self.step_bytes)
        return self.codec.decode(frame, size * self.step_bytes).reshape(size, self.step_bytes)

    def _pack(self, raw: np.ndarray) -> bytes:
        """``raw``'s frame: compressed, or raw where compressing would not make it shorter."""
        frame = self.codec.compress(raw)
        return frame if len(frame) < raw.nbytes else raw.tobytes()

    def _decoded(self, block: int) -> np.ndarray:
        """Block ``block``'s slots, ``[block size, step_bytes]`` (read-only or the head's)."""
        if block == self.head:
            return self.staging
        key = (self.owner, block)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        if not self.frames.has(block):
            return np.zeros((self._block_size(block), self.step_bytes), dtype=np.uint8)
        decoded = self._decode(block)
        self.cache.put(key, decoded)
        return decoded


def block_count(capacity: int) -> int:
    """Blocks of a field of ``capacity`` slots."""
    return math.ceil(capacity / BLOCK_STEPS)


def step_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one step of a field of per-step ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def as_raw(values: torch.Tensor) -> np.ndarray:
    """``values`` (``[n, ...]``, CPU) as ``[n, step_bytes]`` uint8, its bytes as stored."""
    flat = values.detach().contiguous().reshape(values.shape[0], -1)
    if flat.is_conj() or flat.is_neg():
        flat = flat.resolve_conj().resolve_neg()
    return flat.view(torch.uint8).numpy()


def as_values(raw: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (``[*S, step_bytes]`` uint8) as a tensor of ``[*S, *shape]`` and ``dtype``."""
    tensor: torch.Tensor = torch.from_numpy(raw).view(dtype)
    return tensor.reshape(*raw.shape[:-1], *shape)


class CompressedFields:
    """A ring's compressed fields: a `BlockField` each, sharing one `BlockCache`.

    ``specs``: name -> ``(per-step shape, dtype)``; ``codecs``: name -> codec; ``stores``:
    where each field's frames are kept, ``stores(name, capacity, sizes)`` given each block's raw
    bytes
    (a ``storage="memmap"`` allocator's `frame_store`; in memory where None).
    """

    def __init__(
        self,
        capacity: int,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        codecs: Mapping[str, str],
        cache_bytes: int,
        stores: Callable[[str, int, np.ndarray], FrameStore] | None = None,
    ) -> None:
        self.specs = dict(specs)
        self.cache = BlockCache(cache_bytes)
        self.fields = {}
        sizes = np.full(block_count(capacity), BLOCK_STEPS, dtype=np.int64)
        sizes[-1] = capacity - (sizes.shape[0] - 1) * BLOCK_STEPS
        for owner, (name, spec) in enumerate(self.specs.items()):
            width = step_bytes(*spec)
            frames = None if stores is None else stores(name, capacity, sizes * width)
            self.fields[name] = BlockField(capacity, width, codecs[name], self.cache, owner, frames)

    def write(self, begin: int, first: int, steps: Mapping[str, torch.Tensor]) -> None:
        """Write each field's steps from slot ``begin`` (``first`` of them, the rest from 0)."""
        for name, field in self.fields.items():
            if name not in steps:
                continue  # a checkpoint fills one field at a time
            raw = as_raw(steps[name])
            field.write(begin, raw[:first])
            if first < raw.shape[0]:
                field.write(0, raw[first:])

    def gather(self, name: str, slots: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """Field ``name`` at flat ring ``slots``: ``[len(slots), *shape]``.

        Into ``out`` (of that shape and the field's dtype) where given.
        """
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        if out is not None and direct and not (out.is_conj() or out.is_neg()):
            self.fields[name].gather(slots, as_raw(out))  # writes through to `out`
            return out
        values = as_values(self.fields[name].gather(slots), *self.specs[name])
        return values if out is None else out.copy_(values)

    def gather_all(
        self, positions: torch.Tensor, out: Mapping[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """Every field at ring slots ``positions`` (any shape ``S``): ``[*S, *shape]`` each.

        Into ``out``'s tensors where given (`TransitionRing.gather`).
        """
        slots, result = positions.reshape(-1).cpu().numpy(), {}
        for name, (shape, _) in self.specs.items():
            values = self.gather(name, slots).view(*positions.shape, *shape)
            result[name] = values if out is None else out[name].copy_(values)
        return result

    def scatter(self, name: str, slots: np.ndarray, values: torch.Tensor) -> None:
        """Write ``values[i]`` to slot ``slots[i]`` of field ``name``."""
        self.fields[name].scatter(slots, as_raw(values.cpu()))

    def export(self, spans: list[tuple[int, int]]) -> Iterator[tuple[str, list[torch.Tensor]]]:
        """Each field's slots ``(start, count)`` of ``spans``, decoded (copies)."""
        for name in self.fields:
            yield (
                name,
                [
                    self.gather(name, np.arange(start, start + count, dtype=np.int64))
                    for start, count in spans
                ],
            )

    def persist(self) -> None:
        """Write each field's head block into its frames too (see `BlockField.persist`)."""
        for field in self.fields.values():
            field.persist()

    def missing(self, first: int, count: int) -> list[str]:
        """The fields with a block of ``count`` slots from ``first`` (wrapping) never written."""
        return [name for name, field in self.fields.items() if field.missing(first, count)]

    def stored_bytes(self, name: str | None = None) -> int:
        """Bytes of field ``name``'s blocks (``None``: of every field)."""
        if name is None:
            return sum(field.stored_bytes for field in self.fields.values())
        return self.fields[name].stored_bytes

    def cache_bytes(self, name: str) -> int:
        return self.cache.owned_by(self.fields[name].owner)


def _ring_copies() -> ModuleType:
    """`lucid_replay.ring_copies` (it needs numba: imported on the compiled path only)."""
    from lucid_replay import ring_copies

    return ring_copies
