"""The fast W4A16 kernel (kernels/w4a16_mma.cu) against dequantize_w4a16 + float64 matmul, next to the plain
kernel (w4a16_plain.cu) on the same inputs: over awkward shapes (k not a multiple of the split, n = 8,
batch 1, 3, 17, 64) and the K2.6 expert shapes, the fast error is at most 2x the plain error (both measured
here; floor: one float32 ulp of the oracle's scale). The yardstick is judged too, at every case: the plain
kernel against the same float64 oracle within cuda_oracle.check's derived tolerance (FACTOR x the float32
NumPy baseline's error on the same inputs), so a plain-kernel bug at large K cannot widen the fast kernel's
allowance. Each case prints max / mean abs error and NMSE of both kernels and the baseline; KDTR_W4A16_ERRORS=FILE
appends them per case (JSON lines). GPU only: skipped cleanly without pycuda or a device."""
import json
import os

import numpy as np
import pytest

from cuda_oracle import check, gpu_ops, rand

pytestmark = pytest.mark.cuda
F32_EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def ops():
    return gpu_ops()


def dev(a, dtype=None):
    from cuda_engine.device import DevBuf

    return DevBuf.from_array(a, dtype)


def quantized(rng, N, K, g=32):
    from kdtr_format.int4 import dequantize_w4a16, quantize_w4a16, scale_bits

    qw, sc = quantize_w4a16(rng.standard_normal((N, K)) * K ** -0.5, g)
    return qw, scale_bits(sc), dequantize_w4a16(qw, sc, (N, K))


def _stats(got, oracle) -> dict:
    err = np.abs(np.asarray(got, np.float64) - oracle)
    return {"max": float(err.max()), "mean": float(err.mean()),
            "nmse": float(np.sum(err ** 2) / max(float(np.sum(oracle ** 2)), 1e-300))}


def errors(case: str, fast, plain, oracle, baseline) -> tuple[float, float]:
    """(fast, plain) max abs error vs the float64 oracle. Asserts, first, the plain kernel within check's derived
    tolerance of the oracle (`baseline`: the same math in float32 NumPy on the same inputs), then fast <= 2 x
    max(plain, 1 ulp of the scale)."""
    oracle = np.asarray(oracle, np.float64)
    st = {k: _stats(v, oracle) for k, v in (("fast", fast), ("plain", plain), ("numpy_fp32", baseline))}
    fe, pe = st["fast"]["max"], st["plain"]["max"]
    floor = F32_EPS * float(np.max(np.abs(oracle)))
    print(f"{case}: " + "; ".join(f"{k} max {v['max']:.3g} mean {v['mean']:.3g} NMSE {v['nmse']:.3g}"
                                  for k, v in st.items()))
    if os.environ.get("KDTR_W4A16_ERRORS"):
        with open(os.environ["KDTR_W4A16_ERRORS"], "a") as f:
            f.write(json.dumps({"case": case, "fast_err": fe, "plain_err": pe, "ulp_floor": floor, **{
                f"{k}_{m}": x for k, v in st.items() for m, x in v.items()}}) + "\n")
    check(f"{case}: plain kernel vs float64", plain, oracle, baseline)
    assert fe <= 2 * max(pe, floor), f"{case}: fast error {fe:.3g} > 2 x plain error {pe:.3g} (floor {floor:.3g})"
    return fe, pe


def swiglu_refs(x, Wg, Wu):
    """silu(Wg x) * (Wu x) for x [M, D]: (float64 oracle, float32 NumPy baseline)."""
    x64 = x.astype(np.float64)
    a, b = x64 @ Wg.T, x64 @ Wu.T
    a32, b32 = x @ Wg.astype(np.float32).T, x @ Wu.astype(np.float32).T
    return a / (1 + np.exp(-a)) * b, a32 / (np.float32(1) + np.exp(-a32)) * b32


def plain_linear(ops, x, qw, sc_bits):
    """The plain kernel as a linear layer: one expert, every token its own slot (w4a16_down_kernel)."""
    M, K = x.shape
    N = qw.shape[0]
    y = dev(np.zeros((M, N), np.float32))
    ops.w4a16_down(dev(x), dev(qw[None]), dev(sc_bits[None]), dev(np.zeros(M, np.int32)), y, M, 1)
    ops.stream.synchronize()
    return y.get()


def fast_linear(ops, x, packed, N, numerics="fp32", ks=None, rows=None):
    M, K = x.shape
    y = dev(np.zeros((M, N), np.float32))
    ops.w4a16_mma(dev(x), K, dev(packed[None]), N, y, N, M, numerics=numerics, ks=ks, rows=rows)
    ops.stream.synchronize()
    return y.get()


@pytest.mark.parametrize("N,K,M", [
    (8, 96, 1), (8, 96, 3),            # n = 8 (one m16 tile, mostly padding), k = 3 groups; one token: the int8
    (40, 224, 4),                      # digits path (8 digit columns); 2..4 tokens: bf16 terms as columns
    (40, 224, 17),                     # k = 7 groups: no split divides it evenly; batch 17 (3 token tiles)
    (72, 160, 8), (40, 224, 6),        # 5..8 tokens: 3 bf16 terms as columns over 2-3 column tiles (a token's
    (72, 160, 5),                      # terms straddle two tiles)
    (40, 224, 12),                     # 9..16 tokens: a column per token, 4 warps per row block
    (72, 160, 64),                     # batch 64 (the 8-tile kernel)
    (2048, 7168, 1), (2048, 7168, 3), (2048, 7168, 4), (2048, 7168, 8), (2048, 7168, 64),   # K2.6 expert gate
    (2048, 7168, 2), (2048, 7168, 12),  # 2 tokens; 9..16 tokens over many groups per split (staging segments)
    (7168, 2048, 1), (7168, 2048, 17),                    # K2.6 expert down
    (200, 32, 130),                    # one group; 130 tokens: three launches of <= 64
])
def test_fast_linear_within_2x_plain(ops, N, K, M):
    from cuda_engine.w4a16_pack import pack_linear

    rng = np.random.default_rng(N + K + M)
    qw, sc, W = quantized(rng, N, K)
    x = rand(rng, M, K)
    oracle = x.astype(np.float64) @ W.T
    packed, plain, base = pack_linear(qw, sc), plain_linear(ops, x, qw, sc), x @ W.astype(np.float32).T
    errors(f"linear {K}->{N} batch {M}", fast_linear(ops, x, packed, N), plain, oracle, base)
    if K // 32 >= 3 and N < 1024:                      # small shapes (one group per split by default): 2 uneven splits
        errors(f"linear {K}->{N} batch {M} 2 splits", fast_linear(ops, x, packed, N, ks=2), plain, oracle, base)
    if K == 7168 and M in (1, 2, 4):                   # unsplit, 224 groups: staging in segments (the int8 path's
        errors(f"linear {K}->{N} batch {M} unsplit", fast_linear(ops, x, packed, N, ks=1), plain, oracle, base)
        #                                                2 of 176 at one token; the bf16 terms' at 2 and 4)


@pytest.mark.parametrize("M", [1, 2, 4])
def test_wide_ranges(ops, M):
    """Wide-range activations, judged token by token within 2x the plain kernel's error: x spanning
    2^-66 .. 2^13 (an outlier next to tiny values), x around 1e-30 (its scale exceeds float32's largest power
    of two: applied in two factors); a zero token gives exact zeros; with 2 k splits too. One token runs the
    int8 digits path (scaled by its split's largest |x|), 2 and 4 tokens the bf16 terms. A non-finite x gives
    that token NaN outputs and leaves the other tokens as they were."""
    from cuda_engine.w4a16_pack import pack_linear

    rng = np.random.default_rng(40 + M)
    N, K = 96, 1024
    qw, sc, W = quantized(rng, N, K)
    x = rand(rng, M, K)
    x[0] *= np.exp2(rng.integers(-66, 0, K)).astype(np.float32)               # magnitudes over 66 octaves
    x[0, 5] = 8192.0
    if M > 1:
        x[1] = 0.0
    if M > 2:
        x[2] = (x[2] * np.float32(1e-30)).astype(np.float32)
    packed, oracle = pack_linear(qw, sc), x.astype(np.float64) @ W.T
    plain, base = plain_linear(ops, x, qw, sc), x @ W.astype(np.float32).T
    for ks in (None, 2):
        got = fast_linear(ops, x, packed, N, ks=ks)
        for t in range(M):
            if M > 1 and t == 1:
                np.testing.assert_array_equal(got[1], 0.0)
                continue
            errors(f"{'int8 digits' if M == 1 else 'bf16 terms'} wide ranges batch {M} splits {ks} token {t}", got[t:t + 1], plain[t:t + 1],
                   oracle[t:t + 1], base[t:t + 1])
    bad = x.copy()
    bad[0, 7] = np.nan if M % 2 else np.inf
    got = fast_linear(ops, bad, packed, N)
    assert np.isnan(got[0]).all()
    np.testing.assert_array_equal(got[1:], fast_linear(ops, x, packed, N)[1:])


@pytest.mark.parametrize("scale", ["1e-30", "subnormal", "zero", "inf"])
def test_int8_digits_path_extreme_scales(ops, scale):
    """One token (the int8 digits path), split and unsplit: x around 1e-30 (2^(62-E) and 2^(E-66) exceed
    float32's powers of two: each applied as two normal factors) and x of float32 subnormals only, within 2x
    the plain kernel's error; x = 0 gives exact zeros; an infinite x makes every output NaN."""
    from cuda_engine.w4a16_pack import pack_linear

    rng = np.random.default_rng(60)
    N, K = 96, 1024
    qw, sc, W = quantized(rng, N, K)
    x = rand(rng, 1, K)
    x = {"1e-30": x * np.float32(1e-30), "subnormal": x * np.float32(1e-40), "zero": np.zeros_like(x),
         "inf": np.where(np.arange(K) == 9, np.float32(np.inf), x)}[scale].astype(np.float32)
    packed = pack_linear(qw, sc)
    with np.errstate(invalid="ignore"):                    # (inf: 0 x inf in the oracles, never compared)
        plain, oracle, base = plain_linear(ops, x, qw, sc), x.astype(np.float64) @ W.T, x @ W.astype(np.float32).T
    for ks in (None, 2):
        got = fast_linear(ops, x, packed, N, ks=ks)
        if scale == "zero":
            np.testing.assert_array_equal(got, 0.0)
        elif scale == "inf":
            assert np.isnan(got).all()
        else:
            assert np.abs(got).max() > 0, f"{scale}: the outputs underflowed to zero"
            errors(f"int8 digits {scale} x, splits {ks}", got, plain, oracle, base)


@pytest.mark.parametrize("log2_outlier", [12, 20, 30])
def test_int8_digits_path_outlier_on_a_zero_weight_column(ops, log2_outlier):
    """One token, one split: x ~ N(0, 1) with x[0] = 2^12 .. 2^30 and every row's weight on column 0 zero
    (q = 0: no output sees the outlier). The digits are relative to the split's largest |x|, so the other terms
    keep all their bits only while 2^(62 - E) leaves them 24: eight digits (63 bits) cover a 2^38 range. With
    four digits (31 bits) a CPU re-creation measured 12-20x the plain kernel's error at 2^12; with eight,
    0.13-0.20x up to 2^30."""
    from cuda_engine.w4a16_pack import pack_linear
    from kdtr_format.int4 import dequantize_w4a16, quantize_w4a16, scale_bits

    rng = np.random.default_rng(12)
    N, K = 96, 1024
    w = rng.standard_normal((N, K)) * K ** -0.5
    w[:, 0] = 0.0
    qw, sc = quantize_w4a16(w, 32)
    W, sc = dequantize_w4a16(qw, sc, (N, K)), scale_bits(sc)
    assert not W[:, 0].any()
    x = rand(rng, 1, K)
    x[0, 0] = 2.0 ** log2_outlier
    errors(f"int8 digits outlier 2^{log2_outlier} on a zero-weight column, unsplit", fast_linear(ops, x, pack_linear(qw, sc), N, ks=1),
           plain_linear(ops, x, qw, sc), x.astype(np.float64) @ W.T, x @ W.astype(np.float32).T)


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_int8_entries_every_row_count(ops, rows):
    """The one-token entries differ only in how many blocks of 32 rows one block covers (w4a16_plan.w4a16_rows_plan
    picks by shape): each, on rows that end mid-block, split and unsplit; x staged from L2 in two segments
    (224 groups unsplit) and from the copy the exponent pass keeps in shared memory (7 groups); the fused
    gate+up; the MoE slot path (both launches, per-slot down input)."""
    from cuda_engine.w4a16_plan import W4A16_ROWS
    from cuda_engine.w4a16_pack import pack_experts, pack_experts_gate_up, pack_gate_up, pack_linear

    assert ops.w4a16_plan(7, 7, 1, None, 1, "fp32", rows)[0] == W4A16_ROWS[1][rows]    # rows= picks the entry
    rng = np.random.default_rng(50 + rows)
    for N, K, splits in ((200, 224, (None, 2, 1)), (520, 7168, (1, 5))):
        qw, sc, W = quantized(rng, N, K)
        x = rand(rng, 1, K)
        packed, plain, base = pack_linear(qw, sc), plain_linear(ops, x, qw, sc), x @ W.astype(np.float32).T
        for ks in splits:
            errors(f"int8 rows {rows}: linear {K}->{N} splits {ks}", fast_linear(ops, x, packed, N, ks=ks, rows=rows),
                   plain, x.astype(np.float64) @ W.T, base)
    I, D = 40, 224
    (qg, sg, Wg), (qu, su, Wu) = quantized(rng, I, D), quantized(rng, I, D)
    x = rand(rng, 1, D)
    act, plain = dev(np.zeros((1, I), np.float32)), dev(np.zeros((1, I), np.float32))
    ops.w4a16_mma(dev(x), D, dev(pack_gate_up(qg, sg, qu, su)[None]), I, act, I, 1, mode=1, rows=rows)
    ops.w4a16_gate_up(dev(x), dev(qg[None]), dev(sg[None]), dev(qu[None]), dev(su[None]), dev(np.zeros(1, np.int32)),
                      plain, 1, 1)
    ops.stream.synchronize()
    errors(f"int8 rows {rows}: gate+up {D}->2x{I}", act.get(), plain.get(), *swiglu_refs(x, Wg, Wu))
    E, I, D, S = 6, 64, 96, 3
    G, U, Dn = ([quantized(rng, *sh) for _ in range(E)] for sh in ((I, D), (I, D), (D, I)))
    st = lambda L, k: np.stack([t[k] for t in L])  # noqa: E731
    ids = dev(rng.permutation(E)[:S][None].astype(np.int32))
    x = rand(rng, 1, D)
    act_f, y_f, act_p, y_p = (dev(np.zeros(sh, np.float32)) for sh in ((S, I), (S, D), (S, I), (S, D)))
    gu, dn = dev(pack_experts_gate_up(st(G, 0), st(G, 1), st(U, 0), st(U, 1))), dev(pack_experts(st(Dn, 0), st(Dn, 1)))
    ops.w4a16_mma(dev(x), D, gu, I, act_f, I, mode=1, slot_ids=ids, T=1, S=S, nk=S, rows=rows)
    ops.w4a16_gate_up(dev(x), dev(st(G, 0)), dev(st(G, 1)), dev(st(U, 0)), dev(st(U, 1)), ids, act_p, 1, S)
    ops.stream.synchronize()
    a_f = act_f.get()
    ops.w4a16_mma(act_f, I, dn, D, y_f, D, slot_ids=ids, T=1, S=S, nk=S, x_by_slot=True, rows=rows)
    ops.w4a16_down(act_f, dev(st(Dn, 0)), dev(st(Dn, 1)), ids, y_p, 1, S)
    ops.stream.synchronize()
    ids_h = ids.get()[0]
    oracle = np.stack([Dn[e][2] @ a_f[k].astype(np.float64) for k, e in enumerate(ids_h)])
    base = np.stack([Dn[e][2].astype(np.float32) @ a_f[k] for k, e in enumerate(ids_h)])
    errors(f"int8 rows {rows}: MoE down over slots (fast gate+up's act)", y_f.get(), y_p.get(), oracle, base)
    refs = [swiglu_refs(x, G[e][2], U[e][2]) for e in ids_h]                  # [1, I] per slot
    errors(f"int8 rows {rows}: MoE gate+up over slots", a_f, act_p.get(), *(np.concatenate(r) for r in zip(*refs)))


@pytest.mark.parametrize("M,rows", [(M, r) for M in (2, 4, 5, 8) for r in (1, 2, 4)] + [(12, 2), (12, 4), (16, 2), (16, 4)])
def test_bf16_terms_entries_every_row_count(ops, M, rows):
    """2..16 tokens (the bf16 terms; as columns up to 8 tokens, a column per token above): the entries differ
    only in how many blocks of 32 rows one block covers (w4a16_plan.w4a16_rows_plan picks by shape). Each, at a full
    and a padded token count of its family (2; 4, 5; 8; 12, 16): rows that end mid-block, split and unsplit;
    224 groups unsplit (x staged in segments of whole batches: 32-44 groups at 5 tokens, 12-14 at 16); the
    fused gate+up."""
    from cuda_engine.w4a16_plan import W4A16_ROWS
    from cuda_engine.w4a16_pack import pack_gate_up, pack_linear

    family = W4A16_ROWS[next(m for m in W4A16_ROWS if m >= M)]
    assert ops.w4a16_plan(7, 7, 1, None, M, "fp32", rows)[0] == family[rows]    # rows= picks the entry
    rng = np.random.default_rng(70 + 10 * M + rows)
    for N, K, splits in ((200, 224, (None, 2, 1)), (520, 7168, (1, 5))):
        qw, sc, W = quantized(rng, N, K)
        x = rand(rng, M, K)
        packed, plain, base = pack_linear(qw, sc), plain_linear(ops, x, qw, sc), x @ W.astype(np.float32).T
        for ks in splits:
            errors(f"bf16 terms rows {rows}: linear {K}->{N} batch {M} splits {ks}",
                   fast_linear(ops, x, packed, N, ks=ks, rows=rows), plain, x.astype(np.float64) @ W.T, base)
    I, D = 40, 224
    (qg, sg, Wg), (qu, su, Wu) = quantized(rng, I, D), quantized(rng, I, D)
    x = rand(rng, M, D)
    act, plain = dev(np.zeros((M, I), np.float32)), dev(np.zeros((M, I), np.float32))
    ops.w4a16_mma(dev(x), D, dev(pack_gate_up(qg, sg, qu, su)[None]), I, act, I, M, mode=1, rows=rows)
    ops.w4a16_gate_up(dev(x), dev(qg[None]), dev(sg[None]), dev(qu[None]), dev(su[None]), dev(np.zeros(M, np.int32)),
                      plain, M, 1)
    ops.stream.synchronize()
    errors(f"bf16 terms rows {rows}: gate+up {D}->2x{I} batch {M}", act.get(), plain.get(), *swiglu_refs(x, Wg, Wu))


@pytest.mark.parametrize("I,D,M,ks", [(2048, 7168, 1, None), (2048, 7168, 16, None), (24, 96, 3, None),
                                      (2048, 7168, 4, 1), (2048, 7168, 1, 1)])
def test_fast_gate_up_within_2x_plain(ops, I, D, M, ks):
    # K2.6 fused gate+up 7168 -> 4096; the unsplit cases stage x in segments with the SwiGLU epilogue (the int8
    # path at one token, the bf16 terms at 4)
    """Mode 1: silu(Wg x) * (Wu x) from one launch on the interleaved gate+up (7168 -> 2 x 2048 at K2.6)."""
    from cuda_engine.w4a16_pack import pack_gate_up

    rng = np.random.default_rng(I + D + M)
    (qg, sg, Wg), (qu, su, Wu) = quantized(rng, I, D), quantized(rng, I, D)
    x = rand(rng, M, D)
    act = dev(np.zeros((M, I), np.float32))
    ops.w4a16_mma(dev(x), D, dev(pack_gate_up(qg, sg, qu, su)[None]), I, act, I, M, mode=1, ks=ks)
    plain = dev(np.zeros((M, I), np.float32))
    ops.w4a16_gate_up(dev(x), dev(qg[None]), dev(sg[None]), dev(qu[None]), dev(su[None]), dev(np.zeros(M, np.int32)),
                      plain, M, 1)
    ops.stream.synchronize()
    errors(f"gate+up {D}->2x{I} batch {M}" + (f" {ks} split" if ks else ""), act.get(), plain.get(),
           *swiglu_refs(x, Wg, Wu))


@pytest.mark.parametrize("E,I,D,K,T", [(6, 64, 96, 3, 1), (5, 32, 192, 4, 2), (4, 2048, 7168, 2, 1),
                                       (4, 2048, 7168, 4, 4)])
def test_fused_moe_slots_within_2x_plain(ops, E, I, D, K, T):
    """The engine's fused MoE decode path: one launch for the selected experts' gate+up, one for their down,
    over (token, slot) pairs with per-slot expert ids, against the plain kernels on the same slots. At K2.6
    shapes with 16 (token, slot) pairs the launches take w4a16_plan.w4a16_rows_plan's many-row regime (8 row blocks
    per block; the gate+up in 3 splits), the one the one-token MoE layer runs; with 2 pairs its single-weight
    regime."""
    from cuda_engine.w4a16_pack import pack_experts, pack_experts_gate_up

    rng = np.random.default_rng(E * I + D)
    G, U, Dn = ([quantized(rng, *s) for _ in range(E)] for s in ((I, D), (I, D), (D, I)))
    st = lambda L, k: np.stack([t[k] for t in L])  # noqa: E731
    S = K
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    x = rand(rng, T, D)
    ids_d = dev(ids)
    act_f, act_p = dev(np.zeros((T * S, I), np.float32)), dev(np.zeros((T * S, I), np.float32))
    y_f, y_p = dev(np.zeros((T * S, D), np.float32)), dev(np.zeros((T * S, D), np.float32))
    gu, dn = dev(pack_experts_gate_up(st(G, 0), st(G, 1), st(U, 0), st(U, 1))), dev(pack_experts(st(Dn, 0), st(Dn, 1)))
    ops.w4a16_mma(dev(x), D, gu, I, act_f, I, mode=1, slot_ids=ids_d, T=T, S=S, nk=K)
    ops.w4a16_mma(act_f, I, dn, D, y_f, D, slot_ids=ids_d, T=T, S=S, nk=K, x_by_slot=True)
    ops.w4a16_gate_up(dev(x), dev(st(G, 0)), dev(st(G, 1)), dev(st(U, 0)), dev(st(U, 1)), ids_d, act_p, T, S)
    ops.w4a16_down(act_p, dev(st(Dn, 0)), dev(st(Dn, 1)), ids_d, y_p, T, S)
    ops.stream.synchronize()
    oracle, baseline = np.zeros((T * S, D)), np.zeros((T * S, D), np.float32)
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            for out, dt in ((oracle, np.float64), (baseline, np.float32)):      # float64 truth, float32 NumPy
                xt = x[t].astype(dt)
                a, b = G[e][2].astype(dt) @ xt, U[e][2].astype(dt) @ xt
                out[t * S + k] = Dn[e][2].astype(dt) @ (a / (dt(1) + np.exp(-a)) * b)
    errors(f"fused MoE E={E} I={I} D={D} K={K} T={T}", y_f.get(), y_p.get(), oracle, baseline)


def test_bf16_numerics_are_marlins(ops):
    """numerics="bf16": one mma on x rounded to bf16 (Marlin's numerics). Bit for bit the fp32 mode run on
    bf16_round(x) (whose x2 and x3 terms are zero), so it is exactly the fast kernel on bf16 activations; and
    farther from the float32 activations' product than the fp32 mode (the three terms matter)."""
    from cuda_engine.w4a16_pack import pack_linear
    from kdtr_format.bf16 import bf16_round

    rng = np.random.default_rng(3)
    N, K, M = 512, 2048, 6                                 # (from 5 tokens fp32 mode runs the bf16 terms path)
    qw, sc, W = quantized(rng, N, K)
    x = rand(rng, M, K)
    packed = pack_linear(qw, sc)
    got = fast_linear(ops, x, packed, N, "bf16")
    np.testing.assert_array_equal(got, fast_linear(ops, bf16_round(x).astype(np.float32), packed, N, "fp32"))
    exact = x.astype(np.float64) @ W.T
    e_bf16 = np.max(np.abs(got - exact))
    e_fp32 = np.max(np.abs(fast_linear(ops, x, packed, N, "fp32") - exact))
    assert e_fp32 < e_bf16, f"fp32 mode error {e_fp32:.3g} is not below the bf16 mode's {e_bf16:.3g}"


def test_split_k_is_deterministic_and_agrees(ops):
    """The same launch twice gives the same bits (partials summed in split order by the last block); with one
    split and with 16 the error stays within 2x the plain kernel's."""
    from cuda_engine.w4a16_pack import pack_linear

    rng = np.random.default_rng(4)
    N, K, M = 1000, 4096, 5
    qw, sc, W = quantized(rng, N, K)
    x = rand(rng, M, K)
    packed = pack_linear(qw, sc)
    a, b = fast_linear(ops, x, packed, N, ks=16), fast_linear(ops, x, packed, N, ks=16)
    np.testing.assert_array_equal(a, b)
    exact, plain = x.astype(np.float64) @ W.T, plain_linear(ops, x, qw, sc)
    base = x @ W.astype(np.float32).T
    errors("split-K 16: 4096->1000 batch 5", a, plain, exact, base)
    errors("split-K 1: 4096->1000 batch 5", fast_linear(ops, x, packed, N, ks=1),
           plain, exact, base)
