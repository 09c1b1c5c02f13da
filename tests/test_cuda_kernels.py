"""Every kernel against its NumPy oracle, over awkward shapes (1, primes, tile +-1) and K2.6 shapes.

Tolerances: tests/cuda_oracle.py (a small multiple of the fp32-NumPy-vs-float64 error); gathers, copies,
expert ids and argmax are exact. GPU only: skipped cleanly without pycuda or a device.
"""
import numpy as np
import pytest

from refmodel.config import PRESETS
from refmodel.model import apply_rope, rms_norm, route, rope_cos_sin, silu, softmax, yarn_inv_freq
from cuda_engine.ops import LMMA_FEW_ROWS, kv_planes_shape, kv_rows_to_planes, p_terms_shape
from cuda_oracle import check, gpu_ops, rand

pytestmark = pytest.mark.cuda
K26 = PRESETS["k26"]
TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def ops():
    return gpu_ops()


def dev(a, dtype=None):
    from cuda_engine.device import DevBuf

    return DevBuf.from_array(a, dtype)


def run(ops, fn, *args, **kw):
    fn(*args, **kw)
    ops.stream.synchronize()


# ---------------------------------------------------------------- embedding, norms, linear

@pytest.mark.parametrize("V,D,T", [(1, 1, 1), (37, 193, 5), (2048, 7168, 3)])   # last: K2.6 hidden
def test_embedding_exact_then_norm(ops, V, D, T):
    rng = np.random.default_rng(V)
    table, ids, w = rand(rng, V, D), rng.integers(0, V, T).astype(np.int32), rand(rng, D) + 1
    out, y = dev(np.zeros((T, D), np.float32)), dev(np.zeros((T, D), np.float32))
    run(ops, ops.embedding, dev(ids), dev(table), out, T, dev(w), y, 1e-5)
    np.testing.assert_array_equal(out.get(), table[ids])
    check(f"embedding norm V={V} D={D}", y.get(), rms_norm(table[ids].astype(np.float64), w.astype(np.float64), 1e-5),
          rms_norm(table[ids], w, np.float32(1e-5)))


# n: 1, primes, block size 256 +- 1, K2.6 hidden / q_lora / kv_lora
@pytest.mark.parametrize("n,T", [(1, 1), (7, 3), (255, 2), (256, 1), (257, 4), (7168, 2), (1536, 1), (512, 3)])
def test_rms_norm(ops, n, T):
    rng = np.random.default_rng(n)
    x, w = rand(rng, T, n), rand(rng, n) + 1
    y = dev(np.zeros((T, n), np.float32))
    run(ops, ops.rms_norm, dev(x), n, dev(w), y, n, n, T, 1e-5)
    check(f"rms_norm n={n} T={T}", y.get(), rms_norm(x.astype(np.float64), w.astype(np.float64), 1e-5),
          rms_norm(x, w, np.float32(1e-5)))


@pytest.mark.parametrize("n,T", [(1, 1), (257, 3), (7168, 2)])
def test_add_rms_norm(ops, n, T):
    rng = np.random.default_rng(n + 1)
    h, a, w = rand(rng, T, n), rand(rng, T, n), rand(rng, n) + 1
    h_out, y = dev(np.zeros((T, n), np.float32)), dev(np.zeros((T, n), np.float32))
    run(ops, ops.add_rms_norm, dev(h), dev(a), h_out, dev(w), y, T, 1e-5)
    np.testing.assert_array_equal(h_out.get(), h + a)
    s64 = h.astype(np.float64) + a
    check(f"add_rms_norm n={n}", y.get(), rms_norm(s64, w.astype(np.float64), 1e-5), rms_norm(h + a, w, np.float32(1e-5)))


LINEAR = [(1, 1, 1), (3, 31, 17), (2, 257, 9), (5, 33, 8), (4, 64, 7),                # awkward: warps 8 +- 1
          (1, 7168, 1536), (1, 1536, 64 * 192), (1, 7168, 576), (1, 64 * 128, 7168),  # K2.6 attention
          (1, 7168, 384), (3, 7168, 2048), (1, 2048, 7168)]                            # router, expert shapes


@pytest.mark.parametrize("T,I,O", LINEAR)
def test_linear(ops, T, I, O):
    rng = np.random.default_rng(T * I + O)
    x, W = rand(rng, T, I), rand(rng, O, I, scale=I ** -0.5)
    y = dev(np.zeros((T, O), np.float32))
    run(ops, ops.linear, dev(x), dev(W), y, T, I, O)
    check(f"linear T={T} I={I} O={O}", y.get(), x.astype(np.float64) @ W.astype(np.float64).T, x @ W.T)


@pytest.mark.parametrize("T,I,O", [(2, 31, 17), (8, 64, 7), (9, 257, 9), (17, 7168, 64), (33, 1536, 200)])
def test_linear_rows_are_the_one_row_bits(ops, T, I, O):
    """T >= 2 with float32 weights runs linear_rows_kernel (several rows per warp, W read once per row block; bf16
    weights: test_linear_mma_bf16); every row is the
    bits the one-row kernel gives it (T = 1 per row), not merely within tolerance: row blocks of 8, a last
    block of 1 (T = 9, 17, 33), fewer outputs than a block's warps."""
    rng = np.random.default_rng(T * 7 + I)
    x, W = rand(rng, T, I), rand(rng, O, I, scale=I ** -0.5)
    dW, y = dev(W), dev(np.zeros((T, O), np.float32))
    run(ops, ops.linear, dev(x), dW, y, T, I, O)
    rows = []
    for t in range(T):
        yt = dev(np.zeros((1, O), np.float32))
        run(ops, ops.linear, dev(x[t:t + 1]), dW, yt, 1, I, O)
        rows.append(yt.get()[0])
    np.testing.assert_array_equal(y.get(), np.stack(rows))
    check(f"linear rows T={T} I={I} O={O}", y.get(), x.astype(np.float64) @ W.astype(np.float64).T, x @ W.T)


@pytest.mark.parametrize("T,B,I,O,spread", [
    (2, 1, 1, 1, 0), (3, 1, 31, 17, 0), (5, 1, 37, 193, 0), (16, 1, 64, 33, 0), (17, 1, 257, 65, 0),
    (2, 3, 40, 9, 0),                                              # batched, a head stride wider than I
    (5, 1, 7168, 2112, 0), (5, 1, 64 * 128, 7168, 0), (33, 1, 1536, 64 * 192, 0), (64, 1, 7168, 384, 0),  # K2.6
    (9, 1, 7168, 96, 30),                                          # x over 2^+-30: the three terms' exponents
])
def test_linear_mma_bf16(ops, T, B, I, O, spread):
    """T >= 2 rows with bf16 weights run linear_mma_bf16_kernel (tensor cores, x split into three bf16 terms; 2 ..
    LMMA_FEW_ROWS rows its few-rows instance):
    within the fp32 bound of the float64 product of the same values, the same bits on a second launch. Shapes:
    a single element, I not a multiple of 8 (the unaligned loads), row blocks of 16 plus one, outputs past a
    block of 32, K2.6's projections, x spanning 60 binades."""
    from kdtr_format.bf16 import bf16_bits, bf16_to_float32

    rng = np.random.default_rng(T * I + O)
    x = rand(rng, T, B, I + 3)
    if spread:
        x *= np.exp2(rng.integers(-spread, spread + 1, x.shape)).astype(np.float32)
    W16 = bf16_bits(rand(rng, B, O, I, scale=I ** -0.5))
    W = bf16_to_float32(W16)
    y = dev(np.zeros((T, B, O), np.float32))
    args = (dev(x), dev(W16), y, T, I, O)
    kw = dict(x_stride=B * (I + 3), y_stride=B * O, B=B, x_bstride=I + 3, w_bstride=O * I, y_bstride=O)
    name = "linear_mma_bf16_few_kernel" if T <= LMMA_FEW_ROWS else "linear_mma_bf16_kernel"
    before = ops.ran.get(name, 0)
    run(ops, ops.linear, *args, **kw)
    assert ops.ran.get(name, 0) == before + 1
    first = y.get()
    run(ops, ops.linear, *args, **kw)
    np.testing.assert_array_equal(y.get(), first)
    x64 = x[..., :I].astype(np.float64)
    oracle = np.einsum("tbi,boi->tbo", x64, W.astype(np.float64))
    check(f"linear mma bf16 T={T} B={B} I={I} O={O}", first, oracle, np.einsum("tbi,boi->tbo", x[..., :I], W))
    # and per element, within the worst-case bound of a float32 sum of I exact products, n u sum |x W| with the
    # tensor cores' truncating unit u = 2^-23 and n = I additions plus 64 (an mma aligns its 16 products and its
    # accumulator before it adds, twice per 32-k step, 34 chained; then the 8 warps' sum): small outputs beside
    # large ones are held too, which the max-abs check above is not
    bound = (I + 64) * 2.0**-23 * np.einsum("tbi,boi->tbo", np.abs(x64), np.abs(W.astype(np.float64)))
    err = np.abs(first - oracle)
    assert (err <= bound).all(), f"max err / bound {np.max(err / np.maximum(bound, 1e-300)):.3g}"


@pytest.mark.parametrize("T,B,I,O,spread", [(2, 1, 37, 17, 0), (5, 1, 7168, 2112, 0), (8, 1, 64 * 128, 7168, 0),
                                            (5, 1, 7168, 384, 0), (3, 3, 40, 33, 0), (6, 1, 300, 50, 30)])
def test_linear_mma_few_rows_are_the_full_tiles_bits(ops, T, B, I, O, spread):
    """2 .. LMMA_FEW_ROWS rows run linear_mma_bf16_few_kernel (16 outputs x 8 rows a block); the same rows as the
    first of LMMA_FEW_ROWS + 1 run linear_mma_bf16_kernel (32 x 16), and each row comes out the same bits in both
    (kernels/linear.cu: every output's sum runs the same steps in both), not merely within tolerance. Shapes: I
    not a multiple of 8, K2.6's qkv_a, o_proj and router gate, batched with a head stride wider than I, x over
    2^+-30 (the three terms' exponents)."""
    from kdtr_format.bf16 import bf16_bits

    assert T <= LMMA_FEW_ROWS
    rng = np.random.default_rng(T + I + O)
    x = rand(rng, LMMA_FEW_ROWS + 1, B, I + 3)
    if spread:
        x *= np.exp2(rng.integers(-spread, spread + 1, x.shape)).astype(np.float32)
    dW = dev(bf16_bits(rand(rng, B, O, I, scale=I ** -0.5)))
    few, full = dev(np.zeros((T, B, O), np.float32)), dev(np.zeros((LMMA_FEW_ROWS + 1, B, O), np.float32))
    kw = dict(x_stride=B * (I + 3), y_stride=B * O, B=B, x_bstride=I + 3, w_bstride=O * I, y_bstride=O)
    ran = {n: ops.ran.get(n, 0) for n in ("linear_mma_bf16_few_kernel", "linear_mma_bf16_kernel")}
    run(ops, ops.linear, dev(x[:T]), dW, few, T, I, O, **kw)
    run(ops, ops.linear, dev(x), dW, full, LMMA_FEW_ROWS + 1, I, O, **kw)
    assert {n: ops.ran.get(n, 0) - c for n, c in ran.items()} == {n: 1 for n in ran}
    np.testing.assert_array_equal(few.get(), full.get()[:T])


def test_rewritten_bf16_weights_are_read_anew_and_their_bounds_kept(ops):
    """The tiled copy never holds other values than its weights: after W.set (and W.copy_from, and a write through a
    view of a stacked W) a linear of 2 or more rows multiplies by the new weights, the bits of a buffer that never
    held the old ones, and the copy is rewritten in place, so a graph captured before the write reads the new values
    too. A view cannot keep a tiled copy and is refused; so is a batch that would read past the weights, on every
    path (one row, several, float32 and bf16), before anything is tiled."""
    from cuda_engine.device import CudaEngineError
    from cuda_engine.graph import capture
    from kdtr_format.bf16 import bf16_bits

    T, I, O = 5, 70, 33
    rng = np.random.default_rng(11)
    x = dev(rand(rng, T, I))
    old, new = bf16_bits(rand(rng, O, I)), bf16_bits(rand(rng, O, I))
    W, fresh = dev(old), dev(new)
    y, want = dev(np.zeros((T, O), np.float32)), dev(np.zeros((T, O), np.float32))
    run(ops, ops.linear, x, W, y, T, I, O)                       # makes W's tiled copy of the old values
    assert W.tiled is not None
    tiled_at = W.tiled.ptr
    graph = capture(ops, lambda: ops.linear(x, W, y, T, I, O))  # captured before the write: keeps W.tiled's pointer
    run(ops, ops.linear, x, fresh, want, T, I, O)
    W.set(new)
    assert W.tiled.ptr == tiled_at                               # rewritten in place, not dropped and freed
    run(ops, ops.linear, x, W, y, T, I, O)
    np.testing.assert_array_equal(y.get(), want.get())
    y.set(np.full((T, O), np.nan, np.float32))
    graph.launch(ops.stream)
    ops.stream.synchronize()
    np.testing.assert_array_equal(y.get(), want.get(), err_msg="the graph captured before the write")
    graph.destroy()
    W.copy_from(dev(old))
    run(ops, ops.linear, x, W, y, T, I, O)
    run(ops, ops.linear, x, dev(old), want, T, I, O)
    np.testing.assert_array_equal(y.get(), want.get())
    stack = dev(np.stack([old, new]))
    yb, wantb = (dev(np.zeros((2, T, O), np.float32)) for _ in range(2))
    run(ops, ops.linear, x, stack, yb, T, I, O, B=2, w_bstride=O * I, y_bstride=T * O)     # tiles the stack
    stack.view(1).set(old)                                       # a write through a view rewrites the base's copy
    run(ops, ops.linear, x, stack, yb, T, I, O, B=2, w_bstride=O * I, y_bstride=T * O)
    run(ops, ops.linear, x, dev(np.stack([old, old])), wantb, T, I, O, B=2, w_bstride=O * I, y_bstride=T * O)
    np.testing.assert_array_equal(yb.get(), wantb.get(), err_msg="written through a view")
    with pytest.raises(CudaEngineError, match="view"):
        ops.linear(x, stack.view(1), y, T, I, O)
    untiled = dev(old)
    for rows, weights in ((T, stack), (1, stack), (T, dev(rand(rng, 2, O, I))), (1, dev(rand(rng, 2, O, I)))):
        with pytest.raises(ValueError, match=f"past the {2 * O * I} they hold"):   # (ValueError: ops' checks)
            ops.linear(x, weights, y, rows, I, O, B=3, w_bstride=O * I)
    with pytest.raises(ValueError, match=f"past the {O * I} they hold"):
        ops.linear(x, untiled, y, T, I, O, B=2, w_bstride=O * I)
    with pytest.raises(ValueError, match=r"batch B=0: pass B >= 1"):
        ops.linear(x, untiled, y, T, I, O, B=0)
    with pytest.raises(ValueError, match=r"w_bstride -1 < 0: pass the distance"):
        ops.linear(x, untiled, y, T, I, O, B=2, w_bstride=-1)
    assert untiled.tiled is None                                 # refused before its tiled copy was made
    assert W.owns and not stack.view(0).owns


@pytest.mark.parametrize("T,B,I,O", [(1, 1, 1, 1), (3, 5, 17, 9), (1, 64, 128, 512), (2, 64, 512, 128),
                                     (9, 4, 33, 17)])
def test_linear_batched_heads(ops, T, B, I, O):
    """The absorbed-MLA use: x [T, B, I] strided per head, W [B, O, I], y [T, B, O]."""
    rng = np.random.default_rng(B * I)
    x, W = rand(rng, T, B, I + 3), rand(rng, B, O, I)            # +3: a head stride wider than I
    y = dev(np.zeros((T, B, O), np.float32))
    run(ops, ops.linear, dev(x), dev(W), y, T, I, O, x_stride=B * (I + 3), y_stride=B * O, B=B,
        x_bstride=I + 3, w_bstride=O * I, y_bstride=O)
    x64 = x[..., :I].astype(np.float64)
    check(f"batched linear T={T} B={B}", y.get(), np.einsum("tbi,boi->tbo", x64, W.astype(np.float64)),
          np.einsum("tbi,boi->tbo", x[..., :I], W))


# ---------------------------------------------------------------- latents: norms, k rope, cache append

@pytest.mark.parametrize("cfg_name,positions,S0", [
    ("tiny", [0], 0), ("tiny", [1, 2, 7], 5), ("k26", [5, 4096], 300),
    ("k26", [2**17, 2**17 + 1, 262143], 2),        # past 2^17: float32 angles would be off by ~1e-2 rad
])
def test_mla_latent(ops, cfg_name, positions, S0):
    cfg = PRESETS[cfg_name]
    Q, C, R, T = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, len(positions)
    rng = np.random.default_rng(T + C)
    qkv, w_q, w_kv = rand(rng, T, Q + C + R), rand(rng, Q) + 1, rand(rng, C) + 1
    S_cap = S0 + T + 2
    ckv, kpe = rand(rng, S_cap, C), rand(rng, S_cap, R)
    kv = kv_rows_to_planes(ckv, kpe)
    qkv_d, cq, lat, kv_d = dev(qkv), dev(np.zeros((T, Q), np.float32)), dev(np.zeros((T, C), np.float32)), dev(kv)
    pos = np.asarray(positions, np.int64)
    run(ops, ops.mla_latent, qkv_d, T, Q, C, R, dev(w_q), dev(w_kv), 1e-6, cq, lat, kv_d,
        dev(np.array([S0, 0, 0, 0], np.int32)), dev(pos, np.int32), dev(yarn_inv_freq(cfg)), cfg.rope_attention_factor)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    case = f"mla_latent {cfg_name} pos={positions}"
    check(case + " c_q", cq.get(), rms_norm(f64(qkv[:, :Q]), f64(w_q), 1e-6), rms_norm(qkv[:, :Q], w_q, np.float32(1e-6)))
    check(case + " c_kv", lat.get(), rms_norm(f64(qkv[:, Q:Q + C]), f64(w_kv), 1e-6),
          rms_norm(qkv[:, Q:Q + C], w_kv, np.float32(1e-6)))
    cos, sin = rope_cos_sin(cfg, pos)
    c32, s32 = rope_cos_sin(cfg, pos, np.float32)
    got = qkv_d.get()
    np.testing.assert_array_equal(got[:, :Q + C], qkv[:, :Q + C])      # only the rope part changes in place
    check(case + " k_pe", got[:, Q + C:], apply_rope(f64(qkv[:, Q + C:]), cos, sin), apply_rope(qkv[:, Q + C:], c32, s32))
    # appended at rows meta[0] + t as the bf16 terms of the tapped values, bit for bit (the host's split3 is the
    # device's: tests/test_cuda_kv_terms.py holds it to torch's bf16 rounding); the other rows and the padding kept
    kv[:, S0:S0 + T] = kv_rows_to_planes(lat.get(), got[:, Q + C:])
    np.testing.assert_array_equal(kv_d.get(), kv)


# ---------------------------------------------------------------- attention

def attention_oracle(q, w_uk, w_uv, ckv, kpe, mask, scale, N):
    """Absorbed MLA as refmodel.mla writes it: q [T, H, N + R] -> o [T, H, U]."""
    q_lat = np.einsum("thn,hnc->thc", q[..., :N], w_uk)
    scores = np.einsum("thc,sc->hts", q_lat, ckv) + np.einsum("thr,sr->hts", q[..., N:], kpe)
    probs = softmax(scores * scale + mask)
    o_lat = np.einsum("hts,sc->thc", probs, ckv)
    return np.einsum("thc,huc->thu", o_lat, w_uv)


def softmax_l_in_kernel_order(p: np.ndarray) -> np.ndarray:
    """l of each row of a chunk's p [rows, n] (float32, as the kernel computed them) summed as mla_softmax_kernel
    sums it: lane k of a warp adds columns 8 k + 256 u + j (u = 0, 1, ..; j = 0..7) in increasing order in float32,
    then the warp's butterfly (common.cuh warp_sum: partner lane ^ 16, 8, 4, 2, 1), lane 0's total. The order, not
    only the value: a batched or held loop that summed in another order would differ here in the last bits."""
    rows, n = p.shape
    spans = max(1, -(-n // 256))
    x = np.zeros((rows, spans * 256), np.float32)
    x[:, :n] = p
    x = x.reshape(rows, spans, 32, 8)                           # [row, u, lane, j]
    acc = np.zeros((rows, 32), np.float32)
    for u in range(spans):
        for j in range(8):
            acc = acc + x[:, u, :, j]                           # float32 + float32: one rounding, as on the device
    lanes = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[:, lanes ^ off]
    return acc[:, 0]


@pytest.mark.parametrize("cached,T,n_split", [(5000, 3, 4), (5000, 3, 1), (3069, 3, 1), (3070, 3, 1), (2557, 3, 1),
                                             (2558, 3, 1), (7678, 3, 1), (40, 2, 7)])
def test_mla_softmax_chunks(ops, cached, T, n_split):
    """mla_softmax_kernel alone, over chunks of 1280 to 7681 columns (2560 / 2561 at 2557 / 2558 cached: one batch of
    the SOFTMAX_HELD spans a warp holds, then one column more, read twice; 7681: three whole batches and one column;
    3072 / 3104: stop 45's edge, docs/cuda-engine.md) and chunks past the cache. Per chunk against float64:
    m the exact max; each p (its three bf16 terms' sum) within expf's 2 ulp plus the float32 rounding of s - m
    (|s - m| 2^-24 relative); l within the float32 sum's bound, and bit for bit the sum of the kernel's own p in
    the kernel's order (softmax_l_in_kernel_order: the held and the re-read paths must keep the order of the two-pass
    loop they replaced); zeros where p's terms are past the chunk. A row with every entry masked gives m = -inf,
    l = 0 and p = 0; masked entries give p = 0."""
    import re

    from cuda_engine.build import KERNEL_DIR
    from cuda_engine.ops import join3

    held = int(re.search(r"#define SOFTMAX_HELD (\d+)", (KERNEL_DIR / "attention.cu").read_text()).group(1))
    assert held * 32 * 8 == 2560, "the batch edge moved: move the cases at 2557 / 2558 cached rows with it"
    H, C = 2, 8
    S, TH = cached + T, T * H
    S_cap = S + 5
    rng = np.random.default_rng(cached + n_split)
    sc = (rng.standard_normal((TH, S_cap)) * 6).astype(np.float32)
    sc[:, ::37] = -np.inf
    sc[1, :] = -np.inf
    pitch = p_terms_shape(TH, S_cap)[2]
    p = dev(np.full((3, TH, pitch), 0x7777, np.uint16))
    part = dev(np.zeros((n_split, TH, C + 2), np.float32))
    meta = dev(np.array([cached, 0, 0, 0], np.int32))
    scores = dev(sc)                                   # held: freed only after the launch has run
    run(ops, ops._launch, "mla_softmax_kernel", (-(-TH // 8), n_split), scores.ptr, S_cap, meta.ptr, p.ptr, pitch,
        part.ptr, T, H, C)
    got_p, got = join3(p.get()), part.get()
    per = -(-S // n_split)
    chunk = -(-per // 32) * 32
    for j in range(n_split):
        lo, hi = min(S, j * chunk), min(S, j * chunk + chunk)
        s64 = sc[:, lo:hi].astype(np.float64)
        m = s64.max(axis=1) if hi > lo else np.full(TH, -np.inf)
        np.testing.assert_array_equal(got[j, :, 0], m.astype(np.float32))
        with np.errstate(invalid="ignore"):           # -inf - -inf in an all-masked row: left out by the where
            d = np.where(np.isfinite(s64), s64 - m[:, None], -np.inf)
        want = np.exp(d)
        bound = want * ((1 + 2 * 2.0**-23) * (1 + np.abs(np.where(np.isfinite(d), d, 0)) * 2.0**-24) - 1)
        err = np.abs(got_p[:, lo:hi] - want)
        assert (err <= bound).all(), (j, float(np.max(err - bound)))
        n = max(hi - lo, 1)                  # a float32 sum of n terms in any order: (n - 1) u, u = 2^-24, (+ 6 u for
        l_bound = (n + 5) * 2.0**-24 * want.sum(axis=1) + np.abs(want - got_p[:, lo:hi]).sum(axis=1)   # want vs p)
        assert (np.abs(got[j, :, 1] - want.sum(axis=1)) <= l_bound).all(), j
        np.testing.assert_array_equal(got[j, :, 1], softmax_l_in_kernel_order(got_p[:, lo:hi]), err_msg=str(j))
    assert (got[:, 1, 0] == -np.inf).all() and (got[:, 1, 1] == 0).all() and not got_p[1, :S].any()
    assert not p.get()[:, :, S:-(-S // 8) * 8].any()            # zeros from S to a whole piece: p c_kv reads them


@pytest.mark.parametrize("T,H,C,R,N,U,Q,S0,tree", [
    (1, 1, 1, 2, 1, 1, 1, 0, False), (3, 5, 17, 6, 3, 7, 13, 11, False), (7, 2, 33, 4, 9, 5, 31, 0, True),
    (5, 3, 64, 16, 32, 32, 96, 9, True),                          # the golden model's shapes
    (2, 2, 64, 16, 32, 32, 96, 255, False),                       # 257 rows: score passes of 32 rows + 1
    (1, 64, 512, 64, 128, 128, 1536, 300, False),                 # K2.6 decode
    (4, 64, 512, 64, 128, 128, 1536, 257, True),                  # K2.6 tree verify
    (1, 64, 512, 64, 128, 128, 1536, 5000, False),                # K2.6 decode, 32 chunks of 160 rows
    (9, 16, 512, 64, 128, 128, 1536, 1111, True),                 # 2 token blocks, 3 row tiles, the chunks by SM count
    (13, 5, 160, 16, 32, 32, 96, 130, True),                      # wide tiling (65 rows, C >= 128), part tiles
])
def test_mla_attention(ops, T, H, C, R, N, U, Q, S0, tree):
    rng = np.random.default_rng(T * H + C)
    S = S0 + T
    cq, w_qb = rand(rng, T, Q), rand(rng, H * (N + R), Q, scale=Q ** -0.5)
    q64_pre = np.einsum("ti,oi->to", cq.astype(np.float64), w_qb.astype(np.float64)).reshape(T, H, N + R)
    q = np.einsum("ti,oi->to", cq, w_qb).reshape(T, H, N + R)   # the float32 baseline's q
    positions = S0 + np.arange(T) + (2**17 if C == 512 else 0)     # K2.6 cases: past 2^17
    cfg = PRESETS["k26" if C == 512 else "tiny"]
    inv_freq = yarn_inv_freq(cfg)[:R // 2]
    w_uk, w_uv = rand(rng, H, N, C, scale=0.3 * N ** -0.5), rand(rng, H, U, C, scale=C ** -0.5)
    ckv, kpe = rand(rng, S, C), rand(rng, S, R)
    scale = float((N + R) ** -0.5)
    if tree:                                                      # random ancestor-like visibility, diagonal on
        vis = rng.random((T, T)) < 0.5
        vis |= np.eye(T, dtype=bool)
        mask = np.concatenate([np.zeros((T, S0)), np.where(vis, 0.0, -np.inf)], axis=1)
    else:
        mask = np.where(np.arange(S)[None, :] <= S0 + np.arange(T)[:, None], 0.0, -np.inf)
    S_cap = S + 3
    kv_d = dev(kv_rows_to_planes(ckv, kpe, S + 3))
    mask_d = dev(np.pad(mask, ((0, 0), (0, 3)), constant_values=-np.inf).astype(np.float32)) if tree else None
    scores = dev(np.zeros((T * H, S_cap), np.float32))
    o, q_d = dev(np.zeros((T, H, U), np.float32)), dev(np.zeros((T, H, N + R), np.float32))
    qs = dev(np.zeros(kv_planes_shape(T * H, C, R), np.uint16))
    p_terms = dev(np.zeros(p_terms_shape(T * H, S_cap), np.uint16))
    partials = dev(np.zeros((ops.attn_splits(T, H, C) * T * H, C + 2), np.float32))
    args = (dev(cq), dev(w_qb), q_d, dev(positions, np.int32), dev(inv_freq), 1.0, dev(w_uk), dev(w_uv), kv_d,
            dev(np.array([S0, 0, 0, 0], np.int32)), mask_d, S_cap, scores, p_terms, S_cap, partials, qs, o, T, R, scale)
    run(ops, ops.mla_attention, *args)
    first = o.get()
    run(ops, ops.mla_attention, *args)                            # the same launch again: the same bits
    np.testing.assert_array_equal(o.get(), first)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    angle = np.einsum("t,r->tr", positions.astype(np.float64), inv_freq)            # the oracle's rope_cos_sin
    cos, sin = np.cos(angle), np.sin(angle)
    q64 = q64_pre.copy()
    q64[..., N:] = apply_rope(q64[..., N:], cos, sin)
    q32 = q.copy()
    q32[..., N:] = apply_rope(q[..., N:], cos.astype(np.float32), sin.astype(np.float32))
    case = f"mla_attention T={T} H={H} C={C} R={R} N={N} U={U} Q={Q} S0={S0} tree={tree}"
    got_q = q_d.get()
    check(case + " q_nope", got_q[..., :N], q64[..., :N], q32[..., :N])
    check(case + " q_pe (rotated)", got_q[..., N:], q64[..., N:], q32[..., N:])
    oracle = attention_oracle(q64, f64(w_uk), f64(w_uv), f64(ckv), f64(kpe), mask, scale, N)
    base = attention_oracle(q32, w_uk, w_uv, ckv, kpe, mask.astype(np.float32), np.float32(scale), N)
    check(case, o.get(), oracle, base)


@pytest.mark.parametrize("T,H,C,R,S0,tree", [(5, 64, 512, 64, 700, True), (1, 64, 512, 64, 3000, False),
                                               (3, 7, 40, 8, 201, False), (13, 5, 96, 16, 130, True)])
def test_attention_tilings_give_the_same_bits(ops, T, H, C, R, S0, tree):
    """The attention GEMMs' two tilings (ops.ATTN_NARROW, ATTN_WIDE) give every score the same bits, and p
    c_kv's partials too at one chunk count: a tiling is picked for speed (ops.Ops.attn_tiling) and changes a
    result only through p c_kv's chunk count. Both kernels run here on every shape, also where mla_attention
    would pick the other (its own tests hold the results to the float64 oracle)."""
    from cuda_engine.ops import ATTN_NARROW, ATTN_WIDE, split3

    rng = np.random.default_rng(S0 + T)
    S, TH = S0 + T, T * H
    S_cap = S + 5
    qs = dev(kv_rows_to_planes(rand(rng, TH, C), rand(rng, TH, R)))      # the queries' layout is the cache's
    kv = dev(kv_rows_to_planes(rand(rng, S_cap, C), rand(rng, S_cap, R)))
    meta = dev(np.array([S0, 0, 0, 0], np.int32))
    vis = (rng.random((T, T)) < 0.5) | np.eye(T, dtype=bool)
    mask = dev(np.concatenate([np.zeros((T, S0)), np.where(vis, 0.0, -np.inf), np.full((T, 5), -np.inf)],
                              axis=1).astype(np.float32)) if tree else None
    pitch = p_terms_shape(TH, S_cap)[2]
    p_terms = dev(split3(rng.random((TH, pitch)).astype(np.float32)))
    n_split = 4
    got = []
    for tl in (ATTN_NARROW, ATTN_WIDE):
        scores = dev(np.zeros((TH, S_cap), np.float32))
        partials = dev(np.zeros((n_split * TH, C + 2), np.float32))
        ops._launch(f"mla_scores{tl.suffix}_kernel", (-(-TH // tl.rows), -(-S_cap // tl.cols)), qs.ptr, kv.ptr,
                    S_cap, meta.ptr, 0 if mask is None else mask.ptr, S_cap, scores.ptr, S_cap, T, H, C, R, 0.3,
                    shared=tl.scores_smem())
        ops._launch(f"mla_pv{tl.suffix}_kernel", (-(-TH // tl.rows) * -(-C // tl.cols), n_split), p_terms.ptr, pitch,
                    kv.ptr, S_cap, meta.ptr, partials.ptr, T, H, C, R, shared=tl.pv_smem())
        ops.stream.synchronize()
        got.append((scores.get()[:, :S], partials.get()[:, 2:]))
    (s_n, p_n), (s_w, p_w) = got
    assert np.isfinite(s_n).sum() > TH and np.isfinite(p_n).all() and np.abs(p_n).max() > 0
    np.testing.assert_array_equal(s_w, s_n)
    np.testing.assert_array_equal(p_w, p_n)


# ---------------------------------------------------------------- KV cache

@pytest.mark.parametrize("L,S_cap,C,R,start,keep", [
    (1, 4, 1, 2, 0, [0]), (2, 20, 17, 6, 5, [0, 2, 3, 7]), (3, 40, 64, 16, 11, [0, 1, 2, 3]),
    (2, 600, 512, 64, 300, [0, 4, 5, 9, 31])])                   # K2.6 latent width
def test_kv_compact_in_order(ops, L, S_cap, C, R, start, keep):
    rng = np.random.default_rng(C)
    kv = np.stack([kv_rows_to_planes(rand(rng, S_cap, C), rand(rng, S_cap, R)) for _ in range(L)])
    kv_d = dev(kv)
    keep = np.asarray(keep)
    run(ops, ops.kv_compact, kv_d, dev(keep, np.int32), len(keep), start)
    rows = np.concatenate([np.arange(start), start + keep])
    got = kv_d.get()
    np.testing.assert_array_equal(got[:, :, :len(rows)], kv[:, :, rows])       # every term plane, padding too
    np.testing.assert_array_equal(got[:, :, len(rows):], kv[:, :, len(rows):])  # the rows after: untouched


# ---------------------------------------------------------------- MoE

ROUTER = [("tiny", {}, 1), ("tiny", {}, 5),
          ("tiny", {"n_routed_experts": 12, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3}, 7),
          ("tiny", {"norm_topk_prob": False, "num_experts_per_tok": 1}, 2),
          ("k26", {}, 3)]                                         # 384 experts, top-8


@pytest.mark.parametrize("cfg_name,changes,T", ROUTER)
def test_router(ops, cfg_name, changes, T):
    import dataclasses

    cfg = dataclasses.replace(PRESETS[cfg_name], **changes)
    D, E, K = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok     # K2.6: 384 x 7168
    rng = np.random.default_rng(E + K)
    x, gate, bias = rand(rng, T, D), rand(rng, E, D, scale=D ** -0.5), rand(rng, E, scale=0.1)
    p = "model.layers.1.mlp.gate."
    scores64, ids64, w64 = route(cfg, {p + "weight": gate.astype(np.float64), p + "e_score_correction_bias":
                                       bias.astype(np.float64)}, 1, x.astype(np.float64))
    scores32, _, w32 = route(cfg, {p + "weight": gate, p + "e_score_correction_bias": bias}, 1, x)
    S = K + 1
    sc, ids, w = dev(np.zeros((T, E), np.float32)), dev(np.zeros((T, S), np.int32)), dev(np.zeros((T, S), np.float32))
    run(ops, ops.router, dev(x), dev(gate), dev(bias), sc, ids, w, T, K, S, cfg.n_group, cfg.topk_group,
        cfg.norm_topk_prob, cfg.routed_scaling_factor)
    case = f"router {cfg_name} {changes} T={T}"
    check(case + " scores", sc.get(), scores64, scores32)
    got_ids = ids.get()
    np.testing.assert_array_equal(got_ids[:, :K], ids64, err_msg=case)
    np.testing.assert_array_equal(got_ids[:, K], E)               # the shared-expert slot
    check(case + " weights", w.get()[:, :K], w64, w32)
    np.testing.assert_array_equal(w.get()[:, K], 1.0)


@pytest.mark.parametrize("cfg_name,changes,T", [ROUTER[1], ROUTER[2], ROUTER[4]])
def test_router_held(ops, cfg_name, changes, T):
    """Held rows (every other row; the others -1) run the held ids in the slots, weighted from the router's
    own scores there (refmodel's forced routing); own_ids / own_w keep the router's own choice."""
    import dataclasses

    cfg = dataclasses.replace(PRESETS[cfg_name], **changes)
    D, E, K = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    rng = np.random.default_rng(E + K + 1)
    x, gate, bias = rand(rng, T, D), rand(rng, E, D, scale=D ** -0.5), rand(rng, E, scale=0.1)
    held = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)       # [T, K]
    held[1::2] = -1                                                                      # the router decides
    p = "model.layers.1.mlp.gate."
    W64 = {p + "weight": gate.astype(np.float64), p + "e_score_correction_bias": bias.astype(np.float64)}
    W32 = {p + "weight": gate, p + "e_score_correction_bias": bias}
    _, own64, own_w64 = route(cfg, W64, 1, x.astype(np.float64))
    _, _, own_w32 = route(cfg, W32, 1, x)
    _, ids64, w64 = route(cfg, W64, 1, x.astype(np.float64), forced=held)
    _, _, w32 = route(cfg, W32, 1, x, forced=held)
    S = K + 1
    sc, ids, w = dev(np.zeros((T, E), np.float32)), dev(np.zeros((T, S), np.int32)), dev(np.zeros((T, S), np.float32))
    own_ids, own_w = dev(np.zeros((T, K), np.int32)), dev(np.zeros((T, K), np.float32))
    run(ops, ops.router, dev(x), dev(gate), dev(bias), sc, ids, w, T, K, S, cfg.n_group, cfg.topk_group,
        cfg.norm_topk_prob, cfg.routed_scaling_factor, dev(held, np.int32), own_ids, own_w)
    case = f"router held {cfg_name} {changes} T={T}"
    np.testing.assert_array_equal(ids.get()[:, :K], ids64, err_msg=case)
    np.testing.assert_array_equal(own_ids.get(), own64, err_msg=case)
    check(case + " weights", w.get()[:, :K], w64, w32)
    check(case + " own weights", own_w.get(), own_w64, own_w32)
    np.testing.assert_array_equal(w.get()[:, K], 1.0)


def moe_oracle(x, Wg, Wu, Wd, ids, w, K):
    """refmodel.moe's sum: routed slots in ascending expert id (weighted), then the unweighted slots."""
    T, S = ids.shape
    out = np.zeros((T, Wd.shape[1]), x.dtype)
    for t in range(T):
        order = sorted(range(K), key=lambda k: ids[t, k]) + list(range(K, S))
        for k in order:
            e = ids[t, k]
            y = (silu(Wg[e] @ x[t]) * (Wu[e] @ x[t])) @ Wd[e].T
            out[t] = out[t] + (w[t, k] * y if k < K else y)
    return out


@pytest.mark.parametrize("E,I,D,K,T", [
    (1, 1, 1, 0, 1),                   # a dense MLP of width 1: one slot of expert 0
    (5, 7, 13, 2, 3), (9, 33, 257, 4, 2),
    (1, 18432, 7168, 0, 1),            # K2.6 dense MLP
    (10, 2048, 7168, 8, 1),            # K2.6 expert shape, top-8 + shared (10 experts held, not 384: memory)
])
def test_experts(ops, E, I, D, K, T):
    rng = np.random.default_rng(E * I + D)
    Wg, Wu = rand(rng, E, I, D, scale=D ** -0.5), rand(rng, E, I, D, scale=D ** -0.5)
    Wd = rand(rng, E, D, I, scale=I ** -0.5)
    x = rand(rng, T, D)
    S = K + 1 if K else 1
    ids = np.stack([np.concatenate([rng.permutation(E - 1)[:K], [E - 1]]) if K else [0] for _ in range(T)]).astype(np.int32)
    w = np.concatenate([rng.random((T, K)).astype(np.float32), np.ones((T, S - K), np.float32)], axis=1)
    h, w_norm = rand(rng, T, D), rand(rng, D) + 1                  # the residual and the next norm (fused)
    ids_d, w_d = dev(ids), dev(w)
    act, y, out, h_out, y_norm = (dev(np.zeros(s, np.float32)) for s in ((T * S, I), (T * S, D), (T, D), (T, D), (T, D)))
    run(ops, ops.swiglu_gate_up, dev(x), dev(Wg), dev(Wu), ids_d, act, T, S)
    run(ops, ops.expert_down, act, dev(Wd), ids_d, y, T, S)
    run(ops, ops.moe_combine, y, ids_d, w_d, out, T, K, S, dev(h), h_out, dev(w_norm), y_norm, 1e-5)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    case = f"experts E={E} I={I} D={D} K={K} T={T}"
    got = out.get()
    check(case, got, moe_oracle(f64(x), f64(Wg), f64(Wu), f64(Wd), ids, f64(w), K), moe_oracle(x, Wg, Wu, Wd, ids, w, K))
    np.testing.assert_array_equal(h_out.get(), h + got, err_msg=case + " residual")
    check(case + " next norm", y_norm.get(), rms_norm(f64(h + got), f64(w_norm), 1e-5),
          rms_norm(h + got, w_norm, np.float32(1e-5)))


@pytest.mark.parametrize("E,I,D,T,S,wdtype", [
    (2, 7, 13, 3, 2, np.float32),      # D = 13: a warp's last outputs past D for every count but 1
    (5, 64, 192, 33, 5, np.float32),   # the tiny models' 33-row verify (D 192, 165 slots: 4 a warp chosen)
    (3, 33, 257, 2, 3, np.uint16),     # bf16 bits
    (2, 2048, 7168, 5, 1, np.uint16),  # K2.6's shared expert over a 5-row verify (bf16, as the slice holds it)
])
def test_expert_down_gives_the_same_bits_for_any_outputs_a_warp(ops, E, I, D, T, S, wdtype):
    """expert_down with 1 .. 4 outputs a warp (kernels/moe.cu: each output summed as with one a warp) writes the
    same bits, the oracle's values within the fp32 rule, and the engine's choice is one of them (more than one for
    the tiny verify's 3960 blocks, over any GPU's wave); bad counts are refused naming the range."""
    from cuda_engine.ops import down_outputs_per_warp, weight_kernel
    from kdtr_format.bf16 import bf16_bits, bf16_to_float32

    rng = np.random.default_rng(D * T + I)
    Wd = rand(rng, E, D, I, scale=I ** -0.5)
    Wd = bf16_bits(Wd) if wdtype == np.uint16 else Wd
    Wf = bf16_to_float32(Wd) if wdtype == np.uint16 else Wd           # the values the kernel multiplies
    a_h = rand(rng, T * S, I)
    ids_h = rng.integers(0, E, (T, S)).astype(np.int32)
    act, ids = dev(a_h), dev(ids_h)
    W = dev(Wd)
    ys = {}
    for per in (1, 2, 3, 4, None):
        y = dev(np.full((T * S, D), np.nan, np.float32))
        run(ops, ops.expert_down, act, W, ids, y, T, S, per=per)
        ys[per] = y.get()
    assert not np.isnan(ys[1]).any()
    e = ids_h.reshape(-1)
    o64 = np.einsum("rdi,ri->rd", Wf[e].astype(np.float64), a_h.astype(np.float64))
    o32 = np.einsum("rdi,ri->rd", Wf[e], a_h)
    check(f"expert_down E={E} I={I} D={D} T={T} S={S} {np.dtype(wdtype).name}", ys[1], o64, o32)
    if (D, T * S) == (192, 165):
        assert down_outputs_per_warp(D, T * S, ops._resident_blocks(weight_kernel("expert_down", "expert_down", W))) > 1
    for per in (2, 3, 4, None):
        np.testing.assert_array_equal(ys[per].view(np.uint32), ys[1].view(np.uint32), err_msg=f"per={per}")
    for bad in (0, 5):
        with pytest.raises(ValueError, match=f"per={bad} outputs a warp: pass 1 .. 4"):
            ops.expert_down(act, W, ids, dev(np.zeros((T * S, D), np.float32)), T, S, per=bad)


@pytest.mark.parametrize("E,I,D,K,T,g", [
    (2, 8, 8, 1, 1, 8),                # one packed word per row (in must be a multiple of 8 and of g)
    (3, 40, 56, 2, 3, 8),              # 7 words per row (fewer than the 32 lanes), 5 output blocks of 8
    (4, 64, 96, 3, 17, 32),            # batch 17
    (3, 2048, 7168, 2, 1, 32),         # K2.6 expert shapes (3 experts held, not 384: memory)
])
def test_w4a16_experts_against_dequantized(ops, E, I, D, K, T, g):
    """Routed slots on packed INT4 weights, the shared slot dense (e_base = E), as the INT4 bundle runs them.
    Oracle: dequantize_w4a16 + float64 (the exact quantized model); baseline: float32 NumPy on the same."""
    from kdtr_format.int4 import dequantize_w4a16, quantize_w4a16, scale_bits

    rng = np.random.default_rng(E * I + D)
    packed = {}
    for proj, (o_, i_) in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
        pairs = [quantize_w4a16(rng.standard_normal((o_, i_)) * i_ ** -0.5, g) for _ in range(E)]
        packed[proj] = (np.stack([q for q, _ in pairs]), np.stack([scale_bits(sc) for _, sc in pairs]),
                        np.stack([dequantize_w4a16(q, sc, (o_, i_)) for q, sc in pairs]))
    Wg_s, Wu_s, Wd_s = rand(rng, 1, I, D, scale=D ** -0.5), rand(rng, 1, I, D, scale=D ** -0.5), \
        rand(rng, 1, D, I, scale=I ** -0.5)                       # the dense shared expert, id E
    x, h, w_norm = rand(rng, T, D), rand(rng, T, D), rand(rng, D) + 1
    S = K + 1
    ids = np.stack([np.concatenate([rng.permutation(E)[:K], [E]]) for _ in range(T)]).astype(np.int32)
    w = np.concatenate([rng.random((T, K)).astype(np.float32), np.ones((T, 1), np.float32)], axis=1)
    ids_d, w_d = dev(ids), dev(w)
    act, y, out, h_out, y_norm = (dev(np.zeros(s, np.float32)) for s in ((T * S, I), (T * S, D), (T, D), (T, D), (T, D)))
    (qg, sg, _), (qu, su, _), (qd, sd, _) = packed["gate"], packed["up"], packed["down"]
    run(ops, ops.w4a16_gate_up, dev(x), dev(qg), dev(sg), dev(qu), dev(su), ids_d, act, T, S, 0, K)
    run(ops, ops.swiglu_gate_up, dev(x), dev(Wg_s), dev(Wu_s), ids_d, act, T, S, K, 1, E)
    run(ops, ops.w4a16_down, act, dev(qd), dev(sd), ids_d, y, T, S, 0, K)
    run(ops, ops.expert_down, act, dev(Wd_s), ids_d, y, T, S, K, 1, E)
    run(ops, ops.moe_combine, y, ids_d, w_d, out, T, K, S, dev(h), h_out, dev(w_norm), y_norm, 1e-5)
    Wg = np.concatenate([packed["gate"][2], Wg_s]); Wu = np.concatenate([packed["up"][2], Wu_s])  # noqa: E702
    Wd = np.concatenate([packed["down"][2], Wd_s])
    f32 = lambda a: a.astype(np.float32)  # noqa: E731
    check(f"w4a16 experts E={E} I={I} D={D} K={K} T={T} g={g}", out.get(),
          moe_oracle(x.astype(np.float64), Wg.astype(np.float64), Wu.astype(np.float64), Wd.astype(np.float64), ids,
                     w.astype(np.float64), K), moe_oracle(x, f32(Wg), f32(Wu), f32(Wd), ids, w, K))


def combine_oracle(y, ids, w, K, h):
    """The combine in float32 NumPy, term by term in the kernel's order (routed slots by ascending expert id,
    ties in slot order, weighted; then the unweighted slots in slot order): out and h_out bit for bit."""
    T, S = ids.shape
    y = y.reshape(T, S, -1)                                        # [T S, D] -> [T, S, D]
    out = np.zeros((T, y.shape[2]), np.float32)
    for t in range(T):
        for k in sorted(range(K), key=lambda k: ids[t, k]) + list(range(K, S)):
            out[t] = out[t] + (w[t, k] * y[t, k] if k < K else y[t, k])
    return out, h + out


def combine_launch(ops, y, ids, w, h, w_norm, K):
    """One moe_combine into fresh NaN-filled outputs: (out, h_out, y_norm) on the host."""
    T, S = ids.shape
    bufs = [dev(np.full(h.shape, np.nan, np.float32)) for _ in range(3)]
    run(ops, ops.moe_combine, y, ids, w, bufs[0], T, K, S, h, bufs[1], w_norm, bufs[2], 1e-5)
    return [b.get() for b in bufs]


# D: one element, a tiny model's 8, one block + 1 (two blocks, the second of one element), K2.6's 7168 (28
# blocks), 7169 (a 29th block of one element). (K, S): a dense MLP (0, 1); K2.6 top-8 + shared; routed only;
# shared slots only; 17 slots (past the 16 loads a thread issues at once); the 64-slot limit with and without
# a shared slot.
@pytest.mark.parametrize("K,S", [(0, 1), (8, 9), (9, 9), (0, 3), (16, 17), (63, 64), (64, 64)])
@pytest.mark.parametrize("D", [1, 8, 257, 7168, 7169])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_moe_combine(ops, T, D, K, S):
    """out and h_out bit for bit against float32 NumPy in the kernel's order; y_norm against float64; a
    second launch gives the same bits (the last block of each token left its ticket at zero)."""
    rng = np.random.default_rng(T * 100003 + D * 101 + S * 7 + K)
    y, h, w_norm = rand(rng, T * S, D), rand(rng, T, D), rand(rng, D) + 1
    ids = np.concatenate([rng.integers(0, 2 * K + 1, (T, K)),     # repeats: ties go in slot order
                          np.tile(np.arange(S - K) + 2 * K + 1, (T, 1))], axis=1).astype(np.int32)
    w = rng.random((T, S)).astype(np.float32)                      # unweighted slots ignore theirs
    d_in = [dev(y), dev(ids), dev(w), dev(h), dev(w_norm)]
    got = combine_launch(ops, d_in[0], d_in[1], d_in[2], d_in[3], d_in[4], K)
    again = combine_launch(ops, d_in[0], d_in[1], d_in[2], d_in[3], d_in[4], K)
    out, h_out = combine_oracle(y, ids, w, K, h)
    case = f"moe_combine T={T} D={D} K={K} S={S}"
    for name, g, ref in (("out", got[0], out), ("h_out", got[1], h_out)):
        np.testing.assert_array_equal(g.view(np.uint32), ref.view(np.uint32), err_msg=f"{case} {name} (bits)")
    check(case + " y_norm", got[2], rms_norm(h_out.astype(np.float64), w_norm.astype(np.float64), 1e-5),
          rms_norm(h_out, w_norm, np.float32(1e-5)))
    for name, a, b in zip(("out", "h_out", "y_norm"), got, again):
        np.testing.assert_array_equal(b.view(np.uint32), a.view(np.uint32), err_msg=f"{case} {name}: second launch")


def test_moe_combine_workspace_before_capture():
    """The combine's workspace grows outside graph capture only (a captured graph keeps its pointers); once
    reserved, a captured combine replays to the same bits as a direct launch, replay after replay."""
    from cuda_engine.device import CudaEngineError
    from cuda_engine.graph import capture

    fresh = gpu_ops()                                              # its workspace not yet grown
    T, D, K, S = 5, 7168, 8, 9
    rng = np.random.default_rng(5)
    ids = np.stack([np.concatenate([rng.permutation(384)[:K], [384]]) for _ in range(T)]).astype(np.int32)
    h = rand(rng, T, D)
    args = [dev(rand(rng, T * S, D)), dev(ids), dev(rng.random((T, S)).astype(np.float32)), dev(h)]
    w_norm = dev(rand(rng, D) + 1)
    outs = [dev(np.zeros((T, D), np.float32)) for _ in range(3)]

    def record():
        fresh.moe_combine(*args[:3], outs[0], T, K, S, args[3], outs[1], w_norm, outs[2], 1e-5)

    with pytest.raises(CudaEngineError, match=r"moe_combine: the workspace must be reserved before graph capture "
                                              r"\(140 floats, 5 tickets; Ops.moe_combine_reserve\(T=5, D=7168\)\)"):
        capture(fresh, record)
    fresh.moe_combine_reserve(T, D)
    graph = capture(fresh, record)
    direct = combine_launch(fresh, args[0], args[1], args[2], args[3], w_norm, K)
    for replay in range(3):
        for b in outs:
            b.set(np.full((T, D), np.nan, np.float32))
        graph.launch(fresh.stream)
        fresh.stream.synchronize()
        for name, b, ref in zip(("out", "h_out", "y_norm"), outs, direct):
            np.testing.assert_array_equal(b.get().view(np.uint32), ref.view(np.uint32),
                                          err_msg=f"replay {replay} {name}")
    graph.destroy()


# ---------------------------------------------------------------- sampling

@pytest.mark.parametrize("V,T", [(1, 1), (400, 3), (257, 2), (163840, 2)])   # K2.6 vocab
def test_argmax_lowest_index_on_ties(ops, V, T):
    rng = np.random.default_rng(V)
    logits = rand(rng, T, V)
    logits[:, V // 3] = logits[:, (2 * V) // 3] = logits.max() + 1      # an exact tie: the lower id wins
    out = dev(np.zeros(T, np.int32))
    run(ops, ops.argmax, dev(logits), V, out, T)
    np.testing.assert_array_equal(out.get(), np.argmax(logits, axis=-1))


@pytest.mark.cuda
def test_a_grid_over_the_launch_limits_is_a_clear_error(ops):
    """grid.y / grid.z carry rows (tokens x expert slots); past 65535 the driver only says "invalid argument".
    The launch is refused before it reaches the driver, naming the kernel and the limit."""
    from cuda_engine.device import CudaEngineError

    before = ops.launches
    with pytest.raises(CudaEngineError, match=r"argmax_kernel: launch grid \(1, 65536, 1\) exceeds"):
        ops._launch("argmax_kernel", (1, 65536), 0, 1, 0)
    assert ops.launches == before, "a refused launch was counted as launched"
