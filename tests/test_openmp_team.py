"""Copies on torch's OpenMP team: found only where it is torch's, refused where it is not,
never used in a forked child (where it would wait for good), safe from several threads."""

from __future__ import annotations

import os
import select
import signal
import threading
import time

import numpy as np
import pytest
import torch
from segmented_buffers import stream_interleaved

from lucid_replay import SequenceReplay, Window, engine, openmp_team

pytest.importorskip("numba", reason="the team copies the compiled path's listed runs")
listed_copies = pytest.importorskip("lucid_replay.listed_copies")

TEAM = openmp_team.threads(2) is not None
WINDOW = Window(24, burn_in=8, bootstrap=2)
needs_team = pytest.mark.skipif(not (TEAM and engine.available()), reason="no OpenMP team")


def _interleaved(seed: int) -> SequenceReplay:
    """Six episodes streamed at once in random pieces: windows cross seams into segments
    stored elsewhere, so a gather copies them run by run."""
    buffer = SequenceReplay(capacity=3000, segment_length=16)
    rng = np.random.default_rng(seed)

    def obs(serial: torch.Tensor) -> torch.Tensor:
        return serial[:, None].float() + torch.arange(64, dtype=torch.float32)

    options = {"streams": 6, "rounds": 300, "max_piece": 12, "serial_base": 5_000}
    stream_interleaved(buffer, rng, obs=obs, **options)
    return buffer


def _anchors(buffer: SequenceReplay, seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    ids = buffer.episode_ids
    infos = [buffer.episode_info(i) for i in ids]
    picks = rng.integers(len(ids), size=128)
    steps = [infos[p].first_step + int(rng.integers(infos[p].stored_length)) for p in picks]
    return [ids[p] for p in picks], steps


def _threads(count: int) -> int:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    return before


def test_threads_is_none_without_a_runtime_and_run_refuses(monkeypatch):
    monkeypatch.setattr(openmp_team, "_looked", True)
    monkeypatch.setattr(openmp_team, "_parallel", None)
    assert openmp_team.threads(4) is None
    with pytest.raises(RuntimeError, match="no OpenMP team"):
        openmp_team.run(0, 0, 2)


def test_the_runtime_is_the_one_loaded_openmp_library_where_torch_runs_on_openmp(monkeypatch):
    mapped = "7f00-7f01 r-xp 00000000 08:01 42   {}\n"
    gnu, llvm = "/site/torch/lib/libgomp-a34b3233.so.1", "/usr/lib/libomp.so.5"
    assert openmp_team._runtime_path([mapped.format(gnu), mapped.format(gnu)]) == gnu
    assert openmp_team._runtime_path([mapped.format("/usr/lib/libc.so.6")]) is None
    assert openmp_team._runtime_path([mapped.format(gnu), mapped.format(llvm)]) is None
    assert openmp_team._runtime_path(["7f00-7f01 rw-p 00000000 00:00 0\n"]) is None
    monkeypatch.setattr(openmp_team, "_looked", False)
    monkeypatch.setattr(openmp_team, "_parallel", openmp_team._parallel)  # restored after
    monkeypatch.setattr(torch.__config__, "parallel_info", lambda: "ATen parallel backend: native")
    assert openmp_team.threads(2) is None  # torch's own threads are not an OpenMP team


@needs_team
def test_the_team_answers_the_threads_wanted_and_one_in_a_forked_child(monkeypatch):
    assert openmp_team.threads(3) == 3 and openmp_team.threads(0) == 1
    monkeypatch.setattr(openmp_team, "_forked", True)
    assert openmp_team.threads(2) == 1
    with pytest.raises(RuntimeError, match="no OpenMP team"):
        openmp_team.run(0, 0, 2)


def test_team_arguments_refuse_arrays_the_team_cannot_read():
    runs = np.zeros((4, 3), dtype=np.int64)
    windows = np.zeros(3, dtype=np.int64)
    fields = (np.zeros(2, dtype=np.int64),) * 3
    kind = listed_copies._RUNS
    good = listed_copies._team_arguments(kind, fields, 5, (runs, windows, 3), 10, 0)
    assert good.tolist()[:9] == [0, kind, 2, 5, 3, 10, 0, 4, 3]
    assert good.shape == (listed_copies._WORDS,)
    for bad, message in (
        ((fields, (runs[:, ::2], windows, 2), kind), "int64 C-contiguous"),
        ((fields, (runs.astype(np.int32), windows, 3), kind), "int64 C-contiguous"),
        ((fields, (runs, windows, 4), kind), "4 to copy, but 3 columns"),
        ((fields, (runs, windows[:2], 3), kind), "3 to copy, but 3 columns and 2 windows"),
        ((fields, (runs, windows, -1), kind), "-1 to copy"),
        (((*fields[:2], np.zeros(3, dtype=np.int64)), (runs, windows, 3), kind), "one entry"),
        ((fields, (runs, windows, 3), listed_copies._BLOCKS), "table of 4 rows"),
        ((fields, (runs[:1], windows, 3), kind), "table of 1 rows"),
        ((fields, (runs, windows, 3), 7), "kind 7"),
    ):
        (fields_at, work, which) = bad
        with pytest.raises(ValueError, match=message):
            listed_copies._team_arguments(which, fields_at, 5, work, 10, 0)


@needs_team
def test_two_python_threads_copy_on_teams_at_once():
    """Each Python thread that starts a parallel region leads a team of its own."""
    buffers = [_interleaved(seed) for seed in (1, 2)]
    anchors = [_anchors(buffer, seed) for seed, buffer in enumerate(buffers)]
    before = _threads(1)
    try:
        expected = [
            b.gather_windows(*a, WINDOW)["obs"] for b, a in zip(buffers, anchors, strict=True)
        ]
        torch.set_num_threads(2)
        errors: list[BaseException] = []

        def gather(which: int) -> None:
            try:
                for _ in range(40):
                    batch = buffers[which].gather_windows(*anchors[which], WINDOW)
                    assert torch.equal(batch["obs"], expected[which])
            except BaseException as error:  # reported by the test's thread
                errors.append(error)

        workers = [threading.Thread(target=gather, args=(w,)) for w in (0, 1)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=120)
        assert not any(worker.is_alive() for worker in workers) and not errors, errors
    finally:
        torch.set_num_threads(before)


@needs_team
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gathers_on_its_own_thread():
    """GNU OpenMP's team does not survive a fork: a parallel region in the child waits for
    the parent's threads for good. The child's gather copies on its own thread instead; it
    compares with numpy, since any torch op on two threads would wait there too."""
    buffer = _interleaved(4)
    anchors = _anchors(buffer, 4)
    before = _threads(2)
    try:
        expected = buffer.gather_windows(*anchors, WINDOW)["obs"].numpy().copy()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report b"1" if the batch is the parent's, then leave
            code = 1
            try:
                os.close(read)
                got = buffer.gather_windows(*anchors, WINDOW)["obs"].numpy()
                os.write(write, b"1" if np.array_equal(got, expected) else b"0")
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        ready, _, _ = select.select([read], [], [], 60.0)
        answer = os.read(read, 1) if ready else b""
        os.close(read)
        if not answer:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert answer == b"1", "the forked child's gather hung or differed"
    finally:
        torch.set_num_threads(before)


@needs_team
def test_a_team_gather_returns_a_complete_batch():
    """A gather on the team returns only when every thread has finished: the batch read
    right after the call is complete (no thread still writing)."""
    buffer = _interleaved(5)
    anchors = _anchors(buffer, 5)
    before = _threads(1)
    try:
        expected = buffer.gather_windows(*anchors, WINDOW)["obs"].clone()
        torch.set_num_threads(2)
        for _ in range(20):
            batch = buffer.gather_windows(*anchors, WINDOW)["obs"]
            snapshot = batch.clone()
            time.sleep(0.001)
            assert torch.equal(snapshot, expected) and torch.equal(batch, expected)
    finally:
        torch.set_num_threads(before)
