"""`PrioritizedSequenceReplay`: episodes drawn in proportion to their priority (Schaul et al.)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from lucid_replay import arrays
from lucid_replay.arrays import Array
from lucid_replay.batch import PrioritizedBatch, WindowBatch
from lucid_replay.errors import CheckpointError, as_tensor, as_vector, check_float, must
from lucid_replay.replay import SequenceReplay

__all__ = ["PrioritizedSequenceReplay"]


class PrioritizedSequenceReplay(SequenceReplay):
    r"""Sequence replay that draws episodes in proportion to a priority.

    Parameters
    ----------
    capacity
        As `SequenceReplay`, in transitions.
    alpha
        How much prioritization is used; 0 is exactly the uniform buffer's distribution.
    beta
        Starting exponent of the importance-sampling correction; see `anneal_beta`.
    epsilon
        Added to every ``|error|`` so that an episode whose error reached zero can still be
        drawn.
    **kwargs
        ``device``, ``unit``, ``seed``, ``max_times_sampled``, as `SequenceReplay`.

    Raises
    ------
    InvalidArgumentError
        If ``alpha`` or ``beta`` is negative, or ``epsilon`` is not positive.

    Notes
    -----
    Schaul, Quan, Antonoglou and Silver, "Prioritized Experience Replay", ICLR 2016
    (arXiv:1511.05952). Priorities live per episode, ``p_e = |\delta_e| + \epsilon``; a chunk
    (or window anchor) has its episode's priority. With ``n_e`` eligible anchors in episode
    ``e``:

    * ``unit="chunk"``: $P(\text{chunk}) = p_e^\alpha / \sum_c p_c^\alpha$, so episode
      ``e`` is drawn with probability $\propto n_e p_e^\alpha$; ``N`` counts chunks;
    * ``unit="episode"``: $P(e) = p_e^\alpha / \sum_{e'} p_{e'}^\alpha$ over episodes with
      an eligible anchor; ``N`` counts those episodes;

    and the start is uniform among the episode's eligible anchors. The weights are

    $$w_i = \frac{(N P_i)^{-\beta}}{\max_j (N P_j)^{-\beta}},$$

    the maximum taken over the batch, so the largest weight of every batch is 1 and the
    correction only scales updates down. A new episode gets the largest priority ever set
    (initially 1.0; evicted episodes' count), so everything is replayed at least once before
    prioritization can bury it (Algorithm 1, line 6). Draws cost O(B log E) on a float64 sum
    tree per anchor span.

    Examples
    --------
    >>> import torch
    >>> from lucid_replay import Episode
    >>> buffer = PrioritizedSequenceReplay(capacity=1000, seed=0)
    >>> buffer.alpha, buffer.beta
    (0.6, 0.4)
    >>> first = buffer.add(Episode({"obs": torch.zeros(8)}))
    >>> batch = buffer.sample_prioritized(batch_size=2, length=4)
    >>> buffer.update_priorities(batch.indices, [0.5, 0.5])
    1
    """

    _prioritized_by_default: ClassVar[bool] = True

    def __init__(
        self,
        capacity: int = 1_000_000,
        alpha: float = 0.6,
        beta: float = 0.4,
        epsilon: float = 1e-6,
        **kwargs: Any,
    ) -> None:
        alpha = check_float("alpha", alpha, minimum=0.0)
        beta = check_float("beta", beta, minimum=0.0)
        epsilon = check_float("epsilon", epsilon, minimum=0.0, strict=True)
        super().__init__(capacity, **kwargs)
        self._alpha, self._initial_beta, self._beta, self._epsilon = alpha, beta, beta, epsilon
        self._max_priority = 1.0
        self._sampler.alpha = alpha

    @property
    def alpha(self) -> float:
        """Prioritization exponent."""
        return self._alpha

    @property
    def beta(self) -> float:
        """Current importance-sampling exponent."""
        return self._beta

    @property
    def epsilon(self) -> float:
        """Added to every ``|error|``."""
        return self._epsilon

    @property
    def max_priority(self) -> float:
        """The largest priority ever set (what a new episode gets)."""
        return self._max_priority

    @property
    def priorities(self) -> torch.Tensor:
        """float64 ``[num_episodes]``: stored episodes' priorities, aligned with `episode_ids`."""
        with self._lock:
            return self._table.priority[self._table.stored_rows()].clone()

    def _new_episode_priority(self) -> float:
        return self._max_priority

    def _beta_now(self) -> float:
        return self._beta

    # -------------------------------------------------------------------------- sampling
    def sample_prioritized(
        self, batch_size: int, length: int, *, device: torch.device | str | None = None
    ) -> PrioritizedBatch:
        """Draw ``batch_size`` chunks of ``length`` steps by priority, with IS weights.

        Returns a `PrioritizedBatch`: the chunks, ``indices`` (the episode ids, int64 ``[B]``)
        and ``weights`` (float32 ``[B]``, largest 1). O(B log E + B length). Raises as
        `SequenceReplay.sample`.
        """
        chunks, anchors = self._sample_chunks(batch_size, length, device, prioritized=True)
        assert anchors.weights is not None  # a prioritized draw always has weights
        weights = anchors.weights.to(chunks.episode_ids.device)
        return PrioritizedBatch(
            chunks.data, chunks.episode_ids, chunks.starts, chunks.episode_ids, weights
        )

    # ------------------------------------------------------------------------ priorities
    def update_priorities(self, indices: Any, errors: Any) -> int:
        """Set the priorities of episodes ``indices`` to ``|errors| + epsilon``.

        Accepts lists, numpy arrays or tensors on any device. Duplicate ids take the largest
        error. Ids already evicted are skipped (they never touch another episode, nor raise
        the maximum priority). Returns how many distinct ids were applied. O(k log E) at the
        next draw.

        Raises
        ------
        InvalidArgumentError
            If the lengths differ, an error is NaN or infinite, or an id was never issued.
            Nothing is updated then.
        """
        ids = as_vector("indices", indices, torch.int64, self._device)
        values = as_vector("errors", errors, torch.float64, self._device)
        if ids.shape != values.shape:
            raise must("errors", f"as long as indices ({ids.numel()})", values.numel())
        finite = torch.isfinite(values)
        if not bool(finite.all()):
            at = int((~finite).nonzero()[0])
            raise must(f"errors[{at}]", "finite", float(values[at]))
        with self._lock:
            issued = (ids >= 0) & (ids < self._table.next_id)
            if not bool(issued.all()):
                at = int((~issued).nonzero()[0])
                raise must(
                    f"indices[{at}]",
                    f"an issued episode id (< {self._table.next_id})",
                    int(ids[at]),
                )
            return self._apply_priorities(ids, values)

    def _apply_priorities(self, ids: torch.Tensor, errors: torch.Tensor) -> int:
        """Set ``|errors| + epsilon`` for issued ``ids`` (storage device, validated)."""
        table = self._table
        ids_of, errors_of = arrays.engine(ids), arrays.engine(errors)
        stored = table.is_stored(ids_of)
        if not bool(stored.all()):  # evicted ids must not touch the rows now reused
            ids_of, errors_of = ids_of[stored], errors_of[stored]
        if ids_of.shape[0] == 0:
            return 0
        priorities = abs(arrays.cast(errors_of, torch.float64)) + self._epsilon
        rows = table.rows_of(ids_of)
        arrays.assign_max(table.arrays["priority"], rows, priorities)
        self._max_priority = max(self._max_priority, float(priorities.max()))
        self._sampler.mark_priorities_dirty(arrays.tensor(rows))
        return arrays.count_distinct(rows)

    def update_priorities_from(
        self, batch: WindowBatch, errors: Any, *, eta: float = 0.9, mask: Any = None
    ) -> int:
        r"""Route per-record (``[B, W]``) or per-window (``[B]``) errors to episode priorities.

        Per window, over records that are in the learning region, valid, and in the anchor's
        own episode, the priority is R2D2's mix
        $\eta \max_k |\delta_k| + (1 - \eta)\,\mathrm{mean}_k |\delta_k|$ (non-finite
        values outside those records are ignored); ``[B]`` errors are used as they are. Then
        `update_priorities` (duplicates take the max). Returns the number of episodes applied.

        ``mask`` (bool ``[B, W]``, optional) narrows the counted records further, for records
        that have no TD error (for example a step with nothing after it to bootstrap from). A
        window left with no counted record keeps its episode's priority.
        """
        eta = check_float("eta", eta, minimum=0.0)
        if eta > 1:
            raise must("eta", "in [0, 1]", eta)
        if not isinstance(batch, WindowBatch):
            raise TypeError(f"batch must be a WindowBatch, got {type(batch).__name__}")
        masks_device = batch.validity_mask.device
        values = as_tensor("errors", errors).to(masks_device)
        if values.dtype not in (torch.float32, torch.float64):  # also what numpy cannot hold
            values = values.to(torch.float64)
        shape = tuple(batch.validity_mask.shape)
        if tuple(values.shape) == shape[:1]:
            return self.update_priorities(batch.episode_ids, values)
        if tuple(values.shape) != shape:
            raise must("errors", f"of shape {shape} or {shape[:1]}", tuple(values.shape))
        if mask is not None:
            mask = as_tensor("mask", mask).to(masks_device)
            if mask.dtype != torch.bool or tuple(mask.shape) != shape:
                raise must(
                    "mask", f"a bool tensor of shape {shape}", f"{mask.dtype} {tuple(mask.shape)}"
                )
        counted, counted_errors = _counted_records(batch, values, mask)
        magnitudes = arrays.where(counted, abs(counted_errors), 0.0)
        records = counted.sum(1)
        mean = magnitudes.sum(1) / (records + (records == 0))
        mixed = eta * arrays.row_max(magnitudes) + (1 - eta) * mean
        # A NaN or inf on a counted record reaches the max and the sum; others were masked.
        if not arrays.all_finite(mixed):
            raise must("errors", "finite on valid learning records", "a NaN or infinite value")
        ids = arrays.engine(batch.episode_ids)
        if not bool(records.all()):  # windows without a counted record carry no signal
            ids, mixed = ids[records > 0], mixed[records > 0]
        with self._lock:
            return self._apply_priorities(
                arrays.tensor(ids).to(self._device), arrays.tensor(mixed).to(self._device)
            )

    def anneal_beta(self, fraction: float, final: float = 1.0) -> None:
        """Set ``beta = beta0 + fraction * (final - beta0)``, ``beta0`` the constructor's value.

        Calls do not compound. The paper reaches ``final = 1`` at the end of learning, when
        unbiased updates matter most.

        Raises
        ------
        InvalidArgumentError
            If ``fraction`` is outside ``[0, 1]`` or ``final`` is negative.
        """
        fraction = check_float("fraction", fraction, minimum=0.0)
        if fraction > 1:
            raise must("fraction", "in [0, 1]", fraction)
        final = check_float("final", final, minimum=0.0)
        with self._lock:
            self._beta = self._initial_beta + fraction * (final - self._initial_beta)

    # ----------------------------------------------------------------------- persistence
    def _config(self) -> dict[str, Any]:
        return {
            **super()._config(),
            "alpha": self._alpha,
            "beta": self._initial_beta,
            "epsilon": self._epsilon,
        }

    def _extra_state(self) -> dict[str, Any]:
        return {"beta": self._beta, "max_priority": self._max_priority}

    def _check_extra_state(self, extra: Mapping[str, Any]) -> None:
        if not {"beta", "max_priority"} <= set(extra):
            raise CheckpointError(
                f"checkpoint extra state must hold beta and max_priority, got {sorted(extra)}"
            )

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:
        self._beta = float(extra["beta"])
        self._max_priority = float(extra["max_priority"])


def _counted_records(
    batch: WindowBatch, errors: torch.Tensor, mask: torch.Tensor | None
) -> tuple[Array, Array]:
    """The records whose errors set priorities, and their errors (``[B, W']`` arrays each).

    Counted: learning region, valid, in the anchor's own episode, and in ``mask``. Batches
    from `sample_windows` share one learning mask across rows (an expanded ``[W]`` tensor), so
    only its columns are kept, and a row of record ids that is one broadcast value compares
    once per window: the same result with ~40% of the work at R2D2-like windows. The arrays
    are of the `arrays` engine of the batch's device.
    """
    learning = batch.learning_mask
    valid, kept_errors = arrays.engine(batch.validity_mask), arrays.engine(errors)
    records = arrays.engine(batch.record_episode_ids)
    kept_mask = None if mask is None else arrays.engine(mask)
    columns = None
    if learning.stride(0) == 0 and learning.shape[0]:  # one learning mask shared by every row
        columns = arrays.flat_nonzero(arrays.engine(learning[0]))
    if (
        columns is not None
        and columns.shape[0]
        and int(columns[-1]) + 1 - int(columns[0]) == columns.shape[0]
    ):  # and one contiguous learning region, as every Window has
        kept = slice(int(columns[0]), int(columns[-1]) + 1)
        counted, kept_errors, records = valid[:, kept], kept_errors[:, kept], records[:, kept]
        kept_mask = None if kept_mask is None else kept_mask[:, kept]
    else:
        counted = valid & arrays.engine(learning)
    anchor_ids = arrays.engine(batch.episode_ids)[:, None]
    if batch.record_episode_ids.stride(1) == 0:  # one id per window (pad, stop)
        own_episode = records[:, :1] == anchor_ids
    else:
        own_episode = records == anchor_ids
    if not bool(own_episode.all()):
        counted = counted & own_episode
    if kept_mask is not None:
        counted = counted & kept_mask
    return counted, kept_errors
