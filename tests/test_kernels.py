"""The compiled kernels and the numpy and torch code they stand for give identical batches.

Three buffers with one seed, one per engine, go through the same adds, draws and updates;
every batch must be equal to the last bit, weights included, across windows of every
boundary policy, also after evictions, rescales of the priority trees and growth of the
table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_episode

import lucid_replay.arrays
import lucid_replay.kernels
from lucid_replay import Episode, PrioritizedSequenceReplay, Window
from lucid_replay.schema import SUPPORTED_DTYPES

pytestmark = pytest.mark.skipif(
    lucid_replay.kernels.get() is None, reason="numba is not installed: no kernels to compare"
)

WINDOWS = [
    Window(5, burn_in=4, bootstrap=2),
    Window(4, burn_in=3, bootstrap=3, boundary="stop", allow_partial=True),
    Window(3, burn_in=2, bootstrap=2, dilation=2),
    Window(3, burn_in=2, bootstrap=2, boundary="include_reset", allow_partial=True),
]


def _engine(name, monkeypatch):
    monkeypatch.setattr(lucid_replay.arrays, "numpy_on_cpu", name != "torch")
    monkeypatch.setattr(lucid_replay.kernels, "enabled", name == "kernels")


def _run(name, monkeypatch, steps=40):
    """The batches one engine draws through a scripted life of a buffer."""
    _engine(name, monkeypatch)
    rng = np.random.default_rng(3)
    buffer = PrioritizedSequenceReplay(capacity=3_000, alpha=0.7, seed=5)
    drawn = []
    for step in range(steps):
        buffer.extend(
            make_episode(int(n), first_serial=1000 * step) for n in rng.integers(1, 30, 8)
        )
        window = WINDOWS[step % len(WINDOWS)]
        batch = buffer.sample_windows(32, window)
        drawn.append(batch)
        errors = torch.from_numpy(rng.exponential(size=(32, window.size)) * 10.0 ** (step % 7))
        buffer.update_priorities_from(batch, errors)
        drawn.append(buffer.sample_prioritized(16, 2))
        drawn.append(buffer.sample(8, 3))
    return drawn


def _fields(batch):
    names = [n for n in dir(batch) if isinstance(getattr(batch, n, None), torch.Tensor)]
    return {
        **{f"data.{k}": v for k, v in batch.data.items()},
        **{n: getattr(batch, n) for n in names},
    }


def test_every_engine_draws_identical_batches(monkeypatch):
    """Kernels, numpy and torch index arithmetic give bitwise-equal batches and weights."""
    runs = {name: _run(name, monkeypatch) for name in ("kernels", "numpy", "torch")}
    for index, expected in enumerate(runs["numpy"]):
        for name in ("kernels", "torch"):
            got = runs[name][index]
            for field, value in _fields(expected).items():
                assert torch.equal(_fields(got)[field], value), (name, index, field)


def _typed_episode(length: int, first: int) -> dict[str, torch.Tensor]:
    """Steps of every storable dtype, in field shapes ``()``, ``(3,)`` and ``(2, 0)``."""
    serial = torch.arange(first, first + length)
    steps: dict[str, torch.Tensor] = {"serial": serial}
    for dtype in SUPPORTED_DTYPES:
        values = (serial[:, None] * 7 + torch.arange(3)) % 101
        if dtype == torch.bool:
            values = values % 2 == 0
        elif dtype.is_complex:
            values = torch.complex(values.double(), -values.double())
        steps[str(dtype).removeprefix("torch.")] = values.to(dtype)
    steps["scalar"] = serial.to(torch.float16)
    steps["empty"] = torch.zeros(length, 2, 0)
    return steps


def test_repairs_of_clamped_records_are_the_same_bytes_for_every_dtype(monkeypatch):
    """The compiled byte-row repair writes padded records exactly as numpy and torch do."""
    batches = {}
    for name in ("kernels", "numpy", "torch"):
        _engine(name, monkeypatch)
        buffer = PrioritizedSequenceReplay(capacity=2_000, seed=3)
        for index in range(20):
            buffer.add(Episode(_typed_episode(60, 60 * index), terminated=index % 2 == 0))
        batches[name] = buffer.sample_windows(64, Window(8, burn_in=6, bootstrap=3))
    expected = batches["numpy"]
    assert not bool(expected.validity_mask.all())  # some records were clamped and repaired
    for field, values in expected.data.items():
        serial = expected["serial"]  # a padded record repeats its episode's edge step
        assert torch.equal(values, _typed_episode(2_000, 0)[field][serial])
        for name in ("kernels", "torch"):
            assert torch.equal(batches[name].data[field], values), (name, field)


@pytest.mark.parametrize("size", [1, 7, 8, 9, 16, 109])
def test_whole_row_check_finds_a_false_at_every_position(size):
    """The gather's row check reads 8 bools at a time: a single False anywhere in a row, in a
    full word or in the tail, makes the row not exact; rows of True are exact."""
    from lucid_replay.compiled_memory import _all_exact

    rows = np.ones((size + 1, size), dtype=np.bool_)
    rows[np.arange(size), np.arange(size)] = False  # row k has its only False at k
    assert [_all_exact(rows, b, size) for b in range(size + 1)] == [False] * size + [True]
