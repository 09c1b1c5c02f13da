"""Judging an engine's outputs (run-dump names, docs/run-dump.md) against a bundle's goldens, one
prompt at a time, one place per kind of check:

1. taps (conformance/verify/judge_taps.py): every tap in execution order, with the tolerances of the
   run's precision profile (conformance/precision.py) or a rules file; the first failure in execution
   order is the first divergence;
2. tokens (judge_tokens.py): the engine's argmax at every golden step equals the golden token;
3. DDTree (judge_ddtree.py): the replay's stream, rounds, path logits and forward counts;
4. the live DDTree (judge_live.py): for an engine that ran its own DDTree loop too, trees vs golden.

Then one named check per long-position prompt, and, on request, the coverage check. Tokens and expert
choices at near-ties of the profile that the engine's own reported numbers explain
(conformance/verify/near_ties.py) are reported, not failed; under the fp32 profile there are none.
"""
from __future__ import annotations

from conformance.records import position_offset, prompts_of
from conformance.report.coverage import LIVE_CHECKS, coverage, coverage_text, not_run, skip_reasons
from conformance.report.verdict import CheckResult, Divergence
from conformance.verify.context import Prompt, Run
from conformance.verify.judge_ddtree import ddtree_checks
from conformance.verify.judge_live import live_checks, live_tie_row
from conformance.verify.judge_taps import tap_checks
from conformance.verify.judge_tokens import token_check
from conformance.verify.outputs import LIVE, InvalidOutputs, has_live, validate_outputs, widened
from conformance.verify.tree_ties import GoldenDrafts


def judge(run: Run, out: dict) -> tuple[list[CheckResult], Divergence | None]:
    """All checks for outputs `out` (run-dump names) against the bundle of `run`, and the first divergence
    in execution order (earliest prompt, then prefill, then the earliest decode step).
    Raises InvalidOutputs (every problem, each naming its record) when `out` breaks docs/run-dump.md:
    every check below may then rely on the required records (conformance/verify/outputs.py, REQUIRED)."""
    problems = validate_outputs(run.f, out, run.dtype, run.cfg)
    if problems:
        raise InvalidOutputs(problems)
    out = widened(out, run.dtype)
    checks, first, drafts = [], None, GoldenDrafts(run.f)            # drafts: computed only if a tree differs
    for i in prompts_of(run.f):
        pr = Prompt.of(run, i)
        taps, divergence = tap_checks(pr, out)
        checks += taps
        if first is None:
            first = divergence
        checks.append(token_check(pr, out))
        ar_ok = all(c.status == "pass" for c in taps if c.name == pr.p + "ar/logits")
        checks += ddtree_checks(pr, out, ar_ok)
        if has_live(out, i):     # its router runs freely: on a held fp32 bundle, judged up to a routing near-tie
            checks += live_checks(pr, out, drafts, ar_ok, live_tie_row(pr))
        elif "drafter_config" in run.f.metadata:                         # defined by the bundle: not run
            checks += [CheckResult(f"{pr.p}{LIVE}/{c}", "skip", "ddtree", message=(
                f"not run: the outputs hold no {LIVE}/ group (the engine's own DDTree loop, ddtree_generate; "
                f"docs/run-dump.md §2)")) for c in LIVE_CHECKS]
    checks += long_position_checks(run.f, checks)
    return checks, first


def long_position_checks(f, checks: list[CheckResult]) -> list[CheckResult]:
    """One named check per long-position prompt (docs/golden-bundles.md): its own verdict, which says what
    a failure there alone means. Such a prompt computes, in exact arithmetic, what it would at position 0
    (RoPE is relative); only the absolute rotations (q, k_pe) and float32 angle rounding differ."""
    out = []
    for i in prompts_of(f):
        pos0 = position_offset(f, i)
        if not pos0:
            continue
        bad = lambda c: c.status in ("fail", "error")  # noqa: E731
        here = [c for c in checks if c.name.startswith(f"p{i}/") and bad(c)]
        elsewhere = [c for c in checks if c.name.startswith("p") and not c.name.startswith(f"p{i}/") and bad(c)]
        name, metrics = f"p{i}/long_position", {"position_offset": pos0, "failed_checks": len(here)}
        if not here:
            out.append(CheckResult(name, "pass", "numeric", metrics, {"exact": True}))
            continue                                     # failing: the kind of its first failure (exit code)
        why = (f"the long-position prompt p{i} (positions {pos0}..) fails {len(here)} check(s), first {here[0].name}, ")
        why += ("and other prompts fail too: look at their first divergence first" if elsewhere else
                "while every prompt at positions from 0 passes: the engine does not rotate at the positions it is "
                "given (e.g. it derives them from its cache length, which holds only this prompt's rows) or "
                "forms RoPE angles in float32 (off by up to ~4e-3 rad at this position)")
        out.append(CheckResult(name, "fail", here[0].kind, metrics, {"exact": True}, why))
    return out


def coverage_check(checks: list[CheckResult], required: float, defined: dict | None,
                   done_by_kdtr: list | None = None) -> CheckResult:
    """Passes when every group ran at least `required` (0..1) of the checks the bundle defines (`defined`,
    coverage.defined_checks); a step kdtr performed for the engine (`done_by_kdtr`) is named in the message."""
    cov = coverage(checks, defined)
    short = [g for g, d in cov.items() if g != "total" and d["run"] / d["defined"] < required - 1e-12]
    metrics = {g: f"{d['run']}/{d['defined']}" for g, d in cov.items()}
    tol = {"required": required}
    if not cov:
        return CheckResult("coverage", "fail", "coverage", metrics, tol, "the bundle defines no checks")
    if not short:
        return CheckResult("coverage", "pass", "coverage", metrics, tol)
    names = not_run(checks, defined)
    want = "full" if required >= 1 else f"{required:g}"
    kdtr = "; ".join(f"{d['what']} done by kdtr, not judged ({d['checks']} checks)" for d in done_by_kdtr or [])
    reasons = skip_reasons(checks, 3) or names[:3]
    msg = (f"coverage {coverage_text(cov)} is below the required {want} in {', '.join(short)}; "
           f"{len(names)} not run" + (f" ({kdtr})" if kdtr else "") + f", first: {'; '.join(reasons)}")
    return CheckResult("coverage", "fail", "coverage", metrics, tol, msg)
