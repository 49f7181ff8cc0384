"""`EpisodeWriter` on a segmented buffer: every env's episode is streamed in segments.

The equivalence tests feed one gymnasium vector env's step stream to two writers at once, one
over a whole-episode `SequenceReplay` and one over a `SequenceReplay(segment_length=L)`, and
pair the episodes by the ids each call returned: the stored data, ``terminated`` and lengths
must be equal, while the streaming writer never holds ``L`` records of an env.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lucid_replay.writer
from lucid_replay import (
    EpisodesNotStoredError,
    EpisodeWriter,
    PrioritizedSequenceReplay,
    SequenceReplay,
)

gym = pytest.importorskip("gymnasium")
from gymnasium import spaces  # noqa: E402 (gymnasium is an optional extra)
from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402

MODES = ["next_step", "same_step", "disabled"]
GYM_MODES = {"next_step": "NextStep", "same_step": "SameStep", "disabled": "Disabled"}


class RandomEnv(gym.Env):
    """Dict observations ``code = [env, episode, step]`` (int64) and random ``pixels``
    (uint8 ``[2, 2]``); each episode lasts 1..14 steps (seeded) and ends terminated or
    truncated at random, so that many span several segments."""

    def __init__(self, env_id: int) -> None:
        self.env_id = env_id
        code = spaces.Box(0, 1_000_000, (3,), np.int64)
        pixels = spaces.Box(0, 255, (2, 2), np.uint8)
        self.observation_space = spaces.Dict({"code": code, "pixels": pixels})
        self.action_space = spaces.Discrete(5)
        self.episode = -1

    def _obs(self):
        code = np.array([self.env_id, self.episode, self.t], dtype=np.int64)
        return {"code": code, "pixels": self.np_random.integers(0, 256, (2, 2), dtype=np.uint8)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        self.length = int(self.np_random.integers(1, 15))
        self.truncates = bool(self.np_random.integers(2))
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        reward = float(self.np_random.normal()) + float(action)
        end = self.t >= self.length
        return self._obs(), reward, end and not self.truncates, end and self.truncates, {}


def run_both(mode, segment_length, *, kind=SequenceReplay, num_envs=4, calls=150, seed=3):
    """Drive a whole-episode and a segmented buffer's writers with one step stream.

    Besides steps: a flush and a masked reset of open episodes halfway, partial resets under
    ``"disabled"``, a final flush. Returns the two buffers, the two writers and the id pairs
    (whole, segmented) in the order the calls returned them.
    """
    envs = SyncVectorEnv(
        [lambda i=i: RandomEnv(i) for i in range(num_envs)],
        copy=False,  # the env overwrites its arrays in place: the writers must copy
        autoreset_mode=AutoresetMode(GYM_MODES[mode]),
    )
    whole, segmented = kind(10_000), kind(10_000, segment_length=segment_length)
    writers = [EpisodeWriter(b, num_envs, autoreset=mode) for b in (whole, segmented)]
    rng = np.random.default_rng(seed)
    pairs = []

    def call(method, *args, **kwargs):
        whole_ids, segmented_ids = (getattr(w, method)(*args, **kwargs) for w in writers)
        assert len(whole_ids) == len(segmented_ids)
        pairs.extend(zip(whole_ids, segmented_ids, strict=True))
        held = writers[1]._length[writers[1]._state == lucid_replay.writer._OPEN]
        assert held.max(initial=0) < segment_length  # records held by each open episode
        assert writers[1].stats()["open_steps"] <= num_envs * (segment_length - 1)

    observation, _ = envs.reset(seed=seed)
    call("reset", observation)
    for index in range(calls):
        action = rng.integers(0, 5, num_envs)
        h = torch.from_numpy(rng.normal(size=(num_envs, 2)).astype(np.float32))
        logits = rng.normal(size=(num_envs, 4))
        observation, reward, terminated, truncated, info = envs.step(action)
        call("step", action, reward, terminated, truncated, observation, info=info, h=h, q=logits)
        ended = terminated | truncated
        if mode == "disabled" and ended.any():
            observation, _ = envs.reset(options={"reset_mask": ended})
            call("reset", observation, env_mask=ended)
        if index == calls // 2:
            call("flush")
            call("reset", observation, env_mask=rng.random(num_envs) < 0.5)
    call("flush")
    envs.close()
    return whole, segmented, writers, pairs


@pytest.mark.parametrize("page_records", [2, 64], ids=["pages-of-2", "pages-of-64"])
@pytest.mark.parametrize("segment_length", [1, 3, 4])
@pytest.mark.parametrize("mode", MODES)
def test_segmented_buffer_stores_what_a_whole_episode_buffer_stores(
    mode, segment_length, page_records, monkeypatch
):
    """Episode by episode (paired by the ids the same calls returned), a segmented buffer
    holds the whole-episode buffer's data, terminated flags and lengths, closed; no other
    episode is stored or left open; an env's ids increase with its episodes; the writers
    count the same; and the streaming writer never held L records of an env."""
    monkeypatch.setattr(lucid_replay.writer, "_PAGE_RECORDS", page_records)
    whole, segmented, writers, pairs = run_both(mode, segment_length)
    assert [w for w, _ in pairs] == list(whole.episode_ids)  # every episode, in id order
    assert sorted(s for _, s in pairs) == sorted(segmented.episode_ids)
    assert segmented.open_episode_ids == []
    assert len(segmented) == len(whole)
    last_id = {}
    for whole_id, segmented_id in pairs:
        expected, stored = whole[whole_id], segmented[segmented_id]
        assert list(stored) == list(expected)
        for name in expected:
            assert stored[name].dtype == expected[name].dtype, name
            assert torch.equal(stored[name], expected[name]), name
        assert stored.terminated is expected.terminated
        info = segmented.episode_info(segmented_id)
        assert info.total_length == info.stored_length == len(expected)
        assert info.total_length == whole.episode_info(whole_id).total_length
        assert not info.is_open and info.terminated is expected.terminated
        assert info.num_segments == -(-len(expected) // segment_length)
        env = int(expected["code"][0, 0])
        assert segmented_id > last_id.get(env, -1)
        last_id[env] = segmented_id
    assert max(len(whole[w]) for w, _ in pairs) > 2 * segment_length + 1  # several segments
    assert writers[0].stats() == writers[1].stats()
    page = min(page_records, segment_length + 1)  # the pool: at most twice the pages in use
    assert writers[1]._pages.num_pages <= 2 * 4 * -(-(segment_length + 1) // page)


@pytest.mark.parametrize("priority_unit", ["episode", "segment"])
def test_a_segmented_prioritized_buffer_stores_the_same(priority_unit):
    """With a PrioritizedSequenceReplay the streamed episodes equal the added ones too."""

    def kind(capacity, segment_length=None):
        if segment_length is None:
            return PrioritizedSequenceReplay(capacity)
        return PrioritizedSequenceReplay(
            capacity, segment_length=segment_length, priority_unit=priority_unit
        )

    whole, segmented, _, pairs = run_both("next_step", 3, kind=kind, calls=60)
    assert pairs and sorted(s for _, s in pairs) == sorted(segmented.episode_ids)
    for whole_id, segmented_id in pairs:
        expected, stored = whole[whole_id], segmented[segmented_id]
        assert stored.terminated is expected.terminated
        assert all(torch.equal(stored[n], expected[n]) for n in expected)


# ----------------------------------------------------------------------------- scripted streams


def obs(*values):
    """Observations ``[N, 1]`` float32."""
    return np.array(values, dtype=np.float32)[:, None]


def flags(*values):
    return np.array(values, dtype=bool)


def step(writer, action, observation, *, terminated=(), truncated=()):
    """One step, rewards ``action + 0.5``; the flags name the envs that end."""
    n = writer.num_envs
    action = np.array(action, dtype=np.int64)
    term, trunc = np.isin(np.arange(n), terminated), np.isin(np.arange(n), truncated)
    return writer.step(action, action + 0.5, term, trunc, obs(*observation))


def flat(episode, name="observation"):
    return episode[name].flatten().tolist()


def test_records_are_committed_as_segments_while_the_episode_runs():
    """Each time an env holds L records they are committed as one segment by that call (the
    stream keeps nothing pending); the end appends the rest and the final record."""
    buffer = SequenceReplay(100, segment_length=3)
    writer = EpisodeWriter(buffer, 2)
    writer.reset(obs(0, 10))
    for t in range(1, 3):
        assert step(writer, [t, t], [t, 10 + t]) == []
        assert len(buffer) == 0 and buffer.open_episode_ids == []  # opened by the first send
    assert step(writer, [3, 3], [3, 13]) == []
    assert len(buffer) == 6 and buffer.open_episode_ids == [0, 1]
    assert writer._length.tolist() == [0, 0] and writer.stats()["open_steps"] == 0
    assert [s.pending for s in writer._sink.streams] == [0, 0]
    info = buffer.episode_info(0)
    assert (info.total_length, info.is_open, info.num_segments) == (3, True, 1)
    assert flat(buffer[0]) == [0, 1, 2] and buffer[0]["action"].tolist() == [1, 2, 3]
    assert step(writer, [4, 4], [4, 14], terminated=[1]) == [1]
    assert flat(buffer[1]) == [10, 11, 12, 13, 14] and buffer[1].terminated
    assert buffer[1]["action"].tolist() == [1, 2, 3, 4, 0]
    assert buffer[1]["reward"].tolist() == [1.5, 2.5, 3.5, 4.5, 0.0]
    assert buffer.open_episode_ids == [0] and writer._length[0] == 1
    stats = writer.stats()
    assert (stats["episodes_added"], stats["records_added"]) == (1, 3 + 5)


def test_flush_right_after_a_segment_closes_with_the_final_record_alone():
    """An env holding no record (its last L just went out) is flushed by appending its final
    record only; an episode ending there is stored exactly as on a whole-episode buffer."""
    buffer = SequenceReplay(100, segment_length=2)
    writer = EpisodeWriter(buffer, 1)
    writer.reset(obs(0))
    step(writer, [1], [1])
    step(writer, [2], [2])
    assert writer._length.tolist() == [0] and buffer.episode_info(0).total_length == 2
    assert writer.flush() == [0]
    assert flat(buffer[0]) == [0, 1, 2] and buffer[0]["action"].tolist() == [1, 2, 0]
    assert not buffer[0].terminated and buffer.open_episode_ids == []
    step(writer, [3], [3])  # the next episode starts at the observation reached
    step(writer, [4], [4], terminated=[0])
    assert flat(buffer[1]) == [2, 3, 4] and buffer[1].terminated


def test_reset_of_a_streamed_episode_closes_it_truncated():
    """A reset cutting an open episode whose segments are already committed closes its
    stream with terminated=False (as a whole-episode buffer stores it truncated); an env
    reset with no step opens nothing; close ends every open stream."""
    buffer = SequenceReplay(100, segment_length=2)
    writer = EpisodeWriter(buffer, 3, autoreset="disabled")
    writer.reset(obs(0, 10, 20))
    for t in range(1, 4):
        step(writer, [t] * 3, [t, 10 + t, 20 + t])
    assert buffer.open_episode_ids == [0, 1, 2]
    assert writer.reset(obs(5, 15, 25), env_mask=flags(True, False, False)) == [0]
    assert flat(buffer[0]) == [0, 1, 2, 3] and buffer[0]["action"].tolist() == [1, 2, 3, 0]
    info = buffer.episode_info(0)
    assert not info.is_open and not info.terminated and info.total_length == 4
    assert writer.reset(obs(6, 15, 25), env_mask=flags(True, False, False)) == []
    assert buffer.open_episode_ids == [1, 2]
    assert writer.close() == [1, 2]
    assert buffer.open_episode_ids == [] and writer.stats()["open_episodes"] == 0
    assert [flat(buffer[i]) for i in (1, 2)] == [[10, 11, 12, 13], [20, 21, 22, 23]]
    assert set(buffer.episode_ids) == {0, 1, 2}  # env 0's empty episode stored nothing


def test_a_refused_step_streams_nothing_and_changes_nothing():
    """A malformed step is refused before anything is appended: no segment is committed, no
    stream opened, the writer still holds its records, and the next good step goes on."""
    buffer = SequenceReplay(100, segment_length=2)
    writer = EpisodeWriter(buffer, 2)
    writer.reset(obs(0, 10))
    step(writer, [1, 1], [1, 11])
    with pytest.raises(TypeError, match=r"observation must be of dtype float32, got float64"):
        writer.step(
            np.array([2, 2]),
            np.ones(2),
            flags(False, False),
            flags(False, False),
            obs(2, 12).astype(np.float64),
        )
    assert len(buffer) == 0 and buffer.open_episode_ids == []
    assert writer._length.tolist() == [1, 1] and writer.stats()["steps"] == 2
    (ended,) = step(writer, [2, 2], [2, 12], terminated=[0])
    assert flat(buffer[ended]) == [0, 1, 2] and len(buffer) == 3 + 2


class FlakyBuffer:
    """A segmented buffer whose streams refuse appends to the episodes in ``refuse``."""

    def __init__(self, segment_length):
        self.inner = SequenceReplay(100, segment_length=segment_length)
        self.segment_length = segment_length
        self.refuse = set()

    def add(self, episode):
        raise AssertionError("a segmented buffer is streamed, never added to")

    def open_episode(self):
        stream, refuse = self.inner.open_episode(), self.refuse

        class Stream:
            episode_id = stream.episode_id

            @property
            def closed(self):
                return stream.closed

            def append(self, steps):
                if stream.episode_id in refuse:
                    raise ValueError("append refused")
                return stream.append(steps)

            def close(self, *, terminated):
                stream.close(terminated=terminated)

        return Stream()


@pytest.mark.parametrize("where", ["segment", "end"])
def test_a_refused_append_cuts_that_envs_episode_only(where):
    """A stream refusing an append (a full segment mid-episode, or an episode's last
    records) is reported by env with the records the writer held; the committed segments
    stay as a closed truncated episode; the other env streams on, and the refused env goes
    on from the observation reached (or its reset)."""
    buffer = FlakyBuffer(2)
    inner = buffer.inner
    writer = EpisodeWriter(buffer, 2, autoreset="disabled")
    writer.reset(obs(0, 10))
    for t in (1, 2, 3):
        step(writer, [t, t], [t, 10 + t])  # both envs commit a segment: episodes 0 and 1
    buffer.refuse.add(0)
    message = r"got 1 of 1 refused \(env 0: ValueError: append refused\); stored ids \[\]$"
    with pytest.raises(EpisodesNotStoredError, match=message) as caught:
        step(writer, [4, 4], [4, 14], terminated=[0] if where == "end" else [])
    buffer.refuse.clear()
    error = caught.value
    assert error.stored_ids == [] and list(error.refused) == [0]
    kept = error.episodes[0]
    assert flat(kept) == [2, 3, 4] and kept["action"].tolist() == [3, 4, 0]
    assert kept.terminated is (where == "end")
    head = inner.episode_info(0)
    assert not head.is_open and not head.terminated and head.total_length == 2
    assert flat(inner[0]) == [0, 1] and inner.open_episode_ids == [1]
    assert writer.stats()["episodes_dropped"] == 1 and writer._length[1] == 0
    assert writer._length[0] == (0 if where == "segment" else 2)  # cut, or ended unreset
    if where == "end":
        writer.reset(obs(40, 999), env_mask=flags(True, False))
    ids = step(writer, [5, 5], [5, 15], terminated=[0, 1])
    assert flat(inner[ids[0]]) == [4 if where == "segment" else 40, 5]
    assert ids[1] == 1 and flat(inner[1]) == [10, 11, 12, 13, 14, 15] and inner[1].terminated
    assert inner.open_episode_ids == []


@pytest.mark.parametrize("segment_length", [None, 3])
def test_a_buffer_without_streams_gets_whole_episodes(segment_length):
    """A buffer with segment_length None, or with one but no open_episode (a remote client),
    keeps getting whole episodes by add when they end."""

    class Added:
        def __init__(self):
            self.episodes = []
            self.segment_length = segment_length

        def add(self, episode):
            self.episodes.append(episode)
            return len(self.episodes) - 1

        if segment_length is None:

            def open_episode(self):
                raise AssertionError("not a segmented buffer")

    buffer = Added()
    writer = EpisodeWriter(buffer, 1)
    writer.reset(obs(0))
    for t in range(1, 5):
        step(writer, [t], [t])
    assert buffer.episodes == [] and writer._length.tolist() == [4]
    assert step(writer, [5], [5], truncated=[0]) == [0]
    assert flat(buffer.episodes[0]) == [0, 1, 2, 3, 4, 5]


def test_a_segment_length_that_is_no_int_is_refused():
    """A buffer whose segment_length is not a positive int is refused, naming it."""

    class Odd(SequenceReplay):
        segment_length = 2.5

    with pytest.raises(TypeError, match=r"buffer.segment_length must be an int"):
        EpisodeWriter(Odd(10), 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_gpu_fields_are_streamed_as_they_are_added(device):
    """Observations and fields on a GPU reach a segmented buffer (on the CPU or the GPU)
    exactly as the same calls store them in a whole-episode buffer."""
    buffers = [SequenceReplay(100, device=device, segment_length=k) for k in (None, 2)]
    writers = [EpisodeWriter(buffer, 2) for buffer in buffers]
    ids = [[], []]
    for writer in writers:
        writer.reset(torch.zeros(2, 3, device="cuda"))
    for t in range(1, 7):
        args = (np.array([t, t]), np.full(2, t + 0.5), flags(t == 5, False), flags(False, False))
        observation = torch.full((2, 3), float(t), device="cuda")
        h = torch.full((2, 2), float(t), device="cuda")
        for k, writer in enumerate(writers):
            ids[k] += writer.step(*args, observation, h=h)
    for k, writer in enumerate(writers):
        ids[k] += writer.flush()
    assert len(ids[0]) == len(ids[1]) == 2
    for whole_id, segmented_id in zip(*ids, strict=True):
        expected, stored = buffers[0][whole_id], buffers[1][segmented_id]
        assert stored.terminated is expected.terminated
        assert all(torch.equal(stored[n], expected[n]) for n in expected)
