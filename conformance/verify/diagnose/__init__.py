"""Diagnosis: which known mistake explains a failing verdict, with the evidence (docs/diagnosis.md).

`diagnose(engine, f, first, checks, out, ...)` -> a list of findings, best first, each
{"id", "title", "kind": "matched" | "consistent", "score", "evidence"}; empty when no known mistake
explains the failure. At the first divergence, and at the first divergence of every other failing prompt,
the hypotheses predicting that tap are recomputed (evaluate.py); a prompt whose only failures are in its
DDTree replay gets the DDTree hypotheses (tree.py); then signatures of the whole verdict (signatures.py)
add "consistent" hypotheses that no recomputation refuted. Matches are ranked by place (the first
divergence's first), then by score; the consistent ones after them.
"""
from __future__ import annotations

import numpy as np

from conformance.verify.diagnose.evaluate import Place, evaluate_layer, refuted as _refuted
from conformance.verify.diagnose.library import BY_ID, HYPOTHESES
from conformance.verify.diagnose.signatures import observed
from conformance.verify.diagnose.tree import evaluate_tree
from conformance.verify.judge_taps import _divergence, _time_key
from conformance.records import numeric_keys, prompts_of
from refmodel.stored import read_model
from refmodel.stored import upcast_if_fits

MAX_PLACES = 4                   # failing prompts whose first divergence is recomputed
MAX_TREES = 1                    # failing prompts whose DDTree replay is recomputed


def prompt_divergences(f, checks, first, cfg) -> list:
    """The first divergence, then the first divergence of each other failing prompt (judge's order)."""
    keys = numeric_keys(cfg, set(f.metadata["taps"]["ar"]))
    order = {k: n for n, k in enumerate(keys)}
    per: dict = {}
    for c in checks:
        if c.status != "fail" or c.kind != "numeric" or "/" not in c.name:
            continue
        p, key = c.name.split("/", 1)
        if key in order:
            per.setdefault(p, []).append((_time_key(key, c, order[key]), c))
    out = [first] if first is not None else []
    for p in sorted(per, key=lambda p: int(p[1:])):
        if first is not None and first.name.startswith(p + "/"):
            continue
        c = min(per[p], key=lambda t: t[0])[1]
        out.append(_divergence(c, len(f[f"golden/{p}/prompt_ids"])))
    return out


def _ddtree_prompts(f, checks) -> list[tuple[int, int | None]]:
    """(prompt, its first failing round or None) for prompts whose golden-tree replay fails while none of
    their AR taps or tokens do."""
    bad = [c for c in checks if c.status == "fail" and not c.name.endswith("/long_position")]
    out = []
    for i in prompts_of(f):
        mine = [c for c in bad if c.name.startswith(f"p{i}/")]
        if any(c.name.startswith(f"p{i}/ddtree/") for c in mine) and all(c.kind == "ddtree" for c in mine):
            rounds = next((c for c in mine if c.name == f"p{i}/ddtree/rounds"), None)
            out.append((i, None if rounds is None else rounds.metrics.get("matching")))
    return out


def diagnose(engine, f, first, checks, out: dict, overrides=(), dtype: str = "float32",
             profile: str = "fp32") -> list[dict]:
    """Findings for a failing verdict (module docstring); [] when nothing failed."""
    if not any(c.status == "fail" for c in checks):
        return []
    cfg, W = read_model(f, np.float64)
    W = upcast_if_fits(W, copies=1)
    found, refuted = [], {}
    for n, div in enumerate(prompt_divergences(f, checks, first, cfg)[:MAX_PLACES]):
        if div.layer is None:
            continue
        got, tested = evaluate_layer(engine, f, cfg, W, Place(f, div, overrides, profile), out, dtype, HYPOTHESES)
        found += [{**x, "place": n} for x in got]
        refuted.update({k: _refuted(*r) or refuted.get(k, False) for k, r in tested.items()})
    tree_h = [h for h in HYPOTHESES if h.tree]
    for i, upto in _ddtree_prompts(f, checks)[:MAX_TREES]:
        got, tested = evaluate_tree(f, cfg, W, i, out, tree_h, overrides, profile, upto)
        found += [{**x, "place": MAX_PLACES} for x in got]
        refuted.update(tested)
    best: dict = {}
    for x in found:                                                       # one entry per id: its earliest
        key = (x["place"], -x["score"])                                   # place, there its best score
        if x["id"] not in best or key < (best[x["id"]]["place"], -best[x["id"]]["score"]):
            best[x["id"]] = x
    matched = sorted(best.values(), key=lambda x: (x["place"], -x["score"]))   # the first divergence's first
    facts = observed(f, checks, first, out)
    consistent = []
    for h in HYPOTHESES:
        if h.id in best or refuted.get(h.id):
            continue
        sets = [s for s in h.signatures if s and all(fact in facts for fact in s)]
        if sets:
            s = max(sets, key=len)
            consistent.append({"id": h.id, "title": h.title, "kind": "consistent", "score": float(len(s)),
                               "evidence": "signature only: " + "; ".join(facts[x] for x in s)})
    consistent.sort(key=lambda x: -x["score"])
    return [{k: x[k] for k in ("id", "title", "kind", "score", "evidence")} for x in matched + consistent]


__all__ = ["diagnose", "HYPOTHESES", "BY_ID"]


def closeness(engine, f, out: dict, places, overrides=(), dtype: str = "float32", profile: str = "fp32") -> list:
    """The honest-engine control (docs/diagnosis.md): the layer hypotheses evaluated at each of `places`
    ((prompt, phase, layer, tap, step) tuples) whether or not it failed. Returns (place name, id,
    ratio_hyp, ratio_ref, matched) for every hypothesis recomputed; an honest engine has no match and no
    hypothesis CLOSER times closer to it than the reference."""
    from conformance.report.verdict import Divergence
    from conformance.verify.diagnose.evaluate import matched
    cfg, W = read_model(f, np.float64)
    W = upcast_if_fits(W, copies=1)
    rows = []
    for i, phase, layer, tap, step in places:
        name = f"p{i}/{phase}/L{layer}/{tap}"
        div = Divergence(name, layer, tap, phase, step, None, None, None, None)
        _, tested = evaluate_layer(engine, f, cfg, W, Place(f, div, overrides, profile), out, dtype, HYPOTHESES)
        rows += [(name if step is None else f"{name}@{step}", k, rh, rr, matched(rh, rr))
                 for k, (rh, rr) in tested.items()]
    return rows
