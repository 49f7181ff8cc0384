"""The examples run end to end (smoke tests: tiny settings, the scripts' own output checked)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str, cwd: Path) -> str:
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    return completed.stdout


def test_quickstart_prints_what_it_sampled(tmp_path):
    """examples/quickstart.py stores rollouts, samples chunks and windows, and reports them."""
    output = _run("quickstart.py", cwd=tmp_path)
    assert re.search(r"stored \d+ transitions in \d+ episodes", output)
    assert "chunk obs shape: (4, 5, 1)" in output
    assert "beta annealed to 0.70" in output


def test_r2d2_cartpole_smoke_run_ends_with_the_evaluation_line(tmp_path):
    """A few hundred steps of the R2D2 example train, plot, and print the final summary line."""
    pytest.importorskip("gymnasium")
    pytest.importorskip("matplotlib")
    plot = tmp_path / "curve.png"
    output = _run(
        "r2d2_cartpole.py",
        "--total-steps",
        "300",
        "--eval-episodes",
        "2",
        "--plot-path",
        str(plot),
        cwd=tmp_path,
    )
    last_line = output.strip().splitlines()[-1]
    assert re.fullmatch(
        r"final evaluation return: \d+\.\d+ \+/- \d+\.\d+ over 2 episodes", last_line
    )
    assert plot.stat().st_size > 0


def test_torchrl_dqn_smoke_run_trains_on_collector_batches(tmp_path):
    """A few collector batches go through the assembler into the buffer, TorchRL's DQNLoss
    trains on to_tensordict() batches, and the final summary line is printed."""
    pytest.importorskip("torchrl")
    output = _run(
        "torchrl_dqn.py",
        "--frames",
        "400",
        "--learning-starts",
        "100",
        "--updates-per-batch",
        "2",
        "--eval-episodes",
        "1",
        cwd=tmp_path,
    )
    lines = output.strip().splitlines()
    assert re.fullmatch(r"stored \d+ episodes", lines[-2])
    assert re.fullmatch(r"final evaluation return: \d+\.\d", lines[-1])


def test_atari_pixels_stores_compressed_frames_and_samples_stacks(tmp_path):
    """A few hundred Pong steps go through the writer into a zstd, stack=4 buffer; the
    memory report and the iterate rate are printed, and batches hold [4, 84, 84] stacks."""
    pytest.importorskip("ale_py")
    pytest.importorskip("zstandard")
    output = _run("atari_pixels.py", "--steps", "400", "--batches", "3", cwd=tmp_path)
    assert re.search(r"collected \d+ records in [1-9]\d* episodes", output)
    smaller = re.search(r"\((\d+\.\d)x smaller, [\d,]+ B per step", output)
    assert smaller is not None and float(smaller.group(1)) > 2.0, output
    assert re.search(r"batch observation: \(32, \d+, 4, 84, 84\) torch\.uint8", output)
    assert re.search(r"iterate\(prefetch=2\): \d+\.\d batches/s", output)
