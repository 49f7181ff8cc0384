"""`ShardDraws`: a shard's draws for its coordinator, and what it reports before one.

`info` tells the coordinator (`lucid_replay.distributed.coordination`) what a draw would
choose from: the log masses of each law, the draws the reuse limit leaves, and why nothing
can be drawn. `draw` makes the draws the coordinator assigned to this shard, from its own
tree and random stream (`ShardHooks.draw_probed`), and returns them packed with global ids:
gathered (``transport="object"``, `lucid_replay.distributed.transport`) or as record
locations the client gathers itself (``"shared"``, `lucid_replay.distributed.sharing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

import lucid_replay.distributed.sharing as sharing
import lucid_replay.distributed.transport as transport
from lucid_replay import engine
from lucid_replay.distributed.shard_base import ShardBase
from lucid_replay.trees import episode_anchors
from lucid_replay.window import Window

__all__: list[str] = []  # internal module


class ShardDraws(ShardBase):
    """The drawing calls of `ReplayShard` (mixed in; see `ShardBase`)."""

    def info(
        self,
        window: Window,
        laws: tuple[Any, ...],
        updates: list[Any] | None = None,
        masses: list[float] | None = None,
    ) -> dict[str, Any]:
        """What the coordinator needs before a draw of ``window`` by each of ``laws``.

        ``updates``: priority updates that ride this request (``(ids, errors)`` checked by
        the client, applied first, in order); their `update` replies are ``updated``.
        ``masses``: the log masses of ``laws`` as `draw` just read them, kept when no update
        came between.
        """
        updated = [self.update(*update) for update in updates or ()]
        buffer = self.buffer
        with buffer._lock:
            log_masses = masses if masses is not None and not updated else None
            if log_masses is None:
                log_masses = [self.hooks.log_mass(window, law) for law in laws]
            info = {
                "log_masses": log_masses,
                "log_mass": max(log_masses),
                "draws_left": self.hooks.draws_left(window),
                "episodes": buffer.num_episodes,
                "updated": updated,
            }
            if info["log_mass"] == -math.inf:  # what a refusal names (`draw.check`): O(E)
                info |= self._why_empty(window)
            return info

    def _why_empty(self, window: Window) -> dict[str, Any]:
        """The longest stored episode, and whether any has an anchor (reuse limit aside)."""
        table = self.buffer._core.store.table
        slots, owners = table.stored_slots(), table.owners()
        first, total = engine.tensor(owners.first_stored), engine.tensor(owners.total)
        at = engine.tensor(slots)
        lengths = total[at] - first[at]  # each stored episode's stored steps
        extra = window.open_anchor_span - window.anchor_span
        anchors = engine.tensor(episode_anchors(owners, slots, window.anchor_span, extra))
        longest = int(lengths.max()) if lengths.numel() else 0
        return {"longest": longest, "eligible": bool((anchors > 0).any())}

    def draw(
        self,
        count: int,
        window: Window,
        law: Any,
        chunks: bool,
        laws: tuple[Any, ...],
        located: bool = False,
        report: bool = False,
        updates: Any = None,
    ) -> dict[str, Any]:
        """``count`` draws by ``law``; the kept ones packed, their priorities, the kept mask.

        Also each kept anchor's probability in this shard under each of ``laws``
        (``chances``, float64 ``[K, kept]``), the ``log`` totals they are relative to
        (``log_totals``, before the draw) and after it (``log_masses``); see
        `ShardHooks.draw_probed`. A shard with nothing to draw from (its episodes were
        evicted or retired since the coordinator read its mass) keeps none, leaving its
        random stream untouched. ``located`` (windows, ``transport="shared"``): ``batch``
        holds where the records are, for the client to gather (`sharing.located`).
        ``report`` (a stream's draw): ``updates`` are applied after the draw, and ``info``
        is what `info` says then, the masses the stream's next draw starts from.
        """
        evicted = self._counters()[2]
        # The masses are read once before the draw and once after (calls run one at a time).
        totals = [self.hooks.log_mass(window, part) for part in laws]
        mass = totals[laws.index(law)] if law in laws else self.hooks.log_mass(window, law)
        if mass == -math.inf:
            reply: dict[str, Any] = {"batch": None, "priorities": None}
            reply["kept"] = np.zeros(count, dtype=bool)
        else:
            reply = self._drawn(count, window, law, chunks, laws, located, totals)
        reply["log_masses"] = [self.hooks.log_mass(window, part) for part in laws]
        if self._counters()[2] != evicted:  # retired episodes reclaimed
            self._report()
        if report:
            reply["info"] = self.info(window, laws, updates, reply["log_masses"])
        return reply

    def _drawn(self, count: int, window: Window, law: Any, *kinds: Any) -> dict[str, Any]:
        """`draw` from a shard with mass (``kinds``: chunks, laws, located, log totals)."""
        chunks, laws, located, totals = kinds
        locate: Callable[[Any], Any] | None = None
        if located and self.shared is not None:
            store = self.buffer._core.store

            def locate_records(anchors: Any) -> dict[str, Any]:
                return sharing.located(store, anchors, window)

            locate = locate_records

        drawn = self.hooks.draw_probed(count, window, law, laws, chunks, locate, totals)
        batch, priorities, kept, chances, log_totals = drawn
        if locate is not None:
            packed = batch["meta"]
            assert self.shared is not None
            batch["shard"], batch["epoch"] = self.index, self.shared.epoch
            batch["descriptor"] = sharing.descriptor(self.buffer._core.store.ring, self.shared)
            # A small reply travels inline. Compacted first: ids made global after it are
            # the anchors' and the few records' that are not their anchor's.
            sharing.compact(packed, window)
        else:
            packed = transport.pack_batch(batch)
        for key in transport.ID_KEYS:
            if key in packed:
                packed[key] = self._global(packed[key])
        if sharing.ODD_IDS in packed:
            odd, values, dtype = packed[sharing.ODD_IDS]
            packed[sharing.ODD_IDS] = (odd, self._global(values), dtype)
        if transport.SEGMENT_KEY in packed:
            packed[transport.SEGMENT_KEY] = self._global_segments(packed[transport.SEGMENT_KEY])
        return {
            "batch": batch if locate is not None else packed,
            "priorities": None if priorities is None else priorities.numpy(),
            "kept": kept.numpy(),
            "chances": chances,
            "log_totals": log_totals,
        }
