"""What a saved segmented table and its episode directory must satisfy before a buffer adopts them.

A checkpoint of a buffer with ``segment_length`` holds the segment rows (the table's columns,
with ``first_step``, ``slot``, ``prev_key``, ``next_key`` and ``base``) and the live episodes'
directory rows (in id order; a row's index is its slot). Both are untrusted: every link
between them is checked here, vectorised, before anything is adopted. The invariants:

* directory rows: episode ids strictly increasing in ``[0, next_episode_id)``; ``0 <=
  first_stored <= total``; never open and terminated; draw counts ``>= 0``; finite
  positive priorities; closed episodes hold a stored segment (else they would have left);
* every stored segment names a directory row; ``base = start - first_step``; the stored
  segments of one episode, in key order, hold consecutive steps and link to each other
  (``next_key`` / ``prev_key``), the first links back to no stored segment and the last to
  none, and the episode's ``first_key``, ``first_stored``, ``last_key``, ``total`` and
  ``num_segments`` are those of its chain; an episode with no stored segment has
  ``first_key = -1`` and ``first_stored = total``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lucid_replay.directory import DTYPES
from lucid_replay.errors import CheckpointError

__all__: list[str] = []  # internal module

SEGMENT_COLUMNS = {
    "first_step": torch.int64,
    "slot": torch.int64,
    "prev_key": torch.int64,
    "next_key": torch.int64,
    "base": torch.int64,
}


def checked_directory(
    episodes: object, saved: Mapping[str, torch.Tensor], bounds: Mapping[str, int]
) -> tuple[dict[str, torch.Tensor], int, int]:
    """The directory rows, ``next_episode_id`` and ``next_token`` of a checked checkpoint.

    ``saved`` are the table's checked columns (on CPU), ``bounds`` its id and offset ranges.

    Raises
    ------
    CheckpointError
        Naming the first broken invariant.
    """
    if not isinstance(episodes, Mapping) or set(episodes) != {
        "next_episode_id",
        "next_token",
        "columns",
    }:
        raise CheckpointError(
            "checkpoint episodes must hold next_episode_id, next_token and columns, got "
            f"{sorted(episodes) if isinstance(episodes, Mapping) else type(episodes).__name__}"
        )
    issued, token = episodes["next_episode_id"], episodes["next_token"]
    for name, value in (("next_episode_id", issued), ("next_token", token)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**62:
            raise CheckpointError(f"checkpoint {name} must be an int in [0, 2**62], got {value!r}")
    rows = _checked_rows(episodes["columns"])
    count = int(rows["episode_id"].shape[0])
    ids = rows["episode_id"]
    first_id, next_id = bounds["first_id"], bounds["next_id"]
    keys = torch.arange(first_id, next_id)
    stored = keys & (int(saved["episode_id"].shape[0]) - 1)
    slot = saved["slot"][stored]
    first_step, length = saved["first_step"][stored], saved["length"][stored]
    _require(
        (not bool((ids[1:] <= ids[:-1]).any()), "episode ids strictly increasing"),
        (not bool(((ids < 0) | (ids >= issued)).any()), "episode ids below next_episode_id"),
        (not bool((rows["first_stored"] < 0).any()), "first_stored >= 0"),
        (not bool((rows["first_stored"] > rows["total"]).any()), "first_stored <= total"),
        (not bool((rows["opened"] & rows["terminated"]).any()), "no episode open and ended"),
        (not bool((rows["times"] < 0).any()), "draw counts >= 0"),
        (
            bool((torch.isfinite(rows["priority"]) & (rows["priority"] > 0)).all()),
            "finite positive episode priorities",
        ),
        (not bool(((slot < 0) | (slot >= count)).any()), "every stored segment in an episode"),
        (
            torch.equal(saved["base"][stored], saved["start"][stored] - first_step),
            "base = start - first_step",
        ),
        (not bool((first_step < 0).any()), "first steps >= 0"),
    )
    # The chains: stored segments grouped by episode, in key order.
    order = torch.argsort(slot, stable=True)  # keys ascend already: key order in each group
    slot_o, key_o = slot[order], keys[order]
    first_o, end_o = first_step[order], first_step[order] + length[order]
    same = slot_o[1:] == slot_o[:-1]
    starts = torch.cat([torch.tensor([True]), ~same])
    ends = torch.cat([~same, torch.tensor([True])])
    prev_o, next_o = saved["prev_key"][stored][order], saved["next_key"][stored][order]
    counts = torch.bincount(slot, minlength=count) if slot.numel() else torch.zeros(count)
    holding = counts > 0
    chained = slot_o[starts]
    _require(
        (torch.equal(first_o[1:][same], end_o[:-1][same]), "consecutive steps along a chain"),
        (torch.equal(next_o[:-1][same], key_o[1:][same]), "next_key linking a chain"),
        (torch.equal(prev_o[1:][same], key_o[:-1][same]), "prev_key linking a chain"),
        (not bool((prev_o[starts] >= first_id).any()), "a chain's first segment first"),
        (bool((next_o[ends] == -1).all()), "a chain's last segment last"),
        (torch.equal(rows["num_segments"], counts.to(torch.int64)), "num_segments"),
        (torch.equal(rows["first_key"][chained], key_o[starts]), "first_key"),
        (torch.equal(rows["first_stored"][chained], first_o[starts]), "first_stored"),
        (torch.equal(rows["last_key"][chained], key_o[ends]), "last_key"),
        (torch.equal(rows["total"][chained], end_o[ends]), "total"),
        (bool((rows["first_key"][~holding] == -1).all()), "first_key -1 with none stored"),
        (
            torch.equal(rows["first_stored"][~holding], rows["total"][~holding]),
            "first_stored = total with none stored",
        ),
        (bool(rows["opened"][~holding].all()), "closed episodes holding a stored segment"),
        (not bool((rows["last_key"][~holding] >= first_id).any()), "last_key of none stored"),
    )
    rows["token"] = torch.zeros_like(rows["token"])  # no earlier stream may write
    return rows, issued, token


def _checked_rows(columns: object) -> dict[str, torch.Tensor]:
    """The directory's columns on CPU, each a 1-d tensor of its exact dtype, one length."""
    if not isinstance(columns, Mapping) or set(columns) != set(DTYPES):
        got = sorted(columns) if isinstance(columns, Mapping) else type(columns).__name__
        raise CheckpointError(f"checkpoint episode columns must be {sorted(DTYPES)}, got {got}")
    rows = {}
    for name, dtype in DTYPES.items():
        column = columns[name]
        if not isinstance(column, torch.Tensor) or column.dtype != dtype or column.dim() != 1:
            raise CheckpointError(
                f"checkpoint episode column {name!r} must be a 1-d {dtype} tensor, got "
                f"{column.dtype if isinstance(column, torch.Tensor) else type(column).__name__}"
            )
        rows[name] = column.cpu().clone()
    if len({int(column.shape[0]) for column in rows.values()}) != 1:
        raise CheckpointError("checkpoint episode columns must share one length")
    return rows


def _require(*checks: tuple[bool, str]) -> None:
    for holds, rule in checks:
        if not holds:
            raise CheckpointError(
                f"checkpoint segments must have {rule}, got a state that breaks it"
            )
