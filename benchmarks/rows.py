"""The row record every benchmark produces, and small helpers shared by the row modules."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

from benchmarks.timing import Timing

# Which rows a run measures: a predicate on row ids (``--only`` prefixes).
Only = Callable[[str], bool]


@dataclasses.dataclass
class Row:
    id: str
    label: str
    # "main", "add", "segments", "selection", "selectors", "scale_transitions",
    # "scale_episodes", "memory", "device"
    group: str
    min_ms: float | None = None
    median_ms: float | None = None
    reps: int = 0
    faults_per_call: float | None = None  # minor page faults per timed call
    ratio: float | None = None  # filled by bars.evaluate
    ratio_note: str = ""
    note: str = ""
    measured: bool = True
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def timed(
        cls,
        id: str,
        label: str,
        timing: Timing,
        *,
        group: str = "main",
        note: str = "",
        extra: dict[str, Any] | None = None,
    ) -> Row:
        return cls(
            id,
            label,
            group,
            min_ms=timing.min_ms,
            median_ms=timing.median_ms,
            reps=len(timing.samples_s),
            faults_per_call=timing.faults_per_call,
            note=note,
            extra={} if extra is None else extra,
        )

    @classmethod
    def not_measured(cls, id: str, label: str, reason: str, *, group: str = "main") -> Row:
        return cls(id, label, group, note=f"not measured: {reason}", measured=False)


def available_bytes() -> int:
    """Memory the kernel could give this process now (``MemAvailable``, Linux)."""
    with open("/proc/meminfo") as file:
        for line in file:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def release() -> None:
    gc.collect()
