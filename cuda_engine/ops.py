"""Host wrappers of the kernels: validate -> grid -> prepared launch on the engine's stream.

Each kernel `op_kernel` in kernels/*.cu has one wrapper `op()` here. Arguments are DevBufs (or raw
device pointers for strided views); sizes are checked against the kernel's contract before launching,
because a kernel trusts its arguments. Every launch is counted (`launches`), so benchmarks can report
launches per decode step. KDTR_CUDA_SYNC=1 synchronises after every launch (outside graph capture)
and names the kernel that faulted.
"""
from __future__ import annotations

import os

from cuda_engine.build import build_fatbin
from cuda_engine.device import CudaEngineError, DevBuf, driver

WARPS_PER_BLOCK = 8                 # kernels/common.cuh
BLOCK = (32 * WARPS_PER_BLOCK, 1, 1)
ATTN_MAX_QK = 1024                  # kernels/attention.cu
ROUTER_MAX_E, ROUTER_MAX_GROUPS, MOE_MAX_SLOTS = 1024, 64, 64   # kernels/moe.cu

# kernel name -> argument types (struct codes: P pointer, i int32, q int64, f float32, d float64)
SIGNATURES = {
    "embedding_kernel": "PPPi",
    "rms_norm_kernel": "PiPPiif",
    "add_rms_norm_kernel": "PPPPPif",
    "linear_kernel": "PPPiiiiqqq",
    "rope_kernel": "PiiiiiPPd",
    "mla_attention_kernel": "PPPPPPiPiPiiiiif",
    "kv_append_kernel": "PPPPPii",
    "kv_compact_kernel": "PPPiiiii",
    "router_kernel": "PPPPPiiiiiif",
    "swiglu_gate_up_kernel": "PPPPPiii",
    "expert_down_kernel": "PPPPii",
    "moe_combine_kernel": "PPPPiii",
    "argmax_kernel": "PiP",
    "decode_advance_kernel": "PP",
}


def _ptr(x) -> int:
    return x.ptr if isinstance(x, DevBuf) else int(x)


def _need(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{op}: {what}")


class Ops:
    """The loaded kernel module and one prepared function per kernel."""

    def __init__(self, fatbin=None):
        drv = driver()
        path = fatbin or build_fatbin()
        try:
            self.module = drv.module_from_file(str(path))
        except drv.Error as e:
            raise CudaEngineError(f"cannot load {path} on this device ({e}); the fatbin holds sm_90 and "
                                  f"sm_120 code only") from None
        self.fatbin = path
        self.fn = {}
        for name, sig in SIGNATURES.items():
            f = self.module.get_function(name)
            f.prepare(sig)
            self.fn[name] = f
        self.stream = drv.Stream()
        self.launches = 0
        self.capturing = False
        self.debug_sync = os.environ.get("KDTR_CUDA_SYNC") == "1"

    def _launch(self, name: str, grid, *args, block=BLOCK) -> None:
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        if min(grid) <= 0:
            return                                              # nothing to do (e.g. T = 0 rows)
        self.fn[name].prepared_async_call(grid, block, self.stream, *args)
        self.launches += 1
        if self.debug_sync and not self.capturing:
            try:
                self.stream.synchronize()
            except driver().Error as e:
                raise CudaEngineError(f"{name} failed (grid {grid}): {e}") from None

    # ------------------------------------------------------------ elementwise, norms, GEMV
    def embedding(self, ids: DevBuf, table: DevBuf, out, T: int) -> None:
        V, D = table.shape
        _need(T <= ids.shape[0], "embedding", f"T={T} > ids capacity {ids.shape[0]}")
        self._launch("embedding_kernel", (T,), ids.ptr, table.ptr, _ptr(out), D)

    def rms_norm(self, x, x_stride: int, w: DevBuf, y, y_stride: int, n: int, T: int, eps: float) -> None:
        _need(w.shape == (n,), "rms_norm", f"weight shape {w.shape} != ({n},)")
        _need(x_stride >= n and y_stride >= n, "rms_norm", f"strides {x_stride}, {y_stride} < n={n}")
        self._launch("rms_norm_kernel", (T,), _ptr(x), x_stride, w.ptr, _ptr(y), y_stride, n, eps)

    def add_rms_norm(self, h, a, h_out, w: DevBuf, y, T: int, eps: float) -> None:
        n = w.shape[0]
        self._launch("add_rms_norm_kernel", (T,), _ptr(h), _ptr(a), _ptr(h_out), w.ptr, _ptr(y), n, eps)

    def linear(self, x, W, y, T: int, I: int, O: int, x_stride=None, y_stride=None,
               B: int = 1, x_bstride: int = 0, w_bstride: int = 0, y_bstride: int = 0) -> None:
        """y[b, t, :O] = W[b] @ x[b, t, :I]; W [B, O, I] rows contiguous; strides in elements."""
        x_stride = I if x_stride is None else x_stride
        y_stride = O if y_stride is None else y_stride
        if isinstance(W, DevBuf):
            _need(W.shape[-2:] == (O, I), "linear", f"weight {W.shape} is not [.., O={O}, I={I}]")
        _need(x_stride >= I and y_stride >= O, "linear", f"strides x {x_stride} < I={I} or y {y_stride} < O={O}")
        grid = (-(-O // WARPS_PER_BLOCK), T, B)
        self._launch("linear_kernel", grid, _ptr(x), _ptr(W), _ptr(y), I, O, x_stride, y_stride,
                     x_bstride, w_bstride, y_bstride)

    def rope(self, x, T: int, row_stride: int, head_stride: int, offset: int, n_heads: int, R: int,
             positions: DevBuf, inv_freq: DevBuf, attn_factor: float) -> None:
        _need(R % 2 == 0 and inv_freq.shape == (R // 2,), "rope", f"R={R} must be even, inv_freq {inv_freq.shape}")
        self._launch("rope_kernel", (T,), _ptr(x), row_stride, head_stride, offset, n_heads, R,
                     positions.ptr, inv_freq.ptr, attn_factor)

    # ------------------------------------------------------------ attention and cache
    def mla_attention(self, q_lat, q, c_kv, k_pe, meta: DevBuf, mask, mask_stride: int, scores: DevBuf,
                      S_cap: int, o_lat, T: int, H: int, C: int, R: int, A: int, N: int, scale: float) -> None:
        _need(C + R <= ATTN_MAX_QK, "mla_attention", f"kv_lora_rank + qk_rope_head_dim = {C + R} > {ATTN_MAX_QK}")
        _need(scores.nbytes >= T * H * S_cap * 4, "mla_attention", f"scores scratch {scores.shape} < [{T * H}, {S_cap}]")
        self._launch("mla_attention_kernel", (T * H,), _ptr(q_lat), _ptr(q), _ptr(c_kv), _ptr(k_pe), meta.ptr,
                     0 if mask is None else _ptr(mask), mask_stride, scores.ptr, S_cap, _ptr(o_lat),
                     H, C, R, A, N, scale)

    def kv_append(self, c_kv_new, kv, ckv_layer, kpe_layer, meta: DevBuf, T: int, C: int, R: int) -> None:
        self._launch("kv_append_kernel", (T,), _ptr(c_kv_new), _ptr(kv), _ptr(ckv_layer), _ptr(kpe_layer),
                     meta.ptr, C, R)

    def kv_compact(self, cache_ckv: DevBuf, cache_kpe: DevBuf, keep: DevBuf, n: int, start: int) -> None:
        L, S_cap, C = cache_ckv.shape
        R = cache_kpe.shape[2]
        _need(start + n <= S_cap and n <= keep.shape[0], "kv_compact", f"start {start} + n {n} > S_cap {S_cap}")
        self._launch("kv_compact_kernel", (L,), cache_ckv.ptr, cache_kpe.ptr, keep.ptr, n, start, S_cap, C, R)

    # ------------------------------------------------------------ MoE
    def router(self, logits, bias: DevBuf, scores, slot_ids, slot_w, T: int, K: int, S: int, n_group: int,
               topk_group: int, norm_topk_prob: bool, scale: float) -> None:
        E = bias.shape[0]
        _need(E <= ROUTER_MAX_E and n_group <= ROUTER_MAX_GROUPS, "router",
              f"n_routed_experts={E} (max {ROUTER_MAX_E}), n_group={n_group} (max {ROUTER_MAX_GROUPS})")
        self._launch("router_kernel", (T,), _ptr(logits), bias.ptr, _ptr(scores), _ptr(slot_ids), _ptr(slot_w),
                     E, K, S, n_group, topk_group, int(norm_topk_prob), scale)

    def swiglu_gate_up(self, x, Wg: DevBuf, Wu: DevBuf, slot_ids, act, T: int, S: int) -> None:
        _, I, D = Wg.shape
        _need(Wu.shape == Wg.shape, "swiglu_gate_up", f"gate {Wg.shape} and up {Wu.shape} differ")
        self._launch("swiglu_gate_up_kernel", (-(-I // WARPS_PER_BLOCK), T * S), _ptr(x), Wg.ptr, Wu.ptr,
                     _ptr(slot_ids), _ptr(act), D, I, S)

    def expert_down(self, act, Wd: DevBuf, slot_ids, y, T: int, S: int) -> None:
        _, D, I = Wd.shape
        self._launch("expert_down_kernel", (-(-D // WARPS_PER_BLOCK), T * S), _ptr(act), Wd.ptr, _ptr(slot_ids),
                     _ptr(y), I, D)

    def moe_combine(self, y, slot_ids, slot_w, out, T: int, K: int, S: int, D: int) -> None:
        _need(0 <= K <= S <= MOE_MAX_SLOTS, "moe_combine", f"K={K}, S={S} (max {MOE_MAX_SLOTS})")
        self._launch("moe_combine_kernel", (T,), _ptr(y), _ptr(slot_ids), _ptr(slot_w), _ptr(out), K, S, D)

    # ------------------------------------------------------------ sampling
    def argmax(self, logits, V: int, out, T: int) -> None:
        self._launch("argmax_kernel", (T,), _ptr(logits), V, _ptr(out))

    def decode_advance(self, meta: DevBuf, positions: DevBuf) -> None:
        self._launch("decode_advance_kernel", (1,), meta.ptr, positions.ptr, block=(1, 1, 1))
