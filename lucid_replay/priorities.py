"""`Priorities`: the state and rules of prioritized replay, in one value.

Alpha, epsilon, the initial and current beta and the largest priority ever set live here, with
how an error becomes a priority and R2D2's reduction of per-record errors to one priority per
window. The draw by priority and its importance weights are the selection law's
(`lucid_replay.laws.Prioritized`, at this alpha and the current beta). The formulas are
documented once, on `lucid_replay.PrioritizedSequenceReplay`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from lucid_replay import engine
from lucid_replay.batch import WindowBatch
from lucid_replay.checks import as_tensor, check_float
from lucid_replay.engine import Array
from lucid_replay.errors import CheckpointError, must, must_have, wrong_kind
from lucid_replay.laws import Law
from lucid_replay.mixtures import Mixture
from lucid_replay.records import Anchors

__all__: list[str] = []  # internal module

_FLOAT64_MAX = float(torch.finfo(torch.float64).max)


class Priorities:
    """Alpha, epsilon, beta (initial and current) and the largest priority ever set.

    Parameters
    ----------
    alpha, beta, epsilon
        As `lucid_replay.PrioritizedSequenceReplay`; validated here.
    """

    def __init__(self, alpha: float, beta: float, epsilon: float) -> None:
        self.alpha = check_float("alpha", alpha, minimum=0.0)
        self.initial_beta = check_float("beta", beta, minimum=0.0)
        self.epsilon = check_float("epsilon", epsilon, minimum=0.0, strict=True)
        self.beta = self.initial_beta
        self.max_priority = 1.0

    # ---------------------------------------------------------------------- errors
    def of_errors(self, errors: torch.Tensor) -> torch.Tensor:
        """`priorities_of` ``errors`` with this epsilon."""
        return priorities_of(errors, self.epsilon)

    def raise_max(self, priority: float) -> None:
        """Raise the largest priority ever set to ``priority`` if it is larger."""
        self.max_priority = max(self.max_priority, priority)

    def anneal(self, fraction: Any, final: Any) -> None:
        """Set beta to `annealed_beta` of the initial beta; calls do not compound."""
        self.beta = annealed_beta(self.initial_beta, fraction, final)

    # --------------------------------------------------------------------- weights
    def weights(
        self, law: Law | Mixture, anchors: Anchors, probability: Callable[[], Array]
    ) -> Array:
        """float32 importance weights, at the current beta, of ``anchors`` drawn by ``law``.

        ``(N P_i)^-beta / max_j (N P_j)^-beta`` (`Law.weights`; ``probability`` gives the
        anchors' ``P`` if the law asks). Of the `engine` of the anchors' arrays.
        """
        return law.weights(anchors, probability, self.beta)

    # ------------------------------------------------------------------- snapshots
    def config(self) -> dict[str, float]:
        """The constructor's arguments."""
        return {"alpha": self.alpha, "beta": self.initial_beta, "epsilon": self.epsilon}

    def state(self) -> dict[str, float]:
        """What changes after construction: current beta and the largest priority."""
        return {"beta": self.beta, "max_priority": self.max_priority}

    def with_state(self, state: object, stored: torch.Tensor) -> Priorities:
        """A copy holding the saved ``state``, checked against the ``stored`` priorities.

        Raises
        ------
        CheckpointError
            Unless ``state`` holds exactly a finite ``beta >= 0`` and a finite
            ``max_priority >= 1`` that no stored priority exceeds.
        """
        if not isinstance(state, Mapping) or set(state) != {"beta", "max_priority"}:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(
                f"checkpoint extra state must hold exactly beta and max_priority, got {got}"
            )
        try:
            beta = check_float("beta", state["beta"], minimum=0.0)
            largest = check_float("max_priority", state["max_priority"], minimum=1.0)
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"checkpoint {error}") from None
        if stored.numel() and float(stored.max()) > largest:
            raise CheckpointError(
                f"checkpoint max_priority must be >= every stored priority "
                f"({float(stored.max())}), got {largest}"
            )
        restored = Priorities(self.alpha, self.initial_beta, self.epsilon)
        restored.beta, restored.max_priority = beta, largest
        return restored


def annealed_beta(initial: float, fraction: Any, final: Any) -> float:
    """``initial + fraction * (final - initial)``, ``fraction`` in ``[0, 1]``, ``final >= 0``.

    Raises
    ------
    InvalidArgumentError, InvalidTypeError
        Naming ``fraction`` or ``final``.
    """
    share = check_float("fraction", fraction, minimum=0.0, maximum=1.0)
    target = check_float("final", final, minimum=0.0)
    return initial + share * (target - initial)


def priorities_of(errors: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``|errors| + epsilon`` (float64 ``errors``), refusing what no priority can be.

    A NaN or infinite error is refused, and so is an error whose sum with ``epsilon``
    leaves float64's range; the error names the first such position (``errors[i]``). The
    one rule for one buffer and for a sharded replay's client, which checks before it
    routes the errors to the shards.
    """
    values = engine.view(errors)
    if not engine.all_finite(values):
        at = int(engine.flat_nonzero(~(abs(values) < math.inf))[0])
        raise must(f"errors[{at}]", "finite", float(errors[at]))
    with np.errstate(over="ignore"):  # an overflow to inf is refused just below
        priorities = abs(values) + epsilon
    if not engine.all_finite(priorities):
        at = int(engine.flat_nonzero(~(abs(priorities) < math.inf))[0])
        raise must(
            f"errors[{at}]",
            f"at most {_FLOAT64_MAX - epsilon:.6g} so that |error| + epsilon stays finite",
            float(errors[at]),
        )
    return engine.tensor(priorities)


def window_priorities(
    learning_mask: torch.Tensor,
    validity_mask: torch.Tensor,
    record_episode_ids: torch.Tensor,
    episode_ids: torch.Tensor,
    errors: Any,
    *,
    eta: float,
    mask: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""R2D2's per-window priority from per-record errors ``[B, W]``.

    Over the records of each window that are in the learning region, valid, in the anchor's
    own episode and in ``mask``: $\eta \max |\delta| + (1 - \eta)\,\mathrm{mean} |\delta|$.
    Returns the episode ids and mixed values (float64) of the windows that have a counted
    record, on the masks' device.

    Raises
    ------
    InvalidArgumentError
        For errors or a mask of another shape, or a NaN or infinite error on a counted record
        (values outside the counted records are ignored).
    """
    device = validity_mask.device
    values = as_tensor("errors", errors).to(device)
    if values.dtype not in (torch.float32, torch.float64):  # also what numpy cannot hold
        values = values.to(torch.float64)
    shape = tuple(validity_mask.shape)
    if tuple(values.shape) != shape:
        raise must("errors", f"of shape {shape} or {shape[:1]}", tuple(values.shape))
    if mask is not None:
        mask = as_tensor("mask", mask).to(device)
        if mask.dtype != torch.bool or tuple(mask.shape) != shape:
            raise must_have(
                "mask", f"a bool tensor of shape {shape}", f"{mask.dtype} {tuple(mask.shape)}"
            )
    valid = engine.view(validity_mask)
    if engine.compiled(valid):  # the same arithmetic in one compiled pass
        ids, mixed, finite = route_loop(
            engine.view(learning_mask),
            valid,
            engine.view(record_episode_ids),
            engine.view(episode_ids),
            engine.view(values),
            None if mask is None else engine.view(mask),
            eta,
        )
    else:
        with np.errstate(over="ignore"):  # a sum or mix beyond float64 is refused below
            count, largest, total = _reduce_rows(
                learning_mask, validity_mask, record_episode_ids, episode_ids, values, mask
            )
            mixed = eta * largest + (1 - eta) * (total / (count + (count == 0)))
        finite = engine.all_finite(mixed)
        ids = engine.view(episode_ids)
        if not bool(count.all()):  # windows without a counted record carry no signal
            ids, mixed = ids[count > 0], mixed[count > 0]
    # A NaN or inf on a counted record reaches the max and the sum; others were masked.
    if not finite:
        raise must_have("errors", "finite on valid learning records", "a NaN or infinite value")
    return engine.tensor(ids), engine.tensor(mixed)


def _reduce_rows(
    learning: torch.Tensor,
    valid: torch.Tensor,
    records: torch.Tensor,
    anchor_ids: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
) -> tuple[Array, Array, Array]:
    """Per window: counted records, their largest |error| and the sum of their |errors|.

    The sum is float64, in record order, so that every engine (and the compiled ``route``)
    adds the same numbers in the same order. Arrays of the `engine`; a NaN or
    infinite counted error makes its window's largest or sum non-finite.
    """
    # Torch for the [B, W] masks (its row reductions of a few dozen elements are ~5x faster
    # than numpy's on CPU); the sum is a cumulative one, which adds in record order.
    region = _shared_region(engine.view(learning))
    if region is not None:  # only the learning columns can count: work on those alone
        valid, records, values = valid[:, region], records[:, region], values[:, region]
        counted = valid & (records == anchor_ids[:, None])
        if mask is not None:
            mask = mask[:, region]
    else:
        counted = valid & learning & (records == anchor_ids[:, None])
    if mask is not None:
        counted &= mask
    magnitudes = torch.where(counted, values.abs(), 0.0)
    count = engine.view(counted.sum(1))
    largest = engine.cast(engine.view(magnitudes.amax(1)), torch.float64)
    sums = engine.view(magnitudes.double())
    if isinstance(sums, np.ndarray):
        total = np.cumsum(sums, axis=1)[:, -1] if sums.shape[1] else sums.sum(1)
    else:
        total = sums.cumsum(1)[:, -1] if sums.shape[1] else sums.sum(1)
    return count, largest, total


def _shared_region(learning: Array) -> slice | None:
    """The columns of the learning region, if every row has the same contiguous one.

    What `sample_windows` returns (one `Window`): routing then reads ~60% of an R2D2
    window's records. One comparison pass decides it, so a mask edited row by row is
    still honoured.
    """
    if learning.shape[0] == 0:
        return None
    columns = engine.flat_nonzero(learning[0])
    if columns.shape[0] == 0:
        return None
    first, last = int(columns[0]), int(columns[-1])
    if last + 1 - first != columns.shape[0] or not bool((learning == learning[:1]).all()):
        return None
    return slice(first, last + 1)


@engine.jit
def route_loop(
    learning: np.ndarray,
    valid: np.ndarray,
    record_ids: np.ndarray,
    anchor_ids: np.ndarray,
    errors: np.ndarray,
    mask: Any,
    eta: float,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """`window_priorities` after its checks, compiled: ``(ids, mixed, finite)``.

    Per window, over the records that are in the learning region, valid, of the anchor's
    episode and in ``mask`` (None: all): ``eta * max |error| + (1 - eta) * mean |error|``,
    the float64 sum taken in record order (as `_reduce_rows`). The windows without such a
    record are left out of ``ids`` (their anchors' episode ids) and ``mixed``. ``finite``:
    no mix is NaN or infinite (a counted error was, or their sum overflowed).
    """
    rows = valid.shape[0]
    ids = np.empty(rows, dtype=np.int64)
    mixed = np.empty(rows, dtype=np.float64)
    kept, finite = 0, True
    for b in range(rows):
        anchor, counted, most, added = anchor_ids[b], 0, 0.0, 0.0
        for k in range(valid.shape[1]):
            if not (learning[b, k] and valid[b, k] and record_ids[b, k] == anchor):
                continue
            if mask is not None and not mask[b, k]:
                continue
            magnitude = np.float64(abs(errors[b, k]))
            counted += 1
            most = max(most, magnitude)
            added += magnitude
        if counted:
            value = eta * most + (1.0 - eta) * (added / counted)
            finite &= np.isfinite(value)
            ids[kept], mixed[kept] = anchor, value
            kept += 1
    return ids[:kept], mixed[:kept], finite


def batch_errors(
    batch: object, errors: Any, *, eta: float, mask: Any, by_segment: bool = False
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``update_priorities_from``'s arguments, checked: ``(episode ids, values, mixed)``.

    ``[B]`` errors come back as they are, with the anchors' ids (``mixed=False``: they still
    go through ``update_priorities``' checks); ``[B, W]`` errors as the `window_priorities`
    of the windows with a counted record (``mixed=True``). A ``mask`` with ``[B]`` errors is
    refused: it selects records, and those errors have none.
    """
    eta = check_float("eta", eta, minimum=0.0, maximum=1.0)
    if not isinstance(batch, WindowBatch):
        raise wrong_kind("batch", "a WindowBatch", type(batch).__name__)
    anchor_ids, record_ids = batch.episode_ids, batch.record_episode_ids
    if by_segment:  # a window's priority goes to its anchor's segment
        if batch.segment_ids is None:
            raise must_have(
                "batch", "a batch of a buffer with segments (segment_ids)", "segment_ids=None"
            )
        # Counted records are those of the anchor's episode: the same test, on ids shifted
        # so that the anchor's own id becomes its segment id.
        record_ids = record_ids + (batch.segment_ids - batch.episode_ids)[:, None]
        anchor_ids = batch.segment_ids
    values = as_tensor("errors", errors)
    if tuple(values.shape) == tuple(batch.validity_mask.shape[:1]):
        if mask is not None:  # a per-window error has no records left to leave out
            raise must_have(
                "mask",
                "None with per-window errors [B] (mask the records of [B, W] errors instead)",
                f"a mask with errors of shape {tuple(values.shape)}",
            )
        return anchor_ids, values, False
    ids, mixed = window_priorities(
        batch.learning_mask,
        batch.validity_mask,
        record_ids,
        anchor_ids,
        values,
        eta=eta,
        mask=mask,
    )
    return ids, mixed, True
