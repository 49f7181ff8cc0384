"""The naive baseline on the reference configuration (its scaling rows live in scaling.py)."""

from __future__ import annotations

import torch

from benchmarks.config import Config
from benchmarks.data import Dataset
from benchmarks.naive import NaiveSequenceReplay
from benchmarks.rows import Row
from benchmarks.timing import measure


def naive_rows(
    config: Config, dataset: Dataset, errors: torch.Tensor, episode: dict[str, torch.Tensor]
) -> list[Row]:
    naive = NaiveSequenceReplay(
        config.transitions, alpha=config.alpha, beta=config.beta, seed=config.seed
    )
    for index in range(len(dataset.lengths)):
        naive.add(dataset.episode(index)[0])

    def sample() -> object:
        return naive.sample_windows(config.batch, config.burn_in, config.length, config.bootstrap)

    def sample_update() -> object:
        return naive.update_priorities_from(sample(), errors)  # type: ignore[arg-type]

    def loop() -> object:
        naive.add(episode)
        return sample_update()

    common = {"reps": config.reps, "warmup": config.warmup}
    rows = [
        Row.timed("naive.prioritized", "naive prioritized sample", measure(sample, **common)),
        Row.timed(
            "naive.prioritized_update",
            "naive prioritized sample + update",
            measure(sample_update, **common),
        ),
        Row.timed(
            "naive.loop",
            f"naive loop: add {config.add_len}-step episode + sample + update",
            measure(loop, **common),
        ),
    ]
    return rows
