"""Compressed fields (``Field(codec=...)``): batches bit-identical to an uncompressed buffer's.

Every test drives two buffers through the same calls, one with raw fields and one with the
same fields compressed, and compares what they return: draws, batches, stored episodes,
checkpoints. The caches are kept small so that blocks are decoded again and again.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
from codec_twins import WINDOWS, codec_schema, data, episodes, same, stream_into_both, twins

from lucid_replay import (
    Episode,
    Field,
    SequenceReplay,
    Window,
    blocks,
    host_threads,
)

pytest.importorskip("zstandard")
pytest.importorskip("lz4")


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
@pytest.mark.parametrize("cache_bytes", [0, 1000, 1 << 20])
def test_whole_episodes_draw_the_same_batches(index_engine, codec, cache_bytes) -> None:
    plain, packed = twins(codec, cache_bytes=cache_bytes)
    for episode in episodes(0, [17, 40, 33, 80, 9, 60, 71]):  # wraps, evicts
        assert plain.add(episode) == packed.add(episode)
    for _ in range(3):
        for window in WINDOWS:
            same(data(plain.sample_windows(16, window)), data(packed.sample_windows(16, window)))
        same(data(plain.sample(8, 5)), data(packed.sample(8, 5)))
        same(data(plain.sample_prioritized(8, 4)), data(packed.sample_prioritized(8, 4)))
        for episode in episodes(1, [13]):
            plain.add(episode)
            packed.add(episode)
    for episode_id in plain.episode_ids:
        same(dict(plain[episode_id].steps), dict(packed[episode_id].steps))
    assert packed.memory_report()["total"]["cache_bytes"] <= cache_bytes


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
@pytest.mark.parametrize("threads", [2, 3])
def test_gathers_split_over_threads_draw_the_same_batches(monkeypatch, codec, threads) -> None:
    """Decodes and copies spread over torch's threads (every block and row its own part
    here, iterate's prefetch thread included) give the one-thread batches bit for bit."""
    monkeypatch.setattr(blocks, "_SPLIT_BYTES", 1)
    monkeypatch.setattr(blocks, "_SPLIT_BLOCKS", 1)
    monkeypatch.setattr(host_threads, "workers", lambda: threads)
    split = []
    real = host_threads.run_split
    monkeypatch.setattr(
        host_threads, "run_split", lambda work, parts: split.append(len(parts)) or real(work, parts)
    )
    plain, packed = twins(codec, cache_bytes=1000)
    for episode in episodes(2, [17, 40, 33, 80, 9, 60, 71]):
        plain.add(episode)
        packed.add(episode)
    for window in WINDOWS:
        same(data(plain.sample_windows(16, window)), data(packed.sample_windows(16, window)))
    raw, compressed = (
        plain.iterate(8, WINDOWS[0], prefetch=2),
        packed.iterate(8, WINDOWS[0], prefetch=2),
    )
    for _ in range(3):
        same(data(next(raw)), data(next(compressed)))
    raw.close()
    compressed.close()
    assert max(split) == threads  # the split path ran


def test_split_work_keeps_order_and_raises_after_every_part_finished(monkeypatch) -> None:
    monkeypatch.setattr(host_threads, "workers", lambda: 2)
    finished = []

    def work(part: int) -> int:
        if part == 1:
            raise RuntimeError("part 1 failed")
        finished.append(part)
        return part * 10

    assert host_threads.run_split(lambda part: part * 10, [3, 1, 2]) == [30, 10, 20]
    with pytest.raises(RuntimeError, match="part 1 failed"):
        host_threads.run_split(work, [0, 1, 2, 3])
    assert sorted(finished) == [0, 2, 3]
    assert host_threads.chunks(10, 4) == [(0, 5), (5, 10)]
    assert host_threads.chunks(3, 4) == [(0, 3)]  # too little for two threads


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_splits_work_on_its_own_pool(monkeypatch) -> None:
    """The child has none of the parent's pool threads: it must not wait on them."""
    monkeypatch.setattr(host_threads, "workers", lambda: 2)
    assert host_threads.run_split(lambda part: part, [1, 2]) == [1, 2]  # the parent's pool
    child = multiprocessing.get_context("fork").Process(target=_split_in_child)
    child.start()
    child.join(60)
    if child.is_alive():  # waiting on the parent's threads, which the child does not have
        child.kill()
    assert child.exitcode == 0


def _split_in_child() -> None:
    os._exit(0 if host_threads.run_split(lambda part: part + 1, [1, 2]) == [2, 3] else 1)


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_segmented_streams_draw_the_same_batches(index_engine, codec) -> None:
    plain, packed = twins(codec, segment_length=7)
    stream_into_both(plain, packed)
    for episode_id in plain.episode_ids:
        same(dict(plain[episode_id].steps), dict(packed[episode_id].steps))


@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_out_iterate_gather_windows_and_write_back(tmp_path, index_engine, storage) -> None:
    where = {"storage": "memmap", "directory": tmp_path / "d"} if storage == "memmap" else {}
    plain, packed = twins("zstd", **where)
    for episode in episodes(2, [30, 50, 70, 40]):
        plain.add(episode)
        packed.add(episode)
    window = WINDOWS[0]
    first, second = plain.sample_windows(8, window), packed.sample_windows(8, window)
    same(
        data(plain.sample_windows(8, window, out=first)),
        data(packed.sample_windows(8, window, out=second)),
    )
    ids = torch.tensor(list(plain.episode_ids)[:3])
    steps = torch.tensor([0, 5, 9])
    same(
        data(plain.gather_windows(ids, steps, window)),
        data(packed.gather_windows(ids, steps, window)),
    )
    values = torch.randn(first.record_steps.shape)
    assert plain.write_back(first, "reward", values) == packed.write_back(second, "reward", values)
    for episode_id in plain.episode_ids:
        same(dict(plain[episode_id].steps), dict(packed[episode_id].steps))
    with (
        plain.iterate(4, window, prefetch=2) as one,
        packed.iterate(4, window, prefetch=2) as other,
    ):
        for _ in range(3):
            same(data(next(one)), data(next(other)))


def test_checkpoints_round_trip(tmp_path) -> None:
    plain, packed = twins("lz4", kind=SequenceReplay)
    for episode in episodes(3, [30, 90, 60, 45]):
        plain.add(episode)
        packed.add(episode)
    packed.save(tmp_path / "packed.ckpt")
    loaded = SequenceReplay.load(tmp_path / "packed.ckpt")
    assert loaded.schema == packed.schema
    for window in WINDOWS:
        same(data(plain.sample_windows(10, window)), data(loaded.sample_windows(10, window)))
    twin = SequenceReplay(200, schema=codec_schema("lz4"), cache_bytes=0)
    twin.load_state_dict(packed.state_dict())  # the state holds the decoded steps
    same(data(twin.sample(4, 6)), data(packed.sample(4, 6)))


def test_compressible_frames_shrink_and_the_cache_stays_bounded() -> None:
    frames = torch.zeros(400, 84, 84, dtype=torch.uint8)
    frames[:, 10:20, 10:20] = torch.arange(400, dtype=torch.uint8)[:, None, None]
    schema = {"obs": Field((84, 84), torch.uint8, stack=4, codec="zstd")}
    buffer = SequenceReplay(1000, schema=schema, cache_bytes=2 << 20, seed=0)
    buffer.add(Episode({"obs": frames}))
    report = buffer.memory_report()["fields"]["obs"]
    assert report["raw_bytes"] == 400 * 84 * 84
    assert report["stored_bytes"] * 10 < report["raw_bytes"]
    buffer.sample_windows(64, Window(20))
    assert 0 < buffer.memory_report()["fields"]["obs"]["cache_bytes"] <= 2 << 20


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"codec": "gzip"}, ValueError, "codec"),
        ({"codec": 1}, ValueError, "codec"),
    ],
)
def test_field_refuses_bad_codecs(arguments, error, match) -> None:
    with pytest.raises(error, match=match):
        Field((2,), torch.uint8, **arguments)


def test_buffers_refuse_what_compressed_fields_cannot_use() -> None:
    schema = codec_schema("zstd")
    for bad in (-1, True, 1.5):
        with pytest.raises((ValueError, TypeError), match="cache_bytes"):
            SequenceReplay(10, schema=schema, cache_bytes=bad)


def test_a_missing_codec_library_names_the_extra(monkeypatch) -> None:
    import importlib

    real = importlib.import_module

    def without_lz4(name: str, *args: object):
        if name.startswith("lz4"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_lz4)
    with pytest.raises(ImportError, match=r"lucid-replay\[compress\]"):
        Field((2,), torch.uint8, codec="lz4")
