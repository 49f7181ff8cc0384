"""Chi-square checks shared by the statistical tests.

A statistical test draws at a fixed seed, so a pass is a pass: the thresholds only say how lucky
a seed had to be. Each test also shows its power: the same counts are rejected against a
plausible wrong law, so the test could fail.
"""

from __future__ import annotations

import numpy as np
import scipy.stats

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
