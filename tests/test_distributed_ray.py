"""`ShardedReplay` on real Ray actors: the same draws as backend="local", remote writers, restarts.

The only module that starts Ray (one cluster per module, so two xdist workers never start two):
bound to loopback, no dashboard, no auth token, two CPUs, shut down at the end. Tests here
are few and slow (starting Ray takes ~8 s, an actor ~1 s); the exactness tests run on
backend="local" in test_distributed.py.
"""

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_episode
from ray_cluster import local_cluster

from lucid_replay import (
    CheckpointError,
    Episode,
    EpisodeWriter,
    Field,
    InvalidArgumentError,
    Mixture,
    Prioritized,
    Recency,
    Uniform,
    Window,
)
from lucid_replay.distributed import MinSize, SampleToInsertRatio, ShardedReplay, ids

ray = pytest.importorskip("ray", reason='needs Ray: pip install "lucid-replay[distributed]"')
pytestmark = pytest.mark.ray

WINDOW = Window(4, burn_in=2, bootstrap=1)
TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for this module, on 127.0.0.1 only; always shut down."""
    with local_cluster(EXAMPLES):
        yield


def _store(client: ShardedReplay, count: int) -> list[int]:
    """What a collector task does: add episodes through its copy of the client."""
    return [client.add(make_episode(5 + i % 4)) for i in range(count)]


def _collect(client: ShardedReplay, steps: int) -> list[int]:
    """A collector actor's loop: EpisodeWriter over the client, two envs."""
    writer = EpisodeWriter(client, num_envs=2)
    writer.reset(np.zeros((2, 3), dtype=np.float32))
    stored: list[int] = []
    for t in range(steps):
        done = np.array([t % 3 == 2, t % 4 == 3])
        stored += writer.step(
            np.ones(2, dtype=np.int64),
            np.ones(2, dtype=np.float32),
            done,
            np.zeros(2, dtype=bool),
            np.full((2, 3), t, dtype=np.float32),
        )
    return stored


def test_ray_shards_draw_what_local_shards_draw_and_take_remote_writers(cluster):
    """Same seed, same calls: Ray and local backends give identical batches; a pickled
    client adds from Ray tasks and actors; iterate keeps requests in flight."""
    replicas = [
        ShardedReplay.create(3, 3000, seed=11, backend=backend, max_times_sampled=50)
        for backend in ("ray", "local")
    ]
    for replay in replicas:
        replay.extend(make_episode(n, first_serial=100 * n) for n in (4, 9, 6, 12, 3, 7, 8))
    for step in range(3):
        remote, local = (r.sample_windows(16, WINDOW) for r in replicas)
        assert torch.equal(remote.episode_ids, local.episode_ids)
        assert torch.equal(remote["serial"], local["serial"])
        assert torch.equal(remote.weights, local.weights)
        chunks = [r.sample_prioritized(8, 3) for r in replicas]
        assert torch.equal(chunks[0]["serial"], chunks[1]["serial"])
        errors = torch.arange(16.0) + step
        assert replicas[0].update_priorities(remote.episode_ids, errors) == replicas[
            1
        ].update_priorities(local.episode_ids, errors)
    streams = [r.iterate(8, WINDOW, prefetch=3) for r in replicas]
    for _ in range(4):
        remote, local = (next(s) for s in streams)
        assert torch.equal(remote.anchor_steps, local.anchor_steps)
    for stream in streams:
        stream.close()

    ray_replay = replicas[0]
    client = pickle.loads(pickle.dumps(ray_replay))
    assert client.num_shards == 3
    added = ray.get(ray.remote(_store).remote(ray_replay, 6))
    assert len(set(added)) == 6 and set(ids.decode(np.array(added))[0].tolist()) <= {0, 1, 2}
    stats = ray_replay.stats()
    assert stats["episodes_added"] == 7 + 6
    assert len({shard["pid"] for shard in stats["shards"]}) == 3  # one process per shard
    for replay in replicas:
        replay.close()

    steps = ShardedReplay.create(1, 1000, seed=0, backend="ray")
    collector = ray.remote(num_cpus=0)(_Collector).remote(steps)
    collected = ray.get(collector.run.remote(12))
    assert len(set(collected)) == len(collected) == steps.stats()["episodes_added"] > 0
    steps.close()


class _Collector:
    """A Ray actor holding a copy of the client, as a collector on another node would."""

    def __init__(self, client: ShardedReplay) -> None:
        self.client = client

    def run(self, steps: int) -> list[int]:
        return _collect(self.client, steps)


def test_ray_shards_with_a_mixture_schema_and_memmap_draw_what_local_shards_draw(cluster, tmp_path):
    """selector=, schema= and storage="memmap" reach Ray shards: same seed, same calls, the
    same batches (probabilities and weights included) as in-process shards in memory, also
    by `Recency` (replay-wide commit counters issued through the control actor)."""
    mixture = Mixture({Prioritized(): 0.5, Uniform(): 0.3, Recency(half_life=8): 0.2})
    schema = {"serial": ((), torch.int64), "obs": Field((2,), torch.float32, stack=2)}
    schema["done"] = ((), torch.bool)
    options = {"seed": 5, "selector": mixture, "schema": schema}
    remote = ShardedReplay.create(
        2, 2000, backend="ray", storage="memmap", directory=tmp_path / "m", **options
    )
    local = ShardedReplay.create(2, 2000, backend="local", **options)
    try:
        for replay in (remote, local):
            replay.extend(make_episode(n, first_serial=100 * n) for n in (4, 9, 6, 12, 3))
        assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["shard_0", "shard_1"]
        for _ in range(2):
            a, b = remote.sample_windows(16, WINDOW), local.sample_windows(16, WINDOW)
            assert torch.equal(a.episode_ids, b.episode_ids) and torch.equal(a["obs"], b["obs"])
            assert torch.equal(a.probabilities, b.probabilities)
            assert torch.equal(a.weights, b.weights)
    finally:
        remote.close()
        local.close()


def test_a_killed_shard_restarts_from_its_checkpoint(cluster, tmp_path):
    """Ray restarts a killed shard: it holds its last checkpoint, counts the episodes lost,
    issues ids of a new incarnation, skips stale ones and refuses ids its old incarnation
    never issued with nothing updated."""
    replay = ShardedReplay.create(
        2, 2000, seed=3, backend="ray", checkpoint_dir=tmp_path, checkpoint_every=2
    )
    kept = replay.extend(make_episode(6) for _ in range(4))  # each shard checkpoints at 2
    lost = replay.extend(make_episode(6) for _ in range(2))
    ray.kill(replay._shards[0], no_restart=False)
    deadline = time.monotonic() + 60
    while True:  # the kill is asynchronous; calls raise while Ray restarts the actor
        try:
            stats = replay.stats()
            if stats["shards"][0]["incarnation"] == 1:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            pass
        assert time.monotonic() < deadline, "the shard did not come back"
        time.sleep(0.2)
    assert stats["shards"][0]["incarnation"] == 1
    assert stats["shards"][0]["episodes_stored"] == 2
    assert stats["episodes_lost"] == 1 and stats["transitions_lost"] == 6
    never = int(ids.encode(0, np.array(0), np.array(40)))  # incarnation 0 issued 0..2
    with pytest.raises(InvalidArgumentError, match=r"indices\[1\] must be an issued episode"):
        replay.update_priorities([kept[1], never], [50.0, 50.0])
    after = replay.stats()
    assert [s["max_priority"] for s in after["shards"]] == [1.0, 1.0]
    assert after["priority_updates_skipped"] == stats["priority_updates_skipped"] == 0
    fresh = replay.add(make_episode(6))
    assert ids.decode(np.array([fresh]))[1].tolist() == [1]
    assert replay.update_priorities([lost[0], kept[0]], [40.0, 2.0]) == 1
    batch = replay.sample_windows(64, Window(2))
    assert lost[0] not in set(batch.episode_ids.tolist())
    replay.close()


def _named_actors_become(expected: set[str]) -> bool:
    """Whether the named actors become ``expected`` (a kill takes effect asynchronously)."""
    deadline = time.monotonic() + 30
    while set(ray.util.list_named_actors()) != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_ray_load_that_fails_is_a_checkpoint_error_and_leaves_no_actor(cluster, tmp_path):
    """A damaged shard file or a bad manifest entry is refused before any actor starts; a
    file a shard actor refuses is a CheckpointError too, and every actor the load started
    (the named control among them) is stopped."""
    from test_distributed_checkpoints import (
        _rebind,
        _rewrite,
        _set,
        _shard_paths,
        _with_a_bad_inner_checksum,
    )

    replay = ShardedReplay.create(2, 2000, seed=0, backend="ray")
    replay.extend(make_episode(10) for _ in range(6))
    replay.save(tmp_path)
    replay.close()
    assert _named_actors_become(set())
    path = _shard_paths(tmp_path)[1]
    pristine = path.read_bytes()
    data = bytearray(pristine)
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="must be the file its manifest binds"):
        ShardedReplay.load(tmp_path)
    assert ray.util.list_named_actors() == []
    path.write_bytes(pristine)
    manifest = (tmp_path / "manifest.json").read_text()
    _rewrite(tmp_path, _set("control", "limiter", value=[1, 2]))
    with pytest.raises(CheckpointError, match=r"manifest control\['limiter'\] must be a mapping"):
        ShardedReplay.load(tmp_path)
    assert ray.util.list_named_actors() == []
    (tmp_path / "manifest.json").write_text(manifest)
    _with_a_bad_inner_checksum(path)
    _rebind(tmp_path)
    with pytest.raises(CheckpointError, match="checksum must match its payload") as refused:
        ShardedReplay.load(tmp_path)
    assert type(refused.value) is CheckpointError
    assert _named_actors_become(set())


def test_a_ray_learner_waits_on_the_rate_limiter(cluster):
    """Samples wait for inserts across processes; a timed-out sample changes nothing."""
    limiter = SampleToInsertRatio(1.0, 10, (-8.0, 40.0))
    replay = ShardedReplay.create(2, 2000, seed=0, backend="ray", rate_limiter=limiter)
    replay.add(make_episode(6))
    with pytest.raises(TimeoutError, match="sample of 4"):
        replay.sample_windows(4, Window(2), timeout=0.2)
    ray.get(ray.remote(_store).remote(replay, 2))
    assert replay.sample_windows(4, Window(2), timeout=5).batch_size == 4
    assert replay.stats()["limiter"]["samples"] == 4
    replay.close()


def _add_one(client: ShardedReplay, steps: int, seed: int) -> int:
    """A collector task adding one long episode through its copy of the client."""
    generator = torch.Generator().manual_seed(seed)
    return client.add(Episode({"x": torch.randn(steps, 64, generator=generator)}))


def test_a_ray_sampler_waiting_on_min_size_draws_once_a_remote_insert_is_stored(cluster):
    """A learner blocked on MinSize is released only once the shards hold the episode that
    reaches min_size: it draws, never meets an empty replay. The episode is large (5 MB)
    and added by a Ray task, so an insert counted before the shard stored it would leave a
    wide gap to fall into (the in-process version of this test pins the exact order)."""
    steps, seed = 20_000, 0
    replay = ShardedReplay.create(
        2, 4 * steps, seed=seed, backend="ray", rate_limiter=MinSize(steps)
    )
    box: dict[str, object] = {}

    def learner() -> None:
        try:
            box["batch"] = replay.sample_windows(4, Window(3), timeout=60)
        except Exception as error:  # reported below, with its message
            box["error"] = error

    thread = threading.Thread(target=learner)
    thread.start()
    time.sleep(0.2)  # the learner is waiting on the limiter
    assert "batch" not in box and "error" not in box
    ray.get(ray.remote(_add_one).remote(replay, steps, seed))
    thread.join(60)
    assert "error" not in box, box.get("error")
    assert box["batch"].batch_size == 4
    assert replay.stats()["limiter"]["inserts"] == steps
    replay.close()


def _continue_stream(stream, steps: dict[str, torch.Tensor]) -> int:
    """A task continuing an open stream handed over to it (pickled with its pending steps)."""
    stream.append(steps)
    stream.close(terminated=True)
    return stream.episode_id


def _stream_one(client: ShardedReplay, length: int) -> tuple[int, list[int]]:
    """A collector task streaming one episode in pieces through its copy of the client."""
    stream = client.open_episode()
    steps, committed = make_episode(length).steps, []
    for begin in range(0, length, 3):
        committed += stream.append({n: t[begin : begin + 3] for n, t in steps.items()})
    stream.close(terminated=False)
    return stream.episode_id, committed


def test_ray_streams_cross_processes_and_batches_carry_global_segment_ids(cluster):
    """A segmented Ray replay: a task streams an episode through its copy of the client,
    an open stream pickled to a task continues it (pending steps included), and batches
    from the shard processes carry global segment ids of the episodes' shards."""
    replay = ShardedReplay.create(2, 400, seed=3, backend="ray", segment_length=4)
    episode = make_episode(15)
    stream = replay.open_episode()
    assert stream.append({n: t[:6] for n, t in episode.steps.items()}) and stream.pending == 2
    rest = {n: t[6:] for n, t in episode.steps.items()}
    handed = ray.get(ray.remote(_continue_stream).remote(stream, rest))
    assert handed == stream.episode_id
    info = replay.episode_info(handed)
    assert (info.total_length, info.num_segments, info.is_open) == (15, 4, False)
    episode_id, committed = ray.get(ray.remote(_stream_one).remote(replay, 13))
    assert {i >> 55 for i in committed} == {episode_id >> 55} and len(committed) == 3
    assert replay.episode_info(episode_id).total_length == 13
    batch = replay.sample_windows(64, WINDOW)
    assert torch.equal(batch.segment_ids >> 55, batch.episode_ids >> 55)
    assert set(batch.episode_ids.tolist()) == {handed, episode_id}
    replay.close()


def test_the_distributed_r2d2_example_trains_end_to_end(cluster, monkeypatch):
    """examples/distributed_r2d2.py: a collector actor, a shard and the learner run a few
    hundred steps under the rate limiter and leave a trained network (a smoke run)."""
    pytest.importorskip("gymnasium")
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    example = __import__("distributed_r2d2")
    args = example.Args(
        total_steps=400, num_envs=2, num_collectors=1, num_shards=1, batch_size=8,
        learning_starts=80, hidden=16, capacity=5_000, eval_interval=10**9,
        check_episodes=1, sync_every=50,
    )  # fmt: skip
    result = example.train(args)
    assert result["updates"] > 0
    assert result["stats"]["episodes_added"] > 0
    assert result["stats"]["limiter"]["samples"] >= 8 * result["updates"]  # + in flight
