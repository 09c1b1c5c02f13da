"""The reference's computation of one decoder layer, split at the points where the known mistakes live,
so that a mistake is a subclass overriding one method (conformance/verify/diagnose/variants.py).

`Layer(cfg, W, ctx).run(l, inputs)` equals refmodel.model.block on the same inputs (float64, the
same contractions in the same order; tests/test_diagnosis.py checks it against block): the taps of
layer l, keyed by tap name. `inputs` is what conformance/verify/localize.layer_inputs gives: hidden [T, D],
positions [T], the cache rows before these tokens c_kv [S0, C] and k_pe [S0, R].
`ctx` carries what a variant may need beyond the math: the open bundle (its stored INT4 tensors), the
prompt length and position offset (cache-index mistakes), the engine's own taps of this forward (a
fitted variant), the phase.

Legend: T tokens, S keys (cached + new), D hidden, H heads, Q q_lora_rank, C kv_lora_rank,
R qk_rope_head_dim, N qk_nope_head_dim, A = N + R, U v_head_dim, E experts, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from refmodel.config import ModelConfig
from refmodel.model import (apply_rope, causal_mask, expert_weights, linear, rms_norm, select_experts,
                            sigmoid, silu, softmax, yarn_inv_freq)


class _Reached(Exception):
    """Raised once the tap a run was asked for is computed (Layer.run's `upto`)."""


class _Taps(dict):
    def __init__(self, upto: str | None):
        super().__init__()
        self.upto = upto

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if key == self.upto:
            raise _Reached


@dataclass
class Context:
    """What a variant may read besides the weights (module docstring)."""
    f: object = None                     # the open bundle
    phase: str = "prefill"               # "prefill" or "ar"
    prompt_len: int = 0                  # P: the prompt's cache rows
    pos0: int = 0                        # the prompt's position offset
    engine: dict = field(default_factory=dict)   # the engine's taps of this forward, by tap name


class Layer:
    """One layer of the reference (docs/model.md §2-§5), in float64."""

    def __init__(self, cfg: ModelConfig, W, ctx: Context | None = None):
        self.cfg, self.W, self.ctx = cfg, W, ctx or Context()

    # ------------------------------------------------------------ arithmetic
    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return linear(x, w)

    def weight(self, name: str) -> np.ndarray:
        return self.W[name]

    def norm(self, x: np.ndarray, w: np.ndarray, eps: float, which: str) -> np.ndarray:
        """which: input, post (rms_norm_eps), q_a, kv_a (the latent norms)."""
        return rms_norm(x, w, eps)

    def latent_eps(self) -> float:
        return self.cfg.latent_norm_eps

    # ------------------------------------------------------------ positions and RoPE
    def positions(self, positions: np.ndarray) -> np.ndarray:
        return positions

    def inv_freq(self) -> np.ndarray:
        return yarn_inv_freq(self.cfg)                                    # [R/2]

    def attention_factor(self) -> float:
        return self.cfg.rope_attention_factor

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        angle = np.einsum("t,r->tr", positions.astype(np.float64), self.inv_freq())  # [T] -> [T, R/2]
        a = self.attention_factor()
        return np.cos(angle) * a, np.sin(angle) * a

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, which: str) -> np.ndarray:
        """which: "q" ([T, H, R]) or "k" ([T, R])."""
        return apply_rope(x, cos, sin)

    # ------------------------------------------------------------ attention
    def softmax_scale(self) -> float:
        return self.cfg.softmax_scale

    def mask(self, T: int, S0: int) -> np.ndarray:
        return causal_mask(T, S0)                                         # [T, S0 + T]

    def cache(self, c_old, k_old, c_new, k_new) -> tuple[np.ndarray, np.ndarray]:
        """The rows attention reads: the cache before, then the new rows."""
        return np.concatenate([c_old, c_new]), np.concatenate([k_old, k_new])   # [S, C], [S, R]

    def mla(self, l: int, x: np.ndarray, positions, c_old, k_old, taps: dict) -> np.ndarray:
        cfg, p = self.cfg, f"model.layers.{l}.self_attn."
        H, N, C, U, A = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim,
                         cfg.qk_head_dim)
        T = x.shape[0]
        cos, sin = self.cos_sin(self.positions(positions))                # [T, R/2] each
        eps = self.latent_eps()
        c_q = self.norm(self.linear(x, self.weight(p + "q_a_proj.weight")), self.weight(p + "q_a_layernorm.weight"),
                        eps, "q_a")                                       # [T, Q]
        q = self.linear(c_q, self.weight(p + "q_b_proj.weight")).reshape(T, H, A)   # [T, Q] -> [T, H, A]
        q_nope, q_pe = q[..., :N], self.rope(q[..., N:], cos, sin, "q")  # [T, H, N], [T, H, R]
        kv = self.linear(x, self.weight(p + "kv_a_proj_with_mqa.weight"))  # [T, D] -> [T, C + R]
        c_kv = self.norm(kv[:, :C], self.weight(p + "kv_a_layernorm.weight"), eps, "kv_a")  # [T, C]
        k_pe = self.rope(kv[:, C:], cos, sin, "k")                        # [T, R]
        taps["q"] = np.concatenate([q_nope, q_pe], axis=-1)
        taps["kv_latent"] = c_kv
        taps["k_pe"] = k_pe
        c_all, k_all = self.cache(c_old, k_old, c_kv, k_pe)               # [S, C], [S, R]
        mask = self.mask(T, c_old.shape[0])                               # [T, S]
        kvb = self.linear(c_all, self.weight(p + "kv_b_proj.weight")).reshape(-1, H, N + U)  # [S, H, N+U]
        k_nope, v = kvb[..., :N], kvb[..., N:]                            # [S, H, N], [S, H, U]
        scores = np.einsum("thn,shn->hts", q_nope, k_nope) + np.einsum("thr,sr->hts", q_pe, k_all)  # [H, T, S]
        probs = softmax(scores * self.softmax_scale() + mask)             # [H, T, S]
        o = np.einsum("hts,shu->thu", probs, v)                           # [T, H, U]
        return self.linear(o.reshape(T, H * U), self.weight(p + "o_proj.weight"))  # [T, HU] -> [T, D]

    # ------------------------------------------------------------ feed-forward
    def swiglu(self, p: str, x: np.ndarray) -> np.ndarray:
        g = self.linear(x, self.weight(p + "gate_proj.weight"))          # [T, D] -> [T, I]
        u = self.linear(x, self.weight(p + "up_proj.weight"))
        return self.linear(silu(g) * u, self.weight(p + "down_proj.weight"))  # [T, I] -> [T, D]

    def router_scores(self, logits: np.ndarray) -> np.ndarray:
        return sigmoid(logits)                                            # [T, E]

    def select(self, choice: np.ndarray) -> np.ndarray:
        return select_experts(self.cfg, choice)                           # [T, E] -> [T, K]

    def expert_weights(self, scores: np.ndarray, ids: np.ndarray, bias: np.ndarray) -> np.ndarray:
        return expert_weights(self.cfg, scores, ids)                      # [T, K]

    def combine(self, p: str, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        y = np.zeros_like(x)                                              # [T, D]
        for e in np.unique(ids):                                          # ascending expert id, as refmodel
            tok, slot = np.nonzero(ids == e)
            y[tok] += weights[tok, slot, None] * self.swiglu(p + f"experts.{e}.", x[tok])
        return y

    def shared(self, p: str, x: np.ndarray) -> np.ndarray:
        return self.swiglu(p + "shared_experts.", x)

    def moe(self, l: int, x: np.ndarray, taps: dict) -> np.ndarray:
        p = f"model.layers.{l}.mlp."
        scores = self.router_scores(self.linear(x, self.weight(p + "gate.weight")))   # [T, E]
        bias = self.weight(p + "gate.e_score_correction_bias")            # [E]
        ids = self.select(scores + bias)                                  # [T, K]
        weights = self.expert_weights(scores, ids, bias)                  # [T, K]
        taps["router_scores"] = scores
        taps["topk_ids"] = ids.astype(np.int64)
        taps["topk_weights"] = weights
        y = self.combine(p, x, ids, weights)
        return y + self.shared(p, x) if self.cfg.n_shared_experts else y

    # ------------------------------------------------------------ the block
    def run(self, l: int, inputs: dict, upto: str | None = None) -> dict:
        """The layer's taps; with `upto`, only those computed up to and including that tap."""
        taps = _Taps(upto)
        try:
            self._run(l, inputs, taps)
        except _Reached:
            pass
        return dict(taps)

    def _run(self, l: int, inputs: dict, taps: dict) -> None:
        cfg, p = self.cfg, f"model.layers.{l}."
        h = np.asarray(inputs["hidden"], np.float64)                     # [T, D]
        positions = np.asarray(inputs["positions"], np.int64)
        c_old = np.asarray(inputs["c_kv"], np.float64)                   # [S0, C]
        k_old = np.asarray(inputs["k_pe"], np.float64)                   # [S0, R]
        x = self.norm(h, self.weight(p + "input_layernorm.weight"), cfg.rms_norm_eps, "input")
        taps["attn_in"] = x
        a = self.mla(l, x, positions, c_old, k_old, taps)
        taps["attn_out"] = a
        h = h + a
        taps["resid_attn"] = h
        x = self.norm(h, self.weight(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps, "post")
        taps["mlp_in"] = x
        m = self.swiglu(p + "mlp.", x) if l < cfg.first_k_dense_replace else self.moe(l, x, taps)
        taps["mlp_out"] = m
        taps["resid_out"] = h + m
