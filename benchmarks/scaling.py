"""Scaling rows: sample time against stored transitions, sample + update against episodes.

lucid_replay should stay flat (O(B log E) draws, O(B W) gathers), also with the same
episodes stored in segments (``add`` on a buffer with ``segment_length``); the naive
baseline's O(E) draw shows the gap. Buffers are filled with episodes cut from the reference
data set (their contents do not matter to the timings). lucid_replay's buffers of every size
are alive together and timed in the same rounds; the naive ones are built and timed one size
at a time, each freed before the next.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import torch

from benchmarks import naive
from benchmarks.config import Config
from benchmarks.data import Dataset, episode_lengths
from benchmarks.floor import GatherFloor
from benchmarks.lucid_rows import (
    fits,
    metadata_bytes,
    reference_window,
    sample_update,
    scaled_buffer,
    window_errors,
)
from benchmarks.rows import Only, Row, release
from benchmarks.timing import CacheSweep, measure_rounds
from lucid_replay import PrioritizedSequenceReplay


def _label(count: int) -> str:
    return f"{count / 1e6:g}M" if count >= 1_000_000 else f"{count / 1e3:g}k"


def _segmented_label(config: Config, tag: str) -> str:
    return (
        f"lucid_replay uniform sample_windows, segmented buffer (L = {config.segment_length}), "
        f"{tag} transitions"
    )


def _constant(length: int, _: int) -> int:
    return length


def transition_rows(config: Config, source: Dataset, only: Only) -> list[Row]:
    """Sample time at each stored-transition count, every size timed in the same rounds.

    All buffers are built first and each round samples every size once, with the CPU caches
    swept before every call (`CacheSweep`), so no size finds its data in cache: a
    10k-transition ring (2.7 MB) would otherwise be read from cache on every call, which no
    learner that runs a network between samples sees. It also puts every size under the same
    load. Each size's floor is a `GatherFloor` of that many records (the size of that
    buffer's storage). The segmented series (`_segmented_rows`) then samples buffers of the
    same episodes stored in segments of ``segment_length`` steps.
    """
    rows: list[Row] = []
    window = reference_window(config)
    rng = np.random.default_rng(config.seed + 3)
    group = "scale_transitions"
    buffers: dict[int | str, PrioritizedSequenceReplay] = {}  # by size; segmented by row id
    floors: dict[int, GatherFloor] = {}
    lengths_of: dict[int, list[int]] = {}
    calls: dict[str, Callable[[], object]] = {}
    labels: dict[str, tuple[str, dict[str, object]]] = {}
    built = 0
    for size in config.scale_transitions:
        tag = _label(size)
        # the buffer, its fill's transient copies, and its floor's storage
        if not fits(config, built + size, copies=3.0):
            reason = f"{size} transitions need more memory than this machine has free"
            for series in ("uniform", "prioritized"):
                rows.append(
                    Row.not_measured(
                        f"scale.T.{tag}.{series}",
                        f"lucid_replay {series} sample_windows, {tag} transitions",
                        reason,
                        group=group,
                    )
                )
            if only("scale.T.segmented") or only(f"scale.T.{tag}"):
                label = _segmented_label(config, tag)
                key = f"scale.T.{tag}.segmented"
                rows.append(Row.not_measured(key, label, reason, group=group))
            continue
        lengths = lengths_of[size] = episode_lengths(size, config.min_len, config.max_len, rng)
        buffer = buffers[size] = scaled_buffer(
            config, size, lengths.__getitem__, len(lengths), source
        )
        built += size
        extra: dict[str, object] = {"transitions": size, "episodes": buffer.num_episodes}
        if only("scale.T.floor") or only(f"scale.T.{tag}"):
            key = f"scale.T.{tag}.floor"
            floor = floors[size] = GatherFloor(config, source.fields, size)
            calls[key] = floor
            labels[key] = (
                f"gather floor (index_select from {tag} preallocated records), {tag} transitions",
                {**extra, "series": "gather floor"},
            )
        for series, prioritized in (("uniform", False), ("prioritized", True)):
            if only(f"scale.T.{series}") or only(f"scale.T.{tag}"):
                key = f"scale.T.{tag}.{series}"
                calls[key] = functools.partial(
                    buffer.sample_windows, config.batch, window, prioritized=prioritized
                )
                labels[key] = (
                    f"lucid_replay {series} sample_windows, {tag} transitions",
                    {**extra, "series": f"lucid {series}"},
                )
    sweep = CacheSweep()
    timings = (
        measure_rounds(calls, reps=config.reps, warmup=config.warmup, before=sweep) if calls else {}
    )
    for key, timing in timings.items():
        label, extra = labels[key]
        rows.append(Row.timed(key, label, timing, group=group, extra=extra))
    buffers.clear()
    floors.clear()
    release()
    rows += _segmented_rows(config, source, only, lengths_of, sweep)
    for size, lengths in lengths_of.items():
        if only("scale.T.naive") and len(lengths) <= config.naive_max_episodes:
            tag = _label(size)
            baseline = naive.build(config, size, lengths.__getitem__, len(lengths), source)
            rows.append(
                Row.timed(
                    f"scale.T.{tag}.naive",
                    f"naive prioritized sample, {tag} transitions",
                    naive.time_sample(config, baseline, None, allow_partial=False),
                    group=group,
                    extra={"transitions": size, "series": "naive prioritized"},
                )
            )
            del baseline
            release()
    return rows


def _segmented_rows(
    config: Config,
    source: Dataset,
    only: Only,
    lengths_of: dict[int, list[int]],
    sweep: CacheSweep,
) -> list[Row]:
    """The segmented series: the same episodes of every size stored in segments of
    ``segment_length`` steps, all alive together and timed in their own rounds.

    Built once the whole-episode buffers are freed, so that neither series runs with the
    other's gigabytes in memory (at 10M transitions each buffer holds 2.7 GB).
    """
    rows: list[Row] = []
    window = reference_window(config)
    group = "scale_transitions"
    buffers: list[PrioritizedSequenceReplay] = []
    calls: dict[str, Callable[[], object]] = {}
    labels: dict[str, tuple[str, dict[str, object]]] = {}
    built = 0
    for size, lengths in lengths_of.items():
        tag = _label(size)
        if not (only("scale.T.segmented") or only(f"scale.T.{tag}")):
            continue
        key, label = f"scale.T.{tag}.segmented", _segmented_label(config, tag)
        if not fits(config, built + size, copies=2.0):
            reason = f"{size} transitions need more memory than this machine has free"
            rows.append(Row.not_measured(key, label, reason, group=group))
            continue
        segmented = scaled_buffer(
            config,
            size,
            lengths.__getitem__,
            len(lengths),
            source,
            segment_length=config.segment_length,
        )
        buffers.append(segmented)
        built += size
        extra: dict[str, object] = {"transitions": size, "episodes": segmented.num_episodes}
        calls[key] = functools.partial(
            segmented.sample_windows, config.batch, window, prioritized=False
        )
        labels[key] = (label, {**extra, "series": "lucid segmented"})
    if calls:
        timings = measure_rounds(calls, reps=config.reps, warmup=config.warmup, before=sweep)
        for key, timing in timings.items():
            label, extra = labels[key]
            rows.append(Row.timed(key, label, timing, group=group, extra=extra))
    buffers.clear()
    release()
    return rows


def episode_rows(config: Config, source: Dataset, only: Only) -> list[Row]:
    """Sample + update at E episodes of ``episode_total // E`` steps (``allow_partial`` windows).

    ``allow_partial=True`` (every stored step is an anchor, TorchRL's semantics) keeps the same
    256 x 109 records per batch when episodes are shorter than the learning region. As for the
    transition rows, every size's buffer is built first and each round times every size once,
    after a `CacheSweep` (every size reads its table, trees and data from memory), so a burst
    of load lands on all sizes rather than on whichever one was being timed.
    """
    rows: list[Row] = []
    window = reference_window(config, allow_partial=True)
    errors = window_errors(config)
    group = "scale_episodes"
    buffers: dict[str, PrioritizedSequenceReplay] = {}
    sizes = {
        _label(count): _EpisodeSize(count, max(1, config.episode_total // count))
        for count in config.scale_episodes
    }
    built = 0
    for tag, size in (sizes if only("scale.E.lucid") else {}).items():
        if not fits(config, built + size.transitions, copies=2.0):
            label = f"lucid_replay prioritized sample + update, {size.label}"
            reason = f"{size.transitions} more transitions need more memory than is free"
            rows.append(Row.not_measured(f"scale.E.{tag}.lucid", label, reason, group=group))
            continue
        steps = functools.partial(_constant, size.length)
        buffers[tag] = scaled_buffer(config, size.transitions, steps, size.episodes, source)
        built += size.transitions
    calls = {
        tag: functools.partial(sample_update, buffer, config.batch, window, errors)
        for tag, buffer in buffers.items()
    }
    timings = (
        measure_rounds(calls, reps=config.reps, warmup=config.warmup, before=CacheSweep())
        if calls
        else {}
    )
    for tag, timing in timings.items():
        buffer = buffers[tag]
        stored = buffer.stats()["episodes_stored"]
        rows.append(
            Row.timed(
                f"scale.E.{tag}.lucid",
                f"lucid_replay prioritized sample + update, {sizes[tag].label}",
                timing,
                group=group,
                extra={
                    **sizes[tag].extra(),
                    "series": "lucid",
                    "metadata_bytes_per_episode": metadata_bytes(buffer) / stored,
                    "table_bytes_per_episode": buffer.memory_usage()["table_bytes"] / stored,
                },
            )
        )
    buffers.clear()
    release()
    if only("scale.E.naive"):
        rows += _naive_episode_rows(config, source, errors, sizes)
    return rows


@dataclasses.dataclass(frozen=True)
class _EpisodeSize:
    """``episodes`` episodes of ``length`` steps."""

    episodes: int
    length: int

    @property
    def transitions(self) -> int:
        return self.length * self.episodes

    @property
    def label(self) -> str:
        return f"{_label(self.episodes)} episodes of {self.length} steps"

    def extra(self) -> dict[str, object]:
        return {
            "episodes": self.episodes,
            "episode_length": self.length,
            "transitions": self.transitions,
        }


def _naive_episode_rows(
    config: Config,
    source: Dataset,
    errors: torch.Tensor,
    sizes: dict[str, _EpisodeSize],
) -> list[Row]:
    """The naive baseline at each episode count it is built for, one size at a time."""
    rows: list[Row] = []
    group = "scale_episodes"
    for tag, size in sizes.items():
        count, length = size.episodes, size.length
        label = f"naive prioritized sample + update, {size.label}"
        if count > config.naive_max_episodes:
            reason = (
                f"the naive buffer is only built up to {config.naive_max_episodes} episodes "
                "(its fill and per-episode Python objects)"
            )
            rows.append(Row.not_measured(f"scale.E.{tag}.naive", label, reason, group=group))
            continue
        steps = functools.partial(_constant, length)
        baseline = naive.build(config, length * count, steps, count, source)
        rows.append(
            Row.timed(
                f"scale.E.{tag}.naive",
                label,
                naive.time_sample(config, baseline, errors, allow_partial=True),
                group=group,
                extra={**size.extra(), "series": "naive"},
            )
        )
        del baseline
        release()
    return rows
