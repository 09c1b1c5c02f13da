"""DDTree against AR on the CUDA engine, in one run on one device (`kdtr bench ddtree`).

For each bundle and each of its golden prompts (their positions included), `n_tokens` greedy tokens:

- AR: the prompt's causal forward, then the decode step as a replayed CUDA graph, back to back with no
  host work at all between steps (the argmax feeds the next step on the device): the fastest AR this
  engine has, so the ratio is against AR at its best. Its stream is read once in a second, untimed pass
  (a host read per step) and must equal the DDTree stream.
- DDTree: `ddtree_run` (cuda_engine/ddtree.py) as `ddtree_generate` runs it, prefill included: the device
  tree builder (a round = one CUDA graph and one host sync), and for comparison the host builder
  (refmodel's build_ddtree on the drafter logits copied back: two syncs and the Python heap per round).

Wall-clock times (host perf_counter around fully synchronised runs), the best of `repeats`, after one
warm-up run each (graph capture). Then one more DDTree run with timing=True, which synchronises after
each phase, splits a round's time (device builder) into compact (the last round's compaction and this
round's input copy), draft (drafter ingest + block forward), build (top-K + heap kernels), verify (tree
mask + target forward as a graph, the tree/argmax/logits copies back: the round's host sync), walk (host)
and host_other (records); its total is a little larger than the untimed run's. Last, the device time of
the round graph and of each of its parts captured and replayed alone (compaction + drafter ingest,
drafter block, top-K, builder, verify, walk), CUDA events over back-to-back replays. `speedup_after_prefill` leaves out each run's prompt forward
(the same lean prefill in both, measured in the timed run). The cost-aware budget (docs/ddtree.md §3a) runs
too: each round's tree cut to the nodes worth their verify rows under the prices this engine measured on this
GPU in its first cost-aware run (the warm-up; `price_us`), rounds one by one (two syncs each).
"""
from __future__ import annotations

import time

import numpy as np

from cuda_engine.ddtree import PHASES, ddtree_run
from cuda_engine.device import device_info
from cuda_engine.engine import CudaEngine
from kdtr_format import open_kdtr


def _golden_prompts(f) -> list:
    """(prompt ids, position offset) of every golden prompt of an open bundle (docs/golden-bundles.md)."""
    idx = sorted(int(n.split("/")[1][1:]) for n in f.names if n.startswith("golden/p") and n.endswith("/prompt_ids"))
    offsets = f.metadata.get("position_offsets", [0] * len(idx))
    return [(np.asarray(f[f"golden/p{i}/prompt_ids"], np.int64), int(offsets[i])) for i in idx]


def _ar_run(e: CudaEngine, prompt, pos0: int, n: int, read: bool) -> list[int]:
    """Greedy AR on the device: lean prefill (no taps copied), then n-1 graph replays. read=True copies each
    step's token back (the stream); read=False leaves the host out entirely (timing)."""
    P = len(prompt)
    e.reset()
    e._ensure(P, P + n + 1)
    e._set_inputs(prompt, pos0 + np.arange(P), 0, None)
    e._launch_forward(P, masked=False, argmax_out=e.buf["argmax"])
    first = int(e.buf["argmax"].get((P,))[-1])
    e._set_inputs([first], [pos0 + P], P, None)
    g, out = e._decode_graph(), [first]
    for _ in range(n - 1):
        g.launch(e.ops.stream)
        if read:
            out.append(int(e.buf["ids"].get((1,))[0]))
    e.ops.stream.synchronize()
    e.length = P + n - 1
    return out


def _gpu_split(e: CudaEngine, st, reps: int = 20) -> dict:
    """Device microseconds (CUDA events, back-to-back replays) of the round graph and of each of its parts
    replayed alone, on the state a run left (the replays rewrite the same rows: timing only, the next run
    resets the state). The parts' sum exceeds the round by the per-replay overhead of each part."""
    from cuda_engine.bench import _timed
    from cuda_engine.graph import capture

    ops, dr = e.ops, st.drafter
    B = dr.dcfg.block_size
    saved = dr.inp.get()                       # each replay of a walk moves the inputs on by its accepted rows:
    need = int(saved[2]) + (reps + 2) * (B + st.T)      # room for all of them, and the inputs restored per part
    e._ensure(st.T, need)
    dr._ensure_cache(need)

    def ingest():
        dr.compact_target(e)
        dr.ingest(dr.round_rows, B, e.buf["resid_out"], e.T_cap)

    def topk():
        from cuda_engine.drafter import BLOCK, TOPK_SORT_MAX

        V, L, K = st.V, st.L, st.K
        if V <= TOPK_SORT_MAX:
            P2 = 1 << max(V - 1, 1).bit_length()
            ops.fn["ddtree_topk_sort_kernel"].prepared_async_call((L, 1, 1), BLOCK, ops.stream, dr.buf["logits"].ptr,
                                                                  V, K, P2, st.top_id.ptr, st.lp.ptr, shared_size=8 * P2)
        else:
            ops._launch("ddtree_topk_kernel", (L,), dr.buf["logits"].ptr, V, K, st.top_id.ptr, st.lp.ptr)

    def walk():
        ops._launch("ddtree_walk_kernel", (1,), st.rec.ptr, st.T, dr.inp.ptr, B, block=(1, 1, 1))

    rg = st.graph("round")                     # captured (again, after a reallocation) outside the timing
    dr.inp.set(saved)
    out = {"round_graph": _timed(ops, lambda: rg.launch(ops.stream), reps)}
    for name, fn in (("compact_and_ingest", ingest), ("drafter_block", dr._launch_block), ("topk", topk),
                     ("build", st._launch_build), ("verify", st._launch_verify_dev), ("walk", walk)):
        dr.inp.set(saved)
        g = capture(ops, fn)
        out[name] = _timed(ops, lambda: g.launch(ops.stream), reps)
        g.destroy()
    out["heap"] = out["build"] - out["topk"]
    return out


def _best(fn, repeats: int) -> float:
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def ddtree_speed(bundles, n_tokens: int = 128, repeats: int = 3, progress=None) -> dict:
    res = {**device_info(), "n_tokens": n_tokens, "repeats": repeats, "bundles": []}
    for b in bundles:
        e = CudaEngine()
        e.load(b)
        with open_kdtr(b) as f:
            prompts = _golden_prompts(f)
        st = e._ddtree_state()
        host_s, gpu, pre_s = 0.0, {}, 0.0
        rows, ar_s, dd_s, toks, ar_fw, dd_fw, rounds, syncs = [], 0.0, 0.0, 0, 0, 0, 0, 0
        split = dict.fromkeys(PHASES + ("prefill", "host_other"), 0.0)
        ca_s, ca_fw, ca_nodes, ca_rounds, price = 0.0, 0, 0, 0, None
        for k, (prompt, pos0) in enumerate(prompts):
            ar_tokens = _ar_run(e, prompt, pos0, n_tokens, read=True)
            _, warm = ddtree_run(e, prompt, pos0, n_tokens, builder="device")
            same = warm["tokens"] == ar_tokens
            t_ar = _best(lambda: _ar_run(e, prompt, pos0, n_tokens, read=False), repeats)
            t_dd = _best(lambda: ddtree_run(e, prompt, pos0, n_tokens, builder="device"), repeats)
            ddtree_run(e, prompt, pos0, n_tokens, builder="host")
            t_host = _best(lambda: ddtree_run(e, prompt, pos0, n_tokens, builder="host"), repeats)
            e.ddtree_budget = "cost-aware"                                 # its price measured by the first run
            _, ca = ddtree_run(e, prompt, pos0, n_tokens, builder="device")
            t_ca = _best(lambda: ddtree_run(e, prompt, pos0, n_tokens, builder="device"), repeats)
            e.ddtree_budget = "fixed"
            _, timed = ddtree_run(e, prompt, pos0, n_tokens, timing=True, builder="device")
            for ph, s in timed["seconds"].items():
                split[ph] += s
            if st.drafter is not None:
                for ph, us in _gpu_split(e, st).items():
                    gpu[ph] = gpu.get(ph, 0.0) + us / len(prompts)
            pre = timed["seconds"]["prefill"]
            rows.append({"prompt": k, "pos0": int(pos0), "prompt_len": len(prompt), "ar_s": t_ar, "ddtree_s": t_dd, "ddtree_host_builder_s": t_host,
                         "speedup": t_ar / t_dd, "ddtree_target_forwards": warm["target_forwards"],
                         "rounds": warm["rounds"], "same_stream_as_ar": bool(same),
                         "cost_aware_s": t_ca, "cost_aware_speedup": t_ar / t_ca,
                         "cost_aware_target_forwards": ca["target_forwards"],
                         "cost_aware_nodes_per_round": float(np.mean(ca["budgets"])) if ca["budgets"] else 0.0,
                         "cost_aware_same_stream_as_ar": ca["tokens"] == ar_tokens})
            ca_s, ca_fw, ca_nodes = ca_s + t_ca, ca_fw + ca["target_forwards"], ca_nodes + sum(ca["budgets"])
            ca_rounds, price = ca_rounds + ca["rounds"], ca.get("price")
            ar_s, dd_s, toks, host_s = ar_s + t_ar, dd_s + t_dd, toks + n_tokens, host_s + t_host
            pre_s += pre
            ar_fw, dd_fw = ar_fw + n_tokens, dd_fw + warm["target_forwards"]
            rounds, syncs = rounds + warm["rounds"], syncs + warm["host_syncs"]
            if progress:
                progress(b, k + 1, len(prompts))
        n_rounds = max(rounds, 1)
        res["bundles"].append({
            "bundle": str(b), "budget": st.budget, "prompts": rows,
            "ar_tokens_per_s": toks / ar_s, "ddtree_tokens_per_s": toks / dd_s, "speedup": ar_s / dd_s,
            "speedup_after_prefill": (ar_s - pre_s) / (dd_s - pre_s), "ar_us_per_token": 1e6 * ar_s / toks,
            "ddtree_us_per_token": 1e6 * dd_s / toks, "round_gpu_us": gpu,
            "ddtree_host_builder_tokens_per_s": toks / host_s, "speedup_host_builder": ar_s / host_s,
            "ar_target_forwards_per_token": ar_fw / toks, "ddtree_target_forwards_per_token": dd_fw / toks,
            "target_forward_ratio": ar_fw / dd_fw, "speedup_vs_forward_ratio": (ar_s / dd_s) / (ar_fw / dd_fw),
            "tokens_per_round": toks / n_rounds, "host_syncs_per_round": syncs / n_rounds,
            "round_us": {ph: 1e6 * s / n_rounds for ph, s in split.items() if ph != "prefill"},
            "prefill_us_per_prompt": 1e6 * split["prefill"] / max(len(prompts), 1),
            "all_streams_equal_ar": all(r["same_stream_as_ar"] and r["cost_aware_same_stream_as_ar"] for r in rows),
            "cost_aware": {"tokens_per_s": toks / ca_s, "speedup": ar_s / ca_s, "vs_fixed": dd_s / ca_s,
                           "target_forwards_per_token": ca_fw / toks, "nodes_per_round": ca_nodes / max(ca_rounds, 1),
                           "price_us": price}})
    return res
