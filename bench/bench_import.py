"""Peak memory and throughput of `kdtr import` on a synthetic multi-shard INT4 checkpoint.

Claim under test: importing N shards never holds more than one tensor (the largest, memory-mapped)
plus the writer's buffers. A checkpoint of a DeepseekV3 config with K2.6's layout (routed experts INT4
pack-quantized with bf16 scales, everything else bf16, gate bias fp32) is written with random bytes (import
does no math), split over --shards files; the import runs in a fresh child process that reports its peak RSS
(VmHWM, which counts memory-mapped file pages) above its RSS just before the import.

    python bench/bench_import.py --shards 8            # ~0.5 GB checkpoint, largest tensor 64 MiB
    python bench/bench_import.py --shards 4 --small    # ~125 MiB, largest tensor 16 MiB (tests/test_import_memory.py)
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

MiB = 1 << 20
ST_DTYPE = {"bfloat16": "BF16", "float32": "F32", "int32": "I32", "int64": "I64"}
ITEMSIZE = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8}


def bench_config(small: bool):
    from refmodel.config import PRESETS
    big = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
               num_hidden_layers=9, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64,
               qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, num_experts_per_tok=4)
    if small:
        big.update(vocab_size=8192, num_hidden_layers=5, n_routed_experts=16)
    return dataclasses.replace(PRESETS["tiny"], **big)


def checkpoint_tensors(cfg, group_size=32):
    """[(name, safetensors dtype, shape)] of a K2.6-layout checkpoint of cfg (INT4 routed experts)."""
    from refmodel.quant import is_quantized
    from refmodel.weights import expected_shapes
    out = []
    for name, shape in expected_shapes(cfg).items():
        module = name[: -len(".weight")]
        if name.endswith(".weight") and is_quantized(module, "experts"):
            out += [(module + ".weight_packed", "I32", (shape[0], shape[1] // 8)),
                    (module + ".weight_scale", "BF16", (shape[0], shape[1] // group_size)),
                    (module + ".weight_shape", "I64", (2,))]
        else:
            out.append((name, "F32" if name.endswith("e_score_correction_bias") else "BF16", shape))
    return out


def _hf_config(cfg, group_size: int) -> dict:
    d = dict(cfg.to_dict())
    rope = dict(d.pop("rope_scaling"), rope_type="yarn", rope_theta=d.pop("rope_theta"))
    d.update(rope_parameters=rope, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
             quantization_config={
                 "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                     "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
                     "dynamic": False, "actorder": None, "observer": "minmax"},
                     "input_activations": None, "output_activations": None}}})
    d.pop("latent_norm_eps")
    return d


def write_checkpoint(root: str, cfg, n_shards: int, seed: int = 0) -> dict:
    """Write config.json, n_shards safetensors files (balanced by bytes) and the index; return sizes."""
    tensors = checkpoint_tensors(cfg)
    sizes = [ITEMSIZE[dt] * int(np.prod(shape)) for _, dt, shape in tensors]
    target = sum(sizes) / n_shards
    shards, current, acc = [], [], 0
    for t, size in zip(tensors, sizes):
        if current and acc + size > target and len(shards) < n_shards - 1:
            shards.append(current)
            current, acc = [], 0
        current.append(t)
        acc += size
    shards.append(current)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(os.path.join(root, fname), group, rng)
        weight_map.update({name: fname for name, _, _ in group})
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    with open(os.path.join(root, "config.json"), "w") as fh:
        json.dump(_hf_config(cfg, 32), fh)
    return {"shards": len(shards), "total_bytes": sum(sizes), "largest_tensor_bytes": max(sizes),
            "largest_shard_bytes": max(sum(ITEMSIZE[dt] * int(np.prod(s)) for _, dt, s in g) for g in shards)}


def _write_shard(path: str, group, rng) -> None:
    header, offset = {}, 0
    for name, dt, shape in group:
        n = ITEMSIZE[dt] * int(np.prod(shape))
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for name, dt, shape in group:
            if dt == "I64":                                   # weight_shape: must hold the logical shape
                out_dim, packed = next(s for n, _, s in group if n == name[: -len("shape")] + "packed")
                fh.write(np.array([out_dim, packed * 8], "<i8").tobytes())
            else:                                             # import copies bytes: any bits will do
                fh.write(rng.bytes(ITEMSIZE[dt] * int(np.prod(shape))))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(ckpt: str, out: str) -> None:
    """Import in this (fresh) process and print its memory figures as JSON."""
    from refmodel.checkpoint import import_checkpoint
    import kdtr_format  # noqa: F401  (everything imported before the baseline)
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")                                     # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    summary = import_checkpoint(ckpt, out)
    seconds = time.perf_counter() - t0
    print(json.dumps({"baseline_rss_bytes": base * 1024, "peak_rss_bytes": _status_kib("VmHWM") * 1024,
                      "hwm_reset": reset, "seconds": seconds, "bytes_read": summary.bytes_read}))


def run(n_shards: int, small: bool, workdir: str) -> dict:
    cfg = bench_config(small)
    ckpt = os.path.join(workdir, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    sizes = write_checkpoint(ckpt, cfg, n_shards)
    out = os.path.join(workdir, "model.kdtr")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", ckpt, out], cwd=repo,
                          capture_output=True, text=True, check=True)
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    figures.update(sizes)
    figures["peak_above_baseline_bytes"] = figures["peak_rss_bytes"] - figures["baseline_rss_bytes"]
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="~125 MiB checkpoint (the test size)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    ap.add_argument("--child", nargs=2, metavar=("CKPT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as workdir:
        f = run(args.shards, args.small, workdir)
    if args.json:
        print(json.dumps(f))
        return
    print(f"kdtr import: {f['shards']} shards, {f['total_bytes'] / MiB:.1f} MiB, largest tensor "
          f"{f['largest_tensor_bytes'] / MiB:.1f} MiB, largest shard {f['largest_shard_bytes'] / MiB:.1f} MiB")
    print(f"  peak RSS {f['peak_rss_bytes'] / MiB:.1f} MiB = baseline {f['baseline_rss_bytes'] / MiB:.1f} MiB "
          f"+ {f['peak_above_baseline_bytes'] / MiB:.1f} MiB during import "
          f"({f['peak_above_baseline_bytes'] / f['largest_tensor_bytes']:.2f}x the largest tensor, "
          f"{f['peak_above_baseline_bytes'] / f['total_bytes']:.2f}x the checkpoint; VmHWM reset: {f['hwm_reset']})")
    print(f"  {f['seconds']:.2f} s, {f['bytes_read'] / MiB / f['seconds']:.0f} MiB/s")


if __name__ == "__main__":
    main()
