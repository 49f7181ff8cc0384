"""The compiled loops and the numpy and torch code they stand for give identical batches.

Three buffers with one seed, one per engine, go through the same adds, draws and updates;
every batch must be equal to the last bit, weights included (the float64 probabilities to
within rounding: torch's and numpy's powers may differ in the last bit), across windows of every
boundary policy, also after evictions, rescales of the priority trees and growth of the
table. Also: the seam that swaps the loops in (`lucid_replay.engine.jit`), loops calling
loops across modules, and numba's disk cache of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import make_episode

from lucid_replay import Episode, PrioritizedSequenceReplay, Window, engine
from lucid_replay.schema import SUPPORTED_DTYPES

pytestmark = pytest.mark.skipif(
    not engine.available(), reason="numba is not installed: no compiled loops to compare"
)

WINDOWS = [
    Window(5, burn_in=4, bootstrap=2),
    Window(4, burn_in=3, bootstrap=3, boundary="stop", allow_partial=True),
    Window(3, burn_in=2, bootstrap=2, dilation=2),
    Window(3, burn_in=2, bootstrap=2, boundary="include_reset", allow_partial=True),
]


def _run(name, steps=40):
    """The batches one engine draws through a scripted life of a buffer."""
    with engine.use(name):
        return _life(steps)


def _life(steps):
    rng = np.random.default_rng(3)
    buffer = PrioritizedSequenceReplay(capacity=3_000, alpha=0.7, seed=5)
    drawn = []
    for step in range(steps):
        buffer.extend(
            make_episode(int(n), first_serial=1000 * step) for n in rng.integers(1, 30, 8)
        )
        window = WINDOWS[step % len(WINDOWS)]
        batch = buffer.sample_windows(32, window)
        drawn.append(batch)
        errors = torch.from_numpy(rng.exponential(size=(32, window.size)) * 10.0 ** (step % 7))
        buffer.update_priorities_from(batch, errors)
        drawn.append(buffer.sample_prioritized(16, 2))
        drawn.append(buffer.sample(8, 3))
    return drawn


def _fields(batch):
    names = [n for n in dir(batch) if isinstance(getattr(batch, n, None), torch.Tensor)]
    return {
        **{f"data.{k}": v for k, v in batch.data.items()},
        **{n: getattr(batch, n) for n in names},
    }


def test_every_engine_draws_identical_batches():
    """Compiled loops, numpy and torch index arithmetic give bitwise-equal batches and weights,
    and probabilities equal to within float64 rounding (the engines' powers)."""
    runs = {name: _run(name) for name in engine.ENGINES}
    for index, expected in enumerate(runs["numpy"]):
        for name in ("kernels", "torch"):
            got = runs[name][index]
            for field, value in _fields(expected).items():
                if field == "probabilities":
                    torch.testing.assert_close(_fields(got)[field], value, rtol=1e-13, atol=0)
                    continue
                assert torch.equal(_fields(got)[field], value), (name, index, field)


def _typed_episode(length: int, first: int) -> dict[str, torch.Tensor]:
    """Steps of every storable dtype, in field shapes ``()``, ``(3,)`` and ``(2, 0)``."""
    serial = torch.arange(first, first + length)
    steps: dict[str, torch.Tensor] = {"serial": serial}
    for dtype in SUPPORTED_DTYPES:
        values = (serial[:, None] * 7 + torch.arange(3)) % 101
        if dtype == torch.bool:
            values = values % 2 == 0
        elif dtype.is_complex:
            values = torch.complex(values.double(), -values.double())
        steps[str(dtype).removeprefix("torch.")] = values.to(dtype)
    steps["scalar"] = serial.to(torch.float16)
    steps["empty"] = torch.zeros(length, 2, 0)
    return steps


def test_repairs_of_clamped_records_are_the_same_bytes_for_every_dtype():
    """The compiled byte-row repair writes padded records exactly as numpy and torch do."""
    batches = {}
    for name in engine.ENGINES:
        with engine.use(name):
            buffer = PrioritizedSequenceReplay(capacity=2_000, seed=3)
            for index in range(20):
                buffer.add(Episode(_typed_episode(60, 60 * index), terminated=index % 2 == 0))
            batches[name] = buffer.sample_windows(64, Window(8, burn_in=6, bootstrap=3))
    expected = batches["numpy"]
    assert not bool(expected.validity_mask.all())  # some records were clamped and repaired
    for field, values in expected.data.items():
        serial = expected["serial"]  # a padded record repeats its episode's edge step
        assert torch.equal(values, _typed_episode(2_000, 0)[field][serial])
        for name in ("kernels", "torch"):
            assert torch.equal(batches[name].data[field], values), (name, field)


@pytest.mark.parametrize("size", [1, 7, 8, 9, 16, 109])
def test_whole_row_check_finds_a_false_at_every_position(size):
    """The gather's row check reads 8 bools at a time: a single False anywhere in a row, in a
    full word or in the tail, makes the row not exact; rows of True are exact."""
    from lucid_replay import ring_copies

    _all_exact = ring_copies._all_exact

    rows = np.ones((size + 1, size), dtype=np.bool_)
    rows[np.arange(size), np.arange(size)] = False  # row k has its only False at k
    assert [_all_exact(rows, b, size) for b in range(size + 1)] == [False] * size + [True]


# ---------------------------------------------------------------------------- the seam
def test_every_registered_loop_is_its_module_global_compiled():
    """Once the compiled engine runs, each loop registered with `engine.jit` is replaced in
    its module by its numba dispatcher, so callers and other loops reach the compiled one."""
    from lucid_replay import ring_copies  # imported on the compiled path; registers loops

    names = {(loop.__module__, loop.__name__) for loop in engine._loops}
    for module, name in [
        ("lucid_replay.sum_tree", "descend_loop"),
        ("lucid_replay.trees", "refresh_leaves_loop"),
        ("lucid_replay.sampling", "draw_loop"),
        ("lucid_replay.window", "expand_loop"),
        ("lucid_replay.priorities", "route_loop"),
        ("lucid_replay.table_loops", "assign_priorities_loop"),
        ("lucid_replay.ring_copies", "gather_records"),
        ("lucid_replay.raw_memory", "copy"),
        ("lucid_replay.raw_memory", "prefetch_span"),
    ]:
        assert (module, name) in names
        assert type(getattr(sys.modules[module], name)).__name__ == "CPUDispatcher", name
    assert ring_copies.copy_blocks.py_func.__name__ == "copy_blocks"
    assert ring_copies.copy is sys.modules["lucid_replay.raw_memory"].copy  # one dispatcher


def test_use_switches_engines_and_restores_the_previous_one():
    """`engine.use` sets the engine inside its block only, also when the block raises, and
    refuses an unknown name."""
    before = engine.current()
    with engine.use("torch"):
        assert engine.current() == "torch"
        assert not engine.compiled(np.zeros(2))
        with pytest.raises(RuntimeError), engine.use("numpy"):
            assert engine.current() == "numpy"
            raise RuntimeError
        assert engine.current() == "torch"
    assert engine.current() == before
    with pytest.raises(ValueError, match="engine must be one of"):
        engine.use("cuda").__enter__()


_CACHED_CALL = textwrap.dedent(
    """
    import json
    import numpy as np
    from lucid_replay import engine, sampling, sum_tree
    assert engine.available()
    import torch
    tree = sum_tree.build(torch.tensor([1.0, 2.0, 0.0, 4.0], dtype=torch.float64)).numpy()
    uniforms = np.array([[0.1, 0.5], [0.9, 0.2]])
    lengths, zeros = np.array([3, 5, 1, 9]), np.zeros(4, np.int64)
    rows, steps, ids, drawn = sampling.draw_loop(
        tree, 2, uniforms, lengths, 1, 0, np.arange(4), np.ones(4),
        np.arange(4), zeros, lengths, np.zeros(4, np.bool_), zeros, zeros.copy(),
        np.zeros(4, np.bool_),
    )
    stats = {name: getattr(module, name).stats for module, name in [
        (sampling, "draw_loop"), (sampling, "draw_rows_loop"), (sum_tree, "descend_loop")]}
    print(json.dumps({"rows": rows.tolist(), "steps": steps.tolist(),
        "hits": {n: sum(s.cache_hits.values()) for n, s in stats.items()},
        "misses": {n: sum(s.cache_misses.values()) for n, s in stats.items()}}))
    """
)


def test_loops_calling_loops_in_other_modules_compile_and_load_from_the_disk_cache(tmp_path):
    """A loop calling a loop of its module, which calls one of another module, compiles; a
    second process loads it from numba's disk cache and compiles nothing."""
    environment = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "LUCID_REPLAY_KERNELS": "1"}

    def run() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", _CACHED_CALL],
            env=environment,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        import json

        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["rows"] == second["rows"] == [0, 3]
    assert first["steps"] == second["steps"]
    assert first["hits"]["draw_loop"] == 0 and first["misses"]["draw_loop"] == 1
    # The cached caller carries its callees' code: nothing is compiled in the second process.
    assert second["hits"]["draw_loop"] == 1, second
    assert all(count == 0 for count in second["misses"].values()), second
