"""The CUDA engine's own greedy DDTree loop (docs/ddtree.md §1, docs/cuda-engine.md "DDTree"): its drafter
on the GPU (cuda_engine/drafter.py), the reference tree builder on the drafter's logits, one verify
forward over root + nodes with depth positions and the ancestor-only mask, the greedy walk, the in-order
KV compaction, and the next drafter context from the accepted rows.

A round on the device: [drafter ingest of the last accepted rows (C rows, prepared launches)] -> [the
drafter's block forward, a CUDA graph] -> logits to the host (sync 1) -> `build_ddtree` (host, exactly
refmodel.ddtree's) -> one host->device copy of the tree (target meta, ids, positions, parents) ->
[the verify, a CUDA graph: inputs into place, the tree mask from the parents (kernels/drafter.cu), the
target forward, the argmax] -> argmax and logits to the host (sync 2) -> the walk (host) -> the in-order
compaction (one kernel). Every shape of the verify is fixed by the node budget (a tree always has
budget + 1 rows once the budget is at most L * min(budget, V)), so both graphs are captured once per run.

`ddtree_run` returns the run-dump records of docs/run-dump.md §2 plus, on request, per-round timing
(`timing=True` synchronises after each phase so each one's device time is attributed to it).

Legend: P prompt tokens, T verify rows (root + nodes), L draft depth, V vocab.
"""
from __future__ import annotations

import time

import numpy as np

from conformance.records import live_records
from cuda_engine.device import CudaEngineError, DevBuf, driver
from cuda_engine.drafter import CudaDrafter, prepare_kernels, read_drafter, tree_mask
from refmodel.ddtree import Round, Tree, _root_only, build_ddtree, walk

PHASES = ("draft", "build", "verify", "walk", "compact")


class DDTreeState:
    """Per loaded bundle: the drafter on the device, the verify graph and its input block."""

    def __init__(self, engine, host_drafter):
        if host_drafter is None:
            raise CudaEngineError("ddtree_generate: this bundle has no drafter (drafter_config and drafter.* "
                                  "tensors); regenerate it with `kdtr gen`")
        prepare_kernels(engine.ops)                     # before any graph capture
        self.engine = engine
        self.cfg = engine.cfg
        self.dcfg, DW, settings = host_drafter
        self.budget = int(settings.get("budget", 0))
        self.topk = settings.get("topk")
        self.drafter = CudaDrafter(engine, self.dcfg, DW) if self.budget > 0 else None
        self.graphs: dict = {}
        self.tree_in: DevBuf | None = None

    def verify_graph(self, T: int):
        """The verify forward over T tree rows as a CUDA graph (captured per T and engine allocation)."""
        e = self.engine
        key = (T, e.T_cap, e.S_cap, e.buf["mask"].ptr, e.cache["ckv"].ptr, e.buf["logits"].ptr)
        if key not in self.graphs:
            from cuda_engine.graph import capture

            if self.tree_in is None or self.tree_in.shape[0] < 4 + 3 * e.T_cap:
                self.tree_in = DevBuf((4 + 3 * e.T_cap,), np.int32)
            for g in self.graphs.values():
                g.destroy()
            self.graphs = {key: capture(e.ops, lambda: self._launch_verify(T))}
        return self.graphs[key]

    def _launch_verify(self, T: int) -> None:
        e, ti = self.engine, self.tree_in
        drv, s = e.ops, e.ops.stream
        cp = driver().memcpy_dtod_async
        cp(e.meta.ptr, ti.ptr, 4 * 4, s)
        cp(e.buf["ids"].ptr, ti.ptr + 4 * 4, T * 4, s)
        cp(e.buf["positions"].ptr, ti.ptr + (4 + T) * 4, T * 4, s)
        tree_mask(drv, DevBuf((T,), np.int32, ti.ptr + (4 + 2 * T) * 4, ti), T, e.meta, e.buf["mask"])
        e._launch_forward(T, masked=True, argmax_out=e.buf["argmax"])

    def destroy(self) -> None:
        for g in self.graphs.values():
            g.destroy()
        self.graphs = {}
        if self.drafter is not None:
            self.drafter.drop_graph()


def pack_tree_inputs(tree: Tree, root: int, start: int, pos0: int) -> np.ndarray:
    """The verify's inputs as one int32 block [4 + 3T]: the target's meta (cached rows = start), ids
    [root, tokens], positions pos0 + start + [0, depths] (refmodel.ddtree.compile_tree's), parents [T]."""
    T = tree.size
    ti = np.zeros(4 + 3 * T, np.int32)
    ti[0] = start
    ti[4] = root
    ti[5:4 + T] = tree.tokens
    ti[4 + T:4 + 2 * T] = pos0 + start + np.concatenate([[0], tree.depths])
    ti[4 + 2 * T:] = tree.parents
    return ti


def ddtree_run(engine, prompt_ids, pos0: int, n_tokens: int, timing: bool = False, keep_logits: bool = False):
    """The engine's own DDTree loop from an empty cache. Returns (records of docs/run-dump.md §2, stats):
    stats holds rounds, target/drafter forwards, host syncs, and with timing=True seconds per phase;
    keep_logits=True also keeps, per round (stats["verify"]), its start, tree, drafter logits [L, V], full verify
    logits [T, V] and the stream after it."""
    e = engine
    st = e._ddtree_state()
    prompt = np.asarray(prompt_ids, np.int64).reshape(-1)
    P, c = len(prompt), e.cfg
    if P < 1:
        raise ValueError("ddtree_generate: the prompt must hold at least one token")
    if prompt.min() < 0 or prompt.max() >= c.vocab_size:
        raise ValueError(f"ddtree_generate: prompt ids must be in [0, {c.vocab_size}), got {prompt.min()}..{prompt.max()}")
    if pos0 < 0 or pos0 + P + n_tokens + st.budget + 1 >= 2 ** 31:
        raise ValueError(f"ddtree_generate: pos0 {pos0} + prompt and tokens must stay in [0, 2^31)")
    dr = st.drafter
    T_max = st.budget + 1
    rows_cap = P + n_tokens + T_max + 1
    e.reset()
    e._ensure(max(P, T_max), rows_cap)
    if dr is not None:
        dr.reset()
        dr._ensure_cache(rows_cap)
    stats = {"rounds": 0, "target_forwards": 1, "drafter_forwards": 0, "host_syncs": 0,
             "seconds": dict.fromkeys(PHASES + ("prefill", "host_other"), 0.0), "verify": []}
    clock = time.perf_counter
    sync = e.ops.stream.synchronize

    def mark(phase, t0):
        if timing:
            sync()
            t1 = clock()
            stats["seconds"][phase] += t1 - t0
            return t1
        return t0

    t = clock()
    e._set_inputs(prompt, pos0 + np.arange(P), 0, None)                # prefill: causal, no taps copied back
    e._launch_forward(P, masked=False, argmax_out=e.buf["argmax"])
    e.length = P
    out = [int(x) for x in prompt] + [int(e.buf["argmax"].get((P,))[-1])]
    stats["host_syncs"] += 1
    t = mark("prefill", t)
    ctx_rows = np.arange(P)
    start, rounds = P, []
    while len(out) - P < n_tokens:
        if dr is not None:                                               # draft: ingest + block forward
            dev_rows = dr.set_round(ctx_rows, out[start], pos0)
            dr.ingest(dev_rows, len(ctx_rows), e.buf["resid_out"], e.T_cap)
            dr.block(e.use_graph)
            q = dr.logits()                                              # [L, V]; sync 1
            stats["drafter_forwards"] += 1
            stats["host_syncs"] += 1
            t = mark("draft", t)
            tree = build_ddtree(q, st.budget, st.topk)
        else:
            tree = _root_only()
        t = mark("build", t)
        T = tree.size
        if start + T > e.S_cap or T > e.T_cap:
            e._ensure(T, start + T)
        ti = pack_tree_inputs(tree, out[start], start, pos0)
        if e.use_graph:
            g = st.verify_graph(T)
            st.tree_in.set(ti)
            g.launch(e.ops.stream)
        else:
            if st.tree_in is None or st.tree_in.shape[0] < len(ti):
                st.tree_in = DevBuf((4 + 3 * e.T_cap,), np.int32)
            st.tree_in.set(ti)
            st._launch_verify(T)
        post = e.buf["argmax"].get((T,)).astype(np.int64)                # sync 2
        logits = e.buf["logits"].get((T, c.vocab_size))
        e.length = start + T
        stats["target_forwards"] += 1
        stats["host_syncs"] += 1
        t = mark("verify", t)
        acc, bonus = walk(tree.child_maps, post)
        t = mark("walk", t)
        e.compact(start, acc)                                            # rows start + acc[i] -> start + i
        t = mark("compact", t)
        ids = np.concatenate([[out[start]], tree.tokens]).astype(np.int64)
        out[start + 1:] = [int(x) for x in ids[acc[1:]]] + [bonus]
        rounds.append(Round(start, tree.tokens, tree.parents, tree.depths, tree.ranks, post, acc, bonus, T,
                            len(acc) - 1, logits[acc]))
        if keep_logits:
            stats["verify"].append({"start": start, "tree": tree, "logits": logits, "out": list(out),
                                    "draft_logits": None if dr is None else q.copy()})
        ctx_rows = np.asarray(acc)
        start += len(acc)
        stats["rounds"] += 1
        t = mark("host_other", t)
    sync()
    records = live_records(out[P:P + n_tokens], rounds, stats["target_forwards"])
    stats["tokens"] = out[P:P + n_tokens]
    return records, stats


__all__ = ["DDTreeState", "ddtree_run", "pack_tree_inputs", "read_drafter"]
