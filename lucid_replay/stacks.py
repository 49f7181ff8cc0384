"""Frame stacks rebuilt in the gather: each step stores one frame, a batch reads ``k``.

A field declared ``Field(shape, dtype, stack=k)`` stores one frame per step; in a gathered
batch each record holds frames ``t - k + 1 .. t`` of its episode (``[k, *shape]``). The
stack of a record is itself a run of ``k`` records: it starts ``k - 1`` offsets before the
record and reads ``k`` consecutive offsets, except frames before the episode's first stored
step (clamped to it: repeated, or zeroed after the gather for ``stack_pad="zeros"``) and, on
a segmented buffer, frames in an earlier segment of the episode (found by walking its chain,
`seams.rows_holding`). So the ``B x W`` records of a batch are gathered as ``B * W`` runs of
``k`` by the ring's own record gather (`TransitionRing.gather_runs`, compiled or not), with
the clamped and cross-seam frames as its inexact records: no second gather.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from lucid_replay import engine
from lucid_replay.engine import Array
from lucid_replay.ring import TransitionRing
from lucid_replay.seams import rows_holding
from lucid_replay.table import EpisodeTable

__all__: list[str] = []  # internal module

_Plan = tuple[Array, tuple[Array, Array], Array | None, torch.Tensor | None]


def gather(
    ring: TransitionRing,
    table: EpisodeTable,
    shape: tuple[int, int],
    stride: int,
    first_offsets: Array,
    records: tuple[Array, Array] | None,
    exact: Array | None,
    out: Mapping[str, torch.Tensor] | None,
    runs: tuple[Array, Array, int] | None,
    stepped: tuple[Array, Array] | None,
) -> dict[str, torch.Tensor]:
    """`TransitionRing.gather_runs` of ``shape = (B, W)`` records, stacked fields as stacks.

    The arguments are `gather_runs`'s; ``stepped`` gives each record's table row (``[B, 1]``
    or ``[B, W]``) and episode step (``[B, W]``), whatever its run says (needed only with
    stacked fields). ``out`` (or the new
    tensors) holds each stacked field as ``[B, W, k, *shape]``.
    """
    size = shape[1]
    stacks, compressed = ring.stacks, ring.compressed
    if not stacks and compressed is None:
        return ring.gather_runs(table, first_offsets, size, stride, records, exact, out, runs)
    specs = {name: (tuple(t.shape[1:]), t.dtype) for name, t in ring.fields.items()}
    specs.update({} if compressed is None else compressed.specs)
    if out is None:
        out = {
            name: torch.empty(
                (*shape, *((stacks[name][0],) if name in stacks else ()), *field_shape),
                dtype=dtype,
                device=ring.device,
            )
            for name, (field_shape, dtype) in specs.items()
        }
    assert stepped is not None  # the batcher gives every record's step with stacks
    plain = tuple(name for name in ring.fields if name not in stacks)
    if plain:
        part = ring.part(plain)
        into = {name: out[name] for name in plain}
        part.gather_runs(table, first_offsets, size, stride, records, exact, into, runs)
    count = shape[0] * shape[1]
    for (frames, pad), names in groups(stacks, ring.fields).items():
        firsts, frame_records, frame_exact, before = plan(table, stepped, frames)
        views = {
            name: out[name].view(count, frames, *ring.fields[name].shape[1:]) for name in names
        }
        part = ring.part(tuple(names))
        part.gather_runs(table, firsts, frames, 1, frame_records, frame_exact, views)
        if pad == "zeros" and before is not None:
            _zero(out, names, count * frames, before)
    if compressed is not None:
        _gather_compressed(ring, table, stepped, count, out)
    return dict(out)


def groups(
    stacks: Mapping[str, tuple[int, str]], names: Iterable[str]
) -> dict[tuple[int, str], list[str]]:
    """The stacked fields among ``names``, by their stack ``(frames, pad)``."""
    groups: dict[tuple[int, str], list[str]] = {}
    for name in names:
        if name in stacks:
            groups.setdefault(stacks[name], []).append(name)
    return groups


def _zero(
    out: Mapping[str, torch.Tensor], names: list[str], frames: int, before: torch.Tensor
) -> None:
    for name in names:
        out[name].view(frames, -1).index_fill_(0, before.to(out[name].device), 0)


def _gather_compressed(
    ring: TransitionRing,
    table: EpisodeTable,
    stepped: tuple[Array, Array],
    count: int,
    out: Mapping[str, torch.Tensor],
) -> None:
    """The compressed fields' frames of records ``stepped`` (each record's stack, or itself).

    Their slots come from the same plan as the stacks of raw fields; the blocks holding
    them are decoded (`lucid_replay.blocks`) and their frames copied into ``out``.
    """
    compressed = ring.compressed
    assert compressed is not None
    base = engine.tensor(table.arrays["base"])
    groups: dict[tuple[int, str], list[str]] = {}
    for name in compressed.specs:
        groups.setdefault(ring.stacks.get(name, (1, "same")), []).append(name)
    for (frames, pad), names in groups.items():
        _, (frame_rows, frame_steps), _, before = plan(table, stepped, frames)
        offsets = base[engine.tensor(frame_rows)] + engine.tensor(frame_steps)
        slots = ring.slots(offsets.reshape(-1), table.oldest_offset).cpu().numpy()
        for name in names:
            shape = compressed.specs[name][0]
            compressed.gather(name, slots, out[name].view(count * frames, *shape))
        if pad == "zeros" and before is not None:
            _zero(out, names, count * frames, before)


def plan(table: EpisodeTable, stepped: tuple[Array, Array], frames: int) -> _Plan:
    """The stacks of records ``stepped = (rows, steps)`` as ``n = B * W`` runs of ``frames``.

    Returns each run's first offset (``[n]``, the record's offset ``- (frames - 1)``), each
    frame's row and step (``[n, 1]`` or ``[n, frames]``; steps before the episode's first
    stored step clamped to it), which frames lie at their run's offset (``[n, frames]``,
    ``None``: all), and the flat positions of the frames before the first stored step
    (``None``: none). O(n * frames); a segmented table walks each frame's segment chain.
    """
    rows, steps = engine.tensor(stepped[0]), engine.tensor(stepped[1])
    shape = tuple(steps.shape)
    rows = rows.expand(shape)
    back = torch.arange(frames - 1, -1, -1, device=steps.device)
    targets = steps[..., None] - back  # [B, W, frames]
    base = engine.tensor(table.arrays["base"])
    if table.directory is None:  # whole episodes: step 0 is stored, frames share the row
        first = torch.zeros((), dtype=torch.int64, device=steps.device)
        clamped = targets.clamp_min(0)
        frame_rows = rows.reshape(-1, 1)
        record_rows = rows.reshape(-1)
    else:
        owners = table.owners()
        first = engine.tensor(owners.first_stored)[engine.tensor(owners.slot)[rows]][..., None]
        clamped = torch.maximum(targets, first)
        starts = rows[..., None].expand(targets.shape).reshape(-1).contiguous()
        found = rows_holding(table, engine.view(starts), engine.view(clamped.reshape(-1)))
        frame_rows = engine.tensor(found).view(-1, frames)
        record_rows = frame_rows[:, -1]  # a record's own step is stored: never clamped
    clamped = clamped.reshape(-1, frames)
    firsts = base[record_rows] + steps.reshape(-1) - (frames - 1)
    runs = firsts[:, None] + torch.arange(frames, device=steps.device)
    exact = base[frame_rows] + clamped == runs
    before = torch.flatten(targets < first)
    return (
        engine.view(firsts),
        (engine.view(frame_rows.contiguous()), engine.view(clamped.contiguous())),
        None if bool(exact.all()) else engine.view(exact),
        torch.nonzero(before).view(-1) if bool(before.any()) else None,
    )


def chunk_records(rows: Array, steps: Array, length: int) -> tuple[Array, Array]:
    """Rows ``[B, 1]`` and steps ``[B, length]`` of chunks from anchors ``rows``, ``steps``."""
    starts = engine.tensor(steps)
    every = starts[:, None] + torch.arange(length, device=starts.device)
    return engine.view(engine.tensor(rows)[:, None]), engine.view(every)
