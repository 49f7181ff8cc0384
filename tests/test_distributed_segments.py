"""`ShardedReplay` with ``segment_length`` (backend="local"): streamed episodes on one shard
each, one shard equal to the single segmented buffer draw for draw, global segment ids,
endless streams, checkpoints with open episodes, restarts and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_episode, snapshot

from lucid_replay import (
    Episode,
    EpisodeWriter,
    InvalidArgumentError,
    PrioritizedSequenceReplay,
    RateLimiterTimeout,
    SchemaError,
    UnknownEpisodeError,
    Window,
)
from lucid_replay.distributed import MinSize, SampleToInsertRatio, ShardedReplay, ids
from lucid_replay.distributed.calls import LocalHandle
from lucid_replay.distributed.shards import ReplayShard

ALPHA, BETA, EPSILON = 0.7, 0.5, 1e-6
WINDOW = Window(3, burn_in=2, bootstrap=1)
L = 4


def _local(num_shards: int, capacity: int = 400, **kwargs: object) -> ShardedReplay:
    options = {"alpha": ALPHA, "beta": BETA, "epsilon": EPSILON, "seed": 7, **kwargs}
    options.setdefault("segment_length", L)
    return ShardedReplay.create(num_shards, capacity, backend="local", **options)


def _buffer(replay: ShardedReplay, shard: int) -> PrioritizedSequenceReplay:
    return replay._shards[shard].target.buffer


def _steps(n: int) -> dict[str, torch.Tensor]:
    """``n`` steps of `make_episode`'s fields."""
    return dict(make_episode(n).steps)


def _pieces(length: int, rng: np.random.Generator) -> list[tuple[int, int, bool]]:
    """Random pieces ``(begin, end, flush after)`` of 1 .. 2L steps covering ``length``."""
    pieces, begin = [], 0
    while begin < length:
        end = min(begin + int(rng.integers(1, 2 * L + 1)), length)
        pieces.append((begin, end, bool(rng.random() < 0.2)))
        begin = end
    return pieces


def _stream(target, episode: Episode, pieces, *, close: bool = True):
    """Stream ``episode`` into ``target`` (a buffer or a client) in ``pieces``."""
    stream = target.open_episode()
    committed = []
    for begin, end, flush in pieces:
        committed += stream.append({n: t[begin:end] for n, t in episode.steps.items()})
        if flush:
            flushed = stream.flush()
            committed += [] if flushed is None else [flushed]
    if close:
        stream.close(terminated=episode.terminated)
    return stream, committed


def _same(got, expected) -> None:
    assert torch.equal(got.episode_ids, expected.episode_ids)
    assert torch.equal(got.segment_ids, expected.segment_ids)
    assert torch.equal(got["serial"], expected["serial"])
    if getattr(expected, "weights", None) is not None:
        assert torch.equal(got.weights, expected.weights)


# ------------------------------------------------------------------ one shard = buffer
@pytest.mark.parametrize("priority_unit", ["episode", "segment"])
def test_one_shard_streaming_equals_the_segmented_buffer_draw_for_draw(priority_unit):
    """Same seed, same steps in the same random pieces (flushes, adds, an open episode,
    evicted heads): ids, segment ids, data, weights, priority updates and stats equal a
    PrioritizedSequenceReplay(segment_length=L)'s."""
    rng = np.random.default_rng(3)
    replay = _local(1, capacity=90, priority_unit=priority_unit)
    buffer = PrioritizedSequenceReplay(
        90, ALPHA, BETA, EPSILON, seed=7, segment_length=L, priority_unit=priority_unit
    )
    open_streams = []
    for round_ in range(14):
        episode = make_episode(int(rng.integers(1, 30)), terminated=bool(round_ % 2))
        if round_ % 5 == 4:
            assert replay.add(episode) == buffer.add(episode)
        else:
            pieces = _pieces(len(episode), rng)
            close = round_ % 7 != 3  # some episodes stay open (their pending steps too)
            got, committed = _stream(replay, episode, pieces, close=close)
            expected, expected_committed = _stream(buffer, episode, pieces, close=close)
            assert got.episode_id == expected.episode_id  # shard 0, incarnation 0: local ids
            assert committed == expected_committed
            assert got.pending == expected.pending
            if not close:
                open_streams.append((got, expected))
        if round_ < 2:
            continue
        _same(replay.sample_windows(6, WINDOW), buffer.sample_windows(6, WINDOW))
        _same(replay.sample(4, 2), buffer.sample(4, 2))
        sampled, twin = replay.sample_prioritized(5, 3), buffer.sample_prioritized(5, 3)
        _same(sampled, twin)
        assert torch.equal(sampled.indices, twin.indices)
        errors = torch.linspace(0.1, 3.0, 5) * (round_ + 1)
        assert replay.update_priorities(sampled.indices, errors) == buffer.update_priorities(
            twin.indices, errors
        )
        windows = (replay.sample_windows(4, WINDOW), buffer.sample_windows(4, WINDOW))
        _same(*windows)
        per_record = torch.rand(4, WINDOW.size, generator=torch.Generator().manual_seed(round_))
        assert replay.update_priorities_from(windows[0], per_record) == (
            buffer.update_priorities_from(windows[1], per_record)
        )
    for got, expected in open_streams:
        steps = _steps(3)
        assert got.append(steps) == expected.append(steps)
    assert replay.open_episode_ids == buffer.open_episode_ids
    stats = replay.stats()
    assert stats["segments_evicted"] > 0 and stats["episodes_open"] == len(open_streams)
    shard_stats = stats["shards"][0]
    assert {k: shard_stats[k] for k in buffer.stats()} == buffer.stats()
    episode_id = open_streams[0][0].episode_id
    assert replay.episode_info(episode_id) == buffer.episode_info(episode_id)


# ------------------------------------------------------------------- several shards
def test_an_episodes_segments_all_live_on_the_shard_that_opened_it():
    """Opens and adds share the round robin; every segment of a streamed episode is on its
    shard (the id's shard bits), and batches carry global segment ids of that shard."""
    rng = np.random.default_rng(0)
    replay = _local(3)
    streams, segment_ids = [], {}
    for k in range(7):
        if k == 3:
            added = replay.add(make_episode(9))
            assert added >> 55 == 0
            continue
        episode = make_episode(int(rng.integers(9, 30)))
        stream, committed = _stream(replay, episode, _pieces(len(episode), rng))
        streams.append(stream)
        segment_ids[stream.episode_id] = set(committed)
    assert [s.episode_id >> 55 for s in streams] == [0, 1, 2, 1, 2, 0]
    for stream in streams:
        shard, _, local = (int(v[0]) for v in ids.decode(np.array([stream.episode_id])))
        info = replay.episode_info(stream.episode_id)
        assert info.num_segments == _buffer(replay, shard).episode_info(local).num_segments > 1
        assert {i >> 55 for i in segment_ids[stream.episode_id]} == {shard}
    batch = replay.sample_windows(300, WINDOW)
    assert torch.equal(batch.segment_ids >> 55, batch.episode_ids >> 55)
    pairs = zip(batch.episode_ids.tolist(), batch.segment_ids.tolist(), strict=True)
    for episode_id, segment_id in pairs:
        if episode_id in segment_ids:
            assert segment_id in segment_ids[episode_id]
    chunks = replay.sample(50, 2)
    assert torch.equal(chunks.segment_ids >> 55, chunks.episode_ids >> 55)


def test_segment_unit_routes_global_segment_ids_and_refuses_unissued_ones():
    """priority_unit="segment": batch indices are global segment ids; an update reaches
    exactly those segments on their shards, refuses an id no shard issued with nothing
    updated anywhere, and skips (counts) evicted ones."""
    replay = _local(2, capacity=80, priority_unit="segment")
    _, first = _stream(replay, make_episode(12), [(0, 12, False)])
    _, second = _stream(replay, make_episode(8), [(0, 8, False)])
    batch = replay.sample_prioritized(6, 2)
    assert torch.equal(batch.indices, batch.segment_ids)
    assert replay.update_priorities([first[1], second[0]], [4.0, 9.0]) == 2
    assert _buffer(replay, 0).priorities.tolist() == pytest.approx([1.0, 4.0, 1.0], abs=1e-5)
    assert _buffer(replay, 1).priorities.tolist() == pytest.approx([9.0, 1.0], abs=1e-5)
    never = int(ids.encode(1, np.array(0), np.array(2)))  # shard 1 issued segments 0, 1
    before = [snapshot(_buffer(replay, k)) for k in range(2)]
    with pytest.raises(InvalidArgumentError, match=r"indices\[1\] must be an issued segment"):
        replay.update_priorities([first[0], never], [5.0, 5.0])
    assert [snapshot(_buffer(replay, k)) for k in range(2)] == before
    _stream(replay, make_episode(40), [(0, 40, False)])  # fills shard 0: its old ones go
    assert replay.update_priorities([first[0], second[1]], [2.0, 2.0]) == 1
    assert replay.stats()["priority_updates_skipped"] == 1
    windows = replay.sample_windows(8, WINDOW)
    assert replay.update_priorities_from(windows, torch.ones(8, WINDOW.size)) >= 1


def test_an_endless_stream_longer_than_a_shard_flows_through_and_the_limiter_counts_it():
    """One episode of 10x a shard's capacity streams through its shard (heads evicted,
    memory bounded); the limiter counts committed steps as inserts, evictions as deletes,
    and pending steps nowhere."""
    replay = _local(2, capacity=80, rate_limiter=MinSize(10))
    stream = replay.open_episode()
    serial = 0
    for size in [3, 7, 1, 12, 6] * 18:  # 522 steps, a shard holds 40
        steps = torch.arange(serial, serial + size)
        stream.append({"serial": steps, "obs": torch.zeros(size, 2)})
        serial += size
        limiter = replay.stats()["limiter"]
        assert limiter["inserts"] == serial - stream.pending and limiter["pending"] == 0
    info = replay.episode_info(stream.episode_id)
    assert info.total_length == serial - stream.pending and info.is_open
    assert info.stored_length <= 40 and info.first_step >= 480
    stats = replay.stats()
    assert stats["limiter"]["deletes"] == stats["transitions_evicted"] > 400
    assert len(replay) == info.stored_length
    batch = replay.sample_windows(16, WINDOW)
    assert bool((batch["serial"][:, WINDOW.burn_in :].diff(dim=1) == 1).all())
    assert stream.pending == 2 and stream.flush() is not None and stream.pending == 0


def test_a_stream_waits_on_the_rate_limiter_only_when_it_commits():
    """An append that completes a segment is an insert of its steps: held back by the
    limiter, it times out with nothing sent or counted and its pending steps kept; an
    append that completes none never waits."""
    limiter = SampleToInsertRatio(1.0, 4, (0.0, 8.0))  # 8 transitions, then a sample first
    replay = _local(2, rate_limiter=limiter)
    stream = replay.open_episode()
    assert len(stream.append(_steps(9))) == 2 and stream.pending == 1
    before = replay.stats()
    with pytest.raises(RateLimiterTimeout, match="insert of 4 transitions"):
        stream.append(_steps(3), timeout=0.01)
    assert stream.pending == 1 and replay.stats() == before
    assert stream.append(_steps(2), timeout=0.0) == [] and stream.pending == 3
    replay.sample_windows(4, Window(2))
    assert len(stream.append(_steps(1), timeout=1.0)) == 1
    assert replay.stats()["limiter"]["inserts"] == 12


def test_write_back_and_stats_reach_segmented_shards():
    """write_back routes records of streamed episodes to their shard, across seams."""
    replay = _local(2)
    for _ in range(4):
        _stream(replay, make_episode(13), [(0, 5, False), (5, 13, False)])
    batch = replay.sample_windows(8, WINDOW)
    values = torch.full(batch["obs"].shape, -3.0)
    assert replay.write_back(batch, "obs", values) == int(batch.validity_mask.sum())
    again = replay.sample_windows(64, WINDOW)
    assert replay.stats()["segments_stored"] == 4 * 4
    assert bool((again["obs"] == -3.0).any())


def test_an_episode_writer_streams_through_a_segmented_client():
    """EpisodeWriter sees the client's segment_length and open_episode: it streams each
    env's episode onto one shard."""
    replay = _local(2)
    writer = EpisodeWriter(replay, num_envs=2)
    writer.reset(np.zeros((2, 1), dtype=np.float32))
    stored = []
    for t in range(30):
        stored += writer.step(
            np.ones(2, dtype=np.int64),
            np.ones(2, dtype=np.float32),
            np.array([t % 11 == 10, t % 13 == 12]),
            np.zeros(2, dtype=bool),
            np.full((2, 1), t, dtype=np.float32),
        )
    assert stored and {i >> 55 for i in stored} <= {0, 1}
    assert replay.stats()["segments_stored"] > replay.stats()["episodes_stored"]


# ----------------------------------------------------------------- checkpoints
def test_save_and_load_keep_open_episodes_and_resumed_streams_continue_exactly(tmp_path):
    """Open episodes survive save/load with their committed steps (pending steps are the
    caller's); resume_episode continues them, and the loaded replay then draws what the
    saved one draws; the stream resumed on the saved replay supersedes the old one."""
    rng = np.random.default_rng(5)
    replay = _local(2)
    streams = []
    for length in (11, 13, 14):
        episode = make_episode(length)
        pieces = [(begin, end, False) for begin, end, _ in _pieces(length, rng)]
        stream, _ = _stream(replay, episode, pieces, close=False)
        streams.append(stream)
    streams[0].flush()
    pending = streams[1].pending
    assert pending > 0  # not flushed: not saved
    replay.save(tmp_path)
    loaded = ShardedReplay.load(tmp_path)
    assert loaded.segment_length == L and loaded.priority_unit == "episode"
    assert (
        loaded.open_episode_ids == replay.open_episode_ids == sorted(s.episode_id for s in streams)
    )
    for stream in streams:
        assert loaded.episode_info(stream.episode_id) == replay.episode_info(stream.episode_id)
    resumed = replay.resume_episode(streams[1].episode_id)
    before = replay.stats()
    with pytest.raises(InvalidArgumentError, match="superseded by resume_episode"):
        streams[1].append(_steps(9))
    assert streams[1].pending == pending and replay.stats() == before
    resumed_loaded = loaded.resume_episode(streams[1].episode_id)
    steps = _steps(9)
    for target in (resumed, resumed_loaded):
        target.append(steps)
        target.close(terminated=True)
    episode = make_episode(6)
    for target in (replay, loaded):
        target.add(episode)
    got, expected = (r.sample_windows(16, WINDOW) for r in (loaded, replay))
    _same(got, expected)
    assert loaded.stats()["episodes_open"] == 2


def test_a_restarted_shard_keeps_checkpointed_open_episodes_and_refuses_stale_streams(tmp_path):
    """After a restart a client stream of the shard is refused (nothing changes); an episode
    open in the checkpoint resumes; segment ids of lost segments are skipped, new ones
    carry the next incarnation, never-issued ones are refused."""
    replay = _local(2, checkpoint_dir=tmp_path, priority_unit="segment")
    kept, kept_ids = _stream(replay, make_episode(9), [(0, 9, False)], close=False)
    replay.save(tmp_path)  # into checkpoint_dir: the shards' restart files
    _, lost_ids = _stream(replay, make_episode(4), [(0, 4, False)])  # shard 1, not saved
    lost_ids += kept.append(_steps(4))  # shard 0
    settings = replay._shards[0].target.settings
    replay._shards[0] = LocalHandle(ReplayShard(0, settings, replay._control, restarted=True))
    assert replay.stats()["transitions_lost"] == 4
    with pytest.raises(InvalidArgumentError, match="superseded"):
        kept.append(_steps(4))
    resumed = replay.resume_episode(kept.episode_id)
    assert replay.episode_info(kept.episode_id).total_length == 8  # kept.pending: 1, lost
    fresh = resumed.append(_steps(4))
    assert ids.decode(np.array(fresh))[1].tolist() == [1]  # incarnation 1 of shard 0
    assert fresh[0] & ids.MAX_LOCAL == lost_ids[-1] & ids.MAX_LOCAL  # same local number
    skipped = replay.stats()["priority_updates_skipped"]
    assert replay.update_priorities([lost_ids[-1], fresh[0], kept_ids[0]], [7.0, 2.0, 3.0]) == 2
    assert replay.stats()["priority_updates_skipped"] == skipped + 1
    never = int(ids.encode(0, np.array(0), np.array(5)))  # incarnation 0 issued 0 .. 2
    with pytest.raises(InvalidArgumentError, match=r"indices\[0\] must be an issued segment"):
        replay.update_priorities([never], [1.0])


# ------------------------------------------------------------------------- refusals
def test_create_refuses_segment_settings_a_shard_could_not_take():
    """segment_length 1 .. a shard's capacity; priority_unit="segment" needs it and
    unit="chunk"; every refusal names the argument and starts nothing."""
    with pytest.raises(InvalidArgumentError, match="segment_length must be <= 50"):
        _local(2, capacity=100, segment_length=51)
    with pytest.raises(InvalidArgumentError, match="segment_length must be >= 1"):
        _local(2, segment_length=0)
    with pytest.raises(InvalidArgumentError, match="priority_unit must be one of"):
        _local(2, priority_unit="step")
    with pytest.raises(InvalidArgumentError, match='priority_unit must be "episode" unless'):
        _local(2, segment_length=None, priority_unit="segment")
    with pytest.raises(InvalidArgumentError, match='priority_unit must be "episode" unless'):
        _local(2, unit="episode", priority_unit="segment")


def test_refused_stream_calls_change_nothing():
    """open_episode and resume_episode without segment_length, appends after close, close
    twice, steps of another schema or beyond a shard's capacity, unknown ids: refused,
    with the replay and the stream's pending steps unchanged."""
    whole = _local(2, segment_length=None)
    with pytest.raises(InvalidArgumentError, match="segment_length must be set"):
        whole.open_episode()
    with pytest.raises(InvalidArgumentError, match="segment_length must be set"):
        whole.resume_episode(0)
    assert whole.open_episode_ids == [] and whole.stats()["episodes_added"] == 0

    replay = _local(2, capacity=40)
    stream = replay.open_episode()
    stream.append({"serial": torch.arange(6), "obs": torch.zeros(6, 2)})
    before = (replay.stats(), stream.pending, [snapshot(_buffer(replay, k)) for k in range(2)])

    def unchanged() -> bool:
        shards = [snapshot(_buffer(replay, k)) for k in range(2)]
        return (replay.stats(), stream.pending, shards) == before

    with pytest.raises(SchemaError):
        stream.append({"serial": torch.arange(2)})
    assert unchanged()
    with pytest.raises(InvalidArgumentError, match=r"steps must be at most a shard's capacity"):
        stream.append({"serial": torch.arange(21), "obs": torch.zeros(21, 2)})
    assert unchanged()
    with pytest.raises(UnknownEpisodeError, match="no shard issued it"):
        replay.resume_episode(5 << 55)
    with pytest.raises(UnknownEpisodeError, match="never issued"):
        replay.episode_info(int(ids.encode(1, np.array(0), np.array(3))))
    with pytest.raises(TypeError, match="terminated must be a bool"):
        stream.close(terminated=None)
    assert unchanged()
    stream.close(terminated=False)
    after = replay.stats()
    with pytest.raises(InvalidArgumentError, match="the stream must be open to append"):
        stream.append({"serial": torch.arange(2), "obs": torch.zeros(2, 2)})
    with pytest.raises(InvalidArgumentError, match="the stream must be open to append"):
        stream.close(terminated=True)
    with pytest.raises(InvalidArgumentError, match="must be an open episode"):
        replay.resume_episode(stream.episode_id)
    assert replay.stats() == after and stream.closed


def test_a_draw_that_open_episodes_cannot_serve_is_refused_as_the_buffer_refuses_it():
    """Committed steps of open episodes too few for the window and its bootstrap: the
    single buffer's error and message, not a reuse-limit error."""
    window = Window(3, burn_in=1, bootstrap=2)
    messages = []
    for target in (_local(2), PrioritizedSequenceReplay(200, segment_length=L)):
        target.open_episode().append(_steps(4))
        with pytest.raises(InvalidArgumentError) as refused:
            target.sample_windows(2, window)
        messages.append(str(refused.value))
    assert messages[0] == messages[1]
    assert "open episodes' committed steps hold (5 steps" in messages[0]
