"""What crosses between the host and the device in a DDTree round (cuda_engine/ddtree.py): the verify inputs
of a host-built tree (`pack_tree_inputs`), the device builder's tree (`unpack_tree`) and the round's one copy
back (`RoundCopy`), each with its int32 layout.

Legend: T verify rows (root + nodes), V vocab.
"""
from __future__ import annotations

import numpy as np

from cuda_engine.device import CudaEngineError
from refmodel.ddtree import Tree


def pack_tree_inputs(tree: Tree, root: int, start: int, pos0: int) -> np.ndarray:
    """The verify's inputs as one int32 block [4 + 3T]: the target's meta (cached rows = start), ids
    [root, tokens], positions pos0 + start + [0, depths] (refmodel.ddtree.compile_tree's), parents [T]."""
    T = tree.size
    ti = np.zeros(4 + 3 * T, np.int32)
    ti[0] = start
    ti[4] = root
    ti[5:4 + T] = tree.tokens
    ti[4 + T:4 + 2 * T] = pos0 + start + np.concatenate([[0], tree.depths])
    ti[4 + 2 * T:] = tree.parents
    return ti


def unpack_tree(rec: np.ndarray, T: int) -> tuple[Tree, np.ndarray]:
    """(the device builder's tree, the verify argmax [T]) from the rec block [1 + 5T] (kernels/ddtree.cu).
    The tree carries no visibility matrix (the device builds the mask from the parents) and no scores."""
    n = int(rec[0])
    if n != T - 1:
        raise CudaEngineError(f"device tree builder made {n} nodes where the verify was sized for {T - 1}")
    sec = [rec[1 + k * T:1 + (k + 1) * T].astype(np.int64) for k in range(5)]
    ids, parents, depths, ranks, post = sec
    child_maps = [{} for _ in range(T)]
    for k in range(1, T):
        child_maps[int(parents[k])][int(ids[k])] = k
    return Tree(ids[1:], depths[1:], parents, child_maps, None, ranks[1:], np.zeros(0)), post


class RoundCopy:
    """What one round sends back in its one copy (DDTreeState.io), by name. Layout (int32, T = verify rows):
    n (nodes), then T each of ids, parents, depths, ranks (the device builder's tree), the verify argmax and
    the accepted path, then n_acc and bonus (the device walk's), then the verify logits [rows, V] as float32
    (rows <= T: a cut verify's rows only)."""

    def __init__(self, io: np.ndarray, T: int, V: int):
        self.tree_rec = io[:1 + 5 * T]                                   # n + tree + argmax: unpack_tree's
        self.argmax = io[1 + 4 * T:1 + 5 * T]
        self.root = int(io[1])                                           # ids[0]
        self.n_acc, self.bonus = int(io[1 + 6 * T]), int(io[2 + 6 * T])
        self.accepted = io[1 + 5 * T:1 + 5 * T + self.n_acc]
        self.logits = io[3 + 6 * T:].view(np.float32).reshape(-1, V)
