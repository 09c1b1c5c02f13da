"""conformance.report: exit-code precedence, and the JSON / JUnit / HTML / console writers on a
verdict built from real tolerance checks. Also conformance.engines.protocol.check_engine."""
import io
import json
import os
import zlib
import xml.etree.ElementTree as ET
from dataclasses import asdict

import numpy as np
import pytest
from rich.console import Console

from conformance.engines.protocol import check_engine
from conformance.exit_codes import ExitCode
from conformance.report.console import print_console
from conformance.report.html import layer_series, write_html
from conformance.report.verdict import CheckResult, Divergence, exit_code_for, make_verdict, write_json, write_junit
from conformance.tolerance import Rule, check_tap

FAILING_TAP = "golden/p0/prefill/L2/attn_out"


def _numeric(name, scale):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    g = rng.standard_normal((3, 8))
    a = g + scale * rng.standard_normal(g.shape)
    rule = Rule(atol=1e-3, nmse=1e-6, source="manifest")
    r = check_tap(g, a, rule, "float32")
    return CheckResult(name, "pass" if r.passed else "fail", "numeric", r.metrics, rule.to_dict(),
                       "; ".join(r.failures), r.min_passing)


@pytest.fixture
def verdict():
    checks = [CheckResult("bundle checksums", "pass", "integrity")]
    for layer in range(4):
        for tap in ("q", "attn_out"):
            name = f"golden/p0/prefill/L{layer}/{tap}"
            checks.append(_numeric(name, 1e-1 if name == FAILING_TAP else 1e-6))
    checks.append(CheckResult("golden/p0/prefill/logits", "skip", "numeric", message="engine lacks tap"))
    checks.append(CheckResult("golden/p0/ar/tokens", "fail", "tokens",
                              {"step": 5, "golden": 17, "actual": 23, "margin": 0.41},
                              message="step 5: golden 17, actual 23 (margin 0.41)"))
    checks.append(CheckResult("golden/p0/ddtree/tokens", "pass", "ddtree"))
    div = Divergence(FAILING_TAP, 2, "attn_out", "prefill", None, 1, (1, 4), 0.5, 0.71,
                     {"max_abs": 0.2}, {"max_abs": 0.01}, "local")
    return make_verdict("reference", "bundles/model_tiny.kdtr", checks, div, {"dtype": "float32"})


# ------------------------------------------------------------------------------- exit codes

def _checks(*kinds_status):
    return [CheckResult(f"c{i}", s, k) for i, (k, s) in enumerate(kinds_status)]


@pytest.mark.parametrize("checks,code", [
    ([], ExitCode.OK),
    (_checks(("numeric", "pass"), ("tokens", "skip")), ExitCode.OK),
    (_checks(("numeric", "fail")), ExitCode.NUMERIC),
    (_checks(("numeric", "fail"), ("ddtree", "fail")), ExitCode.DDTREE),
    (_checks(("ddtree", "fail"), ("tokens", "fail"), ("numeric", "fail")), ExitCode.TOKENS),
    (_checks(("tokens", "fail"), ("numeric", "error")), ExitCode.ENGINE_ERROR),
    (_checks(("ddtree", "error"), ("tokens", "fail")), ExitCode.ENGINE_ERROR),
    (_checks(("numeric", "error"), ("integrity", "fail")), ExitCode.INVALID_FILE),
    (_checks(("integrity", "error"),), ExitCode.INVALID_FILE),
])
def test_exit_code_precedence(checks, code):
    assert exit_code_for(checks) == code


def test_verdict_words(verdict):
    assert verdict.exit_code == ExitCode.TOKENS and verdict.verdict == "fail"
    assert make_verdict("e", "b", _checks(("numeric", "pass"))).verdict == "pass"
    assert make_verdict("e", "b", _checks(("numeric", "error"))).verdict == "error"
    with pytest.raises(ValueError, match="status must be one of"):
        CheckResult("x", "passed", "numeric")
    with pytest.raises(ValueError, match="kind must be one of"):
        CheckResult("x", "pass", "tap")


# ------------------------------------------------------------------------------- JSON

def test_json_schema(verdict, tmp_path):
    bad = verdict.checks[1]
    bad.metrics["max_abs"] = float("inf")                         # must survive as strict JSON
    p = tmp_path / "r.json"
    write_json(verdict, p)
    text = p.read_text()
    assert "Infinity" not in text and "NaN" not in text
    d = json.loads(text)
    assert {"verdict", "exit_code", "engine", "checks", "first_divergence"} <= set(d)
    assert (d["verdict"], d["exit_code"], d["exit_name"], d["engine"]) == ("fail", 3, "TOKENS", "reference")
    assert d["counts"] == {"pass": 9, "fail": 2, "error": 0, "skip": 1}
    for c in d["checks"]:
        assert {"name", "status", "kind", "metrics", "tolerance", "message", "min_passing"} <= set(c)
    failing = next(c for c in d["checks"] if c["name"] == FAILING_TAP)
    assert failing["status"] == "fail" and failing["tolerance"]["atol"] == 1e-3
    assert failing["min_passing"]["atol"] > 1e-3 and failing["metrics"]["worst_index"]
    assert d["checks"][1]["metrics"]["max_abs"] == "inf"
    assert d["first_divergence"]["tap"] == "attn_out" and d["first_divergence"]["worst_index"] == [1, 4]
    assert os.listdir(tmp_path) == ["r.json"]                      # no temp file left behind


def test_atomic_write_leaves_nothing_on_failure(verdict, tmp_path):
    target = tmp_path / "occupied"
    target.mkdir()
    (target / "keep").write_text("x")                             # replace() onto a dir fails
    with pytest.raises(OSError):
        write_json(verdict, target)
    assert sorted(os.listdir(tmp_path)) == ["occupied"]


# ------------------------------------------------------------------------------- JUnit

def test_junit_parses_with_counts(verdict, tmp_path):
    verdict.checks.append(CheckResult("golden/p1/prefill/L0/q", "error", "numeric",
                                      message="engine raised RuntimeError: boom"))
    p = tmp_path / "r.xml"
    write_junit(verdict, p)
    root = ET.parse(p).getroot()
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == len(verdict.checks) == int(suite.get("tests"))
    failures = [c for c in cases if c.find("failure") is not None]
    assert len(failures) == int(suite.get("failures")) == 2
    assert len([c for c in cases if c.find("error") is not None]) == int(suite.get("errors")) == 1
    assert len([c for c in cases if c.find("skipped") is not None]) == int(suite.get("skipped")) == 1
    tap = next(c for c in cases if c.get("name") == FAILING_TAP)
    assert tap.get("classname") == "kdtr.numeric"
    f = tap.find("failure")
    assert "exceeds atol" in f.get("message") and "min passing: atol=" in f.text
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["exit_code"] == "3" and props["verdict"] == "fail"


# ------------------------------------------------------------------------------- HTML

def test_html_self_contained_with_plot(verdict, tmp_path):
    p = tmp_path / "r.html"
    write_html(verdict, p)
    text = p.read_text()
    assert text.count("<svg") == 1 and FAILING_TAP in text
    assert "first divergence: attn_out L2" in text                # the highlight circle
    for external in ("<script", "src=", "href=", "<link"):
        assert external not in text
    ET.fromstring(text[text.index("<svg"):text.index("</svg>") + 6])   # the SVG is well-formed XML


def test_layer_series_parses_names(verdict):
    s = layer_series(verdict.checks)
    assert list(s) == ["golden/p0/prefill"] and sorted(s["golden/p0/prefill"]) == ["attn_out", "q"]
    pts = s["golden/p0/prefill"]["attn_out"]
    assert [l for l, _ in pts] == [0, 1, 2, 3]
    assert pts[2][1] > 1 and all(r <= 1 for l, r in pts if l != 2)


# ------------------------------------------------------------------------------- console

def test_console_shows_failures_divergence_and_min_passing(verdict):
    buf = io.StringIO()
    print_console(verdict, Console(file=buf, width=200, color_system=None))
    out = buf.getvalue()
    assert FAILING_TAP in out and "golden/p0/ar/tokens" in out and "first divergence" in out
    assert "(limit 0.001)" in out and "cause: local" in out          # error against its tolerance
    assert "golden/p0/prefill/L0/q" not in out                    # passing rows hidden by default
    assert "exit code 3 (TOKENS)" in out
    buf = io.StringIO()
    print_console(verdict, Console(file=buf, width=200, color_system=None), verbose=True)
    assert "golden/p0/prefill/L0/q" in buf.getvalue()
    assert "would pass at atol=" in buf.getvalue()                # the minimum passing tolerance


# ------------------------------------------------------------------------------- engine protocol

def test_check_engine_names_what_is_missing():
    class Partial:
        name, dtype, supports_teacher_forcing = "x", "bfloat8", True

        def load(self, bundle): ...
        def prefill(self, ids, positions): ...

    problems = check_engine(Partial())
    assert "method decode() missing" in problems and "method compact() missing" in problems
    assert "supports_teacher_forcing is True but run_layer() is missing" in problems
    assert "dtype must be 'float32', 'bfloat16' or 'float16', got 'bfloat8'" in problems
    assert asdict(Divergence("n", 0, "q", "prefill", None, 0, (0,), 1.0, 1.0))["cause"] is None
