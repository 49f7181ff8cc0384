"""Do two versions of lucid_replay draw the same batches? `python -m benchmarks.tools.same_batches`.

For refactors that must not change a single draw: the package of another checkout (``--old``,
for example a ``git worktree`` of the commit before the change) is imported under another name
beside the current one, and both go through the same scripted lives (seeded adds of random
lengths with evictions, uniform and prioritized ``sample_windows`` over windows of every
boundary policy and dilation 2, ``update_priorities_from`` with errors over seven decades,
``sample_prioritized``, ``sample``, ``gather_windows``, a reuse limit, both units). Every
tensor of every batch is compared to the last bit; the tool prints the counts and exits 1 on
any difference. Entries only the current version has (a new batch field) are listed as added,
not counted as differences: the old version has nothing to compare them with. ``--engine``
picks the index arithmetic (``kernels``, ``numpy`` or ``torch``).
Every batch is held to the end of its life, so no batch memory is drawn into twice.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

NAME = "lucid_replay_before"


def import_as(checkout: Path, name: str) -> ModuleType:
    """The package ``lucid_replay`` of ``checkout``, copied and imported as ``name``."""
    target = Path(tempfile.mkdtemp()) / name
    shutil.copytree(checkout / "lucid_replay", target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(text.replace("lucid_replay", name))
    sys.path.insert(0, str(target.parent))
    return importlib.import_module(name)


def select_engine(package: ModuleType, engine: str) -> None:
    """Switch ``package`` (this version or an older one) to the index arithmetic ``engine``."""
    numpy_on_cpu, kernels_on = engine != "torch", engine == "kernels"
    modules = {name: sys.modules.get(f"{package.__name__}.{name}") for name in ("engine", "arrays")}
    if modules["engine"] is not None:  # one module holds the switches
        modules["engine"]._numpy_on_cpu = numpy_on_cpu  # type: ignore[attr-defined]
        modules["engine"]._kernels_on = kernels_on  # type: ignore[attr-defined]
        return
    kernels = importlib.import_module(f"{package.__name__}.kernels")
    modules["arrays"].numpy_on_cpu = numpy_on_cpu  # type: ignore[union-attr]
    kernels.enabled = kernels_on  # type: ignore[attr-defined]


def life(package: ModuleType, seed: int, *, prioritized: bool, unit: str, limit: Any) -> list[Any]:
    """Every batch one buffer draws through a scripted life."""
    rng = np.random.default_rng(seed)
    kind = package.PrioritizedSequenceReplay if prioritized else package.SequenceReplay
    buffer = kind(capacity=1_500, unit=unit, seed=seed, max_times_sampled=limit)
    windows = [
        package.Window(6, burn_in=4, bootstrap=2),
        package.Window(5, burn_in=3, bootstrap=3, boundary="stop"),
        package.Window(4, burn_in=2, bootstrap=2, dilation=2),
        package.Window(3, burn_in=2, bootstrap=2, boundary="include_reset", allow_partial=True),
        package.Window(4),
    ]
    drawn: list[Any] = []
    for step in range(60):
        lengths = rng.integers(1, 40, 4)
        episodes = []
        for length in lengths.tolist():
            serial = torch.arange(length) + 1000 * step
            obs = torch.stack([serial, -serial, 2 * serial], dim=1).to(torch.float32)
            steps = {"serial": serial, "obs": obs}
            episodes.append(package.Episode(steps, terminated=bool(length % 2)))
        buffer.extend(episodes)
        window = windows[step % len(windows)]
        try:
            batch = buffer.sample_windows(16, window)
        except ValueError as error:  # the reuse limit refused: equal refusals count too
            drawn.append(str(error))
            continue
        drawn.append(batch)
        if prioritized:
            errors = torch.from_numpy(rng.exponential(size=(16, window.size)) * 10.0 ** (step % 7))
            buffer.update_priorities_from(batch, errors)
            try:
                chunks = buffer.sample_prioritized(8, 2)
                drawn.append(chunks)
                buffer.update_priorities(chunks.indices, rng.exponential(size=8))
            except ValueError as error:
                drawn.append(str(error))
        ids = list(buffer.episode_ids)
        anchors = [int(rng.integers(0, len(buffer[i]["serial"]))) for i in ids[-4:]]
        drawn.append(buffer.gather_windows(ids[-4:], anchors, windows[(step + 1) % len(windows)]))
        try:
            drawn.append(buffer.sample(4, 3))
        except ValueError as error:
            drawn.append(str(error))
    drawn.append(buffer.stats())
    return drawn


def tensors(value: Any) -> dict[str, Any]:
    """A batch's tensors by name (stored fields as ``data.<name>``), or the value itself."""
    if isinstance(value, str | dict):
        return {"value": value}
    found = {f"data.{name}": t for name, t in value.data.items()}
    for name in dir(value):
        item = getattr(value, name, None)
        if isinstance(item, torch.Tensor):
            found[name] = item
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.same_batches")
    parser.add_argument("--old", type=Path, required=True, help="a checkout of the old version")
    parser.add_argument("--engine", default="kernels", choices=("kernels", "numpy", "torch"))
    parser.add_argument("--seeds", type=int, default=6)
    args = parser.parse_args(argv)
    os.environ.setdefault("LUCID_REPLAY_KERNELS", "1")
    import lucid_replay as current

    before = import_as(args.old.resolve(), NAME)
    for package in (current, before):
        select_engine(package, args.engine)
    batches = compared = differences = 0
    added: set[str] = set()
    for seed in range(args.seeds):
        for prioritized, unit, limit in [
            (True, "chunk", None),
            (True, "episode", None),
            (False, "chunk", None),
            (True, "chunk", 3),
        ]:
            torch.manual_seed(seed)
            new = life(current, seed, prioritized=prioritized, unit=unit, limit=limit)
            torch.manual_seed(seed)
            old = life(before, seed, prioritized=prioritized, unit=unit, limit=limit)
            if len(new) != len(old):
                differences += 1
                continue
            for got, want in zip(new, old, strict=True):
                batches += 1
                got_t, want_t = tensors(got), tensors(want)
                added |= set(got_t) - set(want_t)
                if not set(want_t) <= set(got_t):
                    differences += 1
                    print("missing entries:", sorted(set(want_t) - set(got_t)))
                    continue
                for name, other in want_t.items():
                    compared += 1
                    value = got_t[name]
                    same = (
                        torch.equal(value, other)
                        if isinstance(value, torch.Tensor)
                        else value == other.replace(NAME, "lucid_replay")
                        if isinstance(other, str)
                        else value == other
                    )
                    if not same:
                        differences += 1
                        print(f"seed {seed} {prioritized=} {unit=} {limit=}: {name} differs")
    if added:
        print("added entries (not compared):", sorted(added))
    print(
        f"engine {args.engine}: {batches} batches, {compared} tensors and values, "
        f"{differences} differences"
    )
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
