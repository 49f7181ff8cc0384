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
from lucid_replay.batch_memory import views
from lucid_replay.distributed.client_state import Client
from lucid_replay.errors import RateLimiterTimeout

__all__: list[str] = []  # internal module


def begin(
    replay: Client,
    spec: draw.Spec,
    timeout: float | None,
    optional: bool = False,
    *,
    stream: bool = False,
    infos: list[dict[str, Any]] | None = None,
) -> draw.Pending | None:
    """Start a draw; ``optional``: ``None`` instead of waiting or raising (a prefetch).

    ``stream`` (`BatchStream`'s draws): the shards report their masses after the draw
    (`draw.Pending.infos`), and ``infos``, such reports of the stream's previous draw, are
    what this one starts from instead of asking the shards first (one round trip fewer);
    the queued priority updates then ride the draw calls, applied after the draw.
    """
    replay._check_open()
    if not acquire(replay, spec.batch_size, inserting=False, timeout=timeout, quiet=optional):
        return None
    started = time.perf_counter()
    try:
        with replay._lock:
            if not stream:
                replay._state.changes += 1  # the masses a stream read may have changed
            shards, window = replay._draw_handles(), spec.window
            laws, _ = draw.plan(spec.law, len(shards))
            queued = deferred.take(replay)  # priority updates ride this request
            riding: list[Any] | None = queued  # on the draw calls (a stream's, with reports)
            if infos is None:  # on the mass reads, applied before them
                infos = calls.get(
                    [s.info.remote(window, laws, queued[k]) for k, s in enumerate(shards)]
                )
                deferred.settle(replay, infos)
                riding = None
            limit = replay.max_times_sampled
            masses = np.array([info["log_masses"] for info in infos], dtype=np.float64).T
            located = not spec.chunks and replay._shared()
            try:  # a refusal sends nothing: the updates wait for the next request
                draw.check(infos, spec, limit)
                pending = draw.start(
                    shards,
                    replay._state.rng,
                    spec,
                    masses,
                    limit,
                    located,
                    report=stream,
                    riding=riding,
                )
            except BaseException:
                _requeue(replay, riding)
                raise
            _requeue(replay, [pending.unsent.get(k) for k in range(len(shards))])
            # Replaced by the reports after the draw; their updates were settled already.
            pending.infos = {k: {**info, "updated": []} for k, info in enumerate(infos)}
            pending.changes = replay._state.changes
            pending.exponent = replay.alpha * replay.beta  # weights as of the start
            pending.beta = replay.beta
            pending.seconds = time.perf_counter() - started
            return pending
    except BaseException:
        release(replay, samples=spec.batch_size)
        if optional:
            return None
        raise


def _requeue(replay: Client, riding: list[Any] | None) -> None:
    """Put back, ahead of what was queued since, the updates no draw call carried."""
    if riding is None:
        return
    for k, queued in enumerate(riding):
        if queued:
            replay._state.deferred[k] = [*queued, *replay._state.deferred[k]]


def finished(replay: Client, pending: draw.Pending, then: Any = None) -> None:
    """Collect a started draw's replies; a stream's updates settled, ``then(pending)`` called.

    ``then`` runs before the batch is put together: a stream starts its next draw there.
    """
    with replay._lock:
        draw.finish(replay._draw_handles(), replay._state.rng, pending, calls.get)
        if pending.report:
            deferred.settle(replay, list(pending.infos.values()))
    if then is not None:
        then(pending)


def complete(
    replay: Client, pending: draw.Pending, target: torch.device, then: Any = None
) -> Batch | WindowBatch:
    """The merged batch of a started draw, on ``target`` (`finished` first, with ``then``).

    A located draw (``transport="shared"``) is gathered by `gathering.complete`.
    """
    started = time.perf_counter()
    finished(replay, pending, then)
    if pending.located:
        pending.seconds += time.perf_counter() - started
        return gathering.complete(replay, pending, target, begin)
    drawn = time.perf_counter()
    spec = pending.spec
    shapes = transport.shapes(pending.pieces, spec.batch_size)
    tensors = views(replay._blocks, shapes, pin=target.type == "cuda")
    transport.merge(pending.pieces, pending.destinations, tensors)
    chances = draw.merged(pending, pending.probabilities, np.float64)
    weights = draw.weights(pending, chances)
    unit = replay._config["priority_unit"]
    # Each piece was copied by its shard's gather (and into Ray's object store), then here.
    pieces = sum(transport.nbytes(value) for piece in pending.pieces for value in piece.values())
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
    replay: Client, n: int, *, inserting: bool, timeout: float | None, quiet: bool = False
) -> bool:
    """Wait until the limiter admits ``n`` inserts or counts ``n`` samples.

    Admitted inserts (transitions) stay pending until `settle` says what was stored.
    Raises `RateLimiterTimeout` after ``timeout`` seconds (``quiet``: returns False).
    """
    if inserting:
        replay._state.changes += 1  # stored episodes change the masses a stream read
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


def settle(replay: Client, stored: int, refused: int) -> None:
    """An admitted insert's outcome: ``stored`` transitions count now, ``refused`` never."""
    if replay._config["rate_limiter"] is not None:
        calls.get(replay._control.commit_insert.remote(stored, refused))


def release(replay: Client, samples: int) -> None:
    """Give back the samples a refused draw took from the limiter."""
    if replay._config["rate_limiter"] is not None:
        calls.get(replay._control.release.remote(samples))


def draw_batch(
    replay: Client, spec: draw.Spec, target: torch.device, timeout: float | None
) -> Batch | WindowBatch:
    """A whole draw (`begin`, then `complete`)."""
    pending = begin(replay, spec, timeout)
    assert pending is not None  # only an optional draw returns None
    return complete(replay, pending, target)
