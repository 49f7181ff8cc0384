"""Checkpoints of `ShardedReplay` (backend="local"): the manifest binds its shard files.

A save is atomic as a whole (new files, then the manifest's rename, then cleanup); a load
checks the manifest's entries, every shard file's digest and index before any shard starts,
and writes nothing when it is refused. Directories of the first manifest version still load,
with the index checks.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import lucid_replay.distributed.checkpoints as checkpoints
from lucid_replay import CheckpointError, Episode, InvalidArgumentError, Window, files
from lucid_replay.distributed import MinSize, ShardedReplay

Manifest = dict[str, Any]


# ------------------------------------------------------------------------------ helpers
def _tagged(k: int, length: int = 10) -> Episode:
    return Episode({"tag": torch.full((length,), k)})


def _saved(directory: Path, episodes: int = 4, **kwargs: Any) -> ShardedReplay:
    replay = ShardedReplay.create(2, 1000, seed=0, backend="local", **kwargs)
    replay.extend(_tagged(k) for k in range(episodes))
    replay.save(directory)
    return replay


def _manifest(directory: Path) -> Manifest:
    return json.loads((directory / "manifest.json").read_text())


def _rewrite(directory: Path, change: Callable[[Manifest], object]) -> None:
    """The manifest changed by ``change``, written with a valid checksum."""
    manifest = _manifest(directory)
    change(manifest)
    body = {k: v for k, v in manifest.items() if k not in ("checksum", "format", "version")}
    checkpoints.write_manifest(directory, body)


def _files(directory: Path) -> dict[str, str]:
    """Every file in ``directory`` by name, with the SHA-256 of its bytes."""
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file()
    }


def _shard_paths(directory: Path) -> list[Path]:
    """The shard files the manifest in ``directory`` names (either version)."""
    manifest = _manifest(directory)
    if "shards" in manifest:
        return [directory / entry["file"] for entry in manifest["shards"]]
    return [directory / f"shard_{k}.lucid" for k in range(manifest["config"]["num_shards"])]


def _rebind(directory: Path) -> None:
    """Re-digest the files the manifest names (as if it had been written for them)."""

    def change(manifest: Manifest) -> None:
        for entry, path in zip(manifest["shards"], _shard_paths(directory), strict=True):
            entry["sha256"], entry["bytes"] = files.digest(path)

    _rewrite(directory, change)


def _as_version_1(directory: Path) -> None:
    """Turn a save into what the first manifest version wrote: plain names, nothing bound."""
    manifest = _manifest(directory)
    for k, path in enumerate(_shard_paths(directory)):
        path.rename(directory / f"shard_{k}.lucid")
    body = {k: v for k, v in manifest.items() if k not in ("checksum", "generation", "shards")}
    body["version"] = 1
    body["control"].pop("issued")
    body["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    (directory / "manifest.json").write_text(json.dumps(body))


def _swap(first: Path, second: Path) -> None:
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)


def _per_shard_episodes(replay: ShardedReplay) -> list[int]:
    return [shard["episodes_stored"] for shard in replay.stats()["shards"]]


# -------------------------------------------------------------------- binding and index
def test_swapped_shard_files_are_refused(tmp_path):
    """Two shard files swapped: refused for their digests, and, where the manifest binds
    them as they are or binds nothing (version 1), for the index each file records."""
    _saved(tmp_path)
    first, second = _shard_paths(tmp_path)
    _swap(first, second)
    with pytest.raises(CheckpointError, match=rf"{first.name}' must be the file its manifest"):
        ShardedReplay.load(tmp_path)
    _rebind(tmp_path)
    with pytest.raises(CheckpointError, match=rf"{first.name}' must hold shard 0, got shard 1"):
        ShardedReplay.load(tmp_path)
    _swap(first, second)
    _rebind(tmp_path)
    _as_version_1(tmp_path)
    assert _per_shard_episodes(ShardedReplay.load(tmp_path)) == [2, 2]
    _swap(*_shard_paths(tmp_path))
    with pytest.raises(CheckpointError, match=r"shard_0.lucid' must hold shard 0, got shard 1"):
        ShardedReplay.load(tmp_path)


def test_a_shard_file_of_another_replay_is_refused(tmp_path):
    """A shard file copied from another replay's save (same configuration) is refused."""
    _saved(tmp_path / "ours")
    _saved(tmp_path / "theirs", episodes=6)
    ours, theirs = _shard_paths(tmp_path / "ours")[1], _shard_paths(tmp_path / "theirs")[1]
    shutil.copyfile(theirs, ours)
    with pytest.raises(CheckpointError, match=rf"{ours.name}' must be the file its manifest"):
        ShardedReplay.load(tmp_path / "ours")


# ------------------------------------------------------------------------ atomic saves
@pytest.mark.parametrize("failing", ["shard 1", "manifest"])
def test_an_interrupted_resave_leaves_the_previous_save_as_it_was(tmp_path, monkeypatch, failing):
    """A re-save that fails (disk full on shard 1 after shard 0 wrote, or on the manifest)
    leaves every file of the directory as it was: the previous save loads."""
    replay = _saved(tmp_path)
    replay.extend(_tagged(k) for k in range(4, 8))
    before = _files(tmp_path)
    save_shard, write_manifest = checkpoints.save_shard, checkpoints.write_manifest

    def full_on_shard_1(buffer, path, meta):
        if meta["index"] == 1:
            raise OSError(28, "No space left on device")
        return save_shard(buffer, path, meta)

    def full_on_manifest(directory, manifest):
        raise OSError(28, "No space left on device")

    if failing == "shard 1":
        monkeypatch.setattr(checkpoints, "save_shard", full_on_shard_1)
    else:
        monkeypatch.setattr(checkpoints, "write_manifest", full_on_manifest)
    with pytest.raises(OSError, match="No space left"):
        replay.save(tmp_path)
    monkeypatch.setattr(checkpoints, "save_shard", save_shard)
    monkeypatch.setattr(checkpoints, "write_manifest", write_manifest)
    assert _files(tmp_path) == before
    assert _per_shard_episodes(ShardedReplay.load(tmp_path)) == [2, 2]


def test_a_save_replaces_the_previous_generation_only_once_committed(tmp_path):
    """Each save writes a new generation's files, then the manifest, then removes the
    previous generation's: the directory holds exactly one save."""
    replay = _saved(tmp_path)
    assert sorted(_files(tmp_path)) == ["manifest.json", "shard_0.g1.lucid", "shard_1.g1.lucid"]
    (tmp_path / "shard_0.g7.lucid").write_bytes(b"left by a save that died")
    replay.add(_tagged(9))
    replay.save(tmp_path)
    assert sorted(_files(tmp_path)) == ["manifest.json", "shard_0.g8.lucid", "shard_1.g8.lucid"]
    assert _manifest(tmp_path)["generation"] == 8
    assert ShardedReplay.load(tmp_path).stats()["episodes_stored"] == 5


def test_restart_checkpoints_never_replace_the_files_a_save_binds(tmp_path):
    """save(checkpoint_dir), then the shards' own checkpoints after every add: the saved
    state loads (episodes and limiter counters as saved)."""
    replay = ShardedReplay.create(
        2,
        1000,
        seed=0,
        backend="local",
        checkpoint_dir=tmp_path,
        checkpoint_every=1,
        rate_limiter=MinSize(5),
    )
    for k in range(4):
        replay.add(_tagged(k))
    replay.save(tmp_path)
    bound = {path.name: _files(tmp_path)[path.name] for path in _shard_paths(tmp_path)}
    for k in range(4, 10):
        replay.add(_tagged(k))
    assert {name: _files(tmp_path)[name] for name in bound} == bound
    stats = ShardedReplay.load(tmp_path).stats()
    assert stats["episodes_stored"] == 4
    assert stats["limiter"]["size"] == stats["transitions_stored"] == 40


def test_a_save_into_the_checkpoint_dir_is_what_a_restart_reloads(tmp_path):
    """Without checkpoint_every, a save into checkpoint_dir refreshes the restart files."""
    replay = _saved(tmp_path, checkpoint_dir=tmp_path)
    restart = checkpoints.restart_path(tmp_path, 0)
    assert restart.read_bytes() == _shard_paths(tmp_path)[0].read_bytes()
    replay.add(_tagged(5))  # shard 0: 3 episodes now, 2 saved
    replay.add(_tagged(6))
    replay.save(tmp_path)
    assert restart.read_bytes() == _shard_paths(tmp_path)[0].read_bytes()
    assert not (tmp_path / "shard_0.g1.lucid").exists()


# ------------------------------------------------------------------------------ loading
def _with_a_bad_inner_checksum(path: Path) -> None:
    """A shard file whose payload no longer matches its own checksum (digest rebound)."""
    state = torch.load(path, weights_only=True)
    state["counts"]["chunks_sampled"] += 1
    torch.save(state, path)


@pytest.mark.parametrize("damage", ["flipped bit", "bad inner checksum"])
def test_a_refused_load_writes_nothing(tmp_path, damage):
    """A load refused for shard 1's file (found by its digest before any shard starts, or
    by shard 1 itself after shard 0 loaded) changes no file, also with checkpoint_dir."""
    live, saved = tmp_path / "live", tmp_path / "saved"
    replay = _saved(saved, checkpoint_dir=live, checkpoint_every=1)
    replay.extend(_tagged(k) for k in range(4, 10))
    path = _shard_paths(saved)[1]
    if damage == "flipped bit":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 4
        path.write_bytes(bytes(data))
        match = "must be the file its manifest binds"
    else:
        _with_a_bad_inner_checksum(path)
        _rebind(saved)
        match = "checksum must match its payload"
    before = {directory: _files(directory) for directory in (live, saved)}
    with pytest.raises(CheckpointError, match=match):
        ShardedReplay.load(saved)
    with pytest.raises(CheckpointError, match=match):
        ShardedReplay.load(saved, checkpoint_dir=live, checkpoint_every=1)
    assert {directory: _files(directory) for directory in (live, saved)} == before


def test_a_loaded_replay_writes_restart_files_only_where_it_is_told(tmp_path):
    """By default a loaded replay writes no restart files (not into the saved replay's
    checkpoint_dir); with checkpoint_dir= it writes there; both are checked as create's."""
    live, saved, other = tmp_path / "live", tmp_path / "saved", tmp_path / "other"
    replay = _saved(saved, checkpoint_dir=live, checkpoint_every=1)
    before = {directory: _files(directory) for directory in (live, saved)}
    loaded = ShardedReplay.load(saved)
    loaded.extend(_tagged(k) for k in range(4, 8))
    assert loaded.stats()["episodes_stored"] == 8
    assert {directory: _files(directory) for directory in (live, saved)} == before
    moved = ShardedReplay.load(saved, checkpoint_dir=other, checkpoint_every=1)
    moved.add(_tagged(9))
    assert sorted(_files(other)) == ["restart_0.lucid", "restart_1.lucid"]
    assert {directory: _files(directory) for directory in (live, saved)} == before
    with pytest.raises(InvalidArgumentError, match="checkpoint_every must be None without"):
        ShardedReplay.load(saved, checkpoint_every=2)
    with pytest.raises(TypeError, match="checkpoint_dir must be a path or None, got 5"):
        ShardedReplay.load(saved, checkpoint_dir=5)  # type: ignore[arg-type]
    assert replay.stats()["episodes_stored"] == 4


def test_a_version_1_directory_loads_unless_a_file_is_newer_than_its_manifest(tmp_path):
    """A first-version directory loads and continues exactly; a shard file rewritten after
    its save (a restart checkpoint over it) is refused."""
    replay = _saved(tmp_path)
    _as_version_1(tmp_path)
    loaded = ShardedReplay.load(tmp_path)
    for target in (replay, loaded):
        target.extend(_tagged(k) for k in range(4, 7))
    got, expected = (r.sample_windows(8, Window(3)) for r in (loaded, replay))
    assert torch.equal(got.episode_ids, expected.episode_ids)
    assert torch.equal(got["tag"], expected["tag"])
    newer = _saved(tmp_path / "newer", episodes=6)
    shutil.copyfile(_shard_paths(tmp_path / "newer")[0], tmp_path / "shard_0.lucid")
    with pytest.raises(CheckpointError, match=r"shard_0.lucid' must be the state its manifest"):
        ShardedReplay.load(tmp_path)
    newer.close()


def _set(*keys: Any, value: Any) -> Callable[[Manifest], None]:
    def change(manifest: Manifest) -> None:
        target = manifest
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return change


def _drop(*keys: Any) -> Callable[[Manifest], None]:
    def change(manifest: Manifest) -> None:
        target = manifest
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]

    return change


BAD_MANIFESTS = [
    ("config null", _set("config", value=None), "manifest config must be a mapping, got None"),
    ("no backend", _drop("config", "backend"), r"config must hold exactly .*none for \['backend"),
    ("num_shards 'two'", _set("config", "num_shards", value="two"), "num_shards must be an int"),
    ("alpha -1", _set("config", "alpha", value=-1.0), r"config: alpha must be >= 0.0 and finite"),
    ("capacity 0", _set("config", "shard_capacity", value=0), "shard_capacity must be >= 1"),
    ("limiter kind", _set("config", "rate_limiter", value={"kind": "MinSize"}), "config: .*size"),
    ("relative dir", _set("config", "checkpoint_dir", value="rel"), r"\['checkpoint_dir'\] must"),
    ("rng garbage", _set("rng", value={"state": 5}), "manifest rng must be a numpy PCG64 state"),
    ("control garbage", _set("control", value=5), "manifest control must hold"),
    (
        "limiter counters",
        _drop("control", "limiter", "inserts"),
        r"control\['limiter'\]\['inserts'\] must be an int >= 0, got None",
    ),
    ("starts", _set("control", "starts", value=[[0]]), r"control\['starts'\] must be a list of 2"),
    ("first start", _set("control", "starts", 0, value=[3]), "must start at 0"),
    ("issued", _set("control", "issued", 0, value=[[0, 1]]), r"control\['issued'\]\[0\] must"),
    ("schema", _set("control", "schema", value={"x": 5}), r"control\['schema'\]: schema\['x'\]"),
    ("noted", _set("control", "noted", 1, value=[0, 1]), r"control\['noted'\]\[1\] must be \["),
    ("lost", _set("control", "lost", 0, value=None), r"control\['lost'\]\[0\] must hold"),
    (
        "segment starts",
        _set("control", "segments", 1, "starts", value=[2]),
        r"control\['segments'\]\[1\]\['starts'\] must start at 0",
    ),
    (
        "segment marks",
        _set("control", "segments", 0, value={"starts": [0]}),
        r"control\['segments'\]\[0\] must hold 'starts', 'issued' and 'noted'",
    ),
    ("segment_length 0", _set("config", "segment_length", value=0), "segment_length must be >="),
    (
        "priority_unit",
        _set("config", "priority_unit", value="segment"),
        r"config: priority_unit must be \"episode\" unless segment_length is set",
    ),
    ("cursor 'x'", _set("cursor", value="x"), "manifest cursor must be an int >= 0, got 'x'"),
    ("cursor -1", _set("cursor", value=-1), "manifest cursor must be an int >= 0, got -1"),
    ("no cursor", _drop("cursor"), r"got none for \['cursor'\]"),
    ("beta True", _set("beta", value=True), "manifest beta must be a finite number >= 0.0"),
    ("beta -1", _set("beta", value=-1.0), "manifest beta must be a finite number >= 0.0"),
    ("max_priority 0", _set("max_priority", value=0.0), "max_priority must be a finite number >"),
    ("max_priority str", _set("max_priority", value="big"), "max_priority must be a finite"),
    ("skipped 1.5", _set("priority_updates_skipped", value=1.5), "skipped must be an int >= 0"),
    ("generation 0", _set("generation", value=0), "manifest generation must be an int >= 1"),
    ("no shards", _set("shards", value=[]), "manifest shards must be a list of 2 entries"),
    ("file name", _set("shards", 1, "file", value="../x"), r"\['file'\] must be 'shard_1.g1"),
    ("digest", _set("shards", 0, "sha256", value="zz"), r"\['sha256'\] must be 64 hex digits"),
]


def test_a_manifest_written_before_segments_loads_as_a_replay_without_them(tmp_path):
    """A manifest without segment_length, priority_unit and segment marks (as saved before
    streamed segments) loads: whole episodes, segment marks those of its episode ids."""
    replay = _saved(tmp_path)

    def older(manifest: Manifest) -> None:
        for key in ("segment_length", "priority_unit"):
            del manifest["config"][key]
        del manifest["control"]["segments"]

    _rewrite(tmp_path, older)
    loaded = ShardedReplay.load(tmp_path)
    assert loaded.segment_length is None and loaded.priority_unit == "episode"
    marks = loaded._control.target.state()["segments"]
    assert [m["noted"] for m in marks] == [2, 2]
    got, expected = (r.sample_windows(8, Window(3)) for r in (loaded, replay))
    assert torch.equal(got.episode_ids, expected.episode_ids)


@pytest.mark.parametrize(
    ("change", "match"), [case[1:] for case in BAD_MANIFESTS], ids=[c[0] for c in BAD_MANIFESTS]
)
def test_a_manifest_with_a_bad_entry_is_a_checkpoint_error_naming_it(tmp_path, change, match):
    """A manifest whose checksum holds but whose configuration or state no replay could
    have saved is a CheckpointError naming the entry, and nothing is written."""
    _saved(tmp_path)
    _rewrite(tmp_path, change)
    before = _files(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        ShardedReplay.load(tmp_path)
    assert _files(tmp_path) == before
