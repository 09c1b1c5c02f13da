"""INT4 W4A16 in the reference: quantize a weight dict, dequantize it back exactly, describe the scheme.

The layout and the scale rule live in kdtr_format.int4 (the one INT4 truth); this file only decides WHICH
linears are INT4 and renames them: `<module>.weight` [out, in] becomes `<module>.qw` int32 [out, in/8] and
`<module>.sc` [out, in/group_size] (float32 values exactly representable in bf16, or raw bf16 bits as
uint16 when loaded from a bundle). The forward never sees INT4: dequantize_model turns every pair back into
a dense float64 `<module>.weight` = q * scale, which is exact, so an INT4 bundle's goldens are the exact
output of the quantized model (quantization happens only in these functions; layout and scheme: docs/int4.md).

Scopes:
    experts   routed experts' gate/up/down_proj only: what Kimi K2-Thinking / K2.5 / K2.6 ship (default)
    mlp       routed + shared experts + the dense MLP of layers < first_k_dense_replace
Attention, router (mlp.gate), norms, embeddings and lm_head always stay dense.
"""
from __future__ import annotations

import re

import numpy as np

from kdtr_format.int4 import Int4LayoutError, dequantize_w4a16, quantize_w4a16
from refmodel.config import ModelConfig
from refmodel.weights import expected_shapes

# Module-name patterns (full match, without the ".weight" suffix) per scope.
_ROUTED = r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj"
_SHARED = r"model\.layers\.\d+\.mlp\.shared_experts\.(gate|up|down)_proj"
_DENSE = r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj"
SCOPES = {"experts": (_ROUTED,), "mlp": (_ROUTED, _SHARED, _DENSE)}


def _check_scope(scope: str) -> None:
    if scope not in SCOPES:
        raise ValueError(f"unknown INT4 quantization scope {scope!r}: use one of {', '.join(SCOPES)}")


def is_quantized(module: str, scope: str) -> bool:
    """True if the linear `module` (a name without ".weight") is INT4 under `scope`."""
    _check_scope(scope)
    return any(re.fullmatch(p, module) for p in SCOPES[scope])


def quantize_model(W: dict[str, np.ndarray], cfg: ModelConfig, scope: str = "experts",
                   group_size: int = 32) -> dict[str, np.ndarray]:
    """A new dict: every in-scope `<m>.weight` replaced by `<m>.qw` / `<m>.sc`; all else unchanged (same order)."""
    _check_scope(scope)
    shapes = expected_shapes(cfg)
    out = {}
    for name, w in W.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or not is_quantized(module, scope):
            out[name] = w
            continue
        if name not in shapes or tuple(w.shape) != shapes[name]:
            raise ValueError(f"quantize_model: {name} has shape {tuple(w.shape)}, config expects "
                             f"{shapes.get(name, 'no such tensor')}")
        try:
            out[module + ".qw"], out[module + ".sc"] = quantize_w4a16(w, group_size)
        except Int4LayoutError as e:
            raise Int4LayoutError(f"{name}: {e}") from None
    return out


def dequantize_model(W: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A new dict with every `<m>.qw` / `<m>.sc` pair turned into dense float64 `<m>.weight`; other
    tensors become float64 (no copy if they already are). Order: each weight where its .qw was."""
    out = {}
    for name, value in W.items():
        if name.endswith(".sc"):
            if name[:-3] + ".qw" not in W:
                raise Int4LayoutError(f"dequantize_model: scale tensor {name} has no packed weights "
                                      f"{name[:-3]}.qw")
            continue
        if not name.endswith(".qw"):
            out[name] = np.asarray(value, dtype=np.float64)
            continue
        module = name[:-3]
        if module + ".sc" not in W:
            raise Int4LayoutError(f"dequantize_model: packed weights {name} have no scales {module}.sc")
        shape = (value.shape[0], value.shape[1] * 8)                     # [out, in/8] -> [out, in]
        try:
            out[module + ".weight"] = dequantize_w4a16(value, W[module + ".sc"], shape)
        except Int4LayoutError as e:
            raise Int4LayoutError(f"{module}: {e}") from None
    return out


def quant_config(scope: str = "experts", group_size: int = 32) -> dict:
    """JSON-ready description of the INT4 scheme for bundle metadata ("quantization")."""
    _check_scope(scope)
    return {
        "method": "w4a16",
        "format": "compressed-tensors pack-quantized",
        "bits": 4,
        "group_size": group_size,
        "symmetric": True,
        "strategy": "group",
        "scale_dtype": "bfloat16",
        "scope": scope,
        "modules": list(SCOPES[scope]),
        "tensors": "<module>.qw int32 [out, in/8] (8 nibbles per word along in, lowest nibble first, "
                   "value = nibble - 8); <module>.sc [out, in/group_size]",
        "scale_rule": "bf16_rne(absmax(group) / 7.5), 2**-7 for an all-zero group; "
                      "q = round_half_even(clip(w / scale, -8, 7)) (compressed-tensors minmax)",
        "dequantize": "W = q * scale, exact in float32/float64",
    }
