"""Run the benchmark suite: ``python -m benchmarks.run [--quick] [--threads 1,default] ...``.

Each pass measures every row in one fresh process: a stock user process, with glibc's
malloc untouched and one torch thread count (``1``, or ``default``: torch's own count, not
set). By default there are two passes, ``--threads 1,default``; ``--tuned-malloc`` adds the
same passes with a tuned allocator, reported beside them. Rows report min and median of
``--reps`` timed calls after warm-up, and minor page faults per call. The passes are merged
into ``benchmarks/results/results.json`` (``quick.json`` with ``--quick``) and a plot next to
it, and the report is printed as markdown (``--page`` also writes it into the page).

The ``pixels`` group (`benchmarks.pixel_rows`) measures real Atari frames cached by
``python -m benchmarks.atari`` (collected on first use when ale-py is installed, else not
measured): about three minutes a pass on two cores, mostly loading 3 x 1.4 GB of frames,
with at most 10 timed calls per row, ``--quick`` or not. ``--only pixels --threads 1`` runs
it alone, in one pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import (
    environment,
    lucid_rows,
    naive,
    pixel_rows,
    report,
    results_file,
    scaling,
    segment_rows,
    selection_rows,
    selector_rows,
    torchrl_rows,
)
from benchmarks.bars import evaluate
from benchmarks.config import QUICK, REFERENCE, Config
from benchmarks.data import cycled_episode, reference_dataset
from benchmarks.floor import GatherFloor
from benchmarks.results_file import Pass
from benchmarks.rows import Row, release
from benchmarks.timing import measure

GROUPS = (
    "floor",
    "lucid",
    "naive",
    "torchrl",
    "add",
    "memory",
    "segments",
    "selection",
    "scale.T",
    "scale.E",
    "selectors",
    "device",
    "pixels",
)
DEFAULT = "default"
ROOT = Path(__file__).resolve().parent.parent


def _threads(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    for item in items:
        if item != DEFAULT and not (item.isdigit() and int(item) >= 1):
            raise argparse.ArgumentTypeError(f"thread counts are positive ints or {DEFAULT!r}")
    if not items:
        raise argparse.ArgumentTypeError("give at least one thread count")
    return items


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    add = parser.add_argument
    add("--quick", action="store_true", help="small config (about 20 s a pass), for development")
    add("--device", default="cpu", help="also measure with storage on this device (e.g. cuda)")
    add(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions per row (>= 20 for a reference run)",
    )
    add("--only", default="", help=f"comma-separated row prefixes among {', '.join(GROUPS)}")
    add(
        "--threads",
        type=_threads,
        default=["1", DEFAULT],
        help=f"comma-separated torch thread counts, one pass each; {DEFAULT!r} is torch's own "
        "count (default: 1,default)",
    )
    add(
        "--tuned-malloc",
        action="store_true",
        help="also run every pass with glibc's mmap/trim thresholds fixed (reported beside)",
    )
    add("--out", type=Path, default=Path(__file__).parent / "results", help="results folder")
    add(
        "--page",
        type=Path,
        default=None,
        help="write the report into this page's markers (full reference runs only)",
    )
    # Internal: run one pass in this process and write it to this JSON file.
    add("--pass-json", type=Path, default=None, help=argparse.SUPPRESS)
    add(
        "--allocator",
        choices=(environment.STOCK, environment.TUNED),
        default=environment.STOCK,
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args(argv)
    if args.page is not None and (args.quick or args.only):
        # `make bench BENCH_ARGS=--quick` passes --page too: measure, but leave the page alone.
        print(f"not writing {args.page}: it shows a full reference run", file=sys.stderr)
        args.page = None
    return args


def _config(args: argparse.Namespace) -> Config:
    config = QUICK if args.quick else REFERENCE
    return config if args.reps is None else dataclasses.replace(config, reps=args.reps)


def measure_pass(args: argparse.Namespace) -> Pass:
    """Every selected row, in this process, with this pass's threads and allocator."""
    config = _config(args)
    prefixes = [p.strip() for p in args.only.split(",") if p.strip()]

    def only(row_id: str) -> bool:
        return not prefixes or any(row_id.startswith(p) for p in prefixes)

    (threads,) = args.threads
    if threads != DEFAULT:
        torch.set_num_threads(int(threads))
    tuned = args.allocator == environment.TUNED
    allocator = environment.tune_malloc() if tuned else environment.stock_malloc()
    load_before = os.getloadavg()
    began = time.perf_counter()
    torch.manual_seed(config.seed)

    def log(message: str) -> None:
        tag = f"{torch.get_num_threads()} thread(s), {args.allocator}"
        print(
            f"[{time.perf_counter() - began:6.1f} s, {tag}] {message}", file=sys.stderr, flush=True
        )

    rows: list[Row] = []
    if only("pixels"):
        log("pixels: real Atari frames, stacks, codecs, memmap, beside TorchRL's storages")
        rows += pixel_rows.pixel_rows(config, only)
    if not any(only(group) for group in GROUPS if group != "pixels"):
        return _pass(args, threads, allocator, load_before, began, rows)
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
        floor = GatherFloor(config, dataset.fields, config.transitions)
        huge = GatherFloor(config, dataset.fields, config.transitions, huge_pages=True)
        sampled = buffer if only("lucid") else None
        rows += [r for r in lucid_rows.sampling_rows(config, floor, sampled, huge) if only(r.id)]
        del floor, huge
    if needs_buffer and only("memory"):
        rows += lucid_rows.memory_rows(config, buffer, dataset)
        rows.append(torchrl_rows.torchrl_memory_row(config))
    if only("naive"):
        log("naive baseline")
        rows += naive.naive_rows(config, dataset, errors, episode_steps)
    if needs_buffer:
        episode = lucid_rows.add_episode(config, dataset)
    if only("torchrl"):
        log("TorchRL (each row with a lucid_replay partner in rounds with it)")
        partners = lucid_rows.torchrl_partners(config, buffer, episode) if needs_buffer else {}
        torchrl, paired = torchrl_rows.torchrl_rows(
            config, dataset, errors, episode_steps, only, partners
        )
        rows += torchrl
        rows += [r for r in lucid_rows.paired_rows(config, paired) if only(r.id)]
    if needs_buffer:
        if only("lucid.loop") and not any(r.id == "lucid.loop" for r in rows):
            log("lucid_replay loop")
            step = lucid_rows.loop_call(config, buffer, episode)
            timing = measure(step, reps=config.reps, warmup=config.warmup)
            rows.append(lucid_rows.loop_row(config, timing))
        if only("add"):
            log("add")
            rows += lucid_rows.add_rows(config, buffer, episode)
        del buffer
        release()
    if only("segments"):
        log("streamed segments: windows across seams, append, an endless stream's memory")
        rows += segment_rows.segment_rows(config, dataset, only)
    if only("selection"):
        log("selection policies: draws without replacement, epochs")
        rows += selection_rows.selection_rows(config, dataset, only)
    if only("scale.T"):
        log("scaling over transitions")
        rows += scaling.transition_rows(config, dataset, only)
    if only("scale.E"):
        log("scaling over episodes")
        rows += scaling.episode_rows(config, dataset, only)
    if only("selectors"):
        log("selectors: a three-way mixture beside Prioritized() alone, over transitions")
        rows += selector_rows.selector_rows(config, dataset, only)
    if only("device"):
        rows += lucid_rows.device_rows(config, dataset, args.device)
    return _pass(args, threads, allocator, load_before, began, rows)


def _pass(
    args: argparse.Namespace,
    threads: str,
    allocator: str,
    load_before: tuple[float, float, float],
    began: float,
    rows: list[Row],
) -> Pass:
    return Pass(
        threads=torch.get_num_threads(),
        torch_default=threads == DEFAULT,
        allocator=args.allocator,
        allocator_detail=allocator,
        load_before=list(load_before),
        load_after=list(os.getloadavg()),
        wall_s=round(time.perf_counter() - began, 1),
        rows=rows,
        bars=evaluate(rows),
    )


def _plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The passes to run: (threads, allocator), without a repeated thread count."""
    default = torch.get_num_threads()
    counts: dict[int, str] = {}
    for item in args.threads:
        count = default if item == DEFAULT else int(item)
        if count not in counts or item == DEFAULT:
            counts[count] = item
    allocators = [environment.STOCK] + ([environment.TUNED] if args.tuned_malloc else [])
    return [(item, allocator) for allocator in allocators for item in counts.values()]


def _spawn(args: argparse.Namespace, threads: str, allocator: str, target: Path) -> Pass:
    """Run one pass in a fresh interpreter (a stock process) and read it back."""
    command = [sys.executable, "-m", "benchmarks.run", "--pass-json", str(target)]
    command += ["--threads", threads, "--allocator", allocator, "--device", args.device]
    command += ["--only", args.only] if args.only else []
    command += ["--reps", str(args.reps)] if args.reps is not None else []
    command += ["--quick"] if args.quick else []
    subprocess.run(command, check=True, cwd=ROOT)
    _, (measured,) = results_file.read(target)
    return measured


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.pass_json is not None:
        measured = measure_pass(args)
        results_file.write(args.pass_json, {}, [measured])
        return 0
    from benchmarks.plot import plot

    began = time.perf_counter()
    date = environment.now()
    passes = []
    with tempfile.TemporaryDirectory() as folder:
        for index, (threads, allocator) in enumerate(_plan(args)):
            target = Path(folder) / f"pass-{index}.json"
            passes.append(_spawn(args, threads, allocator, target))
    shown = sys.argv[1:] if argv is None else argv
    meta = {
        "command": "python -m benchmarks.run" + (" " + shlex.join(shown) if shown else ""),
        "date": date,
        "wall_s": round(time.perf_counter() - began, 1),
        "machine": environment.machine(),
        "config": dataclasses.asdict(_config(args)),
        "quick": args.quick,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / ("quick.json" if args.quick else "results.json")
    results_file.write(results, meta, passes)
    print(report.render(results, page=args.page, draw=plot))
    print(f"wrote {results} and {results.with_suffix('.png').name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
