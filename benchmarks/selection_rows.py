"""Rows of selection policies: draws without replacement and epochs, beside today's draws.

On the reference buffer (a `PrioritizedSequenceReplay` of the reference episodes, reference
windows of 256 x 109 records), timed in rounds with each other so their ratios compare
calls made under the same load:

* ``selection.with`` / ``selection.without``: prioritized ``sample_windows`` with and
  without replacement (``replacement=False``);
* ``selection.uniform`` / ``selection.epoch``: uniform ``sample_windows`` and one batch of
  an epoch (``next`` on ``buffer.epoch``; a new epoch starts when one ends, its start
  amortised over its ~2,900 batches);

and ``selection.epoch.start``, the start of an epoch alone (snapshot of ~740k anchors and
their random permutation), timed apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from benchmarks.config import Config
from benchmarks.data import Dataset
from benchmarks.lucid_rows import build, reference_window
from benchmarks.rows import Only, Row
from benchmarks.timing import measure, measure_rounds
from lucid_replay import PrioritizedSequenceReplay, Window, WindowBatch

GROUP = "selection"


def selection_rows(config: Config, dataset: Dataset, only: Only) -> list[Row]:
    """The rows above, on one reference buffer."""
    buffer = build(config, dataset)
    window, batch = reference_window(config), config.batch
    calls: dict[str, Callable[[], object]] = {
        "selection.with": lambda: buffer.sample_windows(batch, window),
        "selection.without": lambda: buffer.sample_windows(batch, window, replacement=False),
        "selection.uniform": lambda: buffer.sample_windows(batch, window, prioritized=False),
        "selection.epoch": _epoch_batches(buffer, batch, window),
    }
    calls = {name: call for name, call in calls.items() if only(name)}
    timings = measure_rounds(calls, reps=config.reps, warmup=config.warmup)
    records = f"{batch}x{config.window_size} records"
    labels = {
        "selection.with": f"prioritized sample_windows, with replacement ({records})",
        "selection.without": f"prioritized sample_windows, replacement=False ({records})",
        "selection.uniform": f"uniform sample_windows ({records})",
        "selection.epoch": f"one batch of an epoch ({records}; its start amortised)",
    }
    rows = [Row.timed(name, labels[name], timing, group=GROUP) for name, timing in timings.items()]
    if only("selection.epoch.start"):
        anchors = buffer.num_eligible(window)
        start = measure(
            lambda: buffer.epoch(batch, window), reps=max(config.reps // 10, 5), warmup=1
        )
        label = f"start of an epoch ({anchors} anchors: snapshot and permutation)"
        rows.append(Row.timed("selection.epoch.start", label, start, group=GROUP))
    return rows  # the buffer goes with this frame


def _epoch_batches(
    buffer: PrioritizedSequenceReplay, batch: int, window: Window
) -> Callable[[], WindowBatch]:
    """``next`` on an epoch of ``buffer``, starting the next epoch when one ends."""
    current: list[Iterator[WindowBatch]] = [iter(())]

    def call() -> WindowBatch:
        for _ in range(2):
            drawn = next(current[0], None)
            if drawn is not None:
                return drawn
            current[0] = buffer.epoch(batch, window)
        raise RuntimeError("an epoch of the reference buffer yielded no batch")

    return call
