"""Wall-clock timing: warm-up, then ``reps`` timed calls with ``time.perf_counter``."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass
class Timing:
    samples_s: list[float]

    @property
    def min_ms(self) -> float:
        return min(self.samples_s) * 1e3

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_s) * 1e3


def measure(
    call: Callable[[], Any],
    *,
    reps: int,
    warmup: int,
    setup: Callable[[], Any] | None = None,
) -> Timing:
    """Time ``call`` ``reps`` times after ``warmup`` untimed calls.

    ``setup`` (untimed) runs before every call. The garbage collector is paused while timing
    (as ``timeit`` does) so that a collection triggered by one row is not billed to another.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        call()
    gc.collect()
    samples = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(reps):
            if setup is not None:
                setup()
            begin = time.perf_counter()
            call()
            samples.append(time.perf_counter() - begin)
    finally:
        if was_enabled:
            gc.enable()
    return Timing(samples)


def measure_rounds(
    calls: Mapping[str, Callable[[], Any]], *, reps: int, warmup: int, block: int = 1
) -> dict[str, Timing]:
    """Time several calls in rounds: each round makes ``block`` calls of each, one after the
    other, until every call was timed ``reps`` times.

    Rows compared by a ratio are then timed under the same conditions: a burst of load from
    elsewhere on a shared machine lands on all of them, not on whichever row was running.
    With ``block=1`` no call finds its data in cache from its own previous call; a larger
    block lets each run in its steady state, as when timed alone.
    """
    for _ in range(warmup):
        for call in calls.values():
            call()
    gc.collect()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(-(-reps // block)):
            for name, call in calls.items():
                for _ in range(block):
                    begin = time.perf_counter()
                    call()
                    samples[name].append(time.perf_counter() - begin)
    finally:
        if was_enabled:
            gc.enable()
    return {name: Timing(values[:reps]) for name, values in samples.items()}
