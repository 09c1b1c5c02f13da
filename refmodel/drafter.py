"""The DFlash block-diffusion drafter (docs/ddtree.md §2), adapted to the kdtr target.

One call drafts a whole block: the input is [bonus, MASK x (B-1)] embedded with the TARGET's embedding, the
context is the target's hidden states from `target_layer_ids` fused by fc + RMSNorm, every block query sees
every context key and every block key (bidirectional, no mask), and the TARGET's lm_head turns the last
hidden states into B-1 per-position logits. Draft layers are Qwen3-flavoured: GQA with per-head q/k RMSNorm,
NeoX RoPE, SwiGLU MLP. Only context K/V are cached (block rows never are), so the cache always holds exactly
the committed positions.

Deviations from DFlash (docs/ddtree.md §8; both exist identically here and in refmodel/distill.py's torch forward):

* `block_pos_embed` (DrafterConfig field, on in the `tiny` preset; tensor `drafter.block_pos_embed` [B, D]):
  a learned per-block-offset vector added to the block input, row k gets embed[block_ids[k]] + pe[k].
  Why: DFlash's mask rows are identical, so a row's only offset signal is RoPE, and the `tiny` target's
  draft is a per-offset lookup (row k should predict perm^k(bonus), a different random map per k).
  Measured (seed 0, 320 streams, I 2048, lr 1e-2, 500 steps; golden 4 prompts / 8 prompts of seed 1):
  AR/DDTree ratio 5.57 / 5.17 with it, 3.82 / 3.33 without; it only started to matter once the corpus was
  diverse enough (with the old 160-stream corpus: 3.77 with, 3.88 without). Off (the DFlash default) for
  every other config, and then the tensor does not exist.
* `tiny`'s MLP width is 1024 (the target's is 384): more lookup capacity. Measured at the old settings:
  1024 -> 3.77, 2048 -> 4.20, 4096 -> 4.57 (ratio, 4 golden prompts); with the final settings 2048 x 500
  steps gave 6.40 / 6.32 (4 golden / 8 other prompts) and 1024 x 650 steps 6.40 / 5.89. 1024 is the choice:
  with decode-step attn_out and router_scores and the long-position prompt the two bundles fill 31.85 of
  their 32 MiB, so the drafter (2.9 MiB in each) cannot grow; the distillation settings
  (refmodel/distill.py) do the rest.

Legend: T block rows (= block_size B), C new context rows, S cached context rows, D hidden,
F = len(target_layer_ids) * D fused feature width, H query heads, G kv heads, Dh head dim, I MLP width, V vocab.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

# Tiny drafter, documented choice: the target has 6 layers; we fuse the outputs of layers 1, 3 and 5
# (early, middle, last; spread like DFlash's build_target_layer_ids but without duplicates).
# The MLP is wider than the target's (1024 vs 384) because the drafter must memorise multi-step
# continuations of the target's token rule, one lookup per (token, block offset); block_pos_embed tells
# the mask rows their offset (module docstring: both are measured deviations).
DRAFTER_PRESETS = {
    "tiny": dict(hidden_size=192, vocab_size=400, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=48, intermediate_size=1024, block_size=16,
                 mask_token_id=399, target_layer_ids=[1, 3, 5], num_target_layers=6,
                 rms_norm_eps=1e-6, rope_theta=10000.0, block_pos_embed=True),
    # The shardable model's: tiny's drafter (same hidden size, vocabulary and layer count).
    "shardable": dict(hidden_size=192, vocab_size=400, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=48, intermediate_size=1024, block_size=16,
                      mask_token_id=399, target_layer_ids=[1, 3, 5], num_target_layers=6,
                      rms_norm_eps=1e-6, rope_theta=10000.0, block_pos_embed=True),
    # The edge bundle's drafter: the target's odd widths (hidden 288) through the drafter's kernels too.
    "edge": dict(hidden_size=288, vocab_size=601, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=48, intermediate_size=288, block_size=16,
                 mask_token_id=600, target_layer_ids=[0, 1, 2], num_target_layers=3,
                 rms_norm_eps=1e-6, rope_theta=10000.0, block_pos_embed=True),
    # The wide bundle's drafter: its vocabulary of 4160 through the DDTree builder's wide top-K.
    "wide": dict(hidden_size=64, vocab_size=4160, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=512, block_size=16,
                 mask_token_id=4159, target_layer_ids=[0, 1], num_target_layers=2,
                 rms_norm_eps=1e-6, rope_theta=10000.0, block_pos_embed=True),
    # The real-shape slice's drafter: untrained (no CPU distillation at hidden 7168), as small as the shared
    # embedding allows (one layer fed by the last target layer, MLP 1024, block 4): the bundle's DDTree
    # records exist and are exact; the slice tests the target's shapes, not drafting quality.
    "k26-slice": dict(hidden_size=7168, vocab_size=8192, num_hidden_layers=1, num_attention_heads=8,
                      num_key_value_heads=1, head_dim=64, intermediate_size=1024, block_size=4,
                      mask_token_id=8191, target_layer_ids=[2], num_target_layers=3,
                      rms_norm_eps=1e-6, rope_theta=10000.0, block_pos_embed=False),
    # The tiny slice's drafter: untrained like the real-shape slice's, tiny's widths and block, one layer fed
    # by the slice's three target layers.
    "tiny-slice": dict(hidden_size=192, vocab_size=400, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=48, intermediate_size=1024, block_size=16,
                       mask_token_id=399, target_layer_ids=[0, 1, 2], num_target_layers=3,
                       rms_norm_eps=1e-6, rope_theta=10000.0, block_pos_embed=True),
}


@dataclass
class DrafterConfig:
    hidden_size: int              # = the target's hidden_size (shared embedding and lm_head)
    vocab_size: int               # = the target's vocab_size
    num_hidden_layers: int        # draft depth
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int               # B: one bonus row + B-1 mask rows; drafts depth L = B-1
    mask_token_id: int            # a real row of the target's embedding, reserved (never predicted)
    target_layer_ids: list        # fused target layers l (their outputs = the target's hiddens[l+1])
    num_target_layers: int
    rms_norm_eps: float
    rope_theta: float
    block_pos_embed: bool = False  # kdtr deviation (module docstring): learned [B, D] added to the block input
    num_key_value_groups: int = field(init=False)

    def __post_init__(self):
        self.target_layer_ids = [int(l) for l in self.target_layer_ids]
        ids = self.target_layer_ids
        if not ids or len(set(ids)) != len(ids) or not all(0 <= l < self.num_target_layers for l in ids):
            raise ValueError(f"DrafterConfig.target_layer_ids = {ids}: need distinct layers in "
                             f"[0, {self.num_target_layers})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DrafterConfig.num_key_value_heads = {self.num_key_value_heads}: must divide "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2 or self.block_size < 2 or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DrafterConfig: head_dim {self.head_dim} must be even, block_size "
                             f"{self.block_size} >= 2, mask_token_id {self.mask_token_id} inside the vocabulary")
        self.num_key_value_groups = self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict:
        """JSON-ready init fields (bundle metadata); from_dict(to_dict()) == self."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        return cls(**d)


def drafter_preset(name: str) -> DrafterConfig:
    if name not in DRAFTER_PRESETS:
        raise ValueError(f"unknown drafter preset {name!r}; known: {sorted(DRAFTER_PRESETS)}")
    return DrafterConfig(**{k: (list(v) if isinstance(v, list) else v) for k, v in DRAFTER_PRESETS[name].items()})


def drafter_shapes(dcfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every drafter tensor name -> shape (HF [out, in] layout), in the fixed init order."""
    D, Dh, I = dcfg.hidden_size, dcfg.head_dim, dcfg.intermediate_size
    H, G = dcfg.num_attention_heads, dcfg.num_key_value_heads
    S = {"drafter.fc.weight": (D, len(dcfg.target_layer_ids) * D), "drafter.hidden_norm.weight": (D,)}
    for l in range(dcfg.num_hidden_layers):
        p = f"drafter.layers.{l}."
        S.update({p + "input_layernorm.weight": (D,), p + "self_attn.q_proj.weight": (H * Dh, D),
                  p + "self_attn.k_proj.weight": (G * Dh, D), p + "self_attn.v_proj.weight": (G * Dh, D),
                  p + "self_attn.o_proj.weight": (D, H * Dh), p + "self_attn.q_norm.weight": (Dh,),
                  p + "self_attn.k_norm.weight": (Dh,), p + "post_attention_layernorm.weight": (D,),
                  p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                  p + "mlp.down_proj.weight": (D, I)})
    S["drafter.norm.weight"] = (D,)
    if dcfg.block_pos_embed:
        S["drafter.block_pos_embed"] = (dcfg.block_size, D)
    return S


def init_drafter(dcfg: DrafterConfig, seed: int) -> dict[str, np.ndarray]:
    """Float64 untrained drafter weights: norms 1, linears N(0, 1/fan_in), deterministic in (dcfg, seed)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    DW = {}
    for name, shape in drafter_shapes(dcfg).items():
        DW[name] = np.ones(shape) if len(shape) == 1 else rng.normal(0.0, shape[1] ** -0.5, size=shape)
    return DW


# ----------------------------------------------------------------------------------------------------
# primitives


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def linear(x, w):
    return x @ w.T                         # [..., in] -> [..., out]; matmul (BLAS), c_einsum is ~10x slower


def rope(x, positions, theta):
    """NeoX (rotate-half) RoPE on the last dim of x [T, heads, Dh] at integer positions [T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) / half)     # [Dh/2]
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq   # [T, Dh/2]
    cos = np.cos(ang)[:, None, :].astype(x.dtype)                        # [T, 1, Dh/2]; angles in float64,
    sin = np.sin(ang)[:, None, :].astype(x.dtype)                        #   tables in the compute dtype
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def target_features(dcfg: DrafterConfig, hiddens: list) -> np.ndarray:
    """Concatenate the target's chosen layer outputs: hiddens[l+1] is layer l's output (hiddens[0] = embeddings)."""
    return np.concatenate([hiddens[l + 1] for l in dcfg.target_layer_ids], axis=-1)   # L+1 x [T, D] -> [T, F]


# ----------------------------------------------------------------------------------------------------
# context cache and forward


class DrafterCache:
    """Per draft layer, the K (normed, rotated) and V of committed context positions [0, length)."""

    def __init__(self, dcfg: DrafterConfig, dtype=np.float64):
        G, Dh = dcfg.num_key_value_heads, dcfg.head_dim
        self.k = [np.zeros((0, G, Dh), dtype) for _ in range(dcfg.num_hidden_layers)]
        self.v = [np.zeros((0, G, Dh), dtype) for _ in range(dcfg.num_hidden_layers)]

    @property
    def length(self) -> int:
        return self.k[0].shape[0]


def _layer(dcfg, DW, l, h, c, pos_blk, pos_ctx, cache):
    """One draft layer on the block stream h [T, D] with new fused context c [C, D]; appends c's K/V."""
    p, eps, Dh = f"drafter.layers.{l}.", dcfg.rms_norm_eps, dcfg.head_dim
    x = rms_norm(h, DW[p + "input_layernorm.weight"], eps)             # [T, D]; c skips input_layernorm
    q = linear(x, DW[p + "self_attn.q_proj.weight"]).reshape(len(x), -1, Dh)          # [T, H, Dh]
    q = rope(rms_norm(q, DW[p + "self_attn.q_norm.weight"], eps), pos_blk, dcfg.rope_theta)

    def kv(z, pos):                                                     # same k_proj/v_proj for c and x
        k = linear(z, DW[p + "self_attn.k_proj.weight"]).reshape(len(z), -1, Dh)      # [*, G, Dh]
        k = rope(rms_norm(k, DW[p + "self_attn.k_norm.weight"], eps), pos, dcfg.rope_theta)
        return k, linear(z, DW[p + "self_attn.v_proj.weight"]).reshape(len(z), -1, Dh)  # V: no norm

    kc, vc = kv(c, pos_ctx)
    cache.k[l] = np.concatenate([cache.k[l], kc])                      # [S, G, Dh] -> [S+C, G, Dh]
    cache.v[l] = np.concatenate([cache.v[l], vc])
    kb, vb = kv(x, pos_blk)
    k = np.repeat(np.concatenate([cache.k[l], kb]), dcfg.num_key_value_groups, axis=1)  # [S+C+T, H, Dh]
    v = np.repeat(np.concatenate([cache.v[l], vb]), dcfg.num_key_value_groups, axis=1)
    s = np.einsum("thd,shd->hts", q, k) * Dh ** -0.5                  # [H, T, S+C+T]; no mask
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", a, v).reshape(len(h), -1)            # [T, H*Dh]
    h = h + linear(o, DW[p + "self_attn.o_proj.weight"])
    x = rms_norm(h, DW[p + "post_attention_layernorm.weight"], eps)
    g, u = linear(x, DW[p + "mlp.gate_proj.weight"]), linear(x, DW[p + "mlp.up_proj.weight"])   # [T, I]
    return h + linear(g / (1 + np.exp(-g)) * u, DW[p + "mlp.down_proj.weight"])            # [T, D]


def drafter_forward(dcfg: DrafterConfig, DW: dict, W: dict, block_ids, ctx_features: np.ndarray,
                    cache: DrafterCache, start: int, pos0: int = 0) -> np.ndarray:
    """Draft one block. block_ids [B] = [bonus, MASK...] at positions start..start+B-1; ctx_features [C, F]
    are the fused-layer target features of positions start-C..start-1 (the rows committed since the last
    call). Appends their K/V to cache (which must hold exactly [0, start-C) before, [0, start) after) and
    returns the B-1 per-position logits [B-1, V] for positions start+1..start+B-1."""
    C, B = len(ctx_features), len(block_ids)
    if cache.length != start - C:
        raise ValueError(f"drafter cache holds {cache.length} rows; expected start - C = {start} - {C}")
    eps = dcfg.rms_norm_eps
    c = rms_norm(linear(ctx_features, DW["drafter.fc.weight"]), DW["drafter.hidden_norm.weight"], eps)  # [C, D]
    h = W["model.embed_tokens.weight"][np.asarray(block_ids)]           # [B, D], the target's embedding
    if dcfg.block_pos_embed:
        h = h + DW["drafter.block_pos_embed"][:B]                       # [B, D], row k: block offset k
    pos_ctx, pos_blk = pos0 + np.arange(start - C, start), pos0 + np.arange(start, start + B)  # cache row j: pos0 + j
    for l in range(dcfg.num_hidden_layers):
        h = _layer(dcfg, DW, l, h, c, pos_blk, pos_ctx, cache)
    out = rms_norm(h[1:], DW["drafter.norm.weight"], eps)              # [B-1, D]; block row 0 is dropped
    return linear(out, _lm_head(W))                                     # [B-1, V], the target's lm_head


def _lm_head(W: dict) -> np.ndarray:
    return W["lm_head.weight"] if "lm_head.weight" in W else W["model.embed_tokens.weight"]


def read_drafter(f) -> tuple[DrafterConfig, dict[str, np.ndarray]]:
    """(config, float64 weights) of the drafter an open bundle carries: metadata `drafter_config` and the
    `drafter.*` tensors (stored bfloat16, widened exactly)."""
    DW = {n: np.array(f.get(n), dtype=np.float64) for n in f.names if n.startswith("drafter.")}
    return DrafterConfig.from_dict(f.metadata["drafter_config"]), DW
