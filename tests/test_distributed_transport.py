"""`ShardedReplay` transports: ``"shared"`` batches equal ``"object"`` batches draw for draw
(windows, ids, weights, masks, probabilities, stacks, segments, memmap, both engines), torn
reads detected under both policies, refusals, `transport_stats`, deferred priority updates,
and one Ray cluster for the module (``"auto"`` resolves to ``"shared"`` on one node)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import both_engines
from ray_cluster import local_cluster

from lucid_replay import (
    Episode,
    Field,
    InvalidArgumentError,
    Mixture,
    Prioritized,
    PrioritizedSequenceReplay,
    Uniform,
    Window,
    engine,
)
from lucid_replay.distributed import ShardedReplay, gathering, sharing
from lucid_replay.distributed import transport as packing

WINDOW = Window(5, burn_in=2, bootstrap=1)
KEYS = (
    "episode_ids",
    "anchor_steps",
    "validity_mask",
    "is_init",
    "terminal",
    "record_episode_ids",
    "record_steps",
    "learning_mask",
    "step_in_sequence",
    "weights",
    "probabilities",
    "segment_ids",
)


def _episodes(seed: int, count: int, first: int = 0) -> list[Episode]:
    """Episodes whose every step says which episode it is (``mark``) and which step."""
    rng = np.random.default_rng(seed)
    episodes = []
    for i, length in enumerate(rng.integers(2, 24, count).tolist()):
        marks = torch.full((length,), float(first + i))
        frames = torch.arange(length, dtype=torch.uint8)[:, None, None].expand(length, 3, 2)
        steps = {"mark": marks, "step": torch.arange(length), "frame": frames.contiguous()}
        episodes.append(Episode(steps, terminated=bool(i % 3 == 0)))
    return episodes


def _make(transport: str, num_shards: int, **kwargs: object) -> ShardedReplay:
    options = {"seed": 5, "backend": "local", "alpha": 0.7, "beta": 0.5, **kwargs}
    return ShardedReplay.create(num_shards, 240, transport=transport, **options)


def _same(got, expected) -> None:
    for key in KEYS:
        a, b = getattr(got, key), getattr(expected, key)
        assert (a is None) == (b is None), key
        if a is not None:
            assert torch.equal(a, b), key
    assert list(got.data) == list(expected.data)
    for name in expected.data:
        assert torch.equal(got[name], expected[name]), name


def _run(transport: str, num_shards: int, window: Window, **kwargs: object) -> list:
    """Draws interleaved with adds (the ring wraps) and deferred priority updates."""
    replay = _make(transport, num_shards, **kwargs)
    try:
        batches = []
        replay.extend(_episodes(0, 30))
        for i in range(6):
            batch = replay.sample_windows(12, window)
            errors = np.random.default_rng(i).random(12) * 3
            replay.update_priorities(batch.episode_ids, errors, defer=i % 2 == 0)
            replay.extend(_episodes(10 + i, 4, first=100 + 10 * i))
            batches.append(batch)
        stream = replay.iterate(8, window, prefetch=2)
        for _ in range(3):
            batches.append(next(stream))
        stream.close()
        assert replay.transport == transport
        return batches
    finally:
        replay.close()


STACKED = {
    "mark": ((), torch.float32),
    "step": ((), torch.int64),
    "frame": Field((3, 2), torch.uint8, stack=3, stack_pad="zeros"),
}
CASES = {
    "plain": {},
    "stacks": {"schema": STACKED},
    "segments": {"segment_length": 4},
    "segment priorities": {"segment_length": 5, "priority_unit": "segment"},
    "stacked segments": {"segment_length": 3, "schema": STACKED},
    "mixture": {"selector": Mixture({Prioritized(): 0.5, Uniform(): 0.5})},
    "include reset": {},  # records of the next episodes: ids that are not the anchor's
}
WINDOWS = {
    "plain": Window(4, burn_in=3, bootstrap=1, dilation=2),
    "include reset": Window(4, burn_in=3, bootstrap=2, boundary="include_reset"),
}


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_shared_batches_equal_object_batches_draw_for_draw(case, num_shards):
    window = WINDOWS.get(case, WINDOW)
    shared = _run("shared", num_shards, window, **CASES[case])
    objects = _run("object", num_shards, window, **CASES[case])
    for got, expected in zip(shared, objects, strict=True):
        _same(got, expected)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_object_replies_in_row_pieces_merge_to_the_same_batches(num_shards, monkeypatch):
    """Fields over `PIECE_BYTES` travel as row pieces; merged they equal the shared batches."""
    real, sent = packing.in_pieces, []

    def spied(array):
        value = real(array)
        sent.append(value)
        return value

    monkeypatch.setattr(packing, "PIECE_BYTES", 40)  # a few rows of every field
    monkeypatch.setattr(packing, "in_pieces", spied)
    objects = _run("object", num_shards, WINDOW, schema=STACKED)
    assert any(isinstance(value, list) and len(value) > 2 for value in sent)
    monkeypatch.undo()
    shared = _run("shared", num_shards, WINDOW, schema=STACKED)
    for got, expected in zip(shared, objects, strict=True):
        _same(got, expected)


def test_chunk_draws_in_row_pieces_equal_the_same_draws_sent_whole(monkeypatch):
    def draws() -> list:
        replay = _make("object", 2, schema=STACKED)
        replay.extend(_episodes(0, 30))
        batches = [replay.sample(6, 3), replay.sample_prioritized(6, 4), replay.sample(5, 1)]
        replay.close()
        return batches

    whole = draws()
    monkeypatch.setattr(packing, "PIECE_BYTES", 16)
    for got, expected in zip(draws(), whole, strict=True):
        assert torch.equal(got.episode_ids, expected.episode_ids)
        assert torch.equal(got.starts, expected.starts)
        assert list(got.data) == list(expected.data)
        for name in expected.data:
            assert torch.equal(got.data[name], expected.data[name]), name


def test_row_pieces_split_only_arrays_over_the_size_and_keep_every_row():
    small = np.zeros((packing.PIECE_BYTES // 24, 6), dtype=np.float32)  # 24 bytes a row
    assert packing.in_pieces(small) is small
    big = np.zeros((packing.PIECE_BYTES // 24 * 3 + 7, 6), dtype=np.float32)
    pieces = packing.in_pieces(big)
    assert [len(p) for p in pieces] == [packing.PIECE_BYTES // 24] * 3 + [7]
    assert all(p.base is big for p in pieces)  # views: no copy before Ray's
    assert packing.nbytes(pieces) == big.nbytes
    bfloat = torch.zeros(packing.PIECE_BYTES, dtype=torch.bfloat16)
    assert packing.in_pieces(bfloat) is bfloat  # tensors travel whole


@both_engines
def test_shared_equals_object_on_every_engine():
    stacked = {"schema": STACKED}
    for got, expected in zip(
        _run("shared", 2, WINDOW, **stacked), _run("object", 2, WINDOW, **stacked), strict=True
    ):
        _same(got, expected)


@pytest.mark.parametrize("transport", ["shared", "object"])
def test_a_held_batch_keeps_its_values_and_a_dropped_ones_memory_is_reused(transport):
    """Batches are put together in reused blocks: never in one the caller holds."""
    replay = _make(transport, 2)
    replay.extend(_episodes(0, 20))
    held = []
    for _ in range(6):
        batch = replay.sample_windows(8, WINDOW)
        copies = {key: getattr(batch, key).clone() for key in ("episode_ids", "validity_mask")}
        held.append((batch, copies, {name: v.clone() for name, v in batch.data.items()}))
    for batch, copies, data in held:
        for key, value in copies.items():
            assert torch.equal(getattr(batch, key), value), key
        for name, value in data.items():
            assert torch.equal(batch[name], value), name
    keep = batch["mark"][0]  # a view holds the block too
    del held, batch
    places = []
    for _ in range(6):
        places.append(replay.sample_windows(8, WINDOW)["mark"].data_ptr())
    assert len(set(places)) <= 2 and keep.data_ptr() not in places
    replay.close()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_a_client_maps_the_shards_fields_read_only():
    """The client's mappings of every shard's field files allow reads only."""
    replay = _make("shared", 2)
    replay.extend(_episodes(0, 20))
    replay.sample_windows(8, WINDOW)
    regions = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, permissions = line.split()[:2]
        low, high = (int(end, 16) for end in span.split("-"))
        regions.append((low, high, permissions))
    checked = 0
    for mapped in replay._mapped.values():
        for name, field in mapped.ring.fields.items():
            address = field.data_ptr()
            (permissions,) = [p for low, high, p in regions if low <= address < high]
            assert permissions.startswith("r-"), (name, permissions)
            checked += 1
    assert len(replay._mapped) == 2 and checked == 6  # two shards, three fields each
    replay.close()


def test_memmap_storage_is_shared_from_its_own_files(tmp_path):
    shared = _run("shared", 2, WINDOW, storage="memmap", directory=tmp_path / "s")
    objects = _run("object", 2, WINDOW, storage="memmap", directory=tmp_path / "o")
    for got, expected in zip(shared, objects, strict=True):
        _same(got, expected)


def test_shared_memory_files_are_removed_on_close():
    replay = _make("shared", 2)
    replay.extend(_episodes(0, 4))
    replay.sample_windows(4, WINDOW)
    root = Path(replay._root)
    assert root.is_dir() and any(root.rglob("field-*"))
    replay.close()
    assert not root.exists()


def test_auto_is_shared_locally_and_object_with_codecs():
    replay = _make("auto", 2)
    assert replay.transport == "shared"
    replay.close()
    pytest.importorskip("zstandard")
    compressed = {"mark": Field((), torch.float32, codec="zstd")}
    replay = _make("auto", 2, schema=compressed)
    assert replay.transport == "object"
    replay.close()


# ------------------------------------------------------------------------- torn reads
@pytest.mark.skipif(not engine.available(), reason="needs numba")
def test_a_shared_clients_copy_stays_on_its_thread_and_equals_the_object_batch(monkeypatch):
    """With several torch threads a buffer copies on all of them (on torch's OpenMP team, or
    its large fields by ``index_select``); a client does not: torch's other threads keep
    spinning after it, on the cores its shards need."""
    listed_copies = pytest.importorskip("lucid_replay.listed_copies")
    calls: list[tuple[str, ...]] = []  # the fields each listed copy leaves to index_select
    teams: list[int | None] = []  # and the OpenMP team's threads it copies on
    real = listed_copies.copy_listed

    def spy(*args):
        calls.append(args[3][1])
        teams.append(args[-1] if len(args) > 10 else None)
        return real(*args)

    monkeypatch.setattr(listed_copies, "copy_listed", spy)
    window = Window(24, burn_in=8, bootstrap=2)  # 34 records of 256 B: index_select's size
    rng = np.random.default_rng(0)
    episodes = [Episode({"obs": torch.randn(int(n), 64)}) for n in rng.integers(40, 80, 12)]
    batches = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for transport in ("shared", "object"):
            replay = ShardedReplay.create(1, 2000, seed=1, backend="local", transport=transport)
            replay.extend(episodes)
            batches.append(replay.sample_windows(32, window))
            replay.close()
        assert calls and not any(calls) and all(team in (None, 1) for team in teams)
        buffer = PrioritizedSequenceReplay(2000, seed=1, segment_length=16)
        buffer.extend(episodes)
        buffer.sample_windows(32, window)  # a buffer's own gather of the same runs
    finally:
        torch.set_num_threads(before)
    if teams[-1] is None:  # torch without an OpenMP team
        assert calls[-1] == ("obs",)
    else:
        assert teams[-1] == 2 and calls[-1] == ()
    _same(*batches)


def _add(replay: ShardedReplay, marks: dict[int, float], seed: int, count: int, first: int):
    """Add episodes, noting each global id's mark."""
    ids = replay.extend(_episodes(seed, count, first=first))
    marks.update({episode_id: float(first + i) for i, episode_id in enumerate(ids)})


def _own_data_only(batch, marks: dict[int, float]) -> None:
    """Every valid record holds its own episode's step."""
    valid = batch.validity_mask
    ids = batch.record_episode_ids[valid].tolist()
    expected = torch.tensor([marks[i] for i in ids], dtype=torch.float32)
    assert torch.equal(batch["mark"][valid], expected)
    assert torch.equal(batch["step"][valid], batch.record_steps[valid])


@pytest.mark.parametrize("torn", ["redraw", "invalid"])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_records_overwritten_during_the_copy_are_never_valid(torn, num_shards, monkeypatch):
    replay = _make("shared", num_shards, torn=torn, segment_length=None)
    marks: dict[int, float] = {}
    _add(replay, marks, 0, 30, 0)
    rounds = []

    def overwrite(client):  # between the locations' arrival and the copy
        rounds.append(1)
        if len(rounds) == 1:  # the first draw's locations go stale: the ring wraps
            _add(client, marks, 99, 40, 1000)

    monkeypatch.setattr(gathering, "on_located", overwrite)
    batch = replay.sample_windows(16, WINDOW)
    stats = replay.transport_stats()
    assert stats["torn_reads"] > 0
    _own_data_only(batch, marks)
    if torn == "invalid":
        assert stats["windows_invalidated"] == stats["torn_reads"] > 0
        assert not bool(batch.validity_mask.all())
        assert len(rounds) == 1
    else:
        assert stats["windows_redrawn"] == stats["torn_reads"] and len(rounds) == 1
        assert stats["windows_invalidated"] == 0
        assert bool(batch.validity_mask.any(dim=1).all())  # redrawn windows are whole
        assert set(batch.episode_ids.tolist()) <= set(marks)
    replay.close()


def test_evicted_records_not_yet_overwritten_are_their_own_episodes(monkeypatch):
    replay = _make("shared", 1)
    marks: dict[int, float] = {}
    _add(replay, marks, 0, 12, 0)

    def evict(client):  # evicts stored episodes; their slots are not written again
        stored = client._shards[0].target.buffer._core.store
        stored.evict(stored.table.num_episodes - 1)

    monkeypatch.setattr(gathering, "on_located", evict)
    batch = replay.sample_windows(8, WINDOW, prioritized=False)
    assert replay.transport_stats()["torn_reads"] == 0
    assert bool(batch.validity_mask.any(dim=1).all())
    _own_data_only(batch, marks)
    replay.close()


# -------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"transport": "zero-copy"}, "transport"),
        ({"transport": True}, "transport"),
        ({"torn": "ignore"}, "torn"),
        (
            {"transport": "shared", "schema": {"x": Field((), torch.float32, codec="zstd")}},
            "transport",
        ),
    ],
)
def test_refused_transport_options_start_nothing(options, match, tmp_path, monkeypatch):
    if "schema" in options:
        pytest.importorskip("zstandard")
    # Shared roots under tmp_path: other tests (other workers) use /dev/shm meanwhile.
    monkeypatch.setattr(sharing, "shared_root", lambda replay: str(tmp_path / f"r-{replay}"))
    with pytest.raises(InvalidArgumentError, match=match):
        ShardedReplay.create(2, 100, backend="local", **options)
    assert not os.listdir(tmp_path)


def test_refused_deferred_update_queues_nothing():
    replay = _make("shared", 2)
    ids = replay.extend(_episodes(0, 4))
    with pytest.raises(InvalidArgumentError, match="errors"):
        replay.update_priorities(ids, [1.0, float("nan"), 1.0, 1.0], defer=True)
    with pytest.raises(InvalidArgumentError, match="indices"):
        replay.update_priorities([10**12], [1.0], defer=True)
    assert not any(replay._state.deferred)
    with pytest.raises(TypeError, match="defer"):
        replay.update_priorities(ids, [1.0] * 4, defer=1)
    replay.close()


def test_transport_is_saved_and_loaded(tmp_path):
    replay = _make("object", 2, torn="invalid")
    replay.extend(_episodes(0, 6))
    replay.update_priorities(replay.sample_windows(4, WINDOW).episode_ids, [2.0] * 4, defer=True)
    replay.save(tmp_path / "saved")  # flushes the deferred update first
    assert not any(replay._state.deferred)
    expected = replay.sample_windows(6, WINDOW)
    loaded = ShardedReplay.load(tmp_path / "saved")
    assert loaded._config["transport"] == "object" and loaded._config["torn"] == "invalid"
    _same(loaded.sample_windows(6, WINDOW), expected)
    replay.close()
    loaded.close()


# ------------------------------------------------------------------- stats, updates
STATS_KEYS = {
    "transport",
    "batches",
    "bytes_copied",
    "bytes_copied_last",
    "bytes_copied_mean",
    "batch_bytes_last",
    "copy_ratio_last",
    "draw_seconds",
    "draw_seconds_last",
    "draw_seconds_mean",
    "gather_seconds",
    "gather_seconds_last",
    "gather_seconds_mean",
    "torn_reads",
    "torn_reads_last",
    "windows_redrawn",
    "windows_invalidated",
    "updates_ridden",
}


def test_a_located_replys_masks_travel_as_bits_and_come_back_exactly():
    """The per-record masks cross as bits (an eighth of their bytes), ids and steps as
    their exceptions to the window's pattern; `uncompact` restores every entry exactly,
    also for a batch whose records do not fill the last byte."""
    window = Window(3, burn_in=2, dilation=2)  # 5 records a window, 35 in all
    rng = np.random.default_rng(3)
    anchors, steps = rng.integers(0, 50, 7), rng.integers(0, 30, 7)
    meta = {
        "validity_mask": rng.random((7, 5)) < 0.8,
        "is_init": rng.random((7, 5)) < 0.2,
        "terminal": rng.random((7, 5)) < 0.2,
        "record_episode_ids": np.repeat(anchors[:, None], 5, axis=1),
        "record_steps": steps[:, None] + (np.arange(5) - 2) * 2,
        "episode_ids": anchors,
        "anchor_steps": steps,
    }
    meta["record_episode_ids"][2, 4] = 99  # a record of another episode
    meta["record_steps"][6, 0] = -1  # clamped
    expected = {key: value.copy() for key, value in meta.items()}
    sharing.compact(meta, window)
    assert not any(isinstance(v, np.ndarray) and v.dtype == bool for v in meta.values())
    for key in ("validity_mask", "is_init", "terminal"):
        bits, shape = meta[f"{key}.bits"]
        assert bits.dtype == np.uint8 and bits.nbytes == 5 and shape == (7, 5)  # 35 bits
    assert meta["record_episode_ids.odd"][0].tolist() == [14]
    assert meta["record_episode_ids.odd"][1].tolist() == [99]
    assert meta["record_steps.odd"][0].tolist() == [30]
    sharing.uncompact(meta, window)
    assert meta.keys() == expected.keys()
    for key, value in expected.items():
        assert meta[key].dtype == value.dtype and np.array_equal(meta[key], value), key


@pytest.mark.parametrize("transport", ["shared", "object"])
def test_transport_stats_keys_and_bytes(transport):
    replay = _make(transport, 3)
    replay.extend(_episodes(0, 20))
    for _ in range(3):
        batch = replay.sample_windows(16, WINDOW)
        replay.update_priorities(batch.episode_ids, [1.0] * 16, defer=True)
    stats = replay.transport_stats()
    assert set(stats) == STATS_KEYS
    assert stats["transport"] == transport and stats["batches"] == 3
    assert stats["updates_ridden"] >= 2
    size = sum(t.numel() * t.element_size() for t in batch.data.values())
    size += sum(
        getattr(batch, k).numel() * getattr(batch, k).element_size()
        for k in KEYS
        if getattr(batch, k) is not None
    )
    assert stats["batch_bytes_last"] == size
    ratio = stats["copy_ratio_last"]
    assert (ratio <= 1.1) if transport == "shared" else (ratio > 1.5)
    replay.close()


def test_a_client_dropped_without_close_removes_its_shared_files():
    """They live in memory (/dev/shm) until removed: no replay may leave them behind."""
    roots = []
    for closed in (True, False):
        replay = _make("shared", 2)
        replay.extend(_episodes(0, 6))
        replay.sample_windows(4, WINDOW)
        root = replay._root
        assert root is not None and Path(root, "shard_1").is_dir()
        roots.append(root)
        if closed:
            replay.close()
            assert not Path(root).exists()
        del replay
        gc.collect()
        assert not Path(root).exists()
    assert roots[0] != roots[1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_dropping_its_copy_of_the_client_leaves_the_parents_files():
    replay = _make("shared", 2)
    replay.extend(_episodes(0, 6))
    root = Path(str(replay._root))
    child = os.fork()
    if child == 0:  # the child drops the client it inherited, then exits
        code = 1
        try:
            del replay
            gc.collect()
            code = 0 if root.is_dir() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert root.is_dir()
    assert replay.sample_windows(4, WINDOW).data["mark"].shape == (4, WINDOW.size)
    replay.close()
    assert not root.exists()


def test_deferred_updates_equal_immediate_updates():
    results = []
    for defer in (False, True):
        replay = _make("shared", 2)
        replay.extend(_episodes(0, 20))
        drawn = []
        for i in range(4):
            batch = replay.sample_windows(8, WINDOW)
            replay.update_priorities(batch.episode_ids, np.arange(8.0) + i, defer=defer)
            drawn.append(batch)
        results.append((drawn, replay.stats()["shards"]))
        replay.close()
    for got, expected in zip(results[0][0], results[1][0], strict=True):
        _same(got, expected)
    assert [s["max_priority"] for s in results[0][1]] == [s["max_priority"] for s in results[1][1]]


# ------------------------------------------------------------------------------- Ray
ray = pytest.importorskip("ray", reason='needs Ray: pip install "lucid-replay[distributed]"')


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for this module, on 127.0.0.1 only; always shut down."""
    with local_cluster():
        yield


@pytest.mark.ray
def test_ray_auto_is_shared_on_one_node_and_equals_object(cluster):
    batches = {}
    for transport in ("auto", "object"):
        replay = _make(transport, 2, backend="ray")
        replay.extend(_episodes(0, 20))
        batches[transport] = [replay.sample_windows(8, WINDOW) for _ in range(3)]
        stats = replay.transport_stats()
        assert stats["transport"] == ("shared" if transport == "auto" else "object")
        replay.close()
    for got, expected in zip(batches["auto"], batches["object"], strict=True):
        _same(got, expected)
