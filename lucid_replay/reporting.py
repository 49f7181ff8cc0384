"""What a buffer reports about itself: the `SequenceReplay` methods of counters and memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lucid_replay.core import ReplayCore

__all__: list[str] = []  # internal module


class Reporting:
    """The reporting methods of `SequenceReplay` (documented there)."""

    _lock: Any
    _core: ReplayCore

    def stats(self) -> dict[str, int]:
        """Counters since construction: adds, evictions, retirements, draws."""
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
