"""Gathering: what a draw and its expansion describe, as batches on the learner's device.

`chunk_batch` and `window_batch` read the records out of the ring into a `Batch` or a
`WindowBatch`: a new one (`new_batch`: one allocation, all tensors owned by the batch), or
with ``out=`` one the caller owns, from an earlier call of the same shape, so that a
training loop's steady state allocates nothing. With CPU storage and a CUDA target, records
are gathered into pinned host buffers kept between calls and copied ``non_blocking``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TypeVar, cast

import torch

from lucid_replay import arrays
from lucid_replay.arrays import Array
from lucid_replay.batch import Batch, PrioritizedBatch, WindowBatch
from lucid_replay.blocks import Blocks, Built
from lucid_replay.errors import must, must_have, wrong_kind
from lucid_replay.sampling import Anchors
from lucid_replay.schema import Schema
from lucid_replay.storage import TransitionRing
from lucid_replay.table import EpisodeTable
from lucid_replay.window import RecordArrays, Records, Window, layout

__all__: list[str] = []  # internal module

_Reader = Callable[[Mapping[str, torch.Tensor] | None], dict[str, torch.Tensor]]
_B = TypeVar("_B")


def chunk_batch(
    ring: TransitionRing,
    table: EpisodeTable,
    anchors: Anchors,
    length: int,
    target: torch.device,
    out: Batch,
) -> Batch:
    """``B`` chunks of ``length`` steps starting at ``anchors``, written into ``out``.

    ``out`` (on ``target``) is a `PrioritizedBatch` for a prioritized draw; see `new_batch`.
    """
    first = table.arrays["start"][anchors.rows] + anchors.steps

    def read(into: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        return ring.gather_runs(first, length, 1, None, None, table.oldest_offset, into)

    gather(ring, (int(first.shape[0]), length), target, read, out.data)
    _copy(out.episode_ids, anchors.episode_ids)
    _copy(out.starts, anchors.steps)
    if isinstance(out, PrioritizedBatch) and anchors.weights is not None:
        _copy(out.indices, anchors.episode_ids)
        _copy(out.weights, anchors.weights)
    return out


def window_batch(
    ring: TransitionRing,
    table: EpisodeTable,
    anchors: Anchors,
    records: Records,
    window: Window,
    target: torch.device,
    out: WindowBatch,
) -> WindowBatch:
    """The records expanded from ``anchors``, written into the `WindowBatch` ``out``.

    ``out`` is on ``target``; ``records`` may already have been written into it (see
    `record_arrays`), which is then left as it is.
    """

    def read(into: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        return ring.gather_runs(
            records.first_offsets,
            window.size,
            window.dilation,
            records.parts(),
            records.valid if records.clamped else None,  # the records that were not clamped
            table.oldest_offset,
            into,
        )

    shape = tuple(records.valid.shape)
    gather(ring, (shape[0], shape[1]), target, read, out.data)
    if not records.filled:  # else `expand` wrote them all into out
        _copy(out.validity_mask, records.valid)
        _copy(out.is_init, records.is_init)
        _copy(out.terminal, records.terminal)
        _copy(out.record_episode_ids, records.episode_ids)
        _copy(out.record_steps, records.steps)
        per_record = layout(window, target)
        out.learning_mask.copy_(per_record.learning_mask.expand(shape))  # rewritten: the
        out.step_in_sequence.copy_(per_record.record.expand(shape))  # caller may edit them
    _copy(out.episode_ids, anchors.episode_ids)
    _copy(out.anchor_steps, anchors.steps)
    if out.weights is not None and anchors.weights is not None:
        _copy(out.weights, anchors.weights)
    return out


def _copy(into: torch.Tensor, values: Array) -> None:
    """Copy the `arrays` engine's ``values`` into the batch tensor ``into`` (any device)."""
    into.copy_(arrays.tensor(values), non_blocking=True)


def new_batch(
    kind: Callable[..., _B],
    shape: tuple[int, int],
    schema: Schema,
    device: torch.device,
    *,
    weights: bool,
    blocks: Blocks | None = None,
) -> _B:
    """An empty ``kind`` batch of ``shape`` records, all its tensors in one block.

    One block per batch, taken before anything else of the draw: from ``blocks`` if given
    (a block no earlier batch refers to any more, with the batch last built on it if it has
    this layout), else newly allocated. A stock allocator then hands the next batch the
    block the previous one freed, as it does for a plain gather, instead of growing and
    trimming its heap around a dozen outputs and the temporaries between them (which faults
    hundreds of pages back in per call).
    """
    layout = _block_layout(kind, shape, schema, weights)
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
        batch = kind(data=data, **tensors)
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
    kind: Callable[..., object], shape: tuple[int, int], schema: Schema, weights: bool
) -> tuple[int, tuple[tuple[torch.dtype, tuple[_View, ...]], ...]]:
    """Bytes of a batch's block, and by dtype its tensors' names, shapes, strides, offsets.

    The bytes are a multiple of 64, at least 64. Offsets count elements of the tensor's
    dtype; tensors start 64-byte aligned, so every dtype's view of the block reaches every
    tensor.
    """
    specs = _specs(kind, shape, schema, weights)
    groups: dict[torch.dtype, list[_View]] = {}
    total = 0
    for name, (dims, dtype) in specs.items():
        strides = tuple(math.prod(dims[i + 1 :]) for i in range(len(dims)))
        groups.setdefault(dtype, []).append((name, dims, strides, total // dtype.itemsize))
        total += -(-math.prod(dims) * dtype.itemsize // 64) * 64
    return max(total, 64), tuple((dtype, tuple(views)) for dtype, views in groups.items())


def _specs(
    kind: Callable[..., object], shape: tuple[int, int], schema: Schema, weights: bool
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor of a ``kind`` batch of ``shape`` records.

    Fields are named ``data.<field>``; the others by their attribute.
    """
    batch_size = shape[0]
    specs = {
        f"data.{name}": ((*shape, *field_shape), dtype)
        for name, (field_shape, dtype) in schema.items()
    }
    if kind is WindowBatch:
        for name in ("learning_mask", "validity_mask", "is_init", "terminal"):
            specs[name] = (shape, torch.bool)
        for name in ("record_episode_ids", "record_steps", "step_in_sequence"):
            specs[name] = (shape, torch.int64)
        specs["episode_ids"] = specs["anchor_steps"] = ((batch_size,), torch.int64)
    else:
        specs["episode_ids"] = specs["starts"] = ((batch_size,), torch.int64)
        if kind is PrioritizedBatch:
            specs["indices"] = ((batch_size,), torch.int64)
    if weights:
        specs["weights"] = ((batch_size,), torch.float32)
    return specs


def record_arrays(
    out: WindowBatch | None, storage: torch.device, blocks: Blocks | None = None
) -> RecordArrays | None:
    """``out``'s per-record tensors for `window.expand` to write into, if on ``storage``.

    The ones kept with ``out`` if ``blocks`` built it, else new views.
    """
    if out is None or out.validity_mask.device != storage:
        return None
    built = None if blocks is None else blocks.built_with(out)
    if built is not None and isinstance(built[1], RecordArrays):
        return built[1]
    return _record_views(out)


def _record_views(batch: WindowBatch) -> RecordArrays:
    """``batch``'s per-record tensors as the `arrays` engine holds them (numpy on CPU)."""
    return RecordArrays(
        steps=arrays.engine(batch.record_steps),
        valid=arrays.engine(batch.validity_mask),
        is_init=arrays.engine(batch.is_init),
        terminal=arrays.engine(batch.terminal),
        episode_ids=arrays.engine(batch.record_episode_ids),
        learning=arrays.engine(batch.learning_mask),
        sequence=arrays.engine(batch.step_in_sequence),
    )


def gather(
    ring: TransitionRing,
    shape: tuple[int, int],
    device: torch.device,
    read: _Reader,
    out: Mapping[str, torch.Tensor],
) -> None:
    """Run ``read`` (it fills ``[B, W, *field_shape]`` tensors) so its records land in ``out``.

    ``out`` is on ``device``. With CPU storage and a CUDA target the records are gathered
    into pinned host memory, kept between calls of the same shape, and copied with
    ``non_blocking=True``, so the copy overlaps whatever the learner's stream is doing.
    """
    if ring.device == device:
        read(out)
    elif ring.device.type == "cpu" and device.type == "cuda":
        for name, values in read(ring.pinned(shape, device)).items():
            out[name].copy_(values, non_blocking=True)
        ring.record_copies(device)
    else:
        for name, values in read(None).items():
            out[name].copy_(values)


def check_out(
    out: object,
    kind: type,
    shape: tuple[int, int],
    schema: Schema | None,
    device: torch.device,
    *,
    weights: bool,
) -> None:
    """Refuse an ``out`` batch that cannot receive a draw of ``shape`` records on ``device``.

    It must be a ``kind`` (a `PrioritizedBatch` for a prioritized chunk draw; a `WindowBatch`
    with weights for a prioritized window draw) whose tensors have the draw's shapes, dtypes
    and device and are contiguous: in practice, a batch an earlier call of the same shape
    returned.
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
    for name, (want_shape, dtype) in _specs(kind, shape, schema, weights).items():
        field = name.removeprefix("data.") if name.startswith("data.") else None
        tensor = out.data[field] if field is not None else getattr(out, name)
        got = (tuple(tensor.shape), tensor.dtype, tensor.device)
        if got != (want_shape, dtype, device) or not tensor.is_contiguous():
            raise must_have(
                f"out[{field!r}]" if field is not None else f"out.{name}",
                f"a contiguous {dtype} tensor of shape {want_shape} on {device}",
                f"{got[1]} {got[0]} on {got[2]}",
            )
