"""The hypothesis library: the known mistakes behind K2.6 engine failures, each with its id, a title,
the taps and phases where it predicts the first divergence, the bundles it can act on, and how it is
tested: layer variants recomputed on the engine's inputs (variants.py, variants_moe.py), a DDTree
replay step (tree.py), or only signatures of the verdict (signatures.py). docs/diagnosis.md describes
each one, its evidence rule and its limits.

`acts_on`: "any" bundle; "int4" (the bundle stores INT4 weights); "moe" (the diverging layer is a MoE
layer); "long-position" (the prompt starts at a large position: float32 angles matter only there).
`signatures`: sets of verdict facts (signatures.FACTS); when every fact of one set is observed and no
recomputation refuted the hypothesis, it is reported as "consistent".
"""
from __future__ import annotations

from dataclasses import dataclass

from conformance.verify.diagnose import variants as va
from conformance.verify.diagnose import variants_moe as vm

ROPE_TAPS = ("q", "k_pe", "attn_out")
LINEAR_TAPS = ("q", "kv_latent", "k_pe", "attn_out", "router_scores", "mlp_out")


@dataclass(frozen=True)
class Hypothesis:
    id: str
    title: str
    taps: tuple                  # where it predicts the first divergence ("rounds": the DDTree replay)
    phases: tuple                # "prefill", "ar", "ddtree"
    acts_on: tuple = ("any",)
    variants: tuple = ()         # Layer subclasses: the mistake recomputed
    tree: tuple = ()             # tree.py variants: the DDTree replay recomputed
    signatures: tuple = ()       # tuples of signatures.FACTS


def _h(id, title, taps, phases, acts_on=("any",), variants=(), tree=(), signatures=()):
    return Hypothesis(id, title, tuple(taps), tuple(phases), tuple(acts_on), tuple(variants), tuple(tree),
                      tuple(tuple(s) for s in signatures))


PA = ("prefill", "ar")
HYPOTHESES = (
    _h("rope-layout", "RoPE pairs in the wrong layout (NeoX rotate-half on the interleaved dims)", ROPE_TAPS, PA,
       variants=(va.RopeNeox, va.RopeNeoxK, va.RopeNeoxConverted, va.RopeNeoxKConverted, va.RopeDeinterleaved,
                 va.RopeNeoxBoth)),   # at q or k_pe a one-tensor variant wins the tie: the first best is kept
    _h("rope-theta", "wrong rope_theta", ROPE_TAPS, PA, variants=(va.Theta, va.Theta1e6)),
    _h("rope-float32-angles", "RoPE angles position x inv_freq formed in float32", ROPE_TAPS, PA,
       ("long-position",), (va.F32AnglesFitted, va.F32Angles),
       signatures=(("long_position_only",),)),
    _h("yarn-not-applied", "YaRN frequency scaling not applied", ROPE_TAPS, PA,
       variants=(va.YarnPlain, va.YarnIgnored)),
    _h("yarn-mscale", "YaRN mscale misapplied (softmax scale or cos/sin factor)", ROPE_TAPS, PA,
       variants=(va.MscaleNotSquared, va.MscaleOnCos)),
    _h("yarn-truncate", "YaRN correction range rounded (or not) against the config's truncate", ROPE_TAPS, PA,
       variants=(va.YarnTruncateFlipped,)),
    _h("position-offset", "positions off (by one, or from the cache row instead of the given position)",
       ROPE_TAPS, PA, variants=(va.PositionPlus, va.PositionMinus, va.PositionFromCache),
       signatures=(("long_position_only",), ("decode_only", "input_cause"))),
    _h("causal-mask", "wrong causal mask in the prefill", ("attn_out",), ("prefill",),
       variants=(va.MaskNone, va.MaskOneAhead), signatures=(("prefill_only", "multi_token_only"),)),
    _h("softmax-scale", "wrong attention softmax scale", ("attn_out",), PA,
       variants=(va.ScaleNope, va.ScaleLatent, va.ScaleNone)),
    _h("latent-norm-eps", "latent norms (q_a, kv_a) with rms_norm_eps instead of 1e-6", ("q", "kv_latent"), PA,
       variants=(va.LatentEpsRms, va.RmsEpsLatent)),
    _h("norm-missing", "an RMSNorm skipped or its weight not applied",
       ("attn_in", "q", "kv_latent", "k_pe", "attn_out", "mlp_in"), PA,
       variants=va.NORMS_SKIPPED + (va.NormNoWeight,)),
    _h("kv-write-index", "decode KV rows written at the wrong cache index", ("attn_out",), ("ar",),
       variants=(va.KvEarly, va.KvLate), signatures=(("decode_only", "input_cause"),)),
    _h("kv-compaction", "KV cache not compacted to the accepted path after a DDTree verify", ("rounds",),
       ("ddtree",), tree=("truncate-only",), signatures=(("ddtree_only", "replay_fails", "after_compaction"),)),
    _h("router-softmax", "router scores by softmax instead of sigmoid", ("router_scores",), PA, ("moe",),
       (vm.RouterSoftmax,)),
    _h("router-bias-in-weights", "the correction bias in the expert weights", ("topk_weights",), PA, ("moe",),
       (vm.BiasInWeights,)),
    _h("router-no-renorm", "expert weights not renormalised", ("topk_weights",), PA, ("moe",), (vm.NoRenorm,)),
    _h("router-no-scaling", "routed_scaling_factor not applied", ("topk_weights",), PA, ("moe",),
       (vm.NoScaling,)),
    _h("router-group-limit", "group-limited routing wrong (defaults applied or groups ignored)", ("topk_ids",),
       PA, ("moe",), (vm.GroupsHfDefault, vm.GroupsIgnored)),
    _h("topk-k-minus-1", "top-k off by one: K-1 experts combined", ("mlp_out",), PA, ("moe",),
       (vm.LastSlotDropped, vm.LastSlotDroppedRenorm)),
    _h("shared-expert-dropped", "shared expert not added", ("mlp_out",), PA, ("moe",), (vm.SharedDropped,)),
    _h("shared-expert-scaled", "shared expert scaled by routed_scaling_factor", ("mlp_out",), PA, ("moe",),
       (vm.SharedScaled,)),
    _h("int4-nibble-order", "INT4 nibbles read in the wrong order", ("mlp_out",), PA, ("int4",),
       (vm.NibblesMsbFirst,)),
    _h("int4-zero-point", "INT4 codes without the uint4b8 offset (zero point)", ("mlp_out",), PA, ("int4",),
       (vm.NoZeroOffset,)),
    _h("int4-group-index", "INT4 group scales indexed wrongly", ("mlp_out",), PA, ("int4",),
       (vm.GroupSize, vm.Group64, vm.ScalesTransposed)),
    _h("int4-scale-dtype", "INT4 scales in the wrong dtype (bf16 product, or read as float16)", ("mlp_out",),
       PA, ("int4",), (vm.ScaleProductBf16, vm.ScaleAsFloat16)),
    _h("numerics-bf16", "projections computed in bfloat16", LINEAR_TAPS, PA,
       variants=(vm.Bf16Operands, vm.Bf16OperandsAndResult), signatures=(("rounding_noise_bf16",),)),
    _h("numerics-tf32", "projections computed in TF32", LINEAR_TAPS, PA, variants=(vm.Tf32Operands,),
       signatures=(("rounding_noise_tf32",),)),
    _h("tree-positions", "DDTree nodes at the wrong positions (by index instead of depth)", ("rounds",),
       ("ddtree",), tree=("positions-by-index", "positions-all-root"), signatures=(("ddtree_only", "replay_fails"),)),
    _h("tree-mask", "wrong DDTree attention mask", ("rounds",), ("ddtree",),
       tree=("mask-sees-next", "mask-causal"), signatures=(("ddtree_only", "replay_fails"),)),
    _h("tree-tie-order", "DDTree nodes in another order (tie or pop-order rule)", ("trees",), ("ddtree",),
       signatures=(("ddtree_only", "same_tree_nodes"),)),
)

BY_ID = {h.id: h for h in HYPOTHESES}
