"""Draws without replacement by a `Mixture`: ordered draws against the successive-sampling law
of ``P = sum_k f_k P_k`` enumerated exactly (both units, a reuse limit, segments, a spent
component), the probabilities batches report, refusals, and both engines."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import EPSILON, assert_refused, make_episode
from segmented_buffers import distinct_draws_on_every_engine, segmented_buffer
from stats import ACCEPT, REJECT, chi_square_pvalue

from lucid_replay import (
    InvalidArgumentError,
    Mixture,
    Prioritized,
    PrioritizedSequenceReplay,
    Recency,
    Uniform,
    Window,
)

LENGTHS = [3, 2, 4, 2]  # anchors 2, 1, 3, 1
ERRORS = [20.0, 1.0, 0.5, 2.0]  # the oldest first: Prioritized and Recency disagree
ALPHA, BETA, HALF = 0.8, 0.5, 0.5
WINDOW = Window(2, burn_in=1, bootstrap=1)  # anchor span 2: the 2-step episode has one anchor
FRACTIONS = (0.5, 0.2, 0.3)
MIXTURE = Mixture(
    dict(zip((Prioritized(), Uniform(), Recency(half_life=HALF)), FRACTIONS, strict=True))
)

Key = tuple[int, int] | int  # an anchor (episode, step), or an episode (unit="episode")


def _buffer(
    unit: str, *, lengths=LENGTHS, errors=ERRORS, seed=3, **kwargs: object
) -> PrioritizedSequenceReplay:
    """Whole episodes of ``lengths`` with priorities |``errors``|, drawn by `MIXTURE`."""
    kwargs.setdefault("selector", MIXTURE)
    buffer = PrioritizedSequenceReplay(
        100, alpha=ALPHA, beta=BETA, epsilon=EPSILON, unit=unit, seed=seed, **kwargs
    )
    ids = buffer.extend(make_episode(n, first_serial=100 * k) for k, n in enumerate(lengths))
    buffer.update_priorities(ids, errors[: len(ids)])
    return buffer


def _parts(buffer: PrioritizedSequenceReplay, span: int, half: float = HALF) -> tuple[dict, dict]:
    """Each key's ``[P_prioritized, P_uniform, P_recency]`` (over eligible anchors, or
    episodes), enumerated from the stored whole episodes, and each episode's anchor steps.

    Recency's age: the transitions added after the episode (the buffer's last is age 0)."""
    priority = dict(zip(buffer.episode_ids, buffer.priorities.tolist(), strict=True))
    lengths = {e: len(buffer[e]["serial"]) for e in buffer.episode_ids}
    commits = dict(zip(lengths, np.cumsum(list(lengths.values())).tolist(), strict=True))
    now = max(commits.values())
    steps = {e: range(n - span + 1) for e, n in lengths.items() if n >= span}
    masses = {
        e: np.array([priority[e] ** buffer.alpha, 1.0, 2.0 ** (-(now - commits[e]) / half)])
        for e in steps
    }
    if buffer.unit == "chunk":
        cells = {(e, s): masses[e] for e in steps for s in steps[e]}
    else:
        cells = dict(masses)
    norm = sum(cells.values())
    return {key: mass / norm for key, mass in cells.items()}, steps


def _episode(key: Key) -> int:
    return key[0] if isinstance(key, tuple) else key


def _ordered_law(
    parts: dict,
    size: int,
    *,
    limit: int | None = None,
    per_component: bool = False,
    fractions: tuple[float, ...] = FRACTIONS,
) -> dict:
    """The exact law of ``size`` ordered distinct keys by successive sampling under the
    mixture ``P = sum_k f_k P_k`` (``parts``: each key's ``P_k``): each draw by ``P``
    renormalised over the keys not drawn yet (nor of an episode drawn ``limit`` times).

    ``per_component``: a wrong law, each component renormalised on its own and picked by
    its fraction whatever mass it has left (a component with none left dropped)."""
    shares = np.array(fractions)
    mixture = {key: float(shares @ p) for key, p in parts.items()}
    law: dict = {}

    def extend(prefix: tuple, probability: float) -> None:
        if len(prefix) == size:
            law[prefix] = probability
            return
        drawn = Counter(_episode(key) for key in prefix)
        left = [
            key
            for key in parts
            if key not in prefix and (limit is None or drawn[_episode(key)] < limit)
        ]
        if per_component:
            norms = sum(parts[key] for key in left)
            live = norms > 0
            weights = shares[live] / shares[live].sum()
            chances = {key: float(weights @ (parts[key][live] / norms[live])) for key in left}
        else:
            total = sum(mixture[key] for key in left)
            chances = {key: mixture[key] / total for key in left}
        for key in left:
            extend((*prefix, key), probability * chances[key])

    extend((), 1.0)
    return law


def _with_steps(law: dict, steps: dict) -> dict:
    """``unit="episode"``: ordered episodes to ordered ``(episode, step)``, steps uniform."""
    cells = {}
    for episodes, probability in law.items():
        share = probability / np.prod([len(steps[e]) for e in episodes])
        for chosen in np.ndindex(*[len(steps[e]) for e in episodes]):
            cell = tuple((e, steps[e][i]) for e, i in zip(episodes, chosen, strict=True))
            cells[cell] = share
    return cells


def _count(draw: Callable[[int], object], trials: int) -> Counter:
    """Counts of the ordered ``(episode, step)`` tuples of ``trials`` batches."""
    counts: Counter = Counter()
    for trial in range(trials):
        batch = draw(trial)
        cells = zip(batch.episode_ids.tolist(), batch.anchor_steps.tolist(), strict=True)
        counts[tuple(cells)] += 1
    return counts


def _check(counts: Counter, law: dict, wrongs: list[dict]) -> None:
    """Counts fit ``law`` (chi-square) with nothing outside it, and reject each wrong law."""
    assert set(counts) <= set(law)  # no repeat, nothing ineligible
    assert sum(law.values()) == pytest.approx(1.0, rel=1e-12)
    cells = list(law)
    observed = [counts.get(cell, 0) for cell in cells]
    assert chi_square_pvalue(observed, [law[c] for c in cells]) > ACCEPT
    for wrong in wrongs:  # the test's power
        assert chi_square_pvalue(observed, [wrong.get(c, 0.0) for c in cells]) < REJECT


def _independent(parts: dict, size: int) -> dict:
    """A wrong law: independent draws by ``P`` (with replacement) given no repeat."""
    mixture = {key: float(np.array(FRACTIONS) @ p) for key, p in parts.items()}
    law = {
        cells: float(np.prod([mixture[k] for k in cells])) for cells in _ordered_law(parts, size)
    }
    return {cells: p / sum(law.values()) for cells, p in law.items()}


# ------------------------------------------------------------------------------ the law


@pytest.mark.statistical
@pytest.mark.parametrize(("unit", "size", "draws"), [("chunk", 2, 8_000), ("episode", 3, 8_000)])
def test_ordered_draws_follow_successive_sampling_under_the_mixture(unit, size, draws):
    """Ordered pairs (chunk) and triples (episode, with their uniform steps) of a 3-way
    mixture fit successive sampling by ``sum_k f_k P_k`` enumerated exactly; the counts
    reject each component renormalised on its own and independent draws given distinct."""
    buffer = _buffer(unit)
    parts, steps = _parts(buffer, WINDOW.anchor_span)
    exact = _ordered_law(parts, size)
    wrongs = [_ordered_law(parts, size, per_component=True)]
    if unit == "episode":  # and independent draws given distinct (too close for chunk pairs)
        wrongs.append(_independent(parts, size))
        exact, wrongs = _with_steps(exact, steps), [_with_steps(w, steps) for w in wrongs]

    def draw(_: int):
        return buffer.sample_windows(size, WINDOW, replacement=False)

    _check(_count(draw, draws), exact, wrongs)


@pytest.mark.statistical
def test_a_reuse_limit_removes_an_exhausted_episode_from_every_component():
    """``max_times_sampled=1``, ``unit="chunk"``: the second anchor of a pair comes from
    another episode, by the mixture renormalised over those episodes' anchors (fresh
    buffers, seeds 0..). The counts reject per-component renormalisation, and successive
    sampling that ignores the limit."""

    def draw(trial: int):
        buffer = _buffer("chunk", seed=trial, max_times_sampled=1)
        return buffer.sample_windows(2, WINDOW, replacement=False)

    parts, _ = _parts(_buffer("chunk"), WINDOW.anchor_span)
    exact = _ordered_law(parts, 2, limit=1)
    wrongs = [_ordered_law(parts, 2, limit=1, per_component=True), _ordered_law(parts, 2)]
    _check(_count(draw, 5_000), exact, wrongs)


@pytest.mark.statistical
@pytest.mark.parametrize(("unit", "draws"), [("chunk", 8_000), ("episode", 4_000)])
def test_a_spent_component_is_never_picked_again(unit, draws):
    """Recency with a half-life of 0.001 puts all its mass on the newest episode (the others'
    masses underflow to 0): once that episode is drawn the component has no mass left and
    the draws go on by the other components' remaining mass, as successive sampling has
    it; the counts reject the fractions renormalised over the components left."""
    fractions = (0.5, 0.2, 0.3)
    selector = Mixture(
        dict(zip((Prioritized(), Uniform(), Recency(half_life=0.001)), fractions, strict=True))
    )
    errors = [20.0, 0.5, 2.0, 0.1]  # the newest has the smallest priority
    buffer = _buffer(unit, errors=errors, selector=selector)
    parts, steps = _parts(buffer, WINDOW.anchor_span, half=0.001)
    assert sum(p[2] > 0 for p in parts.values()) == 1  # Recency: the newest only
    exact = _ordered_law(parts, 2, fractions=fractions)
    wrong = _ordered_law(parts, 2, fractions=fractions, per_component=True)
    if unit == "episode":
        exact, wrong = _with_steps(exact, steps), _with_steps(wrong, steps)

    def draw(_: int):
        return buffer.sample_windows(2, WINDOW, replacement=False)

    _check(_count(draw, draws), exact, [wrong])


def _segmented(unit: str) -> PrioritizedSequenceReplay:
    """`segmented_buffer`, drawn by `MIXTURE`."""
    return segmented_buffer(unit, ALPHA, selector=MIXTURE)


@pytest.mark.statistical
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_segmented_draws_follow_successive_sampling_under_the_mixture(unit):
    """Across segments (an open episode, evicted heads), ordered pairs of anchors (triples of
    the 3 episodes, with their steps) fit successive sampling by the mixture's ``P``, read
    off a with-replacement draw (whose probabilities are checked against enumerations
    elsewhere), and reject a flat law (independent draws given distinct); a batch of every
    key once reports that ``P``."""
    window = Window(2, burn_in=1, bootstrap=2)
    buffer = _segmented(unit)
    every = buffer.sample_windows(4_000, window)
    probability: dict = {}
    for e, s, p in zip(
        every.episode_ids.tolist(),
        every.anchor_steps.tolist(),
        every.probabilities.tolist(),
        strict=True,
    ):
        probability[(e, s) if unit == "chunk" else e] = p
    steps: dict = {}
    for e, s in zip(every.episode_ids.tolist(), every.anchor_steps.tolist(), strict=True):
        steps.setdefault(e, set()).add(s)
    steps = {e: sorted(s) for e, s in steps.items()}
    assert sum(probability.values()) == pytest.approx(1.0, rel=1e-12)  # every key was seen
    parts = {key: np.array([p, p, p]) for key, p in probability.items()}  # P_k = P: the law
    size = 2 if unit == "chunk" else 3
    exact, wrong = _ordered_law(parts, size), _independent(parts, size)
    if unit == "episode":
        exact, wrong = _with_steps(exact, steps), _with_steps(wrong, steps)
    else:
        wrong = {cells: 1.0 / len(exact) for cells in exact}  # flat
    everything = buffer.sample_windows(len(probability), window, replacement=False)
    keys = everything.episode_ids.tolist()
    if unit == "chunk":
        keys = list(zip(keys, everything.anchor_steps.tolist(), strict=True))
    assert sorted(keys) == sorted(probability)  # every key once
    expected = [probability[k] for k in keys]
    np.testing.assert_allclose(everything.probabilities.numpy(), expected, rtol=1e-12, atol=0)

    def draw(_: int):
        return buffer.sample_windows(size, window, replacement=False)

    _check(_count(draw, 6_000), exact, [wrong])


# ------------------------------------------------------------------ probabilities


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("unit", ["chunk", "episode"])
@pytest.mark.parametrize("limit", [None, 1])
def test_probabilities_are_the_unconditional_mixture_formula(unit, limit):
    """A batch of every anchor (episode) the call may take reports each one's ``sum_k f_k
    P_k`` over every eligible anchor at the call's start (rtol 1e-12), whichever round drew
    it, and weights ``(N P)^-beta / max`` of it; no key twice, no episode beyond the limit."""
    buffer = _buffer(unit, max_times_sampled=limit)
    parts, steps = _parts(buffer, WINDOW.anchor_span)
    mixture = {key: float(np.array(FRACTIONS) @ p) for key, p in parts.items()}
    size = len(parts) if limit is None or unit == "episode" else len(steps)
    batch = buffer.sample_windows(size, WINDOW, replacement=False)
    ids, drawn_steps = batch.episode_ids.tolist(), batch.anchor_steps.tolist()
    keys = list(zip(ids, drawn_steps, strict=True)) if unit == "chunk" else ids
    assert len(set(keys)) == size and len(set(ids)) == (size if limit or unit != "chunk" else 4)
    assert all(s in steps[e] for e, s in zip(ids, drawn_steps, strict=True))
    expected = np.array([mixture[k] for k in keys])
    np.testing.assert_allclose(batch.probabilities.numpy(), expected, rtol=1e-12, atol=0)
    raw = expected**-BETA
    np.testing.assert_allclose(batch.weights.numpy(), raw / raw.max(), rtol=2e-6, atol=0)


# ----------------------------------------------------------------------- refusals


@pytest.mark.parametrize("unit", ["chunk", "episode"])
@pytest.mark.parametrize("limit", [None, 2])
def test_a_batch_beyond_the_eligible_anchors_is_refused_and_changes_nothing(unit, limit):
    """Refused before any draw (more than the stored steps) or once the rounds ran out of
    anchors, on fresh trees and on cached ones: state, counters, RNG and cached trees
    unchanged (snapshot), the next draws those of a twin never refused; then exactly the
    eligible count is accepted."""
    buffer, twin = _buffer(unit, max_times_sampled=limit), _buffer(unit, max_times_sampled=limit)
    anchors = {0: 2, 1: 1, 2: 3, 3: 1}  # anchor span 2
    under = "" if limit is None else f" under max_times_sampled={limit}"
    what = "anchors" if unit == "chunk" else "episodes"
    drawn: Counter = Counter()
    for _ in range(2):  # trees built inside the refused call, then trees cached before it
        left = {e: n if limit is None else min(n, limit - drawn[e]) for e, n in anchors.items()}
        eligible = sum(left.values()) if unit == "chunk" else sum(n > 0 for n in left.values())
        for size in (eligible + 1, 100):
            assert_refused(
                buffer,
                lambda size=size: buffer.sample_windows(size, WINDOW, replacement=False),
                InvalidArgumentError,
                rf"^batch_size must be <= the eligible {what}{under} \({eligible}\) to draw "
                rf"without replacement, got {size}$",
            )
        ours = buffer.sample_windows(2, WINDOW, replacement=False)
        theirs = twin.sample_windows(2, WINDOW, replacement=False)  # as if never refused
        for name in ("episode_ids", "anchor_steps", "probabilities", "weights"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name))
        drawn.update(ours.episode_ids.tolist())
    left = {e: n if limit is None else min(n, limit - drawn[e]) for e, n in anchors.items()}
    eligible = sum(left.values()) if unit == "chunk" else sum(n > 0 for n in left.values())
    batch = buffer.sample_windows(eligible, WINDOW, replacement=False)  # exactly: accepted
    assert batch.episode_ids.numel() == eligible


# ------------------------------------------------------------------------ engines


def test_engines_draw_the_same_batches():
    """The compiled loops, numpy views and tensors draw the same distinct anchors by a
    mixture: both units, a reuse limit, segments, and batches that need several rounds."""
    distinct_draws_on_every_engine(
        lambda unit: [_buffer(unit), _segmented(unit), _buffer(unit, max_times_sampled=3)],
        WINDOW,
    )


def test_sample_prioritized_and_iterate_draw_distinct_by_a_mixture():
    """``sample_prioritized(..., replacement=False)`` and ``iterate(replacement=False)``
    take the mixture too: every episode once per batch."""
    buffer = _buffer("episode")
    batch = buffer.sample_prioritized(4, 2, replacement=False)
    assert sorted(batch.episode_ids.tolist()) == [0, 1, 2, 3]
    with buffer.iterate(4, WINDOW, prefetch=1, replacement=False) as batches:
        for _ in range(3):
            assert sorted(next(batches).episode_ids.tolist()) == [0, 1, 2, 3]
