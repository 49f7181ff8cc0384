"""Selectors as a buffer takes them: resolved for the buffer, and kept in checkpoints.

A buffer's ``selector=`` is `Uniform`, `Prioritized`, `Recency` or a `Mixture` of them.
`checked_selector` resolves it for the buffer (a `Prioritized` takes the buffer's alpha, a
`Recency` learns whether it ages episodes as a whole); `selector_state` and
`selector_of_state` carry it in a checkpoint's configuration as plain values; `from_key` is
the law of a saved tree's key.
"""

from __future__ import annotations

from typing import Any

from lucid_replay.errors import must, wrong_type
from lucid_replay.laws import Law, LawKey, Prioritized, Uniform
from lucid_replay.mixtures import Component, Mixture
from lucid_replay.recency import Recency, of_key

__all__: list[str] = []  # internal module

Selector = Law | Mixture  # what a buffer draws by (`ReplayCore.law`)
AnySelector = Uniform | Prioritized | Recency | Mixture  # what a buffer's ``selector=`` takes
_KINDS = "None, Uniform(), Prioritized(), Recency(half_life) or Mixture({...})"


def checked_selector(
    selector: object,
    alpha: float | None,
    buffer: type,
    unit: str = "chunk",
    segment_length: int | None = None,
) -> Selector:
    """The law of a ``buffer`` class's ``selector=`` argument, ``alpha`` its priorities' (or None).

    ``None`` is `Prioritized` at ``alpha`` on a buffer with priorities, else `Uniform`; a
    `Prioritized` selector (or component) takes ``alpha`` unless it carries its own (equal
    to it: the caller resolved the pair). A buffer without priorities refuses `Prioritized`,
    also in a `Mixture`. On a segmented buffer (``segment_length``) with ``unit="episode"``
    a `Recency` ages episodes from their newest segment.
    """
    by_episode = unit == "episode" and segment_length is not None
    if selector is None:
        return Uniform() if alpha is None else Prioritized(alpha)
    if isinstance(selector, Mixture):
        pairs = [
            (_component(s, alpha, buffer.__name__, by_episode, selector), f)
            for s, f in selector.components
        ]
        if len({s for s, _ in pairs}) < len(pairs):
            rule = f"distinct components once resolved (Prioritized() is Prioritized({alpha}))"
            raise must("selector", rule, selector)
        return Mixture(dict(pairs))
    if not isinstance(selector, Component):
        raise wrong_type("selector", _KINDS, selector)
    return _component(selector, alpha, buffer.__name__, by_episode, selector)


def _component(
    selector: Component, alpha: float | None, buffer: str, by_episode: bool, given: object
) -> Component:
    if isinstance(selector, Prioritized):
        if alpha is None:
            rule = f"without Prioritized() on a {buffer} (it keeps no priorities)"
            raise must("selector", rule, given)
        if selector.alpha is not None and selector.alpha != alpha:
            raise must("selector", f"of the buffer's alpha ({alpha})", given)
        return Prioritized(alpha)
    if isinstance(selector, Recency):
        return Recency(selector.half_life, by_episode=by_episode)
    return selector


def own_alpha(selector: object) -> float | None:
    """The alpha a `Prioritized` selector (or a `Mixture`'s component) carries, or None."""
    if isinstance(selector, Mixture):
        alphas = [s.alpha for s in selector.selectors if isinstance(s, Prioritized)]
        return next((a for a in alphas if a is not None), None)
    return selector.alpha if isinstance(selector, Prioritized) else None


def selector_state(law: Selector, default: Selector) -> Any:
    """What a checkpoint's configuration keeps of a buffer's law: ``None`` for ``default``.

    ``"Uniform"``, ``"Prioritized"`` (the buffer's alpha), ``{"Recency": half_life}`` or
    ``{"Mixture": [[component, fraction], ...]}``.
    """
    if law == default:
        return None
    if isinstance(law, Mixture):
        return {"Mixture": [[_component_state(s), f] for s, f in law.components]}
    return _component_state(law)


def _component_state(law: object) -> Any:
    if isinstance(law, Recency):
        return {"Recency": law.half_life}
    return type(law).__name__


def selector_of_state(state: object) -> Component | Mixture:
    """The selector `selector_state` saved (a checkpoint's ``"selector"``).

    Raises ``InvalidArgumentError`` or ``InvalidTypeError`` (the caller makes them a
    checkpoint's error) for a state no selector saves.
    """
    if isinstance(state, dict) and list(state) == ["Mixture"]:
        pairs = state["Mixture"]
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in pairs
        ):
            raise must("selector", "[[component, fraction], ...] in a saved Mixture", state)
        return Mixture({_component_of_state(s): f for s, f in pairs})
    return _component_of_state(state)


def _is_recency(state: object) -> bool:
    return isinstance(state, dict) and list(state) == ["Recency"]


def _component_of_state(state: object) -> Component:
    if _is_recency(state):
        assert isinstance(state, dict)
        return Recency(state["Recency"])
    if state == "Uniform":
        return Uniform()
    if state == "Prioritized":  # in a saved Mixture: the buffer's alpha
        return Prioritized()
    rule = "'Uniform', 'Prioritized', {'Recency': half_life} or {'Mixture': [...]}"
    raise must("selector", f"{rule} in a checkpoint's configuration", state)


def from_key(key: LawKey) -> Law:
    """The law whose `Law.key` is ``key`` (a checkpoint's saved tree)."""
    if key is None:
        return Uniform()
    if isinstance(key, str):
        law = of_key(key)
        if law is None:
            raise must("key", "a saved tree's law key", key)
        return law
    return Prioritized(key)
