"""The shard's side of ``transport="shared"``: fields in shared files, a published head.

A shard of a replay made with ``transport="shared"`` keeps every field of its ring in a file
mapped shared (`SharedFields`, a `lucid_replay.mapped_files.FileBacked`): under
``/dev/shm`` for ``storage="memory"``, its own memmap directory for ``storage="memmap"``.
Clients on the same node map those files read-only (`lucid_replay.distributed.gathering`).

A located draw (`located`) returns, instead of the gathered batch, where each record is: the
windows' per-record entries (masks, ids, steps: small) and, per group of fields gathered
alike, the records as *listed runs* (global offset, first record, end record, kind; the
window of each), the form `TransitionRing.gather_runs` copies straight into any batch rows.
Stacked fields are listed from `lucid_replay.stacks.plan`, as their in-process gather
reads them. Each window also carries the lowest offset it reads.

Torn reads. The ring is written FIFO by global offset (slot ``offset % capacity``): adds,
segment commits and checkpoint fills write at the table's next offset only, after the
oldest rows were evicted, so an offset ``o`` is overwritten only by a write ending past
``o + capacity``. Before every ring write the allocator is told the write's end
(`FileBacked.written`); `SharedFields` then publishes ``head = end - capacity`` in a small
shared header, *before* the ring writes: every offset ``>= head`` is intact. A record evicted
but not overwritten still holds its own episode's step (what the ``"object"`` transport
returns too, e.g. of an episode the reuse limit retired in the draw itself): it is not torn.
A write out of that order (`write_back`) bumps the header's ``epoch`` first. A client
compares a window's lowest offset with the head, and the
epoch with the one of the draw, *after* its copy (a seqlock's read side; on x86-64 stores
are seen in order, so seeing a newer record implies seeing the newer head).
"""

from __future__ import annotations

import importlib
import math
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from lucid_replay import engine, stacks
from lucid_replay.mapped_files import FileBacked
from lucid_replay.records import Anchors
from lucid_replay.ring import TransitionRing
from lucid_replay.window import Window, expand

__all__: list[str] = []  # internal module

HEADER = "published.bin"  # int64 [head, epoch]
_HEAD, _EPOCH = 0, 1
_META = ("validity_mask", "is_init", "terminal", "record_episode_ids", "record_steps")


def shared_root(replay: str) -> str:
    """Where a replay's ``storage="memory"`` shards share their fields (``/dev/shm``)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return str(Path(base) / f"lucid_replay-{replay}")


class SharedFields(FileBacked):
    """A `FileBacked` allocator that publishes, before each ring write, what stays intact."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        super().__init__(directory)
        path = directory / HEADER
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            os.ftruncate(descriptor, 64)
            self._header_map = mmap.mmap(descriptor, 64, access=mmap.ACCESS_WRITE)
        finally:
            os.close(descriptor)
        self.header_path = str(path)
        self.header = np.frombuffer(self._header_map, dtype=np.int64, count=2)
        self.described: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # `descriptor`

    def written(self, end: int) -> None:
        """Publish ``head = end - capacity`` (if higher), then let the ring write."""
        self.advance(end - self.capacity)
        super().written(end)

    def advance(self, head: int) -> None:
        """Raise the published head: offsets below ``head`` may no longer hold their record."""
        if head > int(self.header[_HEAD]):
            self.header[_HEAD] = head

    def bump(self) -> None:
        """Before a write out of FIFO order: every location handed out so far is stale."""
        self.header[_EPOCH] += 1

    @property
    def epoch(self) -> int:
        """The published epoch."""
        return int(self.header[_EPOCH])


def install(buffer: Any, directory: str) -> SharedFields:
    """Keep ``buffer``'s fields (its ring is not allocated yet) in shared files under it."""
    store = buffer._core.store
    assert not store.ring.allocated  # only an empty buffer changes where it keeps its fields
    allocator = SharedFields(Path(directory))
    store.allocator = allocator
    store.ring = TransitionRing(
        store.capacity, store.ring.device, allocator, store.ring.cache_bytes
    )
    return allocator


def descriptor(ring: TransitionRing, allocator: SharedFields) -> dict[str, Any]:
    """What a client maps: the header, the capacity, each field's file, shape and dtype.

    Kept on ``allocator`` while the ring's fields are the same files at the same addresses
    (every draw hands it out; building it costs about 0.07 ms). Never changed in place.
    """
    key = (
        id(ring),
        ring.capacity,
        *((name, allocator.names.get(name), t.data_ptr()) for name, t in ring.fields.items()),
    )
    if allocator.described is not None and allocator.described[0] == key:
        return allocator.described[1]
    directory = allocator.directory
    fields = {
        name: (str(directory / allocator.names[name]), list(t.shape[1:]), str(t.dtype))
        for name, t in ring.fields.items()
    }
    made = {"header": allocator.header_path, "capacity": ring.capacity, "fields": fields}
    allocator.described = (key, made)
    return made


def located(store: Any, anchors: Anchors, window: Window) -> dict[str, Any]:
    """Where the records of ``anchors`` expanded into ``window`` are (see the module).

    Returns plain values: ``meta`` (per-record entries and the anchors' ids and steps, local
    ids), ``groups`` (per group of fields: ``names``, ``size`` records a listed window,
    ``frames`` (0 unstacked), ``runs``, ``windows``, ``zero`` frame positions to zero),
    ``low`` (int64 per window) and ``oldest`` (the oldest stored offset now).
    """
    table, ring = store.table, store.ring
    records = expand(table, anchors, window)
    size = window.size
    meta = {
        "validity_mask": records.valid,
        "is_init": records.is_init,
        "terminal": records.terminal,
        "record_episode_ids": records.episode_ids,
        "record_steps": records.steps,
        "episode_ids": anchors.episode_ids,
        "anchor_steps": anchors.steps,
    }
    if table.segmented:
        meta["segment_ids"] = table.arrays["episode_id"][anchors.rows]
    meta = {key: _host(value) for key, value in meta.items()}
    count = int(meta["episode_ids"].shape[0])
    base = _host(table.arrays["base"])
    rows, steps = _host(records.rows), _host(records.steps)
    groups = []
    plain = [name for name in ring.fields if name not in ring.stacks]
    if plain:
        if records.runs is not None:
            runs, windows, listed = records.runs
            runs, windows = np.array(runs[:, :listed]), np.array(windows[:listed])
        else:
            exact = records.exact
            if exact is None:
                exact = records.valid if records.clamped else None
            firsts = _host(records.first_offsets)
            runs, windows = list_runs(
                firsts, window.dilation, size, _host(exact), base, rows, steps
            )
        groups.append(_group(plain, size, 0, runs, windows, None))
    for (frames, pad), names in stacks.groups(ring.stacks, ring.fields).items():
        firsts, (frame_rows, frame_steps), exact, before = stacks.plan(table, (rows, steps), frames)
        runs, windows = list_runs(
            _host(firsts), 1, frames, _host(exact), base, _host(frame_rows), _host(frame_steps)
        )
        zero = None if pad != "zeros" or before is None else before.numpy()
        groups.append(_group(names, frames, frames, runs, windows, zero))
    low = np.full(count, np.iinfo(np.int64).max, dtype=np.int64)
    for group in groups:
        owner = group["windows"] if not group["frames"] else group["windows"] // size
        np.minimum.at(low, owner, group["runs"][0])
    return {"meta": meta, "groups": groups, "low": low, "oldest": int(table.oldest_offset)}


# Per-record entries sent as their exceptions to a pattern: a record's episode is its
# anchor's, its step the anchor's plus its offset in the window, but where it is clamped,
# padded or in another episode. Ray returns a reply under 100 KiB inline and a larger one
# through its object store, some milliseconds more per call: the [B, W] int64 ids and steps
# alone would be 220 KB for 128 windows of 109 records.
_PATTERNED = {"record_episode_ids": "episode_ids", "record_steps": "anchor_steps"}
ODD_IDS = "record_episode_ids.odd"  # the ids `compact` keeps of ``record_episode_ids``
# The per-record masks travel as bits, an eighth of their bytes: as bools, the three masks
# of 256 windows of 109 records were 84 KB of a 128 KB reply, pickled, sent, read and
# unpickled on every draw.
_BITS = ("validity_mask", "is_init", "terminal")
_BITS_SUFFIX = ".bits"


def _pattern(meta: dict[str, Any], key: str, window: Window) -> np.ndarray:
    """What ``meta[key]`` holds but for its exceptions (``[B, W]``, int64)."""
    anchors = np.asarray(meta[_PATTERNED[key]], dtype=np.int64)[:, None]
    if key == "record_steps":
        return anchors + (np.arange(window.size, dtype=np.int64) - window.burn_in) * window.dilation
    return np.repeat(anchors, window.size, axis=1)


def compact(meta: dict[str, Any], window: Window) -> None:
    """Replace ``meta``'s per-record ids and steps by their exceptions, and its masks by bits.

    `uncompact` undoes it.
    """
    for key in _PATTERNED:
        values = np.asarray(meta.pop(key))
        odd = np.flatnonzero(values.reshape(-1) != _pattern(meta, key, window).reshape(-1))
        meta[f"{key}.odd"] = (odd, values.reshape(-1)[odd], values.dtype.str)
    for key in _BITS:
        if key in meta:
            mask = np.asarray(meta.pop(key), dtype=bool)
            meta[f"{key}{_BITS_SUFFIX}"] = (np.packbits(mask.reshape(-1)), mask.shape)


def uncompact(meta: dict[str, Any], window: Window) -> None:
    """The per-record ids and steps `compact` sent, back in ``meta`` (in place)."""
    for key in _PATTERNED:
        if f"{key}.odd" not in meta:
            continue
        odd, values, dtype = meta.pop(f"{key}.odd")
        full = _pattern(meta, key, window).astype(np.dtype(dtype))
        full.reshape(-1)[odd] = values
        meta[key] = full
    for key in _BITS:
        packed = meta.pop(f"{key}{_BITS_SUFFIX}", None)
        if packed is not None:
            bits, shape = packed
            count = math.prod(shape)
            meta[key] = np.unpackbits(bits, count=count).view(bool).reshape(shape)


def _group(
    names: list[str], size: int, frames: int, runs: Any, windows: Any, zero: Any
) -> dict[str, Any]:
    return {
        "names": list(names),
        "size": size,
        "frames": frames,
        "runs": runs,
        "windows": windows,
        "zero": zero,
    }


def _host(values: Any) -> Any:
    """An `engine` array as a numpy array (``None`` stays)."""
    if values is None or isinstance(values, np.ndarray):
        return values
    return np.asarray(engine.tensor(values).cpu().numpy())


def list_runs(
    firsts: np.ndarray,
    stride: int,
    size: int,
    exact: np.ndarray | None,
    base: np.ndarray,
    rows: np.ndarray,
    steps: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The records of `TransitionRing.gather_runs`' arguments as listed runs, and their windows.

    Record ``k`` of window ``b`` is at ``firsts[b] + stride * k`` where ``exact`` (``None``:
    everywhere), else at ``base[rows[b, k or 0]] + steps[b, k]``. Returns ``runs`` int64
    ``[4, n]`` (global offset, first record, end record, kind: 1 consecutive offsets, 0 one
    repeated offset) and ``windows`` int64 ``[n]``, as `ring_copies.copy_runs` reads them.
    """
    firsts = np.ascontiguousarray(firsts, dtype=np.int64)
    count = int(firsts.shape[0])
    if engine.compiled(firsts):
        run_lists = importlib.import_module("lucid_replay.distributed.run_lists")  # numba

        runs = np.empty((4, count * size), dtype=np.int64)
        windows = np.empty(count * size, dtype=np.int64)
        checked = np.empty((0, 0), dtype=np.bool_) if exact is None else exact
        listed = run_lists.list_runs_loop(
            firsts,
            stride,
            size,
            np.ascontiguousarray(checked, dtype=np.bool_),
            np.ascontiguousarray(base, dtype=np.int64),
            np.ascontiguousarray(rows, dtype=np.int64),
            np.ascontiguousarray(steps, dtype=np.int64),
            runs,
            windows,
        )
        return np.array(runs[:, :listed]), np.array(windows[:listed])
    offsets = firsts[:, None] + stride * np.arange(size, dtype=np.int64)
    if exact is not None:
        record = base[rows] + steps
        offsets = np.where(exact, offsets, record)
    flat = offsets.reshape(-1)
    starts = np.ones(flat.shape[0], dtype=bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts[::size] = True
    first = np.flatnonzero(starts)
    ends = np.append(first[1:], flat.shape[0])
    runs = np.stack([flat[first], first % size, (ends - 1) % size + 1, np.ones_like(first)])
    return np.ascontiguousarray(runs), first // size
