"""Dense weights held as bfloat16 on the device (CudaEngine(dense="stored"), the default; docs/cuda-engine.md,
"bf16 dense weights"): every kernel instance that reads bf16 weights gives the bits of its float32 instance on
the widened weights (which tests/test_cuda_kernels.py holds to the NumPy oracles), at K2.6 shapes too, except the
linear of 2 or more rows, which runs on the tensor cores (held to the float64 oracle here and in
tests/test_cuda_kernels.py); and the engine on the committed bundle stored as K2.6 ships (model_tiny_slice: bf16
dense) passes, as does the engine that widens every weight at load. GPU only: skipped cleanly without pycuda or a device."""
import numpy as np
import pytest

from cuda_engine.ops import LMMA_FEW_ROWS
from cuda_oracle import check, gpu_ops, rand
from kdtr_format.bf16 import bf16_bits, bf16_to_float32
from refmodel.config import PRESETS

pytestmark = pytest.mark.cuda
SLICE = "bundles/model_tiny_slice.kdtr"


@pytest.fixture(scope="module")
def ops():
    return gpu_ops()


def dev(a, dtype=None):
    from cuda_engine.device import DevBuf

    return DevBuf.from_array(a, dtype)


def bf16_pair(rng, *shape, scale=1.0):
    """(bf16 bits, the same values as float32) of random weights."""
    bits = bf16_bits(rand(rng, *shape, scale=scale))
    return bits, bf16_to_float32(bits)


def same_bits(ops, kernel: str, launch) -> None:
    """launch(weights_as) runs an op with bf16 or float32 weights and returns its outputs; both give the same
    bits, and the bf16 run really launched `kernel`."""
    before = ops.ran.get(kernel, 0)
    got = launch("bf16")
    ops.stream.synchronize()
    assert ops.ran.get(kernel, 0) > before, f"{kernel} did not run"
    want = launch("float32")
    ops.stream.synchronize()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.get(), w.get(), err_msg=kernel)
        assert np.isfinite(g.get()).all()


@pytest.mark.parametrize("T,B,I,O", [(1, 1, 7168, 1536), (1, 1, 64 * 128, 7168), (1, 1, 7168, 384),
                                     (9, 1, 257, 33), (33, 1, 1536, 200), (2, 5, 17, 9), (1, 3, 31, 7)])
def test_linear(ops, T, B, I, O):
    rng = np.random.default_rng(T + I + O)
    x = rand(rng, T, B, I)
    W16, W32 = bf16_pair(rng, B, O, I, scale=I ** -0.5)

    def launch(kind):
        y = dev(np.zeros((T, B, O), np.float32))
        ops.linear(dev(x), dev(W16 if kind == "bf16" else W32), y, T, I, O, x_stride=B * I, y_stride=B * O, B=B,
                   x_bstride=I, w_bstride=O * I, y_bstride=O)
        return [y]
    if T == 1:
        same_bits(ops, "linear_bf16_kernel", launch)
    else:                                  # T >= 2: linear_mma_bf16(_few)_kernel, tensor cores (test_cuda_kernels.py)
        name = "linear_mma_bf16_few_kernel" if T <= LMMA_FEW_ROWS else "linear_mma_bf16_kernel"
        before = ops.ran.get(name, 0)
        got = launch("bf16")[0].get()
        assert ops.ran.get(name, 0) == before + 1
        x64 = x.astype(np.float64)
        check(f"linear bf16 T={T} B={B} I={I} O={O}", got, np.einsum("tbi,boi->tbo", x64, W32.astype(np.float64)),
              np.einsum("tbi,boi->tbo", x, W32))


@pytest.mark.parametrize("V,D,T", [(37, 193, 5), (2048, 7168, 3)])
def test_embedding(ops, V, D, T):
    rng = np.random.default_rng(V)
    T16, T32 = bf16_pair(rng, V, D)
    ids, w = rng.integers(0, V, T).astype(np.int32), rand(rng, D) + 1

    def launch(kind):
        out, y = dev(np.zeros((T, D), np.float32)), dev(np.zeros((T, D), np.float32))
        ops.embedding(dev(ids), dev(T16 if kind == "bf16" else T32), out, T, dev(w), y, 1e-5)
        return [out, y]
    same_bits(ops, "embedding_bf16_kernel", launch)


@pytest.mark.parametrize("E,I,D,K,T", [(5, 7, 13, 2, 3), (1, 18432, 7168, 0, 1), (2, 2048, 7168, 1, 2)])
def test_dense_experts(ops, E, I, D, K, T):
    rng = np.random.default_rng(E * I + D)
    g, u, d = bf16_pair(rng, E, I, D, scale=D ** -0.5), bf16_pair(rng, E, I, D, scale=D ** -0.5), \
        bf16_pair(rng, E, D, I, scale=I ** -0.5)
    x = rand(rng, T, D)
    S = K + 1
    ids = np.stack([np.concatenate([rng.permutation(E - 1)[:K], [E - 1]]) if K else [0] for _ in range(T)])
    ids_d = dev(ids.astype(np.int32))

    def launch(kind):
        i = 0 if kind == "bf16" else 1
        act, y = dev(np.zeros((T * S, I), np.float32)), dev(np.zeros((T * S, D), np.float32))
        ops.swiglu_gate_up(dev(x), dev(g[i]), dev(u[i]), ids_d, act, T, S)
        ops.expert_down(act, dev(d[i]), ids_d, y, T, S)
        return [act, y]
    same_bits(ops, "expert_down_bf16_kernel", launch)
    assert ops.ran.get("swiglu_gate_up_bf16_kernel", 0) > 0


def test_gate_and_up_of_two_types_are_refused(ops):
    rng = np.random.default_rng(0)
    g, u = bf16_pair(rng, 1, 4, 8)
    with pytest.raises(ValueError, match="weights must all be float32 or all bf16 bits"):
        ops.swiglu_gate_up(dev(rand(rng, 1, 8)), dev(g), dev(u), dev(np.zeros((1, 1), np.int32)),
                           dev(np.zeros((1, 4), np.float32)), 1, 1)


@pytest.mark.parametrize("T,H,C,R,N,U,Q,S0", [(5, 3, 64, 16, 32, 32, 96, 9), (1, 64, 512, 64, 128, 128, 1536, 300),
                                              (9, 16, 512, 64, 128, 128, 1536, 1111)])
def test_mla_attention(ops, T, H, C, R, N, U, Q, S0):
    """W_uk (qprep) and W_uv (merge_uv) as bf16, and q_b (linear) where T = 1; from 2 tokens on q_b stays bf16 in
    both runs (the tensor-core linear, whose bits are not the float32 instance's: test_linear)."""
    from cuda_engine.ops import kv_planes_shape, kv_rows_to_planes, p_terms_shape
    from refmodel.model import yarn_inv_freq

    rng = np.random.default_rng(T * H + C)
    S_cap = S0 + T + 3
    cq = rand(rng, T, Q)
    qb, uk, uv = (bf16_pair(rng, H * (N + R), Q, scale=Q ** -0.5), bf16_pair(rng, H, N, C, scale=0.3 * N ** -0.5),
                  bf16_pair(rng, H, U, C, scale=C ** -0.5))
    inv_freq = yarn_inv_freq(PRESETS["k26" if C == 512 else "tiny"])[:R // 2]
    kv = dev(kv_rows_to_planes(rand(rng, S_cap, C), rand(rng, S_cap, R)))
    positions = dev(S0 + np.arange(T), np.int32)

    def launch(kind):
        i = 0 if kind == "bf16" else 1
        o, q = dev(np.zeros((T, H, U), np.float32)), dev(np.zeros((T, H, N + R), np.float32))
        scores = dev(np.zeros((T * H, S_cap), np.float32))
        qs = dev(np.zeros(kv_planes_shape(T * H, C, R), np.uint16))
        partials = dev(np.zeros((ops.attn_splits(T, H, C) * T * H, C + 2), np.float32))
        ops.mla_attention(dev(cq), dev(qb[i if T == 1 else 0]), q, positions, dev(inv_freq), 1.0, dev(uk[i]), dev(uv[i]), kv,
                          dev(np.array([S0, 0, 0, 0], np.int32)), None, S_cap, scores,
                          dev(np.zeros(p_terms_shape(T * H, S_cap), np.uint16)), S_cap, partials, qs, o, T, R,
                          float((N + R) ** -0.5))
        return [q, o]
    same_bits(ops, "mla_merge_uv_bf16_kernel", launch)
    assert ops.ran.get("mla_qprep_bf16_kernel", 0) > 0


@pytest.fixture(scope="module")
def engine_cls():
    gpu_ops()
    from cuda_engine.engine import CudaEngine

    return CudaEngine


@pytest.mark.parametrize("w4a16", ["fast", "plain"])
def test_the_bf16_bundle_passes_both_ways(engine_cls, w4a16):
    """model_tiny_slice stores its dense weights bf16: the engine that keeps them bf16 (half the bytes) and the
    one that widens them at load both pass; the first holds every matmul weight as bf16 and ran the bf16
    instances, the tensor-core linear for its forwards of 2 or more rows among them. (Their bits differ from a
    prefill on: the widened engine's rows run linear_rows_kernel on the CUDA cores.)"""
    from conformance.verify.runner import verify
    from kdtr_format import open_kdtr

    for dense in ("stored", "float32"):
        e = engine_cls(w4a16=w4a16, dense=dense)
        v = verify(SLICE, engine=e)
        assert v.verdict == "pass", (dense, [(c.name, c.message) for c in v.checks if c.status not in ("pass", "skip")][:5])
        info = e.dump_metadata()
        if dense == "stored":
            # per layer q/kv_a, q_b, W_uk, W_uv, o_proj, the dense MLP's or shared expert's three, the router;
            # the embedding and lm_head
            L, first = e.cfg.num_hidden_layers, e.cfg.first_k_dense_replace
            assert info["bf16_weights"] == 8 * L + (L - first) + 2, info["bf16_weights"]
            # the tiled copies the mma linear reads are made by the load itself, before any forward (Ops.tiled would
            # make a missing one at a prefill's first use, so this is read off an engine that only loaded)
            from cuda_engine.engine import LINEAR_WEIGHTS

            fresh = engine_cls(w4a16=w4a16, dense=dense)
            with open_kdtr(SLICE) as f:
                fresh.load(f)
            held = [w[k] for w in fresh.layers for k in LINEAR_WEIGHTS if k in w] + [fresh.lm_head]
            assert held and all(b.dtype == np.uint16 and b.tiled is not None for b in held)
            del fresh
            ran = info["kernels_ran"]
            assert {"linear_bf16_kernel", "linear_mma_bf16_kernel", "linear_mma_bf16_few_kernel", "embedding_bf16_kernel", "mla_qprep_bf16_kernel",
                    "mla_merge_uv_bf16_kernel", "swiglu_gate_up_bf16_kernel", "expert_down_bf16_kernel",
                    "drafter_embed_bf16_kernel"} <= set(ran)
            # (the drafter's own weights are float32 on the device: its linears run the float32 instances)
            assert not {"embedding_kernel", "mla_qprep_kernel", "mla_merge_uv_kernel", "drafter_embed_kernel"} & set(ran)
        else:
            assert info["bf16_weights"] == 0 and "linear_bf16_kernel" not in info["kernels_ran"]
            assert not {"linear_mma_bf16_kernel", "linear_mma_bf16_few_kernel"} & set(info["kernels_ran"])
