"""INT4 W4A16 layout truth: compressed-tensors "pack-quantized", 4 bits, symmetric, per-group scales.

Every producer and consumer of INT4 weights in kdtr (quantizer, importer, reference, kernels' tests)
goes through this file (docs/int4.md describes it). Layout, for a logical weight W [N = out, K = in]:

    qw  int32 [N, K/8]   word (n, j) holds columns 8j..8j+7; column 8j+i is nibble i (bits 4i..4i+3),
                         so column 8j is the LEAST significant nibble. nibble u = q + 8 ("uint4b8"),
                         q in [-8, 7]. Words with u >= 8 in the top nibble are negative as int32.
    sc  [N, K/g]         scale of group k // g of row n (g = group_size, K/g groups per row).
    W[n, k] = q[n, k] * sc[n, k // g]       (no zero point: symmetric)

This is byte-for-byte compressed-tensors' `pack_to_int32` / `unpack_from_int32` (num_bits=4,
packed_dim=1) with `weight_packed` [N, K/8] and `weight_scale` [N, K/g], as Kimi K2-Thinking, K2.5 and
K2.6 ship their routed experts (docs/int4.md).

Scale convention of `quantize_w4a16` (compressed-tensors' own minmax + group strategy with
scale_dtype=bfloat16, `calculate_qparams` and `_quantize`), per group of g input columns:

    absmax = max(|w|) over the group                        (computed in the working precision P)
    scale  = bf16_rne(min(absmax / 7.5, bf16 max))          (7.5 = (q_max - q_min) / 2 = 15 / 2)
    scale  = 2**-7 if scale == 0                             (bf16 eps: an all-zero group, never 0)
    q      = round_half_even(clip(w / scale, -8, 7))         (division in P)

P is float64 for float64 input and float32 for everything else (float16/float32 inputs are promoted
to float32), exactly as compressed-tensors computes in the weight's own dtype. +absmax maps to 7
(7.5 is clipped); -absmax maps to -8 if bf16 rounding did not raise the scale (-7.5 rounds half to even)
and to -7 if it did, so a group need not use all 16 codes. `sc` is returned as
float32 values that are exactly representable in bfloat16 (K2.6 stores bf16 scales); `scale_bits`
gives the raw bit pattern to store. bf16_rne is kdtr_format/bf16.py's one rounding, from P in one
step; the clamp to the bf16 maximum before it is compressed-tensors' `round_to_quantized_type_dtype`
(clamp, then cast), so a scale saturates where the plain rounding would overflow to inf.

Dequantization is exact: q has 4 significant bits and a bf16 scale 8, so q * scale is exact in
float32 and float64 (never multiply in bf16: that rounds, as compressed-tensors' own `dequantize`
does when handed bf16 scales).
"""
import numpy as np

from kdtr_format.bf16 import bf16_bits, bf16_round, bf16_to_float32, is_bf16
from kdtr_format.errors import Int4LayoutError

NUM_BITS = 4
Q_MIN, Q_MAX = -8, 7
NIBBLES_PER_WORD = 8
BF16_EPS = 2.0 ** -7        # torch.finfo(torch.bfloat16).eps: compressed-tensors' scale for all-zero groups
BF16_MAX = 3.3895313892515355e38


def scale_bits(sc: np.ndarray) -> np.ndarray:
    """Raw bfloat16 bit patterns (uint16) of scales that are bfloat16 values already (as
    `quantize_w4a16` returns them): storing them loses nothing, and a scale that is not one is an error."""
    sc = np.asarray(sc)
    if not is_bf16(sc):
        raise Int4LayoutError("INT4 scales stored as bfloat16 must be bfloat16 values already; round them "
                              "with kdtr_format.bf16.bf16_round first (quantize_w4a16 does)")
    return bf16_bits(sc)


def _check_layout(shape: tuple[int, int], group_size: int) -> None:
    if len(shape) != 2:
        raise Int4LayoutError(f"INT4 weights must be 2-D [out, in], got shape {tuple(shape)}")
    out_dim, in_dim = shape
    if group_size <= 0 or in_dim % NIBBLES_PER_WORD != 0 or in_dim % group_size != 0:
        raise Int4LayoutError(
            f"INT4 W4A16 needs the input dim to be a multiple of group_size={group_size} and of 8 "
            f"(8 nibbles per int32), got shape [out={out_dim}, in={in_dim}]; leave this weight "
            f"unquantized or choose a group_size that divides {in_dim}")


def quantize_w4a16(w: np.ndarray, group_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Quantize W [out, in] to (qw int32 [out, in/8], sc float32 [out, in/group_size]); see module doc."""
    w = np.asarray(w)
    _check_layout(w.shape, group_size)
    if not np.all(np.isfinite(w)):
        raise Int4LayoutError(f"INT4 quantization needs finite weights; shape {w.shape} holds NaN or inf")
    work = np.float64 if w.dtype == np.float64 else np.float32
    out_dim, in_dim = w.shape
    groups = w.astype(work).reshape(out_dim, in_dim // group_size, group_size)   # [N, K/g, g]
    absmax = np.abs(groups).max(axis=2)                                          # [N, K/g]
    scale = bf16_round(np.minimum(absmax / work(7.5), BF16_MAX))                 # [N, K/g] float32, bf16 values
    scale[scale == 0] = BF16_EPS
    scaled = groups / scale.astype(work)[:, :, None]                             # [N, K/g, g] in P
    q = np.rint(np.clip(scaled, Q_MIN, Q_MAX)).astype(np.int32)                  # ties to even, like torch.round
    return pack_int4(q.reshape(out_dim, in_dim)), scale.astype(np.float32)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack integers q in [-8, 7], [out, in] (in a multiple of 8), into int32 words [out, in/8]."""
    q = np.asarray(q)
    if q.ndim != 2 or q.shape[1] % NIBBLES_PER_WORD != 0:
        raise Int4LayoutError(f"pack_int4 needs [out, in] with in a multiple of 8, got shape {q.shape}")
    if q.size and (q.min() < Q_MIN or q.max() > Q_MAX):
        raise Int4LayoutError(f"pack_int4 values must lie in [-8, 7], got [{q.min()}, {q.max()}]")
    u = (q.astype(np.int64) + 8).astype(np.uint32)                      # [N, K] in [0, 15]
    u = u.reshape(q.shape[0], -1, NIBBLES_PER_WORD)                     # [N, K/8, 8]
    shifts = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * NUM_BITS    # nibble i -> bits 4i..4i+3
    words = np.bitwise_or.reduce(u << shifts, axis=2)                   # [N, K/8] uint32
    return words.view(np.int32)


def unpack_int4(qw: np.ndarray) -> np.ndarray:
    """Integers q in [-8, 7] (int8, [out, in]) of packed int32 words [out, in/8]."""
    qw = np.asarray(qw)
    if qw.dtype != np.int32 or qw.ndim != 2:
        raise Int4LayoutError(f"packed INT4 weights must be 2-D int32 [out, in/8], got {qw.dtype} {qw.shape}")
    words = qw.view(np.uint32)[:, :, None]                              # [N, K/8, 1], logical shifts
    shifts = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * NUM_BITS
    u = (words >> shifts) & np.uint32(0xF)                              # [N, K/8, 8]
    return (u.astype(np.int8) - 8).reshape(qw.shape[0], -1)             # [N, K]


def scales_as_float(sc: np.ndarray) -> np.ndarray:
    """Scale values as float32/float64; a uint16 array is read as raw bfloat16 bit patterns."""
    sc = np.asarray(sc)
    if sc.dtype == np.uint16:
        return bf16_to_float32(sc)
    if sc.dtype not in (np.float16, np.float32, np.float64):
        raise Int4LayoutError(f"INT4 scales must be bf16 bits (uint16), float16, float32 or float64, got {sc.dtype}")
    return sc


def dequantize_w4a16(qw: np.ndarray, sc: np.ndarray, shape: tuple[int, int],
                     dtype=np.float64) -> np.ndarray:
    """Exact dense W [out, in] = q * scale from qw int32 [out, in/8] and sc [out, in/group]."""
    shape = tuple(int(s) for s in shape)
    sc = scales_as_float(sc)
    if sc.ndim != 2 or sc.shape[0] != shape[0] or sc.shape[1] == 0 or shape[1] % sc.shape[1] != 0:
        raise Int4LayoutError(f"INT4 scales {tuple(sc.shape)} do not fit weight shape {shape}: "
                              f"expected [out, in/group_size] with group_size dividing in")
    group_size = shape[1] // sc.shape[1]
    _check_layout(shape, group_size)
    if tuple(qw.shape) != (shape[0], shape[1] // NIBBLES_PER_WORD):
        raise Int4LayoutError(f"packed INT4 weights {tuple(qw.shape)} do not fit weight shape {shape}: "
                              f"expected [{shape[0]}, {shape[1] // NIBBLES_PER_WORD}]")
    q = unpack_int4(qw).astype(dtype)                                   # [N, K]
    scale = np.repeat(sc.astype(dtype), group_size, axis=1)             # [N, K/g] -> [N, K]
    return q * scale                                                    # exact: 4 x 8 significant bits
