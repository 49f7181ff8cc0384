"""Batching: what a draw and its expansion describe, gathered into a batch on the learner's device.

A `Batcher` owns every batch a buffer returns, in the order of the data path::

    batch = batcher.reserve(...)  # memory first: a new batch, or the caller's out=
    anchors = draw(...)  # sampling
    records = expand(table, anchors, window, into=batcher.record_arrays(batch))  # window
    batcher.fill_windows(batch, ring, table, anchors, records, window)  # the gather

It allocates (`new_batch`: one block per batch, all tensors owned by the batch, reused once
nothing refers to it; `lucid_replay.batch_memory`), refuses an ``out=`` that cannot receive
a draw (`check_out`), and stages gathers to an accelerator: with CPU storage and a CUDA
target, records are gathered into pinned host buffers kept between calls and copied
``non_blocking``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar, cast

import torch

from lucid_replay import engine, stacks
from lucid_replay.batch import PER_RECORD, Batch, PrioritizedBatch, WindowBatch
from lucid_replay.batch_memory import Blocks, Built
from lucid_replay.engine import Array
from lucid_replay.errors import must, must_have, wrong_kind
from lucid_replay.records import Anchors, RecordArrays, Records
from lucid_replay.ring import TransitionRing
from lucid_replay.schema import Schema
from lucid_replay.table import EpisodeTable
from lucid_replay.window import Window, expand, layout

__all__: list[str] = []  # internal module

_B = TypeVar("_B")
_Kind = type[Batch] | type[WindowBatch]


class Batcher:
    """The batches of one buffer: their memory, ``out=`` checks and accelerator staging."""

    def __init__(self) -> None:
        self.blocks = Blocks()  # the memory of returned batches, reused once unreferenced
        # Pinned host buffers for gathers to an accelerator, by batch shape, and the event
        # after which their last copy out has finished.
        self._pinned: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._copied: dict[tuple[int, int], torch.cuda.Event] = {}

    # --------------------------------------------------------------------- allocation
    def reserve(
        self,
        kind: type[_B],
        shape: tuple[int, int],
        schema: Schema | None,
        device: torch.device,
        *,
        weights: bool,
        out: _B | None = None,
        segments: str | None = None,
        drawn: bool = True,
    ) -> _B | None:
        """The batch a draw of ``shape`` records onto ``device`` fills: ``out``, or a new one.

        Taken before anything else of the draw (see `new_batch`). ``None`` while there is no
        schema (nothing was ever stored: the draw refuses the empty buffer). ``segments``:
        the priority unit of a segmented buffer (its batches carry ``segment_ids``).
        ``drawn``: the anchors are drawn (the batch carries their ``probabilities``).
        """
        if out is not None or schema is None:
            return out
        return new_batch(
            kind,
            shape,
            schema,
            device,
            weights=weights,
            blocks=self.blocks,
            segments=segments,
            drawn=drawn,
        )

    def record_arrays(self, batch: WindowBatch, storage: torch.device) -> RecordArrays | None:
        """``batch``'s per-record tensors for `window.expand` to write into, if on ``storage``.

        The views kept with the batch if this batcher built it, else new ones.
        """
        if batch.validity_mask.device != storage:
            return None
        built = self.blocks.built_with(batch)
        if built is not None and isinstance(built[1], RecordArrays):
            return built[1]
        return _record_views(batch)

    # ------------------------------------------------------------------------ filling
    def fill_chunks(
        self,
        batch: Batch,
        ring: TransitionRing,
        table: EpisodeTable,
        anchors: Anchors,
        length: int,
    ) -> Batch:
        """``batch`` filled with the chunks of ``length`` steps starting at ``anchors``."""
        if table.segmented:  # a chunk may cross seams: the records of a window of it
            records = expand(table, anchors, Window(length))
            shape = (int(records.valid.shape[0]), length)
            parts = (records.rows, records.steps)
            first, exact = records.first_offsets, records.exact
            self._gather(ring, table, shape, batch.data, first, 1, parts, exact, records.runs)
        else:
            first = table.offsets(anchors.rows, anchors.steps)
            shape = (int(first.shape[0]), length)
            stepped = None
            if ring.stacks or ring.compressed:  # they gather each record's step
                stepped = stacks.chunk_records(anchors.rows, anchors.steps, length)
            self._gather(ring, table, shape, batch.data, first, 1, None, None, None, stepped)
        _copy_segment_ids(batch, table, anchors)
        _copy_probabilities(batch, anchors)
        _copy(batch.episode_ids, anchors.episode_ids)
        _copy(batch.starts, anchors.steps)
        if isinstance(batch, PrioritizedBatch) and anchors.weights is not None:
            _copy(batch.weights, anchors.weights)
        return batch

    def fill_windows(
        self,
        batch: WindowBatch,
        ring: TransitionRing,
        table: EpisodeTable,
        anchors: Anchors,
        records: Records,
        window: Window,
    ) -> WindowBatch:
        """``batch`` filled with the ``records`` expanded from ``anchors``.

        Per-record entries that `expand` already wrote into the batch are left as they are.
        """
        shape = (int(records.valid.shape[0]), int(records.valid.shape[1]))
        parts = (records.rows, records.steps)
        exact = records.exact  # the records at their run offset
        if exact is None:
            exact = records.valid if records.clamped else None
        self._gather(
            ring,
            table,
            shape,
            batch.data,
            records.first_offsets,
            window.dilation,
            parts,
            exact,
            records.runs,
        )
        if not records.filled:  # else `expand` wrote them all into the batch
            _copy(batch.validity_mask, records.valid)
            _copy(batch.is_init, records.is_init)
            _copy(batch.terminal, records.terminal)
            _copy(batch.record_episode_ids, records.episode_ids)
            _copy(batch.record_steps, records.steps)
            per_record = layout(window, batch.episode_ids.device)
            batch.learning_mask.copy_(per_record.learning_mask.expand(shape))  # rewritten:
            batch.step_in_sequence.copy_(per_record.record.expand(shape))  # callers edit them
        _copy_segment_ids(batch, table, anchors)
        _copy_probabilities(batch, anchors)
        _copy(batch.episode_ids, anchors.episode_ids)
        _copy(batch.anchor_steps, anchors.steps)
        if batch.weights is not None and anchors.weights is not None:
            _copy(batch.weights, anchors.weights)
        return batch

    def _gather(
        self,
        ring: TransitionRing,
        table: EpisodeTable,
        shape: tuple[int, int],
        out: Mapping[str, torch.Tensor],
        first_offsets: Array,
        stride: int,
        records: tuple[Array, Array] | None,
        exact: Array | None,
        runs: tuple[Array, Array, int] | None = None,
        stepped: tuple[Array, Array] | None = None,
    ) -> None:
        """The ring's records (see `TransitionRing.gather_runs`) into ``out``, on its device.

        With CPU storage and a CUDA target the records are gathered into pinned host memory,
        kept between calls of the same shape, and copied with ``non_blocking=True``, so the
        copy overlaps whatever the learner's stream is doing. Stacked fields are gathered as
        stacks (`lucid_replay.stacks`) from each record's row and step: ``stepped``, or
        ``records``.
        """
        device = next(iter(out.values())).device
        steps = records if stepped is None else stepped

        def gather(into: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
            return stacks.gather(
                ring, table, shape, stride, first_offsets, records, exact, into, runs, steps
            )

        if ring.device == device:
            gather(out)
        elif ring.device.type == "cpu" and device.type == "cuda":
            for name, values in gather(self._staging(out, shape)).items():
                out[name].copy_(values, non_blocking=True)
            self._note_copies(device)
        else:
            for name, values in gather(None).items():
                out[name].copy_(values)

    def _staging(
        self, out: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> dict[str, torch.Tensor]:
        """Pinned host tensors shaped as the batch tensors ``out`` to gather into before a copy.

        Kept for the next call of this shape, which waits until the copy out of them has
        finished.
        """
        buffers = self._pinned.get(shape)
        if buffers is None:
            buffers = {
                name: torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=True)
                for name, t in out.items()
            }
            self._pinned = {shape: buffers}  # one batch shape at a time is what loops use
        event = self._copied.pop(shape, None)
        if event is not None:
            event.synchronize()  # the previous batch's non_blocking copy read these buffers
        return buffers

    def _note_copies(self, device: torch.device) -> None:
        """Note that copies out of the pinned buffers were just queued on ``device``."""
        for shape in self._pinned:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
            event.record(torch.cuda.current_stream(device))
            self._copied[shape] = event

    # ------------------------------------------------------------------- out= batches
    @staticmethod
    def check_out(
        out: object,
        kind: _Kind,
        shape: tuple[int, int],
        schema: Schema | None,
        device: torch.device,
        *,
        weights: bool,
        segments: bool = False,
    ) -> None:
        """Refuse an ``out`` batch that cannot receive a draw of ``shape`` records on ``device``.

        It must be a ``kind`` (a `PrioritizedBatch` for a prioritized chunk draw; a
        `WindowBatch` with weights for a prioritized window draw) whose tensors have the
        draw's shapes, dtypes and device and are contiguous: in practice, a batch an earlier
        call of the same shape returned.
        """
        if not isinstance(out, kind) or (kind is Batch and isinstance(out, PrioritizedBatch)):
            want = kind.__name__ if kind is not Batch else "Batch (not a PrioritizedBatch)"
            raise wrong_kind("out", f"a {want} to overwrite", type(out).__name__)
        assert isinstance(out, Batch | WindowBatch)
        if schema is None or set(out.data) != set(schema):
            raise must("out", f"a batch of the fields {sorted(schema or {})}", sorted(out.data))
        has_weights = getattr(out, "weights", None) is not None
        if has_weights != weights:
            rule = "a batch with importance weights" if weights else "a batch without weights"
            raise must_have("out", f"{rule}, as this draw", "the other kind")
        specs = _specs(kind, shape, schema, weights, segments, drawn=True)
        for name, (want_shape, dtype) in specs.items():
            field = name.removeprefix("data.") if name.startswith("data.") else None
            tensor = out.data[field] if field is not None else getattr(out, name)
            if tensor is None:
                raise must_have("out", f"a batch with {name}, as this draw", f"{name}=None")
            got = (tuple(tensor.shape), tensor.dtype, tensor.device)
            if got != (want_shape, dtype, device) or not tensor.is_contiguous():
                raise must_have(
                    f"out[{field!r}]" if field is not None else f"out.{name}",
                    f"a contiguous {dtype} tensor of shape {want_shape} on {device}",
                    f"{got[1]} {got[0]} on {got[2]}",
                )


def _copy(into: torch.Tensor, values: Array) -> None:
    """Copy the `engine` array ``values`` into the batch tensor ``into`` (any device)."""
    into.copy_(engine.tensor(values), non_blocking=True)


def _copy_probabilities(batch: Batch | WindowBatch, anchors: Anchors) -> None:
    """The anchors' probabilities, on a batch that carries them (a drawn one)."""
    if batch.probabilities is not None and anchors.probabilities is not None:
        _copy(batch.probabilities, anchors.probabilities)


def _copy_segment_ids(batch: Batch | WindowBatch, table: EpisodeTable, anchors: Anchors) -> None:
    """The anchors' segment ids (their rows' keys), on a batch that carries them."""
    if batch.segment_ids is not None:
        _copy(batch.segment_ids, table.arrays["episode_id"][anchors.rows])


def new_batch(
    kind: Callable[..., _B],
    shape: tuple[int, int],
    schema: Schema,
    device: torch.device,
    *,
    weights: bool,
    blocks: Blocks | None = None,
    segments: str | None = None,
    drawn: bool = True,
) -> _B:
    """An empty ``kind`` batch of ``shape`` records, all its tensors in one block.

    One block per batch, taken before anything else of the draw: from ``blocks`` if given
    (a block no earlier batch refers to any more, with the batch last built on it if it has
    this layout), else newly allocated. A stock allocator then hands the next batch the
    block the previous one freed, as it does for a plain gather, instead of growing and
    trimming its heap around a dozen outputs and the temporaries between them (which faults
    hundreds of pages back in per call).
    """
    layout = _block_layout(kind, shape, schema, weights, segments is not None, drawn)
    total, groups = layout

    def build(block: torch.Tensor) -> Built:
        tensors: dict[str, torch.Tensor | None] = {}
        for dtype, views in groups:
            typed = block.view(dtype)  # the block as this dtype: its tensors' offsets align
            for name, dims, strides, offset in views:
                tensors[name] = torch.as_strided(typed, dims, strides, offset)
        fields = {name: tensors.pop(f"data.{name}") for name in schema}
        data = MappingProxyType(fields)
        if kind is WindowBatch and not weights:
            tensors["weights"] = None  # a uniform draw has none
        named: dict[str, Any] = dict(tensors)
        if kind is PrioritizedBatch and segments is not None:
            named["priority_unit"] = segments
        batch = kind(data=data, **named)
        records = _record_views(batch) if isinstance(batch, WindowBatch) else None
        owned = [t for t in (*tensors.values(), *fields.values()) if t is not None]
        # The dict too: a view of the mapping (data.values()) holds it, not the mapping.
        return (batch, records), (batch, data, fields, *owned)

    if blocks is None:
        built = build(torch.empty(total, dtype=torch.uint8, device=device))[0]
    else:
        built = blocks.take(total, device, layout, build)  # the cached layout: its own key
    return cast(_B, built[0])


_View = tuple[str, tuple[int, ...], tuple[int, ...], int]


@functools.lru_cache(maxsize=32)
def _block_layout(
    kind: Callable[..., object],
    shape: tuple[int, int],
    schema: Schema,
    weights: bool,
    segments: bool = False,
    drawn: bool = True,
) -> tuple[int, tuple[tuple[torch.dtype, tuple[_View, ...]], ...]]:
    """Bytes of a batch's block, and by dtype its tensors' names, shapes, strides, offsets.

    The bytes are a multiple of 64, at least 64. Offsets count elements of the tensor's
    dtype; tensors start 64-byte aligned, so every dtype's view of the block reaches every
    tensor.
    """
    specs = _specs(kind, shape, schema, weights, segments, drawn=drawn)
    groups: dict[torch.dtype, list[_View]] = {}
    total = 0
    for name, (dims, dtype) in specs.items():
        strides = tuple(math.prod(dims[i + 1 :]) for i in range(len(dims)))
        groups.setdefault(dtype, []).append((name, dims, strides, total // dtype.itemsize))
        total += -(-math.prod(dims) * dtype.itemsize // 64) * 64
    return max(total, 64), tuple((dtype, tuple(views)) for dtype, views in groups.items())


def _specs(
    kind: Callable[..., object],
    shape: tuple[int, int],
    schema: Schema,
    weights: bool,
    segments: bool = False,
    *,
    drawn: bool = True,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor of a ``kind`` batch of ``shape`` records.

    Fields are named ``data.<field>``; the others by their attribute. ``drawn``: the batch
    carries its anchors' ``probabilities``.
    """
    batch_size = shape[0]
    specs = {  # a stacked field's records hold [frames, *field_shape]
        f"data.{name}": ((*shape, *field_shape), dtype)
        for name, (field_shape, dtype) in schema.gathered.items()
    }
    if kind is WindowBatch:
        specs.update({name: (shape, dtype) for name, dtype in PER_RECORD.items()})
        specs["episode_ids"] = specs["anchor_steps"] = ((batch_size,), torch.int64)
    else:
        specs["episode_ids"] = specs["starts"] = ((batch_size,), torch.int64)
    if weights:
        specs["weights"] = ((batch_size,), torch.float32)
    if segments:
        specs["segment_ids"] = ((batch_size,), torch.int64)
    if drawn:
        specs["probabilities"] = ((batch_size,), torch.float64)
    return specs


def _record_views(batch: WindowBatch) -> RecordArrays:
    """``batch``'s per-record tensors as `engine` arrays (numpy on CPU)."""
    return RecordArrays(
        steps=engine.view(batch.record_steps),
        valid=engine.view(batch.validity_mask),
        is_init=engine.view(batch.is_init),
        terminal=engine.view(batch.terminal),
        episode_ids=engine.view(batch.record_episode_ids),
        learning=engine.view(batch.learning_mask),
        sequence=engine.view(batch.step_in_sequence),
    )
