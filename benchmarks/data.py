"""One synthetic data set shared by every backend: same transitions, same episode boundaries.

Fields are the reference configuration's: ``obs float32[obs_dim]``, ``action int64``,
``reward float32`` and ``done`` / ``terminated`` / ``truncated`` bool (set at each episode's
last step).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from benchmarks.config import Config


@dataclasses.dataclass
class Dataset:
    fields: dict[str, torch.Tensor]  # flat [N, ...] tensors
    lengths: list[int]
    starts: list[int]
    terminated: list[bool]

    @property
    def num_transitions(self) -> int:
        return int(self.fields["obs"].shape[0])

    def episode(self, index: int) -> tuple[dict[str, torch.Tensor], bool]:
        """Per-step tensors of episode ``index`` (views, no copy) and its ``terminated`` flag."""
        begin, length = self.starts[index], self.lengths[index]
        return {k: v[begin : begin + length] for k, v in self.fields.items()}, self.terminated[
            index
        ]


def record_bytes(fields: dict[str, torch.Tensor]) -> int:
    """Bytes of one transition (all fields)."""
    return sum(t[0].numel() * t.element_size() for t in fields.values())


def episode_lengths(total: int, low: int, high: int, rng: np.random.Generator) -> list[int]:
    """Lengths uniform in ``[low, high]`` until they add up to at least ``total``."""
    lengths: list[int] = []
    count = 0
    while count < total:
        length = int(rng.integers(low, high + 1))
        lengths.append(length)
        count += length
    return lengths


def make_dataset(lengths: list[int], obs_dim: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    ends = starts + np.asarray(lengths) - 1
    terminated = rng.random(len(lengths)) < 0.5
    done = torch.zeros(total, dtype=torch.bool)
    done[torch.from_numpy(ends)] = True
    term = torch.zeros(total, dtype=torch.bool)
    term[torch.from_numpy(ends[terminated])] = True
    fields = {
        "obs": torch.randn(total, obs_dim, generator=generator),
        "action": torch.randint(0, 18, (total,), generator=generator),
        "reward": torch.randn(total, generator=generator),
        "done": done,
        "terminated": term,
        "truncated": done & ~term,
    }
    return Dataset(fields, list(lengths), starts.tolist(), terminated.tolist())


def reference_dataset(config: Config, total: int | None = None) -> Dataset:
    """Episodes of lengths uniform in [min_len, max_len] adding up to >= ``total``."""
    rng = np.random.default_rng(config.seed)
    lengths = episode_lengths(total or config.transitions, config.min_len, config.max_len, rng)
    return make_dataset(lengths, config.obs_dim, config.seed)


def cycled_episode(
    source: Dataset, offset: int, length: int, terminated: bool
) -> dict[str, torch.Tensor]:
    """A ``length``-step episode cut from ``source`` at ``offset`` (wrapped), for large fills."""
    begin = offset % (source.num_transitions - length)
    steps = {k: v[begin : begin + length] for k, v in source.fields.items()}
    done = torch.zeros(length, dtype=torch.bool)
    done[-1] = True
    steps["done"] = done
    steps["terminated"] = done if terminated else torch.zeros(length, dtype=torch.bool)
    steps["truncated"] = torch.zeros(length, dtype=torch.bool) if terminated else done
    return steps
