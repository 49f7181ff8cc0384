"""Benchmarks of lucid_replay.distributed on one machine (python -m benchmarks.distributed).

Rows, all in one run:

* batches/s of 256 windows (burn_in 40 + length 64 + bootstrap 5) through a Ray
  ``ShardedReplay`` client with ``iterate(prefetch=1/2/4)``, against in-process
  ``sample_windows`` on one ``PrioritizedSequenceReplay`` holding the same data, with no
  learner compute and with 10 ms of it per batch;
* episodes/s of 256 steps added by K = 1, 2, 4 writer processes (Ray actors holding a copy of
  the client, one ``add`` per episode);
* the loop "add one 256-step episode, sample 256 windows, update their priorities" through
  the client (Ray and local backends) against the single buffer;
* restart time of a killed shard and the episodes it lost, against ``checkpoint_every``;
* transports: batches/s of prioritized ``iterate(prefetch=2)`` (priorities updated each
  batch, ``defer=True``) through ``transport="shared"`` and ``"object"`` Ray clients of 1, 2
  and 4 shards, against the same loop in process: ``of_in_process`` divides by one
  ``PrioritizedSequenceReplay``'s ``iterate(prefetch=2)`` with its priorities updated each
  batch (the same loop, the bar's baseline), ``of_in_process_calls`` by its
  ``sample_windows`` and ``update_priorities`` called without a prefetching thread (faster
  on two cores when the learner computes nothing); both timed again after each client, the
  medians; each rate is the median of five blocks of 60 batches, after five seconds of
  the same loop (one for the in-process loop; see `warm`). Also bytes copied per
  batch over its bytes (``transport_stats``) for 64 and 256 windows; and the floor Ray's
  object store sets under any ``"object"`` client here: an actor returning a batch's arrays
  with no replay behind it (`benchmarks.ray_floor`), divided by the same medians
  (``--only transport`` runs just these).

Only the public API is used. On a 2-core machine every shard, writer and the learner share
the same two cores: the numbers show per-call costs and overlap, not multi-node scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch

from benchmarks.ray_floor import floor_rows
from lucid_replay import Episode, PrioritizedSequenceReplay, Window
from lucid_replay.distributed import ShardedReplay

WINDOW = Window(64, burn_in=40, bootstrap=5)
BATCH = 256


def episode(rng: np.random.Generator, length: int) -> Episode:
    """An episode of the reference layout (obs f32[64], action, reward, three flags)."""
    done = np.zeros(length, dtype=bool)
    done[-1] = True
    return Episode(
        {
            "obs": rng.standard_normal((length, 64), dtype=np.float32),
            "action": rng.integers(0, 6, length),
            "reward": rng.standard_normal(length, dtype=np.float32),
            "done": done,
            "terminated": done.copy(),
            "truncated": np.zeros(length, dtype=bool),
        },
        terminated=True,
    )


def fill(replays: list[Any], transitions: int, seed: int = 0) -> None:
    """The same episodes (lengths uniform in [128, 384]) into every replay."""
    rng = np.random.default_rng(seed)
    stored = 0
    while stored < transitions:
        batch = [episode(rng, int(rng.integers(128, 385))) for _ in range(32)]
        for replay in replays:
            replay.extend(batch)
        stored += sum(len(e) for e in batch)


def rate(call: Any, count: int, warmup: int = 3) -> float:
    """Calls per second of ``call`` over ``count`` calls (after ``warmup``)."""
    for _ in range(warmup):
        call()
    start = time.perf_counter()
    for _ in range(count):
        call()
    return count / (time.perf_counter() - start)


def warm(call: Any, seconds: float) -> None:
    """Call ``call`` for ``seconds`` first: a client's steady state, not its first batches.

    An ``"object"`` client's first few hundred batches run at a third to a half of its
    steady rate: each reply is copied into memory of Ray's object store that nothing has
    touched yet (the shard faulted in about 1,900 pages a batch at first, none once the
    store's memory was in use; one shard made 42-211 batches/s in blocks of 60 over its
    first 300 batches, 136-244 in the blocks after). A learner runs far longer than that.
    """
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        call()


def steady_rate(call: Any, count: int, blocks: int = 5) -> float:
    """The median of ``blocks`` rates of ``call``, each over ``count`` calls (after warmup).

    On two shared cores a burst of other work (Ray starting a worker, the kernel reclaiming
    pages) can halve one block's rate; the median over blocks ignores one or two such.
    """
    rates = [rate(call, count, warmup=3 if block == 0 else 0) for block in range(blocks)]
    return float(np.median(rates))


# ---------------------------------------------------------------------------- rows
def sampling_rows(transitions: int, shards: int, batches: int) -> list[dict[str, Any]]:
    buffer = PrioritizedSequenceReplay(transitions + 1000, seed=0)
    replay = ShardedReplay.create(shards, transitions + 1000 * shards, seed=0)
    fill([buffer, replay], transitions)
    rows = []
    for compute in (0.0, 0.010):

        def in_process(compute: float = compute) -> None:
            buffer.sample_windows(BATCH, WINDOW)
            time.sleep(compute)

        rows.append(
            {"what": "in-process sample_windows", "compute_ms": compute * 1e3,
             "batches_per_s": rate(in_process, batches)}
        )  # fmt: skip
        for prefetch in (1, 2, 4):
            stream: Any = replay.iterate(BATCH, WINDOW, prefetch=prefetch)

            def streamed(stream: Any = stream, compute: float = compute) -> None:
                next(stream)
                time.sleep(compute)

            rows.append(
                {"what": f"client iterate, prefetch {prefetch} ({shards} shards)",
                 "compute_ms": compute * 1e3, "batches_per_s": rate(streamed, batches)}
            )  # fmt: skip
            stream.close()
    replay.close()
    return rows


class Writer:
    """A collector process: adds 256-step episodes through its copy of the client."""

    def __init__(self, replay: ShardedReplay, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.replay, self.episodes = replay, [episode(rng, 256) for _ in range(8)]

    def run(self, count: int) -> int:
        for i in range(count):
            self.replay.add(self.episodes[i % len(self.episodes)])
        return count


def writer_rows(shards: int, per_writer: int) -> list[dict[str, Any]]:
    import ray

    rows = []
    for writers in (1, 2, 4):
        replay = ShardedReplay.create(shards, 2_000_000, seed=0)
        actors: list[Any] = [
            ray.remote(num_cpus=0)(Writer).remote(replay, k) for k in range(writers)
        ]
        ray.get([a.run.remote(2) for a in actors])  # warm: actors up, schema fixed
        start = time.perf_counter()
        added = sum(ray.get([a.run.remote(per_writer) for a in actors]))
        elapsed = time.perf_counter() - start
        rows.append(
            {"writers": writers, "shards": shards, "episodes_per_s": added / elapsed,
             "transitions_per_s": 256 * added / elapsed}
        )  # fmt: skip
        for actor in actors:
            ray.kill(actor)
        replay.close()
    return rows


def loop_rows(transitions: int, shards: int, iterations: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    fresh = [episode(rng, 256) for _ in range(16)]
    errors = torch.rand(BATCH, WINDOW.size)
    targets = {
        "PrioritizedSequenceReplay (in-process)": PrioritizedSequenceReplay(
            transitions + 1000, seed=0
        ),
        f"ShardedReplay, local backend ({shards} shards)": ShardedReplay.create(
            shards, transitions + 1000 * shards, seed=0, backend="local"
        ),
        f"ShardedReplay, Ray backend ({shards} shards)": ShardedReplay.create(
            shards, transitions + 1000 * shards, seed=0, backend="ray"
        ),
    }
    fill(list(targets.values()), transitions)
    rows = []
    for name, replay in targets.items():
        counter = iter(range(10**9))

        def step(replay: Any = replay, counter: Any = counter) -> None:
            replay.add(fresh[next(counter) % len(fresh)])
            batch = replay.sample_windows(BATCH, WINDOW)
            replay.update_priorities_from(batch, errors)

        per_s = rate(step, iterations)
        rows.append({"what": name, "ms_per_iteration": 1e3 / per_s})
        if isinstance(replay, ShardedReplay):
            replay.close()
    return rows


def restart_rows(stored: int, after: int) -> list[dict[str, Any]]:
    import ray

    rows = []
    rng = np.random.default_rng(2)
    pool = [episode(rng, 256) for _ in range(16)]
    for every in (None, 25, 100):
        directory = tempfile.mkdtemp(prefix="lucid-bench-")
        replay = ShardedReplay.create(
            2, 4_000_000, seed=0, checkpoint_dir=directory, checkpoint_every=every
        )
        replay.extend(pool[i % 16] for i in range(stored))
        replay.save(directory)  # the latest checkpoint of every shard
        start = time.perf_counter()
        for i in range(after):
            replay.add(pool[i % 16])
        add_rate = after / (time.perf_counter() - start)
        shard = replay.stats()["shards"][0]
        ray.kill(replay._shards[0], no_restart=False)  # what a crash does
        start = time.perf_counter()
        while True:
            try:
                stats = replay.stats()
                if stats["shards"][0]["incarnation"] == shard["incarnation"] + 1:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                pass
            time.sleep(0.05)
        rows.append(
            {"checkpoint_every": "save only" if every is None else every,
             "episodes_per_s_added": add_rate, "restart_s": time.perf_counter() - start,
             "episodes_lost": stats["episodes_lost"],
             "stored_on_shard_before": shard["episodes_stored"]}
        )  # fmt: skip
        replay.close()
    return rows


def transport_rows(transitions: int, batches: int, warmup: float = 5.0) -> list[dict[str, Any]]:
    buffer = PrioritizedSequenceReplay(transitions + 1000, seed=0)
    fill([buffer], transitions)
    errors = np.random.default_rng(0).random(BATCH)

    def in_process_calls() -> None:
        batch = buffer.sample_windows(BATCH, WINDOW)
        buffer.update_priorities(batch.episode_ids, errors)

    def in_process() -> tuple[float, float]:
        """The in-process rates now: ``iterate(prefetch=2)``, and calls without a thread."""
        stream: Any = buffer.iterate(BATCH, WINDOW, prefetch=2)

        def streamed() -> None:
            batch = next(stream)
            buffer.update_priorities(batch.episode_ids, errors)

        warm(streamed, warmup / 5)
        iterated = steady_rate(streamed, batches)
        stream.close()  # its thread stops: the next rate is measured without it
        return iterated, steady_rate(in_process_calls, batches)

    def measured(call: Any) -> float:
        warm(call, warmup)
        return steady_rate(call, batches)

    # The in-process rates are measured again after every client (the cores' speed drifts
    # over a run): each row is a ratio to the medians of those measurements.
    bases = [in_process()]
    rows: list[dict[str, Any]] = []
    for shards in (1, 2, 4):
        for transport in ("shared", "object"):
            replay = ShardedReplay.create(
                shards, transitions + 1000 * shards, seed=0, transport=transport
            )
            fill([replay], transitions)
            stream: Any = replay.iterate(BATCH, WINDOW, prefetch=2)

            def streamed(stream: Any = stream, replay: Any = replay) -> None:
                batch = next(stream)
                replay.update_priorities(batch.episode_ids, errors, defer=True)

            speed = measured(streamed)
            stats = replay.transport_stats()
            rows.append(
                {"what": f"iterate + update, {transport}, {shards} shards",
                 "batches_per_s": speed, "of_in_process": speed, "of_in_process_calls": speed,
                 "copied_per_batch_bytes": stats["copy_ratio_last"]}
            )  # fmt: skip
            stream.close()
            for size in (64,) if shards == 2 else ():
                replay.sample_windows(size, WINDOW)
                rows.append(
                    {"what": f"{size} windows, {transport}, {shards} shards (bytes only)",
                     "batches_per_s": None, "of_in_process": None, "of_in_process_calls": None,
                     "copied_per_batch_bytes": replay.transport_stats()["copy_ratio_last"]}
                )  # fmt: skip
            replay.close()
            bases.append(in_process())
    rows += floor_rows(buffer.sample_windows(BATCH, WINDOW), measured)
    bases.append(in_process())
    iterated, called = (float(np.median(column)) for column in zip(*bases, strict=True))
    for row in rows:
        if row["batches_per_s"] is not None:  # rows that measure bytes only are not timed
            row["of_in_process"] /= iterated
            row["of_in_process_calls"] /= called
    first = [
        {"what": "in-process iterate(prefetch=2) + update (median)", "batches_per_s": iterated,
         "of_in_process": 1.0, "of_in_process_calls": iterated / called,
         "copied_per_batch_bytes": 1.0},
        {"what": "in-process sample_windows + update (median)", "batches_per_s": called,
         "of_in_process": called / iterated, "of_in_process_calls": 1.0,
         "copied_per_batch_bytes": 1.0},
    ]  # fmt: skip
    return [*first, *rows]


# ---------------------------------------------------------------------------- main
def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [_cell(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    """Floats under 10 (ratios) to two places, larger ones to one; ``None`` (not timed): -."""
    if value is None:
        return "-"
    if not isinstance(value, float):
        return str(value)
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--only", default="", help="'transport': only the transport rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
    )  # fmt: skip
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    quick = args.quick
    transitions = 20_000 if quick else 200_000
    results: dict[str, list[dict[str, Any]]] = {
        "transport": transport_rows(transitions, 5 if quick else 60, 0.5 if quick else 5.0),
    }
    if args.only != "transport":
        results |= {
            "sampling": sampling_rows(transitions, 2, 5 if quick else 40),
            "writers": writer_rows(2, 10 if quick else 150),
            "loop": loop_rows(transitions, 2, 5 if quick else 40),
            "restart": restart_rows(20 if quick else 300, 10 if quick else 60),
        }
    ray.shutdown()
    print(f"stored transitions: {transitions}; window {WINDOW.size} records x {BATCH}\n")
    for name, rows in results.items():
        print(f"### {name}\n\n{table(rows)}\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
