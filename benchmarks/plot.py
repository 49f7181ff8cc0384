"""The results figure: sampling rows per pass, and the two scaling groups."""

from __future__ import annotations

import textwrap
from pathlib import Path

from benchmarks.results_file import Pass
from benchmarks.rows import Row

_REFERENCE_IDS = (
    "floor",
    "floor.out",
    "floor.update",
    "floor.huge",
    "add.memcpy",
    "add.memcpy_hot",
    "add.copy_fields",
    "segments.memcpy",
)
_LINE_STYLES = ("-", "--", "-.", ":")
_SERIES_COLOURS = {
    "gather floor": "#555555",
    "lucid uniform": "C0",
    "lucid prioritized": "C2",
    "lucid segmented": "C9",
    "lucid": "C0",
    "naive prioritized": "C3",
    "naive": "C3",
}


def _colour(row: Row) -> str:
    if row.id in _REFERENCE_IDS:
        return "#555555"
    if row.id.startswith(("lucid", "add.lucid", "segments")):
        return "#1f77b4"
    if row.id.startswith("torchrl"):
        return "#ff7f0e"
    return "#d62728"


def plot(path: Path, passes: list[Pass], title: str) -> None:
    """Medians of the sampling, add and segment rows (one bar per pass, log scale), and the
    scaling series (one line style per pass)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(17, 6), gridspec_kw={"width_ratios": [1.6, 1, 1]})
    shown = [p for p in passes if p.stock] or passes
    first = [r for r in shown[0].rows if r.group in ("main", "add", "segments") and r.measured]
    height = 0.8 / len(shown)
    axis = axes[0]
    for index, run in enumerate(shown):
        medians = {r.id: r.median_ms for r in run.rows if r.measured and r.median_ms}
        positions = [i + index * height for i in range(len(first))]
        axis.barh(
            positions,
            [medians.get(r.id, 0.0) for r in first],
            height=height,
            color=[_colour(r) for r in first],
            alpha=1.0 - 0.45 * index,
            label=run.label,
        )
    axis.set_yticks(
        [i + 0.4 - height / 2 for i in range(len(first))],
        [textwrap.shorten(r.label, 62, placeholder="...") for r in first],
        fontsize=7,
    )
    axis.invert_yaxis()
    if first:
        axis.set_xscale("log")
    axis.set_xlabel("median ms (log); one bar per pass, darkest first")
    axis.set_title("256 windows x 109 records")
    axis.legend(fontsize=8)
    for axis, group, key, xlabel in (
        (axes[1], "scale_transitions", "transitions", "stored transitions"),
        (axes[2], "scale_episodes", "episodes", "stored episodes (fixed transition total)"),
    ):
        drawn = False
        for index, run in enumerate(shown):
            series: dict[str, list[Row]] = {}
            for row in run.rows:
                if row.group == group and row.measured and row.median_ms:
                    series.setdefault(str(row.extra["series"]), []).append(row)
            for name, members in series.items():
                axis.plot(
                    [r.extra[key] for r in members],
                    [r.median_ms for r in members],
                    marker="o",
                    color=_SERIES_COLOURS.get(name, "C4"),
                    linestyle=_LINE_STYLES[index % len(_LINE_STYLES)],
                    label=f"{name} ({run.label})",
                )
                drawn = True
        if drawn:
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.legend(fontsize=7)
        axis.set_xlabel(xlabel)
        axis.set_ylabel("median ms")
        axis.grid(True, which="both", alpha=0.3)
    axes[1].set_title("sample time vs transitions")
    axes[2].set_title("sample + update vs episodes")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    if any(r.group == "pixels_bytes" and r.measured for r in shown[0].rows):
        pixel_plot(path.with_name(PIXEL_PLOT), shown[0], title)


PIXEL_PLOT = "pixels.png"
_STORAGE_COLOURS = {
    "lucid.raw": "#1f77b4",
    "lucid.zstd": "#2ca02c",
    "lucid.lz4": "#17becf",
    "torchrl.memmap": "#ff7f0e",
    "torchrl.compressed": "#d62728",
}


def pixel_plot(path: Path, run: Pass, title: str) -> None:
    """Stored observation bytes per transition (log scale), grouped by game, a bar per
    storage, one frame (7,056 B) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in run.rows if r.group == "pixels_bytes" and r.measured]
    games = list(dict.fromkeys(str(r.extra["game"]) for r in rows))
    storages = list(dict.fromkeys(str(r.extra["storage"]) for r in rows))
    labels = {str(r.extra["storage"]): r.label.split(": ", 1)[1] for r in rows}
    value = {(r.extra["game"], r.extra["storage"]): r.extra["bytes_per_transition"] for r in rows}
    figure, axis = plt.subplots(figsize=(10, 6))
    width = 0.8 / max(len(storages), 1)
    for index, storage in enumerate(storages):
        heights = [float(value.get((game, storage), 0.0)) for game in games]
        positions = [g + index * width for g in range(len(games))]
        axis.bar(
            positions,
            heights,
            width=width,
            color=_STORAGE_COLOURS.get(storage, "C4"),
            label=labels[storage],
        )
        for x, height in zip(positions, heights, strict=True):
            axis.text(x, height * 1.08, f"{height:,.0f}", ha="center", fontsize=7, rotation=90)
    axis.axhline(84 * 84, color="#555555", linestyle=":", linewidth=1, label="one 84x84 frame")
    axis.set_xticks([g + 0.4 - width / 2 for g in range(len(games))], games)
    axis.set_yscale("log")
    axis.set_ylim(top=axis.get_ylim()[1] * 4)
    axis.set_ylabel("stored observation bytes per transition (log)")
    axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=3)
    axis.grid(True, axis="y", which="both", alpha=0.3)
    figure.suptitle(textwrap.shorten(title, 140, placeholder="..."), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
