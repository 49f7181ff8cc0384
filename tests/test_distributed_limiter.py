"""Rate limiting as Reverb: the limiter's state machine against a plain model, and its waits.

The model states the rules once, from scratch: size = inserts - deletes, error = inserts *
spi - samples, counting stored inserts only; a sample of n needs size >= min_size and
error - n >= min_diff, an insert of n needs size + n <= min_size or error + n * spi <=
max_diff, counting admitted (pending) inserts as stored. Calls that may not proceed time out
with nothing counted.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import make_episode, snapshot
from hypothesis import settings, strategies
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lucid_replay import Episode, InvalidArgumentError, RateLimiterTimeout, Window
from lucid_replay.distributed import MinSize, SampleToInsertRatio, ShardedReplay
from lucid_replay.distributed.limiter import RateLimiter


class _Model:
    def __init__(self, min_size: int, spi: float, low: float, high: float) -> None:
        self.min_size, self.spi, self.low, self.high = min_size, spi, low, high
        self.inserts = self.deletes = self.samples = self.pending = 0

    def may_insert(self, n: int) -> bool:
        admitted = self.inserts + self.pending
        size = admitted - self.deletes
        return size + n <= self.min_size or (admitted + n) * self.spi - self.samples <= self.high

    def may_sample(self, n: int) -> bool:
        size = self.inserts - self.deletes
        return size >= self.min_size and self.inserts * self.spi - self.samples - n >= self.low


class LimiterMachine(RuleBasedStateMachine):
    """Random inserts, samples and deletes (timeout 0) against the model."""

    @initialize(
        spi=strategies.sampled_from([0.5, 1.0, 4.0]),
        min_size=strategies.integers(0, 20),
        buffer=strategies.integers(8, 60),
        kind=strategies.sampled_from(["ratio", "min_size"]),
    )
    def start(self, spi: float, min_size: int, buffer: int, kind: str) -> None:
        if kind == "ratio":
            config = SampleToInsertRatio(spi, min_size, float(buffer))
            offset = spi * min_size
            self.model = _Model(min_size, spi, offset - buffer, offset + buffer)
        else:
            config = MinSize(max(min_size, 1))
            self.model = _Model(max(min_size, 1), 1.0, -float("inf"), float("inf"))
        self.limiter = RateLimiter(config)
        self.in_flight: list[int] = []

    @rule(n=strategies.integers(1, 12))
    def insert(self, n: int) -> None:
        allowed = self.model.may_insert(n)
        assert self.limiter.can_insert(n) == allowed
        if allowed:
            self.limiter.acquire_insert(n, timeout=0)
            self.limiter.commit_insert(n)
            self.model.inserts += n
        else:
            with pytest.raises(RateLimiterTimeout, match="insert of"):
                self.limiter.acquire_insert(n, timeout=0)

    @rule(n=strategies.integers(1, 12))
    def admit(self, n: int) -> None:
        """An insert admitted, its shards not replied yet."""
        if self.model.may_insert(n):
            self.limiter.acquire_insert(n, timeout=0)
            self.in_flight.append(n)
            self.model.pending += n

    @rule(share=strategies.floats(0.0, 1.0))
    def settle(self, share: float) -> None:
        """The oldest admitted insert's shards replied: part stored, the rest refused."""
        if self.in_flight:
            n = self.in_flight.pop(0)
            stored = int(n * share)
            self.limiter.commit_insert(stored, n - stored)
            self.model.pending -= n
            self.model.inserts += stored

    @rule(n=strategies.integers(1, 12))
    def sample(self, n: int) -> None:
        allowed = self.model.may_sample(n)
        assert self.limiter.can_sample(n) == allowed
        if allowed:
            self.limiter.acquire_sample(n, timeout=0)
            self.model.samples += n
        else:
            with pytest.raises(RateLimiterTimeout, match="sample of"):
                self.limiter.acquire_sample(n, timeout=0)

    @rule(n=strategies.integers(1, 6))
    def delete(self, n: int) -> None:
        n = min(n, self.model.inserts - self.model.deletes)
        self.limiter.release(deletes=n)
        self.model.deletes += n

    @invariant()
    def counters_agree(self) -> None:
        if hasattr(self, "model"):
            state = self.limiter.state()
            model = self.model
            assert (state["inserts"], state["deletes"], state["samples"]) == (
                model.inserts,
                model.deletes,
                model.samples,
            )
            assert state["pending"] == model.pending


LimiterMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_limiter_state_machine_matches_the_model = LimiterMachine.TestCase


def test_a_sample_blocked_by_min_size_is_released_by_an_insert():
    """A waiting sample proceeds as soon as another thread's insert reaches min_size."""
    limiter = RateLimiter(MinSize(10))
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (limiter.acquire_sample(4, None), done.set()))
    waiter.start()
    time.sleep(0.05)
    assert not done.is_set()
    limiter.acquire_insert(10, timeout=0)
    assert not limiter.can_sample(4)  # admitted, not stored yet
    limiter.commit_insert(10)
    waiter.join(timeout=10)
    assert done.is_set() and limiter.state()["samples"] == 4


def test_an_insert_blocked_by_the_ratio_is_released_by_a_sample():
    """Past the error band inserts wait until samples bring the error back."""
    limiter = RateLimiter(SampleToInsertRatio(1.0, 0, (-4.0, 4.0)))
    limiter.acquire_insert(4, timeout=0)
    limiter.commit_insert(4)
    with pytest.raises(RateLimiterTimeout):
        limiter.acquire_insert(2, timeout=0.01)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (limiter.acquire_insert(2, None), done.set()))
    waiter.start()
    limiter.acquire_sample(3, timeout=0)
    waiter.join(timeout=10)
    assert done.is_set() and limiter.state()["pending"] == 2


def test_limiter_configurations_are_checked():
    """Reverb's rule on the band, and the house messages for bad values."""
    assert SampleToInsertRatio(2.0, 10, 5.0).bounds() == (10, 2.0, 15.0, 25.0)
    with pytest.raises(InvalidArgumentError, match=r"max_diff - min_diff >= 2"):
        SampleToInsertRatio(4.0, 10, 3.0)
    with pytest.raises(InvalidArgumentError, match="samples_per_insert must be > 0"):
        SampleToInsertRatio(0.0, 10, 5.0)
    with pytest.raises(InvalidArgumentError, match="min_size must be >= 1"):
        MinSize(0)
    with pytest.raises(TypeError, match="rate_limiter must be"):
        ShardedReplay.create(2, 100, backend="local", rate_limiter=5)  # type: ignore[arg-type]


def test_a_timed_out_sample_or_add_changes_nothing():
    """RateLimiterTimeout leaves the limiter, the shards and the coordinator untouched."""
    replay = ShardedReplay.create(2, 400, seed=0, backend="local", rate_limiter=MinSize(20))
    replay.add(make_episode(8))
    shard_state = snapshot(replay._shards[0].target.buffer)
    limiter = replay.stats()["limiter"]
    rng = replay._state.rng.bit_generator.state
    with pytest.raises(RateLimiterTimeout, match="sample of 4"):
        replay.sample_windows(4, Window(2), timeout=0.05)
    assert isinstance(RateLimiterTimeout("x"), TimeoutError)
    assert replay.stats()["limiter"] == limiter and replay._state.rng.bit_generator.state == rng
    assert snapshot(replay._shards[0].target.buffer) == shard_state
    replay.extend(make_episode(8) for _ in range(2))
    assert replay.sample_windows(4, Window(2), timeout=0).batch_size == 4
    assert replay.stats()["limiter"]["samples"] == 4

    ratio = SampleToInsertRatio(1.0, 8, (-4.0, 20.0))
    limited = ShardedReplay.create(2, 400, seed=0, backend="local", rate_limiter=ratio)
    for _ in range(2):  # 8 free (up to min_size), then 8 more within the band
        limited.add(make_episode(8), timeout=0)
    with pytest.raises(RateLimiterTimeout, match="insert of 8 transitions"):
        limited.add(make_episode(8), timeout=0.02)
    assert limited.stats()["episodes_added"] == 2
    assert limited.stats()["limiter"]["inserts"] == 16


def test_a_blocked_add_proceeds_once_the_learner_samples():
    """An add waiting on the ratio is released by a sample from another thread."""
    ratio = SampleToInsertRatio(1.0, 8, (-4.0, 20.0))
    replay = ShardedReplay.create(2, 400, seed=0, backend="local", rate_limiter=ratio)
    for _ in range(2):
        replay.add(make_episode(8), timeout=0)
    added: list[int] = []
    writer = threading.Thread(target=lambda: added.append(replay.add(make_episode(8))))
    writer.start()
    time.sleep(0.05)
    assert not added
    replay.sample_windows(8, Window(2), timeout=1)
    writer.join(timeout=10)
    assert len(added) == 1


@pytest.mark.parametrize("seed", range(4))
def test_a_sampler_waiting_on_min_size_is_released_only_once_the_shards_stored_the_data(seed):
    """A sample blocked on MinSize waits until the insert that reaches min_size is stored,
    then draws: it is never released into a replay that does not hold the data yet."""
    length = 40 + 7 * seed
    replay = ShardedReplay.create(2, 1000, seed=seed, backend="local", rate_limiter=MinSize(length))
    control = replay._control.target
    waiting, finished = threading.Event(), threading.Event()
    acquire = control.try_acquire

    def try_acquire(n: int, inserting: bool, wait_s: float | None) -> bool:
        if not inserting:
            waiting.set()
        return acquire(n, inserting, wait_s)

    control.try_acquire = try_acquire
    shard = replay._shards[0].target
    store = shard.add
    released_early: list[bool] = []

    def add(packed):  # the shard has the episode, has not stored it yet
        released_early.append(control.limiter.can_sample(4))
        if released_early[-1]:
            finished.wait(10)  # let the released sampler run into the empty replay
        return store(packed)

    shard.add = add
    box: dict[str, object] = {}

    def sampler() -> None:
        try:
            box["batch"] = replay.sample_windows(4, Window(3), timeout=30)
        except Exception as error:
            box["error"] = error
        finally:
            finished.set()

    thread = threading.Thread(target=sampler)
    thread.start()
    assert waiting.wait(10)
    replay.add(
        Episode({"x": torch.randn(length, 3, generator=torch.Generator().manual_seed(seed))})
    )
    thread.join(30)
    assert "error" not in box, box.get("error")
    assert box["batch"].batch_size == 4 and released_early == [False]
    assert replay.stats()["limiter"]["inserts"] == length


def test_an_add_a_shard_refuses_counts_only_what_the_other_shards_stored():
    """When one shard of an extend fails, the limiter counts the transitions the others
    stored (samplers may draw them) and nothing stays pending."""
    replay = ShardedReplay.create(2, 1000, seed=0, backend="local", rate_limiter=MinSize(10))

    def refuse(packed, call=None):
        raise OSError(28, "No space left on device")

    replay._shards[1].target.add = refuse
    with pytest.raises(OSError, match="No space left"):
        replay.extend([make_episode(12), make_episode(5)])  # shard 0 stores 12, shard 1 fails
    limiter = replay.stats()["limiter"]
    assert (limiter["inserts"], limiter["size"]) == (12, 12)
    assert limiter["pending"] == 0
    assert replay.stats()["transitions_stored"] == 12
    assert replay.sample_windows(2, Window(3), timeout=0).batch_size == 2
