"""Saving and loading a buffer: the `SequenceReplay` methods of persistence.

`lucid_replay.checkpoint` holds the format; these methods take the buffer's lock and move a
`Snapshot` between the buffer's core and that format. `state_dict` copies the stored data;
`save` (and a shard's file, through `write`) writes them to the file straight from the ring,
field by field, so that a save needs no second copy of them in memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lucid_replay import checkpoint, mapped_files
from lucid_replay.errors import CheckpointError, must
from lucid_replay.selectors import checked_selector, selector_state

if TYPE_CHECKING:
    from lucid_replay.core import ReplayCore

__all__: list[str] = []  # internal module

_ReplayT = TypeVar("_ReplayT", bound="Checkpointing")


class Checkpointing:
    """The persistence methods of `SequenceReplay` (documented there)."""

    _lock: Any
    _core: ReplayCore
    _capacity: int
    _device: torch.device

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the buffer exactly (tensors on CPU)."""
        with self._lock:
            return checkpoint.pack(self._snapshot())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict`; on any error the buffer is left unchanged.

        Raises
        ------
        CheckpointError
            For a state of another class, another configuration, or one that breaks an
            invariant of the episode table, the data, the counters, the RNG state or the
            priorities.
        """
        with self._lock:
            checkpoint.check_header(state, type(self).__name__)
            snapshot = checkpoint.unpack(
                state,
                device=self._device,
                capacity=self._capacity,
                allocator=self._core.store.allocator,  # where this buffer keeps its fields
                cache_bytes=self._core.store.ring.cache_bytes,
            )
            self._core.restore(snapshot, self._config())

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the buffer to ``path`` atomically (a temporary file flushed to disk, a rename).

        The file carries a checksum of its contents: a corrupted file is refused by `load`.
        The stored data go to the file straight from the buffer's storage, uncopied; other
        threads' calls wait until the file is written.
        """
        write(self, path)

    @classmethod
    def load(
        cls: type[_ReplayT],
        path: str | os.PathLike[str],
        *,
        device: torch.device | str | None = None,
    ) -> _ReplayT:
        """Read a buffer saved by `save`; returns the class that was saved.

        Raises
        ------
        CheckpointError
            (a ``ValueError``) for a file that is not a buffer, is truncated or corrupt
            (its checksum fails), has an unknown format version or a bad configuration.
        """
        state = checkpoint.read(path)
        buffer = checkpoint.construct(state, cls, device)
        buffer.load_state_dict(state)
        return buffer

    def sync(self) -> None:
        """Make the buffer's ``directory`` a checkpoint of it now (``storage="memmap"`` only).

        Flushes the mapped fields to their files and writes everything else (the episode
        table, counters, the random stream, priorities) beside them, atomically: O(table)
        time, no data copied (a compressed field writes its one block being written, as a
        compressed frame). `open` returns the buffer as of the last ``sync``.

        Raises
        ------
        InvalidArgumentError
            On a buffer with ``storage="memory"`` (use `save`).
        """
        with self._lock:
            allocator = self._core.store.allocator
            if not isinstance(allocator, mapped_files.FileBacked):
                raise must("storage", "'memmap' to sync (else call save)", "memory")
            state = checkpoint.pack(self._snapshot(), copy=False)
            state["data"] = {}  # the files hold them
            if self._core.store.ring.compressed is not None:
                self._core.store.ring.compressed.persist()  # its raw head block too
            mapped_files.sync_state(allocator, state, self._core.store.table.oldest_offset)

    @classmethod
    def open(cls: type[_ReplayT], directory: str | os.PathLike[str]) -> _ReplayT:
        """The buffer synced in ``directory`` (`sync`), with its storage still in those files.

        Returns the class that was synced, exactly as of the last `sync` (its draws
        included): steps added after it are gone, and the ids issued after it may be issued
        again. The one exception is a synced step that a later add overwrote in its file
        (an add into a full buffer reuses the oldest slots): the synced episodes (segments)
        holding such steps are evicted, oldest first, as capacity would have evicted them.
        The buffer goes on using the directory.

        Raises
        ------
        CheckpointError
            When ``directory`` holds no synced buffer, or a corrupt or inconsistent one.
        """
        state, allocator, guarded = mapped_files.read_state(directory)
        saved, mapped = state.get("schema") or {}, allocator.names_to_map()
        if not isinstance(saved, Mapping) or (mapped and set(saved) != set(mapped)):
            raise CheckpointError(
                f"checkpoint field files must be the schema's fields {sorted(saved)}, got "
                f"{sorted(mapped)}"
            )
        overrides = {"storage": "memmap", "directory": allocator.directory}
        with mapped_files.reopening(allocator):
            buffer = checkpoint.construct(state, cls, None, overrides)
        with buffer._lock:
            core = buffer._core
            snapshot = checkpoint.unpack(
                state,
                device=buffer._device,
                capacity=buffer._capacity,
                allocator=allocator,
                in_place=True,
            )
            table = snapshot.table
            if table.num_transitions and not mapped:
                raise CheckpointError("checkpoint field files must hold its steps, got none")
            compressed = snapshot.ring.compressed
            span = table.next_offset - table.oldest_offset
            unwritten = [] if compressed is None else compressed.missing(table.oldest_offset, span)
            if table.num_transitions and unwritten:
                raise CheckpointError(
                    f"compressed field files must hold every stored block, got blocks never "
                    f"written for {unwritten}"
                )
            core.restore(snapshot, buffer._config())
            store, table = core.store, core.store.table
            allocator.guard_from = table.oldest_offset + allocator.capacity
            lost_below = guarded - buffer._capacity  # steps the files no longer hold
            if lost_below > table.oldest_offset:
                store.evict(table.count_to_evict(buffer._capacity, guarded - table.next_offset))
                store.reclaim_retired()
        return buffer

    def _snapshot(self) -> checkpoint.Snapshot:
        return self._core.snapshot(type(self).__name__, self._config())

    def _config(self) -> dict[str, Any]:
        store = self._core.store
        declared = store.schema if store.declared else None
        config = {
            "capacity": self._capacity,
            "device": str(self._device),
            "unit": self._core.sampler.unit,
            "max_times_sampled": self._core.sampler.reuse_limit,
            "schema": declared.to_state() if declared is not None else None,
        }
        if store.segments is not None:  # unsegmented configurations stay as they were
            config["segment_length"] = store.segments.segment_length
            if self._core.priorities is not None:
                config["priority_unit"] = store.segments.priority_unit
        priorities = self._core.priorities
        alpha = None if priorities is None else priorities.alpha
        selector = selector_state(self._core.law, checked_selector(None, alpha, type(self)))
        if selector is not None:  # configurations of default selectors stay as they were
            config["selector"] = selector
        return config if priorities is None else {**config, **priorities.config()}


def write(
    buffer: Checkpointing, path: str | os.PathLike[str], entries: Mapping[str, Any] | None = None
) -> None:
    """Write ``buffer``'s checkpoint, with ``entries`` beside its state, to ``path``.

    Holds the buffer's lock until the file is written: the state is packed without copies
    (`checkpoint.pack`), so its data are the ring's memory, which no call may change meanwhile.
    """
    with buffer._lock:
        state = checkpoint.pack(buffer._snapshot(), copy=False)
        checkpoint.write(path, {**state, **(entries or {})})
