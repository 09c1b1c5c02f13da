"""The fast W4A16 kernel's weight layout (kernels/w4a16_mma.cu): a one-time repack of the bundle's `.qw` /
`.sc` (kdtr_format/int4.py, the layout truth) into chunks whose words are mma.sync A fragments after a mask
(m16n8k32 int8) or a mask and a subtract (m16n8k16 bf16).
Host-side NumPy, no GPU; the engine repacks once at load.

Chunk (block b of 32 output rows, group of 32 input columns) = 144 int32 words:
  words 4 l .. 4 l + 3 (lane l, g = l // 4, c = l % 4): word 2 mt + p holds 8 weights of row
  16 mt + g + 8 p (m-tile mt, p = 0: the lane's row g, p = 1: row g + 8): nibble 2 i (i = 0..3) is column
  4 c + i, nibble 2 i + 1 is column 16 + 4 c + i. A nibble is q mod 16 (q = u - 8 in 4-bit two's complement,
  u the bundle's nibble): `(w << 4) & 0xF0F0F0F0` and `w & 0xF0F0F0F0` are then the PTX m16n8k32 .s8
  A-fragment registers a_p and a_{p+2} holding 16 q (exact in int8), and the m16n8k16 bf16 path reads the
  same word (see kernels/w4a16_mma.cu for its column order);
  words 128..143: 32 bf16 scales, index 4 g + i -> row (16 (i // 2) + g + 8 (i % 2)) of the block.
Rows past the real ones are padding (q = 0, scale 0).
`pack_gate_up` interleaves gate and up: block b = gate rows 16 b .. 16 b + 15 (m-tile 0) and the same up rows
(m-tile 1), so the kernel's SwiGLU epilogue finds both sums of an output in one lane.
"""
from __future__ import annotations

import os

import numpy as np

from kdtr_format.int4 import Int4LayoutError, scale_bits, scales_as_float

CHUNK_WORDS = 144
TILE_K = 32                        # columns per chunk (one mma k-step pair)
ROWS = 32                          # output rows per chunk (two m16 tiles)

_LANE = np.arange(32)
_G, _C = _LANE // 4, _LANE % 4
# [lane, p, n]: the row (within the 32-row block, m-tile 0) and the column (within the group) of nibble n of
# the lane's word (mt = 0, p): row g + 8 p; column 4 c + n // 2, + 16 for an odd n
WORD_ROW = np.broadcast_to(_G[:, None, None] + 8 * np.arange(2)[None, :, None], (32, 2, 8))
WORD_COL = np.broadcast_to(4 * _C[:, None, None] + (np.arange(8) // 2 + 16 * (np.arange(8) % 2))[None, None, :],
                           (32, 2, 8))
# [lane, i]: the scale rows of the lane's C fragment (i = 0..3: mt0 row g, mt0 row g + 8, mt1 row g, mt1 g + 8)
SCALE_ROW = 16 * (np.arange(4)[None, :] // 2) + _G[:, None] + 8 * (np.arange(4)[None, :] % 2)


def _group_of(qw: np.ndarray, sc: np.ndarray) -> int:
    N, K8 = qw.shape
    K = 8 * K8
    if sc.ndim != 2 or sc.shape[0] != N or sc.shape[1] == 0 or K % sc.shape[1]:
        raise Int4LayoutError(f"INT4 scales {sc.shape} do not fit packed weights {qw.shape}")
    g = K // sc.shape[1]
    if g % TILE_K or K % TILE_K:
        raise Int4LayoutError(f"the fast W4A16 kernel needs group_size and the input dim to be multiples of "
                              f"{TILE_K}, got group_size={g}, in={K}; run this bundle with --w4a16 plain")
    return g


def _spread(h: np.ndarray) -> np.ndarray:
    """uint32 with four nibbles in bits 0..15 -> the same nibbles at bits 0, 8, 16 and 24."""
    h = (h | (h << np.uint32(8))) & np.uint32(0x00FF00FF)
    return (h | (h << np.uint32(4))) & np.uint32(0x0F0F0F0F)


def _pack_words(qw: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """qw int32 [Np, K/8] of the bundle's words (Np a multiple of 32), scale float32 [Np, K/32] ->
    int32 [Np/32, K/32, 144]. Word-parallel: the chunk word of (lane 4 g + c, mt, p) takes nibbles 4 (c % 2) ..
    4 (c % 2) + 3 of the row's words c // 2 (columns 4 c ..) and 2 + c // 2 (columns 16 + 4 c ..) of the group,
    spreads them to the even and the odd nibbles, and turns u into q mod 16 (u ^ 8, every nibble at once)."""
    Np, K8 = qw.shape
    Nb, G = Np // ROWS, K8 // (TILE_K // 8)
    w = np.ascontiguousarray(qw).view(np.uint32).reshape(Nb, 2, 2, 8, G, 4)   # [Nb, mt, p, g, G, word]
    words = np.empty((Nb, G, 8, 4, 2, 2), np.uint32)                          # [Nb, G, g, c, mt, p]
    for c in range(4):
        shift = np.uint32(16 * (c % 2))
        lo = _spread((w[..., c // 2] >> shift) & np.uint32(0xFFFF))           # columns 4 c + i
        hi = _spread((w[..., 2 + c // 2] >> shift) & np.uint32(0xFFFF))       # columns 16 + 4 c + i
        words[:, :, :, c] = ((lo | (hi << np.uint32(4))) ^ np.uint32(0x88888888)).transpose(0, 4, 3, 1, 2)
    bits = scale_bits(scale).reshape(Nb, ROWS, G)                        # [Nb, row, G] uint16
    sbits = bits[:, SCALE_ROW.reshape(-1), :].transpose(0, 2, 1)        # [Nb, G, 128 = lane x i]
    sbits = sbits.reshape(Nb, G, 8, 4, 4)[:, :, :, 0, :].reshape(Nb, G, 32)  # the 4 lanes of a g read the same
    out = np.empty((Nb, G, CHUNK_WORDS), np.int32)
    out[:, :, :128] = words.reshape(Nb, G, 128).view(np.int32)
    out[:, :, 128:] = np.ascontiguousarray(sbits).view(np.int32)
    return out


PAD_WORD = np.uint32(0x88888888).view(np.int32)    # eight nibbles u = 8: q = 0, the padding rows' weights


def _words_and_scales(qw: np.ndarray, sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the words int32 [N, K/8], per-32-column scale float32 [N, K/32]) of one packed weight."""
    g = _group_of(qw, sc)
    if np.asarray(qw).dtype != np.int32:
        raise Int4LayoutError(f"packed INT4 weights must be int32 [out, in/8], got {np.asarray(qw).dtype}")
    s = np.repeat(scales_as_float(np.asarray(sc)).astype(np.float32), g // TILE_K, axis=1)
    return np.asarray(qw), s


def _pad_rows(a: np.ndarray, n: int, fill) -> np.ndarray:
    if a.shape[0] == n:
        return a
    out = np.full((n,) + a.shape[1:], fill, a.dtype)
    out[:a.shape[0]] = a
    return out


def pack_linear(qw: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """y = W x (mode 0): packed qw int32 [N, K/8], sc [N, K/g] -> int32 [ceil(N/32), K/32, 144]."""
    w, s = _words_and_scales(qw, sc)
    Np = -(-w.shape[0] // ROWS) * ROWS
    return _pack_words(_pad_rows(w, Np, PAD_WORD), _pad_rows(s, Np, 0.0))


def pack_gate_up(qg: np.ndarray, sg: np.ndarray, qu: np.ndarray, su: np.ndarray) -> np.ndarray:
    """silu(Wg x) * (Wu x) (mode 1): gate and up [I, K/8] / [I, K/g] -> int32 [ceil(I/16), K/32, 144]."""
    if qg.shape != qu.shape or sg.shape != su.shape:
        raise Int4LayoutError(f"gate {qg.shape}/{sg.shape} and up {qu.shape}/{su.shape} differ")
    (wg, s_g), (wu, s_u) = _words_and_scales(qg, sg), _words_and_scales(qu, su)
    I16 = -(-wg.shape[0] // 16) * 16
    wg, wu = _pad_rows(wg, I16, PAD_WORD), _pad_rows(wu, I16, PAD_WORD)
    s_g, s_u = _pad_rows(s_g, I16, 0.0), _pad_rows(s_u, I16, 0.0)
    K8, G = wg.shape[1], s_g.shape[1]
    w = np.stack([wg.reshape(-1, 16, K8), wu.reshape(-1, 16, K8)], axis=1).reshape(2 * I16, K8)
    s = np.stack([s_g.reshape(-1, 16, G), s_u.reshape(-1, 16, G)], axis=1).reshape(2 * I16, G)
    return _pack_words(w, s)


def _over_experts(E: int, pack_one) -> np.ndarray:
    """[E, Nb, G, 144] of pack_one(e) for e < E, written in place, on up to one thread per CPU: NumPy's
    integer ufuncs and copies release the GIL, and K2.6 has 384 experts a layer (each about 0.1 s)."""
    from concurrent.futures import ThreadPoolExecutor
    if E == 0:
        raise Int4LayoutError("no experts to pack")
    first = pack_one(0)
    out = np.empty((E,) + first.shape, first.dtype)
    out[0] = first

    def put(e: int) -> None:
        out[e] = pack_one(e)
    threads = min(E - 1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if threads <= 1:
        for e in range(1, E):
            put(e)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, range(1, E)))
    return out


def pack_experts(qw: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """pack_linear over stacked experts [E, N, K/8] / [E, N, K/g] -> [E, Nb, G, 144]."""
    return _over_experts(len(qw), lambda e: pack_linear(qw[e], sc[e]))


def pack_experts_gate_up(qg, sg, qu, su) -> np.ndarray:
    """pack_gate_up over stacked experts -> [E, Nb, G, 144]."""
    return _over_experts(len(qg), lambda e: pack_gate_up(qg[e], sg[e], qu[e], su[e]))
