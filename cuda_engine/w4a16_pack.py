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

import numpy as np

from kdtr_format.int4 import Int4LayoutError, scale_bits, scales_as_float, unpack_int4

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


def _pack_rows(u: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """u uint8 [Np, K] nibbles (Np a multiple of 32), scale float32 [Np, K/32] -> int32 [Np/32, K/32, 144]."""
    Np, K = u.shape
    Nb, G = Np // ROWS, K // TILE_K
    v = (u.reshape(Nb, 2, 16, G, TILE_K) ^ 8).astype(np.uint32)        # q mod 16, [Nb, mt, row, G, col]
    words = np.zeros((Nb, G, 32, 2, 2), np.uint32)                      # [Nb, G, lane, mt, p]
    for p in range(2):
        for n in range(8):
            rows, cols = WORD_ROW[:, p, n], WORD_COL[:, p, n]           # [lane]
            words[:, :, :, :, p] |= (v[:, :, rows, :, cols] << (4 * n)).transpose(1, 3, 0, 2)
    bits = scale_bits(scale).reshape(Nb, ROWS, G)                        # [Nb, row, G] uint16
    sbits = bits[:, SCALE_ROW.reshape(-1), :].transpose(0, 2, 1)        # [Nb, G, 128 = lane x i]
    sbits = sbits.reshape(Nb, G, 8, 4, 4)[:, :, :, 0, :].reshape(Nb, G, 32)  # the 4 lanes of a g read the same
    out = np.empty((Nb, G, CHUNK_WORDS), np.int32)
    out[:, :, :128] = words.reshape(Nb, G, 128).view(np.int32)
    out[:, :, 128:] = np.ascontiguousarray(sbits).view(np.int32)
    return out


def _nibbles_and_scales(qw: np.ndarray, sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(u uint8 [N, K], per-32-column scale float32 [N, K/32]) of one packed weight."""
    g = _group_of(qw, sc)
    u = (unpack_int4(np.asarray(qw, np.int32)).astype(np.int16) + 8).astype(np.uint8)
    s = np.repeat(scales_as_float(np.asarray(sc)).astype(np.float32), g // TILE_K, axis=1)
    return u, s


def _pad_rows(a: np.ndarray, n: int, fill) -> np.ndarray:
    if a.shape[0] == n:
        return a
    out = np.full((n,) + a.shape[1:], fill, a.dtype)
    out[:a.shape[0]] = a
    return out


def pack_linear(qw: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """y = W x (mode 0): packed qw int32 [N, K/8], sc [N, K/g] -> int32 [ceil(N/32), K/32, 144]."""
    u, s = _nibbles_and_scales(qw, sc)
    Np = -(-u.shape[0] // ROWS) * ROWS
    return _pack_rows(_pad_rows(u, Np, 8), _pad_rows(s, Np, 0.0))


def pack_gate_up(qg: np.ndarray, sg: np.ndarray, qu: np.ndarray, su: np.ndarray) -> np.ndarray:
    """silu(Wg x) * (Wu x) (mode 1): gate and up [I, K/8] / [I, K/g] -> int32 [ceil(I/16), K/32, 144]."""
    if qg.shape != qu.shape or sg.shape != su.shape:
        raise Int4LayoutError(f"gate {qg.shape}/{sg.shape} and up {qu.shape}/{su.shape} differ")
    (ug, s_g), (uu, s_u) = _nibbles_and_scales(qg, sg), _nibbles_and_scales(qu, su)
    I16 = -(-ug.shape[0] // 16) * 16
    ug, uu, s_g, s_u = _pad_rows(ug, I16, 8), _pad_rows(uu, I16, 8), _pad_rows(s_g, I16, 0.0), _pad_rows(s_u, I16, 0.0)
    K = ug.shape[1]
    u = np.stack([ug.reshape(-1, 16, K), uu.reshape(-1, 16, K)], axis=1).reshape(2 * I16, K)
    s = np.stack([s_g.reshape(-1, 16, K // TILE_K), s_u.reshape(-1, 16, K // TILE_K)], axis=1).reshape(2 * I16, -1)
    return _pack_rows(u, s)


def pack_experts(qw: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """pack_linear over stacked experts [E, N, K/8] / [E, N, K/g] -> [E, Nb, G, 144]."""
    return np.stack([pack_linear(q, s) for q, s in zip(qw, sc)])


def pack_experts_gate_up(qg, sg, qu, su) -> np.ndarray:
    """pack_gate_up over stacked experts -> [E, Nb, G, 144]."""
    return np.stack([pack_gate_up(*a) for a in zip(qg, sg, qu, su)])
