"""The row record every benchmark produces, and small helpers shared by the row modules."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

from benchmarks.timing import Timing


@dataclasses.dataclass
class Row:
    id: str
    label: str
    group: str  # "main", "add", "scale_transitions", "scale_episodes", "memory", "device"
    min_ms: float | None = None
    median_ms: float | None = None
    reps: int = 0
    ratio: float | None = None
    ratio_note: str = ""
    bar: str = ""
    holds: bool | None = None
    note: str = ""
    measured: bool = True
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def timed(cls, id: str, label: str, timing: Timing, *, group: str = "main", **kw: Any) -> Row:
        return cls(
            id,
            label,
            group,
            min_ms=timing.min_ms,
            median_ms=timing.median_ms,
            reps=len(timing.samples_s),
            **kw,
        )

    @classmethod
    def not_measured(cls, id: str, label: str, reason: str, *, group: str = "main") -> Row:
        return cls(id, label, group, note=f"not measured: {reason}", measured=False)


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    with open("/proc/self/statm") as file:
        pages = int(file.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


def available_bytes() -> int:
    with open("/proc/meminfo") as file:
        for line in file:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def release() -> None:
    gc.collect()
