"""`ShardedReplay.memory_report`: each shard's report, and their sums."""

from __future__ import annotations

import pytest
import torch

from lucid_replay import Episode, Field, SequenceReplay, Window
from lucid_replay.distributed import ShardedReplay

pytest.importorskip("zstandard")


def _episodes(count: int) -> list[Episode]:
    generator = torch.Generator().manual_seed(0)
    return [
        Episode(
            {
                "obs": torch.randint(
                    0, 3, (20 + 7 * i, 8, 8), dtype=torch.uint8, generator=generator
                ),
                "reward": torch.randn(20 + 7 * i, generator=generator),
            }
        )
        for i in range(count)
    ]


def test_the_report_sums_the_shards_reports_field_by_field() -> None:
    schema = {
        "obs": Field((8, 8), torch.uint8, stack=4, codec="zstd"),
        "reward": ((), torch.float32),
    }
    replay = ShardedReplay.create(3, 600, backend="local", schema=schema, cache_bytes=4096)
    try:
        assert replay.memory_report()["total"] == {
            "raw_bytes": 0,
            "stored_bytes": 0,
            "cache_bytes": 0,
        }
        replay.extend(_episodes(7))
        replay.sample_windows(16, Window(3))  # fills the decode caches
        report = replay.memory_report()
        shards = report["shards"]
        assert len(shards) == 3
        for name in ("obs", "reward"):
            for key in ("raw_bytes", "stored_bytes", "cache_bytes"):
                assert report["fields"][name][key] == sum(s["fields"][name][key] for s in shards)
        # raw bytes are the stored steps, one frame each, wherever they went
        steps = sum(20 + 7 * i for i in range(7))
        assert report["fields"]["obs"]["raw_bytes"] == steps * 64
        assert report["fields"]["reward"]["raw_bytes"] == steps * 4
        assert report["fields"]["obs"]["stored_bytes"] < report["fields"]["obs"]["raw_bytes"]
        assert 0 < report["total"]["cache_bytes"] <= 3 * 4096
        one = SequenceReplay(600, schema=schema)
        one.extend(_episodes(7))
        assert one.memory_report()["fields"]["obs"]["raw_bytes"] == steps * 64
    finally:
        replay.close()
    with pytest.raises(ValueError, match="closed"):
        replay.memory_report()
