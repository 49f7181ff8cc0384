"""Batches: the values a draw returns (`lucid_replay.batching` fills them).

Every tensor of a returned batch owns its memory: writing into one changes neither storage
nor any other batch (unless the caller passes it back as ``out=`` to be overwritten). A
buffer draws into the memory of an earlier batch again only once nothing refers to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

import attrs
import torch

from lucid_replay.errors import wrong_kind

if TYPE_CHECKING:
    from tensordict import TensorDictBase  # type: ignore[import-untyped]  # no py.typed

__all__ = ["Batch", "PrioritizedBatch", "WindowBatch"]

_DeviceLike = torch.device | str
_Moved = TypeVar("_Moved", bound="attrs.AttrsInstance")
_PER_RECORD = "lucid_replay.per_record"  # field metadata: the dtype of a [B, W] entry
_BOOLS = {_PER_RECORD: torch.bool}
_LONGS = {_PER_RECORD: torch.int64}


def record_positions(batch: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Episode ids, steps and validity (``[B, W]`` each) of the records of ``batch``.

    A chunk `Batch` has no padding: every record is valid.
    """
    if isinstance(batch, WindowBatch):
        return batch.record_episode_ids, batch.record_steps, batch.validity_mask
    if isinstance(batch, Batch):
        length = next(iter(batch.data.values())).shape[1]
        steps = batch.starts.unsqueeze(1) + torch.arange(length, device=batch.starts.device)
        ids = batch.episode_ids.unsqueeze(1).expand_as(steps)
        return ids, steps, torch.ones_like(steps, dtype=torch.bool)
    raise wrong_kind("batch", "a Batch or WindowBatch", type(batch).__name__)


def _to_device(value: object, device: _DeviceLike, non_blocking: bool) -> object:
    # copy=True: also on the batch's own device a new tensor, never the batch's memory, which
    # a later draw may overwrite (`out=`, `iterate(recycle=True)`).
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking, copy=True)
    if isinstance(value, Mapping):
        return MappingProxyType(
            {k: v.to(device, non_blocking=non_blocking, copy=True) for k, v in value.items()}
        )
    return value


def _moved(instance: _Moved, device: _DeviceLike, non_blocking: bool) -> _Moved:
    """A copy of the attrs instance with every tensor (also inside mappings) on ``device``.

    Always a copy, also to the device the batch is on: the copy owns its memory.
    """
    changes = {
        field.name: _to_device(getattr(instance, field.name), device, non_blocking)
        for field in attrs.fields(type(instance))
    }
    # The attrs mypy plugin cannot see through a TypeVar bound to AttrsInstance.
    return attrs.evolve(instance, **changes)  # type: ignore[misc]


@attrs.frozen(eq=False)
class Batch:
    """``B`` chunks of ``length`` consecutive steps, each from one stored episode.

    Attributes
    ----------
    data
        Field name -> ``[B, length, *field_shape]`` tensor (also ``batch[name]``).
    episode_ids
        int64 ``[B]``: the episode each chunk came from.
    starts
        int64 ``[B]``: the step of the episode at which each chunk starts.
    segment_ids
        int64 ``[B]`` on a buffer with ``segment_length``: the segment holding each chunk's
        first step; else ``None``.
    probabilities
        float64 ``[B]``: the probability with which each chunk was drawn (see Notes);
        ``None`` on a batch no draw chose.

    Notes
    -----
    ``probabilities`` are the exact ``P`` with which the selector (`Uniform`, `Prioritized`,
    `Recency`, `Mixture`) drew each anchor: the anchor's own for ``unit="chunk"``, its
    episode's for ``unit="episode"``. `Uniform`: ``1 / N`` (``N`` eligible anchors, or
    eligible episodes); `Prioritized`: ``p^alpha / sum p^alpha`` over them; `Recency`:
    ``2^(-age / h) / sum``; `Mixture`: ``sum f_k P_k``. Importance weights are
    ``(N P)^-beta / max`` of these. Under a reuse limit (``max_times_sampled``) a draw runs in
    rounds, and an anchor of a later round reports the probability of its round (over the
    episodes that still had draws left); `Prioritized` weights compare the anchors' masses at
    the draw's start, so they equal ``(N P)^-beta / max`` whenever the draw took one round
    (`Recency` and `Mixture` weights always take the reported ``P``). Computed from the drawn
    rows' masses and the trees' totals: O(B).
    """

    data: Mapping[str, torch.Tensor]
    episode_ids: torch.Tensor
    starts: torch.Tensor
    segment_ids: torch.Tensor | None = attrs.field(default=None, kw_only=True)
    probabilities: torch.Tensor | None = attrs.field(default=None, kw_only=True)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.data[name]

    def to(self, device: _DeviceLike, non_blocking: bool = False) -> Batch:
        """Return a copy with every tensor on ``device``.

        Always a copy, also to the device the batch is already on: ``batch.to("cpu")`` of a
        CPU batch keeps what ``out=`` or ``iterate(recycle=True)`` will overwrite.
        With ``non_blocking=True`` and a CUDA target, the copy is asynchronous: synchronise
        before reading it on the host.
        """
        return _moved(self, device, non_blocking)

    def to_tensordict(self) -> TensorDictBase:
        """A TensorDict of batch dims ``[B, length]``; layout on the TensorDict interop page."""
        from lucid_replay.tensordict import batch_tensordict

        length = next(iter(self.data.values())).shape[1]
        shape = (int(self.episode_ids.shape[0]), int(length))
        return batch_tensordict(self.data, {}, self._per_row(), shape, self.episode_ids.device)

    def _per_row(self) -> dict[str, torch.Tensor]:
        rows = {"episode_ids": self.episode_ids, "starts": self.starts}
        return rows if self.segment_ids is None else {**rows, "segment_ids": self.segment_ids}


@attrs.frozen(eq=False)
class PrioritizedBatch(Batch):
    """A `Batch` drawn by priority, with what `PrioritizedSequenceReplay` needs back.

    Attributes
    ----------
    indices
        int64 ``[B]``: the ids priorities are kept by, to pass to
        `PrioritizedSequenceReplay.update_priorities`: the `episode_ids` tensor itself,
        or `segment_ids` on a buffer with ``priority_unit="segment"``.
    weights
        float32 ``[B]``: importance-sampling weights, largest 1 (see
        `PrioritizedSequenceReplay`).
    priority_unit
        ``"episode"`` or ``"segment"``: what `indices` are.
    """

    weights: torch.Tensor
    priority_unit: str = attrs.field(default="episode", kw_only=True)

    @property
    def indices(self) -> torch.Tensor:
        """int64 ``[B]``: episode ids, or segment ids under ``priority_unit="segment"``."""
        if self.priority_unit == "segment" and self.segment_ids is not None:
            return self.segment_ids
        return self.episode_ids

    def _per_row(self) -> dict[str, torch.Tensor]:
        rows = super()._per_row()
        return {**rows, "indices": self.indices, "priority_weight": self.weights}


@attrs.frozen(eq=False)
class WindowBatch:
    """``B`` windows of ``W = window.size`` records each (see `Window`).

    Attributes
    ----------
    data
        Field name -> ``[B, W, *field_shape]`` (also ``batch[name]``). Invalid records carry
        the data of the step they were clamped to.
    learning_mask, validity_mask, is_init, terminal
        bool ``[B, W]``. ``learning_mask``: the record is in the learning region.
        ``validity_mask``: the record is the step it targets (not clamped). ``is_init``: the
        first valid record of the window, or a valid record at step 0 of an episode.
        ``terminal``: the record is the last step of a terminated episode.
    record_episode_ids, record_steps, step_in_sequence
        int64 ``[B, W]``: the episode and step each record holds; ``step_in_sequence[b, k] ==
        k``.
    episode_ids, anchor_steps
        int64 ``[B]``: the anchors as drawn.
    weights
        float32 ``[B]`` importance-sampling weights of a prioritized draw, else ``None``.
    segment_ids
        int64 ``[B]`` on a buffer with ``segment_length``: the segment holding each anchor
        step (where ``priority_unit="segment"`` routes priorities); else ``None``.
    probabilities
        float64 ``[B]``: the probability with which each anchor was drawn (as on `Batch`);
        ``None`` for anchors given to `SequenceReplay.gather_windows`.
    """

    data: Mapping[str, torch.Tensor]
    learning_mask: torch.Tensor = attrs.field(metadata=_BOOLS)
    validity_mask: torch.Tensor = attrs.field(metadata=_BOOLS)
    is_init: torch.Tensor = attrs.field(metadata=_BOOLS)
    terminal: torch.Tensor = attrs.field(metadata=_BOOLS)
    record_episode_ids: torch.Tensor = attrs.field(metadata=_LONGS)
    record_steps: torch.Tensor = attrs.field(metadata=_LONGS)
    step_in_sequence: torch.Tensor = attrs.field(metadata=_LONGS)
    episode_ids: torch.Tensor
    anchor_steps: torch.Tensor
    weights: torch.Tensor | None
    segment_ids: torch.Tensor | None = attrs.field(default=None, kw_only=True)
    probabilities: torch.Tensor | None = attrs.field(default=None, kw_only=True)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.data[name]

    @property
    def batch_size(self) -> int:
        """``B``, the number of windows."""
        return int(self.episode_ids.shape[0])

    @property
    def window_size(self) -> int:
        """``W``, records per window."""
        return int(self.learning_mask.shape[1])

    def flat(self) -> dict[str, torch.Tensor]:
        """Every data field and per-record entry reshaped to ``[B * W, ...]``.

        Adds ``sequence_id`` (int64 ``[B * W]``: the window each record belongs to), the key
        recurrent modules split on together with ``is_init``.
        """
        entries = {**self.data, **self._per_record()}
        flat = {name: value.flatten(0, 1) for name, value in entries.items()}
        windows = torch.arange(self.batch_size, device=self.episode_ids.device)
        flat["sequence_id"] = windows.repeat_interleave(self.window_size)
        return flat

    def to(self, device: _DeviceLike, non_blocking: bool = False) -> WindowBatch:
        """Return a copy with every tensor on ``device``.

        Always a copy, also to the device the batch is already on: ``batch.to("cpu")`` of a
        CPU batch keeps what ``out=`` or ``iterate(recycle=True)`` will overwrite.
        With ``non_blocking=True`` and a CUDA target, the copy is asynchronous: synchronise
        before reading it on the host.
        """
        return _moved(self, device, non_blocking)

    def to_tensordict(self) -> TensorDictBase:
        """A TensorDict of batch dims ``[B, W]``; layout on the TensorDict interop page."""
        from lucid_replay.tensordict import batch_tensordict

        shape = (self.batch_size, self.window_size)
        per_record = self._per_record()
        windows = torch.arange(shape[0], device=self.episode_ids.device)
        per_record["sequence_id"] = windows[:, None].expand(shape)
        per_row = {"episode_ids": self.episode_ids, "anchor_steps": self.anchor_steps}
        if self.segment_ids is not None:
            per_row["segment_ids"] = self.segment_ids
        if self.weights is not None:
            per_row["priority_weight"] = self.weights
        return batch_tensordict(self.data, per_record, per_row, shape, self.episode_ids.device)

    def _per_record(self) -> dict[str, torch.Tensor]:
        """The per-record entries ``[B, W]`` by attribute name (`PER_RECORD`)."""
        return {name: getattr(self, name) for name in PER_RECORD}


# The per-record entries of a `WindowBatch` (name -> dtype of its [B, W] tensor), in field
# order: what `flat` and `to_tensordict` add beside the data, what a batch allocates and
# what no stored field may be named (`lucid_replay.schema`).
PER_RECORD: dict[str, torch.dtype] = {
    field.name: field.metadata[_PER_RECORD]
    for field in attrs.fields(WindowBatch)
    if _PER_RECORD in field.metadata
}
