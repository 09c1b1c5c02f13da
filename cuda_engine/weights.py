"""A bundle's weights as the engine's device layout (float32): per-layer tensors, stacked experts,
per-head absorbed-MLA matrices. Host-side only (NumPy); the engine uploads the result once.

Legend: L layers, D hidden_size, H heads, N qk_nope_head_dim, U v_head_dim, C kv_lora_rank,
E routed experts, I expert / MLP width.
"""
from __future__ import annotations

import numpy as np

from kdtr_format import open_kdtr
from refmodel.config import ModelConfig
from refmodel.quant import dequantize_model


def read_bundle(f) -> tuple[ModelConfig, dict]:
    """(cfg, float32 dense weights) of an open bundle; INT4 `.qw`/`.sc` dequantized exactly (q * scale has
    at most 12 significant bits, so float32 holds it exactly): the dense path, not a W4A16 kernel."""
    cfg = ModelConfig.from_dict(f.metadata["model_config"])
    W = {}
    for n in f.names:
        if n.startswith(("golden/", "drafter.")):
            continue
        W[n] = np.array(f[n]) if f.info(n).int4_shape is not None else np.array(f.get(n), dtype=np.float64)
    return cfg, {k: v.astype(np.float32) for k, v in dequantize_model(W).items()}


def load_weights(bundle) -> tuple[ModelConfig, dict]:
    if isinstance(bundle, (str, bytes)) or hasattr(bundle, "__fspath__"):
        with open_kdtr(bundle) as f:
            return read_bundle(f)
    return read_bundle(bundle)


def layer_arrays(cfg: ModelConfig, W: dict, l: int) -> dict:
    """Layer l's tensors in the kernels' layouts (contiguous float32)."""
    p = f"model.layers.{l}."
    H, N, U, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w_kvb = W[p + "self_attn.kv_b_proj.weight"].reshape(H, N + U, C)     # [H(N+U), C] -> [H, N+U, C]
    out = {
        "input_ln": W[p + "input_layernorm.weight"],
        "q_a": W[p + "self_attn.q_a_proj.weight"],
        "q_a_ln": W[p + "self_attn.q_a_layernorm.weight"],
        "q_b": W[p + "self_attn.q_b_proj.weight"],
        "kv_a": W[p + "self_attn.kv_a_proj_with_mqa.weight"],
        "kv_a_ln": W[p + "self_attn.kv_a_layernorm.weight"],
        "w_ukT": np.transpose(w_kvb[:, :N], (0, 2, 1)),                  # [H, N, C] -> [H, C, N]
        "w_uv": w_kvb[:, N:],                                            # [H, U, C]
        "o_proj": W[p + "self_attn.o_proj.weight"],
        "post_ln": W[p + "post_attention_layernorm.weight"],
    }
    if l < cfg.first_k_dense_replace:                                    # dense MLP = one slot of expert 0
        names = [p + "mlp."]
    else:
        out["gate"] = W[p + "mlp.gate.weight"]
        out["bias"] = W[p + "mlp.gate.e_score_correction_bias"]
        names = [p + f"mlp.experts.{e}." for e in range(cfg.n_routed_experts)]
        names += [p + "mlp.shared_experts."] * (cfg.n_shared_experts > 0)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        out[proj] = np.stack([W[n + proj + ".weight"] for n in names])  # [E', I, D] / [E', D, I]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}
