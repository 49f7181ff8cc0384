"""`EpisodeWriter`: whole episodes from a gymnasium vector env's step stream.

The stream tests run a real `gymnasium.vector.SyncVectorEnv` (with ``copy=False``, so the env
overwrites its arrays in place) over a counter env whose observation encodes (env, episode,
step), and compare what the writer stored with ground truth from stepping one plain env per
index with the same seed and the same policy: attribution errors, lost or duplicated steps
and misplaced records all show.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import lucid_replay.writer
from lucid_replay import EpisodeWriter, PrioritizedSequenceReplay, SequenceReplay

gym = pytest.importorskip("gymnasium")
from gymnasium import spaces  # noqa: E402 (gymnasium is an optional extra)
from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402

SEED = 7
MODES = ["next_step", "same_step", "disabled"]
GUIDE = (
    Path(__file__).resolve().parent.parent / "docs" / "guides" / "collecting-from-environments.md"
)


class CounterEnv(gym.Env):
    """Observation ``code = [env, episode, step]`` (int64); each reset draws the episode's
    length (1..6) and whether it ends terminated or truncated from the env's seeded RNG."""

    def __init__(self, env_id: int, dict_obs: bool = False) -> None:
        self.env_id, self.dict_obs = env_id, dict_obs
        code = spaces.Box(0, 10_000, (3,), np.int64)
        pixels = spaces.Box(0, 255, (2, 2), np.uint8)
        self.observation_space = spaces.Dict({"code": code, "pixels": pixels}) if dict_obs else code
        self.action_space = spaces.Discrete(4)
        self.episode = -1

    def _obs(self):
        code = np.array([self.env_id, self.episode, self.t], dtype=np.int64)
        if not self.dict_obs:
            return code
        return {"code": code, "pixels": np.full((2, 2), self.t * 10 + self.env_id, np.uint8)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        self.length = int(self.np_random.integers(1, 7))
        self.truncates = bool(self.np_random.integers(2))
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        reward = 1000.0 * self.env_id + 10.0 * self.t + float(action)
        end = self.t == self.length
        return self._obs(), reward, end and not self.truncates, end and self.truncates, {}


def policy(code):
    """Actions [N] from codes [N, 3]: a fixed function of (env, episode, step)."""
    return ((7 * code[:, 0] + 3 * code[:, 1] + code[:, 2]) % 4).astype(np.int64)


def extras(code):
    """Extra fields [N, ...] from codes: a float32 state tensor and float64 logits."""
    h = torch.as_tensor(np.stack([code.sum(1), code[:, 2] * 0.5], 1), dtype=torch.float32)
    return {"h": h, "logits": np.tile(code[:, 2:3] * 0.25, (1, 4)).astype(np.float64)}


def code_of(observation):
    return observation["code"] if isinstance(observation, dict) else observation


def ground_truth(env_id, dict_obs, num_episodes):
    """Episodes of one plain env seeded as the vector env seeds it, played by `policy`."""
    env = CounterEnv(env_id, dict_obs)
    observation, _ = env.reset(seed=SEED + env_id)
    episodes = []
    for _ in range(num_episodes):
        observations, actions, rewards, fields = [observation], [], [], []
        while True:
            code = code_of(observation)[None]
            action = int(policy(code)[0])
            fields.append({k: np.asarray(v[0]) for k, v in extras(code).items()})
            observation, reward, terminated, truncated, _ = env.step(action)
            observations.append(observation)
            actions.append(action)
            rewards.append(reward)
            if terminated or truncated:
                break
        names = list(observation) if dict_obs else None
        steps = (
            {k: np.stack([o[k] for o in observations]) for k in names}
            if dict_obs
            else {"observation": np.stack(observations)}
        )
        steps["action"] = np.array([*actions, 0], dtype=np.int64)
        steps["reward"] = np.array([*rewards, 0.0], dtype=np.float64)
        for name in fields[0]:
            rows = [f[name] for f in fields]
            steps[name] = np.stack([*rows, np.zeros_like(rows[0])])
        episodes.append((steps, bool(terminated)))
        observation, _ = env.reset()
    return episodes


def prefix(steps, length):
    """Ground-truth episode cut after ``length`` steps (what `flush` stores)."""
    cut = {name: values[: length + 1].copy() for name, values in steps.items()}
    for name in ("action", "reward", "h", "logits"):
        cut[name][length] = 0
    return cut


class ListBuffer:
    """A duck-typed buffer: only ``add``, issuing ids 100, 101, ..."""

    def __init__(self):
        self.episodes = []

    def add(self, episode):
        self.episodes.append(episode)
        return 100 + len(self.episodes) - 1


def as_numpy(episode):
    return {name: episode[name].numpy() for name in episode}


def collect(mode, dict_obs, *, num_envs=3, calls=60, autoreset=None, buffer=None):
    """Run the vector env and the writer; return the buffer, per-env steps and per-call ids."""
    envs = SyncVectorEnv(
        [lambda i=i: CounterEnv(i, dict_obs) for i in range(num_envs)],
        copy=False,
        autoreset_mode=AutoresetMode(
            {"next_step": "NextStep", "same_step": "SameStep"}.get(mode, "Disabled")
        ),
    )
    buffer = ListBuffer() if buffer is None else buffer
    writer = EpisodeWriter(buffer, num_envs, autoreset=autoreset or mode)
    observation, _ = envs.reset(seed=SEED)
    assert writer.reset(observation) == []
    steps = np.zeros(num_envs, dtype=np.int64)  # env steps each env really took
    ignored = np.zeros(num_envs, dtype=bool)  # next_step: this call resets, ignoring the action
    calls_ids = []
    for _ in range(calls):
        code = code_of(observation)
        action = policy(code)
        fields = extras(code)
        observation, reward, terminated, truncated, info = envs.step(action)
        ids = writer.step(action, reward, terminated, truncated, observation, info=info, **fields)
        ended = terminated | truncated
        calls_ids.append((ids, np.flatnonzero(ended), terminated.copy()))
        steps += ~ignored
        ignored = ended if mode == "next_step" else np.zeros(num_envs, dtype=bool)
        if mode == "disabled" and ended.any():
            observation, _ = envs.reset(options={"reset_mask": ended})
            assert writer.reset(observation, env_mask=ended) == []
    flushed = writer.flush()
    envs.close()
    return buffer, writer, steps, calls_ids, flushed


@pytest.mark.parametrize("page_records", [2, 64], ids=["pages-of-2", "pages-of-64"])
@pytest.mark.parametrize("dict_obs", [False, True], ids=["box", "dict"])
@pytest.mark.parametrize("mode", MODES)
def test_stored_episodes_equal_single_env_ground_truth(mode, dict_obs, page_records, monkeypatch):
    """Per env, the stored episodes (flushed tail included) are exactly the plain env's
    episodes, in order, with every step the env took and no other env's records; also with
    pages of 2 records, so that episodes span pages taken and given back by other envs."""
    monkeypatch.setattr(lucid_replay.writer, "_PAGE_RECORDS", page_records)
    buffer, writer, steps, _, _ = collect(mode, dict_obs)
    per_env = {}
    for episode in buffer.episodes:
        code = episode["code" if dict_obs else "observation"]
        env_id = int(code[0, 0])
        assert bool((code[:, 0] == env_id).all())
        per_env.setdefault(env_id, []).append(episode)
    assert sorted(per_env) == [0, 1, 2]
    for env_id, stored in per_env.items():
        truth = ground_truth(env_id, dict_obs, len(stored))
        for index, episode in enumerate(stored):
            expected, terminated = truth[index]
            if index == len(stored) - 1 and not episode.terminated:
                # the last one may be a flushed cut of the ground-truth episode
                expected = prefix(expected, len(episode) - 1)
                terminated = terminated and len(episode) == len(truth[index][0]["action"])
            got = as_numpy(episode)
            assert got.keys() == expected.keys()
            for name, values in expected.items():
                assert got[name].dtype == values.dtype, name
                np.testing.assert_array_equal(got[name], values, err_msg=name)
            assert episode.terminated is terminated
        assert sum(len(e) - 1 for e in stored) == steps[env_id]
    stats = writer.stats()
    assert stats["steps"] == steps.sum()
    assert stats["episodes_added"] == len(buffer.episodes)
    assert stats["open_steps"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_each_call_returns_the_ids_of_the_episodes_it_ended(mode):
    """step returns, in env order, the ids of exactly the episodes whose end it reported; flush
    returns the rest; together they are every id the buffer issued, once."""
    buffer, _, _, calls_ids, flushed = collect(mode, dict_obs=False)
    returned = []
    for ids, ended_envs, terminated in calls_ids:
        episodes = [buffer.episodes[i - 100] for i in ids]
        assert [int(e["observation"][0, 0]) for e in episodes] == ended_envs.tolist()
        assert [e.terminated for e in episodes] == terminated[ended_envs].tolist()
        returned += ids
    assert returned + flushed == list(range(100, 100 + len(buffer.episodes)))
    assert all(not buffer.episodes[i - 100].terminated for i in flushed)


@pytest.mark.parametrize("mode", MODES)
def test_real_buffers_store_what_the_stream_produced(mode):
    """A SequenceReplay and a PrioritizedSequenceReplay hold the episodes a duck buffer got."""
    reference, *_ = collect(mode, dict_obs=True)
    for buffer in (SequenceReplay(10_000), PrioritizedSequenceReplay(10_000)):
        _, _, _, calls_ids, flushed = collect(mode, dict_obs=True, buffer=buffer)
        ids = [i for call in calls_ids for i in call[0]] + flushed
        assert ids == list(range(len(reference.episodes)))
        for episode_id, expected in enumerate(reference.episodes):
            stored = buffer[episode_id]
            assert stored.terminated == expected.terminated
            for name in expected:
                assert torch.equal(stored[name], expected[name]), name


@pytest.mark.parametrize("member", list(AutoresetMode))
def test_gymnasium_autoreset_mode_members_are_accepted(member):
    """An AutoresetMode member selects the mode its value names, with the same output."""
    mode = {"NextStep": "next_step", "SameStep": "same_step", "Disabled": "disabled"}[member.value]
    writer = EpisodeWriter(ListBuffer(), 2, autoreset=member)
    assert writer.autoreset == mode
    with_enum, *_ = collect(mode, dict_obs=False, calls=20, autoreset=member)
    with_str, *_ = collect(mode, dict_obs=False, calls=20)
    assert len(with_enum.episodes) == len(with_str.episodes)
    for first, second in zip(with_enum.episodes, with_str.episodes, strict=True):
        assert all(torch.equal(first[n], second[n]) for n in first)


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_cartpole_episodes_match_a_plain_env(mode):
    """On CartPole, every stored episode equals one plain CartPole played by the same policy."""
    envs = gym.make_vec(
        "CartPole-v1",
        num_envs=2,
        vectorization_mode="sync",
        vector_kwargs={
            "autoreset_mode": AutoresetMode("NextStep" if mode == "next_step" else "SameStep")
        },
    )
    buffer = ListBuffer()
    writer = EpisodeWriter(buffer, 2, autoreset=mode)
    observation, _ = envs.reset(seed=SEED)
    writer.reset(observation)
    for _ in range(150):
        action = (observation[:, 2] > 0).astype(np.int64)
        observation, reward, terminated, truncated, info = envs.step(action)
        writer.step(action, reward, terminated, truncated, observation, info=info)
    envs.close()
    assert buffer.episodes
    plain = {i: gym.make("CartPole-v1") for i in range(2)}
    starts = {i: plain[i].reset(seed=SEED + i)[0] for i in range(2)}
    for episode in buffer.episodes:
        first = episode["observation"][0].numpy()
        env_id = next(i for i in range(2) if np.array_equal(starts[i], first))
        observation, rows = starts[env_id], [starts[env_id]]
        for t in range(len(episode) - 1):
            action = int(observation[2] > 0)
            assert int(episode["action"][t]) == action
            observation, reward, terminated, _, _ = plain[env_id].step(action)
            rows.append(observation)
            assert float(episode["reward"][t]) == reward
        np.testing.assert_array_equal(episode["observation"].numpy(), np.stack(rows))
        assert episode.terminated is bool(terminated)
        starts[env_id] = plain[env_id].reset()[0]


# ----------------------------------------------------------------------------- scripted streams


def obs(*values):
    """Observations ``[N, 1]`` float32."""
    return np.array(values, dtype=np.float32)[:, None]


def flags(*values):
    return np.array(values, dtype=bool)


def scripted(num_envs=2, autoreset="next_step", buffer=None):
    """A writer over a `ListBuffer`, reset at observations ``10 * env``."""
    buffer = ListBuffer() if buffer is None else buffer
    writer = EpisodeWriter(buffer, num_envs, autoreset=autoreset)
    writer.reset(obs(*(10.0 * i for i in range(num_envs))))
    return writer, buffer


def step(writer, action, observation, *, terminated=(), truncated=(), info=None, **fields):
    """One step of the stream, rewards ``action + 0.5``; flags name the envs that end."""
    n = writer.num_envs
    action = np.array(action, dtype=np.int64)
    term = np.isin(np.arange(n), terminated)
    trunc = np.isin(np.arange(n), truncated)
    return writer.step(action, action + 0.5, term, trunc, obs(*observation), info=info, **fields)


def flat(episode, name="observation"):
    return episode[name].flatten().tolist()


def test_next_step_reset_step_is_not_a_record():
    """Under next_step the call after an end restarts that env from its observation; its
    action and fields are ignored, and the other env's step is recorded as usual."""
    writer, buffer = scripted()
    h = np.ones((2, 3))
    assert step(writer, [1, 2], [1, 11], terminated=[0], h=h) == [100]
    assert step(writer, [9, 3], [20, 12], h=2 * h) == []  # env 0 resets: action 9 ignored
    assert step(writer, [4, 5], [21, 13], truncated=[1], h=3 * h) == [101]
    first, second = buffer.episodes
    assert flat(first) == [0, 1] and first["action"].tolist() == [1, 0] and first.terminated
    assert flat(second) == [10, 11, 12, 13] and not second.terminated
    assert second["action"].tolist() == [2, 3, 5, 0]
    assert second["reward"].tolist() == [2.5, 3.5, 5.5, 0.0]
    assert second["h"][:, 0].tolist() == [1.0, 2.0, 3.0, 0.0]
    assert writer.flush() == [102]
    assert flat(buffer.episodes[2]) == [20, 21] and buffer.episodes[2]["action"].tolist() == [4, 0]


def test_same_step_final_record_is_info_final_obs():
    """Under same_step the final record is info["final_obs"][i] and the returned observation
    starts the env's next episode at once."""
    writer, buffer = scripted(autoreset="same_step")
    final = np.array([np.array([1.0], np.float32), None], dtype=object)
    info = {"final_obs": final, "_final_obs": flags(True, False)}
    assert step(writer, [1, 2], [50, 11], terminated=[0], info=info) == [100]
    assert step(writer, [3, 4], [51, 12]) == []
    assert flat(buffer.episodes[0]) == [0, 1]
    assert writer.flush() == [101, 102]
    assert flat(buffer.episodes[1]) == [50, 51] and buffer.episodes[1]["action"].tolist() == [3, 0]
    assert flat(buffer.episodes[2]) == [10, 11, 12]


def test_disabled_partial_resets_with_env_mask():
    """Under disabled an ended env waits for reset(obs, env_mask=...); only masked envs
    restart, the others keep their open episode."""
    writer, buffer = scripted(autoreset="disabled")
    assert step(writer, [1, 2], [1, 11], truncated=[0]) == [100]
    assert flat(buffer.episodes[0]) == [0, 1] and not buffer.episodes[0].terminated
    with pytest.raises(ValueError, match=r"step must be .*got 'envs \[0\] not reset'"):
        step(writer, [3, 3], [2, 12])
    assert writer.reset(obs(30, 999), env_mask=flags(True, False)) == []
    step(writer, [3, 4], [31, 12], terminated=[1])
    assert flat(buffer.episodes[1]) == [10, 11, 12] and buffer.episodes[1].terminated
    writer.reset(obs(999, 40), env_mask=flags(False, True))
    step(writer, [5, 6], [32, 41])
    assert writer.flush() == [102, 103]
    assert [flat(e) for e in buffer.episodes[2:]] == [[30, 31, 32], [40, 41]]


def test_env_mask_at_start_resets_only_those_envs():
    """A first reset with a mask opens only the masked envs; a step needs every env open."""
    buffer = ListBuffer()
    writer = EpisodeWriter(buffer, 2, autoreset="disabled")
    writer.reset(obs(0, 10), env_mask=flags(False, True))
    with pytest.raises(ValueError, match=r"envs \[0\] not reset"):
        step(writer, [1, 1], [1, 11])
    writer.reset(obs(5, 99), env_mask=[True, False])
    step(writer, [1, 1], [6, 11])
    assert writer.flush() == [100, 101]
    assert [flat(e) for e in buffer.episodes] == [[5, 6], [10, 11]]


def test_reset_of_an_open_episode_stores_it_truncated():
    """Resetting an env whose episode has steps stores that episode (truncated, ending at the
    observation it reached) and returns its id; an env with no step yet is simply restarted."""
    writer, buffer = scripted(num_envs=3)
    step(writer, [1, 2, 3], [1, 11, 21])
    ids = writer.reset(obs(5, 15, 25), env_mask=flags(True, False, False))
    assert ids == [100] and flat(buffer.episodes[0]) == [0, 1]
    assert buffer.episodes[0]["action"].tolist() == [1, 0] and not buffer.episodes[0].terminated
    assert writer.reset(obs(6, 15, 25), env_mask=flags(True, False, False)) == []
    assert writer.stats()["episodes_flushed"] == 1
    step(writer, [4, 5, 6], [7, 12, 22])
    assert writer.flush() == [101, 102, 103]
    assert [flat(e) for e in buffer.episodes[1:]] == [[6, 7], [10, 11, 12], [20, 21, 22]]


def test_flush_stores_open_episodes_truncated_and_collection_continues():
    """flush stores each open episode with a step as T + 1 records ending at the current
    observation; the env's next episode starts there, so no step is lost or stored twice."""
    writer, buffer = scripted()
    assert writer.flush() == []  # nothing but reset observations yet
    step(writer, [1, 2], [1, 11], terminated=[1])
    assert writer.flush() == [101]
    assert flat(buffer.episodes[1]) == [0, 1] and not buffer.episodes[1].terminated
    step(writer, [3, 4], [2, 20])  # env 1 resets (next_step)
    step(writer, [5, 6], [3, 21], terminated=[0])
    assert flat(buffer.episodes[2]) == [1, 2, 3] and buffer.episodes[2].terminated
    assert buffer.episodes[2]["action"].tolist() == [3, 5, 0]
    stats = writer.stats()
    assert stats["open_episodes"] == 1 and stats["open_steps"] == 1
    assert stats["episodes_added"] == 3 and stats["episodes_flushed"] == 1
    assert stats["records_added"] == 2 + 2 + 3 and stats["steps"] == 5


def test_close_flushes_and_ends_the_stream():
    """close stores open episodes like flush, returns their ids, and then every env needs a
    reset before its next step; a with block closes on exit."""
    buffer = ListBuffer()
    with EpisodeWriter(buffer, 2) as writer:
        writer.reset(obs(0, 10))
        step(writer, [1, 2], [1, 11])
    assert [flat(e) for e in buffer.episodes] == [[0, 1], [10, 11]]
    assert writer.stats()["open_episodes"] == 0
    with pytest.raises(ValueError, match=r"envs \[0, 1\] not reset"):
        step(writer, [1, 2], [2, 12])
    assert writer.close() == []
    writer.reset(obs(3, 13))
    step(writer, [1, 2], [4, 14], terminated=[0, 1])
    assert writer.close() == []
    assert [flat(e) for e in buffer.episodes[2:]] == [[3, 4], [13, 14]]


def test_values_are_copied_when_the_caller_reuses_its_arrays():
    """Arrays overwritten in place after each call (as vector envs do) never change what
    the writer holds or stored."""
    writer, buffer = scripted()
    observation, action = obs(1, 11), np.array([1, 2])
    h = np.zeros((2, 2), np.float32)
    for t in range(1, 4):
        observation[:] = obs(t, 10 + t)
        action[:] = [t, 10 + t]
        h[:] = t
        writer.step(
            action, action + 0.5, flags(t == 3, False), flags(False, False), observation, h=h
        )
        observation[:], action[:], h[:] = -1, -1, -1
    writer.flush()
    assert flat(buffer.episodes[0]) == [0, 1, 2, 3]
    assert buffer.episodes[0]["action"].tolist() == [1, 2, 3, 0]
    assert flat(buffer.episodes[1], "h") == [1, 1, 2, 2, 3, 3, 0, 0]


def test_dtypes_and_shapes_are_kept_and_the_final_record_is_zero():
    """Every field keeps its dtype and per-env shape (numpy and torch, bfloat16 included);
    the final record's action, reward and extra fields are zeros of that dtype and shape."""
    buffer = ListBuffer()
    writer = EpisodeWriter(buffer, 2)
    writer.reset({"x": torch.zeros(2, 3, dtype=torch.float16), "m": np.zeros((2, 1), np.uint8)})
    fields = {
        "state": torch.ones(2, 4, dtype=torch.bfloat16),
        "mask": np.ones((2, 2, 2), dtype=bool),
        "k": np.array([7, 8], dtype=np.int32),
    }
    writer.step(
        np.ones((2, 2), np.float32),
        np.array([1.0, 2.0]),
        flags(True, True),
        flags(False, False),
        {"x": torch.ones(2, 3, dtype=torch.float16), "m": np.ones((2, 1), np.uint8)},
        **fields,
    )
    episode = buffer.episodes[0]
    expected = {
        "x": ((3,), torch.float16),
        "m": ((1,), torch.uint8),
        "action": ((2,), torch.float32),
        "reward": ((), torch.float64),
        "state": ((4,), torch.bfloat16),
        "mask": ((2, 2), torch.bool),
        "k": ((), torch.int32),
    }
    assert dict(episode.schema) == expected
    for name in ("action", "reward", "state", "mask", "k"):
        assert not episode[name][1].any() and episode[name][0].all(), name
    assert episode["x"][1].tolist() == [1.0, 1.0, 1.0]


def test_long_episodes_grow_past_the_initial_capacity():
    """Episodes of hundreds of steps keep every record as the per-env arrays grow."""
    writer, buffer = scripted()
    for t in range(1, 301):
        step(writer, [t, -t], [t, 10 + t], terminated=[0] if t == 300 else [])
    assert flat(buffer.episodes[0]) == list(range(301))
    assert buffer.episodes[0]["action"].tolist() == [*range(1, 301), 0]
    writer.flush()
    assert flat(buffer.episodes[1]) == [10, *range(11, 311)]


class Refusing(ListBuffer):
    """A duck buffer that refuses the episodes whose first observation is in ``refuse``."""

    def __init__(self, refuse, error=ValueError):
        super().__init__()
        self.refuse, self.error, self.offered = set(refuse), error, []

    def add(self, episode):
        first = float(episode["observation"][0, 0])
        self.offered.append(first)
        if first in self.refuse:
            raise self.error(f"episode at {first} refused")
        return super().add(episode)


def test_a_refused_episode_does_not_drop_the_other_envs_episodes():
    """When the buffer refuses one env's episode, the call still offers and stores the other
    envs' episodes, then raises EpisodesNotStoredError from the buffer's error with the ids
    it issued (env order) and the refused env's error and episode; the writer advances as
    for a successful call, so nothing is lost, counted twice or stored twice."""
    buffer = Refusing(refuse={10.0})
    writer, _ = scripted(num_envs=3, buffer=buffer)
    with pytest.raises(lucid_replay.EpisodesNotStoredError) as caught:
        step(writer, [1, 2, 3], [1, 11, 21], terminated=[0, 1, 2])
    error = caught.value
    assert isinstance(error, ValueError) and isinstance(error, lucid_replay.LucidReplayError)
    assert error.stored_ids == [100, 101]
    assert list(error.refused) == [1] and error.__cause__ is error.refused[1]
    assert str(error.refused[1]) == "episode at 10.0 refused"
    assert flat(error.episodes[1]) == [10, 11] and error.episodes[1].terminated
    assert re.fullmatch(
        r"buffer must accept every episode this call finished, got 1 of 3 refused "
        r"\(env 1: ValueError: episode at 10.0 refused\); stored ids \[100, 101\]",
        str(error),
    )
    assert [flat(e) for e in buffer.episodes] == [[0, 1], [20, 21]]
    stats = writer.stats()
    assert (stats["episodes_added"], stats["episodes_dropped"], stats["steps"]) == (2, 1, 3)
    assert step(writer, [4, 5, 6], [30, 40, 50]) == []  # next_step: all three restart
    assert step(writer, [7, 8, 9], [31, 41, 51], terminated=[1]) == [102]
    assert writer.flush() == [103, 104]
    assert [flat(e) for e in buffer.episodes[2:]] == [[40, 41], [30, 31], [50, 51]]
    assert buffer.offered == [0.0, 10.0, 20.0, 40.0, 30.0, 50.0]  # each episode offered once


def test_a_real_buffer_refusing_a_too_long_episode_keeps_the_others():
    """A SequenceReplay refusing an episode longer than its capacity: the other env's
    episode of the same call is stored and its id reported; the refused one is dropped."""
    buffer = SequenceReplay(capacity=3)
    writer, _ = scripted(buffer=buffer)
    assert step(writer, [1, 2], [1, 11], terminated=[1]) == [0]
    step(writer, [3, 4], [2, 20])  # env 1 restarts
    with pytest.raises(lucid_replay.EpisodesNotStoredError, match=r"env 0: Invalid") as caught:
        step(writer, [5, 6], [3, 21], terminated=[0, 1])
    assert caught.value.stored_ids == [1] and list(caught.value.refused) == [0]
    assert isinstance(caught.value.__cause__, lucid_replay.InvalidArgumentError)
    assert len(caught.value.episodes[0]) == 4
    assert buffer[1]["observation"].flatten().tolist() == [20.0, 21.0]
    assert writer.stats()["episodes_dropped"] == 1 and writer.stats()["open_episodes"] == 0


def test_refusals_in_reset_and_flush_are_reported_the_same_way():
    """Episodes cut by reset or flush that the buffer refuses are reported as by step: the
    others are stored, the writer advances, and the cut envs start their next episode."""
    buffer = Refusing(refuse={0.0})
    writer, _ = scripted(buffer=buffer)
    step(writer, [1, 2], [1, 11])
    with pytest.raises(lucid_replay.EpisodesNotStoredError) as caught:
        writer.reset(obs(5, 15))
    assert caught.value.stored_ids == [100] and list(caught.value.refused) == [0]
    assert writer.stats()["open_steps"] == 0 and writer.stats()["episodes_flushed"] == 1
    buffer.refuse = {5.0, 15.0}
    step(writer, [3, 4], [6, 16])
    with pytest.raises(lucid_replay.EpisodesNotStoredError) as caught:
        writer.flush()
    assert caught.value.stored_ids == [] and list(caught.value.refused) == [0, 1]
    assert writer.stats()["episodes_dropped"] == 3
    buffer.refuse = set()
    step(writer, [5, 6], [7, 17])
    assert writer.flush() == [101, 102]
    assert [flat(e) for e in buffer.episodes[1:]] == [[6, 7], [16, 17]]


def test_a_keyboard_interrupt_in_add_propagates_at_once():
    """A BaseException that is not an Exception is not collected: it propagates from the
    first add, the later episodes are not offered, and all of them count as dropped."""
    buffer = Refusing(refuse={0.0}, error=KeyboardInterrupt)
    writer, _ = scripted(buffer=buffer)
    with pytest.raises(KeyboardInterrupt):
        step(writer, [1, 2], [1, 11], terminated=[0, 1])
    assert buffer.offered == [0.0] and writer.stats()["episodes_dropped"] == 2


def test_episodes_not_stored_error_pickles_with_its_reports():
    """The error survives pickling (a process pool, a queue) with its message and reports."""
    import pickle

    buffer = Refusing(refuse={0.0})
    writer, _ = scripted(buffer=buffer)
    with pytest.raises(lucid_replay.EpisodesNotStoredError) as caught:
        step(writer, [1, 2], [1, 11], terminated=[0, 1])
    copied = pickle.loads(pickle.dumps(caught.value))
    assert str(copied) == str(caught.value) and copied.stored_ids == [100]
    assert list(copied.refused) == [0] and flat(copied.episodes[0]) == [0, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_fields_stay_on_their_device():
    """Tensors on a GPU are collected there and stored with their device and dtype."""
    buffer = ListBuffer()
    writer = EpisodeWriter(buffer, 2)
    writer.reset(torch.zeros(2, 3, device="cuda"))
    h = torch.arange(4.0, device="cuda").reshape(2, 2)
    writer.step(
        np.array([1, 2]),
        np.ones(2),
        flags(True, False),
        flags(False, False),
        torch.ones(2, 3, device="cuda"),
        h=h,
    )
    writer.flush()
    assert buffer.episodes[0]["h"].device.type == "cuda"
    assert buffer.episodes[0]["h"].tolist() == [[0.0, 1.0], [0.0, 0.0]]
    assert buffer.episodes[1]["observation"].tolist() == [[0.0] * 3, [1.0] * 3]


# ----------------------------------------------------------------------------- refused input


def good_step():
    """Arguments of a valid step of the `prepared` writer, ending env 0's episode."""
    return {
        "action": np.array([3, 4]),
        "reward": np.array([0.5, 1.5]),
        "terminated": flags(True, False),
        "truncated": flags(False, False),
        "observation": obs(2, 12),
        "info": None,
        "h": np.ones((2, 3), np.float32),
    }


def prepared(autoreset="next_step"):
    """A 2-env writer whose field layout is fixed and whose envs have one step each."""
    writer, buffer = scripted(autoreset=autoreset)
    args = good_step()
    args["terminated"] = flags(False, False)
    writer.step(**args)
    return writer, buffer


def with_arg(**changes):
    def call(writer):
        args = good_step()
        args.update(changes)
        for name in [k for k, v in args.items() if v is ...]:
            del args[name]
        return writer.step(**args)

    return call


REFUSED_STEPS = {
    "action size": (
        with_arg(action=np.zeros(3, np.int64)),
        ValueError,
        r"action must be an array of leading size num_envs \(2\), got \(3,\)",
    ),
    "action strings": (
        with_arg(action=np.array(["a", "b"])),
        TypeError,
        r"action must be an array of numbers or bools, got dtype <U1",
    ),
    "reward size": (with_arg(reward=np.zeros(1)), ValueError, r"reward must be an array of lead"),
    "reward scalar": (with_arg(reward=1.0), ValueError, r"reward must be .*, got \(\)"),
    "terminated ints": (
        with_arg(terminated=np.array([1, 0])),
        TypeError,
        r"terminated must be a bool array, got dtype int64",
    ),
    "truncated shape": (
        with_arg(truncated=np.zeros((2, 1), bool)),
        ValueError,
        r"truncated must be of shape \(2,\), got \(2, 1\)",
    ),
    "observation size": (
        with_arg(observation=obs(1, 2, 3)),
        ValueError,
        r"observation must be an array of leading size num_envs \(2\)",
    ),
    "observation dtype": (
        with_arg(observation=obs(1, 2).astype(np.float64)),
        TypeError,
        r"observation must be of dtype float32, got float64",
    ),
    "observation shape": (
        with_arg(observation=np.zeros((2, 2), np.float32)),
        ValueError,
        r"observation must be of per-env shape \(1,\) .*, got \(2,\)",
    ),
    "observation dict": (
        with_arg(observation={"observation": obs(1, 2)}),
        ValueError,
        r"observation must be of the first reset's fields",
    ),
    "field size": (
        with_arg(h=np.ones((1, 3), np.float32)),
        ValueError,
        r"h must be an array of leading size num_envs \(2\), got \(1, 3\)",
    ),
    "field dtype": (
        with_arg(h=np.ones((2, 3))),
        TypeError,
        r"h must be of dtype float32, got float64",
    ),
    "field shape": (
        with_arg(h=np.ones((2, 4), np.float32)),
        ValueError,
        r"h must be of per-env shape \(3,\) .*, got \(4,\)",
    ),
    "field missing": (
        with_arg(h=...),
        ValueError,
        r"step fields must be the first step's \['action', 'h', 'reward'\], "
        r"got \['action', 'reward'\]",
    ),
    "field extra": (with_arg(g=np.ones(2)), ValueError, r"step fields must be the first step's"),
    "info type": (with_arg(info=["final_obs"]), TypeError, r"info must be a dict or None"),
    "observation tuple": (
        with_arg(observation=(obs(1, 2), obs(1, 2))),
        TypeError,
        r"^observation must be an array or a tensor \(flatten gymnasium Tuple spaces and "
        r"nested Dict spaces\), got a tuple$",
    ),
    "action tuple": (with_arg(action=(3, 4)), TypeError, r"^action must be an .*, got a tuple$"),
    "field sparse": (
        with_arg(h=torch.ones(2, 3).to_sparse()),
        TypeError,
        r"^h must be a dense tensor with data \(strided, not meta, sparse, quantized or "
        r"nested\), got a sparse_coo tensor$",
    ),
    "observation meta": (
        with_arg(observation=torch.empty(2, 1, device="meta")),
        TypeError,
        r"^observation must be a dense tensor .*, got a meta tensor$",
    ),
    "field longdouble": (
        with_arg(h=np.ones((2, 3), np.longdouble)),
        TypeError,
        r"^h must be of a dtype torch can hold \(native byte order, no longdouble\), got dtype",
    ),
}


def _bytes(value):
    if isinstance(value, torch.Tensor):
        value = value.cpu().numpy() if value.dtype != torch.bfloat16 else value.float().numpy()
    value = np.ascontiguousarray(value)
    return (str(value.dtype), value.shape, value.tobytes())


def internals(writer):
    """Everything the writer holds: per-env states and lengths, the page table, every
    column's pool and the counters (a refused call must leave all of it as it was)."""
    columns = {
        group: None if cols is None else {n: (c.is_torch, _bytes(c.data)) for n, c in cols.items()}
        for group, cols in (("obs", writer._obs), ("fields", writer._fields))
    }
    pages = writer._pages
    return {
        "state": _bytes(writer._state),
        "length": _bytes(writer._length),
        "pages": (_bytes(pages.table), _bytes(pages.owned), list(pages.free), pages.num_pages),
        "dict_obs": writer._dict_obs,
        "columns": columns,
        "counts": dict(writer._counts),
    }


def assert_refused_and_unchanged(writer, buffer, bad_call, error, match, continuation):
    """``bad_call`` raises ``error`` matching ``match``, stores nothing, and leaves the writer
    as it was (every internal array and counter): afterwards ``continuation`` gives what it
    gives on a copy taken before."""
    twin, twin_buffer = copy.deepcopy((writer, buffer))
    before, inside = writer.stats(), internals(writer)
    with pytest.raises(error, match=match):
        bad_call(writer)
    assert len(buffer.episodes) == len(twin_buffer.episodes)
    assert writer.stats() == before
    assert internals(writer) == inside
    assert continuation(writer) == continuation(twin)
    assert writer.stats() == twin.stats()
    assert len(buffer.episodes) == len(twin_buffer.episodes) > 0
    for first, second in zip(buffer.episodes, twin_buffer.episodes, strict=True):
        assert first.terminated == second.terminated
        assert list(first) == list(second)
        assert all(torch.equal(first[n], second[n]) for n in first)


def continue_and_flush(writer):
    """The valid step the refused one stood for, then a flush: the ids stored."""
    return writer.step(**good_step()) + writer.flush()


@pytest.mark.parametrize("case", list(REFUSED_STEPS))
def test_refused_step_stores_nothing_and_changes_nothing(case):
    """Each malformed step argument is refused with a message naming it; nothing is stored
    and the writer continues exactly as if the call had not been made."""
    bad_call, error, match = REFUSED_STEPS[case]
    writer, buffer = prepared()
    assert_refused_and_unchanged(writer, buffer, bad_call, error, match, continue_and_flush)


REFUSED_RESETS = {
    "mask shape": (
        dict(env_mask=flags(True)),
        ValueError,
        r"env_mask must be of shape \(2,\), got \(1,\)",
    ),
    "mask dtype": (
        dict(env_mask=np.array([1, 0])),
        TypeError,
        r"env_mask must be a bool array, got dtype int64",
    ),
    "observation size": (
        dict(observation=obs(1, 2, 3)),
        ValueError,
        r"observation must be an array of leading size num_envs \(2\)",
    ),
    "observation dtype": (
        dict(observation=np.zeros((2, 1), np.int64)),
        TypeError,
        r"observation must be of dtype float32, got int64",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_RESETS))
def test_refused_reset_stores_nothing_and_changes_nothing(case):
    """A malformed reset (mask or observation) is refused, and the open episodes it would
    have cut stay open and unchanged."""
    changes, error, match = REFUSED_RESETS[case]

    def bad_call(writer):
        args = {"observation": obs(5, 15), "env_mask": flags(True, True), **changes}
        return writer.reset(args.pop("observation"), **args)

    writer, buffer = prepared()
    assert_refused_and_unchanged(writer, buffer, bad_call, error, match, continue_and_flush)


def without_dense_data(shape):
    """Name -> (a value of ``shape`` an Episode cannot be built from, its refusal's ending)."""
    dense = torch.ones(shape)
    with warnings.catch_warnings():  # both constructors warn that they are prototypes
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8)
        nested = torch.nested.nested_tensor(list(dense))
    return {
        "sparse": (dense.to_sparse(), r"got a sparse_coo tensor$"),
        "meta": (torch.empty(shape, device="meta"), r"got a meta tensor$"),
        "quantized": (quantized, r"got a quantized tensor$"),
        "nested": (nested, r"got a nested tensor$"),
        "longdouble": (np.ones(shape, np.longdouble), r"got dtype '<f16'$"),
        "big-endian": (np.ones(shape, ">f4"), r"got dtype '>f4'$"),
    }


KINDS = list(without_dense_data((2,)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["action", "h"])
def test_first_step_without_dense_data_is_refused_before_fixing_the_layout(name, kind):
    """A first step whose action or extra field has no dense data a record can hold (sparse,
    meta, quantized, nested tensors; numpy dtypes torch lacks) is refused naming it, before
    the step fixes the field layout: the writer is unchanged and a good first step works."""
    writer, buffer = scripted()
    value, ending = without_dense_data((2,) if name == "action" else (2, 3))[kind]
    assert_refused_and_unchanged(
        writer,
        buffer,
        with_arg(**{name: value}),
        TypeError,
        rf"^{name} must be .*{ending}",
        continue_and_flush,
    )
    assert writer._fields is not None  # fixed by the good step, not the refused one


@pytest.mark.parametrize("kind", KINDS)
def test_first_reset_without_dense_data_is_refused(kind):
    """A first reset whose observation (or a dict value) has no dense data is refused before
    it fixes the observation fields; a good reset then starts the stream as usual."""
    value, ending = without_dense_data((2, 1))[kind]
    for observation, param in [(value, "observation"), ({"o": value}, r"observation\['o'\]")]:
        writer = EpisodeWriter(ListBuffer(), 2)
        before = internals(writer)
        with pytest.raises(TypeError, match=rf"^{param} must be .*{ending}"):
            writer.reset(observation)
        assert internals(writer) == before and writer._obs is None
        assert writer.reset(obs(0, 10)) == [] and writer.step(**good_step()) == [100]


def test_a_meta_observation_cannot_leave_an_ended_episode_open():
    """Meta observations after a good reset are refused before the step is recorded, so an
    episode that ends is stored and the env's next steps start a new episode."""
    buffer = ListBuffer()
    writer = EpisodeWriter(buffer, 2)
    writer.reset(torch.zeros(2, 3))
    before = internals(writer)
    args = (np.array([1, 1]), np.zeros(2, np.float32), flags(True, False), flags(False, False))
    with pytest.raises(TypeError, match=r"^observation must be a dense tensor .*meta tensor$"):
        writer.step(*args, torch.empty(2, 3, device="meta"))
    assert internals(writer) == before
    assert writer.step(*args, torch.ones(2, 3)) == [100]
    assert len(buffer.episodes[0]) == 2
    writer.step(*args[:2], flags(False, False), flags(False, False), torch.ones(2, 3))
    assert writer._length.tolist() == [0, 2]  # env 0 restarted: it joins no ended episode


class TupleEnv(gym.Env):
    """A gymnasium Tuple observation of two components, ``value`` and ``-value``, where
    ``value = 100 * env + step``: as many components as there are envs."""

    def __init__(self, env_id):
        self.env_id = env_id
        box = spaces.Box(-1e9, 1e9, (3,), np.float32)
        self.observation_space, self.action_space = spaces.Tuple((box, box)), spaces.Discrete(2)

    def _obs(self):
        value = np.full(3, 100 * self.env_id + self.t, np.float32)
        return value, -value

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, self.t == 2, False, {}


def test_tuple_observations_are_refused_and_flattened_ones_stay_per_env():
    """A Tuple space's observation (a tuple of [num_envs, ...] components, which np.asarray
    would stack along the env axis) is refused at reset and step, naming the argument, with
    the writer unchanged; flattened into one array per env it is stored env by env."""
    envs = SyncVectorEnv([lambda i=i: TupleEnv(i) for i in range(2)])
    observation, _ = envs.reset(seed=0)
    buffer = ListBuffer()
    writer = EpisodeWriter(buffer, 2)
    message = r"^observation must be an array or a tensor \(flatten gymnasium Tuple spaces"
    with pytest.raises(TypeError, match=message):
        writer.reset(observation)
    with pytest.raises(TypeError, match=r"^observation\['pair'\] must be an .*got a tuple$"):
        writer.reset({"pair": observation})
    assert writer._obs is None and writer.stats()["steps"] == 0
    writer.reset(np.concatenate(observation, axis=1))
    action = np.zeros(2, np.int64)
    observation, reward, terminated, truncated, _ = envs.step(action)
    with pytest.raises(TypeError, match=message):
        writer.step(action, reward, terminated, truncated, observation)
    writer.step(action, reward, terminated, truncated, np.concatenate(observation, axis=1))
    observation, reward, terminated, truncated, _ = envs.step(action)
    writer.step(action, reward, terminated, truncated, np.concatenate(observation, axis=1))
    envs.close()
    for env_id, episode in enumerate(buffer.episodes):
        value = 100 * env_id + torch.arange(3.0)[:, None].expand(3, 3)
        assert torch.equal(episode["observation"], torch.cat([value, -value], dim=1))


def test_tuple_and_nested_dict_final_observations_are_refused():
    """Under same_step an info["final_obs"] entry that is a tuple, or a dict observation's
    entry with a nested dict, is refused naming the entry; the writer is unchanged."""
    writer, buffer = prepared("same_step")
    final = np.array([(np.float32(2.0),), None], dtype=object)
    info = {"final_obs": final, "_final_obs": flags(True, False)}
    good = {
        "final_obs": np.array([obs(2)[0], None], dtype=object),
        "_final_obs": info["_final_obs"],
    }

    def continuation(w):
        return w.step(**{**good_step(), "info": good}) + w.flush()

    assert_refused_and_unchanged(
        writer,
        buffer,
        with_arg(info=info),
        TypeError,
        r"^info\['final_obs'\]\[0\] must be an array or a tensor .*, got a tuple$",
        continuation,
    )
    writer = EpisodeWriter(ListBuffer(), 2, autoreset="same_step")
    writer.reset({"code": obs(0, 10)})
    nested = {"final_obs": np.array([{"code": {"x": obs(1)[0]}}, None], dtype=object)}
    with pytest.raises(TypeError, match=r"^info\['final_obs'\]\[0\] must be .*got a dict$"):
        writer.step(
            np.zeros(2, np.int64),
            np.zeros(2),
            flags(True, False),
            flags(False, False),
            {"code": obs(1, 11)},
            info={**nested, "_final_obs": flags(True, False)},
        )
    assert writer.stats()["steps"] == 0


def test_nested_dict_observations_are_refused():
    """A nested Dict space's observation (a dict value that is a dict) is refused naming the
    key, at the first reset and later."""
    writer = EpisodeWriter(ListBuffer(), 2)
    match = r"^observation\['a'\] must be an array or a tensor \(.*\), got a dict$"
    with pytest.raises(TypeError, match=match):
        writer.reset({"a": {"b": obs(0, 1)}})
    assert writer._obs is None
    writer.reset({"a": obs(0, 1)})
    with pytest.raises(TypeError, match=match):
        writer.reset({"a": {"b": obs(0, 1)}})


FIRST_STEP_SCHEMA_REFUSALS = {
    "reserved extra field": (
        {"is_init": np.zeros(2, bool)},
        lucid_replay.SchemaError,
        r"^field names must not be one of the per-record entries .*, got 'is_init'",
    ),
    "uint16 extra field": (
        {"h": np.ones((2, 3), np.uint16)},
        lucid_replay.SchemaDtypeError,
        r"^field 'h' must have a dtype the buffer can store.*got torch.uint16; store it as "
        r"torch.int32$",
    ),
    "uint32 tensor action": (
        {"action": torch.ones(2, dtype=torch.uint32)},
        lucid_replay.SchemaDtypeError,
        r"^field 'action' must have a dtype the buffer can store.*got torch.uint32",
    ),
}


@pytest.mark.parametrize("case", list(FIRST_STEP_SCHEMA_REFUSALS))
def test_first_step_fields_no_buffer_stores_are_refused_at_once(case):
    """A first step whose fields could never be stored (a reserved name, a dtype no buffer
    stores) is refused before it fixes the layout, not at every later episode's end."""
    changes, error, match = FIRST_STEP_SCHEMA_REFUSALS[case]
    writer, buffer = scripted()
    call = with_arg(**changes)
    assert_refused_and_unchanged(writer, buffer, call, error, match, continue_and_flush)


@pytest.mark.parametrize(
    ("observation", "error", "match"),
    [
        (
            {"terminal": obs(0, 1)},
            lucid_replay.SchemaError,
            r"^field names must not be .*, got 'terminal'",
        ),
        (
            np.zeros((2, 1), np.uint16),
            lucid_replay.SchemaDtypeError,
            r"^field 'observation' must have a dtype the buffer can store",
        ),
    ],
)
def test_first_reset_fields_no_buffer_stores_are_refused_at_once(observation, error, match):
    """A first reset whose observation fields could never be stored is refused before it
    fixes them; a good reset then works."""
    buffer = SequenceReplay(100)
    writer = EpisodeWriter(buffer, 2)
    with pytest.raises(error, match=match):
        writer.reset(observation)
    assert writer._obs is None and writer.stats()["open_episodes"] == 0
    writer.reset(obs(0, 10))
    assert writer.step(**good_step()) == [0]


DECLARED = {
    "observation": ((1,), torch.float32),
    "action": ((), torch.int64),
    "reward": ((), torch.float32),
    "h": ((3,), torch.float32),
}
DECLARED_REFUSALS = {
    "field the schema lacks": (
        {"g": np.ones(2, np.float32)},
        lucid_replay.SchemaError,
        r"^field 'g' must be one of the buffer's schema fields \['action', 'h', 'observation', "
        r"'reward'\], got 'g'$",
    ),
    "schema field not passed": (
        {"h": ...},
        lucid_replay.SchemaError,
        r"^fields must include the buffer's schema fields \['h'\], got none$",
    ),
    "another per-step shape": (
        {"h": np.ones((2, 4), np.float32)},
        lucid_replay.SchemaError,
        r"^field 'h' must have the buffer's per-step shape \(3,\), got \(4,\)$",
    ),
    "a dtype of another kind": (
        {"action": np.array([1.0, 2.0])},
        lucid_replay.SchemaDtypeError,
        r"^field 'action' must have a dtype that casts to the buffer's torch.int64 \(same "
        r"kind\), got torch.float64$",
    ),
}


@pytest.mark.parametrize("case", list(DECLARED_REFUSALS))
def test_first_step_fields_that_cannot_match_the_buffers_schema_are_refused(case):
    """Against a buffer's declared schema, a first step with a field it lacks, without one
    of its fields, of another per-step shape or of a dtype that does not cast is refused
    before the layout is fixed; a castable dtype (float64 rewards) is left to the buffer."""
    changes, error, match = DECLARED_REFUSALS[case]
    buffer = SequenceReplay(100, schema=DECLARED)
    writer = EpisodeWriter(buffer, 2)
    writer.reset(obs(0, 10))
    before = internals(writer)
    with pytest.raises(error, match=match):
        with_arg(**changes)(writer)
    assert internals(writer) == before and writer._fields is None
    assert with_arg(reward=np.array([0.5, 1.5]))(writer) == [0]  # float64: cast by add
    assert buffer[0]["reward"].dtype == torch.float32


def test_reset_fields_that_cannot_match_the_buffers_schema_are_refused():
    """At the first reset, observation fields the schema lacks or of another per-step shape
    are refused; so are they against a schema fixed by an episode already stored."""
    writer = EpisodeWriter(SequenceReplay(100, schema=DECLARED), 2)
    with pytest.raises(lucid_replay.SchemaError, match=r"^field 'x' must be one of the buff"):
        writer.reset({"x": obs(0, 1)})
    with pytest.raises(lucid_replay.SchemaError, match=r"per-step shape \(1,\), got \(2,\)$"):
        writer.reset(np.zeros((2, 2), np.float32))
    assert writer._obs is None
    buffer = SequenceReplay(100)
    buffer.add(lucid_replay.Episode({"state": torch.zeros(3, 2)}))
    writer = EpisodeWriter(buffer, 2)
    with pytest.raises(lucid_replay.SchemaError, match=r"^field 'observation' must be one of"):
        writer.reset(obs(0, 1))
    assert writer._obs is None


def test_step_before_reset_is_refused():
    """A step before any reset is refused, and the writer then works normally."""
    buffer = ListBuffer()
    writer = EpisodeWriter(buffer, 2)
    with pytest.raises(ValueError, match=r"step must be called after a first reset"):
        writer.step(**good_step())
    assert writer.stats()["steps"] == 0 and buffer.episodes == []
    writer.reset(obs(0, 10))
    assert writer.step(**good_step()) == [100]


def test_missing_final_obs_under_same_step_is_refused():
    """Under same_step an end without info["final_obs"] for that env is refused."""
    writer, buffer = prepared("same_step")
    final = {
        "final_obs": np.array([obs(2)[0], None], dtype=object),
        "_final_obs": flags(True, False),
    }

    def continuation(w):
        return w.step(**{**good_step(), "info": final}) + w.flush()

    for info, match in [
        (None, r"info must be holding info\['final_obs'\]\[i\] .*env 0"),
        ({"final_obs": np.array([None, None])}, r"none for env 0"),
        ({**final, "_final_obs": flags(False, True)}, r"none for env 0"),
    ]:
        assert_refused_and_unchanged(
            writer, buffer, with_arg(info=info), ValueError, match, continuation
        )
        writer, buffer = prepared("same_step")
    wrong = {"final_obs": np.array([np.zeros(2, np.float32), None], dtype=object)}
    assert_refused_and_unchanged(
        writer,
        buffer,
        with_arg(info=wrong),
        ValueError,
        r"info\['final_obs'\]\[0\] must be of per-env shape \(1,\)",
        continuation,
    )


def test_disabled_step_with_an_ended_env_not_reset_is_refused():
    """Under disabled, stepping an env that ended before resetting it is refused."""
    writer, buffer = prepared("disabled")
    writer.step(**good_step())  # env 0 ends
    stuck = with_arg(terminated=flags(False, False))

    def continuation(w):
        w.reset(obs(7, 0), env_mask=flags(True, False))
        return w.step(**{**good_step(), "terminated": flags(False, True)}) + w.flush()

    assert_refused_and_unchanged(
        writer,
        buffer,
        stuck,
        ValueError,
        r"step must be called only while every env has an open "
        r"episode .*, got 'envs \[0\] not reset'",
        continuation,
    )


def test_dict_observation_keys_that_collide_with_fields_are_refused():
    """A dict observation key equal to action, reward or an extra field is refused, at reset
    or at the step that would introduce the clash."""
    for key in ("action", "reward"):
        writer = EpisodeWriter(ListBuffer(), 2)
        with pytest.raises(ValueError, match=rf"observation keys must be distinct .*'{key}'"):
            writer.reset({key: obs(0, 1)})
        with pytest.raises(ValueError, match=r"step must be called after a first reset"):
            writer.step(**good_step())
    buffer = ListBuffer()
    writer = EpisodeWriter(buffer, 2)
    writer.reset({"h": obs(0, 1), "p": obs(0, 1)})
    args = {**good_step(), "observation": {"h": obs(1, 2), "p": obs(1, 2)}}
    with pytest.raises(ValueError, match=r"field names must be distinct .*, got \['h'\]"):
        writer.step(**args)
    assert buffer.episodes == [] and writer.stats()["steps"] == 0
    with pytest.raises(TypeError, match=r"observation keys must be str, got 3"):
        writer.reset({3: obs(0, 1)})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_envs": True}, TypeError, r"num_envs must be an int, got True"),
        ({"num_envs": 2.0}, TypeError, r"num_envs must be an int, got 2.0"),
        ({"num_envs": 0}, ValueError, r"num_envs must be >= 1, got 0"),
        (
            {"autoreset": "sometimes"},
            ValueError,
            r"autoreset must be 'next_step', 'same_step', 'disabled' or an AutoresetMode, "
            r"got 'sometimes'",
        ),
        ({"autoreset": 1}, TypeError, r"autoreset must be a str or an AutoresetMode, got 1"),
        (
            {"buffer": [1, 2]},
            TypeError,
            r"buffer must be an object with an add\(episode\) method, got list",
        ),
    ],
)
def test_constructor_refuses_bad_arguments(kwargs, error, match):
    """Bool or non-int num_envs, an unknown autoreset and a buffer without add are refused."""
    arguments = {"buffer": ListBuffer(), "num_envs": 2, **kwargs}
    with pytest.raises(error, match=match):
        EpisodeWriter(arguments.pop("buffer"), arguments.pop("num_envs"), **arguments)


def test_gymnasium_mode_names_are_accepted_as_strings():
    """The AutoresetMode values ("NextStep", ...) are accepted as strings too."""
    assert EpisodeWriter(ListBuffer(), 1, autoreset="SameStep").autoreset == "same_step"
    assert EpisodeWriter(ListBuffer(), 1, autoreset="Disabled").autoreset == "disabled"


# ----------------------------------------------------------------------------- the guide


def guide_blocks():
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.DOTALL)


def test_guide_code_runs_prints_what_it_says_and_fits_the_page(tmp_path, monkeypatch, capsys):
    """The collecting guide's code blocks run in order, each prints exactly its ``# ->``
    lines, and no line is wider than 88 characters."""
    blocks = guide_blocks()
    assert len(blocks) >= 4
    wide = [line for block in blocks for line in block.splitlines() if len(line) > 88]
    assert wide == []
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "guide"}
    for block in blocks:
        capsys.readouterr()
        exec(compile(block, str(GUIDE), "exec"), namespace)
        expected = re.findall(r"^# -> (.*)$", block, re.MULTILINE)
        assert capsys.readouterr().out.splitlines() == expected
