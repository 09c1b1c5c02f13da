"""Testing the DDTree hypotheses: the golden-tree replay (conformance/verify/collect.replay_ddtree's loop:
depth positions, ancestor mask, greedy walk, compaction) recomputed in float64 under each mistake, and
the engine's verify argmax compared with each, round by round, row by row.

Only decisive rows count: a row whose recomputed top-1 / top-2 logit margin is at least twice the
bundle's logits tolerance (a correct engine decides it as the recomputation does). A hypothesis is
matched when the engine's argmax equals its replay on every decisive row of every round the engine ran,
it ran as many rounds, and the correct replay differs on at least one decisive row. Score: (rows the
reference gets wrong + 1) / (rows the hypothesis gets wrong + 1).
"""
from __future__ import annotations

import numpy as np

from conformance.tolerance import manifest_rule
from conformance.precision import profile_taps
from conformance.records import golden_tree, position_offset
from conformance.tolerance import resolve_rule
from refmodel.ddtree import compile_tree, walk
from refmodel.model import KVCache, forward

TREE_VARIANTS = {
    "truncate-only": "the cache truncated to the accepted length without moving the accepted rows into place",
    "positions-by-index": "node positions start + node index instead of start + depth",
    "positions-all-root": "every node at the root's position",
    "mask-sees-next": "each node also sees the next node",
    "mask-causal": "a causal mask over the tree rows (every earlier node visible, not only ancestors)",
}


def prefill(cfg, W, f, i: int) -> tuple[KVCache, int]:
    """The prompt's cache and first bonus, shared by every variant (none of them acts in the prefill)."""
    prompt = np.asarray(f[f"golden/p{i}/prompt_ids"], np.int64)
    cache = KVCache(cfg, np.float64)
    logits, _ = forward(cfg, W, prompt, position_offset(f, i) + np.arange(len(prompt)), cache)
    return cache, int(np.argmax(logits[-1]))


def replay(cfg, W, f, i: int, start_state, variant: str | None = None, rounds_max: int | None = None,
           stop=None) -> list:
    """The verify logits [T_r, V] of the golden rounds (the first `rounds_max`), computed as the replay
    would under `variant`, from `start_state` = prefill(...). `stop(r, logits)`: end after round r when
    true (a variant already refuted there need not be replayed further)."""
    p = f"golden/p{i}/"
    P, pos0 = len(f[p + "prompt_ids"]), position_offset(f, i)
    cache, bonus = start_state[0].copy(), start_state[1]
    start, rounds = P, []
    for r, golden_start in enumerate(np.asarray(f[p + "ddtree/round_start"])[:rounds_max]):
        if start != golden_start:
            break
        tree = golden_tree(f, p, r)
        ids, positions, mask = compile_tree(tree, bonus, start, pos0)
        T = len(ids)
        if variant == "positions-by-index":
            positions = pos0 + start + np.arange(T)
        elif variant == "positions-all-root":
            positions = np.full(T, pos0 + start)
        elif variant == "mask-sees-next":
            mask = np.array(mask)
            mask[np.arange(T - 1), start + np.arange(T - 1) + 1] = 0.0
        elif variant == "mask-causal":
            mask = np.array(mask)
            mask[:, start:] = np.where(np.tril(np.ones((T, T), bool)), 0.0, -np.inf)
        lg, _ = forward(cfg, W, ids, positions, cache, mask)
        acc, bonus = walk(tree.child_maps, np.argmax(lg, -1))
        if variant == "truncate-only":
            cache.truncate(start + len(acc))
        else:
            cache.compact(start, np.asarray(acc))
        start += len(acc)
        rounds.append(lg)
        if stop is not None and stop(r, lg):
            break
    return rounds


def _decisive(lg: np.ndarray, margin: float) -> np.ndarray:
    top2 = np.sort(lg, -1)[:, -2:]                                       # [T, 2]
    return (top2[:, 1] - top2[:, 0]) >= margin


def _engine_rounds(f, out: dict, i: int) -> list[np.ndarray]:
    go = np.asarray(f[f"golden/p{i}/ddtree/tree_offsets"])
    arg = np.asarray(out[f"p{i}/ddtree/verify_argmax"])
    n = len(np.asarray(out[f"p{i}/ddtree/accepted_offsets"])) - 1
    return [arg[go[r]:go[r + 1]] for r in range(min(n, len(go) - 1))]


def _misses(rounds, eng, margin) -> tuple[int, int, tuple | None]:
    """(differing decisive rows, decisive rows compared, the first difference (round, node))."""
    bad, seen, first = 0, 0, None
    for r, (lg, e) in enumerate(zip(rounds, eng)):
        if len(e) != len(lg):
            return bad + len(e), seen + len(e), first or (r, 0)
        dec = _decisive(lg, margin)
        diff = dec & (np.argmax(lg, -1) != e)
        if diff.any() and first is None:
            first = (r, int(np.flatnonzero(diff)[0]))
        bad, seen = bad + int(diff.sum()), seen + int(dec.sum())
    return bad, seen, first


def evaluate_tree(f, cfg, W, i: int, out: dict, hypotheses, overrides=(), profile="fp32",
                  upto: int | None = None) -> tuple[list, dict]:
    """Findings for the DDTree hypotheses at prompt i's replay, and {id: refuted?}. `upto`: the first
    failing round; rounds after it are not recomputed (the mistake must explain the rounds up to it)."""
    if f"p{i}/ddtree/verify_argmax" not in out:
        return [], {}
    rule = resolve_rule(f"p{i}/ddtree/path_logits", manifest_rule(profile_taps(f.metadata, profile).get("ar/logits")),
                        overrides)
    margin = 2 * rule.atol
    n = None if upto is None else upto + 1
    eng = _engine_rounds(f, out, i)[:n]
    state = prefill(cfg, W, f, i)
    ref = replay(cfg, W, f, i, state, None, n)
    ref_bad, _, ref_first = _misses(ref, eng, margin)
    ref_bad += abs(len(ref) - len(eng))
    def refuted_at(r, lg):                                              # a decisive row the variant gets wrong
        return r >= len(eng) or _misses([lg], [eng[r]], margin)[0] > 0

    findings, tested = [], {}
    for h in hypotheses:
        best = None
        for v in h.tree:
            rounds = replay(cfg, W, f, i, state, v, n, refuted_at)
            bad, seen, _ = _misses(rounds, eng, margin)
            bad += 0 if bad else abs(len(rounds) - len(eng))
            if best is None or bad < best[0]:
                best = (bad, seen, v, len(rounds))
        if best is None:
            continue
        bad, seen, v, n_rounds = best
        matched = bad == 0 and ref_bad > 0
        tested[h.id] = not matched
        if matched:
            where = "" if ref_first is None else f" (first: round {ref_first[0]}, node {ref_first[1]})"
            findings.append({
                "id": h.id, "title": h.title, "kind": "matched", "score": float(ref_bad + 1), "variant": TREE_VARIANTS[v],
                "evidence": (f"p{i} DDTree replay: the engine's verify argmax equals the replay with "
                             f"{TREE_VARIANTS[v]} on all {seen} decisive rows of {n_rounds} "
                             f"round{'s' if n_rounds != 1 else ''}; "
                             f"the correct replay differs on {ref_bad} row{'s' if ref_bad != 1 else ''}{where}")})
    return findings, tested
