"""kdtr_format.bf16, the one bfloat16 rounding: ties to even, one rounding from float64 (the double-rounding
cases), subnormals, overflow, inf/NaN/-0, against an exact rational oracle for float64 input and torch's
float32 -> bfloat16 for float32 input; and every path in kdtr that stores or models a bf16 value rounds
the double-rounding case the same way."""
import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from kdtr_format.bf16 import QUIET_NAN, bf16_bits, bf16_round, bf16_to_float32, is_bf16

ULP1 = 2.0**-7                   # bfloat16 spacing at 1.0 (8 significant bits)
TINY = 2.0**-133                 # smallest bfloat16 subnormal
BF16_MAX = float(bf16_to_float32(np.uint16(0x7F7F)))
OVERFLOW = 2.0**128 - 2.0**119   # BF16_MAX + half its ULP: the tie between BF16_MAX and 2**128 (inf)


def oracle_bits(x: float) -> int:
    """bfloat16 bits of float64 x by exact rational arithmetic: the nearest multiple of x's quantum
    (8 significant bits, never finer than the subnormal step), half to even; inf past the range."""
    if math.isnan(x):
        return QUIET_NAN
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    if math.isinf(x) or x == 0:
        return sign | (0x7F80 if math.isinf(x) else 0)
    _, e = math.frexp(abs(x))                                    # |x| = m * 2**e, 0.5 <= m < 1
    quantum = Fraction(2) ** max(e - 8, -133)
    q = round(Fraction(abs(x)) / quantum)                        # Fraction rounds half to even
    v = q * quantum
    if v >= 2**128:
        return sign | 0x7F80
    return sign | struct.unpack("<I", struct.pack("<f", float(v)))[0] >> 16   # v is exact in float32


def torch_bits(x32: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def near_ties(rng, n: int) -> np.ndarray:
    """float64 values at and next to bf16 rounding ties, over the whole exponent range (subnormals too):
    the midpoint of two neighbours, and the midpoint moved by 1 float64 ULP and by amounts float32 drops."""
    bits = rng.integers(0, 0x7F7F, size=n, dtype=np.uint16)                 # finite positive bf16
    lo = bf16_to_float32(bits).astype(np.float64)
    hi = bf16_to_float32(bits + 1).astype(np.float64)
    mid = (lo + hi) / 2                                                      # exact in float64
    step = (hi - lo) * 2.0 ** -(rng.integers(20, 40, size=n))               # below float32's ULP there
    signs = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return np.concatenate([mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf), mid + step, mid - step]) \
        * np.tile(signs, 5)


def test_ties_round_to_even_from_float32_and_float64():
    for dtype in (np.float32, np.float64):
        x = np.array([1 + ULP1 / 2, 1 + 1.5 * ULP1, -(1 + ULP1 / 2), 1 + ULP1 / 2 + 2**-20,
                      TINY / 2, 1.5 * TINY, 2.5 * TINY], dtype)
        np.testing.assert_array_equal(bf16_round(x), np.array(
            [1.0, 1 + 2 * ULP1, -1.0, 1 + ULP1, 0.0, 2 * TINY, 2 * TINY], np.float32), err_msg=str(dtype))


def test_float64_rounds_once_never_through_float32():
    """1 + 2**-8 + 2**-30 lies above the tie 1 + 2**-8: it rounds up. float32 drops the 2**-30 and
    leaves exactly the tie, which rounds to even (1.0): the double-rounding error this module avoids.
    The mirror case lies below the tie 1 + 3 * 2**-8 and rounds down."""
    up, down = 1 + 2**-8 + 2**-30, 1 + 3 * 2**-8 - 2**-30
    assert float(np.float32(up)) == 1 + 2**-8 and float(np.float32(down)) == 1 + 3 * 2**-8   # the trap is real
    assert bf16_round(np.float32(up)) == 1.0 and bf16_round(np.float32(down)) == 1 + 2**-6   # via float32
    np.testing.assert_array_equal(bf16_round(np.array([up, down, -up])),
                                  np.array([1.0078125, 1 + ULP1, -1.0078125], np.float32))
    assert bf16_round(up) == 1.0078125                                                       # Python float


def test_float64_matches_the_exact_oracle_at_and_near_ties():
    rng = np.random.default_rng(0)
    x = np.concatenate([near_ties(rng, 3000),
                        rng.standard_normal(2000) * np.exp2(rng.integers(-140, 128, size=2000)),
                        [BF16_MAX, OVERFLOW, np.nextafter(OVERFLOW, 0), 2.0**128, 1e300, 1e-300, -1e-300,
                         TINY / 2, np.nextafter(TINY / 2, 1), 2.0**-126 - 2.0**-134, 2.0**-126]])
    got = bf16_bits(x)
    want = np.array([oracle_bits(float(v)) for v in x], np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} of {x.size} differ, e.g. x={x[bad[0]]!r}: {got[bad[0]]:#06x}, "
                           f"exact {want[bad[0]]:#06x}")


def test_float32_matches_torch():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, size=2000, dtype=np.uint32) << 16) | 0x8000      # low half exactly 0x8000
    words = np.concatenate([words, ties, ties - 1, ties + 1, np.arange(0, 2**17, 7, dtype=np.uint32),  # subnormals
                            np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x80000001,
                                      0x7F800000, 0xFF800000, 0x00000000, 0x80000000], np.uint32)])
    x = words.view(np.float32)
    x = x[~np.isnan(x)]                          # torch's NaN bits differ (0xFFFF on CPU); NaN: next test
    np.testing.assert_array_equal(bf16_bits(x), torch_bits(x))


def test_inf_nan_signed_zero_and_overflow():
    nans64 = np.array([0x7FF8000000000000, 0xFFF8000000000001, 0x7FF0000000000001], np.uint64).view(np.float64)
    nans32 = np.array([0x7FC00000, 0xFF800001, 0x7F800001], np.uint32).view(np.float32)
    for x in (nans64, nans32):
        assert bf16_bits(x).tolist() == [QUIET_NAN] * 3
    for dtype in (np.float32, np.float64):
        x = np.array([np.inf, -np.inf, -0.0, 0.0, BF16_MAX, -OVERFLOW], dtype)
        assert bf16_bits(x).tolist() == [0x7F80, 0xFF80, 0x8000, 0x0000, 0x7F7F, 0xFF80], dtype
    assert bf16_bits(np.array([np.nextafter(OVERFLOW, 0), 1e300, -1e-300])).tolist() == [0x7F7F, 0x7F80, 0x8000]


def test_float16_widens_exactly_and_widening_back_is_exact():
    h = np.arange(0, 2**16, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h)]
    np.testing.assert_array_equal(bf16_bits(h), bf16_bits(h.astype(np.float64)))
    bits = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16)
    finite = bits[np.isfinite(bf16_to_float32(bits))]
    np.testing.assert_array_equal(bf16_bits(bf16_to_float32(finite)), finite)                # every bf16 value


def test_is_bf16():
    assert is_bf16(np.array([1.0, -2**-133, np.inf, np.nan], np.float64))
    assert not is_bf16(np.array([1.0, 1 + 2**-30]))
    assert not is_bf16(np.float32(1 + 2**-10))


def test_every_bf16_path_in_kdtr_rounds_the_double_rounding_case_alike():
    """The drafter, the bf16 profile's weights, bf16-stored target weights, the metrics' bf16 ULPs and
    the INT4 scales each turn a float64 value into bfloat16: all through kdtr_format.bf16, so each gives
    1.0078125 for 1 + 2**-8 + 2**-30 (the drafter and the profile's weights went through float32 and gave 1.0)."""
    from conformance.gen.bundle_model import _bf16_round
    from conformance.metrics import _engine_bits
    from conformance.gen.bf16_profile import bf16_weights
    from kdtr_format.int4 import quantize_w4a16, scale_bits
    from refmodel.stored import _bf16_bits_by_rows

    x = np.array([[1 + 2**-8 + 2**-30]])
    want = np.float32(1.0078125)
    assert _bf16_round({"drafter.w": x})["drafter.w"][0, 0] == want
    assert bf16_weights({"w": x})["w"][0, 0] == want
    assert bf16_to_float32(_bf16_bits_by_rows(x))[0, 0] == want
    assert bf16_to_float32(_engine_bits(x, "bfloat16"))[0, 0] == want
    w = np.zeros((1, 32))
    w[0, 0] = 7.5 * x[0, 0]                                   # absmax / 7.5 is exactly x in float64
    _, sc = quantize_w4a16(w)
    assert sc[0, 0] == want and bf16_to_float32(scale_bits(sc))[0, 0] == want
    with pytest.raises(ValueError, match="INT4 scales stored as bfloat16 must be bfloat16 values already"):
        scale_bits(x)
