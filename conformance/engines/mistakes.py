"""Planted mistakes: the reference engine with one of the known mistakes of the diagnosis library
(conformance/verify/diagnose/library.py) planted, so tests and bench/bench_diagnosis.py can prove that
the diagnosis names it. Five ids are planted by conformance/engines/faults.py's FaultyEngine already
(`PLANTED` maps them); this module plants the rest.

Each mistake is written here as an engine would make it (a wrong config value, wrong weights at load,
a wrong reader, a wrong cache, or one refmodel function swapped for a wrong one while the engine
computes), never with the diagnosis's own variant code, so a match is evidence and not a tautology.
A swapped function is restored after every call (`_swapped`).

Legend: T tokens, S cache rows, E experts, K top-k, C kv_lora_rank, N out, K_in in.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

import refmodel.model as rm
from conformance.engines.faults import FaultyEngine
from conformance.engines.reference_engine import ReferenceEngine, refmodel_swapped
from kdtr_format import open_kdtr
from kdtr_format.int4 import bf16_round, bf16_to_float32, unpack_int4
from refmodel.ddtree import Tree, visibility
from refmodel.model import KVCache, block, causal_mask

MISTAKES = ("rope-theta", "yarn-not-applied", "yarn-mscale", "yarn-truncate", "causal-mask", "softmax-scale",
            "latent-norm-eps", "norm-missing", "kv-write-index", "kv-compaction", "router-softmax",
            "router-bias-in-weights", "router-no-renorm", "router-no-scaling", "router-group-limit",
            "topk-k-minus-1", "shared-expert-dropped", "shared-expert-scaled", "int4-zero-point",
            "int4-group-index", "int4-scale-dtype", "numerics-bf16", "numerics-tf32", "tree-positions",
            "tree-tie-order")
INT4_ONLY = ("int4-nibble-order", "int4-zero-point", "int4-group-index", "int4-scale-dtype")
# every library id -> (engine factory, which bundles it can act on)
PLANTED = {
    "rope-layout": (lambda: FaultyEngine("rope_pairs"), "both"),
    "rope-float32-angles": (lambda: FaultyEngine("rope_f32_angles"), "both"),
    "position-offset": (lambda: FaultyEngine("position_off_by_one"), "both"),
    "int4-nibble-order": (lambda: FaultyEngine("nibble_order"), "int4"),
    "tree-mask": (lambda: FaultyEngine("tree_mask_off_by_one"), "both"),
    **{m: ((lambda m=m: MistakeEngine(m)), "int4" if m in INT4_ONLY else "both") for m in MISTAKES},
}


class EarlyWriteCache(KVCache):
    """A decode row written one slot early, over the row before, and the length counted on: the slot at
    the end is read while still empty (a write index of length - 1)."""
    decoding = False

    def append(self, l, c_kv, k_pe):
        if not (self.decoding and len(c_kv) == 1 and len(self.c_kv[l])):
            return super().append(l, c_kv, k_pe)
        self.c_kv[l] = np.concatenate([self.c_kv[l][:-1], c_kv, np.zeros_like(c_kv)])
        self.k_pe[l] = np.concatenate([self.k_pe[l][:-1], k_pe, np.zeros_like(k_pe)])
        return self.c_kv[l], self.k_pe[l]


def _tf32(x):
    """TF32 rounding written apart from the hypothesis's (variants_moe.tf32_round; a test checks they agree)."""
    m, e = np.frexp(np.asarray(x, np.float32))                           # x = m * 2^e, |m| in [0.5, 1)
    return np.ldexp(np.rint(np.ldexp(m, 11)), e - 11).astype(np.float32)  # 11 significant bits


def _route_bias_in_weights(cfg, W, l, x, forced=None):
    p = f"model.layers.{l}.mlp.gate."
    scores = 1.0 / (1.0 + np.exp(-(x @ W[p + "weight"].T)))            # [T, E]
    biased = scores + W[p + "e_score_correction_bias"]
    ids = np.argsort(-biased, axis=-1, kind="stable")[:, :cfg.num_experts_per_tok]   # [T, K]
    w = np.take_along_axis(biased, ids, -1)                              # the mistake: biased weights
    w = w / (w.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    return scores, ids, w.astype(x.dtype)


def _moe_k_minus_1(cfg, W, l, x, taps, forced=None):
    p = f"model.layers.{l}.mlp."
    scores, ids, weights = rm.route(cfg, W, l, x, forced)
    for name, v in (("router_scores", scores), ("topk_ids", ids.astype(np.int64)), ("topk_weights", weights)):
        taps[f"L{l}/{name}"] = v.copy()
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(cfg.num_experts_per_tok - 1):                     # the mistake: range(K - 1)
            y[t] += weights[t, k] * rm.swiglu(W, p + f"experts.{ids[t, k]}.", x[t:t + 1])[0]
    return y + rm.swiglu(W, p + "shared_experts.", x)


class MistakeEngine(ReferenceEngine):
    """ReferenceEngine with the mistake `mistake` (one of MISTAKES) planted (module docstring)."""

    supports_teacher_forcing = True

    def __init__(self, mistake: str):
        super().__init__()
        if mistake not in MISTAKES:
            raise ValueError(f"unknown mistake {mistake!r}; choose one of {', '.join(MISTAKES)} "
                             f"(the other ids are planted by FaultyEngine: PLANTED)")
        self.mistake, self.name = mistake, f"reference+{mistake}"

    # ------------------------------------------------------------ planting at load
    def load(self, bundle) -> None:
        if isinstance(bundle, (str, os.PathLike)):
            with open_kdtr(bundle) as f:
                return self.load(f)
        super().load(bundle)
        cfg, W, m = self.cfg, self.W, self.mistake
        change = {"rope-theta": {"rope_theta": 10000.0}, "yarn-not-applied": {"rope_scaling": None},
                  "latent-norm-eps": {"latent_norm_eps": cfg.rms_norm_eps},
                  "router-no-renorm": {"norm_topk_prob": False}, "router-no-scaling": {"routed_scaling_factor": 1.0},
                  "router-group-limit": {"n_group": 8, "topk_group": 4}}.get(m)
        if m == "yarn-truncate":
            change = {"rope_scaling": {**cfg.rope_scaling, "truncate": False}}
        if change:
            self.cfg = dataclasses.replace(cfg, **change)
        if m == "softmax-scale":                                          # the absorbed key width C + R
            self.cfg = dataclasses.replace(cfg)
            object.__setattr__(self.cfg, "softmax_scale", cfg.softmax_scale * (
                cfg.qk_head_dim / (cfg.kv_lora_rank + cfg.qk_rope_head_dim)) ** 0.5)
        moe_layers = range(cfg.first_k_dense_replace, cfg.num_hidden_layers)
        if m in ("shared-expert-dropped", "shared-expert-scaled"):
            for l in moe_layers:
                k = f"model.layers.{l}.mlp.shared_experts.down_proj.weight"
                W[k] = W[k] * np.float32(0.0 if m == "shared-expert-dropped" else cfg.routed_scaling_factor)
        if m.startswith("int4-"):
            self._dequantize_wrongly(bundle)
        self.reset()

    def _dequantize_wrongly(self, f) -> None:
        names = [n for n in f.names if n.endswith(".qw")]
        if not names:
            raise ValueError(f"mistake {self.mistake!r} needs an INT4 bundle (kdtr gen --quant int4)")
        for n in names:
            mod = n[:-3]
            q = unpack_int4(np.asarray(f[n])).astype(np.float64)           # [N, K_in]
            sc = np.asarray(f[mod + ".sc"])
            sc = bf16_to_float32(sc).astype(np.float64) if sc.dtype == np.uint16 else sc.astype(np.float64)
            if self.mistake == "int4-zero-point":
                w = (q + 8) * np.repeat(sc, q.shape[1] // sc.shape[1], 1)   # the offset not removed
            elif self.mistake == "int4-group-index":
                w = q * sc[:, np.minimum(np.arange(q.shape[1]) // 128, sc.shape[1] - 1)]   # group 128
            else:
                w = bf16_round(q * np.repeat(sc, q.shape[1] // sc.shape[1], 1))    # product in bf16
            self.W[mod + ".weight"] = w.astype(self.np_dtype)

    # ------------------------------------------------------------ running
    def _swapped(self):
        """The refmodel function this mistake replaces, swapped in for one call."""
        m, cfg = self.mistake, self.cfg
        swap = {}
        if m == "router-softmax":
            swap["sigmoid"] = rm.softmax
        elif m == "router-bias-in-weights":
            swap["route"] = _route_bias_in_weights
        elif m == "topk-k-minus-1":
            swap["moe"] = _moe_k_minus_1
        elif m == "norm-missing":                                         # kv_a_layernorm skipped
            norm = rm.rms_norm
            swap["rms_norm"] = lambda x, w, eps: x if x.shape[-1] == cfg.kv_lora_rank else norm(x, w, eps)
        elif m in ("numerics-bf16", "numerics-tf32"):
            r = (lambda a: bf16_round(a).astype(np.float32)) if m == "numerics-bf16" else _tf32
            swap["linear"] = lambda x, w: np.einsum("ti,oi->to", r(x), r(w)).astype(x.dtype)
        return refmodel_swapped(swap)

    def _cos_sin(self, positions):
        cos, sin = super()._cos_sin(positions)
        if self.mistake != "yarn-mscale":
            return cos, sin
        rope = self.cfg.rope_scaling
        m = np.float32(1 + 0.1 * rope.get("mscale", 1.0) * np.log(rope["factor"]))   # not / m(all_dim)
        return cos * m, sin * m

    def reset(self) -> None:
        self.cache = (EarlyWriteCache if self.mistake == "kv-write-index" else KVCache)(self.cfg, self.np_dtype)

    def _forward(self, ids, positions, mask=None):
        with self._swapped():
            return super()._forward(ids, positions, mask)

    def prefill(self, ids, positions):
        if self.mistake == "causal-mask":                                 # no mask: every token sees all
            T = len(ids)
            return self._forward(ids, positions, np.zeros((T, self.cache.length + T), self.np_dtype))
        return super().prefill(ids, positions)

    def decode(self, token, position):
        self.cache.decoding = True
        try:
            return super().decode(token, position)
        finally:
            self.cache.decoding = False

    def verify_tree(self, ids, positions, mask):
        if self.mistake == "tree-positions":
            positions = np.asarray(positions)[0] + np.arange(len(ids))    # by node index
        return super().verify_tree(ids, positions, mask)

    def compact(self, start, keep) -> None:
        if self.mistake == "kv-compaction":
            self.cache.truncate(start + len(keep))                        # the rows never moved
        else:
            super().compact(start, keep)

    def build_tree(self, draft_logits, budget, topk):
        tree = super().build_tree(draft_logits, budget, topk)
        if self.mistake != "tree-tie-order" or len(tree.tokens) < 2:
            return tree
        order = np.argsort(tree.depths, kind="stable")                    # breadth first, not pop order
        new = np.empty(len(order) + 1, np.int64)
        new[0], new[order + 1] = 0, np.arange(1, len(order) + 1)
        parents = np.concatenate([[-1], new[tree.parents[1:][order]]])
        tokens = tree.tokens[order]
        child_maps = [{} for _ in range(len(tokens) + 1)]
        for i in range(1, len(tokens) + 1):
            child_maps[parents[i]][int(tokens[i - 1])] = i
        return Tree(tokens, tree.depths[order], parents, child_maps, visibility(parents), tree.ranks[order],
                    tree.scores[order])

    def run_layer(self, layer: int, inputs: dict) -> dict:
        """Teacher forcing with the mistake: the reference's, with this engine's cache and functions."""
        cfg, dt = self.cfg, self.np_dtype
        cache = self.cache.__class__(cfg, dt)
        cache.c_kv[layer], cache.k_pe[layer] = np.asarray(inputs["c_kv"], dt), np.asarray(inputs["k_pe"], dt)
        h, positions = np.asarray(inputs["hidden"], dt), np.asarray(inputs["positions"], np.int64)
        cache.decoding = len(h) == 1 and len(inputs["c_kv"]) > 0
        S0 = cache.c_kv[layer].shape[0]
        mask = (np.zeros((len(h), S0 + len(h))) if self.mistake == "causal-mask" and S0 == 0
                else causal_mask(len(h), S0)).astype(dt)
        cos, sin = self._cos_sin(positions)
        taps = {}
        with self._swapped():
            block(cfg, self.W, layer, h, cos, sin, cache, mask, False, taps)
        return taps
