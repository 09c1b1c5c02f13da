"""`kdtr import` on synthetic K2.6-format checkpoints: a tiny DeepseekV3 saved by transformers (sharded),
routed experts compressed by compressed-tensors with the real key names and quantization_config (docs/int4.md),
plain (K2-Thinking names) and wrapped (K2.5/K2.6 text_config + language_model. prefix + vision tensors).
The reference on the imported file must reproduce transformers on the dequantized weights."""
import dataclasses
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

from cli.main import main
from hf_oracle import hf_config, hf_logits, hf_model
from kdtr_format import open_kdtr
from refmodel.checkpoint import CheckpointError, import_checkpoint, load_model
from refmodel.config import PRESETS
from refmodel.model import forward
from refmodel.quant import dequantize_model
from refmodel.weights import init_weights

# Every input dim a multiple of 32 (hidden 64, expert width 32, dense width 96, q/kv ranks 32, H*v 32).
CFG = dataclasses.replace(PRESETS["tiny"], vocab_size=256, hidden_size=64, intermediate_size=96,
                          moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, q_lora_rank=32,
                          kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                          n_routed_experts=8, num_experts_per_tok=2)
GROUP = 32
QUANT_CONFIG = {   # K2.6's field list (docs/int4.md §6)
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                    "dynamic": False, "actorder": None, "observer": "minmax", "block_structure": None},
        "input_activations": None, "output_activations": None}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}
SCHEME = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP, scale_dtype=torch.bfloat16))


def compress_expert(w: torch.Tensor, shape_dtype) -> tuple[dict, np.ndarray]:
    """compressed-tensors' minmax + pack-quantized compressor; returns the on-disk tensors (bf16 scales)
    and CT's own decompression (float32 scales: exact) as float64."""
    scale, _ = compute_dynamic_scales_and_zp(value=w, args=SCHEME.weights, module=torch.nn.Module())
    c = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, SCHEME)
    dense = PackedQuantizationCompressor.decompress(dict(c), SCHEME)["weight"].double().numpy()
    return {"weight_packed": c["weight_packed"], "weight_scale": c["weight_scale"].to(torch.bfloat16),
            "weight_shape": c["weight_shape"].to(shape_dtype)}, dense


def build_checkpoint(root: str, wrapper: bool, shape_dtype, cfg=CFG) -> dict[str, np.ndarray]:
    """Write the checkpoint; return the dequantized weights (HF names) that transformers will run."""
    model = hf_model(cfg, init_weights(cfg, seed=0), torch.float32)   # non-zero e_score_correction_bias
    model.save_pretrained(root, max_shard_size="100KB")
    index_path = os.path.join(root, "model.safetensors.index.json")
    shards = sorted(set(json.load(open(index_path))["weight_map"].values()))
    assert len(shards) >= 3
    prefix = "language_model." if wrapper else ""
    weight_map, deq = {}, {}
    for i, shard in enumerate(shards):
        out = {}
        for name, t in load_file(os.path.join(root, shard)).items():
            if ".mlp.experts." in name:
                parts, deq[name] = compress_expert(t, shape_dtype)
                out.update({prefix + name[: -len("weight")] + k: v for k, v in parts.items()})
            elif name.endswith("e_score_correction_bias"):
                out[prefix + name], deq[name] = t.float(), t.double().numpy()           # F32, as K2.6
            else:
                b = t.to(torch.bfloat16)
                out[prefix + name], deq[name] = b, b.double().numpy()
        if wrapper and i == 0:
            out["vision_tower.blocks.0.attn.qkv.weight"] = torch.ones(8, 8, dtype=torch.bfloat16)
            out["mm_projector.proj.0.weight"] = torch.ones(4, 8, dtype=torch.bfloat16)
        save_file(out, os.path.join(root, shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in out})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(index_path, "w"))
    text = dict(hf_config(cfg).to_dict(), quantization_config=QUANT_CONFIG)
    config = text if not wrapper else {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": dict(text, model_type="kimi_k2"), "quantization_config": QUANT_CONFIG,
        "vision_config": {"model_type": "moonvit", "hidden_size": 8}}
    json.dump(config, open(os.path.join(root, "config.json"), "w"))
    return deq


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("k2thinking"))
    return root, build_checkpoint(root, wrapper=False, shape_dtype=torch.int64)


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("k26"))
    return root, build_checkpoint(root, wrapper=True, shape_dtype=torch.int32)


def test_cli_import_then_reference_equals_transformers_on_dequantized_weights(plain, tmp_path):
    root, deq = plain
    out = str(tmp_path / "model.kdtr")
    result = CliRunner().invoke(main, ["import", root, "--out", out])
    assert result.exit_code == 0, result.output
    assert "INT4 W4A16 g32 (experts, bfloat16 scales)" in result.output
    cfg, W = load_model(out)
    assert cfg == CFG
    D = dequantize_model(W)
    assert set(D) == set(deq)
    for name in deq:                                  # our dequantizer == CT's decompressor, bit for bit
        assert np.array_equal(D[name], deq[name]), name
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, size=24)
    ours, _ = forward(cfg, D, ids, np.arange(len(ids)))
    theirs = hf_logits(hf_model(CFG, deq, torch.float64), ids)
    diff = np.abs(ours - theirs).max()
    print(f"\nimport oracle: reference on imported INT4 .kdtr vs transformers (float64) on dequantized "
          f"weights: logits max abs diff {diff:.3e} over {len(ids)} tokens (|logit| max {np.abs(theirs).max():.2f})")
    assert diff <= 1e-4    # measured 5.0e-6: HF "float64" still runs RMSNorm, router and RoPE in float32


def test_int4_stays_packed_with_raw_bf16_scales_and_metadata(plain, tmp_path):
    root, _ = plain
    out = str(tmp_path / "model.kdtr")
    summary = import_checkpoint(root, out)
    moe = CFG.num_hidden_layers - CFG.first_k_dense_replace
    assert summary.int4_linears == moe * CFG.n_routed_experts * 3 and summary.shards >= 3
    name = "model.layers.2.mlp.experts.5.down_proj"
    disk = {k: v for s in sorted(os.listdir(root)) if s.endswith(".safetensors")
            for k, v in load_file(os.path.join(root, s)).items() if k.startswith(name)}
    with open_kdtr(out, verify=True) as f:
        qw, sc = f.info(name + ".qw"), f.info(name + ".sc")
        assert (qw.dtype, qw.shape, qw.int4_shape) == ("int32", (64, 4), (64, 32))
        assert sc.dtype == "bfloat16" and f.info("model.layers.1.mlp.gate.e_score_correction_bias").dtype == "float32"
        assert np.array_equal(f[name + ".qw"], disk[name + ".weight_packed"].numpy())
        assert np.array_equal(f[name + ".sc"], disk[name + ".weight_scale"].view(torch.int16).numpy().view(np.uint16))
        assert not any(n.endswith(("weight_packed", "weight_scale", "weight_shape")) for n in f.names)
        meta = f.metadata
    q = meta["quantization"]
    assert (q["bits"], q["group_size"], q["symmetric"], q["scale_dtype"], q["scope"]) == (4, 32, True, "bfloat16",
                                                                                       "experts")
    assert q["source"] == QUANT_CONFIG and meta["config"] == CFG.to_dict()
    assert meta["provenance"]["shards"][0]["file"].startswith("model-00001-of-")


def test_wrapped_k26_layout_imports_to_the_same_tensors(plain, wrapped, tmp_path):
    (root_a, _), (root_b, _) = plain, wrapped
    a, b = str(tmp_path / "a.kdtr"), str(tmp_path / "b.kdtr")
    import_checkpoint(root_a, a)
    summary = import_checkpoint(root_b, b)
    assert summary.dropped == 2
    with open_kdtr(a) as fa, open_kdtr(b) as fb:
        assert sorted(fa.names) == sorted(fb.names)
        for n in fa.names:
            assert fa.info(n).checksum == fb.info(n).checksum, n
        assert fb.metadata["provenance"]["name_prefix_stripped"] == "language_model."


# ---------------------------------------------------------------- bad checkpoints

def edit(root: str, tmp_path, drop=(), add=None, config=None) -> str:
    """A copy of the checkpoint with tensors dropped/added (in the first shard) or config.json patched."""
    dst = str(tmp_path / "edited")
    shutil.copytree(root, dst)
    index_path = os.path.join(dst, "model.safetensors.index.json")
    index = json.load(open(index_path))
    for name in drop:
        shard = os.path.join(dst, index["weight_map"].pop(name))
        tensors = load_file(shard)
        del tensors[name]
        save_file(tensors, shard)
    for name, t in (add or {}).items():
        shard_name = index["weight_map"].get(name, sorted(set(index["weight_map"].values()))[0])
        tensors = load_file(os.path.join(dst, shard_name))
        tensors[name] = t
        save_file(tensors, os.path.join(dst, shard_name))
        index["weight_map"][name] = shard_name
    json.dump(index, open(index_path, "w"))
    if config is not None:
        cfg = json.load(open(os.path.join(dst, "config.json")))
        config(cfg)
        json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def expect_error(root: str, tmp_path, message: str) -> None:
    out = str(tmp_path / "bad.kdtr")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        import_checkpoint(root, out)
    assert not os.path.exists(out)
    result = CliRunner().invoke(main, ["import", root, "--out", out])
    assert result.exit_code == 5 and result.output.strip().startswith("error: ") and message in result.output


def test_missing_tensor(plain, tmp_path):
    root = edit(plain[0], tmp_path, drop=["model.layers.2.self_attn.o_proj.weight"])
    expect_error(root, tmp_path, "missing tensor model.layers.2.self_attn.o_proj.weight (1 missing in all): "
                                 "the checkpoint does not hold every weight its config.json describes")


def test_missing_int4_scale(plain, tmp_path):
    root = edit(plain[0], tmp_path, drop=["model.layers.1.mlp.experts.3.up_proj.weight_scale"])
    expect_error(root, tmp_path, "missing tensor model.layers.1.mlp.experts.3.up_proj.weight_scale: every "
                                 "weight_packed needs weight_scale and weight_shape")


def test_unknown_tensor(plain, tmp_path):
    root = edit(plain[0], tmp_path, add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    expect_error(root, tmp_path, "unknown tensor model.layers.0.self_attn.rotary_emb.inv_freq (1 unknown in all): "
                                 "not a tensor of this config's DeepseekV3 text model")


def test_dense_shape_mismatch(plain, tmp_path):
    root = edit(plain[0], tmp_path, add={"model.norm.weight": torch.ones(63, dtype=torch.bfloat16)})
    expect_error(root, tmp_path, "shape mismatch for tensor model.norm.weight: checkpoint [63], config.json "
                                 "implies [64]")


def test_int4_weight_shape_mismatch(plain, tmp_path):
    name = "model.layers.2.mlp.experts.0.gate_proj.weight_shape"
    root = edit(plain[0], tmp_path, add={name: torch.tensor([32, 96])})
    expect_error(root, tmp_path, f"shape mismatch for tensor {name}: holds [32, 96], config.json implies [32, 64] "
                                 f"(int32 or int64)")


def test_int4_scale_shape_mismatch(plain, tmp_path):
    name = "model.layers.2.mlp.experts.0.down_proj.weight_scale"
    root = edit(plain[0], tmp_path, add={name: torch.ones(64, 2, dtype=torch.bfloat16)})
    expect_error(root, tmp_path, f"shape mismatch for tensor {name}: checkpoint BF16 [64, 2], expected "
                                 f"BF16/F16/F32 [64, 1] (group_size 32)")


@pytest.mark.parametrize("field, value", [("num_bits", 8), ("symmetric", False), ("strategy", "channel"),
                                          ("actorder", "group")])
def test_unsupported_quantization_config(plain, tmp_path, field, value):
    root = edit(plain[0], tmp_path,
                config=lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update({field: value}))
    expect_error(root, tmp_path, f"unsupported quantization_config: config_groups.group_0 has {{{field!r}: {value!r}}}; "
                                 "kdtr supports weights {num_bits: 4, type: int, symmetric: true, strategy: group, "
                                 "group_size: N, dynamic: false, actorder: null}, format pack-quantized, "
                                 "unquantized activations")


def test_unsupported_quant_method(plain, tmp_path):
    root = edit(plain[0], tmp_path, config=lambda c: c["quantization_config"].update(quant_method="fp8"))
    expect_error(root, tmp_path, "unsupported quantization_config: quant_method 'fp8'; kdtr imports "
                                 "compressed-tensors pack-quantized INT4 (W4A16) only")


def test_int4_without_quantization_config(plain, tmp_path):
    root = edit(plain[0], tmp_path, config=lambda c: c.pop("quantization_config"))
    expect_error(root, tmp_path, "config.json has no quantization_config but the shards hold INT4 "
                                 "weight_packed tensors; the config does not belong to these weights")


def test_fp8_shard_dtype_is_refused(plain, tmp_path):
    root = edit(plain[0], tmp_path, add={"model.norm.weight": torch.ones(64).to(torch.float8_e4m3fn)})
    expect_error(root, tmp_path, "tensor model.norm.weight has dtype F8_E4M3; kdtr imports BF16/F16/F32/F64 "
                                 "weights and I32/I64 INT4 metadata only")
