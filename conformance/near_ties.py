"""Near-ties: golden decisions so close that an engine inside the precision profile may decide otherwise.

Tokens and expert choices are judged exactly, except where the golden decision is within reach of the
profile's own noise (docs/conformance.md, section 3a):

- **A token** at step s is a near-tie when its golden top-1/top-2 margin is at most twice the profile's
  logits atol: a flip needs an error of half the margin on two logits.
- **An expert set** of a prefill row is a near-tie when every swapped pair is: the golden biased routing
  score of each expert the engine dropped exceeds that of each one it added by at most twice the
  layer's `router_scores` atol. Decode steps keep no golden router scores, so there a differing set is
  a near-tie when the profile's own reference changed expert sets at that tap too
  (`reference_mismatches` > 0, recorded by `kdtr gen`): the precision itself flips routing there.
  The count is not a bound: the engine's flips are a different sample of the same noise (measured on
  the tiny bundle: 12 rows where the reference had 7). Their consequences (`resid_out`, logits) are
  still judged numerically.

Under the fp32 profile `kdtr gen` keeps every margin above 4 atol and every routing gap above 4 router
atol, so nothing is a near-tie and everything stays exact.
"""
from __future__ import annotations

import numpy as np

from conformance.tolerance import DerivedTolerance


def _atol(entry: dict | None) -> float:
    """The derived atol of a manifest entry (0 for an exact or absent one)."""
    if not entry or "baseline_max_abs" not in entry:
        return 0.0
    return DerivedTolerance.from_dict(entry).rule().atol


def logits_atol(man: dict) -> float:
    """The profile's logits bound: the looser of the prefill and AR logits atol (as `kdtr gen` uses)."""
    return max(_atol(man.get("prefill/logits")), _atol(man.get("ar/logits")))


def token_near_ties(margins: np.ndarray, man: dict) -> np.ndarray:
    """[n] bool: which golden greedy decisions an engine within the profile may flip."""
    return np.asarray(margins, np.float64) <= 2 * logits_atol(man)


def routing_near_ties(f, g: str, key: str, man: dict, golden_ids: np.ndarray,
                      actual_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows whose expert sets differ, the subset of those that are near-ties) for topk_ids tap `key`
    (relative to golden/p{i}/, e.g. "prefill/L3/topk_ids")."""
    g_sets = np.sort(golden_ids, axis=-1)
    a_sets = np.sort(actual_ids, axis=-1)
    differ = np.nonzero((g_sets != a_sets).any(axis=-1))[0]
    if not differ.size:
        return differ, differ
    phase, layer = key.split("/")[0], key.split("/")[1]
    scores_key = f"{phase}/{layer}/router_scores"
    if phase != "prefill" or g + scores_key not in f:
        flips = man.get(key, {}).get("reference_mismatches", 0) > 0
        return differ, differ if flips else differ[:0]
    bias = np.asarray(f.get(f"model.layers.{layer[1:]}.mlp.gate.e_score_correction_bias"), np.float64)
    choice = np.asarray(f[g + scores_key], np.float64) + bias                       # [T, E] biased
    reach = 2 * _atol(man.get(scores_key))
    near = []
    for t in differ:
        dropped = np.setdiff1d(g_sets[t], a_sets[t])
        added = np.setdiff1d(a_sets[t], g_sets[t])
        if choice[t, dropped].max() - choice[t, added].min() <= reach:
            near.append(t)
    return differ, np.asarray(near, np.int64)


def stream_near_tie(gold: np.ndarray, mine: np.ndarray, near: np.ndarray) -> int | None:
    """The index where an engine's token stream first leaves the golden one, if that is a near-tie."""
    n = min(len(gold), len(mine))
    bad = np.nonzero(np.asarray(gold[:n]) != np.asarray(mine[:n]))[0]
    if bad.size and bad[0] < len(near) and near[bad[0]]:
        return int(bad[0])
    return None
