"""lucid_replay.distributed: one prioritized replay sharded over Ray actors (or in-process).

`ShardedReplay` draws across shards exactly what a single `PrioritizedSequenceReplay` over
all of their episodes would draw, with global episode ids, a global maximum priority,
Reverb-style rate limiting (`SampleToInsertRatio`, `MinSize`, `RateLimiterTimeout`),
checkpoints and shard restarts. Ray (the ``distributed`` extra) is imported only when a
replay is created with ``backend="ray"``; ``backend="local"`` runs the same shard code in
this process.
"""

from lucid_replay.distributed.client import ShardedReplay
from lucid_replay.distributed.episode_streams import ShardedEpisodeStream
from lucid_replay.distributed.limiter import MinSize, SampleToInsertRatio

# Importable from here too, for code that catches what a sharded replay raises; exported
# (and documented) once, with the other errors, from `lucid_replay`.
from lucid_replay.errors import RateLimiterTimeout  # noqa: F401

__all__ = ["MinSize", "SampleToInsertRatio", "ShardedEpisodeStream", "ShardedReplay"]
