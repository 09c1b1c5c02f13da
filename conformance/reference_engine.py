"""The `reference` engine: refmodel run in float32 on a bundle's own weights.

It is the CI-side proof that a correct fp32 engine passes the bundle's tolerances, and the engine that
fault injection (conformance/faults.py) wraps. Implements conformance.protocol.Engine, teacher forcing
included (run_layer feeds a layer its golden input and golden cache rows).
"""
from __future__ import annotations

import os

import numpy as np

from kdtr_format import open_kdtr
from refmodel.config import ModelConfig
from refmodel.model import KVCache, block, causal_mask, forward, rope_cos_sin
from refmodel.quant import dequantize_model


def bundle_weights(f) -> tuple[ModelConfig, dict]:
    """(cfg, float64 dense weights) of an open bundle: INT4 `.qw`/`.sc` dequantized exactly."""
    cfg = ModelConfig.from_dict(f.metadata["model_config"])
    W = {}
    for n in f.names:
        if n.startswith(("golden/", "drafter.")):
            continue
        W[n] = np.array(f[n]) if f.info(n).int4_shape is not None else np.array(f.get(n), dtype=np.float64)
    return cfg, dequantize_model(W)


class ReferenceEngine:
    name = "reference"
    dtype = "float32"
    supports_teacher_forcing = True

    def __init__(self, dtype=np.float32):
        self.np_dtype = dtype
        self.cfg: ModelConfig | None = None
        self.W: dict = {}
        self.cache: KVCache | None = None

    def load(self, bundle) -> None:
        if isinstance(bundle, (str, os.PathLike)):
            with open_kdtr(bundle) as f:
                self.cfg, W = bundle_weights(f)
        else:
            self.cfg, W = bundle_weights(bundle)
        self.W = {k: v.astype(self.np_dtype) for k, v in W.items()}
        self.reset()

    def reset(self) -> None:
        self.cache = KVCache(self.cfg, self.np_dtype)

    def _cos_sin(self, positions):
        """RoPE tables for `positions`: angles in float64, then cast (float32 angles are a fault at
        long positions: docs/golden-bundles.md, the long-position prompt)."""
        return rope_cos_sin(self.cfg, np.asarray(positions, np.int64), self.np_dtype)

    def _forward(self, ids, positions, mask=None):
        taps = {}
        logits, _ = forward(self.cfg, self.W, ids, positions, self.cache, mask, taps=taps,
                            cos_sin=self._cos_sin(positions))
        return logits, taps

    def prefill(self, ids, positions):
        return self._forward(ids, positions)

    def decode(self, token, position):
        return self._forward([token], [position])

    def verify_tree(self, ids, positions, mask):
        return self._forward(ids, positions, mask)

    def compact(self, start, keep) -> None:
        self.cache.compact(start, keep)

    def run_layer(self, layer: int, inputs: dict) -> dict:
        """Layer `layer` alone on golden inputs (hidden [T, D], positions [T], cache rows c_kv/k_pe [S, .])."""
        cfg, dt = self.cfg, self.np_dtype
        cache = KVCache(cfg, dt)
        cache.c_kv[layer] = np.asarray(inputs["c_kv"], dt)
        cache.k_pe[layer] = np.asarray(inputs["k_pe"], dt)
        h = np.asarray(inputs["hidden"], dt)
        positions = np.asarray(inputs["positions"], np.int64)
        mask = causal_mask(h.shape[0], cache.c_kv[layer].shape[0]).astype(dt)   # [T, S + T]
        cos, sin = self._cos_sin(positions)
        taps = {}
        block(cfg, self.W, layer, h, cos, sin, cache, mask, False, taps)
        return taps
