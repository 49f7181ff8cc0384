"""The performance bars, declared as data, and their verdicts on one pass's rows.

Each bar is a ratio of medians measured in the same pass (the same ratio from the minima is
reported beside it). `BARS` compares two rows; `FLAT_BARS` compares one series over the sizes
of a scaling group; the memory bar reads the memory rows. `BESIDE` holds comparisons of two
rows shown beside the bars, with no limit and so no requirement.
"""

from __future__ import annotations

import dataclasses

from benchmarks.bar_specs import Bar, BarSpec, pair_bar, ratio
from benchmarks.pixel_bars import PIXEL_BARS, PIXEL_BASELINES, pixel_bytes_bars
from benchmarks.rows import Row

__all__ = ["BARS", "BESIDE", "Bar", "BarSpec", "FlatSpec", "annotate", "evaluate"]


@dataclasses.dataclass(frozen=True)
class FlatSpec:
    """The slowest over the fastest median of ``series`` across the sizes of ``group``."""

    name: str
    group: str  # "scale_transitions" or "scale_episodes"
    series: str
    limit: float
    size_key: str  # the row extra naming the size: "transitions" or "episodes"


def _beside(
    name: str, numerator: str, denominator: str, *, fmt: str = "{:.2f}x", faster: bool = False
) -> BarSpec:
    """A comparison shown beside the bars: no limit, so no requirement to name."""
    return BarSpec(name, numerator, denominator, None, not faster, fmt, versus="")


FLOOR = "the cold floor"
BARS = (
    BarSpec(
        name="uniform sample_windows vs floor",
        numerator="lucid.uniform",
        denominator="floor",
        limit=1.3,
        at_most=True,
        fmt="{:.2f}x",
        versus=FLOOR,
    ),
    BarSpec(
        name="prioritized sample_windows + update_priorities_from vs floor",
        numerator="lucid.prioritized_update",
        denominator="floor.update",
        limit=1.6,
        at_most=True,
        fmt="{:.2f}x",
        versus=FLOOR,
    ),
    BarSpec(
        name="add-sample-update loop vs TorchRL",
        numerator="torchrl.loop",
        denominator="lucid.loop",
        limit=5.0,
        at_most=False,
        fmt="{:.1f}x faster",
        versus="TorchRL",
    ),
    BarSpec(
        name="prioritized sample-only vs TorchRL (hot boundary cache)",
        numerator="torchrl.prioritized",
        denominator="lucid.prioritized.paired",
        limit=2.5,
        at_most=False,
        fmt="{:.1f}x faster",
        versus="TorchRL",
    ),
    BarSpec(
        name="add (256-step episode) vs memcpy of its bytes into ring memory",
        numerator="add.lucid",
        denominator="add.memcpy",
        limit=3.0,
        at_most=True,
        fmt="{:.1f}x",
        versus="memcpy",
    ),
    BarSpec(
        name="stream append (256 steps, L = 256, full buffer) vs memcpy of its bytes into ring "
        "memory",
        numerator="segments.append",
        denominator="segments.memcpy",
        limit=3.0,
        at_most=True,
        fmt="{:.1f}x",
        versus="memcpy",
    ),
    BarSpec(
        name="gather_windows of windows crossing seams (L = 256, 16 interleaved streams) vs "
        "the same windows on a whole-episode buffer",
        numerator="segments.gather",
        denominator="segments.gather.whole",
        limit=1.1,
        at_most=True,
        fmt="{:.2f}x",
        versus="the whole-episode buffer",
    ),
    BarSpec(
        name="prioritized sample_windows without replacement vs with replacement",
        numerator="selection.without",
        denominator="selection.with",
        limit=1.5,
        at_most=True,
        fmt="{:.2f}x",
        versus="with replacement",
    ),
    BarSpec(
        name="one batch of an epoch vs a uniform sample_windows",
        numerator="selection.epoch",
        denominator="selection.uniform",
        limit=1.5,
        at_most=True,
        fmt="{:.2f}x",
        versus="uniform sample_windows",
    ),
    BarSpec(
        name="three-way Mixture sample_windows vs Prioritized() alone (same buffer)",
        numerator="selectors.mixture",
        denominator="selectors.prioritized",
        limit=1.3,
        at_most=True,
        fmt="{:.2f}x",
        versus="Prioritized() alone",
    ),
)
# Comparisons shown beside the bars, with no requirement.
BESIDE = (
    _beside("the floor with outputs preallocated (out=) vs the floor", "floor.out", "floor"),
    _beside("the floor from huge-page memory (as the ring's) vs the floor", "floor.huge", "floor"),
    _beside(
        "uniform sample_windows vs the floor from huge-page memory", "lucid.uniform", "floor.huge"
    ),
    _beside(
        "uniform sample_windows vs the floor with preallocated outputs",
        "lucid.uniform",
        "floor.out",
    ),
    _beside(
        "uniform sample-only vs TorchRL's RandomSampler (hot boundary cache)",
        "torchrl.uniform",
        "lucid.uniform.paired",
        fmt="{:.1f}x faster",
        faster=True,
    ),
    _beside("add vs a cache-hot memcpy of its bytes", "add.lucid", "add.memcpy_hot", fmt="{:.1f}x"),
    _beside(
        "add vs a cache-hot copy of its bytes field by field",
        "add.lucid",
        "add.copy_fields",
        fmt="{:.1f}x",
    ),
    _beside(
        "prioritized sample + update on the device vs the floor there", "device", "device.floor"
    ),
    _beside(
        "stream append of the same 256 steps in four pieces vs memcpy of their bytes",
        "segments.append.pieces",
        "segments.memcpy",
        fmt="{:.1f}x",
    ),
    _beside(
        "gather_windows across seams of segments stored back to back (filled by add) vs "
        "a whole-episode buffer",
        "segments.gather.adjacent",
        "segments.gather.whole",
    ),
    _beside(
        "uniform sample_windows, segmented buffer (L = 256) vs whole-episode buffer",
        "segments.uniform",
        "segments.uniform.whole",
    ),
)
FLAT_BARS = (
    FlatSpec(
        "uniform sample flat 10k -> 10M transitions",
        "scale_transitions",
        "lucid uniform",
        1.3,
        "transitions",
    ),
    FlatSpec(
        "prioritized sample flat 10k -> 10M transitions",
        "scale_transitions",
        "lucid prioritized",
        1.3,
        "transitions",
    ),
    FlatSpec(
        "uniform sample flat 10k -> 10M transitions, segmented buffer (L = 256)",
        "scale_transitions",
        "lucid segmented",
        1.3,
        "transitions",
    ),
    FlatSpec(
        "three-way Mixture sample flat 10k -> 10M transitions",
        "selectors",
        "lucid mixture",
        1.3,
        "transitions",
    ),
    FlatSpec(
        "prioritized sample + update flat 1k -> 1M episodes",
        "scale_episodes",
        "lucid",
        1.5,
        "episodes",
    ),
)
METADATA_LIMIT = 100  # bytes per stored episode (episode table and sum trees)
# Resident memory of an endless stream, the buffer's share after `stream_capacities` x
# capacity steps over that after 1x (see `_stream_memory_bar`).
STREAM_MEMORY_LIMIT = 1.05

# Which row each group's ratios divide by.
_BASELINES = {"main": "floor", "add": "add.memcpy", "device": "device.floor"}
_BASELINE_NOTES = {"main": "x floor", "add": "x memcpy", "device": "x device floor"}
# Rows that divide by a row of their own instead (and how the ratio reads): rows timed in
# rounds with a floor call of their own, and the segmented rows beside their baselines.
_OWN_BASELINE = {
    "lucid.prioritized_update": ("floor.update", "x floor"),
    "segments.append": ("segments.memcpy", "x memcpy"),
    "segments.append.pieces": ("segments.memcpy", "x memcpy"),
    "segments.gather": ("segments.gather.whole", "x whole-episode buffer"),
    "segments.gather.adjacent": ("segments.gather.whole", "x whole-episode buffer"),
    "segments.uniform": ("segments.uniform.whole", "x whole-episode buffer"),
    "selection.without": ("selection.with", "x with replacement"),
    "selection.epoch": ("selection.uniform", "x uniform sample_windows"),
}


def _series(rows: list[Row], group: str) -> dict[str, list[Row]]:
    series: dict[str, list[Row]] = {}
    for row in rows:
        if row.group == group and row.measured and row.median_ms is not None:
            series.setdefault(str(row.extra["series"]), []).append(row)
    return series


def annotate(rows: list[Row]) -> None:
    """Fill each row's ratio to its group's baseline (or to the smallest size)."""
    measured = {r.id: r for r in rows if r.measured and r.median_ms is not None}
    for row in measured.values():
        baseline, note = {**_OWN_BASELINE, **PIXEL_BASELINES}.get(
            row.id, (_BASELINES.get(row.group), _BASELINE_NOTES.get(row.group, ""))
        )
        if baseline is not None and baseline in measured and row.id != baseline:
            row.ratio, row.ratio_note = ratio(measured, row.id, baseline), note
    for group in ("scale_transitions", "scale_episodes", "selectors"):
        for members in _series(rows, group).values():
            first = members[0].median_ms or 1.0
            for row in members:
                row.ratio, row.ratio_note = (row.median_ms or 0.0) / first, "x smallest"


def _flat_bar(spec: FlatSpec, rows: list[Row]) -> Bar:
    requirement = f"<= {spec.limit:g}x (slowest / fastest size)"
    members = _series(rows, spec.group).get(spec.series, [])
    if len(members) < 2:
        return Bar(spec.name, requirement, None, None, "not measured")
    medians = [r.median_ms or 0.0 for r in members]
    minima = [r.min_ms or 0.0 for r in members]
    spread = max(medians) / min(medians)
    sizes = ", ".join(f"{r.extra[spec.size_key]:,}" for r in members)
    detail, note = f"{spread:.2f}x", f"over {sizes}"
    kind = spec.series.split()[-1]  # a row id ends with it: "scale.T.10k.uniform"
    unmeasured = [
        r for r in rows if r.group == spec.group and not r.measured and r.id.endswith(f".{kind}")
    ]
    if unmeasured:
        note += f" ({len(unmeasured)} size(s) not measured)"
    floors = {
        r.extra["transitions"]: r.median_ms
        for r in _series(rows, spec.group).get("gather floor", [])
    }
    above = [(r.median_ms or 0.0) - (floors.get(r.extra["transitions"]) or 0.0) for r in members]
    if all(r.extra["transitions"] in floors for r in members) and min(above) > 0:
        note += (
            f"; above the same-size floor: {min(above):.2f}..{max(above):.2f} ms "
            f"({max(above) / min(above):.2f}x)"
        )
    by_min = f"{max(minima) / min(minima):.2f}x"
    return Bar(spec.name, requirement, spread, spread <= spec.limit, detail, by_min, note=note)


def _memory_bar(rows: list[Row]) -> Bar | None:
    """Metadata per stored episode at the largest episode count measured (where the table's
    power-of-two growth leaves the least slack), and bytes per transition."""
    memory = {r.id: r for r in rows if r.group == "memory"}
    if "memory.lucid.episode" not in memory or "memory.lucid.transition" not in memory:
        return None
    reference = memory["memory.lucid.episode"].extra
    sizes = [(int(reference["episodes"]), float(reference["bytes_per_episode"]))]
    sizes += [
        (int(r.extra["episodes"]), float(r.extra["metadata_bytes_per_episode"]))
        for r in rows
        if r.group == "scale_episodes" and r.measured and "metadata_bytes_per_episode" in r.extra
    ]
    episodes, per_episode = max(sizes)
    per_transition = float(memory["memory.lucid.transition"].extra["bytes_per_transition"])
    detail = f"{per_episode:.0f} B/episode, {per_transition:.0f} B/transition"
    note = (
        f"table + sum trees at {episodes:,} episodes; {sizes[0][1]:.0f} B/episode in the "
        f"reference buffer of {sizes[0][0]:,} episodes (rows grow by powers of two)"
    )
    return Bar(
        "metadata beyond the user's data",
        f"O(1): < {METADATA_LIMIT} B per stored episode, 0 B/transition",
        per_episode,
        per_transition == 0 and per_episode < METADATA_LIMIT,
        detail,
        note=note,
    )


def _stream_memory_bar(rows: list[Row]) -> Bar | None:
    """Resident memory after ``N x capacity`` steps of an endless stream over that after 1x,
    counting as the buffer's what it held at 1x (``memory_usage()``) and charging it all the
    process's growth between.

    At 1x every slot of the storage has been written, so the storage is resident in full;
    what may still grow is metadata. The limit, 5%, is 1.5 B per step appended after 1x
    (the storage holds 271 B a step) at any capacity: a cost per step, or one per segment
    of a few hundred bytes, fails it, while the table's growth by powers of two does not.
    """
    row = next((r for r in rows if r.id == "segments.memory"), None)
    if row is None:
        return None
    readings, held = row.extra["readings"], row.extra["buffer_bytes"]
    (_, first), (_, last) = readings[0], readings[-1]
    value = (held + last - first) / held
    name = (
        f"resident memory over an endless stream of {row.extra['capacities']}x capacity "
        f"(L = {row.extra['segment_length']})"
    )
    return Bar(
        name,
        f"<= {STREAM_MEMORY_LIMIT:g}x the buffer's memory at 1x capacity",
        value,
        value <= STREAM_MEMORY_LIMIT,
        f"{value:.3f}x",
        note=f"{(last - first) / 1e6:+.2f} MB against {held / 1e6:.1f} MB",
    )


def evaluate(rows: list[Row]) -> list[Bar]:
    """Annotate ``rows`` with their ratios and return every bar's verdict on them."""
    annotate(rows)
    measured = {r.id: r for r in rows if r.measured and r.median_ms is not None}
    pixels = PIXEL_BARS if any(r.group == "pixels" for r in rows) else ()
    bars = [pair_bar(spec, measured) for spec in (*BARS, *BESIDE, *pixels)]
    bars += [_flat_bar(spec, rows) for spec in FLAT_BARS]
    extra = (_memory_bar(rows), _stream_memory_bar(rows))
    return bars + [bar for bar in extra if bar is not None] + pixel_bytes_bars(rows)
