"""`SequenceReplay` against a plain-Python model buffer (Hypothesis state machine).

The model is a list of ``(episode id, [serials], terminated)`` with oldest-first eviction of whole
episodes; the real buffer must agree with it on ids, lengths, contents, lookups, sampling
errors and every sampled chunk, through save/load and state-dict round trips.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from conftest import make_episode
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lucid_replay import SequenceReplay, engine

CAPACITY = 13


class ReplayModel(RuleBasedStateMachine):
    """Random adds, samples, lookups and round trips, each checked against the model."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = SequenceReplay(CAPACITY, seed=0)
        self.episodes: list[tuple[int, list[int], bool]] = []
        self.next_id = 0
        self.added = {"episodes": 0, "transitions": 0}
        self.evicted = {"episodes": 0, "transitions": 0}

    # --------------------------------------------------------------------------- model
    def _model_add(self, serials: list[int], terminated: bool) -> int:
        while sum(len(s) for _, s, _ in self.episodes) + len(serials) > CAPACITY:
            _, gone, _ = self.episodes.pop(0)
            self.evicted["episodes"] += 1
            self.evicted["transitions"] += len(gone)
        episode_id = self.next_id
        self.next_id += 1
        self.episodes.append((episode_id, serials, terminated))
        self.added["episodes"] += 1
        self.added["transitions"] += len(serials)
        return episode_id

    def _model_episode(self, episode_id: int) -> tuple[list[int], bool] | None:
        for stored_id, serials, terminated in self.episodes:
            if stored_id == episode_id:
                return serials, terminated
        return None

    # --------------------------------------------------------------------------- rules
    @rule(length=st.integers(1, CAPACITY), terminated=st.booleans())
    def add(self, length, terminated):
        """Adding returns the next id and evicts like the model."""
        first = 1_000 * (self.next_id + 1)  # step s of episode i has serial 1000 (i + 1) + s
        episode = make_episode(length, terminated=terminated, first_serial=first)
        expected_id = self._model_add(list(range(first, first + length)), terminated)
        assert self.buffer.add(episode) == expected_id

    @rule(length=st.integers(CAPACITY + 1, CAPACITY + 4))
    def add_too_long(self, length):
        """An episode longer than capacity is refused; nothing changes."""
        before = (len(self.buffer), list(self.buffer.episode_ids), self.buffer.stats())
        with pytest.raises(ValueError, match=rf"<= capacity \({CAPACITY}\), got {length}"):
            self.buffer.add(make_episode(length, first_serial=0))
        assert (len(self.buffer), list(self.buffer.episode_ids), self.buffer.stats()) == before

    @rule(batch_size=st.integers(1, 6), length=st.integers(1, CAPACITY + 1))
    def sample(self, batch_size, length):
        """Errors exactly when the model says so; else every chunk is a model window."""
        longest = max((len(s) for _, s, _ in self.episodes), default=0)
        if not self.episodes:
            with pytest.raises(ValueError, match="the buffer must be non-empty"):
                self.buffer.sample(batch_size, length)
            return
        if longest < length:
            with pytest.raises(
                ValueError, match=rf"longest stored episode \({longest} steps\), got {length}"
            ):
                self.buffer.sample(batch_size, length)
            return
        batch = self.buffer.sample(batch_size, length)
        assert batch["serial"].shape == (batch_size, length)
        assert batch["obs"].shape == (batch_size, length, 2)
        for row in range(batch_size):
            episode_id = int(batch.episode_ids[row])
            start = int(batch.starts[row])
            found = self._model_episode(episode_id)
            assert found is not None, f"sampled episode {episode_id} is not stored"
            serials, _ = found
            assert len(serials) >= length
            assert 0 <= start <= len(serials) - length
            assert batch["serial"][row].tolist() == serials[start : start + length]

    @rule(episode_id=st.integers(-2, 60))
    def lookup(self, episode_id):
        """`in` and `buffer[id]` agree with the model; KeyError says evicted/never issued."""
        found = self._model_episode(episode_id)
        assert (episode_id in self.buffer) == (found is not None)
        if found is None:
            state = "evicted" if 0 <= episode_id < self.next_id else "never issued"
            with pytest.raises(KeyError, match=re.escape(f"got {episode_id}: it was {state}")):
                self.buffer[episode_id]
        else:
            serials, terminated = found
            episode = self.buffer[episode_id]
            assert episode["serial"].tolist() == serials
            assert episode.terminated == terminated

    @rule()
    def save_and_load(self):
        """A save/load round trip keeps everything and leaves only the target file."""
        stats = self.buffer.stats()
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "buffer.pt"
            self.buffer.save(path)
            self.buffer = SequenceReplay.load(path)
            assert [p.name for p in Path(directory).iterdir()] == ["buffer.pt"]
        assert self.buffer.stats() == stats

    @rule()
    def state_dict_round_trip(self):
        """`load_state_dict` into a fresh buffer with another seed continues the model."""
        fresh = SequenceReplay(CAPACITY, seed=123)
        fresh.load_state_dict(self.buffer.state_dict())
        self.buffer = fresh

    @precondition(lambda self: self.episodes)
    @rule(data=st.data())
    def twin_after_round_trip_draws_the_same(self, data):
        """A state-dict twin draws exactly the same next batch."""
        length = data.draw(st.integers(1, max(len(s) for _, s, _ in self.episodes)))
        twin = SequenceReplay(CAPACITY, seed=5)
        twin.load_state_dict(self.buffer.state_dict())
        one, two = self.buffer.sample(3, length), twin.sample(3, length)
        assert torch.equal(one.episode_ids, two.episode_ids)
        assert torch.equal(one.starts, two.starts)
        assert torch.equal(one["serial"], two["serial"])

    # ---------------------------------------------------------------------- invariants
    @invariant()
    def sizes_match(self):
        """`len`, `num_episodes` and `episode_ids` match the model."""
        assert len(self.buffer) == sum(len(s) for _, s, _ in self.episodes)
        assert len(self.buffer) <= CAPACITY
        assert self.buffer.num_episodes == len(self.episodes)
        assert list(self.buffer.episode_ids) == [i for i, _, _ in self.episodes]

    @invariant()
    def contents_match(self):
        """Every stored episode holds the model's serials and flag."""
        for episode_id, serials, terminated in self.episodes:
            episode = self.buffer[episode_id]
            assert episode["serial"].tolist() == serials
            assert episode["obs"][:, 1].tolist() == [-float(s) for s in serials]
            assert episode.terminated == terminated

    @invariant()
    def counters_match(self):
        """Add and eviction counters match the model."""
        stats = self.buffer.stats()
        assert stats["episodes_added"] == self.added["episodes"]
        assert stats["transitions_added"] == self.added["transitions"]
        assert stats["episodes_evicted"] == self.evicted["episodes"]
        assert stats["transitions_evicted"] == self.evicted["transitions"]


ReplayModel.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestReplayModel = ReplayModel.TestCase


class TestReplayModelOnTensorArithmetic(ReplayModel.TestCase):  # type: ignore[misc,valid-type]
    """The same machine with the index arithmetic on tensors (an accelerator's code path)."""

    def setUp(self) -> None:
        self._engine = engine.use("torch")
        self._engine.__enter__()

    def tearDown(self) -> None:
        self._engine.__exit__(None, None, None)
