"""Judging taps: one function judges one tap (`judge_tap`), and `tap_checks` runs it over a prompt's taps
in execution order (prefill L0..L{n-1}, final_hidden, logits; then the decode steps, teacher-forced with
the golden tokens), with the tolerances of the run's precision profile or a rules file.

Expert choices are compared as per-row sets; a row whose set differs at a near-tie of the profile that
the engine's own reported router scores explain (conformance/verify/near_ties.py) is reported, not
failed. A check whose tolerance would pass an all-zero output judges nothing: it is skipped with that
reason, never passed. The first failure in execution order is the prompt's first divergence
(conformance/verify/localize.py then tells a local fault from inherited error).
"""
from __future__ import annotations

import numpy as np

from conformance.metrics import logits_metrics
from conformance.report.verdict import CheckResult, Divergence
from conformance.tolerance import Rule, check_tap, judges_nothing
from conformance.verify.context import Prompt, Run
from conformance.verify.near_ties import routing_near_ties


def judge_tap(run: Run, name: str, key: str, golden, actual, kind: str = "numeric",
              metrics: dict | None = None) -> CheckResult:
    """Check `name`: the engine's `actual` against `golden` by manifest entry `key`'s tolerance (then the
    overrides). Skipped when the engine did not report it or the tolerance judges nothing. `kind`: the
    check's kind (exit code) on failure; `metrics`: facts reported with it whatever the outcome."""
    extra = dict(metrics or {})
    if actual is None:                       # an optional tap (validation requires the rest)
        return CheckResult(name, "skip", kind, extra, message="the engine did not report this tap")
    tol = run.tolerance(name, key)
    golden, actual = np.asarray(golden), np.asarray(actual)  # shapes equal: validated
    why = judges_nothing(golden, tol.rule, run.dtype)
    if why:
        return CheckResult(name, "skip", kind, extra, tol.rule.to_dict(), why)
    r = check_tap(golden, actual, tol.rule, run.dtype, derived=tol.derived)
    if not r.passed:
        r.metrics["first_bad_row"] = first_bad_row(golden, actual, tol.rule)
    if name.endswith("/logits") and golden.ndim == 2:                   # distribution-level view, reported
        lm = logits_metrics(golden, actual)
        r.metrics.update({k: lm[k] for k in ("topk_overlap_min", "kl_max", "argmax_agreement")})
    r.metrics.update(extra)
    return CheckResult(name, "pass" if r.passed else "fail", kind, r.metrics, tol.rule.to_dict(),
                       "; ".join(r.failures), r.min_passing)


def tap_checks(pr: Prompt, out: dict) -> tuple[list[CheckResult], Divergence | None]:
    """Every tap of prompt `pr` the bundle holds, in execution order, and the prompt's first divergence."""
    checks, failed = [], []
    for order, key in enumerate(pr.run.keys):
        if not pr.has(key):
            continue
        name = pr.p + key
        golden, actual = _routing_views(pr, key, out, name)
        actual, tie_rows = _routing_near_ties(pr, key, name, out, golden, actual)
        c = judge_tap(pr.run, name, key, golden, actual)
        if tie_rows:
            c.metrics["near_tie_rows"] = tie_rows
            c.message = (c.message + "; " if c.message else "") + (
                f"expert sets differ at near-tie rows {tie_rows[:8]} (within the profile's routing noise)")
        checks.append(c)
        if c.status == "fail":
            failed.append((_time_key(key, c, order), c))
    first = _divergence(min(failed, key=lambda t: t[0])[1], pr.P) if failed else None
    return checks, first


def canonical_routing(ids: np.ndarray, weights: np.ndarray | None):
    """Routing as per-row sets: ids sorted ascending, weights permuted alike. The order of the top-k
    is a tie rule, not arithmetic (docs/golden-bundles.md): engines may list the same experts otherwise."""
    order = np.argsort(ids, axis=-1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=-1)
    return ids, None if weights is None else np.take_along_axis(weights, order, axis=-1)


def _routing_views(pr: Prompt, key: str, out: dict, name: str):
    """(golden, actual) for a tap, with topk_ids/topk_weights in canonical per-row order."""
    golden, actual = pr.golden(key), out.get(name)
    tap = key.rsplit("/", 1)[-1]
    if tap not in ("topk_ids", "topk_weights") or actual is None:
        return golden, actual
    ids_key, ids_name = key[: -len(tap)] + "topk_ids", name[: -len(tap)] + "topk_ids"
    if ids_name not in out:                  # weights without ids: compared in the order reported
        return golden, actual
    gi, gv = canonical_routing(np.asarray(pr.golden(ids_key)), np.asarray(golden) if tap == "topk_weights" else None)
    ai, av = canonical_routing(np.asarray(out[ids_name]), np.asarray(actual) if tap == "topk_weights" else None)
    return (gi, ai) if tap == "topk_ids" else (gv, av)


def _routing_near_ties(pr: Prompt, key: str, name: str, out: dict, golden, actual):
    """For topk_ids / topk_weights: the engine's rows whose expert set differs from the golden one at a
    near-tie (conformance/verify/near_ties.py) take the golden values, so the check judges every other row
    exactly and keeps row numbers; returns (actual, those rows). Other taps pass through. The engine's
    own router_scores must be reported and judged by a tolerance that judges something."""
    tap = key.rsplit("/", 1)[-1]
    ids_name = name[: -len(tap)] + "topk_ids"
    if tap not in ("topk_ids", "topk_weights") or actual is None or ids_name not in out:
        return actual, []
    gi, ai = np.asarray(pr.golden(key[: -len(tap)] + "topk_ids")), np.asarray(out[ids_name])
    scores_key = key[: -len(tap)] + "router_scores"
    scores = out.get(name[: -len(tap)] + "router_scores")
    if scores is not None and pr.vacuous(scores_key):
        scores = None
    run = pr.run
    _, near = routing_near_ties(run.f, pr.g, key[: -len(tap)] + "topk_ids", run.man, gi, ai, scores, run.cfg)
    if not near.size:
        return actual, []
    actual = np.array(actual)
    actual[near] = np.asarray(golden)[near]
    return actual, [int(t) for t in near]


def _time_key(key: str, c: CheckResult, order: int) -> tuple:
    """When a failing check's first bad value was computed: prefill first (in tap order), then decode
    step s (layer taps of step s in order, then logits row s + 1, which step s produced)."""
    row = c.metrics.get("first_bad_row", 0) or 0
    if key.startswith("prefill/"):
        return (-2, 0, order)
    if key == "ar/logits":
        return (row - 1, 1, order)                                       # row 0 came from the prefill
    return (row, 0, order)


def first_bad_row(golden: np.ndarray, actual: np.ndarray, rule: Rule) -> int:
    """The first row (token or step) with an element over the elementwise bound: where the error began,
    which the worst element need not be. Aggregate-only failures point at row 0."""
    g, a = np.asarray(golden), np.asarray(actual)
    if g.ndim == 0 or g.shape[0] == 0:
        return 0
    g64, a64 = g.astype(np.float64), a.astype(np.float64)
    if g.dtype.kind in "iu" or rule.mode == "exact":
        bad = g64 != a64
    else:
        bad = ~(np.abs(a64 - g64) <= rule.atol + rule.rtol * np.abs(g64))  # NaN counts as bad
    rows = np.nonzero(bad.reshape(g.shape[0], -1).any(axis=1))[0]
    if not rows.size and rule.nmse is not None:                          # an aggregate-only failure:
        err = ((a64 - g64) ** 2).reshape(g.shape[0], -1).sum(axis=1)     # the first row over the NMSE
        ref = (g64 ** 2).reshape(g.shape[0], -1).sum(axis=1)
        rows = np.nonzero(err > rule.nmse * np.maximum(ref, np.finfo(float).tiny))[0]
    return int(rows[0]) if rows.size else 0


def _divergence(c: CheckResult, P: int) -> Divergence:
    """Where a failed numeric check points: layer, tap, phase, step, token position, worst element."""
    parts = c.name.split("/")                                            # p{i}/{phase}/[L{l}/]{tap}
    phase, tap = parts[1], parts[-1]
    layer = int(parts[2][1:]) if len(parts) == 4 else None
    worst = c.metrics.get("worst_index") or c.metrics.get("first_mismatch")
    worst = tuple(int(x) for x in worst) if worst is not None else None
    row = c.metrics.get("first_bad_row", worst[0] if worst else None)
    if phase == "prefill":
        step, pos = None, row
    elif tap == "logits":                                   # ar/logits row r: made by decode step r-1 at P-1+r
        step, pos = None if row is None else row - 1, None if row is None else P - 1 + row
    else:                                                                # decode forward s at position P+s
        step, pos = row, None if row is None else P + row
    golden = c.metrics.get("golden_at_worst", c.metrics.get("golden_at_first"))
    actual = c.metrics.get("actual_at_worst", c.metrics.get("actual_at_first"))
    return Divergence(c.name, layer, tap, phase, step, pos, worst, golden, actual)
