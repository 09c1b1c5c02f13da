"""The HTML report: one static file (no scripts, no external assets) with the verdict, the first-divergence
panel, per-layer SVG plots of error / tolerance, and the check table, failures first. Every value is
printed as text a reader knows (numbers, `key=value` lists), never as a Python repr."""
from __future__ import annotations

import html
import math
import re
from dataclasses import asdict
from pathlib import Path

from conformance.report.console import count_line
from conformance.report.coverage import coverage_text
from conformance.report.diagnosis import html_panel
from conformance.report.verdict import (CheckResult, Verdict, error_ratio, fmt_value, metric_summary, ran_text,
                                        write_text)

_LAYER_TAP = re.compile(r"^(?P<group>.*?)/?L(?P<layer>\d+)/(?P<tap>[^/]+)$")
RATIO_FLOOR = 1e-6                            # plotted floor for exact matches (log10 -> -6)


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


# One colour per tap, the same in every plot, 12 that tell apart at a glance (the even hue steps gave
# neighbouring taps such as mlp_in / mlp_out the same-looking colour); the legend lists taps in execution order.
TAP_COLOURS = {"attn_in": "#1f77b4", "q": "#ff7f0e", "kv_latent": "#2ca02c", "k_pe": "#d62728",
               "attn_out": "#9467bd", "resid_attn": "#8c564b", "mlp_in": "#e377c2", "router_scores": "#7f7f7f",
               "topk_ids": "#bcbd22", "topk_weights": "#17becf", "mlp_out": "#000000", "resid_out": "#ffbf00"}
_TAP_ORDER = {t: i for i, t in enumerate(TAP_COLOURS)}


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
    for i, (tap, pts) in enumerate(sorted(taps.items(), key=lambda kv: _TAP_ORDER.get(kv[0], 99))):
        color = TAP_COLOURS.get(tap, "#555")
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


def write_html(v: Verdict, path: str | Path) -> None:
    """One static file: the verdict, the first-divergence panel, per-layer SVG plots, and the check
    table (failures first). No scripts, no external assets."""
    e = html.escape
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kdtr verify: {e(v.engine)}"
           f"</title><style>{_CSS}</style></head><body>",
           f"<h1>kdtr verify: <span class='{e(v.verdict)}'>{e(v.verdict.upper())}</span>{e(ran_text(v))}</h1>",
           f"<p>engine <code>{e(v.engine)}</code>, bundle <code>{e(v.bundle)}</code>, exit code "
           f"{int(v.exit_code)} ({e(v.exit_code.name)}).</p>", f"<p>{e(count_line(v).split('; coverage')[0])}</p>",
           f"<p>coverage (checks run / checks the bundle defines): {e(coverage_text(v.coverage))}</p>"]
    if v.done_by_kdtr:
        items = "".join(f"<li>{e(d['what'])}: {e(d['why'])} ({d['checks']} checks not counted as covered)</li>"
                        for d in v.done_by_kdtr)
        out.append(f"<h2>Done by kdtr, not judged</h2><ul>{items}</ul>")
    d = v.first_divergence
    if d:
        rows = "".join(f"<tr><th>{e(k.replace('_', ' '))}</th><td>{e(_cell(val))}</td></tr>"
                       for k, val in asdict(d).items() if val is not None)
        out.append(f"<div class='panel'><h2>First divergence: {e(d.name)}</h2><table>{rows}</table></div>")
    out.append(html_panel(v.diagnosis))
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
    write_text(path, "\n".join(out))


def _cell(val) -> str:
    """A panel value as text: a dict as `key=value, ...` (booleans as yes/no), a list as its items."""
    if isinstance(val, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in val.items())
    if isinstance(val, (list, tuple)):
        return ", ".join(_cell(v) for v in val)
    if isinstance(val, bool):
        return "yes" if val else "no"
    return fmt_value(val)
