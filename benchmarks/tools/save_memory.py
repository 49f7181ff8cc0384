"""How much memory do `save` and `load` add? `python -m benchmarks.tools.save_memory`.

Each measurement runs in a fresh process, which builds a buffer holding ``--megabytes`` of
stored transitions (float32 observations of ``--obs`` values, an int64 action, a float32
reward and a bool flag per step), added in episodes of 10,000 steps past its capacity, so that
its ring is full and has wrapped (the usual state of a running buffer; ``--unwrapped`` keeps
the stored transitions in one run of the ring). It then resets the process's peak resident
memory (``/proc/self/clear_refs``, Linux), saves the buffer to a temporary file and reads
the peak (``VmHWM``); likewise for `SequenceReplay.load` of that file. What each adds over
the memory the process held before it is printed in MB and as a ratio of the stored bytes.

A load's peak counts the pages of the file it maps (``RssFile``: page cache, which the
kernel may drop) as well as the process's own memory; the largest ``RssAnon`` seen while it
runs (sampled every 2 ms) is printed beside it.

``--checkout DIR`` measures the package of another checkout (for example a ``git worktree``
of an earlier commit): the child imports ``lucid_replay`` from there. ``--json`` prints the
child's measurements as one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
_EPISODE = 10_000  # steps per added episode
_MB = 2**20


def status() -> dict[str, int]:
    """This process's ``VmHWM``, ``VmRSS``, ``RssAnon`` and ``RssFile``, in bytes."""
    text = Path("/proc/self/status").read_text()
    found = re.findall(r"^(VmHWM|VmRSS|RssAnon|RssFile):\s+(\d+) kB", text, re.MULTILINE)
    return {name: int(kb) * 1024 for name, kb in found}


def reset_peak() -> None:
    """Make ``VmHWM`` the current ``VmRSS`` (Linux 4.0 and later)."""
    Path("/proc/self/clear_refs").write_text("5")


class AnonPeak:
    """The largest ``RssAnon`` seen while the ``with`` block runs, sampled every 2 ms."""

    def __enter__(self) -> AnonPeak:
        self.peak = status()["RssAnon"]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, status()["RssAnon"])

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self.peak = max(self.peak, status()["RssAnon"])


def measure(megabytes: float, obs: int, wrapped: bool, load: bool = True) -> dict[str, Any]:
    """Build the buffer, then the peak memory each of `save` and `load` adds (bytes)."""
    import torch

    import lucid_replay

    step_bytes = obs * 4 + 8 + 4 + 1
    capacity = max(_EPISODE, int(megabytes * _MB) // step_bytes // _EPISODE * _EPISODE)
    buffer = lucid_replay.SequenceReplay(capacity, seed=0)
    # Past capacity by a third: full, with the oldest transition a third of the way round.
    total = capacity + capacity // 3 // _EPISODE * _EPISODE if wrapped else capacity
    for k in range(total // _EPISODE):
        serial = torch.arange(k * _EPISODE, (k + 1) * _EPISODE)
        episode = {
            "obs": (serial[:, None] + torch.arange(obs)).float(),
            "action": serial % 7,
            "reward": serial.float(),
            "done": serial % 1000 == 999,
        }
        buffer.add(lucid_replay.Episode(episode))
    stored = len(buffer) * step_bytes
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "buffer.pt"
        gc.collect()
        before = status()
        reset_peak()
        start = time.perf_counter()
        buffer.save(path)
        save_seconds = time.perf_counter() - start
        save_peak = status()["VmHWM"]
        file_bytes = path.stat().st_size
        result = {
            "package": str(Path(lucid_replay.__file__).parent),
            "transitions": len(buffer),
            "stored_bytes": stored,
            "file_bytes": file_bytes,
            "save_added_bytes": save_peak - before["VmRSS"],
            "save_seconds": save_seconds,
        }
        if not load:
            return result
        gc.collect()
        load_before = status()
        reset_peak()
        start = time.perf_counter()
        with AnonPeak() as anon:
            loaded = lucid_replay.SequenceReplay.load(path)
        load_seconds = time.perf_counter() - start
        load_peak = status()["VmHWM"]
    same = len(loaded) == len(buffer) and all(
        torch.equal(loaded[i][name], buffer[i][name])
        for i in (buffer.episode_ids[0], buffer.episode_ids[-1])
        for name in ("obs", "action")
    )
    return {
        **result,
        "load_added_bytes": load_peak - load_before["VmRSS"],
        "load_added_anon_bytes": anon.peak - load_before["RssAnon"],
        "load_seconds": load_seconds,
        "loaded_equal": same,
    }


def run_child(
    megabytes: float,
    obs: int,
    wrapped: bool,
    checkout: Path | None = None,
    load: bool = True,
) -> dict[str, Any]:
    """`measure` in a fresh Python process (importing ``lucid_replay`` from ``checkout``)."""
    command = [sys.executable, "-m", "benchmarks.tools.save_memory", "--child"]
    command += ["--megabytes", str(megabytes), "--obs", str(obs)]
    command += [] if wrapped else ["--unwrapped"]
    command += [] if load else ["--save-only"]
    command += [] if checkout is None else ["--checkout", str(checkout)]
    done = subprocess.run(command, cwd=_ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the measuring process failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=400.0, help="stored data, MB")
    parser.add_argument("--obs", type=int, default=64, help="float32 values per observation")
    parser.add_argument("--unwrapped", action="store_true", help="stored in one run of the ring")
    parser.add_argument("--save-only", action="store_true", help="measure save alone")
    parser.add_argument("--checkout", type=Path, help="import lucid_replay from this checkout")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.checkout is not None:  # before this checkout (the child runs in its root)
            sys.path.insert(0, str(args.checkout.resolve()))
        measured = measure(args.megabytes, args.obs, not args.unwrapped, not args.save_only)
        print(json.dumps(measured))
        return
    result = run_child(
        args.megabytes, args.obs, not args.unwrapped, args.checkout, not args.save_only
    )
    if args.json:
        print(json.dumps(result))
        return
    stored = result["stored_bytes"]
    print(f"package   {result['package']}")
    print(
        f"stored    {stored / _MB:8.1f} MB in {result['transitions']:,} transitions "
        f"({'wrapped' if not args.unwrapped else 'unwrapped'} ring); file "
        f"{result['file_bytes'] / _MB:.1f} MB"
    )
    for what in ("save", "load") if not args.save_only else ("save",):
        added = result[f"{what}_added_bytes"]
        print(
            f"{what} adds {added / _MB:8.1f} MB peak RSS = {added / stored:.2f}x stored "
            f"({result[what + '_seconds']:.2f} s)"
        )
    if not args.save_only:
        anon = result["load_added_anon_bytes"]
        print(f"load adds {anon / _MB:8.1f} MB anonymous memory = {anon / stored:.2f}x stored")
        print(f"loaded buffer equal: {result['loaded_equal']}")


if __name__ == "__main__":
    main()
