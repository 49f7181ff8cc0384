"""Selectors (`Uniform`, `Prioritized`) as ``selector=``, and the probabilities batches report."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import EPSILON, assert_refused, make_episode
from stats import ACCEPT, DRAWS, REJECT, chi_square_pvalue, eligible_starts

from lucid_replay import (
    CheckpointError,
    Episode,
    InvalidArgumentError,
    InvalidTypeError,
    Prioritized,
    PrioritizedSequenceReplay,
    SequenceReplay,
    Uniform,
    Window,
)

LENGTHS = [3, 5, 8, 13, 4, 9, 2]
ERRORS = [0.5, 3.0, 1.0, 0.25, 2.0, 1e-3, 7.0]
WINDOW = Window(3, burn_in=2, bootstrap=1)  # anchor span 3: the 2-step episode has none
ALPHA, BETA = 0.7, 0.5
SPAN = WINDOW.anchor_span


def _buffer(unit: str = "chunk", **kwargs: object) -> PrioritizedSequenceReplay:
    """Episodes of `LENGTHS` with priorities |`ERRORS`| + epsilon, alpha 0.7, beta 0.5."""
    buffer = PrioritizedSequenceReplay(
        200, alpha=ALPHA, beta=BETA, epsilon=EPSILON, unit=unit, seed=11, **kwargs
    )
    ids = buffer.extend(make_episode(n, first_serial=100 * n) for n in LENGTHS)
    buffer.update_priorities(ids, ERRORS)
    return buffer


def _expected(buffer: SequenceReplay, batch, span: int, prioritized: bool) -> np.ndarray:
    """``P`` of each drawn anchor from the stored priorities and eligible anchor counts of a
    buffer of whole episodes: ``m / sum n m`` (chunk) or ``m / sum [n > 0] m`` (episode)."""
    ids = list(buffer.episode_ids)
    lengths = np.array([len(buffer[i]["serial"]) for i in ids])
    counts = eligible_starts(lengths, span)
    units = counts if buffer.unit == "chunk" else (counts > 0)
    masses = buffer.priorities.numpy() ** buffer.alpha if prioritized else np.ones(len(ids))
    by_id = dict(zip(ids, masses / (units * masses).sum(), strict=True))
    return np.array([by_id[i] for i in batch.episode_ids.tolist()])


def _draws(buffer: SequenceReplay) -> list:
    """A fixed sequence of draws through every method a selector drives (and ``sample``)."""
    drawn = [buffer.sample_windows(16, WINDOW), buffer.sample(8, 3)]
    if isinstance(buffer, PrioritizedSequenceReplay):
        drawn.append(buffer.sample_prioritized(8, 2))
        drawn.append(buffer.sample_windows(8, WINDOW, prioritized=True))
    drawn.append(buffer.sample_windows(8, WINDOW, prioritized=False))
    with buffer.iterate(8, WINDOW, prefetch=1) as batches:
        drawn.append(next(batches))
    return drawn


def _tensors(batch) -> dict[str, torch.Tensor]:
    names = [n for n in dir(batch) if isinstance(getattr(batch, n, None), torch.Tensor)]
    return {
        **{f"data.{k}": v for k, v in batch.data.items()},
        **{n: getattr(batch, n) for n in names},
    }


def _assert_same_draws(first: list, second: list) -> None:
    assert len(first) == len(second)
    for one, other in zip(first, second, strict=True):
        assert type(one) is type(other)
        ours, theirs = _tensors(one), _tensors(other)
        assert ours.keys() == theirs.keys()
        for name, value in ours.items():
            assert torch.equal(value, theirs[name]), name


# ------------------------------------------------------------------ selector=None is today's


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("unit", ["chunk", "episode"])
@pytest.mark.parametrize("limit", [None, 15])
def test_prioritized_selector_draws_what_the_default_draws(unit, limit):
    """``selector=Prioritized()`` and ``Prioritized(alpha)`` draw as ``selector=None``,
    batch for batch and bit for bit, through every drawing method."""
    runs = [
        _draws(_buffer(unit, max_times_sampled=limit, selector=selector))
        for selector in (None, Prioritized(), Prioritized(alpha=ALPHA))
    ]
    alpha_of_the_selector = PrioritizedSequenceReplay(
        200,
        beta=BETA,
        epsilon=EPSILON,
        unit=unit,
        seed=11,
        max_times_sampled=limit,
        selector=Prioritized(ALPHA),
    )
    ids = alpha_of_the_selector.extend(make_episode(n, first_serial=100 * n) for n in LENGTHS)
    alpha_of_the_selector.update_priorities(ids, ERRORS)
    runs.append(_draws(alpha_of_the_selector))
    _assert_same_draws(runs[0], runs[3])
    _assert_same_draws(runs[0], runs[1])
    _assert_same_draws(runs[0], runs[2])


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_uniform_selector_on_a_uniform_buffer_draws_what_the_default_draws(unit):
    """``SequenceReplay(selector=Uniform())`` draws as ``selector=None``."""
    runs = []
    for selector in (None, Uniform()):
        buffer = SequenceReplay(200, unit=unit, seed=4, selector=selector)
        buffer.extend(make_episode(n, first_serial=100 * n) for n in LENGTHS)
        runs.append(_draws(buffer))
    _assert_same_draws(*runs)


@pytest.mark.usefixtures("index_engine")
def test_uniform_selector_on_a_prioritized_buffer_draws_its_uniform_draws_with_unit_weights():
    """On a prioritized buffer, ``selector=Uniform()`` makes ``prioritized=None`` draw what
    ``prioritized=False`` draws on a default buffer, with weights of 1 (``sample_prioritized``
    too); ``prioritized=True`` still draws by priority."""
    uniform, default = _buffer(selector=Uniform()), _buffer()
    assert uniform.selector == Uniform() and default.selector == Prioritized(ALPHA)
    ours, theirs = (
        uniform.sample_windows(32, WINDOW),
        default.sample_windows(32, WINDOW, prioritized=False),
    )
    for name in ("episode_ids", "anchor_steps", "probabilities", "validity_mask"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name))
    assert ours.weights is not None and bool((ours.weights == 1).all())
    chunks = uniform.sample_prioritized(16, 2)
    assert bool((chunks.weights == 1).all())
    np.testing.assert_array_equal(
        chunks.probabilities.numpy(), _expected(uniform, chunks, 2, False)
    )
    by_priority = _buffer(selector=Uniform()).sample_windows(32, WINDOW, prioritized=True)
    expected = _buffer().sample_windows(32, WINDOW, prioritized=True)
    assert torch.equal(by_priority.episode_ids, expected.episode_ids)
    assert torch.equal(by_priority.weights, expected.weights)


# ---------------------------------------------------------------------- the probabilities


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("unit", ["chunk", "episode"])
@pytest.mark.parametrize("selector", [None, Uniform()], ids=["prioritized", "uniform"])
def test_probabilities_are_the_law_of_each_drawn_anchor(unit, selector):
    """``P = p^alpha / sum`` over eligible anchors (episodes), or ``1 / N``; float64 ``[B]``;
    a uniform draw's too, chunks and windows alike."""
    buffer = _buffer(unit, selector=selector)
    prioritized = selector is None
    for batch, span in (
        (buffer.sample_windows(64, WINDOW), WINDOW.anchor_span),
        (buffer.sample_prioritized(64, 3), 3),
    ):
        assert batch.probabilities.dtype == torch.float64 and batch.probabilities.shape == (64,)
        expected = _expected(buffer, batch, span, prioritized)
        np.testing.assert_allclose(batch.probabilities.numpy(), expected, rtol=1e-13, atol=0)
    for batch, span in (
        (buffer.sample(32, 5), 5),
        (buffer.sample_windows(32, WINDOW, prioritized=False), SPAN),
    ):
        np.testing.assert_allclose(
            batch.probabilities.numpy(), _expected(buffer, batch, span, False), rtol=1e-15, atol=0
        )


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_weights_are_n_p_to_the_minus_beta_over_their_maximum(unit):
    """``(N P)^-beta / max`` of the reported probabilities is the batch's weights."""
    buffer = _buffer(unit)
    buffer.anneal_beta(0.5)
    for batch in (buffer.sample_windows(64, WINDOW), buffer.sample_prioritized(64, 2)):
        raw = batch.probabilities.numpy() ** -buffer.beta  # N cancels in the ratio
        np.testing.assert_allclose(batch.weights.numpy(), raw / raw.max(), rtol=2e-6, atol=0)
        assert batch.weights.max() == 1.0


@pytest.mark.statistical
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_draw_frequencies_follow_the_reported_probabilities(unit):
    """Counts of 20,000 draws fit the probabilities the batch reports (chunk: per anchor;
    episode: per episode), and not a flat law."""
    buffer = _buffer(unit)
    batch = buffer.sample_windows(DRAWS, WINDOW)
    chunk = unit == "chunk"
    cells = batch.episode_ids * 100 + batch.anchor_steps if chunk else batch.episode_ids
    keys, inverse = torch.unique(cells, return_inverse=True)
    counts = np.bincount(inverse.numpy(), minlength=keys.numel())
    reported = np.zeros(keys.numel())
    reported[inverse.numpy()] = batch.probabilities.numpy()  # one value per cell
    assert np.allclose(reported[inverse.numpy()], batch.probabilities.numpy(), rtol=0, atol=0)
    expected_cells = eligible_starts(LENGTHS, WINDOW.anchor_span)
    assert keys.numel() == (expected_cells.sum() if unit == "chunk" else (expected_cells > 0).sum())
    assert reported.sum() == pytest.approx(1.0, rel=1e-12)  # every cell was drawn
    assert chi_square_pvalue(counts, reported) > ACCEPT
    assert chi_square_pvalue(counts, np.ones(keys.numel())) < REJECT


def _segmented_buffer(priority_unit: str, unit: str) -> PrioritizedSequenceReplay:
    """Segments of 4 steps: an open episode whose head was evicted, closed episodes, distinct
    priorities set through the public route."""
    buffer = PrioritizedSequenceReplay(
        40, alpha=ALPHA, segment_length=4, seed=5, priority_unit=priority_unit, unit=unit
    )
    stream = buffer.open_episode()
    stream.append({"x": torch.arange(10)})
    for length in (7, 9):
        buffer.add(Episode({"x": torch.arange(length)}))
    stream.append({"x": torch.arange(10, 33)})  # evicts heads: its own and others'
    if priority_unit == "segment":
        ids = torch.arange(buffer.stats()["segments_added"])
    else:
        ids = torch.tensor(list(buffer.episode_ids))
    rng = np.random.default_rng(2)
    buffer.update_priorities(ids, rng.uniform(0.1, 5.0, ids.numel()))
    assert buffer.episode_info(0).first_step > 0 and buffer.open_episode_ids == [0]
    return buffer


def _segmented_law(buffer: PrioritizedSequenceReplay, window: Window) -> dict:
    """``P`` by anchor ``(episode, step)``, enumerated from the stored priorities: of the
    anchor (chunk) or of its episode (``unit="episode"``, ``N`` the eligible episodes)."""
    state = buffer.state_dict()
    table, anchors, by_anchor = state["table"], {}, {}
    for episode_id in buffer.episode_ids:
        info = buffer.episode_info(episode_id)
        need = window.open_anchor_span if info.is_open else window.anchor_span
        anchors[episode_id] = range(info.first_step, info.total_length - need + 1)
    if buffer.priority_unit == "segment":
        columns, episodes = table["columns"], table["episodes"]["columns"]["episode_id"]
        key = columns["episode_id"]
        stored = (key >= table["first_id"]) & (key < table["next_id"])
        for row in stored.nonzero().flatten().tolist():
            episode_id = int(episodes[int(columns["slot"][row])])
            first = int(columns["first_step"][row])
            for step in range(first, first + int(columns["length"][row])):
                by_anchor[(episode_id, step)] = float(columns["priority"][row]) ** ALPHA
    else:
        by_id = dict(zip(buffer.episode_ids, buffer.priorities.tolist(), strict=True))
        by_anchor = {(e, s): by_id[e] ** ALPHA for e in anchors for s in anchors[e]}
    if buffer.unit == "episode":
        masses = {e: by_anchor[(e, steps[0])] for e, steps in anchors.items() if len(steps)}
        total = sum(masses.values())
        return {(e, s): masses[e] / total for e in masses for s in anchors[e]}
    cells = [(e, s) for e in anchors for s in anchors[e]]
    total = sum(by_anchor[cell] for cell in cells)
    return {cell: by_anchor[cell] / total for cell in cells}


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize(
    ("priority_unit", "unit"), [("episode", "chunk"), ("segment", "chunk"), ("episode", "episode")]
)
def test_probabilities_on_segmented_buffers_are_the_enumerated_law(priority_unit, unit):
    """Across segments, open episodes and evicted heads, ``P`` is the anchor's (its segment's
    priority under ``priority_unit="segment"``) or its episode's; the weights follow it."""
    buffer = _segmented_buffer(priority_unit, unit)
    window = Window(2, burn_in=1, bootstrap=2)
    law = _segmented_law(buffer, window)
    batch = buffer.sample_windows(256, window)
    drawn = zip(batch.episode_ids.tolist(), batch.anchor_steps.tolist(), strict=True)
    expected = np.array([law[cell] for cell in drawn])
    np.testing.assert_allclose(batch.probabilities.numpy(), expected, rtol=1e-12, atol=0)
    raw = batch.probabilities.numpy() ** -buffer.beta
    np.testing.assert_allclose(batch.weights.numpy(), raw / raw.max(), rtol=2e-6, atol=0)


@pytest.mark.usefixtures("index_engine")
@pytest.mark.parametrize("selector", [None, Uniform()], ids=["prioritized", "uniform"])
def test_under_a_reuse_limit_each_anchor_reports_the_probability_of_its_round(selector):
    """With ``max_times_sampled=1`` a batch of every eligible episode runs in rounds; each
    anchor's ``P`` is its mass over the mass left when its round began (the episodes not
    drawn in earlier rounds), so the implied totals only shrink, from the whole mass."""
    buffer = _buffer("episode", max_times_sampled=1, selector=selector)
    eligible = [i for i, n in zip(buffer.episode_ids, LENGTHS, strict=True) if n >= SPAN]
    prioritized = selector is None
    masses = buffer.priorities.numpy() ** ALPHA if prioritized else np.ones(len(LENGTHS))
    mass = {i: masses[k] for k, i in enumerate(buffer.episode_ids)}
    batch = buffer.sample_windows(len(eligible), WINDOW)
    ids = batch.episode_ids.tolist()
    assert sorted(ids) == eligible  # every eligible episode once
    probabilities = batch.probabilities.numpy()
    implied = np.array([mass[i] for i in ids]) / probabilities
    left = [sum(mass[i] for i in eligible if i not in ids[:start]) for start in range(len(ids))]
    assert implied[0] == pytest.approx(left[0], rel=1e-12)
    for at, total in enumerate(implied):
        assert any(total == pytest.approx(left[start], rel=1e-12) for start in range(at + 1))
    assert (np.diff(implied) <= 1e-12 * implied[0]).all()  # rounds only remove mass
    roomy = _buffer("episode", max_times_sampled=50, selector=selector)
    single = roomy.sample_windows(8, WINDOW)  # one round: the whole law
    expected = _expected(roomy, single, SPAN, prioritized)
    np.testing.assert_allclose(single.probabilities.numpy(), expected, rtol=1e-13)


def test_anchors_given_to_gather_windows_have_no_probabilities():
    """``gather_windows`` draws nothing: ``probabilities`` (and weights) are None."""
    batch = _buffer().gather_windows([2, 3], [0, 4], WINDOW)
    assert batch.probabilities is None and batch.weights is None
    moved = batch.to("cpu")
    assert moved.probabilities is None


def test_out_batches_carry_the_probabilities_of_their_draw():
    """A batch passed back as ``out=`` receives the new draw's probabilities; one without
    them (from ``gather_windows``) is refused, and nothing changes."""
    buffer = _buffer()
    batch = buffer.sample_windows(4, WINDOW)
    again = buffer.sample_windows(4, WINDOW, out=batch)
    assert again is batch
    np.testing.assert_allclose(
        batch.probabilities.numpy(), _expected(buffer, batch, SPAN, True), rtol=1e-13
    )
    gathered = buffer.gather_windows([2, 3, 3, 5], [0, 4, 1, 2], WINDOW)
    assert_refused(
        buffer,
        lambda: buffer.sample_windows(4, WINDOW, prioritized=True, out=gathered),
        InvalidArgumentError,
        r"^out must be a batch with importance weights",
    )


# -------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: SequenceReplay(10, selector=Prioritized()),
            InvalidArgumentError,
            r"^selector must be without Prioritized\(\) on a SequenceReplay \(it keeps no "
            r"priorities\), got Prioritized\(alpha=None\)$",
        ),
        (
            lambda: PrioritizedSequenceReplay(10, selector="uniform"),
            InvalidTypeError,
            r"^selector must be None, Uniform\(\), Prioritized\(\), Recency\(half_life\) or "
            r"Mixture\(\{\.\.\.\}\), got 'uniform'$",
        ),
        (
            lambda: SequenceReplay(10, selector=Uniform),
            InvalidTypeError,
            r"^selector must be None, Uniform\(\), Prioritized\(\), Recency\(half_life\) or "
            r"Mixture\(\{\.\.\.\}\), got <class",
        ),
        (
            lambda: PrioritizedSequenceReplay(10, alpha=0.5, selector=Prioritized(0.7)),
            InvalidArgumentError,
            r"^alpha must be None or the selector's alpha \(0\.7\) when the selector carries "
            r"one, got 0\.5$",
        ),
        (lambda: Prioritized(-1.0), InvalidArgumentError, r"^alpha must be >= 0\.0 and finite"),
        (lambda: Prioritized(float("nan")), InvalidArgumentError, r"^alpha must be >= 0\.0"),
        (
            lambda: Prioritized("0.5"),
            InvalidTypeError,
            r"^alpha must be a real number, got '0\.5'$",
        ),
        (lambda: Prioritized(True), InvalidTypeError, r"^alpha must be a real number, got True$"),
    ],
)
def test_constructors_refuse_selectors_that_make_no_sense(make, error, match):
    """Each refusal names the argument and the value; the global random stream is untouched."""
    state = torch.random.get_rng_state()
    with pytest.raises(error, match=match):
        make()
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_selector_alpha_sets_the_buffer_alpha_and_an_equal_alpha_is_accepted():
    """``Prioritized(alpha)`` is the buffer's alpha; given twice it must agree."""
    assert PrioritizedSequenceReplay(10, selector=Prioritized(0.3)).alpha == 0.3
    assert PrioritizedSequenceReplay(10, alpha=0.3, selector=Prioritized(0.3)).alpha == 0.3
    assert PrioritizedSequenceReplay(10, alpha=0.3, selector=Prioritized()).selector == Prioritized(
        0.3
    )
    assert PrioritizedSequenceReplay(10).alpha == 0.6
    assert (
        SequenceReplay(10).selector == Uniform() == SequenceReplay(10, selector=Uniform()).selector
    )


def test_draws_refuse_flags_that_make_no_sense_and_change_nothing():
    """``prioritized`` must be a bool or None, and True only with priorities."""
    uniform = SequenceReplay(100, seed=0)
    uniform.extend(make_episode(n) for n in LENGTHS)
    assert_refused(
        uniform,
        lambda: uniform.sample_windows(4, WINDOW, prioritized=True),
        InvalidArgumentError,
        r"^prioritized must be False or None on a SequenceReplay, got True$",
    )
    buffer = _buffer(selector=Uniform())
    assert_refused(
        buffer,
        lambda: buffer.sample_windows(4, WINDOW, prioritized=1),
        InvalidTypeError,
        r"^prioritized must be a bool or None, got 1$",
    )


# ------------------------------------------------------------------------- checkpoints


def test_a_selector_survives_save_and_load_and_a_buffer_of_another_refuses_it(tmp_path):
    """A non-default selector is saved with the configuration: a loaded buffer draws as the
    saved one; a buffer of another selector refuses the state and changes nothing."""
    buffer = _buffer(selector=Uniform())
    buffer.sample_windows(8, WINDOW)
    buffer.save(tmp_path / "uniform.pt")
    loaded = PrioritizedSequenceReplay.load(tmp_path / "uniform.pt")
    assert loaded.selector == Uniform()
    _assert_same_draws(_draws(loaded), _draws(buffer))
    default = _buffer()
    assert "selector" not in default.state_dict()["config"]  # default configurations as before
    assert_refused(
        default,
        lambda: default.load_state_dict(buffer.state_dict()),
        CheckpointError,
        r"^checkpoint configuration must be .*got .*'selector': 'Uniform'",
    )
    alpha = PrioritizedSequenceReplay(50, selector=Prioritized(0.3), epsilon=EPSILON)
    alpha.save(tmp_path / "alpha.pt")
    assert PrioritizedSequenceReplay.load(tmp_path / "alpha.pt").selector == Prioritized(0.3)
