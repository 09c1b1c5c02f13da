"""`kdtr bench ddtree --k26`, the host half: what a DDTree verify costs at Kimi K2.6 scale and what it buys.

Pure NumPy, no GPU (docs/k26-scale.md): the tree shapes (the committed bundles' golden trees), the acceptance
per budget (measured by the bundles; modelled from a published acceptance length), the routing models
(distinct experts and bytes per tree), the projected wall speedup per budget and the best budget, and the
console table. The GPU half (bench/k26_ddtree_gpu.py) times the layers; `run` joins both.

Legend: b node budget (drafted nodes; a verify runs T = b + 1 rows, the root first), E routed experts, K experts
per token, D hidden_size, I moe_intermediate_size, tau tokens per round (accepted nodes + the bonus token).
"""
from __future__ import annotations

import heapq
import math

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


def dense_bytes(c: dict = K26) -> int:
    """Bytes of one layer's attention and router weights as the engine holds them (float32): the fused
    q_a/kv_a, q_b, W_uk, W_uv, o_proj and the router gate (the norms left out)."""
    D, H, Q, C, N, R, U, E = (c[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts"))
    return 4 * ((Q + C + R) * D + H * (N + R) * Q + 2 * H * N * C + D * H * U + E * D)


def cache_bytes(rows: int, c: dict = K26) -> int:
    """Bytes of one layer's float32 latent cache over `rows` rows (c_kv and k_pe)."""
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


def layer_bytes(distinct_routed: float, rows: int, cached: int) -> float:
    """Bytes one MoE layer's forward reads at the least, each weight once: the distinct routed experts and
    the shared one, the dense weights, and the latent cache over the cached rows and the new ones."""
    return (distinct_routed + K26["n_shared_experts"]) * expert_bytes() + dense_bytes() + cache_bytes(cached + rows)


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


# ---------------------------------------------------------------- the report

def acceptance_models(rounds: list[dict], budgets) -> dict:
    """{name: {"source": ..., "tau": {b: tokens per round}}}: the bundles' measured acceptance and the
    published lengths' modelled one (tree_tau over a per-token acceptance fitted to each)."""
    out = {"bundles": {"source": f"{len(rounds)} golden DDTree rounds of the committed bundles, trees cut to "
                                 f"b nodes (measured up to their budget {min(r['budget'] for r in rounds)})",
                       "tau": bundle_acceptance(rounds, budgets)}}
    for name, tau in PUBLISHED["tau"].items():
        alpha = fit_alpha(tau, PUBLISHED["block_size"] - 1)
        out[f"published {name}"] = {"source": f"{PUBLISHED['source']}: {name} tau {tau}; per-token acceptance "
                                              f"{alpha:.3f}, geometric ranks, depth <= {PUBLISHED['block_size'] - 1}",
                                    "tau": published_acceptance(budgets, tau)}
    return out


def routing_table(shapes: dict, shares=(0.0, 0.25, 0.5, 0.75), samples: int = 64) -> list[dict]:
    """Per budget: distinct routed experts of the verify (the independent formula, the correlated model at
    each share on the tree's shape) and the least bytes one layer's verify reads at each, over the AR step's."""
    ar = layer_bytes(K26["num_experts_per_tok"], 1, 0)
    rows = []
    for b, parents in sorted(shapes.items()):
        T = len(parents)
        d = {f"{s:g}": mean_distinct(parents, s, samples, seed=b) for s in shares}
        rows.append({"budget": b, "rows": T, "independent": independent_distinct(T), "correlated": d,
                     "bytes_over_ar_at_share": {k: layer_bytes(v, T, 0) / ar for k, v in d.items()}})
    return rows


def summarize(gpu: dict) -> list[dict]:
    """Per context, routing and budget: the mean over layers of the measured verify and AR times, their
    ratio, the MoE half, the distinct routed experts and the least bytes over the time (effective GB/s); the
    MoE half against the copy floor of its experts' bytes (the distinct routed ones and the shared one at the
    measured copy bandwidth; the half also holds the router and the combine)."""
    ms = [m for m in gpu.get("measurements", []) if m["us_layer"] is not None]
    copy = gpu.get("copy_gbps")
    out = []
    for ctx in gpu.get("contexts", []):
        ar = [m for m in ms if m["context"] == ctx and m["routing"] == "ar"]
        ar_us = float(np.mean([m["us_layer"] for m in ar])) if ar else None
        for routing in ("ar", "router", "correlated"):
            for b in sorted({m["budget"] for m in ms if m["routing"] == routing}):
                sel = [m for m in ms if m["context"] == ctx and m["routing"] == routing and m["budget"] == b]
                if not sel:
                    continue
                us = float(np.mean([m["us_layer"] for m in sel]))
                moe = [m["us_moe"] for m in sel if m["us_moe"] is not None]
                dist = float(np.mean([m["distinct_routed"] for m in sel]))
                nbytes = layer_bytes(dist, sel[0]["rows"], ctx)
                floor = (dist + K26["n_shared_experts"]) * expert_bytes() / copy / 1e3 if copy else None
                out.append({"context": ctx, "routing": routing, "budget": b, "rows": sel[0]["rows"],
                            "layers": len(sel), "us_layer": us, "us_moe": float(np.mean(moe)) if moe else None,
                            "us_attention": us - float(np.mean(moe)) if moe else None, "distinct_routed": dist,
                            "bytes": nbytes, "gbps": nbytes / us / 1e3, "ar_us": ar_us, "moe_floor_us": floor,
                            "moe_over_floor": float(np.mean(moe)) / floor if moe and floor else None,
                            "verify_over_ar": us / ar_us if ar_us else None})
    return out


def projections(summary: list[dict], acceptance: dict, draft: float = 0.0) -> list[dict]:
    """Per context, routing model and acceptance model: the projected speedup per budget and the best."""
    out = []
    for ctx in sorted({r["context"] for r in summary}):
        for routing in ("router", "correlated"):
            ratio = {r["budget"]: r["verify_over_ar"] for r in summary
                     if r["context"] == ctx and r["routing"] == routing}
            if not ratio:
                continue
            for name, acc in acceptance.items():
                s = project(ratio, acc["tau"], draft)
                b, best = best_budget(s)
                out.append({"context": ctx, "routing": routing, "acceptance": name, "speedup": s,
                            "best_budget": b, "best_speedup": best})
    return out


def bytes_bound(routing_model: list[dict], acceptance: dict) -> list[dict]:
    """The speedup an engine whose layer time were its least bytes (weights only, each read once at one
    bandwidth) would reach: tau / (verify bytes / AR bytes), per correlated share and acceptance model."""
    out = []
    for share in routing_model[0]["bytes_over_ar_at_share"]:
        ratio = {x["budget"]: x["bytes_over_ar_at_share"][share] for x in routing_model}
        for name, acc in acceptance.items():
            sp = project(ratio, acc["tau"])
            b, best = best_budget(sp)
            out.append({"share": share, "acceptance": name, "speedup": {str(k): v for k, v in sp.items()},
                        "best_budget": b, "best_speedup": best})
    return out


def report(rounds, shapes, synthesised, acceptance, routing_model, gpu: dict | None, draft: float = 0.0,
           gpu_error=None) -> dict:
    """Everything the JSON holds; routing_model: routing_table(shapes) (made once: it samples)."""
    summary = summarize(gpu) if gpu else []
    proj = projections(summary, acceptance, draft)
    return {"what": "kdtr bench ddtree --k26 (docs/k26-scale.md)", "dims": K26, "expert_bytes": expert_bytes(),
            "dense_bytes": dense_bytes(), "budgets": sorted(shapes),
            "shapes": {str(b): {"rows": len(p), "synthesised": synthesised[b], "parents": p.tolist()}
                       for b, p in sorted(shapes.items())},
            "acceptance": {k: {"source": v["source"], "tau": {str(b): t for b, t in v["tau"].items()}}
                           for k, v in acceptance.items()},
            "routing_model": routing_model, "bytes_bound": bytes_bound(routing_model, acceptance),
            "draft_ar_steps": draft,
            "gpu": gpu, "gpu_error": gpu_error, "summary": summary,
            "projection": [{**p, "speedup": {str(b): s for b, s in p["speedup"].items()}} for p in proj],
            "aims": aims(proj)}


AIM_SPEEDUP = 1.5                # the projected batch-1 speedup aimed at, under the published acceptance


def aims(proj: list[dict]) -> list[dict]:
    """The aim (a projected speedup of at least AIM_SPEEDUP under the published GSM8K acceptance) per
    context and routing model, with the best budget's value and whether it is met."""
    return [{"aim": f"projected speedup >= {AIM_SPEEDUP}x, published GSM8K acceptance, {p['context']} cached rows, "
                    f"{p['routing']} routing", "best_budget": p["best_budget"], "value": p["best_speedup"],
             "met": p["best_speedup"] is not None and p["best_speedup"] >= AIM_SPEEDUP}
            for p in proj if p["acceptance"] == "published GSM8K"]


def _f(x, fmt: str) -> str:
    """x formatted, or '-' right-aligned to the format's width where x is None."""
    width = fmt.split(".")[0]
    return f"{'-':>{int(width) if width.isdigit() else 1}}" if x is None else format(x, fmt)


def table(r: dict) -> str:
    """The console tables: routing model, acceptance, measured times, projected speedup per budget."""
    budgets = r["budgets"]

    def head(width: int) -> str:
        return "  " + f"{'budget':<{width}}" + "".join(f"{b:>7d}" for b in budgets)

    lines = ["distinct routed experts per verify (rows = budget + 1) and its least weight bytes over the AR "
             "step's, by routing model:", head(12),
             "  independent " + "".join(f"{x['independent']:7.1f}" for x in r["routing_model"])]
    for s in r["routing_model"][0]["correlated"]:
        lines.append(f"  share {s:<5} " + "".join(f"{x['correlated'][s]:7.1f}" for x in r["routing_model"]))
        lines.append(f"    bytes/AR  " + "".join(f"{x['bytes_over_ar_at_share'][s]:7.2f}" for x in r["routing_model"]))
    lines += ["tokens per round (tau) by acceptance model:", head(44)]
    for name, a in r["acceptance"].items():
        lines.append(f"  {name:<44}" + "".join(f"{_f(a['tau'][str(b)], '7.2f')}" for b in budgets))
    lines += ["bytes-bound speedup (tau / verify-over-AR weight bytes: an engine at its copy floor), best budget:",
              head(44)]
    for p in r["bytes_bound"]:
        lines.append(f"  share {p['share']:<5} {p['acceptance']:<32}" + "".join(
            f"{_f(p['speedup'][str(b)], '7.2f')}" for b in budgets) + f"   b={p['best_budget']} "
            f"{_f(p['best_speedup'], '.2f')}x")
    if r["gpu"]:
        g = r["gpu"]
        lines.append(f"{g.get('device', '?')}: {g['layers']} random-weight K2.6 MoE layers, {g['reps']} replays per "
                     f"measurement, correlated share {g['share']}, {g.get('elapsed_s', 0):.0f} s, "
                     f"{g.get('skipped', 0)} skipped")
        lines.append(f"  copy bandwidth {_f(g.get('copy_gbps'), '.0f')} GB/s; MoE/floor: the MoE half over its "
                     f"experts' bytes at that bandwidth")
        lines.append("  ctx    routing     b rows  layer us    MoE us   attn us  experts    GB/s MoE/floor  verify/AR")
        for s in r["summary"]:
            lines.append(f"  {s['context']:<6} {s['routing']:<10} {s['budget']:>2} {s['rows']:>4} {s['us_layer']:9.1f} "
                         f"{_f(s['us_moe'], '9.1f')} {_f(s['us_attention'], '9.1f')} {s['distinct_routed']:8.1f} "
                         f"{s['gbps']:7.0f} {_f(s.get('moe_over_floor'), '9.2f')} {_f(s['verify_over_ar'], '10.2f')}")
        errors = [m for m in g["measurements"] if m["error"] and not m["error"].startswith("skipped")]
        lines += [f"  error: L{m['layer']} ctx {m['context']} {m['routing']} b{m['budget']}: {m['error']}"
                  for m in errors[:5]]
    elif r["gpu_error"]:
        lines.append(f"no device measurement: {r['gpu_error']}")
    if r["projection"]:
        lines.append(f"projected wall speedup over AR (tau / (verify/AR + draft {r['draft_ar_steps']:g})), best budget:")
        lines.append(f"  {'ctx':<6} {'routing':<10} {'acceptance':<28}" + "".join(f"{b:>6d}" for b in budgets)
                     + "   best")
        for p in r["projection"]:
            lines.append(f"  {p['context']:<6} {p['routing']:<10} {p['acceptance']:<28}"
                         + "".join(f"{_f(p['speedup'].get(str(b)), '6.2f')}" for b in budgets)
                         + f"   b={p['best_budget']} {_f(p['best_speedup'], '.2f')}x")
    lines += [f"aim: {a['aim']}: {_f(a['value'], '.2f')} at b={a['best_budget']} -> {'met' if a['met'] else 'MISSED'}"
              for a in r.get("aims", [])]
    return "\n".join(lines)


def run(bundles, quick: bool = False, share: float = SHARE, draft: float = 0.0, layers: int = 3,
        reps: int = 5, time_budget_s: float = 90.0, progress=print, checkpoint=None, device: bool = True) -> dict:
    """The whole benchmark: shapes and acceptance from the bundles, the device measurement (fail soft: a
    failure to start is recorded as gpu_error), the summary and the projection. checkpoint(report) is
    called with the report so far after each layer and context of the device run."""
    rounds = golden_rounds(bundles)
    budgets = QUICK_BUDGETS if quick else BUDGETS
    made = {b: tree_shape(rounds, b) for b in budgets}
    shapes, synth = {b: p for b, (p, _) in made.items()}, {b: s for b, (_, s) in made.items()}
    acceptance, routing = acceptance_models(rounds, budgets), routing_table(shapes)
    gpu, err = None, None
    if device:
        try:
            from bench.k26_ddtree_gpu import measure

            cb = None if checkpoint is None else (
                lambda g: checkpoint(report(rounds, shapes, synth, acceptance, routing, g, draft)))
            gpu = measure(shapes, CONTEXTS, layers, reps, share, time_budget_s, progress, cb)
        except Exception as e:  # noqa: BLE001 - fail soft: the host half still reports
            err = f"{type(e).__name__}: {e}"[:600]
    else:
        err = "not run (--no-device)"
    return report(rounds, shapes, synth, acceptance, routing, gpu, draft, err)
