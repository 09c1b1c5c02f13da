"""Judging an engine's own DDTree loop (the `ddtree_live/` records, docs/run-dump.md §2) against the goldens:

- `tokens`: the live stream equals the golden DDTree stream, exactly, always;
- `tokens_vs_own_ar`: and the engine's own AR stream (teacher-forced, so comparable while the live
  stream is golden, up to and including its first deviation);
- `trees`: every live round that starts where a golden round starts (in exact arithmetic the drafter's
  input there is the same, whatever the earlier rounds were) has the golden tree; where it differs, the
  first differing node must be a near-tie of the golden drafter (conformance/verify/tree_ties.py), else the
  check fails naming the round. On an equal tree the accepted path, the target's argmax on it and the
  bonus equal the golden ones. An engine that declares its own per-round budget (`round_budget`, a
  cost-aware budget) may verify the golden tree's first round_budget nodes: the path and bonus are then
  judged against the golden argmax on those rows. The records must also be self-consistent: each round's
  accepted path and bonus are the walk of its verify argmax over its tree, and the rounds produce the stream;
- `target_forwards`: the reported counters agree with the records, always (counters = [1 + rounds,
  rounds]: one prefill and one verify forward per round); and the live count against the golden count,
  exact when every round had the golden tree (then the runs are the same), reported otherwise (a
  near-tie tree may accept another number).

- `path_logits`: the live tree forward's logits on the committed rows, judged as the replay's
  (judge_ddtree.py, `path_logits_check`).

On an fp32 bundle made with `--routing-near-ties held` (judged with the fp32 profile), the live loop's
router still runs freely (tree rows have no golden expert sets), so a correct engine may pick another
expert set at a near-tie golden routing decision and from there compute another, equally valid, run.
`tie_row` (near_ties.routing_tie_row: the prompt's first cache row whose golden routing is a near-tie) draws
the line: every check above is exact for what depends only on cache rows before it (stream tokens up to
the one that row predicts, trees drafted from earlier rows, verifications that commit only earlier
tokens); after it the stream may leave the golden one and trees and verifications may differ, and only
the records' self-consistency (walks, the stream they make up, counters) is judged. What this cannot
catch: a fault of the engine's own DDTree loop whose first effect falls at or after that row (the golden
tree replay, which holds routing, still judges verification and compaction there).
"""
from __future__ import annotations

import numpy as np

from conformance.records import LIVE_BUDGET
from conformance.report.verdict import CheckResult
from conformance.verify.context import Prompt
from conformance.verify.judge_ddtree import path_logits_check
from conformance.verify.near_ties import routing_tie_row
from conformance.verify.outputs import LIVE, tree_offsets
from conformance.verify.tree_ties import GoldenDrafts, first_difference
from refmodel.ddtree import walk


def live_tie_row(pr: Prompt) -> int | None:
    """The prompt's first cache row whose golden routing is a near-tie, on a bundle judged with the fp32
    profile whose routing is held (module docstring); None: every live check exact throughout."""
    run = pr.run
    if run.profile != "fp32" or not run.holds_routing:
        return None
    return routing_tie_row(run.f, pr.g, run.man, run.cfg)


def free_from_token(pr: Prompt, tie_row: int | None) -> int | None:
    """The first stream token a near-tie routing decision at cache row `tie_row` may move: token j is
    predicted by row P + j - 1 (token 0 by the last prompt row), so j = tie_row - P + 1, at least 0."""
    return None if tie_row is None else max(0, tie_row - pr.P + 1)


def live_checks(pr: Prompt, out: dict, drafts: GoldenDrafts, ar_ok: bool = True,
                tie_row: int | None = None) -> list[CheckResult]:
    """The checks of prompt `pr`'s live DDTree (outputs that passed validation). `ar_ok`: whether the
    engine's AR logits passed; if not, the drafter's context (the target's features) is off already and a
    tree difference is that numeric failure seen downstream, kind "numeric", not a DDTree fault.
    `tie_row` (`live_tie_row`): the prompt's first near-tie golden routing row under a profile that holds
    routing (module docstring), None: every check exact throughout."""
    p = pr.p + f"{LIVE}/"
    mine, gold = np.asarray(out[p + "tokens"]), np.asarray(pr.golden("ddtree/tokens"))     # both [n]
    bad = np.nonzero(mine != gold)[0]
    free = free_from_token(pr, tie_row)
    parted = bool(bad.size) and free is not None and int(bad[0]) >= free    # left at a routing near-tie
    metrics = {"tokens": int(len(mine)), **({} if tie_row is None else {"routing_tie_row": tie_row,
                                                                        "free_from_token": free})}
    if parted:
        msg = (f"leaves the golden DDTree stream at token {int(bad[0])} (expected {int(gold[bad[0]])}, got "
               f"{int(mine[bad[0]])}), at or after token {free}, the first that the near-tie golden routing "
               f"decision at cache row {tie_row} may move: the live loop routes freely, so from there its "
               f"stream is another valid one, not compared")
    else:
        msg = "" if not bad.size else (f"differs from the golden DDTree stream at token {int(bad[0])}: expected "
                                       f"{int(gold[bad[0]])}, got {int(mine[bad[0]])}")
    checks = [CheckResult(p + "tokens", "fail" if bad.size and not parted else "pass", "ddtree", metrics,
                          {"exact": True}, msg)]
    ar = np.asarray(out[pr.p + "ar/tokens"])
    k = int(bad[0]) + (0 if parted else 1) if bad.size else len(mine)    # a parted token is not the golden one
    diff = np.nonzero(ar[:k] != mine[:k])[0]
    checks.append(CheckResult(p + "tokens_vs_own_ar", "fail" if diff.size else "pass", "ddtree",
                              {"compared": k}, {"exact": True}, "" if not diff.size else
                              f"token {int(diff[0])}: the live DDTree emitted {int(mine[diff[0]])} where the "
                              f"engine's own AR argmax is {int(ar[diff[0]])}"))
    trees, all_golden = _trees_check(pr, out, drafts, tie_row)
    if trees.status == "fail" and not ar_ok:
        trees.kind = "numeric"
        trees.message += " (the engine's AR logits fail too: its drafter saw off target features)"
    checks.append(trees)
    checks.append(_forwards_check(pr, out, all_golden))
    checks.append(path_logits_check(pr, p, out, "ddtree" if ar_ok else "numeric", tie_row=tie_row))
    return checks


def _round_rows(out: dict, p: str, et, eo, r: int):
    """Live round r: tree tokens, parents, verify argmax (rows), accepted path."""
    rows = slice(et[r], et[r + 1])
    return (np.asarray(out[p + "tree_tokens"][rows]), np.asarray(out[p + "tree_parents"][rows]),
            np.asarray(out[p + "verify_argmax"][rows]), np.asarray(out[p + "accepted"][eo[r]:eo[r + 1]]))


def _walk(tok, par, post) -> tuple[list, int]:
    """The greedy walk (docs/ddtree.md §4) over a tree in the bundle's layout."""
    children = [{} for _ in tok]
    for k in range(1, len(tok)):
        children[int(par[k])][int(tok[k])] = k
    return walk(children, post)


def _is_prefix(gtok, gpar, tok, par) -> bool:
    """Whether a live tree is the golden tree's first nodes in the heap-pop order both lay out (a popped
    node's parent precedes it, so any prefix is a tree), fewer of them (docs/ddtree.md §3a)."""
    k = len(tok)
    return k < len(gtok) and np.array_equal(gtok[:k], tok) and np.array_equal(gpar[:k], par)


def _pruned(gtok, gpar, tok, par, budget: int) -> bool:
    """Whether a live tree is the golden tree cut to the round's declared budget: its first `budget` nodes."""
    return len(tok) - 1 == budget and _is_prefix(gtok, gpar, tok, par)


def _trees_check(pr: Prompt, out: dict, drafts: GoldenDrafts,
                 tie_row: int | None = None) -> tuple[CheckResult, bool]:
    """(the `trees` check, whether every live round was a golden round with the golden tree, judged in
    full). `tie_row`: a round drafted from cache rows at or after it (start > tie_row) may have another
    tree, and one whose golden verification commits tokens predicted by such rows another path and bonus:
    those are counted in `after_routing_tie`, not failed."""
    f, g, i = pr.run.f, pr.g, pr.i
    p = pr.p + f"{LIVE}/"
    name = p + "trees"
    gs = {int(s): r for r, s in enumerate(np.asarray(f[g + "ddtree/round_start"]))}
    go, ga = np.asarray(f[g + "ddtree/tree_offsets"]), np.asarray(f[g + "ddtree/accepted_offsets"])
    eo = np.asarray(out[p + "accepted_offsets"])
    R = len(eo) - 1
    et = tree_offsets(f, g, out, pr.p, R, LIVE)
    bonus, tokens = np.asarray(out[p + "round_bonus"]), np.asarray(out[p + "tokens"])
    start, stream = pr.P, [int(tokens[0])]
    m = {"rounds": R, "golden_rounds": len(go) - 1, "compared": 0, "equal": 0, "near_ties": [], "not_comparable": 0,
         "after_routing_tie": 0, "pruned": 0}
    budgets = out.get(p + LIVE_BUDGET)                # the engine's own per-round budgets, when it declares them
    moved = lambda row: tie_row is not None and row >= tie_row  # noqa: E731 - may a routing near-tie move it

    def fail(r, msg):
        return CheckResult(name, "fail", "ddtree", m, {"exact": True, "near_ties": "golden drafter"},
                           f"round {r}: {msg}"), False

    for r in range(R):
        tok, par, post, acc = _round_rows(out, p, et, eo, r)
        walked, nxt = _walk(tok, par, post)
        if walked != acc.tolist() or nxt != int(bonus[r]):
            return fail(r, f"accepted {acc.tolist()} and bonus {int(bonus[r])} are not the walk of its verify "
                           f"argmax over its tree ({walked}, {nxt})")
        stream += [int(t) for t in tok[acc[1:]]] + [int(bonus[r])]
        gr = gs.get(start)
        start += len(acc)
        if gr is None:                   # an earlier near-tie tree accepted another count: no golden round here
            m["not_comparable"] += 1
            continue
        m["compared"] += 1
        gl = slice(go[gr], go[gr + 1])
        gtok, gpar = np.asarray(f[g + "ddtree/tree_tokens"][gl]), np.asarray(f[g + "ddtree/tree_parents"][gl])
        at = f"golden round {gr}, position {start - len(acc)}"
        same = np.array_equal(gtok, tok) and np.array_equal(gpar, par)
        if not same and moved(start - len(acc) - 1):
            m["after_routing_tie"] += 1                                  # drafted from rows a near-tie moves
            continue
        cut = not same and budgets is not None and _pruned(gtok, gpar, tok, par, int(budgets[r]))
        if not same and not cut and _is_prefix(gtok, gpar, tok, par):   # cut, but not as declared
            return fail(r, f"({at}) the golden tree's first {len(tok) - 1} nodes, a cut tree, but " + (
                "the engine declares no ddtree_live/round_budget: an engine that cuts its trees reports each "
                "round's budget (docs/run-dump.md §5)" if budgets is None else
                f"its declared round_budget is {int(budgets[r])}: a cut tree has exactly round_budget nodes"))
        if not same and not cut:
            lp = drafts.log_probs(i, gr)
            if lp is None or drafts.problem:
                return fail(r, f"({at}) the tree differs from the golden one and no near-tie can be assessed: "
                               f"{drafts.problem or 'no golden drafter logits for it'}")
            d = first_difference(gtok, gpar, tok, par, lp, drafts.delta)
            if not d.near_tie:
                return fail(r, f"({at}) the tree differs from the golden one at {d.why}")
            m["near_ties"].append({"round": r, "golden_round": gr, "row": d.row, "gap": d.gap, "bound": d.bound})
            continue
        # the golden tree, or its first round_budget nodes as declared: the golden verification on those rows
        m["equal" if same else "pruned"] += 1
        gpost = np.asarray(f[g + "ddtree/verify_argmax"][gl])
        if same:
            gacc, gbonus = np.asarray(f[g + "ddtree/accepted"][ga[gr]:ga[gr + 1]]), int(f[g + "ddtree/round_bonus"][gr])
        else:                                    # the walk of the golden argmax over the cut tree's rows
            walked, gbonus = _walk(tok, par, gpost[:len(tok)])
            gacc = np.asarray(walked)
        if moved(start - len(acc) + len(gacc) - 1):                      # verified on rows a near-tie moves
            m["after_routing_tie"] += 1
            continue
        what = "the golden tree" if same else f"the golden tree's first {len(tok) - 1} nodes (its declared budget)"
        if not np.array_equal(acc, gacc):
            return fail(r, f"({at}) {what}, but accepted rows {acc.tolist()} where golden {gacc.tolist()}")
        if not np.array_equal(post[acc], gpost[gacc]):
            return fail(r, f"({at}) {what}: target argmax on the accepted path {post[acc].tolist()}, golden "
                           f"{gpost[gacc].tolist()}")
        if int(bonus[r]) != gbonus:
            return fail(r, f"({at}) {what}: bonus {int(bonus[r])}, golden {gbonus}")
    if stream[:len(tokens)] != tokens.tolist() or len(stream) < len(tokens):
        return fail(R - 1, "the rounds' accepted tokens and bonuses do not make up the reported stream")
    if m["near_ties"]:
        m["drafter_atol"] = drafts.delta
    msg = "" if not m["near_ties"] else "; ".join(
        f"round {t['round']} (golden round {t['golden_round']}) differs at node {t['row']}: a near-tie of the "
        f"golden drafter, golden score gap {t['gap']:.3g} <= {t['bound']:.3g}, allowed" for t in m["near_ties"])
    if m["pruned"]:
        msg += ("; " if msg else "") + (f"{m['pruned']} round(s) verified the golden tree's first nodes, as many as "
                                        f"the engine's declared budget for the round: path and bonus judged on them")
    if m["not_comparable"]:
        msg += ("; " if msg else "") + f"{m['not_comparable']} round(s) start where no golden round does, not compared"
    if m["after_routing_tie"]:
        msg += ("; " if msg else "") + (f"{m['after_routing_tie']} round(s) drafted or verified on cache rows from "
                                        f"{tie_row} on, where a near-tie golden routing decision may move the "
                                        f"freely routed live run: tree and path not compared")
    same = m["equal"] == R == len(go) - 1 and not m["after_routing_tie"]
    return CheckResult(name, "pass", "ddtree", m, {"exact": True, "near_ties": "golden drafter"}, msg), same


def _forwards_check(pr: Prompt, out: dict, all_golden: bool) -> CheckResult:
    """The engine's reported counters against its own records always (1 prefill + one verify per round,
    docs/run-dump.md), and against the golden count exactly when every round had the golden tree."""
    p = pr.p + f"{LIVE}/"
    n = len(pr.golden("ar/tokens"))               # AR: 1 prefill + n - 1 decodes
    fw, rounds, gfw = int(out[p + "counters"][0]), int(out[p + "counters"][1]), int(pr.golden("ddtree/counters")[0])
    R = len(out[p + "accepted_offsets"]) - 1      # the rounds the records hold
    m = {"engine": fw, "golden": gfw, "ar_forwards": n, "engine_ratio": round(n / fw, 4) if fw > 0 else None,
         "golden_ratio": round(n / gfw, 4), "rounds": R}
    if (fw, rounds) != (1 + R, R):
        return CheckResult(p + "target_forwards", "fail", "ddtree", m, {"exact": True},
                           f"counters [{fw}, {rounds}] disagree with the {R} rounds the records hold: expected "
                           f"[{1 + R}, {R}] (1 prefill + one verify forward per round)")
    if all_golden and fw != gfw:
        return CheckResult(p + "target_forwards", "fail", "ddtree", m, {"exact": True},
                           f"{fw} target forwards with every golden tree, golden {gfw}")
    msg = "" if all_golden else (f"{fw} target forwards, golden {gfw}: consistent with the {R} rounds of its "
                                 f"records; not judged against golden (not every round had the golden tree; "
                                 f"see the trees check)")
    return CheckResult(p + "target_forwards", "pass", "ddtree", m, {"exact": all_golden}, msg)
