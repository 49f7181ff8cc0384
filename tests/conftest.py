"""Shared fixtures: small episodes whose every step carries a unique serial number."""

from __future__ import annotations

import itertools

import pytest
import torch

import lucid_replay

_serials = itertools.count(1_000)


def make_episode(
    length: int, *, terminated: bool = False, first_serial: int | None = None
) -> lucid_replay.Episode:
    """An episode of ``length`` steps: ``serial`` (int64, unique across the test session unless
    ``first_serial`` is given), ``obs`` (float32 ``[2]``: serial and -serial), ``done`` (bool).
    """
    start = next(_serials) * 1_000 if first_serial is None else first_serial
    serial = torch.arange(start, start + length, dtype=torch.int64)
    return lucid_replay.Episode(
        {
            "serial": serial,
            "obs": torch.stack([serial, -serial], dim=1).to(torch.float32),
            "done": torch.arange(length) == length - 1,
        },
        terminated=terminated,
    )


@pytest.fixture
def episode_factory():
    """The `make_episode` factory."""
    return make_episode


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["numpy", "torch"])
def index_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the index arithmetic on numpy views (what CPU storage uses) and on
    tensors (what an accelerator uses), so the accelerator's code path is tested on CPU too.
    """
    monkeypatch.setattr(lucid_replay.arrays, "numpy_on_cpu", request.param == "numpy")
    return str(request.param)


def _comparable(value: object) -> object:
    """``value`` with every tensor replaced by its dtype, shape and bytes, for ``==``."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        return (
            "tensor",
            str(value.dtype),
            tuple(value.shape),
            flat.view(torch.uint8).numpy().tobytes(),
        )
    if isinstance(value, dict):
        return {key: _comparable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_comparable(item) for item in value)
    return value


def snapshot(buffer: lucid_replay.SequenceReplay) -> object:
    """Everything a refused call must leave unchanged: the whole state dict (stored data,
    episode table, counters, RNG state, beta and maximum priority) and the stats."""
    return _comparable({"state": buffer.state_dict(), "stats": buffer.stats()})


def assert_refused(buffer, call, error: type[BaseException], match: str) -> None:
    """``call()`` raises ``error`` (message matching ``match``) and changes nothing."""
    before = snapshot(buffer)
    with pytest.raises(error, match=match):
        call()
    assert snapshot(buffer) == before
