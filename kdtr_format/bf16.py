"""bfloat16 rounding: the one place in kdtr where a float becomes a bfloat16 (docs/kdtr-format.md, dtypes).

bfloat16 is the top half of an IEEE binary32: sign, the 8 exponent bits, 7 stored significand bits
(8 significant). Every producer of bfloat16 values in kdtr (stored weights, INT4 scales, the drafter,
the bf16 profile's reference, run dumps, metrics) rounds through `bf16_bits`:

- round to nearest, ties to even, in ONE rounding from the input's own precision. A float64 value is
  never rounded to float32 first: that is a second rounding, and it errs where the float32 result lands
  on a bf16 tie. 1 + 2**-8 + 2**-30 lies above the tie between 1 and 1 + 2**-7, so it rounds up to
  1.0078125; via float32 it becomes exactly the tie 1 + 2**-8 and then rounds to even, 1.0.
- float64 input is first narrowed to float32 *rounded to odd* (truncate toward zero, set the last bit
  when anything was dropped). float32 keeps 16 more bits than bfloat16 at every exponent, subnormals
  included, and a round-to-odd result with at least 2 extra bits rounds to nearest-even exactly as the
  float64 value would (Boldo and Melquiond, "When double rounding is odd", 2005). So float32 and
  float64 input share one round-to-nearest-even, on the float32 bits.
- IEEE overflow: a magnitude at or above the bf16 maximum plus half its ULP (2**128 - 2**119) becomes
  inf, as torch's float32 -> bfloat16 does. inf stays inf, -0 stays -0, subnormals round on the
  subnormal grid (step 2**-133). Every NaN becomes the quiet NaN 0x7FC0 (torch gives 0xFFFF on CPU:
  a NaN is a NaN to every consumer here). Saturating instead of overflowing is a caller's policy,
  written where it applies (INT4 scales: kdtr_format/int4.py).

Widening back (`bf16_to_float32`) is exact: the bits become the top half of a float32.
"""
import numpy as np

QUIET_NAN = 0x7FC0


def bf16_bits(x) -> np.ndarray:
    """Raw bfloat16 bit patterns (uint16) of float values, rounded to nearest, ties to even, once.

    float16 and float32 input round from float32 (float16 widens exactly); anything else is taken as
    float64 and rounds from float64 directly (see the module doc)."""
    x = np.asarray(x)
    f = x.astype(np.float32) if x.dtype in (np.float16, np.float32) else _float32_round_to_odd(x)
    u = f.view(np.uint32).astype(np.uint64)                # uint64: the +0x8000 never wraps
    rne = (u + 0x7FFF + ((u >> 16) & 1)) >> 16             # half of the dropped 16 bits, +1 if the kept lsb is odd
    return np.where(np.isnan(f), QUIET_NAN, rne).astype(np.uint16)


def bf16_to_float32(bits) -> np.ndarray:
    """Exact float32 values of raw bfloat16 bit patterns (uint16)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_round(x) -> np.ndarray:
    """float values rounded to the nearest bfloat16 (as `bf16_bits`), returned as float32 (exact)."""
    return bf16_to_float32(bf16_bits(x))


def is_bf16(x) -> bool:
    """Whether every value of x is a bfloat16 value already (NaN counts as one): storing x as
    bfloat16 loses nothing."""
    x = np.asarray(x, dtype=np.float64)                    # exact for float16/32/64
    back = bf16_round(x).astype(np.float64)
    return bool(np.all((back == x) | (np.isnan(back) & np.isnan(x))))


def _float32_round_to_odd(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd: an exact value stays; an inexact one is truncated toward zero
    and gets its last significand bit set (the sticky bit of everything dropped)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):     # beyond float32's range: inf, fixed below; NaN
        f = x.astype(np.float32)
    back = f.astype(np.float64)
    inexact = back != x                                    # NaN != NaN: harmless, NaN is replaced after
    bits = f.view(np.uint32).copy()
    away = inexact & (np.abs(back) > np.abs(x))            # rounded away from zero (inf included)
    bits[away] -= 1                                        # sign-magnitude: one step toward zero
    bits[inexact] |= 1
    return bits.view(np.float32)
