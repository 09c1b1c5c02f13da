"""Known mistakes of the feed-forward half and of the arithmetic as variants of the reference's layer
(conformance/verify/diagnose/layer.py): the router, the combine, the shared expert, INT4 dequantization, and
reduced-precision projections. The attention half is in variants.py.

Legend: T tokens, E experts, K top-k, N out, K_in in (INT4: [N, K_in/8] words, [N, K_in/32] scales).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from conformance.verify.diagnose.layer import Layer
from kdtr_format.int4 import bf16_round, bf16_to_float32
from refmodel.model import expert_weights, select_experts, softmax

F32, F64 = np.float32, np.float64


def _cfg(cfg, **changes):
    return dataclasses.replace(cfg, **changes)


def tf32_round(x):
    """Round to TF32 (10 explicit mantissa bits), to nearest even, via float32 bits."""
    b = np.asarray(x, F32).view(np.uint32).astype(np.uint64)
    b = (b + 0xFFF + ((b >> 13) & 1)) & ~np.uint64(0x1FFF)
    return (b & 0xFFFFFFFF).astype(np.uint32).view(F32).astype(F64)


# ---------------------------------------------------------------- router and combine

class RouterSoftmax(Layer):
    label = "softmax router scores instead of sigmoid"

    def router_scores(self, logits):
        return softmax(logits)


class BiasInWeights(Layer):
    label = "expert weights from the biased scores (the correction bias weighs, not only chooses)"

    def expert_weights(self, scores, ids, bias):
        return expert_weights(self.cfg, scores + bias, ids)


class NoRenorm(Layer):
    label = "the chosen experts' weights not renormalised (norm_topk_prob ignored)"

    def expert_weights(self, scores, ids, bias):
        return expert_weights(_cfg(self.cfg, norm_topk_prob=False), scores, ids)


class NoScaling(Layer):
    label = "routed_scaling_factor not applied to the expert weights"

    def expert_weights(self, scores, ids, bias):
        return expert_weights(_cfg(self.cfg, routed_scaling_factor=1.0), scores, ids)


class GroupsHfDefault(Layer):
    label = "group-limited routing with transformers' defaults n_group 8, topk_group 4"

    def select(self, choice):
        cfg = self.cfg
        if cfg.n_routed_experts % 8 or cfg.n_routed_experts // 8 < 2 or cfg.num_experts_per_tok > 4 * (
                cfg.n_routed_experts // 8):
            return super().select(choice)
        return select_experts(_cfg(cfg, n_group=8, topk_group=4), choice)


class GroupsIgnored(Layer):
    label = "group limit ignored (n_group treated as 1)"

    def select(self, choice):
        return select_experts(_cfg(self.cfg, n_group=1, topk_group=1), choice)


class LastSlotDropped(Layer):
    label = "the combine runs K-1 experts (the last chosen slot dropped)"
    renorm = False

    def combine(self, p, x, ids, weights):
        w = np.array(weights)
        w[:, -1] = 0.0
        if self.renorm:
            w = w / w.sum(-1, keepdims=True) * weights.sum(-1, keepdims=True)
        return super().combine(p, x, ids, w)


class LastSlotDroppedRenorm(LastSlotDropped):
    label, renorm = "the combine runs K-1 experts, their weights renormalised over K-1", True


class SharedDropped(Layer):
    label = "shared expert not added"

    def shared(self, p, x):
        return np.zeros_like(x)


class SharedScaled(Layer):
    label = "shared expert multiplied by routed_scaling_factor"

    def shared(self, p, x):
        return super().shared(p, x) * self.cfg.routed_scaling_factor


# ---------------------------------------------------------------- INT4 dequantization and numerics

class Int4(Layer):
    """A weight stored INT4 in the bundle decoded another way; dense weights as usual."""

    def weight(self, name):
        f, m = self.ctx.f, name[:-len(".weight")]
        if f is None or not name.endswith(".weight") or m + ".qw" not in f:
            return super().weight(name)
        shape = tuple(f.info(m + ".qw").int4_shape)
        words = np.asarray(f[m + ".qw"]).view(np.uint32)[:, :, None]      # [N, K/8, 1]
        sc = np.asarray(f[m + ".sc"])
        sc = bf16_to_float32(sc).astype(F64) if sc.dtype == np.uint16 else sc.astype(F64)   # [N, K/g]
        return self.decode(words, sc, shape, f[m + ".sc"])

    def codes(self, words, order):
        u = (words >> (np.asarray(order, np.uint32) * 4)) & np.uint32(0xF)    # [N, K/8, 8]
        return u.reshape(words.shape[0], -1).astype(F64)                   # [N, K] nibbles 0..15

    def decode(self, words, sc, shape, raw_sc):
        q = self.codes(words, range(8)) - 8
        return q * np.repeat(sc, shape[1] // sc.shape[1], axis=1)


class NibblesMsbFirst(Int4):
    label = "nibbles read most significant first (column 8j from bits 28..31)"

    def decode(self, words, sc, shape, raw_sc):
        return (self.codes(words, range(7, -1, -1)) - 8) * np.repeat(sc, shape[1] // sc.shape[1], axis=1)


class NoZeroOffset(Int4):
    label = "nibbles taken as unsigned codes (the -8 offset of uint4b8 not subtracted)"

    def decode(self, words, sc, shape, raw_sc):
        return self.codes(words, range(8)) * np.repeat(sc, shape[1] // sc.shape[1], axis=1)


class GroupSize(Int4):
    size = 128

    @property
    def label(self):
        return f"group index k // {self.size} (scales read as for group size {self.size}, not 32)"

    def decode(self, words, sc, shape, raw_sc):
        g = np.minimum(np.arange(shape[1]) // self.size, sc.shape[1] - 1)   # [K]
        return (self.codes(words, range(8)) - 8) * sc[:, g]


class Group64(GroupSize):
    size = 64


class ScalesTransposed(Int4):
    label = "scales read as a [in/32, out] array (column-major), not [out, in/32]"

    def decode(self, words, sc, shape, raw_sc):
        t = sc.reshape(-1).reshape(sc.shape[1], sc.shape[0]).T              # [N, K/g] from the flat buffer
        return (self.codes(words, range(8)) - 8) * np.repeat(t, shape[1] // sc.shape[1], axis=1)


class ScaleProductBf16(Int4):
    label = "dequantized weight rounded to bfloat16 (q x scale multiplied in bf16)"

    def decode(self, words, sc, shape, raw_sc):
        return bf16_round(super().decode(words, sc, shape, raw_sc))


class ScaleAsFloat16(Int4):
    label = "bfloat16 scale bits read as float16"

    def decode(self, words, sc, shape, raw_sc):
        raw = np.asarray(raw_sc)
        if raw.dtype != np.uint16:
            return super().decode(words, sc, shape, raw_sc)
        return super().decode(words, raw.view(np.float16).astype(F64), shape, raw_sc)


class Bf16Operands(Layer):
    label = "every projection's operands rounded to bfloat16 (float32 accumulation)"

    def linear(self, x, w):
        return super().linear(bf16_round(x), bf16_round(w))


class Bf16OperandsAndResult(Layer):
    label = "every projection's operands and result rounded to bfloat16"

    def linear(self, x, w):
        return bf16_round(super().linear(bf16_round(x), bf16_round(w)))


class Tf32Operands(Layer):
    label = "every projection's operands rounded to TF32 (10-bit mantissa; float32 accumulation)"

    def linear(self, x, w):
        return super().linear(tf32_round(x), tf32_round(w))
