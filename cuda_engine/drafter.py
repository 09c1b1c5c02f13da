"""The DFlash drafter on the GPU (docs/ddtree.md §2), float32, from the bundle's `drafter.*` weights.

Same maths as refmodel/drafter.py's `drafter_forward`, split in two so the per-round part has fixed
shapes:

- `ingest(rows)`: the context rows committed since the last call (the target's per-layer residual
  outputs of its last forward, gathered on the device in path order) are fused (fc + hidden_norm) and
  their K (k_norm, RoPE) and V appended to the drafter cache, every layer. C rows, C varies per round.
- `block()`: one forward over [bonus, MASK x (B-1)] attending to every cached row and every block row
  (no mask), the drafter's final norm and the target's lm_head: the per-depth logits [B-1, V] on the
  device. Always B rows, so it is captured once as a CUDA graph and replayed (cuda_engine/graph.py).

The block rows' K/V never enter the cache (refmodel: "block rows never are"), so after a call the cache
holds exactly the committed positions. Row offsets and positions live in a small device block (`meta`,
kernels/drafter_meta.cuh), rewritten by the host before each call.

Legend: B block rows, C new context rows, S cached rows, D hidden, F = len(target_layer_ids) D, H query
heads, G kv heads, Dh head dim, I MLP width, V vocab.
"""
from __future__ import annotations

import numpy as np

from cuda_engine.device import CudaEngineError, DevBuf
from cuda_engine.ops import BLOCK, WARPS_PER_BLOCK, need_kv_cache, weight_kernel
from kdtr_format import open_kdtr
from refmodel import drafter as refmodel_drafter
from refmodel.drafter import DrafterConfig, drafter_shapes

# kernels/drafter.cu and kernels/ddtree.cu: name -> argument types (struct codes as cuda_engine/ops.py)
DRAFTER_SIGNATURES = {
    "drafter_gather_kernel": "PqiPiPP",
    "drafter_embed_kernel": "PPPPi",
    "drafter_embed_bf16_kernel": "PPPPi",
    "drafter_block_qk_kernel": "PiiiPPfPPPP",
    "drafter_ctx_kv_kernel": "PiiPfPPPP",
    "drafter_attention_kernel": "PPPPPPiiiifPiP",
    "silu_mul_kernel": "PPi",
    "tree_mask_kernel": "PiPPi",
    "ddtree_topk_kernel": "PiiPP",
    "ddtree_heap_kernel": "PPiiiiPPPPPP",
    "ddtree_topk_sort_kernel": "PiiiPP",
    "ddtree_compact_kernel": "PPPii",
    "ddtree_walk_kernel": "PiPi",
}
TOPK_SORT_MAX = 4096              # kernels/ddtree.cu: the bitonic top-K up to this vocabulary
WARP = (32, 1, 1)
S_CAP0 = 512                      # first drafter-cache capacity (rows); grows x2


def read_drafter(bundle) -> tuple[DrafterConfig, dict, dict] | None:
    """(drafter config, float32 drafter weights (stored bfloat16: exact), the bundle's `ddtree` settings), or
    None for a bundle without a drafter. `bundle`: a path or an open KdtrFile."""
    if isinstance(bundle, (str, bytes)) or hasattr(bundle, "__fspath__"):
        with open_kdtr(bundle) as f:
            return read_drafter(f)
    meta = bundle.metadata
    if "drafter_config" not in meta:
        return None
    dcfg, DW64 = refmodel_drafter.read_drafter(bundle)                  # the one reader (refmodel/drafter.py)
    DW = {n: w.astype(np.float32) for n, w in DW64.items()}             # stored bfloat16: exact in float32
    missing = sorted(set(drafter_shapes(dcfg)) - set(DW))
    if missing:
        raise CudaEngineError(f"bundle drafter: tensors {missing[:3]} missing for its drafter_config")
    return dcfg, DW, dict(meta.get("ddtree", {}))


def prepare_kernels(ops) -> None:
    """Prepare kernels/drafter.cu's and kernels/ddtree.cu's functions in the engine's module (once per Ops)."""
    for name, sig in DRAFTER_SIGNATURES.items():
        if name not in ops.fn:
            f = ops.module.get_function(name)
            f.prepare(sig)
            ops.fn[name] = f


class CudaDrafter:
    """The drafter's weights, cache and scratch on the device of `engine` (a loaded CudaEngine)."""

    def __init__(self, engine, dcfg: DrafterConfig, DW: dict):
        c = engine.cfg
        if dcfg.hidden_size != c.hidden_size or dcfg.vocab_size != c.vocab_size:
            raise CudaEngineError(f"bundle drafter: hidden_size {dcfg.hidden_size} / vocab_size {dcfg.vocab_size} "
                                  f"must equal the target's {c.hidden_size} / {c.vocab_size}")
        if max(dcfg.target_layer_ids) >= c.num_hidden_layers:
            raise CudaEngineError(f"bundle drafter: target_layer_ids {dcfg.target_layer_ids} outside the target's "
                                  f"{c.num_hidden_layers} layers")
        if dcfg.head_dim % 2 or dcfg.head_dim > 128:
            raise CudaEngineError(f"bundle drafter: head_dim {dcfg.head_dim} must be even (NeoX RoPE halves) and "
                                  f"at most 128 (drafter_attention_kernel)")
        prepare_kernels(engine.ops)
        self.engine, self.ops, self.dcfg = engine, engine.ops, dcfg
        B, Dh = dcfg.block_size, dcfg.head_dim
        D, H, G, I = dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.intermediate_size
        up = DevBuf.from_array
        self.w = {"fc": up(DW["drafter.fc.weight"]), "hidden_norm": up(DW["drafter.hidden_norm.weight"]),
                  "norm": up(DW["drafter.norm.weight"])}
        self.pe = up(DW["drafter.block_pos_embed"][:B]) if dcfg.block_pos_embed else None
        self.layers = []
        for l in range(dcfg.num_hidden_layers):
            p = f"drafter.layers.{l}."
            g = lambda n: DW[p + n]                                         # noqa: E731
            self.layers.append({
                "input_ln": up(g("input_layernorm.weight")), "post_ln": up(g("post_attention_layernorm.weight")),
                "qkv": up(np.concatenate([g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"),
                                          g("self_attn.v_proj.weight")])),           # [(H + 2G) Dh, D]
                "kv": up(np.concatenate([g("self_attn.k_proj.weight"), g("self_attn.v_proj.weight")])),  # [2G Dh, D]
                "q_norm": up(g("self_attn.q_norm.weight")), "k_norm": up(g("self_attn.k_norm.weight")),
                "o_proj": up(g("self_attn.o_proj.weight")),
                "gate_up": up(np.concatenate([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")])),  # [2I, D]
                "down": up(g("mlp.down_proj.weight"))})
        half = Dh // 2
        self.inv_freq = up(dcfg.rope_theta ** (-np.arange(half, dtype=np.float64) / half), np.float64)
        self.layer_ids = up(np.asarray(dcfg.target_layer_ids, np.int32))
        # meta (kernels/drafter_meta.cuh), the block ids, a round's context rows: one host->device copy per round
        self.inp = DevBuf.from_array(np.zeros(8 + 2 * B, np.int32))
        self.meta = self.inp
        self.ids = DevBuf((B,), np.int32, self.inp.ptr + 8 * 4, self.inp)
        self.round_rows = DevBuf((B,), np.int32, self.inp.ptr + (8 + B) * 4, self.inp)
        f = np.float32
        self.buf = {"h": DevBuf((B, D), f), "x": DevBuf((B, D), f), "qkv": DevBuf((B, (H + 2 * G) * Dh), f),
                    "q": DevBuf((B, H * Dh), f), "kb": DevBuf((B, G * Dh), f), "o": DevBuf((B, H * Dh), f),
                    "a": DevBuf((B, D), f), "gu": DevBuf((B, 2 * I), f), "act": DevBuf((B, I), f),
                    "logits": DevBuf((B - 1, dcfg.vocab_size), f)}
        self.C_cap = 0
        self.S_cap = 0
        self.length = 0
        self.graph = None
        self._ensure_ctx(max(64, B))
        self._ensure_cache(S_CAP0)

    # ------------------------------------------------------------ capacity
    def _ensure_ctx(self, C: int) -> None:
        if C <= self.C_cap:
            return
        d, f = self.dcfg, np.float32
        cap = max(C, 2 * self.C_cap)
        self.rows = DevBuf((cap,), np.int32)
        self.cbuf = {"feat": DevBuf((cap, len(d.target_layer_ids) * d.hidden_size), f),
                     "fc": DevBuf((cap, d.hidden_size), f), "c": DevBuf((cap, d.hidden_size), f),
                     "kv": DevBuf((cap, 2 * d.num_key_value_heads * d.head_dim), f)}
        self.C_cap = cap

    def _ensure_cache(self, S: int) -> None:
        """Cache capacity for S rows, keeping the cached ones (drops the captured block graph)."""
        if S <= self.S_cap:
            return
        d = self.dcfg
        cap = max(S, 2 * self.S_cap)
        w = d.num_key_value_heads * d.head_dim
        new = [(DevBuf((cap, w), np.float32), DevBuf((cap, w), np.float32)) for _ in range(d.num_hidden_layers)]
        if self.S_cap and self.length:
            for (k, v), (ok, ov) in zip(new, self.cache):
                k.copy_from(ok, self.length * w * 4)
                v.copy_from(ov, self.length * w * 4)
        self.cache, self.S_cap = new, cap
        self.scores = DevBuf((d.block_size * d.num_attention_heads, cap + d.block_size), np.float32)
        self.drop_graph()

    def drop_graph(self) -> None:
        if self.graph is not None:
            self.graph.destroy()
            self.graph = None

    def reset(self) -> None:
        self.length = 0

    # ------------------------------------------------------------ one call
    def set_round(self, rows, bonus: int, pos0: int, keep_start: int | None = None):
        """Host -> device in one copy: meta for ingesting the context rows `rows` (the target's last forward's
        row indices, in path order) at the cache's end, the block [bonus, MASK...] right after them, and the
        rows; with keep_start, also the target compaction keeping those rows after keep_start
        (compact_target). Returns the device buffer holding the rows."""
        d, S, B = self.dcfg, self.length, self.dcfg.block_size
        rows = np.asarray(rows, np.int32)
        C, start = len(rows), self.length + len(rows)
        self._ensure_cache(start)
        inp = np.zeros(8 + 2 * B, np.int32)
        inp[:7] = (S, pos0 + S, start, pos0 + start, 0 if keep_start is None else C, keep_start or 0, C)
        inp[8] = bonus
        inp[9:8 + B] = d.mask_token_id
        if C <= B:
            inp[8 + B:8 + B + C] = rows                         # rows past C stay 0: a valid row to gather
            dev_rows = self.round_rows
        else:                                                   # the prompt: more rows than a round has
            self._ensure_ctx(C)
            self.rows.set(rows)
            dev_rows = self.rows
        self.inp.set(inp)
        return dev_rows

    def compact_target(self, engine) -> None:
        """The target cache's in-order compaction that set_round described (n and start read on the device)."""
        kv = engine.cache["kv"]                                  # [L, 3, rows, Kp]
        need_kv_cache(kv, "ddtree_compact")
        self.ops._launch("ddtree_compact_kernel", (kv.shape[0],), kv.ptr, self.round_rows.ptr, self.meta.ptr,
                         kv.shape[2], kv.shape[3])

    def ingest(self, dev_rows: DevBuf, C: int, resid_out: DevBuf, T_cap: int) -> None:
        """Append the context of C committed rows (set_round's row buffer): their features from the target's
        per-layer outputs resid_out [L, T_cap, D], fused, K/V into the cache of every layer. The advance of
        `length` is the caller's (advance). A captured round launches it over B rows (the most a round
        commits); the kernels write the first C (meta)."""
        d, o = self.dcfg, self.ops
        D, G, Dh, nL = d.hidden_size, d.num_key_value_heads, d.head_dim, len(d.target_layer_ids)
        if C <= 0:
            return
        self._ensure_ctx(C)
        cb = self.cbuf
        o._launch("drafter_gather_kernel", (C, nL), resid_out.ptr, T_cap * D, D, self.layer_ids.ptr, nL,
                  dev_rows.ptr, cb["feat"].ptr)
        o.linear(cb["feat"], self.w["fc"], cb["fc"], C, nL * D, D)                      # [C, F] -> [C, D]
        o.rms_norm(cb["fc"], D, self.w["hidden_norm"], cb["c"], D, D, C, d.rms_norm_eps)
        for l, w in enumerate(self.layers):
            o.linear(cb["c"], w["kv"], cb["kv"], C, D, 2 * G * Dh)                      # [C, D] -> [C, 2G Dh]
            o._launch("drafter_ctx_kv_kernel", (C, G), cb["kv"].ptr, G, Dh, w["k_norm"].ptr, d.rms_norm_eps,
                      self.meta.ptr, self.inv_freq.ptr, self.cache[l][0].ptr, self.cache[l][1].ptr, block=WARP)

    def advance(self, C: int) -> None:
        self.length += C

    def block(self, use_graph: bool = True) -> None:
        """The block forward: per-depth logits [B-1, V] into buf["logits"] (no host sync)."""
        if not use_graph:
            return self._launch_block()
        self.captured_block().launch(self.ops.stream)

    def captured_block(self):
        """The block forward's graph, captured on first use."""
        if self.graph is None:
            from cuda_engine.graph import capture

            self.graph = capture(self.ops, self._launch_block)
        return self.graph

    def _launch_block(self) -> None:
        d, o, b, e = self.dcfg, self.ops, self.buf, self.engine
        D, H, G, Dh, B, I = (d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.block_size,
                             d.intermediate_size)
        eps = d.rms_norm_eps
        o._launch(weight_kernel("drafter_embed", "drafter", e.embed), (B,), self.ids.ptr, e.embed.ptr,
                  0 if self.pe is None else self.pe.ptr,
                  b["h"].ptr, D)
        o.rms_norm(b["h"], D, self.layers[0]["input_ln"], b["x"], D, D, B, eps)
        for l, w in enumerate(self.layers):
            o.linear(b["x"], w["qkv"], b["qkv"], B, D, (H + 2 * G) * Dh)
            o._launch("drafter_block_qk_kernel", (B, H + G), b["qkv"].ptr, H, G, Dh, w["q_norm"].ptr,
                      w["k_norm"].ptr, eps, self.meta.ptr, self.inv_freq.ptr, b["q"].ptr, b["kb"].ptr, block=WARP)
            o._launch("drafter_attention_kernel", (B * H,), b["q"].ptr, b["kb"].ptr, b["qkv"].ptr,
                      self.cache[l][0].ptr, self.cache[l][1].ptr, self.meta.ptr, B, H, G, Dh,
                      np.float32(Dh ** -0.5), self.scores.ptr, self.scores.shape[1], b["o"].ptr)
            o.linear(b["o"], w["o_proj"], b["a"], B, H * Dh, D)
            o.add_rms_norm(b["h"], b["a"], b["h"], w["post_ln"], b["x"], B, eps)      # h += attn; x = norm(h)
            o.linear(b["x"], w["gate_up"], b["gu"], B, D, 2 * I)
            o._launch("silu_mul_kernel", (B,), b["gu"].ptr, b["act"].ptr, I)
            o.linear(b["act"], w["down"], b["a"], B, I, D)
            nxt = self.layers[l + 1]["input_ln"] if l + 1 < len(self.layers) else self.w["norm"]
            o.add_rms_norm(b["h"], b["a"], b["h"], nxt, b["x"], B, eps)               # h += mlp; x = next norm
        # block row 0 (the bonus) is dropped: rows 1 .. B-1 through the target's lm_head
        o.linear(b["x"].ptr + D * 4, e.lm_head, b["logits"], B - 1, D, d.vocab_size)

    def logits(self) -> np.ndarray:
        """The last block's per-depth logits [B-1, V] (synchronous copy)."""
        return self.buf["logits"].get()


def heap_smem_bytes(N: int, L: int, K: int) -> int:
    """Dynamic shared memory of ddtree_heap_kernel: 2N + 2 entries (score, parent, depth, rank), N + 1 paths,
    the staged lp and top_id [L, K]."""
    cap = 2 * N + 2
    return cap * (8 + 12) + (N + 1) * L * 4 + L * K * 8


HEAP_SMEM_MAX = 48 * 1024          # the default dynamic shared-memory limit per block


def build_tree(ops, logits, V: int, L: int, K: int, N: int, T: int, top_id: DevBuf, lp: DevBuf, dmeta: DevBuf,
               block_ids: DevBuf, rec, t_meta: DevBuf, t_ids: DevBuf, t_pos: DevBuf, topk: bool = True) -> None:
    """The device builder (kernels/ddtree.cu): per-depth top-K and log-probs of logits [L, V] (skipped with
    topk=False: top_id/lp hold them already), then the best-first search for N nodes into rec
    [1 + 4T] (n, ids, parents, depths, ranks) and the target's verify inputs."""
    prepare_kernels(ops)
    _need = heap_smem_bytes(N, L, K)
    if _need > HEAP_SMEM_MAX or K > 4096:
        raise CudaEngineError(f"device tree builder: budget {N} x depth {L} needs {_need} bytes of shared memory "
                              f"(max {HEAP_SMEM_MAX}); use the host builder (KDTR_DDTREE_BUILDER=host)")
    if topk:
        lg = logits if isinstance(logits, int) else logits.ptr
        if V <= TOPK_SORT_MAX:
            P2 = 1 << max(V - 1, 1).bit_length()
            ops.fn["ddtree_topk_sort_kernel"].prepared_async_call((L, 1, 1), BLOCK, ops.stream, lg, V, K, P2,
                                                                  top_id.ptr, lp.ptr, shared_size=8 * P2)
            ops.count("ddtree_topk_sort_kernel")
        else:
            ops._launch("ddtree_topk_kernel", (L,), lg, V, K, top_id.ptr, lp.ptr)
    ops.fn["ddtree_heap_kernel"].prepared_async_call((1, 1, 1), WARP, ops.stream, top_id.ptr, lp.ptr, L, K, N, T,
                                                     dmeta.ptr, block_ids.ptr, rec if isinstance(rec, int) else rec.ptr,
                                                     t_meta.ptr, t_ids.ptr, t_pos.ptr, shared_size=_need)
    ops.count("ddtree_heap_kernel")


def tree_mask(ops, parents: DevBuf, T: int, target_meta: DevBuf, mask: DevBuf) -> None:
    """The verify's additive mask rows [T, mask.shape[1]] from the tree's parents (kernels/ddtree.cu)."""
    prepare_kernels(ops)
    ops._launch("tree_mask_kernel", (T,), parents.ptr, T, target_meta.ptr, mask.ptr, mask.shape[1])


__all__ = ["CudaDrafter", "read_drafter", "tree_mask", "BLOCK", "WARPS_PER_BLOCK"]
