"""DDTree speculative decoding (shared/spec/ddtree.md): the best-first draft-tree builder, tree compile,
the greedy acceptance walk, and one generation loop that runs DDTree, the DFlash chain and plain AR.

Legend: V vocab, L draft depth (= block_size - 1), N node budget (non-root nodes), n built nodes,
S committed context length (= start), T rows in one target forward.
"""
import heapq
from dataclasses import dataclass

import numpy as np


# ----------------------------------------------------------------------------------------------------
# Tree builder (spec §2.2, byte-for-byte the reference algorithm)


@dataclass
class Tree:
    """A draft tree. Index 0 is the root (the previous bonus token); nodes 1..n are in heap-pop order,
    so scores are non-increasing and parents[i] < i (spec §2.3)."""
    tokens: np.ndarray       # [n] int64, token of node i+1
    depths: np.ndarray       # [n] int64, depth 1..L of node i+1 (the root has depth 0)
    parents: np.ndarray      # [n+1] int64, parents[0] = -1
    child_maps: list         # n+1 dicts {token: child index}
    visibility: np.ndarray   # [n+1, n+1] bool, row i = ancestors of i (root included) and i itself
    ranks: np.ndarray        # [n] int64, per-depth top-K rank of node i+1 (0 = the drafter's argmax)
    scores: np.ndarray       # [n] float64, sum of float32 log-probs along the path to node i+1

    @property
    def size(self) -> int:
        """Number of verified rows: root + nodes."""
        return 1 + len(self.tokens)


def _top_log_probs(draft_logits: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row top-K token ids and their float32 log-softmax values, best first. Ties between equal
    logits go to the lower token id (stable sort); the reference's torch.topk leaves that order
    implementation-defined, and ties change only the tree, never the output (spec §2.3)."""
    x = np.asarray(draft_logits, dtype=np.float32)                      # [L, V]
    top_id = np.argsort(-x, axis=-1, kind="stable")[:, :K]              # [L, V] -> [L, K]
    top_logit = np.take_along_axis(x, top_id, axis=-1)                  # [L, K]
    m = x.max(axis=-1, keepdims=True)                                   # [L, 1]
    log_z = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True, dtype=np.float32))  # [L, 1] float32
    return top_id.astype(np.int64), (top_logit - log_z).astype(np.float32)


def _root_only() -> Tree:
    e = np.zeros(0, dtype=np.int64)
    return Tree(e, e.copy(), np.array([-1], dtype=np.int64), [{}], np.ones((1, 1), dtype=bool),
                e.copy(), np.zeros(0))


def build_ddtree(draft_logits: np.ndarray, budget: int, topk: int | None = None) -> Tree:
    """The N = budget most probable prefixes under the factorised draft distribution (spec §2.2).
    draft_logits [L, V]: row d-1 is the depth-d marginal. topk overrides K = min(N, V); topk=1 with
    budget = L is the vanilla DFlash chain."""
    L, V = draft_logits.shape
    if budget <= 0 or L == 0:
        return _root_only()
    K = min(budget if topk is None else topk, V)
    top_id, lp = _top_log_probs(draft_logits, K)                        # [L, K], [L, K]
    first = float(lp[0, 0])
    # Entry: (-score, rank path, parent, depth, rank, score). Equal scores fall to the rank path:
    # the lexicographically smaller path wins and a prefix beats its extension (spec §2.3).
    heap = [(-first, (0,), 0, 1, 0, first)]
    tokens, depths, ranks, scores, parents, child_maps = [], [], [], [], [-1], [{}]
    while heap and len(tokens) < budget:
        _, path, par, d, r, logw = heapq.heappop(heap)
        tok, idx = int(top_id[d - 1, r]), len(tokens) + 1
        tokens.append(tok); depths.append(d); ranks.append(r); scores.append(logw); parents.append(par)
        child_maps.append({})
        child_maps[par][tok] = idx
        if r + 1 < K:  # next sibling, score formed incrementally as the reference does
            s = logw - float(lp[d - 1, r]) + float(lp[d - 1, r + 1])
            heapq.heappush(heap, (-s, path[:-1] + (r + 1,), par, d, r + 1, s))
        if d < L:      # first child: the rank-0 token one level deeper
            c = logw + float(lp[d, 0])
            heapq.heappush(heap, (-c, path + (0,), idx, d + 1, 0, c))
    n = len(tokens)
    vis = np.zeros((n + 1, n + 1), dtype=bool)                          # [n+1, n+1]
    vis[0, 0] = True
    for i in range(1, n + 1):  # parents[i] < i, so the parent's row is final already
        vis[i, :i] = vis[parents[i], :i]
        vis[i, i] = True
    i64 = np.int64
    return Tree(np.array(tokens, i64), np.array(depths, i64), np.array(parents, i64), child_maps, vis,
                np.array(ranks, i64), np.array(scores, np.float64))
