"""Honest variants: the reference engine computing the same model another correct way (other summation
orders: pairwise, reversed, split-K; float64 intermediates; fused or reassociated operations), the
controls of the diagnosis (docs/diagnosis.md): none of them may be diagnosed with a "matched" mistake,
and no known mistake may sit closer to one of them than the correct reference does.

Each variant swaps refmodel functions for the length of one engine call, as conformance/engines/
mistakes.py does for its mistakes; every result is still float32 (float64 where the variant says so,
cast back to float32 at the taps).

Legend: T tokens, I in, O out, H heads, S keys, R rope dims.
"""
from __future__ import annotations


import numpy as np

import refmodel.model as rm
from conformance.engines.reference_engine import ReferenceEngine, refmodel_swapped

F32 = np.float32


def _pairwise(x, w):
    return (x[:, None, :] * w[None, :, :]).sum(-1)                      # [T, O, I] -> [T, O]: pairwise sums


def _reversed(x, w):
    return np.einsum("ti,oi->to", x[:, ::-1], w[:, ::-1]).astype(x.dtype)   # K summed from the end


def _split_k(parts: int):
    def linear(x, w):
        cuts = np.array_split(np.arange(x.shape[1]), min(parts, x.shape[1]))
        y = np.zeros((x.shape[0], w.shape[0]), x.dtype)
        for c in cuts:                                                   # partial sums, then added
            y = y + np.einsum("ti,oi->to", x[:, c], w[:, c])
        return y.astype(x.dtype)
    return linear


def _wide(x, w):
    return np.einsum("ti,oi->to", x.astype(np.float64), w.astype(np.float64)).astype(x.dtype)


def _rms_rsqrt(x, w, eps):
    inv = (1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + x.dtype.type(eps))).astype(x.dtype)
    return (x * inv) * w                                                # scale first, then the weight


def _rms_wide(x, w, eps):
    x64 = x.astype(np.float64)
    return (w * (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps))).astype(x.dtype)


def _softmax_lse(x):
    m = np.max(x, axis=-1, keepdims=True)
    lse = m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))
    return np.exp(x - lse)                                               # fused log-sum-exp form


def _silu_tanh(x):
    return x * (x.dtype.type(0.5) * (1 + np.tanh(x * x.dtype.type(0.5))))


def _sigmoid_tanh(x):
    return x.dtype.type(0.5) * (1 + np.tanh(x * x.dtype.type(0.5)))


def _rope_complex(x, cos, sin):
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * (cos + 1j * sin).reshape(shape)   # pairs as complex numbers
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


SWAPS = {
    "pairwise-sum": {"linear": _pairwise},
    "reversed-k": {"linear": _reversed},
    "split-k-2": {"linear": _split_k(2)},
    "split-k-7": {"linear": _split_k(7)},
    "float64-projections": {"linear": _wide},
    "rmsnorm-rsqrt": {"rms_norm": _rms_rsqrt},
    "rmsnorm-float64": {"rms_norm": _rms_wide},
    "softmax-logsumexp": {"softmax": _softmax_lse},
    "silu-sigmoid-tanh": {"silu": _silu_tanh, "sigmoid": _sigmoid_tanh},
    "rope-complex": {"apply_rope": _rope_complex},
    "fused-split-k-rsqrt": {"linear": _split_k(3), "rms_norm": _rms_rsqrt, "softmax": _softmax_lse},
}
VARIANTS = tuple(SWAPS) + ("absorbed-mla", "float64-everything")


class HonestEngine(ReferenceEngine):
    """The reference computed the `variant` way (VARIANTS; module docstring)."""

    def __init__(self, variant: str):
        if variant not in VARIANTS:
            raise ValueError(f"unknown honest variant {variant!r}; choose one of {', '.join(VARIANTS)}")
        super().__init__(np.float64 if variant == "float64-everything" else F32)
        self.variant, self.name = variant, f"reference~{variant}"

    def _swapped(self):
        return refmodel_swapped(SWAPS.get(self.variant, {}))

    def _forward(self, ids, positions, mask=None):
        with self._swapped():
            if self.variant == "absorbed-mla":
                return self._absorbed(ids, positions, mask)
            logits, taps = super()._forward(ids, positions, mask)
        return self._narrow(logits), {k: self._narrow(v) for k, v in taps.items()}

    def _absorbed(self, ids, positions, mask):
        taps = {}
        logits, _ = rm.forward(self.cfg, self.W, ids, positions, self.cache, mask, absorbed=True, taps=taps,
                               cos_sin=self._cos_sin(positions), forced_ids=self._take_held())
        return logits, taps

    def _take_held(self):
        held, self._held_ids = self._held_ids, {}
        return held or None

    def run_layer(self, layer, inputs):
        with self._swapped():
            return {k: self._narrow(v) for k, v in super().run_layer(layer, inputs).items()}

    @staticmethod
    def _narrow(a):
        a = np.asarray(a)
        return a.astype(F32) if a.dtype == np.float64 else a

    def ddtree_generate(self, prompt_ids, pos0, n_tokens):
        with self._swapped():
            out = super().ddtree_generate(prompt_ids, pos0, n_tokens)
        return {k: self._narrow(v) for k, v in out.items()}
