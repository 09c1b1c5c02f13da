"""A verdict as JUnit XML: one <testsuite>, one <testcase> per check, for CI systems that read JUnit."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from conformance.report.coverage import coverage_text
from conformance.report.verdict import CheckResult, Verdict, counts, fmt_value, write_report


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
    write_report(path, ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n")


