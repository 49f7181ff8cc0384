"""The transition ring: contiguous per-field tensors over transitions, on one device.

Transitions are addressed by their global *offset* (see `lucid_replay.table`); a stored
offset lives in ring slot ``offset % capacity``. Each field's storage comes from the ring's
allocator (`lucid_replay.allocators`). The gather's raw-memory copies, compiled, are beside it
in `lucid_replay.ring_copies`; a checkpoint's fields go out and back in through
`lucid_replay.ring_export`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from lucid_replay import engine, openmp_team
from lucid_replay.allocators import Allocator, allocate_fields
from lucid_replay.blocks import CACHE_BYTES, CompressedFields
from lucid_replay.engine import Array
from lucid_replay.records import blocks_pay

if TYPE_CHECKING:
    from lucid_replay.table import EpisodeTable

__all__: list[str] = []  # internal module


class TransitionRing:
    """Preallocated ``[capacity, *field_shape]`` tensors, one per field, on one device.

    Allocated by ``allocator`` on the first write, when the schema is known. Costs: ``write``
    is one or two slice copies per field; ``gather`` is one ``index_select`` per field.
    """

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        allocator: Allocator,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.capacity = capacity
        self.device = device
        self.allocator = allocator
        self.fields: dict[str, torch.Tensor] = {}  # the fields kept raw
        self.compressed: CompressedFields | None = None  # fields kept as compressed blocks
        self.cache_bytes = cache_bytes
        self._host_fields: dict[str, np.ndarray] | None = None
        # Where each CPU field's memory is, and its bytes per record, for the compiled gather.
        self._addresses = self._row_bytes = _NO_STARTS
        self._signed: dict[str, bool] = {}
        self._runs_scratch = np.empty((4, 0), dtype=np.int64)
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # see _run_views
        self._splits: dict[tuple[int, int, int], tuple[np.ndarray, tuple[str, ...]]] = {}
        self._scratch: dict[str, torch.Tensor] = {}
        # A file-backed allocator is told each write's end first (`lucid_replay.mapped_files`).
        self._written: Callable[[int], None] | None = getattr(allocator, "written", None)
        # Fields gathered as frame stacks (name -> frames, pad; `lucid_replay.stacks`), and
        # rings over some of the fields' memory, for their gathers (see `part`).
        self.stacks: Mapping[str, tuple[int, str]] = {}
        self._parts: dict[tuple[str, ...], TransitionRing] = {}

    def allocate(self, schema: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Create the storage tensors for ``schema`` (name -> (per-step shape, dtype)).

        All or nothing (see `allocate_fields`): on a `MemoryError` the ring keeps no storage.
        A `Schema`'s stacked fields are kept in `stacks`, its compressed ones in `compressed`.
        """
        codecs = dict(getattr(schema, "codecs", {}))
        raw = {name: spec for name, spec in schema.items() if name not in codecs}
        fields = allocate_fields(self.allocator, self.capacity, raw, self.device)
        self.stacks = dict(getattr(schema, "stacks", {}))
        self.compressed = None
        if codecs:
            specs = {name: schema[name] for name in codecs}
            stores = getattr(self.allocator, "frame_store", None)  # files, or memory (None)
            self.compressed = CompressedFields(
                self.capacity, specs, codecs, self.cache_bytes, stores
            )
        self._adopt(fields)
        self.allocated = True  # (compressed fields only: no tensors)

    allocated = False

    def part(self, names: tuple[str, ...]) -> TransitionRing:
        """A ring over fields ``names`` of this one (the same memory), for their own gathers.

        Kept: built once per set of names, until the next `allocate`.
        """
        part = self._parts.get(names)
        if part is None:
            part = TransitionRing(self.capacity, self.device, self.allocator)
            part._adopt({name: self.fields[name] for name in names})
            self._parts[names] = part
        return part

    def _adopt(self, fields: dict[str, torch.Tensor]) -> None:
        """Take ``fields`` (``[capacity, ...]`` tensors) as this ring's storage."""
        self.fields = fields
        self._views, self._splits, self._parts = {}, {}, {}
        try:  # numpy views of the same memory, for `write`
            self._host_fields = {name: store.numpy() for name, store in fields.items()}
        except TypeError:  # not on CPU, or a dtype numpy lacks
            self._host_fields = None
        self._addresses = self._row_bytes = _NO_STARTS
        # Fields whose steps may be lazy negation or conjugation views (floating, complex).
        self._signed = {n: t.is_floating_point() or t.is_complex() for n, t in fields.items()}
        if self.device.type == "cpu":
            self._addresses = np.array([t.data_ptr() for t in fields.values()], dtype=np.int64)
            self._row_bytes = np.array(
                [math.prod(t.shape[1:]) * t.element_size() for t in fields.values()],
                dtype=np.int64,
            )

    def write(
        self,
        offset: int,
        steps: Mapping[str, torch.Tensor],
        host_steps: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Copy ``steps`` (``[T, ...]`` each) to the slots of offsets ``offset .. offset+T-1``.

        ``host_steps``, numpy views of ``steps`` (made here if not given), make the copies
        numpy assignments into views of a CPU ring: about 0.5 us a field instead of 2 us
        for `Tensor.copy_`.
        """
        if host_steps is None and self._host_fields is not None:
            host_steps = engine.host_views(steps)
        begin = offset % self.capacity
        length = next(iter(steps.values())).shape[0]
        if self._written is not None:
            self._written(offset + length)
        first = min(length, self.capacity - begin)  # the rest wraps across the seam
        stores: Mapping[str, Array]
        sources: Mapping[str, Array]
        if host_steps is not None and self._host_fields is not None:
            stores, sources = self._host_fields, host_steps
        else:  # detached: copying a tensor that requires grad would put the ring in its graph
            stores, sources = self.fields, {name: t.detach() for name, t in steps.items()}
        for name in sources:
            if name not in stores:
                continue  # a compressed field: below
            store: Array = stores[name]
            values: Array = sources[name]
            if first == length:
                store[begin : begin + length] = values
            else:
                store[begin:] = values[:first]
                store[: length - first] = values[first:]
        if self.compressed is not None:
            self.compressed.write(begin, first, steps)

    def layout(self) -> tuple[np.ndarray, np.ndarray]:
        """Each field's address and bytes per step (empty off the CPU), for compiled copies."""
        return self._addresses, self._row_bytes

    def sources(self, steps: Mapping[str, torch.Tensor]) -> np.ndarray | None:
        """The addresses of checked ``steps``, in the ring's field order, for a compiled write.

        None unless every field is C-contiguous CPU memory holding its values as they read
        (a lazy conjugate or negation view does not): a raw copy must not reinterpret them.
        """
        if not self._addresses.shape[0] or self._written is not None:
            return None  # a compiled write would not report its end (see `write`)
        if self.compressed is not None:
            return None  # nor compress
        addresses = []  # a list, then one array: about 0.3 us less a call than item assignment
        for name, signed in self._signed.items():
            values = steps[name]
            if not (values.is_cpu and values.is_contiguous()):
                return None
            if signed and (values.is_conj() or values.is_neg()):  # only these dtypes have them
                return None
            addresses.append(values.data_ptr())
        return np.array(addresses, dtype=np.int64)

    def slots(self, offsets: Array, oldest_offset: int) -> Array:
        """Ring slots of stored global ``offsets`` (all in ``[oldest_offset, oldest + capacity)``).

        ``offset % capacity`` without an integer division: offsets relative to the ring lap of
        the oldest stored transition lie in ``[0, 2 capacity)``, so one conditional subtraction
        wraps them.
        """
        relative = offsets - (oldest_offset - oldest_offset % self.capacity)
        wraps = relative >= self.capacity
        if bool(wraps.any()):  # most batches read no record past the seam
            relative -= wraps * self.capacity
        return relative

    def scatter(
        self, name: str, offsets: torch.Tensor, values: torch.Tensor, oldest_offset: int
    ) -> None:
        """Write ``values[i]`` to the slot of stored offset ``offsets[i]`` of field ``name``."""
        slots = engine.tensor(self.slots(engine.view(offsets), oldest_offset))
        if name not in self.fields:
            assert self.compressed is not None  # a stored field is raw or compressed
            self.compressed.scatter(name, slots.cpu().numpy(), values)
            return
        self.fields[name][slots] = values

    def read(self, offset: int, length: int) -> dict[str, torch.Tensor]:
        """Return a copy of the ``length`` transitions starting at global ``offset``."""
        positions = torch.arange(offset, offset + length, device=self.device) % self.capacity
        return self.gather(positions)

    def gather(
        self, positions: torch.Tensor, out: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Gather ring slots ``positions`` (any shape ``S``) into ``[*S, *field_shape]`` tensors.

        ``out`` may supply preallocated (for example pinned) destination tensors.
        """
        flat = positions.reshape(-1)
        result = {}
        for name, store in self.fields.items():
            shape = (*positions.shape, *store.shape[1:])
            if out is None:
                result[name] = store.index_select(0, flat).view(shape)
            else:
                target = out[name]
                torch.index_select(store, 0, flat, out=target.view(flat.shape[0], *store.shape[1:]))
                result[name] = target
        if self.compressed is not None:
            result.update(self.compressed.gather_all(positions, out))
        return result

    def gather_runs(
        self,
        table: EpisodeTable,
        first_offsets: Array,
        size: int,
        stride: int,
        records: tuple[Array, Array] | None,
        exact: Array | None,
        out: Mapping[str, torch.Tensor] | None = None,
        listed: tuple[np.ndarray, np.ndarray, int] | None = None,
        one_thread: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Gather ``B`` runs of ``size`` records (``[B, size, *field_shape]``) stored in ``table``.

        Run ``b`` holds the transitions at offsets ``first_offsets[b] + stride * k``, except the
        records where ``exact`` is False (clamped records; ``exact=None`` means none are),
        which hold step ``steps[b, k]`` of the episode in table row ``rows[b, k]`` of
        ``records = (rows, steps)`` (``[B, size]``, or ``[B, 1]`` rows for one episode per
        window; ``None`` only with ``exact=None``): offset `EpisodeTable.offsets`. All are
        `engine` arrays.

        ``listed`` (with the kernels, into CPU memory): the windows' records as runs already
        listed (offsets, first and end record, kind; their windows; their count), as the
        expansion of windows across segment seams lists them: copied by
        `lucid_replay.listed_copies` (as blocks where windows lie in place; with several
        threads on torch's OpenMP team, `lucid_replay.openmp_team`), on this thread alone
        with ``one_thread`` (a caller whose other cores other processes need).

        Each run is read as one block through a strided view of the ring (about 30% faster
        than gathering its records one by one). With the compiled kernels, CPU storage and
        ``out`` on CPU, one kernel call then copies the clamped records and the runs across
        the ring's seam; with more than a quarter of the records clamped it copies every
        run itself instead, as blocks of memory. Otherwise the runs are copied first: with
        stride 1 by a kernel that copies each field's blocks in turn (with one torch thread
        6-11% faster per sample than ``index_select`` from 10k to 10M transitions, caches
        swept), except that with several threads ``index_select``, which splits a copy
        across them, copies the fields whose runs are large (see `_copiers`). Without the kernels
        the clamped records are repaired by a per-record gather, and a batch with a run
        across the seam, or with more than a quarter of its records to repair, is gathered
        record by record.
        """
        span = 1 + stride * (size - 1)
        firsts = first_offsets % self.capacity  # offsets may be negative
        oldest_offset = table.oldest_offset
        cpu = out is not None and next(iter(out.values())).device.type == "cpu"
        if engine.compiled(firsts) and out is not None and cpu:
            ring_copies = _ring_copies()
            if listed is not None:  # the windows' runs, listed by their expansion
                from lucid_replay.listed_copies import copy_listed

                lap = oldest_offset - oldest_offset % self.capacity
                team = openmp_team.threads(1 if one_thread else torch.get_num_threads())
                # index_select only without an OpenMP team: a team copies every field itself,
                # and a forked child's (team == 1) copies on this thread.
                by_torch = team is None and not one_thread
                split = self._copiers(size, 1) if by_torch else (np.arange(len(self.fields)), ())
                plan = self.fields, self._addresses, self._row_bytes, split
                fits = size <= self.capacity  # else no block of a window fits in the ring
                views = self._run_views(size, 1) if split[1] and fits else None
                copy_listed(*plan, out, size, listed, self.capacity, lap, views, team)
                return dict(out)

            # The runs are copied first; those that are clamped or cross the seam read any
            # run in range, and gather_records overwrites them, so with most records clamped
            # it copies everything itself instead.
            engine_exact = None if exact is None else np.ascontiguousarray(exact)
            copied = span <= self.capacity
            if copied and engine_exact is not None:
                repaired = engine_exact.size - np.count_nonzero(engine_exact)
                copied = blocks_pay(repaired, engine_exact.size)
            targets = np.array([out[name].data_ptr() for name in self.fields], dtype=np.int64)
            if copied:
                slots = np.minimum(firsts, self.capacity - span)
                serial, parallel = self._copiers(size, stride)
                if serial.shape[0]:
                    blocks = self._addresses[serial], self._row_bytes[serial], slots, size
                    ring_copies.copy_blocks(targets[serial], *blocks, self.capacity)
                if parallel:
                    positions = torch.from_numpy(slots)
                    views = self._run_views(size, stride)
                    for name in parallel:
                        torch.index_select(views[name], 0, positions, out=out[name])
            rows, steps = (_NO_RECORDS, _NO_RECORDS) if records is None else records
            ring_copies.gather_records(
                targets,
                self._addresses,
                self._row_bytes,
                copied,
                np.ascontiguousarray(first_offsets),
                stride,
                size,
                _ALL_EXACT if engine_exact is None else engine_exact,
                table.arrays["base"],
                rows,
                steps,
                self.capacity,
                oldest_offset - oldest_offset % self.capacity,
                self._scratch_runs(size),
            )
            return dict(out)

        def offsets_at(positions: Array | None) -> Array:
            return _offsets(table, first_offsets, size, stride, records, positions)

        every = None
        if span > self.capacity or not bool((firsts <= self.capacity - span).all()):
            every = offsets_at(None)
        where = None if exact is None else engine.flat_nonzero(~exact)
        if where is not None and not blocks_pay(where.shape[0], first_offsets.shape[0] * size):
            every = offsets_at(None)
        if every is not None:
            return self.gather(engine.tensor(self.slots(every, oldest_offset)), out)
        result = {}
        positions = engine.tensor(firsts)
        for name, runs in self._run_views(size, stride).items():
            target = None if out is None else out[name]
            result[name] = torch.index_select(runs, 0, positions, out=target)
        if where is not None and where.shape[0]:
            self._repair(result, where, self.slots(offsets_at(where), oldest_offset))
        return result

    def _copiers(self, size: int, stride: int) -> tuple[np.ndarray, tuple[str, ...]]:
        """Which fields' runs the kernel copies (positions), and which ``index_select`` does.

        A run of stride 1 is one block. ``index_select`` splits its copy across torch's
        threads, which pays for large blocks only: with two threads, a batch's 28 kB blocks
        (256 windows of 109 records of 64 float32) copied 1.35x faster than by the serial
        kernel, its 872 B and 109 B blocks 1.8x slower (each field timed after a floor
        gather). With one thread the kernel copies every field.
        """
        threads = torch.get_num_threads()
        split = self._splits.get((size, stride, threads))
        if split is None:
            serial = [
                stride == 1 and (threads == 1 or size * width < _PARALLEL_BLOCK)
                for width in self._row_bytes.tolist()
            ]
            split = (
                np.flatnonzero(serial),
                tuple(name for name, kernel in zip(self.fields, serial, strict=True) if not kernel),
            )
            if len(self._splits) >= 8:
                self._splits.clear()
            self._splits[(size, stride, threads)] = split
        return split

    def _run_views(self, size: int, stride: int) -> dict[str, torch.Tensor]:
        """Each field as overlapping runs, ``[capacity - span + 1, size, *field_shape]``.

        Run ``i`` holds the records at slots ``i + stride * k``. Kept for the last few
        window shapes: building the views costs more than a small field's copy.
        """
        views = self._views.get((size, stride))
        if views is None:
            span = 1 + stride * (size - 1)
            views = {
                name: store.as_strided(
                    (self.capacity - span + 1, size, *store.shape[1:]),
                    (store.stride(0), stride * store.stride(0), *store.stride()[1:]),
                )
                for name, store in self.fields.items()
            }
            if len(self._views) >= 8:
                self._views.clear()
            self._views[(size, stride)] = views
        return views

    def _scratch_runs(self, size: int) -> np.ndarray:
        """Scratch for the compiled gather of windows of ``size`` records, kept between calls."""
        runs = self._runs_scratch
        if runs.shape[1] < size:
            runs = self._runs_scratch = np.empty((4, size), dtype=np.int64)
        return runs

    def _repair(self, result: Mapping[str, torch.Tensor], where: Array, slots: Array) -> None:
        """Overwrite the records at flat positions ``where`` with the ring's ``slots``."""
        some = result[next(iter(result))]
        cpu = isinstance(where, np.ndarray) and some.device.type == "cpu"
        if cpu and self._host_fields is not None:
            # numpy's row take and put: about 40% cheaper than index_select + index_copy_
            records = math.prod(some.shape[:2])
            for name, store in self._host_fields.items():
                rows = result[name].numpy().reshape(records, *store.shape[1:])
                rows[where] = np.take(store, slots, axis=0)
            return
        positions, slot_tensor = engine.tensor(where), engine.tensor(slots)
        records = math.prod(some.shape[:2])
        for name, ring_field in self.fields.items():
            flat = result[name].view(records, *ring_field.shape[1:])
            flat.index_copy_(0, positions, self._repair_buffer(name, slot_tensor))

    def _repair_buffer(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """The records at ``slots`` of field ``name``, in a buffer kept for repairs.

        Reused from call to call: a temporary of a new size every batch would fragment the
        heap of a stock allocator, which then trims and faults pages back in on later calls.
        """
        store, count = self.fields[name], int(slots.shape[0])
        scratch = self._scratch.get(name)
        if scratch is None or scratch.shape[0] < count:
            scratch = torch.empty(
                (max(count, 1024), *store.shape[1:]), dtype=store.dtype, device=store.device
            )
            self._scratch[name] = scratch
        return torch.index_select(store, 0, slots, out=scratch[:count])


_PARALLEL_BLOCK = 4096  # bytes of a field's run from which index_select copies it
_NO_STARTS = np.empty(0, dtype=np.int64)  # a ring off the CPU: no field addresses
_NO_RECORDS = np.empty((0, 0), dtype=np.int64)  # records=None: every record at its run's offset
_ALL_EXACT = np.empty((0, 0), dtype=np.bool_)  # exact=None: no record is clamped


_copies: ModuleType | None = None  # lucid_replay.ring_copies once imported (it needs numba)


def _ring_copies() -> ModuleType:
    """`lucid_replay.ring_copies`, imported on first use: only the compiled path needs it."""
    global _copies
    if _copies is None:
        from lucid_replay import ring_copies

        _copies = ring_copies
    return _copies


def _offsets(
    table: EpisodeTable,
    first_offsets: Array,
    size: int,
    stride: int,
    records: tuple[Array, Array] | None,
    positions: Array | None,
) -> Array:
    """Offsets of `gather_runs`'s records at flat ``positions`` (all, ``[B, size]``, for None)."""
    if records is None:
        every = first_offsets[:, None] + engine.arange(size, first_offsets) * stride
        return every if positions is None else every.reshape(-1)[positions]
    rows, steps = records
    if positions is None:
        return table.offsets(rows, steps)
    # The row of a flat position: its window's ([B, 1] rows) or its record's ([B, size]).
    at = rows[positions // size, 0] if rows.shape[1] == 1 else rows.reshape(-1)[positions]
    return table.offsets(at, steps.reshape(-1)[positions])
