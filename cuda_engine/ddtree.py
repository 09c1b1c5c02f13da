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

from cuda_engine.ddtree_io import RoundCopy, pack_tree_inputs, unpack_tree
from cuda_engine.device import CudaEngineError, DevBuf, driver, timed_us
from cuda_engine.drafter import (HEAP_SMEM_MAX, CudaDrafter, build_tree, heap_smem_bytes, prepare_kernels, read_drafter,
                                 tree_mask)
from refmodel.ddtree import (LIVE_BUDGET, Round, Tree, _root_only, build_ddtree, cost_aware_nodes, live_records,
                             prune_tree, verify_cost_table, walk)

PHASES = ("draft", "build", "verify", "walk", "compact")
BUILDERS = ("device", "host")
BUDGETS = ("fixed", "cost-aware")     # the bundle's budget every round, or each tree cut by its price (below)
CALIBRATION_ROWS = (1, 2, 3, 5, 9, 17, 33, 65, 129)   # verify rows timed for the measured price (and the tree's)


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


def node_scores(tree: Tree, lp: np.ndarray) -> np.ndarray:
    """[n] float64: the path log-probs of a device-built tree's nodes (refmodel.ddtree.Tree.scores, which the
    device builder does not send back), from the builder's per-depth top-K log-probs lp [L, K], formed as
    build_ddtree forms them (a first child from its parent, a sibling from the sibling ranked just above it),
    so the same bits as the host builder's scores."""
    n = len(tree.tokens)
    s = np.zeros(n + 1, np.float64)
    sibling = {}                                          # (parent, rank) -> node index
    for i in range(1, n + 1):
        p, d, r = int(tree.parents[i]), int(tree.depths[i - 1]), int(tree.ranks[i - 1])
        if r == 0:
            s[i] = s[p] + float(lp[d - 1, 0])                 # the root's score is 0
        else:
            s[i] = s[sibling[(p, r - 1)]] - float(lp[d - 1, r - 1]) + float(lp[d - 1, r])
        sibling[(p, r)] = i
    return s[1:]


class Price:
    """What a cost-aware round pays (docs/ddtree.md §3a, docs/cuda-engine.md "Stop 37"): verify_us
    {rows: cost} of one target forward over that many rows, and draft_us per round (drafter block + tree
    builder), in one unit. source: "given" (a table passed in; no draft cost unless given) or "measured" (this
    engine on this GPU: the verify graphs timed once per loaded bundle, builder and graph mode, over chains on
    the empty cache before the first run's prefill (_price); the draft cost the least a round has taken so far,
    CUDA events around each round's drafter block and builder (_draft_timer), so it falls from the first round's
    cold launch to the warm one)."""

    def __init__(self, verify_us: dict, draft_us: float, source: str):
        rows = sorted(verify_us)
        mono = np.maximum.accumulate([float(verify_us[r]) for r in rows])   # a larger forward never prices
        self.verify_us = {r: float(c) for r, c in zip(rows, mono)}          # below a smaller one (timing noise)
        self.draft_us, self.source = float(draft_us), source
        self.cost = verify_cost_table(self.verify_us)

    def nodes(self, scores: np.ndarray) -> int:
        """How many of a tree's nodes (heap-pop order, scores [n]) to verify: refmodel's cost_aware_nodes."""
        return cost_aware_nodes(scores, self.cost, self.draft_us)

    def as_dict(self) -> dict:
        """For JSON: the draft cost None where no round measured it yet."""
        return {"source": self.source, "verify": {str(r): c for r, c in self.verify_us.items()},
                "draft": None if np.isnan(self.draft_us) else self.draft_us}


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
        # what a round sends back, in one copy (RoundCopy below): rec = n, ids, parents, depths, ranks, verify
        # argmax, accepted path [T each], n_acc, bonus (int32), then the verify logits [T, V] (float32)
        n_rec = 3 + 6 * self.T
        self.io = DevBuf((n_rec + self.T * V,), np.int32)
        self.rec = DevBuf((n_rec,), np.int32, self.io.ptr, self.io)
        self.logits = DevBuf((self.T, V), np.float32, self.io.ptr + n_rec * 4, self.io)
        self.device_builder = self.drafter is not None and heap_smem_bytes(self.budget, L, self.K) <= HEAP_SMEM_MAX
        self.tree_in = DevBuf((4 + 3 * self.T,), np.int32)
        self.graphs: dict = {}
        self.prices: dict = {}                          # (builder, graphs) -> the measured Price (_price)

    def _rec_at(self, k: int) -> int:
        """Device address of rec section k (0 ids, 1 parents, 2 depths, 3 ranks, 4 argmax), T ints each."""
        return self.rec.ptr + (1 + k * self.T) * 4

    def graph(self, kind: str, T: int | None = None):
        """A captured launch sequence: 'round' (the last round's compaction, the drafter's ingest over B rows,
        then 'round_head': its block, the device builder, the verify, the walk), 'verify_dev' (tree mask +
        verify over the device builder's tree), 'verify_host' (the host tree's inputs into place
        + tree mask + verify); the two verifies over the first T rows where T is given (a cut tree), one graph
        per T. Re-captured when the engine's or the drafter's buffers move."""
        e, dr = self.engine, self.drafter
        ptrs = (e.T_cap, e.S_cap, e.buf["mask"].ptr, e.cache["kv"].ptr, e.buf["logits"].ptr,
                dr.cache[0][0].ptr if dr else 0, dr.scores.ptr if dr else 0)
        if self.graphs.get("ptrs") != ptrs:
            self.destroy_graphs()
            self.graphs = {"ptrs": ptrs}
        key, fn = self._launcher(kind, T)
        if key not in self.graphs:
            from cuda_engine.graph import capture

            self.graphs[key] = capture(e.ops, fn)
        return self.graphs[key]

    def _launcher(self, kind: str, T: int | None):
        fn = getattr(self, "_launch_" + kind)
        if T is None or T == self.T:
            return kind, fn
        if not 1 <= T <= self.T or kind not in ("verify_dev", "verify_host"):
            raise CudaEngineError(f"{kind} over {T} rows: only a verify takes a row count, 1 .. {self.T}")
        return f"{kind}:{T}", lambda: fn(T)

    def launch(self, kind: str, T: int | None = None) -> None:
        if self.engine.use_graph:
            self.graph(kind, T).launch(self.engine.ops.stream)
        else:
            self._launcher(kind, T)[1]()

    def _launch_build(self) -> None:
        e, dr, T = self.engine, self.drafter, self.T
        build_tree(e.ops, dr.buf["logits"], self.V, self.L, self.K, self.budget, T, self.top_id, self.lp, dr.meta,
                   dr.ids, self.rec, e.meta, e.buf["ids"], e.buf["positions"])

    def _launch_verify_dev(self, T: int | None = None) -> None:
        e, T = self.engine, T or self.T
        tree_mask(e.ops, DevBuf((T,), np.int32, self._rec_at(1), self.rec), T, e.meta, e.buf["mask"])
        e._launch_forward(T, masked=True, argmax_out=self._rec_at(4))
        self._logits_out(T)

    def _logits_out(self, T: int | None = None) -> None:
        """The verify logits of its T rows (all by default) next to rec, so the round comes back in one copy."""
        driver().memcpy_dtod_async(self.logits.ptr, self.engine.buf["logits"].ptr, (T or self.T) * self.V * 4,
                                   self.engine.ops.stream)

    def copy_back(self, T: int | None = None) -> RoundCopy:
        """The round's one copy to the host (its sync): rec and the logits of the verify's T rows."""
        return RoundCopy(self.io.get((self.rec.shape[0] + (T or self.T) * self.V,)), self.T, self.V)

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

    def _launch_verify_host(self, T: int | None = None) -> None:
        e, ti, T = self.engine, self.tree_in, T or self.T
        cp, s = driver().memcpy_dtod_async, e.ops.stream
        cp(e.meta.ptr, ti.ptr, 4 * 4, s)
        cp(e.buf["ids"].ptr, ti.ptr + 4 * 4, T * 4, s)
        cp(e.buf["positions"].ptr, ti.ptr + (4 + T) * 4, T * 4, s)
        tree_mask(e.ops, DevBuf((T,), np.int32, ti.ptr + (4 + 2 * T) * 4, ti), T, e.meta, e.buf["mask"])
        e._launch_forward(T, masked=True, argmax_out=self._rec_at(4))
        self._logits_out(T)

    def device_tree(self) -> tuple[Tree, np.ndarray]:
        """The device builder's tree of this round and its node scores (node_scores), copied back before the
        verify (the cost-aware round's second sync)."""
        rec = self.rec.get()
        tree, _ = unpack_tree(rec[:1 + 5 * self.T], self.T)
        return tree, node_scores(tree, self.lp.get())

    def measure_verify(self, start: int, pos0: int, on_device: bool, reps: int = 5) -> dict:
        """{rows: microseconds} of this run's verify (its graph, the kind the run launches) over a chain of
        rows - 1 nodes after `start` cached rows, for the rows of CALIBRATION_ROWS up to the tree's and the
        tree's own: CUDA events over back-to-back replays after one warm-up. The replays write cache rows start
        .. start + rows - 1 and the per-layer outputs (the drafter's features): call it before the prefill."""
        e, out = self.engine, {}
        for T in sorted({r for r in CALIBRATION_ROWS if r < self.T} | {self.T}):
            chain = _chain(T - 1, self.V)
            if on_device:                               # the device builder's places: parents in rec, the
                DevBuf((T,), np.int32, self._rec_at(1), self.rec).set(chain.parents.astype(np.int32))
                ids = np.concatenate([[0], chain.tokens])                                    # inputs in e
                e._set_inputs(ids, pos0 + start + np.arange(T), start, None)
                kind = "verify_dev"
            else:
                self.tree_in.set(pack_tree_inputs(chain, 0, start, pos0))
                kind = "verify_host"
            self.launch(kind, T)
            out[T] = timed_us(e.ops, lambda: self.launch(kind, T), reps)
        return out

    def destroy_graphs(self) -> None:
        for k, g in self.graphs.items():
            if k != "ptrs":
                g.destroy()
        self.graphs = {}

    def destroy(self) -> None:
        self.destroy_graphs()
        if self.drafter is not None:
            self.drafter.drop_graph()


def _chain(n: int, V: int) -> Tree:
    """A chain of n nodes (a tree of verify shape n + 1, for timing) whose tokens spread over the vocabulary V,
    so that its rows route to experts as varied ones do, not all to one token's."""
    i64 = np.int64
    tokens = (np.arange(1, n + 1, dtype=i64) * 7919) % V                 # 7919: a prime, coprime to V mostly
    return Tree(tokens, np.arange(1, n + 1, dtype=i64), np.arange(-1, n, dtype=i64),
                [{int(tokens[i]): i + 1} for i in range(n)] + [{}], None, np.zeros(n, i64), np.zeros(n))


def reserve_w4a16_rows(e, T: int) -> None:
    """The fast W4A16 kernel's split-K workspace for a T-row forward (the verify), reserved before the round
    graph is captured (a capture cannot allocate); the engine itself reserves only for a decode step."""
    if getattr(e, "w4a16", None) == "fast" and hasattr(e, "_reserve_w4a16"):
        e._reserve_w4a16(T)


def _record(out: list, rounds: list, start: int, tree: Tree, post, acc: list, bonus: int, T: int, logits) -> None:
    """Commit a walked round: the accepted tokens and the bonus into the stream `out` from `start` on, and its
    Round (refmodel.ddtree) for the run-dump records."""
    ids = np.concatenate([[out[start]], tree.tokens]).astype(np.int64)
    out[start + 1:] = [int(x) for x in ids[acc[1:]]] + [bonus]
    rounds.append(Round(start, tree.tokens, tree.parents, tree.depths, tree.ranks, post, acc, bonus, T,
                        len(acc) - 1, logits[acc]))


def _pipelined(e, st: DDTreeState, out: list, P: int, pos0: int, n_tokens: int, stats: dict, rounds: list) -> None:
    """The rounds with the walk on the device: as soon as round r's results are back (one copy), round r + 1
    is launched (its inputs were written by r's walk kernel), and the host records round r while the device
    runs r + 1. The host re-walks every tree (refmodel.ddtree.walk) and fails on any difference. Leaves the
    last round's verify rows in the cache (e.length = start + T), its compaction to the caller."""
    dr, T = st.drafter, st.T
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
        got = st.copy_back()                                             # round r is done; r + 1's inputs
        bonus = got.bonus                                                # are on the device already
        more = start + got.n_acc + 1 - P < n_tokens
        if more:
            st.launch("round")
            stats["drafter_forwards"] += 1
        tree, post = unpack_tree(got.tree_rec, T)
        if got.root != out[start]:
            raise CudaEngineError(f"device tree builder: root {got.root} is not the bonus {out[start]}")
        acc, host_bonus = walk(tree.child_maps, post)
        if acc != [int(a) for a in got.accepted] or host_bonus != bonus:
            raise CudaEngineError(f"round {len(rounds)}: the device walk accepted {got.accepted} "
                                  f"-> {bonus}, the host walk {acc} -> {host_bonus}")
        _record(out, rounds, start, tree, post, acc, bonus, T, got.logits)
        stats["host_syncs"] += 1
        stats["target_forwards"] += 1
        stats["rounds"] += 1
        e.length = start + T
        if not more:
            return
        dr.advance(len(acc))
        start += len(acc)


def _checked_builder(e, st: DDTreeState, prompt: np.ndarray, pos0: int, n_tokens: int, builder: str | None) -> str:
    """The tree builder this run uses, after refusing a bad prompt, pos0 or builder name: "device" falls back
    to "host" where the budget x depth is past the heap kernel's shared memory."""
    builder = builder or os.environ.get("KDTR_DDTREE_BUILDER", "device")
    if builder not in BUILDERS:
        raise CudaEngineError(f"tree builder {builder!r}: choose one of {', '.join(BUILDERS)} (KDTR_DDTREE_BUILDER)")
    P, c = len(prompt), e.cfg
    if P < 1:
        raise ValueError("ddtree_generate: the prompt must hold at least one token")
    if prompt.min() < 0 or prompt.max() >= c.vocab_size:
        raise ValueError(f"ddtree_generate: prompt ids must be in [0, {c.vocab_size}), got {prompt.min()}..{prompt.max()}")
    if pos0 < 0 or pos0 + P + n_tokens + st.T >= 2 ** 31:
        raise ValueError(f"ddtree_generate: pos0 {pos0} + prompt and tokens must stay in [0, 2^31)")
    if builder == "device" and st.drafter is not None and not st.device_builder:
        builder = "host"                     # a budget x depth past the heap kernel's shared memory
    return builder


def _prepare(e, st: DDTreeState, P: int, n_tokens: int) -> None:
    """Empty caches sized for the run: the target's for the prompt, the stream and one verify, the fast
    W4A16 kernel's workspace for a verify (for a verify of every row count up to the tree's under the
    cost-aware budget: a cut tree's verify is captured over its own rows, and its split-K plan may need more),
    the drafter's cache."""
    rows_cap = P + n_tokens + st.T + 1
    e.reset()
    e._ensure(max(P, st.T), rows_cap)
    for T in range(1, st.T + 1) if e.ddtree_budget == "cost-aware" else (st.T,):
        reserve_w4a16_rows(e, T)
    if st.drafter is not None:
        st.drafter.reset()
        st.drafter._ensure_cache(rows_cap)


def _prefill(e, prompt: np.ndarray, pos0: int) -> list:
    """The prompt's causal forward (no taps copied back); the stream so far: the prompt and its argmax."""
    P = len(prompt)
    e._set_inputs(prompt, pos0 + np.arange(P), 0, None)
    e._launch_forward(P, masked=False, argmax_out=e.buf["argmax"])
    e.length = P
    return [int(x) for x in prompt] + [int(e.buf["argmax"].get((P,))[-1])]


def ddtree_run(engine, prompt_ids, pos0: int, n_tokens: int, timing: bool = False, keep_logits: bool = False,
               builder: str | None = None):
    """The engine's own DDTree loop from an empty cache. Returns (records of docs/run-dump.md §2, stats):
    stats holds rounds, target/drafter forwards, host syncs, and with timing=True seconds per phase;
    keep_logits=True also keeps, per round (stats["verify"]), its start, tree, drafter logits [L, V], full verify
    logits [T, V] and the stream after it. builder: "device" (default; KDTR_DDTREE_BUILDER) builds the tree
    on the GPU inside the round's graph, "host" copies the drafter logits back and runs refmodel's
    build_ddtree. With the engine's cost-aware budget (CudaEngine(ddtree_budget="cost-aware"), docs/ddtree.md
    §3a) each round's tree is cut to the nodes that pay for their verify rows under the engine's Price
    (stats["price"]), verified over those rows alone, and the records declare each round's budget
    (`round_budget`); its rounds run one by one (the cut needs the tree on the host: a second sync).

    Steps: check the inputs and pick the builder, prepare the caches, prefill; then the pipelined rounds where
    they apply (device builder, graphs, no timing or kept logits: `_pipelined`), else round by round: the
    drafter's context (and last round's compaction), the draft and the tree (device builder, host builder,
    or the root alone at budget 0), the verify, its one copy back (RoundCopy), the walk and the commit
    (`_record`); finally the last compaction, so the cache is left committed."""
    e = engine
    st = e._ddtree_state()
    prompt = np.asarray(prompt_ids, np.int64).reshape(-1)
    builder = _checked_builder(e, st, prompt, pos0, n_tokens, builder)
    P, dr, T = len(prompt), st.drafter, st.T
    on_device = dr is not None and builder == "device"
    cost_aware = e.ddtree_budget == "cost-aware" and dr is not None
    _prepare(e, st, P, n_tokens)
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

    price = _price(e, st, pos0, on_device) if cost_aware else None   # before the prefill: its timing verifies
    t = clock()                                                       # write the rows the prefill then fills
    out = _prefill(e, prompt, pos0)
    stats["host_syncs"] += 1
    t = mark("prefill", t)
    ctx_rows, start, rounds, pending = np.arange(P), P, [], None        # pending: (start, accepted) to compact
    if on_device and not timing and not keep_logits and e.use_graph and not cost_aware and n_tokens > len(out) - P:
        _pipelined(e, st, out, P, pos0, n_tokens, stats, rounds)
    while len(out) - P < n_tokens:
        # -- the drafter's context: this round's rows, last round's compaction (keep = the same rows)
        q = None
        if dr is not None:
            keep_start = None if pending is None else pending[0]
            dev_rows = dr.set_round(ctx_rows, out[start], pos0, keep_start)
            if pending is not None:
                e.length = pending[0] + len(pending[1])
                pending = None
            C = len(ctx_rows)
            stats["drafter_forwards"] += 1
        # -- the draft and the tree: one graph (compact + draft + build + verify), or step by step
        scores = None
        if on_device and not timing and not cost_aware and dev_rows is dr.round_rows:
            st.launch("round")
            dr.advance(C)
        elif dr is not None:
            if keep_start is not None:
                dr.compact_target(e)
                t = mark("compact", t)
            dr.ingest(dev_rows, C, e.buf["resid_out"], e.T_cap)
            dr.advance(C)
            drafted = _draft_timer(e, price)
            dr.block(e.use_graph)
            if on_device:
                t = mark("draft", t)
                st._launch_build()
                t = mark("build", t)
                if cost_aware:
                    drafted(price)
                    tree, scores = st.device_tree()                      # a sync: the tree before its verify
                    stats["host_syncs"] += 1
                else:
                    st.launch("verify_dev")
            else:
                q = dr.logits()                                          # [L, V]; a host sync
                stats["host_syncs"] += 1
                t = mark("draft", t)
                tree = build_ddtree(q, st.budget, st.topk)
                scores = tree.scores
                t = mark("build", t)
                drafted(price)
            if cost_aware:                                               # the cut (docs/ddtree.md §3a)
                tree = prune_tree(tree, price.nodes(scores))
        else:                                                            # budget 0: AR through the same loop
            if pending is not None:
                e.compact(*pending)
                pending = None
            tree = _root_only()
        # -- the verify of a host-built tree, or of a cut one (over its own rows)
        Tv = tree.size if cost_aware or not on_device else T
        if not on_device:
            if tree.size != T and not cost_aware:
                raise CudaEngineError(f"host tree builder made {tree.size} rows where the verify was sized for {T}")
            st.tree_in.set(pack_tree_inputs(tree, out[start], start, pos0))
            st.launch("verify_host", Tv)
        elif cost_aware:
            st.launch("verify_dev", Tv)
        # -- the round's one copy back (its sync), the walk, the commit
        got = st.copy_back(Tv)
        stats["host_syncs"] += 1
        stats["target_forwards"] += 1
        t = mark("verify", t)
        if on_device and not cost_aware:
            tree, post = unpack_tree(got.tree_rec, T)
        else:
            post = got.argmax[:Tv].astype(np.int64)
        if on_device and (int(tree.parents[0]) != -1 or got.root != out[start]):
            raise CudaEngineError(f"device tree builder: root {got.root} is not the bonus {out[start]}")
        e.length = start + Tv
        acc, bonus = walk(tree.child_maps, post)
        t = mark("walk", t)
        pending = (start, acc)
        logits = got.logits[:Tv]
        _record(out, rounds, start, tree, post, acc, bonus, Tv, logits)
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
    stats["budgets"] = [len(r.tree_tokens) for r in rounds]               # nodes verified per round
    if cost_aware:                                                       # each round's budget, declared
        records[LIVE_BUDGET] = np.asarray(stats["budgets"], np.int64)
        stats["price"] = price.as_dict()
    stats["tokens"] = out[P:P + n_tokens]
    return records, stats


def _price(e, st: DDTreeState, pos0: int, on_device: bool) -> Price:
    """The run's Price: the engine's given table, else the one measured by the first cost-aware run of this
    loaded bundle with this builder (before its prefill, over the empty cache: the timing verifies write cache
    rows and the per-layer outputs the first round's drafter reads, which the prefill then writes; the draft
    cost is the least round time so far: _draft_timer). The drafter's block graph is captured first, so no capture
    falls inside a timed interval."""
    if e.ddtree_costs:
        return Price(e.ddtree_costs, e.ddtree_draft_cost, "given")
    key = ("device" if on_device else "host", e.use_graph)
    if key not in st.prices:                    # once per loaded bundle and builder: later runs reuse it
        if e.use_graph:
            st.drafter.captured_block()
        st.prices[key] = Price(st.measure_verify(0, pos0, on_device), np.nan, "measured")
    return st.prices[key]


def _draft_timer(e, price):
    """For a measured Price: CUDA events around this round's drafter block and tree build, from now to the call
    of the function returned (made once the tree is known on the host: the host builder's Python heap counts);
    the price's draft cost becomes the least such time so far. Else a no-op."""
    if price is None or price.source != "measured":
        return lambda p: None
    start, end = driver().Event(), driver().Event()
    start.record(e.ops.stream)

    def done(p: Price) -> None:
        end.record(e.ops.stream)
        end.synchronize()
        us = end.time_since(start) * 1000.0
        p.draft_us = us if np.isnan(p.draft_us) else min(p.draft_us, us)
    return done


__all__ = ["DDTreeState", "ddtree_run", "live_records", "read_drafter", "tree_rows"]
