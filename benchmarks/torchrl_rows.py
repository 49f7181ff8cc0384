"""TorchRL 0.14.1 rows: the same data, the same 256 x 109 records, the same TD errors.

Each buffer gets its own ``LazyTensorStorage(capacity)`` filled with the reference data set
(written in two ``extend`` calls, so it wraps like a ring that has been running). ``Sequence``
(``episode_boundary="pad"``, ``done_key="done"``) caches episode boundaries per storage revision
(``cache_values=True`` inside ``Sequence.expand``); the slice samplers get ``cache_values=True``.
Sample-only rows run after warm-up calls without writes in between, so their boundary cache is
hot; the loop row writes every iteration, which invalidates it (as in training).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from benchmarks.config import Config
from benchmarks.data import Dataset
from benchmarks.rows import Only, Row, release
from benchmarks.timing import Timing, measure, measure_rounds

LABELS = {
    "torchrl.uniform": "TorchRL ReplayBuffer + Sequence, RandomSampler",
    "torchrl.prioritized": "TorchRL TensorDictReplayBuffer + Sequence, PrioritizedSampler",
    "torchrl.prioritized_update": (
        "TorchRL TensorDictReplayBuffer + Sequence, PrioritizedSampler + update_tensordict_priority"
    ),
    "torchrl.loop": "TorchRL loop: extend 256-step episode + sample + update",
    "torchrl.slice": "TorchRL SliceSampler(slice_len=109, cache_values=True)",
    "torchrl.prioritized_slice": (
        "TorchRL PrioritizedSliceSampler(slice_len=109, cache_values=True)"
    ),
}


def extension_error() -> str | None:
    """Why TorchRL's C++ extension (needed by the prioritized samplers) does not load, or None."""
    try:
        from torchrl._torchrl import SumSegmentTreeFp32  # type: ignore[import-untyped]  # noqa: F401
    except Exception as error:  # an ImportError or an undefined-symbol OSError
        text = str(error)
        return f"TorchRL C++ extension does not load with torch {torch.__version__}: " + (
            text if len(text) < 120 else text[:117] + "..."
        )
    return None


def torchrl_rows(
    config: Config,
    dataset: Dataset,
    errors: torch.Tensor,
    episode: dict[str, torch.Tensor],
    only: Only,
    partners: Mapping[str, Callable[[], object]] | None = None,
) -> tuple[list[Row], dict[str, Timing]]:
    """TorchRL's rows, and the timings of their ``partners`` (by TorchRL row id).

    A TorchRL row with a partner (lucid_replay's loop step for ``torchrl.loop``, its
    ``sample_windows`` for the sample-only rows) is timed in alternating blocks of 10 calls
    with it, so that the bar comparing the two compares calls made under the same load and
    the same cache conditions: each runs in its steady state (TorchRL's boundary cache hot,
    lucid_replay's own memory as its previous call left it). Partners of rows that are not
    measured have no timing.

    TorchRL is imported here, not at module level, so that the benchmarks import wherever
    lucid_replay does; its prioritized samplers need its C++ extension, which loads only with
    the torch it was built against (rows that need it report "not measured" otherwise).
    """
    partners = {} if partners is None else partners
    paired: dict[str, Timing] = {}
    try:
        # no py.typed in either package
        from tensordict import TensorDict  # type: ignore[import-untyped]
        from torchrl.data import (  # type: ignore[import-untyped]
            LazyTensorStorage,
            ReplayBuffer,
            TensorDictReplayBuffer,
        )
        from torchrl.data.replay_buffers import (  # type: ignore[import-untyped]
            PrioritizedSampler,
            PrioritizedSliceSampler,
            RandomSampler,
            Sequence,
            SliceSampler,
        )
    except ImportError as error:
        return [
            Row.not_measured(k, v, f"torchrl not importable ({error})") for k, v in LABELS.items()
        ], paired
    logging.getLogger("torchrl").setLevel(logging.WARNING)

    capacity = config.transitions
    data = TensorDict(dict(dataset.fields), batch_size=[dataset.num_transitions])
    new_episode = TensorDict(dict(episode), batch_size=[len(episode["obs"])])
    flat_errors = errors.reshape(-1)
    records = config.batch * config.window_size
    reps, warmup = config.reps, config.warmup
    broken = extension_error()

    def buffer(kind: type, sampler: Any, *, unit: Any = None, batch: int, **kw: Any) -> Any:
        rb = kind(
            storage=LazyTensorStorage(capacity),
            sampler=sampler,
            sample_unit=unit,
            batch_size=batch,
            **kw,
        )
        rb.extend(data[:capacity])
        rb.extend(data[capacity:])
        return rb

    def sequence() -> Any:
        return Sequence(
            length=config.length,
            burn_in=config.burn_in,
            bootstrap=config.bootstrap,
            dilation=config.dilation,
            done_key="done",
        )

    def timed(row_id: str, call: Callable[[], object]) -> Timing:
        """``call``'s timing: beside its partner in blocks of 10 if it has one, else alone."""
        if row_id not in partners:
            return measure(call, reps=reps, warmup=warmup)
        calls = {row_id: call, "partner": partners[row_id]}
        timings = measure_rounds(calls, block=10, reps=reps, warmup=warmup)
        paired[row_id] = timings["partner"]
        return timings[row_id]

    def sample_row(row_id: str, sample: Callable[[], object], note: str) -> Row:
        """Time a sample-only call (no writes: a ``Sequence`` boundary cache stays hot)."""
        return Row.timed(row_id, LABELS[row_id], timed(row_id, sample), note=note)

    rows: list[Row] = []
    if only("torchrl.uniform"):
        rb = buffer(ReplayBuffer, RandomSampler(), unit=sequence(), batch=config.batch)
        uniform = functools.partial(rb.sample, return_info=True)  # as Sequence's masks need
        rows.append(sample_row("torchrl.uniform", uniform, "hot boundary cache"))
        del rb
        release()

    prioritized = ("torchrl.prioritized", "torchrl.prioritized_update", "torchrl.loop")
    if any(only(k) for k in prioritized):
        if broken:
            rows += [Row.not_measured(k, LABELS[k], broken) for k in prioritized if only(k)]
        else:
            rb = buffer(
                TensorDictReplayBuffer,
                PrioritizedSampler(capacity, config.alpha, config.beta),
                unit=sequence(),
                batch=config.batch,
                priority_key="td_error",
            )

            def sample_update() -> None:
                sample = rb.sample()
                sample.set("td_error", flat_errors)
                rb.update_tensordict_priority(sample)

            def loop() -> None:
                rb.extend(new_episode)
                sample_update()

            if only("torchrl.prioritized"):
                rows.append(sample_row("torchrl.prioritized", rb.sample, "hot boundary cache"))
            if only("torchrl.prioritized_update"):
                rows.append(
                    Row.timed(
                        "torchrl.prioritized_update",
                        LABELS["torchrl.prioritized_update"],
                        measure(sample_update, reps=reps, warmup=warmup),
                        note="hot boundary cache",
                    )
                )
            if only("torchrl.loop"):
                rows.append(
                    Row.timed(
                        "torchrl.loop",
                        LABELS["torchrl.loop"],
                        timed("torchrl.loop", loop),
                        note="each extend invalidates the boundary cache",
                    )
                )
            del rb
            release()

    slice_kw = {"slice_len": config.window_size, "end_key": "done", "cache_values": True}
    slice_kw["truncated_key"] = None
    if only("torchrl.slice"):
        rb = buffer(ReplayBuffer, SliceSampler(**slice_kw), batch=records)
        note = "reference only: contiguous slices, no burn-in/bootstrap masks"
        rows.append(sample_row("torchrl.slice", rb.sample, note))
        del rb
        release()
    if only("torchrl.prioritized_slice"):
        if broken:
            rows.append(
                Row.not_measured(
                    "torchrl.prioritized_slice", LABELS["torchrl.prioritized_slice"], broken
                )
            )
        else:
            sampler = PrioritizedSliceSampler(
                max_capacity=capacity, alpha=config.alpha, beta=config.beta, **slice_kw
            )
            rb = buffer(ReplayBuffer, sampler, batch=records)
            rows.append(sample_row("torchrl.prioritized_slice", rb.sample, "reference only"))
            del rb
            release()
    return rows, paired


def torchrl_memory_row(config: Config) -> Row:
    """What TorchRL keeps beyond the data, from its documented layout (not measured live)."""
    per_transition = 2 * 2 * 4  # float32 SumSegmentTree + MinSegmentTree, 2 nodes per leaf
    return Row(
        "memory.torchrl.transition",
        "TorchRL PrioritizedSampler bytes per transition beyond the data (layout estimate)",
        "memory",
        extra={"bytes_per_transition": per_transition},
        note=(
            "~16 B/transition: float32 sum + min segment trees over capacity (priorities are "
            "per transition); plus Sequence's cached boundaries, 3 x int64 per episode"
        ),
    )
