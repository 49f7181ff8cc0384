"""The floor Ray's object store sets under an ``"object"`` client, with no replay behind it.

An actor hands the learner a batch's arrays (a real batch's: the same names, shapes, dtypes
and bytes), as a shard of an ``"object"`` client hands it its piece, one call in flight as a
stream keeps one draw in flight. Nothing is drawn, expanded or updated:

* ``returned``: the actor returns arrays it holds (Ray's copy into its store, and the read
  that maps them): the transfer alone, which bounds any client that moves a batch through
  Ray's object store on the machine, whatever its replay does;
* ``copied``: the actor first copies them into arrays it reuses (what a shard's gather
  writes), and the learner copies what it read into a batch it reuses (the merge): the
  copies an ``"object"`` client makes, three of the batch's bytes, which bound it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class _Batches:
    """Holds one batch's arrays and returns them, or a copy made into arrays it reuses."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = {name: np.array(values) for name, values in arrays.items()}
        self.copies = {name: np.empty_like(values) for name, values in self.arrays.items()}

    def batch(self, copy: bool) -> dict[str, np.ndarray]:
        if not copy:
            return self.arrays
        for name, values in self.arrays.items():
            np.copyto(self.copies[name], values)
        return self.copies


def batch_arrays(batch: Any) -> dict[str, np.ndarray]:
    """Every tensor of a `WindowBatch` (its fields as ``data.<name>``), as numpy arrays."""
    arrays = {f"data.{name}": tensor.numpy() for name, tensor in batch.data.items()}
    for name in dir(batch):
        value = getattr(batch, name, None)
        if not name.startswith("_") and isinstance(value, torch.Tensor):
            arrays[name] = value.numpy()
    return arrays


def floor_rows(batch: Any, measure: Callable[[Callable[[], None]], float]) -> list[dict[str, Any]]:
    """Batches/s of the two floors (see the module); ``measure(call)``: calls per second."""
    import ray  # imported by `benchmarks.distributed.main` after its environment is set

    arrays = batch_arrays(batch)
    size = sum(values.nbytes for values in arrays.values())
    # No CPU reserved, as a shard: it shares the cores with the learner, as shards do.
    actor: Any = ray.remote(num_cpus=0)(_Batches).remote(arrays)
    rows = []
    try:
        for copy, what, copies in (
            (False, "returned", 1.0),
            (True, "copied by the actor, then by the learner", 3.0),
        ):
            out = {name: np.empty_like(values) for name, values in arrays.items()}
            pending = [actor.batch.remote(copy)]

            def call(
                copy: bool = copy, out: dict[str, np.ndarray] = out, pending: list[Any] = pending
            ) -> None:
                pending.append(actor.batch.remote(copy))  # the next one in flight
                read = ray.get(pending.pop(0))
                if copy:
                    for name, values in read.items():
                        np.copyto(out[name], values)

            speed = measure(call)
            ray.get(pending)
            rows.append(
                {"what": f"Ray alone: an actor's batch arrays ({size / 1e6:.2f} MB), {what}",
                 "batches_per_s": speed, "of_in_process": speed, "of_in_process_calls": speed,
                 "copied_per_batch_bytes": copies}
            )  # fmt: skip
    finally:
        ray.kill(actor)
    return rows
