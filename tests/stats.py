"""The laws of prioritized draws in plain numpy, and the chi-square check of counts against them.

A statistical test draws at a fixed seed, so a pass is a pass: the thresholds only say how lucky
a seed had to be. Each test also shows its power: the same counts are rejected against a
plausible wrong law, so the test could fail.
"""

from __future__ import annotations

import numpy as np
import scipy.stats

from lucid_replay import Batch, WindowBatch

DRAWS = 20_000  # draws of a statistical check, unless it says otherwise
ACCEPT = 1e-3  # p-value above which counts fit the law under test
REJECT = 1e-6  # p-value below which counts are far from a wrong law (the test's power)


def chi_square_pvalue(observed: object, probabilities: object) -> float:
    """Chi-square goodness of fit of ``observed`` counts to ``probabilities`` (any scale).

    Cells of probability zero must be empty (asserted) and are left out of the test.

    Examples
    --------
    >>> round(chi_square_pvalue([50, 50], [1, 1]), 6)
    1.0
    >>> chi_square_pvalue([90, 10], [0.5, 0.5]) < REJECT
    True
    """
    counts = np.asarray(observed, dtype=np.float64)
    weights = np.asarray(probabilities, dtype=np.float64)
    possible = weights > 0
    assert counts[~possible].sum() == 0, "a zero-probability cell was drawn"
    expected = weights[possible] / weights[possible].sum() * counts.sum()
    return float(scipy.stats.chisquare(counts[possible], expected).pvalue)


def eligible_starts(lengths: object, length: int) -> np.ndarray:
    """``n_e``: the eligible chunk starts ``T - length + 1`` of each episode (0 if too short).

    >>> eligible_starts([4, 2, 6], 3).tolist()
    [2, 0, 4]
    """
    return np.maximum(np.asarray(lengths) - length + 1, 0)


def episode_counts(batch: Batch | WindowBatch, ids: list[int]) -> np.ndarray:
    """How often each of the consecutive episode ids ``ids`` was drawn in ``batch``."""
    return np.bincount(batch.episode_ids.numpy() - ids[0], minlength=len(ids))


def expected_weights(
    batch_priorities: np.ndarray,
    lengths: list[int],
    priorities: np.ndarray,
    length: int,
    alpha: float,
    beta: float,
    unit: str,
) -> np.ndarray:
    """``w = (N P)^-beta / max`` over the batch, ``P`` the probability of the drawn item.

    ``unit="chunk"``: ``P(chunk) = p^alpha / sum over eligible chunks`` and ``N`` the number of
    chunks; ``unit="episode"``: the same over eligible episodes.
    """
    counts = eligible_starts(lengths, length)
    scaled = priorities**alpha
    if unit == "chunk":  # P(chunk) = p^a / sum over eligible chunks; N = number of chunks
        total, population = (counts * scaled).sum(), counts.sum()
    else:  # P(episode) = p^a / sum over eligible episodes; N = number of eligible episodes
        total, population = ((counts > 0) * scaled).sum(), (counts > 0).sum()
    raw = (population * batch_priorities**alpha / total) ** -beta
    return raw / raw.max()
