"""The configuration of a sharded replay: checked once, kept as plain JSON-able values.

The configuration goes into the manifest of every checkpoint, so that `ShardedReplay.load`
restarts the same replay. Seeds: with one shard the shard's buffer is seeded with ``seed``
itself (so that it draws what a `PrioritizedSequenceReplay` seeded alike draws); with
``S > 1`` shards, shard ``k`` gets ``SeedSequence(seed, spawn_key=(k,))``'s first 64-bit
word. The coordinator's generator (numpy PCG64) is seeded with ``SeedSequence(seed)``.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import numpy as np

import lucid_replay.distributed.calls as calls
import lucid_replay.distributed.ids as ids
import lucid_replay.distributed.options as options
from lucid_replay.blocks import CACHE_BYTES
from lucid_replay.checks import check_float, check_int, check_unit
from lucid_replay.distributed.limiter import (
    MinSize,
    RateLimiterConfig,
    SampleToInsertRatio,
    check_limiter,
)
from lucid_replay.errors import must, wrong_type
from lucid_replay.segments import checked_segmenting

__all__: list[str] = []  # internal module


def checked(**arguments: Any) -> dict[str, Any]:
    """The configuration of `ShardedReplay.create`'s arguments, every one validated."""
    num_shards = check_int("num_shards", arguments["num_shards"], minimum=1, maximum=ids.MAX_SHARDS)
    capacity = check_int("capacity", arguments["capacity"], minimum=num_shards, maximum=2**62)
    unit = check_unit(arguments["unit"])
    seed = arguments["seed"]
    if seed is not None:
        seed = check_int("seed", seed, minimum=0, maximum=2**64 - 1)
    reuse = arguments["max_times_sampled"]
    if reuse is not None:
        reuse = check_int("max_times_sampled", reuse, minimum=1)
    limiter = check_limiter(arguments["rate_limiter"])
    if arguments["backend"] not in calls.BACKENDS:
        raise must("backend", f"one of {calls.BACKENDS}", arguments["backend"])
    directory, every = checked_checkpoints(
        arguments["checkpoint_dir"], arguments["checkpoint_every"]
    )
    segment_length, priority_unit = checked_segments(
        arguments["segment_length"], arguments["priority_unit"], capacity // num_shards, unit
    )
    alpha = check_float("alpha", arguments["alpha"], minimum=0.0)
    shards = options.checked(arguments, alpha, unit)
    return {
        "num_shards": num_shards,
        "shard_capacity": capacity // num_shards,
        "alpha": alpha,
        "beta": check_float("beta", arguments["beta"], minimum=0.0),
        "epsilon": check_float("epsilon", arguments["epsilon"], minimum=0.0, strict=True),
        "unit": unit,
        "seed": seed,
        "max_times_sampled": reuse,
        "rate_limiter": limiter_state(limiter),
        "backend": arguments["backend"],
        "checkpoint_dir": directory,
        "checkpoint_every": every,
        "segment_length": segment_length,
        "priority_unit": priority_unit,
        **shards,
    }


def checked_segments(
    segment_length: Any, priority_unit: Any, shard_capacity: int, unit: str
) -> tuple[int | None, str]:
    """``segment_length`` (``1 ..`` a shard's capacity, or None) and ``priority_unit``.

    As `PrioritizedSequenceReplay` checks them, against one shard's capacity.
    """
    return checked_segmenting(segment_length, priority_unit, unit, shard_capacity)


def checked_checkpoints(directory: Any, every: Any) -> tuple[str | None, int | None]:
    """``checkpoint_dir`` (made absolute) and ``checkpoint_every``, checked together."""
    if directory is not None:
        if not isinstance(directory, str | os.PathLike) or isinstance(os.fspath(directory), bytes):
            raise wrong_type("checkpoint_dir", "a path or None", directory)
        directory = os.path.abspath(os.fspath(directory))
    if every is not None:
        every = check_int("checkpoint_every", every, minimum=1)
        if directory is None:
            raise must("checkpoint_every", "None without a checkpoint_dir", every)
    return directory, every


def shard_settings(
    config: dict[str, Any], index: int, replay: str, root: str | None = None
) -> dict[str, Any]:
    """What shard ``index``'s constructor takes; ``replay`` names the running replay.

    ``root``: where ``storage="memory"`` shards share their fields (`options.shared_directory`).
    """
    return {
        "capacity": config["shard_capacity"],
        "alpha": config["alpha"],
        "beta": config["beta"],
        "epsilon": config["epsilon"],
        "unit": config["unit"],
        "seed": shard_seed(config["seed"], index, config["num_shards"]),
        "max_times_sampled": config["max_times_sampled"],
        "checkpoint_dir": config["checkpoint_dir"],
        "checkpoint_every": config["checkpoint_every"],
        "segment_length": config["segment_length"],
        "priority_unit": config["priority_unit"],
        "selector": config.get("selector"),
        "schema": config.get("schema"),
        "storage": config.get("storage", "memory"),
        "directory": options.shard_directory(config, index),
        "cache_bytes": config.get("cache_bytes", CACHE_BYTES),
        "replay": replay,
        "shared": options.shared_directory(config, index, root),
    }


def shard_seed(seed: int | None, index: int, num_shards: int) -> int | None:
    """Shard ``index``'s buffer seed: ``seed`` itself for one shard (see the module)."""
    if seed is None or num_shards == 1:
        return seed
    sequence = np.random.SeedSequence(seed, spawn_key=(index,))
    return int(sequence.generate_state(1, np.uint64)[0])


def coordinator_seed(seed: int | None) -> np.random.SeedSequence | None:
    """The coordinator generator's seed."""
    return None if seed is None else np.random.SeedSequence(seed)


def limiter_state(limiter: RateLimiterConfig | None) -> dict[str, Any] | None:
    """A limiter as plain values (for the manifest)."""
    if limiter is None:
        return None
    fields = attrs.asdict(limiter)
    if isinstance(fields.get("error_buffer"), tuple):
        fields["error_buffer"] = list(fields["error_buffer"])
    return {"kind": type(limiter).__name__, **fields}


def limiter_from(state: dict[str, Any] | None) -> RateLimiterConfig | None:
    """The limiter of `limiter_state` output."""
    if state is None:
        return None
    fields = {k: v for k, v in state.items() if k != "kind"}
    if state["kind"] == "MinSize":
        return MinSize(**fields)
    if isinstance(fields["error_buffer"], list):
        fields["error_buffer"] = tuple(fields["error_buffer"])
    return SampleToInsertRatio(**fields)


def checked_timeout(timeout: Any) -> float | None:
    """``None`` (wait for ever) or a number of seconds ``>= 0``."""
    if timeout is None:
        return None
    return check_float("timeout", timeout, minimum=0.0)


def config_property(name: str, doc: str) -> Any:
    """A read-only property returning ``self._config[name]``."""

    def read(self: Any) -> Any:
        return self._config[name]

    read.__doc__ = doc
    return property(read)
