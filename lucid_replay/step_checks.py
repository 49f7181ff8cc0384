"""Whether appended steps are exactly as stored: the fast path of `EpisodeStream.append`.

An actor appends dicts of tensors with the buffer's fields, dtypes and per-step shapes, at
the same few step counts, call after call. `StoredSteps` holds what such a dict is compared
with, built once per stream and schema: the field names, dtypes, which dtypes can require
grad (floating and complex ones; no other tensor can), and the full shapes ``[n, ...]`` of
the step counts already seen. A dict is then checked field by field with one comparison of
its shape, instead of slicing the shape and comparing its parts. Every attribute of every
tensor is still read on every call (a tensor's dtype and shape can change in place); only
what is derived from the schema is cached. Anything else returns 0, and the full path
converts, checks and refuses it with the reason.
"""

from __future__ import annotations

import torch

from lucid_replay.schema import Schema

__all__: list[str] = []  # internal module

_MAX_COUNTS = 16  # step counts whose full shapes are kept (an actor uses one or two)


class StoredSteps:
    """The stored fields of one schema, to compare appended steps with (see the module)."""

    def __init__(self, schema: Schema, capacity: int) -> None:
        self.schema, self.capacity = schema, capacity
        specs = schema.specs()
        self._names = tuple(specs)
        self._dtypes = tuple(dtype for _, dtype in specs.values())
        self._graded = tuple(dtype.is_floating_point or dtype.is_complex for dtype in self._dtypes)
        self._shapes = tuple(tuple(shape) for shape, _ in specs.values())
        self._full: dict[int, tuple[torch.Size, ...]] = {}

    def count(self, steps: object) -> int:
        """The step count of ``steps`` if exactly as stored, else 0.

        As stored: a dict of exactly the stored fields, tensors of the stored dtypes and
        per-step shapes, not requiring grad, with one step count ``1 .. capacity``.
        """
        names = self._names
        if type(steps) is not dict or len(steps) != len(names):
            return 0
        full: tuple[torch.Size, ...] | None = None
        for at, name in enumerate(names):
            values = steps.get(name)
            if type(values) is not torch.Tensor or values.dtype is not self._dtypes[at]:
                return 0
            if self._graded[at] and values.requires_grad:
                return 0
            size = values.shape
            if full is None:  # the first field gives the step count
                if not size:
                    return 0
                full = self._full.get(size[0]) or self._full_shapes(size[0])
                if full is None:
                    return 0
            if size != full[at]:
                return 0
        return 0 if full is None else full[0][0]

    def _full_shapes(self, count: int) -> tuple[torch.Size, ...] | None:
        """The shapes ``[count, ...]`` of the fields (None: no valid step count)."""
        if not 1 <= count <= self.capacity:
            return None
        if len(self._full) >= _MAX_COUNTS:
            self._full.clear()
        full = self._full[count] = tuple(torch.Size((count, *shape)) for shape in self._shapes)
        return full


def stored_steps(
    cached: StoredSteps | None, schema: Schema | None, capacity: int
) -> StoredSteps | None:
    """``cached`` if built for ``schema`` and ``capacity``, else a new one (or None).

    None while the buffer has no schema yet (nothing stored, none declared).
    """
    if cached is not None and cached.schema is schema and cached.capacity == capacity:
        return cached
    return None if schema is None else StoredSteps(schema, capacity)
