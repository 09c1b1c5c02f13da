"""Fault injection: the reference engine with one known bug planted, so tests prove `kdtr verify` catches
each kind of bug and points at the right layer and tap.

Every fault is a real computational fault (wrong weights, a wrong reader, a wrong mask), never an edit
of a reported value: it propagates through the residual stream, the KV cache and the logits exactly as
the same bug in a real engine would, and `run_layer` (teacher forcing) carries it too, so the runner's
local-vs-inherited test sees it. The diagnosis's other known mistakes (docs/diagnosis.md) are planted by
conformance/engines/mistakes.py, whose PLANTED maps every id to its engine.

    scale_tap             o_proj of layer L scaled by (1 + eps)      -> first divergence L{L}/attn_out
                          (eps 1e-4: ~10x the fp32 atol there, yet too small to flip a token or a
                          DDTree verify row; 1e-3 at L1 of the test bundle flips an off-path tree row)
    swap_expert           two routed experts of layer L trade weights -> L{L}/mlp_out (routing unchanged)
    rope_pairs            NeoX rotate-half on the raw interleaved rope dims, every layer -> L0/q or L0/k_pe
    tree_mask_off_by_one  in verify_tree each node also sees the next node -> DDTree checks only
    nibble_order          INT4 words read MSB-first (INT4 bundles)    -> L{first_k_dense_replace}/mlp_out
    rope_f32_angles       RoPE angles position * inv_freq formed in float32 (as many engines do), cos/sin
                          of them                                     -> the long-position prompt's L0/q
                          (angle error ~3e-6 rad at position 82, at most 0.21x the k_pe tolerance, so the
                          ordinary prompts pass; ~4e-3 rad at 196608: up to 650x)
    decode_attn_scale     layer L's attention output scaled by (1 + eps) in decode steps only (a decode-only
                          kernel bug, e.g. a split-KV merge normalising by a wrong sum; o_proj is linear, so
                          scaling it during decode is the same) -> L{L}/attn_out of the first decode step
    position_off_by_one   decode step `step` (default 2) runs at position + 1: RoPE of that token and
                          its cache row rotate by the wrong angle      -> L0/k_pe at that step, cause
                          "input" (every layer is right on the inputs its taps show)
    draft_row_shift       the live DDTree's tree builder reads the drafter's output one row late from
                          round `round` (default 0) on: depth d gets the depth-(d+1) logits, the last
                          depth repeats      -> the live `trees` check at that round only (the stream
                          stays exact: verification still decides every token)

Legend: H heads, N qk_nope_head_dim, R qk_rope_head_dim, C kv_lora_rank, A = N + R, T tokens, S cache.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np

from conformance.engines.reference_engine import ReferenceEngine
from conformance.records import prompts_of
from kdtr_format import open_kdtr
from refmodel.model import yarn_inv_freq

FAULTS = ("scale_tap", "swap_expert", "rope_pairs", "tree_mask_off_by_one", "nibble_order",
          "position_off_by_one", "rope_f32_angles", "decode_attn_scale", "draft_row_shift")
_NEEDS_LAYER = ("scale_tap", "swap_expert", "decode_attn_scale")
_EXPERT_MATS = ("gate_proj", "up_proj", "down_proj")


def neox_perms(R: int) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q): P = [0, 2, .., R-2, 1, 3, .., R-1] (docs/model.md §3) and its inverse Q. For any x [.., R],
    neox(x) = interleaved(x[Q])[P]: interleaved RoPE on rows permuted by Q is NeoX on the raw rows,
    with its output in the Q layout (x[Q] has pairs (2i, 2i+1) = (x[i], x[i + R/2]), NeoX's pairs)."""
    P = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])
    return P, np.argsort(P)


def msb_first(qw: np.ndarray) -> np.ndarray:
    """Packed int32 words with their 8 nibbles reversed: the standard LSB-first decoder then reads the
    original words MSB-first (column 8j = the top nibble), the bug this fault plants."""
    w = np.asarray(qw).view(np.uint32)
    out = np.zeros_like(w)
    for i in range(8):                                                   # nibble i -> nibble 7 - i
        out |= ((w >> np.uint32(4 * i)) & np.uint32(0xF)) << np.uint32(4 * (7 - i))
    return out.view(np.int32)


class _MsbFirstReader:
    """An open bundle whose INT4 tensors read MSB-first; everything else passes through."""

    def __init__(self, f):
        self._f = f

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __getitem__(self, name):
        v = self._f[name]
        return msb_first(v) if self._f.info(name).int4_shape is not None else v


class FaultyEngine(ReferenceEngine):
    """ReferenceEngine with `fault` (one of FAULTS) planted; `layer` for scale_tap and swap_expert.
    params: eps (scale_tap, default 1e-4), experts=(a, b) (swap_expert; default: picked from the
    bundle's golden routing so the swap really changes what the golden prompts compute), step
    (position_off_by_one, default 2: the decode step, counted from the last reset, that is off), round
    (draft_row_shift, default 0: the first live round whose tree is built from shifted rows)."""

    supports_teacher_forcing = True

    def __init__(self, fault: str, layer: int | None = None, **params):
        super().__init__()
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
        if fault in _NEEDS_LAYER and layer is None:
            raise ValueError(f"fault {fault!r} needs a layer")
        self.fault, self.layer, self.params = fault, layer, params
        self.name = f"reference+{fault}" + ("" if layer is None else f"@L{layer}")
        self.experts: tuple[int, int] | None = None

    # ------------------------------------------------------------ planting (at load)

    def load(self, bundle) -> None:
        if isinstance(bundle, (str, os.PathLike)):
            with open_kdtr(bundle) as f:
                return self.load(f)
        if self.fault == "nibble_order":
            if not any(bundle.info(n).int4_shape for n in bundle.names):
                raise ValueError("fault 'nibble_order' needs an INT4 bundle (kdtr gen --quant int4)")
            bundle = _MsbFirstReader(bundle)
        super().load(bundle)
        cfg, W, l = self.cfg, self.W, self.layer
        if self.fault == "scale_tap":
            W[f"model.layers.{l}.self_attn.o_proj.weight"] *= np.float32(1 + self.params.get("eps", 1e-4))
        elif self.fault == "swap_expert":
            if not cfg.first_k_dense_replace <= l < cfg.num_hidden_layers:
                raise ValueError(f"swap_expert: layer {l} has no routed experts (MoE layers are "
                                 f"{cfg.first_k_dense_replace}..{cfg.num_hidden_layers - 1})")
            a, b = self.experts = tuple(self.params.get("experts") or routed_pair(bundle, l))
            for m in _EXPERT_MATS:
                pa, pb = (f"model.layers.{l}.mlp.experts.{e}.{m}.weight" for e in (a, b))
                W[pa], W[pb] = W[pb], W[pa]
        elif self.fault == "rope_pairs":
            H, N, R, C, A = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                             cfg.kv_lora_rank, cfg.qk_head_dim)
            _, Q = neox_perms(R)
            for l in range(cfg.num_hidden_layers):
                p = f"model.layers.{l}.self_attn."
                qb = W[p + "q_b_proj.weight"].reshape(H, A, -1).copy()        # [HA, Q] -> [H, A, Q]
                qb[:, N:] = qb[:, N:][:, Q]                                   # rope rows of every head
                W[p + "q_b_proj.weight"] = qb.reshape(H * A, -1)              # [H, A, Q] -> [HA, Q]
                kva = W[p + "kv_a_proj_with_mqa.weight"].copy()               # [C + R, D]
                kva[C:] = kva[C:][Q]
                W[p + "kv_a_proj_with_mqa.weight"] = kva

    # ------------------------------------------------------------ running

    def _cos_sin(self, positions):
        if self.fault != "rope_f32_angles":
            return super()._cos_sin(positions)
        inv_freq = yarn_inv_freq(self.cfg).astype(np.float32)                 # [R/2]
        angle = np.asarray(positions, np.float32)[:, None] * inv_freq          # [T, R/2], rounded to float32
        a = np.float32(self.cfg.rope_attention_factor)
        return np.cos(angle) * a, np.sin(angle) * a

    def reset(self) -> None:
        super().reset()
        self.decode_steps = 0

    def decode(self, token, position):
        if self.fault == "position_off_by_one" and self.decode_steps == self.params.get("step", 2):
            position += 1
        self.decode_steps += 1
        with self._decode_path():
            return super().decode(token, position)

    def _forward(self, ids, positions, mask=None):
        logits, taps = super()._forward(ids, positions, mask)
        return logits, self._raw_layout(taps)

    def ddtree_generate(self, prompt_ids, pos0, n_tokens):
        self.rounds_built = 0
        return super().ddtree_generate(prompt_ids, pos0, n_tokens)

    def build_tree(self, draft_logits, budget, topk):
        if self.fault == "draft_row_shift" and self.rounds_built >= self.params.get("round", 0):
            draft_logits = np.concatenate([draft_logits[1:], draft_logits[-1:]])   # [L, V], rows one late
        self.rounds_built += 1
        return super().build_tree(draft_logits, budget, topk)

    @contextlib.contextmanager
    def _decode_path(self):
        """decode_attn_scale: layer L's o_proj scaled while a decode step runs, restored after."""
        if self.fault != "decode_attn_scale":
            yield
            return
        key = f"model.layers.{self.layer}.self_attn.o_proj.weight"
        saved = self.W[key]
        self.W[key] = saved * np.float32(1 + self.params.get("eps", 1e-4))
        try:
            yield
        finally:
            self.W[key] = saved

    def verify_tree(self, ids, positions, mask):
        if self.fault == "tree_mask_off_by_one":
            mask = np.array(mask, copy=True)                                  # [T, S + T]
            T = mask.shape[0]
            S = mask.shape[1] - T
            i = np.arange(T - 1)
            mask[i, S + i + 1] = 0.0                                          # node i also sees node i + 1
        return self._forward(ids, positions, mask)

    def run_layer(self, layer: int, inputs: dict) -> dict:
        if self.fault == "rope_pairs":                                        # golden k_pe rows -> our layout
            _, Q = neox_perms(self.cfg.qk_rope_head_dim)
            inputs = {**inputs, "k_pe": np.asarray(inputs["k_pe"])[:, Q]}
        if len(inputs["hidden"]) == 1 and len(inputs["c_kv"]):               # a decode step: one token, a cache
            with self._decode_path():
                return self._raw_layout(super().run_layer(layer, inputs))
        return self._raw_layout(super().run_layer(layer, inputs))

    def _raw_layout(self, taps: dict) -> dict:
        """rope_pairs keeps q_pe / k_pe in the Q layout inside (cache included); report them in the
        raw layout, as the engine with the bug (NeoX on the raw dims) would: x[Q][P] = x."""
        if self.fault != "rope_pairs":
            return taps
        N, (P, _) = self.cfg.qk_nope_head_dim, neox_perms(self.cfg.qk_rope_head_dim)
        for k, v in taps.items():
            if k.endswith("/q"):
                v[..., N:] = v[..., N:][..., P]                               # [T, H, A]
            elif k.endswith("/k_pe"):
                taps[k] = v[..., P]                                           # [T, R]
        return taps


def routed_pair(f, layer: int) -> tuple[int, int]:
    """Two experts the golden prompts route to at `layer`: the first prompt's first token's top expert,
    and the most used expert (over every golden token at that layer) that this token does not use, so
    the swap changes the very first MoE output the runner checks there."""
    first = np.asarray(f[f"golden/p{prompts_of(f)[0]}/prefill/L{layer}/topk_ids"])[0]   # [K]
    ids = np.concatenate([np.asarray(f[n]).ravel() for n in f.names
                          if n.startswith("golden/") and n.endswith(f"/L{layer}/topk_ids")])
    counts = np.bincount(ids, minlength=int(ids.max()) + 1)
    counts[first] = -1
    return int(first[0]), int(np.argmax(counts))
