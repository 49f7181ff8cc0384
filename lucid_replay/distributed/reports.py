"""The `ShardedReplay` client's reports about stored bytes: `ClientReports.memory_report`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lucid_replay.distributed.calls as calls

__all__: list[str] = []  # internal module

_KEYS = ("raw_bytes", "stored_bytes", "cache_bytes")


class ClientReports:
    """What a sharded replay holds, summed over its shards."""

    _shards: list[Any]
    _call_handles: Callable[[], list[Any]]  # `ClientTransport._call_handles`

    def _check_open(self) -> None: ...  # `ClientLife`

    def memory_report(self) -> dict[str, Any]:
        """Bytes of the stored data now, per field and in total, summed over the shards.

        Returns
        -------
        dict
            ``{"fields": {name: {"raw_bytes", "stored_bytes", "cache_bytes"}}, "total":
            {...}, "shards": [report, ...]}``: each shard's own report (as
            `SequenceReplay.memory_report` defines the three counts; each shard has its own
            decode cache of ``cache_bytes``) in shard order, and their sums. A field is
            listed once any shard knows the schema. One call to every shard.

        Examples
        --------
        >>> import torch
        >>> from lucid_replay import Episode
        >>> from lucid_replay.distributed import ShardedReplay
        >>> replay = ShardedReplay.create(2, 100, backend="local")
        >>> _ = replay.add(Episode({"obs": torch.zeros(10, 4)}))
        >>> replay.memory_report()["total"]["raw_bytes"]
        160
        >>> replay.close()
        """
        self._check_open()
        reports = calls.get([shard.memory_report.remote() for shard in self._call_handles()])
        fields: dict[str, dict[str, int]] = {}
        for report in reports:
            for name, counts in report["fields"].items():
                summed = fields.setdefault(name, dict.fromkeys(_KEYS, 0))
                for key in _KEYS:
                    summed[key] += counts[key]
        total = {key: sum(report["total"][key] for report in reports) for key in _KEYS}
        return {"fields": fields, "total": total, "shards": reports}
