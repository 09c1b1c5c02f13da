"""conformance.tolerance: rule semantics at the boundary, minimum passing tolerance, the derived
(baseline-multiple) rule; conformance.rules_file: rules files."""
import json

import numpy as np
import pytest

from conformance.rules_file import load_rules_file, parse_rules
from conformance.tolerance import (DEFAULT_FLOOR_ULPS, DEFAULT_MULTIPLIER, FP32_EPS,
                                   DerivedTolerance, Rule, check_tap, derive_tolerance,
                                   min_passing_tolerance, resolve_rule)

G = np.array([0.0, 1.0, -2.0, 4.0, 0.5])


# ------------------------------------------------------------------------------- rule semantics

def test_elementwise_bound_is_atol_plus_rtol_at_the_boundary():
    atol, rtol = 2.0**-10, 2.0**-6                               # powers of two: exact arithmetic
    bound = atol + rtol * np.abs(G)
    rule = Rule(atol=atol, rtol=rtol)
    assert check_tap(G, G + bound, rule, "float32").passed       # on the bound: pass
    over = (G + bound).copy()
    over[3] += 2.0**-20
    res = check_tap(G, over, rule, "float32")
    assert not res.passed and res.ratio > 1
    assert "(3,)" in res.failures[0] and "exceeds atol" in res.failures[0]
    # On the bound, element 3's error exceeds atol alone and rtol*|g| alone: Polygraphy's OR form
    # (pass if either holds) would fail it; the additive form passes it.
    err3 = bound[3]
    assert err3 > atol and err3 > rtol * abs(G[3])


def test_gates_are_anded():
    a = G + 1e-3
    assert check_tap(G, a, Rule(atol=1e-2), "float32").passed
    nm = check_tap(G, a, Rule(atol=1e-2, nmse=1e-9), "float32")
    assert not nm.passed and nm.failures == [f"NMSE {nm.metrics['nmse']:.3g} > 1e-09"]
    ulp = check_tap(G, a, Rule(atol=1e-2, max_ulp=3), "float32")
    assert not ulp.passed and ulp.failures[0].startswith("max ULP")
    # aggregate mode: no elementwise bound, only the gates.
    assert check_tap(G, a, Rule(atol=0.0, nmse=1e-6, mode="aggregate"), "float32").passed


def test_exact_mode_and_integer_taps():
    assert check_tap(G, G.copy(), Rule(mode="exact"), "float32").passed
    res = check_tap(G, np.nextafter(G, np.inf), Rule(mode="exact"), "float32")
    assert not res.passed and res.failures[0].startswith("not bit-exact")
    ids = np.array([[1, 2], [3, 4]])
    swapped = np.array([[1, 2], [3, 5]])
    res = check_tap(ids, swapped, Rule(atol=100.0), "float32")   # a loose rule changes nothing
    assert not res.passed
    assert res.failures == ["1 of 4 values differ; first at (1, 1): golden 4, actual 5"]


def test_nonfinite_fails_whatever_the_rule():
    a = G.copy()
    a[2] = np.nan
    res = check_tap(G, a, Rule(atol=float("inf"), mode="aggregate"), "float32")
    assert not res.passed and "non-finite" in res.failures[0] and "(2,)" in res.failures[0]


def test_rule_validation():
    with pytest.raises(ValueError, match="rule mode must be one of"):
        Rule(mode="loose")
    with pytest.raises(ValueError, match="rule atol must be a number >= 0, got -1"):
        Rule(atol=-1)


# ------------------------------------------------------------------------------- minimum passing

@pytest.mark.parametrize("seed,rtol", [(0, 0.0), (1, 1e-3), (2, 0.05)])
def test_min_passing_atol_is_tight(seed, rtol):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(200)
    a = g + 1e-3 * rng.standard_normal(200)
    res = check_tap(g, a, Rule(atol=0.0, rtol=rtol), "float32")
    need = res.min_passing["atol"]
    assert not res.passed and res.min_passing["rtol"] == rtol and res.min_passing["atol_exact"]
    assert check_tap(g, a, Rule(atol=need, rtol=rtol), "float32").passed
    assert not check_tap(g, a, Rule(atol=need * (1 - 1e-9), rtol=rtol), "float32").passed
    # Independent: the smallest atol is max(|a-g| - rtol|g|).
    assert need == pytest.approx(np.max(np.abs(a - g) - rtol * np.abs(g)), rel=1e-12)


def test_min_passing_multiplier_repasses():
    d = derive_tolerance(1e-6, 1e-13, magnitude=2.0)
    rng = np.random.default_rng(4)
    g = rng.standard_normal(100)
    a = g + 3e-5 * rng.standard_normal(100)
    res = check_tap(g, a, d.rule(), "float32", derived=d)
    assert not res.passed
    mult = res.min_passing["multiplier"]
    assert mult > d.multiplier
    again = DerivedTolerance(**{**d.to_dict(), "multiplier": mult * (1 + 1e-9)})
    assert check_tap(g, a, again.rule(), "float32").passed
    below = DerivedTolerance(**{**d.to_dict(), "multiplier": mult * (1 - 1e-6)})
    assert not check_tap(g, a, below.rule(), "float32").passed


def test_min_passing_without_elementwise_pass_uses_max_abs():
    m = {"max_abs": 0.25, "nmse": 1e-3, "max_ulp": 7}
    out = min_passing_tolerance(m, Rule(rtol=0.1))
    assert out["atol"] == 0.25 and out["atol_exact"] is False


# ------------------------------------------------------------------------------- derived rule

def test_derive_tolerance_defaults():
    d = derive_tolerance(2e-6, 3e-14, magnitude=3.0)
    ulp3 = 2.0**-22                                              # float32 spacing in [2, 4)
    assert d.multiplier == DEFAULT_MULTIPLIER["fp32"] == 16.0
    assert d.abs_floor == DEFAULT_FLOOR_ULPS * ulp3
    assert d.nmse_floor == (DEFAULT_FLOOR_ULPS * FP32_EPS) ** 2
    r = d.rule()
    assert r.atol == pytest.approx(16 * 2e-6 + 4 * ulp3) and r.rtol == 0.0
    assert r.nmse == pytest.approx(16 * 3e-14 + (4 * FP32_EPS) ** 2)
    assert derive_tolerance(0, 0, quant="int4", abs_floor=1e-7).multiplier == DEFAULT_MULTIPLIER["int4"]
    assert DerivedTolerance.from_dict(json.loads(json.dumps(d.to_dict()))) == d


def test_derive_tolerance_errors():
    with pytest.raises(ValueError, match=r"needs abs_floor or the tap's magnitude"):
        derive_tolerance(1e-6, 1e-13)
    with pytest.raises(ValueError, match="quant must be one of"):
        derive_tolerance(1e-6, 1e-13, magnitude=1.0, quant="fp8")
    with pytest.raises(ValueError, match="baseline_max_abs must be finite and >= 0, got nan"):
        derive_tolerance(float("nan"), 1e-13, magnitude=1.0)
    with pytest.raises(ValueError, match=r"tolerance entry lacks \['nmse_floor'\]"):
        DerivedTolerance.from_dict({"baseline_max_abs": 1, "baseline_nmse": 1, "multiplier": 1,
                                    "abs_floor": 1})


def test_exact_fp32_noise_passes_and_10x_tolerance_fails():
    """The rule's purpose: float32 rounding of the truth passes, an error 10x the tolerance fails."""
    rng = np.random.default_rng(5)
    truth = rng.standard_normal((16, 32))
    f32 = truth.astype(np.float32).astype(np.float64)
    base_abs = np.abs(f32 - truth).max()
    base_nmse = np.sum((f32 - truth) ** 2) / np.sum(truth**2)
    d = derive_tolerance(base_abs, base_nmse, magnitude=np.abs(truth).max())
    engine = (truth * (1 + 2 * FP32_EPS * rng.standard_normal(truth.shape))).astype(np.float32)
    assert check_tap(truth, engine, d.rule(), "float32", derived=d).passed
    bad = engine.copy()
    bad[3, 7] += 10 * d.rule().atol
    res = check_tap(truth, bad, d.rule(), "float32", derived=d)
    assert not res.passed and res.metrics["worst_index"] == (3, 7)


# ------------------------------------------------------------------------------- rules files

TOML = """
# bf16 engine: routing scores need a looser bound, everything else 64x the baseline
[[rule]]
match = "golden/*/prefill/L*/router_scores"
atol = 2e-3
rtol = 1e-2
max_ulp = 4
why = "bf16 sigmoid"

[[rule]]
match = "*logits"
multiplier = 64
max_ulp = 16

[[rule]]
match = "*"
atol = 1e-2
"""


def test_rules_file_toml_first_match_wins(tmp_path):
    p = tmp_path / "bf16.toml"
    p.write_text(TOML)
    rules = load_rules_file(p)
    man = derive_tolerance(1e-6, 1e-13, abs_floor=1e-7)
    r = resolve_rule("golden/p0/prefill/L3/router_scores", man, rules)
    assert (r.atol, r.rtol, r.max_ulp, r.nmse) == (2e-3, 1e-2, 4, None)
    assert r.source == "bf16.toml: rule 1 'golden/*/prefill/L*/router_scores'"
    # The decode-step router scores skip rule 1 and fall to the catch-all.
    assert resolve_rule("golden/p0/ar/L3/router_scores", man, rules).atol == 1e-2
    lg = resolve_rule("golden/p2/ar/logits", man, rules)
    assert lg.atol == pytest.approx(64 * 1e-6 + 1e-7) and lg.max_ulp == 16
    assert lg.nmse == pytest.approx(64 * 1e-13 + man.nmse_floor)
    # No rules: the manifest rule.
    assert resolve_rule("golden/p0/prefill/L0/q", man, []) == man.rule()


def test_rules_file_json_equivalent(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"rule": [{"match": "*/q", "atol": 1e-4, "nmse": 1e-9}]}))
    [o] = load_rules_file(p)
    assert resolve_rule("golden/p0/prefill/L1/q", None, [o]) == Rule(atol=1e-4, nmse=1e-9,
                                                                     source="r.json: rule 1 '*/q'")


@pytest.mark.parametrize("doc,msg", [
    ({"rules": []}, r"expected a list under the single key 'rule'"),
    ({"rule": [{"atol": 1}]}, r"rule 1: each rule needs a 'match' glob string"),
    ({"rule": [{"match": "*", "atl": 1}]}, r"rule 1 \('\*'\): unknown keys \['atl'\]"),
    ({"rule": [{"match": "*", "atol": 1, "multiplier": 4}]}, r"give 'atol' or derive it"),
    ({"rule": [{"match": "*", "rtol": -1}]}, r"rule 1 \('\*'\): 'rtol' must be a number >= 0, got -1"),
])
def test_rules_file_errors(doc, msg):
    with pytest.raises(ValueError, match=msg):
        parse_rules(doc)


def test_resolve_errors(tmp_path):
    derived = parse_rules({"rule": [{"match": "*", "multiplier": 4}]}, where="x.toml")
    with pytest.raises(ValueError, match=r"no tolerance for tap 'golden/p0/logits'"):
        resolve_rule("golden/p0/logits", None, derived)       # a multiplier needs a baseline to multiply
    exact = Rule(mode="exact")                                 # ids and tokens have none: they stay exact
    assert resolve_rule("golden/p0/prefill/L1/topk_ids", exact, derived) is exact
    with pytest.raises(ValueError, match=r"no tolerance for tap 'a/b'"):
        resolve_rule("a/b", None, [])
    with pytest.raises(ValueError, match=r"must end in .toml or .json"):
        load_rules_file(tmp_path / "rules.yaml")
