"""What a buffer reports about itself: the `SequenceReplay` methods of counters and memory.

`memory_report` gives, per field, the bytes of the stored steps as they are read back
(``raw_bytes``, one frame per step for a stacked field), the bytes that hold them
(``stored_bytes``), and the bytes of decoded blocks kept for gathers (``cache_bytes``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lucid_replay.core import ReplayCore

__all__: list[str] = []  # internal module

_KEYS = ("raw_bytes", "stored_bytes", "cache_bytes")


class Reporting:
    """The reporting methods of `SequenceReplay` (documented there)."""

    _lock: Any
    _core: ReplayCore

    def stats(self) -> dict[str, int]:
        """Counters since construction: adds, evictions, retirements, draws.

        ``epoch_skipped``: anchors epochs skipped because they were evicted (see `epoch`),
        counted by this buffer object (a checkpoint does not keep it).
        """
        with self._lock:
            return self._core.stats()

    def memory_usage(self) -> dict[str, int]:
        """Bytes the buffer holds: its data, and the metadata beyond it.

        ``data_bytes`` is the ring (``capacity`` steps of every field), ``table_bytes`` the
        episode table and ``tree_bytes`` the cached sum trees: per episode row, nothing per
        transition.
        """
        with self._lock:
            return {
                **self._core.store.memory(),
                "tree_bytes": self._core.sampler.trees.tree_bytes(),
            }

    def memory_report(self) -> dict[str, dict[str, Any]]:
        """Bytes of the stored data now, per field and in total.

        Returns
        -------
        dict
            ``{"fields": {name: {"raw_bytes", "stored_bytes", "cache_bytes"}}, "total":
            {"raw_bytes", "stored_bytes", "cache_bytes"}}``, ints:

            - ``raw_bytes``: the stored steps (``len(buffer)``) uncompressed, one frame per
              step (a ``Field(..., stack=k)`` stores one frame per step, not ``k``);
            - ``stored_bytes``: the memory that holds them. A raw field is allocated whole
              at the first add (``capacity`` steps, in memory or in its file), so this is
              that allocation, whether the steps fill it or not (``raw_bytes <=
              stored_bytes``, equal once the buffer is full); 0 before the first add. A
              compressed field (``Field(codec=...)``) holds its compressed blocks of 32
              slots, plus the one block being written, raw (with ``storage="memmap"`` the
              blocks are in a file, which holds this many bytes, each frame rounded up to
              whole pages);
            - ``cache_bytes``: the compressed field's decoded blocks kept for gathers (at
              most the buffer's ``cache_bytes`` for all fields together); 0 for raw fields.

            Fields are listed once the schema is known (declared, or fixed by the first
            add). The episode table's few dozen bytes per episode are not counted. O(fields).

        Examples
        --------
        >>> import torch
        >>> from lucid_replay import Episode, Field, SequenceReplay
        >>> obs = Field((84, 84), torch.uint8, stack=4)
        >>> buffer = SequenceReplay(100, schema={"obs": obs})
        >>> frames = torch.zeros(10, 84, 84, dtype=torch.uint8)
        >>> buffer.add(Episode({"obs": frames}))
        0
        >>> buffer.memory_report()["fields"]["obs"]
        {'raw_bytes': 70560, 'stored_bytes': 705600, 'cache_bytes': 0}
        """
        with self._lock:
            store = self._core.store
            stored_steps = store.table.num_transitions
            fields: dict[str, dict[str, int]] = {}
            compressed = store.ring.compressed
            for name, (shape, dtype) in (store.schema or {}).items():
                step_bytes = math.prod(shape) * dtype.itemsize
                holding = 0 if store.ring.fields.get(name) is None else store.ring.capacity
                stored, cached = holding * step_bytes, 0
                if compressed is not None and name in compressed.specs:
                    stored, cached = compressed.stored_bytes(name), compressed.cache_bytes(name)
                fields[name] = {
                    "raw_bytes": stored_steps * step_bytes,
                    "stored_bytes": stored,
                    "cache_bytes": cached,
                }
        total = {key: sum(entry[key] for entry in fields.values()) for key in _KEYS}
        return {"fields": fields, "total": total}
