"""Import a HF-layout Kimi K2.x / DeepseekV3 checkpoint into one .kdtr model file, and load it back.

Input (docs/model.md §1, docs/int4.md): config.json (plain, or the K2.5/K2.6 wrapper with `text_config`
whose tensors carry a `language_model.` prefix; `vision_tower.*` / `mm_projector.*` are dropped), and one
`model.safetensors` or shards listed by `model.safetensors.index.json`. Tensors are BF16/F16/F32, and
compressed-tensors "pack-quantized" INT4 linears (`<m>.weight_packed` int32 [out, in/8], `<m>.weight_scale`
[out, in/g], `<m>.weight_shape` int32/int64 [2]).

Output: every dense tensor byte-for-byte in its own dtype (bf16 as raw bits); every INT4 linear as
`<m>.qw` (the packed words, int4_shape = weight_shape) and `<m>.sc` (the scales, bf16 kept raw): no
dequantization on import. Metadata: "config" (ModelConfig.to_dict()), "quantization" (refmodel.quant's
description plus the checkpoint's own quantization_config) and "provenance".

Streaming: safetensors headers are parsed here (json + np.memmap, no torch, no safetensors library); all
headers are validated against refmodel.weights.expected_shapes before a byte is written, then tensors go
shard by shard, in file order, one memory-mapped tensor at a time into the streaming writer. Peak memory
is one tensor's mapped pages plus the writer's buffers (bench/bench_import.py measures it).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from kdtr_format import Tensor, open_kdtr, write_kdtr
from kdtr_format.paths import open_regular
from refmodel.config import ModelConfig
from refmodel.quant import SCOPES, is_quantized, quant_config
from refmodel.stored import StoredWeights
from refmodel.weights import expected_shapes

PREFIX = "language_model."                          # K2.5 / K2.6 wrapper prefix of the text model
DROPPED_PREFIXES = ("vision_tower.", "mm_projector.")
MAX_SAFETENSORS_HEADER = 100 << 20                  # the reference implementation's own limit
ST_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
             "I32": np.dtype("<i4"), "I64": np.dtype("<i8")}
KDTR_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I32": "int32"}
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
INT4_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
UNSUPPORTED_INT4_SUFFIXES = ("weight_zero_point", "weight_g_idx")


class CheckpointError(Exception):
    """The checkpoint is unreadable, does not match its config, or uses a scheme kdtr does not support.
    The message names the file or tensor and the fix; `kdtr import` prints it and exits 5."""


@dataclass(frozen=True)
class StEntry:
    """One tensor in a safetensors shard (absolute byte offset of its data)."""
    path: str
    key: str                # the name on disk (with any language_model. prefix)
    dtype: str              # safetensors dtype string
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ImportSummary:
    out_path: str
    shards: int
    tensors: int            # tensors written
    int4_linears: int
    dense: int
    dropped: int            # vision_tower / mm_projector tensors skipped
    bytes_read: int
    quantization: dict | None


# ---------------------------------------------------------------- safetensors headers

def read_safetensors_header(path: str) -> list[StEntry]:
    """Entries of one shard, in data order, with every offset and size checked against the file."""
    size = os.path.getsize(path)
    with open_regular(path, "safetensors shard") as fh:
        raw_len = fh.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw_len, "little")
        if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: safetensors header length {n} is impossible for a {size}-byte "
                                  f"file; the shard is truncated or not safetensors")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    entries = []
    for key, e in header.items():
        if key == "__metadata__":
            continue
        entries.append(_entry(path, key, e, 8 + n, size))
    entries.sort(key=lambda e: e.offset)
    for a, b in zip(entries, entries[1:]):
        if b.offset < a.offset + a.nbytes:
            raise CheckpointError(f"{path}: tensors {a.key} and {b.key} overlap; the shard is corrupt")
    return entries


def _entry(path: str, key: str, e, data_start: int, size: int) -> StEntry:
    try:
        dtype, shape, (begin, end) = e["dtype"], tuple(int(d) for d in e["shape"]), e["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: tensor {key}: malformed safetensors entry {e!r}") from None
    if dtype not in ST_DTYPES:
        raise CheckpointError(f"{path}: tensor {key} has dtype {dtype}; kdtr imports BF16/F16/F32/F64 weights "
                              f"and I32/I64 INT4 metadata only (FP8 checkpoints such as K2-Instruct are not "
                              f"supported: use an INT4 or BF16 release)")
    nbytes = ST_DTYPES[dtype].itemsize * int(np.prod(shape, dtype=object))
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
            and end - begin == nbytes and data_start + end <= size):
        raise CheckpointError(f"{path}: tensor {key}: data_offsets [{begin}, {end}] do not fit dtype {dtype} "
                              f"shape {list(shape)} inside the {size}-byte file; the shard is corrupt or truncated")
    return StEntry(path, key, dtype, shape, data_start + begin, nbytes)


def _load(e: StEntry) -> np.ndarray:
    """The tensor's data as a read-only memory map (the pages are read as the writer consumes them)."""
    if e.nbytes == 0:
        return np.zeros(e.shape, ST_DTYPES[e.dtype])
    return np.memmap(e.path, dtype=ST_DTYPES[e.dtype], mode="r", offset=e.offset, shape=e.shape)


# ---------------------------------------------------------------- checkpoint layout

def read_config(ckpt_dir: str) -> tuple[dict, ModelConfig, dict | None]:
    """(config.json as a dict, the text model's ModelConfig, the quantization_config or None)."""
    path = os.path.join(ckpt_dir, "config.json")
    try:
        with open_regular(path, "config.json") as fh:   # a FIFO here would block forever
            raw = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir}: no config.json; point kdtr import at a HF checkpoint directory") \
            from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    text = raw.get("text_config", raw)
    try:
        cfg = ModelConfig.from_hf(raw)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return raw, cfg, text.get("quantization_config", raw.get("quantization_config"))


def shard_paths(ckpt_dir: str) -> list[str]:
    """Shard files in order: those named by model.safetensors.index.json, else model.safetensors."""
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open_regular(index, "checkpoint index") as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map; the index is damaged")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(ckpt_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{ckpt_dir}: neither model.safetensors nor model.safetensors.index.json")
    paths = [os.path.join(ckpt_dir, f) for f in files]
    for p in paths:
        if not os.path.exists(p):
            raise CheckpointError(f"{p}: shard named by model.safetensors.index.json is missing")
    return paths


def inventory(paths: list[str]) -> tuple[dict[str, StEntry], int]:
    """Text-model name (prefix stripped) -> entry over all shards, and the count of dropped vision tensors."""
    found, dropped = {}, 0
    for path in paths:
        for e in read_safetensors_header(path):
            name = e.key[len(PREFIX):] if e.key.startswith(PREFIX) else e.key
            if e.key.startswith(DROPPED_PREFIXES):
                dropped += 1
                continue
            if name in found:
                raise CheckpointError(f"tensor {e.key} appears twice: in {found[name].path} and {path}")
            found[name] = e
    return found, dropped


def check_quantization_config(qc: dict | None, has_int4: bool) -> int | None:
    """The group size of a supported compressed-tensors W4A16 config (None when unquantized)."""
    if qc is None:
        if has_int4:
            raise CheckpointError("config.json has no quantization_config but the shards hold INT4 "
                                  "weight_packed tensors; the config does not belong to these weights")
        return None
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"unsupported quantization_config: quant_method {qc.get('quant_method')!r}; kdtr "
                              f"imports compressed-tensors pack-quantized INT4 (W4A16) only")
    sizes = set()
    for gname, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "dynamic": False}
        bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
        if fmt != "pack-quantized":
            bad["format"] = fmt
        if w.get("actorder") not in (None, False):
            bad["actorder"] = w.get("actorder")
        if group.get("input_activations") is not None or group.get("output_activations") is not None:
            bad["activations"] = "quantized"
        if bad or not isinstance(w.get("group_size"), int) or w["group_size"] <= 0:
            raise CheckpointError(
                f"unsupported quantization_config: config_groups.{gname} has {bad or {'group_size': w.get('group_size')}};"
                f" kdtr supports weights {{num_bits: 4, type: int, symmetric: true, strategy: group, "
                f"group_size: N, dynamic: false, actorder: null}}, format pack-quantized, unquantized activations")
        sizes.add(w["group_size"])
    if len(sizes) != 1:
        raise CheckpointError(f"unsupported quantization_config: need exactly one weight group size, got "
                              f"{sorted(sizes) or 'no config_groups'}")
    return sizes.pop()


def plan(cfg: ModelConfig, found: dict[str, StEntry], group_size: int | None) -> tuple[list, str | None]:
    """Validate every tensor against expected_shapes(cfg); return the INT4 modules (sorted) and their scope."""
    expected = expected_shapes(cfg)
    unknown = [n for n in found if n not in expected and not n.endswith(INT4_SUFFIXES)]
    for n in found:
        if n.endswith(UNSUPPORTED_INT4_SUFFIXES):
            raise CheckpointError(f"tensor {found[n].key}: asymmetric or act-order INT4 ({n.rsplit('.', 1)[1]}) "
                                  f"is not supported; kdtr imports symmetric pack-quantized INT4 only")
    if unknown:
        raise CheckpointError(f"unknown tensor {found[unknown[0]].key} ({len(unknown)} unknown in all): not a "
                              f"tensor of this config's DeepseekV3 text model")
    int4 = set()
    for name, shape in expected.items():
        module = name[: -len(".weight")]
        if name in found:
            _check_dense(found[name], shape)
        elif name.endswith(".weight") and module + ".weight_packed" in found:
            _check_int4(module, found, shape, group_size)
            int4.add(module)
        else:
            missing = [n for n in expected if n not in found and n[: -len('.weight')] + '.weight_packed' not in found]
            raise CheckpointError(f"missing tensor {name} ({len(missing)} missing in all): the checkpoint does "
                                  f"not hold every weight its config.json describes")
    leftovers = [n for n in found if n.endswith(INT4_SUFFIXES) and n.rsplit(".", 1)[0] not in int4]
    if leftovers:
        raise CheckpointError(f"unknown tensor {found[leftovers[0]].key}: INT4 parts without a matching "
                              f"weight_packed of an expected linear")
    return _scope(cfg, int4)


def _check_dense(e: StEntry, shape: tuple) -> None:
    if e.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {e.key} has dtype {e.dtype}; dense weights must be BF16, F16, F32 or F64")
    if e.shape != tuple(shape):
        raise CheckpointError(f"shape mismatch for tensor {e.key}: checkpoint {list(e.shape)}, config.json "
                              f"implies {list(shape)}")


def _check_int4(module: str, found: dict, shape: tuple, group_size: int | None) -> None:
    if group_size is None:
        raise CheckpointError(f"tensor {found[module + '.weight_packed'].key}: INT4 weights but no "
                              f"quantization_config in config.json")
    for suffix in INT4_SUFFIXES:
        if module + "." + suffix not in found:
            raise CheckpointError(f"missing tensor {found[module + '.weight_packed'].key[:-len('weight_packed')]}"
                                  f"{suffix}: every weight_packed needs weight_scale and weight_shape")
    packed, scale, wshape = (found[module + "." + s] for s in INT4_SUFFIXES)
    out_dim, in_dim = shape
    if wshape.dtype not in ("I32", "I64") or wshape.shape != (2,) \
            or [int(v) for v in _load(wshape)] != [out_dim, in_dim]:
        got = [int(v) for v in _load(wshape)] if wshape.dtype in ("I32", "I64") else wshape.dtype
        raise CheckpointError(f"shape mismatch for tensor {wshape.key}: holds {got}, config.json implies "
                              f"[{out_dim}, {in_dim}] (int32 or int64)")
    if in_dim % group_size or in_dim % 8:
        raise CheckpointError(f"tensor {packed.key}: input dim {in_dim} is not a multiple of group_size "
                              f"{group_size} and of 8; compressed-tensors padding is not supported")
    if packed.dtype != "I32" or packed.shape != (out_dim, in_dim // 8):
        raise CheckpointError(f"shape mismatch for tensor {packed.key}: checkpoint {packed.dtype} "
                              f"{list(packed.shape)}, expected I32 [{out_dim}, {in_dim // 8}]")
    if scale.dtype not in ("BF16", "F16", "F32") or scale.shape != (out_dim, in_dim // group_size):
        raise CheckpointError(f"shape mismatch for tensor {scale.key}: checkpoint {scale.dtype} "
                              f"{list(scale.shape)}, expected BF16/F16/F32 [{out_dim}, {in_dim // group_size}] "
                              f"(group_size {group_size})")


def _scope(cfg: ModelConfig, int4: set[str]) -> tuple[list, str | None]:
    if not int4:
        return sorted(int4), None
    linears = [n[: -len(".weight")] for n in expected_shapes(cfg) if n.endswith("_proj.weight")]
    for scope in SCOPES:
        if int4 == {m for m in linears if is_quantized(m, scope)}:
            return sorted(int4), scope
    odd = sorted(int4 ^ {m for m in linears if is_quantized(m, "experts")})
    raise CheckpointError(f"unsupported INT4 module set: {odd[0]} (and {len(odd) - 1} more) differ from the "
                          f"supported scopes experts (routed experts, as K2.6) and mlp (+ shared and dense MLP)")


# ---------------------------------------------------------------- import / load

def import_checkpoint(ckpt_dir, out_path, progress=None) -> ImportSummary:
    """Validate the whole checkpoint, then stream it into out_path (.kdtr). progress(done_bytes, total_bytes)
    is called after each tensor."""
    ckpt_dir, out_path = os.fspath(ckpt_dir), os.fspath(out_path)
    raw_cfg, cfg, qc = read_config(ckpt_dir)
    paths = shard_paths(ckpt_dir)
    found, dropped = inventory(paths)
    has_int4 = any(n.endswith(".weight_packed") for n in found)
    group_size = check_quantization_config(qc, has_int4)
    int4, scope = plan(cfg, found, group_size)
    int4_set = set(int4)
    total = sum(e.nbytes for e in found.values())   # ImportSummary.bytes_read
    quantization = None
    if scope is not None:
        scale_dtype = KDTR_DTYPE[found[int4[0] + ".weight_scale"].dtype]
        quantization = dict(quant_config(scope, group_size), scale_dtype=scale_dtype, source=qc)
    metadata = {
        "kind": "model",
        "config": cfg.to_dict(),
        "quantization": quantization,
        "provenance": _provenance(ckpt_dir, raw_cfg, paths, dropped),
    }
    write_kdtr(out_path, stored_tensors(found, int4_set, paths, progress), metadata)
    written = len(found) - len(int4)
    return ImportSummary(out_path, len(paths), written, len(int4), written - 2 * len(int4), dropped, total,
                         quantization)


def stored_tensors(found: dict[str, StEntry], int4_set: set, paths: list[str], progress=None):
    """(kdtr name, Tensor) of every entry as a model file stores it, shard by shard in file order: dense
    tensors in their own dtype, INT4 as `.qw` (int4_shape from weight_shape) and `.sc`; each one memory-mapped
    only while the writer consumes it. progress(done_bytes, total_bytes) after each."""
    total, done = sum(e.nbytes for e in found.values()), 0
    for e in sorted(found.values(), key=lambda e: (paths.index(e.path), e.offset)):
        name = e.key[len(PREFIX):] if e.key.startswith(PREFIX) else e.key
        module, _, suffix = name.rpartition(".")
        if module in int4_set and suffix == "weight_shape":
            pass                                            # recorded as the .qw's int4_shape
        elif module in int4_set and suffix == "weight_packed":
            yield module + ".qw", Tensor(_load(e), int4_shape=(e.shape[0], e.shape[1] * 8))
        elif module in int4_set:
            yield module + ".sc", Tensor(_load(e), dtype=KDTR_DTYPE[e.dtype])
        else:
            yield name, Tensor(_load(e), dtype=KDTR_DTYPE[e.dtype])
        done += e.nbytes
        if progress is not None:
            progress(done, total)


def _provenance(ckpt_dir: str, raw_cfg: dict, paths: list[str], dropped: int) -> dict:
    with open(os.path.join(ckpt_dir, "config.json"), "rb") as fh:
        config_sha = hashlib.sha256(fh.read()).hexdigest()
    return {
        "importer": "kdtr import (refmodel.checkpoint.import_checkpoint)",
        "source_dir": os.path.abspath(ckpt_dir),
        "config_sha256": config_sha,
        "architectures": raw_cfg.get("architectures"),
        "model_type": raw_cfg.get("model_type"),
        "text_model_type": raw_cfg.get("text_config", {}).get("model_type"),
        "shards": [{"file": os.path.basename(p), "bytes": os.path.getsize(p)} for p in paths],
        "dropped_tensors": dropped,
        "name_prefix_stripped": PREFIX if "text_config" in raw_cfg else None,
    }


def load_model(path, dtype=np.float64) -> tuple[ModelConfig, StoredWeights]:
    """(cfg, W) from an imported .kdtr: every tensor memory-mapped as stored (bf16 raw, INT4 `.qw`/`.sc`
    packed) and upcast to `dtype` one tensor at a time as a forward reads it (refmodel/stored.py), so a
    real checkpoint never has to fit in memory in float64. `dequantize_model(W)` still gives the dense
    float64 dict (for a small model)."""
    with open_kdtr(path) as f:
        if "config" not in f.metadata:
            raise CheckpointError(f"{path}: no 'config' in the metadata; not a model file from kdtr import")
        cfg = ModelConfig.from_dict(f.metadata["config"])
        return cfg, StoredWeights.from_kdtr(f, dtype, skip=())    # the views outlive the closed file
