"""Near-ties: golden decisions so close that an engine inside the precision profile may decide otherwise.

Tokens and expert choices are judged exactly, except where the golden decision is within reach of the
profile's own noise AND the engine's own reported numbers explain its decision (docs/conformance.md,
section 3a). A profile's reach alone is no licence: where it is wider than the margins every flip would
be "within reach", so a flip is granted only when the engine shows the values it decided on, and those
values are themselves judged numerically.

- **A token** at step s is a near-tie candidate when its golden top-1/top-2 margin is at most twice the
  profile's logits atol (a flip needs an error of half the margin on two logits) and that atol judges
  something (a tolerance that would pass all-zero logits grants nothing). A flip there is a near-tie
  when the engine's token is the argmax of its own `ar/logits` row (validated, conformance/verify/outputs.py)
  and its logit error on that row is at least half the golden margin and at most the logits atol
  (`explains_flip`): the engine's own numbers, within the profile, chose its token. A DDTree
  stream that leaves the golden one at a candidate j is a near-tie when its token j is the engine's own
  AR token j or the argmax of its own `path_logits[j - 1]`.
- **An expert set** that differs from the golden one is a near-tie when the engine reported that tap's
  `router_scores`, the bundle holds golden ones to judge them against (a bundle made before decode steps
  recorded them keeps none for decode, whose routing then stays exact), the engine's set is exactly the
  top-K of its own scores + the correction bias (`refmodel.model.select_experts`, groups included), and
  every swapped pair's golden biased scores are within twice the layer's `router_scores` atol.

Under the fp32 profile `kdtr gen` keeps every margin above 4 atol, so no token is a near-tie, and, unless
the bundle was made with `--routing-near-ties held` (metadata `tolerances.routing` "held"), every routing
gap above 4 router atol, so no expert set is one either and everything stays exact.

- **The live DDTree** (an engine's own loop, conformance/verify/judge_live.py) runs its router freely: tree rows
  have no golden expert sets to hold. On a bundle whose fp32 routing is held, the first golden routing
  decision of a prompt that is a near-tie (`routing_tie_row`) is where the live run may legitimately part
  from the golden one: the live checks judge exactly what lies before it and only self-consistency after
  it. (The bf16 profile keeps its exact live checks: docs/conformance.md §8.)
"""
from __future__ import annotations

import numpy as np

from conformance.metrics import routing_gaps
from conformance.tolerance import entry_atol
from refmodel.model import select_experts


def logits_atol(man: dict) -> float:
    """The profile's logits bound: the looser of the prefill and AR logits atol (as `kdtr gen` uses)."""
    return max(entry_atol(man.get("prefill/logits")), entry_atol(man.get("ar/logits")))


def token_near_ties(margins: np.ndarray, man: dict, vacuous: bool = False) -> np.ndarray:
    """[n] bool: the golden greedy decisions an engine within the profile may flip (candidates: a flip
    there still needs `explains_flip`). `vacuous`: the logits tolerance judges nothing (it would pass
    all-zero logits), so it licenses no flip either."""
    m = np.asarray(margins, np.float64)
    if vacuous:
        return np.zeros(m.shape, bool)
    return m <= 2 * logits_atol(man)


def explains_flip(golden_row: np.ndarray, engine_row: np.ndarray, margin: float, atol: float) -> bool:
    """Whether an engine's logits row accounts for its flip at a near-tie: its largest logit error there
    is at least half the golden margin (what a flip takes; the engine's token is its row's argmax:
    validated) and within the profile's logits atol `atol` (noise, not a fault)."""
    err = np.max(np.abs(np.asarray(engine_row, np.float64) - np.asarray(golden_row, np.float64)))
    return bool(margin <= 2 * err <= 2 * atol)


def routing_near_ties(f, g: str, key: str, man: dict, golden_ids: np.ndarray, actual_ids: np.ndarray,
                      engine_scores: np.ndarray | None, cfg) -> tuple[np.ndarray, np.ndarray]:
    """(rows whose expert sets differ, the subset of those that are near-ties) for topk_ids tap `key`
    (relative to golden/p{i}/, e.g. "prefill/L3/topk_ids"); `engine_scores`: the engine's own
    router_scores at that tap (None when not reported)."""
    g_sets = np.sort(golden_ids, axis=-1)
    a_sets = np.sort(actual_ids, axis=-1)
    differ = np.nonzero((g_sets != a_sets).any(axis=-1))[0]
    phase, layer = key.split("/")[0], key.split("/")[1]
    scores_key = f"{phase}/{layer}/router_scores"
    if not differ.size or engine_scores is None or g + scores_key not in f:
        return differ, differ[:0]
    bias = np.asarray(f.get(f"model.layers.{layer[1:]}.mlp.gate.e_score_correction_bias"), np.float64)
    own = np.sort(select_experts(cfg, np.asarray(engine_scores, np.float64) + bias), axis=-1)  # [T, K]
    choice = np.asarray(f[g + scores_key], np.float64) + bias                       # [T, E] biased
    reach = 2 * entry_atol(man.get(scores_key))
    near = []
    for t in differ:
        dropped = np.setdiff1d(g_sets[t], a_sets[t])
        added = np.setdiff1d(a_sets[t], g_sets[t])
        if not dropped.size or not added.size or not np.array_equal(own[t], a_sets[t]):
            continue
        if choice[t, dropped].max() - choice[t, added].min() <= reach:
            near.append(t)
    return differ, np.asarray(near, np.int64)


def stream_near_tie(gold: np.ndarray, mine: np.ndarray, near: np.ndarray, own_ar: np.ndarray,
                    path_logits: np.ndarray) -> int | None:
    """The index j where an engine's DDTree stream first leaves the golden one, if that is a near-tie:
    a candidate whose token j the engine's own logits chose (its AR token j, or the argmax of its
    path_logits[j - 1], the committed tree row that predicted token j)."""
    n = min(len(gold), len(mine))
    bad = np.nonzero(np.asarray(gold[:n]) != np.asarray(mine[:n]))[0]
    if not bad.size or bad[0] >= len(near) or not near[bad[0]]:
        return None
    j = int(bad[0])
    return j if own_choice(j, int(mine[j]), own_ar, path_logits) else None


def own_choice(j: int, token: int, own_ar: np.ndarray, path_logits: np.ndarray) -> bool:
    """Whether DDTree token j = `token` is what the engine's own logits chose: its AR token j, or the
    argmax of path_logits[j - 1]."""
    if j < len(own_ar) and int(own_ar[j]) == token:
        return True
    return 1 <= j <= len(path_logits) and int(np.argmax(np.asarray(path_logits[j - 1]))) == token


def routing_tie_row(f, g: str, man: dict, cfg) -> int | None:
    """The first cache row of prompt g (prefill row r, or P + s for decode step s) whose golden routing
    decision, in any MoE layer, is a near-tie of the profile: the golden K-th vs (K+1)-th biased score gap
    within twice that tap's router_scores atol, so an engine within the profile may choose another set
    there. None when every recorded routing decision of the prompt is decisive (a decode step whose
    router_scores the bundle does not record counts as decisive: such bundles hold no near-ties)."""
    P, first = len(f[g + "prompt_ids"]), None
    for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        for phase, row0 in (("prefill", 0), ("ar", P)):
            rows = near_tie_rows(f, g, phase, l, man, cfg)
            near = np.nonzero(rows)[0] if rows is not None else np.zeros(0, np.int64)
            if near.size and (first is None or row0 + int(near[0]) < first):
                first = row0 + int(near[0])
    return first


def near_tie_rows(f, g: str, phase: str, l: int, man: dict, cfg) -> np.ndarray | None:
    """[T] bool: the rows of prompt g's `phase` ("prefill" or "ar") routing in MoE layer l whose golden
    K-th vs (K+1)-th biased score gap is within twice that tap's router_scores atol in `man` (a profile's
    taps): the decisions an engine within the profile may take otherwise. None when the bundle records no
    router_scores there (or top-K takes every expert): every such decision counts as decisive."""
    key = f"{phase}/L{l}/router_scores"
    if g + key not in f:
        return None
    bias = np.asarray(f.get(f"model.layers.{l}.mlp.gate.e_score_correction_bias"), np.float64)     # [E]
    gaps = routing_gaps(np.asarray(f[g + key], np.float64) + bias, cfg.num_experts_per_tok)
    return None if gaps is None else gaps <= 2 * entry_atol(man.get(key))
