"""Verdicts and their reports: data classes, the exit code, and two file writers (JSON, JUnit XML; the HTML
report with its SVG plots is conformance/report/html.py, the console view conformance/report/console.py,
the diagnosis's parts conformance/report/diagnosis.py). Every file write is atomic.

Exit-code precedence when checks of several kinds fail (docs/conformance.md says why):
    integrity (5) > engine error (6) > tokens (3) > ddtree (4) > numeric (1) > coverage (7)
A check with status "error" counts as an engine error, except for kind "integrity" (the bundle).
"""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from conformance.report.diagnosis import junit_properties
from conformance.exit_codes import ExitCode
from conformance.report.coverage import coverage, coverage_text
from kdtr_format.paths import write_atomically

STATUSES = ("pass", "fail", "error", "skip")
KINDS = ("integrity", "numeric", "tokens", "ddtree", "coverage")
# Most severe first; the exit code is the first class present among the failures.
PRECEDENCE = (ExitCode.INVALID_FILE, ExitCode.ENGINE_ERROR, ExitCode.TOKENS, ExitCode.DDTREE,
              ExitCode.NUMERIC, ExitCode.COVERAGE)
_FAIL_CODE = {"integrity": ExitCode.INVALID_FILE, "numeric": ExitCode.NUMERIC,
              "tokens": ExitCode.TOKENS, "ddtree": ExitCode.DDTREE, "coverage": ExitCode.COVERAGE}
SCHEMA = "kdtr-verify/1"


@dataclass
class CheckResult:
    """One check: a tap, a token stream, a DDTree round set, a bundle checksum...
    `tolerance` is the rule applied (Rule.to_dict()), `min_passing` set only on numeric failures."""
    name: str
    status: str
    kind: str
    metrics: dict = field(default_factory=dict)
    tolerance: dict = field(default_factory=dict)
    message: str = ""
    min_passing: dict | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name!r}: status must be one of {STATUSES}, got {self.status!r}")
        if self.kind not in KINDS:
            raise ValueError(f"check {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")


@dataclass
class Divergence:
    """The first tap over tolerance in execution order. `local_error` is the tap's error when the
    layer ran on golden inputs (teacher forcing), `inherited_error` its error in the full run, on the
    engine's own inputs (what earlier layers passed on plus the local part); both None when the engine
    cannot run a layer alone. `cause` (conformance/verify/localize.py): "local" (over tolerance on golden
    inputs too), "inherited" (within tolerance there, over it on the engine's own reported inputs:
    sub-tolerance errors of earlier layers added up), "input" (within tolerance on both: what differs is
    an input no tap shows, such as positions, the cache rows read or the embedding), or None; `evidence`
    says what the cause rests on. The local check uses the same end-to-end tolerance, so a local fault
    smaller than it is not labelled local. `ranks`: in a sharded run (conformance/verify/judge_ranks.py), the
    ranks whose shard or copy of the record diverges first; None for a run of one process."""
    name: str                                # the check name, e.g. golden/p0/prefill/L3/q
    layer: int | None
    tap: str
    phase: str                               # "prefill", "ar", "ddtree"
    step: int | None
    token_position: int | None
    worst_index: tuple | None
    golden: float | None
    actual: float | None
    local_error: dict | None = None
    inherited_error: dict | None = None
    cause: str | None = None
    evidence: dict | None = None
    ranks: list | None = None


@dataclass
class Verdict:
    engine: str
    bundle: str
    checks: list[CheckResult]
    first_divergence: Divergence | None
    exit_code: ExitCode
    verdict: str                             # "pass", "fail" (a check failed) or "error"
    info: dict = field(default_factory=dict)  # free-form: engine dtype, timings, bundle sha256
    coverage: dict = field(default_factory=dict)  # conformance/report/coverage.py: per group {run, defined}
    diagnosis: list | None = None            # conformance/verify/diagnose/: at a failing verdict, best first
    done_by_kdtr: list = field(default_factory=list)  # steps kdtr performed for the engine, not judged
    #                                          ({"step", "what", "checks"}: conformance/verify/not_judged.py)


def exit_code_for(checks: list[CheckResult]) -> ExitCode:
    """The most severe failure class among `checks` (PRECEDENCE); OK when none failed."""
    present = set()
    for c in checks:
        if c.status == "error":
            present.add(ExitCode.INVALID_FILE if c.kind == "integrity" else ExitCode.ENGINE_ERROR)
        elif c.status == "fail":
            present.add(_FAIL_CODE[c.kind])
    return next((code for code in PRECEDENCE if code in present), ExitCode.OK)


def make_verdict(engine: str, bundle: str, checks: list[CheckResult],
                 first_divergence: Divergence | None = None, info: dict | None = None,
                 defined: dict | None = None, done_by_kdtr: list | None = None) -> Verdict:
    """`defined`: the checks the bundle defines (coverage.defined_checks), None when it could not be read;
    `done_by_kdtr`: the steps kdtr performed for the engine (not_judged.py)."""
    code = exit_code_for(checks)
    word = ("pass" if code == ExitCode.OK else
            "error" if code in (ExitCode.INVALID_FILE, ExitCode.ENGINE_ERROR) else "fail")
    return Verdict(engine, bundle, list(checks), first_divergence, code, word, dict(info or {}),
                   coverage(checks, defined), done_by_kdtr=list(done_by_kdtr or []))


def ran_text(v: Verdict) -> str:
    """"" when every check the bundle defines ran, else ", 412 of 470 checks ran (58 not run)": a run
    whose checks did not all run never reads as a plain PASS."""
    t = v.coverage.get("total")
    if t is None or t["run"] == t["defined"]:
        return ""
    return f", {t['run']} of {t['defined']} checks ran ({t['defined'] - t['run']} not run)"


def counts(checks: list[CheckResult]) -> dict[str, int]:
    return {s: sum(c.status == s for c in checks) for s in STATUSES}


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------

def _jsonable(x):
    """NumPy scalars/arrays -> Python; tuples -> lists; non-finite floats -> "inf", "-inf", "nan"
    (strict JSON has no such numbers)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def verdict_dict(v: Verdict) -> dict:
    return _jsonable({
        "schema": SCHEMA, "verdict": v.verdict, "exit_code": int(v.exit_code),
        "exit_name": v.exit_code.name, "engine": v.engine, "bundle": v.bundle,
        "counts": counts(v.checks), "coverage": v.coverage, "done_by_kdtr": v.done_by_kdtr, "info": v.info,
        "first_divergence": asdict(v.first_divergence) if v.first_divergence else None,
        "diagnosis": v.diagnosis or [], "checks": [asdict(c) for c in v.checks],
    })


def write_text(path: str | Path, data: str) -> None:
    """Readers never see half a report (kdtr_format.paths.write_atomically); a device, FIFO or
    /dev/stdout given as the report path is written directly, never replaced by a file."""
    write_atomically(path, lambda fh: fh.write(data.encode("utf-8")), stream_ok=True)


def write_json(v: Verdict, path: str | Path) -> None:
    write_text(path, json.dumps(verdict_dict(v), indent=2, allow_nan=False) + "\n")


# ---------------------------------------------------------------------------------------------
# How a check's numbers read (console, JUnit, HTML)
# ---------------------------------------------------------------------------------------------

def fmt_value(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _detail(c: CheckResult) -> str:
    lines = [c.message] if c.message else []
    for label, d in (("metrics", c.metrics), ("tolerance", c.tolerance), ("min passing", c.min_passing)):
        if d:
            flat = {k: v for k, v in d.items() if not isinstance(v, (dict, list))}
            lines.append(f"{label}: " + ", ".join(f"{k}={fmt_value(v)}" for k, v in flat.items()))
    return "\n".join(lines)


def write_junit(v: Verdict, path: str | Path) -> None:
    """One <testsuite> with one <testcase> per check (classname kdtr.<kind>); failures carry the
    message as attribute and the metrics, tolerance and minimum passing tolerance as text."""
    n = counts(v.checks)
    suites = ET.Element("testsuites", name="kdtr verify", tests=str(len(v.checks)),
                        failures=str(n["fail"]), errors=str(n["error"]), skipped=str(n["skip"]))
    suite = ET.SubElement(suites, "testsuite", name=f"kdtr verify {v.engine} {v.bundle}",
                          tests=str(len(v.checks)), failures=str(n["fail"]), errors=str(n["error"]),
                          skipped=str(n["skip"]))
    props = ET.SubElement(suite, "properties")
    for k, val in (("verdict", v.verdict), ("exit_code", int(v.exit_code)), ("engine", v.engine),
                   ("bundle", v.bundle), ("coverage", coverage_text(v.coverage)),
                   *((f"done_by_kdtr.{d['step']}", f"not judged: {d['what']}") for d in v.done_by_kdtr),
                   *junit_properties(v.diagnosis)):
        ET.SubElement(props, "property", name=k, value=str(val))
    for c in v.checks:
        case = ET.SubElement(suite, "testcase", classname=f"kdtr.{c.kind}", name=c.name)
        tag = {"fail": "failure", "error": "error", "skip": "skipped"}.get(c.status)
        if tag:
            el = ET.SubElement(case, tag, message=c.message or c.status,
                               type=f"kdtr.{c.kind}" if tag != "skipped" else "skip")
            if tag != "skipped":
                el.text = _detail(c)
    ET.indent(suites)
    write_text(path, ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n")


# ---------------------------------------------------------------------------------------------
# Per-layer error series (for the HTML plots)
# ---------------------------------------------------------------------------------------------


_SUMMARY_KEYS = {
    "metrics": ("max_abs", "max_rel", "max_ulp", "nmse", "cosine", "ratio", "mismatch_count", "kl_max"),
    "tolerance": ("atol", "rtol", "nmse", "max_ulp", "mode"),
    "min_passing": ("atol", "rtol", "nmse", "max_ulp", "multiplier"),
}


def metric_summary(d: dict | None, role: str = "metrics") -> str:
    """The few numbers worth a table cell; dicts without the usual keys show their first scalars."""
    if not d:
        return ""
    keys = [k for k in _SUMMARY_KEYS[role] if d.get(k) is not None]
    keys = keys or [k for k, v in d.items() if not isinstance(v, (dict, list))][:6]
    return ", ".join(f"{k}={fmt_value(d[k])}" for k in keys)


def error_ratio(c: CheckResult) -> float | None:
    """How far a numeric check is from its tolerance (<= 1 passes): metrics["ratio"] from
    tolerance.check_tap, else max_abs / atol."""
    if "ratio" in c.metrics:
        return float(c.metrics["ratio"])
    if "max_abs" in c.metrics and c.tolerance.get("atol"):
        return float(c.metrics["max_abs"]) / float(c.tolerance["atol"])
    return None
