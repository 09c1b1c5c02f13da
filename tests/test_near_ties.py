"""Near-ties under a precision profile: a flipped decision passes only where the golden decision is within
twice the profile's bound AND the engine's own reported numbers explain it; the same flip fails under the
fp32 profile, and a flip the engine's numbers do not explain fails under both."""
import numpy as np
import pytest

from conformance.precision import profile_taps
from conformance.tolerance import DerivedTolerance
from conformance.verify.context import Run
from conformance.verify.judge import judge
from conformance.verify.near_ties import logits_atol, routing_near_ties
from conformance.verify.outputs import InvalidOutputs
from refmodel.config import ModelConfig


@pytest.fixture(scope="module")
def run(reference_run):
    return reference_run


def status(checks, name):
    return next(c for c in checks if c.name == name)


def near_tie_step(f):
    """The p0 step with the smallest golden margin: a near-tie under bf16, decisive under fp32."""
    margins = np.asarray(f["golden/p0/ar/margins"])
    s = int(np.argmin(margins))
    assert margins[s] <= 2 * logits_atol(profile_taps(f.metadata, "bf16"))
    assert margins[s] > 2 * logits_atol(profile_taps(f.metadata, "fp32"))
    return s, float(margins[s])


def flip_step(f, out, s, err):
    """Outputs whose p0 logits row s raises the golden runner-up `err` above the golden top-1 (its token
    follows: the row's argmax), everything else the correct run's."""
    gl = np.asarray(f["golden/p0/ar/logits"][s], np.float64)
    top, runner = np.argsort(gl)[-1], np.argsort(gl)[-2]
    logits, toks = np.array(out["p0/ar/logits"]), np.array(out["p0/ar/tokens"])
    logits[s] = gl
    logits[s, runner] = gl[top] + err
    toks[s] = runner
    return {**out, "p0/ar/logits": logits, "p0/ar/tokens": toks}


def test_a_token_flip_its_own_logits_explain_at_a_near_tie_passes_only_under_bf16(run):
    f, out = run
    s, margin = near_tie_step(f)
    flipped = flip_step(f, out, s, 1e-3)                                  # error: just over the margin
    c = status(judge(Run.of(f, "bf16"), flipped)[0], "p0/ar/tokens")
    assert c.status == "pass" and c.metrics["near_ties"] == [s] and "near-tie flips at steps" in c.message
    assert status(judge(Run.of(f, "fp32"), flipped)[0], "p0/ar/tokens").status == "fail"


def test_a_near_tie_flip_with_a_logit_error_beyond_the_profile_is_a_token_failure(run):
    """The same step, flipped by a logits row far outside the bf16 logits atol: a fault, not noise."""
    f, out = run
    s, _ = near_tie_step(f)
    flipped = flip_step(f, out, s, 4 * logits_atol(profile_taps(f.metadata, "bf16")))
    c = status(judge(Run.of(f, "bf16"), flipped)[0], "p0/ar/tokens")
    assert c.status == "fail" and "exceeds the profile's logits atol" in c.message


def test_a_token_that_is_not_its_own_logits_argmax_is_invalid_output(run):
    """Tokens shifted by one under unchanged logits (the reviewer's 'garbage stream'): not a greedy
    decision at all, refused before judging under every profile."""
    f, out = run
    V = f.metadata["model_config"]["vocab_size"]
    bad = {**out, "p0/ar/tokens": (np.asarray(out["p0/ar/tokens"]) + 1) % V}
    for profile in ("bf16", "fp32"):
        with pytest.raises(InvalidOutputs, match="p0/ar/tokens holds .* but the argmax of ar/logits row 0"):
            judge(Run.of(f, profile), bad)


def test_a_garbage_ddtree_stream_fails_under_bf16(run):
    """Every DDTree token shifted by one: the first differs at token 0, where neither the engine's AR token
    nor any tree row chose it, so no near-tie is granted however wide the profile."""
    f, out = run
    V = f.metadata["model_config"]["vocab_size"]
    bad = dict(out)
    for i in range(2):
        bad[f"p{i}/ddtree/tokens"] = (np.asarray(out[f"p{i}/ddtree/tokens"]) + 1) % V
    checks = judge(Run.of(f, "bf16"), bad)[0]
    for i in range(2):
        c = status(checks, f"p{i}/ddtree/tokens")
        assert c.status == "fail" and "differs from the golden DDTree stream at token 0" in c.message
        assert status(checks, f"p{i}/ddtree/tokens_vs_own_ar").status == "fail"


def test_a_ddtree_stream_leaving_at_its_first_token_skips_what_it_cannot_compare(run):
    """The stream leaves the golden one at a near-tie token 0 chosen by the engine's own AR token 0: no
    round and no committed row is comparable, so rounds and path_logits are skipped with that reason
    (never a pass over 0 rounds), and coverage says so."""
    from conformance.report.coverage import defined_checks
    from conformance.verify.judge import coverage_check
    f, out = run
    margins = np.asarray(f["golden/p0/ar/margins"])
    if margins[0] > 2 * logits_atol(profile_taps(f.metadata, "bf16")):
        pytest.skip("p0 step 0 is no bf16 near-tie on this bundle")
    flipped = flip_step(f, out, 0, 1e-3)
    tokens = np.array(out["p0/ddtree/tokens"])
    tokens[0] = flipped["p0/ar/tokens"][0]
    flipped["p0/ddtree/tokens"] = tokens
    checks = judge(Run.of(f, "bf16"), flipped)[0]
    assert status(checks, "p0/ddtree/tokens").status == "pass"
    for name in ("p0/ddtree/rounds", "p0/ddtree/path_logits", "p0/ddtree/target_forwards"):
        c = status(checks, name)
        assert c.status == "skip" and "near-tie token 0" in c.message, (name, c.message)
    cov = coverage_check(checks, 1.0, defined_checks(f))
    assert cov.status == "fail" and "near-tie token 0" in cov.message and "did not report" not in cov.message


def routing_swap(f, near: bool):
    """Prefill row 0 of p0, layer 1: the golden set with its weakest expert swapped for the strongest
    unchosen one (near=True, the runner-up) or for the weakest expert of all (near=False); the gap."""
    g, l = "golden/p0/", 1
    choice = (np.asarray(f[g + f"prefill/L{l}/router_scores"][0], np.float64)
              + np.asarray(f.get(f"model.layers.{l}.mlp.gate.e_score_correction_bias"), np.float64))
    ids = np.array(f[g + f"prefill/L{l}/topk_ids"])
    order = np.argsort(-choice)
    K = ids.shape[1]
    weakest = np.nonzero(ids[0] == order[K - 1])[0][0]
    ids[0, weakest] = order[K] if near else order[-1]
    return ids, choice[order[K - 1]] - choice[ids[0, weakest]]


def own_scores(f, ids, gap):
    """Router scores that choose `ids` at row 0 of p0 layer 1: the golden ones with the added expert
    lifted just past the dropped one (an error of about the golden gap)."""
    scores = np.array(f["golden/p0/prefill/L1/router_scores"], np.float32)
    added = np.setdiff1d(ids[0], f["golden/p0/prefill/L1/topk_ids"][0])
    scores[0, added] += np.float32(gap + 1e-4)
    return scores


def test_an_expert_swap_at_a_routing_near_tie_passes_only_with_its_own_scores(run):
    f, out = run
    cfg = ModelConfig.from_dict(f.metadata["model_config"])
    bf16 = profile_taps(f.metadata, "bf16")
    reach = 2 * DerivedTolerance.from_dict(bf16["prefill/L1/router_scores"]).rule().atol
    ids, gap = routing_swap(f, True)
    assert gap <= reach / 2, "the runner-up is within the bf16 router bound on this bundle"
    gold = np.asarray(f["golden/p0/prefill/L1/topk_ids"])
    cases = [  # (engine router_scores, near-tie?)
        (own_scores(f, ids, gap), True),                # its own scores choose the swapped set
        (np.asarray(out["p0/prefill/L1/router_scores"]), False),   # its scores choose the golden set
        (None, False),                                  # no scores reported: nothing explains the swap
    ]
    for scores, ok in cases:
        swapped = {**out, "p0/prefill/L1/topk_ids": ids}
        if scores is None:
            swapped.pop("p0/prefill/L1/router_scores")
        else:
            swapped["p0/prefill/L1/router_scores"] = scores
        c = status(judge(Run.of(f, "bf16"), swapped)[0], "p0/prefill/L1/topk_ids")
        assert (c.status == "pass") == ok, (ok, c.message)
        assert status(judge(Run.of(f, "fp32"), swapped)[0], "p0/prefill/L1/topk_ids").status == "fail"
        _, ties = routing_near_ties(f, "golden/p0/", "prefill/L1/topk_ids", bf16, gold, ids, scores, cfg)
        assert ties.tolist() == ([0] if ok else [])


def test_a_far_expert_swap_is_no_near_tie_even_with_its_own_scores(run):
    f, out = run
    cfg = ModelConfig.from_dict(f.metadata["model_config"])
    bf16 = profile_taps(f.metadata, "bf16")
    ids, gap = routing_swap(f, False)
    reach = 2 * DerivedTolerance.from_dict(bf16["prefill/L1/router_scores"]).rule().atol
    assert gap > reach, "the weakest expert is far outside the bf16 router bound"
    gold = np.asarray(f["golden/p0/prefill/L1/topk_ids"])
    _, ties = routing_near_ties(f, "golden/p0/", "prefill/L1/topk_ids", bf16, gold, ids, own_scores(f, ids, gap), cfg)
    assert ties.size == 0


def test_decode_step_sets_its_own_scores_do_not_choose_fail(run):
    """Every decode-step set shifted by one expert id (its reported router scores unchanged, so they still
    choose the golden sets): no near-tie under the bf16 profile, every decode topk_ids check fails."""
    f, out = run
    assert "router_scores" in f.metadata["taps"]["ar"]                  # decode steps record golden scores
    E = f.metadata["model_config"]["n_routed_experts"]
    shifted = dict(out)
    for k in out:
        if "/ar/L" in k and k.endswith("/topk_ids"):
            shifted[k] = (np.asarray(out[k]) + 1) % E
    checks = judge(Run.of(f, "bf16"), shifted)[0]
    bad = [c.name for c in checks if c.name.endswith("/topk_ids") and "/ar/" in c.name and c.status == "fail"]
    assert len(bad) == len([k for k in out if "/ar/L" in k and k.endswith("/topk_ids")]) > 0


def test_a_repeated_expert_id_is_invalid_output_not_a_crash(run):
    f, out = run
    ids = np.array(out["p0/prefill/L1/topk_ids"])
    ids[0, 1] = ids[0, 0]
    for profile in ("fp32", "bf16"):
        with pytest.raises(InvalidOutputs, match=r"p0/prefill/L1/topk_ids row 0 names expert \d+ twice"):
            judge(Run.of(f, profile), {**out, "p0/prefill/L1/topk_ids": ids})
