"""A draw through the client: the rate limiter, the shards' masses, the rounds, the merge.

`begin` waits for the limiter, reads every shard's mass and sends each labelled shard its
count (`lucid_replay.distributed.draw`); `complete` collects the replies, runs the rounds a
reuse limit needs, merges the pieces and computes the weights over the whole batch. A draw
that is refused gives back what it took from the limiter. The coordinator's generator is
used under the client's lock, so concurrent calls on one client draw in some serial order.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

import lucid_replay.distributed.calls as calls
import lucid_replay.distributed.deferred as deferred
import lucid_replay.distributed.draw as draw
import lucid_replay.distributed.gathering as gathering
import lucid_replay.distributed.transport as transport
from lucid_replay.batch import Batch, WindowBatch
from lucid_replay.errors import RateLimiterTimeout

__all__: list[str] = []  # internal module


def begin(
    replay: Any, spec: draw.Spec, timeout: float | None, optional: bool = False
) -> draw.Pending | None:
    """Start a draw; ``optional``: ``None`` instead of waiting or raising (a prefetch)."""
    replay._check_open()
    if not acquire(replay, spec.batch_size, inserting=False, timeout=timeout, quiet=optional):
        return None
    started = time.perf_counter()
    try:
        with replay._lock:
            shards, window = replay._shards, spec.window
            laws, _ = draw.plan(spec.law, len(shards))
            riding = deferred.take(replay)  # priority updates ride this request
            infos = calls.get(
                [s.info.remote(window, laws, riding[k]) for k, s in enumerate(shards)]
            )
            deferred.settle(replay, infos)
            limit = replay.max_times_sampled
            draw.check(infos, spec, limit)
            masses = np.array([info["log_masses"] for info in infos], dtype=np.float64).T
            located = not spec.chunks and replay._shared()
            pending = draw.start(shards, replay._rng, spec, masses, limit, located)
            pending.exponent = replay.alpha * replay.beta  # weights as of the start
            pending.beta = replay.beta
            pending.seconds = time.perf_counter() - started
            return pending
    except BaseException:
        release(replay, samples=spec.batch_size)
        if optional:
            return None
        raise


def complete(replay: Any, pending: draw.Pending, target: torch.device) -> Batch | WindowBatch:
    """The merged batch of a started draw, on ``target``.

    A located draw (``transport="shared"``) is gathered by `gathering.complete`.
    """
    if pending.located:
        return gathering.complete(replay, pending, target, begin)
    started = time.perf_counter()
    with replay._lock:
        draw.finish(replay._shards, replay._rng, pending, calls.get)
    drawn = time.perf_counter()
    spec = pending.spec
    tensors = transport.merge(pending.pieces, pending.destinations, spec.batch_size, target)
    chances = draw.merged(pending, pending.probabilities, np.float64)
    weights = draw.weights(pending, chances)
    unit = replay._config["priority_unit"]
    # Each piece was copied by its shard's gather (and into Ray's object store), then here.
    pieces = sum(value.nbytes for piece in pending.pieces for value in piece.values())
    size = gathering.batch_bytes(tensors) + chances.nbytes
    size += 0 if weights is None else weights.nbytes
    copies = 1 if replay.backend == "local" else 2
    seconds = pending.seconds + drawn - started
    gathered = time.perf_counter() - drawn
    replay._transport_stats.note(copies * pieces + size, size, seconds, gathered, 0)
    return transport.build(
        tensors,
        weights,
        target,
        chunks=spec.chunks,
        priority_unit=unit,
        probabilities=chances,
    )


def acquire(
    replay: Any, n: int, *, inserting: bool, timeout: float | None, quiet: bool = False
) -> bool:
    """Wait until the limiter admits ``n`` inserts or counts ``n`` samples.

    Admitted inserts (transitions) stay pending until `settle` says what was stored.
    Raises `RateLimiterTimeout` after ``timeout`` seconds (``quiet``: returns False).
    """
    if replay._config["rate_limiter"] is None:
        return True
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if calls.get(replay._control.try_acquire.remote(n, inserting, left)):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            if quiet:
                return False
            what = f"insert of {n} transitions" if inserting else f"sample of {n}"
            raise RateLimiterTimeout(
                f"timeout must be long enough for the rate limiter to allow the {what}, "
                f"got {timeout!r} s"
            )


def settle(replay: Any, stored: int, refused: int) -> None:
    """An admitted insert's outcome: ``stored`` transitions count now, ``refused`` never."""
    if replay._config["rate_limiter"] is not None:
        calls.get(replay._control.commit_insert.remote(stored, refused))


def release(replay: Any, samples: int) -> None:
    """Give back the samples a refused draw took from the limiter."""
    if replay._config["rate_limiter"] is not None:
        calls.get(replay._control.release.remote(samples))


def draw_batch(
    replay: Any, spec: draw.Spec, target: torch.device, timeout: float | None
) -> Batch | WindowBatch:
    """A whole draw (`begin`, then `complete`)."""
    pending = begin(replay, spec, timeout)
    assert pending is not None  # only an optional draw returns None
    return complete(replay, pending, target)
