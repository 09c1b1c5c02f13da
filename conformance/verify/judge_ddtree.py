"""Judging the DDTree replay (the `ddtree/` records, docs/run-dump.md §2): the engine's DDTree stream
equals the golden stream and its own AR stream (100%), every round's verify argmax, accepted path and
bonus equal the golden ones, target-forward counts are equal, and the tree forward's logits on the
committed rows are judged numerically (`path_logits_check`, which the live DDTree's judge uses too:
conformance/verify/judge_live.py).

When the engine's stream leaves the golden one at a near-tie token j (conformance/verify/near_ties.py),
what follows is another (valid) stream: the rounds before j are judged exactly, the rest is skipped.
"""
from __future__ import annotations

import numpy as np

from conformance.report.verdict import CheckResult
from conformance.verify.context import Prompt
from conformance.verify.judge_taps import judge_tap
from conformance.verify.near_ties import own_choice, stream_near_tie
from conformance.verify.outputs import tree_offsets


def ddtree_checks(pr: Prompt, out: dict, ar_ok: bool) -> list[CheckResult]:
    """The replay's checks of prompt `pr`. `ar_ok`: the engine's AR logits passed (a path-logits failure
    is then the tree path's own, kind "ddtree"; else the same drift as the AR path, kind "numeric")."""
    p, f, g = pr.p + "ddtree/", pr.run.f, pr.g
    checks = []
    mine, gold = np.asarray(out[p + "tokens"]), np.asarray(pr.golden("ddtree/tokens"))
    n = min(len(gold), len(mine))
    bad = np.nonzero(gold[:n] != mine[:n])[0]
    ar, path = np.asarray(out[pr.p + "ar/tokens"]), out[p + "path_logits"]
    tie = stream_near_tie(gold, mine, pr.near, ar, path)
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
            if not (pr.near[d] and own_choice(d, int(mine[d]), ar[:0], path))]
    msg = "" if not diff else (f"token {diff[0]}: DDTree emitted {int(mine[diff[0]])} where the "
                               f"engine's own AR argmax is {int(ar[diff[0]])}")
    checks.append(CheckResult(p + "tokens_vs_own_ar", "fail" if diff else "pass", "ddtree",
                              {"compared": int(k)}, {"exact": True}, msg))
    checks.append(_rounds_check(pr, out, _rounds_before(pr, tie), tie))
    checks.append(path_logits_check(pr, p, out, "ddtree" if ar_ok else "numeric", tie))
    fw, gfw = np.asarray(out[p + "counters"]), np.asarray(pr.golden("ddtree/counters"))
    ok = int(fw[0]) == int(gfw[0])
    if tie is not None:
        checks.append(CheckResult(p + "target_forwards", "skip", "ddtree", message=(
            f"not comparable: the stream left the golden one at near-tie token {tie}")))
    else:
        checks.append(CheckResult(p + "target_forwards", "pass" if ok else "fail", "ddtree",
                                  {"engine": int(fw[0]), "golden": int(gfw[0])}, {"exact": True},
                                  "" if ok else f"{int(fw[0])} target forwards, golden {int(gfw[0])}"))
    return checks


def _rounds_before(pr: Prompt, tie: int | None) -> int | None:
    """How many golden rounds committed only tokens before stream index `tie` (None: no near-tie, all).
    Round r's tokens are stream indices round_start[r] - P + 1 .. round_start[r] - P + len(accepted_r)."""
    if tie is None:
        return None
    starts, acc = np.asarray(pr.golden("ddtree/round_start")), np.diff(np.asarray(pr.golden("ddtree/accepted_offsets")))
    return int(np.count_nonzero(starts - pr.P + acc < tie))


def path_logits_check(pr: Prompt, p: str, out: dict, kind: str, tie: int | None = None,
                      tie_row: int | None = None) -> CheckResult:
    """The tree forward's logits on the committed rows (group prefix `p`: the replay's or the live
    loop's), against the golden AR logits with the AR logits tolerance. Committed row j sits at position
    P + j and predicts token j + 1: in exact arithmetic it is AR row j + 1 (docs/run-dump.md §4). Argmax
    checks alone would let a tree-only numeric bug smaller than the token margins pass; this catches it.
    Compared while the engine's stream is golden. `kind`: "ddtree" when the AR logits passed (the tree
    path alone is off: a DDTree failure), else "numeric" (the same drift as the AR path, not a
    DDTree-specific fault). `tie_row`: a live loop's rows from this cache row on are not compared (a
    near-tie golden routing decision may move them: judge_live.py)."""
    name = p + "path_logits"
    got = out[name]
    gold_ar, mine, gold = pr.golden("ar/logits"), np.asarray(out[p + "tokens"]), np.asarray(pr.golden("ar/tokens"))
    n = min(len(mine), len(gold))
    bad = np.nonzero(mine[:n] != gold[:n])[0]
    k = min(len(got), len(gold_ar) - 1, int(bad[0]) if bad.size else n)
    if tie_row is not None:                                              # committed row j is cache row P + j
        k = min(k, max(0, tie_row - pr.P))
    if not k:
        why = ("not compared: no committed row while the engine's stream is golden"
               + ("" if tie is None else f" (it left the golden stream at near-tie token {tie})")
               + ("" if tie_row is None else f" and before cache row {tie_row}, the first near-tie golden "
                                             f"routing decision (the live loop routes freely)"))
        return CheckResult(name, "skip", kind, {"rows": k}, pr.run.tolerance(name, "ar/logits").rule.to_dict(), why)
    return judge_tap(pr.run, name, "ar/logits", np.asarray(gold_ar[1:1 + k]), np.asarray(got[:k]), kind,
                     {"rows": k, **({} if tie_row is None else {"routing_tie_row": tie_row})})


def _rounds_check(pr: Prompt, out: dict, upto: int | None = None, tie: int | None = None) -> CheckResult:
    """Round by round: the verified tree (an engine with its own drafter), the accepted node path, the
    target's argmax on it and the bonus equal the golden ones, and the engine ran as many rounds. Off-path
    rows are counted, not judged: their argmax changes no output and, unlike every decision on the path
    (an AR decision, margin-checked by `kdtr gen`), has no margin guarantee. `upto`: judge only the
    first rounds (the engine's stream left the golden one at a near-tie after them)."""
    p, f, g = pr.p + "ddtree/", pr.run.f, pr.g
    go, ga = np.asarray(f[g + "ddtree/tree_offsets"]), np.asarray(f[g + "ddtree/accepted_offsets"])
    eo = np.asarray(out[p + "accepted_offsets"])
    R, Re, off_path = len(go) - 1, len(eo) - 1, 0
    if upto is not None:                                                 # rounds after a near-tie: another
        R, Re = min(R, upto), min(Re, upto)                              # stream, not compared
    if upto == 0:
        return CheckResult(p + "rounds", "skip", "ddtree", {"rounds": 0}, {"exact": True},
                           f"not compared: the stream left the golden one at near-tie token {tie} in the "
                           f"first round, so no round committed only golden tokens")
    et = tree_offsets(f, g, out, pr.p, Re)                              # the trees the engine verified
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
