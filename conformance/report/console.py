"""The verdict at the desk: what `kdtr verify` prints. Short by default, so a failing run reads on one
screen; every check with `verbose` (and always in the JSON / JUnit / HTML reports).

Default, in order: errors (a bad bundle, dump or engine), the first divergence and its cause, a compact
layer x tap grid per prompt (all-pass layers folded), token and DDTree failures, the 10 worst numeric
failures, skipped checks, then the verdict line with the coverage.

Everything printed is plain text: names, paths, messages and metadata come from files and the command
line, and must never be read as rich markup (a tensor named "[/]" is just a name).
"""
from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table
from rich.text import Text

from conformance.exit_codes import ExitCode
from conformance.report.coverage import check_group, coverage_text, skip_reasons, skipped
from conformance.report.diagnosis import summary_line
from conformance.report.verdict import KINDS, Verdict, counts, error_ratio, fmt_value, metric_summary, ran_text

WORST = 10                                   # numeric failures listed by default
_STYLE = {"pass": "green", "fail": "bold red", "error": "bold red", "skip": "dim"}
_CELL = {"pass": ".", "fail": "X", "error": "E", "skip": "-"}
# One letter per tap for the grid header, in execution order (docs/architecture.md).
TAP_LETTERS = {"attn_in": "a", "q": "q", "kv_latent": "c", "k_pe": "k", "attn_out": "o", "resid_attn": "r",
               "mlp_in": "m", "router_scores": "s", "topk_ids": "i", "topk_weights": "w", "mlp_out": "f",
               "resid_out": "h"}
_LAYER_CHECK = re.compile(r"(?:^|/)p(?P<p>\d+)/(?P<phase>prefill|ar)/L(?P<layer>\d+)/(?P<tap>[^/]+)$")


def print_console(v: Verdict, console: Console | None = None, verbose: bool = False, verdict: bool = True) -> None:
    """Everything above, then (verdict=True) the verdict line; the CLI passes False and prints the verdict
    itself once the reports are written (print_verdict)."""
    console = console or Console()

    def say(line: str = "", style: str = "") -> None:
        console.print(Text(line, style=style), highlight=False)

    for c in v.checks:
        if c.status == "error":
            say(f"ERROR {c.name}: {c.message}", "bold red")
            for problem in c.metrics.get("problems", [])[1:5]:
                say(f"  also: {problem}")
    _divergence(v, say)
    _grid(v, say)
    failed = {c.name for c in v.checks if c.status == "fail"}
    echoes = [c.name for c in v.checks if c.name in failed and _echoes_replay(c.name, failed)]
    for c in v.checks:
        if c.status == "fail" and c.kind in ("tokens", "ddtree", "coverage") and c.name not in echoes:
            say(f"{c.kind} FAIL {c.name}: {c.message}", "red")
    if echoes:
        say(f"ddtree FAIL {', '.join(echoes)}: the live DDTree stream fails where the replay's does", "red")
    if v.first_divergence is None and v.diagnosis is not None:          # a DDTree-only failure
        say(summary_line(v.diagnosis), "bold")
    _live_ddtree(v, say)
    _worst(v, say, None if verbose else WORST)
    for d in v.done_by_kdtr:
        say(f"done by kdtr, not judged: {d['what']}: {d['why']} ({d['checks']} checks not counted as covered)",
            "yellow")
    names = skipped(v.checks)
    if names:
        say(f"{len(names)} checks skipped:", "yellow")
        for line in skip_reasons(v.checks, 5):
            say(f"  {line}", "yellow")
        if len(names) > 5:
            say(f"  ... and {len(names) - 5} more", "yellow")
    if verbose:
        _tables(v, console)
    say(count_line(v))
    if verdict:
        print_verdict(v, console)


def count_line(v: Verdict) -> str:
    """The checks the bundle defines by outcome, adding up to the coverage total beside it: passed and
    failed ran; not run = skipped (done by kdtr included) or absent (an earlier error stopped the run). The
    others (bundle integrity, errors, the coverage gate, per-prompt summaries) are counted apart."""
    t = v.coverage.get("total", {"run": 0, "defined": 0})
    n = counts([c for c in v.checks if check_group(c)])
    rest = counts([c for c in v.checks if not check_group(c)])
    other = ", ".join(f"{rest[k]} {w}" for k, w in (("pass", "passed"), ("fail", "failed"), ("error", "errors"),
                                                      ("skip", "skipped")) if rest[k])
    return (f"{n['pass']} passed, {n['fail']} failed, {t['defined'] - t['run']} not run of {t['defined']} defined; "
            f"coverage (checks run / defined): {coverage_text(v.coverage)}"
            + (f"; other checks (integrity, errors, summaries): {other}" if other else ""))


def print_verdict(v: Verdict, console: Console, not_written: list[str] = ()) -> None:
    """The verdict line, last: `kdtr verify` prints it after every report was written, or names the
    reports that were not, and then a passing run's exit code is 2 (the reports CI reads are incomplete)."""
    code = ExitCode.USAGE if not_written and v.exit_code == ExitCode.OK else v.exit_code
    style = "bold green" if code == ExitCode.OK else "bold red"
    what = f"{v.verdict.upper()} {v.engine} on {v.bundle}{ran_text(v)}"
    if not_written:
        what += f", INCOMPLETE REPORTS (not written: {', '.join(not_written)})"
    console.print(Text(f"{what}: exit code {int(code)} ({code.name})", style=style), highlight=False)


def _echoes_replay(name: str, failed: set) -> bool:
    """A live DDTree stream failure of a prompt whose replayed stream failed too: the same flip, once."""
    return name.endswith("/ddtree_live/tokens") and name.replace("/ddtree_live/", "/ddtree/") in failed


def _live_ddtree(v: Verdict, say) -> None:
    """An engine's own DDTree loop: trees that passed with a note (allowed near-ties, rounds not compared)
    and the target forwards against golden and AR, summed over the prompts."""
    for c in v.checks:
        if c.status == "pass" and c.name.endswith("/ddtree_live/trees") and c.message:
            say(f"ddtree note {c.name}: {c.message}", "yellow")
    fw = [c.metrics for c in v.checks if c.name.endswith("/ddtree_live/target_forwards") and c.metrics]
    if fw:
        e, g, ar = (sum(m[k] for m in fw) for k in ("engine", "golden", "ar_forwards"))
        say(f"live DDTree: {e} target forwards for {len(fw)} prompts, golden {g}, AR {ar} "
            f"({ar / e:.2f}x fewer than AR; golden {ar / g:.2f}x)")


def _divergence(v: Verdict, say) -> None:
    d = v.first_divergence
    if d is None:
        return
    where = ", ".join(x for x in (None if d.layer is None else f"layer {d.layer}", f"tap {d.tap}", d.phase) if x)
    where += f", rank(s) {d.ranks}" if getattr(d, "ranks", None) is not None else ""
    say(f"first divergence: {d.name} ({where})", "bold red")
    first = [f"decode step {d.step}" if d.step is not None and d.step >= 0 else
             "the prefill's last row" if d.step == -1 else None,
             f"token position {d.token_position}" if d.token_position is not None else None]
    if any(first):
        say(f"  first failing row: {', '.join(x for x in first if x)}")
    golden, actual = distinct_values(d.golden, d.actual)
    diff = (f" (actual - golden = {d.actual - d.golden:+.3g})"
            if isinstance(d.golden, (int, float)) and isinstance(d.actual, (int, float)) else "")
    say(f"  worst element {d.worst_index}: golden {golden}, actual {actual}{diff}")
    prompt = d.name.split("/")[0]
    for c in v.checks:                      # the prompt's own named checks explain what its failure means
        if c.status == "fail" and c.message and c.name.count("/") == 1 and c.name.startswith(prompt + "/"):
            say(f"  {c.name}: {c.message}")
    if d.local_error is not None or d.inherited_error is not None:
        say(f"  on golden inputs: {metric_summary(d.local_error)}; in the run: {metric_summary(d.inherited_error)}")
    if d.cause:
        say(f"  cause: {d.cause}", "bold")
    for k, val in (d.evidence or {}).items():
        say(f"  {k}: {val}")
    if v.diagnosis is not None:
        say(f"  {summary_line(v.diagnosis)}", "bold")


def distinct_values(golden, actual) -> tuple[str, str]:
    """The two values with as many significant digits (4 to 17) as it takes to tell them apart."""
    if not (isinstance(golden, float) and isinstance(actual, float)):
        return fmt_value(golden), fmt_value(actual)
    for digits in range(4, 18):
        g, a = f"{golden:.{digits}g}", f"{actual:.{digits}g}"
        if g != a:
            break
    return g, a


def _grid(v: Verdict, say) -> None:
    """Per prompt, one row per layer: a cell per tap, prefill then decode. Consecutive layers where every
    cell passed fold into one row; a prompt with nothing but passes is one line."""
    cells: dict = {}                              # prompt -> layer -> phase -> {tap: status}
    for c in v.checks:
        m = _LAYER_CHECK.search(c.name)
        if m and c.kind == "numeric":
            cells.setdefault(int(m["p"]), {}).setdefault(int(m["layer"]), {}).setdefault(
                m["phase"], {})[m["tap"]] = c.status
    if not cells or all(st == "pass" for pr in cells.values() for lay in pr.values()
                        for taps in lay.values() for st in taps.values()):
        return                                     # nothing to point at: the counts line says it
    taps = {ph: [t for t in TAP_LETTERS if any(t in lay.get(ph, {}) for pr in cells.values() for lay in pr.values())]
            for ph in ("prefill", "ar")}
    head = lambda ph: "".join(TAP_LETTERS[t] for t in taps[ph])  # noqa: E731
    say("layer x tap grid (. pass  X fail  - skipped  blank: no such tap); taps: "
        + " ".join(f"{ch}={t}" for t, ch in TAP_LETTERS.items()))
    say(f"{'':10}{'prefill':<{len(taps['prefill']) + 2}}decode")
    say(f"{'':10}{head('prefill'):<{len(taps['prefill']) + 2}}{head('ar')}")
    for p, layers in sorted(cells.items()):
        rows = []
        for l, phases in sorted(layers.items()):
            row = "  ".join("".join(_CELL.get(phases.get(ph, {}).get(t), " ") for t in taps[ph])
                            for ph in ("prefill", "ar"))
            rows.append((l, row))
        _fold(p, rows, say)


def _fold(p: int, rows: list, say) -> None:
    """Print layer rows, runs of all-pass rows as one line "L0-L4  all pass"."""
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and set(rows[j][1]) <= {".", " "}:
            j += 1
        if j > i:
            span = f"L{rows[i][0]}" + (f"-L{rows[j - 1][0]}" if j - 1 > i else "")
            say(f"p{p:<3}{span:<7}all pass" if (i, j) != (0, len(rows)) else f"p{p:<3}every layer passes")
            i = j
            continue
        say(f"p{p:<3}L{rows[i][0]:<6}{rows[i][1]}")
        i += 1


def _worst(v: Verdict, say, limit: int | None) -> None:
    bad = [c for c in v.checks if c.status == "fail" and c.kind == "numeric"]
    if not bad:
        return
    bad.sort(key=lambda c: -(error_ratio(c) or 0.0))
    shown = bad if limit is None else bad[:limit]
    say(f"numeric failures, worst first ({len(shown)} of {len(bad)}; -v or the reports for the rest):")
    for c in shown:
        r = error_ratio(c)
        parts = []
        for metric, limit in (("max_abs", "atol"), ("nmse", "nmse"), ("mismatch_count", None)):
            if c.metrics.get(metric) is not None:
                bound = f" (limit {fmt_value(c.tolerance[limit])})" if c.tolerance.get(limit) else ""
                parts.append(f"{metric}={fmt_value(c.metrics[metric])}{bound}")
        say(f"  {c.name}  {'' if r is None else f'{r:.3g}x tolerance: '}{', '.join(parts)}")


def _tables(v: Verdict, console: Console) -> None:
    """Every check, a table per kind (verbose)."""
    for kind in KINDS:
        checks = [c for c in v.checks if c.kind == kind]
        if not checks:
            continue
        t = Table(title=f"{kind} checks", title_justify="left")
        for col in ("check", "status", "metrics", "tolerance", "min passing / message"):
            t.add_column(col, overflow="fold")
        for c in checks:
            last = (f"would pass at {metric_summary(c.min_passing, 'min_passing')}" if c.min_passing
                    else c.message)
            t.add_row(Text(c.name), Text(c.status, style=_STYLE[c.status]), Text(metric_summary(c.metrics)),
                      Text(metric_summary(c.tolerance, "tolerance")), Text(last))
        console.print(t)
