"""``storage="memmap"``: fields in files under a directory, `sync` and `SequenceReplay.open`.

The reference for every reopened buffer is an in-memory buffer loaded from the state the
memmap buffer had at its sync: the two must then hold the same episodes and draw the same
batches, call for call.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_batches_equal, comparable, drive, make_episode

from lucid_replay import (
    CheckpointError,
    Episode,
    PrioritizedSequenceReplay,
    SequenceReplay,
    Window,
)


def _memmap(directory: Path, kind: type[SequenceReplay] = SequenceReplay, **kwargs):
    return kind(**{"capacity": 40, "seed": 0, **kwargs}, storage="memmap", directory=directory)


def _fill(buffer: SequenceReplay, lengths=(9, 3, 7, 12, 5, 8, 2, 6)) -> None:
    for index, length in enumerate(lengths):
        buffer.add(make_episode(length, terminated=index % 2 == 0))


def _reference(buffer: SequenceReplay) -> SequenceReplay:
    """An in-memory buffer in ``buffer``'s state now."""
    twin = type(buffer)(**buffer._config())
    twin.load_state_dict(buffer.state_dict())
    return twin


def _episodes(buffer: SequenceReplay) -> dict[int, object]:
    return {i: comparable(dict(buffer[i].steps)) for i in buffer.episode_ids}


@pytest.mark.parametrize("kind", [SequenceReplay, PrioritizedSequenceReplay])
def test_open_returns_the_synced_buffer_draw_for_draw(tmp_path, kind) -> None:
    buffer = _memmap(tmp_path / "d", kind)
    _fill(buffer)  # the ring has wrapped
    buffer.sample(3, 2)
    buffer.sync()
    reference = _reference(buffer)
    buffer.sample(3, 2)  # later draws are gone too
    reopened = kind.open(tmp_path / "d")
    assert type(reopened) is kind and reopened.episode_ids == reference.episode_ids
    assert _episodes(reopened) == _episodes(reference)
    assert reopened.stats() == reference.stats()
    for got, expected in zip(drive(reopened), drive(reference), strict=True):
        assert_batches_equal(got, expected)
    window = Window(3, burn_in=1)
    assert comparable(dict(reopened.sample_windows(6, window).data)) == comparable(
        dict(reference.sample_windows(6, window).data)
    )


def test_ids_issued_after_the_sync_are_issued_again(tmp_path) -> None:
    buffer = _memmap(tmp_path / "d", capacity=100)
    _fill(buffer, (5, 5))
    buffer.sync()
    assert buffer.add(make_episode(3)) == 2
    reopened = SequenceReplay.open(tmp_path / "d")
    assert list(reopened.episode_ids) == [0, 1]
    assert reopened.add(make_episode(4, first_serial=77)) == 2
    assert reopened[2]["serial"].tolist() == [77, 78, 79, 80]


def test_overwritten_synced_episodes_are_evicted_on_open(tmp_path) -> None:
    buffer = _memmap(tmp_path / "d", capacity=50)
    _fill(buffer, (10, 20, 15))  # offsets 0-9, 10-29, 30-44
    buffer.sync()
    expected = _episodes(buffer)
    buffer.add(make_episode(30))  # offsets 45-74: slots of offsets 0-24 rewritten
    reopened = SequenceReplay.open(tmp_path / "d")
    assert list(reopened.episode_ids) == [2]  # 0 and 1 had steps overwritten
    assert _episodes(reopened) == {2: expected[2]}
    stats = reopened.stats()
    assert stats["episodes_evicted"] == 2 and stats["transitions_evicted"] == 30
    # Opened again without a sync in between: the same record of overwritten steps holds.
    reopened.add(make_episode(5))
    del reopened
    assert list(SequenceReplay.open(tmp_path / "d").episode_ids) == [2]


def test_segmented_buffer_with_open_episodes_reopens_and_resumes(tmp_path) -> None:
    buffer = _memmap(tmp_path / "d", capacity=30, segment_length=4, seed=2)
    rng = np.random.default_rng(3)
    streams = [buffer.open_episode() for _ in range(3)]
    for _ in range(25):
        steps = torch.arange(int(rng.integers(1, 7)))
        streams[int(rng.integers(3))].append({"x": steps, "y": steps[:, None] * torch.ones(3)})
    streams[0].close(terminated=True)
    buffer.sync()
    reference = _reference(buffer)
    reopened = SequenceReplay.open(tmp_path / "d")
    assert reopened.open_episode_ids == reference.open_episode_ids
    assert _episodes(reopened) == _episodes(reference)
    episode = reopened.open_episode_ids[0]
    for twin in (reopened, reference):
        stream = twin.resume_episode(episode)
        stream.append({"x": torch.arange(9), "y": torch.ones(9, 3)})
        stream.close(terminated=False)
    assert _episodes(reopened) == _episodes(reference)
    window = Window(5)
    assert comparable(dict(reopened.sample_windows(8, window).data)) == comparable(
        dict(reference.sample_windows(8, window).data)
    )


def test_fields_live_in_files_of_the_ring_size(tmp_path) -> None:
    buffer = _memmap(tmp_path / "d", capacity=1000)
    buffer.add(Episode({"frame": torch.zeros(3, 84, 84, dtype=torch.uint8)}))
    field_files = sorted(p for p in (tmp_path / "d").iterdir() if p.name.startswith("field-"))
    assert [p.stat().st_size for p in field_files] == [1000 * 84 * 84]
    assert buffer._core.store.ring.fields["frame"].untyped_storage().data_ptr() != 0


def test_save_and_load_from_a_memmap_buffer(tmp_path) -> None:
    buffer = _memmap(tmp_path / "d")
    _fill(buffer)
    buffer.save(tmp_path / "file.ckpt")
    loaded = SequenceReplay.load(tmp_path / "file.ckpt")  # a self-contained in-memory copy
    assert _episodes(loaded) == _episodes(buffer)
    for got, expected in zip(drive(loaded), drive(buffer), strict=True):
        assert_batches_equal(got, expected)


def test_load_state_dict_into_a_memmap_buffer_then_sync(tmp_path) -> None:
    source = SequenceReplay(40, seed=5)
    _fill(source)
    buffer = _memmap(tmp_path / "d")
    _fill(buffer, (3,))
    buffer.load_state_dict(source.state_dict())
    buffer.sync()
    assert _episodes(SequenceReplay.open(tmp_path / "d")) == _episodes(source)
    field_files = [p for p in (tmp_path / "d").iterdir() if p.name.startswith("field-")]
    assert len(field_files) == 3  # serial, obs, done: the first ring's files are gone


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"storage": "disk"}, "storage"),
        ({"storage": "memmap"}, "directory"),
        ({"storage": "memory", "directory": "x"}, "directory"),
        ({"storage": "memmap", "directory": 3}, "directory"),
        ({"storage": "memmap", "directory": "d", "capacity": 0}, "capacity"),
    ],
)
def test_bad_storage_arguments_are_refused_and_claim_nothing(tmp_path, kwargs, match) -> None:
    if "directory" in kwargs and isinstance(kwargs["directory"], str):
        kwargs = {**kwargs, "directory": tmp_path / kwargs["directory"]}
    with pytest.raises((ValueError, TypeError), match=match):
        SequenceReplay(**{"capacity": 10, **kwargs})
    assert list(tmp_path.iterdir()) == []


def test_a_directory_holding_anything_is_refused(tmp_path) -> None:
    _memmap(tmp_path / "taken")
    with pytest.raises(ValueError, match="directory must be a new or empty directory"):
        _memmap(tmp_path / "taken")  # another buffer's
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="directory"):
        _memmap(tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="directory"):
        _memmap(tmp_path / "file")
    _memmap(tmp_path / "empty_but_there").add(make_episode(2))  # an empty one is taken


def test_sync_on_a_memory_buffer_is_refused(tmp_path) -> None:
    buffer = SequenceReplay(10)
    buffer.add(make_episode(3))
    with pytest.raises(ValueError, match="storage"):
        buffer.sync()


def test_open_refuses_what_is_not_a_synced_directory(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="directory"):
        SequenceReplay.open(tmp_path)  # empty
    buffer = _memmap(tmp_path / "d")
    _fill(buffer)
    with pytest.raises(CheckpointError, match="synced"):
        SequenceReplay.open(tmp_path / "d")
    buffer.sync()
    with pytest.raises(CheckpointError, match="class"):
        PrioritizedSequenceReplay.open(tmp_path / "d")
    state = tmp_path / "d" / "state.ckpt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        SequenceReplay.open(tmp_path / "d")


def test_open_refuses_a_field_file_of_another_size(tmp_path) -> None:
    buffer = _memmap(tmp_path / "d")
    _fill(buffer)
    buffer.sync()
    field = next(p for p in (tmp_path / "d").iterdir() if p.name.startswith("field-"))
    os.truncate(field, field.stat().st_size - 1)
    with pytest.raises(CheckpointError, match="bytes"):
        SequenceReplay.open(tmp_path / "d")


def test_declared_schema_synced_before_any_add(tmp_path) -> None:
    schema = {"obs": ((2,), torch.float32)}
    buffer = _memmap(tmp_path / "d", schema=schema)
    buffer.sync()
    reopened = SequenceReplay.open(tmp_path / "d")
    assert reopened.schema == buffer.schema and len(reopened) == 0
    reopened.add(Episode({"obs": torch.ones(4, 2)}))
    reopened.sync()
    assert SequenceReplay.open(tmp_path / "d")[0]["obs"].sum().item() == 8.0
