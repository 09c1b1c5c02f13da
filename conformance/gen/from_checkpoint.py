"""`kdtr gen --from-checkpoint DIR [--layers N]`: the target straight from a HF-layout checkpoint, truncated to
its first N layers (docs/golden-bundles.md, "Goldens from a checkpoint").

The weights are refmodel.truncate's mapped StoredWeights: nothing of the checkpoint is copied, in memory or on
disk; each forward maps, upcasts and drops one tensor at a time, and an INT4 expert is dequantized only when a
prompt routes a token to it. The bundle stores exactly those tensors as the checkpoint holds them (bf16 raw,
INT4 packed with its bf16 scales). The drafter is distilled when --distill-steps asks for it and the float64
model fits in memory for the distillation corpus; otherwise it is untrained, and the bundle and the console say
why.
"""
from __future__ import annotations

from conformance.gen.bundle_model import GenSettings, Model, _bf16_round, _distill, default_drafter
from refmodel.config import ModelConfig
from refmodel.drafter import DrafterConfig, init_drafter
from refmodel.stored import StoredWeights, available_memory
from refmodel.checkpoint import read_config
from refmodel.truncate import LayerProgress, mapped_weights, open_truncated, provenance, tensor_hashes
from refmodel.weights import mask_token_id

DISTILL_COPIES = 2.0    # the distillation holds the float64 model and torch's float32 embedding/head and corpus
DISTILL_SHARE = 0.5     # ... within this share of the memory available now


def model_from_checkpoint(path: str, s: GenSettings, progress=None) -> Model:
    """The truncated target (s.layers; None: every layer), hashed for provenance, mapped per lookup."""
    layers = s.layers if s.layers is not None else read_config(path)[1].num_hidden_layers
    t = open_truncated(path, layers)
    hashes = tensor_hashes(t, progress)
    W = mapped_weights(t)
    if progress is not None:
        W.watch = LayerProgress(t.cfg, progress)          # a bar through the layers of each forward
    dcfg, DW, note = _drafter(t.cfg, W, s, progress)
    meta = {"source": provenance(t, hashes), "drafter_training": note}
    if t.quantization is not None:
        meta["quantization"] = dict(t.quantization, other_weights="as the checkpoint stores them")
    return Model(t.cfg, W, dcfg, DW, meta)


def distill_fits(W: StoredWeights, budget: int | None = None) -> tuple[bool, str]:
    """(whether the drafter can be distilled here, why): the distillation corpus runs the whole float64
    model, so DISTILL_COPIES x its float64 size must fit in DISTILL_SHARE of `budget` (default: the memory
    available now)."""
    need = DISTILL_COPIES * W.upcast_nbytes()
    avail = available_memory() if budget is None else budget
    if avail is None:
        return False, "the system does not say how much memory is available"
    if need > DISTILL_SHARE * avail:
        return False, (f"the truncated model is {W.upcast_nbytes() / 2**30:.1f} GiB in float64; distilling needs "
                       f"{need / 2**30:.1f} GiB, over {DISTILL_SHARE:g} x the {avail / 2**30:.1f} GiB available")
    return True, ""


def _drafter(cfg: ModelConfig, W: StoredWeights, s: GenSettings, progress) -> tuple[DrafterConfig, dict, str]:
    """(drafter config, bf16-rounded weights, what the bundle says about its training)."""
    if s.distill_steps > 0:
        fits, why = distill_fits(W)
        if fits:
            dcfg = default_drafter(cfg)
            return dcfg, _distill(cfg, W, dcfg, s, progress), f"distilled, {s.distill_steps} steps"
        note = f"untrained: --distill-steps {s.distill_steps} asked for distillation, but {why}"
        if progress is not None:
            progress(f"drafter {note}", 1, 1, None)
    else:
        note = "untrained: --distill-steps 0"
    dcfg = small_drafter(cfg)
    return dcfg, _bf16_round(init_drafter(dcfg, s.seed)), note + (" (the DDTree records stay exact; only the "
                                                                  "acceptance is low)")


def small_drafter(cfg: ModelConfig) -> DrafterConfig:
    """The untrained drafter: the real-shape slice's shape (one layer fed by the last target layer, MLP 1024,
    block 4, 8 heads of 64), sized to the target's hidden size and vocabulary, so that its float64 DDTree
    rounds cost little next to the target's forwards."""
    return DrafterConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=1, head_dim=64, intermediate_size=1024,
                         block_size=4, mask_token_id=mask_token_id(cfg), target_layer_ids=[cfg.num_hidden_layers - 1],
                         num_target_layers=cfg.num_hidden_layers, rms_norm_eps=1e-6, rope_theta=10000.0,
                         block_pos_embed=False)
