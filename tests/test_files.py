"""`lucid_replay.files`: a path holds the previous file or the new one, never part of one."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lucid_replay import Episode, SequenceReplay, files


def test_a_write_is_on_the_disk_before_the_rename_that_makes_it_visible(tmp_path, monkeypatch):
    """The data is flushed (fsync of the file) before the rename, and the directory after
    it: after a power loss the path holds the old file or the whole new one."""
    events: list[str] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(descriptor: int) -> None:
        is_dir = os.path.isdir(f"/proc/self/fd/{descriptor}")
        events.append("fsync dir" if is_dir else "fsync file")
        fsync(descriptor)

    def recorded_replace(source: Any, target: Any) -> None:
        events.append("rename")
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    files.write_atomically(tmp_path / "a", lambda file: file.write(b"new"))
    monkeypatch.undo()
    assert (tmp_path / "a").read_bytes() == b"new"
    assert events[:2] == ["fsync file", "rename"]
    assert events[2:] in ([], ["fsync dir"])  # a directory that cannot be opened is skipped


def test_a_written_file_has_the_mode_the_umask_gives_a_new_file(tmp_path):
    """Not the private 0600 of a temporary file: 0666 less the umask, as `open` would give."""
    umask = os.umask(0o022)
    try:
        files.write_atomically(tmp_path / "a", lambda file: file.write(b"x"))
        os.umask(0o077)
        files.write_atomically(tmp_path / "b", lambda file: file.write(b"x"))
    finally:
        os.umask(umask)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b").stat().st_mode & 0o777 == 0o600


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    """A writer that raises half way leaves the path as it was and removes its temporary."""
    path = tmp_path / "checkpoint"
    path.write_bytes(b"previous")

    def half(file: Any) -> None:
        file.write(b"half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        files.write_atomically(path, half)
    assert path.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def test_a_buffer_save_that_fails_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """SequenceReplay.save goes through the same write: a failure keeps the last save loadable."""
    buffer = SequenceReplay(100, seed=0)
    buffer.add(Episode({"x": torch.arange(5.0)}))
    path = tmp_path / "buffer.lucid"
    buffer.save(path)
    saved = path.read_bytes()
    buffer.add(Episode({"x": torch.arange(7.0)}))

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError):
        buffer.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == saved
    assert len(SequenceReplay.load(path)) == 5


@pytest.mark.parametrize("hard_links", [True, False])
def test_link_gives_the_file_a_second_name_also_without_hard_links(
    tmp_path, monkeypatch, hard_links
):
    """The target holds the source's bytes and replaced what it held; no temporary is left."""
    source, target = tmp_path / "source", tmp_path / "target"
    source.write_bytes(b"shard file")
    target.write_bytes(b"older restart file")
    if not hard_links:

        def refuse(*args: Any) -> None:
            raise OSError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", refuse)
    files.link_atomically(source, target)
    assert target.read_bytes() == b"shard file"
    assert os.path.samefile(source, target) is hard_links
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source", "target"]


def test_the_digest_of_a_file_is_streamed(tmp_path, monkeypatch):
    """Digests read files in bounded chunks, whatever their size."""
    path = tmp_path / "big"
    path.write_bytes(bytes(range(256)) * (3 * 2**12) + b"tail!")
    sizes: list[int] = []

    class Reader:
        def __init__(self, file: Any) -> None:
            self.file = file

        def read(self, size: int = -1) -> bytes:
            sizes.append(size)
            return self.file.read(size)

        def __enter__(self) -> Reader:
            return self

        def __exit__(self, *exc_info: object) -> None:
            self.file.close()

    def opened(*a: Any) -> Reader:
        return Reader(open(*a))

    monkeypatch.setattr(files, "open", opened, raising=False)
    sha, size = files.digest(Path(path))
    monkeypatch.undo()
    assert (sha, size) == (hashlib.sha256(path.read_bytes()).hexdigest(), 3 * 2**20 + 5)
    assert sizes and max(sizes) == 2**20 and -1 not in sizes
