"""Pixel rows: real Atari frames stored once, compressed, in files, beside TorchRL's storages.

For each game of `benchmarks.atari` (Pong, Breakout, MsPacman; 200k cached transitions each,
84x84 uint8 frames), the episodes are added whole (``T + 1`` records each: the final
observation is a record) to buffers with ``Field((84, 84), torch.uint8, stack=4)``:

* bytes rows (group ``pixels_bytes``): the stored bytes of the observations per transition,
  from ``memory_report()``, for ``stack=4`` raw, zstd and lz4, and from TorchRL's storages
  of the same steps: ``LazyMemmapStorage`` of the stacked observation (what a TorchRL user
  of a ``CatFrames`` / frame-stacked env stores; its size is fixed by its shape, so it is
  filled with the first `TORCHRL_MEMMAP_STEPS` transitions only) and
  ``CompressedListStorage`` of one frame per transition (every transition, as a
  ``CatFrames`` replay-buffer transform would restack them). Each row also states the add
  (lucid_replay: ``add`` of whole episodes; TorchRL: ``extend``) cost per frame, timed once
  over the whole fill;
* timed rows (group ``pixels``, 256 windows x 109 records, ``stack=4``: 788 MB a batch):
  ``sample_windows`` on the raw buffer and on a memmap one (``storage="memmap"``, its files
  in the page cache), in rounds with `StackedFloor`, an ``index_select`` of the same stacked
  bytes from the game's frames into a preallocated output; then ``iterate(prefetch=2)`` on
  the raw, zstd and lz4 buffers, each alone, the learner doing nothing between ``next``
  calls (its median is the time per batch of the background thread).

Each game runs at most `PIXEL_REPS` timed calls (808 MB batches: the group stays at a few
minutes on two cores). Only observations are measured: actions and rewards are a few bytes.
TorchRL's ``SliceSampler`` refuses a ``CompressedListStorage`` (it needs a tensordict
storage to find trajectories), so no TorchRL window sample is timed on it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from benchmarks import atari
from benchmarks.config import Config
from benchmarks.lucid_rows import reference_window
from benchmarks.rows import Only, Row, release
from benchmarks.timing import Timing, measure, measure_rounds
from lucid_replay import Episode, Field, SequenceReplay, WindowBatch

GROUP, BYTES_GROUP = "pixels", "pixels_bytes"
STEPS = 200_000  # cached transitions per game
STACK = 4
FRAME_BYTES = 84 * 84
PIXEL_REPS, PIXEL_WARMUP = 10, 2
TORCHRL_MEMMAP_STEPS = 20_000
INDEX_SETS = 16
# Storages of the bytes rows, in the order shown: (row suffix, label).
STORAGES = (
    ("lucid.raw", "lucid_replay stack=4"),
    ("lucid.zstd", "lucid_replay stack=4, zstd"),
    ("lucid.lz4", "lucid_replay stack=4, lz4"),
    ("torchrl.memmap", "TorchRL LazyMemmapStorage, stacked obs [4, 84, 84]"),
    ("torchrl.compressed", "TorchRL CompressedListStorage, one frame (+ CatFrames)"),
)


def slug(game: str) -> str:
    return game.lower()


def pixel_rows(config: Config, only: Only) -> list[Row]:
    """Every game's bytes and timed rows (one game's frames in memory at a time)."""
    rows: list[Row] = []
    for game in atari.GAMES:
        missing = not (atari.cache_directory() / f"{game}-{STEPS}.npz").exists()
        if missing and importlib.util.find_spec("ale_py") is None:
            reason = "no cached frames and no ale_py to collect them: pip install ale-py"
            rows.append(Row.not_measured(f"pixels.{slug(game)}", game, reason, group=GROUP))
            continue
        data = atari.load(game, STEPS)  # collected first (minutes) if not cached
        rows += _game_rows(dataclasses.replace(config, reps=min(config.reps, PIXEL_REPS)), data)
        rows = [r for r in rows if only(r.id)]
        del data
        release()
    return rows


def episodes(data: atari.AtariSteps) -> list[Episode]:
    """Each episode as ``T + 1`` records (the last one's action and reward zero), no copies
    of the frames."""
    out = []
    for item in data.episodes():
        actions, rewards = np.asarray(item["actions"]), np.asarray(item["rewards"])
        steps = {
            "obs": torch.from_numpy(np.asarray(item["frames"])),
            "action": torch.from_numpy(np.append(actions, 0)),
            "reward": torch.from_numpy(np.append(rewards, np.float32(0))),
        }
        out.append(Episode(steps, terminated=bool(item["terminated"])))
    return out


def filled(
    data: atari.AtariSteps, codec: str | None, **storage: Any
) -> tuple[SequenceReplay, float]:
    """A buffer holding every episode of ``data``, and the seconds its adds took."""
    schema: dict[str, Field | tuple[tuple[int, ...], torch.dtype]] = {
        "obs": Field(atari.FRAME, torch.uint8, stack=STACK, codec=codec),
        "action": ((), torch.int64),
        "reward": ((), torch.float32),
    }
    buffer = SequenceReplay(int(data.frames.shape[0]), schema=schema, seed=0, **storage)
    began = time.perf_counter()
    for episode in episodes(data):
        buffer.add(episode)
    return buffer, time.perf_counter() - began


class StackedFloor:
    """``index_select`` of ``B x W`` stacks of ``k`` frames from ``frames`` (``[N, ...]``) at
    fresh random window positions: the bytes a stacked batch holds, with no episodes.

    Into an output allocated once (``out=``): ``sample_windows`` reuses the memory of a batch
    no longer referenced, so a floor that faulted in 788 MB of fresh pages per call (about 7x
    slower here) would flatter the buffer.
    """

    def __init__(self, frames: torch.Tensor, batch: int, size: int, *, seed: int) -> None:
        self.frames, self.shape = frames, (batch, size, STACK, *frames.shape[1:])
        generator = torch.Generator().manual_seed(seed)
        high = frames.shape[0] - size + 1
        starts = torch.randint(STACK - 1, high, (INDEX_SETS, batch, 1, 1), generator=generator)
        offsets = torch.arange(size)[:, None] + torch.arange(1 - STACK, 1)
        self.indices = [(starts[i] + offsets).reshape(-1) for i in range(INDEX_SETS)]
        self.out = torch.empty((batch * size * STACK, *frames.shape[1:]), dtype=frames.dtype)
        self.out.fill_(0)  # faulted in before timing
        self._turn = itertools.cycle(range(INDEX_SETS))

    def __call__(self) -> torch.Tensor:
        index = self.indices[next(self._turn)]
        return torch.index_select(self.frames, 0, index, out=self.out).view(self.shape)


def _bytes_row(game: str, key: str, label: str, stored: int, data: atari.AtariSteps) -> Row:
    per = stored / data.transitions
    return Row(
        f"pixels.{slug(game)}.bytes.{key}",
        f"{game}: {label}",
        BYTES_GROUP,
        extra={"game": game, "storage": key, "bytes_per_transition": per, "stored_bytes": stored},
        note=f"{per:,.0f} B/transition ({per / FRAME_BYTES:.3f} frames)",
    )


def _with_add(row: Row, seconds: float, frames: int) -> Row:
    row.extra.update(add_us_per_frame=seconds / frames * 1e6, add_frames=frames)
    row.note += f"; add {seconds / frames * 1e6:.1f} us/frame"
    return row


def _game_rows(config: Config, data: atari.AtariSteps) -> list[Row]:
    game, rows = data.game, []
    tag = f"pixels.{slug(game)}"
    frames = int(data.frames.shape[0])
    buffers: dict[str, SequenceReplay] = {}
    for key, codec in (("lucid.raw", None), ("lucid.zstd", "zstd"), ("lucid.lz4", "lz4")):
        buffer, seconds = filled(data, codec)
        stored = buffer.memory_report()["fields"]["obs"]["stored_bytes"]
        label = dict(STORAGES)[key]
        rows.append(_with_add(_bytes_row(game, key, label, stored, data), seconds, frames))
        buffers[key] = buffer
    rows += _torchrl_rows(data)
    window, batch = reference_window(config), config.batch
    records = f"{batch}x{config.window_size} records, stack=4"
    with tempfile.TemporaryDirectory(prefix="lucid-pixels-") as folder:
        buffers["memmap"], _ = filled(data, None, storage="memmap", directory=f"{folder}/buffer")
        floor = StackedFloor(
            torch.from_numpy(data.frames), batch, config.window_size, seed=config.seed + 7
        )
        calls: dict[str, Callable[[], object]] = {
            f"{tag}.floor": floor,
            f"{tag}.raw": lambda: buffers["lucid.raw"].sample_windows(batch, window),
            f"{tag}.memmap": lambda: buffers["memmap"].sample_windows(batch, window),
        }
        timings = measure_rounds(calls, reps=config.reps, warmup=config.warmup)
        labels = {
            f"{tag}.floor": (
                f"{game}: floor, index_select of the same stacked bytes, out= ({records})"
            ),
            f"{tag}.raw": f"{game}: sample_windows, memory ({records})",
            f"{tag}.memmap": f"{game}: sample_windows, memmap, page cache warm ({records})",
        }
        rows += [_timed(name, labels[name], t, game) for name, t in timings.items()]
        del buffers["memmap"], floor, calls
        release()
    for key in ("lucid.raw", "lucid.zstd", "lucid.lz4"):
        codec = key.split(".")[1]
        iterator = buffers[key].iterate(batch, window, prefetch=2)
        try:
            timing = _iterated(iterator, config)
        finally:
            iterator.close()  # type: ignore[attr-defined]  # a generator
        label = f"{game}: iterate(prefetch=2), {codec} ({records}), time per batch"
        rows.append(_timed(f"{tag}.iterate.{codec}", label, timing, game))
        del buffers[key]
        release()
    return rows


def _iterated(iterator: Iterator[WindowBatch], config: Config) -> Timing:
    """Time per ``next`` (the learner doing nothing else): the producer's time per batch."""
    return measure(lambda: next(iterator), reps=config.reps, warmup=config.warmup)


def _timed(row_id: str, label: str, timing: Timing, game: str) -> Row:
    return Row.timed(row_id, label, timing, group=GROUP, extra={"game": game})


def _torchrl_rows(data: atari.AtariSteps) -> list[Row]:
    """TorchRL's ``LazyMemmapStorage`` of stacked observations and ``CompressedListStorage``
    of single frames, filled by ``extend`` with the transitions of ``data``."""
    game = data.game
    labels = dict(STORAGES)
    try:
        # no py.typed in either package
        from tensordict import TensorDict  # type: ignore[import-untyped]
        from torchrl.data import (  # type: ignore[import-untyped]
            CompressedListStorage,
            LazyMemmapStorage,
            ReplayBuffer,
        )
    except ImportError as error:
        return [
            Row.not_measured(
                f"pixels.{slug(game)}.bytes.{key}",
                f"{game}: {labels[key]}",
                f"torchrl not importable ({error})",
                group=BYTES_GROUP,
            )
            for key in ("torchrl.memmap", "torchrl.compressed")
        ]
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    frames = torch.from_numpy(data.frames)
    index = _transition_frames(data.lengths)  # each transition's observation, [T total]
    rows = []
    count = min(TORCHRL_MEMMAP_STEPS, index.shape[0])
    stacks = frames[_stack_index(data.lengths)[:count]]  # [count, 4, 84, 84]
    with tempfile.TemporaryDirectory(prefix="torchrl-pixels-") as folder:
        storage = LazyMemmapStorage(count, scratch_dir=folder)
        buffer = ReplayBuffer(storage=storage)
        began = time.perf_counter()
        buffer.extend(TensorDict({"obs": stacks}, batch_size=[count]))
        seconds = time.perf_counter() - began
        held = storage._storage  # the memory-mapped TensorDict
        stored = sum(t.numel() * t.element_size() for t in held.values(True, True))
        row = _bytes_row(game, "torchrl.memmap", labels["torchrl.memmap"], stored, data)
        per = stored / count
        row.extra["bytes_per_transition"] = per
        row.note = f"{per:,.0f} B/transition ({per / FRAME_BYTES:.3f} frames; {count:,} filled)"
        rows.append(_with_add(row, seconds, count))
        del buffer, storage, held
    del stacks
    storage = CompressedListStorage(int(index.shape[0]))
    buffer = ReplayBuffer(storage=storage)
    began = time.perf_counter()
    buffer.extend(TensorDict({"obs": frames[index]}, batch_size=[index.shape[0]]))
    seconds = time.perf_counter() - began
    label = labels["torchrl.compressed"]
    row = _bytes_row(game, "torchrl.compressed", label, int(storage.bytes()), data)
    rows.append(_with_add(row, seconds, int(index.shape[0])))
    return rows


def _transition_frames(lengths: np.ndarray) -> torch.Tensor:
    """Frame index of each transition's observation (each episode's first ``T`` frames)."""
    counts = torch.from_numpy(lengths)
    starts = torch.cumsum(counts + 1, 0) - (counts + 1)  # first frame of each episode
    step = torch.arange(int(counts.sum())) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    return torch.repeat_interleave(starts, counts) + step


def _stack_index(lengths: np.ndarray) -> torch.Tensor:
    """``[T total, 4]`` frame indices of each transition's stacked observation (frames before
    the episode's first repeat it, as ``FrameStackObservation``'s default padding)."""
    lengths_t = torch.from_numpy(lengths)
    starts = torch.repeat_interleave(torch.cumsum(lengths_t + 1, 0) - (lengths_t + 1), lengths_t)
    own = _transition_frames(lengths)
    back = own[:, None] + torch.arange(1 - STACK, 1)
    return torch.maximum(back, starts[:, None])
