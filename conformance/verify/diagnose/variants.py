"""Known mistakes of the attention half as variants of the reference's layer (conformance/verify/diagnose/
layer.py): each class overrides the one method where the mistake lives and says what it computes in
`label`. The hypothesis library (library.py) groups them under the mistakes' ids; docs/diagnosis.md
describes each. The feed-forward half, INT4 and numerics are in variants_moe.py.

Legend: T tokens, H heads, R qk_rope_head_dim, C kv_lora_rank, N qk_nope_head_dim, K top-k.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from conformance.verify.diagnose.layer import Layer
from refmodel.config import yarn_get_mscale
from refmodel.model import apply_rope, yarn_inv_freq

F32, F64 = np.float32, np.float64


def _cfg(cfg, **changes):
    return dataclasses.replace(cfg, **changes)


def _bcast(cos, x):
    return cos.reshape((cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],))   # [T, 1.., R/2]


def neox(x, cos, sin):
    """Rotate-half (pairs (i, i + R/2)) on the dims as given: the NeoX rule on the raw interleaved layout."""
    h = x.shape[-1] // 2
    c, s = _bcast(cos, x), _bcast(sin, x)
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


# ---------------------------------------------------------------- RoPE

class RopeNeox(Layer):
    """One tap shows one tensor's rotation, so each variant rotates one of q and k wrongly; an engine
    wrong on both shows it first at q (its first rotated tap)."""
    label, on = "NeoX rotate-half on the raw interleaved rope dims of q", ("q",)

    def rope(self, x, cos, sin, which):
        return neox(x, cos, sin) if which in self.on else super().rope(x, cos, sin, which)


class RopeNeoxK(RopeNeox):
    label, on = "NeoX rotate-half on the raw interleaved rope dims of k", ("k",)


class RopeNeoxBoth(RopeNeox):
    label, on = "NeoX rotate-half on the raw interleaved rope dims of q and k", ("q", "k")


class RopeNeoxConverted(RopeNeox):
    """An engine that keeps HF's de-interleaved layout and converts its reports back (x = y[argsort(P)])
    reports a NeoX-on-raw result permuted too: the same mistake seen through that conversion."""
    label, on = "NeoX rotate-half on q's raw rope dims, seen through the de-interleaved layout's conversion back", ("q",)

    def rope(self, x, cos, sin, which):
        if which not in self.on:
            return Layer.rope(self, x, cos, sin, which)
        R = x.shape[-1]
        return neox(x, cos, sin)[..., np.argsort(np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)]))]


class RopeNeoxKConverted(RopeNeoxConverted):
    label, on = "NeoX rotate-half on k's raw rope dims, seen through the de-interleaved layout's conversion back", ("k",)


class RopeDeinterleaved(Layer):
    label = "rotated right but reported de-interleaved ([evens ; odds], HF's layout)"

    def rope(self, x, cos, sin, which):
        R = x.shape[-1]
        return super().rope(x, cos, sin, which)[..., np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])]


class Theta(Layer):
    theta = 10000.0

    @property
    def label(self):
        return f"rope_theta {self.theta:g} instead of the config's {self.cfg.rope_theta:g}"

    def inv_freq(self):
        return yarn_inv_freq(_cfg(self.cfg, rope_theta=self.theta))


class Theta1e6(Theta):
    theta = 1e6


class F32Angles(Layer):
    label = "angles position x inv_freq formed in float32 (inv_freq cast to float32)"

    def cos_sin(self, positions):
        angle = positions.astype(F32)[:, None] * self.inv_freq().astype(F32)      # [T, R/2] in float32
        a = self.attention_factor()
        return np.cos(angle.astype(F64)) * a, np.sin(angle.astype(F64)) * a


class F32AnglesFitted(Layer):
    """Which float32 angle an engine forms depends on how it computes inv_freq in float32 (HF's float32
    pow differs from a float64 one cast in the last bit), so this variant fits it: per token and pair,
    the float32 value within 2 float32 ULPs of position x inv_freq that best explains the engine's own
    rotated pair. An engine with float64 angles is off by up to half an ULP of the angle from every
    candidate (4e-3 rad at 2^17), so the fit cannot explain it where float32 angles matter."""
    label = "angles rounded to float32 (the float32 angle within 2 ULPs that fits each pair)"

    def cos_sin(self, positions):
        self._angle = np.einsum("t,r->tr", positions.astype(F64), self.inv_freq())   # [T, R/2]
        return super().cos_sin(positions)

    def rope(self, x, cos, sin, which):
        y = self.ctx.engine.get("q" if which == "q" else "k_pe")
        if y is None:
            return super().rope(x, cos, sin, which)
        y = np.asarray(y, F64)[..., -x.shape[-1]:]                       # q: its rope dims
        up = dn = self._angle.astype(F32)
        cands = [up]
        for _ in range(2):
            up, dn = np.nextafter(up, F32(np.inf)), np.nextafter(dn, F32(-np.inf))
            cands += [up, dn]
        a = self.attention_factor()
        outs = [apply_rope(x, np.cos(c.astype(F64)) * a, np.sin(c.astype(F64)) * a) for c in cands]
        err = [((o - y) ** 2) for o in outs]
        err = np.stack([(e[..., 0::2] + e[..., 1::2]).reshape(e.shape[0], -1, e.shape[-1] // 2).sum(1)
                        for e in err])                                    # [cands, T, R/2]
        best = np.take_along_axis(np.stack(cands), err.argmin(0)[None], 0)[0].astype(F64)
        return apply_rope(x, np.cos(best) * a, np.sin(best) * a)


class YarnPlain(Layer):
    label = "plain RoPE frequencies (no YaRN ramp); softmax scale and factor as configured"

    def inv_freq(self):
        return yarn_inv_freq(_cfg(self.cfg, rope_scaling=None))


class YarnIgnored(YarnPlain):
    label = "rope_scaling ignored altogether: plain frequencies and the plain A^-1/2 softmax scale"

    def softmax_scale(self):
        return self.cfg.qk_head_dim ** -0.5

    def attention_factor(self):
        return 1.0


class MscaleNotSquared(Layer):
    label = "softmax scale without YaRN's m(factor, mscale_all_dim)^2 (plain A^-1/2)"

    def softmax_scale(self):
        return self.cfg.qk_head_dim ** -0.5


class MscaleOnCos(Layer):
    label = "cos/sin multiplied by m(factor, mscale) without dividing by m(factor, mscale_all_dim)"

    def attention_factor(self):
        rope = self.cfg.rope_scaling or {}
        return yarn_get_mscale(rope.get("factor", 1.0), rope.get("mscale") or 1.0)


class YarnTruncateFlipped(Layer):
    @property
    def label(self):
        said = (self.cfg.rope_scaling or {}).get("truncate", True)
        return f"YaRN correction range {'not ' if said else ''}rounded to whole dims (truncate {not said})"

    def inv_freq(self):
        rope = dict(self.cfg.rope_scaling or {})
        rope["truncate"] = not rope.get("truncate", True)
        return yarn_inv_freq(_cfg(self.cfg, rope_scaling=rope))


# ---------------------------------------------------------------- positions, masks, scale, norms

class PositionPlus(Layer):
    delta, label = 1, "positions one too high"

    def positions(self, positions):
        return positions + self.delta


class PositionMinus(PositionPlus):
    delta, label = -1, "positions one too low"


class PositionFromCache(Layer):
    label = "positions taken from the cache row, not the given positions (the offset dropped)"

    def positions(self, positions):
        return positions - self.ctx.pos0


class MaskNone(Layer):
    label = "no causal mask in the prefill (every token sees every token)"

    def mask(self, T, S0):
        return np.zeros((T, S0 + T))


class MaskOneAhead(Layer):
    label = "causal mask off by one (each token also sees the next)"

    def mask(self, T, S0):
        j, i = np.arange(S0 + T)[None, :], np.arange(T)[:, None] + S0
        return np.where(j <= i + 1, 0.0, -np.inf)


class ScaleNope(Layer):
    label = "softmax scale from qk_nope_head_dim instead of qk_head_dim"

    def softmax_scale(self):
        return self.cfg.softmax_scale * (self.cfg.qk_head_dim / self.cfg.qk_nope_head_dim) ** 0.5


class ScaleLatent(Layer):
    label = "softmax scale from the absorbed key width kv_lora_rank + qk_rope_head_dim"

    def softmax_scale(self):
        cfg = self.cfg
        return cfg.softmax_scale * (cfg.qk_head_dim / (cfg.kv_lora_rank + cfg.qk_rope_head_dim)) ** 0.5


class ScaleNone(Layer):
    label = "no softmax scale"

    def softmax_scale(self):
        return 1.0


class LatentEpsRms(Layer):
    @property
    def label(self):
        return f"latent norms with rms_norm_eps {self.cfg.rms_norm_eps:g} instead of {self.cfg.latent_norm_eps:g}"

    def latent_eps(self):
        return self.cfg.rms_norm_eps


class RmsEpsLatent(Layer):
    @property
    def label(self):
        return f"input/post norms with {self.cfg.latent_norm_eps:g} instead of rms_norm_eps {self.cfg.rms_norm_eps:g}"

    def norm(self, x, w, eps, which):
        return super().norm(x, w, self.cfg.latent_norm_eps if which in ("input", "post") else eps, which)


def _norm_skipped(which: str):
    class NormSkipped(Layer):
        label = f"the {which} norm skipped (no normalisation, no weight)"

        def norm(self, x, w, eps, w_which):
            return x if w_which == which else super().norm(x, w, eps, w_which)
    NormSkipped.__name__ = f"NormSkipped_{which}"
    return NormSkipped


NORMS_SKIPPED = tuple(_norm_skipped(w) for w in ("kv_a", "q_a", "input", "post"))


class NormNoWeight(Layer):
    label = "kv_a_layernorm normalises but its weight is not applied"

    def norm(self, x, w, eps, which):
        return super().norm(x, np.ones_like(w) if which == "kv_a" else w, eps, which)


class KvEarly(Layer):
    label = "decode rows written one slot early (over the last prompt row; an empty slot read at the end)"

    def cache(self, c_old, k_old, c_new, k_new):
        P = self.ctx.prompt_len
        if self.ctx.phase != "ar" or not 0 < P <= len(c_old):
            return super().cache(c_old, k_old, c_new, k_new)
        z = lambda a: np.zeros((1, a.shape[1]))                         # noqa: E731
        return (np.concatenate([c_old[:P - 1], c_old[P:], c_new, z(c_new)]),
                np.concatenate([k_old[:P - 1], k_old[P:], k_new, z(k_new)]))


class KvLate(Layer):
    label = "decode rows written one slot late (the new row unread; an empty slot after the prompt)"

    def cache(self, c_old, k_old, c_new, k_new):
        P = self.ctx.prompt_len
        if self.ctx.phase != "ar" or not 0 < P <= len(c_old):
            return super().cache(c_old, k_old, c_new, k_new)
        z = lambda a: np.zeros((1, a.shape[1]))                         # noqa: E731
        return (np.concatenate([c_old[:P], z(c_new), c_old[P:]]), np.concatenate([k_old[:P], z(k_new), k_old[P:]]))
