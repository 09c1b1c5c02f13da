"""Deterministic float64 weights with HF names, and the golden "worth drafting" target construction.

Every tensor is drawn from one numpy Generator(PCG64(seed)) in the fixed order of expected_shapes(cfg), so the
bytes are identical on every machine. Plain random weights give chaotic greedy streams (no drafter can follow), so the
golden target is built to be predictable in stretches:

* lm_head row perm[x] = embed row x * head_scale, where perm is a seeded permutation of the ids 0..V-2. The
  residual stream's token direction then votes for "the next token is perm[current token]".
* The attention o_proj and every MLP/expert down_proj are drawn with std out_scale * alpha / sqrt(fan_in), so
  alpha dials how much the layers can overrule the permutation rule (alpha = 0: pure rule).
* The last id V-1 is reserved as the DDTree drafter's mask token: it is outside perm's domain and image, and its
  lm_head row is small (head_scale * mask_row_scale), so the target never predicts it.
"""
from __future__ import annotations

import numpy as np

from refmodel.config import ModelConfig

# Construction constants, recorded in construction_info() (bundle metadata). Tuned on `tiny`: see
# docs/golden-bundles.md ("Target construction") for the measured rule-following rate and margins.
EMBED_STD = 1.0          # embedding rows ~ N(0, 1): the token direction carried by the residual stream
OUT_SCALE = 1.0          # o_proj / down_proj std = OUT_SCALE * alpha / sqrt(fan_in)
NORM_SPREAD = 0.2        # norm weights ~ U(1 - spread/2, 1 + spread/2): non-trivial but near 1
BIAS_STD = 0.1           # e_score_correction_bias ~ N(0, BIAS_STD): moves selections, never zero
MASK_ROW_SCALE = 0.01    # lm_head[V-1] is this small: the mask token is never predicted
HEAD_GAIN = 4.0          # logit scale: the rule token's logit is ~HEAD_GAIN * sqrt(D) / (residual RMS); sets margins


def mask_token_id(cfg: ModelConfig) -> int:
    """The reserved drafter mask token: the last vocabulary id."""
    return cfg.vocab_size - 1


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name (HF naming, per-expert) -> shape, in the fixed generation order."""
    D, H, V = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
    Q, C, R = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    N, Dv, I, Im = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.intermediate_size, cfg.moe_intermediate_size
    S = {"model.embed_tokens.weight": (V, D)}
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        S[p + "input_layernorm.weight"] = (D,)
        S[p + "self_attn.q_a_proj.weight"] = (Q, D)
        S[p + "self_attn.q_a_layernorm.weight"] = (Q,)
        S[p + "self_attn.q_b_proj.weight"] = (H * cfg.qk_head_dim, Q)
        S[p + "self_attn.kv_a_proj_with_mqa.weight"] = (C + R, D)
        S[p + "self_attn.kv_a_layernorm.weight"] = (C,)
        S[p + "self_attn.kv_b_proj.weight"] = (H * (N + Dv), C)
        S[p + "self_attn.o_proj.weight"] = (D, H * Dv)
        S[p + "post_attention_layernorm.weight"] = (D,)
        if l < cfg.first_k_dense_replace:
            S.update(_mlp_shapes(p + "mlp.", D, I))
            continue
        S[p + "mlp.gate.weight"] = (cfg.n_routed_experts, D)
        S[p + "mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            S.update(_mlp_shapes(p + f"mlp.experts.{e}.", D, Im))
        if cfg.n_shared_experts:
            S.update(_mlp_shapes(p + "mlp.shared_experts.", D, Im * cfg.n_shared_experts))
    S["model.norm.weight"] = (D,)
    if not cfg.tie_word_embeddings:
        S["lm_head.weight"] = (V, D)
    return S


def _mlp_shapes(p: str, D: int, I: int) -> dict[str, tuple[int, int]]:
    return {p + "gate_proj.weight": (I, D), p + "up_proj.weight": (I, D), p + "down_proj.weight": (D, I)}


def init_weights(cfg: ModelConfig, seed: int, alpha: float = 1.0) -> dict[str, np.ndarray]:
    """Float64 weights for cfg, deterministic in (cfg, seed, alpha). Untied configs get the golden construction."""
    return {name: w for _, _, name, w in iter_weights(cfg, seed, alpha)}


def iter_weights(cfg: ModelConfig, seed: int, alpha: float = 1.0):
    """init_weights one tensor at a time: yields (index, count, name, float64 array) in expected_shapes
    order, so a caller can store each tensor (bf16, INT4) before the next is drawn. Only the embedding is
    held back (lm_head, drawn last, copies its rows)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    V = cfg.vocab_size
    perm = rng.permutation(V - 1)                      # drawn first: perm depends on (V, seed) only
    shapes = expected_shapes(cfg)
    embed = None
    for i, (name, shape) in enumerate(shapes.items()):
        w = _draw(rng, cfg, name, shape, alpha)
        if name == "model.embed_tokens.weight":
            embed = w
        if name == "lm_head.weight" and not cfg.tie_word_embeddings:
            w[perm] = embed[: V - 1] * _head_scale(cfg)  # drawn as N(0, 1/D); row V-1 kept (scaled down)
            w[V - 1] *= MASK_ROW_SCALE
        yield i, len(shapes), name, w


def _head_scale(cfg: ModelConfig) -> float:
    # A normalised hidden of RMS 1 equal to embed row x / EMBED_STD gives logit HEAD_GAIN * sqrt(D) for perm[x].
    return HEAD_GAIN / (EMBED_STD * np.sqrt(cfg.hidden_size))


def _draw(rng: np.random.Generator, cfg: ModelConfig, name: str, shape: tuple, alpha: float) -> np.ndarray:
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return rng.uniform(1 - NORM_SPREAD / 2, 1 + NORM_SPREAD / 2, size=shape)
    if name.endswith("e_score_correction_bias"):
        return rng.normal(0.0, BIAS_STD, size=shape)
    if name == "model.embed_tokens.weight":
        return rng.normal(0.0, EMBED_STD, size=shape)
    std = 1.0 / np.sqrt(shape[1])                      # nn.Linear [out, in]: fan_in = in
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
        std *= OUT_SCALE * alpha
    return rng.normal(0.0, std, size=shape)


def construction_info(cfg: ModelConfig, seed: int, alpha: float = 1.0) -> dict:
    """The golden target's construction parameters, JSON-ready, for bundle metadata."""
    tied = cfg.tie_word_embeddings
    return {
        "method": "plain_random_tied" if tied else "lm_head_permuted_embedding",
        "rng": "numpy.random.Generator(PCG64(seed)); permutation(V-1) first, then tensors in expected_shapes order",
        "seed": int(seed),
        "alpha": float(alpha),
        "embed_std": EMBED_STD,
        "out_scale": OUT_SCALE,
        "out_proj_std": "out_scale * alpha / sqrt(fan_in) for self_attn.o_proj and all mlp down_proj",
        "other_linear_std": "1 / sqrt(fan_in)",
        "norm_weights": f"U({1 - NORM_SPREAD / 2}, {1 + NORM_SPREAD / 2})",
        "e_score_correction_bias_std": BIAS_STD,
        "lm_head": None if tied else "lm_head[perm[x]] = embed[x] * head_scale for x < V-1, head_scale = head_gain / (embed_std * sqrt(D))",
        "head_gain": HEAD_GAIN,
        "head_scale": None if tied else _head_scale(cfg),
        "mask_token_id": mask_token_id(cfg),
        "mask_row": None if tied else f"lm_head[V-1] ~ N(0, 1/D) * {MASK_ROW_SCALE}",
    }


def permutation(cfg: ModelConfig, seed: int) -> np.ndarray:
    """perm[x] = the token the golden target's rule predicts after x (x < V-1)."""
    return np.random.Generator(np.random.PCG64(seed)).permutation(cfg.vocab_size - 1)
