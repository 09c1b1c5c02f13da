"""The host's copy of the device split (cuda_engine.ops.split3, kernels/tensor_core.cuh) held to torch's bf16
rounding, and the latent cache's row layout (kernels/kv_layout.cuh). CPU only: the GPU tests compare the device's
cache rows with these host rows bit for bit (test_cuda_kernels.py, test_mla_latent)."""
import numpy as np
import pytest
import torch

from cuda_engine.ops import join3, kv_pitch, kv_planes_shape, kv_rows_to_planes, split3


def bf16_round_bits(x: np.ndarray) -> np.ndarray:
    """torch's float32 -> bfloat16 conversion (round to nearest, ties to even), as the bf16's 16 bits."""
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy() \
        .view(np.uint16)


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def values(n: int, seed: int) -> np.ndarray:
    """float32 of both signs over the split's exact range 2^-110 .. 2^127, ties to even planted, zeros."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(1, 2, n) * np.exp2(rng.integers(-110, 127, n))).astype(np.float32)
    ties = widen((0x3F80 + rng.integers(0, 128, x[::7].size)).astype(np.uint16)) + np.float32(2.0 ** -8)
    x[::7] = ties * np.exp2(rng.integers(-100, 100, ties.size)).astype(np.float32)   # halfway between two bf16
    x[::11] = 0.0
    return np.where(rng.random(n) < 0.5, -x, x).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split3_terms_are_successive_bf16_roundings(seed):
    x = values(20000, seed)
    t = split3(x)
    assert t.shape == (3,) + x.shape and t.dtype == np.uint16
    np.testing.assert_array_equal(t[0], bf16_round_bits(x))                       # t0 = rn_bf16(x)
    r0 = x - widen(t[0])
    np.testing.assert_array_equal(t[1], bf16_round_bits(r0))                      # t1 = rn_bf16(x - t0)
    r1 = r0 - widen(t[1])
    np.testing.assert_array_equal(widen(t[2]), r1)                                # t2 = the rest, exact in bf16
    np.testing.assert_array_equal(join3(t), x)                                    # x = t0 + t1 + t2 exactly


def test_split3_ties_go_to_even():
    ones = np.float32([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8)])      # halfway: 1 | 1 + 2^-7 (even: 1)
    np.testing.assert_array_equal(widen(split3(ones)[0]), np.float32([1.0, 1 + 2 * 2.0 ** -7, -1.0]))


@pytest.mark.parametrize("C,R", [(1, 2), (17, 6), (64, 16), (512, 64), (33, 4)])
def test_cache_rows_are_padded_to_whole_pieces(C, R):
    Kp = kv_pitch(C, R)
    assert Kp % 8 == 0 and C + R <= Kp < C + R + 8
    rng = np.random.default_rng(C)
    ckv, kpe = rng.standard_normal((5, C)).astype(np.float32), rng.standard_normal((5, R)).astype(np.float32)
    planes = kv_rows_to_planes(ckv, kpe, rows=7)
    assert planes.shape == kv_planes_shape(7, C, R) == (3, 7, Kp)
    np.testing.assert_array_equal(join3(planes[:, :5, :C]), ckv)
    np.testing.assert_array_equal(join3(planes[:, :5, C:C + R]), kpe)
    assert not planes[:, :, C + R:].any() and not planes[:, 5:].any()          # padding and spare rows: zero


@pytest.mark.parametrize("shape,dtype,why", [
    ((2, 3, 8, 16), np.float32, "float32"),                    # a float32 cache: the old layout
    ((2, 8, 16), np.uint16, "(2, 8, 16)"),                     # one layer's planes, not the whole cache
    ((2, 2, 8, 16), np.uint16, "(2, 2, 8, 16)"),               # two planes
    ((2, 3, 8, 20), np.uint16, "multiple of 8"),               # rows not in whole 16-byte pieces
])
def test_a_cache_of_another_layout_is_refused_before_a_launch(shape, dtype, why):
    """The compactions move rows in 16-byte pieces of three term planes (kv_layout.cuh): anything else is a clear
    error naming what was given (checked on the host; no device needed)."""
    from cuda_engine.device import DevBuf
    from cuda_engine.ops import need_kv_cache

    with pytest.raises(ValueError, match="kv_compact: the cache must be bf16 terms") as e:
        need_kv_cache(DevBuf(shape, dtype, ptr=1), "kv_compact")     # a fake address: nothing is allocated or read
    assert why in str(e.value)
    need_kv_cache(DevBuf((2, 3, 8, 16), np.uint16, ptr=1), "kv_compact")   # the layout itself passes
