"""Verdicts and their reports: data classes, the exit code, and three file writers (JSON, JUnit XML, one
self-contained HTML file with inline SVG plots; the console view is conformance/report/console.py). Every file
write is atomic.

Exit-code precedence when checks of several kinds fail (docs/conformance.md says why):

    integrity (5) > engine error (6) > tokens (3) > ddtree (4) > numeric (1) > coverage (7)

A check with status "error" counts as an engine error, except for kind "integrity" (the bundle).
"""
from __future__ import annotations

import html
import json
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from conformance.report.coverage import coverage, coverage_text
from conformance.exit_codes import ExitCode
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
                 first_divergence: Divergence | None = None, info: dict | None = None) -> Verdict:
    code = exit_code_for(checks)
    word = ("pass" if code == ExitCode.OK else
            "error" if code in (ExitCode.INVALID_FILE, ExitCode.ENGINE_ERROR) else "fail")
    return Verdict(engine, bundle, list(checks), first_divergence, code, word, dict(info or {}),
                   coverage(checks))


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
        "counts": counts(v.checks), "coverage": v.coverage, "info": v.info,
        "first_divergence": asdict(v.first_divergence) if v.first_divergence else None,
        "checks": [asdict(c) for c in v.checks],
    })


def _atomic_write(path: str | Path, data: str) -> None:
    """Readers never see half a report (kdtr_format.paths.write_atomically); a device, FIFO or
    /dev/stdout given as the report path is written directly, never replaced by a file."""
    write_atomically(path, lambda fh: fh.write(data.encode("utf-8")), stream_ok=True)


def write_json(v: Verdict, path: str | Path) -> None:
    _atomic_write(path, json.dumps(verdict_dict(v), indent=2, allow_nan=False) + "\n")


# ---------------------------------------------------------------------------------------------
# JUnit XML
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
                   ("bundle", v.bundle), ("coverage", coverage_text(v.coverage))):
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
    _atomic_write(path, ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n")


# ---------------------------------------------------------------------------------------------
# Per-layer error series (for the HTML plots)
# ---------------------------------------------------------------------------------------------

_LAYER_TAP = re.compile(r"^(?P<group>.*?)/?L(?P<layer>\d+)/(?P<tap>[^/]+)$")
RATIO_FLOOR = 1e-6                            # plotted floor for exact matches (log10 -> -6)


def error_ratio(c: CheckResult) -> float | None:
    """How far a numeric check is from its tolerance (<= 1 passes): metrics["ratio"] from
    tolerance.check_tap, else max_abs / atol."""
    if "ratio" in c.metrics:
        return float(c.metrics["ratio"])
    if "max_abs" in c.metrics and c.tolerance.get("atol"):
        return float(c.metrics["max_abs"]) / float(c.tolerance["atol"])
    return None


def layer_series(checks: list[CheckResult]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{group: {tap: [(layer, ratio), ...]}} for numeric checks named ".../L{l}/{tap}"; the group
    is the name before L{l} (prompt and phase, e.g. golden/p0/prefill)."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for c in checks:
        m = _LAYER_TAP.match(c.name)
        r = error_ratio(c) if c.kind == "numeric" else None
        if m and r is not None:
            out.setdefault(m["group"], {}).setdefault(m["tap"], []).append((int(m["layer"]), r))
    for taps in out.values():
        for pts in taps.values():
            pts.sort()
    return out


def _y(r: float) -> float:
    return math.log10(max(r, RATIO_FLOOR)) if math.isfinite(r) else 3.0


def svg_plot(group: str, taps: dict[str, list[tuple[int, float]]], highlight: tuple[int, str] | None,
             width: int = 640, height: int = 260) -> str:
    """log10(error / tolerance) per layer, a line per tap, the threshold at 0, and the first
    divergence (layer, tap) circled. Infinite ratios are drawn at +3, exact matches at -6."""
    pad_l, pad_r, pad_t, pad_b = 44, 150, 22, 28
    layers = [l for pts in taps.values() for l, _ in pts]
    ys = [_y(r) for pts in taps.values() for _, r in pts]
    x0, x1 = min(layers), max(max(layers), min(layers) + 1)
    y0, y1 = min(min(ys), -1.0), max(max(ys), 1.0)
    pw, ph = width - pad_l - pad_r, height - pad_t - pad_b

    def px(l):
        return pad_l + (l - x0) / (x1 - x0) * pw

    def py(y):
        return pad_t + (y1 - y) / (y1 - y0) * ph

    e = html.escape
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="{e(group)}">',
             f'<text x="{pad_l}" y="14" font-size="12">{e(group)}: log10(error / tolerance) per layer</text>',
             f'<rect x="{pad_l}" y="{pad_t}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
             f'<line x1="{pad_l}" y1="{py(0):.1f}" x2="{pad_l + pw}" y2="{py(0):.1f}" '
             f'stroke="#d00" stroke-dasharray="4 3"/>',
             f'<text x="4" y="{py(0) + 4:.1f}" font-size="10" fill="#d00">0</text>',
             f'<text x="4" y="{py(y1) + 4:.1f}" font-size="10">{y1:.0f}</text>',
             f'<text x="4" y="{py(y0) + 4:.1f}" font-size="10">{y0:.0f}</text>']
    for l in sorted(set(layers)):
        parts.append(f'<text x="{px(l):.1f}" y="{height - 8}" font-size="10" '
                     f'text-anchor="middle">L{l}</text>')
    for i, (tap, pts) in enumerate(sorted(taps.items())):
        color = f"hsl({i * 360 // max(len(taps), 1)},65%,42%)"
        path = " ".join(f"{px(l):.1f},{py(_y(r)):.1f}" for l, r in pts)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5">'
                     f'<title>{e(tap)}</title></polyline>')
        for l, r in pts:
            parts.append(f'<circle cx="{px(l):.1f}" cy="{py(_y(r)):.1f}" r="2.5" fill="{color}">'
                         f'<title>{e(tap)} L{l}: ratio {r:.3g}</title></circle>')
        ly = pad_t + 10 + i * 12
        parts.append(f'<text x="{width - pad_r + 8}" y="{ly}" font-size="10" fill="{color}">'
                     f'{e(tap)}</text>')
    if highlight:
        for l, r in taps.get(highlight[1], []):
            if l == highlight[0]:
                parts.append(f'<circle cx="{px(l):.1f}" cy="{py(_y(r)):.1f}" r="7" fill="none" '
                             f'stroke="#d00" stroke-width="2"><title>first divergence: '
                             f'{e(highlight[1])} L{l}</title></circle>')
    parts.append("</svg>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------

_CSS = """body{font:14px system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;
margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:12px}
.pass{color:#070}.fail,.error{color:#c00;font-weight:bold}.skip{color:#888}
.panel{border:2px solid #c00;padding:.5em 1em;background:#fff4f4}code{font-size:12px}"""


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


def write_html(v: Verdict, path: str | Path) -> None:
    """One static file: the verdict, the first-divergence panel, per-layer SVG plots, and the check
    table (failures first). No scripts, no external assets."""
    e = html.escape
    n = counts(v.checks)
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kdtr verify: {e(v.engine)}"
           f"</title><style>{_CSS}</style></head><body>",
           f"<h1>kdtr verify: <span class='{e(v.verdict)}'>{e(v.verdict.upper())}</span></h1>",
           f"<p>engine <code>{e(v.engine)}</code>, bundle <code>{e(v.bundle)}</code>, exit code "
           f"{int(v.exit_code)} ({e(v.exit_code.name)}); {n['pass']} passed, {n['fail']} failed, "
           f"{n['error']} errors, {n['skip']} skipped.</p>",
           f"<p>coverage (checks run / checks the bundle defines): {e(coverage_text(v.coverage))}</p>"]
    d = v.first_divergence
    if d:
        rows = "".join(f"<tr><th>{e(k)}</th><td>{e(fmt_value(val))}</td></tr>"
                       for k, val in asdict(d).items() if val is not None)
        out.append(f"<div class='panel'><h2>First divergence: {e(d.name)}</h2><table>{rows}</table></div>")
    series = layer_series(v.checks)
    if series:
        out.append("<h2>Per-layer error (above the red line fails)</h2>")
        for group, taps in series.items():
            dm = _LAYER_TAP.match(d.name) if d else None
            hl = (int(dm["layer"]), dm["tap"]) if dm and dm["group"] == group else None
            out.append(svg_plot(group, taps, hl))
    order = {"error": 0, "fail": 1, "skip": 2, "pass": 3}
    out.append("<h2>Checks</h2><table><tr><th>check</th><th>kind</th><th>status</th>"
               "<th>metrics</th><th>tolerance</th><th>min passing</th><th>message</th></tr>")
    for c in sorted(v.checks, key=lambda c: order[c.status]):
        out.append(f"<tr><td><code>{e(c.name)}</code></td><td>{e(c.kind)}</td>"
                   f"<td class='{c.status}'>{c.status}</td><td>{e(metric_summary(c.metrics))}</td>"
                   f"<td>{e(metric_summary(c.tolerance, 'tolerance'))}</td>"
                   f"<td>{e(metric_summary(c.min_passing, 'min_passing'))}"
                   f"</td><td>{e(c.message)}</td></tr>")
    out.append("</table></body></html>\n")
    _atomic_write(path, "\n".join(out))
