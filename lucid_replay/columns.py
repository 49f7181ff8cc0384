"""Open episodes of every env of a vector environment, in growing per-field arrays.

`EpisodeWriter` keeps, per field, one ``[num_envs, capacity, ...]`` array: env ``i``'s open
episode holds its records in row ``i``, columns ``0..length[i]``. A vector step writes one
column of every collecting env with one indexed assignment, and a finished episode leaves as
one slice copy, so no Python loop runs over steps. This module imports only errors from
lucid_replay.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lucid_replay.errors import must

__all__: list[str] = []  # internal module


def _zeros(like: Any, shape: tuple[int, ...]) -> Any:
    """Zeros of ``shape`` in ``like``'s kind (numpy or torch), dtype and device."""
    if isinstance(like, torch.Tensor):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    return np.zeros(shape, dtype=like.dtype)


def as_batch(param: str, value: Any, num_envs: int) -> Any:
    """``value`` as a numpy array or a detached tensor with leading size ``num_envs``."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
    elif not isinstance(value, np.ndarray):
        if isinstance(value, Mapping | str | bytes):
            raise TypeError(f"{param} must be an array, got {type(value).__name__}")
        try:
            value = np.asarray(value)
        except (TypeError, ValueError):
            raise TypeError(f"{param} must be array-like, got {type(value).__name__}") from None
    if isinstance(value, np.ndarray) and value.dtype.kind not in "biufc":
        raise TypeError(f"{param} must hold numbers or bools, got dtype {value.dtype}")
    if value.ndim == 0 or value.shape[0] != num_envs:
        shape = tuple(value.shape)
        raise must(param, f"an array of leading size num_envs ({num_envs})", shape)
    return value


def as_flags(param: str, value: Any, num_envs: int) -> np.ndarray:
    """A bool ``[num_envs]`` numpy array (``terminated``, ``truncated``, ``env_mask``)."""
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.dtype != np.bool_:
        raise TypeError(f"{param} must be a bool array, got dtype {array.dtype}")
    if array.shape != (num_envs,):
        raise must(param, f"of shape ({num_envs},)", tuple(array.shape))
    return np.array(array, dtype=np.bool_)  # a copy: the caller may reuse its array


class Column:
    """One field's open episodes, all envs at once: a growing ``[num_envs, capacity, ...]`` array.

    Numpy input is kept in numpy, tensors in torch on their device, dtypes as given. Writes
    copy the values (environments may overwrite their arrays in place).
    """

    def __init__(self, name: str, batch: Any, capacity: int) -> None:
        self.name = name
        self.is_torch = isinstance(batch, torch.Tensor)
        self.data: Any = _zeros(batch, (batch.shape[0], capacity, *batch.shape[1:]))

    def conform(self, param: str, value: Any, *, per_env: bool = False) -> Any:
        """``value`` in this column's kind, its per-env shape and dtype checked."""
        if self.is_torch and not isinstance(value, torch.Tensor):
            value = torch.from_numpy(np.array(value))
        elif not self.is_torch and isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        elif not self.is_torch:
            value = np.asarray(value)
        shape = tuple(self.data.shape[2:])
        got = tuple(value.shape if per_env else value.shape[1:])
        if got != shape:
            raise must(param, f"of per-env shape {shape} ({self.name!r})", got)
        if value.dtype != self.data.dtype:
            # A sub-environment's own final observation may differ in dtype from the batched
            # ones, which the vector env casts into its space's dtype: do what it does.
            castable = (
                torch.can_cast(value.dtype, self.data.dtype)
                if self.is_torch
                else np.can_cast(value.dtype, self.data.dtype, casting="same_kind")
            )
            if not (per_env and castable):
                raise TypeError(f"{param} must have dtype {self.data.dtype}, got {value.dtype}")
            value = value.to(self.data.dtype) if self.is_torch else value.astype(self.data.dtype)
        return value.to(self.data.device) if self.is_torch else value

    def write(self, rows: np.ndarray, columns: np.ndarray, batch: Any) -> None:
        """``data[rows[k], columns[k]] = batch[rows[k]]`` for every ``k`` (numpy indices)."""
        self.data[rows, columns] = batch[rows]

    def restart(self, rows: np.ndarray, columns: np.ndarray) -> None:
        """``data[rows[k], 0] = data[rows[k], columns[k]]``: move a record to the front."""
        self.data[rows, 0] = self.data[rows, columns]

    def grow(self, capacity: int) -> None:
        """Make room for ``capacity`` records per env, keeping the open records."""
        old = self.data
        self.data = _zeros(old, (old.shape[0], capacity, *old.shape[2:]))
        self.data[:, : old.shape[1]] = old

    def take(self, env: int, length: int, *, zero_last: bool) -> Any:
        """A copy of env ``env``'s records ``0..length``, the last one zeroed if asked."""
        part = self.data[env, : length + 1]
        part = part.clone() if self.is_torch else part.copy()
        if zero_last:
            part[length] = 0
        return part
