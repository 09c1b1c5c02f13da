"""Testing the hypotheses at one diverging layer tap: the layer recomputed under each mistake on the
inputs the engine computed that tap from, and the engine's tap compared with each recomputation.

Inputs, in order of preference (docs/diagnosis.md):
  own      the engine's own reported taps (the previous layer's resid_out, the layer's cache rows), at the
           golden positions: what localize's second replay uses; compared with the tap from the run;
  replay   the golden inputs, compared with the engine's own run_layer on them (teacher forcing);
  golden   the golden inputs, compared with the tap from the run (a run dump without the input taps):
           the error the earlier layers passed on stays in the comparison.

Measure: `ratio(a, b)` = max |a - b| / the tap's elementwise bound (the bundle's derived tolerance under
the verdict's profile), so 1 is "as far apart as the tolerance allows". A hypothesis is **matched**
when the engine is within the bound of it (ratio_hyp <= 1), beyond the bound of the correct reference
(ratio_ref > 1), and at least CLOSER times closer to it than to the reference. Its score is
ratio_ref / ratio_hyp (capped at 1e6).
"""
from __future__ import annotations

import numpy as np

from conformance.verify.diagnose.layer import Context, Layer
from conformance.tolerance import manifest_rule
from conformance.verify.judge_taps import canonical_routing
from conformance.verify.localize import layer_inputs
from conformance.verify.outputs import widened
from conformance.precision import profile_taps
from conformance.records import position_offset
from conformance.tolerance import resolve_rule
from refmodel.config import ModelConfig

CLOSER = 4.0                 # the hypothesis must explain at least 3/4 of the error (docs/diagnosis.md)
SCORE_CAP = 1e6
ID_TAPS = ("topk_ids",)


class Place:
    """One diverging layer tap of one prompt: names, rows, the rule."""

    def __init__(self, f, div, overrides=(), profile="fp32"):
        self.div, self.i = div, int(div.name.split("/")[0][1:])
        self.layer, self.tap, self.phase = div.layer, div.tap, div.phase
        self.rel = div.name.split("/", 1)[1]                              # prefill/L3/q
        self.rows = slice(div.step, div.step + 1) if div.phase == "ar" else slice(None)
        self.rule = resolve_rule(div.name, manifest_rule(profile_taps(f.metadata, profile).get(self.rel)), overrides)
        self.pos0 = position_offset(f, self.i)
        self.prompt_len = len(f[f"golden/p{self.i}/prompt_ids"])

    def where(self) -> str:
        step = f" decode step {self.div.step}" if self.phase == "ar" else " prefill"
        return f"p{self.i}{step} L{self.layer}/{self.tap}"


def ratio(tap: str, a, b, rule, a_ids=None, b_ids=None) -> float:
    """How far apart a and b are in units of the tap's bound (module docstring); ids: 2 per differing row."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return float("inf")
    if tap in ID_TAPS:
        sa, sb = np.sort(a, -1), np.sort(b, -1)
        return 2.0 * float(np.count_nonzero((sa != sb).any(-1)))
    if tap == "topk_weights" and a_ids is not None:
        a = canonical_routing(np.asarray(a_ids), a)[1]
        b = canonical_routing(np.asarray(b_ids), b)[1]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    bound = rule.atol + rule.rtol * np.abs(b64)
    d = np.abs(a64 - b64)
    if not np.all(np.isfinite(d)):
        return float("inf")
    if not d.size:
        return 0.0
    return float(np.max(d / np.maximum(bound, np.finfo(float).tiny)))


def max_abs(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) if a.shape == b.shape and a.size else float("inf")


def engine_side(engine, f, place: Place, out: dict, dtype: str):
    """(inputs, the engine's taps of that layer on them, source): module docstring's order."""
    i, l, ph = place.i, place.layer, place.phase
    prefix = f"p{i}/{ph}/L{l}/"
    own_taps = {k[len(prefix):]: v for k, v in out.items() if k.startswith(prefix)}
    own_taps = {k: np.asarray(v)[place.rows] for k, v in widened(own_taps, dtype).items()}
    try:
        return layer_inputs(f, place.div, out, dtype), own_taps, "own"
    except KeyError:
        pass
    golden = layer_inputs(f, place.div)
    if engine is not None and getattr(engine, "supports_teacher_forcing", False):
        taps = engine.run_layer(l, golden)
        taps = {k.split("/", 1)[1]: v for k, v in taps.items() if k.startswith(f"L{l}/")}
        if place.tap in taps:
            return golden, {k: np.asarray(v) for k, v in widened(taps, dtype).items()}, "replay"
    return golden, own_taps, "golden"


SOURCE_TEXT = {"own": "on the engine's own reported inputs",
               "replay": "on the golden inputs (the engine's run_layer)",
               "golden": "on the golden inputs (the tap from the run, so earlier layers' error included)"}


def acts(h, f, cfg: ModelConfig, place: Place) -> bool:
    for need in h.acts_on:
        if need == "int4" and not any(n.endswith(".qw") for n in f.names):
            return False
        if need == "moe" and place.layer < cfg.first_k_dense_replace:
            return False
        if need == "long-position" and place.pos0 == 0:
            return False
    return True


def evaluate_layer(engine, f, cfg, W, place: Place, out: dict, dtype: str, hypotheses) -> tuple[list, dict]:
    """Findings (dicts, unsorted) for the layer hypotheses predicting `place`, and {id: (ratio_hyp,
    ratio_ref)} for every hypothesis recomputed there (its best variant)."""
    inputs, eng_taps, source = engine_side(engine, f, place, out, dtype)
    tap, rule = place.tap, place.rule
    if tap not in eng_taps:
        return [], {}
    eng = eng_taps[tap]
    ctx = Context(f, place.phase, place.prompt_len, place.pos0, eng_taps)
    ref_taps = Layer(cfg, W, ctx).run(place.layer, inputs, tap)
    r_ref = ratio(tap, eng, ref_taps[tap], rule, eng_taps.get("topk_ids"), ref_taps.get("topk_ids"))
    findings, tested = [], {}
    for h in hypotheses:
        if not h.variants or tap not in h.taps or place.phase not in h.phases or not acts(h, f, cfg, place):
            continue
        best = None
        for V in h.variants:
            try:
                hyp = V(cfg, W, ctx).run(place.layer, inputs, tap)
            except (ValueError, IndexError, KeyError, FloatingPointError):
                continue                                                  # the variant cannot apply here
            r = ratio(tap, eng, hyp[tap], rule, eng_taps.get("topk_ids"), hyp.get("topk_ids"))
            if best is None or r < best[0]:
                best = (r, V(cfg, W, ctx).label, hyp[tap])
        if best is None:
            continue
        r_hyp, label, value = best
        tested[h.id] = (r_hyp, r_ref)
        if matched(r_hyp, r_ref):
            score = min(r_ref / max(r_hyp, 1.0 / SCORE_CAP), SCORE_CAP)
            findings.append({"id": h.id, "title": h.title, "kind": "matched", "score": round(score, 3),
                             "evidence": _evidence(place, tap, label, eng, value, ref_taps[tap], r_hyp, r_ref,
                                                   rule, source),
                             "variant": label})
    return findings, tested


def matched(r_hyp: float, r_ref: float) -> bool:
    """The matching rule (module docstring)."""
    return r_hyp <= 1.0 < r_ref and r_hyp * CLOSER <= r_ref


def refuted(r_hyp: float, r_ref: float) -> bool:
    """Recomputed, and the engine is not CLOSER times closer to the mistake than to the reference."""
    return not matched(r_hyp, r_ref) and r_hyp * CLOSER > r_ref


def _evidence(place, tap, label, eng, hyp, ref, r_hyp, r_ref, rule, source) -> str:
    if tap in ID_TAPS:
        n = int(round(r_ref / 2))
        return (f"{place.where()} equals the reference with {label} on every row {SOURCE_TEXT[source]}; the "
                f"correct reference chooses other experts on {n} row{'s' if n != 1 else ''}")
    return (f"{place.where()} equals the reference with {label} to {max_abs(eng, hyp):.2g} (max abs, "
            f"{r_hyp:.2g}x the tolerance {rule.atol:.2g}) {SOURCE_TEXT[source]}; the correct reference is "
            f"{max_abs(eng, ref):.2g} away ({r_ref:.3g}x)")
