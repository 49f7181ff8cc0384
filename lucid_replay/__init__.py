"""lucid_replay: episode-granular, prioritized sequence replay for PyTorch.

The data path is ``Episode -> storage -> sampling -> window -> batch``: whole episodes go into
a transition ring (`SequenceReplay`, `PrioritizedSequenceReplay`), anchors are drawn uniformly
or by priority, each anchor expands to a chunk or a `Window`, and records are gathered into a
`Batch` / `WindowBatch` on the learner's device.
"""

from lucid_replay.assembler import TrajectoryAssembler
from lucid_replay.batch import Batch, PrioritizedBatch, WindowBatch
from lucid_replay.episode import Episode
from lucid_replay.errors import (
    CheckpointError,
    EpisodesNotStoredError,
    InvalidArgumentError,
    InvalidTypeError,
    LucidReplayError,
    RateLimiterTimeout,
    ReuseLimitError,
    SchemaDtypeError,
    SchemaError,
    UnknownEpisodeError,
)
from lucid_replay.fields import Field
from lucid_replay.laws import Prioritized, Uniform
from lucid_replay.mixtures import Mixture
from lucid_replay.prioritized import PrioritizedSequenceReplay
from lucid_replay.protocols import Adds, PrioritizedReplayLike, ReplayLike
from lucid_replay.recency import Recency
from lucid_replay.replay import SequenceReplay
from lucid_replay.returns import n_step_returns
from lucid_replay.streams import EpisodeInfo, EpisodeStream
from lucid_replay.window import Window
from lucid_replay.writer import EpisodeWriter

__all__ = [
    "Adds",
    "Batch",
    "CheckpointError",
    "Episode",
    "EpisodeInfo",
    "EpisodeStream",
    "EpisodeWriter",
    "EpisodesNotStoredError",
    "Field",
    "InvalidArgumentError",
    "InvalidTypeError",
    "LucidReplayError",
    "Mixture",
    "Prioritized",
    "PrioritizedBatch",
    "PrioritizedReplayLike",
    "PrioritizedSequenceReplay",
    "RateLimiterTimeout",
    "Recency",
    "ReplayLike",
    "ReuseLimitError",
    "SchemaDtypeError",
    "SchemaError",
    "SequenceReplay",
    "TrajectoryAssembler",
    "Uniform",
    "UnknownEpisodeError",
    "Window",
    "WindowBatch",
    "n_step_returns",
]

__version__ = "0.1.0"
