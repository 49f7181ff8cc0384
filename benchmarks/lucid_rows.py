"""Rows measured on lucid_replay, the gather floor, and the memcpy reference for ``add``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch

from benchmarks.config import Config
from benchmarks.data import Dataset, cycled_episode, record_bytes
from benchmarks.floor import GatherFloor, RingCopy
from benchmarks.rows import Row, available_bytes
from benchmarks.timing import Timing, measure, measure_rounds
from lucid_replay import Episode, Mixture, PrioritizedSequenceReplay, Window


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


def sample_update(
    buffer: PrioritizedSequenceReplay, batch: int, window: Window, errors: torch.Tensor
) -> object:
    """One prioritized sample of ``batch`` windows, and the update of their priorities."""
    drawn = buffer.sample_windows(batch, window)
    return buffer.update_priorities_from(drawn, errors)


def fill(buffer: PrioritizedSequenceReplay, dataset: Dataset) -> None:
    for index in range(len(dataset.lengths)):
        steps, terminated = dataset.episode(index)
        buffer.add(Episode(steps, terminated=terminated))


def build(
    config: Config,
    dataset: Dataset,
    device: str = "cpu",
    *,
    segment_length: int | None = None,
) -> PrioritizedSequenceReplay:
    """The reference buffer (``segment_length``: stored in segments), filled with ``dataset``."""
    buffer = PrioritizedSequenceReplay(
        config.transitions,
        alpha=config.alpha,
        beta=config.beta,
        seed=config.seed,
        device=device,
        segment_length=segment_length,
    )
    fill(buffer, dataset)
    return buffer


def add_episode(config: Config, dataset: Dataset) -> Episode:
    steps = cycled_episode(dataset, 12_345, config.add_len, terminated=False)
    return Episode({k: v.clone() for k, v in steps.items()})


def sampling_rows(
    config: Config,
    floor: GatherFloor,
    buffer: PrioritizedSequenceReplay | None,
    huge_floor: GatherFloor | None = None,
) -> list[Row]:
    """The gather floor (both variants, and on huge pages given ``huge_floor``) and, given a
    buffer, lucid_replay's sampling rows.

    The floor, its preallocated variant and the two sample-only rows are timed in rounds
    (`measure_rounds`), so their ratios compare calls made under the same load. Sample +
    update is timed afterwards in rounds of its own with the floor (row ``floor.update``, the
    denominator of its bar): in the first rounds its priority updates would make the next
    prioritized sample-only call refresh its tree.
    """
    window = reference_window(config)
    errors = window_errors(config)
    batch = config.batch
    calls: dict[str, Callable[[], object]] = {
        "floor": floor,
        "floor.out": floor.into_preallocated(),
    }
    if huge_floor is not None:
        calls["floor.huge"] = huge_floor
    if buffer is not None:
        calls["lucid.uniform"] = lambda: buffer.sample_windows(batch, window, prioritized=False)
        calls["lucid.prioritized"] = lambda: buffer.sample_windows(batch, window)
    timings = measure_rounds(calls, reps=config.reps, warmup=config.warmup)
    records = f"{config.batch}x{config.window_size} records"
    extra: dict[str, object] = {"bytes": floor.gathered_bytes, "storage_bytes": floor.storage_bytes}
    note = (
        f"{floor.gathered_bytes / 1e6:.2f} MB gathered ({len(floor.storage)} fields) from "
        f"{floor.storage_bytes / 1e6:.0f} MB"
    )
    if buffer is not None:
        extra["buffer_data_bytes"] = data_bytes = buffer.memory_usage()["data_bytes"]
        if data_bytes != floor.storage_bytes:
            note += f" (the buffer's storage holds {data_bytes / 1e6:.0f} MB)"
    rows = [
        Row.timed(
            "floor",
            f"gather floor: index_select of {records}, outputs allocated per call",
            timings["floor"],
            note=note,
            extra=extra,
        ),
        Row.timed(
            "floor.out",
            f"gather floor, preallocated outputs (index_select out=) of {records}",
            timings["floor.out"],
            note=note,
        ),
    ]
    if huge_floor is not None:
        rows.append(
            Row.timed(
                "floor.huge",
                f"gather floor of {records} from memory in transparent huge pages, as the "
                "ring's fields are",
                timings["floor.huge"],
                note=note,
            )
        )
    if buffer is None:
        return rows

    prioritized_update = functools.partial(sample_update, buffer, batch, window, errors)
    beside_update = measure_rounds(
        {"floor": floor, "update": prioritized_update}, reps=config.reps, warmup=config.warmup
    )
    return [
        *rows,
        Row.timed(
            "floor.update",
            f"gather floor of {records}, timed in rounds with sample + update",
            beside_update["floor"],
            note=note,
        ),
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
            beside_update["update"],
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
        return sample_update(buffer, config.batch, window, errors)

    return step


def loop_row(config: Config, timing: Timing) -> Row:
    return Row.timed("lucid.loop", LOOP_LABEL.format(config.add_len), timing)


# TorchRL row id -> (lucid_replay row id, label) of the call timed beside it.
PAIRED = {
    "torchrl.loop": ("lucid.loop", LOOP_LABEL),
    "torchrl.uniform": (
        "lucid.uniform.paired",
        "lucid_replay sample_windows, uniform, in blocks beside TorchRL's",
    ),
    "torchrl.prioritized": (
        "lucid.prioritized.paired",
        "lucid_replay sample_windows, prioritized, in blocks beside TorchRL's",
    ),
}


def torchrl_partners(
    config: Config, buffer: PrioritizedSequenceReplay, episode: Episode
) -> dict[str, Callable[[], object]]:
    """By TorchRL row id, the lucid_replay call timed beside it (see `PAIRED`)."""
    window = reference_window(config)
    return {
        "torchrl.loop": loop_call(config, buffer, episode),
        "torchrl.uniform": lambda: buffer.sample_windows(config.batch, window, prioritized=False),
        "torchrl.prioritized": lambda: buffer.sample_windows(config.batch, window),
    }


def paired_rows(config: Config, timings: Mapping[str, Timing]) -> list[Row]:
    """The rows of the partners timed beside TorchRL's rows (by TorchRL row id)."""
    return [
        Row.timed(PAIRED[key][0], PAIRED[key][1].format(config.add_len), timing)
        for key, timing in timings.items()
    ]


def add_rows(config: Config, buffer: PrioritizedSequenceReplay, episode: Episode) -> list[Row]:
    """``add`` into a full buffer (evicting) next to copying the episode's bytes.

    The bar's baseline copies the bytes where an ``add`` must put them: into the next slots of
    a ring as large as the buffer's storage, so the destination is memory out of cache, as it
    is for ``add``. The two are timed in alternating blocks of ten calls, ``add_reps`` calls
    each: 100 calls of ~15 us span under 2 ms, less than the spells (a few to about 50 ms,
    on the 2-vCPU machine of the published runs) in which Python code ran up to 2x slower
    while a memory-bound copy did not, so two rows timed one after the other could each land
    in a different spell. The cache-hot copy (the same 69 kB source and destination every call)
    and the field-by-field copy are shown for reference, each timed alone.
    """
    reps, warmup = max(config.add_reps, 50), config.warmup
    memcpy_ring = RingCopy(config, episode.steps)
    nbytes = memcpy_ring.nbytes
    source = torch.empty(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8)
    destinations = {k: torch.empty_like(v) for k, v in episode.steps.items()}

    def memcpy_hot() -> None:
        target.copy_(source)

    def per_field() -> None:
        for name, values in episode.steps.items():
            destinations[name].copy_(values)

    fields = len(episode.steps)
    paired = measure_rounds(
        {"add": lambda: buffer.add(episode), "memcpy": memcpy_ring},
        reps=reps,
        warmup=warmup,
        block=10,
    )
    return [
        Row.timed(
            "add.lucid",
            f"lucid_replay add ({config.add_len}-step episode, full buffer)",
            paired["add"],
            group="add",
        ),
        memcpy_ring.row("add.memcpy", paired["memcpy"], group="add"),
        Row.timed(
            "add.memcpy_hot",
            f"memcpy of the same bytes into the same cache-hot {nbytes / 1e3:.0f} kB every call",
            measure(memcpy_hot, reps=reps, warmup=warmup),
            group="add",
        ),
        Row.timed(
            "add.copy_fields",
            f"copy of its bytes field by field ({fields} copy_, cache-hot)",
            measure(per_field, reps=reps, warmup=warmup),
            group="add",
        ),
    ]


def metadata_bytes(buffer: PrioritizedSequenceReplay) -> int:
    """Bytes beyond the user's data: the episode table and the cached sum trees."""
    usage = buffer.memory_usage()
    return usage["table_bytes"] + usage["tree_bytes"]


def memory_rows(config: Config, buffer: PrioritizedSequenceReplay, dataset: Dataset) -> list[Row]:
    """Bytes beyond the user's data, from ``memory_usage()`` and ``stats()``."""
    usage = buffer.memory_usage()
    episodes = buffer.stats()["episodes_stored"]
    per_episode = metadata_bytes(buffer) / episodes
    user_bytes = buffer.capacity * record_bytes(dataset.fields)
    per_transition = (usage["data_bytes"] - user_bytes) / buffer.capacity
    return [
        Row(
            "memory.lucid.episode",
            "lucid_replay metadata per stored episode (episode table + sum trees)",
            "memory",
            extra={
                "bytes_per_episode": per_episode,
                "table_bytes": usage["table_bytes"],
                "tree_bytes": usage["tree_bytes"],
                "episodes": episodes,
            },
            note=(
                f"{per_episode:.0f} B/episode: table {usage['table_bytes']:,} B + trees "
                f"{usage['tree_bytes']:,} B for {episodes:,} episodes (rows grow by powers of two)"
            ),
        ),
        Row(
            "memory.lucid.transition",
            "lucid_replay bytes per transition beyond the user's data",
            "memory",
            extra={"bytes_per_transition": per_transition},
            note=(
                f"{per_transition:.0f} B/transition (data_bytes {usage['data_bytes']:,} B for "
                f"{buffer.capacity:,} transitions of {record_bytes(dataset.fields)} B)"
            ),
        ),
    ]


def scaled_buffer(
    config: Config,
    capacity: int,
    lengths: Callable[[int], int],
    count: int,
    source: Dataset,
    *,
    segment_length: int | None = None,
    selector: Mixture | None = None,
) -> PrioritizedSequenceReplay:
    buffer = PrioritizedSequenceReplay(
        capacity,
        alpha=config.alpha,
        beta=config.beta,
        seed=config.seed,
        segment_length=segment_length,
        selector=selector,
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
    """The floor and lucid_replay with storage on ``device`` (e.g. CUDA), synchronised per
    call; "not measured" rows without one."""
    name = "a GPU" if device == "cpu" else device
    labels = {
        "device.floor": f"gather floor on {name}: index_select, outputs allocated per call",
        "device": f"lucid_replay on {name}: prioritized sample_windows + update_priorities_from",
    }
    reason = ""
    if device == "cpu":
        reason = "run with --device cuda"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        reason = "no GPU on this machine"
    if reason:
        return [Row.not_measured(k, v, reason, group="device") for k, v in labels.items()]
    buffer = build(config, dataset, device=device)
    floor = GatherFloor(config, dataset.fields, config.transitions, device=device)
    window = reference_window(config)
    errors = window_errors(config).to(device)

    cuda = torch.device(device).type == "cuda"

    def synchronised(call: Callable[[], object]) -> Callable[[], object]:
        def timed() -> None:
            call()
            if cuda:
                torch.cuda.synchronize()

        return timed

    step = functools.partial(sample_update, buffer, config.batch, window, errors)
    calls = {"device.floor": synchronised(floor), "device": synchronised(step)}
    timings = measure_rounds(calls, reps=config.reps, warmup=config.warmup)
    note = "storage on the device, synchronised per call"
    return [Row.timed(key, labels[key], timings[key], group="device", note=note) for key in calls]
