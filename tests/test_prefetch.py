"""Prefetching and processes: `iterate` yields batches drawn by a worker thread, checks its
arguments before starting one, raises the worker's errors in the consumer and ends the thread
on ``close``; abandoned iterators never deadlock, and forked children work.

The scenarios that used to hang run in a subprocess with a timeout, so a regression fails the
test instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import F, T, both_engines, make_episode, standard_buffer

from lucid_replay import PrioritizedSequenceReplay, SequenceReplay, Window, WindowBatch

PREFETCH_THREAD = "lucid_replay-prefetch"

_PRELUDE = """
import gc, os, sys, threading, time
import torch
from lucid_replay import Episode, PrioritizedSequenceReplay, Window

def episode(length, first):
    serial = torch.arange(first, first + length)
    return Episode({"serial": serial, "obs": torch.randn(length, 8)})

buffer = PrioritizedSequenceReplay(capacity=5_000, seed=0)
buffer.extend(episode(50, 1000 * i) for i in range(60))
"""


def _run(script: str, timeout: float = 60) -> str:
    """Run ``script`` after the prelude in a fresh interpreter; return its stdout."""
    code = _PRELUDE + textwrap.dedent(script)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the scenario hung for {timeout} s")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_iterators_collected_by_the_cyclic_gc_on_a_worker_thread_do_not_deadlock():
    """Abandoned iterators in reference cycles, freed by the cyclic garbage collector on
    another prefetch worker while it holds the buffer lock, never hang (old: deadlock)."""
    out = _run(
        """
        for round in range(6):
            # a deep queue keeps each abandoned worker drawing, so it waits for the lock
            iterator = buffer.iterate(16, Window(8, burn_in=4), prefetch=10_000)
            next(iterator)
            cycle = [iterator]
            cycle.append(cycle)  # only the cyclic collector can free it
            del iterator, cycle
        keep = buffer.iterate(16, Window(8), prefetch=10_000)
        next(keep)
        gc.set_threshold(20, 1, 1)  # collect often: inside the workers' draws, lock held
        time.sleep(3)  # the main thread allocates nothing meanwhile
        for _ in range(20):
            next(keep)
        keep.close()
        gc.collect()
        print("done")
        """
    )
    assert out.strip().endswith("done")


def test_forked_child_draws_after_the_parent_held_the_lock_mid_draw():
    """A child forked while a prefetch worker held the buffer lock can draw (old: deadlock),
    and draws another random stream than the parent (old: the same)."""
    out = _run(
        """
        parent = os.getpid()
        holding, release = threading.Event(), threading.Event()
        original = buffer._core.draw

        def slow_draw(*args, **kwargs):
            if os.getpid() == parent and not release.is_set():
                holding.set()
                release.wait()
            return original(*args, **kwargs)

        buffer._core.draw = slow_draw
        iterator = buffer.iterate(8, Window(4), prefetch=1)
        consumer = threading.Thread(target=lambda: next(iterator))
        consumer.start()
        assert holding.wait(10)  # the worker is inside a draw, holding the buffer lock
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            try:
                starts = buffer.sample(32, 4).starts.tolist()
                windows = next(buffer.iterate(8, Window(4), prefetch=1))  # fresh worker
                os.write(write, (repr(starts) + "\\n").encode())
                os._exit(0 if windows.batch_size == 8 else 3)
            except BaseException as error:
                os.write(write, repr(error).encode())
                os._exit(2)
        release.set()
        consumer.join()
        mine = buffer.sample(32, 4).starts.tolist()
        deadline = time.monotonic() + 30
        while True:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.kill(child, 9)
                raise SystemExit("child hung")
            time.sleep(0.05)
        theirs = os.read(read, 100_000).decode()
        assert os.waitstatus_to_exitcode(status) == 0, theirs
        iterator.close()
        print("same" if eval(theirs) == mine else "different")
        """
    )
    assert out.strip() == "different"


def test_reseed_gives_reproducible_streams():
    """`reseed` with the same seed gives the same draws, as a per-worker seed needs."""
    first, second = SequenceReplay(100, seed=1), SequenceReplay(100, seed=2)
    for buffer in (first, second):
        buffer.extend(make_episode(10, first_serial=0) for _ in range(3))
        buffer.reseed(17)
    assert first.sample(16, 3).starts.tolist() == second.sample(16, 3).starts.tolist()


def test_prefetched_batches_count_towards_the_reuse_limit_as_documented():
    """Prefetched batches are drawn when prepared, so they count towards ``max_times_sampled``
    even if never consumed; `iterate`'s docstring says so (old: undocumented)."""
    buffer = SequenceReplay(100, seed=0, max_times_sampled=4)
    buffer.extend(make_episode(10) for _ in range(4))  # 16 draws allowed in all
    iterator = buffer.iterate(4, Window(2), prefetch=2)
    next(iterator)
    iterator.close()
    # one consumed batch, and at least one more drawn ahead of the consumer
    assert buffer.stats()["chunks_sampled"] >= 8
    doc = " ".join((SequenceReplay.iterate.__doc__ or "").split())
    assert "count towards max_times_sampled" in doc


def test_closed_iterator_joins_its_worker():
    """`close` stops and joins the worker thread, and a closed iterator stays exhausted."""
    buffer = SequenceReplay(100, seed=0)
    buffer.extend(make_episode(10) for _ in range(3))
    before = {t for t in threading.enumerate() if t.name == "lucid_replay-prefetch"}
    iterator = buffer.iterate(4, Window(2), prefetch=2)
    next(iterator)
    iterator.close()
    after = {t for t in threading.enumerate() if t.name == "lucid_replay-prefetch"}
    assert after <= before
    with pytest.raises(StopIteration):
        next(iterator)


# ----------------------------------- iterate: batches, the worker thread and its errors


def _prefetch_threads(exclude=()):
    """The live prefetch worker threads, but those in ``exclude``."""
    return [
        thread
        for thread in threading.enumerate()
        if thread.name == PREFETCH_THREAD and thread not in exclude
    ]


def _wait_until_stopped(threads, timeout=5.0):
    """Whether every thread of ``threads`` ended within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(thread.is_alive() for thread in threads)


@both_engines
def test_iterate_yields_window_batches_of_the_right_shape():
    """iterate() yields WindowBatches of [B, W] records, drawn like sample_windows."""
    buffer = standard_buffer(seed=0)
    window = Window(2, burn_in=1, bootstrap=1)
    batches = buffer.iterate(3, window, prefetch=2)
    try:
        for _ in range(4):
            batch = next(batches)
            assert isinstance(batch, WindowBatch)
            assert tuple(batch.validity_mask.shape) == (3, 4)
            assert tuple(batch["obs"].shape) == (3, 4, 2)
            assert batch.learning_mask.tolist() == [[F, T, T, F]] * 3
            assert batch.weights is None
    finally:
        batches.close()


@both_engines
def test_iterate_thread_stops_when_the_generator_is_closed():
    """Closing the iterator after use ends the prefetch thread."""
    before = _prefetch_threads()
    buffer = standard_buffer(seed=0)
    batches = buffer.iterate(2, Window(1), prefetch=1)
    next(batches)
    started = _prefetch_threads(exclude=before)
    assert len(started) == 1 and started[0].is_alive()
    batches.close()
    assert _wait_until_stopped(started)


@both_engines
def test_iterate_thread_stops_when_closed_before_the_first_batch():
    """Closing the iterator before taking any batch also ends the prefetch thread."""
    before = _prefetch_threads()
    buffer = standard_buffer(seed=0)
    batches = buffer.iterate(2, Window(1), prefetch=1)
    started = _prefetch_threads(exclude=before)
    try:
        batches.close()
        assert _wait_until_stopped(started, timeout=1.0)
    finally:
        # Stop the leaked worker so it does not outlive the test (drain it, then start-and-close).
        if started and started[0].is_alive():
            _stop_leaked_worker(started[0])


def _stop_leaked_worker(thread):
    """Stop a worker whose consumer generator was closed unstarted (via its closure's event)."""
    for stop in _worker_closure(thread, threading.Event):
        stop.set()
    thread.join(timeout=5.0)


def _worker_closure(thread, kind):
    """The object of type ``kind`` the prefetch worker's function closes over (event, queue)."""
    cells = getattr(getattr(thread, "_target", None), "__closure__", None) or ()
    return [cell.cell_contents for cell in cells if isinstance(cell.cell_contents, kind)]


@both_engines
def test_iterate_close_returns_when_the_worker_failed_behind_a_full_queue():
    """close() returns promptly even if the worker failed while the prefetch queue was full."""
    before = _prefetch_threads()
    buffer = SequenceReplay(capacity=20, seed=0, max_times_sampled=2)
    buffer.add(make_episode(4))  # two draws allowed in all
    batches = buffer.iterate(1, Window(1), prefetch=1)
    next(batches)  # draw 1; the worker queues draw 2, then draw 3 fails (reuse limit)
    (worker,) = _prefetch_threads(exclude=before)
    deadline = time.monotonic() + 5.0
    while buffer.stats()["chunks_sampled"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # let the worker reach its hand-over of the error
    closer = threading.Thread(target=batches.close, daemon=True)
    closer.start()
    closer.join(timeout=2.0)
    try:
        assert not closer.is_alive(), "close() did not return"
        assert _wait_until_stopped([worker])
    finally:
        for ready in _worker_closure(worker, queue.Queue):  # unblock the stuck put
            while worker.is_alive():
                with contextlib.suppress(queue.Empty):
                    ready.get(timeout=0.05)
        closer.join(timeout=5.0)


@both_engines
def test_iterate_worker_errors_surface_in_the_consumer():
    """An error raised in the prefetch thread is raised by next(); the thread then ends."""
    before = _prefetch_threads()
    buffer = SequenceReplay(capacity=20, seed=0)
    buffer.add(make_episode(2))
    buffer.add(make_episode(3))
    batches = buffer.iterate(2, Window(4))
    started = _prefetch_threads(exclude=before)
    with pytest.raises(
        ValueError, match=r"^length must be <= the longest stored episode \(3 steps\), got 4$"
    ):
        next(batches)
    assert _wait_until_stopped(started)


@both_engines
def test_iterate_validates_its_arguments_eagerly():
    """batch_size, prefetch and window are checked when iterate() is called, before any thread."""
    buffer = standard_buffer(seed=0)
    before = _prefetch_threads()
    with pytest.raises(ValueError, match=r"^batch_size must be >= 1, got 0$"):
        buffer.iterate(0, Window(1))
    with pytest.raises(ValueError, match=r"^prefetch must be >= 1, got 0$"):
        buffer.iterate(2, Window(1), prefetch=0)
    with pytest.raises(TypeError, match=r"^window must be a Window, got int$"):
        buffer.iterate(2, 1)
    assert _prefetch_threads(exclude=before) == []


@both_engines
def test_iterate_on_a_prioritized_buffer_yields_weights():
    """On a PrioritizedSequenceReplay iterate() draws by priority (weights present)."""
    buffer = standard_buffer(PrioritizedSequenceReplay, seed=0)
    batches = buffer.iterate(4, Window(2))
    try:
        batch = next(batches)
        assert batch.weights is not None
        assert tuple(batch.weights.shape) == (4,)
        assert float(batch.weights.max()) == 1.0
    finally:
        batches.close()
