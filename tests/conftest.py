"""Shared fixtures and builders, imported by the test modules (``from conftest import ...``).

Small episodes whose every step carries a unique serial number; the two index engines; the
standard buffer with the anchors and tables computed by hand for it; wrapped buffers, seeded
twins and the calls that drive them; and prioritized buffers with known priorities.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import lucid_replay
from lucid_replay import engine

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


@pytest.fixture(params=list(engine.ENGINES))
def index_engine(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the index arithmetic in the compiled loops (what CPU storage uses
    when numba is installed), on numpy views (without them) and on tensors (what an
    accelerator uses), so that every code path is tested on CPU.
    """
    if request.param == "kernels" and not engine.available():
        pytest.skip("numba is not installed: the compiled loops cannot run")
    with engine.use(request.param):
        yield str(request.param)


# `index_engine` as a mark, for single tests in a module whose other tests run once.
both_engines = pytest.mark.usefixtures("index_engine")


def comparable(value: object) -> object:
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
        return {key: comparable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(comparable(item) for item in value)
    return value


def snapshot(buffer: lucid_replay.SequenceReplay) -> object:
    """Everything a refused call must leave unchanged: the whole state dict (stored data,
    episode table, counters, RNG state, beta and maximum priority) and the stats."""
    return comparable({"state": buffer.state_dict(), "stats": buffer.stats()})


def assert_refused(buffer, call, error: type[BaseException], match: str) -> None:
    """``call()`` raises ``error`` (message matching ``match``), a `LucidReplayError` like
    every deliberate refusal, and changes nothing."""
    before = snapshot(buffer)
    with pytest.raises(error, match=match) as raised:
        call()
    assert isinstance(raised.value, lucid_replay.LucidReplayError), type(raised.value)
    assert snapshot(buffer) == before


# ------------------------------------------------------------------- the standard buffer

F, T = False, True

# One window shape for every hand-computed table: records target t-4, t-2, t, t+2, t+4
# (W = 5); the learning records are k = 2, 3.
TABLE_WINDOW = {"length": 2, "burn_in": 2, "bootstrap": 1, "dilation": 2}

# The anchors of the hand-computed tables (episode id, step): (2, 1), (0, 3), (1, 0), (2, 4).
ANCHOR_IDS = [2, 0, 1, 2]
ANCHOR_STEPS = [1, 3, 0, 4]


def standard_buffer(
    buffer_type: type[lucid_replay.SequenceReplay] = lucid_replay.SequenceReplay,
    capacity: int = 100,
    **kwargs: object,
) -> lucid_replay.SequenceReplay:
    """Episodes of lengths [4, 2, 6] (ids 0, 1, 2; the second terminated) whose steps carry
    serials ``100 * (id + 1) + step``: global offsets 0..3, 4..5 and 6..11, nothing evicted
    (at the default capacity)."""
    buffer = buffer_type(capacity=capacity, **kwargs)
    buffer.add(make_episode(4, first_serial=100))
    buffer.add(make_episode(2, terminated=True, first_serial=200))
    buffer.add(make_episode(6, first_serial=300))
    return buffer


def write_values(batch_size: int = 4, window_size: int = 5) -> torch.Tensor:
    """int64 ``[batch_size, window_size]`` values to write back: ``9000 + window_size * b + k``."""
    return 9000 + torch.arange(batch_size * window_size, dtype=torch.int64).reshape(
        batch_size, window_size
    )


def stored(buffer: lucid_replay.SequenceReplay, episode_id: int, name: str = "serial") -> list:
    """The stored values of field ``name`` of episode ``episode_id``, as a list."""
    return buffer[episode_id][name].tolist()


NAN, INF = float("nan"), float("inf")

# Priority routing over TABLE_WINDOW with boundary="include_reset". Records of the anchors
# (2, 4), (0, 3), (1, 0), (2, 1):
#   (2, 4): episodes [2, 2, 2, 2, 2], valid [T, T, T, F, F]  -> counted k = 2
#   (0, 3): episodes [0, 0, 0, 1, 2], valid [F, T, T, T, T]  -> counted k = 2 (k = 3 is ep 1)
#   (1, 0): episodes [0, 0, 1, 2, 2], valid [T, T, T, T, T]  -> counted k = 2 (k = 3 is ep 2)
#   (2, 1): episodes [0, 1, 2, 2, 2], valid [T, T, T, T, T]  -> counted k = 2, 3
# The mixes below are those of eta = 0.75.
ROUTING_IDS = [2, 0, 1, 2]
ROUTING_STEPS = [4, 3, 0, 1]
ROUTING_ERRORS = [
    [0.0, 0.0, 4.0, NAN, 0.0],  # only 4.0 counts              -> 4.0
    [INF, 5.0, 0.5, 100.0, NAN],  # 5.0 burn-in, 100.0 episode 1 -> 0.5
    [7.0, 7.0, -1.5, 9.0, 8.0],  # 9.0 belongs to episode 2   -> 1.5
    [NAN, INF, -3.0, 1.0, NAN],  # max 3, mean 2              -> 0.75*3 + 0.25*2 = 2.75
]


# ------------------------------------------------------------ wrapped buffers and twins


def assert_chunks_match_storage(
    buffer: lucid_replay.SequenceReplay, batch: lucid_replay.Batch, length: int
) -> None:
    """Every chunk is steps ``start .. start+length-1`` of the episode the batch names."""
    for row, (episode_id, start) in enumerate(
        zip(batch.episode_ids.tolist(), batch.starts.tolist(), strict=True)
    ):
        episode = buffer[episode_id]
        assert 0 <= start <= len(episode) - length
        for name in episode:
            assert torch.equal(batch[name][row], episode[name][start : start + length])


def assert_batches_equal(first: lucid_replay.Batch, second: lucid_replay.Batch) -> None:
    """Both batches drew the same episodes and starts and hold equal data."""
    assert torch.equal(first.episode_ids, second.episode_ids)
    assert torch.equal(first.starts, second.starts)
    assert first.data.keys() == second.data.keys()
    for name in first.data:
        assert torch.equal(first[name], second[name])


def filled_buffer(
    capacity: int = 40, lengths=(9, 3, 7, 12, 5, 8, 2, 6), **kwargs
) -> lucid_replay.SequenceReplay:
    """A buffer whose ring has wrapped (with the default lengths and capacity)."""
    buffer = lucid_replay.SequenceReplay(capacity, **{"seed": 0, **kwargs})
    for index, length in enumerate(lengths):
        buffer.add(make_episode(length, terminated=index % 2 == 0))
    return buffer


def drive(buffer: lucid_replay.SequenceReplay, rounds: int = 3) -> list[lucid_replay.Batch]:
    """A fixed sequence of calls: samples of mixed lengths with adds in between."""
    batches = []
    for round_ in range(rounds):
        batches.append(buffer.sample(5, 2))
        batches.append(buffer.sample(3, 4))
        buffer.add(make_episode(4 + round_, first_serial=10_000 * (round_ + 1)))
        batches.append(buffer.sample(4, 1))
    return batches


def seeded_twins(**kwargs) -> tuple[lucid_replay.SequenceReplay, lucid_replay.SequenceReplay]:
    """Two buffers seeded 7 (unless ``kwargs`` say otherwise) holding the same wrapped ring."""
    lengths = (9, 3, 7, 12, 5, 8, 2, 6)
    made = []
    for _ in range(2):
        buffer = lucid_replay.SequenceReplay(40, **{"seed": 7, **kwargs})
        for index, length in enumerate(lengths):
            buffer.add(make_episode(length, first_serial=1_000 * index))
        made.append(buffer)
    return made[0], made[1]


# Configurations that `drive` runs under, and their test ids.
DRIVE_CONFIGS = [{}, {"unit": "episode"}, {"max_times_sampled": 6}]
DRIVE_CONFIG_IDS = ["chunk", "episode", "reuse-limit"]


# ------------------------------------------------------------------ prioritized buffers

EPSILON = 1e-6  # the epsilon of `prioritized_buffer`


def prioritized_buffer(
    unit: str = "chunk",
    alpha: float = 0.6,
    *,
    lengths: list[int],
    errors: list[float] | None,
    seed: int = 0,
    capacity: int = 1_000,
    **kwargs: object,
) -> tuple[lucid_replay.PrioritizedSequenceReplay, list[int]]:
    """A prioritized buffer (epsilon EPSILON) of episodes of ``lengths``, and their ids; the
    priorities come from ``errors`` unless it is ``None``."""
    buffer = lucid_replay.PrioritizedSequenceReplay(
        capacity, alpha=alpha, epsilon=EPSILON, unit=unit, seed=seed, **kwargs
    )
    ids = buffer.extend(make_episode(n) for n in lengths)
    if errors is not None:
        assert buffer.update_priorities(ids, errors) == len(ids)
    return buffer, ids


def priorities_of(errors: list[float]) -> np.ndarray:
    """The priorities ``|error| + EPSILON`` that `prioritized_buffer` sets for ``errors``."""
    return np.abs(np.asarray(errors, dtype=np.float64)) + EPSILON
