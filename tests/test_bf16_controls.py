"""Negative controls under the bf16 profile: wrong engines must fail it. The profile is derived from a bf16
reference run with routing held to the golden expert sets (conformance/gen/bf16_profile.py), so its bounds
measure arithmetic noise, not the discrete expert flips that once made decode bounds as large as the
signal (logits x 0.3 passed). Judge-side, a tolerance that would pass an all-zero output is reported as
skipped with that reason, never as a pass."""
import numpy as np
import pytest

from conformance.engines.faults import FaultyEngine
from conformance.precision import profile_taps
from conformance.rules_file import RuleOverride
from conformance.tolerance import DerivedTolerance
from conformance.verify.collect import collect
from conformance.verify.context import Run
from conformance.verify.judge import judge


@pytest.fixture(scope="module")
def run(reference_run):
    return reference_run


def failed(f, out, profile="bf16", overrides=()):
    return [c.name for c in judge(Run.of(f, profile, overrides), out)[0] if c.status == "fail"]


def test_the_correct_run_passes_bf16(run):
    f, out = run
    assert failed(f, out) == []


def test_decode_bounds_are_far_below_the_signal(run):
    """Every decode tap's NMSE bound is under 5% of the signal's power (it was up to 0.996)."""
    f, _ = run
    for k, e in profile_taps(f.metadata, "bf16").items():
        if k.startswith("ar/") and "baseline_nmse" in e:
            assert DerivedTolerance.from_dict(e).rule().nmse < 0.05, k


@pytest.mark.parametrize("what", ["logits x 0.3", "decode L3+ resid_out x 0.5"])
def test_a_scaled_decode_output_fails_bf16(run, what):
    f, out = run
    bad = dict(out)
    for k, v in out.items():
        if what.startswith("logits") and k.endswith("/ar/logits"):
            bad[k] = 0.3 * np.asarray(v)
        if what.startswith("decode") and "/ar/L" in k and k.endswith("/resid_out") and int(k.split("/L")[1][0]) >= 3:
            bad[k] = 0.5 * np.asarray(v)
    names = failed(f, bad)
    assert names and all("/ar/" in n or n.endswith("/long_position") for n in names), names


def test_a_decode_only_bug_fails_bf16(run):
    """A real decode-only fault (one decode step at the wrong position) fails under the bf16 profile."""
    f, _ = run
    e = FaultyEngine("position_off_by_one")
    e.load(f)
    names = failed(f, collect(e, f))
    assert any(n.startswith("p0/ar/") for n in names), names


def test_a_wrong_token_fails_bf16(run):
    """The golden worst token made the argmax of its row: the logits row is out of bounds and the flip is
    a token failure, at a step where the golden margin is decisive or not."""
    f, out = run
    bad = dict(out)
    logits, toks = np.array(out["p0/ar/logits"]), np.array(out["p0/ar/tokens"])
    for s in range(len(toks)):
        g = np.asarray(f["golden/p0/ar/logits"][s])
        w = int(np.argmin(g))
        logits[s, w] = g.max() + 1
        toks[s] = w
    bad["p0/ar/logits"], bad["p0/ar/tokens"] = logits, toks
    names = failed(f, bad)
    assert "p0/ar/tokens" in names and "p0/ar/logits" in names


def test_a_tolerance_that_passes_zeros_is_a_skip_not_a_pass(run):
    """Judge-side, whatever the bundle: a rule wide enough to pass all-zero logits judges nothing."""
    f, out = run
    wide = [RuleOverride("p0/ar/logits", {"atol": 1e9, "nmse": 2.0}, why="test", where="test: rule 1")]
    zero = {**out, "p0/ar/logits": np.zeros_like(np.asarray(out["p0/ar/logits"]))}
    zero["p0/ar/tokens"] = np.zeros_like(np.asarray(out["p0/ar/tokens"]))      # argmax of a zero row
    checks = judge(Run.of(f, "bf16", wide), zero)[0]
    c = next(c for c in checks if c.name == "p0/ar/logits")
    assert c.status == "skip" and "would pass an all-zero output" in c.message
    # with its logits unjudged, no token flip of p0 is a near-tie: the zero stream fails the token check
    assert next(c for c in checks if c.name == "p0/ar/tokens").status == "fail"
