"""Judging the AR token stream: the engine's argmax at every golden step equals the golden token
(exact). A mismatch reports the step, both tokens, the golden top-1/top-2 margin and the engine's logit
error there; a flip at a near-tie of the profile that the engine's own logits explain
(conformance/verify/near_ties.py) is reported, not failed. Under the fp32 profile there are none.
"""
from __future__ import annotations

import numpy as np

from conformance.report.verdict import CheckResult
from conformance.verify.context import Prompt
from conformance.verify.near_ties import explains_flip, logits_atol


def token_check(pr: Prompt, out: dict) -> CheckResult:
    """Exact, except that a flip at a near-tie step (`pr.near`: golden margin <= 2 x the profile's logits
    atol) that the engine's own logits explain (near_ties.explains_flip: its row's error is between half
    the margin and that atol) is listed in `near_ties` and the message, not failed."""
    name, near, atol = pr.p + "ar/tokens", pr.near, logits_atol(pr.run.man)
    gold, got = np.asarray(pr.golden("ar/tokens")), np.asarray(out[name])      # both [n]: validated
    bad = np.nonzero(gold != got)[0]
    metrics = {"tokens": int(len(gold)), "matching_prefix": int(bad[0]) if bad.size else len(gold)}
    if not bad.size:
        return CheckResult(name, "pass", "tokens", metrics, {"exact": True})
    gl, el, margins = pr.golden("ar/logits"), out[pr.p + "ar/logits"], np.asarray(pr.golden("ar/margins"))
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
    err = float(np.max(np.abs(np.asarray(el[s], np.float64) - np.asarray(gl[s]))))
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
