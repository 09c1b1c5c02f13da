"""ModelConfig: every DeepseekV3 / Kimi K2.x config.json field that changes the math, plus named presets.

Field names are the HF names unchanged. Derived constants (qk_head_dim, the YaRN softmax scale with mscale^2,
the cos/sin attention factor) are computed once in __post_init__. Math: docs/model.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# rope_scaling keys we understand; anything else in a config.json rope dict is ignored (not math).
_ROPE_KEYS = ("type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction m(s, a) = 1 + 0.1 a ln s for s > 1, else 1 (docs/model.md §3)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Frozen; hash with to_dict() (rope_scaling is a dict)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int              # dense MLP width (layers < first_k_dense_replace)
    moe_intermediate_size: int          # routed and shared expert width
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope_theta: float
    rope_scaling: dict | None           # None = plain RoPE; else {"type": "yarn", factor, ...}
    max_position_embeddings: int
    rms_norm_eps: float                 # input, post-attention and final norms
    tie_word_embeddings: bool = False
    latent_norm_eps: float = 1e-6       # q_a_layernorm / kv_a_layernorm: HF hard-codes 1e-6 (docs/model.md §2)

    # derived in __post_init__
    qk_head_dim: int = field(init=False)
    softmax_scale: float = field(init=False)    # qk_head_dim^-0.5 * m(factor, mscale_all_dim)^2
    rope_attention_factor: float = field(init=False)  # multiplies cos/sin (1.0 for every Kimi variant)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                     "num_experts_per_tok", "n_group", "topk_group"):
            _check(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name, getattr(self, name),
                   "must be a positive int" + (" (q_lora_rank None / q_proj is not supported: Kimi uses "
                                               "q_a_proj/q_b_proj)" if name == "q_lora_rank" else ""))
        for name in ("n_shared_experts", "first_k_dense_replace"):
            _check(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, name, getattr(self, name),
                   "must be an int >= 0")
        _check(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", self.qk_rope_head_dim,
               "must be even: RoPE rotates interleaved pairs (2i, 2i+1)")
        _check(self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
               self.first_k_dense_replace, f"must be <= num_hidden_layers ({self.num_hidden_layers})")
        _check(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok", self.num_experts_per_tok,
               f"must be <= n_routed_experts ({self.n_routed_experts})")
        _check(self.n_routed_experts % self.n_group == 0, "n_group", self.n_group,
               f"must divide n_routed_experts ({self.n_routed_experts}); Kimi uses n_group=1")
        _check(self.n_routed_experts // self.n_group >= 2, "n_group", self.n_group,
               "needs >= 2 experts per group (the group score is the sum of the top-2)")
        _check(self.topk_group <= self.n_group, "topk_group", self.topk_group,
               f"must be <= n_group ({self.n_group}); Kimi uses topk_group=1")
        per_group = self.n_routed_experts // self.n_group
        _check(self.num_experts_per_tok <= self.topk_group * per_group, "num_experts_per_tok",
               self.num_experts_per_tok, f"must be <= topk_group * experts per group ({self.topk_group * per_group})")
        _check(self.rms_norm_eps > 0 and self.latent_norm_eps > 0, "rms_norm_eps/latent_norm_eps",
               (self.rms_norm_eps, self.latent_norm_eps), "must be > 0")
        _check(self.rope_theta > 0, "rope_theta", self.rope_theta, "must be > 0")
        rope = _normalise_rope_scaling(self.rope_scaling)
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        softmax_scale, attention_factor = _yarn_scales(qk_head_dim, rope)
        set_ = object.__setattr__           # frozen: presets are shared, nobody may mutate one
        set_(self, "rope_scaling", rope)
        set_(self, "qk_head_dim", qk_head_dim)
        set_(self, "softmax_scale", softmax_scale)
        set_(self, "rope_attention_factor", attention_factor)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Read a DeepseekV3 / Kimi K2 config.json dict, or a K2.5/K2.6 wrapper (the LLM is under text_config)."""
        if "text_config" in d:
            d = d["text_config"]
        rope = d.get("rope_scaling") or d.get("rope_parameters")
        theta = d.get("rope_theta", (rope or {}).get("rope_theta"))
        if rope is not None:
            rope = dict(rope)
            rope.setdefault("type", rope.get("rope_type", "default"))
            if rope["type"] == "default":      # transformers v5 saves plain RoPE as {"rope_type": "default", ...}
                rope = None
        kw = {"rope_theta": theta, "rope_scaling": rope}
        for f in dataclasses.fields(cls):
            if not f.init or f.name in kw:
                continue
            if f.name in d:
                kw[f.name] = d[f.name]
            elif f.default is dataclasses.MISSING:
                raise ValueError(f"config.json has no field {f.name!r}: every math field must be read from the "
                                 f"checkpoint's own config.json (or its text_config), never guessed")
        _check(theta is not None, "rope_theta", None, "missing from config.json and from rope_scaling")
        return cls(**kw)

    def to_dict(self) -> dict:
        """JSON-ready dict of the init fields (bundle metadata); from_dict(to_dict()) == self."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        d["rope_scaling"] = None if self.rope_scaling is None else dict(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"ModelConfig.from_dict: unknown fields {unknown}; use from_hf for a config.json")
        return cls(**d)


def _check(ok: bool, name: str, value, what: str) -> None:
    if not ok:
        raise ValueError(f"ModelConfig.{name} = {value!r}: {what}")


def _normalise_rope_scaling(rope: dict | None) -> dict | None:
    """Keep the math keys of a yarn rope dict, with HF's defaults made explicit (beta_fast 32, beta_slow 1)."""
    if rope is None:
        return None
    rope = {k: v for k, v in rope.items() if k in _ROPE_KEYS}
    kind = rope.get("type")
    _check(kind in ("yarn", "deepseek_yarn"), "rope_scaling['type']", kind,
           "only 'yarn' (DeepSeek YaRN) or None (plain RoPE) are supported")
    for key in ("factor", "original_max_position_embeddings"):
        _check(rope.get(key) is not None, f"rope_scaling[{key!r}]", rope.get(key), "is required for yarn")
    _check(rope["factor"] >= 1, "rope_scaling['factor']", rope["factor"], "must be >= 1")
    rope["type"] = "yarn"
    rope["beta_fast"] = rope.get("beta_fast") or 32     # HF: `get("beta_fast") or 32`
    rope["beta_slow"] = rope.get("beta_slow") or 1
    return rope


def _yarn_scales(qk_head_dim: int, rope: dict | None) -> tuple[float, float]:
    """(softmax scale, cos/sin attention factor) exactly as HF decides them (docs/model.md §3, §7)."""
    scale = qk_head_dim ** -0.5
    if rope is None:
        return scale, 1.0
    factor, mscale, mscale_all_dim = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale_all_dim:                                  # mscale^2 only when mscale_all_dim is truthy
        scale *= yarn_get_mscale(factor, mscale_all_dim) ** 2
    attn = rope.get("attention_factor")
    if attn is None:
        if mscale and mscale_all_dim:
            attn = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attn = yarn_get_mscale(factor)
    return scale, float(attn)


_KIMI_ROPE = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
              "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

PRESETS = {
    # The golden model: Kimi's structure scaled down (docs/golden-bundles.md).
    "tiny": ModelConfig(vocab_size=400, hidden_size=192, intermediate_size=384, moe_intermediate_size=32,
                 num_hidden_layers=6, num_attention_heads=6, q_lora_rank=96, kv_lora_rank=64,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
                 num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                 norm_topk_prob=True, routed_scaling_factor=2.827, rope_theta=50000.0,
                 rope_scaling=dict(_KIMI_ROPE), max_position_embeddings=262144, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
    # The golden model made shardable (docs/golden-bundles.md, "The shardable bundle"): tiny's widths, with
    # 16 heads and 32 routed experts, top-8 of group-limited routing (8 groups of 4, the best 4 groups
    # compete, as DeepSeek-V3 routes 256 experts), so heads, experts, groups and every width divide over
    # 2, 4 and 8 ranks.
    "shardable": ModelConfig(vocab_size=400, hidden_size=192, intermediate_size=384, moe_intermediate_size=32,
                 num_hidden_layers=6, num_attention_heads=16, q_lora_rank=96, kv_lora_rank=64,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32,
                 num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=8, topk_group=4,
                 norm_topk_prob=True, routed_scaling_factor=2.827, rope_theta=50000.0,
                 rope_scaling=dict(_KIMI_ROPE), max_position_embeddings=262144, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
    # Real Kimi K2.6 text model (docs/model.md §1). Used for real-shape slices; never allocated whole.
    "k26": ModelConfig(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
                num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                norm_topk_prob=True, routed_scaling_factor=2.827, rope_theta=50000.0,
                rope_scaling=dict(_KIMI_ROPE), max_position_embeddings=262144, rms_norm_eps=1e-5,
                tie_word_embeddings=False),
    # Every path the CUDA engine ships, at tiny cost (docs/golden-bundles.md, "The edge bundle"): a hidden size
    # past one 256-wide combine block and not a multiple of 64 (288 = 9 x 32), expert widths at group edges
    # (224 = 7 groups of 32, an odd number of 32-row blocks; its down projection allows 7 k-splits), a
    # vocabulary that is not a multiple of 8 (601), and 8 experts top-4, so a 34-token prefill or a 33-node
    # tree verify routes many tokens of one forward to one expert.
    "edge": ModelConfig(vocab_size=601, hidden_size=288, intermediate_size=160, moe_intermediate_size=224,
                 num_hidden_layers=3, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
                 num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                 norm_topk_prob=True, routed_scaling_factor=2.827, rope_theta=50000.0,
                 rope_scaling=dict(_KIMI_ROPE), max_position_embeddings=262144, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
    # The entries only K2.6's widths reach, at small cost (docs/golden-bundles.md, "The wide bundle"): an expert
    # width of 2080 (65 groups of 32) makes the MoE gate+up 130 blocks of 16 rows, so with top-8 one decode
    # step or any forward of 2+ tokens fills the H200's 132 SMs at 8 row blocks per block (the many-row
    # regime K2.6 runs in every MoE layer); a vocabulary of 4160 (> 4096) takes the DDTree builder's top-K
    # past the in-block sort, as K2.6's 163840 does; a latent of 128 (K2.6: 512) takes a verify's attention
    # to the wide tiling (cuda_engine/ops.py, Ops.attn_tiling). Hidden 64 keeps it light.
    "wide": ModelConfig(vocab_size=4160, hidden_size=64, intermediate_size=128, moe_intermediate_size=2080,
                 num_hidden_layers=2, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=128,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
                 num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                 norm_topk_prob=True, routed_scaling_factor=2.827, rope_theta=50000.0,
                 rope_scaling=dict(_KIMI_ROPE), max_position_embeddings=262144, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
    # K2.6's true per-layer shapes and config values, shrunk only where one CPU machine must: 3 layers (the
    # dense first layer and two MoE layers), 32 routed experts (top-8 stays a real choice) and an 8192-token
    # vocabulary. SLICE_OF names the model it slices; docs/golden-bundles.md ("The real-shape slice").
    "k26-slice": ModelConfig(vocab_size=8192, hidden_size=7168, intermediate_size=18432,
                moe_intermediate_size=2048, num_hidden_layers=3, num_attention_heads=64, q_lora_rank=1536,
                kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                n_routed_experts=32, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
                n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
                rope_theta=50000.0, rope_scaling=dict(_KIMI_ROPE), max_position_embeddings=262144,
                rms_norm_eps=1e-5, tie_word_embeddings=False),
}

# The tiny model stored as K2.6 ships (a slice preset: every dense weight bfloat16, the routed experts INT4, an
# untrained drafter), cut to its dense first layer and two MoE layers: the committed bundle whose dense weights
# an engine reads as bfloat16 (docs/golden-bundles.md, "The tiny slice").
PRESETS["tiny-slice"] = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=3)

# A slice preset -> the full model it is cut from (the bundle records every field that differs).
SLICE_OF = {"k26-slice": "k26", "tiny-slice": "tiny"}


def slice_shrinkage(name: str) -> dict:
    """{field: {"full": value in the full model, "slice": value here}} for every config field a slice
    preset changes; JSON-ready, for bundle metadata."""
    cut, full = PRESETS[name].to_dict(), PRESETS[SLICE_OF[name]].to_dict()
    return {k: {"full": full[k], "slice": v} for k, v in cut.items() if v != full[k]}
