"""The fast W4A16 kernel's repacked layout (cuda_engine/w4a16_pack.py), checked on the CPU: reading a packed
buffer back through the PTX mma.sync.m16n8k16 fragment definitions (written out here from the PTX ISA, not
taken from the packer) and the kernel's scale and dequantization rules gives exactly the dequantized
weights of kdtr_format/int4.py. No GPU needed: a wrong nibble order, row or group shows up here."""
import numpy as np
import pytest

from cuda_engine.w4a16_pack import CHUNK_WORDS, pack_gate_up, pack_linear
from kdtr_format.int4 import Int4LayoutError, bf16_bits, bf16_to_float32, dequantize_w4a16, quantize_w4a16


def a_fragment(lane: int, reg: int) -> tuple[int, int]:
    """PTX m16n8k16 (.bf16) A fragment: (row, first column) of register a_reg (two consecutive columns)."""
    g, c = lane // 4, lane % 4
    return g + 8 * (reg % 2), 2 * c + 8 * (reg // 2)


def c_rows(lane: int) -> tuple[int, int]:
    """PTX m16n8k16 C fragment rows of a lane: c0, c1 -> row g; c2, c3 -> row g + 8."""
    return lane // 4, lane // 4 + 8


def read_back(packed: np.ndarray) -> np.ndarray:
    """Dense float64 [32 Nb, 32 G] as the kernel computes it: q = (nibble | 128 as bf16) - 136, scale from
    the lane's scale words, per m16 tile mt and k-step kk of each chunk."""
    Nb, G, words = packed.shape
    assert words == CHUNK_WORDS
    W = np.full((32 * Nb, 32 * G), np.nan)
    u32 = packed.view(np.uint32)
    for b in range(Nb):
        for grp in range(G):
            chunk = u32[b, grp]
            scales = bf16_to_float32(chunk[128:].view(np.uint16))            # 32 bf16
            for lane in range(32):
                s = scales[4 * (lane // 4): 4 * (lane // 4) + 4]               # uint2 at word 128 + 2 g
                for mt in range(2):
                    rows = c_rows(lane)
                    for kk in range(2):
                        w = int(chunk[4 * lane + 2 * mt + kk])
                        for reg in range(4):
                            r, col = a_fragment(lane, reg)
                            pair = (w >> (4 * reg)) & 0x000F000F
                            for half, dc in ((pair & 0xF, 0), (pair >> 16, 1)):
                                q = half - 8
                                # the row's scale is the one the lane's C fragment applies to that row
                                sc = s[2 * mt + rows.index(r)]
                                W[32 * b + 16 * mt + r, 32 * grp + 16 * kk + col + dc] = q * sc
    return W


@pytest.mark.parametrize("N,K,g", [(8, 96, 32), (40, 64, 64), (64, 224, 32), (33, 32, 32)])
def test_pack_linear_reads_back_exactly(N, K, g):
    rng = np.random.default_rng(N * K)
    qw, sc = quantize_w4a16(rng.standard_normal((N, K)), g)
    W = read_back(pack_linear(qw, sc))
    assert not np.isnan(W).any()
    np.testing.assert_array_equal(W[:N], dequantize_w4a16(qw, sc, (N, K)))
    assert not W[N:].any()                                                     # padding rows are zero


def test_pack_linear_takes_bf16_bits_like_floats():
    rng = np.random.default_rng(5)
    qw, sc = quantize_w4a16(rng.standard_normal((32, 64)), 32)
    np.testing.assert_array_equal(pack_linear(qw, sc), pack_linear(qw, bf16_bits(sc)))


@pytest.mark.parametrize("I,K", [(32, 192), (24, 64), (16, 32)])
def test_pack_gate_up_interleaves_16_row_tiles(I, K):
    rng = np.random.default_rng(I + K)
    (qg, sg), (qu, su) = (quantize_w4a16(rng.standard_normal((I, K)), 32) for _ in range(2))
    W = read_back(pack_gate_up(qg, sg, qu, su))
    Wg, Wu = dequantize_w4a16(qg, sg, (I, K)), dequantize_w4a16(qu, su, (I, K))
    for i in range(I):                                     # block i // 16: m-tile 0 = gate, m-tile 1 = up
        b, r = divmod(i, 16)
        np.testing.assert_array_equal(W[32 * b + r], Wg[i])
        np.testing.assert_array_equal(W[32 * b + 16 + r], Wu[i])


def test_group_below_32_is_refused_with_the_fix():
    qw, sc = quantize_w4a16(np.ones((8, 64)), 16)
    with pytest.raises(Int4LayoutError, match=r"group_size=16, in=64; run this bundle with --w4a16 plain"):
        pack_linear(qw, sc)
