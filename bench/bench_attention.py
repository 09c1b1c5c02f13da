"""The attention GEMMs' two tilings on a GPU (docs/cuda-engine.md, "Stop 42"), in one device command:

1. per launch at K2.6's shapes (64 heads, C = 512, R = 64): the scores GEMM, the softmax and p c_kv in the narrow
   (64 x 64) and the wide (64 x 128) tiling, each p c_kv with the chunk count one wave of its blocks gives, and
   the whole `mla_attention` as the engine runs it; CUDA events over `--reps` launches each;
2. with --ab BUNDLE...: the A/B stop 42 left open. `kdtr bench ddtree`'s measurement (cuda_engine.bench_ddtree)
   on the bundles four times in one process, rule / narrow / narrow / rule: with the engine's rule (the wide
   tiling from ops.ATTN_WIDE_MIN_ROWS query rows) and with the narrow tiling for every forward (the threshold
   past every forward's rows; Ops.attn_tiling reads it at each call, and every engine is made after it is
   set). Same machine, same start: the difference is the tiling's. (Stop 43 ran it on the tiny bundles: their
   verifies ran 3-5% faster narrow, so the rule now also asks for a latent of ATTN_WIDE_MIN_C or more, and
   picks the narrow tiling for them; the A/B is for bundles whose latent is that wide, e.g. model_wide.)

    python bench/bench_attention.py [--cached 4096,32768] [--tokens 1,2,5,9,17,33] [--reps 20]
                                    [--ab bundles/model_wide.kdtr] [--json out.json]

Needs an NVIDIA GPU and PyCUDA (cuda_engine/device.py); without them it says so and exits 6 (engine error).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kdtr_format.paths import write_atomically  # noqa: E402 - after the path line, as a script

H, C, R, N, U, Q = 64, 512, 64, 128, 128, 1536        # K2.6's MLA (refmodel.config.PRESETS["k26"])


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag} {text!r}: give positive integers separated by commas, e.g. 1,5,9")
    return vals


def _splits(ops, tl, T: int, C: int) -> int:
    """p c_kv's chunk count for tiling tl: the engine's own Ops.attn_splits, with the tiling rule's threshold set
    so that Ops.attn_tiling picks tl."""
    import cuda_engine.ops as ops_mod

    rule = ops_mod.ATTN_WIDE_MIN_ROWS
    ops_mod.ATTN_WIDE_MIN_ROWS = 1 if tl is ops_mod.ATTN_WIDE else 1 << 30
    try:
        assert ops.attn_tiling(T, H, C) is tl
        return ops.attn_splits(T, H, C)
    finally:
        ops_mod.ATTN_WIDE_MIN_ROWS = rule


def per_launch(cached: list[int], tokens: list[int], reps: int, progress=print) -> list[dict]:
    """Per-launch times (us) of both tilings' GEMMs, the softmax and the whole mla_attention at K2.6 shapes."""
    import numpy as np

    from cuda_engine.device import DevBuf, timed_us
    from cuda_engine.ops import (ATTN_MAX_SPLIT, ATTN_NARROW, ATTN_WIDE, WARPS_PER_BLOCK, Ops, kv_planes_shape,
                                 kv_rows_to_planes, p_terms_shape)
    from refmodel.config import PRESETS
    from refmodel.model import yarn_inv_freq

    ops, dev = Ops(), DevBuf.from_array

    def timed(fn) -> float:                               # one launch first, then the engine's event timer
        fn()
        return timed_us(ops, fn, reps)

    def rand(rng, *shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    inv_freq = yarn_inv_freq(PRESETS["k26"])[:R // 2]
    out = []
    for S0 in cached:
        rng = np.random.default_rng(S0)
        S_cap = S0 + max(tokens)
        kv = dev(kv_rows_to_planes(rand(rng, S_cap, C), rand(rng, S_cap, R)))
        meta = dev(np.array([S0, 0, 0, 0], np.int32))
        for T in tokens:
            TH = T * H
            mask = np.concatenate([np.zeros((T, S0)), np.where(np.tril(np.ones((T, T), bool)), 0.0, -np.inf),
                                   np.full((T, S_cap - S0 - T), -np.inf)], axis=1).astype(np.float32)
            mask_d = dev(mask) if T > 1 else None
            scores = dev(np.zeros((TH, S_cap), np.float32))
            qs = dev(np.zeros(kv_planes_shape(TH, C, R), np.uint16))
            p_t = dev(np.zeros(p_terms_shape(TH, S_cap), np.uint16))
            partials = dev(np.zeros((ATTN_MAX_SPLIT * TH, C + 2), np.float32))
            args = (dev(rand(rng, T, Q)), dev(rand(rng, H * (N + R), Q, scale=Q ** -0.5)),
                    dev(np.zeros((T, H, N + R), np.float32)), dev(S0 + np.arange(T), np.int32), dev(inv_freq), 1.0,
                    dev(rand(rng, H, N, C, scale=0.3 * N ** -0.5)), dev(rand(rng, H, U, C, scale=C ** -0.5)), kv,
                    meta, mask_d, S_cap, scores, p_t, S_cap, partials, qs, dev(np.zeros((T, H, U), np.float32)), T,
                    R, float((N + R) ** -0.5))
            row = {"cached": S0, "tokens": T, "tiling": ops.attn_tiling(T, H, C).suffix.strip("_") or "narrow",
                   "mla_attention_us": timed(lambda: ops.mla_attention(*args))}
            pitch = p_t.shape[2]
            for tl in (ATTN_NARROW, ATTN_WIDE):
                name = tl.suffix.strip("_") or "narrow"
                rt, ct = -(-TH // tl.rows), -(-C // tl.cols)
                n_split = _splits(ops, tl, T, C)
                row[f"{name}_chunks"] = n_split
                row[f"{name}_scores_us"] = timed(lambda: ops._launch(
                    f"mla_scores{tl.suffix}_kernel", (rt, -(-S_cap // tl.cols)), qs.ptr, kv.ptr, kv.shape[1], meta.ptr,
                    0 if mask_d is None else mask_d.ptr, S_cap, scores.ptr, S_cap, T, H, C, R, 0.07,
                    shared=tl.scores_smem()))
                row[f"{name}_softmax_us"] = timed(lambda: ops._launch(
                    "mla_softmax_kernel", (-(-TH // WARPS_PER_BLOCK), n_split), scores.ptr, S_cap, meta.ptr, p_t.ptr,
                    pitch, partials.ptr, T, H, C))
                row[f"{name}_pv_us"] = timed(lambda: ops._launch(
                    f"mla_pv{tl.suffix}_kernel", (rt * ct, n_split), p_t.ptr, pitch, kv.ptr, kv.shape[1], meta.ptr,
                    partials.ptr, T, H, C, R, shared=tl.pv_smem()))
            progress(f"{S0:6d} rows, {T:2d} tokens ({row['tiling']}): mla_attention {row['mla_attention_us']:8.1f} us; "
                     f"scores {row['narrow_scores_us']:7.1f} / {row['wide_scores_us']:7.1f}, p c_kv "
                     f"{row['narrow_pv_us']:7.1f} / {row['wide_pv_us']:7.1f} (narrow / wide)")
            out.append(row)
    return out


def ab(bundles: list[str], progress=print) -> dict:
    """cuda_engine.bench_ddtree.ddtree_speed on the bundles with the engine's tiling rule and with the narrow
    tiling for every forward, in the order rule, narrow, narrow, rule (so neither arm gains from coming first);
    per bundle the faster run of each arm is compared, and every run is kept."""
    import cuda_engine.ops as ops_mod
    from cuda_engine.bench_ddtree import ddtree_speed

    rule = ops_mod.ATTN_WIDE_MIN_ROWS
    runs = {"rule": [], "narrow": []}
    try:
        for label in ("rule", "narrow", "narrow", "rule"):
            ops_mod.ATTN_WIDE_MIN_ROWS = rule if label == "rule" else 1 << 30
            runs[label].append(ddtree_speed(bundles))
    finally:
        ops_mod.ATTN_WIDE_MIN_ROWS = rule
    best = {}
    for i, b in enumerate(bundles):
        best[b] = {arm: max((r["bundles"][i] for r in runs[arm]), key=lambda x: x["speedup"]) for arm in runs}
        r, n = best[b]["rule"], best[b]["narrow"]
        same = all(x["bundles"][i]["all_streams_equal_ar"] for arm in runs for x in runs[arm])
        progress(f"{b}: DDTree over AR {r['speedup']:.2f}x with the rule, {n['speedup']:.2f}x narrow (best of 2 each); "
                 f"verify in the round graph {r['round_gpu_us'].get('verify', 0):.0f} / "
                 f"{n['round_gpu_us'].get('verify', 0):.0f} us; every stream equals AR: {same}")
    return {"runs": runs, "best": best}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cached", default="4096,32768", help="cached rows, comma-separated (default 4096,32768)")
    ap.add_argument("--tokens", default="1,2,5,9,17,33", help="tokens per forward, comma-separated")
    ap.add_argument("--reps", type=int, default=20, help="launches per timing (default 20)")
    ap.add_argument("--ab", nargs="+", metavar="BUNDLE", help="also the DDTree A/B on these bundles")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON (written whole, then renamed)")
    a = ap.parse_args(argv)
    try:
        cached, tokens = _ints(a.cached, "--cached"), _ints(a.tokens, "--tokens")
    except ValueError as e:
        ap.error(str(e))                                   # exit 2, the usage code
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: give at least 1")
    for b in a.ab or ():
        if not os.path.isfile(b):
            ap.error(f"--ab {b}: no such bundle (the committed ones are in bundles/)")
    from cuda_engine.device import CudaEngineError, device_info

    try:
        res = {**device_info(), "per_launch": per_launch(cached, tokens, a.reps)}
        if a.ab:
            res["ab"] = ab(a.ab)
    except CudaEngineError as e:
        print(f"bench_attention: {e}", file=sys.stderr)
        return 6
    if a.json:
        write_atomically(a.json, lambda fh: fh.write(json.dumps(res, indent=1).encode()), stream_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
