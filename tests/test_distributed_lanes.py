"""Lanes: a client's draws reach a same-node Ray shard over a Unix socket, in call order.

The unit tests run a `LaneServer` in this process; the Ray tests check that a shared Ray
client draws on lanes what a local twin draws, also with adds and updates between a
stream's batches, and that a killed shard's lane fails its calls as Ray does and is opened
again to the restarted shard.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import numpy as np
import pytest
import torch
from conftest import make_episode
from ray_cluster import local_cluster

from lucid_replay import Window
from lucid_replay.distributed import ShardedReplay
from lucid_replay.distributed.lanes import Lane, LaneHandle, LaneServer, serialized

ray = pytest.importorskip("ray", reason='needs Ray: pip install "lucid-replay[distributed]"')

WINDOW = Window(3, burn_in=1, bootstrap=1)


class Toy:
    """A target whose calls record when they start and end."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def slow(self, name: str, seconds: float) -> str:
        self.log.append(f"{name}+")
        time.sleep(seconds)
        self.log.append(f"{name}-")
        return name

    def fail(self) -> None:
        raise KeyError("the shard's own error")

    def _private(self) -> str:
        return "never"

    @staticmethod
    def helper(value: int) -> int:
        return value + 1


SerialToy = serialized(Toy, __name__)


def _lane(target: object) -> Lane:
    server = LaneServer(target)
    return Lane(server.address, server.key)


def test_serialized_calls_run_one_at_a_time_in_order_of_the_lock():
    log: list[str] = []
    toy = SerialToy(log)
    lane = _lane(toy)
    future = LaneHandle(lane).slow.remote("lane", 0.2)
    time.sleep(0.05)  # the lane's call holds the lock
    assert toy.slow("direct", 0.0) == "direct"  # what Ray's thread would call
    assert future.result() == "lane"
    assert log == ["lane+", "lane-", "direct+", "direct-"]
    plain: list[str] = []
    unlocked = Toy(plain)  # the same calls without `serialized` overlap
    future = LaneHandle(_lane(unlocked)).slow.remote("lane", 0.2)
    time.sleep(0.05)
    unlocked.slow("direct", 0.0)
    future.result()
    assert plain == ["lane+", "direct+", "direct-", "lane-"]
    assert SerialToy.helper(1) == toy.helper(1) == 2  # static methods are left as they are
    lane.close()


def test_replies_come_back_in_order_with_the_shards_errors():
    lane = _lane(SerialToy([]))
    handle = LaneHandle(lane)
    futures = [handle.slow.remote(str(k), 0.0) for k in range(5)]
    failed, private = handle.fail.remote(), handle._private.remote()
    assert futures[3].result() == "3"  # reads the replies before it, and keeps them
    assert all(f.done for f in futures[:4]) and not failed.done
    assert [f.result() for f in futures] == ["0", "1", "2", "3", "4"]
    with pytest.raises(KeyError, match="the shard's own error"):
        failed.result()
    with pytest.raises(AttributeError, match="a lane calls public methods, got '_private'"):
        private.result()
    lane.close()


def test_settle_reads_every_reply_in_flight():
    """What `ShardedReplay._call_handles` waits for before a call that is not a draw."""
    log: list[str] = []
    lane = _lane(SerialToy(log))
    future = LaneHandle(lane).slow.remote("draw", 0.2)
    lane.settle()
    assert future.done and log == ["draw+", "draw-"]
    lane.close()


def test_a_closed_lane_fails_its_calls_as_ray_fails_calls_to_a_dead_actor():
    lane = _lane(SerialToy([]))
    lane.close()
    assert not lane.usable
    with pytest.raises(ray.exceptions.RayActorError, match="lane"):
        LaneHandle(lane).slow.remote("x", 0.0).result()


def test_a_lane_is_not_used_by_a_forked_child():
    lane = _lane(SerialToy([]))
    pid = os.fork()
    if pid == 0:  # the child sees the lane as not its own, and leaves the socket alone
        os._exit(0 if not lane.usable else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert lane.usable and LaneHandle(lane).slow.remote("after", 0.0).result() == "after"
    lane.close()


def test_a_wrong_key_is_refused_at_the_handshake():
    server = LaneServer(SerialToy([]))
    with pytest.raises((multiprocessing.AuthenticationError, EOFError, OSError)):
        Lane(server.address, b"not the key")
    assert LaneHandle(Lane(server.address, server.key)).slow.remote("ok", 0).result() == "ok"


# ------------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for this module, on 127.0.0.1 only; always shut down."""
    with local_cluster():
        yield


def _same(first, second) -> None:
    for key in ("episode_ids", "anchor_steps", "weights", "probabilities"):
        assert torch.equal(getattr(first, key), getattr(second, key)), key
    for name in first.data:
        assert torch.equal(first.data[name], second.data[name]), name


@pytest.mark.ray
def test_a_shared_ray_stream_draws_on_lanes_what_a_local_twin_draws(cluster):
    """Adds and updates between batches run after the draw in flight, as they were sent."""
    made = [
        ShardedReplay.create(3, 600, seed=5, backend=backend, transport="shared")
        for backend in ("ray", "local")
    ]
    remote, local = made
    try:
        for replay in made:
            replay.extend(make_episode(n, first_serial=100 * n) for n in (4, 6, 9, 5, 7, 8))
        errors = np.linspace(0.1, 3.0, 16)
        streams = [replay.iterate(16, WINDOW) for replay in made]
        got: list[list] = [[], []]
        for step in range(6):
            for k, (replay, stream) in enumerate(zip(made, streams, strict=True)):
                got[k].append(next(stream))  # the next draw is in flight now
                if step == 1:
                    replay.add(make_episode(11, first_serial=5000))
                if step == 3:
                    replay.update_priorities(got[k][0].episode_ids, errors)
                if step == 4:
                    replay.update_priorities(got[k][2].episode_ids, errors, defer=True)
        assert all(lane is not None and lane.usable for lane in remote._lanes)
        for first, second in zip(*got, strict=True):
            _same(first, second)
        assert remote.stats()["chunks_sampled"] == local.stats()["chunks_sampled"]
        priorities = [[s["max_priority"] for s in r.stats()["shards"]] for r in made]
        assert priorities[0] == priorities[1]
    finally:
        for replay in made:
            replay.close()


@pytest.mark.ray
def test_a_killed_shards_lane_fails_as_ray_does_and_opens_again(cluster, tmp_path):
    replay = ShardedReplay.create(
        2, 2000, seed=3, backend="ray", checkpoint_dir=tmp_path, checkpoint_every=1
    )
    try:
        replay.extend(make_episode(6) for _ in range(4))
        replay.sample_windows(8, Window(2))
        old = replay._lanes[0]
        assert old is not None and old.usable
        ray.kill(replay._shards[0], no_restart=False)  # asynchronous: it lands in a while
        deadline = time.monotonic() + 60
        failures = 0
        while True:
            try:
                batch = replay.sample_windows(8, Window(2))
                if failures:  # drawn again after the kill landed
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                failures += 1
            assert time.monotonic() < deadline, "the shard did not come back"
            time.sleep(0.2)
        assert failures >= 1 and not old.usable
        assert replay._lanes[0] is not old and replay._lanes[0].usable
        assert replay.stats()["shards"][0]["incarnation"] == 1
        assert batch.episode_ids.shape == (8,)
    finally:
        replay.close()


@pytest.mark.ray
def test_a_pickled_client_opens_its_own_lanes(cluster):
    @ray.remote
    def draw_elsewhere(client: ShardedReplay) -> tuple[bool, list[int]]:
        had = any(lane is not None for lane in client._lanes)
        batch = client.sample_windows(4, Window(2))
        return had, batch.episode_ids.tolist()

    replay = ShardedReplay.create(2, 600, seed=1, backend="ray")
    try:
        stored = set(replay.extend(make_episode(5) for _ in range(4)))
        replay.sample_windows(4, Window(2))  # this client's lanes are open
        had, drawn = ray.get(draw_elsewhere.remote(replay))
        assert not had and set(drawn) <= stored
        assert replay._root is not None and os.path.isdir(replay._root)  # a copy's end left them
    finally:
        replay.close()


def test_lanes_are_threads_safe_between_a_draw_and_a_call():
    """Two client threads on one lane: every reply reaches its own future."""
    lane = _lane(SerialToy([]))
    handle = LaneHandle(lane)
    results: dict[int, list[str]] = {}

    def caller(k: int) -> None:
        futures = [handle.slow.remote(f"{k}-{i}", 0.0) for i in range(50)]
        if k % 2:
            lane.settle()
        results[k] = [f.result() for f in futures]

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {k: [f"{k}-{i}" for i in range(50)] for k in range(4)}
    lane.close()
