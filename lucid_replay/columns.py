"""Open episodes of every env of a vector environment, in one paged pool per field.

`EpisodeWriter` stores the records of open episodes in a pool of fixed-size pages shared by
all envs (as a paged KV cache does): each field is one ``[pages * page_size, ...]`` array, and
a `PageTable` says which pages hold env ``i``'s records, in order. A vector step then writes
one record of every collecting env with one indexed assignment, a finished episode leaves as
one gather, and memory follows the records actually open (an env in a long episode does not
make every env reserve that length). No Python loop runs over steps. This module imports only
errors from lucid_replay.
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


class PageTable:
    """Which pages of the pool hold each env's open episode, in order.

    Record ``t`` of env ``i`` lives in slot ``table[i, t // page_size] * page_size +
    t % page_size``. Every env keeps at least its first page; the pages past it return to a
    free list when its episode is stored. The pool doubles when the free list runs dry
    (callers then `grow` their columns to `slots`).
    """

    def __init__(self, num_envs: int, page_size: int) -> None:
        self.page_size = page_size
        self.table = np.arange(num_envs, dtype=np.int64)[:, None]  # env i owns page i
        self.owned = np.ones(num_envs, dtype=np.int64)
        self.free: list[int] = []
        self.num_pages = num_envs

    @property
    def slots(self) -> int:
        """Records the pool holds."""
        return self.num_pages * self.page_size

    def slot(self, rows: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Slots of record ``steps[k]`` of env ``rows[k]`` (pages reserved by `reserve`)."""
        page, offset = np.divmod(steps, self.page_size)
        result: np.ndarray = self.table[rows, page] * self.page_size + offset
        return result

    def episode(self, env: int, length: int) -> np.ndarray:
        """Slots of records ``0..length`` of env ``env``, in order."""
        steps = np.arange(length + 1)
        return self.slot(np.full_like(steps, env), steps)

    def reserve(self, rows: np.ndarray, steps: np.ndarray) -> bool:
        """Give env ``rows[k]`` the pages up to record ``steps[k]``; True if the pool grew."""
        needed = steps // self.page_size + 1
        short = np.flatnonzero(needed > self.owned[rows])
        if not short.size:
            return False
        width = self.table.shape[1]
        if needed.max() > width:
            extra = max(int(needed.max()), 2 * width) - width
            self.table = np.pad(self.table, ((0, 0), (0, extra)))
        grew = False
        for env, need in zip(rows[short].tolist(), needed[short].tolist(), strict=True):
            while self.owned[env] < need:
                if not self.free:
                    self.free = list(range(2 * self.num_pages - 1, self.num_pages - 1, -1))
                    self.num_pages *= 2
                    grew = True
                self.table[env, self.owned[env]] = self.free.pop()
                self.owned[env] += 1
        return grew

    def release(self, rows: np.ndarray) -> None:
        """Return every page but the first of envs ``rows`` to the free list."""
        for env in rows.tolist():
            self.free.extend(self.table[env, 1 : self.owned[env]].tolist())
        self.owned[rows] = 1


class Column:
    """One field of every open episode: a ``[slots, ...]`` pool array (see `PageTable`).

    Numpy input is kept in numpy, tensors in torch on their device, dtypes as given. Writes
    copy the values (environments may overwrite their arrays in place).
    """

    def __init__(self, name: str, batch: Any, slots: int) -> None:
        self.name = name
        self.is_torch = isinstance(batch, torch.Tensor)
        self.data: Any = _zeros(batch, (slots, *batch.shape[1:]))

    def conform(self, param: str, value: Any, *, per_env: bool = False) -> Any:
        """``value`` in this column's kind, its per-env shape and dtype checked."""
        if self.is_torch and not isinstance(value, torch.Tensor):
            value = torch.from_numpy(np.array(value))
        elif not self.is_torch and isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        elif not self.is_torch:
            value = np.asarray(value)
        shape = tuple(self.data.shape[1:])
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

    def _index(self, slots: np.ndarray) -> Any:
        return torch.from_numpy(slots).to(self.data.device) if self.is_torch else slots

    def write(self, slots: np.ndarray, batch: Any, rows: np.ndarray) -> None:
        """``data[slots[k]] = batch[rows[k]]`` for every ``k`` (``rows`` sorted, distinct)."""
        every_env = rows.size == batch.shape[0]  # then rows is 0..n-1: skip gathering a copy
        self.data[self._index(slots)] = batch if every_env else batch[self._index(rows)]

    def put(self, slot: int, value: Any) -> None:
        """``data[slot] = value`` (one env's record)."""
        self.data[slot] = value

    def move(self, targets: np.ndarray, sources: np.ndarray) -> None:
        """``data[targets[k]] = data[sources[k]]`` for every ``k``."""
        self.data[self._index(targets)] = self.data[self._index(sources)]

    def take(self, slots: np.ndarray, *, zero_last: bool) -> Any:
        """A copy of the records in ``slots``, the last one zeroed if asked."""
        part = self.data[self._index(slots)]  # advanced indexing: a new array
        if zero_last:
            part[-1] = 0
        return part

    def grow(self, slots: int) -> None:
        """Make room for ``slots`` records, keeping the ones held."""
        old = self.data
        self.data = _zeros(old, (slots, *old.shape[1:]))
        self.data[: old.shape[0]] = old
