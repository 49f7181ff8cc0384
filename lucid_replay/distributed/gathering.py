"""The client's side of ``transport="shared"``: it gathers a located draw's records itself.

Each shard's fields are mapped read-only (`Mapped`: a `TransitionRing` whose allocator hands
out the mappings), and the listed runs of its located reply (`lucid_replay.distributed.sharing`)
are copied by the ring's own gather (`TransitionRing.gather_runs`, its listed-runs path)
straight into the batch rows the coordinator gave that shard's draws: each byte of the batch
is copied once. Without the compiled kernels the runs are read record by record
(`TransitionRing.gather`) and put in place, a second copy.

After the copy every shard's published head and epoch are read again: a window whose lowest
offset fell below the head, or drawn before the epoch moved, may hold records of other
episodes (torn). By the replay's ``torn=`` it is drawn again (``"redraw"``: the torn positions
are drawn anew by the same law, as a draw of that many windows, and the weights are
normalised over the batch as it ends up; after `REDRAWS` rounds the rest are invalidated) or
returned with every record invalid (``"invalid"``: ``validity_mask`` and ``learning_mask``
False). Either way the torn windows are counted (`TransportStats`).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any, cast

import attrs
import numpy as np
import torch

import lucid_replay.distributed.calls as calls
import lucid_replay.distributed.draw as draw
import lucid_replay.distributed.sharing as sharing
import lucid_replay.distributed.transport as transport
from lucid_replay import engine
from lucid_replay.batch import PER_RECORD, WindowBatch
from lucid_replay.batch_memory import Shapes, views
from lucid_replay.distributed.client_state import Client
from lucid_replay.distributed.mapped import Mapped, dtype_named, key_of
from lucid_replay.ring import TransitionRing
from lucid_replay.window import layout
from lucid_replay.writer_pages import torch_dtype

__all__: list[str] = []  # internal module

REDRAWS = 8  # rounds of redraws of torn windows before the rest are marked invalid
_CPU = torch.device("cpu")
_NO_FIRSTS = np.empty(0, dtype=np.int64)


def on_located(replay: Client) -> None:
    """Called between the arrival of a draw's locations and the copy (a seam for tests)."""


def batch_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of a batch's tensors."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def complete(
    replay: Client, pending: draw.Pending, target: torch.device, begin: Callable[..., Any]
) -> WindowBatch:
    """The batch of a located draw whose replies are in, gathered here.

    ``begin`` starts a redraw (`lucid_replay.distributed.coordination.begin`).
    """
    started = drawn = time.perf_counter()
    _expand(pending)
    spec = pending.spec
    size, width = spec.batch_size, spec.window.size
    tensors = _allocate(replay, pending.pieces[0], size, width, target.type == "cuda")
    on_located(replay)
    copied = [0]
    torn = _fill(replay, pending, tensors, np.arange(size), copied)
    count = torn.size
    rounds = 0
    while torn.size and replay._config["torn"] == "redraw" and rounds < REDRAWS:
        again = begin(replay, attrs.evolve(spec, batch_size=int(torn.size)), None)
        with replay._lock:
            draw.finish(replay._draw_handles(), replay._state.rng, again, calls.get)
        _expand(again)
        replay._transport_stats.windows_redrawn += int(torn.size)
        pending.destinations += [torn[rows] for rows in again.destinations]
        pending.priorities += again.priorities
        pending.probabilities += again.probabilities
        torn = _fill(replay, again, tensors, torn, copied)
        count += torn.size
        rounds += 1
    per_record = layout(spec.window, _CPU)
    tensors["learning_mask"].copy_(per_record.learning_mask.expand(size, width))
    tensors["step_in_sequence"].copy_(per_record.record.expand(size, width))
    if torn.size:  # never another episode's data as valid
        replay._transport_stats.windows_invalidated += int(torn.size)
        rows = torch.from_numpy(torn)
        tensors["validity_mask"][rows] = False
        tensors["learning_mask"][rows] = False
    chances = draw.merged(pending, pending.probabilities, np.float64)
    weights = draw.weights(pending, chances)
    unit = replay._config["priority_unit"]
    total = batch_bytes(tensors) + chances.nbytes + (0 if weights is None else weights.nbytes)
    copied[0] += size * width * 9  # the learning mask and record index (bool, int64)
    batch = transport.build(
        tensors, weights, target, chunks=False, priority_unit=unit, probabilities=chances
    )
    seconds = pending.seconds + drawn - started
    gathered = time.perf_counter() - drawn
    replay._transport_stats.note(copied[0], total, seconds, gathered, count)
    assert isinstance(batch, WindowBatch)
    return batch


def _expand(pending: draw.Pending) -> None:
    """Each piece's per-record ids and steps, sent as exceptions (`sharing.compact`)."""
    for piece in cast(list[Any], pending.pieces):
        sharing.uncompact(piece["meta"], pending.spec.window)


def _allocate(
    replay: Client, piece: dict[str, Any], size: int, width: int, pin: bool
) -> dict[str, torch.Tensor]:
    """Empty batch tensors: the fields (``data.<name>``), then the per-record entries.

    Views of one of the client's reused blocks (`batch_memory.views`).
    """
    fields = piece["descriptor"]["fields"]
    frames = {name: group["frames"] for group in piece["groups"] for name in group["names"]}
    shapes: Shapes = {}
    for name, (_, shape, dtype) in fields.items():
        stack = (frames[name],) if frames[name] else ()
        shapes[f"data.{name}"] = ((size, width, *stack, *shape), dtype_named(dtype))
    for key, values in piece["meta"].items():
        dtype = torch_dtype(values.dtype)
        assert dtype is not None  # the shard made every entry from a tensor
        shapes[key] = ((size, *values.shape[1:]), dtype)
    for key in ("learning_mask", "step_in_sequence"):
        shapes[key] = ((size, width), PER_RECORD[key])
    return views(replay._blocks, shapes, pin)


def _fill(
    replay: Client,
    pending: draw.Pending,
    tensors: dict[str, torch.Tensor],
    positions: np.ndarray,
    copied: list[int],
) -> np.ndarray:
    """Copy every piece of ``pending`` into batch rows ``positions[destinations]``.

    Returns the batch rows of the torn windows (checked after every piece was copied).
    """
    width = pending.spec.window.size
    checks = []
    pieces = cast(list[Any], pending.pieces)
    for piece, rows in zip(pieces, pending.destinations, strict=True):
        mapped = _mapping(replay, piece)
        rows = positions[rows]
        for key, values in piece["meta"].items():
            tensors[key].numpy()[rows] = values
            copied[0] += values.nbytes
        for group in piece["groups"]:
            copied[0] += _copy_group(mapped.ring, piece["oldest"], group, rows, width, tensors)
        checks.append((mapped, piece, rows))
    torn = []
    for mapped, piece, rows in checks:
        head, epoch = mapped.published()
        stale = (piece["low"] < head) | (epoch != piece["epoch"])
        torn.append(rows[stale])
    return np.concatenate(torn) if torn else np.empty(0, dtype=np.int64)


def _mapping(replay: Client, piece: dict[str, Any]) -> Mapped:
    """The client's mapping of the piece's shard, (re)mapped when its files changed."""
    descriptor = piece["descriptor"]
    mapped: Mapped | None = replay._mapped.get(piece["shard"])
    if mapped is None or mapped.key != key_of(descriptor):
        mapped = replay._mapped[piece["shard"]] = Mapped(descriptor)
    return mapped


def _copy_group(
    ring: TransitionRing,
    oldest: int,
    group: dict[str, Any],
    rows: np.ndarray,
    width: int,
    tensors: dict[str, torch.Tensor],
) -> int:
    """Copy a group's listed runs into the batch; returns the bytes copied."""
    names, size, frames = tuple(group["names"]), group["size"], group["frames"]
    runs, windows = group["runs"], group["windows"]
    if frames:  # a run is a record's stack: window b's record w is batch record b * W + w
        windows = rows[windows // width] * width + windows % width
        targets = {}
        for name in names:
            out = tensors[f"data.{name}"]
            targets[name] = out.view(-1, frames, *out.shape[3:])
    else:
        windows = rows[windows]
        targets = {name: tensors[f"data.{name}"] for name in names}
    part = ring.part(names)
    count = int(windows.shape[0])
    if engine.compiled(runs) and count:
        table = cast(Any, types.SimpleNamespace(oldest_offset=oldest))
        listed = (runs, np.ascontiguousarray(windows), count)
        # On one thread: the shards on this node need the other cores, and torch's threads
        # keep spinning on one after a parallel copy (a one-shard client's second thread
        # took 4.4 ms of CPU a batch of 256 x 109 windows, and its shard drew the slower).
        part.gather_runs(table, _NO_FIRSTS, size, 1, None, None, targets, listed, one_thread=True)
    elif count:
        _copy_records(part, runs, windows, size, targets)
    if group["zero"] is not None:
        zero = group["zero"]
        record = zero // frames
        flat = (rows[record // width] * width + record % width) * frames + zero % frames
        for name in names:
            tensors[f"data.{name}"].view(-1, *ring.fields[name].shape[1:])[flat] = 0
    records = int((runs[2] - runs[1]).sum())
    row = sum(ring.fields[n].stride(0) * ring.fields[n].element_size() for n in names)
    return records * row


def _copy_records(
    ring: TransitionRing,
    runs: np.ndarray,
    windows: np.ndarray,
    size: int,
    targets: dict[str, torch.Tensor],
) -> None:
    """Listed runs record by record: the ring's gather, then each record to its place."""
    lengths = runs[2] - runs[1]
    run_of = np.repeat(np.arange(lengths.shape[0]), lengths)
    within = np.arange(run_of.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    offsets = runs[0][run_of] + within * runs[3][run_of]
    places = windows[run_of] * size + runs[1][run_of] + within
    values = ring.gather(torch.from_numpy(offsets % ring.capacity))
    where = torch.from_numpy(places)
    for name, out in targets.items():
        flat = out.view(-1, *ring.fields[name].shape[1:])
        flat.index_copy_(0, where, values[name])
