"""Where a golden bundle's model comes from (`kdtr gen --preset / --model / --from-checkpoint`): the target
weights as they will be stored (float32, or INT4 `.qw`/`.sc`), the drafter (distilled with torch, or read
from the model file), and INT4 quantization of a float32 target. Also the generator's settings and its
user-facing error, shared by conformance.gen.goldens and conformance.gen.gen.
"""
from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, field

import numpy as np

from kdtr_format import bf16_round, open_kdtr
from refmodel.config import PRESETS, SLICE_OF, ModelConfig, slice_shrinkage
from refmodel.distill import DistillSettings
from refmodel.drafter import DrafterConfig, drafter_preset, init_drafter
from refmodel.pinned import PinnedWorker
from refmodel.quant import dequantize_model, quant_config, quantize_model
from refmodel.stored import StoredWeights, generate_stored
from refmodel.weights import construction_info, init_weights, mask_token_id

# The long-position prompt's first position (docs/golden-bundles.md, "The long-position prompt": why 1.5 * 2^17).
LONG_POSITION_OFFSET = 196_608


class GenError(ValueError):
    """A user-facing generation problem (bad prompt, undecisive prompt, bad option)."""


@dataclass
class GenSettings:
    preset: str = "tiny"
    quant: str | None = "fp32"            # fp32 | int4 | None: the --model's own quantization
    int4_scope: str = "experts"
    seed: int = 0
    prompts: list | None = None           # explicit prompt id lists; else num_prompts random ones
    num_prompts: int = 4
    max_new_tokens: int = 64
    budget: int = 32                      # DDTree node budget
    distill_steps: int = 1000
    distill_math: str = "numpy"           # DistillSettings.vector_math: numpy, or torch to reproduce older bundles
    long_position: int | None = None      # first position of the long-position prompt; 0: no such prompt;
                                          # None: the default, long_position_default(cfg) (docs/golden-bundles.md)
    layers: int | None = None             # --from-checkpoint: the first N layers (None: all)
    command: str = ""                     # provenance: the command line that made the bundle
    bf16_profile: bool = True             # derive the bf16 precision profile (a bf16 reference run per prompt)
    routing_near_ties: str = "forbid"     # forbid: reject prompts with near-tie routing; held: judge them
                                          # (the fp32 baseline and live engines run the golden expert sets)


@dataclass
class Model:
    cfg: ModelConfig
    W: dict                               # as stored: float32 arrays (+ int32 .qw, float32 .sc for INT4),
                                          # or a StoredWeights (a real-shape slice: bf16 + INT4, never float64)
    dcfg: DrafterConfig
    DW: dict                              # float32 drafter weights, bfloat16-representable (stored bf16)
    meta: dict = field(default_factory=dict)   # construction, quantization, provenance of the weights


# ---------------------------------------------------------------- the model

def _f32(W) -> dict:
    if isinstance(W, StoredWeights):
        return W.astype(np.float32)                      # the same stored bytes, upcast to float32 per access
    return {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in W.items()}


def as_stored(W) -> StoredWeights:
    """The model's weights as the float64 oracle reads them: upcast (INT4 dequantized) per access, never
    the whole model in float64; the values are exactly dequantize_model's (refmodel/stored.py)."""
    return W.astype(np.float64) if isinstance(W, StoredWeights) else StoredWeights.from_arrays(W, np.float64)


def stored_names(W) -> list[str]:
    return W.stored_names() if isinstance(W, StoredWeights) else list(W)


def model_from_preset(s: GenSettings, progress=None) -> Model:
    """The preset target (float32-rounded), its drafter distilled on the target's own greedy streams."""
    if s.preset not in PRESETS:
        raise GenError(f"unknown preset {s.preset!r}; choose one of {sorted(PRESETS)}")
    if s.preset == "k26":
        raise GenError("preset 'k26' has the real K2.6 dimensions (1T parameters) and cannot be generated "
                       "whole; use --preset k26-slice (its true shapes, 3 layers), tiny or --from-checkpoint")
    if s.preset in SLICE_OF:
        return _slice_model(s, progress)
    cfg = PRESETS[s.preset]
    with distill_worker(s) as worker:       # started first: its start-up overlaps building the target
        W = _f32(init_weights(cfg, s.seed))
        dcfg = drafter_preset(s.preset)
        DW = _distill(cfg, W, dcfg, s, progress, worker)
    return Model(cfg, W, dcfg, DW, {"construction": construction_info(cfg, s.seed)})


def _slice_model(s: GenSettings, progress=None) -> Model:
    """A real-shape slice (docs/golden-bundles.md, "The real-shape slice"): the golden construction drawn
    tensor by tensor and stored as K2.6 ships it (routed experts INT4 W4A16 g32 with bf16 scales,
    everything else bfloat16), with an untrained drafter."""
    if s.quant == "fp32":
        raise GenError(f"--preset {s.preset} stores its routed experts INT4 as K2.6 ships them; pass "
                       f"--quant int4 or leave --quant out")
    if s.distill_steps:
        raise GenError(f"--preset {s.preset}: the drafter cannot be distilled on the CPU at hidden size "
                       f"{PRESETS[s.preset].hidden_size}; pass --distill-steps 0 (an untrained drafter: the "
                       f"DDTree records stay exact)")
    cfg = PRESETS[s.preset]
    report = None if progress is None else (lambda done, total: progress("weights", done, total, None))
    W = generate_stored(cfg, s.seed, dense="bfloat16", int4_scope="experts", progress=report)
    dcfg = drafter_preset(s.preset)
    DW = _bf16_round(init_drafter(dcfg, s.seed))
    meta = {"construction": construction_info(cfg, s.seed),
            "quantization": dict(quant_config("experts"), other_weights="bfloat16 (round to nearest even "
                                 "from the float64 draw), as K2.6 ships its non-expert weights"),
            "slice": {"of": SLICE_OF[s.preset], "preset": s.preset, "shrunk": slice_shrinkage(s.preset),
                      "kept": "every other config field equals the full model's (model_config)",
                      "drafter": "untrained (refmodel.drafter DRAFTER_PRESETS[preset]), stored bfloat16"}}
    return Model(cfg, W, dcfg, DW, meta)


def model_from_kdtr(path: str, s: GenSettings, progress=None) -> Model:
    """Target and drafter from an existing bundle or model file (`kdtr gen --model`); a model from
    `kdtr import` has no drafter yet, so one is distilled for it."""
    with open_kdtr(path, verify=True) as f:
        meta = f.metadata
        conf = meta.get("model_config", meta.get("config"))
        if conf is None:
            raise GenError(f"{path} has no model_config in its metadata: it is not a kdtr model or bundle; "
                           f"make one with `kdtr gen --preset tiny --out MODEL.kdtr` or `kdtr import`")
        cfg = ModelConfig.from_dict(conf)
        W = {n: _read(f, n) for n in f.names if not n.startswith(("golden/", "drafter."))}
        DW = _bf16_round({n: np.array(f.get(n)) for n in f.names if n.startswith("drafter.")})  # as stored
    keep = {k: meta[k] for k in ("construction", "quantization", "source", "provenance_of_weights")
            if meta.get(k)}
    if "drafter_config" in meta:
        return Model(cfg, W, DrafterConfig.from_dict(meta["drafter_config"]), DW, keep)
    dcfg = default_drafter(cfg)
    return Model(cfg, W, dcfg, _distill(cfg, W, dcfg, s, progress), keep)


def _read(f, name: str) -> np.ndarray:
    """Stored weights as the generator keeps them: int32 .qw as is, everything else float32."""
    if f.info(name).int4_shape is not None:
        return np.array(f[name])
    return np.array(f.get(name), dtype=np.float32)


def default_drafter(cfg: ModelConfig) -> DrafterConfig:
    """The tiny drafter for the tiny target; otherwise a one-layer drafter sized from the target."""
    if cfg == PRESETS["tiny"]:
        return drafter_preset("tiny")
    heads = max(1, cfg.hidden_size // 64)
    return DrafterConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=1,
                         head_dim=max(2, cfg.hidden_size // heads // 2 * 2), intermediate_size=2 * cfg.hidden_size,
                         block_size=16, mask_token_id=mask_token_id(cfg),
                         target_layer_ids=sorted({0, cfg.num_hidden_layers - 1}),
                         num_target_layers=cfg.num_hidden_layers, rms_norm_eps=1e-6, rope_theta=10000.0)


def _bf16_round(W: dict) -> dict:
    """Round to bfloat16 (RNE, once from the values' own precision), kept as float32. The drafter ships
    bf16, as real drafters do: it halves the bundle's largest part and only moves its proposals, never
    the target's goldens."""
    return {k: bf16_round(v) for k, v in W.items()}


TORCH_NEEDED = ("distilling the drafter needs torch, which is not installed here: pip install torch==2.13.0 "
                "(the CPU wheel; an unpinned torch pulls a CUDA build). Without torch: --distill-steps 0 "
                "(an untrained drafter) or --model with a bundle that already has a drafter")


def distill_worker(s: GenSettings):
    """The pinned-math process that will distill the drafter (refmodel/pinned.py), started now so that its
    start-up (a fresh interpreter, NumPy and refmodel) overlaps the caller's work; a null context when s trains
    none. torch is imported there only (refmodel/distill_torch.py), never in this process."""
    if s.distill_steps <= 0:
        return contextlib.nullcontext()
    if importlib.util.find_spec("torch") is None:
        raise GenError(TORCH_NEEDED)
    return PinnedWorker(modules=("refmodel.distill",))


def _distill(cfg, W, dcfg, s: GenSettings, progress, worker=None) -> dict:
    """The drafter: init_drafter's when s trains none, else distilled (refmodel/distill.py) in `worker`
    (distill_worker's) or in one started here."""
    if s.distill_steps <= 0:
        return _bf16_round(init_drafter(dcfg, s.seed))
    with (worker or distill_worker(s)) as w:
        return _bf16_round(w.call("refmodel.distill:distill_drafter", cfg, dequantize_model(W), dcfg, s.seed,
                                  s.distill_steps, progress=progress,
                                  settings=DistillSettings(vector_math=s.distill_math)))


def apply_quant(m: Model, s: GenSettings) -> Model:
    """INT4 bundles quantize the float32 target (scope experts or mlp); the drafter is kept. quant None:
    the model's own quantization (an INT4 model stays INT4, a float32 one float32)."""
    if s.quant is None:
        return m
    if s.quant == "fp32":
        if any(k.endswith(".qw") for k in stored_names(m.W)):
            raise GenError("the model is INT4 already; pass --quant int4 (or leave --quant out) to keep it so")
        return m
    if s.quant != "int4":
        raise GenError(f"--quant {s.quant!r}: choose fp32 or int4")
    if any(k.endswith(".qw") for k in stored_names(m.W)):
        return m
    W = quantize_model(dequantize_model(m.W), m.cfg, s.int4_scope)
    W = {k: (v if k.endswith(".qw") else v.astype(np.float32)) for k, v in W.items()}
    return Model(m.cfg, W, m.dcfg, m.DW, {**m.meta, "quantization": quant_config(s.int4_scope)})


def quant_of(m: Model) -> str:
    """"int4" when the target holds packed INT4 weights, else "fp32" (the tolerance multiplier's key)."""
    return "int4" if any(k.endswith(".qw") for k in stored_names(m.W)) else "fp32"
