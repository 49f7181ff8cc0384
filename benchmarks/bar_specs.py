"""A bar's declaration (`BarSpec`: a ratio of two rows' medians and its limit) and verdict
(`Bar`), shared by `benchmarks.bars` and the groups that declare bars of their own."""

from __future__ import annotations

import dataclasses

from benchmarks.rows import Row


@dataclasses.dataclass(frozen=True)
class BarSpec:
    """``numerator / denominator`` (row ids), at most or at least ``limit``."""

    name: str
    numerator: str
    denominator: str
    limit: float | None  # None: a comparison shown beside the bars
    at_most: bool  # True: ratio <= limit; False: ratio >= limit (a speed-up over ``versus``)
    fmt: str  # how a ratio prints, e.g. "{:.2f}x"
    versus: str  # how the requirement names the denominator

    @property
    def requirement(self) -> str:
        if self.limit is None:
            return ""
        if self.at_most:
            return f"<= {self.limit:g}x {self.versus}"
        return f">= {self.limit:g}x faster than {self.versus}"

    def format(self, value: float | None) -> str:
        """``value`` as the bar states it; a speed-up below 1 reads as a slow-down."""
        if value is None:
            return ""
        if not self.at_most and 0 < value < 1:
            return f"{1 / value:.1f}x slower"
        return self.fmt.format(value)

    def holds(self, value: float | None) -> bool | None:
        if value is None or self.limit is None:
            return None
        return value <= self.limit if self.at_most else value >= self.limit


@dataclasses.dataclass
class Bar:
    """A bar's verdict in one pass."""

    name: str
    requirement: str
    value: float | None
    holds: bool | None
    detail: str
    by_min: str = ""  # the same ratio from the minima (less sensitive to contention)
    required: bool = True  # False: a comparison shown beside the bars
    note: str = ""  # context shown after the verdict


def ratio(rows: dict[str, Row], top: str, bottom: str, *, minima: bool = False) -> float | None:
    a, b = rows.get(top), rows.get(bottom)
    if a is None or b is None:
        return None
    x, y = (a.min_ms, b.min_ms) if minima else (a.median_ms, b.median_ms)
    return None if x is None or not y else x / y


def pair_bar(spec: BarSpec, rows: dict[str, Row]) -> Bar:
    value = ratio(rows, spec.numerator, spec.denominator)
    by_min = ratio(rows, spec.numerator, spec.denominator, minima=True)
    return Bar(
        spec.name,
        spec.requirement,
        value,
        spec.holds(value),
        "not measured" if value is None else spec.format(value),
        spec.format(by_min),
        required=spec.limit is not None,
    )
