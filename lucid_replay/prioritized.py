"""`PrioritizedSequenceReplay`: episodes drawn in proportion to their priority (Schaul et al.)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from lucid_replay.batch import PrioritizedBatch, WindowBatch
from lucid_replay.blocks import CACHE_BYTES
from lucid_replay.checks import as_vector, check_float
from lucid_replay.errors import must
from lucid_replay.fields import Field
from lucid_replay.priorities import Priorities, batch_errors
from lucid_replay.replay import SequenceReplay
from lucid_replay.selectors import AnySelector, own_alpha

__all__ = ["PrioritizedSequenceReplay"]


class PrioritizedSequenceReplay(SequenceReplay):
    r"""Sequence replay that draws episodes in proportion to a priority.

    Parameters
    ----------
    capacity
        As `SequenceReplay`, in transitions.
    alpha
        How much prioritization is used; 0 is exactly the uniform buffer's distribution.
        ``None`` (default): the ``selector``'s alpha if it carries one, else 0.6.
    beta
        Starting exponent of the importance-sampling correction; see `anneal_beta`.
    epsilon
        Added to every ``|error|`` so that an episode whose error reached zero can still be
        drawn.
    device, unit, seed, max_times_sampled, schema, segment_length, storage, directory,
    cache_bytes
        As `SequenceReplay`.
    selector
        Which anchors `sample_prioritized`, `sample_windows` (``prioritized=None``) and
        `iterate` draw: ``None`` (default) or `Prioritized` by priority at ``alpha``,
        `Uniform` uniformly (batches keep their weights, all 1, and priorities are kept and
        updated as ever), `Recency` by age, or a `Mixture` of them (its `Prioritized`
        components take ``alpha``; weights follow the mixture's probabilities). `sample`
        and ``prioritized=False`` draw uniformly, and ``prioritized=True`` by priority,
        whatever it is. A checkpoint keeps it.
    priority_unit
        What a priority belongs to on a buffer with ``segment_length``: ``"episode"``
        (default; one priority per episode, shared by its segments, and `update_priorities`
        takes episode ids) or ``"segment"`` (needs ``segment_length`` and ``unit="chunk"``:
        each segment has its own priority, a new one gets the largest priority ever set, an
        anchor's priority is its anchor step's segment's, and ``indices`` of batches and
        `update_priorities` are segment ids, issued 0, 1, 2, ... in commit order).

    Raises
    ------
    InvalidArgumentError
        If ``alpha`` or ``beta`` is negative, ``epsilon`` is not positive, ``alpha`` differs
        from the alpha of a `Prioritized` selector (or mixture component) that carries one
        (or for the arguments
        `SequenceReplay` refuses).
    InvalidTypeError
        If ``selector`` is not ``None``, `Uniform`, `Prioritized`, `Recency` or `Mixture`.

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

    $$w_i = \frac{(N P_i)^{-\beta}}{\max_j (N P_j)^{-\beta}}
          = \left(\frac{\min_j p_j}{p_i}\right)^{\alpha \beta},$$

    the maximum and minimum taken over the batch, so the largest weight of every batch is 1
    and the correction only scales updates down. A new episode gets the largest priority ever
    set (initially 1.0; evicted episodes' count), so everything is replayed at least once
    before prioritization can bury it (Algorithm 1, line 6). Draws cost O(B log E) on a
    float64 sum tree per anchor span.

    The law holds for every finite priority: powers are taken of ratios of priorities
    (``p / p_max`` in the trees, ``p_min / p`` in the weights), so ``p^alpha`` never has to
    be a float64 itself (``1e7 ** 50`` is not). An error whose ``|error| + epsilon`` would
    exceed float64's range is refused.

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

    def __init__(
        self,
        capacity: int = 1_000_000,
        alpha: float | None = None,
        beta: float = 0.4,
        epsilon: float = 1e-6,
        *,
        device: torch.device | str = "cpu",
        unit: str = "chunk",
        seed: int | torch.Generator | None = None,
        max_times_sampled: int | None = None,
        schema: Mapping[str, tuple[tuple[int, ...], torch.dtype] | Field] | None = None,
        segment_length: int | None = None,
        priority_unit: str = "episode",
        selector: AnySelector | None = None,
        storage: str = "memory",
        directory: str | os.PathLike[str] | None = None,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        priorities = Priorities(_alpha_of(alpha, selector), beta, epsilon)
        self._asked_unit = priority_unit  # checked by SequenceReplay.__init__
        self._alpha_asked = priorities.alpha  # the selector's (SequenceReplay.__init__)
        super().__init__(
            capacity,
            device=device,
            unit=unit,
            seed=seed,
            max_times_sampled=max_times_sampled,
            schema=schema,
            segment_length=segment_length,
            selector=selector,
            storage=storage,
            directory=directory,
            cache_bytes=cache_bytes,
        )
        self._core.prioritize(priorities)

    @property
    def _priorities(self) -> Priorities:
        priorities = self._core.priorities
        assert priorities is not None  # set in __init__, replaced whole by load_state_dict
        return priorities

    @property
    def alpha(self) -> float:
        """Prioritization exponent."""
        return self._priorities.alpha

    @property
    def beta(self) -> float:
        """Current importance-sampling exponent."""
        return self._priorities.beta

    @property
    def epsilon(self) -> float:
        """Added to every ``|error|``."""
        return self._priorities.epsilon

    def _asked_priority_unit(self) -> object:
        return self._asked_unit

    @property
    def priority_unit(self) -> str:
        """``"episode"`` or ``"segment"``: what priorities (and batch ``indices``) belong to."""
        return self._core.priority_unit or "episode"

    @property
    def max_priority(self) -> float:
        """The largest priority ever set (what a new episode gets)."""
        return self._priorities.max_priority

    @property
    def priorities(self) -> torch.Tensor:
        """float64: stored episodes' priorities, aligned with `episode_ids`.

        With ``priority_unit="segment"``: the stored segments' priorities, by segment id.
        """
        with self._lock:
            return self._core.stored_priorities().clone()

    # -------------------------------------------------------------------------- sampling
    def sample_prioritized(
        self,
        batch_size: int,
        length: int,
        *,
        device: torch.device | str | None = None,
        out: PrioritizedBatch | None = None,
        replacement: bool = True,
    ) -> PrioritizedBatch:
        """Draw ``batch_size`` chunks of ``length`` steps by priority, with IS weights.

        Returns a `PrioritizedBatch`: the chunks, ``indices`` (the episode ids, int64 ``[B]``)
        and ``weights`` (float32 ``[B]``, largest 1). O(B log E + B length). ``out``: a
        `PrioritizedBatch` of the same shapes to overwrite and return (as for
        `SequenceReplay.sample`). Raises as `SequenceReplay.sample`. ``replacement=False``:
        no chunk (``unit="episode"``: no episode) twice, as `SequenceReplay.sample_windows`.
        """
        batch = self._sample_chunks(
            batch_size, length, device, out, prioritized=None, replacement=replacement
        )
        assert isinstance(batch, PrioritizedBatch)  # a prioritized draw always has weights
        return batch

    # ------------------------------------------------------------------------ priorities
    def update_priorities(self, indices: Any, errors: Any) -> int:
        """Set the priorities of episodes ``indices`` to ``|errors| + epsilon``.

        Accepts lists, numpy arrays or tensors on any device (integer ids, real errors).
        Duplicate ids take the largest error. Ids already evicted are skipped (they never
        touch another episode, nor raise the maximum priority). Returns how many distinct ids
        were applied. O(k log E) at the next draw.

        Raises
        ------
        InvalidArgumentError
            If the lengths differ, an error is NaN or infinite (or so large that
            ``|error| + epsilon`` is), or an id was never issued. Nothing is updated then.
        TypeError
            For ids that are not integers (``bool`` included) or complex errors.
        """
        return self._update_priorities(indices, errors)[0]

    def _update_priorities(self, indices: Any, errors: Any) -> tuple[int, float]:
        """`update_priorities`, also returning the largest priority set (``-inf``: none)."""
        ids = as_vector("indices", indices, torch.int64, self._device)
        values = as_vector("errors", errors, torch.float64, self._device)
        if ids.shape != values.shape:
            raise must("errors", f"as long as indices ({ids.numel()})", values.numel())
        priorities = self._priorities.of_errors(values)
        with self._lock:
            self._check_issued(ids)
            return self._core.apply_priorities(ids, priorities)

    def _check_issued(self, ids: torch.Tensor, param: str = "indices") -> None:
        at = self._core.first_unissued(ids)
        if at >= 0:
            next_id = self._core.issued_ids()
            ids_so_far = f"0 .. {next_id - 1}" if next_id else "none issued yet"
            what = "segment" if self._core.priority_unit == "segment" else "episode"
            raise must(f"{param}[{at}]", f"an issued {what} id ({ids_so_far})", int(ids[at]))

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
        window left with no counted record keeps its episode's priority. With ``[B]`` errors
        ``mask`` must be ``None``.

        Raises
        ------
        InvalidArgumentError
            As `update_priorities` (both forms: an id never issued by this buffer is refused
            and nothing is updated), for errors of another shape, a NaN or infinite error on
            a counted record, or a ``mask`` with ``[B]`` errors.
        TypeError
            If ``batch`` is not a `WindowBatch`.
        """
        by_segment = self._core.priority_unit == "segment"
        ids, mixed, per_record = batch_errors(
            batch, errors, eta=eta, mask=mask, by_segment=by_segment
        )
        if not per_record:
            return self.update_priorities(ids, mixed)
        priorities = self._priorities.of_errors(mixed.to(self._device))
        with self._lock:
            # Every anchor, not only the routed ones: a batch of another buffer is refused.
            anchors = batch.segment_ids if by_segment else batch.episode_ids
            assert anchors is not None  # checked by batch_errors
            if anchors.device != self._device:
                anchors = anchors.to(self._device)
            param = "batch.segment_ids" if by_segment else "batch.episode_ids"
            self._check_issued(anchors, param)
            return self._core.apply_priorities(ids.to(self._device), priorities)[0]

    def anneal_beta(self, fraction: float, final: float = 1.0) -> None:
        """Set ``beta = beta0 + fraction * (final - beta0)``, ``beta0`` the constructor's value.

        Calls do not compound. The paper reaches ``final = 1`` at the end of learning, when
        unbiased updates matter most.

        Raises
        ------
        InvalidArgumentError
            If ``fraction`` is outside ``[0, 1]`` or ``final`` is negative.
        """
        with self._lock:
            self._priorities.anneal(fraction, final)

    # -------------------------------------------------------------------- shard hooks
    def _raise_max_priority(self, priority: float) -> None:
        """Raise the maximum priority (a new episode's) to at least ``priority``.

        For a coordinator keeping the maximum global across buffers; monotone, idempotent.
        """
        priority = check_float("priority", priority, minimum=0.0)
        with self._lock:
            self._priorities.raise_max(priority)


def _alpha_of(alpha: float | None, selector: object) -> float:
    """The buffer's alpha: ``alpha``, else a `Prioritized` selector's, else 0.6.

    Both given must agree (a buffer has one alpha); ``alpha`` itself is checked by
    `Priorities`.
    """
    own = own_alpha(selector)
    if alpha is None:
        return 0.6 if own is None else own
    if own is not None and alpha != own:
        rule = f"None or the selector's alpha ({own}) when the selector carries one"
        raise must("alpha", rule, alpha)
    return alpha
