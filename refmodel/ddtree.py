"""DDTree speculative decoding (docs/ddtree.md): the best-first draft-tree builder, tree compile,
the greedy acceptance walk, and one generation loop that runs DDTree, the DFlash chain and plain AR.

Legend: V vocab, L draft depth (= block_size - 1), N node budget (non-root nodes), n built nodes,
S committed context length (= start), T rows in one target forward.

Positions: cache row j holds position pos0 + j, where pos0 is the position of the prompt's first token (0
for an ordinary prompt; a golden bundle's long-position prompt starts at a large pos0 with a cache holding
only its own rows). Everything that indexes the cache uses rows (start); everything that rotates uses
positions (pos0 + start + depth).
"""
import heapq
from dataclasses import dataclass, field

import numpy as np

from refmodel.drafter import DrafterCache, DrafterConfig, drafter_forward, target_features
from refmodel.model import KVCache, forward, weights_dtype


# ----------------------------------------------------------------------------------------------------
# Tree builder (docs/ddtree.md §3, byte-for-byte the published DDTree algorithm)


@dataclass
class Tree:
    """A draft tree. Index 0 is the root (the previous bonus token); nodes 1..n are in heap-pop order,
    so scores are non-increasing and parents[i] < i (docs/ddtree.md §3)."""
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
    implementation-defined, and ties change only the tree, never the output (docs/ddtree.md §3)."""
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
    """The N = budget most probable prefixes under the factorised draft distribution (docs/ddtree.md §3).
    draft_logits [L, V]: row d-1 is the depth-d marginal. topk overrides K = min(N, V); topk=1 with
    budget = L is the vanilla DFlash chain."""
    L, V = draft_logits.shape
    if budget <= 0 or L == 0:
        return _root_only()
    K = min(budget if topk is None else topk, V)
    top_id, lp = _top_log_probs(draft_logits, K)                        # [L, K], [L, K]
    first = float(lp[0, 0])
    # Entry: (-score, rank path, parent, depth, rank, score). Equal scores fall to the rank path:
    # the lexicographically smaller path wins and a prefix beats its extension (docs/ddtree.md §3).
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
    i64 = np.int64
    return Tree(np.array(tokens, i64), np.array(depths, i64), np.array(parents, i64), child_maps,
                visibility(parents), np.array(ranks, i64), np.array(scores, np.float64))


# ----------------------------------------------------------------------------------------------------
# The cost-aware budget (docs/ddtree.md §3a): how many of a built tree's nodes pay for their verify rows


def expected_tokens(scores: np.ndarray) -> np.ndarray:
    """[n + 1]: entry b = the tokens a round commits in expectation when only the first b nodes (heap-pop
    order) are verified, under the drafter's own factorised distribution: the bonus token plus, per node, the
    probability that the target's greedy continuation runs through it (exp of its path log-prob)."""
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.exp(np.asarray(scores, np.float64)))])


def cost_aware_nodes(scores: np.ndarray, verify_cost, draft_cost: float = 0.0) -> int:
    """The b in 0..n that maximises expected tokens per unit cost, expected_tokens(scores)[b] /
    (draft_cost + verify_cost(b + 1)); verify_cost(T): the cost of one target forward over T rows (root
    included), in any unit, non-decreasing in T. Ties go to the smaller tree."""
    gain = expected_tokens(scores)
    cost = np.array([draft_cost + float(verify_cost(b + 1)) for b in range(len(gain))])
    if np.any(~np.isfinite(cost)) or np.any(cost <= 0):
        raise ValueError(f"verify costs must be finite and positive, got {cost.tolist()}")
    return int(np.argmax(gain / cost))


def prune_tree(tree: Tree, b: int) -> Tree:
    """The tree's first b nodes (heap-pop order): the tree build_ddtree makes with budget b from the same
    logits (a popped node's parent was popped before it, so any prefix is closed under ancestors)."""
    if not 0 <= b <= len(tree.tokens):
        raise ValueError(f"prune_tree: b={b} outside 0..{len(tree.tokens)}")
    if b == len(tree.tokens):
        return tree
    child_maps = [{t: c for t, c in m.items() if c <= b} for m in tree.child_maps[:b + 1]]
    vis = None if tree.visibility is None else tree.visibility[:b + 1, :b + 1].copy()   # None: a device tree's
    return Tree(tree.tokens[:b].copy(), tree.depths[:b].copy(), tree.parents[:b + 1].copy(), child_maps, vis,
                tree.ranks[:b].copy(), tree.scores[:b].copy())


def verify_cost_table(points: dict[int, float]):
    """verify_cost(T) interpolated linearly in T between measured {rows: cost} points (at least two),
    extended linearly past the last two: e.g. the K2.6 layer's verify / AR step ratios of docs/k26-scale.md."""
    rows = np.array(sorted(points), np.float64)
    cost = np.array([float(points[r]) for r in sorted(points)])
    if len(rows) < 2 or rows[0] < 1 or not np.all(np.isfinite(cost)) or np.any(np.diff(cost) < 0) or np.any(cost <= 0):
        raise ValueError(f"verify costs {points}: need two or more points at T >= 1, finite, positive, non-decreasing")
    slope = (cost[-1] - cost[-2]) / (rows[-1] - rows[-2])

    def verify_cost(T: int) -> float:
        if T <= rows[-1]:
            return float(np.interp(T, rows, cost))
        return float(cost[-1] + slope * (T - rows[-1]))
    return verify_cost


def parse_verify_costs(text: str) -> dict[int, float]:
    """A verify price table written "rows:cost,rows:cost,..." (e.g. 1:1,2:1.54,33:10.54, the K2.6 layer's
    verify / AR step ratios) as {rows: cost}, checked by verify_cost_table; a ValueError naming the text."""
    try:
        costs = {int(r): float(c) for r, c in (p.split(":") for p in text.split(","))}
        verify_cost_table(costs)
    except ValueError as e:
        raise ValueError(f"verify costs {text!r}: give two or more rows:cost pairs, rows >= 1, costs positive and "
                         f"non-decreasing in rows, e.g. 1:1,2:1.54,33:10.54 ({e})") from None
    return costs


def visibility(parents) -> np.ndarray:
    """[n+1, n+1] bool: row i = the ancestors of i (root included) and i itself (docs/ddtree.md §3)."""
    n = len(parents) - 1
    vis = np.zeros((n + 1, n + 1), dtype=bool)                          # [n+1, n+1]
    vis[0, 0] = True
    for i in range(1, n + 1):  # parents[i] < i, so the parent's row is final already
        vis[i, :i] = vis[parents[i], :i]
        vis[i, i] = True
    return vis


# ----------------------------------------------------------------------------------------------------
# Verification (docs/ddtree.md §4, §5): compile, one target forward, greedy walk, in-order compaction


def compile_tree(tree: Tree, root: int, start: int, pos0: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Target inputs for one verify forward: ids [T] = [root, tokens], positions [T] = pos0 + start + depth
    (depth-based, not sequential), additive mask [T, start + T]: the committed context is visible to every
    row, inside the tree only ancestors and self (docs/ddtree.md §4)."""
    ids = np.concatenate([[root], tree.tokens]).astype(np.int64)               # [T]
    positions = pos0 + start + np.concatenate([[0], tree.depths]).astype(np.int64)   # [T]
    mask = np.zeros((tree.size, start + tree.size))                           # [T, S+T]
    mask[:, start:] = np.where(tree.visibility, 0.0, -np.inf)
    return ids, positions, mask


def walk(child_maps: list, post: np.ndarray) -> tuple[list, int]:
    """Greedy acceptance (docs/ddtree.md §4): follow the target's argmax down the tree while it matches a child.
    Returns the accepted node indices (root first, strictly increasing) and the bonus token."""
    acc, cur, nxt = [0], 0, int(post[0])
    while nxt in child_maps[cur]:
        cur = child_maps[cur][nxt]
        acc.append(cur)
        nxt = int(post[cur])
    return acc, nxt


# ----------------------------------------------------------------------------------------------------
# Generation: one loop for DDTree (budget N), the DFlash chain (topk=1, N=B-1) and plain AR (N=0: the tree
# is the root alone, no drafter call, one token per target forward). Stops by length only (docs/ddtree.md §1).


@dataclass
class Round:
    """One draft-verify round, recorded for golden bundles and engine comparison."""
    start: int                  # committed length before the round; the root sits at position pos0 + start
    tree_tokens: np.ndarray     # [n] node tokens (verify ids = [root, tree_tokens])
    parents: np.ndarray         # [n+1]
    depths: np.ndarray          # [n]
    ranks: np.ndarray           # [n] per-depth draft rank; an accepted rank >= 1 node leaves the top-1 spine
    verify_argmax: np.ndarray   # [n+1] target argmax at every verified row
    accepted: list              # accepted node indices, root first
    bonus: int                  # the target's token after the last accepted node
    tree_size: int              # n+1 verified rows
    accepted_depth: int         # accepted draft tokens (len(accepted) - 1); tokens this round = depth + 1
    path_logits: np.ndarray     # [len(accepted), V] the verify logits of the committed rows


@dataclass
class Counters:
    target_forwards: int = 0    # prefill included
    drafter_forwards: int = 0
    tokens_per_round: list = field(default_factory=list)   # len(accepted) per round (root included)


@dataclass
class GenResult:
    tokens: list                # exactly max_new_tokens generated tokens (the prompt excluded)
    rounds: list                # Round per round when record=True, else empty
    counters: Counters


@dataclass
class Decoder:
    """Between rounds: out[:start] is committed and in `cache`; out[start] is the pending bonus (next root);
    ctx holds the fused target features of the rows committed since the last drafter call; the drafter
    cache holds context rows [0, start - len(ctx)). Row j is at position pos0 + j."""
    out: list
    start: int
    cache: KVCache
    dcache: DrafterCache | None
    ctx: np.ndarray | None
    counters: Counters
    pos0: int = 0


def prefill(cfg, W, prompt, dcfg: DrafterConfig | None = None, pos0: int = 0) -> Decoder:
    """Causal forward over the prompt at positions pos0..pos0+P-1; its argmax is the first bonus and its
    features the first context."""
    P = len(prompt)
    if P < 1:
        raise ValueError("prompt must hold at least one token")
    dtype = weights_dtype(W)       # float64 oracle; float32 for the reference engine
    cache = KVCache(cfg, dtype)
    logits, hiddens = forward(cfg, W, np.asarray(prompt, dtype=np.int64), pos0 + np.arange(P), cache)  # [P, V]
    ctx = None if dcfg is None else target_features(dcfg, hiddens)                           # [P, F]
    dcache = None if dcfg is None else DrafterCache(dcfg, dtype)
    out = [int(t) for t in prompt] + [int(np.argmax(logits[-1]))]
    return Decoder(out, P, cache, dcache, ctx, Counters(target_forwards=1), pos0)


def draft_logits(W, dcfg, DW, dec: Decoder) -> np.ndarray:
    """One drafter call on [bonus, MASK x (B-1)]: the per-depth logits [B-1, V] (docs/ddtree.md §2)."""
    block = [dec.out[dec.start]] + [dcfg.mask_token_id] * (dcfg.block_size - 1)
    q_logits = drafter_forward(dcfg, DW, W, block, dec.ctx, dec.dcache, dec.start, dec.pos0)   # [B-1, V]
    dec.counters.drafter_forwards += 1
    dec.ctx = None                       # consumed: those rows now live in the drafter cache
    return q_logits


def draft_tree(W, dcfg, DW, dec: Decoder, budget: int, topk: int | None) -> Tree:
    """One drafter call and the best-first tree over its B-1 marginals."""
    if budget <= 0:
        return _root_only()
    return build_ddtree(draft_logits(W, dcfg, DW, dec), budget, topk)


def verify_round(cfg, W, dcfg, dec: Decoder, tree: Tree) -> Round:
    """One target forward over the compiled tree, greedy walk, commit and in-order KV compaction."""
    start = dec.start
    ids, positions, mask = compile_tree(tree, dec.out[start], start, dec.pos0)
    logits, hiddens = forward(cfg, W, ids, positions, dec.cache, mask)   # appends T rows at [start, start+T)
    dec.counters.target_forwards += 1
    post = np.argmax(logits, axis=-1)                                  # [T]
    acc, bonus = walk(tree.child_maps, post)
    dec.cache.compact(start, acc)                                      # rows start+acc[i] -> start+i
    if dcfg is not None:
        dec.ctx = target_features(dcfg, hiddens)[acc]                  # [len(acc), F], path order
    dec.out[start + 1:] = [int(t) for t in ids[acc[1:]]] + [bonus]     # out[start] = root, already there
    dec.start = start + len(acc)
    dec.counters.tokens_per_round.append(len(acc))
    return Round(start, tree.tokens, tree.parents, tree.depths, tree.ranks, post, acc, bonus, tree.size,
                 len(acc) - 1, logits[acc])


def generate(cfg, W, prompt, max_new_tokens: int, dcfg=None, DW=None, budget: int = 0,
             topk: int | None = None, record: bool = True, pos0: int = 0, verify_cost=None,
             draft_cost: float = 0.0) -> GenResult:
    """Greedy speculative generation; budget 0 is plain AR and needs no drafter. The prompt sits at
    positions pos0.. (module docstring). verify_cost (T rows -> cost): each round's tree is cut to the
    cost_aware_nodes of its `budget` nodes (the cost-aware budget; the tokens are the same, the rounds and
    forwards change, so it is a benchmark mode: bundles record the fixed budget's)."""
    if budget > 0 and (dcfg is None or DW is None):
        raise ValueError(f"budget {budget} needs a drafter (dcfg and DW); budget 0 runs plain AR")
    dec = prefill(cfg, W, prompt, dcfg if budget > 0 else None, pos0)
    rounds, P = [], len(prompt)
    while len(dec.out) - P < max_new_tokens:
        tree = draft_tree(W, dcfg, DW, dec, budget, topk)
        if verify_cost is not None:
            tree = prune_tree(tree, cost_aware_nodes(tree.scores, verify_cost, draft_cost))
        r = verify_round(cfg, W, dcfg if budget > 0 else None, dec, tree)
        if record:
            rounds.append(r)
    return GenResult(dec.out[P:P + max(max_new_tokens, 0)], rounds, dec.counters)


def ddtree_generate(cfg, W, dcfg, DW, prompt, max_new_tokens: int, budget: int = 32, topk: int | None = None,
                    record: bool = True, pos0: int = 0) -> GenResult:
    return generate(cfg, W, prompt, max_new_tokens, dcfg, DW, budget, topk, record, pos0)


def chain_generate(cfg, W, dcfg, DW, prompt, max_new_tokens: int, record: bool = True) -> GenResult:
    """Vanilla DFlash: the drafter's argmax at every depth, verified as one causal chain."""
    return generate(cfg, W, prompt, max_new_tokens, dcfg, DW, dcfg.block_size - 1, 1, record)


def ar_generate(cfg, W, prompt, max_new_tokens: int, record: bool = True) -> GenResult:
    return generate(cfg, W, prompt, max_new_tokens, budget=0, record=record)


# Records: a generation's Rounds in the layout golden bundles and run dumps share (docs/golden-bundles.md,
# docs/run-dump.md §2). One builder, used by the reference engine and the CUDA engine alike.

def ragged(rows) -> np.ndarray:
    """Per-round int records concatenated into one int64 tensor (read back with `offsets`)."""
    return np.concatenate([np.asarray(x, np.int64).reshape(-1) for x in rows]) if rows else np.zeros(0, np.int64)


def offsets(sizes) -> np.ndarray:
    """[R+1] int64: round r's rows of a ragged tensor are [o[r], o[r+1])."""
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


# the live records' name of each round's declared budget, an engine's own cut (docs/run-dump.md §5; §3a above)
LIVE_BUDGET = "round_budget"


def live_records(tokens, rounds, target_forwards: int) -> dict:
    """A live DDTree run (its Rounds) as the `ddtree_live/` records of docs/run-dump.md §2, names relative
    to the group: the stream, the trees as the bundle lays them out (row 0 of a round = the root: token -1,
    parent -1), per round the verify argmax, accepted path, bonus, path logits, and counters
    [target forwards (prefill included), rounds]."""
    return {
        "tokens": np.asarray(tokens, np.int64),
        "tree_tokens": ragged([[-1] + list(r.tree_tokens) for r in rounds]),
        "tree_parents": ragged([r.parents for r in rounds]),
        "verify_argmax": ragged([r.verify_argmax for r in rounds]),
        "accepted": ragged([r.accepted for r in rounds]),
        "accepted_offsets": offsets([len(r.accepted) for r in rounds]),
        "round_bonus": np.asarray([r.bonus for r in rounds], np.int64),
        "counters": np.array([target_forwards, len(rounds)], np.int64),
        "path_logits": np.concatenate([r.path_logits for r in rounds]),
    }
