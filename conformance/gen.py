"""`kdtr gen`: build a golden bundle (schema: docs/golden-bundles.md).

A bundle holds the model (weights as stored, float32 or INT4 `.qw`/`.sc`), the drafter, the prompts and
what a correct engine must produce for them: every prefill tap, the greedy AR stream with its logits and
decode-step taps, and the DDTree rounds. The goldens are the float64 reference run on exactly the stored
weights. The generator also runs the reference in float32 on the same weights with the same (golden)
tokens: its error against float64 is the same-precision baseline that each tap's tolerance is derived
from, and a prompt whose greedy margins are not far above that noise, or whose float32 run already picks
other experts, is rejected: a correct fp32 engine can then never flip a golden decision.
"""
from __future__ import annotations

import platform
import sys
from dataclasses import dataclass, field

import numpy as np

from conformance.profiles import bf16_profile
from conformance.records import BUNDLE_SCHEMA, offsets, ragged
from conformance.tolerance import DEFAULT_FLOOR_ULPS, DEFAULT_MULTIPLIER, derive_tolerance
from kdtr_format import Tensor, bfloat16_to_float32, float32_to_bfloat16, open_kdtr, write_kdtr
from refmodel.config import PRESETS, ModelConfig
from refmodel.ddtree import ddtree_generate
from refmodel.drafter import DrafterConfig, drafter_preset, init_drafter
from refmodel.generate import decode_one_token, prefill, top2_margin
from refmodel.model import KVCache, tap_names
from refmodel.quant import dequantize_model, quant_config, quantize_model
from refmodel.weights import construction_info, init_weights, mask_token_id

# Decode steps keep only the taps that pin down each layer's state cheaply (the cache rows an engine
# writes, the routing decision and the layer output); prefill keeps every tap. docs/golden-bundles.md.
AR_TAPS = ("kv_latent", "k_pe", "topk_ids", "resid_out")
MARGIN_SAFETY = 4.0     # a greedy margin must exceed this many logits tolerances (a flip needs > 2)


class GenError(ValueError):
    """A user-facing generation problem (bad prompt, undecisive prompt, bad option)."""


@dataclass
class GenSettings:
    preset: str = "tiny"
    quant: str = "fp32"                   # fp32 | int4
    int4_scope: str = "experts"
    seed: int = 0
    prompts: list | None = None           # explicit prompt id lists; else num_prompts random ones
    num_prompts: int = 4
    max_new_tokens: int = 64
    budget: int = 32                      # DDTree node budget
    distill_steps: int = 650
    command: str = ""                     # provenance: the command line that made the bundle


@dataclass
class Model:
    cfg: ModelConfig
    W: dict                               # as stored: float32 arrays (+ int32 .qw, float32 .sc for INT4)
    dcfg: DrafterConfig
    DW: dict                              # float32 drafter weights, bfloat16-representable (stored bf16)
    meta: dict = field(default_factory=dict)   # construction, quantization, provenance of the weights


# ---------------------------------------------------------------- the model

def _f32(W: dict) -> dict:
    return {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in W.items()}


def model_from_preset(s: GenSettings, progress=None) -> Model:
    """The preset target (float32-rounded), its drafter distilled on the target's own greedy streams."""
    if s.preset not in PRESETS:
        raise GenError(f"unknown preset {s.preset!r}; choose one of {sorted(PRESETS)}")
    if s.preset == "k26":
        raise GenError("preset 'k26' has the real K2.6 dimensions (1T parameters) and cannot be generated "
                       "whole; use --preset tiny or --from-checkpoint")
    cfg = PRESETS[s.preset]
    W = _f32(init_weights(cfg, s.seed))
    dcfg = drafter_preset(s.preset)
    DW = _distill(cfg, W, dcfg, s, progress)
    return Model(cfg, W, dcfg, DW, {"construction": construction_info(cfg, s.seed)})


def model_from_kdtr(path: str, s: GenSettings, progress=None) -> Model:
    """Target and drafter from an existing bundle or model file (`kdtr gen --model`); a model from
    `kdtr import` has no drafter yet, so one is distilled for it."""
    with open_kdtr(path, verify=True) as f:
        meta = f.metadata
        conf = meta.get("model_config", meta.get("config"))
        if conf is None:
            raise GenError(f"{path} has no model_config in its metadata: it is not a kdtr model or bundle; "
                           f"make one with `kdtr gen --preset tiny --out MODEL.kdtr` or `kdtr import`")
        cfg = ModelConfig.from_dict(conf)
        W = {n: _read(f, n) for n in f.names if not n.startswith(("golden/", "drafter."))}
        DW = _bf16_round({n: np.array(f.get(n)) for n in f.names if n.startswith("drafter.")})  # as stored
    keep = {k: meta[k] for k in ("construction", "quantization", "source", "provenance_of_weights")
            if meta.get(k)}
    if "drafter_config" in meta:
        return Model(cfg, W, DrafterConfig.from_dict(meta["drafter_config"]), DW, keep)
    dcfg = default_drafter(cfg)
    return Model(cfg, W, dcfg, _distill(cfg, W, dcfg, s, progress), keep)


def _read(f, name: str) -> np.ndarray:
    """Stored weights as the generator keeps them: int32 .qw as is, everything else float32."""
    if f.info(name).int4_shape is not None:
        return np.array(f[name])
    return np.array(f.get(name), dtype=np.float32)


def model_from_checkpoint(path: str, s: GenSettings, progress=None) -> Model:
    """An HF-layout checkpoint (bf16/fp16/fp32, compressed-tensors INT4 experts), via `kdtr import`."""
    import os
    import tempfile

    from refmodel.checkpoint import import_checkpoint

    with tempfile.TemporaryDirectory() as d:
        tmp = os.path.join(d, "model.kdtr")
        import_checkpoint(path, tmp)
        m = model_from_kdtr(tmp, s, progress)
    m.meta["source"] = {"checkpoint": os.path.basename(os.path.abspath(path))}
    return m


def default_drafter(cfg: ModelConfig) -> DrafterConfig:
    """The tiny drafter for the tiny target; otherwise a one-layer drafter sized from the target."""
    if cfg == PRESETS["tiny"]:
        return drafter_preset("tiny")
    heads = max(1, cfg.hidden_size // 64)
    return DrafterConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=1,
                         head_dim=max(2, cfg.hidden_size // heads // 2 * 2), intermediate_size=2 * cfg.hidden_size,
                         block_size=16, mask_token_id=mask_token_id(cfg),
                         target_layer_ids=sorted({0, cfg.num_hidden_layers - 1}),
                         num_target_layers=cfg.num_hidden_layers, rms_norm_eps=1e-6, rope_theta=10000.0)


def _bf16_round(W: dict) -> dict:
    """Round to bfloat16 (RNE), kept as float32. The drafter ships bf16, as real drafters do: it halves
    the bundle's largest part and only moves its proposals, never the target's goldens."""
    return {k: bfloat16_to_float32(float32_to_bfloat16(v.astype(np.float32))) for k, v in W.items()}


def _distill(cfg, W, dcfg, s: GenSettings, progress) -> dict:
    if s.distill_steps <= 0:
        return _bf16_round(init_drafter(dcfg, s.seed))
    from refmodel.distill import distill_drafter  # torch: only when a drafter is trained

    return _bf16_round(distill_drafter(cfg, dequantize_model(W), dcfg, s.seed, s.distill_steps, progress))


def apply_quant(m: Model, s: GenSettings) -> Model:
    """INT4 bundles quantize the float32 target (scope experts or mlp); the drafter is kept."""
    if s.quant == "fp32":
        if any(k.endswith(".qw") for k in m.W):
            raise GenError("the model is INT4 already; pass --quant int4 to keep it so")
        return m
    if s.quant != "int4":
        raise GenError(f"--quant {s.quant!r}: choose fp32 or int4")
    if any(k.endswith(".qw") for k in m.W):
        return m
    W = quantize_model(dequantize_model(m.W), m.cfg, s.int4_scope)
    W = {k: (v if k.endswith(".qw") else v.astype(np.float32)) for k, v in W.items()}
    return Model(m.cfg, W, m.dcfg, m.DW, {**m.meta, "quantization": quant_config(s.int4_scope)})


# ---------------------------------------------------------------- goldens

def routing_gap(cfg, W: dict, taps: dict) -> float:
    """Smallest gap, over the forward's rows and MoE layers, between the K-th and (K+1)-th biased
    choice score: how far the routing decision is from a tie (the bias is exact; the scores are not)."""
    gaps = [np.inf]
    for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        choice = taps[f"L{l}/router_scores"] + W[f"model.layers.{l}.mlp.gate.e_score_correction_bias"]  # [T, E]
        top = -np.sort(-choice, axis=-1)                                 # [T, E] descending
        K = cfg.num_experts_per_tok
        if K < top.shape[-1]:
            gaps.append(float(np.min(top[:, K - 1] - top[:, K])))
    return min(gaps)


def run_reference(cfg, W: dict, prompt, n: int, tokens=None, ar_taps=AR_TAPS, routing: dict | None = None):
    """Prefill, then n-1 decode forwards: greedy (tokens=None) or fed the given tokens (teacher forcing).
    Works in the dtype of W: float64 for the goldens, float32 for the baseline. Returns (arrays keyed by
    bundle names relative to golden/p{i}/: prefill/..., ar/logits, ar/L{l}/{tap}; the tokens; each
    decision's top-1/top-2 margin; the smallest routing gap of all forwards). `routing`: goldens holding
    prefill/L{l}/topk_ids and ar/L{l}/topk_ids, whose expert sets every forward then runs (the bf16
    profile's noise measurement, conformance/profiles.py)."""
    cache, taps = KVCache(cfg, dtype=W["model.embed_tokens.weight"].dtype), {}
    rows = [prefill(cfg, W, prompt, cache, taps=taps, forced_ids=_forced(cfg, routing, "prefill", None))]
    out = {f"prefill/{k}": v for k, v in taps.items()}
    gap = routing_gap(cfg, W, taps)
    toks = [int(np.argmax(rows[0]))] if tokens is None else [int(t) for t in tokens]
    steps: dict[str, list] = {}
    for s in range(n - 1):
        taps = {}
        rows.append(decode_one_token(cfg, W, toks[s], cache, taps=taps, forced_ids=_forced(cfg, routing, "ar", s)))
        gap = min(gap, routing_gap(cfg, W, taps))
        if tokens is None:
            toks.append(int(np.argmax(rows[-1])))
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


def golden_for_prompt(m: Model, W64: dict, prompt, n: int, budget: int) -> PromptGoldens:
    """W64: the model's weights dequantized to float64 (once per bundle, not per prompt)."""
    g64, tokens, margins, gap = run_reference(m.cfg, W64, prompt, n)
    g32, _, _, _ = run_reference(m.cfg, _f32(W64), prompt, n, tokens=tokens)
    DW64 = {k: v.astype(np.float64) for k, v in m.DW.items()}
    dd = ddtree_generate(m.cfg, W64, m.dcfg, DW64, prompt, n, budget=budget)
    return PromptGoldens(np.asarray(prompt, np.int64), tokens, margins, gap, g64, baseline_errors(g64, g32), dd)


def check_decisive(pg: PromptGoldens, logits_atol: float, router_atol: float) -> str | None:
    """Why this prompt cannot be a golden (None if it can). A flip needs an error above half the gap on
    two values, so a gap of MARGIN_SAFETY (4) tolerances leaves a correct engine a 2x reserve."""
    need = MARGIN_SAFETY * logits_atol
    if pg.margins.min() < need:
        j = int(np.argmin(pg.margins))
        return (f"greedy step {j} has top-1/top-2 margin {pg.margins[j]:.3g} < {need:.3g} "
                f"({MARGIN_SAFETY:g} x the logits tolerance): a correct fp32 engine could flip it")
    if pg.routing_gap < MARGIN_SAFETY * router_atol:
        return (f"a routing decision is {pg.routing_gap:.3g} from a tie, under {MARGIN_SAFETY:g} x the "
                f"router_scores tolerance ({MARGIN_SAFETY * router_atol:.3g}): a correct fp32 engine could "
                f"pick another expert")
    flips = [k for k, e in pg.errors.items() if e.get("mismatches")]
    if flips:
        return f"the float32 reference already picks other experts at {flips[0]}: routing too close to a tie"
    if not np.array_equal(np.asarray(pg.ddtree.tokens), pg.tokens):
        return "DDTree tokens differ from AR tokens (a reference bug: please report it)"
    return None


def manifest(pgs: list[PromptGoldens], quant: str) -> dict:
    """Tolerance manifest: per tap key, the float32 baseline (the worst prompt's max abs error and NMSE,
    as the runner judges each prompt on its own) and the derived tolerance; integer taps are exact."""
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
    return {
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


# ---------------------------------------------------------------- prompts

MAX_REDRAWS = 8         # random prompts: candidates tried per length before giving up


def prompt_length(i: int) -> int:
    """Length of random prompt i: 1, 5, 10, 18, 33, 63, 118, 224."""
    return 1 if i == 0 else int(round(5 * 1.9 ** (i - 1)))


def random_prompt(cfg: ModelConfig, seed: int, i: int, draw: int) -> np.ndarray:
    """Candidate `draw` for random prompt i: ids from (seed, i, draw), never the mask id."""
    rng = np.random.Generator(np.random.PCG64([seed, 1_000_003, i, draw]))
    return rng.integers(0, mask_token_id(cfg), size=prompt_length(i)).astype(np.int64)


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


# ---------------------------------------------------------------- the bundle

def ddtree_tensors(dd) -> dict:
    """Per-round DDTree records as ragged tensors with offsets (docs/golden-bundles.md)."""
    R = dd.rounds
    return {
        "ddtree/tokens": np.asarray(dd.tokens, np.int64),
        "ddtree/round_start": np.array([r.start for r in R], np.int64),
        "ddtree/round_bonus": np.array([r.bonus for r in R], np.int64),
        "ddtree/round_accepted_depth": np.array([r.accepted_depth for r in R], np.int64),
        "ddtree/tree_offsets": offsets([r.tree_size for r in R]),            # rows of round r: [o[r], o[r+1])
        "ddtree/tree_tokens": ragged([[-1] + list(r.tree_tokens) for r in R]),   # row 0 of a round = root (-1 here)
        "ddtree/tree_parents": ragged([r.parents for r in R]),
        "ddtree/tree_depths": ragged([[0] + list(r.depths) for r in R]),
        "ddtree/tree_ranks": ragged([[0] + list(r.ranks) for r in R]),
        "ddtree/verify_argmax": ragged([r.verify_argmax for r in R]),
        "ddtree/accepted_offsets": offsets([len(r.accepted) for r in R]),
        "ddtree/accepted": ragged([r.accepted for r in R]),
        "ddtree/counters": np.array([dd.counters.target_forwards, dd.counters.drafter_forwards], np.int64),
    }


def _store(name: str, v: np.ndarray):
    if v.dtype.kind == "f":
        return v.astype(np.float32)     # goldens stored float32: rounding <= 0.5 ULP, below every floor
    return v


def bundle_tensors(m: Model, pgs: list[PromptGoldens]):
    """Yields (name, array) in the bundle's fixed order: weights, drafter, then goldens per prompt."""
    for k, v in m.W.items():
        if k.endswith(".sc"):
            yield k, Tensor(_bf16_bits(v), dtype="bfloat16")            # K2.6 stores the scales bf16
        elif k.endswith(".qw"):
            yield k, Tensor(v, int4_shape=(v.shape[0], v.shape[1] * 8))
        else:
            yield k, v
    for k, v in m.DW.items():
        yield k, Tensor(_bf16_bits(v), dtype="bfloat16")
    for i, pg in enumerate(pgs):
        p = f"golden/p{i}/"
        yield p + "prompt_ids", pg.prompt
        yield p + "ar/tokens", pg.tokens
        yield p + "ar/margins", pg.margins
        for k, v in pg.g64.items():
            yield p + k, _store(k, v)
        for k, v in ddtree_tensors(pg.ddtree).items():
            yield p + k, v


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if np.any(bits & 0xFFFF):
        raise GenError("bfloat16 tensors (INT4 scales, drafter) must be exactly bfloat16-representable")
    return (bits >> 16).astype(np.uint16)


def figures(pgs: list[PromptGoldens], n: int) -> dict:
    ar = sum(n for _ in pgs)                                            # 1 prefill + n-1 decodes per prompt
    dd = sum(pg.ddtree.counters.target_forwards for pg in pgs)
    depths = np.concatenate([[r.accepted_depth for r in pg.ddtree.rounds] for pg in pgs])
    off_spine = sum(int(any(r.ranks[i - 1] > 0 for i in r.accepted[1:])) for pg in pgs for r in pg.ddtree.rounds)
    return {
        "ar_target_forwards": ar, "ddtree_target_forwards": dd,
        "drafter_forwards": sum(pg.ddtree.counters.drafter_forwards for pg in pgs),
        "forward_ratio": round(ar / dd, 4),
        "mean_tokens_per_round": round(float(np.mean(depths + 1)), 4),
        "accepted_depth_histogram": np.bincount(depths).tolist(),
        "off_spine_rounds": off_spine,
        "min_margin": float(min(pg.margins.min() for pg in pgs)),
        "min_routing_gap": float(min(pg.routing_gap for pg in pgs)),
        "rounds": int(depths.size),
    }


def generate_bundle(m: Model, s: GenSettings, out: str, progress=None) -> dict:
    """Goldens for every prompt, rejection of undecisive prompts, tolerance manifest, atomic write.
    Returns the summary figures (also stored in the metadata)."""
    if s.max_new_tokens < 2:
        raise GenError(f"--max-new-tokens {s.max_new_tokens}: need at least 2 (one prefill, one decode)")
    W64 = dequantize_model(m.W)
    explicit = bool(s.prompts)
    prompts = [check_prompt(m.cfg, p) for p in s.prompts] if explicit else \
        [random_prompt(m.cfg, s.seed, i, 0) for i in range(s.num_prompts)]
    pgs = []
    for i, p in enumerate(prompts):
        pgs.append(golden_for_prompt(m, W64, p, s.max_new_tokens, s.budget))
        if progress:
            progress("goldens", i + 1, len(prompts), None)
    draws = [0] * len(pgs)
    while True:                          # the tolerances depend on the prompt set: judge, redraw, repeat
        man = manifest(pgs, s.quant)
        logits_atol = max(_atol(man, "prefill/logits"), _atol(man, "ar/logits"))
        router_atol = max([_atol(man, k) for k in man["taps"] if k.endswith("/router_scores")], default=0.0)
        rejected = [(i, why) for i, pg in enumerate(pgs) if (why := check_decisive(pg, logits_atol, router_atol))]
        if not rejected:
            break
        if explicit or any(draws[i] + 1 >= MAX_REDRAWS for i, _ in rejected):
            raise GenError("; ".join(f"prompt {i} ({pgs[i].prompt.tolist()[:8]}...) rejected: {why}"
                                     for i, why in rejected) + ". Choose other prompts or another --seed.")
        for i, why in rejected:          # a random prompt that is not decisive is redrawn (and said so)
            draws[i] += 1
            if progress:
                progress(f"redraw p{i}: {why[:60]}", 1, 1, None)
            pgs[i] = golden_for_prompt(m, W64, random_prompt(m.cfg, s.seed, i, draws[i]), s.max_new_tokens,
                                       s.budget)
    # Precision profiles beyond fp32 (conformance/profiles.py): same prompts, same rule, other dtypes.
    man["profiles"] = {"bf16": bf16_profile(m.cfg, W64, [(pg.prompt, pg.tokens, pg.g64) for pg in pgs], s.quant)}
    meta = {
        "schema": BUNDLE_SCHEMA,
        "model_config": m.cfg.to_dict(),
        "drafter_config": m.dcfg.to_dict(),
        "quantization": m.meta.get("quantization", {"method": "none", "weights": "float32"}),
        "ddtree": {"block_size": m.dcfg.block_size, "budget": s.budget, "topk": None,
                   "mask_token_id": m.dcfg.mask_token_id, "target_layer_ids": m.dcfg.target_layer_ids},
        "taps": {"prefill": {str(l): tap_names(m.cfg, l) for l in range(m.cfg.num_hidden_layers)},
                 "prefill_final": ["final_hidden", "logits"], "ar": list(AR_TAPS)},
        "prompts": len(pgs), "max_new_tokens": s.max_new_tokens,
        "tolerances": man,
        "figures": figures(pgs, s.max_new_tokens),
        "provenance": {"generator": f"kdtr {_version()}", "command": s.command, "seed": s.seed,
                       "numpy": np.__version__, "python": platform.python_version()},
        **{k: v for k, v in m.meta.items() if k != "quantization"},
    }
    write_kdtr(out, bundle_tensors(m, pgs), meta)
    return meta["figures"]


def _atol(man: dict, key: str) -> float:
    e = man["taps"].get(key, {})
    return e.get("multiplier", 0) * e.get("baseline_max_abs", 0) + e.get("abs_floor", 0)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kdtr")
    except PackageNotFoundError:
        return "0+unknown"
