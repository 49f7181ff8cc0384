"""The pixel group's bars (`benchmarks.pixel_rows`), one set per game.

Timed bars compare rows of the same game in the same pass: ``stack=4`` windows from memory
within 1.3x of the floor gather of the same stacked bytes; from memmap files (page cache
warm) within 1.3x of memory; ``iterate(prefetch=2)`` on the zstd buffer at least half the
raw buffer's throughput (its time per batch at most 2x). The bytes bars read the bytes rows:
``stack=4`` stores at most 1.02 frames per transition, zstd at least 10x less than the raw
frames.
"""

from __future__ import annotations

from benchmarks.atari import GAMES
from benchmarks.bar_specs import Bar, BarSpec
from benchmarks.rows import Row

BYTES_GROUP = "pixels_bytes"  # as benchmarks.pixel_rows
FRAME_BYTES = 84 * 84
RAW_LIMIT = 1.02  # stored obs bytes per transition, in frames
ZSTD_LIMIT = 10.0  # raw frames' bytes over zstd's


def _tag(game: str) -> str:
    return f"pixels.{game.lower()}"


def _game_bars(game: str) -> tuple[BarSpec, ...]:
    tag = _tag(game)
    records = "256 x 109 stack=4 windows"
    return (
        BarSpec(
            f"{game}: {records} from memory vs a floor gather of the same stacked bytes",
            f"{tag}.raw",
            f"{tag}.floor",
            1.3,
            True,
            "{:.2f}x",
            "the floor",
        ),
        BarSpec(
            f"{game}: {records} from memmap files (page cache warm) vs from memory",
            f"{tag}.memmap",
            f"{tag}.raw",
            1.3,
            True,
            "{:.2f}x",
            "memory",
        ),
        BarSpec(
            f"{game}: iterate(prefetch=2) time per batch, zstd vs raw (throughput >= half)",
            f"{tag}.iterate.zstd",
            f"{tag}.iterate.raw",
            2.0,
            True,
            "{:.2f}x",
            "raw",
        ),
    )


PIXEL_BARS = tuple(spec for game in GAMES for spec in _game_bars(game))
# Rows that divide by a row of their own (and how the ratio reads), as bars._OWN_BASELINE.
PIXEL_BASELINES = {
    f"{_tag(game)}.{row}": (f"{_tag(game)}.{base}", note)
    for game in GAMES
    for row, base, note in (
        ("raw", "floor", "x floor"),
        ("memmap", "raw", "x memory"),
        ("iterate.zstd", "iterate.raw", "x raw"),
        ("iterate.lz4", "iterate.raw", "x raw"),
    )
}


def pixel_bytes_bars(rows: list[Row]) -> list[Bar]:
    """Per game measured: ``stack=4`` raw bytes per transition in frames, and raw frames'
    bytes over zstd's."""
    per = {
        (r.extra["game"], r.extra["storage"]): float(r.extra["bytes_per_transition"])
        for r in rows
        if r.group == BYTES_GROUP and r.measured and "bytes_per_transition" in r.extra
    }
    bars = []
    for game in GAMES:
        raw, zstd = per.get((game, "lucid.raw")), per.get((game, "lucid.zstd"))
        if raw is not None:
            frames = raw / FRAME_BYTES
            bars.append(
                Bar(
                    f"{game}: stored obs bytes per transition, stack=4",
                    f"<= {RAW_LIMIT:g}x one frame ({FRAME_BYTES:,} B)",
                    frames,
                    frames <= RAW_LIMIT,
                    f"{frames:.4f}x",
                    note=f"{raw:,.0f} B",
                )
            )
        if zstd is not None:
            smaller = FRAME_BYTES / zstd
            bars.append(
                Bar(
                    f"{game}: stored obs bytes per transition, stack=4 zstd",
                    f">= {ZSTD_LIMIT:g}x smaller than raw frames",
                    smaller,
                    smaller >= ZSTD_LIMIT,
                    f"{smaller:.1f}x smaller",
                    note=f"{zstd:,.0f} B",
                )
            )
    return bars
