"""Transport: episodes and batches cross processes as dicts of contiguous numpy arrays.

Numpy arrays travel through Ray's object store without per-record pickling (and are read
without a copy on the receiving side), where torch tensors would be pickled whole. The
learner merges the shards' pieces into one batch with one copy per byte, into a reused block
(`lucid_replay.batch_memory.views`) or straight into pinned host memory when the target is a
CUDA device, then moves it with ``non_blocking=True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lucid_replay.batch import PER_RECORD, Batch, PrioritizedBatch, WindowBatch
from lucid_replay.batch_memory import Shapes
from lucid_replay.episode import Episode
from lucid_replay.writer_pages import torch_dtype

__all__: list[str] = []  # internal module

Packed = dict[str, Any]  # name -> numpy array (a tensor for dtypes numpy lacks)
_DATA = "data."
_WINDOW_KEYS = (*PER_RECORD, "episode_ids", "anchor_steps")
_CHUNK_KEYS = ("episode_ids", "starts")
ID_KEYS = ("episode_ids", "record_episode_ids")  # local ids on a shard, global once packed
SEGMENT_KEY = "segment_ids"  # batches of buffers with segment_length: global once packed
# Ray writes each buffer over 1 MiB into its object store with six threads started for that
# one copy, whatever the cores: on two cores that costs more than the copy (returning 7 MB
# took 2.8-5.1 ms of the shard's CPU whole, 1.9 ms in pieces of 1 MB, about 1,400 page faults
# fewer). A batch's large fields travel as row pieces of at most this size, each copied by
# one plain memcpy.
PIECE_BYTES = 1_000_000


def _host(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A CPU tensor as numpy (shared memory); dtypes numpy lacks stay tensors."""
    tensor = tensor.detach().cpu()
    try:
        return tensor.numpy()
    except TypeError:  # bfloat16 and friends
        return tensor


def pack_episode(episode: Episode) -> tuple[dict[str, Any], bool]:
    """An episode as ``(name -> array, terminated)``."""
    return pack_steps(episode.steps), episode.terminated


def pack_steps(steps: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Steps (name -> tensor ``[n, ...]``) as name -> array, for a stream's append."""
    return {name: _host(t) for name, t in steps.items()}


def unpack_episode(packed: tuple[Mapping[str, Any], bool]) -> Episode:
    """The `Episode` of `pack_episode` output (numpy arrays are wrapped, not copied)."""
    steps, terminated = packed
    return Episode(dict(steps), terminated=terminated)


def in_pieces(array: np.ndarray | torch.Tensor) -> Any:
    """``array`` as a list of row pieces of at most `PIECE_BYTES` each (views), if larger."""
    if not isinstance(array, np.ndarray) or array.nbytes <= PIECE_BYTES or len(array) < 2:
        return array
    rows = max(PIECE_BYTES // max(array.nbytes // len(array), 1), 1)
    return [array[start : start + rows] for start in range(0, len(array), rows)]


def nbytes(value: Any) -> int:
    """Bytes of a packed value: an array, a tensor, or row pieces (`in_pieces`)."""
    if isinstance(value, list):
        return sum(nbytes(piece) for piece in value)
    return int(value.nbytes)


def pack_batch(batch: Batch | WindowBatch) -> Packed:
    """A batch's tensors by name (``data.<field>`` for stored fields); weights are not kept.

    Stored fields larger than `PIECE_BYTES` are lists of row pieces (`in_pieces`).
    """
    keys = _WINDOW_KEYS if isinstance(batch, WindowBatch) else _CHUNK_KEYS
    packed: Packed = {f"{_DATA}{name}": in_pieces(_host(t)) for name, t in batch.data.items()}
    for key in keys:
        packed[key] = getattr(batch, key).cpu().numpy()
    if batch.segment_ids is not None:
        packed[SEGMENT_KEY] = batch.segment_ids.cpu().numpy()
    return packed


def shapes(pieces: list[Packed], size: int) -> Shapes:
    """The shape and dtype of each tensor of a ``size``-row batch merged from ``pieces``."""
    out: Shapes = {}
    for key, value in pieces[0].items():
        first = value[0] if isinstance(value, list) else value
        dtype = first.dtype if isinstance(first, torch.Tensor) else torch_dtype(first.dtype)
        assert dtype is not None  # every packed array came from a tensor
        out[key] = ((size, *first.shape[1:]), dtype)
    return out


def merge(
    pieces: list[Packed], destinations: list[np.ndarray], tensors: dict[str, torch.Tensor]
) -> None:
    """Rows of each piece written to its ``destinations`` rows of ``tensors`` (`shapes`).

    A value sent in row pieces (`in_pieces`) is written piece by piece.
    """
    for key, out in tensors.items():
        if isinstance(pieces[0][key], torch.Tensor):
            for piece, rows in zip(pieces, destinations, strict=True):
                out[torch.from_numpy(rows)] = torch.as_tensor(piece[key])
            continue
        view = out.numpy()
        for piece, rows in zip(pieces, destinations, strict=True):
            parts = piece[key] if isinstance(piece[key], list) else [piece[key]]
            start = 0
            for part in parts:
                view[rows[start : start + len(part)]] = part
                start += len(part)


def _moved(tensors: dict[str, torch.Tensor], target: torch.device) -> dict[str, torch.Tensor]:
    if target.type == "cpu":
        return tensors
    return {k: v.to(target, non_blocking=target.type == "cuda") for k, v in tensors.items()}


def build(
    tensors: dict[str, torch.Tensor],
    weights: np.ndarray | None,
    target: torch.device,
    *,
    chunks: bool,
    priority_unit: str = "episode",
    probabilities: np.ndarray | None = None,
) -> Batch | WindowBatch:
    """The core's batch value of merged ``tensors`` (and float32 ``weights``) on ``target``.

    ``segment_ids`` are kept where the pieces had them; ``priority_unit`` is what the
    `PrioritizedBatch.indices` of a prioritized chunk draw are; ``probabilities``: the
    drawn anchors' float64 ``P``.
    """
    if weights is not None:
        tensors["weights"] = torch.from_numpy(weights)
    if probabilities is not None:
        tensors["probabilities"] = torch.from_numpy(probabilities)
    tensors = _moved(tensors, target)
    data = {k[len(_DATA) :]: v for k, v in tensors.items() if k.startswith(_DATA)}
    segment_ids, chances = tensors.get(SEGMENT_KEY), tensors.get("probabilities")
    if chunks:
        if weights is None:
            return Batch(
                data,
                tensors["episode_ids"],
                tensors["starts"],
                segment_ids=segment_ids,
                probabilities=chances,
            )
        return PrioritizedBatch(
            data=data,
            episode_ids=tensors["episode_ids"],
            starts=tensors["starts"],
            weights=tensors["weights"],
            segment_ids=segment_ids,
            priority_unit=priority_unit,
            probabilities=chances,
        )
    return WindowBatch(
        data=data,
        weights=tensors.get("weights"),
        segment_ids=segment_ids,
        probabilities=chances,
        **{key: tensors[key] for key in _WINDOW_KEYS},
    )
