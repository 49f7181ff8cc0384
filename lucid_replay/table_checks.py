"""What a saved episode table must satisfy before a buffer adopts it.

A checkpoint's table is untrusted input: every column's dtype and shape, the id and offset
ranges, and the invariants `lucid_replay.table` relies on (stored rows hold their own ids,
episodes tile the stored offsets in order, priorities are finite and positive) are checked
here, all before anything is adopted.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lucid_replay.errors import CheckpointError

__all__: list[str] = []  # internal module

MAX_INDEX = 2**62  # ids and offsets stay below this, so `+ span` and `+ 1` never wrap int64
_COLUMN_DTYPES = {
    "episode_id": torch.int64,
    "start": torch.int64,
    "length": torch.int64,
    "terminated": torch.bool,
    "times_sampled": torch.int64,
    "priority": torch.float64,
}
_RANGES = ("first_id", "next_id", "oldest_offset", "next_offset", "generation")


def checked_table_state(
    columns: Mapping[str, object],
    ranges: Mapping[str, object],
    capacity: int,
    extra_columns: Mapping[str, torch.dtype] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """A saved table's ``columns`` (on CPU) and id/offset ``ranges``, every invariant checked.

    The invariants are listed on `EpisodeTable.from_columns`. ``extra_columns``: the
    further columns of a segmented table (checked by `lucid_replay.segment_checks`) and the
    ``commit`` column of a table that keeps one (each stored row's at least its length).

    Raises
    ------
    CheckpointError
        Naming the first broken invariant.
    """
    saved = _checked_columns(columns, {**_COLUMN_DTYPES, **(extra_columns or {})})
    rows = int(saved["episode_id"].shape[0])
    if rows < 1 or rows & (rows - 1):
        raise CheckpointError(f"checkpoint table rows must be a power of two >= 1, got {rows}")
    first_id, next_id, oldest, newest, generation = (_checked_range(ranges, n) for n in _RANGES)
    if first_id > next_id or oldest > newest:
        raise CheckpointError(
            "checkpoint table must have first_id <= next_id and oldest_offset <= next_offset, "
            f"got ids [{first_id}, {next_id}) and offsets [{oldest}, {newest})"
        )
    if next_id - first_id > rows:
        raise CheckpointError(
            f"checkpoint table rows must hold its {next_id - first_id} episodes, got {rows}"
        )
    if newest - oldest > capacity:
        raise CheckpointError(
            f"checkpoint transitions must fit the capacity ({capacity}), got {newest - oldest}"
        )
    ids = torch.arange(first_id, next_id)
    stored = ids & (rows - 1)
    length, start = saved["length"][stored], saved["start"][stored]
    claims = (saved["episode_id"] >= first_id) & (saved["episode_id"] < next_id)
    tiles = torch.cat([start, torch.tensor([newest])]) == torch.cat(
        [torch.tensor([oldest]), start + length]
    )
    priority = saved["priority"]
    for broken, rule in (
        (not torch.equal(saved["episode_id"][stored], ids), "stored rows holding their own ids"),
        (int(claims.sum()) != ids.numel(), "no other row claiming a stored id"),
        (bool((length < 1).any()), "stored lengths >= 1"),
        (not bool(tiles.all()), "stored episodes tiling [oldest_offset, next_offset) in order"),
        (not bool((torch.isfinite(priority) & (priority > 0)).all()), "priorities finite, > 0"),
        (bool((saved["times_sampled"][stored] < 0).any()), "times_sampled >= 0"),
        (
            "commit" in saved and bool((saved["commit"][stored] < length).any()),
            "commit counters >= their rows' lengths",
        ),
    ):
        if broken:
            raise CheckpointError(f"checkpoint table must have {rule}, got a table that breaks it")
    bounds = dict(zip(_RANGES, (first_id, next_id, oldest, newest, generation), strict=True))
    return saved, bounds


def _checked_columns(columns: object, dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """The saved columns on CPU, each a 1-d tensor of its exact dtype, all of one length."""
    if not isinstance(columns, Mapping) or set(columns) != set(dtypes):
        got = sorted(columns) if isinstance(columns, Mapping) else type(columns).__name__
        raise CheckpointError(f"checkpoint table columns must be {sorted(dtypes)}, got {got}")
    saved = {}
    for name, dtype in dtypes.items():
        column = columns[name]
        if not isinstance(column, torch.Tensor) or column.dtype != dtype or column.dim() != 1:
            got = (
                f"{column.dtype} of shape {tuple(column.shape)}"
                if isinstance(column, torch.Tensor)
                else type(column).__name__
            )
            raise CheckpointError(
                f"checkpoint column {name!r} must be a 1-d {dtype} tensor, got {got}"
            )
        saved[name] = column.cpu()
    lengths = {name: int(column.shape[0]) for name, column in saved.items()}
    if len(set(lengths.values())) != 1:
        raise CheckpointError(f"checkpoint columns must share one length, got {lengths}")
    return saved


def _checked_range(ranges: object, name: str) -> int:
    value = ranges.get(name) if isinstance(ranges, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INDEX:
        raise CheckpointError(
            f"checkpoint table {name} must be an int in [0, 2**62], got {value!r}"
        )
    return value
