"""How large the bundle of a `kdtr gen` command will be, known before any work: the command checks the
free space of --out's file system against it first, rather than losing a long run at the final write.

From the settings and the model's config alone: the target's weights as they will be stored (float32; INT4
`.qw` + bf16 `.sc` for quantized linears; a real-shape slice bf16), the drafter (bf16), per prompt its
golden records (float32 taps for every prompt token and generated token, int64 DDTree records), and the
header (names and the tolerance manifest, about HEADER_PER_TENSOR bytes a tensor). An upper estimate: the
DDTree records count every round as full (budget + 1 tree rows).
"""
from __future__ import annotations

import json
import os

from conformance.gen.bundle_model import GenSettings, default_drafter
from conformance.gen.goldens import AR_TAPS, LONG_NEW_TOKENS, LONG_PROMPT_LENGTH, prompt_length
from conformance.records import DDTREE_RECORDS
from kdtr_format import open_kdtr
from refmodel.config import PRESETS, SLICE_OF, ModelConfig
from refmodel.drafter import drafter_preset, drafter_shapes
from refmodel.model import tap_names
from refmodel.quant import is_quantized
from refmodel.truncate import open_truncated
from refmodel.weights import expected_shapes

HEADER_PER_TENSOR = 512     # its directory entry and manifest entry (measured 230-290 on the committed bundles)
ALIGN = 64


def estimate_bundle_bytes(s: GenSettings, model_path: str | None = None, checkpoint: str | None = None) -> int:
    """Bytes the bundle of these settings will take, at most (module doc)."""
    if model_path:
        with open_kdtr(model_path) as f:                       # the header only
            conf = f.metadata.get("model_config", f.metadata.get("config"))
            cfg = ModelConfig.from_dict(conf) if conf else None
            weights = sum(f.info(n).nbytes + ALIGN for n in f.names if not n.startswith("golden/"))
            count = sum(not n.startswith("golden/") for n in f.names)
        if cfg is None:
            return weights                                     # gen says what is wrong with the file
    elif checkpoint:
        with open(os.path.join(checkpoint, "config.json"), "rb") as fh:
            layers = s.layers or ModelConfig.from_hf(json.load(fh)).num_hidden_layers
        t = open_truncated(checkpoint, layers)                 # the shards' headers of the first N layers only
        cfg = t.cfg                                            # the bundle stores the tensors as the shards do
        weights, count = sum(e.nbytes + ALIGN for e in t.found.values()), len(t.found)
        weights += _drafter_bytes(cfg)
    else:
        cfg = PRESETS[s.preset]
        weights, count = _weight_bytes(cfg, s), len(expected_shapes(cfg))
        weights += _drafter_bytes(cfg, s.preset)
    lengths = [len(p) for p in s.prompts] if s.prompts else [prompt_length(i) for i in range(s.num_prompts)]
    runs = [(T, s.max_new_tokens) for T in lengths]
    if s.long_position is None or s.long_position:          # None: the default position, which exists when it fits
        runs.append((LONG_PROMPT_LENGTH, min(LONG_NEW_TOKENS, s.max_new_tokens)))
    goldens = sum(_golden_bytes(cfg, T, n, s.budget) for T, n in runs)
    records = len(runs) * (3 + len(DDTREE_RECORDS) + len(_tap_widths(cfg, 0)) * cfg.num_hidden_layers * 2 + 3)
    return weights + goldens + HEADER_PER_TENSOR * (count + records)


def _weight_bytes(cfg: ModelConfig, s: GenSettings) -> int:
    dense = 2 if s.preset in SLICE_OF else 4
    scope = "experts" if s.preset in SLICE_OF else (s.int4_scope if s.quant == "int4" else None)
    total = 0
    for name, shape in expected_shapes(cfg).items():
        n = 1
        for d in shape:
            n *= d
        if scope and name.endswith(".weight") and len(shape) == 2 and is_quantized(name[:-7], scope):
            total += n // 2 + 2 * (n // 32) + 2 * ALIGN       # packed nibbles + bf16 group-32 scales
        else:
            total += dense * n + ALIGN
    return total


def _drafter_bytes(cfg: ModelConfig, preset: str | None = None) -> int:
    dcfg = drafter_preset(preset) if preset else default_drafter(cfg)
    return sum(2 * _size(shape) + ALIGN for shape in drafter_shapes(dcfg).values())


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tap_widths(cfg: ModelConfig, layer: int) -> dict:
    """Bytes per token of each tap of a layer (float32; topk_ids int64)."""
    D, E, K = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    width = {"attn_in": D, "q": cfg.num_attention_heads * cfg.qk_head_dim, "kv_latent": cfg.kv_lora_rank,
             "k_pe": cfg.qk_rope_head_dim, "attn_out": D, "resid_attn": D, "mlp_in": D, "router_scores": E,
             "topk_ids": 2 * K, "topk_weights": K, "mlp_out": D, "resid_out": D}
    return {t: 4 * width[t] for t in tap_names(cfg, layer)}


def _golden_bytes(cfg: ModelConfig, T: int, n: int, budget: int) -> int:
    """A prompt of T tokens with n generated: prefill taps, final hidden and logits for T rows, decode taps
    and logits for n rows, and the DDTree records with every round full."""
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    prefill = sum(sum(_tap_widths(cfg, l).values()) for l in range(L)) + 4 * (D + V)
    decode = sum(w for l in range(L) for t, w in _tap_widths(cfg, l).items() if t in AR_TAPS) + 4 * V
    ddtree = 8 * n * (budget + 1) * len(DDTREE_RECORDS)
    return T * prefill + n * decode + ddtree + 8 * (T + 2 * n)
