"""The first N layers of a HF-layout checkpoint, read straight from its shards (`kdtr gen --from-checkpoint DIR
--layers N`, `kdtr import DIR --layers N`; docs/golden-bundles.md, "Goldens from a checkpoint").

The truncated model is what every serving engine runs when config.json's `num_hidden_layers` is set to N:
the embedding, layers 0..N-1, the final norm and the lm_head. It is read without a copy of the checkpoint,
in memory or on disk:

- the index (`model.safetensors.index.json`) names the shards that hold the truncated model's tensors; only
  those shards' headers are read, and every other tensor (layers N.., an MTP layer, a vision tower) is never
  touched;
- those tensors are checked against the truncated config exactly as `kdtr import` checks a whole checkpoint
  (refmodel.checkpoint.plan), then each becomes a `refmodel.stored.Mapped` entry of a StoredWeights: a lookup
  maps that one tensor, upcasts it (bf16 widened, INT4 dequantized exactly) for one matmul and drops the
  map. The reference therefore holds one tensor in float64 at a time, and an INT4 expert is dequantized only
  when a forward routes a token to it;
- provenance: the sha256 of config.json and of the index, and of every tensor the truncated model reads, by
  its name in the checkpoint (hashed with plain reads a chunk at a time, so hashing maps nothing).

Dense BF16 tensors stay raw bf16 bits (as the bundle stores them), F32 stay F32, F16 and F64 are read as
float32 (F16 exactly; F64 rounded once, as every kdtr bundle stores a non-bf16 dense weight), and the goldens
are computed on those stored values.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from kdtr_format.paths import open_regular
from kdtr_format import write_kdtr
from refmodel.checkpoint import (DROPPED_PREFIXES, KDTR_DTYPE, PREFIX, ST_DTYPES, CheckpointError, ImportSummary,
                                 StEntry, check_quantization_config, plan, read_config, read_safetensors_header,
                                 stored_tensors)
from refmodel.config import ModelConfig
from refmodel.quant import quant_config
from refmodel.stored import Mapped, StoredWeights
from refmodel.weights import expected_shapes

INDEX = "model.safetensors.index.json"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
HASH_CHUNK = 16 << 20           # bytes per read while hashing a tensor


class LayersError(CheckpointError):
    """--layers is not 1..num_hidden_layers of the checkpoint (a usage error: exit 2)."""


def layer_of(name: str) -> int | None:
    """The decoder layer a text-model tensor belongs to (None: embedding, final norm, lm_head)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def truncated_config(cfg: ModelConfig, layers: int) -> ModelConfig:
    """cfg with num_hidden_layers = layers (first_k_dense_replace capped at it: the same dense layers)."""
    if not isinstance(layers, int) or not 1 <= layers <= cfg.num_hidden_layers:
        raise LayersError(f"--layers {layers}: the checkpoint has {cfg.num_hidden_layers} layers; pass "
                              f"1..{cfg.num_hidden_layers}")
    return dataclasses.replace(cfg, num_hidden_layers=layers,
                               first_k_dense_replace=min(cfg.first_k_dense_replace, layers))


@dataclass
class Truncated:
    """What `open_truncated` found: the truncated model's config and entries, and the checkpoint's facts."""
    ckpt_dir: str
    raw_config: dict
    full_config: ModelConfig
    cfg: ModelConfig                # num_hidden_layers = the truncation
    paths: list[str]                # the shards read (those holding a truncated-model tensor)
    found: dict[str, StEntry]       # text-model name -> entry, the truncated model's tensors only
    int4: list[str]                 # INT4 modules (sorted)
    scope: str | None
    group_size: int | None
    qc: dict | None                 # the checkpoint's quantization_config
    index_sha256: str | None
    dropped: int = 0                # vision_tower / mm_projector tensors the index lists (never read)

    @property
    def quantization(self) -> dict | None:
        if self.scope is None:
            return None
        scale_dtype = KDTR_DTYPE[self.found[self.int4[0] + ".weight_scale"].dtype]
        return dict(quant_config(self.scope, self.group_size), scale_dtype=scale_dtype, source=self.qc)


def open_truncated(ckpt_dir, layers: int) -> Truncated:
    """Read config, index and the needed shards' headers; validate the truncated model's tensors."""
    ckpt_dir = os.fspath(ckpt_dir)
    raw_cfg, full, qc = read_config(ckpt_dir)
    cfg = truncated_config(full, layers)
    files, index_sha, dropped = _needed_shards(ckpt_dir, layers)
    paths = [os.path.join(ckpt_dir, f) for f in files]
    found = {}
    for path in paths:
        for e in read_safetensors_header(path):
            name = e.key[len(PREFIX):] if e.key.startswith(PREFIX) else e.key
            if e.key.startswith(DROPPED_PREFIXES) or not _wanted(name, layers):
                continue
            if name in found:
                raise CheckpointError(f"tensor {e.key} appears twice: in {found[name].path} and {path}")
            found[name] = e
    has_int4 = any(n.endswith(".weight_packed") for n in found)
    group_size = check_quantization_config(qc, has_int4)
    int4, scope = plan(cfg, found, group_size)
    return Truncated(ckpt_dir, raw_cfg, full, cfg, paths, found, int4, scope, group_size, qc, index_sha, dropped)


def _wanted(name: str, layers: int) -> bool:
    l = layer_of(name)
    return l is None or l < layers


def _needed_shards(ckpt_dir: str, layers: int) -> tuple[list[str], str | None, int]:
    """The shard files holding a tensor of the first `layers` layers (or embedding, norm, head), in order,
    the index's sha256 (None for a one-file checkpoint) and how many vision tensors it lists."""
    index = os.path.join(ckpt_dir, INDEX)
    if not os.path.exists(index):
        if not os.path.exists(os.path.join(ckpt_dir, "model.safetensors")):
            raise CheckpointError(f"{ckpt_dir}: neither model.safetensors nor {INDEX}")
        return ["model.safetensors"], None, 0
    with open_regular(index, "checkpoint index") as fh:
        raw = fh.read()
    try:
        weight_map = json.loads(raw).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a JSON object with a weight_map ({e})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no weight_map; the index is damaged")
    files = set()
    for key, f in weight_map.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if not key.startswith(DROPPED_PREFIXES) and _wanted(name, layers):
            files.add(f)
    for f in sorted(files):
        if not os.path.exists(os.path.join(ckpt_dir, f)):
            raise CheckpointError(f"{os.path.join(ckpt_dir, f)}: shard named by {INDEX} is missing")
    dropped = sum(k.startswith(DROPPED_PREFIXES) for k in weight_map)
    return sorted(files), hashlib.sha256(raw).hexdigest(), dropped


# ---------------------------------------------------------------- the weights, mapped per lookup

def mapped_weights(t: Truncated, dtype=np.float64) -> StoredWeights:
    """The truncated model as a StoredWeights whose every tensor is a `Mapped` checkpoint tensor, in
    expected_shapes order (INT4 linears under their dense `<m>.weight` name)."""
    int4 = set(t.int4)
    dense, packed, order = {}, {}, []
    for name, shape in expected_shapes(t.cfg).items():
        module = name[: -len(".weight")]
        order.append(name)
        if module in int4:
            qw, sc = t.found[module + ".weight_packed"], t.found[module + ".weight_scale"]
            packed[name] = (_mapped(qw), _mapped(sc), tuple(shape))
        else:
            e = t.found[name]
            dense[name] = (_mapped(e), e.dtype == "BF16")
    return StoredWeights(dense, packed, order, dtype)


def _mapped(e: StEntry) -> Mapped:
    widen = np.float32 if e.dtype in ("F16", "F64") else None       # stored float32 (module docstring)
    return Mapped(e.path, ST_DTYPES[e.dtype], e.shape, e.offset, as_dtype=widen)


def float64_bytes(t: Truncated, names) -> int:
    """Bytes of these tensors (dense names, INT4 linears by `<m>.weight`) upcast to float64."""
    shapes = expected_shapes(t.cfg)
    return 8 * sum(int(np.prod(shapes[n], dtype=np.int64)) for n in names)


class LayerProgress:
    """A StoredWeights watch: progress("layer", l + 1, N + 1, None) when a forward reaches layer l (N + 1:
    the final norm and lm_head), so a long forward at real dimensions shows where it is."""

    def __init__(self, cfg: ModelConfig, progress):
        self.total, self.progress, self.last = cfg.num_hidden_layers + 1, progress, None

    def __call__(self, name: str) -> None:
        l = layer_of(name)
        step = self.total if name in ("model.norm.weight", "lm_head.weight") else (None if l is None else l + 1)
        if step is not None and step != self.last:
            self.last = step
            self.progress("layer", step, self.total, None)


# ---------------------------------------------------------------- provenance

def tensor_hashes(t: Truncated, progress=None) -> dict[str, str]:
    """sha256 of every truncated-model tensor's bytes in the checkpoint, by checkpoint key (prefix kept).
    progress("hash layer", done, total, None) per layer (the embedding and head count as one more)."""
    groups: dict[int, list[StEntry]] = {}
    for name, e in t.found.items():
        l = layer_of(name)
        groups.setdefault(t.cfg.num_hidden_layers if l is None else l, []).append(e)
    out = {}
    for done, l in enumerate(sorted(groups), 1):
        for e in sorted(groups[l], key=lambda e: (e.path, e.offset)):
            out[e.key] = _sha256(e)
        if progress:
            progress("hash layers", done, len(groups), None)
    return dict(sorted(out.items()))


def _sha256(e: StEntry) -> str:
    h = hashlib.sha256()
    with open(e.path, "rb") as fh:
        fh.seek(e.offset)
        left = e.nbytes
        while left:
            chunk = fh.read(min(HASH_CHUNK, left))
            if not chunk:
                raise CheckpointError(f"{e.path}: tensor {e.key} ends past the end of the file; the shard "
                                      f"changed while it was read")
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def provenance(t: Truncated, hashes: dict[str, str]) -> dict:
    with open(os.path.join(t.ckpt_dir, "config.json"), "rb") as fh:
        config_sha = hashlib.sha256(fh.read()).hexdigest()
    return {
        "checkpoint": os.path.basename(os.path.abspath(t.ckpt_dir)),
        "source_dir": os.path.abspath(t.ckpt_dir),
        "config_sha256": config_sha,
        "index_sha256": t.index_sha256,
        "truncation": {"num_hidden_layers": t.cfg.num_hidden_layers, "of": t.full_config.num_hidden_layers,
                       "kept": "embedding, layers 0..N-1, final norm, lm_head: the model an engine runs with "
                               "config.json num_hidden_layers = N"},
        "architectures": t.raw_config.get("architectures"),
        "model_type": t.raw_config.get("model_type"),
        "name_prefix_stripped": PREFIX if "text_config" in t.raw_config else None,
        "shards_read": [{"file": os.path.basename(p), "bytes": os.path.getsize(p)} for p in t.paths],
        "tensor_sha256": hashes,
    }


# ---------------------------------------------------------------- kdtr import --layers N

def import_truncated(ckpt_dir, out_path, layers: int, progress=None) -> ImportSummary:
    """The truncated model into a .kdtr model file (as `kdtr import` writes a whole checkpoint: dense
    tensors in their own dtype, INT4 kept packed), config num_hidden_layers = layers, provenance with the
    index and per-tensor hashes. progress(done_bytes, total_bytes) while writing."""
    t = open_truncated(ckpt_dir, layers)
    metadata = {"kind": "model", "config": t.cfg.to_dict(), "quantization": t.quantization,
                "provenance": dict(importer="kdtr import --layers (refmodel.truncate.import_truncated)",
                                   **provenance(t, tensor_hashes(t)))}
    write_kdtr(os.fspath(out_path), stored_tensors(t.found, set(t.int4), t.paths, progress), metadata)
    written = len(t.found) - len(t.int4)
    return ImportSummary(os.fspath(out_path), len(t.paths), written, len(t.int4), written - 2 * len(t.int4),
                         t.dropped, sum(e.nbytes for e in t.found.values()), t.quantization)
