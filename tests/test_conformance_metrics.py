"""conformance.metrics against independent computations: np.nextafter stepping for ULPs, torch's KL and
top-k, and the plain formulas for NMSE, cosine and max_rel (bfloat16 rounding: tests/test_bf16.py)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.metrics import logits_metrics, tensor_metrics, ulp_distance
from kdtr_format.bf16 import bf16_to_float32


def _step(x, n, dtype):
    """x moved n representable values toward +inf (negative n: toward -inf), by np.nextafter."""
    x = np.asarray(x, dtype=dtype)
    target = np.asarray(np.inf if n > 0 else -np.inf, dtype=dtype)
    for _ in range(abs(n)):
        x = np.nextafter(x, target)
    return x


# ------------------------------------------------------------------------------- ULP distance

@pytest.mark.parametrize("dtype", ["float32", "float16"])
@settings(max_examples=60, deadline=None)
@given(bits=st.integers(0, 2**16 - 1), n=st.integers(-6, 6))
def test_ulp_matches_nextafter_stepping(dtype, bits, n):
    if dtype == "float32":
        x = np.array(bits << 16 | (bits & 0xFF), dtype=np.uint32).view(np.float32)
    else:
        x = np.array(bits, dtype=np.uint16).view(np.float16)
    if not np.isfinite(x):
        return
    y = _step(x, n, dtype)
    if not np.isfinite(y):
        return
    # Every nextafter step moves one representable value; across zero it visits only one of +-0,
    # which the ordering treats as one value, so the distance is exactly |n|.
    d = int(ulp_distance(np.array([x]), np.array([y]), dtype)[0])
    assert d == abs(n)
    # And numpy's own sign-magnitude helper agrees.
    assert d == np.testing.assert_array_max_ulp(x, y, maxulp=100, dtype=np.dtype(dtype)).item()


def test_ulp_float32_simple_cases():
    one = np.float32(1.0)
    y = _step(one, 3, np.float32)
    assert ulp_distance(np.array([one]), np.array([y]))[0] == 3
    # Across zero: -min_subnormal -> +min_subnormal is two steps (+0 and -0 collapse).
    tiny = np.float32(1e-45)
    assert ulp_distance(np.array([-tiny]), np.array([tiny]))[0] == 2
    assert ulp_distance(np.array([-0.0], np.float32), np.array([0.0], np.float32))[0] == 0
    # float64 inputs are rounded into float32 first: these two round to the same float32.
    assert ulp_distance(np.array([1.0]), np.array([1.0 + 2.0**-30]))[0] == 0


# ------------------------------------------------------------------------------- bfloat16

def test_ulp_bfloat16_counts_bf16_steps():
    rng = np.random.default_rng(1)
    base = rng.integers(0x0080, 0x7F00, size=500, dtype=np.uint16)    # positive normals
    sign = rng.integers(0, 2, size=500, dtype=np.uint16) << 15
    n = rng.integers(0, 50, size=500).astype(np.uint16)
    g = bf16_to_float32(base | sign)
    a = bf16_to_float32((base + n) | sign)                   # same sign: n bf16 steps apart
    np.testing.assert_array_equal(ulp_distance(g, a, "bfloat16"), n)
    # A float32 error smaller than half a bf16 step is 0 bf16 ULPs but many float32 ULPs.
    g1, a1 = np.float32([1.0]), np.float32([1.0 + 2.0**-10])
    assert ulp_distance(g1, a1, "bfloat16")[0] == 0
    assert ulp_distance(g1, a1, "float32")[0] == 2**13
    # Raw uint16 bf16 bits are accepted as the engine's tensor.
    m = tensor_metrics(g, ((base + n) | sign).astype(np.uint16), dtype="bfloat16")
    assert m["max_ulp"] == int(n.max())


# ------------------------------------------------------------------------------- tensor metrics

def test_tensor_metrics_match_formulas():
    rng = np.random.default_rng(2)
    g = rng.standard_normal((7, 5, 3))
    g[0, 0, 0] = 0.0
    a = (g + 1e-4 * rng.standard_normal(g.shape)).astype(np.float32)
    a[3, 2, 1] = g[3, 2, 1] + 0.5                                 # the planted worst element
    m = tensor_metrics(g, a)
    d = a.astype(np.float64) - g
    nz = g != 0
    assert m["max_abs"] == pytest.approx(np.abs(d).max(), rel=1e-12)
    assert m["max_rel"] == pytest.approx((np.abs(d)[nz] / np.abs(g[nz])).max(), rel=1e-12)
    assert m["nmse"] == pytest.approx((d**2).sum() / (g**2).sum(), rel=1e-12)
    cos = torch.nn.functional.cosine_similarity(torch.from_numpy(g.ravel()),
                                                torch.from_numpy(a.ravel().astype(np.float64)), dim=0)
    assert m["cosine"] == pytest.approx(float(cos), rel=1e-12)
    assert m["worst_index"] == (3, 2, 1)
    assert m["golden_at_worst"] == g[3, 2, 1] and m["actual_at_worst"] == float(a[3, 2, 1])
    # numpy's helper returns float32 counts (the zero golden gives ~1e9 ULPs), so compare loosely.
    ulps = np.testing.assert_array_max_ulp(g.astype(np.float32), a, maxulp=2**31)
    assert m["max_ulp"] == pytest.approx(float(ulps.max()), rel=1e-6)
    assert m["max_ulp"] > 9e8
    assert m["nonfinite"] == 0 and m["exact"] is False


def test_zero_golden_conventions():
    z = np.zeros(4)
    m = tensor_metrics(z, z)
    assert (m["nmse"], m["cosine"], m["max_rel"], m["max_abs"]) == (0.0, 1.0, 0.0, 0.0)
    m = tensor_metrics(z, np.array([0, 0, 1e-3, 0]))
    assert m["nmse"] == float("inf") and m["cosine"] == 0.0 and m["max_rel"] == 0.0
    assert m["max_abs"] == pytest.approx(1e-3) and m["worst_index"] == (2,)


def test_nonfinite_policy():
    g = np.array([1.0, 2.0, -np.inf, 4.0])
    ok = tensor_metrics(g, np.array([1.0, 2.0, -np.inf, 4.0]))
    assert ok["nonfinite"] == 0 and ok["max_abs"] == 0.0
    nan = tensor_metrics(g, np.array([1.0, np.nan, -np.inf, np.inf]))
    assert nan["nonfinite"] == 2 and nan["first_nonfinite"] == (1,)
    assert nan["max_abs"] == nan["nmse"] == nan["max_ulp"] == float("inf")
    assert nan["worst_index"] == (1,) and np.isnan(nan["actual_at_worst"])
    lost_mask = tensor_metrics(g, np.array([1.0, 2.0, 0.0, 4.0]))
    assert lost_mask["nonfinite"] == 1 and lost_mask["first_nonfinite"] == (2,)


def test_integer_tensors_exact():
    g = np.array([[3, 7], [1, 4], [0, 2]], dtype=np.int64)
    assert tensor_metrics(g, g.copy())["mismatch_count"] == 0
    a = g.copy()
    a[1, 1], a[2, 0] = 5, 9
    m = tensor_metrics(g, a.astype(np.int32))
    assert m["exact"] and m["match_count"] == 4 and m["mismatch_count"] == 2
    assert m["first_mismatch"] == (1, 1) and (m["golden_at_first"], m["actual_at_first"]) == (4, 5)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"shape mismatch: golden \(2, 3\) vs actual \(3, 2\)"):
        tensor_metrics(np.zeros((2, 3)), np.zeros((3, 2)))


# ------------------------------------------------------------------------------- logits

def test_logits_metrics_against_torch():
    rng = np.random.default_rng(3)
    g = rng.standard_normal((6, 50)) * 3
    a = g + 0.3 * rng.standard_normal(g.shape)
    a[4] = g[4]
    a[4, np.argsort(g[4])[-2]] += 100.0                           # row 4: the runner-up wins
    m = logits_metrics(g, a, k=5)
    tg, ta = torch.from_numpy(g), torch.from_numpy(a)
    kl = torch.nn.functional.kl_div(torch.log_softmax(ta, -1), torch.log_softmax(tg, -1),
                                    log_target=True, reduction="none").sum(-1).numpy()
    np.testing.assert_allclose(m["per_row"]["kl"], kl, rtol=1e-10, atol=1e-14)
    assert m["kl_max"] == pytest.approx(kl.max()) and m["kl_mean"] == pytest.approx(kl.mean())
    ov = [len(set(torch.topk(tg[t], 5).indices.tolist()) & set(torch.topk(ta[t], 5).indices.tolist()))
          / 5 for t in range(6)]
    assert m["per_row"]["topk_overlap"] == ov and m["topk_overlap_min"] == min(ov)
    top2 = torch.topk(tg, 2).values.numpy()
    np.testing.assert_allclose(m["per_row"]["margin"], top2[:, 0] - top2[:, 1])
    agree = (g.argmax(-1) == a.argmax(-1))
    assert m["argmax_agreement"] == pytest.approx(agree.mean())
    assert 4 in m["argmax_mismatch_rows"]


def test_logits_identical_and_nonfinite():
    g = np.array([1.0, 3.0, 2.0, 0.5])                           # one row, [V]
    m = logits_metrics(g, g, k=2)
    assert m["kl_max"] == 0.0 and m["topk_overlap_min"] == 1.0 and m["argmax_agreement"] == 1.0
    assert m["margin_min"] == pytest.approx(1.0)
    bad = logits_metrics(g, np.array([1.0, np.nan, 2.0, 0.5]), k=2)
    assert bad["nonfinite_rows"] == 1 and bad["kl_max"] == float("inf")
    assert bad["argmax_agreement"] == 0.0
