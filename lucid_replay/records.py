"""The values a draw hands along the data path: anchors, then the records they expand to.

``draw -> Anchors -> expand -> Records -> gather``: the sampler returns `Anchors` (which
episode rows and steps), `lucid_replay.window.expand` turns them into `Records` (where each
record of each window lands, and its masks), and the batcher reads those records out of the
ring. `RecordArrays` are destinations that `expand` may write its ``[B, W]`` results into
(a batch's own per-record tensors). All hold arrays of the `lucid_replay.engine` (numpy on
CPU), so the stages pass them on without converting to tensors and back.
"""

from __future__ import annotations

import attrs

from lucid_replay.engine import Array

__all__: list[str] = []  # internal module


@attrs.frozen(eq=False)
class Anchors:
    """Drawn anchors: table rows, episode ids and steps (int64 ``[B]``).

    ``priorities`` (float64 ``[B]``) are the drawn episodes' priorities for a prioritized
    draw, from which the caller computes importance weights over the whole batch; ``None``
    for a uniform draw. ``weights`` (float32 ``[B]``) are those weights once computed.
    ``probabilities`` (float64 ``[B]``): each anchor's probability in the draw that chose
    it (`lucid_replay.laws.Law.probability`); ``None`` for anchors no draw chose.
    """

    rows: Array
    episode_ids: Array
    steps: Array
    priorities: Array = None
    weights: Array = None
    probabilities: Array = None


@attrs.frozen(eq=False)
class Records:
    """Where each record of ``B`` windows of ``W`` records lands (``[B, W]`` unless noted).

    Record ``k`` of window ``b`` holds step ``steps[b, k]`` of the episode in table row
    ``rows[b, k]`` (``rows[b, 0]`` when ``rows`` is ``[B, 1]``: one episode per window), at
    global offset ``EpisodeTable.offsets(rows, steps)`` (broadcast). Where ``clamped``
    is False (every record is the step it targets, in the anchor's episode), record ``k``
    is also at offset ``first_offsets[b] + k * dilation``; the gather reads those runs as
    blocks and takes ``rows`` and ``steps`` only for the records that are not ``valid``.
    ``filled``: `expand` wrote the per-record entries into `RecordArrays` (the learning mask
    and record index too). ``exact``, when set, says which records lie at their run offset
    (windows across segment seams: valid records of the anchor's own segment).
    """

    first_offsets: Array  # [B]: where record 0 would be without clamping
    rows: Array  # [B, W], or [B, 1] when every window lies in its anchor's episode
    episode_ids: Array
    steps: Array
    valid: Array
    is_init: Array
    terminal: Array
    clamped: bool
    filled: bool = False
    exact: Array = None  # [B, W]: records at their run offset (None: ``valid`` if clamped)
    runs: tuple[Array, Array, int] | None = None  # see `TransitionRing.gather_runs`


@attrs.frozen(eq=False)
class RecordArrays:
    """Destinations ``[B, W]`` for `expand` to write records into (a batch's own tensors).

    ``learning`` and ``sequence`` receive the window's learning mask and record index.
    """

    steps: Array
    valid: Array
    is_init: Array
    terminal: Array
    episode_ids: Array
    learning: Array
    sequence: Array


def blocks_pay(repaired: int, records: int) -> bool:
    """Whether a gather copies each window's block, then ``repaired`` of ``records`` over them.

    Else it copies every record (or run) once. A block is the cheapest copy there is, and a
    repaired record is copied twice: blocks pay while fewer than a quarter are repaired.
    """
    return 4 * repaired < records
