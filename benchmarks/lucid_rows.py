"""Rows measured on lucid_replay, the gather floor, and the memcpy reference for ``add``."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from benchmarks.config import Config
from benchmarks.data import Dataset, cycled_episode, record_bytes
from benchmarks.rows import Row, available_bytes
from benchmarks.timing import Timing, measure, measure_rounds
from lucid_replay import Episode, PrioritizedSequenceReplay, Window


def reference_window(config: Config, *, allow_partial: bool = False) -> Window:
    return Window(
        config.length,
        burn_in=config.burn_in,
        bootstrap=config.bootstrap,
        dilation=config.dilation,
        allow_partial=allow_partial,
    )


def window_errors(config: Config, seed: int = 1) -> torch.Tensor:
    """Per-record TD errors ``[B, W]`` fed to every priority update (same for all backends)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(config.batch, config.window_size, generator=generator)


def fill(buffer: PrioritizedSequenceReplay, dataset: Dataset) -> None:
    for index in range(len(dataset.lengths)):
        steps, terminated = dataset.episode(index)
        buffer.add(Episode(steps, terminated=terminated))


def build(config: Config, dataset: Dataset, device: str = "cpu") -> PrioritizedSequenceReplay:
    buffer = PrioritizedSequenceReplay(
        config.transitions, alpha=config.alpha, beta=config.beta, seed=config.seed, device=device
    )
    fill(buffer, dataset)
    return buffer


def add_episode(config: Config, dataset: Dataset) -> Episode:
    steps = cycled_episode(dataset, 12_345, config.add_len, terminated=False)
    return Episode({k: v.clone() for k, v in steps.items()})


def floor_call(config: Config, dataset: Dataset) -> Callable[[], object]:
    """One ``index_select`` per field of ``B x W`` records from preallocated flat tensors.

    Each call gathers a fresh set of random windows (64 index sets prepared beforehand and
    cycled), so the floor reads cold memory as a sampler does rather than re-reading 7.6 MB
    that the previous call left in cache.
    """
    generator = torch.Generator().manual_seed(config.seed + 7)
    span = 1 + config.dilation * (config.window_size - 1)
    record = torch.arange(config.window_size) * config.dilation
    indices = [
        (
            torch.randint(0, dataset.num_transitions - span, (config.batch, 1), generator=generator)
            + record
        ).reshape(-1)
        for _ in range(64)
    ]
    fields = dataset.fields
    calls = itertools.count()

    def gather() -> dict[str, torch.Tensor]:
        index = indices[next(calls) % len(indices)]
        return {k: v.index_select(0, index) for k, v in fields.items()}

    return gather


def sampling_rows(
    config: Config, dataset: Dataset, buffer: PrioritizedSequenceReplay | None
) -> list[Row]:
    """The gather floor and, given a buffer, lucid_replay's ``sample_windows`` rows.

    The floor and the two sample-only rows are timed in rounds (`measure_rounds`), so their
    ratios compare calls made under the same load. Sample + update runs on its own
    afterwards: its priority updates would make the next prioritized draw refresh its tree.
    """
    window = reference_window(config)
    errors = window_errors(config)
    batch = config.batch
    calls: dict[str, Callable[[], object]] = {"floor": floor_call(config, dataset)}
    if buffer is not None:
        calls["lucid.uniform"] = lambda: buffer.sample_windows(batch, window, prioritized=False)
        calls["lucid.prioritized"] = lambda: buffer.sample_windows(batch, window)
    timings = measure_rounds(calls, reps=config.reps, warmup=config.warmup)
    moved = config.batch * config.window_size * record_bytes(dataset.fields)
    rows = [
        Row.timed(
            "floor",
            f"gather floor: index_select of {config.batch}x{config.window_size} records",
            timings["floor"],
            note=f"{moved / 1e6:.2f} MB gathered ({len(dataset.fields)} fields)",
            extra={"bytes": moved},
        )
    ]
    if buffer is None:
        return rows

    def prioritized_update() -> object:
        drawn = buffer.sample_windows(batch, window)
        return buffer.update_priorities_from(drawn, errors)

    return [
        *rows,
        Row.timed(
            "lucid.uniform", "lucid_replay sample_windows, uniform", timings["lucid.uniform"]
        ),
        Row.timed(
            "lucid.prioritized",
            "lucid_replay sample_windows, prioritized",
            timings["lucid.prioritized"],
        ),
        Row.timed(
            "lucid.prioritized_update",
            "lucid_replay prioritized sample_windows + update_priorities_from",
            measure(prioritized_update, reps=config.reps, warmup=config.warmup),
        ),
    ]


LOOP_LABEL = "lucid_replay loop: add {}-step episode + sample + update"


def loop_call(
    config: Config, buffer: PrioritizedSequenceReplay, episode: Episode
) -> Callable[[], object]:
    """One training-loop step: add an episode, sample windows, route their errors."""
    window = reference_window(config)
    errors = window_errors(config)

    def step() -> object:
        buffer.add(episode)
        drawn = buffer.sample_windows(config.batch, window)
        return buffer.update_priorities_from(drawn, errors)

    return step


def loop_row(config: Config, timing: Timing) -> Row:
    return Row.timed("lucid.loop", LOOP_LABEL.format(config.add_len), timing)


def add_rows(config: Config, buffer: PrioritizedSequenceReplay, episode: Episode) -> list[Row]:
    """``add`` into a full buffer (evicting) next to copying the episode's bytes.

    The bar's baseline copies the bytes where an ``add`` must put them: into the next slots of
    a ring as large as the buffer's storage, so the destination is memory last written a
    whole ring ago, as it is for ``add``. The cache-hot copy (the same 69 kB source and
    destination every call) and the field-by-field copy are shown for reference.
    """
    common = {"reps": max(config.reps, 50), "warmup": config.warmup}
    nbytes = sum(t.numel() * t.element_size() for t in episode.steps.values())
    source = torch.empty(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8)
    ring_bytes = config.transitions * record_bytes(dict(episode.steps))
    ring = torch.ones(ring_bytes // nbytes * nbytes, dtype=torch.uint8)  # touched: no page faults
    position = itertools.cycle(range(0, ring.numel(), nbytes))
    destinations = {k: torch.empty_like(v) for k, v in episode.steps.items()}

    def memcpy_ring() -> None:
        begin = next(position)
        ring[begin : begin + nbytes].copy_(source)

    def memcpy_hot() -> None:
        target.copy_(source)

    def per_field() -> None:
        for name, values in episode.steps.items():
            destinations[name].copy_(values)

    fields = len(episode.steps)
    return [
        Row.timed(
            "add.lucid",
            f"lucid_replay add ({config.add_len}-step episode, full buffer)",
            measure(lambda: buffer.add(episode), **common),
            group="add",
        ),
        Row.timed(
            "add.memcpy",
            f"memcpy of its {nbytes / 1e3:.1f} kB into the next slots of a "
            f"{ring.numel() / 1e6:.0f} MB ring (one contiguous copy_)",
            measure(memcpy_ring, **common),
            group="add",
            extra={"bytes": nbytes, "ring_bytes": ring.numel()},
        ),
        Row.timed(
            "add.memcpy_hot",
            f"memcpy of the same bytes into the same cache-hot {nbytes / 1e3:.0f} kB every call",
            measure(memcpy_hot, **common),
            group="add",
        ),
        Row.timed(
            "add.copy_fields",
            f"copy of its bytes field by field ({fields} copy_, cache-hot)",
            measure(per_field, **common),
            group="add",
        ),
    ]


def memory_rows(config: Config, buffer: PrioritizedSequenceReplay) -> list[Row]:
    """Bytes beyond the user's data, read off the buffer's own tensors."""
    table = buffer._core.store.table
    table_bytes = sum(t.numel() * t.element_size() for t in table.columns.values())
    tree_bytes = buffer._core.sampler.tree_bytes()
    ring = buffer._core.store.ring.fields
    ring_bytes = sum(t.numel() * t.element_size() for t in ring.values())
    user_bytes = buffer.capacity * sum(t[0].numel() * t.element_size() for t in ring.values())
    episodes = buffer.num_episodes
    per_row = table_bytes / table.row_count
    trees = len(buffer._core.sampler._trees)
    return [
        Row(
            "memory.lucid.episode",
            "lucid_replay metadata per stored episode (table + sum trees)",
            "memory",
            extra={
                "bytes_per_episode": (table_bytes + tree_bytes) / episodes,
                "table_bytes_per_row": per_row,
                "tree_bytes_per_row": tree_bytes / table.row_count,
                "trees": trees,
                "rows_allocated": table.row_count,
                "episodes": episodes,
            },
            note=(
                f"{(table_bytes + tree_bytes) / episodes:.0f} B/episode: table "
                f"{per_row:.0f} B/row, {trees} sum tree(s) of 16 B/row; "
                f"{table.row_count} rows for {episodes} episodes (power-of-two growth)"
            ),
        ),
        Row(
            "memory.lucid.transition",
            "lucid_replay bytes per transition beyond the user's data",
            "memory",
            extra={"bytes_per_transition": (ring_bytes - user_bytes) / buffer.capacity},
            note=f"{(ring_bytes - user_bytes) / buffer.capacity:.0f} B/transition",
        ),
    ]


def scaled_buffer(
    config: Config, capacity: int, lengths: Callable[[int], int], count: int, source: Dataset
) -> PrioritizedSequenceReplay:
    buffer = PrioritizedSequenceReplay(
        capacity, alpha=config.alpha, beta=config.beta, seed=config.seed
    )
    offset = 0
    for index in range(count):
        length = lengths(index)
        steps = cycled_episode(source, offset, length, terminated=bool(index % 2))
        buffer.add(Episode(steps, terminated=bool(index % 2)))
        offset += length
    return buffer


def fits(config: Config, transitions: int, copies: float = 1.5) -> bool:
    per = config.obs_dim * 4 + 8 + 4 + 3
    return transitions * per * copies < available_bytes()


def device_rows(config: Config, dataset: Dataset, device: str) -> list[Row]:
    """lucid_replay with storage on ``device`` (e.g. CUDA), once; "not measured" without one."""
    label = f"lucid_replay on {device}: prioritized sample_windows + update_priorities_from"
    if device == "cpu":
        return [Row.not_measured("device", label, "run with --device cuda", group="device")]
    if device.startswith("cuda") and not torch.cuda.is_available():
        return [Row.not_measured("device", label, "no GPU on this machine", group="device")]
    buffer = build(config, dataset, device=device)
    window = reference_window(config)
    errors = window_errors(config).to(device)

    def step() -> None:
        drawn = buffer.sample_windows(config.batch, window)
        buffer.update_priorities_from(drawn, errors)
        torch.cuda.synchronize()

    row = Row.timed(
        "device",
        label,
        measure(step, reps=config.reps, warmup=config.warmup),
        group="device",
        note="storage on the device, synchronised per call",
    )
    return [row]
