"""Host wrappers of the kernels: validate -> grid -> prepared launch on the engine's stream.

Each kernel `op_kernel` in kernels/*.cu has one wrapper `op()` here. Arguments are DevBufs (or raw
device pointers for strided views); sizes are checked against the kernel's contract before launching,
because a kernel trusts its arguments. Every launch is counted (`launches`), so benchmarks can report
launches per decode step. KDTR_CUDA_SYNC=1 synchronises after every launch (outside graph capture)
and names the kernel that faulted.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from cuda_engine.build import build_fatbin
from cuda_engine.device import CudaEngineError, DevBuf, driver, driver_device
from cuda_engine.w4a16_plan import (W4A16_DIGITS_ROWS, W4A16_DIGITS_TOKENS, W4A16_ENTRIES, W4A16_GROUP_TOKENS,
                                    W4A16_ROWS, w4a16_entry, w4a16_groups_cap, w4a16_launch)

WARPS_PER_BLOCK = 8                 # kernels/common.cuh
BLOCK = (32 * WARPS_PER_BLOCK, 1, 1)
ATTN_MAX_C, ATTN_MAX_R, ATTN_MAX_N, ATTN_MAX_SPLIT = 512, 128, 256, 32   # kernels/attention.cu
ATTN_TOKENS, ATTN_MERGE_U = 8, 64   # kernels/attention.cu: tokens per qprep / merge_uv block, W_uv rows per merge_uv block
ATTN_KSTEP, ATTN_SPITCH, ATTN_STAGES = 32, 32 + 8, 2   # kernels/attention.cu: the GEMMs' k step, staging row, stages


@dataclass(frozen=True)
class AttnTiling:
    """One of the attention GEMMs' block tilings (kernels/attention.cu, Narrow and Wide): the kernels' name
    suffix, the output tile (rows x cols) and the blocks per SM their __launch_bounds__ declare, by compute
    capability (major)."""
    suffix: str
    rows: int
    cols: int
    blocks_per_sm: dict

    def scores_smem(self) -> int:      # SCORES_SMEM(TL): both operand tiles, ATTN_STAGES stages, three terms
        return ATTN_STAGES * 3 * (self.rows + self.cols) * ATTN_SPITCH * 2

    def pv_smem(self) -> int:          # PV_SMEM(TL)
        return ATTN_STAGES * 3 * (self.rows * ATTN_SPITCH + ATTN_KSTEP * (self.cols + 8)) * 2


ATTN_NARROW = AttnTiling("", 64, 64, {9: 3, 12: 1})        # twice the blocks: fills the GPU where grids are small
ATTN_WIDE = AttnTiling("_wide", 64, 128, {9: 2, 12: 1})    # 0.75x the L2 bytes per product at 320 query rows
ATTN_WIDE_MIN_ROWS = 65             # T H query rows from which both GEMMs run the wide tiling (two row tiles and on),
ATTN_WIDE_MIN_C = 128               # where the latent width C fills p c_kv's 128 columns (at C = 64 half is padding)
# kernel -> dynamic shared memory bytes it is launched with (over the 48 KB allowed unasked)
ATTN_DYNAMIC_SMEM = {f"mla_{g}{t.suffix}_kernel": (t.scores_smem() if g == "scores" else t.pv_smem())
                     for t in (ATTN_NARROW, ATTN_WIDE) for g in ("scores", "pv")}
KV_PIECE = 8                        # kernels/kv_layout.cuh: a cache row is padded to whole 16-byte pieces of bf16
ROUTER_MAX_E, ROUTER_MAX_GROUPS, MOE_MAX_SLOTS = 1024, 64, 64   # kernels/moe.cu
LINEAR_ROWS = 8                   # kernels/linear.cu, linear_rows_kernel: rows per warp
LMMA_OUT, LMMA_ROWS = 32, 16      # kernels/linear.cu, linear_mma_bf16_kernel: outputs and x rows per block
LMMA_FEW_OUT, LMMA_FEW_ROWS = 16, 8   # linear_mma_bf16_few_kernel, for 2 .. LMMA_FEW_ROWS rows (same bits a row)
LMMA_TILE = (16, 32)              # kernels/linear.cu, LMMA_TILE_ELEMS: the mma kernels' W blocks (outputs x k)
COMBINE_DSLICE = 32 * WARPS_PER_BLOCK   # kernels/moe.cu: the elements of a row one combine block owns
W4A16_CHUNK_WORDS = 144             # kernels/w4a16_mma.cu
MOE_GROUP_MAX_E = ROUTER_MAX_E + 1  # kernels/moe.cu, moe_group_kernel: the routed experts and the shared one

# kernel name -> argument types (struct codes: P pointer, i int32, q int64, f float32, d float64)
SIGNATURES = {
    "embedding_kernel": "PPPiPPf",
    "embedding_bf16_kernel": "PPPiPPf",
    "rms_norm_kernel": "PiPPiif",
    "add_rms_norm_kernel": "PPPPPif",
    "linear_kernel": "PPPiiiiqqq",
    "linear_rows_kernel": "PPPiiiiiqqq",
    "linear_bf16_kernel": "PPPiiiiqqq",
    "linear_mma_bf16_kernel": "PPPiiiiiqqq",
    "linear_mma_bf16_few_kernel": "PPPiiiiiqqq",
    "mla_latent_kernel": "PiiiPPfPPPiPPPd",
    "mla_qprep_kernel": "PPPdPPiiiii",
    "mla_qprep_bf16_kernel": "PPPdPPiiiii",
    "mla_scores_kernel": "PPiPPiPiiiiif",
    "mla_scores_wide_kernel": "PPiPPiPiiiiif",
    "mla_softmax_kernel": "PiPPiPiii",
    "mla_pv_kernel": "PiPiPPiiii",
    "mla_pv_wide_kernel": "PiPiPPiiii",
    "mla_merge_uv_kernel": "PiPPPiiii",
    "mla_merge_uv_bf16_kernel": "PiPPPiiii",
    "kv_compact_kernel": "PPiiii",
    "router_kernel": "PPPPiiiiiifPPP",
    "swiglu_gate_up_kernel": "PPPPPiiiiii",
    "expert_down_kernel": "PPPPiiiiiii",
    "swiglu_gate_up_bf16_kernel": "PPPPPiiiiii",
    "expert_down_bf16_kernel": "PPPPiiiiiii",
    "w4a16_gate_up_kernel": "PPPPPPPiiiiiii",
    "w4a16_down_kernel": "PPPPPiiiiiii",
    "moe_combine_kernel": "PPPPiiiPPPPfPP",
    "stream_read_kernel": "PqP",
    **{name: "PiPP" + "i" * 10 + "PiPPiP" for entries in W4A16_ENTRIES.values() for _, name in entries},
    **{name: "PiPP" + "i" * 10 + "PiPPiP" for family in W4A16_ROWS.values() for name in family.values()},
    **{name: "PiPP" + "i" * 10 + "PiPPiP" for name in W4A16_DIGITS_ROWS.values()},
    "moe_group_kernel": "P" + "i" * 8 + "P",
    "argmax_kernel": "PiP",
    "decode_advance_kernel": "PP",
}


# Dense weights are float32 or bfloat16 (raw bits, uint16): the kernels that read them have one instance per
# type (kernels/common.cuh, wval), `name_kernel` and `name_bf16_kernel`, the same arithmetic on the same values.
DENSE_WEIGHT_DTYPES = (np.dtype(np.float32), np.dtype(np.uint16))


def weight_kernel(name: str, op: str, *weights: DevBuf) -> str:
    """The instance of kernel `name` ("linear" -> "linear_kernel" or "linear_bf16_kernel") for these weights,
    which must all have one dtype: float32 or bf16 bits (uint16)."""
    dtypes = {w.dtype for w in weights}
    _need(len(dtypes) == 1 and dtypes <= set(DENSE_WEIGHT_DTYPES), op,
          f"weights must all be float32 or all bf16 bits (uint16), got {sorted(map(str, dtypes))}")
    return f"{name}_bf16_kernel" if dtypes == {np.dtype(np.uint16)} else f"{name}_kernel"


EXPERT_DOWN_MAX_PER = 4           # kernels/moe.cu


def down_outputs_per_warp(D: int, rows: int, resident: int) -> int:
    """Outputs a warp of expert_down over `rows` (token, slot) rows of D outputs, where `resident` blocks fit the
    GPU at once: the fewest of 1, 2, 4 whose grid fits one wave, else 4. One a warp where its grid already fits
    (a decode step, K2.6's one-token shared expert); the tiny models' 33-row verify (D = 192, 165 rows: 3960
    blocks of one a warp, several waves) takes 4."""
    for per in (1, 2, EXPERT_DOWN_MAX_PER):
        if -(-D // (WARPS_PER_BLOCK * per)) * rows <= resident:
            return per
    return EXPERT_DOWN_MAX_PER


def _ptr(x) -> int:
    return x.ptr if isinstance(x, DevBuf) else int(x)


def whole_pieces(n: int) -> int:
    """n bf16 rounded up to whole 16-byte pieces (KV_PIECE bf16 each): the term planes' row pitch."""
    return -(-n // KV_PIECE) * KV_PIECE


def kv_pitch(C: int, R: int) -> int:
    """bf16 per row of the latent cache's term planes: C + R rounded up to whole 16-byte pieces (kv_layout.cuh)."""
    return whole_pieces(C + R)


def kv_planes_shape(rows: int, C: int, R: int) -> tuple[int, int, int]:
    """One layer's latent cache (kv_layout.cuh): three planes of bf16 terms, [3, rows, kv_pitch(C, R)] uint16."""
    return (3, rows, kv_pitch(C, R))


def split3(x: np.ndarray) -> np.ndarray:
    """float32 x -> its three bf16 terms [3, *x.shape] (uint16 bits), x = t0 + t1 + t2 exactly: the split
    kernels/tensor_core.cuh does (split3: round to nearest even by integer adds, differences in float32), so the
    host writes the cache rows the device would (run_layer's golden rows, tests)."""
    x = np.ascontiguousarray(x, np.float32)

    def rn(v: np.ndarray) -> np.ndarray:                  # rn_bf16_bits: the float32 bits of v rounded to bf16
        u = v.view(np.uint32)
        return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))

    with np.errstate(over="ignore"):
        t0 = rn(x)
        r0 = x - t0.view(np.float32)
        t1 = rn(r0)
        t2 = (r0 - t1.view(np.float32)).view(np.uint32) & np.uint32(0xFFFF0000)
    return (np.stack([t0, t1, t2]) >> np.uint32(16)).astype(np.uint16)


def join3(terms: np.ndarray) -> np.ndarray:
    """[3, ...] bf16 term bits -> the float32 values they sum to (exactly: the inverse of split3)."""
    f = (np.asarray(terms, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return (f[0] + f[1] + f[2]).astype(np.float32)


def p_terms_shape(rows: int, S_cap: int) -> tuple[int, int, int]:
    """The attention probabilities' scratch for `rows` query rows over S_cap cached rows: [3, rows, S_cap rounded
    up to a multiple of 8] uint16 (bf16 terms; whole 16-byte pieces per row, kernels/attention.cu)."""
    return (3, rows, whole_pieces(S_cap))


def _need_kv(kv: DevBuf, C: int, R: int, op: str) -> None:
    _need(kv.dtype == np.uint16 and len(kv.shape) == 3 and kv.shape[0] == 3 and kv.shape[2] == kv_pitch(C, R), op,
          f"the layer's cache must be bf16 terms [3, rows, {kv_pitch(C, R)}] (uint16), got {kv.shape} {kv.dtype}")


def need_kv_cache(kv: DevBuf, op: str) -> None:
    """kv is a whole cache, [L, 3, rows, Kp] bf16 terms with Kp a multiple of 8 (the row moves copy 16 bytes)."""
    _need(kv.dtype == np.uint16 and len(kv.shape) == 4 and kv.shape[1] == 3 and kv.shape[3] % KV_PIECE == 0, op,
          f"the cache must be bf16 terms [L, 3, rows, Kp] (uint16, Kp a multiple of {KV_PIECE}), got {kv.shape} "
          f"{kv.dtype}")


def kv_rows_to_planes(ckv: np.ndarray, kpe: np.ndarray, rows: int | None = None) -> np.ndarray:
    """Host rows c_kv [S, C] and k_pe [S, R] (float32) as one layer's cache planes [3, rows, Kp] (rows >= S;
    rows past S and the padding columns zero)."""
    S, C = ckv.shape
    R = kpe.shape[1]
    out = np.zeros(kv_planes_shape(S if rows is None else rows, C, R), np.uint16)
    out[:, :S, :C + R] = split3(np.concatenate([ckv, kpe], axis=1))
    return out


GRID_X_MAX, GRID_YZ_MAX = 2**31 - 1, 65535          # CUDA launch limits (compute capability >= 3.0)


def _need(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{op}: {what}")


def _group(qw: DevBuf, sc: DevBuf, op: str) -> int:
    """The INT4 group size of packed weights [E', out, in/8] and bf16 scale bits [E', out, in/g]."""
    E, out, in8 = qw.shape
    _need(qw.dtype == np.int32 and sc.dtype == np.uint16, op, f"qw must be int32 and sc uint16 (bf16 bits), "
          f"got {qw.dtype}, {sc.dtype}")
    _need(sc.shape[:2] == (E, out) and sc.shape[2] > 0 and (8 * in8) % sc.shape[2] == 0, op,
          f"scales {sc.shape} do not fit packed weights {qw.shape}")
    g = 8 * in8 // sc.shape[2]
    _need(g % 8 == 0, op, f"group size {g} must be a multiple of 8 (a packed word in one group)")
    return g


def tile_bf16(W: np.ndarray) -> np.ndarray:
    """bf16 weight bits [..., O, I] -> the layout the mma linear kernels read (kernels/linear.cu): per 16 outputs
    and per 32 k one 16 x 32 block, row-major, a tile's blocks consecutive: [..., ceil(O/16), ceil(I/32), 16, 32],
    zeros past O and I. Every weight value keeps its bits; only its place changes."""
    _need(W.dtype == np.uint16 and W.ndim >= 2, "tile_bf16", f"weight must be bf16 bits [.., O, I], got {W.shape} "
          f"{W.dtype}")
    (O, I), (mo, mk) = W.shape[-2:], LMMA_TILE
    lead = W.shape[:-2]
    P = np.zeros(lead + (-(-O // mo) * mo, -(-I // mk) * mk), np.uint16)
    P[..., :O, :I] = W
    P = P.reshape(lead + (P.shape[-2] // mo, mo, P.shape[-1] // mk, mk))
    return np.ascontiguousarray(np.moveaxis(P, -3, -2))


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
        carveout = getattr(drv.function_attribute, "PREFERRED_SHARED_MEMORY_CARVEOUT", None)
        for name, sig in SIGNATURES.items():
            f = self.module.get_function(name)
            f.prepare(sig)
            if carveout is not None and name.startswith("w4a16_mma_"):
                # all of L1 as shared memory: the driver's default carveout held the 45 KB blocks of w4a16_mma
                # to 2 per SM whatever their registers allowed
                f.set_attribute(carveout, 100)
            if name in ATTN_DYNAMIC_SMEM:   # the attention GEMMs' two stages: over the 48 KB allowed unasked
                f.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, ATTN_DYNAMIC_SMEM[name])
                if carveout is not None:        # all of L1 as shared memory, so 2-3 blocks' stages fit an SM (sm_90)
                    f.set_attribute(carveout, 100)
            self.fn[name] = f
        self.stream = drv.Stream()
        self.sm_count = driver_device().get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
        self.cc_major = driver_device().compute_capability()[0]   # the attention GEMMs' blocks per SM follow it
        self.launches = 0
        # what ran (a captured graph's launches counted once, at capture): kernel name -> launches, and the
        # w4a16_mma launches' "path:regime" (w4a16_plan.py: W4A16_PATHS, W4A16_REGIMES) -> launches; a run dump's engine_info
        # records both (CudaEngine.dump_metadata)
        self.ran: dict[str, int] = {}
        self.w4a16_regimes: dict[str, int] = {}
        self._resident: dict[str, int] = {}
        self.capturing = False
        self.debug_sync = os.environ.get("KDTR_CUDA_SYNC") == "1"
        # workspaces (fp32 partials, int32 tickets) by owner, "w4a16_mma" (split-K) and "moe_combine" (the
        # norm's sums): grown, never freed (a captured graph may still point at an old one, kept in _retired)
        self._ws: dict[str, tuple[DevBuf, DevBuf]] = {}
        self._retired: list[DevBuf] = []

    def _launch(self, name: str, grid, *args, block=BLOCK, shared: int = 0) -> None:
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        if min(grid) <= 0:
            return                                              # nothing to do (e.g. T = 0 rows)
        if grid[0] > GRID_X_MAX or max(grid[1:]) > GRID_YZ_MAX:
            # (token, slot) pairs or rows ride on grid.y / grid.z, whose limit is 65535 on sm_90 and sm_120:
            # a long prompt on a wide MoE would otherwise fail with the driver's bare "invalid argument".
            raise CudaEngineError(f"{name}: launch grid {grid} exceeds the device's limits (x <= {GRID_X_MAX}, "
                                  f"y, z <= {GRID_YZ_MAX}): too many rows (tokens x expert slots) for one forward")
        self.fn[name].prepared_async_call(grid, block, self.stream, *args, shared_size=shared)
        self.count(name)
        if self.debug_sync and not self.capturing:
            try:
                self.stream.synchronize()
            except driver().Error as e:
                raise CudaEngineError(f"{name} failed (grid {grid}): {e}") from None

    def count(self, name: str) -> None:
        """One launch of kernel `name` (made here, or by a caller that launched it itself)."""
        self.launches += 1
        self.ran[name] = self.ran.get(name, 0) + 1

    # ------------------------------------------------------------ elementwise, norms, GEMV
    def embedding(self, ids: DevBuf, table: DevBuf, out, T: int, w_norm: DevBuf, y, eps: float) -> None:
        """out = table[ids]; y = rms_norm(out, w_norm) (the first layer's input norm)."""
        V, D = table.shape
        _need(T <= ids.shape[0] and w_norm.shape == (D,), "embedding",
              f"T={T} > ids capacity {ids.shape[0]} or norm weight {w_norm.shape} != ({D},)")
        self._launch(weight_kernel("embedding", "embedding", table), (T,), ids.ptr, table.ptr, _ptr(out), D, w_norm.ptr,
                     _ptr(y), eps)

    def rms_norm(self, x, x_stride: int, w: DevBuf, y, y_stride: int, n: int, T: int, eps: float) -> None:
        _need(w.shape == (n,), "rms_norm", f"weight shape {w.shape} != ({n},)")
        _need(x_stride >= n and y_stride >= n, "rms_norm", f"strides {x_stride}, {y_stride} < n={n}")
        self._launch("rms_norm_kernel", (T,), _ptr(x), x_stride, w.ptr, _ptr(y), y_stride, n, eps)

    def add_rms_norm(self, h, a, h_out, w: DevBuf, y, T: int, eps: float) -> None:
        n = w.shape[0]
        self._launch("add_rms_norm_kernel", (T,), _ptr(h), _ptr(a), _ptr(h_out), w.ptr, _ptr(y), n, eps)

    def tiled(self, W: DevBuf, host: np.ndarray | None = None) -> DevBuf:
        """The tiled copy (tile_bf16) of bf16 weights W that the mma linear kernels read, made once and kept
        with W (the one-row GEMV reads W itself). `host`, W's values when the caller holds them, spares the copy
        back; a loader makes every copy before any graph is captured (no allocation may happen in one)."""
        if not W.owns:
            raise CudaEngineError(f"bf16 weights {W.shape} read by 2 or more rows must be a buffer of their own, not "
                                  f"a view into another allocation (a view cannot keep the tiled copy, so every call "
                                  f"would make it again): load each weight as its own DevBuf")
        if W.tiled is None:
            if self.capturing:
                raise CudaEngineError(f"the tiled copy of bf16 weights {W.shape} must be made before a graph is "
                                      f"captured (no allocation may happen in one): call Ops.tiled(W) after loading "
                                      f"them, as the engine's loader does (engine.tile_linear_weights)")
            W.tiled = DevBuf.from_array(tile_bf16(W.get() if host is None else host))
        return W.tiled

    def linear(self, x, W: DevBuf, y, T: int, I: int, O: int, x_stride=None, y_stride=None,
               B: int = 1, x_bstride: int = 0, w_bstride: int = 0, y_bstride: int = 0) -> None:
        """y[b, t, :O] = W[b] @ x[b, t, :I]; W [B, O, I] float32 or bf16 bits, rows contiguous (bf16 ones read by 2
        or more rows through their tiled copy, Ops.tiled); strides in elements."""
        x_stride = I if x_stride is None else x_stride
        y_stride = O if y_stride is None else y_stride
        _need(W.shape[-2:] == (O, I), "linear", f"weight {W.shape} is not [.., O={O}, I={I}]")
        _need(x_stride >= I and y_stride >= O, "linear", f"strides x {x_stride} < I={I} or y {y_stride} < O={O}")
        _need(B >= 1, "linear", f"batch B={B}: pass B >= 1 (B=1 for one matrix)")       # every path, before
        _need(w_bstride >= 0, "linear", f"w_bstride {w_bstride} < 0: pass the distance between the batch's weight "
              f"matrices in elements, 0 to share one matrix")                              # anything runs
        size, reach = math.prod(W.shape), (B - 1) * w_bstride + O * I
        _need(reach <= size, "linear", f"batch B={B} with w_bstride {w_bstride} reads weights {W.shape} up to "
              f"element {reach}, past the {size} they hold")
        if T == 1:                                  # a GEMV: one warp per output streams W once
            self._launch(weight_kernel("linear", "linear", W), (-(-O // WARPS_PER_BLOCK), 1, B), _ptr(x), W.ptr, _ptr(y),
                         I, O, x_stride, y_stride, x_bstride, w_bstride, y_bstride)
        elif W.dtype == np.uint16:                  # bf16 weights: the tensor cores, x split into three bf16
            few = T <= LMMA_FEW_ROWS                # terms (FP32-faithful), W read once per 16 rows (per 8 for
            out, rows = (LMMA_FEW_OUT, LMMA_FEW_ROWS) if few else (LMMA_OUT, LMMA_ROWS)   # few: twice the blocks)
            per = O * I                             # their W is the tiled copy: batch strides in whole matrices
            _need(w_bstride % per == 0, "linear", f"w_bstride {w_bstride} is not a whole number of [{O}, {I}] "
                  f"matrices (the tiled copy of bf16 weights moves by whole matrices)")
            Wt = self.tiled(W)
            grid = (-(-O // out), -(-T // rows), B)
            self._launch("linear_mma_bf16_few_kernel" if few else "linear_mma_bf16_kernel", grid, _ptr(x), Wt.ptr,
                         _ptr(y), T, I, O, x_stride, y_stride, x_bstride, w_bstride // per * math.prod(Wt.shape[-4:]),
                         y_bstride)
        else:                                       # LINEAR_ROWS rows per warp: W read once per row block,
            grid = (-(-O // WARPS_PER_BLOCK), -(-T // LINEAR_ROWS), B)   # each row the bits linear_kernel gives
            self._launch(weight_kernel("linear_rows", "linear", W), grid, _ptr(x), W.ptr, _ptr(y), T, I, O, x_stride,
                         y_stride, x_bstride, w_bstride, y_bstride)

    # ------------------------------------------------------------ attention and cache
    def mla_latent(self, qkv, T: int, Q: int, C: int, R: int, w_q: DevBuf, w_kv: DevBuf, eps: float, cq, lat,
                   kv: DevBuf, meta: DevBuf, positions: DevBuf, inv_freq: DevBuf, attn_factor: float) -> None:
        """qkv [T, Q + C + R] -> c_q [T, Q], c_kv [T, C], k_pe roped in place; c_kv and k_pe appended to the
        layer's cache kv [3, rows, Kp] (their bf16 terms, kv_layout.cuh) at rows meta[0] + t."""
        _need(w_q.shape == (Q,) and w_kv.shape == (C,), "mla_latent", f"norm weights {w_q.shape}, {w_kv.shape} "
              f"!= ({Q},), ({C},)")
        _need(R % 2 == 0 and inv_freq.shape == (R // 2,), "mla_latent", f"R={R} must be even, inv_freq {inv_freq.shape}")
        _need_kv(kv, C, R, "mla_latent")
        self._launch("mla_latent_kernel", (T,), _ptr(qkv), Q, C, R, w_q.ptr, w_kv.ptr, eps, _ptr(cq), _ptr(lat),
                     kv.ptr, kv.shape[1], meta.ptr, positions.ptr, inv_freq.ptr, attn_factor)

    @staticmethod
    def attn_tiling(T: int, H: int, C: int) -> AttnTiling:
        """The attention GEMMs' tiling for T tokens of H heads over a latent of width C: the wide one from
        ATTN_WIDE_MIN_ROWS query rows on (a verify) where C >= ATTN_WIDE_MIN_C (K2.6's 512), else the narrow one
        (a decode step: twice the blocks, and p c_kv's chunk count follows them; a latent of 64, where the wide
        tile's p c_kv is half padding and its scores' few blocks wait on latency: the tiny bundles' verifies ran
        3-5% faster narrow, docs/cuda-engine.md "Stop 43"). It depends on the shape alone: with the chunk count
        (attn_splits) it fixes the order of every sum. (The scores' tiling changes no bit, kernels/attention.cu;
        p c_kv's changes the chunk count.)"""
        return ATTN_WIDE if T * H >= ATTN_WIDE_MIN_ROWS and C >= ATTN_WIDE_MIN_C else ATTN_NARROW

    def attn_splits(self, T: int, H: int, C: int) -> int:
        """The chunks p c_kv (mla_pv_*) splits the cache rows into for T tokens: as many as its blocks resident
        on the GPU at once hold in one wave (the tiling's blocks per SM, by compute capability; rounded down: a
        second wave of a few blocks would cost a whole chunk's time), at most ATTN_MAX_SPLIT. It depends on
        (T, H, C) and the GPU alone, not on the cache's capacity, so a forward sums in the same order whatever
        the buffers have grown to. A chunk past the cache's rows (ceil(S / chunk) and on, S read on the device)
        costs a block that writes m = -inf, l = 0, o = 0; the merge leaves it out, where it would have added
        exactly 0."""
        tl = self.attn_tiling(T, H, C)
        blocks = -(-T * H // tl.rows) * -(-C // tl.cols)
        return max(1, min(ATTN_MAX_SPLIT, tl.blocks_per_sm.get(self.cc_major, 1) * self.sm_count // blocks))

    def attn_partials_rows(self, T_cap: int, H: int, C: int) -> int:
        """Rows of [C + 2] floats the partials scratch needs for any forward of 1 .. T_cap tokens."""
        return max(self.attn_splits(T, H, C) * T * H for T in range(1, T_cap + 1))

    def mla_attention(self, cq, w_qb: DevBuf, q, positions: DevBuf, inv_freq: DevBuf, attn_factor: float,
                      w_uk: DevBuf, w_uv: DevBuf, kv: DevBuf, meta: DevBuf, mask, mask_stride: int, scores: DevBuf,
                      p_terms: DevBuf, S_cap: int, partials: DevBuf, qs: DevBuf, o, T: int, R: int,
                      scale: float) -> None:
        """o [T, H, U] over the cache rows, from c_q [T, Q]: q = c_q W_qb^T [T, H, N + R] (q_pe roped; written to
        `q`); w_qb [H (N + R), Q], w_uk [H, N, C], w_uv [H, U, C]; kv the layer's cache [3, rows, Kp] (bf16
        terms, kv_layout.cuh); p_terms the probabilities' scratch [3, >= T H, pitch] (bf16 terms, pitch >= S_cap
        and a multiple of 8: p_terms_shape). Six launches (kernels/attention.cu): the q_b GEMV/GEMM, rope + W_uk
        absorption into qs (bf16 terms [3, T H, Kp]), the scores GEMM over every query row at once, the chunks'
        partial softmax (p's terms, m, l), the chunked p c_kv GEMM, and the chunk merge + W_uv."""
        H, N, C = w_uk.shape
        U, Q = w_uv.shape[1], w_qb.shape[1]
        _need(w_uv.shape == (H, U, C) and w_qb.shape == (H * (N + R), Q), "mla_attention",
              f"w_uv {w_uv.shape} != [H={H}, U, C={C}] or w_qb {w_qb.shape} != [{H * (N + R)}, Q]")
        _need(C <= ATTN_MAX_C and R <= ATTN_MAX_R and N <= ATTN_MAX_N, "mla_attention",
              f"kv_lora_rank={C} (max {ATTN_MAX_C}), qk_rope_head_dim={R} (max {ATTN_MAX_R}), "
              f"qk_nope_head_dim={N} (max {ATTN_MAX_N})")
        _need(R % 2 == 0 and inv_freq.shape == (R // 2,), "mla_attention", f"R={R} must be even, inv_freq "
              f"{inv_freq.shape} != ({R // 2},)")
        _need(scores.nbytes >= T * H * S_cap * 4, "mla_attention", f"scores scratch {scores.shape} < [{T * H}, {S_cap}]")
        Kp = kv_pitch(C, R)
        _need(qs.dtype == np.uint16 and qs.nbytes >= 3 * T * H * Kp * 2, "mla_attention", f"qs scratch {qs.shape} "
              f"{qs.dtype} is not bf16 terms (uint16) of at least 3 x [{T * H}, {Kp}]")
        _need_kv(kv, C, R, "mla_attention")
        pitch = p_terms.shape[2] if len(p_terms.shape) == 3 else 0
        _need(p_terms.dtype == np.uint16 and p_terms.shape[0] == 3 and p_terms.shape[1] >= T * H and pitch >= S_cap
              and pitch % KV_PIECE == 0, "mla_attention", f"p_terms {p_terms.shape} {p_terms.dtype} is not bf16 terms "
              f"{p_terms_shape(T * H, S_cap)} or larger")
        n_split = self.attn_splits(T, H, C)
        _need(partials.nbytes >= n_split * T * H * (C + 2) * 4, "mla_attention",
              f"partials {partials.shape} < [{n_split * T * H}, {C + 2}]")
        self.linear(cq, w_qb, q, T, Q, H * (N + R))
        tl = self.attn_tiling(T, H, C)
        tok_blocks, row_tiles = -(-T // ATTN_TOKENS), -(-T * H // tl.rows)
        self._launch(weight_kernel("mla_qprep", "mla_attention", w_uk), (H, tok_blocks, -(-C // BLOCK[0])), _ptr(q),
                     positions.ptr, inv_freq.ptr, attn_factor, w_uk.ptr, qs.ptr, T, H, N, R, C)
        self._launch(f"mla_scores{tl.suffix}_kernel", (row_tiles, -(-S_cap // tl.cols)), qs.ptr, kv.ptr, kv.shape[1],
                     meta.ptr, 0 if mask is None else _ptr(mask), mask_stride, scores.ptr, S_cap, T, H, C, R, scale,
                     shared=tl.scores_smem())
        self._launch("mla_softmax_kernel", (-(-T * H // WARPS_PER_BLOCK), n_split), scores.ptr, S_cap, meta.ptr,
                     p_terms.ptr, pitch, partials.ptr, T, H, C)
        self._launch(f"mla_pv{tl.suffix}_kernel", (row_tiles * -(-C // tl.cols), n_split), p_terms.ptr, pitch,
                     kv.ptr, kv.shape[1], meta.ptr, partials.ptr, T, H, C, R, shared=tl.pv_smem())
        self._launch(weight_kernel("mla_merge_uv", "mla_attention", w_uv), (H, tok_blocks, -(-U // ATTN_MERGE_U)),
                     partials.ptr, n_split, meta.ptr, w_uv.ptr, _ptr(o), T, H, C, U)

    def kv_compact(self, kv: DevBuf, keep: DevBuf, n: int, start: int) -> None:
        """Rows start + keep[i] -> start + i of every layer of the cache kv [L, 3, rows, Kp] (keep strictly
        increasing)."""
        need_kv_cache(kv, "kv_compact")
        L, _, rows, Kp = kv.shape
        _need(start + n <= rows and n <= keep.shape[0], "kv_compact", f"start {start} + n {n} > rows {rows}")
        self._launch("kv_compact_kernel", (L,), kv.ptr, keep.ptr, n, start, rows, Kp)

    # ------------------------------------------------------------ MoE
    def router(self, x, gate: DevBuf, bias: DevBuf, scores, slot_ids, slot_w, T: int, K: int, S: int, n_group: int,
               topk_group: int, norm_topk_prob: bool, scale: float, held=None, own_ids=None, own_w=None) -> None:
        """Router GEMV (gate [E, D]) and selection for x [T, D]: scores [T, E], slots [T, S] (ids, weights).
        Held routing: held [T, K] int32 (a row of -1: the router's choice) sets the routed slots; own_ids
        [T, K] int32 and own_w [T, K] receive the router's own choice and weights (kernels/moe.cu)."""
        E, D = gate.shape
        _need(bias.shape == (E,), "router", f"bias {bias.shape} != ({E},)")
        _need(E <= ROUTER_MAX_E and n_group <= ROUTER_MAX_GROUPS, "router",
              f"n_routed_experts={E} (max {ROUTER_MAX_E}), n_group={n_group} (max {ROUTER_MAX_GROUPS})")
        _need((own_ids is None) == (own_w is None), "router", "own_ids and own_w come together")
        null = lambda b: 0 if b is None else _ptr(b)  # noqa: E731 - an absent optional buffer: a null pointer
        self.linear(x, gate, scores, T, D, E)                  # the logits, into scores (the kernel makes them sigmoid)
        self._launch("router_kernel", (T,), bias.ptr, _ptr(scores), _ptr(slot_ids),
                     _ptr(slot_w), E, K, S, n_group, topk_group, int(norm_topk_prob), scale, null(held),
                     null(own_ids), null(own_w))

    # Expert GEMVs run over the slots k0 .. k0+nk-1 of each token's S slots (all by default); the expert of
    # slot (t, k) is slot_ids[t, k] - e_base in the given stack.
    def swiglu_gate_up(self, x, Wg: DevBuf, Wu: DevBuf, slot_ids, act, T: int, S: int, k0: int = 0,
                       nk: int | None = None, e_base: int = 0) -> None:
        _, I, D = Wg.shape
        nk = S - k0 if nk is None else nk
        _need(Wu.shape == Wg.shape, "swiglu_gate_up", f"gate {Wg.shape} and up {Wu.shape} differ")
        _need(0 <= k0 and k0 + nk <= S, "swiglu_gate_up", f"slots {k0}..{k0 + nk - 1} outside 0..{S - 1}")
        self._launch(weight_kernel("swiglu_gate_up", "swiglu_gate_up", Wg, Wu), (-(-I // WARPS_PER_BLOCK), T * nk),
                     _ptr(x), Wg.ptr, Wu.ptr,
                     _ptr(slot_ids), _ptr(act), D, I, S, k0, nk, e_base)

    def expert_down(self, act, Wd: DevBuf, slot_ids, y, T: int, S: int, k0: int = 0, nk: int | None = None,
                    e_base: int = 0, per: int | None = None) -> None:
        """y[t, k] = Wd[e] act[t, k] for the slots k0 .. k0+nk-1; `per` outputs a warp (1 .. EXPERT_DOWN_MAX_PER,
        the same bits for each), by default down_outputs_per_warp's choice for this GPU."""
        _, D, I = Wd.shape
        nk = S - k0 if nk is None else nk
        _need(0 <= k0 and k0 + nk <= S, "expert_down", f"slots {k0}..{k0 + nk - 1} outside 0..{S - 1}")
        name = weight_kernel("expert_down", "expert_down", Wd)
        if per is None:
            per = down_outputs_per_warp(D, T * nk, self._resident_blocks(name))
        _need(1 <= per <= EXPERT_DOWN_MAX_PER, "expert_down",
              f"per={per} outputs a warp: pass 1 .. {EXPERT_DOWN_MAX_PER}, or None for the engine's choice")
        self._launch(name, (-(-D // (WARPS_PER_BLOCK * per)), T * nk), _ptr(act), Wd.ptr, _ptr(slot_ids),
                     _ptr(y), I, D, S, k0, nk, e_base, per)

    def w4a16_gate_up(self, x, qg: DevBuf, sg: DevBuf, qu: DevBuf, su: DevBuf, slot_ids, act, T: int, S: int,
                      k0: int = 0, nk: int | None = None, e_base: int = 0) -> None:
        """The swiglu_gate_up of packed INT4 experts: qg/qu int32 [E', I, D/8], sg/su bf16 bits [E', I, D/g]."""
        _, I, D8 = qg.shape
        D, g = 8 * D8, _group(qg, sg, "w4a16_gate_up")
        nk = S - k0 if nk is None else nk
        _need(qu.shape == qg.shape and su.shape == sg.shape, "w4a16_gate_up", f"gate {qg.shape}/{sg.shape} and "
              f"up {qu.shape}/{su.shape} differ")
        self._launch("w4a16_gate_up_kernel", (-(-I // WARPS_PER_BLOCK), T * nk), _ptr(x), qg.ptr, sg.ptr, qu.ptr,
                     su.ptr, _ptr(slot_ids), _ptr(act), D, I, S, k0, nk, e_base, g)

    def w4a16_down(self, act, qd: DevBuf, sd: DevBuf, slot_ids, y, T: int, S: int, k0: int = 0,
                   nk: int | None = None, e_base: int = 0) -> None:
        _, D, I8 = qd.shape
        I, g = 8 * I8, _group(qd, sd, "w4a16_down")
        nk = S - k0 if nk is None else nk
        self._launch("w4a16_down_kernel", (-(-D // WARPS_PER_BLOCK), T * nk), _ptr(act), qd.ptr, sd.ptr,
                     _ptr(slot_ids), _ptr(y), I, D, S, k0, nk, e_base, g)

    def w4a16_kernel(self, M: int, numerics: str = "fp32") -> tuple[str, int]:
        """(entry name, row blocks per block) of the w4a16_mma entry for M <= 64 tokens (w4a16_entry)."""
        return w4a16_entry(M, numerics)

    def w4a16_plan(self, Nb: int, G: int, Z: int, ks: int | None = None, M: int = 1, numerics: str = "fp32",
                   rows: int | None = None, digits: bool = False, moe: bool = False) -> tuple[str, int, int]:
        """(entry name, blocks along the output, k splits) of one w4a16_mma launch of M <= 64 tokens. Up to 16
        FP32-faithful tokens: the entry and splits by w4a16_rows_plan, or `rows` row blocks per block where
        given (tests) at their one-wave split; ks, where given, overrides the splits. digits: the int8 digits
        entries of up to W4A16_DIGITS_TOKENS tokens (the grouped MoE path); moe: the MoE pairs path's row
        counts and regimes (w4a16_launch)."""
        return self._w4a16_plan(Nb, G, Z, ks, M, numerics, rows, digits, moe)[:3]

    def _w4a16_plan(self, Nb, G, Z, ks, M, numerics, rows, digits=False, moe=False) -> tuple[str, int, int, str]:
        """w4a16_plan and the regime that chose it (W4A16_REGIMES, or "forced" for rows=): w4a16_launch on
        this GPU's SM count and entry residency; moe: a launch of the MoE pairs path."""
        return w4a16_launch(Nb, G, Z, ks, M, numerics, rows, digits, self._resident_blocks, self.sm_count, moe)

    def _resident_blocks(self, name: str) -> int:
        """Blocks of kernel `name` resident on the whole GPU at once (shared memory and registers per SM)."""
        if name not in self._resident:
            self._resident[name] = self._resident_blocks_now(name)
        return self._resident[name]

    def _resident_blocks_now(self, name: str) -> int:
        drv, f = driver(), self.fn[name]
        dev = driver_device()
        smem = dev.get_attribute(drv.device_attribute.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
        regs = dev.get_attribute(drv.device_attribute.MAX_REGISTERS_PER_MULTIPROCESSOR)
        per_sm = min(smem // (f.shared_size_bytes + 1024), regs // (-(-f.num_regs // 8) * 8 * BLOCK[0]),
                     2048 // BLOCK[0])
        return max(1, per_sm) * self.sm_count

    def _reserve(self, owner: str, partials: int, tickets: int, fix: str) -> tuple[DevBuf, DevBuf]:
        """`owner`'s workspace grown to hold `partials` floats and `tickets` zeroed counters; outside graph
        capture only (`fix` says how a caller reserves it first)."""
        part, tick = self._ws.get(owner, (None, None))
        if part is None or part.shape[0] < partials or tick.shape[0] < tickets:
            if self.capturing:
                raise CudaEngineError(f"{owner}: the workspace must be reserved before graph capture ({partials} "
                                      f"floats, {tickets} tickets; {fix})")
            self._retired += [b for b in (part, tick) if b is not None]
            part = DevBuf((max(partials, 0 if part is None else part.shape[0], 1),), np.float32)
            tick = DevBuf.from_array(np.zeros(max(tickets, 0 if tick is None else tick.shape[0], 1), np.int32))
            self._ws[owner] = (part, tick)
        return part, tick

    def w4a16_reserve(self, partials: int, tickets: int) -> None:
        """Make the split-K workspace hold `partials` floats and `tickets` counters (zeroed)."""
        self._reserve("w4a16_mma", partials, tickets, "Ops.w4a16_reserve(*Ops.w4a16_need(...))")

    def w4a16_need(self, packed: DevBuf, M: int = 1, Z: int = 1, ks: int | None = None,
                   numerics: str = "fp32", rows: int | None = None, digits: bool = False,
                   moe: bool = False) -> tuple[int, int]:
        """(partials floats, tickets) one w4a16_mma launch over `packed` needs."""
        _, Nb, G, _ = packed.shape
        need = (0, 0)
        for m in {min(M, 64), M % 64 or 64}:                   # the launches of <= 64 tokens
            _, gx, k = self.w4a16_plan(Nb, G, Z, ks, m, numerics, rows, digits, moe)
            if k > 1:
                need = (max(need[0], Z * k * m * Nb * 32), max(need[1], Z * gx))
        return need

    def w4a16_mma(self, x, x_stride: int, packed: DevBuf, N: int, out, out_stride: int, M: int = 1, *,
                  mode: int = 0, numerics: str = "fp32", slot_ids=None, T: int = 1, S: int = 1, k0: int = 0,
                  nk: int = 1, e_base: int = 0, x_by_slot: bool = False, ks: int | None = None,
                  rows: int | None = None, groups=None, Z: int = 1, digits: bool = False) -> None:
        """The fast W4A16 GEMM (kernels/w4a16_mma.cu) on weights repacked by cuda_engine/w4a16_pack.py.

        packed int32 [E, Nb, G, 144]; mode 0: out[t, :N] = W x[t] (N <= 32 Nb); mode 1: the fused SwiGLU
        gate+up, out[t, :N] = silu(Wg x[t]) * (Wu x[t]) (N <= 16 Nb). Without slot_ids: expert 0, M tokens (in
        launches of at most 64). With slot_ids: the MoE decode path, one (token, slot) pair per grid z over
        the slots k0 .. k0+nk-1 of T tokens (M = 1), expert slot_ids[ts] - e_base; x row t, or ts when
        x_by_slot (the down projection's input is per slot); output row ts. With groups (moe_group's work
        list, Z its capacity): the grouped MoE path of a forward over several tokens, group z of at most M
        pairs per grid z, its pairs' x and output rows as on the slot path (kernels/w4a16_mma.cu), on the int8
        digits entries of M = W4A16_DIGITS_TOKENS (digits=True, the engine's) or the bf16 terms' of M in
        W4A16_GROUP_TOKENS. numerics: "fp32" (three bf16
        terms, or one token's eight int8 digits: float32-accurate) or "bf16" (one term: activations rounded to
        bf16). rows: the row blocks per block of an FP32-faithful entry of up to 16 tokens (W4A16_ROWS; tests),
        else by shape."""
        E, Nb, G, words = packed.shape
        _need(packed.dtype == np.int32 and words == W4A16_CHUNK_WORDS, "w4a16_mma",
              f"packed weights must be int32 [E, Nb, G, {W4A16_CHUNK_WORDS}], got {packed.dtype} {packed.shape}")
        _need(numerics in W4A16_ENTRIES, "w4a16_mma", f"numerics {numerics!r}: choose one of {', '.join(W4A16_ENTRIES)}")
        _need(mode in (0, 1) and 0 < N <= (32 if mode == 0 else 16) * Nb, "w4a16_mma",
              f"mode {mode}, N={N} does not fit {Nb} blocks of 32 rows")
        _need(G <= 65535, "w4a16_mma", f"{G} groups of 32 input columns: at most 65535 (K <= 2097120)")
        _need(x_stride >= 32 * G and x_stride % 2 == 0 and out_stride >= N, "w4a16_mma",
              f"x_stride {x_stride} < K = {32 * G} (or odd), or out_stride {out_stride} < N = {N}")
        path = "linear"
        if groups is not None:
            ok_m = M == W4A16_DIGITS_TOKENS if digits else M in W4A16_GROUP_TOKENS
            _need(slot_ids is None and numerics == "fp32" and ok_m and Z >= 1 and S >= 1
                  and groups.dtype == np.int32 and groups.shape[0] >= 1 + 3 * Z, "w4a16_mma",
                  f"the grouped path takes the FP32-faithful numerics, M = {W4A16_DIGITS_TOKENS} tokens per group "
                  f"(digits) or one of {W4A16_GROUP_TOKENS} (bf16 terms) (got {M}, digits={digits}), no slot_ids, "
                  f"and an int32 work list of at least 1 + 3 Z = {1 + 3 * Z} entries (got {groups.dtype} "
                  f"{groups.shape})")
            path = "grouped"
        elif slot_ids is not None:
            _need(M == 1 and 0 <= k0 and nk >= 1 and k0 + nk <= S, "w4a16_mma",
                  f"slots {k0}..{k0 + nk - 1} outside 0..{S - 1} (or M = {M} != 1 on the slot path)")
            Z, path = T * nk, "pairs"
        else:
            Z = 1
            _need(E >= 1 and M >= 1, "w4a16_mma", f"need E >= 1 experts and M >= 1 tokens, got {E}, {M}")
        _need(groups is not None or not digits, "w4a16_mma", "digits=True is the grouped path's (pass groups)")
        moe = path != "linear"
        self.w4a16_reserve(*self.w4a16_need(packed, M, Z, ks, numerics, rows, digits, moe))
        for m0 in range(0, M, 64):
            m = min(64, M - m0)
            name, gx, k, regime = self._w4a16_plan(Nb, G, Z, ks, m, numerics, rows, digits, moe)
            self._launch(name, (gx, k, Z), _ptr(x) + 4 * m0 * x_stride,
                         x_stride, packed.ptr, 0 if slot_ids is None else _ptr(slot_ids), S, k0, nk, e_base,
                         int(x_by_slot), m, N, Nb, G, k, _ptr(out) + 4 * m0 * out_stride, out_stride,
                         *(b.ptr for b in self._ws["w4a16_mma"]), mode, 0 if groups is None else _ptr(groups))
            key = f"{path}:{regime}"
            self.w4a16_regimes[key] = self.w4a16_regimes.get(key, 0) + 1

    def moe_group(self, slot_ids, T: int, S: int, k0: int, nk: int, e_base: int, E: int, MT: int, Z: int,
                  groups: DevBuf) -> None:
        """The grouped MoE path's work list (kernels/moe.cu, moe_group_kernel) in `groups` (int32, at least
        1 + 3 Z + T nk entries): the pairs of slots k0 .. k0+nk-1 of T tokens whose expert slot_ids - e_base lies
        in [0, E), by expert, in chunks of at most MT; Z >= w4a16_groups_cap(T nk, E, MT)."""
        _need(1 <= E <= MOE_GROUP_MAX_E and 1 <= MT and 0 <= k0 and nk >= 1 and k0 + nk <= S, "moe_group",
              f"E={E} experts (1..{MOE_GROUP_MAX_E}), MT={MT}, slots {k0}..{k0 + nk - 1} of S={S}")
        _need(Z >= w4a16_groups_cap(T * nk, E, MT), "moe_group", f"Z={Z} < the most groups "
              f"{w4a16_groups_cap(T * nk, E, MT)} of {T * nk} pairs")
        _need(groups.dtype == np.int32 and groups.shape[0] >= 1 + 3 * Z + T * nk, "moe_group",
              f"work list {groups.dtype} {groups.shape} < 1 + 3 Z + pairs = {1 + 3 * Z + T * nk} int32")
        self._launch("moe_group_kernel", (1,), _ptr(slot_ids), T, S, k0, nk, e_base, E, MT, Z, groups.ptr)

    def stream_read(self, src_ptr: int, nbytes: int, sink: DevBuf) -> None:
        """Read nbytes (a multiple of 16) once: the bandwidth floor of kdtr bench w4a16."""
        _need(nbytes % 16 == 0 and src_ptr % 16 == 0, "stream_read", f"{nbytes} bytes at {src_ptr:#x}: need 16-byte units")
        self._launch("stream_read_kernel", (8 * self.sm_count,), src_ptr, nbytes // 16, sink.ptr)

    def moe_combine_reserve(self, T: int, D: int) -> None:
        """Make the combine's workspace hold T tokens of a D-wide row: partials [T, blocks per row], tickets
        [T] (zeroed). Called before graph capture (the engine reserves its T_cap); grown here otherwise."""
        self._reserve("moe_combine", T * -(-D // COMBINE_DSLICE), T, f"Ops.moe_combine_reserve(T={T}, D={D})")

    def moe_combine(self, y, slot_ids, slot_w, out, T: int, K: int, S: int, h, h_out, w_norm: DevBuf, y_norm,
                    eps: float) -> None:
        """out = weighted sum of the slots; then h_out = h + out and y_norm = rms_norm(h_out, w_norm).
        A row's slices run on ceil(D / COMBINE_DSLICE) blocks; the last to finish writes y_norm (kernels/moe.cu)."""
        D = w_norm.shape[0]
        _need(0 <= K <= S <= MOE_MAX_SLOTS, "moe_combine", f"K={K}, S={S} (max {MOE_MAX_SLOTS})")
        self.moe_combine_reserve(T, D)
        self._launch("moe_combine_kernel", (-(-D // COMBINE_DSLICE), T), _ptr(y), _ptr(slot_ids), _ptr(slot_w),
                     _ptr(out), K, S, D, _ptr(h), _ptr(h_out), w_norm.ptr, _ptr(y_norm), eps,
                     *(b.ptr for b in self._ws["moe_combine"]))

    # ------------------------------------------------------------ sampling
    def argmax(self, logits, V: int, out, T: int) -> None:
        self._launch("argmax_kernel", (T,), _ptr(logits), V, _ptr(out))

    def decode_advance(self, meta: DevBuf, positions: DevBuf) -> None:
        self._launch("decode_advance_kernel", (1,), meta.ptr, positions.ptr, block=(1, 1, 1))
