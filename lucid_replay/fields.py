"""`Field`: one stored field declared with how it is kept and how batches read it.

A buffer's ``schema=`` maps each name to ``(shape, dtype)`` or to a `Field`; `Field` adds
what the pair cannot say: ``stack=k`` gathers each record as the last ``k`` frames of its
episode while every step stores one frame (`lucid_replay.stacks` rebuilds the stacks in the
gather), and ``codec=`` keeps the steps compressed (`lucid_replay.blocks`).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from lucid_replay.errors import must, wrong_type

__all__ = ["Field"]

STACK_PADS = ("same", "zeros")
CODECS = ("zstd", "lz4")


def _check_shape(instance: Field, attribute: attrs.Attribute[Any], shape: Any) -> None:
    if not isinstance(shape, tuple) or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape
    ):
        raise must("shape", "a tuple of ints >= 0", shape)


def _check_dtype(instance: Field, attribute: attrs.Attribute[Any], dtype: Any) -> None:
    if not isinstance(dtype, torch.dtype):
        raise wrong_type("dtype", "a torch.dtype", dtype)


def _check_stack(instance: Field, attribute: attrs.Attribute[Any], stack: Any) -> None:
    if isinstance(stack, bool) or not isinstance(stack, int):
        raise wrong_type("stack", "an int", stack)
    if stack < 1 or stack > MAX_STACK:
        raise must("stack", f"an int in [1, {MAX_STACK}]", stack)


def _check_pad(instance: Field, attribute: attrs.Attribute[Any], pad: Any) -> None:
    if not isinstance(pad, str) or pad not in STACK_PADS:
        raise must("stack_pad", f"one of {STACK_PADS}", pad)


def _check_codec(instance: Field, attribute: attrs.Attribute[Any], codec: Any) -> None:
    if codec is None:
        return
    if not isinstance(codec, str) or codec not in CODECS:
        raise must("codec", f"None or one of {CODECS}", codec)
    from lucid_replay.block_files import codec_module  # numpy and the codec: only when asked

    codec_module(codec)  # an ImportError that names the extra to install


MAX_STACK = 1024  # frames a record stacks: far beyond any frame stack in use


@attrs.frozen
class Field:
    """A stored field: per-step ``shape`` and ``dtype``, and how a gathered batch reads it.

    Parameters
    ----------
    shape
        The per-step shape (a tuple of ints ``>= 0``): what each step stores, and what
        `SequenceReplay.add`, episode streams and ``buffer[id]`` carry.
    dtype
        The stored torch dtype.
    stack
        Frames per record in a gathered batch (``1 <= stack <= 1024``). With ``stack=k > 1``
        each step still stores one frame; a batch (`SequenceReplay.sample`,
        ``sample_windows``, ``gather_windows``, ``iterate``, ``out=``, TensorDicts) holds
        the field as ``[..., k, *shape]`` per record: frames ``t - k + 1 .. t`` of the
        record's episode, oldest first. A record clamped by a window boundary carries the
        stack of the step it was clamped to.
    stack_pad
        Frames before the episode's first stored step: ``"same"`` repeats that first frame
        (gymnasium's ``FrameStackObservation(env, k)``, ``padding_type="reset"``);
        ``"zeros"`` makes them zeros (``padding_type="zero"``).
    codec
        ``None`` (raw steps), ``"zstd"`` or ``"lz4"``: the field's steps are kept as
        compressed blocks of 32 consecutive ring slots, and a gather decodes only the blocks
        it reads, through a cache of decoded blocks (``cache_bytes`` of the buffer). Batches
        are bit-identical to an uncompressed field's. Needs the extra ``compress``
        (``zstandard``, ``lz4``) and CPU storage (``device="cpu"``); with
        ``storage="memmap"`` the blocks are kept in a sparse file of the buffer's directory,
        so the disk and the page cache hold only the compressed frames.

    Raises
    ------
    InvalidArgumentError
        For a negative or non-int dimension, ``stack`` out of range, an unknown
        ``stack_pad`` or ``codec``.
    ImportError
        For a ``codec`` whose library is not installed (it names the extra).
    InvalidTypeError
        For a ``dtype`` that is not a ``torch.dtype`` or a ``stack`` that is not an int
        (``bool`` included).

    Notes
    -----
    A stack costs nothing in storage: the ring keeps one frame per step (what
    ``memory_report`` counts), and the gather reads ``k`` frames per record. With the
    ``T + 1`` records of an `EpisodeWriter` episode the next observation's stack is the
    next record's. A ``stack=1`` field is the ``(shape, dtype)`` pair (``stack_pad`` then
    has no effect and is not kept).

    Examples
    --------
    >>> import torch
    >>> from lucid_replay import Episode, SequenceReplay, Window
    >>> obs = Field((2,), torch.uint8, stack=3)
    >>> buffer = SequenceReplay(100, schema={"obs": obs}, seed=0)
    >>> frames = torch.arange(10, dtype=torch.uint8).view(5, 2)  # [2t, 2t + 1]
    >>> buffer.add(Episode({"obs": frames}))
    0
    >>> buffer[0]["obs"].shape  # one frame per step
    torch.Size([5, 2])
    >>> first = torch.tensor([0])  # episode 0, step 0
    >>> batch = buffer.gather_windows(first, first, Window(2))
    >>> batch.data["obs"][0, :, :, 0].tolist()  # before step 0: frame 0
    [[0, 0, 0], [0, 0, 2]]
    """

    shape: tuple[int, ...] = attrs.field(validator=_check_shape)
    dtype: torch.dtype = attrs.field(validator=_check_dtype)
    stack: int = attrs.field(default=1, kw_only=True, validator=_check_stack)
    stack_pad: str = attrs.field(default="same", kw_only=True, validator=_check_pad)
    codec: str | None = attrs.field(default=None, kw_only=True, validator=_check_codec)

    def to_state(self) -> dict[str, Any]:
        """What a checkpoint keeps beside shape and dtype: ``stack``, ``stack_pad``, ``codec``."""
        return {"stack": self.stack, "stack_pad": self.stack_pad, "codec": self.codec}
