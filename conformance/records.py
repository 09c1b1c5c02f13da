"""The records of a golden bundle and of a run dump: schema names, the layout of the per-prompt and
per-round records (docs/golden-bundles.md, docs/run-dump.md), their structural validation, and reading
and writing run dumps. Everything here is layout; nothing judges numbers or drives an engine."""
from __future__ import annotations

import numpy as np

from kdtr_format import KdtrError, Tensor, open_kdtr, write_kdtr
from refmodel.config import ModelConfig
from refmodel.drafter import DrafterConfig, drafter_shapes
from refmodel.weights import expected_shapes
from refmodel.ddtree import LIVE_BUDGET, Tree, live_records, offsets, ragged, visibility  # noqa: F401 - the records' one builder
from refmodel.model import tap_names

BUNDLE_SCHEMA = "kdtr-bundle/2"     # /2: decode-step attn_out, position_offsets, the long-position prompt
DUMP_SCHEMA = "kdtr-run-dump/1"
DUMP_ROUTING = ("held", "free")    # metadata "routing": how the run's expert sets were chosen
# LIVE_BUDGET (imported above, named beside live_records so that an engine can write it without importing
# conformance): optional in a run's live DDTree group (p{i}/ddtree_live/), the node budget the engine chose per
# round (a cost-aware budget, at most the bundle's), int64 [rounds] (docs/run-dump.md §5)


class BundleSchemaError(KdtrError):
    """A well-formed .kdtr file that is not a golden bundle of a schema this kdtr understands."""



def prompts_of(f) -> list[int]:
    return sorted(int(n.split("/")[1][1:]) for n in f.names if n.startswith("golden/p") and n.endswith("/prompt_ids"))


def check_schema(f, path: str) -> None:
    meta = f.metadata
    if meta.get("schema") is None and "config" in meta:
        raise BundleSchemaError(f"{path} is a model file (from `kdtr import`), not a golden bundle: make one "
                                f"from it with `kdtr gen --model {path} --out BUNDLE.kdtr`")
    if meta.get("schema") != BUNDLE_SCHEMA:
        raise BundleSchemaError(f"{path}: metadata schema is {meta.get('schema')!r}, expected {BUNDLE_SCHEMA!r}: "
                                f"not a golden bundle (or a newer one); regenerate it with the command in "
                                f"bundles/MANIFEST.md")
    for key in ("model_config", "tolerances", "taps", "ddtree", "position_offsets"):
        if key not in meta:
            raise BundleSchemaError(f"{path}: metadata lacks {key!r}; regenerate the bundle with `kdtr gen`")
    if not prompts_of(f):
        raise BundleSchemaError(f"{path}: no golden/p{{i}}/prompt_ids tensor; regenerate the bundle with `kdtr gen`")
    routing = meta["tolerances"].get("routing", "free") if isinstance(meta["tolerances"], dict) else "free"
    if routing not in ("free", "held"):
        raise BundleSchemaError(f"{path}: metadata tolerances.routing is {str(routing)[:40]!r}, must be \"held\" or "
                                f"\"free\" (or left out); regenerate the bundle with `kdtr gen`")
    offs = meta["position_offsets"]
    if not (isinstance(offs, list) and len(offs) > max(prompts_of(f))
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)):
        raise BundleSchemaError(f"{path}: metadata position_offsets must list one integer >= 0 per prompt, got "
                                f"{str(offs)[:80]}; regenerate the bundle with `kdtr gen`")
    check_tensors(f, path)


# The per-prompt records besides the numeric goldens (numeric_keys), as conformance/gen/gen.py writes them.
PROMPT_RECORDS = ("prompt_ids", "ar/tokens", "ar/margins")
DDTREE_RECORDS = tuple(f"ddtree/{k}" for k in (
    "tokens", "round_start", "round_bonus", "round_accepted_depth", "tree_offsets", "tree_tokens", "tree_parents",
    "tree_depths", "tree_ranks", "verify_argmax", "accepted_offsets", "accepted", "counters"))


def check_tensors(f, path: str) -> None:
    """Every tensor is one the bundle's schema names, from its metadata alone and before any byte is read
    or hashed: the target's weights at the shapes of model_config (INT4 `.qw`/`.sc` for a quantized
    linear), the drafter's at drafter_config's, and per prompt its golden records. A tensor outside these
    (a declared 1 TiB extra, say) is refused at once, not hashed for an hour."""
    meta = f.metadata
    try:
        cfg = ModelConfig.from_dict(meta["model_config"])
        weights = expected_shapes(cfg)
        drafter = drafter_shapes(DrafterConfig.from_dict(meta["drafter_config"])) if "drafter_config" in meta else {}
        ar_taps = list(meta["taps"]["ar"])
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise BundleSchemaError(f"{path}: metadata model_config, drafter_config or taps is not valid ({e}); "
                                f"regenerate the bundle with `kdtr gen`") from None
    golden = {*PROMPT_RECORDS, *DDTREE_RECORDS, *numeric_keys(cfg, ar_taps)}
    prompts = set(prompts_of(f))
    for name in f.names:
        info, why = f.info(name), None
        if name.startswith("golden/"):
            p, _, key = name[len("golden/"):].partition("/")
            if not (p[:1] == "p" and p[1:].isdigit() and int(p[1:]) in prompts and key in golden):
                why = "is no golden record of this bundle's prompts and taps"
        elif name in weights or name in drafter:
            want = weights.get(name, drafter.get(name))
            if info.shape != want:
                why = f"has shape {list(info.shape)}, but the metadata's config says {list(want)}"
        elif name.endswith((".qw", ".sc")) and name[:-3] + ".weight" in weights:
            out, inp = weights[name[:-3] + ".weight"]
            ok = (info.int4_shape == (out, inp) if name.endswith(".qw") else
                  len(info.shape) == 2 and info.shape[0] == out and 0 < info.shape[1] <= inp and inp % info.shape[1] == 0)
            why = None if ok else f"does not pack the [{out}, {inp}] weight of the metadata's config"
        else:
            why = "is not a weight of the metadata's model_config or drafter_config, nor a golden record"
        if why:
            raise BundleSchemaError(f"{path}: tensor {name!r} ({info.nbytes} bytes) {why}; regenerate the "
                                    f"bundle with `kdtr gen` (docs/golden-bundles.md lists a bundle's records)")


def position_offset(f, i: int) -> int:
    """Position of prompt i's first token: its prompt, decode and tree positions are this plus the cache
    row (docs/golden-bundles.md). 0 for an ordinary prompt; large for the long-position prompt."""
    return int(f.metadata["position_offsets"][i])


def numeric_keys(cfg: ModelConfig, ar_taps) -> list[str]:
    """Golden keys relative to golden/p{i}/, in execution order."""
    keys = [f"prefill/L{l}/{t}" for l in range(cfg.num_hidden_layers) for t in tap_names(cfg, l)]
    keys += ["prefill/final_hidden", "prefill/logits", "ar/logits"]
    keys += [f"ar/L{l}/{t}" for l in range(cfg.num_hidden_layers) for t in tap_names(cfg, l) if t in ar_taps]
    return keys


def golden_tree(f, p: str, r: int) -> Tree:
    """Round r's tree from the ragged golden records (row 0 = root)."""
    o = f[p + "ddtree/tree_offsets"]
    lo, hi = int(o[r]), int(o[r + 1])
    tokens = np.asarray(f[p + "ddtree/tree_tokens"][lo + 1:hi], np.int64)
    parents = np.asarray(f[p + "ddtree/tree_parents"][lo:hi], np.int64)
    depths = np.asarray(f[p + "ddtree/tree_depths"][lo + 1:hi], np.int64)
    child_maps = [{} for _ in range(len(tokens) + 1)]
    for i in range(1, len(tokens) + 1):
        child_maps[parents[i]][int(tokens[i - 1])] = i
    ranks = np.asarray(f[p + "ddtree/tree_ranks"][lo + 1:hi], np.int64)
    return Tree(tokens, depths, parents, child_maps, visibility(parents), ranks, np.zeros(len(tokens)))


# ---------------------------------------------------------------- run dumps

def read_dump(path: str) -> tuple[dict, str]:
    """A run dump's outputs (run-dump names; bfloat16 records as raw uint16 bit patterns, as a live
    engine returns them) and the engine's compute dtype. A golden bundle given as the dump stands for its
    own goldens (to judge a regenerated bundle against a committed one)."""
    with open_kdtr(path, verify=True, private=True) as d:   # private: a dump cut meanwhile is an error, not SIGBUS
        meta = d.metadata
        if meta.get("schema") == BUNDLE_SCHEMA:                      # a regenerated bundle: its goldens
            return bundle_as_outputs(d), "float32"
        if meta.get("schema") != DUMP_SCHEMA:
            raise BundleSchemaError(f"metadata schema is {meta.get('schema')!r}, expected {DUMP_SCHEMA!r} "
                                    f"(docs/run-dump.md)")
        dtype = meta.get("dtype", "float32")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise BundleSchemaError(f"metadata dtype {dtype!r}: the engine's compute dtype must be float32, "
                                    f"bfloat16 or float16 (docs/run-dump.md)")
        if meta.get("routing", "free") not in DUMP_ROUTING:
            raise BundleSchemaError(f"metadata routing {meta['routing']!r}: must be \"held\" or \"free\", or left "
                                    f"out (docs/run-dump.md)")
        steps = meta.get("done_by_kdtr", {})
        if not isinstance(steps, dict) or not all(isinstance(v, str) for v in steps.values()):
            raise BundleSchemaError(f"metadata done_by_kdtr {steps!r}: must be an object of step -> why (strings), "
                                    f"or left out (docs/run-dump.md)")
        return {n: np.array(d[n]) for n in d.names}, dtype              # bfloat16 as raw uint16


def dump_done_by_kdtr(path: str) -> dict:
    """A run dump's metadata `done_by_kdtr` (read_dump validated it): the steps kdtr performed for the engine
    in the live run that wrote it ({} when none, or for an external engine's dump)."""
    with open_kdtr(path) as d:
        return dict(d.metadata.get("done_by_kdtr", {})) if d.metadata.get("schema") == DUMP_SCHEMA else {}


def bundle_as_outputs(d) -> dict:
    """A bundle's goldens under run-dump names (to judge a regenerated bundle against a committed one).
    Its float64 tree forwards equal its AR forwards (to ~1e-10, tests/test_ddtree_verify.py), so the
    committed path rows are its AR logits rows 1.. (see `path_logits_check` in conformance/verify/judge_ddtree.py)."""
    out = {n[len("golden/"):]: np.array(d.get(n)) for n in d.names if n.startswith("golden/")}
    for i in prompts_of(d):
        p = f"p{i}/"
        rows = int(out[p + "ddtree/accepted_offsets"][-1])
        out[p + "ddtree/path_logits"] = out[p + "ar/logits"][1:1 + rows]
    return out


def dump_routing(path: str) -> str | None:
    """A run dump's metadata `routing` ("held" or "free"; read_dump validated it), None when the dump
    does not say how its engine's expert sets were chosen (docs/run-dump.md)."""
    with open_kdtr(path) as d:
        return d.metadata.get("routing")


def dump_made_from_other(path: str, f) -> str | None:
    """Why the run dump at `path` was not made from the open bundle `f`, or None. The dump's metadata
    `bundle_sha256` (the bundle's header_sha256, which covers every tensor's checksum) decides; a dump
    without it (an external engine may leave it out) is compared by its `bundle_command` against the
    bundle's provenance command when both are given."""
    with open_kdtr(path) as d:
        meta = d.metadata
    if meta.get("schema") != DUMP_SCHEMA:
        return None                                       # read_dump says what is wrong with it
    made, this = meta.get("bundle_sha256"), f.header_sha256
    if made is not None:
        return None if made == this else (f"this dump was made from another bundle (its bundle_sha256 {str(made)[:16]}... "
                                          f"!= this bundle's {this[:16]}...); judge it against the bundle it was made from")
    cmd, own = meta.get("bundle_command"), f.metadata.get("provenance", {}).get("command")
    if cmd and own and cmd != own:
        return (f"this dump was made from another bundle (its bundle_command {str(cmd)[:80]!r} is not this bundle's "
                f"{own[:80]!r}); judge it against the bundle it was made from")
    return None


def write_dump(out: dict, path: str, engine_name: str, dtype: str, bundle_command: str = "",
               engine_info: dict | None = None, routing: str | None = None, bundle_sha256: str | None = None,
               shard: dict | None = None, done_by_kdtr: dict | None = None) -> None:
    """A run dump (docs/run-dump.md) of a live engine's outputs: what an external engine writes.
    engine_info: the engine's own provenance (`dump_metadata()`, e.g. the CUDA engine's device and source
    hash), stored under metadata "engine_info". routing: "held" when the run held its routing to the
    golden expert sets, "free" when its router chose them (metadata "routing"). shard: a rank dump's
    metadata "shard" (conformance/shard_plan.py, docs/run-dump.md §7). done_by_kdtr: the steps kdtr
    performed for the engine, {step: why} (conformance/verify/not_judged.py), metadata "done_by_kdtr"."""

    meta = {"schema": DUMP_SCHEMA, "engine": engine_name, "dtype": dtype, "bundle_command": bundle_command}
    if bundle_sha256 is not None:                         # the bundle it was made from (dump_made_from_other)
        meta["bundle_sha256"] = bundle_sha256
    if routing is not None:
        meta["routing"] = routing
    if engine_info:
        meta["engine_info"] = engine_info
    if shard is not None:
        meta["shard"] = shard
    if done_by_kdtr:
        meta["done_by_kdtr"] = dict(done_by_kdtr)
    bf16 = lambda v: dtype == "bfloat16" and v.dtype == np.uint16  # noqa: E731 - raw bf16 bit patterns
    write_kdtr(path, ((k, Tensor(np.ascontiguousarray(v), dtype="bfloat16") if bf16(v) else np.ascontiguousarray(v))
                      for k, v in out.items()), meta)
