"""Write a synthetic K2.6-layout checkpoint with NumPy alone (no torch, no safetensors library), at any size.

The layout is Kimi K2.6's (docs/int4.md, docs/model.md section 1): a K2.5/K2.6 wrapper config.json
(`text_config`, compressed-tensors W4A16 g32 `quantization_config`), the tensors under the `language_model.`
prefix in several safetensors shards named by `model.safetensors.index.json`, the routed experts as
`weight_packed` / `weight_scale` (bf16) / `weight_shape`, the gate bias float32, every other tensor bf16.
Values: embedding N(0, 1), linears N(0, 1/fan_in), norms U(0.9, 1.1), gate bias N(0, 0.1^2), each tensor from
its own seeded stream (PCG64([seed, tensor index])); the experts' INT4 codes uniform over the 16 levels with
one bf16 scale per row (U(0.5, 1.5) x 1/sqrt(fan_in) / rms(code)), drawn as random words: a valid W4A16
model of the right scale, made at disk speed (tests/test_gen_checkpoint.py quantizes with compressed-tensors
itself where the packing is what is tested). Because every tensor has its own stream and its place in its shard is
fixed before any value is drawn, tensors are written in parallel straight to their offsets (--jobs), which is
what makes K2.6's true dimensions (384 experts: 9.5 GB of INT4 per MoE layer) a few minutes' work.

    python bench/synth_checkpoint.py OUT --preset k26 --layers 4 --jobs 16      # 4 layers at K2.6's dims
    python bench/synth_checkpoint.py OUT --preset tiny --experts 512           # small dims, many experts
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdtr_format.int4 import bf16_bits, bf16_round  # noqa: E402
from refmodel.config import PRESETS, ModelConfig  # noqa: E402
from refmodel.quant import is_quantized  # noqa: E402
from refmodel.weights import expected_shapes  # noqa: E402

PREFIX = "language_model."
GROUP = 32
ITEMSIZE = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8}
ROWS = 4096                     # rows drawn at a time (bounded temporaries at any width)


def quantization_config() -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                "dynamic": False, "actorder": None, "observer": "minmax", "block_structure": None},
                "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"], "kv_cache_scheme": None}


def hf_text_config(cfg: ModelConfig) -> dict:
    d = dict(cfg.to_dict())
    rope = d.pop("rope_scaling")
    d.pop("latent_norm_eps")
    if rope is not None:
        d["rope_scaling"] = dict(rope)
    d.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], quantization_config=quantization_config())
    return d


def layout(cfg: ModelConfig) -> list[tuple[str, str, tuple, int, str]]:
    """[(checkpoint key, dtype, shape, tensor index, how to fill)] in expected_shapes order."""
    out = []
    for i, (name, shape) in enumerate(expected_shapes(cfg).items()):
        module = name[: -len(".weight")]
        if name.endswith(".weight") and is_quantized(module, "experts"):
            out += [(PREFIX + module + ".weight_packed", "I32", (shape[0], shape[1] // 8), i, "int4"),
                    (PREFIX + module + ".weight_scale", "BF16", (shape[0], shape[1] // GROUP), i, "int4"),
                    (PREFIX + module + ".weight_shape", "I64", (2,), i, "shape")]
        elif name.endswith("e_score_correction_bias"):
            out.append((PREFIX + name, "F32", shape, i, "bias"))
        elif name.endswith("norm.weight"):
            out.append((PREFIX + name, "BF16", shape, i, "norm"))
        else:
            out.append((PREFIX + name, "BF16", shape, i, "embed" if "embed_tokens" in name else "linear"))
    return out


def _nbytes(dt: str, shape: tuple) -> int:
    return ITEMSIZE[dt] * int(np.prod(shape))


def plan_shards(tensors: list, shard_bytes: int) -> list[list]:
    """Consecutive tensors into shards of about shard_bytes (an INT4 triple never split)."""
    shards, current, acc = [], [], 0
    for t in tensors:
        size = _nbytes(t[1], t[2])
        if current and acc + size > shard_bytes and not t[0].endswith(("weight_scale", "weight_shape")):
            shards.append(current)
            current, acc = [], 0
        current.append(t)
        acc += size
    shards.append(current)
    return shards


def _header(group: list) -> tuple[bytes, dict]:
    header, offsets, pos = {"__metadata__": {"format": "pt"}}, {}, 0
    for key, dt, shape, _, _ in group:
        n = _nbytes(dt, shape)
        header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets[key] = pos
        pos += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, {k: len(raw) + 8 + v for k, v in offsets.items()}


def _fill(job: tuple) -> int:
    """Write one tensor (an INT4 linear: its packed words and scales) at its offsets."""
    path, seed, index, kind, shape, offsets = job
    rng = np.random.Generator(np.random.PCG64([seed, index]))
    with open(path, "r+b") as fh:
        if kind == "shape":
            fh.seek(offsets[0])
            fh.write(np.array(shape, "<i8").tobytes())
            return 16
        if kind in ("bias", "norm"):
            v = rng.normal(0.0, 0.1, shape) if kind == "bias" else rng.uniform(0.9, 1.1, shape)
            data = v.astype("<f4") if kind == "bias" else bf16_bits(bf16_round(v.astype(np.float32)))
            fh.seek(offsets[0])
            fh.write(np.ascontiguousarray(data).tobytes())
            return data.nbytes
        out_dim, in_dim = shape
        std = 1.0 if kind == "embed" else 1.0 / np.sqrt(in_dim)
        for r in range(0, out_dim, ROWS):
            rows = min(ROWS, out_dim - r)
            if kind == "int4":
                # codes uniform over the 16 levels (mean -1/2, variance 85/4): random words; one scale per row
                # (U(0.5, 1.5) around std / rms(q), bf16) repeated over its groups: W ~ std in every row
                qw = rng.integers(0, 2**32, size=(rows, in_dim // 8), dtype=np.uint32)
                row_scale = rng.uniform(0.5, 1.5, size=(rows, 1)) * std / np.sqrt(85 / 4 + 1 / 4)
                sc = np.repeat(bf16_bits(bf16_round(row_scale).astype(np.float32)), in_dim // GROUP, axis=1)
                fh.seek(offsets[0] + r * (in_dim // 8) * 4)
                fh.write(qw.astype("<u4").tobytes())
                fh.seek(offsets[1] + r * (in_dim // GROUP) * 2)
                fh.write(np.ascontiguousarray(sc, "<u2").tobytes())
            else:
                w = rng.standard_normal((rows, in_dim), dtype=np.float32) * np.float32(std)
                fh.seek(offsets[0] + r * in_dim * 2)
                fh.write(bf16_bits(bf16_round(w)).tobytes())
    return _nbytes("BF16", shape)


def write_checkpoint(root: str, cfg: ModelConfig, seed: int = 0, shard_bytes: int = 5 << 30, jobs: int = 1) -> dict:
    """Write config.json, the shards and the index under root; return a summary."""
    os.makedirs(root, exist_ok=True)
    tensors = layout(cfg)
    shards = plan_shards(tensors, shard_bytes)
    weight_map, work = {}, []
    for s, group in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        path = os.path.join(root, fname)
        head, offsets = _header(group)
        with open(path, "wb") as fh:
            fh.write(head)
            fh.truncate(len(head) + sum(_nbytes(t[1], t[2]) for t in group))
        weight_map.update({t[0]: fname for t in group})
        by_index: dict[int, list] = {}
        for key, dt, shape, i, kind in group:
            by_index.setdefault(i, []).append((key, shape, kind))
        for i, parts in by_index.items():
            kinds = {k for _, _, k in parts}
            if "int4" in kinds:                       # packed + scale together, shape on its own
                packed = next(p for p in parts if p[0].endswith("weight_packed"))
                scale = next(p for p in parts if p[0].endswith("weight_scale"))
                full = (packed[1][0], packed[1][1] * 8)
                work.append((path, seed, i, "int4", full, (offsets[packed[0]], offsets[scale[0]])))
            for key, shape, kind in parts:
                if kind == "shape":
                    full = next((p[1][0], p[1][1] * 8) for p in parts if p[0].endswith("weight_packed"))
                    work.append((path, seed, i, "shape", full, (offsets[key],)))
                elif kind != "int4":
                    work.append((path, seed, i, kind, shape, (offsets[key],)))
    work.sort(key=lambda j: -int(np.prod(j[4])))      # largest first: the pool stays busy to the end
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            written = sum(pool.map(_fill, work, chunksize=1))
    else:
        written = sum(map(_fill, work))
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": written}, "weight_map": weight_map}, fh)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": hf_text_config(cfg), "quantization_config": quantization_config()}
    with open(os.path.join(root, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    return {"shards": len(shards), "tensors": len(tensors),
            "bytes": sum(os.path.getsize(os.path.join(root, f)) for f in set(weight_map.values()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--preset", default="k26", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the preset's)")
    ap.add_argument("--experts", type=int, default=None, help="n_routed_experts (default: the preset's)")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    cfg = PRESETS[a.preset]
    change = {k: v for k, v in (("num_hidden_layers", a.layers), ("n_routed_experts", a.experts)) if v is not None}
    cfg = dataclasses.replace(cfg, **change)
    print(json.dumps(write_checkpoint(a.out, cfg, a.seed, int(a.shard_gb * 2**30), a.jobs)))


if __name__ == "__main__":
    main()
