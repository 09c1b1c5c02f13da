"""Rules files cannot make a PASS mean nothing: an infinite, NaN, zero or negative-zero tolerance is refused
with the explicit form that asks for what it would do (mode = "exact" for bit-equal values, mode =
"aggregate" to judge by the gates only, a key left out to drop its gate), and so is an elementwise rule
whose bound is 0 because it gives neither atol, rtol nor a derived key. Once, `atol = 1e999` let a dump
with a planted fault pass."""
import os

import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.rules_file import load_rules_file, parse_rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, "bundles", "model_int4_tiny.kdtr")


@pytest.mark.parametrize("name, text, says", [
    ("inf.json", '{"rule": [{"match": "*", "atol": 1e999}]}', "'atol' = inf: an infinite tolerance passes anything"),
    ("inf.toml", '[[rule]]\nmatch = "*"\nmultiplier = inf\n', "'multiplier' = inf: an infinite tolerance"),
    ("nan.toml", '[[rule]]\nmatch = "*"\nnmse = nan\natol = 1\n', "'nmse' = nan: NaN is no tolerance"),
    ("zero.toml", '[[rule]]\nmatch = "*"\nmultiplier = 0\n', "'multiplier' = 0: a zero tolerance passes only bit-equal"),
    ("negzero.toml", '[[rule]]\nmatch = "*"\nmultiplier = -0.0\n', "'multiplier' = -0.0: a zero tolerance"),
    ("atol0.json", '{"rule": [{"match": "*", "atol": 0}]}', "'atol' = 0: a zero tolerance"),
    ("ulp0.json", '{"rule": [{"match": "*", "atol": 1, "max_ulp": 0}]}', "'max_ulp' = 0: a zero tolerance"),
    ("floor0.json", '{"rule": [{"match": "*", "abs_floor": 0.0}]}', "'abs_floor' = 0.0: a zero tolerance"),
    ("gates.json", '{"rule": [{"match": "*", "max_ulp": 4}]}', "no atol, rtol or derived key: its elementwise bound is 0"),
])
def test_unbounded_or_zero_tolerances_are_refused_naming_the_explicit_form(tmp_path, name, text, says):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError, match="rule 1 \\('\\*'\\)") as e:
        load_rules_file(p)
    assert says in str(e.value) and 'write mode = "exact"' in str(e.value)
    r = CliRunner().invoke(main, ["verify", BUNDLE, "--dump", BUNDLE, "--rules", str(p)])
    assert r.exit_code == 2 and says in r.output and "PASS" not in r.output, r.output


def test_the_explicit_forms_are_accepted():
    exact, gates = parse_rules({"rule": [{"match": "*/topk_ids", "mode": "exact"},
                                         {"match": "*", "mode": "aggregate", "nmse": 1e-6}]})
    assert exact.fields == {"mode": "exact"} and gates.fields == {"mode": "aggregate", "nmse": 1e-6}
    [rel] = parse_rules({"rule": [{"match": "*", "rtol": 1e-2}]})      # atol left out: the rtol term alone
    assert rel.fields == {"rtol": 1e-2}


def test_an_infinite_rule_is_refused_before_the_engine_runs(tmp_path):
    rules = tmp_path / "inf.json"
    rules.write_text('{"rule": [{"match": "*", "atol": 1e999}]}')
    r = CliRunner().invoke(main, ["verify", BUNDLE, "--engine", "reference", "--rules", str(rules)])
    assert r.exit_code == 2 and "engine:" not in r.output, r.output
