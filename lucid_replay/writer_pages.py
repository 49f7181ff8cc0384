"""Open episodes of every env of a vector environment, in one paged pool per field.

`EpisodeWriter` stores the records of open episodes in a pool of fixed-size pages shared by
all envs (as a paged KV cache does): each field is one ``[pages * page_size, ...]`` array, and
a `PageTable` says which pages hold env ``i``'s records, in order. A vector step then writes
one record of every collecting env with one indexed assignment, a finished episode leaves as
one gather, and memory follows the records actually open (an env in a long episode does not
make every env reserve that length). No Python loop runs over steps. The checks every value
passes before the writer changes state live here too. This module imports only errors and
schema from lucid_replay.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lucid_replay.errors import SchemaDtypeError, SchemaError, must, wrong_kind, wrong_type
from lucid_replay.schema import FieldSpec, Schema, casts_same_kind

__all__: list[str] = []  # internal module


# The mode names of this package, and gymnasium's `AutoresetMode` values, to the mode.
_MODES = {"next_step": "next_step", "same_step": "same_step", "disabled": "disabled"}
_MODES.update({"NextStep": "next_step", "SameStep": "same_step", "Disabled": "disabled"})


def autoreset_mode(autoreset: Any) -> str:
    """The mode named by a string or by an enum member (gymnasium's `AutoresetMode`)."""
    value = autoreset.value if isinstance(autoreset, enum.Enum) else autoreset
    if not isinstance(value, str):
        raise wrong_type("autoreset", "a str or an AutoresetMode", autoreset)
    if value not in _MODES:
        raise must("autoreset", "'next_step', 'same_step', 'disabled' or an AutoresetMode", value)
    return _MODES[value]


def _zeros(like: Any, shape: tuple[int, ...]) -> Any:
    """Zeros of ``shape`` in ``like``'s kind (numpy or torch), dtype and device."""
    if isinstance(like, torch.Tensor):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    return np.zeros(shape, dtype=like.dtype)


@functools.lru_cache(maxsize=64)
def torch_dtype(dtype: np.dtype[Any]) -> torch.dtype | None:
    """The torch dtype numpy ``dtype`` becomes in an `Episode`, or None if it has none.

    None for ``longdouble`` or a non-native byte order, which ``torch.from_numpy`` refuses.
    """
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except (TypeError, ValueError):
        return None


def as_array(param: str, value: Any) -> Any:
    """``value`` as a numpy array or a detached dense tensor, if an `Episode` can hold it.

    Refused (``TypeError``): tuples (gymnasium ``Tuple`` spaces) and dicts (nested ``Dict``
    spaces), which ``np.asarray`` would stack along the env axis; tensors without dense data
    (sparse, ``meta``, quantized, nested); dtypes torch has no counterpart for.
    """
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_meta or value.is_quantized or value.is_nested:
            kind = "meta" if value.is_meta else str(value.layout).removeprefix("torch.")
            kind = "nested" if value.is_nested else "quantized" if value.is_quantized else kind
            rule = "a dense tensor with data (strided, not meta, sparse, quantized or nested)"
            raise wrong_kind(param, rule, f"a {kind} tensor")
        return value.detach()
    if isinstance(value, tuple | Mapping | str | bytes):
        rule = "an array or a tensor (flatten gymnasium Tuple spaces and nested Dict spaces)"
        raise wrong_kind(param, rule, f"a {type(value).__name__}")
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)
        except (TypeError, ValueError):
            raise wrong_kind(param, "array-like", f"a {type(value).__name__}") from None
    if value.dtype.kind not in "biufc":
        raise wrong_kind(param, "an array of numbers or bools", f"dtype {value.dtype}")
    if torch_dtype(value.dtype) is None:
        rule = "of a dtype torch can hold (native byte order, no longdouble)"
        raise wrong_kind(param, rule, f"dtype {value.dtype.str!r}")
    return value


def as_batch(param: str, value: Any, num_envs: int) -> Any:
    """``value`` (see `as_array`) with leading size ``num_envs``."""
    value = as_array(param, value)
    if value.ndim == 0 or value.shape[0] != num_envs:
        shape = tuple(value.shape)
        raise must(param, f"an array of leading size num_envs ({num_envs})", shape)
    return value


def _dtype_of(array: Any) -> torch.dtype:
    """The torch dtype of a tensor or of a numpy array `as_array` accepted."""
    dtype = array.dtype if isinstance(array, torch.Tensor) else torch_dtype(array.dtype)
    if dtype is None:  # as_array refuses these first
        raise wrong_kind("array", "of a dtype torch can hold", f"dtype {array.dtype}")
    return dtype


def per_env_spec(batch: Any) -> FieldSpec:
    """``(per-env shape, torch dtype)`` of a checked ``[num_envs, ...]`` batch."""
    return tuple(batch.shape[1:]), _dtype_of(batch)


def check_fields(specs: dict[str, FieldSpec], declared: Any, *, complete: bool) -> None:
    """Refuse fields that no buffer could store, or that cannot match its schema ``declared``.

    ``specs``: the fields a first `reset` (observations) or first `step` (the rest) fixes,
    ``complete`` for the latter, when ``specs`` is every field of the episodes to come. Names
    and per-step shapes must match ``declared`` (a buffer's non-None ``schema``) exactly; a
    dtype is refused only when it does not even cast to the declared one by numpy's
    ``same_kind`` rule, the buffer deciding whether it takes a cast.

    Raises
    ------
    SchemaError, SchemaDtypeError
        As `Schema.check_storable`, and for a field the schema lacks, one it has that is
        missing, another per-step shape or a dtype of another kind.
    """
    Schema(specs).check_storable()
    if not isinstance(declared, Mapping):
        return
    for name, (shape, dtype) in specs.items():
        if name not in declared:
            raise SchemaError(
                f"field {name!r} must be one of the buffer's schema fields {sorted(declared)}, "
                f"got {name!r}"
            )
        want_shape, want_dtype = declared[name]
        if tuple(want_shape) != shape:
            raise SchemaError(
                f"field {name!r} must have the buffer's per-step shape {tuple(want_shape)}, "
                f"got {shape}"
            )
        if dtype != want_dtype and not casts_same_kind(dtype, want_dtype):
            raise SchemaDtypeError(
                f"field {name!r} must have a dtype that casts to the buffer's {want_dtype} "
                f"(same kind), got {dtype}"
            )
    if complete and set(declared) - set(specs):
        missing = sorted(set(declared) - set(specs))
        raise SchemaError(f"fields must include the buffer's schema fields {missing}, got none")


def as_flags(param: str, value: Any, num_envs: int) -> np.ndarray:
    """A bool ``[num_envs]`` numpy array (``terminated``, ``truncated``, ``env_mask``)."""
    array = as_array(param, list(value) if isinstance(value, tuple) else value)
    if isinstance(array, torch.Tensor):
        array = array.cpu().numpy() if array.dtype == torch.bool else array
    if array.dtype != np.bool_:
        raise wrong_kind(param, "a bool array", f"dtype {array.dtype}")
    if tuple(array.shape) != (num_envs,):
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

    def spans(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Slots ``[k, W]`` of records ``0 .. counts[k] - 1`` of env ``rows[k]``.

        ``counts >= 1``, ``W = max(counts)``; a shorter row repeats its last slot past
        ``counts[k]``. One vectorised lookup for any number of envs.
        """
        steps = np.minimum(np.arange(int(counts.max()))[None, :], (counts - 1)[:, None])
        return self.slot(np.broadcast_to(rows[:, None], steps.shape), steps)

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
        self.dtype = _dtype_of(batch)  # the torch dtype, also of a numpy column
        self.data: Any = _zeros(batch, (slots, *batch.shape[1:]))

    def conform(self, param: str, value: Any, *, per_env: bool = False) -> Any:
        """``value`` in this column's kind, its per-env shape and dtype checked.

        ``value`` is a batch from `as_batch`, or with ``per_env`` one env's value (checked
        here by `as_array`).
        """
        if per_env:
            value = as_array(param, value)
        shape = tuple(self.data.shape[1:])
        got = tuple(value.shape if per_env else value.shape[1:])
        if got != shape:
            raise must(param, f"of per-env shape {shape} ({self.name!r})", got)
        dtype = _dtype_of(value)
        # A sub-environment's own final observation may differ in dtype from the batched
        # ones, which the vector env casts into its space's dtype: do what it does.
        if dtype != self.dtype and not (per_env and casts_same_kind(dtype, self.dtype)):
            raise wrong_kind(param, f"of dtype {self.data.dtype}", f"{value.dtype}")
        if self.is_torch:
            if not isinstance(value, torch.Tensor):
                value = torch.from_numpy(np.array(value))
            return value.to(device=self.data.device, dtype=self.dtype)
        if isinstance(value, torch.Tensor):
            value = value.to(self.dtype).cpu().numpy()
        return value.astype(self.data.dtype, copy=False)

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


def final_observations(
    columns: dict[str, Column], dict_obs: bool, info: Mapping[str, Any] | None, ended: np.ndarray
) -> dict[int, dict[str, Any]]:
    """Env -> its final observation from ``info["final_obs"]`` (``"same_step"``), checked.

    ``ended``: the envs whose episode ended; ``columns``: the observation fields, of a dict
    observation if ``dict_obs``. Raises (``InvalidArgumentError``) for a missing entry, or one
    of other fields, kind or per-env shape.
    """
    final = None if info is None else info.get("final_obs")
    present = None if info is None else info.get("_final_obs")
    finals: dict[int, dict[str, Any]] = {}
    for env in ended.tolist():
        entry = None
        if final is not None and (present is None or bool(present[env])):
            entry = final[env]
        if entry is None:
            rule = "holding info['final_obs'][i] for every env i that ended"
            raise must("info", rule, f"none for env {env}")
        param = f"info['final_obs'][{env}]"
        got = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
        if dict_obs != isinstance(entry, Mapping) or (dict_obs and set(entry) != set(columns)):
            raise must(param, f"one env's observation of fields {list(columns)}", got)
        parts = entry if dict_obs else {"observation": entry}
        finals[env] = {
            name: column.conform(param, parts[name], per_env=True)
            for name, column in columns.items()
        }
    return finals


def observation_batches(
    observation: Any, num_envs: int, columns: dict[str, Column] | None, dict_obs: bool
) -> dict[str, Any]:
    """Field name -> ``[num_envs, ...]`` batch of ``observation`` (an array or a dict).

    Checked against the fields ``columns`` (of a dict observation if ``dict_obs``) once the
    first reset fixed them (else None); refused as `as_batch` refuses, for a non-str key, or
    for other fields, per-env shapes or dtypes.
    """
    if isinstance(observation, Mapping):
        obs = {}
        for key, value in observation.items():
            if not isinstance(key, str):
                raise wrong_type("observation keys", "str", key)
            obs[key] = as_batch(f"observation[{key!r}]", value, num_envs)
    else:
        obs = {"observation": as_batch("observation", observation, num_envs)}
    if columns is None:
        return obs
    if isinstance(observation, Mapping) != dict_obs or set(obs) != set(columns):
        raise must("observation", f"of the first reset's fields {list(columns)}", list(obs))
    return {
        name: column.conform(f"observation[{name!r}]" if dict_obs else name, obs[name])
        for name, column in columns.items()
    }
