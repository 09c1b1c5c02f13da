"""Coverage: how many of the checks a bundle defines an engine's run actually made, per group.

An engine may skip taps it cannot produce (say `q` for an absorbed-MLA engine): the judge then reports
that check as skipped, never silently drops it, so every defined check is in the verdict and coverage is
a count over them. `--require-coverage FRACTION` (or `full` = 1) turns a shortfall into a failed check
of kind "coverage" (exit code 7, below every other failure: what ran, passed; conformance/verify/judge.py,
`coverage_check`).

Groups: prefill (prefill taps and logits), decode (teacher-forced decode taps and logits), tokens (the
AR stream), ddtree (stream, rounds, path logits, forward counts). Integrity checks are not counted.
"""
from __future__ import annotations

GROUPS = ("prefill", "decode", "tokens", "ddtree")
_PHASE_GROUP = {"prefill": "prefill", "ar": "decode", "ddtree": "ddtree"}


def check_group(c) -> str | None:
    """The coverage group of a check, None for checks outside coverage (integrity, errors, coverage)."""
    if c.kind in ("tokens", "ddtree"):
        return c.kind
    if c.kind == "numeric" and c.status != "error":
        parts = c.name.split("/")
        return _PHASE_GROUP.get(parts[1]) if len(parts) > 2 else None
    return None


def coverage(checks) -> dict:
    """{group: {"run": checks made, "defined": checks the bundle defines}} over GROUPS present, plus
    "total"; a check runs unless it was skipped."""
    cov = {g: {"run": 0, "defined": 0} for g in GROUPS}
    for c in checks:
        g = check_group(c)
        if g:
            cov[g]["defined"] += 1
            cov[g]["run"] += c.status != "skip"
    cov = {g: d for g, d in cov.items() if d["defined"]}
    if cov:
        cov["total"] = {k: sum(d[k] for d in cov.values()) for k in ("run", "defined")}
    return cov


def coverage_text(cov: dict) -> str:
    """"prefill 170/180, decode 48/48, tokens 2/2, ddtree 10/10 (total 230/240, 95.8%)"."""
    if not cov:
        return "no checks ran"
    parts = [f"{g} {d['run']}/{d['defined']}" for g, d in cov.items() if g != "total"]
    t = cov["total"]
    return ", ".join(parts) + f" (total {t['run']}/{t['defined']}, {100 * t['run'] / t['defined']:.1f}%)"


def skipped(checks) -> list[str]:
    return [c.name for c in checks if c.status == "skip" and check_group(c)]


def skip_reasons(checks, limit: int) -> list[str]:
    """"name (its own message)" for the first `limit` skipped checks: a tap the engine did not report,
    a DDTree round past a near-tie and a tolerance that judges nothing are different gaps."""
    return [f"{c.name} ({c.message or 'skipped'})" for c in checks if c.status == "skip" and check_group(c)][:limit]
