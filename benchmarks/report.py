"""The performance bars and their verdicts, the markdown tables, results.json and the plot.

The bars are the targets docs/benchmarks.md states, in the reference configuration: uniform
``sample_windows`` within 1.5x of the gather floor; prioritized ``sample_windows`` +
``update_priorities_from`` within 2x of it; the add-sample-update loop at least 4x, and
prioritized sample-only (hot boundary cache) at least 2x, faster than TorchRL; sample time
within 1.5x from 10k to 10M stored transitions and from 1k to 1M episodes; ``add`` of a 256-step
episode within 3x of copying its bytes; metadata O(1) per episode and nothing per transition.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from benchmarks.rows import Row


@dataclasses.dataclass
class Bar:
    name: str
    requirement: str
    value: float | None
    holds: bool | None
    detail: str
    by_min: str = ""  # the same ratio computed from the minima (less sensitive to contention)
    required: bool = True  # False: a comparison shown beside the bars, with no requirement


def _by_id(rows: list[Row]) -> dict[str, Row]:
    return {row.id: row for row in rows if row.measured and row.median_ms is not None}


def _at_most(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _at_least(value: float | None, limit: float) -> bool | None:
    return None if value is None else value >= limit


def evaluate(rows: list[Row]) -> list[Bar]:
    """Fill ratios / bar cells of ``rows`` and return the bars with their verdicts."""
    rows_by_id = _by_id(rows)
    median = {k: r.median_ms for k, r in rows_by_id.items()}
    minimum = {k: r.min_ms for k, r in rows_by_id.items()}

    def ratio(a: str, b: str, source: dict[str, float | None] = median) -> float | None:
        if a in source and b in source and source[b]:
            return source[a] / source[b]  # type: ignore[operator]
        return None

    for row in rows:
        if not row.measured or row.median_ms is None:
            continue
        if row.group == "main" and row.id != "floor":
            row.ratio, row.ratio_note = ratio(row.id, "floor"), "x floor"
        elif row.group == "add" and row.id != "add.memcpy":
            row.ratio, row.ratio_note = ratio(row.id, "add.memcpy"), "x memcpy"
    for group in ("scale_transitions", "scale_episodes"):
        series: dict[str, list[Row]] = {}
        for row in rows:
            if row.group == group and row.measured:
                series.setdefault(row.extra["series"], []).append(row)
        for members in series.values():
            first = members[0].median_ms
            for row in members:
                row.ratio, row.ratio_note = row.median_ms / first, "x smallest"  # type: ignore[operator]

    bars: list[Bar] = []
    # (name, requirement, numerator row, denominator row, limit (None: shown beside the bars),
    #  at most?, row to annotate, fmt)
    pairs = [
        (
            "uniform sample_windows vs floor",
            "<= 1.5x floor",
            "lucid.uniform",
            "floor",
            1.5,
            True,
            "lucid.uniform",
            "{:.2f}x",
        ),
        (
            "prioritized sample + update vs floor",
            "<= 2x floor",
            "lucid.prioritized_update",
            "floor",
            2.0,
            True,
            "lucid.prioritized_update",
            "{:.2f}x",
        ),
        (
            "add-sample-update loop vs TorchRL",
            ">= 4x faster than TorchRL",
            "torchrl.loop",
            "lucid.loop",
            4.0,
            False,
            "lucid.loop",
            "{:.1f}x faster",
        ),
        (
            "prioritized sample-only vs TorchRL (hot cache)",
            ">= 2x faster than TorchRL",
            "torchrl.prioritized",
            "lucid.prioritized",
            2.0,
            False,
            "lucid.prioritized",
            "{:.1f}x faster",
        ),
        (
            "uniform sample-only vs TorchRL's RandomSampler (hot cache)",
            "",
            "torchrl.uniform",
            "lucid.uniform",
            None,
            False,
            "",
            "{:.1f}x faster",
        ),
        (
            "add (256-step episode) vs memcpy of its bytes into ring memory",
            "<= 3x memcpy",
            "add.lucid",
            "add.memcpy",
            3.0,
            True,
            "add.lucid",
            "{:.1f}x",
        ),
        (
            "add vs a cache-hot memcpy of its bytes",
            "",
            "add.lucid",
            "add.memcpy_hot",
            None,
            True,
            "",
            "{:.1f}x",
        ),
        (
            "add vs a cache-hot copy of its bytes field by field",
            "",
            "add.lucid",
            "add.copy_fields",
            None,
            True,
            "",
            "{:.1f}x",
        ),
    ]
    for name, requirement, top, bottom, limit, at_most, on, cell in pairs:
        value = ratio(top, bottom)
        if limit is None:
            holds = None
        else:
            holds = _at_most(value, limit) if at_most else _at_least(value, limit)
        detail = "not measured" if value is None else cell.format(value)
        by_min = ratio(top, bottom, minimum)
        bars.append(
            Bar(
                name,
                requirement,
                value,
                holds,
                detail,
                "" if by_min is None else cell.format(by_min),
                required=limit is not None,
            )
        )
        if on in rows_by_id:
            target = rows_by_id[on]
            target.bar = f"{requirement} ({detail})"
            target.holds = holds

    flat = (
        ("scale_transitions", "lucid uniform", "uniform sample flat 10k -> 10M transitions"),
        (
            "scale_transitions",
            "lucid prioritized",
            "prioritized sample flat 10k -> 10M transitions",
        ),
        ("scale_episodes", "lucid", "sample + update flat 1k -> 1M episodes"),
    )
    for group, series, name in flat:
        members = [
            r for r in rows if r.group == group and r.measured and r.extra.get("series") == series
        ]
        missing = [r for r in rows if r.group == group and not r.measured and "naive" not in r.id]
        requirement = "<= 1.5x (max / min over sizes)"
        if len(members) < 2:
            bars.append(Bar(name, requirement, None, None, "not measured"))
            continue
        key = "transitions" if group == "scale_transitions" else "episodes"
        medians = [r.median_ms or 0.0 for r in members]
        minima = [r.min_ms or 0.0 for r in members]
        spread = max(medians) / min(medians)
        sizes = ", ".join(f"{r.extra[key]:,}" for r in members)
        detail = f"{spread:.2f}x over {sizes}"
        if missing:
            unmeasured = len(missing) // (2 if group == "scale_transitions" else 1)
            detail += f" ({unmeasured} size(s) not measured)"
        by_min = f"{max(minima) / min(minima):.2f}x"
        floors = {
            r.extra["transitions"]: r.median_ms
            for r in rows
            if r.group == group and r.measured and r.extra.get("series") == "gather floor"
        }
        above = [
            (r.median_ms or 0.0) - floors[r.extra["transitions"]]  # type: ignore[operator]
            for r in members
            if r.extra["transitions"] in floors
        ]
        if len(above) == len(members) and min(above) > 0:
            detail += (
                f"; time above the same-size gather floor: {min(above):.2f}..{max(above):.2f} ms "
                f"({max(above) / min(above):.2f}x)"
            )
        bars.append(Bar(name, requirement, spread, spread <= 1.5, detail, by_min))
        members[-1].bar = f"<= 1.5x across sizes ({spread:.2f}x)"
        members[-1].holds = spread <= 1.5

    memory = {r.id: r for r in rows if r.group == "memory"}
    if "memory.lucid.episode" in memory and "memory.lucid.transition" in memory:
        extra = memory["memory.lucid.episode"].extra
        per_row = extra["table_bytes_per_row"] + extra["tree_bytes_per_row"]
        per_transition = memory["memory.lucid.transition"].extra["bytes_per_transition"]
        holds = per_transition == 0 and per_row < 100
        detail = (
            f"{per_row:.0f} B per table row ({extra['bytes_per_episode']:.0f} B per stored "
            f"episode with growth slack), {per_transition:.0f} B/transition"
        )
        bars.append(
            Bar(
                "metadata beyond the user's data",
                "O(1): a few dozen B/episode (< 100), 0 B/transition",
                per_row,
                holds,
                detail,
            )
        )
    return bars


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _holds(value: bool | None) -> str:
    return "" if value is None else ("yes" if value else "**no**")


def table(rows: list[Row], groups: tuple[str, ...]) -> str:
    lines = ["| row | min ms | median ms | ratio | bar | holds? |", "|---|---:|---:|---:|---|---|"]
    for row in rows:
        if row.group not in groups:
            continue
        label = row.label if row.measured else f"{row.label} — {row.note}"
        ratio = "" if row.ratio is None else f"{row.ratio:.2f} {row.ratio_note}"
        times = f"{_fmt(row.min_ms)} | {_fmt(row.median_ms)}"
        lines.append(f"| {label} | {times} | {ratio} | {row.bar} | {_holds(row.holds)} |")
    return "\n".join(lines)


def memory_table(rows: list[Row]) -> str:
    lines = ["| what | value |", "|---|---|"]
    for row in rows:
        if row.group == "memory":
            lines.append(f"| {row.label} | {row.note} |")
        elif (
            row.group == "scale_episodes"
            and row.measured
            and "table_bytes_per_episode" in row.extra
        ):
            what = f"lucid_replay episode table at {row.extra['episodes']} episodes"
            lines.append(f"| {what} | {row.extra['table_bytes_per_episode']:.0f} B/episode |")
    return "\n".join(lines)


def bars_table(bars: list[Bar]) -> str:
    lines = [
        "| bar | requirement | measured (medians) | holds? | same from minima |",
        "|---|---|---|---|---|",
    ]
    for bar in bars:
        if not bar.required:
            continue
        verdict = _holds(bar.holds)
        lines.append(
            f"| {bar.name} | {bar.requirement} | {bar.detail} | {verdict} | {bar.by_min} |"
        )
    return "\n".join(lines)


def beside_table(bars: list[Bar]) -> str:
    """Comparisons shown next to the bars, which no target covers."""
    lines = ["| comparison | measured (medians) | same from minima |", "|---|---|---|"]
    lines += [f"| {b.name} | {b.detail} | {b.by_min} |" for b in bars if not b.required]
    return "\n".join(lines)


def markdown(rows: list[Row], bars: list[Bar]) -> str:
    parts = [
        "### Sampling (reference configuration)",
        table(rows, ("main", "device")),
        "### add",
        table(rows, ("add",)),
        "### Scaling: stored transitions",
        table(rows, ("scale_transitions",)),
        "### Scaling: stored episodes",
        table(rows, ("scale_episodes",)),
        "### Memory beyond the user's data",
        memory_table(rows),
        "### Bars",
        bars_table(bars),
        "### Beside the bars",
        beside_table(bars),
    ]
    return "\n\n".join(parts) + "\n"


def write_json(path: Path, meta: dict[str, Any], rows: list[Row], bars: list[Bar]) -> None:
    payload = {
        "meta": meta,
        "rows": [dataclasses.asdict(r) for r in rows],
        "bars": [dataclasses.asdict(b) for b in bars],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")


def plot(path: Path, rows: list[Row], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(17, 5.5), gridspec_kw={"width_ratios": [1.6, 1, 1]})
    main = [r for r in rows if r.group in ("main", "add") and r.measured and r.median_ms]
    labels = [textwrap.shorten(r.label, 62, placeholder="...") for r in main]
    colours = [
        "#555555"
        if r.id in ("floor", "add.memcpy", "add.memcpy_hot", "add.copy_fields")
        else "#1f77b4"
        if r.id.startswith(("lucid", "add.lucid"))
        else "#ff7f0e"
        if r.id.startswith("torchrl")
        else "#d62728"
        for r in main
    ]
    axis = axes[0]
    axis.barh(range(len(main)), [r.median_ms for r in main], xerr=None, color=colours)
    axis.scatter(
        [r.min_ms for r in main],
        range(len(main)),
        color="black",
        marker="|",
        s=80,
        zorder=3,
        label="min",
    )
    axis.set_yticks(range(len(main)), labels, fontsize=7)
    axis.invert_yaxis()
    if main:
        axis.set_xscale("log")
    axis.set_xlabel("median ms (log); | = min")
    floor = next((r.median_ms for r in main if r.id == "floor"), None)
    if floor:
        axis.axvline(floor, color="#555555", linestyle=":", linewidth=1)
    axis.set_title("256 windows x 109 records, 1M transitions")
    for axis, group, key, xlabel in (
        (axes[1], "scale_transitions", "transitions", "stored transitions"),
        (axes[2], "scale_episodes", "episodes", "stored episodes (fixed transition total)"),
    ):
        series: dict[str, list[Row]] = {}
        for row in rows:
            if row.group == group and row.measured:
                series.setdefault(row.extra["series"], []).append(row)
        for name, members in series.items():
            sizes = [r.extra[key] for r in members]
            minima = [r.min_ms for r in members]
            (line,) = axis.plot(sizes, minima, marker="o", label=f"{name} (min)")
            medians = [r.median_ms for r in members]
            axis.plot(sizes, medians, linestyle=":", color=line.get_color())
        if floor:
            axis.axhline(
                floor, color="#555555", linestyle=":", linewidth=1, label="gather floor (1M)"
            )
        if series:
            axis.set_xscale("log")
            axis.set_yscale("log")
        axis.set_xlabel(xlabel)
        axis.set_ylabel("ms: min (solid), median (dotted)")
        axis.legend(fontsize=8)
        axis.grid(True, which="both", alpha=0.3)
    axes[1].set_title("sample time vs transitions")
    axes[2].set_title("sample + update vs episodes")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def replot(path: Path) -> None:
    """Redraw the PNG beside a results JSON: ``python -m benchmarks.report results.json``."""
    payload = json.loads(path.read_text())
    rows = [Row(**row) for row in payload["rows"]]
    info, command = payload["meta"]["machine"], payload["meta"]["command"]
    title = (
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']} "
        f"({info['torch_threads']} threads), torchrl {info.get('torchrl', '?')}; {command}"
    )
    plot(path.with_suffix(".png"), rows, title)


if __name__ == "__main__":
    replot(Path(sys.argv[1]))
