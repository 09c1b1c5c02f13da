"""The conformance runner behind `kdtr verify`: one verdict over taps, token streams and DDTree.

Two ways in, one judge. A live engine (conformance.engines.protocol.Engine) is driven by `collect`
(conformance/verify/collect.py), which returns its outputs under the run-dump names of docs/run-dump.md; an
external engine writes a `.kdtr` run dump with the same names itself (conformance/records.py reads it).
`judge` (conformance/verify/judge.py) compares either against the bundle's goldens; the first numeric failure
in execution order is the first divergence, and with a live engine that can run one layer alone,
`localize` (conformance/verify/localize.py) re-runs that layer on golden inputs to tell a local fault from
inherited error. The bundle's config and the chosen profile are resolved once, into a `Run`
(conformance/verify/context.py), which collection, judge and localizer share. A failing verdict is then diagnosed (conformance/verify/diagnose/, docs/diagnosis.md):
which known mistake, recomputed, the engine's taps agree with.
"""
from __future__ import annotations

import os
import tempfile
import time

from conformance.engines.protocol import check_engine
from conformance.precision import PROFILE_OF_DTYPE, holds_routing
from conformance.records import check_schema, dump_made_from_other, dump_routing, prompts_of, read_dump, write_dump
from conformance.report.coverage import defined_checks
from conformance.report.verdict import CheckResult, make_verdict
from conformance.verify.collect import can_hold_routing, collect
from conformance.verify.context import Run
from conformance.verify.judge import coverage_check, judge
from conformance.verify.diagnose import diagnose
from conformance.verify.judge_ranks import judge_ranks, read_dump_dir
from conformance.verify.localize import localize
from conformance.verify.not_judged import kdtr_steps, mark_not_judged
from conformance.verify.outputs import InvalidOutputs
from conformance.verify.preflight import preflight_localisation
from kdtr_format import KdtrError, open_kdtr


def verify(bundle: str, engine=None, dump: str | None = None, overrides=(), progress=None,
           save_dump: str | None = None, require_coverage: float | None = None, profile: str | None = None,
           announce=None, dump_dir: str | None = None, save_dump_dir: str | None = None):
    """Judge `engine` (live) or `dump` (a run dump) against `bundle`; returns a report.Verdict.
    `require_coverage` (0..1): add a coverage check that fails (exit 7) when a group of checks ran
    less than that fraction of the checks the bundle defines (conformance/report/coverage.py).
    `profile`: the precision profile to judge with (fp32 or bf16, conformance/precision.py); None = the
    one of the engine's (or the dump's) dtype. Raises ProfileError when the bundle lacks it.
    `announce(line)`: told before the run, in one line, when localisation will not work and why
    (conformance/verify/preflight.py).
    `dump_dir`: judge a sharded run's rank dumps instead (rank{r}.kdtr, conformance/verify/judge_ranks.py);
    a sharded engine (conformance/engines/shard_run.py) writes them, into `save_dump_dir` when given, and
    is judged the same way."""
    t0 = time.perf_counter()
    name = "dump" if dump or dump_dir else str(getattr(engine, "name", "engine"))
    try:
        f = _open_checked(bundle, progress)
    except KdtrError as e:
        return make_verdict(name, bundle, [CheckResult("bundle/integrity", "error", "integrity", message=str(e))])
    with f:
        checks = [CheckResult("bundle/integrity", "pass", "integrity",
                              {"tensors": len(f.names), "checksums": "verified"})]
        defined = defined_checks(f)                                      # from the bundle alone
        steps = {}                                                       # what kdtr does for the engine

        def verdict(checks, first=None, info=None):
            return make_verdict(name, os.fspath(bundle), checks, first, info, defined,
                                mark_not_judged(checks, steps, f))
        if dump_dir is not None or getattr(engine, "sharded", False):
            return _verify_ranks(f, bundle, name, checks, engine, dump_dir, save_dump_dir, overrides,
                                 require_coverage, profile, t0, defined)
        other = dump_made_from_other(dump, f) if dump else None
        if other:
            checks.append(CheckResult("dump/bundle", "error", "integrity", message=f"{dump}: {other}"))
            return verdict(checks)
        lacks = check_engine(engine) if dump is None else []
        if lacks:                                                        # before step 37, not during it
            checks.append(CheckResult("engine/run", "error", "numeric",
                                      message=f"not an engine (conformance/engines/protocol.py): {'; '.join(lacks)}"))
            return verdict(checks)
        run = None
        if engine is not None and dump is None:                          # a missing profile: say so before
            run = Run.of(f, profile or PROFILE_OF_DTYPE.get(engine.dtype, "fp32"), overrides, engine.dtype)
        held = bool(run and run.holds_routing) and can_hold_routing(engine)   # what collect will do
        unlocalised = None
        try:
            out, dtype, unlocalised = _outputs(f, engine, dump, progress, run, announce)
        except KdtrError as e:                                           # the dump's, or the bundle cut meanwhile
            label = "bundle/integrity" if not dump or str(e).startswith(os.fspath(bundle)) else "dump/integrity"
            checks.append(CheckResult(label, "error", "integrity",
                                      message=str(e) if label == "bundle/integrity" else f"{dump}: {e}"))
            return verdict(checks)
        except Exception as e:  # noqa: BLE001 - any failure inside the engine under test is its error
            checks.append(CheckResult("engine/run", "error", "numeric",
                                      message=f"{type(e).__name__}: {e}"))
            return verdict(checks)
        t1 = time.perf_counter()
        steps.update(kdtr_steps(engine if dump is None else None, f, dump))
        if run is None:                                                  # a dump: its dtype picks the profile
            run = Run.of(f, profile or PROFILE_OF_DTYPE.get(dtype, "fp32"), overrides, dtype)
        try:
            judged, first = judge(run, out)
        except InvalidOutputs as e:                                      # a bad dump is a bad file (5);
            kind, label = ("integrity", "dump/structure") if dump else ("numeric", "engine/outputs")  # a bad engine, 6
            checks.append(CheckResult(label, "error", kind, {"problems": e.problems}, message=str(e)))
            return verdict(checks)
        except KdtrError as e:                                           # the bundle changed while being read
            checks.append(CheckResult("bundle/integrity", "error", "integrity", message=str(e)))
            return verdict(checks)
        saved = (_save_dump(f, out, save_dump, engine, name, dtype, held, steps)
                 if save_dump and dump is None else None)
        _say_why_unobserved(judged, getattr(engine, "unobserved", None) or {})
        if first is not None and unlocalised is not None:               # said up front; not tried again
            if getattr(engine, "supports_teacher_forcing", False):      # (an engine without it: no cause)
                first.cause = f"not localised: {unlocalised}"
        elif first is not None and engine is not None and dump is None:
            try:
                first = localize(engine, run, first, judged, out)
            except Exception as e:  # noqa: BLE001 - localisation is best effort; the verdict stands
                first.cause = f"not localised: run_layer raised {type(e).__name__}: {e}"
        t2, diagnosis, why = time.perf_counter(), None, None
        if any(c.status == "fail" for c in judged):
            try:
                diagnosis = diagnose(engine if dump is None else None, f, first, judged, out, overrides, dtype,
                                     run.profile)
            except Exception as e:  # noqa: BLE001 - the diagnosis is best effort, like localize; the verdict stands
                why = f"the diagnosis could not run: {type(e).__name__}: {e}"
        done = mark_not_judged(judged, steps, f)                        # before coverage counts them
        if require_coverage is not None:
            judged.append(coverage_check(judged, require_coverage, defined, done))
        info = {"dtype": dtype, "profile": run.profile,
                "routing": _routing_info(engine, dump, run.profile, held, run.holds_routing),
                "localisation": None if dump else (unlocalised or "ready: run_layer answered on golden inputs"),
                "engine_seconds": round(t1 - t0, 3),
                "judge_seconds": round(t2 - t1, 3), "diagnosis_seconds": round(time.perf_counter() - t2, 3),
                "prompts": len(prompts_of(f)), "bundle_figures": f.metadata.get("figures", {})}
        if saved is not None:
            info["save_dump"] = saved
        if why:
            info["diagnosis_error"] = why
        v = make_verdict(name, os.fspath(bundle), checks + judged, first, info, defined, done)
        v.diagnosis = diagnosis
        return v


def _open_checked(bundle: str, progress=None):
    """The bundle opened privately (every tensor read is a checksum-checked copy: a file cut or rewritten
    during the run is a KdtrError, never a SIGBUS), its metadata and tensor names checked against the
    bundle schema before any byte is hashed, then every checksum verified with progress in MiB."""
    f = open_kdtr(bundle, private=True)
    try:
        check_schema(f, bundle)
        step = None if progress is None else (lambda done, total: progress("checksums (MiB)", done >> 20, total >> 20,
                                                                           None))
        f.verify(progress=step)
    except BaseException:
        f.close()
        raise
    return f


def _save_dump(f, out: dict, path: str, engine, name: str, dtype: str, held: bool, steps: dict) -> dict:
    """Write the run dump; {"path": path} when written, plus "error" (one line) when the write failed: the
    verdict stands, and the caller reports the failure with the other reports."""
    own = engine.dump_metadata() if callable(getattr(engine, "dump_metadata", None)) else None
    try:
        write_dump(out, path, name, dtype, f.metadata.get("provenance", {}).get("command", ""), own,
                   routing="held" if held else "free", bundle_sha256=f.header_sha256, done_by_kdtr=steps)
    except OSError as e:
        return {"path": path, "error": e.strerror or str(e)}
    return {"path": path}


def _verify_ranks(f, bundle, name, checks, engine, dump_dir, save_dump_dir, overrides, require_coverage, profile, t0,
                  defined=None):
    """A sharded run: the rank dumps of `dump_dir`, or those the sharded engine writes now (into
    `save_dump_dir`, else a temporary folder), judged rank by rank; no localisation (no layer runs alone)."""
    with tempfile.TemporaryDirectory(prefix="kdtr-rank-dumps-") as tmp:
        folder = dump_dir
        if engine is not None:
            folder = save_dump_dir or tmp
            os.makedirs(folder, exist_ok=True)
            try:
                engine.run(os.fspath(bundle), folder)
            except Exception as e:  # noqa: BLE001 - any failure of a rank is the engine's error
                checks.append(CheckResult("engine/run", "error", "numeric", message=f"{type(e).__name__}: {e}"))
                return make_verdict(name, bundle, checks, defined=defined)
        t1 = time.perf_counter()
        try:
            outs, metas, dtype, _ = read_dump_dir(folder)
        except KdtrError as e:
            checks.append(CheckResult("dump/integrity", "error", "integrity", message=f"{folder}: {e}"))
            return make_verdict(name, bundle, checks, defined=defined)
        profile = profile or PROFILE_OF_DTYPE.get(dtype, "fp32")
        try:
            judged, first, summary = judge_ranks(f, outs, metas, overrides, dtype, profile)
        except InvalidOutputs as e:                # a bad dump is a bad file (5), a bad engine's outputs an error (6)
            kind, label = ("integrity", "dump/structure") if dump_dir else ("numeric", "engine/outputs")
            checks.append(CheckResult(label, "error", kind, {"problems": e.problems}, message=str(e)))
            return make_verdict(name, bundle, checks, defined=defined)
        done = mark_not_judged(judged, kdtr_steps(engine, f), f)
        if require_coverage is not None:
            judged.append(coverage_check(judged, require_coverage, defined, done))
        info = {"dtype": dtype, "profile": profile, "shard": summary,
                "routing": _routing_info(None, os.path.join(folder, "rank0.kdtr"), profile, False,
                                         holds_routing(f.metadata, profile)),
                "engine_seconds": round(t1 - t0, 3), "judge_seconds": round(time.perf_counter() - t1, 3),
                "prompts": len(prompts_of(f)), "bundle_figures": f.metadata.get("figures", {})}
        return make_verdict(name, os.fspath(bundle), checks + judged, first, info, defined, done)


def _say_why_unobserved(checks, why: dict) -> None:
    """A skipped tap that the engine said it cannot observe carries the engine's reason."""
    for c in checks:
        tap = c.name.rsplit("/", 1)[-1]
        if c.status == "skip" and tap in why:
            c.message = f"not observable: {why[tap]}"


def _routing_info(engine, dump, profile: str, held: bool, derived_held: bool) -> str:
    """How the expert sets the engine computed with were chosen (docs/conformance.md §3a). A live run:
    what the runner did; a run dump: what its metadata `routing` says (the runner cannot hold a finished
    run's routing; docs/run-dump.md). `derived_held`: the profile was derived with routing held."""
    caveat = (f", but the {profile} profile was derived with routing held to the golden expert sets, so a "
              f"near-tie expert flip also moves the taps after it") if derived_held else ""
    if dump is not None:
        said = dump_routing(dump)
        if said == "held":
            return "held to the golden expert sets by the run that wrote this dump (its metadata routing: held)"
        if said == "free":
            return "free: the run that wrote this dump let its router choose every expert set" + caveat
        return "not recorded: the dump's metadata does not say how its expert sets were chosen" + caveat
    if not held:
        return ("free: the engine's own router chose every expert set" +
                (caveat and f"{caveat}; this engine has no hold_routing"))
    rows = getattr(engine, "held_rows", None)
    return ("held to the golden expert sets, as the profile was derived" +
            ("" if rows is None else f"; {rows} row(s) ran the golden experts instead of the engine's own choice"))


def _outputs(f, engine, dump, progress, run: Run | None, announce=None) -> tuple[dict, str, str | None]:
    """(outputs under run-dump names, their dtype, why localisation will not work or None): the dump's, or
    the live engine's (`run`: resolved before the run, its profile says whether to hold routing)."""
    if dump is not None:
        return *read_dump(dump), None
    engine.load(f)
    unlocalised = preflight_localisation(engine, f)
    if unlocalised is not None and announce is not None:
        announce(unlocalised)
    hold = run.holds_routing
    return collect(engine, f, progress, hold, run.man if hold else None), engine.dtype, unlocalised
