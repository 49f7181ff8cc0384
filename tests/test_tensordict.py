"""TensorDict interop: `Episode.from_tensordict`, ``to_tensordict()`` on batches, and
`TrajectoryAssembler` against a real TorchRL collector.

Trajectories are TorchRL-shaped: ``("next", ...)`` entries, ``[T, 1]`` flags. The collector
tests run CartPole through `GymEnv` with a step limit, so episodes end both terminated and
truncated, with ``frames_per_batch`` not dividing the episode lengths; the ground truth is
each trajectory cut out of all collector batches concatenated.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from conftest import cuda

tensordict = pytest.importorskip("tensordict")
from tensordict import NonTensorData, TensorDict  # noqa: E402

from lucid_replay import (  # noqa: E402
    Episode,
    InvalidArgumentError,
    PrioritizedSequenceReplay,
    SequenceReplay,
    TrajectoryAssembler,
    Window,
)

F, T = False, True


def _trajectory(length, *, terminated=True, first=0.0, traj=None, done=True):
    """A TorchRL trajectory: obs = first + step, next obs = obs + 1, reward 1, one end flag."""
    obs = torch.arange(length, dtype=torch.float32)[:, None] + first
    end = torch.zeros(length, 1, dtype=torch.bool)
    end[-1] = done
    entries = {
        "obs": obs,
        "action": torch.arange(length),
        ("next", "obs"): obs + 1,
        ("next", "reward"): torch.ones(length, 1),
        ("next", "done"): end,
        ("next", "terminated"): end & terminated,
        ("next", "truncated"): end & (not terminated),
    }
    if traj is not None:
        entries[("collector", "traj_ids")] = torch.full((length,), traj)
    return TensorDict(entries, batch_size=[length])


# ------------------------------------------------------------------------- from_tensordict


def test_from_tensordict_flattens_nested_keys_and_shares_memory():
    """("next", k) becomes "next.k" (also deeper nests); the tensors are the TensorDict's."""
    td = _trajectory(4)
    td["a", "b", "c"] = torch.zeros(4, 3)
    episode = Episode.from_tensordict(td)
    assert list(episode.keys()) == [
        "obs",
        "action",
        "next.obs",
        "next.reward",
        "next.done",
        "next.terminated",
        "next.truncated",
        "a.b.c",
    ]
    assert len(episode) == 4
    assert episode["next.obs"].data_ptr() == td["next", "obs"].data_ptr()
    assert episode.schema["a.b.c"] == ((3,), torch.float32)


@pytest.mark.parametrize("terminated", [True, False])
def test_from_tensordict_reads_terminated_at_the_last_step(terminated):
    """terminated is ("next", "terminated") at the last step."""
    assert Episode.from_tensordict(_trajectory(3, terminated=terminated)).terminated is terminated


def test_from_tensordict_without_a_terminated_entry():
    """Without ("next", "terminated"): not done at the end means not terminated; done at the
    end needs terminated=, which is then used."""
    open_ended = _trajectory(3, done=False).exclude(("next", "terminated"))
    assert Episode.from_tensordict(open_ended).terminated is False
    ended = _trajectory(3).exclude(("next", "terminated"))
    message = (
        r"^terminated must be a bool when td has no \('next', 'terminated'\) entry and is done"
    )
    with pytest.raises(InvalidArgumentError, match=message):
        Episode.from_tensordict(ended)
    assert Episode.from_tensordict(ended, terminated=True).terminated is True
    bare = TensorDict({"obs": torch.zeros(2)}, batch_size=[2])
    with pytest.raises(InvalidArgumentError, match=r"'terminated'\) entry, got None$"):
        Episode.from_tensordict(bare)
    assert Episode.from_tensordict(bare, terminated=False).terminated is False


def test_from_tensordict_ignores_the_root_flags():
    """Root "terminated" / "done" (the state a step starts from) are plain fields."""
    td = _trajectory(2, terminated=False)
    td["terminated"] = torch.ones(2, 1, dtype=torch.bool)
    episode = Episode.from_tensordict(td)
    assert episode.terminated is False
    assert episode["terminated"].all()


def test_from_tensordict_refuses_a_terminated_that_contradicts_the_entry():
    """terminated= must agree with ("next", "terminated"), and be a bool."""
    with pytest.raises(InvalidArgumentError, match=r"^terminated must be td\[\('next', 'term"):
        Episode.from_tensordict(_trajectory(3, terminated=True), terminated=False)
    with pytest.raises(TypeError, match=r"^terminated must be a bool or None, got 1$"):
        Episode.from_tensordict(_trajectory(3), terminated=1)


@pytest.mark.parametrize("flag", ["done", "terminated", "truncated"])
def test_from_tensordict_refuses_an_episode_end_before_the_last_step(flag):
    """A done, terminated or truncated flag set before the last step: two episodes, refused."""
    td = _trajectory(5, done=False)
    td["next", flag][2] = True
    message = rf"^td\[\('next', '{flag}'\)\] must be False before the last step .*step 2 of 5$"
    with pytest.raises(InvalidArgumentError, match=message):
        Episode.from_tensordict(td)


@pytest.mark.parametrize(
    ("td", "error", "message"),
    [
        ({"obs": torch.zeros(3)}, TypeError, r"^td must be a TensorDict, got dict$"),
        (
            TensorDict({"obs": torch.zeros(2, 3)}, batch_size=[2, 3]),
            InvalidArgumentError,
            r"^td must be a trajectory with one batch dimension \(time\), got \[2, 3\]$",
        ),
        (
            TensorDict({"obs": torch.zeros(3)}, batch_size=[]),
            InvalidArgumentError,
            r"^td must be a trajectory with one batch dimension \(time\), got \[\]$",
        ),
        (
            TensorDict({"obs": torch.zeros(0)}, batch_size=[0]),
            InvalidArgumentError,
            r"^td must be a trajectory of at least one step, got \[0\]$",
        ),
        (
            TensorDict({}, batch_size=[3]),
            InvalidArgumentError,
            r"^td must be a trajectory with at least one tensor entry, got \[\]$",
        ),
        (
            TensorDict({"obs.x": torch.zeros(3)}, batch_size=[3]),
            InvalidArgumentError,
            r"^td key 'obs\.x' must be free of '\.' \(it joins nested keys\), got 'obs\.x'$",
        ),
        (
            TensorDict({("next", "a.b"): torch.zeros(3)}, batch_size=[3]),
            InvalidArgumentError,
            r"^td key \('next', 'a\.b'\) must be free of '\.'",
        ),
        (
            TensorDict({("next", "done"): torch.zeros(3, 1)}, batch_size=[3]),
            TypeError,
            r"^td\[\('next', 'done'\)\] must be a bool tensor, got torch\.float32$",
        ),
        (
            TensorDict({("next", ""): torch.zeros(3), "obs": torch.zeros(3)}, batch_size=[3]),
            InvalidArgumentError,
            r"^td key \('next', ''\) must be made of non-empty parts \(joined by '\.' into "
            r"the field name\), got \('next', ''\)$",
        ),
        (
            TensorDict({"": torch.zeros(3)}, batch_size=[3]),
            InvalidArgumentError,
            r"^td key '' must be made of non-empty parts",
        ),
    ],
)
def test_from_tensordict_refuses_what_is_not_one_trajectory(td, error, message):
    """Not a TensorDict, no single time dimension, T == 0, no entries, a '.' in a key or an
    empty key part (neither would nest back), a non-bool flag: refused, naming td."""
    with pytest.raises(error, match=message):
        Episode.from_tensordict(td)


def test_from_tensordict_refuses_non_tensor_entries():
    """A NonTensorData leaf cannot be stored: TypeError naming the key."""
    td = _trajectory(3)
    td["note"] = NonTensorData("hello", batch_size=[3])
    with pytest.raises(TypeError, match=r"^td\['note'\] must be a tensor, got NonTensorData$"):
        Episode.from_tensordict(td)


def test_missing_tensordict_raises_an_import_error_saying_how_to_install(monkeypatch):
    """Without tensordict, the interop says which extra to install."""
    monkeypatch.setitem(sys.modules, "tensordict", None)
    with pytest.raises(ImportError, match=r"pip install lucid-replay\[tensordict\]$"):
        Episode.from_tensordict(object())


# --------------------------------------------------------------------------- to_tensordict


def _buffer(buffer_type=SequenceReplay, **kwargs):
    """Two trajectories through from_tensordict: 5 steps (terminated), then 3 (truncated);
    obs of episode e at step t is 100 * e + t."""
    buffer = buffer_type(capacity=100, seed=0, **kwargs)
    buffer.add(Episode.from_tensordict(_trajectory(5, first=0.0)))
    buffer.add(Episode.from_tensordict(_trajectory(3, terminated=False, first=100.0)))
    return buffer


def test_window_batch_to_tensordict_entries_and_values():
    """[B, W] batch dims; fields nested back; per-record entries under their attribute names;
    [B] anchors repeated along the window; no priority_weight on a uniform draw."""
    batch = _buffer().gather_windows([0, 1], [3, 0], Window(2, burn_in=1, bootstrap=1))
    td = batch.to_tensordict()
    assert td.batch_size == torch.Size([2, 4])
    assert td.device == torch.device("cpu")
    # Records target t-1 .. t+2: episode 0 from step 3 (step 5 is padding), episode 1 from 0.
    assert td["obs"].squeeze(-1).tolist() == [[2.0, 3.0, 4.0, 4.0], [100.0, 100.0, 101.0, 102.0]]
    assert torch.equal(td["next", "obs"], batch["next.obs"])
    assert td["validity_mask"].tolist() == [[T, T, T, F], [F, T, T, T]]
    assert td["terminal"].tolist() == [[F, F, T, T], [F, F, F, F]]
    assert td["episode_ids"].tolist() == [[0] * 4, [1] * 4]
    assert td["anchor_steps"].tolist() == [[3] * 4, [0] * 4]
    assert td["sequence_id"].tolist() == [[0] * 4, [1] * 4]
    for name in ("learning_mask", "is_init", "record_episode_ids", "record_steps"):
        assert torch.equal(td[name], getattr(batch, name)), name
    assert "priority_weight" not in td
    flat = td.reshape(-1)
    for name, value in batch.flat().items():
        key = tuple(name.split(".")) if "." in name else name
        assert torch.equal(flat[key], value), name


def test_prioritized_window_batch_carries_priority_weight_per_element():
    """priority_weight is the window's weight at each of its records, float32 [B, W]."""
    batch = _buffer(PrioritizedSequenceReplay).sample_windows(3, Window(2, bootstrap=1))
    td = batch.to_tensordict()
    assert td["priority_weight"].dtype == torch.float32
    assert torch.equal(td["priority_weight"], batch.weights[:, None].expand(3, 3))


def test_chunk_batches_to_tensordict():
    """Batch: fields, episode_ids and starts [B, L]; PrioritizedBatch adds indices and
    priority_weight."""
    buffer = _buffer(PrioritizedSequenceReplay)
    chunks = buffer.sample(4, 3)
    td = chunks.to_tensordict()
    assert td.batch_size == torch.Size([4, 3])
    assert sorted(td.keys()) == ["action", "episode_ids", "next", "obs", "starts"]
    assert torch.equal(td["starts"], chunks.starts[:, None].expand(4, 3))
    prioritized = buffer.sample_prioritized(4, 3)
    td = prioritized.to_tensordict()
    assert torch.equal(td["indices"], prioritized.indices[:, None].expand(4, 3))
    assert torch.equal(td["priority_weight"], prioritized.weights[:, None].expand(4, 3))
    assert torch.equal(td["next", "reward"], prioritized["next.reward"])


def test_round_trip_trajectory_to_buffer_to_tensordict():
    """A trajectory stored whole comes back, as a chunk of its full length, equal to itself."""
    original = _trajectory(5, first=7.0)
    buffer = SequenceReplay(capacity=10)
    buffer.add(Episode.from_tensordict(original))
    td = buffer.sample(1, 5).to_tensordict()[0]
    assert (td.exclude("episode_ids", "starts") == original).all()


def test_to_tensordict_shares_memory_and_a_clone_is_writable():
    """Entries are views of the batch (no copy); a clone can be written in place."""
    batch = _buffer().gather_windows([0], [0], Window(2))
    td = batch.to_tensordict()
    assert td["obs"].data_ptr() == batch["obs"].data_ptr()
    assert td["episode_ids"].data_ptr() == batch.episode_ids.data_ptr()
    copy = td.clone()
    copy["episode_ids"][0, 0] = 9
    assert batch.episode_ids.tolist() == [0]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"anchor_steps": torch.zeros(3)},
            r"^batch field 'anchor_steps' must be named unlike the entries added \(\[",
        ),
        (
            {"next": torch.zeros(3), "next.obs": torch.zeros(3)},
            r"^batch field 'next' must be a leaf, not the sub-dict of 'next\.obs', got 'next'$",
        ),
        (
            {"a..b": torch.zeros(3)},
            r"^batch field 'a\.\.b' must be made of non-empty parts between '\.', got 'a\.\.b'$",
        ),
    ],
)
def test_to_tensordict_refuses_fields_that_do_not_nest(fields, message):
    """A field named like an added entry, a field that is another's prefix, or an empty part
    between dots: refused, naming the field."""
    buffer = SequenceReplay(capacity=10)
    buffer.add(Episode(fields))
    batch = buffer.gather_windows([0], [0], Window(1))
    with pytest.raises(InvalidArgumentError, match=message):
        batch.to_tensordict()


def test_to_tensordict_keeps_the_batch_device():
    """The TensorDict is on the batch's device (here the meta device, which needs no GPU)."""
    batch = _buffer().gather_windows([0], [0], Window(2)).to("meta")
    td = batch.to_tensordict()
    assert td.device == torch.device("meta")
    assert td["next", "obs"].device == torch.device("meta")


@cuda
def test_to_tensordict_of_a_cuda_batch_is_on_cuda():
    """A batch gathered onto CUDA converts to a CUDA TensorDict."""
    batch = _buffer().sample_windows(2, Window(2), device="cuda")
    td = batch.to_tensordict()
    assert td.device.type == "cuda"
    assert td["obs"].is_cuda and td["sequence_id"].is_cuda


# ------------------------------------------------------------------------------ assembler


def _steps(traj_ids, done, *, first=0.0, terminated=None):
    """Collector-like steps: per-step trajectory ids and done flags; obs counts from first."""
    traj = torch.tensor(traj_ids)
    end = torch.tensor(done)[..., None]
    obs = (torch.arange(traj.numel(), dtype=torch.float32) + first).reshape(traj.shape)
    return TensorDict(
        {
            "obs": obs,
            ("collector", "traj_ids"): traj,
            ("next", "done"): end,
            ("next", "terminated"): end
            if terminated is None
            else torch.tensor(terminated)[..., None],
        },
        batch_size=traj.shape,
    )


def test_assembler_carries_open_trajectories_across_batches():
    """Steps of one id are joined across calls; the call that sees the done stores the
    episode and returns its id; flush stores what is open as truncated."""
    buffer = SequenceReplay(capacity=100)
    assembler = TrajectoryAssembler(buffer)
    assert assembler.extend(_steps([0, 0, 1], [F, F, F])) == []
    assert assembler.num_open == 2
    assert assembler.extend(_steps([0, 1, 1], [T, F, F], first=10.0)) == [0]
    assert buffer[0]["obs"].tolist() == [0.0, 1.0, 10.0]
    assert buffer[0].terminated is True
    assert "collector.traj_ids" not in list(buffer[0])
    assert assembler.flush() == [1]
    assert buffer[1]["obs"].tolist() == [2.0, 11.0, 12.0]
    assert buffer[1].terminated is False
    assert assembler.num_open == 0
    assert assembler.flush() == []


def test_assembler_rows_are_separate_streams_and_order_is_by_finishing_step():
    """[N, T] batches: each row is one environment; episodes are stored in the order they
    finished (step, then row); an id may come back after its done as a new trajectory."""
    buffer = SequenceReplay(capacity=100)
    assembler = TrajectoryAssembler(buffer, exclude=())
    ids = assembler.extend(_steps([[0, 0, 0, 2], [1, 1, 3, 3]], [[F, F, T, F], [F, T, F, T]]))
    assert ids == [0, 1, 2]  # traj 1 ends at step 1, traj 0 at step 2, traj 3 at step 3
    stored = [buffer[i]["collector.traj_ids"][0].item() for i in ids]
    assert stored == [1, 0, 3]
    assert buffer[2]["obs"].tolist() == [6.0, 7.0]
    assert assembler.extend(_steps([[2, 4], [5, 5]], [[T, F], [F, F]])) == [3]
    assert assembler.extend(_steps([[4, 4], [5, 5]], [[T, F], [T, F]])) == [4, 5]
    assert assembler.num_open == 2  # 4 and 5 came back after their dones: new trajectories
    reused = assembler.flush()
    assert [buffer[i]["collector.traj_ids"].tolist() for i in reused] == [[4], [5]]


def test_assembler_copies_open_pieces():
    """Writing into a batch after extend (as a collector reusing its buffers would) does not
    change the trajectory being assembled."""
    buffer = SequenceReplay(capacity=100)
    assembler = TrajectoryAssembler(buffer)
    batch = _steps([0, 0], [F, F])
    assembler.extend(batch)
    batch["obs"].fill_(-1.0)
    assembler.extend(_steps([0], [T], first=5.0))
    assert buffer[0]["obs"].tolist() == [0.0, 1.0, 5.0]


@pytest.mark.parametrize("shape", [[0], [2, 0], [0, 3]])
def test_assembler_treats_a_batch_without_steps_as_a_no_op(shape):
    """A batch of batch dims [0], [N, 0] or [0, T] stores nothing, returns [] and keeps the
    open trajectories; its keys and dtypes are still checked."""
    buffer = SequenceReplay(capacity=100)
    assembler = TrajectoryAssembler(buffer)
    assembler.extend(_steps([4, 4], [F, F]))
    empty = TensorDict(
        {
            "obs": torch.zeros(*shape, 2),
            ("collector", "traj_ids"): torch.zeros(shape, dtype=torch.int64),
            ("next", "done"): torch.zeros(*shape, 1, dtype=torch.bool),
        },
        batch_size=shape,
    )
    assert assembler.extend(empty) == []
    assert (assembler.num_open, buffer.num_episodes) == (1, 0)
    empty["collector", "traj_ids"] = torch.zeros(shape)
    with pytest.raises(TypeError, match=r"^td\[\('collector', 'traj_ids'\)\] must be integers"):
        assembler.extend(empty)
    assert assembler.extend(_steps([4], [T])) == [0]
    assert buffer[0]["obs"].tolist() == [0.0, 1.0, 0.0]


class _Keeper:
    """A buffer that keeps the episodes it is given (as a list, a queue or a remote client
    that sends later would); with ``extend`` or with ``add`` only."""

    def __init__(self, *, refuse=(), with_extend=True):
        self.episodes, self.refuse = [], set(refuse)
        if with_extend:
            self.extend = lambda episodes: [self.add(e) for e in episodes]

    def add(self, episode):
        first = float(episode["obs"][0])
        if first in self.refuse:
            raise ValueError(f"episode at {first} refused")
        self.episodes.append(episode)
        return 100 + len(self.episodes) - 1


@pytest.mark.parametrize("with_extend", [True, False], ids=["extend", "add"])
def test_assembler_episodes_own_their_memory(with_extend):
    """A finished episode of one piece does not share memory with the collector's batch:
    writing into the batch afterwards (a collector reusing its output) changes nothing the
    buffer was given."""
    keeper = _Keeper(with_extend=with_extend)
    assembler = TrajectoryAssembler(keeper)
    batch = _steps([[0, 0, 1], [2, 2, 2]], [[F, T, T], [F, F, T]])
    assert assembler.extend(batch) == [100, 101, 102]
    batch["obs"].fill_(-1.0)
    batch["next", "done"].fill_(False)
    assert [e["obs"].tolist() for e in keeper.episodes] == [[0.0, 1.0], [2.0], [3.0, 4.0, 5.0]]
    assert all(e["next.done"][-1].item() for e in keeper.episodes)


def test_assembler_over_add_only_buffer_reports_what_it_stored():
    """With add only, a refused episode does not stop the others: every finished episode is
    offered, then EpisodesNotStoredError reports the ids stored and, by position, the
    buffer's errors and episodes. The call is taken: open trajectories carry on and nothing
    is stored twice."""
    from lucid_replay import EpisodesNotStoredError

    keeper = _Keeper(refuse={1.0}, with_extend=False)
    assembler = TrajectoryAssembler(keeper)
    with pytest.raises(EpisodesNotStoredError, match=r"got 1 of 3 refused \(episode 1: ") as caught:
        assembler.extend(_steps([0, 1, 2, 2, 3], [T, T, F, T, F]))
    error = caught.value
    assert isinstance(error, ValueError)
    assert error.stored_ids == [100, 101] and list(error.refused) == [1]
    assert error.__cause__ is error.refused[1] and error.episodes[1]["obs"].tolist() == [1.0]
    assert [e["obs"].tolist() for e in keeper.episodes] == [[0.0], [2.0, 3.0]]
    assert assembler.num_open == 1  # trajectory 3, carried on
    assert assembler.extend(_steps([3, 5], [T, F], first=10.0)) == [102]
    assert keeper.episodes[-1]["obs"].tolist() == [4.0, 10.0]
    keeper.refuse = {11.0}
    with pytest.raises(EpisodesNotStoredError, match=r"stored ids \[\]$") as caught:
        assembler.flush()
    assert list(caught.value.refused) == [0] and assembler.num_open == 0
    assert len(keeper.episodes) == 3


def test_assembler_uses_add_when_the_buffer_has_no_extend():
    """Any object with add will do."""

    class Sink:
        def __init__(self):
            self.episodes = []

        def add(self, episode):
            self.episodes.append(episode)
            return 100 + len(self.episodes)

    sink = Sink()
    assembler = TrajectoryAssembler(sink)
    assert assembler.extend(_steps([0, 1, 1, 2], [T, F, T, F])) == [101, 102]
    assert [len(e) for e in sink.episodes] == [1, 2]


@pytest.mark.parametrize(
    ("batch", "error", "message"),
    [
        (
            _steps([[0, 0], [0, 1]], [[F, F], [F, F]]),
            InvalidArgumentError,
            r"^td\[\('collector', 'traj_ids'\)\] must be ids that continue only within a row, "
            r"or come back after a done, got 'trajectory 0 again at flat step 2'$",
        ),
        (
            _steps([0, 1, 0], [F, F, F]),
            InvalidArgumentError,
            r"got 'trajectory 0 again at flat step 2'$",
        ),
        (
            _steps([0, 0], [F, F]).exclude("collector"),
            InvalidArgumentError,
            r"^td must be a batch with a \('collector', 'traj_ids'\) entry, got \['next', 'obs'\]$",
        ),
        (
            TensorDict({"obs": torch.zeros(2, 2, 2)}, batch_size=[2, 2, 2]),
            InvalidArgumentError,
            r"^td must be a batch of dims \[T\] or \[N, T\], got \[2, 2, 2\]$",
        ),
        (
            _steps([0.0, 0.0], [F, F]),
            TypeError,
            r"^td\[\('collector', 'traj_ids'\)\] must be integers, got torch\.float32$",
        ),
        (
            _steps([0, 0], [0, 1]),
            TypeError,
            r"^td\[\('next', 'done'\)\] must be bools, got torch\.int64$",
        ),
        (
            _steps([0, 0], [F, T], terminated=[T, F]),
            InvalidArgumentError,
            r"^td\[\('next', 'terminated'\)\] must be False before the last step",
        ),
        ({"obs": torch.zeros(2)}, TypeError, r"^td must be a TensorDict, got dict$"),
    ],
)
def test_assembler_refuses_bad_batches_and_changes_nothing(batch, error, message):
    """Ids continued across rows or back without a done, missing or mistyped keys, other
    batch dims, an episode from_tensordict refuses: refused, with nothing stored or opened."""
    buffer = SequenceReplay(capacity=100)
    assembler = TrajectoryAssembler(buffer)
    assembler.extend(_steps([7, 7], [F, F]))
    with pytest.raises(error, match=message):
        assembler.extend(batch)
    assert (assembler.num_open, buffer.num_episodes) == (1, 0)
    assert assembler.extend(_steps([7], [T])) == [0]
    assert len(buffer[0]) == 3


def test_assembler_refuses_padded_split_trajs_batches():
    """A ("collector", "mask") marks split_trajs=True padding: refused."""
    batch = _steps([[0, 0]], [[F, F]])
    batch["collector", "mask"] = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(InvalidArgumentError, match=r"^td must be contiguous \(split_trajs"):
        TrajectoryAssembler(SequenceReplay(capacity=10)).extend(batch)


def test_assembler_refuses_a_trajectory_whose_keys_change():
    """A later batch with other keys than the trajectory's earlier ones is refused."""
    assembler = TrajectoryAssembler(SequenceReplay(capacity=10))
    assembler.extend(_steps([0], [F]))
    changed = _steps([0], [T])
    changed["extra"] = torch.zeros(1)
    with pytest.raises(InvalidArgumentError, match=r"^td must be the keys of the earlier batc"):
        assembler.extend(changed)
    assert assembler.num_open == 1


def test_assembler_leaves_everything_unchanged_when_the_buffer_refuses():
    """An episode the buffer's extend refuses (another schema) stores nothing and keeps the
    open trajectories, so the call can be repeated after fixing the buffer."""
    buffer = SequenceReplay(capacity=100)
    buffer.add(Episode({"other": torch.zeros(2)}))
    assembler = TrajectoryAssembler(buffer)
    assembler.extend(_steps([0, 1], [F, F]))
    with pytest.raises(ValueError, match="fields"):
        assembler.extend(_steps([0, 1], [T, T]))
    assert (assembler.num_open, buffer.num_episodes) == (2, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buffer": []}, r"^buffer must be an object with an add method, got list$"),
        ({"traj_key": ("collector", 1)}, r"^traj_key must be a str or a tuple of str, got "),
        ({"done_key": ()}, r"^done_key must be a str or a tuple of str, got \(\)$"),
        ({"exclude": [3]}, r"^exclude must be a str or a tuple of str, got 3$"),
    ],
)
def test_assembler_constructor_refuses_bad_arguments(kwargs, message):
    """A buffer without add or a key that is not a str / tuple of str: TypeError."""
    arguments = {"buffer": SequenceReplay(capacity=10), **kwargs}
    with pytest.raises(TypeError, match=message):
        TrajectoryAssembler(**arguments)


# ------------------------------------------------------------------ a real TorchRL collector


def _torchrl():
    """torchrl's collectors and envs, or a skip (gymnasium is needed for GymEnv too)."""
    pytest.importorskip("gymnasium")
    with warnings.catch_warnings():
        # torchrl.collectors warns (DeprecationWarning) about its own weight updaters on import.
        warnings.simplefilter("ignore")
        collectors = pytest.importorskip("torchrl.collectors")
        envs = pytest.importorskip("torchrl.envs")
    return collectors, envs


def _cartpole():
    _, envs = _torchrl()
    return envs.TransformedEnv(envs.GymEnv("CartPole-v1"), envs.StepCounter(max_steps=16))


@pytest.mark.parametrize(
    ("envs", "frames_per_batch"), [(1, 7), (2, 10)], ids=["one-env-[7]", "two-envs-[2,5]"]
)
def test_assembler_on_a_collector_stream_equals_the_trajectories(envs, frames_per_batch):
    """Episodes assembled from a TorchRL 0.14 `Collector` (the former SyncDataCollector) cut
    every 7 / 5 steps, episodes of up to 16 steps, equal each trajectory cut out of all
    batches concatenated: every key, the terminated flag, and the call that stored it."""
    collectors, torchrl_envs = _torchrl()
    torch.manual_seed(0)
    env = _cartpole() if envs == 1 else torchrl_envs.SerialEnv(envs, _cartpole)
    env.set_seed(0)
    collector = collectors.Collector(
        env, policy=None, frames_per_batch=frames_per_batch, total_frames=140
    )
    buffer = SequenceReplay(capacity=1_000)
    assembler = TrajectoryAssembler(buffer, exclude=())
    batches, stored_by_call = [], []
    for batch in collector:
        batches.append(batch.clone())
        stored_by_call.append(assembler.extend(batch))
    collector.shutdown()
    flushed = assembler.flush()

    # Ground truth: each environment's whole stream, cut by trajectory id.
    stream = torch.cat(batches, dim=batches[0].batch_dims - 1).reshape(-1)
    traj_ids = stream["collector", "traj_ids"]
    truth = {int(t): stream[traj_ids == t] for t in traj_ids.unique()}
    stored = {int(buffer[i]["collector.traj_ids"][0]): i for i in buffer.episode_ids}
    assert sorted(stored) == sorted(truth)
    flags = {"terminated": 0, "truncated": 0}
    for traj, expected in truth.items():
        episode = buffer[stored[traj]]
        for key in expected.keys(include_nested=True, leaves_only=True):
            name = ".".join(key) if isinstance(key, tuple) else key
            assert torch.equal(episode[name], expected[key]), (traj, name)
        finished = bool(expected["next", "done"][-1])
        assert episode.terminated == bool(expected["next", "terminated"][-1])
        flags["terminated"] += episode.terminated
        flags["truncated"] += finished and not episode.terminated
        if finished:  # stored by the call whose batch holds its done step
            call = next(c for c, ids in enumerate(stored_by_call) if stored[traj] in ids)
            mine = batches[call]["collector", "traj_ids"] == traj
            assert bool(batches[call]["next", "done"][mine].any())
        else:
            assert stored[traj] in flushed
    assert flags["terminated"] > 0 and flags["truncated"] > 0
    assert len(buffer) == stream.numel()
    seen_in = [sum(bool((b["collector", "traj_ids"] == t).any()) for b in batches) for t in truth]
    assert max(seen_in) > 1  # trajectories were cut across batches
