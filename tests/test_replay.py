"""`SequenceReplay`: construction, `sample` and its refusals, the uniform laws of chunks,
determinism under a seed, stats and thread safety.

``unit="chunk"`` draws every eligible (episode, start) equally often; ``unit="episode"`` draws
every episode at least ``length`` long equally often, then a start uniformly.

Every step of a test episode carries a unique int64 ``serial`` (see `conftest.make_episode`), so a
chunk can be checked against the episode and start the batch reports for it.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import attrs
import numpy as np
import pytest
import torch
from conftest import (
    DRIVE_CONFIG_IDS,
    DRIVE_CONFIGS,
    assert_batches_equal,
    assert_chunks_match_storage,
    drive,
    filled_buffer,
    make_episode,
    seeded_twins,
)
from scipy import stats as scipy_stats
from stats import chi_square_pvalue

from lucid_replay import Batch, SequenceReplay

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic

REQUIRED_STATS = {
    "episodes_added",
    "transitions_added",
    "episodes_evicted",
    "transitions_evicted",
    "episodes_evicted_unsampled",
    "episodes_retired",
    "chunks_sampled",
}


# ----------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"capacity": 0}, ValueError, "capacity must be >= 1, got 0"),
        ({"capacity": -5}, ValueError, "capacity must be >= 1, got -5"),
        ({"capacity": 2.5}, TypeError, "capacity must be an int, got 2.5"),
        ({"unit": "step"}, ValueError, r"unit must be one of \('chunk', 'episode'\), got 'step'"),
        ({"max_times_sampled": 0}, ValueError, "max_times_sampled must be >= 1, got 0"),
        ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
    ],
)
def test_constructor_refuses_bad_arguments(kwargs, error, message):
    """Bad constructor arguments raise with the house message template."""
    with pytest.raises(error, match=message):
        SequenceReplay(**{"capacity": 10, **kwargs})


def test_constructor_properties():
    """`capacity`, `unit`, `max_times_sampled`, `device` reflect the constructor."""
    buffer = SequenceReplay(17, unit="episode", max_times_sampled=4, seed=1)
    assert buffer.capacity == 17
    assert buffer.unit == "episode"
    assert buffer.max_times_sampled == 4
    assert buffer.device == torch.device("cpu")
    assert SequenceReplay(5).unit == "chunk"
    assert SequenceReplay(5).max_times_sampled is None


# ---------------------------------------------------------------------------- sample()


@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_sample_shapes_dtypes_and_consistency(unit):
    """Fields are [B, length, *field_shape] with stored dtypes; ids/starts match the data."""
    buffer = filled_buffer(unit=unit)
    batch = buffer.sample(32, 4)
    assert isinstance(batch, Batch)
    assert batch["serial"].shape == (32, 4)
    assert batch["serial"].dtype == torch.int64
    assert batch["obs"].shape == (32, 4, 2)
    assert batch["obs"].dtype == torch.float32
    assert batch["done"].shape == (32, 4)
    assert batch["done"].dtype == torch.bool
    assert batch.data["obs"] is batch["obs"]
    assert batch.episode_ids.shape == (32,)
    assert batch.episode_ids.dtype == torch.int64
    assert batch.starts.shape == (32,)
    assert batch.starts.dtype == torch.int64
    assert bool((batch["serial"].diff(dim=1) == 1).all())
    assert_chunks_match_storage(buffer, batch, 4)


def test_sample_of_the_longest_length_only_draws_whole_episodes():
    """`length` equal to the longest episode draws that episode from start 0 only."""
    buffer = filled_buffer()
    longest = max(len(buffer[i]) for i in buffer.episode_ids)
    batch = buffer.sample(16, longest)
    assert set(batch.starts.tolist()) == {0}
    assert len(set(batch.episode_ids.tolist())) == 1
    assert_chunks_match_storage(buffer, batch, longest)


def test_sample_length_one_covers_every_stored_step():
    """With length 1 every stored step is a chunk; enough draws reach each of them."""
    buffer = filled_buffer(capacity=20, lengths=(6, 5, 4, 3, 2, 1))
    batch = buffer.sample(2_000, 1)
    stored = {int(s) for i in buffer.episode_ids for s in buffer[i]["serial"]}
    assert set(batch["serial"].flatten().tolist()) == stored


def test_sample_device_argument_and_batch_to():
    """`device=` places the batch; `Batch.to` returns a moved copy with the same values."""
    buffer = filled_buffer()
    batch = buffer.sample(4, 2, device="cpu")
    assert batch["obs"].device == torch.device("cpu")
    moved = batch.to("cpu", non_blocking=False)
    assert isinstance(moved, Batch)
    assert_batches_equal(batch, moved)


def test_batch_is_frozen():
    """`Batch` fields cannot be re-bound."""
    batch = filled_buffer().sample(2, 2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        batch.starts = torch.zeros(2, dtype=torch.int64)


def test_sample_from_empty_buffer_is_refused():
    """Sampling an empty buffer raises ValueError saying it is empty."""
    buffer = SequenceReplay(10, seed=0)
    with pytest.raises(ValueError, match="the buffer must be non-empty to sample"):
        buffer.sample(1, 1)


def test_sample_longer_than_every_episode_is_refused():
    """No episode with T >= length: ValueError stating the longest stored length."""
    buffer = SequenceReplay(30, seed=0)
    for length in (3, 7, 5):
        buffer.add(make_episode(length))
    before = buffer.stats()
    with pytest.raises(ValueError, match=r"longest stored episode \(7 steps\), got 8"):
        buffer.sample(4, 8)
    assert buffer.stats() == before


@pytest.mark.parametrize(
    ("batch_size", "length", "message"),
    [
        (0, 2, "batch_size must be >= 1, got 0"),
        (-3, 2, "batch_size must be >= 1, got -3"),
        (2, 0, "length must be >= 1, got 0"),
        (2, -1, "length must be >= 1, got -1"),
    ],
)
def test_sample_refuses_non_positive_sizes(batch_size, length, message):
    """`batch_size < 1` or `length < 1` raises ValueError."""
    buffer = filled_buffer()
    with pytest.raises(ValueError, match=message):
        buffer.sample(batch_size, length)


@pytest.mark.parametrize(
    ("batch_size", "length", "message"),
    [
        (2.0, 2, r"batch_size must be an int, got 2.0"),
        ("2", 2, r"batch_size must be an int, got '2'"),
        (True, 2, r"batch_size must be an int, got True"),
        (2, 3.0, r"length must be an int, got 3.0"),
        (2, None, r"length must be an int, got None"),
    ],
)
def test_sample_refuses_non_int_arguments(batch_size, length, message):
    """Non-integer `batch_size` / `length` (floats, strings, bools, None) raise TypeError."""
    buffer = filled_buffer()
    with pytest.raises(TypeError, match=message):
        buffer.sample(batch_size, length)


def test_sample_accepts_numpy_integers():
    """numpy integers are integers: `sample(np.int64(3), np.int32(2))` works."""
    batch = filled_buffer().sample(np.int64(3), np.int32(2))
    assert batch["serial"].shape == (3, 2)


# --------------------------------------------------------------------------- statistics

STAT_LENGTHS = [3, 5, 8, 13, 2]  # the 2-step episode is never eligible for length 3
STAT_LENGTH = 3
STAT_DRAWS = 20_000


def _stat_buffer(unit: str, seed: int) -> tuple[SequenceReplay, dict[int, int]]:
    """Episodes of varied lengths stored across the ring's seam (a 10-step prefix evicted)."""
    buffer = SequenceReplay(32, unit=unit, seed=seed)
    buffer.add(make_episode(10))
    lengths = {buffer.add(make_episode(n)): n for n in STAT_LENGTHS}
    assert list(buffer.episode_ids) == list(lengths)  # the prefix is gone: storage wraps
    return buffer, lengths


def _chunk_counts(buffer: SequenceReplay, cells: list[tuple[int, int]]) -> np.ndarray:
    counts: Counter[tuple[int, int]] = Counter()
    for _ in range(4):
        batch = buffer.sample(STAT_DRAWS // 4, STAT_LENGTH)
        counts.update(zip(batch.episode_ids.tolist(), batch.starts.tolist(), strict=True))
    assert set(counts) <= set(cells), "a chunk outside every eligible (episode, start) was drawn"
    return np.array([counts[cell] for cell in cells], dtype=np.float64)


def _cells_and_models(lengths: dict[int, int]) -> tuple[list, np.ndarray, np.ndarray]:
    """All eligible (episode, start) cells; P(cell) under unit="chunk" and unit="episode"."""
    cells = [(e, s) for e, n in lengths.items() for s in range(n - STAT_LENGTH + 1)]
    starts = {e: n - STAT_LENGTH + 1 for e, n in lengths.items() if n >= STAT_LENGTH}
    per_chunk = np.full(len(cells), 1.0 / len(cells))
    per_episode = np.array([1.0 / len(starts) / starts[e] for e, _ in cells])
    return cells, per_chunk, per_episode


@pytest.mark.statistical
def test_chunk_unit_draws_every_chunk_uniformly():
    """`unit="chunk"`: each (episode, start) window inside an episode is equally likely."""
    buffer, lengths = _stat_buffer("chunk", seed=11)
    cells, per_chunk, per_episode = _cells_and_models(lengths)
    assert len(cells) == 1 + 3 + 6 + 11
    observed = _chunk_counts(buffer, cells)
    assert chi_square_pvalue(observed, per_chunk) > 1e-3
    # The test has power: the episode-uniform law, a law proportional to T (uniform over
    # transitions rather than chunks), and even a 10% mixture of the episode-uniform law are
    # all rejected by the same counts.
    assert chi_square_pvalue(observed, per_episode) < 1e-12
    per_transition = np.array([lengths[e] / (lengths[e] - STAT_LENGTH + 1) for e, _ in cells])
    assert chi_square_pvalue(observed, per_transition) < 1e-12
    mixture = 0.9 * per_chunk + 0.1 * per_episode
    assert chi_square_pvalue(observed, mixture) < 1e-3


@pytest.mark.statistical
def test_episode_unit_draws_eligible_episodes_then_starts_uniformly():
    """`unit="episode"`: episodes with T >= length equally likely, then a uniform start."""
    buffer, lengths = _stat_buffer("episode", seed=12)
    cells, per_chunk, per_episode = _cells_and_models(lengths)
    observed = _chunk_counts(buffer, cells)
    assert chi_square_pvalue(observed, per_episode) > 1e-3
    # Marginals: episodes uniform among the 4 eligible ones, starts uniform within each.
    by_episode = Counter()
    for (episode_id, _), count in zip(cells, observed, strict=True):
        by_episode[episode_id] += count
    eligible = [e for e, n in lengths.items() if n >= STAT_LENGTH]
    episode_counts = np.array([by_episode[e] for e in eligible])
    assert scipy_stats.chisquare(episode_counts).pvalue > 1e-3
    # Power: the chunk-uniform law and a 10% mixture of it are rejected.
    assert chi_square_pvalue(observed, per_chunk) < 1e-12
    assert chi_square_pvalue(observed, 0.9 * per_episode + 0.1 * per_chunk) < 1e-3


# -------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("config", DRIVE_CONFIGS, ids=DRIVE_CONFIG_IDS)
def test_same_seed_and_calls_give_identical_batches(config):
    """Two buffers with the same seed and the same calls draw identical batches."""
    first, second = seeded_twins(**config)
    for one, two in zip(drive(first), drive(second), strict=True):
        assert_batches_equal(one, two)


def test_different_seeds_give_different_batches():
    """The seed matters: another seed draws other chunks."""
    first, _ = seeded_twins()
    other = SequenceReplay(40, seed=8)
    for index, length in enumerate((9, 3, 7, 12, 5, 8, 2, 6)):
        other.add(make_episode(length, first_serial=1_000 * index))
    assert not torch.equal(first.sample(64, 2).starts, other.sample(64, 2).starts)


def test_torch_generator_as_seed_matches_the_integer_seed():
    """`seed=torch.Generator().manual_seed(7)` draws exactly what `seed=7` draws."""
    by_int, _ = seeded_twins()
    by_generator = SequenceReplay(40, seed=torch.Generator().manual_seed(7))
    for index, length in enumerate((9, 3, 7, 12, 5, 8, 2, 6)):
        by_generator.add(make_episode(length, first_serial=1_000 * index))
    for one, two in zip(drive(by_int), drive(by_generator), strict=True):
        assert_batches_equal(one, two)


# -------------------------------------------------------------------------------- stats


def test_stats_has_every_key_and_starts_at_zero():
    """`stats()` holds every documented counter, all zero for a new buffer."""
    stats = SequenceReplay(10).stats()
    assert set(stats) >= REQUIRED_STATS
    assert all(stats[key] == 0 for key in REQUIRED_STATS)
    assert all(isinstance(value, int) for value in stats.values())


def test_stats_after_a_known_sequence():
    """Counters after a hand-traced sequence of adds, evictions and samples."""
    buffer = SequenceReplay(10, seed=0)
    buffer.add(make_episode(4))  # id 0, steps 0..3
    buffer.sample(3, 4)  # id 0 sampled three times
    buffer.add(make_episode(4))  # id 1, steps 4..7
    buffer.add(make_episode(5))  # id 2 needs 5: evicts id 0 (sampled)
    buffer.sample(2, 5)  # id 2 is the only 5-step episode
    buffer.add(make_episode(6))  # id 3 needs 6 of 10: evicts id 1 (unsampled) and id 2
    stats = buffer.stats()
    expected = {
        "episodes_added": 4,
        "transitions_added": 19,
        "episodes_evicted": 3,
        "transitions_evicted": 13,
        "episodes_evicted_unsampled": 1,
        "episodes_retired": 0,
        "chunks_sampled": 5,
    }
    assert {key: stats[key] for key in REQUIRED_STATS} == expected
    assert list(buffer.episode_ids) == [3]
    assert len(buffer) == 6


def test_stats_count_retirements_and_unsampled_evictions():
    """`episodes_retired` counts episodes reaching K; unsampled evictions are counted."""
    buffer = SequenceReplay(12, seed=0, max_times_sampled=2)
    for length in (2, 5, 5):  # ids 0, 1, 2
        buffer.add(make_episode(length))
    buffer.sample(4, 5)  # ids 1 and 2 twice each: both retired, not at the front
    stats = buffer.stats()
    assert stats["episodes_retired"] == 2
    assert stats["chunks_sampled"] == 4
    assert stats["episodes_evicted"] == 0
    buffer.add(make_episode(2))  # needs 2 of 12 (12 stored): evicts id 0, never sampled
    stats = buffer.stats()
    assert stats["episodes_evicted_unsampled"] == 1
    assert stats["episodes_retired"] == 2


def test_refused_sample_does_not_count():
    """A refused `sample` leaves `chunks_sampled` unchanged."""
    buffer = filled_buffer()
    before = buffer.stats()
    with pytest.raises(ValueError, match="longest stored episode"):
        buffer.sample(4, 100)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        buffer.sample(0, 2)
    assert buffer.stats() == before


# ------------------------------------------------------------------------ thread safety


def test_concurrent_adds_and_samples_never_tear_a_chunk():
    """2 writers and 2 readers for ~1 s: every chunk is consecutive steps of one episode."""
    buffer = SequenceReplay(300, seed=0)
    buffer.add(make_episode(10, first_serial=0))
    first_serial_of = {0: 0}  # episode id -> serial of its step 0 (written by the writers)
    errors: list[BaseException] = []
    seen: list[tuple[int, int]] = []  # (episode id, serial of step 0 implied by the chunk)
    writers_done = threading.Event()
    deadline = time.monotonic() + 1.0
    length = 4

    def write(writer: int) -> None:
        rng = random.Random(writer)
        count = 0
        try:
            while time.monotonic() < deadline:
                count += 1
                # serial = writer * 1e9 + episode * 1e3 + step
                first = (writer + 1) * 1_000_000_000 + count * 1_000
                episode_id = buffer.add(make_episode(rng.randint(1, 40), first_serial=first))
                first_serial_of[episode_id] = first
        except BaseException as error:
            errors.append(error)

    def read() -> None:
        draws = 0
        try:
            while not writers_done.is_set() or draws == 0:
                batch = buffer.sample(16, length)
                serial = batch["serial"]
                assert bool((serial.diff(dim=1) == 1).all()), "torn chunk"
                assert bool((serial[:, 0] % 1_000 == batch.starts).all()), "start mismatch"
                assert bool((batch["obs"][..., 0] == serial.float()).all()), "torn field"
                implied = serial[:, 0] - batch.starts
                seen.extend(zip(batch.episode_ids.tolist(), implied.tolist(), strict=True))
                draws += 1
        except BaseException as error:
            errors.append(error)

    writers = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in writers + readers:
        thread.start()
    for thread in writers:
        thread.join(timeout=30)
    writers_done.set()
    for thread in readers:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in writers + readers)
    assert errors == []
    assert len(first_serial_of) > 20
    assert len(seen) > 100
    for episode_id, first in seen:  # each chunk came from the episode the batch names
        assert first_serial_of[episode_id] == first
    assert len(buffer) <= 300
    assert list(buffer.episode_ids) == list(range(buffer.episode_ids.start, len(first_serial_of)))
