"""A vectorised sum tree: prefix-sum search and batched leaf updates on a flat tensor.

A tree over ``n`` leaves (``n`` a power of two) is a float64 tensor of ``2 n`` nodes: node 1 is
the root, node ``i`` has children ``2 i`` and ``2 i + 1``, and leaf ``j`` is node ``n + j``
(node 0 is unused). Each internal node holds exactly ``left + right`` as computed from its
children, so the tree is a pure function of its leaves: building from scratch and updating
in place give bitwise-identical nodes, and a subtree of zero leaves sums to exactly zero.

Sums are float64 because float32 sums drift under many updates, and the search can then walk
into zero-mass leaves or past the end; the search below additionally never enters a subtree
whose mass is zero. This module imports nothing from lucid_replay.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

__all__: list[str] = []  # internal module

# The step loops take numpy views of CPU tensors (same memory) or the tensors themselves.
_Array = TypeVar("_Array", np.ndarray, torch.Tensor)


def leaf_count(tree: torch.Tensor) -> int:
    """Number of leaves of ``tree``."""
    return int(tree.shape[0]) // 2


def build(leaves: torch.Tensor) -> torch.Tensor:
    """Return the tree over ``leaves`` (float64, length a power of two).

    Cost O(n) work in ``log2 n`` vectorised steps.
    """
    count = int(leaves.shape[0])
    if count < 1 or count & (count - 1):
        raise ValueError(f"leaves must have a power-of-two length, got {count}")
    tree = torch.zeros(2 * count, dtype=torch.float64, device=leaves.device)
    tree[count:] = leaves
    level = count
    while level > 1:
        tree[level // 2 : level] = tree[level : 2 * level].view(-1, 2).sum(dim=1)
        level //= 2
    return tree


def total(tree: torch.Tensor) -> torch.Tensor:
    """The sum of all leaves, a 0-d tensor (no host synchronisation)."""
    return tree[1]


def leaves(tree: torch.Tensor) -> torch.Tensor:
    """A view of the leaf values."""
    return tree[leaf_count(tree) :]


def set_leaves(tree: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Set leaves ``indices`` to ``values`` in place and refresh their ancestors.

    Indices may come in any order; duplicates reduce with ``max``. Cost O(k log n) for k
    indices (one sort, then `assign_leaves`).
    """
    if indices.numel() == 0:
        return
    # Sorting (unique) puts siblings together; scatter brings each value to its sorted index.
    unique, inverse = torch.unique(indices, return_inverse=True)
    reduced = torch.full(unique.shape, -torch.inf, dtype=tree.dtype, device=tree.device)
    assign_leaves(tree, unique, reduced.scatter_reduce_(0, inverse, values.to(tree.dtype), "amax"))


def assign_leaves(tree: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """`set_leaves` for indices already unique and sorted (no checks): 4 ops per level.

    Ancestors are recomputed from their children (never adjusted by a delta), so no rounding
    error accumulates and the result is bitwise that of `build`.
    """
    count = leaf_count(tree)
    nodes = indices + count
    tree[nodes] = values.to(tree.dtype)
    if tree.device.type == "cpu":  # numpy runs these tiny steps ~3x faster than torch
        _refresh_ancestors(tree.numpy(), nodes.numpy(), count.bit_length() - 1)
    else:
        _refresh_ancestors(tree, nodes, count.bit_length() - 1)


def _refresh_ancestors(tree: _Array, nodes: _Array, levels: int) -> None:
    """Recompute the ``levels`` ancestors of leaf ``nodes`` (numpy arrays or tensors)."""
    children = tree.reshape(-1, 2)  # row i holds nodes (2 i, 2 i + 1): the children of node i
    for _ in range(levels):
        nodes = nodes >> 1
        # Siblings share a parent; duplicate parents write the same value.
        pair = children[nodes]
        tree[nodes] = pair[:, 0] + pair[:, 1]  # numpy's sum(1) costs a ufunc reduce


def search(tree: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Return, for each target in ``[0, total)``, the leaf whose prefix-sum interval holds it.

    Leaf ``j`` is returned for ``sum(leaves[:j]) <= target < sum(leaves[:j + 1])``, so a leaf is
    hit with probability proportional to its value when targets are uniform on
    ``[0, total)``. A zero-mass leaf is never returned when ``total > 0``. Cost O(B log n) for B
    targets: ``log2 n`` vectorised steps of 6 ops.

    Notes
    -----
    Rounding can leave a target a hair past an interval's end, and the descent can then end on
    a zero-mass leaf. That is checked once at the end (one host synchronisation) and those rare
    targets are searched again with `_guarded_search`, which never enters an empty subtree.
    """
    count = leaf_count(tree)
    levels = count.bit_length() - 1
    start = torch.ones(targets.shape, dtype=torch.int64, device=tree.device)
    remaining = targets.to(torch.float64)
    if tree.device.type == "cpu":  # numpy runs these tiny steps ~3x faster than torch
        node = torch.from_numpy(_descend(tree.numpy(), start.numpy(), remaining.numpy(), levels))
    else:
        node = _descend(tree, start, remaining, levels)
    empty = tree[node] <= 0
    if bool(empty.any()):
        node[empty] = _guarded_search(tree, targets[empty]) + count
    return node - count


def _descend(tree: _Array, node: _Array, remaining: _Array, levels: int) -> _Array:
    """The unguarded descent of `search` (numpy arrays or tensors): 6 ops a level."""
    for _ in range(levels):
        node = node * 2  # the left child
        left = tree[node]
        go_right = remaining >= left
        remaining = remaining - left * go_right
        node = node + go_right
    return node


def _guarded_search(tree: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`search` that refuses to enter an empty right subtree at every level (9 ops a level)."""
    count = leaf_count(tree)
    children = tree.view(-1, 2)
    node = torch.ones(targets.shape, dtype=torch.int64, device=tree.device)
    remaining = targets.to(torch.float64)
    for _ in range(count.bit_length() - 1):
        pair = children[node]
        left, right = pair[..., 0], pair[..., 1]
        go_right = (remaining >= left) & (right > 0)
        remaining = torch.where(go_right, remaining - left, remaining)
        node = 2 * node + go_right
    return node - count
