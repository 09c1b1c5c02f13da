"""The diagnosis (conformance/verify/diagnose/) as every report shows it: one console line, JUnit
properties, an HTML panel. The JSON report carries the findings as they are, under "diagnosis".

A finding is {"id", "title", "kind": "matched" | "consistent", "score", "evidence"}, best first
(docs/diagnosis.md); an empty list at a failing verdict means that no known mistake explains it.
"""
from __future__ import annotations

import html

NONE = "no known mistake explains it"


def summary_line(findings: list[dict]) -> str:
    """The one line under the first divergence."""
    if not findings:
        return f"diagnosis: {NONE}"
    top = findings[0]
    if top["kind"] == "matched":
        more = "" if len(findings) == 1 else f" (+{len(findings) - 1} more in the reports)"
        return f"diagnosis: {top['id']} (matched, score {top['score']:.3g}): {top['evidence']}{more}"
    ids = ", ".join(x["id"] for x in findings[:4])
    return f"diagnosis: no recomputed mistake matches; consistent with {ids} ({top['evidence']})"


def finding_text(x: dict) -> str:
    return f"{x['id']} ({x['kind']}, score {x['score']:.3g}): {x['title']}. {x['evidence']}"


def junit_properties(findings: list[dict] | None) -> list[tuple[str, str]]:
    """("diagnosis", the summary line), then ("diagnosis.N", each finding); none when not diagnosed."""
    if findings is None:
        return []
    return [("diagnosis", summary_line(findings))] + [(f"diagnosis.{n}", finding_text(x))
                                                      for n, x in enumerate(findings, 1)]


def html_panel(findings: list[dict] | None) -> str:
    """The diagnosis panel: every finding with its kind, score and evidence; "" when not diagnosed."""
    if findings is None:
        return ""
    e = html.escape
    if not findings:
        return f"<div class='panel'><h2>Diagnosis</h2><p>{e(NONE)}.</p></div>"
    rows = "".join(f"<tr><td><code>{e(x['id'])}</code></td><td>{e(x['kind'])}</td><td>{x['score']:.3g}</td>"
                   f"<td>{e(x['title'])}</td><td>{e(x['evidence'])}</td></tr>" for x in findings)
    return ("<div class='panel'><h2>Diagnosis</h2><p>matched: recomputed under the mistake, the engine's tap "
            "agrees with it; consistent: only signatures of the verdict point at it.</p><table><tr><th>id</th>"
            f"<th>kind</th><th>score</th><th>mistake</th><th>evidence</th></tr>{rows}</table></div>")
