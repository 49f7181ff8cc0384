"""One benchmark pass (a thread count and an allocator), and the results file holding them.

The file keeps each pass's bars as evaluated when it was written; `read` evaluates them again
from the rows, so a report rendered later always applies the bars as `benchmarks.bars`
declares them now.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from benchmarks.bars import Bar, evaluate
from benchmarks.environment import STOCK
from benchmarks.rows import Row


@dataclasses.dataclass
class Pass:
    """Every row measured in one process, with one torch thread count and one allocator."""

    threads: int
    torch_default: bool  # True: torch's own thread count (set_num_threads not called)
    allocator: str  # environment.STOCK or environment.TUNED
    allocator_detail: str
    load_before: list[float]
    load_after: list[float]
    wall_s: float
    rows: list[Row]
    bars: list[Bar]

    @property
    def stock(self) -> bool:
        return self.allocator == STOCK

    @property
    def label(self) -> str:
        text = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        if self.torch_default:
            text += " (torch default)"
        return text if self.stock else f"{text}, tuned malloc"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> Pass:
        fields = dict(payload)
        fields["rows"] = rows = [Row(**row) for row in payload["rows"]]
        fields["bars"] = evaluate(rows)
        return cls(**fields)


def write(path: Path, meta: dict[str, Any], passes: list[Pass]) -> None:
    payload = {"meta": meta, "passes": [p.to_json() for p in passes]}
    path.write_text(json.dumps(payload, indent=2) + "\n")


def read(path: Path) -> tuple[dict[str, Any], list[Pass]]:
    payload = json.loads(path.read_text())
    if "passes" not in payload:
        raise ValueError(f"{path} holds no passes: it was written by an older runner; rerun it")
    return payload["meta"], [Pass.from_json(p) for p in payload["passes"]]
