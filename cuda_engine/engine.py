"""CudaEngine: the conformance protocol (docs/architecture.md) on hand-written CUDA kernels, float32.

Weights are uploaded once at load(); the latent KV cache lives on the device ([L, 3, S_cap, Kp]: each row's
c_kv | k_pe as three bf16 terms, kernels/kv_layout.cuh); a forward runs entirely on the device and copies back only the logits and, for the
runner, the taps. Every tap has its own per-layer device buffer ([L, T_cap, width]), so a whole forward
is one uninterrupted launch sequence and the decode step (T = 1) can be captured once as a CUDA graph
(cuda_engine/graph.py) and replayed: the step's inputs (token, position, cached rows) are read by the
kernels from small device buffers the host rewrites before each replay.

Legend: T tokens of this forward, S cached + new rows, L layers, D hidden_size, H heads, A qk_head_dim,
N qk_nope_head_dim, R qk_rope_head_dim, C kv_lora_rank, Q q_lora_rank, U v_head_dim, E routed experts,
K experts per token, V vocab, I MLP width.
"""
from __future__ import annotations

import os

import numpy as np

from conformance.engines.protocol import compact_keep
from cuda_engine.build import engine_source_hash
from cuda_engine.device import CudaEngineError, DevBuf, device_info, driver
from cuda_engine.drafter import read_drafter
from cuda_engine.ops import (ATTN_MAX_C, ATTN_MAX_N, ATTN_MAX_R, MOE_MAX_SLOTS, ROUTER_MAX_E, ROUTER_MAX_GROUPS, Ops,
                             kv_planes_shape, kv_rows_to_planes, p_terms_shape)
from cuda_engine.w4a16_plan import moe_path, w4a16_group_tokens, w4a16_groups_cap
from cuda_engine.weights import DENSE_MODES, layer_arrays, load_weights
from refmodel.config import ModelConfig
from refmodel.model import tap_names, yarn_inv_freq

T_CAP0, S_CAP0 = 64, 512            # first capacities (tokens per forward, cache rows); both grow x2
W4A16_MODES = ("fast", "plain", "dense")   # INT4 experts: kernels/w4a16_mma.cu, w4a16_plain.cu, dequantized
LINEAR_WEIGHTS = ("qkv_a", "q_b", "o_proj", "gate", "lm_head")   # the weights a forward passes to Ops.linear


def tile_linear_weights(ops: Ops, bufs: dict, host: dict) -> None:
    """Make the tiled copies (Ops.tiled) of the bf16 weights among LINEAR_WEIGHTS in bufs, from their host
    values: a forward of 2 or more rows reads them, and none may be made while a graph is captured."""
    for k in LINEAR_WEIGHTS:
        if k in bufs and bufs[k].dtype == np.uint16:
            ops.tiled(bufs[k], host[k])


def check_config(cfg: ModelConfig) -> None:
    """CudaEngineError naming the field and the limit when the kernels cannot run this config."""
    limits = [
        ("kv_lora_rank", cfg.kv_lora_rank, ATTN_MAX_C),
        ("qk_rope_head_dim", cfg.qk_rope_head_dim, ATTN_MAX_R),
        ("qk_nope_head_dim", cfg.qk_nope_head_dim, ATTN_MAX_N),
        ("n_routed_experts", cfg.n_routed_experts, ROUTER_MAX_E),
        ("n_group", cfg.n_group, ROUTER_MAX_GROUPS),
        ("num_experts_per_tok + n_shared_experts", cfg.num_experts_per_tok + cfg.n_shared_experts, MOE_MAX_SLOTS),
        ("n_shared_experts", cfg.n_shared_experts, 1),
    ]
    for field, value, limit in limits:
        if value > limit:
            raise CudaEngineError(f"unsupported config: {field} = {value} exceeds the CUDA engine's limit {limit}"
                                  + (" (the shared expert is stacked as one extra expert)"
                                     if field == "n_shared_experts" else ""))


class CudaEngine:
    name = "cuda"
    dtype = "float32"
    supports_teacher_forcing = True

    def __init__(self, use_graph: bool = True, w4a16: str | None = None, ddtree_budget: str = "fixed",
                 ddtree_costs: dict | None = None, ddtree_draft_cost: float = 0.0, dense: str = "stored"):
        self.use_graph = use_graph and os.environ.get("KDTR_CUDA_GRAPH", "1") != "0"
        # the live DDTree's budget (cuda_engine/ddtree.py): "fixed" = the bundle's every round; "cost-aware" =
        # each tree cut to the nodes that pay for their rows (docs/ddtree.md §3a), priced by ddtree_costs
        # {rows: cost} and ddtree_draft_cost (same unit) where given, else by this GPU's measured times
        from cuda_engine.ddtree import BUDGETS

        if ddtree_budget not in BUDGETS:
            raise CudaEngineError(f"DDTree budget {ddtree_budget!r}: choose one of {', '.join(BUDGETS)} "
                                  f"(--ddtree-budget)")
        if ddtree_costs and ddtree_budget != "cost-aware":
            raise CudaEngineError("verify costs price the cost-aware budget: give --ddtree-budget cost-aware with "
                                  "--ddtree-costs")
        if ddtree_costs:
            from refmodel.ddtree import verify_cost_table

            try:
                verify_cost_table(ddtree_costs)
            except ValueError as e:
                raise CudaEngineError(f"--ddtree-costs: {e}") from None
        if not np.isfinite(ddtree_draft_cost) or ddtree_draft_cost < 0:
            raise CudaEngineError(f"the drafter's cost per round must be finite and >= 0, got {ddtree_draft_cost}")
        if ddtree_draft_cost and not ddtree_costs:
            raise CudaEngineError("a drafter cost is in the unit of given verify costs (--ddtree-costs); without "
                                  "them the engine measures both itself: drop --ddtree-draft-cost or give the costs")
        self.ddtree_budget, self.ddtree_costs = ddtree_budget, dict(ddtree_costs or {})
        self.ddtree_draft_cost = float(ddtree_draft_cost)
        # INT4 experts: "fast" = repacked at load for the tensor-core kernel (w4a16_mma.cu, FP32-faithful),
        # "plain" = the packed weights as stored (w4a16_plain.cu), "dense" = dequantized at load
        self.w4a16 = w4a16 or "fast"
        if self.w4a16 not in W4A16_MODES:
            raise CudaEngineError(f"w4a16 mode {self.w4a16!r}: choose one of {', '.join(W4A16_MODES)} (--w4a16)")
        # dense matmul weights: "stored" = a bundle's bfloat16 ones stay bfloat16 on the device (half the bytes;
        # the kernels widen them exactly, so one-row results are the bits of "float32", every dense weight upcast
        # at load; a linear of 2 or more rows runs on the tensor cores instead: FP32-faithful, other bits)
        if dense not in DENSE_MODES:
            raise CudaEngineError(f"dense weights {dense!r}: choose one of {', '.join(DENSE_MODES)}")
        self.dense = dense
        self.bf16_weights = 0                 # dense matmul weights held as bf16 on the device (load)
        self.ops: Ops | None = None
        self.cfg: ModelConfig | None = None
        self.graph = None
        self.length = 0                       # cached rows (host mirror of meta[0] between forwards)
        self._held_ids: dict = {}             # layer -> [T, K] expert ids for the next forward (hold_routing)
        self.held_rows = 0                    # rows that ran held experts other than the router's own set

    # ------------------------------------------------------------ load and buffers
    def load(self, bundle) -> None:
        cfg, W = load_weights(bundle, keep_int4=self.w4a16 in ("plain", "fast"), keep_bf16=self.dense == "stored")
        check_config(cfg)
        driver()
        self.ops = self.ops or Ops()
        self.cfg = cfg
        self.layers, self.n_int4, self.int4_width = [], [], []
        for l in range(cfg.num_hidden_layers):
            arrays, n_int4 = layer_arrays(cfg, W, l)
            self.int4_width.append(arrays["gate_proj.qw"].shape[1] if n_int4 else 0)      # the experts' I
            moe = l >= cfg.first_k_dense_replace
            if n_int4 not in ((0, cfg.n_routed_experts, cfg.n_routed_experts + cfg.n_shared_experts) if moe else (0, 1)):
                raise CudaEngineError(f"layer {l}: {n_int4} INT4 expert modules; the engine runs INT4 for all routed "
                                      f"experts (and optionally the shared expert) or none")
            if n_int4 and self.w4a16 == "fast":
                arrays = _repack_fast(arrays, l)
            self.layers.append({k: DevBuf.from_array(v) for k, v in arrays.items()})
            tile_linear_weights(self.ops, self.layers[-1], arrays)
            self.n_int4.append(n_int4)
        self._reserve_w4a16()
        self.embed = DevBuf.from_array(W["model.embed_tokens.weight"])
        self.norm = DevBuf.from_array(W["model.norm.weight"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else DevBuf.from_array(W["lm_head.weight"])
        if self.lm_head.dtype == np.uint16:          # bf16: the verify's logits read its tiled copy (Ops.tiled)
            self.ops.tiled(self.lm_head, W["model.embed_tokens.weight" if cfg.tie_word_embeddings
                                           else "lm_head.weight"])
        held = [b for w in self.layers for k, b in w.items() if not k.endswith(".sc")] + [self.embed]
        held += [self.lm_head] if self.lm_head is not self.embed else []
        self.bf16_weights = sum(b.dtype == np.uint16 for b in held)
        self.inv_freq = DevBuf.from_array(yarn_inv_freq(cfg), np.float64)
        self.meta = DevBuf.from_array(np.zeros(4, np.int32))
        self.T_cap = self.S_cap = 0
        self._alloc_activations(T_CAP0, S_CAP0)
        self._alloc_cache(S_CAP0)
        self.held_rows = 0
        self.reset()
        self._drafter_host = read_drafter(bundle)       # the live DDTree's drafter (cuda_engine/drafter.py)

    def _int4_slots(self, l: int) -> tuple[int, int, int]:
        """(K routed slots, S slots per token, k4 = how many leading slots run on INT4 weights) of layer l."""
        c, n_int4 = self.cfg, self.n_int4[l]
        K, S = (c.num_experts_per_tok, c.num_experts_per_tok + c.n_shared_experts) if l >= c.first_k_dense_replace \
            else (0, 1)
        k4 = 0 if n_int4 == 0 else S if n_int4 == (c.n_routed_experts + c.n_shared_experts if K else 1) else K
        return K, S, k4

    def _reserve_w4a16(self, T: int = 1) -> None:
        """The fast kernel's split-K workspace for a forward of T tokens (a decode step by default), reserved
        before a graph of that forward is captured (a capture cannot allocate)."""
        if self.w4a16 != "fast":
            return
        need = [(0, 0)]
        for l, w in enumerate(self.layers):
            k4 = self._int4_slots(l)[2]
            if k4:
                M, Z = self._moe_launch(l, T)
                need += [self.ops.w4a16_need(w[k], M, Z, digits=moe_path(T) == "grouped", moe=True)
                         for k in ("gate_up.mma", "down.mma")]
        self.ops.w4a16_reserve(max(p for p, _ in need), max(t for _, t in need))

    def _moe_launch(self, l: int, T: int) -> tuple[int, int]:
        """(tokens per z, grid z) of layer l's fast INT4 expert launches in a forward of T tokens: up to
        w4a16_plan.MOE_PAIRS_MAX_TOKENS a (token, slot) pair per z (M = 1, Z = T k4); above, the grouped path, a
        group of at most M pairs of one expert per z (the int8 digits entries of w4a16_plan.W4A16_DIGITS_TOKENS),
        Z the most groups there can be (w4a16_plan.w4a16_groups_cap)."""
        k4 = self._int4_slots(l)[2]
        if moe_path(T) == "pairs":
            return 1, T * k4
        M = w4a16_group_tokens(T)
        return M, w4a16_groups_cap(T * k4, self.n_int4[l], M)

    def _alloc_activations(self, T_cap: int, S_cap: int) -> None:
        c, L = self.cfg, self.cfg.num_hidden_layers
        D, H, A, C, R, U = (c.hidden_size, c.num_attention_heads, c.qk_head_dim, c.kv_lora_rank,
                            c.qk_rope_head_dim, c.v_head_dim)
        E, S = c.n_routed_experts, c.num_experts_per_tok + c.n_shared_experts
        I = max(c.intermediate_size, c.moe_intermediate_size)
        f, i = np.float32, np.int32
        K = c.num_experts_per_tok
        per_layer = {"attn_in": D, "q": H * A, "qkv_a": c.q_lora_rank + C + R, "kv_latent": C, "attn_out": D, "resid_attn": D,
                     "mlp_in": D, "router_scores": E, "slot_w": S, "own_w": K, "mlp_out": D, "resid_out": D}
        self.buf = {k: DevBuf((L, T_cap, w), f) for k, w in per_layer.items()}
        self.buf["slot_ids"] = DevBuf((L, T_cap, S), i)
        self.buf["own_ids"] = DevBuf((L, T_cap, K), i)               # the router's own choice: topk_ids
        self.layer_keys = list(per_layer) + ["slot_ids", "own_ids"]  # the [L, T_cap, width] tap buffers
        # held routing: the expert ids the next forward runs, -1 = the router's choice (kernels/moe.cu);
        # all -1 except during a held forward, so a decode graph or the DDTree loop never runs stale ids
        self.buf["held"] = DevBuf.from_array(np.full((L, T_cap, K), -1, i))
        for k, shape, dt in (("x0", (T_cap, D), f), ("cq", (T_cap, c.q_lora_rank), f),
                             ("o", (T_cap, H * U), f),
                             ("act", (T_cap * S, I), f), ("y_slots", (T_cap * S, D), f), ("final", (T_cap, D), f),
                             ("logits", (T_cap, c.vocab_size), f), ("ids", (T_cap,), i), ("positions", (T_cap,), i),
                             ("argmax", (T_cap,), i), ("keep", (T_cap,), i), ("mask", (T_cap, S_cap), f),
                             ("scores", (T_cap * H, S_cap), f), ("p_terms", p_terms_shape(T_cap * H, S_cap), np.uint16),
                             ("qs", kv_planes_shape(T_cap * H, C, R), np.uint16),
                             ("partials", (self.ops.attn_partials_rows(T_cap, H, C), C + 2), f)):
            self.buf[k] = DevBuf(shape, dt)
        self.buf["dense_slots"] = DevBuf.from_array(np.zeros(T_cap, i))
        # the grouped MoE path's work list (ops.moe_group): 1 + 3 Z + pairs entries, Z <= pairs <= T_cap S
        self.buf["groups"] = DevBuf((1 + 4 * T_cap * S,), i)
        self.ops.moe_combine_reserve(T_cap, D)                        # its norm workspace, before any capture
        self.T_cap = T_cap
        self._drop_graph()

    def _alloc_cache(self, S_cap: int) -> None:
        """(Re)allocate the cache with S_cap rows per layer, keeping the rows already cached. The cache is
        `kv` [L, 3, S_cap, Kp]: each layer's c_kv | k_pe rows as three planes of bf16 terms (kernels/kv_layout.cuh)."""
        c, L = self.cfg, self.cfg.num_hidden_layers
        new = DevBuf((L,) + kv_planes_shape(S_cap, c.kv_lora_rank, c.qk_rope_head_dim), np.uint16)
        if self.S_cap and self.length:
            old = self.cache["kv"]
            for l in range(L):
                for t in range(3):
                    new.view(l).view(t).copy_from(old.view(l).view(t), self.length * old.shape[3] * 2)
        self.cache, self.S_cap = {"kv": new}, S_cap
        self._drop_graph()

    def _ensure(self, T: int, S: int) -> None:
        """Capacity for a forward of T tokens with S rows in the cache afterwards."""
        if S > self.S_cap:
            self._alloc_cache(max(S, 2 * self.S_cap))
        if T > self.T_cap or self.buf["scores"].shape[1] < self.S_cap:
            T_cap = self.T_cap
            while T_cap < T:
                T_cap *= 2
            self._alloc_activations(T_cap, self.S_cap)

    def _drop_graph(self) -> None:
        if self.graph is not None:
            self.graph.destroy()
            self.graph = None

    # ------------------------------------------------------------ the protocol
    def reset(self) -> None:
        self.length = 0

    def hold_routing(self, ids: dict | None) -> None:
        """The expert sets the next prefill/decode/verify_tree runs ({layer: [T, K]}, a row of -1: the router
        decides; conformance/engines/protocol.py). The router still reports its own scores, ids and weights; the
        MoE runs the held ids, weighted from its own scores there (kernels/moe.cu, router_kernel)."""
        self._held_ids = {int(l): np.asarray(v, np.int64) for l, v in (ids or {}).items()}

    def prefill(self, ids, positions):
        return self._forward(ids, positions, None)

    def decode(self, token, position):
        return self._forward([token], [position], None)

    def verify_tree(self, ids, positions, mask):
        return self._forward(ids, positions, mask)

    def compact(self, start, keep) -> None:
        keep = compact_keep(start, keep, self.length)         # the protocol's one check of the arguments
        if keep.size:
            self.buf["keep"].set(keep.astype(np.int32))
            self.ops.kv_compact(self.cache["kv"], self.buf["keep"], keep.size, start)
        self.length = start + keep.size

    def ddtree_generate(self, prompt_ids, pos0: int, n_tokens: int) -> dict:
        """The engine's own greedy DDTree loop on the GPU (cuda_engine/ddtree.py): its drafter, its trees, its
        verify forwards, from an empty cache; the records of docs/run-dump.md §2 (`ddtree_live/`)."""
        from cuda_engine.ddtree import ddtree_run

        return ddtree_run(self, prompt_ids, int(pos0), int(n_tokens))[0]

    def _ddtree_state(self):
        """The drafter on the device and the verify graph, built on first use after each load()."""
        dd = getattr(self, "_dd", None)
        if dd is None or dd.cfg is not self.cfg:
            from cuda_engine.ddtree import DDTreeState

            if dd is not None:
                dd.destroy()
            self._dd = dd = DDTreeState(self, self._drafter_host)
        return dd

    def run_layer(self, layer: int, inputs: dict) -> dict:
        """Layer `layer` alone on golden inputs, with its own temporary cache holding the golden rows."""
        c = self.cfg
        h = np.asarray(inputs["hidden"], np.float32)
        ckv, kpe = np.asarray(inputs["c_kv"], np.float32), np.asarray(inputs["k_pe"], np.float32)
        T, S = h.shape[0], ckv.shape[0]
        self._ensure(T, S + T)
        tmp_kv = DevBuf.from_array(kv_rows_to_planes(ckv, kpe, S + T))   # the golden rows as the cache holds them
        self._set_inputs(None, inputs["positions"], S, None)
        self.buf["x0"].set(h)
        self.ops.rms_norm(self.buf["x0"], c.hidden_size, self.layers[layer]["input_ln"],
                          self.buf["attn_in"].view(layer), c.hidden_size, c.hidden_size, T, c.rms_norm_eps)
        self._layer(layer, T, self.buf["x0"], tmp_kv, masked=False)
        self.ops.stream.synchronize()
        return self._layer_taps(layer, T)

    # ------------------------------------------------------------ one forward
    def _set_inputs(self, ids, positions, S0: int, mask) -> None:
        positions = np.asarray(positions, np.int64).reshape(-1)
        if positions.size and (positions.min() < 0 or positions.max() >= 2**31):
            raise ValueError(f"positions must be in [0, 2^31), got {positions.min()}..{positions.max()}")
        if ids is not None:
            self.buf["ids"].set(np.asarray(ids, np.int32))
        self.buf["positions"].set(positions.astype(np.int32))
        self.meta.set(np.array([S0, 0, 0, 0], np.int32))
        if mask is not None:
            T, S = mask.shape
            full = np.full((T, self.S_cap), -np.inf, np.float32)   # columns >= S are never read
            full[:, :S] = mask
            self.buf["mask"].set(full)

    def _forward(self, ids, positions, mask):
        c = self.cfg
        if c is None:
            raise RuntimeError("CudaEngine: load() a bundle first")
        ids = np.asarray(ids, np.int64).reshape(-1)
        positions = np.asarray(positions, np.int64).reshape(-1)
        T = ids.shape[0]
        if T == 0 or positions.shape[0] != T:
            raise ValueError(f"forward: need T >= 1 ids and as many positions, got {T} ids, {positions.shape[0]}")
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"forward: token ids must be in [0, {c.vocab_size}), got {ids.min()}..{ids.max()}")
        if mask is not None:
            mask = np.asarray(mask, np.float32)
            if mask.shape != (T, self.length + T):
                raise ValueError(f"verify_tree: mask shape {mask.shape} must be [T, S_cache + T] = "
                                 f"{(T, self.length + T)}")
        held, self._held_ids = self._held_ids, {}                                     # held for one call only
        self._ensure(T, self.length + T)
        self._set_inputs(ids, positions, self.length, mask)
        self._set_held(held, T)
        try:
            if T == 1 and mask is None and self.use_graph:
                self._decode_graph().launch(self.ops.stream)
            else:
                self._launch_forward(T, masked=mask is not None, argmax_out=self.buf["argmax"])
            self.ops.stream.synchronize()
        finally:
            if held:                                                                  # back to "router decides"
                self.buf["held"].set(np.full(self.buf["held"].shape, -1, np.int32))
        self.length += T
        logits = self.buf["logits"].get()[:T].copy()                                 # [T, V]
        taps = self._taps(T)
        taps["logits"] = logits.copy()
        for l, v in held.items():                                                     # rows whose held set is
            own = np.sort(taps[f"L{l}/topk_ids"], -1)                                 # not the router's own
            self.held_rows += int(np.count_nonzero((v >= 0).all(-1) & (np.sort(v, -1) != own).any(-1)))
        return logits, taps

    def _set_held(self, held: dict, T: int) -> None:
        """Write this forward's held expert ids into the device buffer the router reads (checked first)."""
        if not held:
            return
        c = self.cfg
        K, E = c.num_experts_per_tok, c.n_routed_experts
        rows = np.full(self.buf["held"].shape, -1, np.int32)                           # [L, T_cap, K]
        for l, v in held.items():
            if not c.first_k_dense_replace <= l < c.num_hidden_layers or v.shape != (T, K):
                raise ValueError(f"hold_routing: layer {l}, held ids of shape {v.shape}: need an MoE layer in "
                                 f"[{c.first_k_dense_replace}, {c.num_hidden_layers}) and shape [{T}, {K}]")
            ok = ((v >= 0) & (v < E)).all(-1) | (v == -1).all(-1)                     # [T]
            if not ok.all():
                raise ValueError(f"hold_routing: layer {l}: each row must be {K} expert ids in [0, {E}) or all "
                                 f"-1, got {v[~ok][0].tolist()}")
            rows[l, :T] = v
        self.buf["held"].set(rows)

    def _decode_graph(self):
        """The decode step (T = 1) captured once; the argmax feeds ids[0] and the advance kernel moves the
        step inputs on, so back-to-back replays generate greedily without the host (bench/)."""
        if self.graph is None:
            from cuda_engine.graph import capture

            def step():
                self._launch_forward(1, masked=False, argmax_out=self.buf["ids"])
                self.ops.decode_advance(self.meta, self.buf["positions"])

            self.graph = capture(self.ops, step)
        return self.graph

    def _launch_forward(self, T: int, masked: bool, argmax_out) -> None:
        c, o, b = self.cfg, self.ops, self.buf
        D, L = c.hidden_size, c.num_hidden_layers
        o.embedding(b["ids"], self.embed, b["x0"], T, self.layers[0]["input_ln"], b["attn_in"].view(0), c.rms_norm_eps)
        for l in range(L):
            h_in = b["x0"] if l == 0 else b["resid_out"].view(l - 1)
            self._layer(l, T, h_in, self.cache["kv"].view(l), masked)
        o.linear(b["final"], self.lm_head, b["logits"], T, D, c.vocab_size)
        o.argmax(b["logits"], c.vocab_size, argmax_out, T)

    def _layer(self, l: int, T: int, h_in, kv: DevBuf, masked: bool) -> None:
        """Layer l on attn_in[l] (already normed from h_in); ends with the next norm (or the final one)."""
        c, o, b, w = self.cfg, self.ops, self.buf, self.layers[l]
        D, H, R, C, Q, U = (c.hidden_size, c.num_attention_heads, c.qk_rope_head_dim, c.kv_lora_rank, c.q_lora_rank,
                            c.v_head_dim)
        x, qkv, lat = b["attn_in"].view(l), b["qkv_a"].view(l), b["kv_latent"].view(l)
        # attention: the fused q_a/kv_a GEMV, both latent norms + k rope + cache append, queries
        o.linear(x, w["qkv_a"], qkv, T, D, Q + C + R)                                 # [T, D] -> [T, Q + C + R]
        o.mla_latent(qkv, T, Q, C, R, w["q_a_ln"], w["kv_a_ln"], c.latent_norm_eps, b["cq"], lat, kv,
                     self.meta, b["positions"], self.inv_freq, c.rope_attention_factor)
        self._mla_core(l, T, kv, masked)                                        # [T, Q] -> [T, H, U]
        o.linear(b["o"], w["o_proj"], b["attn_out"].view(l), T, H * U, D)             # [T, H U] -> [T, D]
        o.add_rms_norm(h_in, b["attn_out"].view(l), b["resid_attn"].view(l), w["post_ln"], b["mlp_in"].view(l),
                       T, c.rms_norm_eps)
        self._mlp_half(l, T)

    def _mla_core(self, l: int, T: int, kv: DevBuf, masked: bool) -> None:
        """Layer l's absorbed MLA over the latent cache, c_q -> o [T, H, U] (q_b_proj, q rope, W_uk and W_uv
        inside; kernels/attention.cu); also timed alone by bench/k26_ddtree_gpu.py."""
        c, b, w = self.cfg, self.buf, self.layers[l]
        self.ops.mla_attention(b["cq"], w["q_b"], b["q"].view(l), b["positions"], self.inv_freq,
                               c.rope_attention_factor, w["w_uk"], w["w_uv"], kv, self.meta,
                               b["mask"] if masked else None, self.S_cap, b["scores"], b["p_terms"], self.S_cap,
                               b["partials"], b["qs"], b["o"], T, c.qk_rope_head_dim, c.softmax_scale)

    def _mlp_half(self, l: int, T: int) -> None:
        """Layer l from mlp_in[l]: the router and the experts (routed + shared), or the dense MLP as one slot
        of expert 0, then the combine with the residual and the next norm (or the final one); also timed alone
        by bench/k26_ddtree_gpu.py."""
        c, o, b, w = self.cfg, self.ops, self.buf, self.layers[l]
        D = c.hidden_size
        xm = b["mlp_in"].view(l)
        if l >= c.first_k_dense_replace:
            K, S = c.num_experts_per_tok, c.num_experts_per_tok + c.n_shared_experts
            o.router(xm, w["gate"], w["bias"], b["router_scores"].view(l), b["slot_ids"].view(l),       # [T, D] -> [T, E]
                     b["slot_w"].view(l), T, K, S, c.n_group, c.topk_group, c.norm_topk_prob,
                     c.routed_scaling_factor, b["held"].view(l), b["own_ids"].view(l), b["own_w"].view(l))
            slots = b["slot_ids"].view(l)
        else:
            K, S, slots = 0, 1, b["dense_slots"]
        n_int4 = self.n_int4[l]                 # INT4 experts stacked first: slots [0, k4) run on packed weights
        k4 = self._int4_slots(l)[2]
        if k4 and self.w4a16 == "fast" and moe_path(T) == "pairs":   # one launch for gate+up, one for down, a
            I = self.int4_width[l]                   # (token, slot) pair per z (the int8 digits): decode, small trees
            o.w4a16_mma(xm, D, w["gate_up.mma"], I, b["act"], I, mode=1, slot_ids=slots, T=T, S=S, k0=0, nk=k4)
            o.w4a16_mma(b["act"], I, w["down.mma"], D, b["y_slots"], D, mode=0, slot_ids=slots, T=T, S=S, k0=0,
                        nk=k4, x_by_slot=True)
        elif k4 and self.w4a16 == "fast":       # larger T: the pairs grouped by expert (on the device), each touched
            I = self.int4_width[l]              # expert's weights read once for up to M of its tokens, one launch
            M, Z = self._moe_launch(l, T)       # each for gate+up and down over every group (the int8 digits)
            o.moe_group(slots, T, S, 0, k4, 0, n_int4, M, Z, b["groups"])
            o.w4a16_mma(xm, D, w["gate_up.mma"], I, b["act"], I, M, mode=1, groups=b["groups"], Z=Z, S=S,
                        digits=True)
            o.w4a16_mma(b["act"], I, w["down.mma"], D, b["y_slots"], D, M, mode=0, groups=b["groups"], Z=Z, S=S,
                        x_by_slot=True, digits=True)
        elif k4:
            o.w4a16_gate_up(xm, w["gate_proj.qw"], w["gate_proj.sc"], w["up_proj.qw"], w["up_proj.sc"], slots,
                            b["act"], T, S, 0, k4)                                    # [T S, I]
            o.w4a16_down(b["act"], w["down_proj.qw"], w["down_proj.sc"], slots, b["y_slots"], T, S, 0, k4)
        if k4 < S:                                                                    # dense (shared) slots
            o.swiglu_gate_up(xm, w["gate_proj"], w["up_proj"], slots, b["act"], T, S, k4, S - k4, n_int4)
            o.expert_down(b["act"], w["down_proj"], slots, b["y_slots"], T, S, k4, S - k4, n_int4)
        last = l == c.num_hidden_layers - 1                                           # + residual, next norm:
        o.moe_combine(b["y_slots"], slots, b["slot_w"].view(l), b["mlp_out"].view(l), T, K, S,
                      b["resid_attn"].view(l), b["resid_out"].view(l),
                      self.norm if last else self.layers[l + 1]["input_ln"],
                      b["final"] if last else b["attn_in"].view(l + 1), c.rms_norm_eps)

    # ------------------------------------------------------------ taps back to the host
    def _host(self, key: str, T: int) -> np.ndarray:
        buf = self.buf[key]
        return buf.get()[:, :T]                                                       # [L, T, width]

    def _layer_taps(self, l: int, T: int, host=None) -> dict:
        c = self.cfg
        H, A, C = c.num_attention_heads, c.qk_head_dim, c.kv_lora_rank
        K = c.num_experts_per_tok
        host = host or {k: self._host(k, T) for k in self.layer_keys}
        QC = c.q_lora_rank + C
        values = {"attn_in": host["attn_in"][l], "q": host["q"][l].reshape(T, H, A),
                  "kv_latent": host["kv_latent"][l], "k_pe": host["qkv_a"][l][:, QC:], "attn_out": host["attn_out"][l],
                  "resid_attn": host["resid_attn"][l], "mlp_in": host["mlp_in"][l],
                  "router_scores": host["router_scores"][l], "topk_ids": host["own_ids"][l].astype(np.int64),
                  "topk_weights": host["own_w"][l], "mlp_out": host["mlp_out"][l],
                  "resid_out": host["resid_out"][l]}
        return {f"L{l}/{t}": np.ascontiguousarray(values[t]) for t in tap_names(c, l)}

    def _taps(self, T: int) -> dict:
        c = self.cfg
        host = {k: self._host(k, T) for k in self.layer_keys}
        taps = {}
        for l in range(c.num_hidden_layers):
            taps.update(self._layer_taps(l, T, host))
        taps["final_hidden"] = self.buf["final"].get()[:T].copy()
        return taps

    # ------------------------------------------------------------ provenance for GPU proofs
    def dump_metadata(self) -> dict:
        """What a GPU proof records (docs/cuda-engine.md): device, driver, commit, source hash."""
        info = device_info()
        info.update(source_hash=engine_source_hash(), commit=_commit(), fatbin=os.path.basename(str(self.ops.fatbin)),
                    cuda_graph=self.use_graph, w4a16=self.w4a16 if any(self.n_int4) else None,
                    # the dense matmul weights held as bfloat16 bits on the device (dense="stored", bf16-stored ones)
                    bf16_weights=self.bf16_weights,
                    # what this engine launched since it was made (a captured graph's launches once, at capture):
                    # kernel entries and the fast W4A16 launches' "path:regime" (cuda_engine/w4a16_plan.py), by count
                    kernels_ran=dict(sorted(self.ops.ran.items())),
                    w4a16_regimes=dict(sorted(self.ops.w4a16_regimes.items())))
        return info


def _repack_fast(arrays: dict, l: int) -> dict:
    """Layer arrays with the INT4 experts repacked for w4a16_mma (cuda_engine/w4a16_pack.py) in place of
    their .qw/.sc: gate+up interleaved for the fused SwiGLU launch, down for the second launch."""
    from cuda_engine.w4a16_pack import pack_experts, pack_experts_gate_up
    from kdtr_format.int4 import Int4LayoutError

    a = dict(arrays)
    try:
        a["gate_up.mma"] = pack_experts_gate_up(a.pop("gate_proj.qw"), a.pop("gate_proj.sc"), a.pop("up_proj.qw"),
                                                a.pop("up_proj.sc"))
        a["down.mma"] = pack_experts(a.pop("down_proj.qw"), a.pop("down_proj.sc"))
    except Int4LayoutError as e:
        raise CudaEngineError(f"layer {l}: {e}") from None
    return a


def _commit() -> str:
    """KDTR_COMMIT (set by cuda_engine/device_run.sh, where .git may be absent), else git, else unknown."""
    if os.environ.get("KDTR_COMMIT"):
        return os.environ["KDTR_COMMIT"]
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
