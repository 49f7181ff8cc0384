r"""The `Mixture` selector: each draw picks a component selector by its fraction, then draws by it.

A mixture has no tree of its own: it draws from its components' trees (cached as theirs, so a
`Prioritized` component shares the tree of the buffer's `Prioritized` law), as
`lucid_replay.mixture_draws` describes, and reports $P = \sum_k f_k P_k$.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import attrs

from lucid_replay.checks import check_float
from lucid_replay.engine import Array
from lucid_replay.errors import must, wrong_type
from lucid_replay.laws import Prioritized, Uniform, importance_weights
from lucid_replay.recency import Recency
from lucid_replay.records import Anchors

__all__ = ["Mixture"]

Component = Uniform | Prioritized | Recency
TOLERANCE = 1e-9  # how far from 1 the fractions may sum


def _components(value: object) -> tuple[tuple[Component, float], ...]:
    """`Mixture`'s ``components``, checked: selectors to fractions ``> 0`` summing to 1."""
    if not isinstance(value, Mapping) or not value:
        rule = "a non-empty mapping of Uniform(), Prioritized() or Recency() to fractions"
        raise wrong_type("components", rule, value)
    pairs = []
    for selector, fraction in value.items():
        if not isinstance(selector, Component):
            rule = "keyed by Uniform(), Prioritized() or Recency() (not a Mixture)"
            raise wrong_type("components", rule, selector)
        name = f"components[{selector!r}]"
        pairs.append((selector, check_float(name, fraction, minimum=0.0, strict=True)))
    total = math.fsum(fraction for _, fraction in pairs)
    if not abs(total - 1.0) <= TOLERANCE:
        raise must("components", f"fractions summing to 1 (within {TOLERANCE})", dict(value))
    return tuple(pairs)


@attrs.frozen(repr=False)
class Mixture:
    r"""Selector: each draw picks a component with probability its fraction, then draws by it.

    DreamerV3's replay, for instance, mixes uniform, prioritized and recent data:
    ``Mixture({Prioritized(): 0.7, Uniform(): 0.2, Recency(half_life=100_000): 0.1})``.

    Parameters
    ----------
    components
        A mapping of `Uniform`, `Prioritized` and `Recency` selectors to their fractions: reals
        ``> 0`` summing to 1 within 1e-9 (draws divide them by their sum, so that the
        probabilities sum to 1 exactly). A `Prioritized` component takes the buffer's
        ``alpha`` (or carries it, as ``selector=Prioritized(alpha)`` does), and needs a buffer
        with priorities. Their order is kept: it is part of the draw (and of equality).

    Raises
    ------
    InvalidTypeError
        If ``components`` is not a non-empty mapping of those selectors (a nested `Mixture`
        is refused) or a fraction is not a real number.
    InvalidArgumentError
        If a fraction is not finite or not ``> 0``, or the fractions do not sum to 1.

    Notes
    -----
    Each drawn anchor (``unit="episode"``: episode) has probability $P = \sum_k f_k P_k$,
    $P_k$ its probability under component $k$ over the same eligible anchors (episodes), as
    ``batch.probabilities`` reports; importance weights are $(N P)^{-\beta} / \max$ with that
    $P$. A batch draws a component for each of its positions independently (so the batch's
    order says nothing beyond those independent choices), then each component's positions
    from its own sum tree: O(B log E) in all. Under a reuse limit a refused draw is redrawn
    from the *same* component, renormalised over the episodes still allowed, so each draw
    follows the mixture of the components' renormalised laws; its ``P`` is reported with the
    components' totals of the round that drew it, as a single law's is. Draws without
    replacement (``replacement=False``) follow successive sampling by $P$: each draw by
    $\sum_k f_k P_k$ renormalised over the anchors (episodes) not drawn yet in the batch,
    each reporting its unconditional $P$.

    Examples
    --------
    >>> import torch
    >>> from lucid_replay import Episode, PrioritizedSequenceReplay, Window
    >>> mixture = Mixture({Prioritized(): 0.5, Uniform(): 0.5})
    >>> buffer = PrioritizedSequenceReplay(100, seed=0, selector=mixture)
    >>> buffer.extend(Episode({"obs": torch.zeros(4)}) for _ in range(2))
    [0, 1]
    >>> buffer.update_priorities([0, 1], [1.0, 3.0])
    2
    >>> buffer.selector
    Mixture({Prioritized(alpha=0.6): 0.5, Uniform(): 0.5})
    >>> batch = buffer.sample_windows(4, Window(4))  # P = (P_prioritized + 1/2) / 2
    >>> batch.episode_ids.tolist(), batch.probabilities.round(decimals=4).tolist()
    ([0, 1, 1, 0], [0.4205, 0.5795, 0.5795, 0.4205])
    >>> distinct = buffer.sample_windows(2, Window(4), replacement=False)
    >>> sorted(distinct.episode_ids.tolist())
    [0, 1]
    """

    components: tuple[tuple[Component, float], ...] = attrs.field(converter=_components)

    def __repr__(self) -> str:
        inner = ", ".join(f"{selector!r}: {fraction!r}" for selector, fraction in self.components)
        return f"Mixture({{{inner}}})"

    @property
    def selectors(self) -> tuple[Component, ...]:
        """The component selectors, in order."""
        return tuple(selector for selector, _ in self.components)

    @property
    def fractions(self) -> tuple[float, ...]:
        """The components' fractions, in order."""
        return tuple(fraction for _, fraction in self.components)

    @property
    def shares(self) -> tuple[float, ...]:
        """The fractions divided by their sum (within 1e-9 of 1): what the draw uses."""
        total = math.fsum(self.fractions)
        return tuple(fraction / total for fraction in self.fractions)

    @property
    def by_priority(self) -> bool:
        """False: a mixture's draws carry their probabilities, not their priorities."""
        return False

    def weights(self, anchors: Anchors, probability: Callable[[], Array], beta: float) -> Array:
        """float32 ``(P_min / P) ** beta`` of the drawn anchors' probabilities (largest 1)."""
        drawn = anchors.probabilities
        return importance_weights(probability() if drawn is None else drawn, beta)
