"""A bundle's weights as the engine's device layout (float32): per-layer tensors, stacked experts,
per-head absorbed-MLA matrices. Host-side only (NumPy); the engine uploads the result once.

Legend: L layers, D hidden_size, H heads, N qk_nope_head_dim, U v_head_dim, C kv_lora_rank,
E routed experts, I expert / MLP width.
"""
from __future__ import annotations

import numpy as np

from kdtr_format import open_kdtr
from refmodel.config import ModelConfig
from kdtr_format.int4 import scale_bits, scales_as_float
from refmodel.quant import dequantize_model


def read_bundle(f, keep_int4: bool) -> tuple[ModelConfig, dict]:
    """(cfg, weights) of an open bundle: dense tensors as float32; INT4 `.qw` (int32) / `.sc` as stored
    (scales as raw bf16 bits, uint16) when keep_int4, else dequantized exactly to float32 `.weight`
    (q * scale has at most 12 significant bits, so float32 holds it exactly)."""
    cfg = ModelConfig.from_dict(f.metadata["model_config"])
    W = {}
    for n in f.names:
        if n.startswith(("golden/", "drafter.")):
            continue
        W[n] = np.array(f[n]) if f.info(n).int4_shape is not None else np.array(f.get(n), dtype=np.float64)
    if not keep_int4:
        return cfg, {k: v.astype(np.float32) for k, v in dequantize_model(W).items()}
    out = {}
    for k, v in W.items():
        if k.endswith(".sc"):                   # raw bf16 bits as stored; float scales must be bf16 values
            sc = np.asarray(f[k])
            out[k] = sc if sc.dtype == np.uint16 else scale_bits(scales_as_float(sc))
        else:
            out[k] = v if k.endswith(".qw") else v.astype(np.float32)
    return cfg, out


def load_weights(bundle, keep_int4: bool = False) -> tuple[ModelConfig, dict]:
    if isinstance(bundle, (str, bytes)) or hasattr(bundle, "__fspath__"):
        with open_kdtr(bundle) as f:
            return read_bundle(f, keep_int4)
    return read_bundle(bundle, keep_int4)


def layer_arrays(cfg: ModelConfig, W: dict, l: int) -> tuple[dict, int]:
    """Layer l's tensors in the kernels' layouts (contiguous float32; INT4 int32 words and bf16 scale bits),
    and how many of its MLP modules (routed experts first, then the shared expert) are INT4."""
    p = f"model.layers.{l}."
    H, N, U, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w_kvb = W[p + "self_attn.kv_b_proj.weight"].reshape(H, N + U, C)     # [H(N+U), C] -> [H, N+U, C]
    out = {
        "input_ln": W[p + "input_layernorm.weight"],
        # q_a and kv_a read the same input: one GEMV for both, [Q + C + R, D]
        "qkv_a": np.concatenate([W[p + "self_attn.q_a_proj.weight"], W[p + "self_attn.kv_a_proj_with_mqa.weight"]]),
        "q_a_ln": W[p + "self_attn.q_a_layernorm.weight"],
        "q_b": W[p + "self_attn.q_b_proj.weight"],
        "kv_a_ln": W[p + "self_attn.kv_a_layernorm.weight"],
        "w_uk": w_kvb[:, :N],                                            # [H, N, C]
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
    n_int4 = sum(n + "gate_proj.qw" in W for n in names)                 # INT4 modules: a prefix of the slots
    if any(n + "gate_proj.qw" in W for n in names[n_int4:]):
        raise ValueError(f"layer {l}: INT4 and dense experts interleave; the engine needs the INT4 ones first")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if n_int4 < len(names):                                          # dense: [E', I, D] / [E', D, I]
            out[proj] = np.stack([W[n + proj + ".weight"] for n in names[n_int4:]]).astype(np.float32)
        if n_int4:                                                       # INT4: [E', out, in/8], [E', out, in/g]
            out[proj + ".qw"] = np.stack([W[n + proj + ".qw"] for n in names[:n_int4]])
            out[proj + ".sc"] = np.stack([W[n + proj + ".sc"] for n in names[:n_int4]])
    arrays = {k: np.ascontiguousarray(v if v.dtype in (np.int32, np.uint16) else v.astype(np.float32))
              for k, v in out.items()}
    return arrays, n_int4
