"""`Recency` and `Mixture` selectors: their laws against exact enumerations, the probabilities
and weights batches report, reuse limits, both engines, refusals and checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import EPSILON, assert_refused, both_engines, make_episode
from stats import ACCEPT, REJECT, chi_square_pvalue

from lucid_replay import (
    CheckpointError,
    Episode,
    InvalidArgumentError,
    InvalidTypeError,
    Mixture,
    Prioritized,
    PrioritizedSequenceReplay,
    Recency,
    ReuseLimitError,
    SequenceReplay,
    Uniform,
    Window,
    engine,
)

LENGTHS = [3, 5, 8, 13, 4, 9, 2, 6, 7, 3]
ERRORS = [0.5, 3.0, 1.0, 0.25, 2.0, 1e-3, 7.0, 1.5, 0.75, 4.0]
WINDOW = Window(3, burn_in=2, bootstrap=1)  # anchor span 3: a 2-step episode has none
SPAN = WINDOW.anchor_span
ALPHA, BETA, HALF = 0.7, 0.5, 9.0
THREE_WAY = {Prioritized(): 0.5, Uniform(): 0.3, Recency(half_life=HALF): 0.2}


class Tracked:
    """A buffer of whole episodes, with each episode's commit counter kept by the test."""

    def __init__(self, buffer: SequenceReplay) -> None:
        self.buffer, self.commit, self.now = buffer, {}, 0

    def add(self, length: int) -> int:
        episode_id = self.buffer.add(make_episode(length, first_serial=1000 * (self.now + 1)))
        self.now += length
        self.commit[episode_id] = self.now
        return episode_id

    def anchors(self, span: int) -> list[tuple[int, int, int]]:
        """Eligible ``(id, step, commit counter)`` of the stored episodes."""
        out = []
        for i in self.buffer.episode_ids:
            length = len(self.buffer[i]["serial"])
            out += [(i, t, self.commit[i]) for t in range(max(length - span + 1, 0))]
        return out


def exact(buffer, anchors, parts, now, unit) -> dict:
    """``P`` of each cell (``(id, step)`` for chunks, ``id`` for episodes) under the mixture
    ``parts`` (``[(selector, fraction)]``), enumerated: each component's ``m / sum m`` over
    the eligible anchors (episodes: one mass each, that of its anchors) summed by fraction."""
    priority = {}
    if isinstance(buffer, PrioritizedSequenceReplay):
        priority = dict(zip(buffer.episode_ids, buffer.priorities.tolist(), strict=True))
    cells = [(i, t) if unit == "chunk" else i for i, t, _ in anchors]
    total = dict.fromkeys(cells, 0.0)
    for selector, fraction in parts:
        mass = {}
        for (i, _, commit), cell in zip(anchors, cells, strict=True):
            if isinstance(selector, Recency):
                mass[cell] = 2.0 ** (-(now - commit) / selector.half_life)
            elif isinstance(selector, Prioritized):
                mass[cell] = priority[i] ** buffer.alpha
            else:
                mass[cell] = 1.0
        norm = math.fsum(mass.values())
        for cell, m in mass.items():
            total[cell] += fraction * m / norm
    return total


def _cells(batch, unit) -> list:
    steps = batch.anchor_steps if hasattr(batch, "anchor_steps") else batch.starts
    ids, steps = batch.episode_ids.tolist(), steps.tolist()
    return list(zip(ids, steps, strict=True)) if unit == "chunk" else ids


def _check_exact(batch, law, unit, beta=None) -> None:
    """The batch's probabilities are the enumerated ``P`` (rtol 1e-12), its weights
    ``(N P)^-beta / max``."""
    expected = np.array([law[c] for c in _cells(batch, unit)])
    np.testing.assert_allclose(batch.probabilities.numpy(), expected, rtol=1e-12, atol=0)
    if beta is not None:
        raw = expected**-beta
        np.testing.assert_allclose(batch.weights.numpy(), raw / raw.max(), rtol=2e-6, atol=0)


def _fits(batch, law, unit, wrong=None) -> None:
    """Counts fit ``law`` (chi-square), and are far from ``wrong`` if given (the power)."""
    keys = sorted(law)
    index = {k: n for n, k in enumerate(keys)}
    counts = np.bincount([index[c] for c in _cells(batch, unit)], minlength=len(keys))
    assert chi_square_pvalue(counts, [law[k] for k in keys]) > ACCEPT
    if wrong is not None:
        assert chi_square_pvalue(counts, [wrong[k] for k in keys]) < REJECT


def _tracked(kind=PrioritizedSequenceReplay, *, capacity=200, lengths=LENGTHS, **kwargs):
    extra = {"alpha": ALPHA, "beta": BETA, "epsilon": EPSILON} if kind is not SequenceReplay else {}
    tracked = Tracked(kind(capacity, seed=11, **extra, **kwargs))
    ids = [tracked.add(n) for n in lengths]
    if kind is not SequenceReplay:
        stored = [i for i in ids if i in set(tracked.buffer.episode_ids)]
        tracked.buffer.update_priorities(stored, ERRORS[: len(stored)])
    return tracked


# ------------------------------------------------------------------------------ Recency


@both_engines
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_recency_probabilities_and_weights_are_the_formulas_with_eviction(unit):
    """``P ∝ 2^(-age / h)`` over eligible anchors (episodes), age counted in transitions added
    since each episode's commit; evicted episodes are gone from the law; weights follow P."""
    tracked = _tracked(capacity=40, unit=unit, selector=Recency(half_life=HALF))
    assert len(tracked.buffer.episode_ids) < len(LENGTHS)  # some were evicted
    for _ in range(2):
        law = exact(
            tracked.buffer, tracked.anchors(SPAN), [(Recency(HALF), 1.0)], tracked.now, unit
        )
        batch = tracked.buffer.sample_windows(64, WINDOW)
        _check_exact(batch, law, unit, BETA)
        tracked.add(4)  # every age grows; the trees' leaves need no update
    chunks = tracked.buffer.sample_prioritized(32, 2)
    law = exact(tracked.buffer, tracked.anchors(2), [(Recency(HALF), 1.0)], tracked.now, unit)
    _check_exact(chunks, law, unit, BETA)


@pytest.mark.statistical
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_recency_draw_frequencies_follow_the_enumerated_law(unit):
    """20,000 draws fit the enumerated recency law and not the uniform one."""
    tracked = _tracked(SequenceReplay, capacity=45, unit=unit, selector=Recency(half_life=HALF))
    anchors = tracked.anchors(SPAN)
    law = exact(tracked.buffer, anchors, [(Recency(HALF), 1.0)], tracked.now, unit)
    flat = exact(tracked.buffer, anchors, [(Uniform(), 1.0)], tracked.now, unit)
    batch = tracked.buffer.sample_windows(20_000, WINDOW)
    _check_exact(batch, law, unit)
    _fits(batch, law, unit, wrong=flat)


def _segmented_anchors(commits, capacity, span, by_episode) -> list[tuple[int, int, int]]:
    """Eligible anchors of closed episodes stored in segments, oldest segments evicted first:
    ``commits`` lists ``(id, first step, length, commit counter)`` of each segment in commit
    order. The commit counter is the anchor's segment's (its episode's newest, by episode)."""
    stored, held = [], 0
    for segment in commits:
        while held + segment[2] > capacity:
            held -= stored.pop(0)[2]
        stored.append(segment)
        held += segment[2]
    total = {i: first + n for i, first, n, _ in commits}  # every episode is closed
    newest = {i: c for i, _, _, c in stored}
    out = []
    for i, first, n, commit in stored:
        for t in range(first, min(first + n, total[i] - span + 1)):
            out.append((i, t, newest[i] if by_episode else commit))
    return out


@pytest.mark.statistical
@both_engines
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_recency_on_a_segmented_buffer_ages_segments_and_evicted_heads_leave(unit):
    """Segments: an anchor's age counts from its segment's commit (``unit="episode"``: its
    episode's newest segment's); episodes whose oldest segments were evicted keep the rest."""
    capacity, size = 40, 4
    buffer = SequenceReplay(
        capacity, seed=5, unit=unit, segment_length=size, selector=Recency(half_life=HALF)
    )
    commits, now = [], 0
    for length in LENGTHS:
        episode_id = buffer.add(make_episode(length))
        for first in range(0, length, size):
            now += min(size, length - first)
            commits.append((episode_id, first, min(size, length - first), now))
    anchors = _segmented_anchors(commits, capacity, SPAN, unit == "episode")
    assert {i for i, *_ in anchors} < {c[0] for c in commits}  # some heads and episodes left
    law = exact(buffer, anchors, [(Recency(HALF), 1.0)], now, unit)
    flat = exact(buffer, anchors, [(Uniform(), 1.0)], now, unit)
    batch = buffer.sample_windows(10_000 if engine.current() == "kernels" else 2_000, WINDOW)
    _check_exact(batch, law, unit)
    _fits(batch, law, unit, wrong=flat if engine.current() == "kernels" else None)


@pytest.mark.statistical
@both_engines
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_recency_with_an_open_episode_ages_its_committed_segments(unit):
    """An open episode's segments age from their own commits (flushed short ones too), its
    anchors need the bootstrap steps committed; episode unit: its newest segment's age."""
    size = 4
    buffer = SequenceReplay(
        200, seed=9, unit=unit, segment_length=size, selector=Recency(half_life=HALF)
    )
    commits, now = [], 0  # (id, first step, length, commit counter) of every segment
    for length in (9, 6):
        episode_id = buffer.add(make_episode(length))
        for first in range(0, length, size):
            now += min(size, length - first)
            commits.append((episode_id, first, min(size, length - first), now))
    stream = buffer.open_episode()
    for piece, flush in ((4, False), (4, False), (3, True), (5, False)):
        first = sum(c[2] for c in commits if c[0] == stream.episode_id)
        stream.append({k: v[:piece] for k, v in make_episode(piece).steps.items()})
        if flush:
            stream.flush()
        committed = piece if flush else piece // size * size
        if committed:
            now += committed
            commits.append((stream.episode_id, first, committed, now))
    buffer.add(make_episode(5))  # after the open episode's commits
    now += 5
    commits.append((buffer.episode_ids[-1], 0, 4, now - 1))
    commits.append((buffer.episode_ids[-1], 4, 1, now))
    anchors = []
    for i in {c[0] for c in commits}:
        mine = [c for c in commits if c[0] == i]
        total = sum(c[2] for c in mine)
        need = WINDOW.open_anchor_span if i == stream.episode_id else SPAN
        newest = mine[-1][3]
        for _, first, n, commit in mine:
            for t in range(first, min(first + n, total - need + 1)):
                anchors.append((i, t, newest if unit == "episode" else commit))
    law = exact(buffer, anchors, [(Recency(HALF), 1.0)], now, unit)
    assert {c for c in law if (c if unit == "episode" else c[0]) == stream.episode_id}
    batch = buffer.sample_windows(10_000 if engine.current() == "kernels" else 2_000, WINDOW)
    _check_exact(batch, law, unit)
    _fits(batch, law, unit)


def test_recency_does_not_drift_over_a_billion_transitions():
    """After 1e9 transitions added in long episodes (the trees rebuilt at new references as
    masses overflow, or kept and updated leaf by leaf for a long half-life), the law of the
    stored episodes is still the exact enumeration: the commit counters are exact integers."""
    capacity, long = 2**20, 2**20 - 64
    for half_life in (5.0, 3e8):
        buffer = SequenceReplay(capacity, seed=1, selector=Recency(half_life))
        episode, now, commit = Episode({"x": torch.zeros(long, dtype=torch.uint8)}), 0, {}
        for n in [long] * 954 + [40, 30, 12, 5]:  # the short ones evict the last long one
            episode_id = buffer.add(
                episode if n == long else Episode({"x": torch.ones(n, dtype=torch.uint8)})
            )
            now += n
            commit[episode_id] = now
            if episode_id % 97 == 0:  # trees built, then rescaled or updated
                buffer.sample_windows(8, Window(2))
        assert now > 10**9 and len(buffer.episode_ids) == 4
        anchors = [
            (i, t, commit[i]) for i in buffer.episode_ids for t in range(len(buffer[i]["x"]) - 1)
        ]
        law = exact(buffer, anchors, [(Recency(half_life), 1.0)], now, "chunk")
        batch = buffer.sample_windows(20_000, Window(2))
        _check_exact(batch, law, "chunk")
        _fits(batch, law, "chunk")


# ------------------------------------------------------------------------------ Mixture


@both_engines
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_mixture_probabilities_and_weights_are_the_formula_with_updated_priorities(unit):
    """``P = sum f_k P_k`` of a three-way mixture, with priorities updated between draws;
    weights ``(N P)^-beta / max``; the draw counts the episodes drawn."""
    tracked = _tracked(capacity=60, unit=unit, selector=Mixture(THREE_WAY))
    buffer = tracked.buffer
    parts = list(buffer.selector.components)
    for round_ in range(3):
        law = exact(buffer, tracked.anchors(SPAN), parts, tracked.now, unit)
        batch = buffer.sample_windows(64, WINDOW)
        _check_exact(batch, law, unit, BETA)
        ids = batch.episode_ids.unique()
        buffer.update_priorities(ids, torch.rand(ids.numel(), dtype=torch.float64) * 5 + round_)
        tracked.add(5)
    law = exact(buffer, tracked.anchors(2), parts, tracked.now, unit)
    _check_exact(buffer.sample_prioritized(32, 2), law, unit, BETA)
    with buffer.iterate(16, WINDOW, prefetch=1) as batches:
        _check_exact(
            next(batches), exact(buffer, tracked.anchors(SPAN), parts, tracked.now, unit), unit
        )


@pytest.mark.statistical
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_mixture_draw_frequencies_follow_the_enumerated_law(unit):
    """20,000 draws of the three-way mixture fit ``sum f_k P_k`` and not its prioritized part."""
    tracked = _tracked(capacity=60, unit=unit, selector=Mixture(THREE_WAY))
    buffer = tracked.buffer
    anchors = tracked.anchors(SPAN)
    law = exact(buffer, anchors, list(buffer.selector.components), tracked.now, unit)
    alone = exact(buffer, anchors, [(Prioritized(ALPHA), 1.0)], tracked.now, unit)
    batch = buffer.sample_windows(20_000, WINDOW)
    _check_exact(batch, law, unit, BETA)
    _fits(batch, law, unit, wrong=alone)


@pytest.mark.statistical
def test_mixture_on_a_uniform_buffer_and_sample_stays_uniform():
    """A `SequenceReplay` takes a mixture of `Uniform` and `Recency`: its windows follow it,
    ``sample`` stays uniform."""
    mixture = Mixture({Uniform(): 0.4, Recency(half_life=4.0): 0.6})
    tracked = _tracked(SequenceReplay, capacity=60, selector=mixture)
    law = exact(
        tracked.buffer, tracked.anchors(SPAN), list(mixture.components), tracked.now, "chunk"
    )
    batch = tracked.buffer.sample_windows(20_000, WINDOW)
    _check_exact(batch, law, "chunk")
    _fits(batch, law, "chunk")
    chunks = tracked.buffer.sample(64, 3)
    flat = exact(tracked.buffer, tracked.anchors(3), [(Uniform(), 1.0)], tracked.now, "chunk")
    _check_exact(chunks, flat, "chunk")


@pytest.mark.statistical
@both_engines
def test_mixture_under_a_reuse_limit_follows_the_components_renormalised_laws():
    """Limit 1, three one-anchor episodes, batches of 2: the first draw follows ``Q = sum f_k
    P_k``, the second ``sum f_k P_k`` renormalised over the episodes left (a refused draw is
    redrawn from its own component); counts of the 6 ordered pairs fit that law."""
    mixture = Mixture({Prioritized(): 0.5, Recency(half_life=0.5): 0.5})
    masses = {"p": [10.0, 1.0, 1.0], "r": [2.0**-12, 2.0**-6, 1.0]}  # p; 2^(-age/h), ages 6, 3, 0
    fractions = {"p": 0.5, "r": 0.5}

    def law(first: int, second: int) -> float:
        one = sum(f * masses[k][first] / sum(masses[k]) for k, f in fractions.items())
        left = [e for e in range(3) if e != first]
        two = sum(
            f * masses[k][second] / sum(masses[k][e] for e in left) for k, f in fractions.items()
        )
        return one * two

    pairs = [(a, b) for a in range(3) for b in range(3) if a != b]
    trials = 800 if engine.current() == "kernels" else 200
    template = PrioritizedSequenceReplay(
        30, alpha=1.0, epsilon=EPSILON, seed=0, max_times_sampled=1, selector=mixture
    )
    template.extend(make_episode(3) for _ in range(3))
    template.update_priorities([0, 1, 2], [10.0 - EPSILON, 1.0 - EPSILON, 1.0 - EPSILON])
    state = template.state_dict()
    counts = dict.fromkeys(pairs, 0)
    for trial in range(trials):
        template.load_state_dict(state)
        template.reseed(trial)
        batch = template.sample_windows(2, Window(3))
        first, second = batch.episode_ids.tolist()
        counts[(first, second)] += 1
        assert batch.probabilities[0].item() == pytest.approx(
            sum(f * masses[k][first] / sum(masses[k]) for k, f in fractions.items()), rel=1e-12
        )
    observed = [counts[p] for p in pairs]
    assert chi_square_pvalue(observed, [law(*p) for p in pairs]) > ACCEPT
    if trials > 500:  # rejection from the whole mixture instead: a different law

        def rejected(first: int, second: int) -> float:
            q = [
                sum(f * masses[k][e] / sum(masses[k]) for k, f in fractions.items())
                for e in range(3)
            ]
            return q[first] * q[second] / (1 - q[first])

        assert chi_square_pvalue(observed, [rejected(*p) for p in pairs]) < REJECT
    template.load_state_dict(state)
    template.sample_windows(1, Window(3))  # builds the trees (caches a checkpoint lists)
    assert_refused(
        template,
        lambda: template.sample_windows(3, Window(3)),
        ReuseLimitError,
        r"^batch_size must be <= the draws left under max_times_sampled=1 .*\(2\), got 3$",
    )


@pytest.mark.parametrize(
    "selector",
    [Recency(half_life=HALF), Mixture(THREE_WAY)],
    ids=["recency", "mixture"],
)
@pytest.mark.parametrize("limit", [None, 6])
def test_both_engines_draw_the_same_batches(selector, limit):
    """The compiled loops and the array code draw the same anchors, probabilities and
    weights, batch for batch (also in rounds under a reuse limit)."""
    runs = []
    for name in engine.ENGINES:
        if name == "kernels" and not engine.available():
            continue
        with engine.use(name):
            tracked = _tracked(capacity=60, selector=selector, max_times_sampled=limit)
            batches = []
            for _ in range(4):
                batches.append(tracked.buffer.sample_windows(8, WINDOW))
                tracked.add(6)
            runs.append(batches)
    for other in runs[1:]:
        for one, two in zip(runs[0], other, strict=True):
            for name in ("episode_ids", "anchor_steps", "probabilities", "weights"):
                assert torch.equal(getattr(one, name), getattr(two, name)), name


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: Recency(0), InvalidArgumentError, r"^half_life must be > 0.0 and finite, got 0$"),
        (lambda: Recency(-2.0), InvalidArgumentError, r"^half_life must be > 0.0"),
        (lambda: Recency(math.inf), InvalidArgumentError, r"^half_life must be .*got inf$"),
        (lambda: Recency(math.nan), InvalidArgumentError, r"^half_life must be .*got nan$"),
        (lambda: Recency(True), InvalidTypeError, r"^half_life must be a real number, got True$"),
        (lambda: Recency("9"), InvalidTypeError, r"^half_life must be a real number, got '9'$"),
        (lambda: Mixture({}), InvalidTypeError, r"^components must be a non-empty mapping"),
        (lambda: Mixture([Uniform()]), InvalidTypeError, r"^components must be a non-empty"),
        (
            lambda: Mixture({Uniform(): 0.5}),
            InvalidArgumentError,
            r"^components must be fractions summing to 1",
        ),
        (
            lambda: Mixture({Uniform(): 0.5, Recency(3): 0.5 + 1e-8}),
            InvalidArgumentError,
            r"^components must be fractions summing to 1 \(within 1e-09\), got",
        ),
        (
            lambda: Mixture({Uniform(): 0.0, Recency(3): 1.0}),
            InvalidArgumentError,
            r"^components\[Uniform\(\)\] must be > 0.0 and finite, got 0.0$",
        ),
        (
            lambda: Mixture({Uniform(): True}),
            InvalidTypeError,
            r"^components\[Uniform\(\)\] must be a real number, got True$",
        ),
        (
            lambda: Mixture({Mixture({Uniform(): 1.0}): 1.0}),
            InvalidTypeError,
            r"^components must be keyed by Uniform\(\), Prioritized\(\) or Recency\(\) "
            r"\(not a Mixture\)",
        ),
    ],
)
def test_bad_selectors_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_buffers_refuse_selectors_they_cannot_draw_by():
    """A buffer without priorities refuses a mixture with `Prioritized`; a component's own
    alpha must be the buffer's; two components equal once resolved are refused."""
    with pytest.raises(
        InvalidArgumentError, match=r"^selector must be without Prioritized\(\) on a SequenceReplay"
    ):
        SequenceReplay(10, selector=Mixture({Prioritized(): 0.5, Uniform(): 0.5}))
    with pytest.raises(
        InvalidArgumentError, match=r"^alpha must be None or the selector's alpha \(0.3\)"
    ):
        PrioritizedSequenceReplay(10, alpha=0.5, selector=Mixture({Prioritized(0.3): 1.0}))
    with pytest.raises(
        InvalidArgumentError, match=r"^selector must be of the buffer's alpha \(0.3\)"
    ):
        PrioritizedSequenceReplay(
            10, selector=Mixture({Prioritized(0.3): 0.5, Prioritized(0.4): 0.5})
        )
    with pytest.raises(
        InvalidArgumentError, match=r"^selector must be distinct components once resolved"
    ):
        PrioritizedSequenceReplay(
            10, alpha=0.3, selector=Mixture({Prioritized(0.3): 0.5, Prioritized(): 0.5})
        )
    with pytest.raises(
        InvalidTypeError, match=r"^selector must be None, Uniform\(\), Prioritized\(\), Recency"
    ):
        SequenceReplay(10, selector="recency")
    assert PrioritizedSequenceReplay(10, selector=Mixture({Prioritized(0.3): 1.0})).alpha == 0.3


def test_refused_draws_change_nothing():
    """A mixture draw from an empty buffer, or a span no episode holds, changes nothing (but
    the cached trees of that span, as a single law's draw)."""
    buffer = PrioritizedSequenceReplay(50, seed=2, selector=Mixture(THREE_WAY))
    assert_refused(
        buffer, lambda: buffer.sample_windows(4, WINDOW), InvalidArgumentError, "non-empty"
    )
    buffer.extend(make_episode(n) for n in (3, 4))
    with pytest.raises(InvalidArgumentError):  # builds the trees of the span (caches)
        buffer.sample_windows(4, Window(9))
    assert_refused(
        buffer,
        lambda: buffer.sample_windows(4, Window(9)),
        InvalidArgumentError,
        r"^length must be <= the longest stored episode \(4 steps\), got 9$",
    )


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize(
    "selector",
    [Recency(half_life=HALF), Mixture(THREE_WAY)],
    ids=["recency", "mixture"],
)
@pytest.mark.parametrize("segment_length", [None, 4])
def test_checkpoints_keep_the_selector_and_the_draws(tmp_path, selector, segment_length):
    """A saved buffer loads with its selector (config) and its trees at their scales: the
    loaded buffer draws what the saved one draws next, bit for bit."""
    tracked = _tracked(capacity=50, selector=selector, segment_length=segment_length)
    tracked.buffer.sample_windows(8, WINDOW)
    tracked.add(7)  # masses above the trees' references
    tracked.buffer.save(tmp_path / "buffer.pt")
    loaded = PrioritizedSequenceReplay.load(tmp_path / "buffer.pt")
    assert loaded.selector == tracked.buffer.selector
    for _ in range(3):
        one, two = tracked.buffer.sample_windows(16, WINDOW), loaded.sample_windows(16, WINDOW)
        for name in ("episode_ids", "anchor_steps", "probabilities", "weights"):
            assert torch.equal(getattr(one, name), getattr(two, name)), name
    twin = PrioritizedSequenceReplay(
        50, ALPHA, BETA, EPSILON, selector=selector, segment_length=segment_length
    )
    twin.load_state_dict(tracked.buffer.state_dict())


@pytest.mark.parametrize(
    "saved, match",
    [
        ({"Recency": -1.0}, r"half_life must be > 0.0"),
        ({"Recency": "a"}, r"half_life must be a real number"),
        ({"Mixture": [["Uniform", 0.5]]}, r"fractions summing to 1"),
        ({"Mixture": "Uniform"}, r"\[\[component, fraction\], \.\.\.\] in a saved Mixture"),
        ({"Mixture": [["Mixture", 1.0]]}, r"selector must be 'Uniform', 'Prioritized'"),
        ({"Recency": 3.0, "x": 1}, r"selector must be 'Uniform', 'Prioritized'"),
    ],
)
def test_crafted_selectors_in_a_checkpoint_are_refused(tmp_path, saved, match):
    path = tmp_path / "buffer.pt"
    _tracked(capacity=50, selector=Recency(half_life=HALF)).buffer.save(path)
    state = torch.load(path, weights_only=True)
    state["config"]["selector"] = saved
    state.pop("checksum", None)
    state["version"] = 1  # no checksum to recompute
    torch.save(state, path)
    with pytest.raises(
        CheckpointError, match=f"^checkpoint configuration must be valid, .*{match}"
    ):
        PrioritizedSequenceReplay.load(path)


def test_a_crafted_tree_key_is_refused(tmp_path):
    path = tmp_path / "buffer.pt"
    buffer = _tracked(capacity=50, selector=Recency(half_life=HALF)).buffer
    buffer.sample_windows(4, WINDOW)
    buffer.save(path)
    state = torch.load(path, weights_only=True)
    assert [key for _, _, key, _ in state["trees"]] == ["recency:9.0"]
    for bad in ("recency:-1.0", "recency:x", "recency:9.0:chunk", "uniform"):
        state["trees"] = [[SPAN, 0, bad, 1.0]]
        state.pop("checksum", None)
        state["version"] = 1
        torch.save(state, path)
        with pytest.raises(CheckpointError, match=r"^checkpoint trees must be \[span >= 1"):
            PrioritizedSequenceReplay.load(path)
