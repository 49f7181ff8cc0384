"""`lucid_replay.engine`: each helper gives the same result on numpy arrays and on tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lucid_replay import engine


def _both(values: list, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
    tensor = torch.tensor(values, dtype=dtype)
    return tensor.numpy().copy(), tensor


def _same(from_numpy: np.ndarray, from_torch: torch.Tensor) -> None:
    assert isinstance(from_numpy, np.ndarray) and isinstance(from_torch, torch.Tensor)
    np.testing.assert_array_equal(from_numpy, from_torch.numpy())
    assert from_numpy.dtype == from_torch.numpy().dtype


def test_view_is_a_numpy_view_on_cpu_unless_the_torch_engine_runs():
    """On CPU an engine view is a numpy view of the tensor's memory; under the torch engine,
    the tensor itself."""
    tensor = torch.zeros(3)
    view = engine.view(tensor)
    view[1] = 5.0
    assert tensor[1] == 5.0
    assert engine.tensor(view).data_ptr() == tensor.data_ptr()
    with engine.use("torch"):
        assert engine.view(tensor) is tensor


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32, torch.float64])
def test_cast(dtype):
    """cast gives the same values and dtype on both engines."""
    host, device = _both([0.0, 1.5, -2.0], torch.float64)
    _same(engine.cast(host, dtype), engine.cast(device, dtype))


def test_minimum_where_and_flat_nonzero():
    """minimum, where, row_max and flat_nonzero agree on numpy arrays and tensors."""
    first, first_t = _both([[3, -1, 7], [0, 2, 2]], torch.int64)
    second, second_t = _both([[1, 4, 7], [5, -3, 9]], torch.int64)
    _same(engine.minimum(first, second), engine.minimum(first_t, second_t))
    _same(engine.where(first > 1, first, 0), engine.where(first_t > 1, first_t, 0))
    _same(engine.flat_nonzero(first > 1), engine.flat_nonzero(first_t > 1))
    assert engine.flat_nonzero(first > 1).tolist() == [0, 2, 4, 5]


def test_all_finite():
    """all_finite agrees with numpy on both engines, for NaN and infinities too."""
    for values in ([1.0, 2.0], [1.0, float("nan")], [float("-inf")]):
        host, device = _both(values, torch.float32)
        assert engine.all_finite(host) == engine.all_finite(device) == np.isfinite(values).all()


def test_concatenate_and_from_ints():
    """concatenate agrees on both engines; from_ints gives the engine's array for the device."""
    parts, parts_t = zip(*(_both(v, torch.int64) for v in ([1, 2], [3], [4, 5])), strict=True)
    _same(engine.concatenate(list(parts)), engine.concatenate(list(parts_t)))
    host = engine.from_ints([7, 8], torch.device("cpu"))
    assert isinstance(host, np.ndarray) and host.tolist() == [7, 8]
    with engine.use("torch"):
        assert torch.equal(engine.from_ints([7, 8], torch.device("cpu")), torch.tensor([7, 8]))


def test_add_at_counts_repeated_indices_once_each():
    """add_at adds once per occurrence of an index, also when indices repeat."""
    target, target_t = _both([0, 0, 0, 0], torch.int64)
    indices, indices_t = _both([1, 3, 1, 1], torch.int64)
    engine.add_at(target, indices, 2)
    engine.add_at(target_t, indices_t, 2)
    _same(target, target_t)
    assert target.tolist() == [0, 6, 0, 2]


def test_assign_max_keeps_the_largest_value_of_a_repeated_index():
    """Whatever value the plain assignment leaves for a repeated index, the max wins."""
    generator = np.random.default_rng(0)
    for _ in range(20):
        indices = generator.integers(0, 5, size=12)
        values = generator.normal(size=12)
        expected = np.full(5, 9.0)
        for index in np.unique(indices):
            expected[index] = values[indices == index].max()
        target, target_t = np.full(5, 9.0), torch.full((5,), 9.0, dtype=torch.float64)
        engine.assign_max(target, indices, values)
        engine.assign_max(target_t, torch.from_numpy(indices), torch.from_numpy(values))
        np.testing.assert_array_equal(target, expected)
        np.testing.assert_array_equal(target_t.numpy(), expected)


@pytest.mark.parametrize("values", [[], [4], [3, 3, 3], [5, 1, 5, 2, 1, 9]])
def test_count_distinct(values):
    """count_distinct counts distinct values alike on both engines, empty input included."""
    host, device = _both(values, torch.int64)
    assert engine.count_distinct(host) == engine.count_distinct(device) == len(set(values))


def test_no_module_keeps_the_python_twin_of_a_compiled_loop():
    """`engine.jit` swaps the compiled loop into its own module only: a name another module
    imported before the swap would keep running the Python loop (as `table` once did with
    `assign_priorities_loop`, ~0.4 ms a priority update of 256 ids)."""
    import importlib
    import pkgutil
    import sys
    import types

    import lucid_replay
    from lucid_replay import engine

    pytest.importorskip("numba")
    for info in pkgutil.walk_packages(lucid_replay.__path__, "lucid_replay."):
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra that is not installed
            continue
    assert engine.available()
    loops = {id(loop) for loop in engine._loops}
    stale = [
        f"{name}.{attr}"
        for name, module in list(sys.modules.items())
        if name.startswith("lucid_replay") and isinstance(module, types.ModuleType)
        for attr, value in vars(module).items()
        if id(value) in loops
    ]
    assert stale == []


def test_prefetch_is_a_hint_that_never_faults_nor_writes():
    """`engine.prefetch` does nothing from Python; inside a compiled loop it starts a cache
    miss at any address, in the array or far outside it, without a fault or a write."""
    assert engine.prefetch(0) is None
    pytest.importorskip("numba")
    assert engine.available()
    values = np.arange(8)
    for index in (0, 7, 8, -1, 2**40, -(2**40)):
        engine.prefetch_entry(values, index)
    np.testing.assert_array_equal(values, np.arange(8))
