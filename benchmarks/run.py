"""Run the benchmark suite: ``python -m benchmarks.run [--quick] [--device cuda] [--only ...]``.

Every row is measured in this one process, on this machine: min and median of ``--reps``
timed calls after warm-up. Writes ``benchmarks/results/results.json`` (or ``quick.json``),
a PNG plot next to it, and prints the markdown tables.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import lucid_rows, naive_rows, report, scaling, torchrl_rows
from benchmarks.config import QUICK, REFERENCE, Config
from benchmarks.data import cycled_episode, reference_dataset
from benchmarks.rows import Row, release
from benchmarks.timing import measure

GROUPS = ("floor", "lucid", "naive", "torchrl", "add", "memory", "scale.T", "scale.E", "device")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="small config (< 60 s), for development"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="also measure lucid_replay with storage on this device (e.g. cuda)",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions per row (>= 20 for the reference run)",
    )
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated row prefixes among {', '.join(GROUPS)} (default: all)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) before measuring (default: leave torch's default)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results", help="results folder"
    )
    parser.add_argument(
        "--glibc-malloc-defaults",
        action="store_true",
        help="keep glibc's malloc thresholds (see steady_malloc): every row that allocates "
        "multi-MB outputs then pays page faults on a random share of its calls",
    )
    return parser.parse_args(argv)


def steady_malloc() -> str:
    """Make glibc keep freed batch memory for reuse instead of returning it to the kernel.

    With the default, dynamic thresholds, glibc now and then trims the 7.5 MB that a freed
    batch leaves at the top of the heap, and the next batch faults ~1,800 fresh pages back in
    (about +2.5 ms on this machine). Which calls pay depends on the order of allocations, so
    the penalty lands at random on a quarter of the calls of one row and on almost none of
    another's. Fixed thresholds apply to every row alike (floor, lucid_replay, TorchRL,
    naive); PyTorch's CPU performance guide recommends a caching allocator for the same
    reason. Returns what was set, for the results' metadata.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        # mallopt(M_MMAP_THRESHOLD = -3), mallopt(M_TRIM_THRESHOLD = -1); 1 means success
        if libc.mallopt(-3, 64 << 20) == 1 and libc.mallopt(-1, 512 << 20) == 1:
            return "glibc mallopt: mmap threshold 64 MiB, trim threshold 512 MiB"
    except OSError:
        pass
    return "allocator defaults (glibc mallopt not available)"


def machine() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as file:
            model = next(
                (line.split(":", 1)[1].strip() for line in file if line.startswith("model name")),
                "",
            )
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as file:
            memory = int(file.readline().split()[1]) * 1024
    except OSError:
        memory = 0
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(memory / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        **torchrl_rows.versions(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    config: Config = QUICK if args.quick else REFERENCE
    if args.reps is not None:
        config = dataclasses.replace(config, reps=args.reps)
    prefixes = [p.strip() for p in args.only.split(",") if p.strip()]

    def only(row_id: str) -> bool:
        return not prefixes or any(row_id.startswith(p) for p in prefixes)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    allocator = "glibc defaults" if args.glibc_malloc_defaults else steady_malloc()
    load_before = os.getloadavg()
    began = time.perf_counter()
    torch.manual_seed(config.seed)
    rows: list[Row] = []

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f} s] {message}", file=sys.stderr, flush=True)

    log(f"data set: >= {config.transitions} transitions, {config.min_len}..{config.max_len} steps")
    dataset = reference_dataset(config)
    errors = lucid_rows.window_errors(config)
    steps = cycled_episode(dataset, 12_345, config.add_len, terminated=False)
    episode_steps = {k: v.clone() for k, v in steps.items()}

    needs_buffer = any(only(p) for p in ("lucid", "memory", "add"))
    if needs_buffer:
        log("lucid_replay: filling the reference buffer")
        buffer = lucid_rows.build(config, dataset)
    if only("floor") or only("lucid"):
        log("gather floor and lucid_replay sampling, in rounds")
        sampled = buffer if only("lucid") else None
        rows += [row for row in lucid_rows.sampling_rows(config, dataset, sampled) if only(row.id)]
    if needs_buffer and only("memory"):
        rows += lucid_rows.memory_rows(config, buffer)
        rows.append(torchrl_rows.torchrl_memory_row(config))
    if only("naive"):
        log("naive baseline")
        rows += naive_rows.naive_rows(config, dataset, errors, episode_steps)
    loop_timing = None
    if needs_buffer:
        episode = lucid_rows.add_episode(config, dataset)
    if only("torchrl"):
        log("TorchRL (its loop in rounds with lucid_replay's)")
        partner = lucid_rows.loop_call(config, buffer, episode) if only("lucid.loop") else None
        torchrl, loop_timing = torchrl_rows.torchrl_rows(
            config, dataset, errors, episode_steps, only, partner
        )
        rows += torchrl
    if needs_buffer:
        if only("lucid.loop"):
            if loop_timing is None:
                log("lucid_replay loop")
                step = lucid_rows.loop_call(config, buffer, episode)
                loop_timing = measure(step, reps=config.reps, warmup=config.warmup)
            rows.append(lucid_rows.loop_row(config, loop_timing))
        if only("add"):
            log("add")
            rows += lucid_rows.add_rows(config, buffer, episode)
        del buffer
        release()
    if only("scale.T"):
        log("scaling over transitions")
        rows += scaling.transition_rows(config, dataset, only)
    if only("scale.E"):
        log("scaling over episodes")
        rows += scaling.episode_rows(config, dataset, only)
    if only("device"):
        rows += lucid_rows.device_rows(config, dataset, args.device)

    bars = report.evaluate(rows)
    command = "python -m benchmarks.run" + (
        ""
        if argv is None and len(sys.argv) <= 1
        else " " + shlex.join(sys.argv[1:] if argv is None else argv)
    )
    meta = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - began, 1),
        "machine": {**machine(), "allocator": allocator},
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "config": dataclasses.asdict(config),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "quick" if args.quick else "results"
    report.write_json(args.out / f"{name}.json", meta, rows, bars)
    info = meta["machine"]
    title = (
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']} "
        f"({info['torch_threads']} threads), torchrl {info.get('torchrl', '?')}; {command}"
    )
    report.plot(args.out / f"{name}.png", rows, title)
    print(f"Machine: {title}\nAllocator: {allocator}\n")
    print(report.markdown(rows, bars))
    log(f"wrote {args.out / (name + '.json')} and {name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
