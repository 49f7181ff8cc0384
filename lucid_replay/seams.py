"""Windows across segment seams: an episode's stored segments read as one sequence.

On a segmented buffer an episode's steps lie in several segments, each a contiguous run of
the ring, in commit order among other episodes' segments. A window is expanded exactly as
on the same steps stored contiguously (`lucid_replay.window` states the rules): its records
clamp to the episode's first stored step and to its last committed step, ``stop`` shifts
the window back at most to the first stored step, and a record at the last step of a
terminated episode is terminal. Each record then finds the segment holding its step by
walking the episode's chain of segments from the anchor's (a window of ``S`` steps crosses
at most ``S / segment_length + 1`` seams). Records in the anchor's own segment are read as
one run; the others are read one by one (`Records.exact`).
"""

from __future__ import annotations

import torch

from lucid_replay import engine
from lucid_replay.records import Anchors, Records
from lucid_replay.table import EpisodeTable

__all__: list[str] = []  # internal module


def expand_segments(
    table: EpisodeTable,
    anchors: Anchors,
    size: int,
    burn_in: int,
    dilation: int,
    stop_span: int | None,
) -> Records:
    """The records of ``anchors`` (segment rows, episode ids, episode steps) on a segmented table.

    Windows of ``size`` records, record ``k`` targeting ``anchor + (k - burn_in) * dilation``;
    ``stop_span``: under ``boundary="stop"`` the steps from the anchor to the window's last
    record (``dilation * (length + bootstrap - 1)``), else ``None``.
    """
    owners, column = table.owners(), table.arrays
    rows = engine.tensor(anchors.rows)
    anchor = engine.tensor(anchors.steps)
    slot_of = engine.tensor(owners.slot)
    slots = slot_of[rows]
    first = engine.tensor(owners.first_stored)[slots]
    last = engine.tensor(owners.total)[slots] - 1
    ended = engine.tensor(owners.terminated)[slots] & ~engine.tensor(owners.opened)[slots]
    if stop_span is not None:
        overrun = (stop_span - (last - anchor)).clamp_min(0)
        anchor = anchor - torch.minimum(overrun, anchor - first)
    offset = (torch.arange(size, device=anchor.device) - burn_in) * dilation
    targets = anchor[:, None] + offset
    valid = (targets >= first[:, None]) & (targets <= last[:, None])
    steps = torch.minimum(torch.maximum(targets, first[:, None]), last[:, None])
    is_init = valid & (valid.cumsum(dim=1) == 1)  # one episode: its first valid record
    terminal = ended[:, None] & (steps == last[:, None])
    record_rows = segment_of(table, rows, steps)
    episode_ids = engine.tensor(anchors.episode_ids)[:, None].expand_as(steps)
    base = engine.tensor(column["base"])
    return Records(
        first_offsets=engine.view(base[rows] + targets[:, 0]),
        rows=engine.view(record_rows),
        episode_ids=engine.view(episode_ids.contiguous()),
        steps=engine.view(steps),
        valid=engine.view(valid),
        is_init=engine.view(is_init),
        terminal=engine.view(terminal),
        clamped=True,
        exact=engine.view(valid & (record_rows == rows[:, None])),
    )


def segment_of(table: EpisodeTable, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Row of the segment holding each of ``steps`` ``[B, W]``, walking from ``rows`` ``[B]``.

    ``steps`` are stored steps of the episodes whose segments include ``rows``; each record
    walks its episode's chain of segments from there.
    """
    column = table.arrays
    first_step = engine.tensor(column["first_step"])
    length = engine.tensor(column["length"])
    prev_key, next_key = engine.tensor(column["prev_key"]), engine.tensor(column["next_key"])
    mask = table.row_count - 1
    current = rows[:, None].expand_as(steps).clone()
    while True:
        starts = first_step[current]
        before = steps < starts
        after = steps >= starts + length[current]
        if not bool((before | after).any()):
            return current
        current = torch.where(before, prev_key[current] & mask, current)
        current = torch.where(after, next_key[current] & mask, current)
