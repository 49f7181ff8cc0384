"""Wall-clock timing: warm-up, then ``reps`` timed calls with ``time.perf_counter``.

Each timed call also records the minor page faults the process took during it
(``getrusage(RUSAGE_SELF).ru_minflt``, read outside the timed interval): a call that allocates
fresh multi-MB outputs the allocator just returned to the kernel faults its pages back in, and
the fault count shows that churn where the times alone only show noise.
"""

from __future__ import annotations

import dataclasses
import gc
import resource
import statistics
import time
from collections.abc import Callable, Mapping

import numpy as np


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclasses.dataclass(frozen=True)
class Timing:
    samples_s: list[float]
    faults: list[int]  # minor page faults taken during each timed call

    @property
    def min_ms(self) -> float:
        return min(self.samples_s) * 1e3

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_s) * 1e3

    @property
    def faults_per_call(self) -> float:
        return sum(self.faults) / len(self.faults)


class _Recorder:
    """Times calls with the garbage collector paused (as ``timeit`` does), so that a collection
    triggered by one row is not billed to another."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.faults: list[int] = []

    def time(self, call: Callable[[], object]) -> None:
        faults = _minor_faults()
        begin = time.perf_counter()
        call()
        elapsed = time.perf_counter() - begin
        self.faults.append(_minor_faults() - faults)
        self.samples.append(elapsed)

    def timing(self, reps: int) -> Timing:
        return Timing(self.samples[:reps], self.faults[:reps])


class _GcPaused:
    def __enter__(self) -> None:
        gc.collect()
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was_enabled:
            gc.enable()


def measure(
    call: Callable[[], object],
    *,
    reps: int,
    warmup: int,
    before: Callable[[], object] | None = None,
) -> Timing:
    """Time ``call`` ``reps`` times after ``warmup`` untimed calls (``before`` each, untimed)."""
    for _ in range(warmup):
        call()
    recorder = _Recorder()
    with _GcPaused():
        for _ in range(reps):
            if before is not None:
                before()
            recorder.time(call)
    return recorder.timing(reps)


class CacheSweep:
    """Evicts the CPU caches (untimed) by writing a buffer of several times their size.

    Before each timed call of a scaling row, so that every size reads its data from memory,
    as a learner does after a network's forward and backward pass evicted it: a 2.7 MB ring
    would otherwise sit in a 32 MB L3 cache and gather twice as fast as a 2.7 GB one, which
    measures the cache, not the sampler.
    """

    def __init__(self, megabytes: int = 128) -> None:
        self._lines = np.zeros(megabytes * 2**20 // 8, dtype=np.int64)

    def __call__(self) -> None:
        self._lines[::8] += 1  # one write per 64-byte cache line


def measure_rounds(
    calls: Mapping[str, Callable[[], object]],
    *,
    reps: int,
    warmup: int,
    block: int = 1,
    before: Callable[[], object] | None = None,
) -> dict[str, Timing]:
    """Time several calls in rounds: each round makes ``block`` calls of each, one after the
    other, until every call was timed ``reps`` times.

    Rows compared by a ratio are then timed under the same conditions: a burst of load from
    elsewhere on a shared machine lands on all of them, not on whichever row was running.
    With ``block=1`` no call finds its data in cache from its own previous call; a larger
    block lets each run in its steady state, as when timed alone. ``before`` runs, untimed,
    before every timed call (for example a `CacheSweep`).
    """
    for _ in range(warmup):
        for call in calls.values():
            call()
    recorders = {name: _Recorder() for name in calls}
    with _GcPaused():
        for _ in range(-(-reps // block)):
            for name, call in calls.items():
                for _ in range(block):
                    if before is not None:
                        before()
                    recorders[name].time(call)
    return {name: recorder.timing(reps) for name, recorder in recorders.items()}
