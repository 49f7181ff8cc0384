"""Prefetching and processes: abandoned iterators never deadlock, forked children work.

The scenarios that used to hang run in a subprocess with a timeout, so a regression fails the
test instead of hanging the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import make_episode

from lucid_replay import SequenceReplay, Window

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
    import threading

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
