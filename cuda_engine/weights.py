"""A bundle's weights as the engine's device layout: per-layer tensors, stacked experts, per-head absorbed-MLA
matrices. Host-side only (NumPy); the engine uploads the result once.

Dense weights are float32, except that a matmul weight the bundle stores as bfloat16 (a real checkpoint's
attention projections, router, shared expert, dense MLP, embedding and lm_head; BF16_WEIGHTS) stays bfloat16,
as raw bits (uint16), when asked (the engine's default, `dense="stored"`): the kernels widen it exactly as they
read it (kernels/common.cuh, wval), so the results are the bits of the float32 path at half the bytes, except a
linear of 2 or more rows, which multiplies bf16 weights on the tensor cores (kernels/linear.cu,
linear_mma_bf16_kernel: FP32-faithful, other bits). Norm weights and the router's bias are always float32.

Legend: L layers, D hidden_size, H heads, N qk_nope_head_dim, U v_head_dim, C kv_lora_rank,
E routed experts, I expert / MLP width.
"""
from __future__ import annotations

import numpy as np

from kdtr_format import open_kdtr
from refmodel.config import ModelConfig
from kdtr_format.bf16 import bf16_to_float32
from kdtr_format.int4 import scale_bits, scales_as_float
from refmodel.quant import dequantize_model

# the matmul weights (name suffixes) that a kernel reads through wval, so may stay bfloat16 on the device
BF16_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight", "self_attn.q_a_proj.weight",
                "self_attn.kv_a_proj_with_mqa.weight", "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")
DENSE_MODES = ("stored", "float32")     # bf16-stored matmul weights kept bf16, or every dense weight float32


def read_bundle(f, keep_int4: bool, keep_bf16: bool = False) -> tuple[ModelConfig, dict]:
    """(cfg, weights) of an open bundle: dense tensors as float32, or, when keep_bf16, the BF16_WEIGHTS the
    bundle stores as bfloat16 as their raw bits (uint16); INT4 `.qw` (int32) / `.sc` as stored (scales as raw
    bf16 bits, uint16) when keep_int4, else dequantized exactly to float32 `.weight` (q * scale has at most 12
    significant bits, so float32 holds it exactly)."""
    cfg = ModelConfig.from_dict(f.metadata["model_config"])
    W, bf16 = {}, {}
    for n in f.names:
        if n.startswith(("golden/", "drafter.")):
            continue
        if keep_bf16 and f.info(n).dtype == "bfloat16" and n.endswith(BF16_WEIGHTS):
            bf16[n] = np.array(f[n])                                     # raw bits, uint16
            continue
        W[n] = np.array(f[n]) if f.info(n).int4_shape is not None else np.array(f.get(n), dtype=np.float64)
    if not keep_int4:
        return cfg, {**{k: v.astype(np.float32) for k, v in dequantize_model(W).items()}, **bf16}
    out = dict(bf16)
    for k, v in W.items():
        if k.endswith(".sc"):                   # raw bf16 bits as stored; float scales must be bf16 values
            sc = np.asarray(f[k])
            out[k] = sc if sc.dtype == np.uint16 else scale_bits(scales_as_float(sc))
        else:
            out[k] = v if k.endswith(".qw") else v.astype(np.float32)
    return cfg, out


def load_weights(bundle, keep_int4: bool = False, keep_bf16: bool = False) -> tuple[ModelConfig, dict]:
    if isinstance(bundle, (str, bytes)) or hasattr(bundle, "__fspath__"):
        with open_kdtr(bundle) as f:
            return read_bundle(f, keep_int4, keep_bf16)
    return read_bundle(bundle, keep_int4, keep_bf16)


def _f32(a: np.ndarray) -> np.ndarray:
    """float32 values of a weight: bf16 bits (uint16) widened exactly, anything else converted."""
    return bf16_to_float32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def _join(parts: list[np.ndarray], axis_op=np.concatenate) -> np.ndarray:
    """parts joined (concatenated or stacked): bf16 bits when all are, else float32."""
    if all(p.dtype == np.uint16 for p in parts):
        return axis_op(parts)
    return axis_op([_f32(p) for p in parts])


def layer_arrays(cfg: ModelConfig, W: dict, l: int) -> tuple[dict, int]:
    """Layer l's tensors in the kernels' layouts (contiguous float32; INT4 int32 words and bf16 scale bits),
    and how many of its MLP modules (routed experts first, then the shared expert) are INT4."""
    p = f"model.layers.{l}."
    H, N, U, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w_kvb = W[p + "self_attn.kv_b_proj.weight"].reshape(H, N + U, C)     # [H(N+U), C] -> [H, N+U, C]
    out = {
        "input_ln": W[p + "input_layernorm.weight"],
        # q_a and kv_a read the same input: one GEMV for both, [Q + C + R, D]
        "qkv_a": _join([W[p + "self_attn.q_a_proj.weight"], W[p + "self_attn.kv_a_proj_with_mqa.weight"]]),
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
            out[proj] = _join([W[n + proj + ".weight"] for n in names[n_int4:]], np.stack)
        if n_int4:                                                       # INT4: [E', out, in/8], [E', out, in/g]
            out[proj + ".qw"] = np.stack([W[n + proj + ".qw"] for n in names[:n_int4]])
            out[proj + ".sc"] = np.stack([W[n + proj + ".sc"] for n in names[:n_int4]])
    if n_int4 < len(names) and out["gate_proj"].dtype != out["up_proj"].dtype:   # one launch reads both: one type
        out["gate_proj"], out["up_proj"] = _f32(out["gate_proj"]), _f32(out["up_proj"])
    for k in ("input_ln", "q_a_ln", "kv_a_ln", "post_ln", "bias"):        # read as float32 by their kernels
        if k in out:
            out[k] = _f32(out[k])
    arrays = {k: np.ascontiguousarray(v if v.dtype in (np.int32, np.uint16) else v.astype(np.float32))
              for k, v in out.items()}
    return arrays, n_int4
