"""Guides whose code blocks claim to run as is, in order: they do, and print what they say.

Each ```python block of a guide runs in one shared namespace, in page order. A top-level
``print(...)`` line states its output in a comment, on the same line or on the next one
(``# -> output``, the arrow optional).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

GUIDES = Path(__file__).resolve().parent.parent / "docs" / "guides"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _expected_output(block: str) -> list[str]:
    lines = block.splitlines()
    expected = []
    for at, line in enumerate(lines):
        if not line.startswith("print("):
            continue
        if "  # " in line:
            expected.append(line.split("  # ", 1)[1].removeprefix("-> "))
        elif at + 1 < len(lines) and lines[at + 1].startswith("# "):
            expected.append(lines[at + 1][2:].removeprefix("-> "))
    return expected


@pytest.mark.parametrize(
    "guide", ["recurrent-q-learning.md", "long-and-continuing-episodes.md", "pixels.md"]
)
def test_guide_blocks_run_in_order_and_print_what_they_state(guide):
    """Every code block of the guide runs after the previous ones; printed lines match the
    comments beside the prints."""
    blocks = BLOCK.findall((GUIDES / guide).read_text(encoding="utf-8"))
    assert blocks, f"no python blocks in {guide}"
    namespace: dict[str, object] = {"__name__": f"guide_{guide}"}
    for number, block in enumerate(blocks):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block, f"{guide}, block {number}", "exec"), namespace)
        assert printed.getvalue().splitlines() == _expected_output(block), f"block {number}"
