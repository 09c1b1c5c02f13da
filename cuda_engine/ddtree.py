"""The CUDA engine's own greedy DDTree loop (docs/ddtree.md §1, docs/cuda-engine.md "DDTree"): its drafter
on the GPU (cuda_engine/drafter.py), refmodel's tree builder run on the device, one verify forward over
root + nodes with depth positions and the ancestor-only mask, the greedy walk, the in-order KV compaction,
and the next drafter context from the accepted rows.

A round (device builder, the default) is ONE CUDA graph: the in-order compaction of the target cache to the
last round's accepted path, the drafter's ingest of those rows (fused features -> K/V into its cache), its
block forward, the builder (per-depth top-K + log-probs, then the best-first heap: refmodel's build_ddtree
on the device), the tree mask from the parents, the target's verify forward over root + nodes at depth
positions, its argmax, and the greedy walk, which writes the next round's drafter inputs on the device.
Every shape is fixed by the node budget (tree_rows), padding rows of the ingest are never written, so the
graph is captured once per run. The rounds are pipelined (`_pipelined`): the tree, argmax, accepted path and
logits come back in one copy (the round's one sync), the next round is launched at once, and the host
records the round (re-walking it: a difference is an engine error) while the device runs the next. A
prompt longer than a block is ingested by prepared launches before the first round.

The host builder (builder="host") copies the drafter's logits back instead and runs refmodel's
build_ddtree (a second sync and the Python heap per round): bit-identical trees by construction, kept to
compare against.

`ddtree_run` returns the run-dump records of docs/run-dump.md §2 plus, on request, per-round timing
(`timing=True` synchronises after each phase so each one's device time is attributed to it).

Legend: P prompt tokens, T verify rows (root + nodes), L draft depth, V vocab.
"""
from __future__ import annotations

import os
import time

import numpy as np

from cuda_engine.device import CudaEngineError, DevBuf, driver
from cuda_engine.drafter import (HEAP_SMEM_MAX, CudaDrafter, build_tree, heap_smem_bytes, prepare_kernels, read_drafter,
                                 tree_mask)
from refmodel.ddtree import Round, Tree, _root_only, build_ddtree, live_records, walk

PHASES = ("draft", "build", "verify", "walk", "compact")
BUILDERS = ("device", "host")


def tree_rows(budget: int, L: int, K: int) -> int:
    """Rows of every verify (root + nodes): build_ddtree pops min(budget, all prefixes in the top-K rank
    space) nodes, sum_{d=1..L} K^d prefixes; so the verify's shapes are fixed for a run."""
    if budget <= 0 or L == 0:
        return 1
    total, level = 0, 1
    for _ in range(L):
        level *= K
        total += level
        if total >= budget:
            return budget + 1
    return total + 1


class DDTreeState:
    """Per loaded bundle: the drafter on the device, the builder's buffers, the captured graphs."""

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
        V, L = self.cfg.vocab_size, self.dcfg.block_size - 1
        self.L, self.V = L, V
        self.K = min(self.budget if self.topk is None else int(self.topk), V) if self.budget > 0 else 0
        self.T = tree_rows(self.budget, L, self.K)
        if self.drafter is not None:
            self.top_id = DevBuf((L, self.K), np.int32)
            self.lp = DevBuf((L, self.K), np.float32)
        # what a round sends back, in one copy: rec = n, ids, parents, depths, ranks, verify argmax, accepted
        # path [T each], n_acc, bonus (int32; REC_* below), then the verify logits [T, V] (float32)
        n_rec = 3 + 6 * self.T
        self.io = DevBuf((n_rec + self.T * V,), np.int32)
        self.rec = DevBuf((n_rec,), np.int32, self.io.ptr, self.io)
        self.logits = DevBuf((self.T, V), np.float32, self.io.ptr + n_rec * 4, self.io)
        self.device_builder = self.drafter is not None and heap_smem_bytes(self.budget, L, self.K) <= HEAP_SMEM_MAX
        self.tree_in = DevBuf((4 + 3 * self.T,), np.int32)
        self.graphs: dict = {}

    def _rec_at(self, k: int) -> int:
        """Device address of rec section k (0 ids, 1 parents, 2 depths, 3 ranks, 4 argmax), T ints each."""
        return self.rec.ptr + (1 + k * self.T) * 4

    def graph(self, kind: str):
        """A captured launch sequence: 'round' (the last round's compaction, the drafter's ingest over B rows,
        then 'round_head': its block, the device builder, the verify, the walk), 'verify_dev' (tree mask +
        verify over the device builder's tree), 'verify_host' (the host tree's inputs into place
        + tree mask + verify). Re-captured when the engine's or the drafter's buffers move."""
        e, dr = self.engine, self.drafter
        ptrs = (e.T_cap, e.S_cap, e.buf["mask"].ptr, e.cache["ckv"].ptr, e.buf["logits"].ptr,
                dr.cache[0][0].ptr if dr else 0, dr.scores.ptr if dr else 0)
        if self.graphs.get("ptrs") != ptrs:
            self.destroy_graphs()
            self.graphs = {"ptrs": ptrs}
        if kind not in self.graphs:
            from cuda_engine.graph import capture

            self.graphs[kind] = capture(e.ops, getattr(self, "_launch_" + kind))
        return self.graphs[kind]

    def launch(self, kind: str) -> None:
        if self.engine.use_graph:
            self.graph(kind).launch(self.engine.ops.stream)
        else:
            getattr(self, "_launch_" + kind)()

    def _launch_build(self) -> None:
        e, dr, T = self.engine, self.drafter, self.T
        build_tree(e.ops, dr.buf["logits"], self.V, self.L, self.K, self.budget, T, self.top_id, self.lp, dr.meta,
                   dr.ids, self.rec, e.meta, e.buf["ids"], e.buf["positions"])

    def _launch_verify_dev(self) -> None:
        e, T = self.engine, self.T
        tree_mask(e.ops, DevBuf((T,), np.int32, self._rec_at(1), self.rec), T, e.meta, e.buf["mask"])
        e._launch_forward(T, masked=True, argmax_out=self._rec_at(4))
        self._logits_out()

    def _logits_out(self) -> None:
        """The verify logits next to rec, so the round comes back in one copy."""
        driver().memcpy_dtod_async(self.logits.ptr, self.engine.buf["logits"].ptr, self.logits.nbytes,
                                   self.engine.ops.stream)

    def _launch_round(self) -> None:
        e, dr = self.engine, self.drafter
        dr.compact_target(e)
        dr.ingest(dr.round_rows, dr.dcfg.block_size, e.buf["resid_out"], e.T_cap)   # B rows, C written
        self._launch_round_head()

    def _launch_round_head(self) -> None:
        """A round after its context is in the drafter cache: block, builder, verify, walk (the walk writes
        the next round's drafter inputs)."""
        dr = self.drafter
        dr._launch_block()
        self._launch_build()
        self._launch_verify_dev()
        self.engine.ops._launch("ddtree_walk_kernel", (1,), self.rec.ptr, self.T, dr.inp.ptr, dr.dcfg.block_size,
                                block=(1, 1, 1))

    def _launch_verify_host(self) -> None:
        e, ti, T = self.engine, self.tree_in, self.T
        cp, s = driver().memcpy_dtod_async, e.ops.stream
        cp(e.meta.ptr, ti.ptr, 4 * 4, s)
        cp(e.buf["ids"].ptr, ti.ptr + 4 * 4, T * 4, s)
        cp(e.buf["positions"].ptr, ti.ptr + (4 + T) * 4, T * 4, s)
        tree_mask(e.ops, DevBuf((T,), np.int32, ti.ptr + (4 + 2 * T) * 4, ti), T, e.meta, e.buf["mask"])
        e._launch_forward(T, masked=True, argmax_out=self._rec_at(4))
        self._logits_out()

    def destroy_graphs(self) -> None:
        for k, g in self.graphs.items():
            if k != "ptrs":
                g.destroy()
        self.graphs = {}

    def destroy(self) -> None:
        self.destroy_graphs()
        if self.drafter is not None:
            self.drafter.drop_graph()


def reserve_w4a16_rows(e, T: int) -> None:
    """The fast W4A16 kernel's split-K workspace for a T-row forward (the verify), reserved before the round
    graph is captured (a capture cannot allocate); the engine itself reserves only for a decode step."""
    if getattr(e, "w4a16", None) == "fast" and hasattr(e, "_reserve_w4a16"):
        e._reserve_w4a16(T)


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


def unpack_tree(rec: np.ndarray, T: int) -> tuple[Tree, np.ndarray]:
    """(the device builder's tree, the verify argmax [T]) from the rec block [1 + 5T] (kernels/drafter.cu).
    The tree carries no visibility matrix (the device builds the mask from the parents) and no scores."""
    n = int(rec[0])
    if n != T - 1:
        raise CudaEngineError(f"device tree builder made {n} nodes where the verify was sized for {T - 1}")
    sec = [rec[1 + k * T:1 + (k + 1) * T].astype(np.int64) for k in range(5)]
    ids, parents, depths, ranks, post = sec
    child_maps = [{} for _ in range(T)]
    for k in range(1, T):
        child_maps[int(parents[k])][int(ids[k])] = k
    return Tree(ids[1:], depths[1:], parents, child_maps, None, ranks[1:], np.zeros(0)), post


def _pipelined(e, st: DDTreeState, out: list, P: int, pos0: int, n_tokens: int, stats: dict, rounds: list) -> None:
    """The rounds with the walk on the device: as soon as round r's results are back (one copy), round r + 1
    is launched (its inputs were written by r's walk kernel), and the host records round r while the device
    runs r + 1. The host re-walks every tree (refmodel.ddtree.walk) and fails on any difference. Leaves the
    last round's verify rows in the cache (e.length = start + T), its compaction to the caller."""
    dr, T, V = st.drafter, st.T, e.cfg.vocab_size
    start = P
    dev_rows = dr.set_round(np.arange(P), out[P], pos0, None)
    if dev_rows is dr.round_rows:
        st.launch("round")
    else:                                                                # a prompt longer than a block
        dr.ingest(dev_rows, P, e.buf["resid_out"], e.T_cap)
        st.launch("round_head")
    dr.advance(P)
    stats["drafter_forwards"] += 1
    while True:
        io = st.io.get()                                                 # round r is done; r + 1's inputs
        n_acc, bonus = int(io[1 + 6 * T]), int(io[2 + 6 * T])            # are on the device already
        more = start + n_acc + 1 - P < n_tokens
        if more:
            st.launch("round")
            stats["drafter_forwards"] += 1
        tree, post = unpack_tree(io[:1 + 5 * T], T)
        if int(io[1]) != out[start]:
            raise CudaEngineError(f"device tree builder: root {int(io[1])} is not the bonus {out[start]}")
        acc, host_bonus = walk(tree.child_maps, post)
        if acc != [int(a) for a in io[1 + 5 * T:1 + 5 * T + n_acc]] or host_bonus != bonus:
            raise CudaEngineError(f"round {len(rounds)}: the device walk accepted {io[1 + 5 * T:1 + 5 * T + n_acc]} "
                                  f"-> {bonus}, the host walk {acc} -> {host_bonus}")
        logits = io[3 + 6 * T:].view(np.float32).reshape(T, V)
        ids = np.concatenate([[out[start]], tree.tokens]).astype(np.int64)
        out[start + 1:] = [int(x) for x in ids[acc[1:]]] + [bonus]
        rounds.append(Round(start, tree.tokens, tree.parents, tree.depths, tree.ranks, post, acc, bonus, T,
                            len(acc) - 1, logits[acc]))
        stats["host_syncs"] += 1
        stats["target_forwards"] += 1
        stats["rounds"] += 1
        e.length = start + T
        if not more:
            return
        dr.advance(len(acc))
        start += len(acc)


def ddtree_run(engine, prompt_ids, pos0: int, n_tokens: int, timing: bool = False, keep_logits: bool = False,
               builder: str | None = None):
    """The engine's own DDTree loop from an empty cache. Returns (records of docs/run-dump.md §2, stats):
    stats holds rounds, target/drafter forwards, host syncs, and with timing=True seconds per phase;
    keep_logits=True also keeps, per round (stats["verify"]), its start, tree, drafter logits [L, V], full verify
    logits [T, V] and the stream after it. builder: "device" (default; KDTR_DDTREE_BUILDER) builds the tree
    on the GPU inside the round's graph, "host" copies the drafter logits back and runs refmodel's
    build_ddtree."""
    e = engine
    st = e._ddtree_state()
    builder = builder or os.environ.get("KDTR_DDTREE_BUILDER", "device")
    if builder not in BUILDERS:
        raise CudaEngineError(f"tree builder {builder!r}: choose one of {', '.join(BUILDERS)} (KDTR_DDTREE_BUILDER)")
    prompt = np.asarray(prompt_ids, np.int64).reshape(-1)
    P, c = len(prompt), e.cfg
    if P < 1:
        raise ValueError("ddtree_generate: the prompt must hold at least one token")
    if prompt.min() < 0 or prompt.max() >= c.vocab_size:
        raise ValueError(f"ddtree_generate: prompt ids must be in [0, {c.vocab_size}), got {prompt.min()}..{prompt.max()}")
    if pos0 < 0 or pos0 + P + n_tokens + st.T >= 2 ** 31:
        raise ValueError(f"ddtree_generate: pos0 {pos0} + prompt and tokens must stay in [0, 2^31)")
    dr, T, V = st.drafter, st.T, c.vocab_size
    if builder == "device" and dr is not None and not st.device_builder:
        builder = "host"                     # a budget x depth past the heap kernel's shared memory
    on_device = dr is not None and builder == "device"
    rows_cap = P + n_tokens + T + 1
    e.reset()
    e._ensure(max(P, T), rows_cap)
    reserve_w4a16_rows(e, T)
    if dr is not None:
        dr.reset()
        dr._ensure_cache(rows_cap)
    stats = {"rounds": 0, "target_forwards": 1, "drafter_forwards": 0, "host_syncs": 0, "builder": builder,
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
    ctx_rows, start, rounds, pending = np.arange(P), P, [], None        # pending: (start, accepted) to compact
    if on_device and not timing and not keep_logits and e.use_graph and n_tokens > len(out) - P:
        _pipelined(e, st, out, P, pos0, n_tokens, stats, rounds)
    while len(out) - P < n_tokens:
        q = None
        if dr is not None:                                               # this round's context, last round's
            keep_start = None if pending is None else pending[0]        # compaction (keep = the same rows)
            dev_rows = dr.set_round(ctx_rows, out[start], pos0, keep_start)
            if pending is not None:
                e.length = pending[0] + len(pending[1])
                pending = None
            C = len(ctx_rows)
            stats["drafter_forwards"] += 1
        if on_device and not timing and dev_rows is dr.round_rows:
            st.launch("round")                                           # compact + draft + build + verify
            dr.advance(C)
        elif dr is not None:
            if keep_start is not None:
                dr.compact_target(e)
                t = mark("compact", t)
            dr.ingest(dev_rows, C, e.buf["resid_out"], e.T_cap)
            dr.advance(C)
            dr.block(e.use_graph)
            if on_device:
                t = mark("draft", t)
                st._launch_build()
                t = mark("build", t)
                st.launch("verify_dev")
            else:
                q = dr.logits()                                          # [L, V]; a host sync
                stats["host_syncs"] += 1
                t = mark("draft", t)
                tree = build_ddtree(q, st.budget, st.topk)
                t = mark("build", t)
        else:                                                            # budget 0: AR through the same loop
            if pending is not None:
                e.compact(*pending)
                pending = None
            tree = _root_only()
        if not on_device:
            if tree.size != T:
                raise CudaEngineError(f"host tree builder made {tree.size} rows where the verify was sized for {T}")
            st.tree_in.set(pack_tree_inputs(tree, out[start], start, pos0))
            st.launch("verify_host")
        io = st.io.get()                                                 # the sync of the round
        rec, logits = io[:1 + 5 * T], io[3 + 6 * T:].view(np.float32).reshape(T, V)
        stats["host_syncs"] += 1
        stats["target_forwards"] += 1
        t = mark("verify", t)
        if on_device:
            tree, post = unpack_tree(rec, T)
            if int(tree.parents[0]) != -1 or int(rec[1]) != out[start]:
                raise CudaEngineError(f"device tree builder: root {int(rec[1])} is not the bonus {out[start]}")
        else:
            post = rec[1 + 4 * T:1 + 5 * T].astype(np.int64)
        e.length = start + T
        acc, bonus = walk(tree.child_maps, post)
        t = mark("walk", t)
        pending = (start, acc)
        ids = np.concatenate([[out[start]], tree.tokens]).astype(np.int64)
        out[start + 1:] = [int(x) for x in ids[acc[1:]]] + [bonus]
        rounds.append(Round(start, tree.tokens, tree.parents, tree.depths, tree.ranks, post, acc, bonus, T,
                            len(acc) - 1, logits[acc]))
        if keep_logits:
            stats["verify"].append({"start": start, "tree": tree, "logits": logits, "out": list(out),
                                    "draft_logits": None if dr is None else (q if q is not None else dr.logits())})
        ctx_rows = np.asarray(acc)
        start += len(acc)
        stats["rounds"] += 1
        t = mark("host_other", t)
    if pending is None and rounds:                                       # the pipelined rounds' last one
        pending = (rounds[-1].start, rounds[-1].accepted)
    if pending is not None:                                              # leave the cache committed
        e.compact(*pending)
    sync()
    records = live_records(out[P:P + n_tokens], rounds, stats["target_forwards"])
    stats["tokens"] = out[P:P + n_tokens]
    return records, stats


__all__ = ["DDTreeState", "ddtree_run", "live_records", "pack_tree_inputs", "read_drafter", "tree_rows", "unpack_tree"]
