"""`kdtr bench ddtree --k26`, the host half: what a DDTree verify costs at Kimi K2.6 scale and what it buys.

Pure NumPy, no GPU (docs/k26-scale.md): the tree shapes (the committed bundles' golden trees), the acceptance
per budget (measured by the bundles; modelled from a published acceptance length), the routing models
(distinct experts and bytes per tree), the projected wall speedup per budget and the best budget. The device
half (bench/k26_ddtree_gpu.py) times the layers; bench/k26_ddtree_report.py joins both into the report, its
tables and `run`.

Legend: b node budget (drafted nodes; a verify runs T = b + 1 rows, the root first), E routed experts, K experts
per token, D hidden_size, I moe_intermediate_size, tau tokens per round (accepted nodes + the bonus token).
"""
from __future__ import annotations

import heapq

import numpy as np

BUDGETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)      # drafted nodes per tree (verify rows: + the root)
QUICK_BUDGETS = (1, 4, 8, 16, 32, 64)
CONTEXTS = (4096, 32768)                              # cached rows (the KV cache before the verify)
SHARE = 0.5                                           # correlated routing: a child keeps each parent expert w.p.
# K2.6 per-layer dims (refmodel/config.py PRESETS["k26"]); the fast W4A16 layout: 32-row blocks x 32-column
# groups, 144 int32 words per (block, group) (128 of weights, 16 of bf16 scales; cuda_engine/w4a16_pack.py)
K26 = {"hidden_size": 7168, "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
       "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384,
       "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048, "num_hidden_layers": 61}
# A published acceptance length of a K2.5-class DFlash drafter (docs/k26-scale.md): z-lab's Kimi-K2.5-DFlash
# model card, SGLang, block size 8 (7 drafted tokens per round), thinking on: tokens per round by data set.
PUBLISHED = {"source": "z-lab/Kimi-K2.5-DFlash model card (SGLang, block size 8, chain drafting)",
             "block_size": 8, "tau": {"GSM8K": 5.3, "MT-Bench": 3.7}}


def expert_bytes(D: int = K26["hidden_size"], I: int = K26["moe_intermediate_size"]) -> int:
    """Bytes one INT4 expert occupies in the fast layout: fused gate+up [2I/32, D/32, 144] and down
    [D/32, I/32, 144] int32 words (weights and their group-32 bf16 scales)."""
    return (2 * I // 32) * (D // 32) * 144 * 4 + (D // 32) * (I // 32) * 144 * 4


DENSE_ITEMSIZE = {"bf16": 2, "float32": 4}      # the dense weights as K2.6 stores them (bf16) or widened


def dense_bytes(c: dict = K26, dense: str = "bf16") -> int:
    """Bytes of one layer's attention and router weights as the engine holds them (bf16, as K2.6 stores them
    and the engine keeps them; float32 when widened at load): the fused q_a/kv_a, q_b, W_uk, W_uv, o_proj and the
    router gate (the norms left out)."""
    D, H, Q, C, N, R, U, E = (c[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts"))
    return DENSE_ITEMSIZE[dense] * ((Q + C + R) * D + H * (N + R) * Q + 2 * H * N * C + D * H * U + E * D)


def cache_bytes(rows: int, c: dict = K26) -> int:
    """Bytes of one layer's latent cache over `rows` rows (c_kv and k_pe) at 4 bytes a value: the least an
    FP32-faithful engine reads (the CUDA engine holds each value as three bf16 terms, 6 bytes: docs/cuda-engine.md,
    "The latent cache"), so the bytes-bound speedup stays an engine-independent floor."""
    return 4 * rows * (c["kv_lora_rank"] + c["qk_rope_head_dim"])


# ---------------------------------------------------------------- the committed bundles' golden trees

def golden_rounds(paths) -> list[dict]:
    """Every DDTree round of every golden prompt of the bundles: {bundle, prompt, round, budget, parents
    [n+1] (root first, parents[0] = -1), tokens [n+1] (root -1), verify_argmax [n+1], accepted (row indices,
    root first), accepted_depth}."""
    from conformance.records import prompts_of
    from kdtr_format import open_kdtr

    out = []
    for path in paths:
        with open_kdtr(path) as f:
            budget = int(f.metadata["ddtree"]["budget"])
            for i in prompts_of(f):
                p = f"golden/p{i}/ddtree/"
                o, ao = np.asarray(f[p + "tree_offsets"]), np.asarray(f[p + "accepted_offsets"])
                par, tok = np.asarray(f[p + "tree_parents"]), np.asarray(f[p + "tree_tokens"])
                arg, acc = np.asarray(f[p + "verify_argmax"]), np.asarray(f[p + "accepted"])
                depth = np.asarray(f[p + "round_accepted_depth"])
                for r in range(len(o) - 1):
                    lo, hi = int(o[r]), int(o[r + 1])
                    out.append({"bundle": str(path), "prompt": i, "round": r, "budget": budget,
                                "parents": par[lo:hi].astype(np.int64), "tokens": tok[lo:hi].astype(np.int64),
                                "verify_argmax": arg[lo:hi].astype(np.int64),
                                "accepted": acc[int(ao[r]):int(ao[r + 1])].astype(np.int64),
                                "accepted_depth": int(depth[r])})
    return out


def accepted_depth_at(accepted: np.ndarray, b: int) -> int:
    """Accepted draft tokens of a round had its tree kept only its first b nodes. The builder pops nodes
    best first, so the first b nodes are the tree a budget of b builds from the same draft, and a node's
    index exceeds its parent's: the accepted path keeps exactly its nodes of index <= b (a node's target
    argmax depends only on its ancestors)."""
    return int(np.count_nonzero(np.asarray(accepted)[1:] <= b))


def bundle_acceptance(rounds: list[dict], budgets) -> dict:
    """{b: mean tokens per round (accepted + the bonus)} over all rounds at budget b; None above the
    smallest bundle budget (a larger tree was never drafted, so its acceptance is not measured)."""
    cap = min(r["budget"] for r in rounds)
    return {b: (float(np.mean([1 + accepted_depth_at(r["accepted"], b) for r in rounds])) if b <= cap else None)
            for b in budgets}


def tree_shape(rounds: list[dict], b: int) -> tuple[np.ndarray, bool]:
    """(parents [b+1], synthesised) of a verify of b nodes: the first b nodes of the first golden tree;
    above its size, the next golden trees' nodes are grafted under the deepest node so far, as the next
    round's tree would continue the path (synthesised = True)."""
    parents = list(rounds[0]["parents"][:b + 1])
    k = 1
    while len(parents) < b + 1:
        depth = _depths(np.asarray(parents))
        at = int(np.argmax(depth))                         # the first deepest node
        extra = rounds[k % len(rounds)]["parents"]
        base = len(parents) - 1                            # extra's row j (j >= 1) becomes row base + j
        for j in range(1, len(extra)):
            if len(parents) == b + 1:
                break
            parents.append(at if extra[j] == 0 else base + int(extra[j]))
        k += 1
    return np.asarray(parents, np.int64), b + 1 > len(rounds[0]["parents"])


def _depths(parents: np.ndarray) -> np.ndarray:
    d = np.zeros(len(parents), np.int64)
    for i in range(1, len(parents)):                       # parents[i] < i
        d[i] = d[parents[i]] + 1
    return d


def tree_mask(parents: np.ndarray, cached: int) -> np.ndarray:
    """Additive float32 [T, cached + T]: 0 where row i sees a cache row or one of its ancestors (itself
    included), -inf elsewhere (the verify's tree attention)."""
    from refmodel.ddtree import visibility

    T = len(parents)
    m = np.zeros((T, cached + T), np.float32)
    m[:, cached:][~visibility(parents)] = -np.inf
    return m


# ---------------------------------------------------------------- routing models

def independent_distinct(N: int, E: int = K26["n_routed_experts"], K: int = K26["num_experts_per_tok"]) -> float:
    """Expected distinct experts N tokens touch when each picks K of E uniformly and independently:
    each expert is missed by one token with probability 1 - K / E."""
    return E * (1.0 - (1.0 - K / E) ** N)


def route_tree(parents: np.ndarray, share: float, rng: np.random.Generator, E: int = K26["n_routed_experts"],
               K: int = K26["num_experts_per_tok"]) -> np.ndarray:
    """[T, K] int32 expert ids under the correlated-routing model (docs/k26-scale.md): the root picks K of E
    uniformly; every other node keeps each of its parent's experts independently with probability `share`
    and fills its other slots uniformly from the experts it does not hold. share = 0: independent routing;
    share = 1: every node routes as the root."""
    T = len(parents)
    ids = np.zeros((T, K), np.int32)
    ids[0] = rng.choice(E, K, replace=False)
    for i in range(1, T):
        kept = ids[parents[i]][rng.random(K) < share]
        free = np.setdiff1d(np.arange(E), kept, assume_unique=True)
        ids[i] = np.concatenate([kept, rng.choice(free, K - len(kept), replace=False)])
    return ids


def distinct_experts(ids: np.ndarray) -> int:
    return int(np.unique(np.asarray(ids)).size)


def mean_distinct(parents: np.ndarray, share: float, samples: int = 64, seed: int = 0, **kw) -> float:
    """Mean distinct routed experts of one tree's verify under route_tree, over `samples` draws."""
    rng = np.random.default_rng(seed)
    return float(np.mean([distinct_experts(route_tree(parents, share, rng, **kw)) for _ in range(samples)]))


def layer_bytes(distinct_routed: float, rows: int, cached: int, dense: str = "bf16") -> float:
    """Bytes one MoE layer's forward reads at the least, each weight once: the distinct routed experts and
    the shared one, the dense weights (held as `dense`), and the latent cache over the cached rows and the new
    ones."""
    return ((distinct_routed + K26["n_shared_experts"]) * expert_bytes() + dense_bytes(dense=dense)
            + cache_bytes(cached + rows))


# ---------------------------------------------------------------- acceptance from a published length

def chain_tau(alpha: float, depth: int) -> float:
    """Tokens per round of a chain of `depth` drafts, each accepted with probability alpha given its
    prefix: 1 + alpha + ... + alpha^depth."""
    return float(sum(alpha ** d for d in range(depth + 1)))


def fit_alpha(tau: float, depth: int) -> float:
    """The per-token acceptance alpha whose chain of `depth` drafts gives tau tokens per round (bisection;
    chain_tau rises with alpha from 1 at 0 to depth + 1 at 1)."""
    if not 1.0 <= tau <= depth + 1:
        raise ValueError(f"tau {tau} must lie in [1, {depth + 1}] for a chain of {depth} drafts")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tau(mid, depth) < tau else (lo, mid)
    return (lo + hi) / 2


def tree_tau(alpha: float, b: int, depth: int, ranks: int = 16) -> float:
    """Tokens per round of the best tree of b nodes (depth <= `depth`) when the true token at every depth
    is the drafter's rank-r guess with probability alpha (1 - alpha)^(r - 1), independently per depth: a
    node's acceptance probability is the product over its path, the builder keeps the b most probable
    nodes, and the expected accepted nodes is their sum (DDTree's surrogate), + 1 for the bonus token."""
    p = [alpha * (1 - alpha) ** r for r in range(ranks)]      # rank 1..ranks
    heap, total = [(-p[0], 1, 0)], 0.0                       # (-q, depth, rank index); children by rank
    for _ in range(b):
        if not heap:
            break
        nq, d, r = heapq.heappop(heap)
        total += -nq
        if r + 1 < ranks:                                    # the next sibling
            heapq.heappush(heap, (nq / p[r] * p[r + 1], d, r + 1))
        if d < depth:                                        # the first child
            heapq.heappush(heap, (nq * p[0], d + 1, 0))
    return 1.0 + total


def published_acceptance(budgets, tau: float, block_size: int = PUBLISHED["block_size"]) -> dict:
    """{b: tokens per round} from a published chain acceptance length tau (block_size - 1 drafts per round)."""
    alpha = fit_alpha(tau, block_size - 1)
    return {b: tree_tau(alpha, b, block_size - 1) for b in budgets}


# ---------------------------------------------------------------- projection

def project(ratio: dict, tau: dict, draft: float = 0.0) -> dict:
    """{b: projected wall speedup over AR} = tau(b) / (verify time / AR step time + draft), draft the
    drafter's and builder's time per round in AR steps; None where a ratio or tau is missing."""
    return {b: (tau[b] / (ratio[b] + draft) if ratio.get(b) and tau.get(b) else None) for b in ratio}


def best_budget(speedup: dict):
    """(budget, speedup) of the largest projected speedup (the smaller budget on a tie); (None, None) if none."""
    ok = [(s, -b) for b, s in speedup.items() if s is not None]
    if not ok:
        return None, None
    s, nb = max(ok)
    return -nb, s
