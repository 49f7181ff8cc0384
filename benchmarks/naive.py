"""A naive episode replay, written the way the original design worked, as a scaling baseline.

Straightforward pure Python: a list of episode dicts, Python lists of priorities and
lengths re-laid on every eviction (``list.pop(0)`` shifts every list), and every draw
recomputing the episodes' masses and their cumulative sum with numpy (O(E) per sample), then
gathering each window with its own indexing ops. Nothing here is deliberately slowed down;
it is simply what one writes first, and it is correct (same anchor / window / weight
semantics as lucid_replay with ``boundary="pad"``).

Below the class: its rows on the reference configuration, and the helpers the scaling rows
use to build and time it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from benchmarks.config import Config
from benchmarks.data import Dataset, cycled_episode
from benchmarks.rows import Row
from benchmarks.timing import Timing, measure


class NaiveSequenceReplay:
    def __init__(
        self,
        capacity: int,
        *,
        alpha: float = 0.6,
        beta: float = 0.4,
        epsilon: float = 1e-6,
        seed: int = 0,
    ) -> None:
        self.capacity = capacity
        self.alpha, self.beta, self.epsilon = alpha, beta, epsilon
        self.episodes: list[dict[str, torch.Tensor]] = []
        self.priorities: list[float] = []
        self.ids: list[int] = []
        self.lengths: list[int] = []
        self.size = 0
        self.next_id = 0
        self.max_priority = 1.0
        self.rng = np.random.default_rng(seed)

    def add(self, steps: dict[str, torch.Tensor]) -> int:
        length = len(next(iter(steps.values())))
        while self.size + length > self.capacity:
            evicted = self.episodes.pop(0)
            self.priorities.pop(0)
            self.ids.pop(0)
            self.lengths.pop(0)
            self.size -= len(next(iter(evicted.values())))
        self.episodes.append({k: v.clone() for k, v in steps.items()})
        self.priorities.append(self.max_priority)
        self.ids.append(self.next_id)
        self.lengths.append(length)
        self.size += length
        self.next_id += 1
        return self.next_id - 1

    def sample_windows(
        self,
        batch_size: int,
        burn_in: int,
        length: int,
        bootstrap: int,
        *,
        prioritized: bool = True,
        allow_partial: bool = False,
    ) -> dict[str, torch.Tensor]:
        lengths = np.asarray(self.lengths)
        anchors = lengths if allow_partial else np.maximum(lengths - length + 1, 0)
        mass = anchors.astype(np.float64)
        if prioritized:
            mass = mass * np.asarray(self.priorities) ** self.alpha
        cumulative = np.cumsum(mass)
        total = cumulative[-1]
        picked = np.searchsorted(cumulative, self.rng.random(batch_size) * total, side="right")
        picked = np.minimum(picked, len(self.episodes) - 1)
        starts = (self.rng.random(batch_size) * anchors[picked]).astype(np.int64)
        size = burn_in + length + bootstrap
        record = np.arange(size) - burn_in
        windows: dict[str, list[torch.Tensor]] = {name: [] for name in self.episodes[0]}
        valid = []
        for episode_index, start in zip(picked.tolist(), starts.tolist(), strict=True):
            episode = self.episodes[episode_index]
            steps = record + start
            count = lengths[episode_index]
            valid.append(torch.from_numpy((steps >= 0) & (steps < count)))
            index = torch.from_numpy(np.clip(steps, 0, count - 1))
            for name, values in episode.items():
                windows[name].append(values[index])
        batch = {name: torch.stack(parts) for name, parts in windows.items()}
        batch["validity_mask"] = torch.stack(valid)
        learning = (record >= 0) & (record < length)
        batch["learning_mask"] = torch.from_numpy(learning).expand(batch_size, size)
        batch["episode_ids"] = torch.tensor([self.ids[i] for i in picked.tolist()])
        batch["anchor_steps"] = torch.from_numpy(starts)
        if prioritized:
            chunks = anchors.sum()
            probability = mass[picked] / total / anchors[picked]
            weights = (chunks * probability) ** -self.beta
            batch["weights"] = torch.from_numpy(weights / weights.max()).float()
        return batch

    def update_priorities_from(
        self, batch: dict[str, torch.Tensor], errors: torch.Tensor, eta: float = 0.9
    ) -> int:
        counted = batch["learning_mask"] & batch["validity_mask"]
        magnitudes = torch.where(counted, errors.abs(), torch.zeros_like(errors))
        mixed = eta * magnitudes.amax(1) + (1 - eta) * magnitudes.sum(1) / counted.sum(1).clamp(
            min=1
        )
        first = self.ids[0]
        updated: dict[int, float] = {}
        for episode_id, value in zip(batch["episode_ids"].tolist(), mixed.tolist(), strict=True):
            position = episode_id - first
            if 0 <= position < len(self.ids):
                priority = abs(value) + self.epsilon
                updated[position] = max(updated.get(position, 0.0), priority)
        for position, priority in updated.items():
            self.priorities[position] = priority
            self.max_priority = max(self.max_priority, priority)
        return len(updated)


def build(
    config: Config, capacity: int, lengths: Callable[[int], int], count: int, source: Dataset
) -> NaiveSequenceReplay:
    """``count`` episodes of ``lengths(i)`` steps cut from ``source`` (as the scaling rows')."""
    naive = NaiveSequenceReplay(capacity, alpha=config.alpha, beta=config.beta, seed=config.seed)
    offset = 0
    for index in range(count):
        naive.add(cycled_episode(source, offset, lengths(index), terminated=bool(index % 2)))
        offset += lengths(index)
    return naive


def time_sample(
    config: Config,
    naive: NaiveSequenceReplay,
    errors: torch.Tensor | None,
    *,
    allow_partial: bool,
) -> Timing:
    """A prioritized draw of the reference windows, followed by an update given ``errors``."""

    def step() -> object:
        drawn = naive.sample_windows(
            config.batch,
            config.burn_in,
            config.length,
            config.bootstrap,
            allow_partial=allow_partial,
        )
        return drawn if errors is None else naive.update_priorities_from(drawn, errors)

    return measure(step, reps=config.reps, warmup=config.warmup)


def naive_rows(
    config: Config, dataset: Dataset, errors: torch.Tensor, episode: dict[str, torch.Tensor]
) -> list[Row]:
    """The naive buffer on the reference configuration: sample, sample + update, loop."""
    naive = NaiveSequenceReplay(
        config.transitions, alpha=config.alpha, beta=config.beta, seed=config.seed
    )
    for index in range(len(dataset.lengths)):
        naive.add(dataset.episode(index)[0])

    def loop() -> object:
        naive.add(episode)
        drawn = naive.sample_windows(config.batch, config.burn_in, config.length, config.bootstrap)
        return naive.update_priorities_from(drawn, errors)

    reps, warmup = config.reps, config.warmup
    return [
        Row.timed(
            "naive.prioritized",
            "naive prioritized sample",
            time_sample(config, naive, None, allow_partial=False),
        ),
        Row.timed(
            "naive.prioritized_update",
            "naive prioritized sample + update",
            time_sample(config, naive, errors, allow_partial=False),
        ),
        Row.timed(
            "naive.loop",
            f"naive loop: add {config.add_len}-step episode + sample + update",
            measure(loop, reps=reps, warmup=warmup),
        ),
    ]
