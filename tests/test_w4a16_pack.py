"""The fast W4A16 kernel's repacked layout (cuda_engine/w4a16_pack.py), checked on the CPU: reading a packed
buffer back through the PTX mma.sync fragment definitions (written out here from the PTX ISA, not taken from
the packer) and the kernel's scale and dequantization rules gives exactly the dequantized weights of
kdtr_format/int4.py, on both of the kernel's paths: the int8 digits path (m16n8k32 .s8, one token) and the
bf16 terms path (m16n8k16 .bf16), whose column order within a group is its own permutation (the activations
are staged in the same order). No GPU needed: a wrong nibble order, row or group shows up here."""
import numpy as np
import pytest

from cuda_engine.w4a16_pack import CHUNK_WORDS, pack_gate_up, pack_linear
from kdtr_format.bf16 import bf16_to_float32
from kdtr_format.int4 import Int4LayoutError, dequantize_w4a16, quantize_w4a16, scale_bits


def s8_a_fragment(lane: int, reg: int, byte: int) -> tuple[int, int]:
    """PTX m16n8k32 (.s8) A fragment, row-major: (row, column) of byte `byte` of register a_reg."""
    g, c = lane // 4, lane % 4
    return g + 8 * (reg % 2), 4 * c + byte + 16 * (reg // 2)


def bf16_a_fragment(lane: int, reg: int, half: int) -> tuple[int, int]:
    """PTX m16n8k16 (.bf16) A fragment: (row, k within the k-step) of half `half` of register a_reg."""
    g, c = lane // 4, lane % 4
    return g + 8 * (reg % 2), 2 * c + half + 8 * (reg // 2)


def bf16_column(kk: int, kb: int) -> int:
    """The bf16 path's order (kernels/w4a16_mma.cu): k-step kk's k index kb is group column
    16 (kb // 8) + 4 ((kb % 8) // 2) + kk + 2 (kb % 2)."""
    return 16 * (kb // 8) + 4 * ((kb % 8) // 2) + kk + 2 * (kb % 2)


def c_rows(lane: int) -> tuple[int, int]:
    """PTX m16n8k16 / m16n8k32 C fragment rows of a lane: c0, c1 -> row g; c2, c3 -> row g + 8."""
    return lane // 4, lane // 4 + 8


def _s8(x: int) -> int:
    return x - 256 if x >= 128 else x


def read_back(packed: np.ndarray, path: str) -> np.ndarray:
    """Dense float64 [32 Nb, 32 G] as the kernel computes it on `path`:
    "int8": registers (w << 4) & 0xF0F0F0F0 (a_p) and w & 0xF0F0F0F0 (a_{p+2}) of word 2 mt + p hold 16 q;
    "bf16": register a_r of k-step kk is ((w >> 4 j) & 0x000F000F) ^ 0x00080008 | 0x43004300 - 136 per half,
    w = word 2 mt + r % 2, j = 2 kk + r // 2;
    then the row's scale from the lane's scale words (the scale its C fragment applies to that row)."""
    assert path in ("int8", "bf16")
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
                rows = c_rows(lane)
                for mt in range(2):
                    def put(r, col, q):
                        sc = s[2 * mt + rows.index(r)]
                        W[32 * b + 16 * mt + r, 32 * grp + col] = q * sc
                    if path == "int8":
                        for p in range(2):
                            w = int(chunk[4 * lane + 2 * mt + p])
                            for reg, val in ((p, (w << 4) & 0xF0F0F0F0), (p + 2, w & 0xF0F0F0F0)):
                                for byte in range(4):
                                    q16 = _s8((val >> (8 * byte)) & 0xFF)
                                    assert q16 % 16 == 0
                                    put(*s8_a_fragment(lane, reg, byte), q16 // 16)
                    else:
                        for kk in range(2):
                            for reg in range(4):
                                w = int(chunk[4 * lane + 2 * mt + reg % 2])
                                bits = (((w >> (4 * (2 * kk + reg // 2))) & 0x000F000F) ^ 0x00080008) | 0x43004300
                                for half in range(2):
                                    r, kb = bf16_a_fragment(lane, reg, half)
                                    h = (bits >> (16 * half)) & 0xFFFF
                                    q = float(bf16_to_float32(np.array([h], np.uint16))[0]) - 136
                                    put(r, bf16_column(kk, kb), q)
    return W


def test_bf16_column_order_is_a_permutation():
    assert sorted(bf16_column(kk, kb) for kk in range(2) for kb in range(16)) == list(range(32))


@pytest.mark.parametrize("path", ["int8", "bf16"])
@pytest.mark.parametrize("N,K,g", [(8, 96, 32), (40, 64, 64), (64, 224, 32), (33, 32, 32)])
def test_pack_linear_reads_back_exactly(N, K, g, path):
    rng = np.random.default_rng(N * K)
    qw, sc = quantize_w4a16(rng.standard_normal((N, K)), g)
    W = read_back(pack_linear(qw, sc), path)
    assert not np.isnan(W).any()
    np.testing.assert_array_equal(W[:N], dequantize_w4a16(qw, sc, (N, K)))
    assert not W[N:].any()                                                     # padding rows are zero


def test_pack_linear_takes_bf16_bits_like_floats():
    rng = np.random.default_rng(5)
    qw, sc = quantize_w4a16(rng.standard_normal((32, 64)), 32)
    np.testing.assert_array_equal(pack_linear(qw, sc), pack_linear(qw, scale_bits(sc)))


@pytest.mark.parametrize("path", ["int8", "bf16"])
@pytest.mark.parametrize("I,K", [(32, 192), (24, 64), (16, 32)])
def test_pack_gate_up_interleaves_16_row_tiles(I, K, path):
    rng = np.random.default_rng(I + K)
    (qg, sg), (qu, su) = (quantize_w4a16(rng.standard_normal((I, K)), 32) for _ in range(2))
    W = read_back(pack_gate_up(qg, sg, qu, su), path)
    Wg, Wu = dequantize_w4a16(qg, sg, (I, K)), dequantize_w4a16(qu, su, (I, K))
    for i in range(I):                                     # block i // 16: m-tile 0 = gate, m-tile 1 = up
        b, r = divmod(i, 16)
        np.testing.assert_array_equal(W[32 * b + r], Wg[i])
        np.testing.assert_array_equal(W[32 * b + 16 + r], Wu[i])


def test_group_below_32_is_refused_with_the_fix():
    qw, sc = quantize_w4a16(np.ones((8, 64)), 16)
    with pytest.raises(Int4LayoutError, match=r"group_size=16, in=64; run this bundle with --w4a16 plain"):
        pack_linear(qw, sc)
