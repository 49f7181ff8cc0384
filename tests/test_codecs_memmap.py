"""Compressed fields in files (``Field(codec=...)`` with ``storage="memmap"``).

Twins again: a buffer of raw fields in memory and the same buffer with its fields compressed
into files under a directory draw the same batches, call for call. A reopened directory is
compared with an in-memory buffer loaded from the state the memmap buffer had at its sync.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from codec_twins import WINDOWS, codec_schema, data, episodes, same, stream_into_both, twins
from conftest import assert_batches_equal, comparable
from hypothesis import given, settings
from hypothesis import strategies as st

from lucid_replay import (
    CheckpointError,
    Episode,
    Field,
    PrioritizedSequenceReplay,
    SequenceReplay,
    Window,
    block_files,
)
from lucid_replay.block_files import BlockCache, MappedFrames
from lucid_replay.blocks import BLOCK_STEPS, BlockField

pytest.importorskip("zstandard")
pytest.importorskip("lz4")

LENGTHS = [17, 40, 33, 80, 9, 60, 71]  # 310 steps: a ring of 200 wraps and evicts


def _twins(codec: str, directory: Path, kind=PrioritizedSequenceReplay, **kwargs):
    """Raw fields in memory, and the same fields compressed into files under ``directory``."""
    return twins(codec, kind, storage="memmap", directory=directory, **kwargs)


def _stored(buffer: SequenceReplay) -> dict[int, object]:
    return {i: comparable(dict(buffer[i].steps)) for i in buffer.episode_ids}


def _reference(buffer: SequenceReplay, path: Path) -> SequenceReplay:
    """An in-memory buffer in ``buffer``'s state now (its fields compressed in memory)."""
    buffer.save(path)
    return type(buffer).load(path)


def _frames(buffer: SequenceReplay, name: str = "obs"):
    compressed = buffer._core.store.ring.compressed
    assert compressed is not None
    return compressed.fields[name].frames


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_twins_draw_the_same_batches(tmp_path, index_engine, codec) -> None:
    plain, mapped = _twins(codec, tmp_path / "d")
    for episode in episodes(0, LENGTHS):
        assert plain.add(episode) == mapped.add(episode)
    assert isinstance(_frames(mapped), MappedFrames)  # in files, not in memory
    names = sorted(p.suffix for p in (tmp_path / "d").iterdir() if p.name.startswith("field-"))
    assert names == [".bin", ".blocks", ".blocks", ".index", ".index"]
    for round_ in range(3):
        for window in WINDOWS:
            same(data(plain.sample_windows(16, window)), data(mapped.sample_windows(16, window)))
        same(data(plain.sample(8, 5)), data(mapped.sample(8, 5)))
        same(data(plain.sample_prioritized(8, 4)), data(mapped.sample_prioritized(8, 4)))
        drawn = plain.sample_windows(6, WINDOWS[0])
        assert torch.equal(drawn.episode_ids, mapped.sample_windows(6, WINDOWS[0]).episode_ids)
        errors = torch.rand(drawn.episode_ids.shape, generator=torch.Generator().manual_seed(9))
        plain.update_priorities(drawn.episode_ids, errors)
        mapped.update_priorities(drawn.episode_ids, errors)
        for episode in episodes(round_ + 1, [13]):
            plain.add(episode)
            mapped.add(episode)
    for episode_id in plain.episode_ids:
        same(dict(plain[episode_id].steps), dict(mapped[episode_id].steps))
    assert mapped.memory_report()["total"]["cache_bytes"] <= 1000


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_segmented_streams_draw_the_same_batches_and_reopen(tmp_path, codec) -> None:
    plain, mapped = _twins(codec, tmp_path / "d", kind=SequenceReplay, segment_length=7)
    stream_into_both(plain, mapped)
    assert _stored(plain) == _stored(mapped)
    mapped.sync()
    reference = _reference(mapped, tmp_path / "at_sync")
    reopened = SequenceReplay.open(tmp_path / "d")
    assert reopened.open_episode_ids == reference.open_episode_ids
    assert _stored(reopened) == _stored(reference)
    episode = reopened.open_episode_ids[0]
    for twin in (reopened, reference):
        stream = twin.resume_episode(episode)
        stream.append(dict(episodes(99, [9])[0].steps))
        stream.close(terminated=False)
    assert _stored(reopened) == _stored(reference)
    same(data(reopened.sample_windows(8, Window(5))), data(reference.sample_windows(8, Window(5))))


@pytest.mark.parametrize("kind", [SequenceReplay, PrioritizedSequenceReplay])
@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_open_returns_the_synced_buffer_draw_for_draw(tmp_path, kind, codec) -> None:
    _, buffer = _twins(codec, tmp_path / "d", kind=kind)
    for episode in episodes(3, LENGTHS):  # the ring has wrapped
        buffer.add(episode)
    buffer.sample_windows(3, WINDOWS[0])
    buffer.sync()
    reference = _reference(buffer, tmp_path / "at_sync")
    buffer.sample_windows(3, WINDOWS[0])  # later draws are gone too
    for episode in episodes(4, [5, 30]):  # the head block rewritten, then others
        buffer.add(episode)
    reopened = kind.open(tmp_path / "d")
    assert type(reopened) is kind and reopened.episode_ids == reference.episode_ids
    assert _stored(reopened) == _stored(reference)
    assert reopened.stats() == reference.stats()
    for window in WINDOWS:
        same(data(reopened.sample_windows(9, window)), data(reference.sample_windows(9, window)))
    for got, expected in zip(drive_pixels(reopened), drive_pixels(reference), strict=True):
        assert_batches_equal(got, expected)


def drive_pixels(buffer: SequenceReplay) -> list:
    """A fixed sequence of draws and adds (as `conftest.drive`, with this schema's steps)."""
    batches = []
    for round_ in range(3):
        batches.append(buffer.sample(5, 2))
        buffer.add(episodes(50 + round_, [4 + round_])[0])
        batches.append(buffer.sample(4, 1))
    return batches


def test_overwritten_synced_episodes_are_evicted_on_open(tmp_path) -> None:
    _, buffer = _twins("zstd", tmp_path / "d", kind=SequenceReplay)
    for episode in episodes(5, [40, 80, 60]):  # offsets 0-39, 40-119, 120-179
        buffer.add(episode)
    buffer.sync()
    expected = _stored(buffer)
    buffer.add(episodes(6, [90])[0])  # offsets 180-269: slots of offsets 0-69 rewritten
    reopened = SequenceReplay.open(tmp_path / "d")
    assert list(reopened.episode_ids) == [2]  # 0 and 1 had steps overwritten
    assert _stored(reopened) == {2: expected[2]}
    stats = reopened.stats()
    assert stats["episodes_evicted"] == 2 and stats["transitions_evicted"] == 120
    reopened.add(episodes(7, [5])[0])  # opened again without a sync: the same record holds
    del reopened
    assert list(SequenceReplay.open(tmp_path / "d").episode_ids) == [2]


def test_write_back_after_a_sync_reaches_the_files_as_a_raw_field_does(tmp_path) -> None:
    """A raw memmap field is written back in its file; a compressed one in its blocks, the
    one being written (raw, in memory) included: both reopen with the values written back."""
    raw = SequenceReplay(
        200, seed=1, schema=codec_schema(None), storage="memmap", directory=tmp_path / "r"
    )
    _, mapped = _twins("lz4", tmp_path / "z", kind=SequenceReplay)
    for episode in episodes(8, [30, 50, 41]):  # the last block is being written
        raw.add(episode)
        mapped.add(episode)
    raw.sync()
    mapped.sync()
    window = Window(6, boundary="stop", allow_partial=True)
    ids, steps = torch.tensor([0, 1, 2]), torch.tensor([2, 30, 40])  # 2, 40: the head block
    first, second = (
        raw.gather_windows(ids, steps, window),
        mapped.gather_windows(ids, steps, window),
    )
    values = torch.randn(first.record_steps.shape)
    assert raw.write_back(first, "reward", values) == mapped.write_back(second, "reward", values)
    expected = _stored(raw)
    assert _stored(SequenceReplay.open(tmp_path / "r")) == expected
    assert _stored(SequenceReplay.open(tmp_path / "z")) == expected


def test_a_crash_while_a_block_is_rewritten_keeps_its_synced_steps(tmp_path, monkeypatch) -> None:
    """The block holding the synced head is compressed again once the writes move past it:
    a write that dies half-way through its new frame leaves the synced frame in use."""
    _, buffer = _twins("zstd", tmp_path / "d", kind=SequenceReplay)
    for episode in episodes(9, [30, 45]):  # block 2 (slots 64-95) holds synced steps 64-74
        buffer.add(episode)
    buffer.sync()
    expected = _stored(buffer)
    real = os.pwrite

    def dies_half_way(descriptor: int, data: bytes, offset: int) -> int:
        real(descriptor, data[: len(data) // 2], offset)
        raise OSError("killed")

    monkeypatch.setattr(block_files.os, "pwrite", dies_half_way)
    with pytest.raises(OSError, match="killed"):
        buffer.add(episodes(10, [40])[0])  # moves the head past block 2
    monkeypatch.setattr(block_files.os, "pwrite", real)
    assert _stored(SequenceReplay.open(tmp_path / "d")) == expected


def _synced(directory: Path) -> SequenceReplay:
    _, buffer = _twins("zstd", directory, kind=SequenceReplay)
    for episode in episodes(11, [30, 50, 41]):
        buffer.add(episode)
    buffer.sync()
    return buffer


def _index(directory: Path) -> Path:
    return next(p for p in directory.iterdir() if p.suffix == ".index")


def _truncate_index(directory: Path) -> None:
    os.truncate(_index(directory), _index(directory).stat().st_size - 8)


def _truncate_blocks(directory: Path) -> None:
    blocks = next(p for p in directory.iterdir() if p.suffix == ".blocks")
    os.truncate(blocks, blocks.stat().st_size - 1)


def _entry(value: list[int], block: int = 1):
    def craft(directory: Path) -> None:
        index = np.fromfile(_index(directory), dtype=np.int64).reshape(-1, 5)
        index[block] = value
        index.tofile(_index(directory))

    return craft


def _flip_a_frame_byte(directory: Path) -> None:
    """Flip a byte inside block 1's frame in use, of one field (its index and blocks)."""
    blocks = next(p for p in directory.iterdir() if p.suffix == ".blocks")
    index = np.fromfile(blocks.with_suffix(".index"), dtype=np.int64).reshape(-1, 5)
    use, length = int(index[1, 0]), int(index[1, 2 * index[1, 0] - 1])
    slot = blocks.stat().st_size // (2 * index.shape[0])
    with open(blocks, "r+b") as file:
        file.seek((2 + use - 1) * slot + length // 2)
        byte = file.read(1)[0]
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte ^ 0xFF]))


def _remove_blocks(directory: Path) -> None:
    next(p for p in directory.iterdir() if p.suffix == ".blocks").unlink()


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_truncate_index, "bytes"),
        (_truncate_blocks, "bytes"),
        (_remove_blocks, "must exist"),
        (_entry([3, 0, 0, 0, 0]), "valid frame entries"),
        (_entry([1, 10**9, 0, 0, 0]), "valid frame entries"),
        (_entry([2, 0, 0, -4, 0]), "valid frame entries"),
        (_entry([1, 10, 1 << 33, 0, 0]), "valid frame entries"),
        (_entry([0, 0, 0, 0, 0]), "every stored block"),
    ],
)
def test_open_refuses_damaged_compressed_files_and_creates_nothing(tmp_path, damage, match) -> None:
    _synced(tmp_path / "d")
    damage(tmp_path / "d")
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "d").iterdir())
    with pytest.raises(CheckpointError, match=match):
        SequenceReplay.open(tmp_path / "d")
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "d").iterdir()) == before


def test_a_frame_whose_bytes_changed_is_refused_when_read(tmp_path) -> None:
    """Frames are checked against their CRC as they are read (`open` reads no data)."""
    _synced(tmp_path / "d")
    _flip_a_frame_byte(tmp_path / "d")
    reopened = SequenceReplay.open(tmp_path / "d")
    with pytest.raises(CheckpointError, match="checksum"):
        reopened[1]  # episode 1 (steps 30-79) lies in block 1


def test_memory_report_counts_the_frames_and_disk_holds_only_them(tmp_path) -> None:
    frames = torch.zeros(600, 84, 84, dtype=torch.uint8)
    frames[:, 10:20, 10:20] = torch.arange(600, dtype=torch.uint8)[:, None, None]
    schema = {"obs": Field((84, 84), torch.uint8, stack=4, codec="zstd")}
    memory = SequenceReplay(1000, schema=schema, cache_bytes=2 << 20, seed=0)
    mapped = SequenceReplay(
        1000, schema=schema, cache_bytes=2 << 20, seed=0, storage="memmap", directory=tmp_path / "d"
    )
    for buffer in (memory, mapped):
        buffer.add(Episode({"obs": frames[:500]}))
        buffer.add(Episode({"obs": frames[500:]}))
        buffer.sample_windows(64, Window(20))
    report, expected = mapped.memory_report(), memory.memory_report()
    assert report == expected  # the same frames, in files
    obs = report["fields"]["obs"]
    assert obs["raw_bytes"] == 600 * 84 * 84 and obs["stored_bytes"] * 10 < obs["raw_bytes"]
    mapped.sync()  # writes the head block's frame: the report is what holds the steps, still
    assert mapped.memory_report() == report
    blocks = next(p for p in (tmp_path / "d").iterdir() if p.suffix == ".blocks")
    slot = -(-32 * 84 * 84 // os.sysconf("SC_PAGE_SIZE")) * os.sysconf("SC_PAGE_SIZE")
    assert blocks.stat().st_size == 2 * 32 * slot  # 32 blocks of 32 steps, two slots each
    disk = blocks.stat().st_blocks * 512
    assert disk <= obs["stored_bytes"] + 20 * 2 * os.sysconf("SC_PAGE_SIZE")  # sparse


def test_anonymous_memory_stays_the_table_and_the_cache(tmp_path) -> None:
    """Incompressible frames (kept raw, in the file) add no anonymous resident memory."""
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs /proc")

    def anonymous() -> int:
        line = next(x for x in status.read_text().splitlines() if x.startswith("RssAnon"))
        return int(line.split()[1]) * 1024

    schema = {"obs": Field((256, 256), torch.uint8, codec="lz4")}
    buffer = SequenceReplay(
        1024, schema=schema, cache_bytes=1 << 20, storage="memmap", directory=tmp_path / "d"
    )
    generator = torch.Generator().manual_seed(0)
    piece = torch.randint(0, 256, (64, 256, 256), dtype=torch.uint8, generator=generator)
    buffer.add(Episode({"obs": piece}))
    before = anonymous()
    for _ in range(15):  # 60 MiB more
        buffer.add(Episode({"obs": piece}))
    assert anonymous() - before < 16 << 20
    assert buffer.memory_report()["fields"]["obs"]["stored_bytes"] >= 60 << 20


def test_sharded_replays_keep_each_shards_blocks_in_its_directory(tmp_path) -> None:
    from lucid_replay.distributed import ShardedReplay

    options = {"seed": 3, "cache_bytes": 4096}
    mapped = ShardedReplay.create(
        2,
        400,
        backend="local",
        schema=codec_schema("zstd"),
        storage="memmap",
        directory=tmp_path / "m",
        **options,
    )
    memory = ShardedReplay.create(2, 400, backend="local", schema=codec_schema(None), **options)
    try:
        stored = episodes(12, [20, 33, 41, 17, 60])
        assert mapped.extend(stored) == memory.extend(stored)
        for shard in ("shard_0", "shard_1"):
            suffixes = {p.suffix for p in (tmp_path / "m" / shard).iterdir()}
            assert {".blocks", ".index", ".bin"} <= suffixes
        for window in WINDOWS[:2]:
            a, b = mapped.sample_windows(16, window), memory.sample_windows(16, window)
            assert torch.equal(a.episode_ids, b.episode_ids)
            same({k: a[k] for k in ("obs", "reward")}, {k: b[k] for k in ("obs", "reward")})
    finally:
        mapped.close()
        memory.close()


def test_tensordict_episodes_and_batches(tmp_path) -> None:
    tensordict = pytest.importorskip("tensordict")
    plain, mapped = _twins("lz4", tmp_path / "d", kind=SequenceReplay)
    for episode in episodes(13, [25, 40]):
        steps = tensordict.TensorDict(dict(episode.steps), batch_size=[episode["action"].shape[0]])
        plain.add(Episode.from_tensordict(steps, terminated=True))
        mapped.add(Episode.from_tensordict(steps, terminated=True))
    first = plain.sample_windows(6, WINDOWS[0]).to_tensordict()
    second = mapped.sample_windows(6, WINDOWS[0]).to_tensordict()
    assert (first == second).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cache_bytes": -1}, "cache_bytes"),
        ({"cache_bytes": True}, "cache_bytes"),
        ({"directory": None}, "directory"),
        ({"storage": "disk"}, "storage"),
    ],
)
def test_refusals_name_the_argument_and_claim_nothing(tmp_path, kwargs, match) -> None:
    arguments = {"storage": "memmap", "directory": tmp_path / "d", **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        SequenceReplay(10, schema=codec_schema("zstd"), **arguments)
    assert list(tmp_path.iterdir()) == []


def test_a_taken_directory_is_refused_and_left_as_it_was(tmp_path) -> None:
    _synced(tmp_path / "d")
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "d").iterdir())
    with pytest.raises(ValueError, match="directory must be a new or empty directory"):
        _twins("zstd", tmp_path / "d")
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "d").iterdir()) == before


def test_save_and_load_state_dict_compose_with_sync(tmp_path) -> None:
    plain, mapped = _twins("zstd", tmp_path / "d", kind=SequenceReplay)
    for episode in episodes(14, LENGTHS):
        plain.add(episode)
        mapped.add(episode)
    mapped.save(tmp_path / "file.ckpt")
    loaded = SequenceReplay.load(tmp_path / "file.ckpt")  # a self-contained in-memory copy
    assert _stored(loaded) == _stored(plain)
    other = SequenceReplay(
        200, seed=1, schema=codec_schema("zstd"), storage="memmap", directory=tmp_path / "e"
    )
    other.add(episodes(15, [3])[0])
    other.load_state_dict(mapped.state_dict())  # into new files
    other.sync()
    assert _stored(SequenceReplay.open(tmp_path / "e")) == _stored(plain)
    suffixes = sorted(p.suffix for p in (tmp_path / "e").iterdir() if p.name.startswith("field-"))
    assert suffixes == [".bin", ".blocks", ".blocks", ".index", ".index"]  # old ones removed


def test_compressed_fields_still_need_the_cpu() -> None:
    from lucid_replay.blocks import checked_cache

    with pytest.raises(ValueError, match="device must be 'cpu' with compressed fields"):
        checked_cache(0, {"obs": "zstd"}, torch.device("cuda"))
    assert checked_cache(0, {}, torch.device("cuda")) == 0


@settings(max_examples=40, deadline=None)
@given(
    codec=st.sampled_from(["zstd", "lz4"]),
    capacity=st.integers(1, 3 * BLOCK_STEPS + 5),
    step_bytes=st.integers(1, 9),
    calls=st.lists(
        st.tuples(st.sampled_from(["write", "scatter", "persist"]), st.integers(1, 70)),
        max_size=20,
    ),
    seed=st.integers(0, 2**31),
)
def test_a_field_in_files_reopens_with_every_byte(codec, capacity, step_bytes, calls, seed):
    """Writes in slot order, scatters and persists into files; a second field over the same
    files (as `open` builds one) reads every slot as written, after a persist."""
    rng = np.random.default_rng(seed)
    sizes = np.full(-(-capacity // BLOCK_STEPS), BLOCK_STEPS) * step_bytes
    sizes[-1] = (capacity - (sizes.shape[0] - 1) * BLOCK_STEPS) * step_bytes
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "field-x.blocks"
        frames = MappedFrames(path, sizes, create=True)
        field = BlockField(capacity, step_bytes, codec, BlockCache(0), 0, frames)
        reference = np.zeros((capacity, step_bytes), dtype=np.uint8)
        head = 0
        for call, size in calls:
            if call == "write":
                raw = rng.integers(0, 3, (min(size, capacity), step_bytes)).astype(np.uint8)
                first = min(raw.shape[0], capacity - head)
                field.write(head, raw[:first])
                field.write(0, raw[first:])  # nothing where it does not wrap
                reference[head : head + first] = raw[:first]
                reference[: raw.shape[0] - first] = raw[first:]
                head = (head + raw.shape[0]) % capacity
            elif call == "scatter":
                slots = rng.permutation(capacity)[: min(size, capacity)].astype(np.int64)
                raw = rng.integers(0, 256, (slots.shape[0], step_bytes)).astype(np.uint8)
                field.scatter(slots, raw)
                reference[slots] = raw
            else:
                field.persist()
        field.persist()
        frames.flush()
        reopened = MappedFrames(path, sizes, create=False)
        again = BlockField(capacity, step_bytes, codec, BlockCache(0), 0, reopened)
        everything = np.arange(capacity, dtype=np.int64)
        assert np.array_equal(field.gather(everything), reference)
        assert np.array_equal(again.gather(everything), reference)
        assert again.stored_bytes == frames.stored_bytes
