"""Profile lucid_replay's hot paths: ``python -m benchmarks.tools.profile_hot [--quick]``.

cProfile (per Python function, and per torch call made from Python) and torch.profiler (per
aten op) over ``--calls`` calls each of: uniform ``sample_windows``, prioritized
``sample_windows``, ``update_priorities_from`` on a drawn batch, and ``add`` of a 256-step
episode into the full reference buffer. Writes ``benchmarks/results/profile.txt``.

``--cold`` makes a call of the cold gather floor before every profiled call, outside the
profile and the timing, as the floor bars' rounds do: every path then starts from caches
that a 7.5 MB gather evicted, as in a training loop, where the fixed cost of many small
calls is several times what the same calls cost back to back. It writes
``profile_cold.txt``, with the cProfile tables only (torch.profiler cannot leave the floor's
own aten ops out).

A tool, not a benchmark: the runner does not call it, and no bar reads its output. Like the
runner, it profiles a stock process unless ``--tuned-malloc`` is given.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import environment, lucid_rows
from benchmarks.config import QUICK, REFERENCE
from benchmarks.data import reference_dataset
from benchmarks.floor import GatherFloor


def _cprofile(
    call: Callable[[], object], calls: int, top: int, before: Callable[[], object]
) -> str:
    profiler = cProfile.Profile()
    for _ in range(calls):
        before()
        profiler.enable()
        call()
        profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}({name})" if line else name
        rows.append((tottime, cumtime, ncalls, where))
    rows.sort(reverse=True)
    out = io.StringIO()
    out.write(f"{'self us/call':>13} {'cum us/call':>12} {'calls/call':>10}  function\n")
    for tottime, cumtime, ncalls, where in rows[:top]:
        out.write(
            f"{tottime / calls * 1e6:13.1f} {cumtime / calls * 1e6:12.1f} "
            f"{ncalls / calls:10.1f}  {where}\n"
        )
    return out.getvalue()


def _torch_profile(call: Callable[[], object], calls: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    out = io.StringIO()
    out.write(f"{'self us/call':>13} {'count/call':>10}  aten op\n")
    for event in events[:top]:
        out.write(
            f"{event.self_cpu_time_total / calls:13.1f} {event.count / calls:10.1f}  {event.key}\n"
        )
    return out.getvalue()


def _wall(call: Callable[[], object], calls: int, before: Callable[[], object]) -> float:
    samples = []
    for _ in range(calls):
        before()
        begin = time.perf_counter()
        call()
        samples.append(time.perf_counter() - begin)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.profile_hot")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tuned-malloc", action="store_true", help="fix glibc's thresholds")
    parser.add_argument("--cold", action="store_true", help="a floor gather before each call")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "results")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    allocator = environment.tune_malloc() if args.tuned_malloc else environment.stock_malloc()
    config = QUICK if args.quick else REFERENCE
    dataset = reference_dataset(config)
    buffer = lucid_rows.build(config, dataset)
    window = lucid_rows.reference_window(config)
    errors = lucid_rows.window_errors(config)
    episode = lucid_rows.add_episode(config, dataset)
    before: Callable[[], object] = GatherFloor(config, dataset.fields, config.transitions)
    if not args.cold:
        before = _nothing
    batch = buffer.sample_windows(config.batch, window)
    for _ in range(config.transitions // config.add_len + 10):  # wrap: steady-state add
        buffer.add(episode)

    paths: dict[str, Callable[[], object]] = {
        "sample_windows uniform": lambda: buffer.sample_windows(
            config.batch, window, prioritized=False
        ),
        "sample_windows prioritized": lambda: buffer.sample_windows(config.batch, window),
        "update_priorities_from (one drawn batch, [B, W] errors)": lambda: (
            buffer.update_priorities_from(batch, errors)
        ),
        "prioritized sample_windows + update_priorities_from (includes the tree flush)": (
            lambda: buffer.update_priorities_from(
                buffer.sample_windows(config.batch, window), errors
            )
        ),
        "add (256-step episode, full buffer)": lambda: buffer.add(episode),
    }
    report = io.StringIO()
    report.write(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {allocator}; "
        f"{config.transitions} "
        f"transitions, {buffer.num_episodes} episodes; {args.calls} calls per path"
        f"{', each after a floor gather (cold caches)' if args.cold else ''}\n"
    )
    for name, call in paths.items():
        for _ in range(10):
            call()
        wall = _wall(call, args.calls, before)
        report.write(f"\n## {name}: median wall {wall:.1f} us (unprofiled)\n\n")
        report.write("cProfile (self time per call, sorted):\n")
        report.write(_cprofile(call, args.calls, args.top, before))
        if not args.cold:  # its profile cannot be paused around the floor's own aten ops
            report.write("\ntorch.profiler (aten ops, self CPU per call):\n")
            report.write(_torch_profile(call, max(20, args.calls // 4), 15))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ("profile_cold.txt" if args.cold else "profile.txt")).write_text(report.getvalue())
    print(report.getvalue())


def _nothing() -> None:
    """No call before a profiled one (caches as the previous call left them)."""


if __name__ == "__main__":
    main()
