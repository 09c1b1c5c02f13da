"""Judging an engine's outputs (run-dump names, docs/run-dump.md) against a bundle's goldens:

1. numeric: every tap, in execution order (prefill L0..L{n-1}, final_hidden, logits; then the decode
   steps, teacher-forced with the golden tokens), with the tolerances of the chosen precision profile
   (conformance/precision.py) or a rules file;
2. tokens: the engine's argmax at every golden step equals the golden token (exact); a mismatch reports
   the step, both tokens, the golden top-1/top-2 margin and the engine's logit error there;
3. ddtree: the engine's DDTree stream equals the golden stream and its own AR stream (100%), every
   round's verify argmax, accepted path and bonus equal the golden ones, target-forward counts equal;
   for an engine that ran its own DDTree loop too, conformance/verify/judge_live.py (trees vs golden, near-ties).

Tokens and expert choices at near-ties of the profile that the engine's own reported numbers explain
(conformance/verify/near_ties.py) are reported, not failed; under the fp32 profile there are none. A check whose
tolerance would pass an all-zero output judges nothing: it is skipped with that reason, never passed.

The first numeric failure in execution order is the first divergence (conformance/verify/localize.py then
tells a local fault from inherited error).
"""
from __future__ import annotations

import numpy as np

from conformance.report.coverage import coverage, coverage_text, skip_reasons, skipped
from conformance.metrics import logits_metrics
from conformance.verify.judge_live import live_checks
from conformance.verify.near_ties import (explains_flip, logits_atol, own_choice, routing_near_ties, routing_tie_row,
                                   stream_near_tie, token_near_ties)
from conformance.verify.outputs import LIVE, InvalidOutputs, has_live, tree_offsets, validate_outputs, widened
from conformance.precision import holds_routing, profile_taps
from conformance.records import numeric_keys, position_offset, prompts_of
from conformance.report.verdict import CheckResult, Divergence
from conformance.tolerance import DerivedTolerance, Rule, check_tap, judges_nothing, resolve_rule
from conformance.verify.tree_ties import GoldenDrafts
from refmodel.config import ModelConfig


def manifest_rule(entry: dict | None):
    if entry and "baseline_max_abs" in entry:
        return DerivedTolerance.from_dict(entry)
    return Rule(mode="exact", source="manifest (exact tap)")


def canonical_routing(ids: np.ndarray, weights: np.ndarray | None):
    """Routing as per-row sets: ids sorted ascending, weights permuted alike. The order of the top-k
    is a tie rule, not arithmetic (docs/golden-bundles.md): engines may list the same experts otherwise."""
    order = np.argsort(ids, axis=-1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=-1)
    return ids, None if weights is None else np.take_along_axis(weights, order, axis=-1)


def _routing_views(f, g: str, key: str, out: dict, name: str):
    """(golden, actual) for a tap, with topk_ids/topk_weights in canonical per-row order."""
    golden, actual = f[g + key], out.get(name)
    tap = key.rsplit("/", 1)[-1]
    if tap not in ("topk_ids", "topk_weights") or actual is None:
        return golden, actual
    ids_key, ids_name = key[: -len(tap)] + "topk_ids", name[: -len(tap)] + "topk_ids"
    if ids_name not in out:                  # weights without ids: compared in the order reported
        return golden, actual
    gi, gv = canonical_routing(np.asarray(f[g + ids_key]), np.asarray(golden) if tap == "topk_weights" else None)
    ai, av = canonical_routing(np.asarray(out[ids_name]), np.asarray(actual) if tap == "topk_weights" else None)
    return (gi, ai) if tap == "topk_ids" else (gv, av)


def judge(f, out: dict, overrides=(), dtype: str = "float32",
          profile: str = "fp32") -> tuple[list[CheckResult], Divergence | None]:
    """All checks for outputs `out` (run-dump names) against the open bundle `f` under the precision
    `profile` (conformance/precision.py), and the first divergence in execution order (earliest prompt,
    then prefill, then the earliest decode step).
    Raises InvalidOutputs (every problem, each naming its record) when `out` breaks docs/run-dump.md:
    every check below may then rely on the required records (conformance/verify/outputs.py, REQUIRED)."""
    problems = validate_outputs(f, out, dtype)
    if problems:
        raise InvalidOutputs(problems)
    out = widened(out, dtype)
    meta = f.metadata
    cfg = ModelConfig.from_dict(meta["model_config"])
    man = profile_taps(meta, profile)
    keys = numeric_keys(cfg, set(meta["taps"]["ar"]))
    checks, first, drafts = [], None, GoldenDrafts(f)                  # drafts: computed only if a tree differs
    for i in prompts_of(f):
        g = f"golden/p{i}/"
        vacuous = _vacuous(f, g, "ar/logits", man, overrides, dtype, f"p{i}/ar/logits")
        near = token_near_ties(f[g + "ar/margins"], man, vacuous is not None)
        failed_here = []
        for order, key in enumerate(keys):
            name = f"p{i}/{key}"
            if g + key not in f:
                continue
            golden, actual = _routing_views(f, g, key, out, name)
            actual, tie_rows = _routing_near_ties(f, g, key, name, man, out, golden, actual, cfg, overrides,
                                                  dtype)
            c, failed = _numeric_check(name, golden, actual, man.get(key), overrides, dtype)
            if tie_rows:
                c.metrics["near_tie_rows"] = tie_rows
                c.message = (c.message + "; " if c.message else "") + (
                    f"expert sets differ at near-tie rows {tie_rows[:8]} (within the profile's routing noise)")
            checks.append(c)
            if failed:
                failed_here.append((_time_key(key, c, order, cfg), c))
        if failed_here and first is None:
            first = _divergence(min(failed_here, key=lambda t: t[0])[1], len(f[g + "prompt_ids"]))
        checks.append(_token_check(f, g, i, out, near, logits_atol(man)))
        ar_ok = all(c.status == "pass" for c in checks if c.name == f"p{i}/ar/logits")
        checks += _ddtree_checks(f, g, i, out, overrides, dtype, ar_ok, man, near)
        if has_live(out, i):     # its router runs freely: on a held fp32 bundle, judged up to a routing near-tie
            tie_row = routing_tie_row(f, g, man, cfg) if profile == "fp32" and holds_routing(meta, profile) else None
            checks += live_checks(f, g, i, out, drafts, ar_ok, tie_row)
            checks.append(_path_logits_check(f, g, f"p{i}/{LIVE}/", out, overrides, dtype,
                                             "ddtree" if ar_ok else "numeric", man, tie_row=tie_row))
    checks += long_position_checks(f, checks)
    return checks, first


def _vacuous(f, g: str, key: str, man: dict, overrides, dtype: str, name: str) -> str | None:
    """Why the rule for tap `key` would pass an all-zero output (conformance/tolerance.judges_nothing)."""
    if g + key not in f:
        return None
    return judges_nothing(np.asarray(f[g + key]), resolve_rule(name, manifest_rule(man.get(key)), overrides), dtype)


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


def _routing_near_ties(f, g: str, key: str, name: str, man: dict, out: dict, golden, actual, cfg,
                       overrides, dtype):
    """For topk_ids / topk_weights: the engine's rows whose expert set differs from the golden one at a
    near-tie (conformance/verify/near_ties.py) take the golden values, so the check judges every other row
    exactly and keeps row numbers; returns (actual, those rows). Other taps pass through. The engine's
    own router_scores must be reported and judged by a tolerance that judges something."""
    tap = key.rsplit("/", 1)[-1]
    ids_name = name[: -len(tap)] + "topk_ids"
    if tap not in ("topk_ids", "topk_weights") or actual is None or ids_name not in out:
        return actual, []
    gi, ai = np.asarray(f[g + key[: -len(tap)] + "topk_ids"]), np.asarray(out[ids_name])
    scores_key = key[: -len(tap)] + "router_scores"
    scores = out.get(name[: -len(tap)] + "router_scores")
    if scores is not None and _vacuous(f, g, scores_key, man, overrides, dtype, name[: -len(tap)] + "router_scores"):
        scores = None
    _, near = routing_near_ties(f, g, key[: -len(tap)] + "topk_ids", man, gi, ai, scores, cfg)  # validated
    if not near.size:
        return actual, []
    actual = np.array(actual)
    actual[near] = np.asarray(golden)[near]
    return actual, [int(t) for t in near]


def _time_key(key: str, c: CheckResult, order: int, cfg: ModelConfig) -> tuple:
    """When a failing check's first bad value was computed: prefill first (in tap order), then decode
    step s (layer taps of step s in order, then logits row s + 1, which step s produced)."""
    row = c.metrics.get("first_bad_row", 0) or 0
    if key.startswith("prefill/"):
        return (-2, 0, order)
    if key == "ar/logits":
        return (row - 1, 1, order)                                       # row 0 came from the prefill
    return (row, 0, order)


def _numeric_check(name, golden, actual, entry, overrides, dtype) -> tuple[CheckResult, bool]:
    if actual is None:                       # an optional tap (validation requires the rest)
        return CheckResult(name, "skip", "numeric", message="the engine did not report this tap"), False
    derived = manifest_rule(entry)
    rule = resolve_rule(name, derived, overrides)
    golden, actual = np.asarray(golden), np.asarray(actual)  # shapes equal: validated
    why = judges_nothing(golden, rule, dtype)
    if why:
        return CheckResult(name, "skip", "numeric", tolerance=rule.to_dict(), message=why), False
    r = check_tap(golden, actual, rule, dtype, derived=derived if isinstance(derived, DerivedTolerance) else None)
    if not r.passed:
        r.metrics["first_bad_row"] = first_bad_row(golden, actual, rule)
    if name.endswith("/logits") and golden.ndim == 2:                   # distribution-level view, reported
        lm = logits_metrics(golden, actual)
        r.metrics.update({k: lm[k] for k in ("topk_overlap_min", "kl_max", "argmax_agreement")})
    return CheckResult(name, "pass" if r.passed else "fail", "numeric", r.metrics, rule.to_dict(),
                       "; ".join(r.failures), r.min_passing), not r.passed


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


def _token_check(f, g: str, i: int, out: dict, near: np.ndarray, atol: float) -> CheckResult:
    """Exact, except that a flip at a near-tie step (`near`: golden margin <= 2 x the profile's logits
    atol) that the engine's own logits explain (near_ties.explains_flip: its row's error is between half
    the margin and `atol`) is listed in `near_ties` and the message, not failed."""
    name = f"p{i}/ar/tokens"
    gold, got = np.asarray(f[g + "ar/tokens"]), np.asarray(out[name])      # both [n]: validated
    bad = np.nonzero(gold != got)[0]
    metrics = {"tokens": int(len(gold)), "matching_prefix": int(bad[0]) if bad.size else len(gold)}
    if not bad.size:
        return CheckResult(name, "pass", "tokens", metrics, {"exact": True})
    gl, el, margins = f[g + "ar/logits"], out[f"p{i}/ar/logits"], np.asarray(f[g + "ar/margins"])
    explained = [bool(near[s]) and explains_flip(gl[s], el[s], float(margins[s]), atol)
                 for s in range(len(gold))]
    ties = [int(s) for s in bad if explained[s]]
    real = [int(s) for s in bad if not explained[s]]
    if ties:
        metrics["near_ties"] = ties
    if not real:
        return CheckResult(name, "pass", "tokens", metrics, {"exact": True},
                           f"near-tie flips at steps {ties[:8]}: golden margins "
                           f"{np.round(margins[ties][:8], 4).tolist()} "
                           f"<= 2 x the profile's logits atol {atol:.4g}, and the engine's own logits there "
                           f"choose its token with an error between half the margin and that atol")
    s = real[0]
    margin = float(margins[s])
    err = float(np.max(np.abs(np.asarray(out[f"p{i}/ar/logits"][s], np.float64) - np.asarray(f[g + "ar/logits"][s]))))
    metrics.update(step=s, golden_token=int(gold[s]), engine_token=int(got[s]), margin=margin, logit_error=err)
    if 2 * err < margin:
        why = ("its logit error is under half the margin, so noise cannot explain the flip: "
               "look at argmax / tie-breaking / the token fed back")
    elif near[s]:
        why = (f"a near-tie of the profile, but its logit error exceeds the profile's logits atol {atol:.4g}: "
               f"a numeric fault, not noise")
    else:
        why = "its logit error exceeds half the margin: a numeric fault big enough to flip a decisive token"
    msg = (f"step {s}: golden token {int(gold[s])}, engine {int(got[s])}; golden top-1/top-2 margin "
           f"{margin:.4g}, engine logit error there {err:.4g}: {why}")
    return CheckResult(name, "fail", "tokens", metrics, {"exact": True}, msg)


def _ddtree_checks(f, g: str, i: int, out: dict, overrides, dtype, ar_ok, man: dict,
                   near: np.ndarray) -> list[CheckResult]:
    """The DDTree replay. When the engine's stream leaves the golden one at a near-tie token j, what
    follows is another (valid) stream: the rounds before j are judged exactly, the rest is skipped."""
    p = f"p{i}/ddtree/"
    checks = []
    mine, gold = np.asarray(out[p + "tokens"]), np.asarray(f[g + "ddtree/tokens"])
    n = min(len(gold), len(mine))
    bad = np.nonzero(gold[:n] != mine[:n])[0]
    ar, path = np.asarray(out[f"p{i}/ar/tokens"]), out[p + "path_logits"]
    tie = stream_near_tie(gold, mine, near, ar, path)
    ok = (not bad.size and len(gold) == len(mine)) or tie is not None
    if tie is not None:
        msg = (f"left the golden DDTree stream at near-tie token {tie} (golden margin "
               f"{float(f[g + 'ar/margins'][tie]):.4g}; the engine's own logits chose its token there); later "
               f"tokens are another stream, not compared")
    elif ok:
        msg = ""
    elif bad.size:
        msg = (f"differs from the golden DDTree stream at token {int(bad[0])}: expected {int(gold[bad[0]])}, "
               f"got {int(mine[bad[0]])}")
    else:
        msg = f"{len(mine)} tokens, the golden DDTree stream has {len(gold)}"
    checks.append(CheckResult(p + "tokens", "pass" if ok else "fail", "ddtree",
                              {"tokens": int(len(mine)), **({"near_tie": tie} if tie is not None else {})},
                              {"exact": True}, msg))
    # The AR tokens are teacher-forced (context = the golden prefix), so DDTree token j is comparable
    # while the DDTree stream's own prefix [:j] is golden: up to and including its first deviation.
    k = min(len(ar), len(mine), int(bad[0]) + 1 if bad.size else n)
    # A tree row and a decode row compute the same logits differently, so they may split a near-tie,
    # when the tree row's own argmax chose the DDTree token.
    diff = [int(d) for d in np.nonzero(ar[:k] != mine[:k])[0]
            if not (near[d] and own_choice(d, int(mine[d]), ar[:0], path))]
    msg = "" if not diff else (f"token {diff[0]}: DDTree emitted {int(mine[diff[0]])} where the "
                               f"engine's own AR argmax is {int(ar[diff[0]])}")
    checks.append(CheckResult(p + "tokens_vs_own_ar", "fail" if diff else "pass", "ddtree",
                              {"compared": int(k)}, {"exact": True}, msg))
    checks.append(_rounds_check(f, g, i, out, _rounds_before(f, g, tie), tie))
    checks.append(_path_logits_check(f, g, p, out, overrides, dtype, "ddtree" if ar_ok else "numeric", man, tie))
    fw, gfw = np.asarray(out[p + "counters"]), np.asarray(f[g + "ddtree/counters"])
    ok = int(fw[0]) == int(gfw[0])
    if tie is not None:
        checks.append(CheckResult(p + "target_forwards", "skip", "ddtree", message=(
            f"not comparable: the stream left the golden one at near-tie token {tie}")))
    else:
        checks.append(CheckResult(p + "target_forwards", "pass" if ok else "fail", "ddtree",
                                  {"engine": int(fw[0]), "golden": int(gfw[0])}, {"exact": True},
                                  "" if ok else f"{int(fw[0])} target forwards, golden {int(gfw[0])}"))
    return checks


def _rounds_before(f, g: str, tie: int | None) -> int | None:
    """How many golden rounds committed only tokens before stream index `tie` (None: no near-tie, all).
    Round r's tokens are stream indices round_start[r] - P + 1 .. round_start[r] - P + len(accepted_r)."""
    if tie is None:
        return None
    P = len(f[g + "prompt_ids"])
    starts, acc = np.asarray(f[g + "ddtree/round_start"]), np.diff(np.asarray(f[g + "ddtree/accepted_offsets"]))
    return int(np.count_nonzero(starts - P + acc < tie))


def _path_logits_check(f, g: str, p: str, out: dict, overrides, dtype, kind: str, man: dict,
                       tie: int | None = None, tie_row: int | None = None) -> CheckResult:
    """The tree forward's logits on the committed rows, against the golden AR logits with the AR logits
    tolerance. Committed row j sits at position P + j and predicts token j + 1: in exact arithmetic it is
    AR row j + 1 (docs/run-dump.md §4). Argmax checks alone would let a tree-only numeric bug smaller
    than the token margins pass; this catches it. Compared while the engine's stream is golden. `kind`:
    "ddtree" when the AR logits passed (the tree path alone is off: a DDTree failure), else "numeric"
    (the same drift as the AR path, not a DDTree-specific fault). `tie_row`: a live loop's rows from this
    cache row on are not compared (a near-tie golden routing decision may move them: judge_live.py)."""
    name = p + "path_logits"
    got = out[name]
    gold_ar, mine, gold = f[g + "ar/logits"], np.asarray(out[p + "tokens"]), np.asarray(f[g + "ar/tokens"])
    n = min(len(mine), len(gold))
    bad = np.nonzero(mine[:n] != gold[:n])[0]
    k = min(len(got), len(gold_ar) - 1, int(bad[0]) if bad.size else n)
    P = len(f[g + "prompt_ids"])
    if tie_row is not None:                                              # committed row j is cache row P + j
        k = min(k, max(0, tie_row - P))
    derived = manifest_rule(man.get("ar/logits"))
    rule = resolve_rule(name, derived, overrides)
    why = judges_nothing(np.asarray(gold_ar[1:1 + k]), rule, dtype) if k else (
        "not compared: no committed row while the engine's stream is golden"
        + ("" if tie is None else f" (it left the golden stream at near-tie token {tie})")
        + ("" if tie_row is None else f" and before cache row {tie_row}, the first near-tie golden routing "
                                      f"decision (the live loop routes freely)"))
    if why:
        return CheckResult(name, "skip", kind, {"rows": k}, rule.to_dict(), why)
    r = check_tap(np.asarray(gold_ar[1:1 + k]), np.asarray(got[:k]), rule, dtype,
                  derived=derived if isinstance(derived, DerivedTolerance) else None)
    r.metrics["rows"] = k
    if tie_row is not None:
        r.metrics["routing_tie_row"] = tie_row
    return CheckResult(name, "pass" if r.passed else "fail", kind, r.metrics, rule.to_dict(),
                       "; ".join(r.failures), r.min_passing)


def _rounds_check(f, g: str, i: int, out: dict, upto: int | None = None, tie: int | None = None) -> CheckResult:
    """Round by round: the verified tree (an engine with its own drafter), the accepted node path, the
    target's argmax on it and the bonus equal the golden ones, and the engine ran as many rounds. Off-path
    rows are counted, not judged: their argmax changes no output and, unlike every decision on the path
    (an AR decision, margin-checked by `kdtr gen`), has no margin guarantee. `upto`: judge only the
    first rounds (the engine's stream left the golden one at a near-tie after them)."""
    p = f"p{i}/ddtree/"
    go, ga = np.asarray(f[g + "ddtree/tree_offsets"]), np.asarray(f[g + "ddtree/accepted_offsets"])
    eo = np.asarray(out[p + "accepted_offsets"])
    R, Re, off_path = len(go) - 1, len(eo) - 1, 0
    if upto is not None:                                                 # rounds after a near-tie: another
        R, Re = min(R, upto), min(Re, upto)                              # stream, not compared
    if upto == 0:
        return CheckResult(p + "rounds", "skip", "ddtree", {"rounds": 0}, {"exact": True},
                           f"not compared: the stream left the golden one at near-tie token {tie} in the "
                           f"first round, so no round committed only golden tokens")
    et = tree_offsets(f, g, out, f"p{i}/", Re)                          # the trees the engine verified
    fail = lambda r, msg: CheckResult(p + "rounds", "fail", "ddtree", {"rounds": R, "matching": r},  # noqa: E731
                                      {"exact": True}, f"round {r}: {msg}")
    for r in range(min(R, Re)):
        for key in ("tree_tokens", "tree_parents"):                      # an engine with its own drafter
            if p + key in out:
                tg, te = np.asarray(f[g + "ddtree/" + key][go[r]:go[r + 1]]), np.asarray(out[p + key])[et[r]:et[r + 1]]
                if not np.array_equal(tg, te):
                    return fail(r, f"{key} {te.tolist()} but golden {tg.tolist()} (the drafter proposed another tree)")
        acc_g = np.asarray(f[g + "ddtree/accepted"][ga[r]:ga[r + 1]])
        acc_e = np.asarray(out[p + "accepted"])[eo[r]:eo[r + 1]]
        if not np.array_equal(acc_g, acc_e):
            return fail(r, f"accepted rows {_rows(acc_e)} but golden {_rows(acc_g)}")
        post_g = np.asarray(f[g + "ddtree/verify_argmax"][go[r]:go[r + 1]])
        post_e = np.asarray(out[p + "verify_argmax"])[et[r]:et[r + 1]]   # same tree, so same rows
        if not np.array_equal(post_g[acc_g], post_e[acc_g]):
            d = int(np.flatnonzero(post_g[acc_g] != post_e[acc_g])[0])     # accepted row d sits at depth d
            return fail(r, f"target argmax on the accepted path differs first at depth {d}: {post_e[acc_g[d]]}, "
                           f"golden {post_g[acc_g[d]]} (accepted rows {_rows(acc_g)})")
        off_path += int(np.count_nonzero(post_g != post_e))
        if int(out[p + "round_bonus"][r]) != int(f[g + "ddtree/round_bonus"][r]):
            return fail(r, f"bonus {int(out[p + 'round_bonus'][r])}, golden {int(f[g + 'ddtree/round_bonus'][r])}")
    if Re != R:
        return fail(min(R, Re), f"the engine ran {Re} rounds, the golden run {R}")
    later = "" if upto is None else f"rounds from {upto} on not compared: the stream left the golden one at a near-tie"
    return CheckResult(p + "rounds", "pass", "ddtree", {"rounds": R, "off_path_argmax_differences": off_path},
                       {"exact": True}, later)


def _rows(a) -> str:
    """Row indices as text, a run of three or more consecutive rows as first..last: [0..9, 16]."""
    a, parts, i = [int(x) for x in a], [], 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and a[j + 1] == a[j] + 1:
            j += 1
        parts += [f"{a[i]}..{a[j]}"] if j - i >= 2 else [str(x) for x in a[i:j + 1]]
        i = j + 1
    return "[" + ", ".join(parts) + "]"


def coverage_check(checks: list[CheckResult], required: float) -> CheckResult:
    """Passes when every group ran at least `required` (0..1) of the checks it defines."""
    cov = coverage(checks)
    short = [g for g, d in cov.items() if g != "total" and d["run"] / d["defined"] < required - 1e-12]
    metrics = {g: f"{d['run']}/{d['defined']}" for g, d in cov.items()}
    tol = {"required": required}
    if not cov:
        return CheckResult("coverage", "fail", "coverage", metrics, tol, "no checks ran")
    if not short:
        return CheckResult("coverage", "pass", "coverage", metrics, tol)
    names = skipped(checks)
    want = "full" if required >= 1 else f"{required:g}"
    msg = (f"coverage {coverage_text(cov)} is below the required {want} in {', '.join(short)}; "
           f"{len(names)} skipped, first: {'; '.join(skip_reasons(checks, 3))}")
    return CheckResult("coverage", "fail", "coverage", metrics, tol, msg)
