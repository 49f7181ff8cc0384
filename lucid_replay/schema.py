"""`Schema`: the field names, per-step shapes and dtypes a buffer stores.

One value serves every place that compares data against the buffer's layout: `add` (an
episode's fields), `write_back` (values for one field), declared schemas and checkpoints.
This module also owns which dtypes can be stored and which field names are taken by the
per-record entries of a window batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from lucid_replay.batch import PER_RECORD
from lucid_replay.errors import (
    InvalidArgumentError,
    SchemaDtypeError,
    SchemaError,
    must,
    must_have,
    wrong_kind,
    wrong_type,
)
from lucid_replay.fields import Field

__all__: list[str] = []  # internal module

FieldSpec = tuple[tuple[int, ...], torch.dtype]
Stack = tuple[int, str]  # a stacked field's frames per record and padding (see `Field`)

# Dtypes that every storage path handles: slice and indexed copies, gathers (also strided,
# across the ring's seam), equality, `torch.save`, on CPU and CUDA.
SUPPORTED_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
)
_SUGGESTED = {
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
    torch.uint64: torch.int64,
}

# Names a window batch gives its per-record entries in `WindowBatch.flat` and `to_tensordict`
# (and the window index those add); a stored field of the same name would be shadowed there,
# so none may take one.
RESERVED_NAMES = tuple(sorted([*PER_RECORD, "sequence_id"]))

_DTYPES_BY_NAME = {str(dtype): dtype for dtype in SUPPORTED_DTYPES}


def casts_same_kind(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether numpy's ``same_kind`` rule casts ``source`` to ``target`` (bfloat16: a float)."""
    try:
        return bool(np.can_cast(_numpy_kind(source), _numpy_kind(target), casting="same_kind"))
    except TypeError:  # a dtype with no numpy counterpart of its kind
        return False


def _numpy_kind(dtype: torch.dtype) -> np.dtype[Any]:
    if dtype == torch.bfloat16:  # no numpy bfloat16; float32 is of the same kind
        return np.dtype(np.float32)
    return np.dtype(str(dtype).removeprefix("torch."))


def _check_cast(name: str, values: torch.Tensor, target: torch.dtype) -> None:
    """Refuse ``values`` that the cast to ``target`` would wrap or overflow (see `check_casts`)."""
    if values.dtype == torch.bool or target == torch.bool:
        return  # bool casts only to and from where every value is kept
    if not (target.is_floating_point or target.is_complex):  # integer target: range check
        info = torch.iinfo(target)
        low, high = _extremes(values)
        if low < info.min or high > info.max:
            got = low if low < info.min else high
            raise must(f"steps[{name!r}]", f"in [{info.min}, {info.max}] to cast to {target}", got)
        return
    largest = torch.finfo(target).max  # of the real parts, for a complex target
    parts = torch.view_as_real(values) if values.is_complex() else values
    magnitudes = parts.abs() if parts.is_floating_point() else parts.abs().double()
    finite = torch.where(torch.isfinite(magnitudes), magnitudes, 0)
    peak = float(finite.max())
    if peak > largest:
        raise must_have(
            f"steps[{name!r}]",
            f"finite values of magnitude <= {largest:g} to cast to {target}",
            f"{peak:g}, which would become inf",
        )


def _extremes(values: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest of integer ``values``, as Python ints."""
    if values.dtype in (torch.uint16, torch.uint32, torch.uint64):  # torch reduces none of them
        array = values.detach().cpu().numpy()
        return int(array.min()), int(array.max())
    return int(values.min()), int(values.max())


class Schema(Mapping[str, FieldSpec]):
    """Field name -> ``(per-step shape, dtype)``; immutable, compares equal to a plain dict.

    Field order does not matter: two schemas with the same entries are equal. ``stacks``:
    name -> ``(frames, pad)`` of the fields a gathered batch reads as frame stacks (`Field`
    with ``stack > 1``); ``codecs``: name -> codec of the fields kept compressed; the mapping
    itself always says what one step stores.
    """

    __slots__ = ("_codecs", "_fields", "_gathered", "_hash", "_stacks")

    def __init__(
        self,
        fields: Mapping[str, FieldSpec],
        stacks: Mapping[str, Stack] | None = None,
        codecs: Mapping[str, str] | None = None,
    ) -> None:
        self._fields = {name: (tuple(shape), dtype) for name, (shape, dtype) in fields.items()}
        self._stacks = dict(stacks or {})
        self._codecs = dict(codecs or {})
        self._hash: int | None = None  # computed once: every draw looks up its batch layout
        self._gathered: Schema | None = None if self._stacks else self

    @classmethod
    def of(cls, steps: Mapping[str, torch.Tensor]) -> Schema:
        """The schema of per-step tensors ``steps`` (``[T, *field_shape]`` each)."""
        return cls({name: (tuple(t.shape[1:]), t.dtype) for name, t in steps.items()})

    @classmethod
    def declared(cls, fields: Any) -> Schema:
        """A schema written by a user: name -> ``(shape, dtype)`` with a sequence shape, or `Field`.

        Raises
        ------
        TypeError
            If ``fields`` is not such a mapping.
        SchemaError, SchemaDtypeError
            If a name is reserved or a dtype cannot be stored (see `check_storable`).
        """
        if isinstance(fields, Schema) and fields:  # a checkpoint's (see `from_state`)
            fields.check_storable()
            return fields
        if not isinstance(fields, Mapping) or not fields:
            raise wrong_type("schema", "a non-empty mapping of name -> (shape, dtype)", fields)
        parsed: dict[str, FieldSpec] = {}
        stacks: dict[str, Stack] = {}
        codecs: dict[str, str] = {}
        for name, spec in fields.items():
            if not isinstance(name, str):
                raise wrong_type("schema names", "str", name)
            if isinstance(spec, Field):  # checked by itself
                parsed[name] = (spec.shape, spec.dtype)
                if spec.stack > 1:
                    stacks[name] = (spec.stack, spec.stack_pad)
                if spec.codec is not None:
                    codecs[name] = spec.codec
                continue
            try:
                shape, dtype = spec
                dims = tuple(shape)
            except (TypeError, ValueError):
                raise wrong_type(
                    f"schema[{name!r}]", "a (shape tuple, torch dtype) pair or a Field", spec
                ) from None
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in dims):
                raise must(f"schema[{name!r}] shape", "a tuple of ints >= 0", shape)
            if not isinstance(dtype, torch.dtype):
                raise wrong_type(f"schema[{name!r}] dtype", "a torch.dtype", dtype)
            parsed[name] = (dims, dtype)
        schema = cls(parsed, stacks, codecs)
        schema.check_storable()
        return schema

    @property
    def stacks(self) -> Mapping[str, Stack]:
        """Name -> ``(frames, pad)`` of the stacked fields (empty: none), read only."""
        return self._stacks

    @property
    def codecs(self) -> Mapping[str, str]:
        """Name -> codec of the fields kept compressed (empty: none), read only."""
        return self._codecs

    @property
    def gathered(self) -> Schema:
        """The per-record layout of a gathered batch: ``[frames, *shape]`` for stacked fields."""
        if self._gathered is None:
            self._gathered = Schema(
                {
                    name: ((self._stacks[name][0], *shape), dtype)
                    if name in self._stacks
                    else (shape, dtype)
                    for name, (shape, dtype) in self._fields.items()
                }
            )
        return self._gathered

    def field(self, name: str) -> Field:
        """Field ``name`` as a `Field` (its stack included)."""
        shape, dtype = self._fields[name]
        stack, pad = self._stacks.get(name, (1, "same"))
        return Field(shape, dtype, stack=stack, stack_pad=pad, codec=self._codecs.get(name))

    # ------------------------------------------------------------------------ Mapping
    def __getitem__(self, name: str) -> FieldSpec:
        return self._fields[name]

    def specs(self) -> dict[str, FieldSpec]:
        """The fields as a plain dict, read only (iterated without the `Mapping` machinery)."""
        return self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __eq__(self, other: object) -> bool:
        # `add` compares every episode's schema with the buffer's: a dict comparison, not
        # Mapping's generic one (which builds two dicts).
        if isinstance(other, Schema):
            return (
                self._fields == other._fields
                and self._stacks == other._stacks
                and self._codecs == other._codecs
            )
        if not isinstance(other, Mapping):
            return False
        if not (self._stacks or self._codecs) and not any(
            isinstance(v, Field) for v in other.values()
        ):
            return self._fields == dict(other.items())
        try:
            return self == Schema.declared(other)
        except (TypeError, ValueError):
            return False

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(
                (
                    frozenset(self._fields.items()),
                    frozenset(self._stacks.items()),
                    frozenset(self._codecs.items()),
                )
            )
        return self._hash

    def __reduce__(
        self,
    ) -> tuple[type[Schema], tuple[dict[str, FieldSpec], dict[str, Stack], dict[str, str]]]:
        # The fields only: a hash computed in another process (salted string hashes) is
        # wrong in this one.
        return Schema, (self._fields, self._stacks, self._codecs)

    def __repr__(self) -> str:
        special = self._stacks.keys() | self._codecs.keys()
        if not special:
            return repr(self._fields)  # reads as the plain mapping it compares equal to
        return repr({n: self.field(n) if n in special else s for n, s in self.items()})

    # ------------------------------------------------------------------------- checks
    def check_storable(self) -> None:
        """Refuse reserved field names and dtypes the buffer cannot store.

        Raises
        ------
        SchemaError
            For a field named like a per-record entry of a window batch (``is_init``, ...).
        SchemaDtypeError
            For a dtype outside `SUPPORTED_DTYPES` (for example ``uint16``).
        """
        for name, (_, dtype) in self._fields.items():
            if name in RESERVED_NAMES:
                raise SchemaError(
                    f"field names must not be one of the per-record entries of a window batch "
                    f"{list(RESERVED_NAMES)}, got {name!r}: rename the field"
                )
            if dtype not in SUPPORTED_DTYPES:
                instead = _SUGGESTED.get(dtype)
                advice = f"; store it as {instead}" if instead is not None else ""
                raise SchemaDtypeError(
                    f"field {name!r} must have a dtype the buffer can store, gather and save "
                    f"({', '.join(str(d) for d in SUPPORTED_DTYPES)}), got {dtype}{advice}"
                )

    def check(self, incoming: Mapping[str, FieldSpec], *, cast: bool = False) -> None:
        """Refuse an episode schema ``incoming`` that differs from this one.

        With ``cast=True`` (a declared schema) a dtype may differ where numpy's
        ``same_kind`` rule casts it to this schema's (float64 to float32, int64 to float32,
        but not float to int).

        Raises
        ------
        SchemaError
            For missing or extra fields, or another per-step shape.
        SchemaDtypeError
            For another dtype (one that does not cast, with ``cast=True``).
        """
        if incoming == self:
            return
        if set(incoming) != set(self):
            missing, extra = sorted(set(self) - set(incoming)), sorted(set(incoming) - set(self))
            raise SchemaError(
                f"episode fields must be {sorted(self)}, got missing {missing}, extra {extra}"
            )
        for name, (shape, dtype) in self.items():
            got_shape, got_dtype = incoming[name]
            if got_shape != shape:
                raise SchemaError(
                    f"field {name!r} must have per-step shape {shape}, got {got_shape}"
                )
            if got_dtype != dtype and not (cast and casts_same_kind(got_dtype, dtype)):
                rule = f"a dtype that casts to {dtype} (same kind)" if cast else f"dtype {dtype}"
                raise SchemaDtypeError(f"field {name!r} must have {rule}, got {got_dtype}")

    def check_casts(self, steps: Mapping[str, torch.Tensor]) -> None:
        """Refuse ``steps`` whose cast to this schema's dtypes would change a value.

        For the fields whose dtype differs from this schema's (a declared schema's
        ``same_kind`` casts, checked by `check` first): an integer must lie in the range of
        an integer dtype it narrows to, and a finite number must not exceed the largest
        finite value of a floating or complex dtype (it would become ``inf``). Rounding to
        the nearer representable value (float64 to float32, large ints to float) is a cast,
        not a change; NaN and infinities stay what they are. O(T) per cast field.

        Raises
        ------
        InvalidArgumentError
            Naming the field, the declared dtype's range and the first value outside it.
        """
        for name, values in steps.items():
            target = self._fields[name][1]
            if values.dtype != target:
                _check_cast(name, values, target)

    def check_values(self, name: Any, values: Any, leading: tuple[int, ...]) -> None:
        """Refuse ``values`` for field ``name`` unless a tensor of ``[*leading, *shape]``.

        Raises
        ------
        InvalidArgumentError
            For an unknown field or another shape.
        TypeError
            For a value that is not a tensor, or another dtype (`SchemaDtypeError`).
        """
        if not isinstance(name, str) or name not in self._fields:
            raise must("name", f"a stored field {sorted(self)}", name)
        shape, dtype = self._fields[name]
        if not isinstance(values, torch.Tensor):
            raise wrong_kind("values", "a torch.Tensor", type(values).__name__)
        expected = (*leading, *shape)
        if tuple(values.shape) != expected:
            raise must("values", f"of shape {expected}", tuple(values.shape))
        if values.dtype != dtype:
            raise SchemaDtypeError(f"values must have dtype {dtype}, got {values.dtype}")

    # ------------------------------------------------------------------- checkpoints
    def to_state(self) -> dict[str, list[Any]]:
        """Plain containers for a checkpoint: name -> ``[shape list, dtype name]``.

        A stacked field's entry has a third item, `Field.to_state`'s dict.
        """
        state: dict[str, list[Any]] = {}
        for name, (shape, dtype) in self.items():
            entry: list[Any] = [list(shape), str(dtype)]
            if name in self._stacks or name in self._codecs:
                entry.append(self.field(name).to_state())
            state[name] = entry
        return state

    @classmethod
    def from_state(cls, state: Any) -> Schema:
        """Parse `to_state` output; `ValueError`/`TypeError` for anything else."""
        if not isinstance(state, Mapping):
            raise wrong_kind("schema", "a mapping", type(state).__name__)
        fields: dict[str, FieldSpec] = {}
        stacks: dict[str, Stack] = {}
        codecs: dict[str, str] = {}
        for name, entry in state.items():
            if (
                not isinstance(name, str)
                or not isinstance(entry, list | tuple)
                or len(entry) not in (2, 3)
            ):
                raise must(f"schema[{name!r}]", "a [shape, dtype] pair (and a field dict)", entry)
            shape, dtype_name = entry[:2]
            if not isinstance(shape, list | tuple) or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape
            ):
                raise must(f"schema[{name!r}] shape", "a list of ints >= 0", shape)
            dtype = _DTYPES_BY_NAME.get(str(dtype_name))
            if dtype is None:
                raise must_have(
                    f"schema[{name!r}] dtype", "a storable torch dtype", repr(dtype_name)
                )
            fields[name] = (tuple(shape), dtype)
            if len(entry) == 3:
                field = _field_of(name, (tuple(shape), dtype), entry[2])
                if field.stack > 1:
                    stacks[name] = (field.stack, field.stack_pad)
                if field.codec is not None:
                    codecs[name] = field.codec
        schema = cls(fields, stacks, codecs)
        schema.check_storable()
        return schema


def _field_of(name: str, spec: FieldSpec, options: Any) -> Field:
    """A checkpoint's field dict (`Field.to_state`), checked by `Field`."""
    keys = ("stack", "stack_pad", "codec")
    if not isinstance(options, Mapping) or set(options) != set(keys):
        raise must(f"schema[{name!r}] field", f"a dict of {list(keys)}", options)
    try:
        field = Field(*spec, **{key: options[key] for key in keys})
    except (InvalidArgumentError, TypeError) as error:
        raise must_have(
            f"schema[{name!r}] field", "a valid Field", f"{options!r} ({error})"
        ) from None
    return field
