"""A minimal engine in plain NumPy (float32), written against docs/engine-api.md alone.

    kdtr verify bundles/model_tiny.kdtr --engine python --module examples.numpy_engine:NumpyEngine

It is a skeleton to copy: each protocol method is a few lines around one forward, and the math is the
model of docs/model.md in the compute dtype (float32), independent of kdtr's reference. Replace `_block`
and its helpers with calls into your own kernels and the rest still holds. It implements the required
methods and `run_layer` (so a failure is localised); it leaves out the optional `hold_routing` and
`ddtree_generate` (the verdict then reports the live DDTree checks as not run).

Legend: T tokens of a forward, S cache rows, D hidden, H heads, N nope dims, R rope dims, A = N + R,
C kv_lora_rank, U v_head_dim, E routed experts, K experts per token, V vocab.
"""
import os

import numpy as np

from kdtr_format import open_kdtr
from kdtr_format.int4 import dequantize_w4a16
from refmodel.config import ModelConfig      # the bundle's config with its derived constants (docs/model.md §1)

F32 = np.float32


def rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps)))


def swiglu(W, p, x):
    g, u = x @ W[p + "gate_proj.weight"].T, x @ W[p + "up_proj.weight"].T          # [T, D] -> [T, I]
    return (g / (1 + np.exp(-g)) * u) @ W[p + "down_proj.weight"].T                 # [T, I] -> [T, D]


def inv_freq(cfg):
    """DeepSeek YaRN frequencies per rope pair (docs/model.md §3), float64."""
    R, theta, rope = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling
    f = theta ** -(np.arange(0, R, 2, dtype=np.float64) / R)                        # [R/2]
    if rope is None:
        return f
    dim = lambda rot: R * np.log(rope["original_max_position_embeddings"] / (rot * 2 * np.pi)) / (2 * np.log(theta))  # noqa: E731
    low, high = dim(rope["beta_fast"]), dim(rope["beta_slow"])
    if rope.get("truncate", True):
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0.0), min(high, R - 1.0)
    ramp = np.clip((np.arange(R // 2) - low) / (high - low + (0.001 if low == high else 0.0)), 0, 1)
    return f * (1 - ramp) + f / rope["factor"] * ramp


def rope(x, cos, sin):
    """Rotate the interleaved pairs (2i, 2i+1) of x [T, .., R] by angle i; cos/sin [T, R/2]."""
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return out


class NumpyEngine:
    name = "numpy-skeleton"
    dtype = "float32"
    supports_teacher_forcing = True          # run_layer below

    def load(self, bundle) -> None:
        """`bundle`: an open KdtrFile (what `kdtr verify` passes) or a path."""
        if isinstance(bundle, (str, os.PathLike)):
            with open_kdtr(bundle) as f:
                return self.load(f)
        f = bundle
        self.cfg = ModelConfig.from_dict(f.metadata["model_config"])
        self.W = {}
        for n in f.names:
            if n.startswith(("golden/", "drafter.")) or n.endswith(".sc"):
                continue
            if f.info(n).int4_shape is not None:                                    # INT4 W4A16 expert
                m = n[:-len(".qw")]
                self.W[m + ".weight"] = dequantize_w4a16(f[n], f[m + ".sc"], f.info(n).int4_shape, F32)
            else:
                self.W[n] = np.asarray(f.get(n), F32)                              # bf16 widened to float32
        self.freq = inv_freq(self.cfg)
        self.reset()

    def reset(self) -> None:
        L, C, R = self.cfg.num_hidden_layers, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim
        self.c_kv = [np.zeros((0, C), F32) for _ in range(L)]                       # [S, C] per layer
        self.k_pe = [np.zeros((0, R), F32) for _ in range(L)]                       # [S, R], interleaved

    # -- the protocol's forwards: one causal or tree-masked forward over the shared cache

    def prefill(self, ids, positions):
        return self._forward(ids, positions, None)

    def decode(self, token, position):
        return self._forward([token], [position], None)

    def verify_tree(self, ids, positions, mask):
        return self._forward(ids, positions, mask)

    def compact(self, start, keep) -> None:
        rows = np.concatenate([np.arange(start), start + np.asarray(keep, np.int64)])
        self.c_kv = [c[rows] for c in self.c_kv]
        self.k_pe = [k[rows] for k in self.k_pe]

    def run_layer(self, layer, inputs):
        """Layer `layer` alone on golden inputs, on a cache of its own (the engine's stays untouched)."""
        h = np.asarray(inputs["hidden"], F32)                                       # [T, D]
        cache = ([np.asarray(inputs["c_kv"], F32)], [np.asarray(inputs["k_pe"], F32)])
        taps = {}
        self._block(layer, h, np.asarray(inputs["positions"]), cache, 0, None, taps)
        return taps

    def _forward(self, ids, positions, mask):
        ids, positions = np.asarray(ids, np.int64).reshape(-1), np.asarray(positions, np.int64).reshape(-1)
        taps, h = {}, self.W["model.embed_tokens.weight"][ids]                     # [T] -> [T, D]
        for l in range(self.cfg.num_hidden_layers):
            h = self._block(l, h, positions, (self.c_kv, self.k_pe), l, mask, taps)
        x = rms_norm(h, self.W["model.norm.weight"], self.cfg.rms_norm_eps)
        head = self.W["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]
        taps["final_hidden"], taps["logits"] = x, x @ head.T                        # [T, D] -> [T, V]
        return taps["logits"], taps

    # -- the model (docs/model.md §2-§5), float32

    def _block(self, l, h, positions, cache, slot, mask, taps):
        """One decoder layer; appends this forward's cache rows to cache[.][slot]. Records the taps."""
        cfg, W, p = self.cfg, self.W, f"model.layers.{l}."
        put = lambda name, v: taps.__setitem__(f"L{l}/{name}", v)                   # noqa: E731
        x = rms_norm(h, W[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        put("attn_in", x)
        a = self._attention(l, x, positions, cache, slot, mask, put)
        put("attn_out", a)
        h = h + a
        put("resid_attn", h)
        x = rms_norm(h, W[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        put("mlp_in", x)
        m = swiglu(W, p + "mlp.", x) if l < cfg.first_k_dense_replace else self._moe(l, x, put)
        put("mlp_out", m)
        h = h + m
        put("resid_out", h)
        return h

    def _attention(self, l, x, positions, cache, slot, mask, put):
        cfg, W, p = self.cfg, self.W, f"model.layers.{l}.self_attn."
        H, N, C, U = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        T = x.shape[0]
        angle = positions.astype(np.float64)[:, None] * self.freq                   # [T, R/2], float64 angles
        cos = (np.cos(angle) * cfg.rope_attention_factor).astype(F32)               # then cos/sin cast
        sin = (np.sin(angle) * cfg.rope_attention_factor).astype(F32)
        c_q = rms_norm(x @ W[p + "q_a_proj.weight"].T, W[p + "q_a_layernorm.weight"], cfg.latent_norm_eps)
        q = (c_q @ W[p + "q_b_proj.weight"].T).reshape(T, H, N + cfg.qk_rope_head_dim)  # [T, H, A]
        q = np.concatenate([q[..., :N], rope(q[..., N:], cos, sin)], axis=-1)
        kv = x @ W[p + "kv_a_proj_with_mqa.weight"].T                               # [T, C + R]
        c_kv = rms_norm(kv[:, :C], W[p + "kv_a_layernorm.weight"], cfg.latent_norm_eps)  # [T, C]
        k_pe = rope(kv[:, C:], cos, sin)                                            # [T, R], never normed
        put("q", q), put("kv_latent", c_kv), put("k_pe", k_pe)
        S0 = len(cache[0][slot])
        cache[0][slot] = c_all = np.concatenate([cache[0][slot], c_kv])            # [S, C]
        cache[1][slot] = k_all = np.concatenate([cache[1][slot], k_pe])            # [S, R]
        if mask is None:                                                            # causal over cache + new
            mask = np.where(np.arange(S0 + T)[None] <= S0 + np.arange(T)[:, None], 0.0, -np.inf)
        kvb = (c_all @ W[p + "kv_b_proj.weight"].T).reshape(-1, H, N + U).transpose(1, 0, 2)  # [H, S, N + U]
        qh = q.transpose(1, 0, 2)                                                   # [H, T, A]
        scores = qh[..., :N] @ kvb[..., :N].transpose(0, 2, 1) + qh[..., N:] @ k_all.T  # [H, T, S]
        scores = scores * F32(cfg.softmax_scale) + np.asarray(mask, F32)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        o = (probs @ kvb[..., N:]).transpose(1, 0, 2).reshape(T, H * U)           # [H, T, U] -> [T, H * U]
        return o @ W[p + "o_proj.weight"].T                                         # [T, D]

    def _moe(self, l, x, put):
        """Sigmoid router, the bias choosing experts but never weighing them, group-limited top-K."""
        cfg, W, p = self.cfg, self.W, f"model.layers.{l}.mlp."
        T, E, G, K = x.shape[0], cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
        scores = 1 / (1 + np.exp(-(x @ W[p + "gate.weight"].T)))                   # [T, E]
        choice = scores + W[p + "gate.e_score_correction_bias"]
        if G > 1:
            top2 = np.sort(choice.reshape(T, G, E // G), -1)[..., -2:].sum(-1)     # [T, G]
            kept = np.argsort(-top2, -1, kind="stable")[:, :cfg.topk_group]
            keep = np.zeros((T, G), bool)
            np.put_along_axis(keep, kept, True, -1)
            choice = np.where(np.repeat(keep, E // G, -1), choice, -np.inf)
        ids = np.argsort(-choice, -1, kind="stable")[:, :K]                         # [T, K], ties: lower id
        w = np.take_along_axis(scores, ids, -1)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + F32(1e-20))
        w = w * F32(cfg.routed_scaling_factor)
        put("router_scores", scores), put("topk_ids", ids.astype(np.int64)), put("topk_weights", w)
        y = np.zeros_like(x)
        for e in np.unique(ids):
            tok, k = np.nonzero(ids == e)
            y[tok] += w[tok, k, None] * swiglu(W, p + f"experts.{e}.", x[tok])
        return y + swiglu(W, p + "shared_experts.", x) if cfg.n_shared_experts else y
