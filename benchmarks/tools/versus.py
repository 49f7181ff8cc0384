"""Is this version slower than another? ``python -m benchmarks.tools.versus --old <checkout>``.

Both packages are imported into one process (the other as ``lucid_replay_before``, see
`benchmarks.tools.same_batches`), each fills a buffer of the same data, and the hot calls of
both are timed in rounds that alternate which version goes first. A round's ratio (this
version's time over the other's) sees the same machine state for both, so the median of the
per-round ratios reads through the drift and the neighbours' load that move a whole
``benchmarks.run`` pass by tens of percent on a small VM. Prints, per call, both medians and
the median and range of the per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from benchmarks.tools.same_batches import NAME, import_as

Calls = dict[str, Callable[[], object]]
REPS = {
    "sample_windows": 20,
    "sample_windows + update": 20,
    "update_priorities_from": 100,
    "add": 300,
}


def calls(package: ModuleType, transitions: int, obs_dim: int) -> Calls:
    """The timed calls on a prioritized buffer of ``transitions`` reference-like steps."""
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    buffer = package.PrioritizedSequenceReplay(transitions, seed=0)

    def episode(length: int) -> object:
        steps = {
            "obs": torch.randn(length, obs_dim, generator=generator),
            "action": torch.randint(0, 4, (length,), generator=generator),
            "reward": torch.randn(length, generator=generator),
            "done": torch.zeros(length, dtype=torch.bool),
        }
        return package.Episode(steps)

    total = 0
    while total < transitions:
        length = int(rng.integers(128, 385))
        buffer.add(episode(length))
        total += length
    window = package.Window(64, burn_in=40, bootstrap=5)
    errors = torch.rand(256, window.size, generator=generator)
    held = buffer.sample_windows(256, window)
    new_episode = episode(256)

    def sample_and_update() -> None:
        buffer.update_priorities_from(buffer.sample_windows(256, window), errors)

    return {
        "sample_windows": lambda: buffer.sample_windows(256, window, prioritized=False),
        "sample_windows + update": sample_and_update,
        "update_priorities_from": lambda: buffer.update_priorities_from(held, errors),
        "add": lambda: buffer.add(new_episode),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.versus")
    parser.add_argument("--old", type=Path, required=True, help="a checkout of the other version")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--transitions", type=int, default=100_000)
    parser.add_argument("--obs-dim", type=int, default=64)
    parser.add_argument("--first", choices=("old", "new"), default="old", help="built first")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import lucid_replay

    before = import_as(args.old.resolve(), NAME)
    # Which buffer is built first decides where its ring lands (huge pages, heap): --first
    # swaps it, so that a layout effect shows as a ratio that flips with it.
    order = ("old", "new") if args.first == "old" else ("new", "old")
    packages = {"old": before, "new": lucid_replay}
    versions = {v: calls(packages[v], args.transitions, args.obs_dim) for v in order}
    for timed in versions.values():  # warm up: compiled loops, trees, batch memory
        for call in timed.values():
            for _ in range(10):
                call()
    times: dict[tuple[str, str], list[float]] = {(v, c): [] for v in versions for c in REPS}
    for index in range(args.rounds):
        for version in ("old", "new") if index % 2 else ("new", "old"):
            for name, call in versions[version].items():
                began = time.perf_counter()
                for _ in range(REPS[name]):
                    call()
                times[(version, name)].append((time.perf_counter() - began) / REPS[name] * 1e6)
    print(f"{args.rounds} rounds, {args.threads} torch thread(s), {args.transitions} transitions")
    for name in REPS:
        old, new = times[("old", name)], times[("new", name)]
        ratios = [b / a for a, b in zip(old, new, strict=True)]
        print(
            f"{name:24s} old {statistics.median(old):8.1f} us, new {statistics.median(new):8.1f}"
            f" us; new/old per round: median {statistics.median(ratios):.3f}"
            f" [{min(ratios):.3f}, {max(ratios):.3f}]"
        )


if __name__ == "__main__":
    main()
