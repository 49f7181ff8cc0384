"""Windows: what each anchor expands to (burn-in, learning region, bootstrap, boundaries).

Sampling decides *which* anchors; this module decides *what each anchor expands to*. An anchor
``(episode, t)`` starts the learning region at step ``t``; record ``k`` of a window targets step
``t + (k - burn_in) * dilation``. Episode boundaries come from the `EpisodeTable` (starts,
lengths, and `EpisodeTable.locate` across episodes); this module only applies the policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import attrs
import numpy as np
import torch

from lucid_replay import engine
from lucid_replay.checks import check_int
from lucid_replay.engine import Array
from lucid_replay.errors import must, wrong_kind, wrong_type
from lucid_replay.records import Anchors, RecordArrays, Records
from lucid_replay.seams import expand_segments
from lucid_replay.table import EpisodeTable

__all__ = ["Window"]

Boundary = Literal["pad", "stop", "include_reset"]
_BOUNDARIES = ("pad", "stop", "include_reset")
MAX_RECORDS = 2**24  # per count (length, burn_in, bootstrap): far beyond any sequence model
MAX_SPAN = 2**56  # steps a window may cover, so that offset + span stays an int64


def _count(minimum: int) -> Callable[[object, attrs.Attribute[int], Any], None]:
    def validate(instance: object, attribute: attrs.Attribute[int], value: Any) -> None:
        check_int(attribute.name, value, minimum=minimum, maximum=MAX_RECORDS)

    return validate


def _dilation(instance: object, attribute: attrs.Attribute[int], value: Any) -> None:
    check_int(attribute.name, value, minimum=1)


def _as_int(value: Any) -> Any:
    """Numpy integers become Python ints (validated after); anything else is left to refuse."""
    if isinstance(value, np.integer):  # np.bool_ is not an np.integer
        return int(value)
    return value


def _is_bool(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise wrong_type(attribute.name, "a bool", value)


def _known_boundary(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in _BOUNDARIES:
        raise must("boundary", f"one of {_BOUNDARIES}", value)


@attrs.frozen
class Window:
    """The records drawn around each anchor: ``burn_in + length + bootstrap`` of them.

    Parameters
    ----------
    length
        Records in the learning region, starting at the anchor. ``>= 1``.
    burn_in
        Records before the anchor (for example to warm up a recurrent state). They never
        shift the anchor; records before the episode start are invalid. ``>= 0``.
    bootstrap
        Records after the learning region (for example n-step targets). ``>= 0``.
    dilation
        Steps between consecutive records. ``>= 1``.
    boundary
        What records past the episode end become:

        * ``"pad"``: clamped to the last step and marked invalid;
        * ``"stop"``: the whole window shifts back by
          ``clamp(dilation * (length + bootstrap - 1) - (T - 1 - t), 0, t)`` steps, then what
          still overruns is padded;
        * ``"include_reset"``: records continue into the previous or next *stored* episode
          (storage order, not necessarily the same environment's stream when several
          collectors add), clamped and invalid only beyond the oldest or newest stored
          step; ``is_init`` marks each episode start inside the window.
    allow_partial
        ``False``: an anchor is eligible only if its learning region lies inside the episode
        (``t + dilation * (length - 1) <= T - 1``). ``True``: every stored step is an anchor
        (TorchRL's ``Sequence`` semantics).

    Raises
    ------
    InvalidArgumentError
        For a value outside the ranges above or an unknown ``boundary``; for a count above
        ``2**24`` records or a span above ``2**56`` steps (so that step offsets stay int64).
    TypeError
        For a count that is not an integer (numpy integers are converted to ``int``) or an
        ``allow_partial`` that is not a bool.

    Examples
    --------
    >>> window = Window(4, burn_in=2, bootstrap=1, dilation=2)
    >>> window.size, window.span, window.learning_mask.tolist()
    (7, 13, [False, False, True, True, True, True, False])
    """

    length: int = attrs.field(converter=_as_int, validator=_count(1))
    burn_in: int = attrs.field(default=0, kw_only=True, converter=_as_int, validator=_count(0))
    bootstrap: int = attrs.field(default=0, kw_only=True, converter=_as_int, validator=_count(0))
    dilation: int = attrs.field(default=1, kw_only=True, converter=_as_int, validator=_dilation)
    boundary: Boundary = attrs.field(default="pad", kw_only=True, validator=_known_boundary)
    allow_partial: bool = attrs.field(default=False, kw_only=True, validator=_is_bool)

    def __attrs_post_init__(self) -> None:
        if self.span > MAX_SPAN:
            raise must("span (1 + dilation * (size - 1))", "<= 2**56 steps", self.span)

    @property
    def size(self) -> int:
        """Records per window, ``W = burn_in + length + bootstrap``."""
        return self.burn_in + self.length + self.bootstrap

    @property
    def span(self) -> int:
        """Steps the whole window covers, ``1 + dilation * (size - 1)``."""
        return 1 + self.dilation * (self.size - 1)

    @property
    def anchor_span(self) -> int:
        """Steps an anchor needs after it to be eligible (1 under ``allow_partial``)."""
        return 1 if self.allow_partial else 1 + self.dilation * (self.length - 1)

    @property
    def open_anchor_span(self) -> int:
        """Steps an anchor needs after it in an *open* episode of a segmented buffer.

        The learning region and the bootstrap records, ``1 + dilation * (length + bootstrap
        - 1)``, also under ``allow_partial``: an open episode goes on, so its last committed
        step is no end to pad or stop at.
        """
        return 1 + self.dilation * (self.length + self.bootstrap - 1)

    @property
    def learning_mask(self) -> torch.Tensor:
        """Bool ``[W]``: True on the learning region's records."""
        record = torch.arange(self.size)
        return (record >= self.burn_in) & (record < self.burn_in + self.length)


def check_window(window: object, *, segmented: bool = False) -> None:
    """Refuse anything that is not a `Window`, and ``include_reset`` on ``segmented`` buffers.

    A segmented buffer stores episodes as interleaved segments: there is no next stored
    episode for ``include_reset`` to continue into.
    """
    if not isinstance(window, Window):
        raise wrong_kind("window", "a Window", type(window).__name__)
    if segmented and window.boundary == "include_reset":
        raise must(
            "window.boundary",
            '"pad" or "stop" on a buffer with segment_length (its episodes are stored as '
            "interleaved segments: there is no next stored episode to continue into)",
            window.boundary,
        )


class Layout(NamedTuple):
    """Per-record constants of a window, ``[W]`` each."""

    record: torch.Tensor  # 0 .. W-1
    step_offset: torch.Tensor  # (record - burn_in) * dilation: the step relative to the anchor
    learning_mask: torch.Tensor


@functools.lru_cache(maxsize=64)
def layout(window: Window, device: torch.device) -> Layout:
    """The `Layout` of ``window`` on ``device``.

    Cached: windows are frozen and a training loop reuses a handful of them.
    """
    record = torch.arange(window.size, device=device)
    step_offset = (record - window.burn_in) * window.dilation
    return Layout(record, step_offset, window.learning_mask.to(device))


def expand(
    table: EpisodeTable, anchors: Anchors, window: Window, into: RecordArrays | None = None
) -> Records:
    """Expand ``anchors`` (stored episodes, their rows and steps) into records.

    The boundary policy of ``window`` (see `Window`) is applied here and only here. One
    vectorised computation for the whole batch (or one compiled loop, `expand_loop`, on
    CPU); cost O(B W), plus O(n log E) for the n records that ``include_reset`` sends into
    other episodes. Computed on the table's `engine` arrays. ``into``: destinations for the
    ``[B, W]`` results (a batch's own per-record tensors), used unless the window crosses
    episodes (``include_reset``), whose records are computed apart (`Records.filled` says
    which happened).
    """
    if table.segmented:
        stop_span = window.dilation * (window.length + window.bootstrap - 1)
        stop = stop_span if window.boundary == "stop" else None
        learning = (window.burn_in, window.burn_in + window.length)
        return expand_segments(
            table, anchors, window.size, window.burn_in, window.dilation, stop, into, learning
        )
    column, where = table.arrays, anchors.rows
    last = column["length"][where] - 1
    anchor = anchors.steps
    if window.boundary == "stop":
        to_last_record = window.dilation * (window.length + window.bootstrap - 1)
        overrun = to_last_record - (last - anchor)
        anchor = anchor - engine.minimum(overrun * (overrun > 0), anchor)
    if window.boundary == "include_reset":
        return _across_episodes(table, anchors, last, anchor, window)
    if engine.compiled(anchor):
        return _expanded_by_loop(table, anchors, anchor, last, window, into)
    cached = layout(window, table.device)
    # Record k targets step anchor + (k - burn_in) * dilation, which rises with k: a window's
    # valid records are one run, from the first with a target >= 0 (the only record that is
    # first or at step 0) to the last with a target <= last, and a record is at the last step
    # (or clamped to it) from the first with a target >= last on: from record 0 if last is 0.
    first_valid = window.burn_in - anchor // window.dilation
    first_valid = first_valid * (first_valid > 0)
    at_last = (window.burn_in - (anchor - last) // window.dilation) * (last > 0)
    at_last = at_last + window.size * ~column["terminated"][where]  # never if not terminated
    record, step_offset = engine.view(cached.record), engine.view(cached.step_offset)
    shape = (int(anchor.shape[0]), window.size)
    episode_ids = anchors.episode_ids
    if into is None:
        steps = anchor[:, None] + step_offset  # the target steps; clamped below where needed
        valid = engine.full(shape, True, torch.bool, steps)
        is_init = engine.full(shape, False, torch.bool, steps)
        terminal = engine.full(shape, False, torch.bool, steps)
        record_ids = engine.repeat_columns(episode_ids, window.size)
    else:
        steps, valid, is_init, terminal = into.steps, into.valid, into.is_init, into.terminal
        engine.add_outer(anchor, step_offset, out=steps)
        valid[...], is_init[...], terminal[...] = True, False, False
        record_ids = into.episode_ids
        record_ids[...] = episode_ids[:, None]
        into.learning[...] = engine.view(cached.learning_mask)
        into.sequence[...] = record
    first_step = anchor - window.burn_in * window.dilation  # record 0's target
    # Most windows lie inside their episode: only the rows of the others clamp and compare.
    out_of_episode = (first_step < 0) | (first_step + window.dilation * (window.size - 1) > last)
    clamped = bool(out_of_episode.any())
    if clamped:
        rows = engine.flat_nonzero(out_of_episode)
        steps[rows] = engine.clip_rows(steps[rows], 0, last[rows])
        last_valid = window.burn_in + (last - anchor) // window.dilation  # its record index
        valid[rows] = (record >= first_valid[rows, None]) & (record <= last_valid[rows, None])
    # is_init: the first valid record only (one episode); terminal: a suffix of some rows.
    is_init[engine.arange(shape[0], steps), first_valid] = True
    ending = engine.flat_nonzero(at_last < window.size)
    if ending.shape[0]:
        terminal[ending] = record >= at_last[ending, None]
    return Records(
        first_offsets=table.offsets(where, first_step),
        rows=where[:, None],
        episode_ids=record_ids,
        steps=steps,
        valid=valid,
        is_init=is_init,
        terminal=terminal,
        clamped=clamped,
        filled=into is not None,
    )


def _expanded_by_loop(
    table: EpisodeTable,
    anchors: Anchors,
    anchor: Array,
    last: Array,
    window: Window,
    into: RecordArrays | None,
) -> Records:
    """`expand`'s one-episode windows by `expand_loop` (the same records)."""
    shape = (int(anchor.shape[0]), window.size)
    filled = into is not None
    if into is None:
        into = RecordArrays(
            steps=np.empty(shape, dtype=np.int64),
            valid=np.empty(shape, dtype=np.bool_),
            is_init=np.empty(shape, dtype=np.bool_),
            terminal=np.empty(shape, dtype=np.bool_),
            episode_ids=np.empty(shape, dtype=np.int64),
            learning=np.empty(shape, dtype=np.bool_),
            sequence=np.empty(shape, dtype=np.int64),
        )
    where = anchors.rows
    clamped = expand_loop(
        np.ascontiguousarray(anchor),
        np.ascontiguousarray(last),
        np.ascontiguousarray(table.arrays["terminated"][where]),
        anchors.episode_ids,
        window.burn_in,
        window.length,
        window.dilation,
        into.steps,
        into.valid,
        into.is_init,
        into.terminal,
        into.episode_ids,
        into.learning,
        into.sequence,
    )
    return Records(
        first_offsets=table.offsets(where, anchor - window.burn_in * window.dilation),
        rows=where[:, None],
        episode_ids=into.episode_ids,
        steps=into.steps,
        valid=into.valid,
        is_init=into.is_init,
        terminal=into.terminal,
        clamped=bool(clamped),
        filled=filled,
    )


@engine.jit
def expand_loop(
    anchor: np.ndarray,
    last: np.ndarray,
    terminated: np.ndarray,
    episode_ids: np.ndarray,
    burn_in: int,
    length: int,
    dilation: int,
    steps: np.ndarray,
    valid: np.ndarray,
    is_init: np.ndarray,
    terminal: np.ndarray,
    record_ids: np.ndarray,
    learning: np.ndarray,
    sequence: np.ndarray,
) -> bool:
    """`expand` for one episode per window (pad, and stop after its shift), compiled.

    Per window, records ``first .. final`` are valid (their targets lie in the episode);
    the ones before clamp to step 0, the ones after to the last step, and a record at
    (or clamped to) the last step of a terminated episode is terminal. Also writes the
    window's constants: ``learning`` (records ``burn_in .. burn_in + length - 1``) and
    ``sequence`` (``k``). Returns whether any record was clamped.
    """
    clamped = False
    size = steps.shape[1]
    for b in range(anchor.shape[0]):
        first_step, end = anchor[b] - burn_in * dilation, last[b]
        first = max(0, -(first_step // dilation))  # first k with a target >= 0
        final = min(size - 1, (end - first_step) // dilation)  # last k with target <= end
        clamped |= first > 0 or final < size - 1
        for k in range(size):
            step = min(max(first_step + k * dilation, 0), end)
            steps[b, k] = step
            valid[b, k] = first <= k <= final
            is_init[b, k] = k == first
            terminal[b, k] = terminated[b] and step == end
            record_ids[b, k] = episode_ids[b]
            learning[b, k] = burn_in <= k < burn_in + length
            sequence[b, k] = k
    return clamped


def _across_episodes(
    table: EpisodeTable, anchors: Anchors, last: Array, anchor: Array, window: Window
) -> Records:
    """``include_reset``: records continue into the neighbouring stored episodes."""
    step_offset = engine.view(layout(window, table.device).step_offset)
    targets = anchor[:, None] + step_offset  # steps of the anchor's episode, any sign
    wanted = engine.tensor(table.offsets(anchors.rows[:, None], targets))
    target, last = engine.tensor(targets), engine.tensor(last).unsqueeze(1)
    offsets = wanted.clamp(table.oldest_offset, table.next_offset - 1)
    valid = offsets == wanted
    record_ids = engine.tensor(anchors.episode_ids).unsqueeze(1).expand_as(target).clone()
    steps = target.clone()
    elsewhere = (target < 0) | (target > last)
    if bool(elsewhere.any()):
        record_ids[elsewhere], steps[elsewhere] = table.locate(offsets[elsewhere])
    record_rows = table.rows_of(record_ids)
    first_valid = valid & (valid.cumsum(dim=1) == 1)
    is_init = first_valid | (valid & (steps == 0))
    terminal = table.terminated[record_rows] & (steps == table.length[record_rows] - 1)
    return Records(
        first_offsets=engine.view(wanted[:, 0]),
        rows=engine.view(record_rows),
        episode_ids=engine.view(record_ids),
        steps=engine.view(steps),
        valid=engine.view(valid),
        is_init=engine.view(is_init),
        terminal=engine.view(terminal),
        clamped=True,  # records of other episodes are read one by one
    )
