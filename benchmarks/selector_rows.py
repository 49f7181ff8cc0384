"""Selector rows: a three-way `Mixture`'s sample time beside `Prioritized()` alone.

At each stored-transition count of the scaling rows, one buffer of reference episodes has the
selector ``Mixture({Prioritized(): 0.7, Uniform(): 0.2, Recency(half_life=capacity / 10):
0.1})``: ``sample_windows`` draws by the mixture (three sum trees, each drawn for its share of
the batch, and the exact ``P`` of every anchor under all three), and ``prioritized=True`` by
`Prioritized` alone, on the same data, in the same rounds, the CPU caches swept before every
call (as the scaling rows). The bars: the mixture within 1.3x of `Prioritized` alone at the
reference size, and flat (slowest over fastest size within 1.3x) from 10k to 10M transitions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from benchmarks.config import Config
from benchmarks.data import Dataset, episode_lengths
from benchmarks.lucid_rows import fits, reference_window, scaled_buffer
from benchmarks.rows import Only, Row, release
from benchmarks.timing import CacheSweep, measure_rounds
from lucid_replay import Mixture, Prioritized, PrioritizedSequenceReplay, Recency, Uniform

GROUP = "selectors"
SERIES = {"mixture": "lucid mixture", "prioritized": "lucid prioritized alone"}


def _label(count: int) -> str:
    return f"{count / 1e6:g}M" if count >= 1_000_000 else f"{count / 1e3:g}k"


def row_id(config: Config, size: int, series: str) -> str:
    """``selectors.<series>`` at the reference size (the bar's pair), else with the size."""
    return (
        f"selectors.{series}"
        if size == config.transitions
        else f"selectors.{_label(size)}.{series}"
    )


def mixture(capacity: int) -> Mixture:
    """The three-way mixture of the rows: DreamerV3-like shares, a tenth of the buffer's
    capacity as the half-life."""
    return Mixture(
        {Prioritized(): 0.7, Uniform(): 0.2, Recency(half_life=max(capacity // 10, 1)): 0.1}
    )


def selector_rows(config: Config, source: Dataset, only: Only) -> list[Row]:
    """Mixture and `Prioritized` sample times at every scaling size, timed in the same rounds."""
    rows: list[Row] = []
    window = reference_window(config)
    rng = np.random.default_rng(config.seed + 7)
    buffers: list[PrioritizedSequenceReplay] = []
    calls: dict[str, Callable[[], object]] = {}
    labels: dict[str, tuple[str, dict[str, object]]] = {}
    built = 0
    for size in config.scale_transitions:
        tag = _label(size)
        if not fits(config, built + size, copies=2.0):
            for series in SERIES:
                label = f"lucid_replay {series} sample_windows, {tag} transitions"
                reason = f"{size} transitions need more memory than this machine has free"
                rows.append(
                    Row.not_measured(row_id(config, size, series), label, reason, group=GROUP)
                )
            continue
        lengths = episode_lengths(size, config.min_len, config.max_len, rng)
        buffer = scaled_buffer(
            config, size, lengths.__getitem__, len(lengths), source, selector=mixture(size)
        )
        buffers.append(buffer)
        built += size
        extra: dict[str, object] = {"transitions": size, "episodes": buffer.num_episodes}
        for series, prioritized in (("mixture", None), ("prioritized", True)):
            key = row_id(config, size, series)
            if only(key):
                calls[key] = functools.partial(
                    buffer.sample_windows, config.batch, window, prioritized=prioritized
                )
                what = "three-way Mixture" if series == "mixture" else "Prioritized() alone"
                labels[key] = (
                    f"lucid_replay sample_windows by {what}, {tag} transitions",
                    {**extra, "series": SERIES[series]},
                )
    timings = (
        measure_rounds(calls, reps=config.reps, warmup=config.warmup, before=CacheSweep())
        if calls
        else {}
    )
    for key, timing in timings.items():
        label, described = labels[key]
        rows.append(Row.timed(key, label, timing, group=GROUP, extra=described))
    buffers.clear()
    release()
    return rows
