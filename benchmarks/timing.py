"""Wall-clock timing: warm-up, then ``reps`` timed calls with ``time.perf_counter``."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
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
