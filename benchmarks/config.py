"""The reference configuration of the performance bars and the small ``--quick`` one."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    transitions: int = 1_000_000  # stored transitions (= capacity)
    min_len: int = 128  # episode lengths uniform in [min_len, max_len]
    max_len: int = 384
    obs_dim: int = 64
    batch: int = 256  # windows per batch
    burn_in: int = 40
    length: int = 64
    bootstrap: int = 5
    dilation: int = 1
    add_len: int = 256  # the episode added by the add / loop rows
    reps: int = 100
    warmup: int = 10
    add_reps: int = 2_000  # `add` and its memcpy take ~10-40 us: see `add_rows`
    alpha: float = 0.6
    beta: float = 0.4
    # Scaling rows: stored transitions (reference episodes), and episode counts at a fixed
    # transition total (episode length = episode_total // E).
    scale_transitions: tuple[int, ...] = (10_000, 100_000, 1_000_000, 10_000_000)
    scale_episodes: tuple[int, ...] = (1_000, 100_000, 1_000_000)
    episode_total: int = 4_000_000
    naive_max_episodes: int = 100_000  # the naive buffer is only built up to this many episodes
    # Streamed segments: the segmented buffers' segment length (also the appended piece's
    # length), and how many capacities of steps the endless stream of the memory row appends.
    segment_length: int = 256
    stream_capacities: int = 10
    seed: int = 0

    @property
    def window_size(self) -> int:
        return self.burn_in + self.length + self.bootstrap


REFERENCE = Config()
QUICK = dataclasses.replace(
    REFERENCE,
    transitions=100_000,
    reps=10,
    warmup=2,
    add_reps=200,
    scale_transitions=(10_000, 100_000, 300_000),
    scale_episodes=(1_000, 10_000, 30_000),
    episode_total=300_000,
    naive_max_episodes=10_000,
)
