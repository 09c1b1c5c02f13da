"""Golden runs, prompts and tolerances for `kdtr gen`: the float64 reference run of one prompt (prefill taps,
the greedy AR stream with its decode-step taps, the DDTree rounds), the float32 run of the same weights and
tokens whose error is each tap's same-precision baseline, the decisiveness rules that reject a prompt a
correct fp32 engine could flip, the tolerance manifest, and the random prompts (docs/golden-bundles.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conformance.gen.bundle_model import GenError, Model, _f32
from conformance.metrics import routing_gaps
from conformance.tolerance import DEFAULT_FLOOR_ULPS, DEFAULT_MULTIPLIER, derive_tolerance, entry_atol
from refmodel.config import ModelConfig
from refmodel.ddtree import ddtree_generate
from refmodel.generate import decode_one_token, prefill, top2_margin
from refmodel.model import KVCache, weights_dtype
from refmodel.weights import mask_token_id

# Decode steps keep the taps that pin down each layer's state and name the sublayer of a decode-only fault:
# the cache rows an engine writes, the attention output, the routing scores and decision (the scores let a
# precision profile judge a decode-step expert flip at a near-tie, as in prefill) and the layer output;
# prefill keeps every tap. Sizes and the choice: docs/golden-bundles.md.
AR_TAPS = ("kv_latent", "k_pe", "attn_out", "router_scores", "topk_ids", "resid_out")
MARGIN_SAFETY = 4.0     # a greedy margin must exceed this many logits tolerances (a flip needs > 2)
LONG_PROMPT_LENGTH = 6  # tokens of the long-position prompt
LONG_NEW_TOKENS = 16    # its greedy stream: 3-4 DDTree rounds at long positions (bundle size: the doc)


# ---------------------------------------------------------------- golden runs

def routing_gap(cfg, W: dict, taps: dict) -> float:
    """Smallest gap, over the forward's rows and MoE layers, between the K-th and (K+1)-th biased
    choice score: how far the routing decision is from a tie (the bias is exact; the scores are not).
    With groups (n_group > 1), group_gaps: the group choice too, and the experts among the kept groups."""
    gaps = [np.inf]
    for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        choice = taps[f"L{l}/router_scores"] + W[f"model.layers.{l}.mlp.gate.e_score_correction_bias"]  # [T, E]
        g = group_gaps(cfg, choice) if cfg.n_group > 1 else routing_gaps(choice, cfg.num_experts_per_tok)
        if g is not None:
            gaps.append(float(np.min(g)))
    return min(gaps)


def group_gaps(cfg, choice: np.ndarray) -> np.ndarray:
    """[T]: a group-limited decision's distance from a tie, in score units: the smaller of the topk_group-th
    minus (topk_group+1)-th group score (the sum of a group's top 2) halved, since a flip there moves two
    scores on each side, and the K-th minus (K+1)-th score among the kept groups' experts."""
    T, E, G = choice.shape[0], cfg.n_routed_experts, cfg.n_group
    grouped = np.asarray(choice, np.float64).reshape(T, G, E // G)                       # [T, G, E/G]
    group = np.sort(np.sort(grouped, axis=-1)[..., -2:].sum(-1), axis=-1)[:, ::-1]      # [T, G] descending
    gaps = [np.full(T, np.inf)]
    if cfg.topk_group < G:
        gaps.append((group[:, cfg.topk_group - 1] - group[:, cfg.topk_group]) / 2)
    kept = np.argsort(-np.sort(grouped, axis=-1)[..., -2:].sum(-1), axis=-1, kind="stable")[:, :cfg.topk_group]
    inside = np.take_along_axis(grouped, kept[:, :, None], axis=1).reshape(T, -1)       # [T, topk_group E/G]
    within = routing_gaps(inside, cfg.num_experts_per_tok)
    if within is not None:
        gaps.append(within)
    return np.min(np.stack(gaps), axis=0)


def run_reference(cfg, W: dict, prompt, n: int, tokens=None, ar_taps=AR_TAPS, pos0: int = 0,
                  routing: dict | None = None, tick=None):
    """Prefill at positions pos0.., then n-1 decode forwards: greedy (tokens=None) or fed the given tokens
    (teacher forcing). Works in the dtype of W: float64 for the goldens, float32 for the baseline. Returns
    (arrays keyed by bundle names relative to golden/p{i}/: prefill/..., ar/logits, ar/L{l}/{tap}; the
    tokens; each decision's top-1/top-2 margin; the smallest routing gap of all forwards). `routing`:
    goldens holding prefill/L{l}/topk_ids and ar/L{l}/topk_ids, whose expert sets every forward then
    runs (the bf16 profile's noise measurement, conformance/gen/bf16_profile.py). tick(done, n): after each forward."""
    cache, taps = KVCache(cfg, dtype=weights_dtype(W)), {}
    rows = [prefill(cfg, W, prompt, cache, taps=taps, pos0=pos0, forced_ids=_forced(cfg, routing, "prefill", None))]
    out = {f"prefill/{k}": v for k, v in taps.items()}
    gap = routing_gap(cfg, W, taps)
    if tick:
        tick(1, n)
    toks = [int(np.argmax(rows[0]))] if tokens is None else [int(t) for t in tokens]
    steps: dict[str, list] = {}
    for s in range(n - 1):
        taps = {}
        rows.append(decode_one_token(cfg, W, toks[s], cache, taps=taps, pos0=pos0,
                                     forced_ids=_forced(cfg, routing, "ar", s)))
        gap = min(gap, routing_gap(cfg, W, taps))
        if tokens is None:
            toks.append(int(np.argmax(rows[-1])))
        if tick:
            tick(s + 2, n)
        for l in range(cfg.num_hidden_layers):
            for t in ar_taps:
                if f"L{l}/{t}" in taps:
                    steps.setdefault(f"ar/L{l}/{t}", []).append(taps[f"L{l}/{t}"][0])  # [1, ...] -> [...]
    out["ar/logits"] = np.stack(rows)                                      # [n, V]
    out.update({k: np.stack(v) for k, v in steps.items()})                 # [n-1, ...]
    margins = np.array([top2_margin(r) for r in rows])                     # [n]
    return out, np.array(toks[:n], dtype=np.int64), margins, gap


def _forced(cfg, routing: dict | None, phase: str, step: int | None) -> dict | None:
    """{layer: [T, K] expert ids} of one forward from golden topk_ids (None: the router decides)."""
    if routing is None:
        return None
    forced = {}
    for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        ids = np.asarray(routing[f"{phase}/L{l}/topk_ids"])
        forced[l] = ids if step is None else ids[step:step + 1]                 # decode: [1, K]
    return forced


def baseline_errors(g64: dict, g32: dict) -> dict:
    """Per golden key: max abs error and NMSE of float32 vs float64; integer keys: mismatch count."""
    out = {}
    for k, g in g64.items():
        a = g32[k]
        if g.dtype.kind in "iu":
            out[k] = {"mismatches": int(np.count_nonzero(g != a))}
            continue
        err = a.astype(np.float64) - g
        denom = float(np.sum(g * g))
        out[k] = {"max_abs": float(np.max(np.abs(err))), "magnitude": float(np.max(np.abs(g))),
                  "nmse": float(np.sum(err * err)) / denom if denom > 0 else 0.0}
    return out


@dataclass
class PromptGoldens:
    prompt: np.ndarray
    tokens: np.ndarray
    margins: np.ndarray
    routing_gap: float      # smallest K-th vs (K+1)-th biased router score gap over all forwards
    g64: dict
    errors: dict
    ddtree: object          # refmodel.ddtree.GenResult
    pos0: int = 0           # position of the first prompt token (cache row j at pos0 + j)


def golden_for_prompt(m: Model, W64: dict, prompt, n: int, budget: int, pos0: int = 0,
                      tick=None, hold_routing: bool = False, W32=None) -> PromptGoldens:
    """W64: the model's weights in float64 (refmodel.stored.StoredWeights: upcast per matmul). tick(phase,
    done, total): progress of the float64, float32 and DDTree runs. `hold_routing`: the float32 baseline
    runs the float64 run's expert sets (a bundle whose routing near-ties are judged, not forbidden), so its
    errors are arithmetic noise, never an expert swapped at a near-tie. W32: the same weights in float32
    (default `_f32(W64)`; a caller running many prompts passes one copy)."""
    step = (lambda phase: None) if tick is None else (lambda phase: lambda d, t: tick(phase, d, t))
    g64, tokens, margins, gap = run_reference(m.cfg, W64, prompt, n, pos0=pos0, tick=step("float64"))
    g32, _, _, _ = run_reference(m.cfg, _f32(W64) if W32 is None else W32, prompt, n, tokens=tokens, pos0=pos0,
                                 routing=g64 if hold_routing else None, tick=step("float32"))
    DW64 = {k: v.astype(np.float64) for k, v in m.DW.items()}
    dd = ddtree_generate(m.cfg, W64, m.dcfg, DW64, prompt, n, budget=budget, pos0=pos0)
    if tick:
        tick("ddtree", 1, 1)
    return PromptGoldens(np.asarray(prompt, np.int64), tokens, margins, gap, g64, baseline_errors(g64, g32), dd,
                         pos0)


def check_decisive(pg: PromptGoldens, logits_atol: float, router_atol: float,
                   routing_held: bool = False) -> str | None:
    """Why this prompt cannot be a golden (None if it can). A flip needs an error above half the gap on
    two values, so a gap of MARGIN_SAFETY (4) tolerances leaves a correct engine a 2x reserve.
    `routing_held`: routing near-ties are judged (conformance/verify/near_ties.py) with the engine's routing held
    to the golden sets, so neither a small routing gap nor a float32 expert flip rejects the prompt."""
    need = MARGIN_SAFETY * logits_atol
    if pg.margins.min() < need:
        j = int(np.argmin(pg.margins))
        return (f"greedy step {j} has top-1/top-2 margin {pg.margins[j]:.3g} < {need:.3g} "
                f"({MARGIN_SAFETY:g} x the logits tolerance): a correct fp32 engine could flip it")
    if not routing_held:
        why = _routing_not_decisive(pg, router_atol)
        if why:
            return why
    if not np.array_equal(np.asarray(pg.ddtree.tokens), pg.tokens):
        return "DDTree tokens differ from AR tokens (a reference bug: please report it)"
    return None


def _routing_not_decisive(pg: PromptGoldens, router_atol: float) -> str | None:
    if pg.routing_gap < MARGIN_SAFETY * router_atol:
        return (f"a routing decision is {pg.routing_gap:.3g} from a tie, under {MARGIN_SAFETY:g} x the "
                f"router_scores tolerance ({MARGIN_SAFETY * router_atol:.3g}): a correct fp32 engine could "
                f"pick another expert")
    flips = [k for k, e in pg.errors.items() if e.get("mismatches")]
    if flips:
        return f"the float32 reference already picks other experts at {flips[0]}: routing too close to a tie"
    return None


def routing_near_tie_count(cfg, W64, pgs: list[PromptGoldens], router_atol: float) -> int:
    """How many golden routing decisions (token row x MoE layer, prefill and decode, every prompt) have a
    K-th vs (K+1)-th biased score gap under MARGIN_SAFETY x the router_scores atol: the decisions a bundle
    with held routing leaves to the near-tie rules."""
    count = 0
    for pg in pgs:
        for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
            bias = np.asarray(W64[f"model.layers.{l}.mlp.gate.e_score_correction_bias"], np.float64)
            for phase in ("prefill", "ar"):
                scores = pg.g64.get(f"{phase}/L{l}/router_scores")
                gaps = None if scores is None else routing_gaps(np.asarray(scores, np.float64) + bias,
                                                                 cfg.num_experts_per_tok)
                if gaps is not None:
                    count += int(np.sum(gaps < MARGIN_SAFETY * router_atol))
    return count


def manifest(pgs: list[PromptGoldens], quant: str, routing_held: bool = False) -> dict:
    """Tolerance manifest: per tap key, the float32 baseline (the worst prompt's max abs error and NMSE,
    as the runner judges each prompt on its own) and the derived tolerance; integer taps are exact.
    `routing_held`: the baseline ran the golden expert sets and near-tie routing is judged, not forbidden
    (recorded as "routing": "held"; a bundle without the key forbids near-ties: "free")."""
    agg: dict[str, dict] = {}
    for pg in pgs:
        for k, e in pg.errors.items():
            a = agg.setdefault(k, {})
            for key, v in e.items():
                a[key] = max(a.get(key, 0), v)
    taps = {}
    for k, a in sorted(agg.items()):
        if "mismatches" in a:
            taps[k] = {"exact": True}
        else:
            taps[k] = derive_tolerance(a["max_abs"], a["nmse"], magnitude=a["magnitude"], quant=quant).to_dict()
    man = {
        "rule": ("fp32 engine passes a tap if max|a - g| <= multiplier * baseline_max_abs + abs_floor and "
                 "NMSE <= multiplier * baseline_nmse + nmse_floor, where the baseline is the float32 "
                 "reference vs the float64 golden on the same weights and tokens, worst prompt; "
                 "abs_floor = floor_ulps float32 ULPs of the tap's largest golden value. Integer taps "
                 "(topk_ids) and tokens are exact. INT4 bundles use the same rule: their golden is the "
                 "exact output of the dequantized model."),
        "multiplier": DEFAULT_MULTIPLIER[quant],
        "floor_ulps": DEFAULT_FLOOR_ULPS,
        "margin_rule": (f"every golden greedy margin >= {MARGIN_SAFETY:g} x the logits atol, every routing gap "
                        f"(K-th vs (K+1)-th biased router score) >= {MARGIN_SAFETY:g} x the router_scores atol"),
        "taps": taps,
    }
    if routing_held:
        man["margin_rule"] = (f"every golden greedy margin >= {MARGIN_SAFETY:g} x the logits atol; routing gaps "
                              f"are not bounded: the float32 baseline ran the golden expert sets, a live engine's "
                              f"routing is held to them, and its own expert choice is judged by the near-tie "
                              f"rules")
        man["routing"] = "held"
    return man


def atol(man: dict, key: str) -> float:
    """The derived absolute tolerance of tap `key` (the same rule the judge applies); a key the manifest
    lacks is a generator bug, never a tolerance of 0."""
    entry = man["taps"].get(key)
    if entry is None:
        raise KeyError(f"tolerance manifest has no entry {key!r} (taps: {len(man['taps'])}): a generator bug")
    return entry_atol(entry)


def decisive_atols(man: dict) -> tuple[float, float]:
    """(logits atol, router_scores atol) that check_decisive measures margins and routing gaps against."""
    logits = max(atol(man, "prefill/logits"), atol(man, "ar/logits"))
    router = max([atol(man, k) for k in man["taps"] if k.endswith("/router_scores")], default=0.0)
    return logits, router


# ---------------------------------------------------------------- prompts

MAX_REDRAWS = 8         # random prompts: candidates tried per length before giving up


def prompt_length(i: int) -> int:
    """Length of random prompt i: 1, 5, 10, 18, 33, 63, 118, 224."""
    return 1 if i == 0 else int(round(5 * 1.9 ** (i - 1)))


def random_prompt(cfg: ModelConfig, seed: int, i: int, draw: int) -> np.ndarray:
    """Candidate `draw` for random prompt i: ids from (seed, i, draw), never the mask id."""
    rng = np.random.Generator(np.random.PCG64([seed, 1_000_003, i, draw]))
    return rng.integers(0, mask_token_id(cfg), size=prompt_length(i)).astype(np.int64)


def long_prompt(cfg: ModelConfig, seed: int, draw: int) -> np.ndarray:
    """Candidate `draw` for the long-position prompt: LONG_PROMPT_LENGTH ids from (seed, draw)."""
    rng = np.random.Generator(np.random.PCG64([seed, 1_000_003, 1_000_000, draw]))
    return rng.integers(0, mask_token_id(cfg), size=LONG_PROMPT_LENGTH).astype(np.int64)


def long_position_extent(n: int, block_size: int) -> int:
    """Positions the long-position prompt spans past its first: its tokens, its n-token stream and the
    deepest DDTree row a round can verify (a block)."""
    return LONG_PROMPT_LENGTH + n + block_size


def long_position_default(cfg: ModelConfig, n: int, block_size: int, offset: int) -> int:
    """The default first position of the long-position prompt: `offset` (1.5 x 2^17, why:
    docs/golden-bundles.md), or where the model's context is shorter, the largest first position whose
    prompt, stream and tree rows still lie below max_position_embeddings (the probe grows with the
    position). 0, no long-position prompt, when even that is not past position 0."""
    return max(0, min(offset, cfg.max_position_embeddings - long_position_extent(n, block_size)))


def check_prompt(cfg: ModelConfig, prompt) -> np.ndarray:
    if not isinstance(prompt, (list, tuple, np.ndarray)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt) or len(prompt) == 0:
        raise GenError(f"a prompt must be a non-empty list of token ids, got {prompt!r}")
    p = np.asarray(prompt, dtype=np.int64)
    bad = p[(p < 0) | (p >= cfg.vocab_size) | (p == mask_token_id(cfg))]
    if bad.size:
        raise GenError(f"prompt token {int(bad[0])} is outside [0, {cfg.vocab_size - 1}) (id "
                       f"{mask_token_id(cfg)} is the drafter's reserved mask token)")
    return p.astype(np.int64)

