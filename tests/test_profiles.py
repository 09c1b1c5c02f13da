"""Precision profiles: the bf16 reference really rounds where a bf16 engine does, and `kdtr gen` stores a
bf16 profile derived from it with the fp32 rule's multiplier and a floor in bfloat16 ULPs."""
import numpy as np
import pytest

from conformance.gen.gen import run_reference
from conformance.gen.bf16_profile import BF16_EPS, Bf16Array, Fp32Array, bf16_weights
from conformance.precision import ProfileError, profile_taps
from kdtr_format import open_kdtr
from kdtr_format.bf16 import bf16_round
from refmodel.config import PRESETS
from refmodel.weights import init_weights

TINY = PRESETS["tiny"]


def is_bf16(x) -> bool:
    x = np.asarray(x, np.float32)
    return bool(np.all(x.view(np.uint32) & 0xFFFF == 0))


def test_operations_round_to_bf16_and_accumulate_in_float32():
    rng = np.random.default_rng(0)
    a = bf16_round(rng.normal(size=(3, 512))).view(Bf16Array)
    b = bf16_round(rng.normal(size=(7, 512))).view(Bf16Array)
    y = np.einsum("ti,oi->to", a, b)
    assert isinstance(y, Bf16Array) and is_bf16(y)
    exact = np.einsum("ti,oi->to", a.astype(np.float64).view(np.ndarray), b.astype(np.float64).view(np.ndarray))
    # one rounding of a float32 sum: within half a bf16 ulp (plus the float32 accumulation error)
    assert np.all(np.abs(np.asarray(y) - exact) <= 0.5 * BF16_EPS * np.abs(exact) + 1e-4)
    s = a.sum(-1)
    assert isinstance(s, Bf16Array) and is_bf16(s)
    z = np.zeros_like(a)
    z[[0, 2]] += a[[0, 2]] * np.float32(1.0 / 3.0)                          # in place, fancy index: rounded
    assert isinstance(z, Bf16Array) and is_bf16(z)


def test_float32_weights_promote_like_torch():
    """bf16 activation x float32 router weight: computed and kept in float32 (transformers' router)."""
    rng = np.random.default_rng(1)
    x = bf16_round(rng.normal(size=(2, 64))).view(Bf16Array)
    w = rng.normal(size=(5, 64)).astype(np.float32).view(Fp32Array)
    y = np.einsum("ti,oi->to", x, w)
    assert isinstance(y, Fp32Array) and not is_bf16(y)
    assert np.array_equal(np.asarray(y), np.einsum("ti,oi->to", np.asarray(x), np.asarray(w)))


def test_bf16_reference_rounds_every_tap_but_the_router():
    W = bf16_weights(init_weights(TINY, 0))
    out, tokens, _, _ = run_reference(TINY, W, np.array([5, 6, 7]), 3)
    assert len(tokens) == 3
    for k, v in out.items():
        if np.asarray(v).dtype.kind != "f":
            continue
        router = k.endswith(("router_scores", "topk_weights"))
        assert is_bf16(v) != router, f"{k}: {'float32' if router else 'bfloat16'} expected"


def test_gen_stores_a_bf16_profile_noisier_than_fp32_at_every_tap(small_bundle):
    with open_kdtr(small_bundle) as f:
        meta = f.metadata
    fp32, bf16 = profile_taps(meta, "fp32"), profile_taps(meta, "bf16")
    prof = meta["tolerances"]["profiles"]["bf16"]
    assert prof["dtype"] == "bfloat16" and prof["multiplier"] == meta["tolerances"]["multiplier"]
    assert set(fp32) == set(bf16)
    for k, e in fp32.items():
        if e.get("exact"):
            assert bf16[k]["exact"], k
            continue
        b = bf16[k]
        # bfloat16 keeps 8 significand bits to float32's 24: its error is orders of magnitude larger
        assert b["baseline_max_abs"] > 64 * e["baseline_max_abs"], (k, b, e)
        assert b["abs_floor"] == pytest.approx(e["abs_floor"] * 2**16), k   # 4 ulps, in bf16 instead of fp32
        assert b["nmse_floor"] == pytest.approx((4 * BF16_EPS) ** 2)


def test_missing_profile_is_a_clear_error(small_bundle):
    with open_kdtr(small_bundle) as f:
        meta = dict(f.metadata)
    meta["tolerances"] = {k: v for k, v in meta["tolerances"].items() if k != "profiles"}
    with pytest.raises(ProfileError, match="this bundle carries no 'bf16' precision profile"):
        profile_taps(meta, "bf16")
    with pytest.raises(ProfileError, match="unknown precision profile 'fp16'; choose one of fp32, bf16"):
        profile_taps(meta, "fp16")


def test_forced_routing_runs_the_given_experts_and_records_the_routers_own_choice():
    """The bf16 profile's noise run holds routing to the golden sets (`routing=`): forcing the golden sets
    reproduces the golden exactly; forcing other sets changes the MoE output, while the topk_ids tap still
    records the router's own choice (what the profile counts as reference_mismatches)."""
    W = init_weights(TINY, 0)
    prompt = np.array([5, 6, 7])
    g, toks, _, _ = run_reference(TINY, W, prompt, 3)
    same, _, _, _ = run_reference(TINY, W, prompt, 3, tokens=toks, routing=g)
    assert all(np.array_equal(same[k], g[k]) for k in g)
    l = TINY.first_k_dense_replace
    other = {k: (v + 1) % TINY.n_routed_experts if k.endswith("topk_ids") else v for k, v in g.items()}
    moved, _, _, _ = run_reference(TINY, W, prompt, 3, tokens=toks, routing=other)
    assert np.array_equal(moved[f"prefill/L{l}/topk_ids"], g[f"prefill/L{l}/topk_ids"])   # own choice
    assert not np.allclose(moved[f"prefill/L{l}/mlp_out"], g[f"prefill/L{l}/mlp_out"])     # forced experts ran
