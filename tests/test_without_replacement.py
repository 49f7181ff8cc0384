"""Draws without replacement: ``sample_windows(..., replacement=False)`` and ``iterate``."""

from __future__ import annotations

import itertools
from collections import Counter

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from conftest import assert_refused, make_episode
from hypothesis import HealthCheck, given, settings
from segmented_buffers import distinct_draws_on_every_engine, segmented_buffer
from stats import ACCEPT, REJECT, chi_square_pvalue

from lucid_replay import (
    Episode,
    InvalidArgumentError,
    InvalidTypeError,
    PrioritizedSequenceReplay,
    SequenceReplay,
    Uniform,
    Window,
)

LENGTHS = [3, 6, 2, 4]
ERRORS = [0.5, 3.0, 1.0, 6.0]
ALPHA, BETA = 0.8, 0.5
WINDOW = Window(2, burn_in=1, bootstrap=1)  # anchor span 2: the 2-step episode has one anchor


def _buffer(unit: str, selector=None, **kwargs: object) -> PrioritizedSequenceReplay:
    """Episodes of `LENGTHS` with priorities |`ERRORS`| (alpha 0.8, beta 0.5)."""
    buffer = PrioritizedSequenceReplay(
        100, alpha=ALPHA, beta=BETA, unit=unit, seed=3, selector=selector, **kwargs
    )
    ids = buffer.extend(make_episode(n, first_serial=100 * k) for k, n in enumerate(LENGTHS))
    buffer.update_priorities(ids, ERRORS)
    return buffer


def _segmented(unit: str) -> PrioritizedSequenceReplay:
    return segmented_buffer(unit, ALPHA)


def _law(buffer: SequenceReplay, window: Window, prioritized: bool) -> dict:
    """The selector's ``P`` by anchor ``(episode, step)``, enumerated from the stored episodes:
    ``p^alpha / sum`` over anchors (chunk), or over episodes, split evenly over the episode's
    anchors (``unit="episode"``: the probability of the episode and then of the step)."""
    anchors, mass = {}, {}
    by_id = dict(zip(buffer.episode_ids, buffer.priorities.tolist(), strict=True))
    for episode_id in buffer.episode_ids:
        info = buffer.episode_info(episode_id)
        need = window.open_anchor_span if info.is_open else window.anchor_span
        steps = range(info.first_step, info.total_length - need + 1)
        if len(steps):
            anchors[episode_id] = steps
            mass[episode_id] = by_id[episode_id] ** buffer.alpha if prioritized else 1.0
    if buffer.unit == "chunk":
        total = sum(mass[e] * len(anchors[e]) for e in anchors)
        return {(e, s): mass[e] / total for e in anchors for s in anchors[e]}
    total = sum(mass.values())
    return {(e, s): mass[e] / total / len(anchors[e]) for e in anchors for s in anchors[e]}


def _successive(law: dict, size: int, unit: str) -> dict:
    """The exact law of ordered draws of ``size`` distinct anchors (episodes), each by ``P``
    renormalised over what was not drawn yet; ``unit="episode"`` then a uniform step."""
    if unit == "chunk":
        cells = law
        keys = list(cells)
    else:
        episodes: dict = {}
        for (e, s), p in law.items():
            episodes.setdefault(e, []).append((s, p))
        keys = list(episodes)
        cells = {e: sum(p for _, p in steps) for e, steps in episodes.items()}
    result = {}
    for tup in itertools.permutations(keys, size):
        probability, left = 1.0, 1.0
        for key in tup:
            probability *= cells[key] / left
            left -= cells[key]
        if unit == "chunk":
            result[tup] = probability
        else:
            for steps in itertools.product(*[episodes[e] for e in tup]):
                share = np.prod([1.0 / len(episodes[e]) for e in tup])
                result[tuple(zip(tup, (s for s, _ in steps), strict=True))] = probability * share
    return result


def _ordered(buffer: SequenceReplay, size: int, draws: int, window: Window) -> Counter:
    """Counts of the ordered anchors of ``draws`` batches of ``size`` without replacement."""
    counts: Counter = Counter()
    for _ in range(draws):
        batch = buffer.sample_windows(size, window, replacement=False)
        drawn = zip(batch.episode_ids.tolist(), batch.anchor_steps.tolist(), strict=True)
        counts[tuple(drawn)] += 1
    return counts


def _check_law(counts: Counter, law: dict, wrong: dict | None) -> None:
    assert set(counts) <= set(law)  # nothing outside the law, no repeat
    cells = list(law)
    observed = [counts.get(cell, 0) for cell in cells]
    assert sum(law.values()) == pytest.approx(1.0, rel=1e-12)
    assert chi_square_pvalue(observed, [law[c] for c in cells]) > ACCEPT
    if wrong is not None:  # the test's power: a plausible wrong law is rejected
        assert chi_square_pvalue(observed, [wrong[c] for c in cells]) < REJECT


def _independent_distinct(law: dict, size: int, unit: str) -> dict:
    """A wrong law: independent draws by ``P`` conditioned on being distinct."""
    exact = _successive(law, size, unit)
    raw = {}
    for cells in exact:
        raw[cells] = np.prod([law[k] for k in cells])
    total = sum(raw.values())
    return {k: v / total for k, v in raw.items()}


# ------------------------------------------------------------------------------ the law


@pytest.mark.statistical
@pytest.mark.parametrize(("unit", "size", "draws"), [("chunk", 2, 12_000), ("episode", 3, 12_000)])
@pytest.mark.parametrize("prioritized", [True, False], ids=["prioritized", "uniform"])
def test_ordered_draws_follow_the_successive_sampling_law(unit, size, draws, prioritized):
    """Ordered pairs (chunk) and triples (episode: with their uniform steps) of a batch fit
    successive sampling enumerated exactly. The power: episode triples reject independent
    draws conditioned on being distinct (a different law under priorities), chunk pairs and
    uniform episodes a flat law over the ordered cells."""
    buffer = _buffer(unit, selector=None if prioritized else Uniform())
    law = _law(buffer, WINDOW, prioritized)
    exact = _successive(law, size, unit)
    wrong = dict.fromkeys(exact, 1.0)  # flat: ignores priorities, or the step's 1 / n
    if unit == "episode" and prioritized:
        wrong = _independent_distinct(law, size, unit)
    elif unit == "chunk" and not prioritized:
        wrong = None  # flat is the law
    _check_law(_ordered(buffer, size, draws, WINDOW), exact, wrong)


@pytest.mark.statistical
@pytest.mark.parametrize(("unit", "size"), [("chunk", 2), ("episode", 2)])
def test_segmented_draws_follow_the_successive_sampling_law(unit, size):
    """Across segments, an open episode (its bootstrap committed) and evicted heads, ordered
    draws fit successive sampling over the anchors (episodes) section 9 makes eligible."""
    buffer = _segmented(unit)
    window = Window(2, burn_in=1, bootstrap=2)
    law = _law(buffer, window, True)
    exact = _successive(law, size, unit)
    wrong = _independent_distinct(law, size, unit) if unit == "episode" else None
    _check_law(_ordered(buffer, size, 10_000, window), exact, wrong or dict.fromkeys(exact, 1.0))


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("unit", ["chunk", "episode"])
@pytest.mark.parametrize("segmented", [False, True])
def test_probabilities_and_weights_are_the_unconditional_law(unit, segmented):
    """``batch.probabilities`` is each anchor's ``P`` under the selector (not conditioned on
    the draws before it), and the weights ``(N P)^-beta / max`` of it."""
    buffer = _segmented(unit) if segmented else _buffer(unit)
    window = Window(2, burn_in=1, bootstrap=2) if segmented else WINDOW
    law = _law(buffer, window, True)
    size = len(law) if unit == "chunk" else len({e for e, _ in law})
    batch = buffer.sample_windows(size, window, replacement=False)
    cells = list(zip(batch.episode_ids.tolist(), batch.anchor_steps.tolist(), strict=True))
    if unit == "chunk":
        assert sorted(cells) == sorted(law)  # every anchor once
        expected = [law[c] for c in cells]
    else:
        assert sorted(e for e, _ in cells) == sorted({e for e, _ in law})
        per_episode = Counter(e for e, _ in law)
        expected = [law[c] * per_episode[c[0]] for c in cells]
    np.testing.assert_allclose(batch.probabilities.numpy(), expected, rtol=1e-12, atol=0)
    raw = batch.probabilities.numpy() ** -buffer.beta
    np.testing.assert_allclose(batch.weights.numpy(), raw / raw.max(), rtol=2e-6, atol=0)


# --------------------------------------------------------------------- no repeats, ever


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    unit=st.sampled_from(["chunk", "episode"]),
    limit=st.sampled_from([None, 1, 2, 3]),
    span=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_no_anchor_twice_and_the_reuse_limit_holds(lengths, unit, limit, span, seed, data):
    """Any batch up to the distinct anchors (episodes) left has no repeat and no episode
    beyond its allowance; one more is refused, and everything drawn is counted."""
    buffer = PrioritizedSequenceReplay(100, unit=unit, seed=seed, max_times_sampled=limit)
    buffer.extend(Episode({"x": torch.arange(n)}) for n in lengths)
    window = Window(span)
    anchors = [max(n - span + 1, 0) for n in lengths]
    counted: Counter = Counter()
    for _ in range(2):
        allowance = [
            (a if limit is None else min(a, limit - counted[i]))
            if unit == "chunk"
            else int(a > 0 and (limit is None or counted[i] < limit))
            for i, a in enumerate(anchors)
        ]
        available = sum(allowance)
        if available == 0:
            break
        size = data.draw(st.integers(1, available))
        batch = buffer.sample_windows(size, window, replacement=False)
        cells = list(zip(batch.episode_ids.tolist(), batch.anchor_steps.tolist(), strict=True))
        keys = cells if unit == "chunk" else [e for e, _ in cells]
        assert len(set(keys)) == size
        per_episode = Counter(e for e, _ in cells)
        assert all(per_episode[e] <= allowance[e] for e in per_episode)
        assert all(0 <= s <= lengths[e] - span for e, s in cells)
        counted.update(per_episode)
        assert buffer.stats()["chunks_sampled"] == sum(counted.values())
    allowance = [
        (a if limit is None else max(min(a, limit - counted[i]), 0))
        if unit == "chunk"
        else int(a > 0 and (limit is None or counted[i] < limit))
        for i, a in enumerate(anchors)
    ]
    available = sum(allowance)
    if available == 0:
        return
    assert_refused(
        buffer,
        lambda: buffer.sample_windows(available + 1, window, replacement=False),
        InvalidArgumentError,
        rf"^batch_size must be <= the eligible (anchors|episodes).* \({available}\) to draw "
        rf"without replacement, got {available + 1}$",
    )


# -------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("unit", ["chunk", "episode"])
@pytest.mark.parametrize("limit", [None, 2])
def test_a_batch_beyond_the_eligible_anchors_is_refused_and_changes_nothing(unit, limit):
    """State, counters, RNG and retirements unchanged; the message says how many there are."""
    buffer = _buffer(unit, max_times_sampled=limit)
    eligible = {"chunk": 2 + 5 + 1 + 3, "episode": 4}[unit]  # anchor span 2
    if limit is not None and unit == "chunk":
        eligible = 2 + 2 + 1 + 2  # at most 2 of each episode
    under = "" if limit is None else f" under max_times_sampled={limit}"
    what = "anchors" if unit == "chunk" else "episodes"
    assert_refused(
        buffer,
        lambda: buffer.sample_windows(eligible + 1, WINDOW, replacement=False),
        InvalidArgumentError,
        rf"^batch_size must be <= the eligible {what}{under} \({eligible}\) to draw without "
        rf"replacement, got {eligible + 1}$",
    )
    batch = buffer.sample_windows(eligible, WINDOW, replacement=False)  # exactly: accepted
    assert batch.episode_ids.numel() == eligible


def test_the_flag_must_be_a_bool():
    """``replacement`` must be a bool (1, None and "False" refused), in ``sample_windows`` and
    ``iterate``; nothing changes."""
    buffer = _buffer("chunk")
    for value in (1, None, "False"):
        assert_refused(
            buffer,
            lambda value=value: buffer.sample_windows(2, WINDOW, replacement=value),
            InvalidTypeError,
            rf"^replacement must be a bool, got {value!r}$",
        )
        assert_refused(
            buffer,
            lambda value=value: buffer.iterate(2, WINDOW, replacement=value),
            InvalidTypeError,
            r"^replacement must be a bool",
        )


def test_a_refused_round_rewinds_the_generator_and_restores_the_tree():
    """A batch refused mid-draw (the check after the rounds found too few anchors left under
    the reuse limit) leaves the next draws as they would have been."""
    buffer = _buffer("chunk", max_times_sampled=1)
    twin = _buffer("chunk", max_times_sampled=1)
    with pytest.raises(InvalidArgumentError):
        buffer.sample_windows(5, WINDOW, replacement=False)  # 4 episodes, one draw each
    for one, other in ((buffer, twin), (buffer, twin)):
        ours = one.sample_windows(2, WINDOW, replacement=False)
        theirs = other.sample_windows(2, WINDOW, replacement=False)
        assert torch.equal(ours.episode_ids, theirs.episode_ids)
        assert torch.equal(ours.anchor_steps, theirs.anchor_steps)
        assert torch.equal(ours.probabilities, theirs.probabilities)


# ------------------------------------------------------------------- with replacement


@pytest.mark.usefixtures("index_engine")
def test_replacement_true_is_the_default_draw_for_draw():
    """``replacement=True`` draws what a call without the keyword draws."""
    one, other = _buffer("chunk"), _buffer("chunk")
    for _ in range(3):
        ours = one.sample_windows(64, WINDOW, replacement=True)
        theirs = other.sample_windows(64, WINDOW)
        assert torch.equal(ours.episode_ids, theirs.episode_ids)
        assert torch.equal(ours.anchor_steps, theirs.anchor_steps)
        assert torch.equal(ours.weights, theirs.weights)


def test_iterate_draws_without_replacement_batch_by_batch():
    """Each prefetched batch of ``iterate(replacement=False)`` has no repeat."""
    buffer = _buffer("episode")
    with buffer.iterate(4, WINDOW, prefetch=1, replacement=False) as batches:
        for _ in range(5):
            assert sorted(next(batches).episode_ids.tolist()) == [0, 1, 2, 3]


def test_engines_draw_the_same_batches():
    """The compiled loops, numpy views and tensors draw the same distinct anchors."""
    distinct_draws_on_every_engine(
        lambda unit: [_buffer(unit), _segmented(unit), _buffer(unit, max_times_sampled=3)],
        WINDOW,
    )


def test_a_large_episode_drawn_whole_takes_few_rounds():
    """Drawing every anchor of one long episode (coupon collector) stays exact and quick."""
    buffer = SequenceReplay(5000, seed=1)
    buffer.add(Episode({"x": torch.arange(4000)}))
    batch = buffer.sample_windows(3999, Window(2), replacement=False)
    assert sorted(batch.anchor_steps.tolist()) == list(range(3999))
    assert buffer.stats()["chunks_sampled"] == 3999


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_sample_prioritized_draws_distinct_chunks(unit):
    """``sample_prioritized(..., replacement=False)``: every chunk (episode) once, each with
    its unconditional ``P``; a non-bool flag is refused."""
    buffer = _buffer(unit)
    law = _law(buffer, Window(2), True)
    size = len(law) if unit == "chunk" else len({e for e, _ in law})
    batch = buffer.sample_prioritized(size, 2, replacement=False)
    cells = list(zip(batch.episode_ids.tolist(), batch.starts.tolist(), strict=True))
    keys = cells if unit == "chunk" else [e for e, _ in cells]
    assert len(set(keys)) == size
    per_episode = Counter(e for e, _ in law)
    share = 1 if unit == "chunk" else None
    expected = [law[c] * (share or per_episode[c[0]]) for c in cells]
    np.testing.assert_allclose(batch.probabilities.numpy(), expected, rtol=1e-12, atol=0)
    assert_refused(
        buffer,
        lambda: buffer.sample_prioritized(2, 2, replacement=0),
        InvalidTypeError,
        r"^replacement must be a bool, got 0$",
    )
