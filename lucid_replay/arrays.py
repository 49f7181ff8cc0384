"""Index arithmetic on numpy arrays or tensors: one formula, the cheaper engine for the device.

Sampling and priority bookkeeping work on vectors of a few hundred elements, where the cost is
per operation, not per element: a torch op on CPU costs about 5 us of dispatch, the same numpy
op on the same memory about 1 us. So on CPU that arithmetic runs on numpy views of the tensors
(`Tensor.numpy` shares memory), and on an accelerator on the tensors themselves. Arithmetic,
comparisons and indexing are spelled alike in both; the few operations that are not are here.
This module imports nothing from lucid_replay.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import numpy as np
import torch

__all__: list[str] = []  # internal module

# A numpy array (CPU) or a tensor (elsewhere). The code using it is written against what both
# spell alike, which no static type expresses, so it is typed as Any; tests run the sampler
# on both engines (see `numpy_on_cpu`).
Array: TypeAlias = Any

_NUMPY_DTYPES = {
    torch.bool: np.bool_,
    torch.int64: np.int64,
    torch.float32: np.float32,
    torch.float64: np.float64,
}


numpy_on_cpu = True  # tests set it to False to run the accelerator code path on CPU


def engine(values: torch.Tensor) -> Array:
    """``values`` as the array the index arithmetic runs on: a numpy view on CPU."""
    return values.numpy() if numpy_on_cpu and values.is_cpu else values


def tensor(values: Array) -> torch.Tensor:
    """Back to a tensor (a numpy array is wrapped, not copied)."""
    return torch.from_numpy(values) if isinstance(values, np.ndarray) else values


def cast(values: Array, dtype: torch.dtype) -> Array:
    """``values`` converted to ``dtype`` (a torch dtype for both engines)."""
    if isinstance(values, np.ndarray):
        return values.astype(_NUMPY_DTYPES[dtype], copy=False)
    return values.to(dtype)


def concatenate(parts: list[Array]) -> Array:
    """The 1-d arrays ``parts`` (one engine, at least one) end to end."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return torch.cat(parts)


def minimum(first: Array, second: Array) -> Array:
    """Elementwise minimum of two arrays of one engine."""
    if isinstance(first, np.ndarray):
        return np.minimum(first, second)
    return torch.minimum(first, second)


def where(condition: Array, chosen: Array, otherwise: float) -> Array:
    """``chosen`` where ``condition`` holds, else the scalar ``otherwise`` (``chosen``'s dtype)."""
    if isinstance(condition, np.ndarray):
        return np.where(condition, chosen, otherwise)
    return torch.where(condition, chosen, otherwise)


def row_max(values: Array) -> Array:
    """The largest element of each row of a 2-d array."""
    if isinstance(values, np.ndarray):
        return values.max(axis=1)
    return values.amax(dim=1)


def all_finite(values: Array) -> bool:
    """Whether no element is NaN or infinite (a host synchronisation on a device)."""
    if isinstance(values, np.ndarray):
        return bool(np.isfinite(values).all())
    return bool(torch.isfinite(values).all())


def flat_nonzero(mask: Array) -> Array:
    """Positions of the True elements of ``mask`` in its flattened (row-major) order."""
    if isinstance(mask, np.ndarray):
        return np.flatnonzero(mask)
    return mask.reshape(-1).nonzero().squeeze(1)


def add_at(target: Array, indices: Array, amount: int) -> None:
    """``target[indices] += amount`` in place, counting repeated indices once each."""
    if isinstance(target, np.ndarray):
        np.add.at(target, indices, amount)
    else:
        target.index_add_(0, indices, torch.full_like(indices, amount, dtype=target.dtype))


def assign_max(target: Array, indices: Array, values: Array) -> None:
    """``target[indices] = values`` in place, a repeated index taking the largest of its values.

    Without a sort: a plain assignment leaves one of each index's values, then an unbuffered
    maximum brings in the others.
    """
    target[indices] = values
    if isinstance(target, np.ndarray):
        np.maximum.at(target, indices, values)
    else:
        target.scatter_reduce_(0, indices, values, "amax")


def count_distinct(values: Array) -> int:
    """How many distinct values the 1-d ``values`` holds (a host synchronisation on a device)."""
    if values.shape[0] == 0:
        return 0
    ordered: Array = np.sort(values) if isinstance(values, np.ndarray) else values.sort().values
    return int((ordered[1:] != ordered[:-1]).sum()) + 1


def full(shape: tuple[int, ...], value: float, dtype: torch.dtype, like: Array) -> Array:
    """A new array of ``shape`` filled with ``value``, of ``like``'s engine and device."""
    if isinstance(like, np.ndarray):
        return np.full(shape, value, dtype=_NUMPY_DTYPES[dtype])
    return torch.full(shape, value, dtype=dtype, device=like.device)


def arange(count: int, like: Array) -> Array:
    """``0 .. count - 1`` (int64) of ``like``'s engine and device."""
    if isinstance(like, np.ndarray):
        return np.arange(count, dtype=np.int64)
    return torch.arange(count, device=like.device)


def clip_rows(values: Array, low: int, high: Array) -> Array:
    """Each row of the 2-d ``values`` clamped into ``[low, high[row]]`` (a new array)."""
    if isinstance(values, np.ndarray):
        return np.clip(values, low, high[:, None])
    return torch.minimum(values.clamp_min(low), high[:, None])


def add_outer(rows: Array, columns: Array, out: Array) -> None:
    """``out[i, j] = rows[i] + columns[j]``, written into ``out``."""
    if isinstance(out, np.ndarray):
        np.add(rows[:, None], columns, out=out)
    else:
        torch.add(rows[:, None], columns, out=out)


def repeat_columns(values: Array, count: int) -> Array:
    """``[n, count]``: the 1-d ``values`` repeated along a new last axis (owned memory)."""
    if isinstance(values, np.ndarray):
        return np.repeat(values[:, None], count, axis=1)
    return values[:, None].expand(values.shape[0], count).contiguous()


def from_ints(values: list[int], device: torch.device) -> Array:
    """An int64 vector of ``values``, as the engine of ``device`` holds it."""
    if numpy_on_cpu and device.type == "cpu":
        return np.array(values, dtype=np.int64)
    return torch.tensor(values, dtype=torch.int64, device=device)
