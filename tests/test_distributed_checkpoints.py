"""Checkpoints of `ShardedReplay` (backend="local"): a manifest's entries are checked.

A manifest whose checksum holds but whose configuration or state no replay could have saved
is refused with a CheckpointError naming the entry, before any shard starts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import lucid_replay.distributed.checkpoints as checkpoints
from lucid_replay import CheckpointError, Episode
from lucid_replay.distributed import ShardedReplay

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
    (
        "config null",
        _set("config", value=None),
        "manifest config must be a mapping, got None",
    ),
    (
        "no backend",
        _drop("config", "backend"),
        r"config must hold exactly .*none for \['backend",
    ),
    (
        "num_shards 'two'",
        _set("config", "num_shards", value="two"),
        "num_shards must be an int",
    ),
    (
        "alpha -1",
        _set("config", "alpha", value=-1.0),
        r"config: alpha must be >= 0.0 and finite",
    ),
    (
        "capacity 0",
        _set("config", "shard_capacity", value=0),
        "shard_capacity must be >= 1",
    ),
    (
        "limiter kind",
        _set("config", "rate_limiter", value={"kind": "MinSize"}),
        "config: .*size",
    ),
    (
        "relative dir",
        _set("config", "checkpoint_dir", value="rel"),
        r"\['checkpoint_dir'\] must",
    ),
    (
        "rng garbage",
        _set("rng", value={"state": 5}),
        "manifest rng must be a numpy PCG64 state",
    ),
    ("control garbage", _set("control", value=5), "manifest control must hold"),
    (
        "limiter counters",
        _drop("control", "limiter", "inserts"),
        r"control\['limiter'\]\['inserts'\] must be an int >= 0, got None",
    ),
    (
        "starts",
        _set("control", "starts", value=[[0]]),
        r"control\['starts'\] must be a list of 2",
    ),
    ("first start", _set("control", "starts", 0, value=[3]), "must start at 0"),
    (
        "schema",
        _set("control", "schema", value={"x": 5}),
        r"control\['schema'\]: schema\['x'\]",
    ),
    (
        "noted",
        _set("control", "noted", 1, value=[0, 1]),
        r"control\['noted'\]\[1\] must be \[",
    ),
    (
        "lost",
        _set("control", "lost", 0, value=None),
        r"control\['lost'\]\[0\] must hold",
    ),
    (
        "cursor 'x'",
        _set("cursor", value="x"),
        "manifest cursor must be an int >= 0, got 'x'",
    ),
    (
        "cursor -1",
        _set("cursor", value=-1),
        "manifest cursor must be an int >= 0, got -1",
    ),
    ("no cursor", _drop("cursor"), r"got none for \['cursor'\]"),
    (
        "beta True",
        _set("beta", value=True),
        "manifest beta must be a finite number >= 0.0",
    ),
    (
        "beta -1",
        _set("beta", value=-1.0),
        "manifest beta must be a finite number >= 0.0",
    ),
    (
        "max_priority 0",
        _set("max_priority", value=0.0),
        "max_priority must be a finite number >",
    ),
    (
        "max_priority str",
        _set("max_priority", value="big"),
        "max_priority must be a finite",
    ),
    (
        "skipped 1.5",
        _set("priority_updates_skipped", value=1.5),
        "skipped must be an int >= 0",
    ),
]


@pytest.mark.parametrize(
    ("change", "match"),
    [case[1:] for case in BAD_MANIFESTS],
    ids=[c[0] for c in BAD_MANIFESTS],
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
