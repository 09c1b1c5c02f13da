"""kdtr_format.int4 against the compressed-tensors package itself: its pack/unpack, its
"pack-quantized" compressor and decompressor, and its minmax scales (bf16 scale dtype).
Every comparison is bit-exact; sizes are kept small so the whole file runs in a few seconds."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

from kdtr_format.bf16 import bf16_round
from kdtr_format.int4 import (Int4LayoutError, dequantize_w4a16, pack_int4, quantize_w4a16, scale_bits,
                              unpack_int4)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def ct_scheme(group_size: int) -> QuantizationScheme:
    """The K2.6 weight scheme (docs/int4.md §6), with bf16 scales as K2.6 stores them."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=group_size, scale_dtype=torch.bfloat16)
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_minmax_scale(w: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
    """compressed-tensors' own minmax group scales (what an observer hands the compressor)."""
    scale, _ = compute_dynamic_scales_and_zp(value=w, args=scheme.weights, module=torch.nn.Module())
    return scale


def ct_compress(w: torch.Tensor, scale: torch.Tensor, scheme: QuantizationScheme) -> dict:
    return PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)


def ct_decompress(qw: np.ndarray, sc: torch.Tensor, shape, shape_dtype, scheme) -> torch.Tensor:
    state = {"weight_packed": torch.from_numpy(qw.copy()), "weight_scale": sc,
             "weight_shape": torch.tensor(shape, dtype=shape_dtype)}
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"]


def awkward_weight(rng: np.random.Generator, out_dim: int, in_dim: int, group_size: int,
                   dtype) -> np.ndarray:
    """Gaussian weights with the awkward cases mixed in: all-zero groups, one-sign groups,
    huge and tiny magnitudes, exact ties at +-absmax."""
    w = rng.standard_normal((out_dim, in_dim)) * 10.0 ** rng.integers(-4, 3)
    groups = w.reshape(out_dim, in_dim // group_size, group_size)
    mask = rng.random(groups.shape[:2])
    groups[mask < 0.15] = 0.0                                        # all-zero groups
    groups[(mask >= 0.15) & (mask < 0.25)] = -np.abs(groups[(mask >= 0.15) & (mask < 0.25)])
    groups[(mask >= 0.25) & (mask < 0.30)] *= 1e30                   # huge
    groups[(mask >= 0.30) & (mask < 0.35)] *= 1e-30                  # tiny (scale near bf16 underflow)
    return w.astype(dtype)


shapes = st.tuples(st.integers(1, 9), st.integers(1, 6), st.sampled_from([8, 16, 32, 64, 128]))


def test_known_word_decodes_as_the_spec_says():
    word = np.array([[0x010448AD]], dtype=np.uint32).view(np.int32)
    assert unpack_int4(word).tolist() == [[5, 2, 0, -4, -4, -8, -7, -8]]
    assert pack_int4(np.array([[5, 2, 0, -4, -4, -8, -7, -8]])).view(np.uint32)[0, 0] == 0x010448AD
    ct = unpack_from_int32(torch.from_numpy(word.copy()), 4, torch.Size([1, 8]))
    assert ct.tolist() == [[5, 2, 0, -4, -4, -8, -7, -8]]


@SETTINGS
@given(out_dim=st.integers(1, 17), words=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_pack_and_unpack_equal_compressed_tensors(out_dim, words, seed):
    q = np.random.default_rng(seed).integers(-8, 8, size=(out_dim, 8 * words), dtype=np.int8)
    ours = pack_int4(q)
    theirs = pack_to_int32(torch.from_numpy(q), 4).numpy()
    assert ours.dtype == np.int32 and np.array_equal(ours, theirs), f"pack differs for {q.shape}"
    assert np.array_equal(unpack_int4(ours), q)
    back = unpack_from_int32(torch.from_numpy(ours.copy()), 4, torch.Size(q.shape)).numpy()
    assert np.array_equal(back, q)


@SETTINGS
@given(shape=shapes, dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**32 - 1))
def test_our_quantizer_equals_the_compressed_tensors_compressor(shape, dtype, seed):
    """Same packed words and same bf16 scales as CT's minmax + pack-quantized compressor."""
    out_dim, n_groups, group_size = shape
    w = awkward_weight(np.random.default_rng(seed), out_dim, n_groups * group_size, group_size, dtype)
    scheme = ct_scheme(group_size)
    wt = torch.from_numpy(w)
    ct = ct_compress(wt, ct_minmax_scale(wt, scheme), scheme)
    qw, sc = quantize_w4a16(w, group_size)
    case = f"shape={w.shape} group_size={group_size} dtype={np.dtype(dtype).name} seed={seed}"
    assert np.array_equal(sc, ct["weight_scale"].numpy().astype(np.float32)), f"scales differ: {case}"
    assert np.array_equal(qw, ct["weight_packed"].numpy()), f"packed words differ: {case}"
    assert ct["weight_shape"].tolist() == list(w.shape)


@SETTINGS
@given(shape=shapes, clip=st.sampled_from([1.0, 3.0, 1e6]), seed=st.integers(0, 2**32 - 1))
def test_compressed_tensors_output_reads_bit_exactly(shape, clip, seed):
    """CT packs with scales too small for the data (clip > 1 saturates codes at -8 / 7); our
    dequantizer reproduces CT's decompressor bit-exactly, for float32 and bf16 scale tensors."""
    out_dim, n_groups, group_size = shape
    w = awkward_weight(np.random.default_rng(seed), out_dim, n_groups * group_size, group_size, np.float32)
    scheme = ct_scheme(group_size)
    wt = torch.from_numpy(w)
    ct = ct_compress(wt * clip, ct_minmax_scale(wt, scheme), scheme)
    q = unpack_int4(ct["weight_packed"].numpy())
    if clip > 1 and np.abs(w).max() > 0:
        assert (q == -8).any() or (q == 7).any()
    sc32 = ct["weight_scale"]
    ours = dequantize_w4a16(ct["weight_packed"].numpy(), sc32.numpy(), w.shape)
    theirs = PackedQuantizationCompressor.decompress(ct, scheme)["weight"].numpy()
    assert np.array_equal(ours, theirs.astype(np.float64)), f"float32 scales: shape={w.shape} seed={seed}"
    # bf16 scales on disk (as K2.6): our uint16 bits path is exact; CT multiplies in bf16 and rounds.
    bits = scale_bits(sc32.numpy())
    ours_bits = dequantize_w4a16(ct["weight_packed"].numpy(), bits, w.shape)
    assert np.array_equal(ours_bits, ours)
    theirs_bf16 = ct_decompress(ct["weight_packed"].numpy(), sc32.to(torch.bfloat16), w.shape,
                                torch.int32, scheme).float().numpy()
    assert np.array_equal(bf16_round(ours), theirs_bf16.astype(np.float64))


@SETTINGS
@given(shape=shapes, shape_dtype=st.sampled_from([torch.int32, torch.int64]),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**32 - 1))
def test_our_output_reads_bit_exactly_in_compressed_tensors(shape, shape_dtype, dtype, seed):
    out_dim, n_groups, group_size = shape
    w = awkward_weight(np.random.default_rng(seed), out_dim, n_groups * group_size, group_size, dtype)
    qw, sc = quantize_w4a16(w, group_size)
    theirs = ct_decompress(qw, torch.from_numpy(sc), w.shape, shape_dtype, ct_scheme(group_size))
    assert np.array_equal(dequantize_w4a16(qw, sc, w.shape), theirs.numpy().astype(np.float64))


def test_quantization_error_is_at_most_half_a_step_and_extremes_use_all_codes():
    w = np.random.default_rng(0).standard_normal((64, 256))
    qw, sc = quantize_w4a16(w)
    err = np.abs(dequantize_w4a16(qw, sc, w.shape) - w).reshape(64, 8, 32).max(axis=2)
    # Half a step, plus what rounding the scale to bf16 (relative error <= 2**-8) costs at 7.5 steps.
    assert np.all(err <= sc * (0.5 + 7.5 * 2.0 ** -8)), f"max err/scale {(err / sc).max()}"
    q = unpack_int4(qw)
    assert q.min() == -8 and q.max() == 7
    assert set(np.unique(q)) == set(range(-8, 8))


def test_all_zero_group_gets_the_bf16_eps_scale_and_zero_codes():
    qw, sc = quantize_w4a16(np.zeros((2, 64)))
    assert np.all(sc == 2.0 ** -7) and np.all(qw == np.int32(0x88888888 - 2**32))
    assert np.all(dequantize_w4a16(qw, sc, (2, 64)) == 0.0)


@pytest.mark.parametrize("shape, group_size", [((4, 48), 32), ((4, 20), 4), ((3, 31), 31), ((64,), 32)])
def test_refuses_input_dims_that_do_not_fit(shape, group_size):
    with pytest.raises(Int4LayoutError, match=r"input dim to be a multiple of group_size=\d+ and of 8"
                       r"|must be 2-D"):
        quantize_w4a16(np.ones(shape), group_size)


def test_refusal_message_names_the_shape_and_the_fix():
    with pytest.raises(Int4LayoutError) as err:
        quantize_w4a16(np.ones((4, 48)), 32)
    assert str(err.value) == ("INT4 W4A16 needs the input dim to be a multiple of group_size=32 and of 8 "
                              "(8 nibbles per int32), got shape [out=4, in=48]; leave this weight "
                              "unquantized or choose a group_size that divides 48")


def test_dequantize_refuses_mismatched_tensors():
    qw, sc = quantize_w4a16(np.ones((4, 64)))
    with pytest.raises(Int4LayoutError, match=r"packed INT4 weights \(4, 8\) do not fit weight shape "
                                              r"\(4, 128\): expected \[4, 16\]"):
        dequantize_w4a16(qw, np.repeat(sc, 2, axis=1), (4, 128))
    with pytest.raises(Int4LayoutError, match=r"INT4 scales \(3, 2\) do not fit weight shape \(4, 64\)"):
        dequantize_w4a16(qw, sc[:3], (4, 64))
