"""Near-ties under a precision profile: a flipped decision passes only where the golden decision is within
twice the profile's bound; the same flip fails under the fp32 profile, and a decisive flip fails under both."""
import numpy as np
import pytest

from conformance.collect import collect
from conformance.judge import judge
from conformance.near_ties import logits_atol, routing_near_ties
from conformance.profiles import profile_taps
from conformance.reference_engine import ReferenceEngine
from conformance.tolerance import DerivedTolerance
from kdtr_format import open_kdtr


@pytest.fixture(scope="module")
def run(small_bundle):
    """The reference engine's outputs on the small bundle (a correct run), and the open bundle."""
    with open_kdtr(small_bundle) as f:
        e = ReferenceEngine()
        e.load(f)
        yield f, collect(e, f)


def status(checks, name):
    return next(c for c in checks if c.name == name)


def test_a_token_flip_at_a_near_tie_is_reported_not_failed(run):
    f, out = run
    margins = np.asarray(f["golden/p0/ar/margins"])
    bf16 = profile_taps(f.metadata, "bf16")
    s = int(np.argmin(margins))
    assert margins[s] <= 2 * logits_atol(bf16) and margins[s] > 2 * logits_atol(profile_taps(f.metadata, "fp32"))
    flipped = dict(out)
    toks = np.array(out["p0/ar/tokens"])
    toks[s] = np.argsort(np.asarray(f["golden/p0/ar/logits"][s]))[-2]      # the golden runner-up
    flipped["p0/ar/tokens"] = toks
    c = status(judge(f, flipped, profile="bf16")[0], "p0/ar/tokens")
    assert c.status == "pass" and c.metrics["near_ties"] == [s] and "near-tie flips at steps" in c.message
    assert status(judge(f, flipped, profile="fp32")[0], "p0/ar/tokens").status == "fail"


def routing_swap(f, near: bool):
    """Prefill row 0 of p0, layer 1: the golden set with its weakest expert swapped for the strongest
    unchosen one (near=True, the runner-up) or for the weakest expert of all (near=False)."""
    g, l = "golden/p0/", 1
    choice = (np.asarray(f[g + f"prefill/L{l}/router_scores"][0], np.float64)
              + np.asarray(f.get(f"model.layers.{l}.mlp.gate.e_score_correction_bias"), np.float64))
    ids = np.array(f[g + f"prefill/L{l}/topk_ids"])
    order = np.argsort(-choice)
    K = ids.shape[1]
    weakest = np.nonzero(ids[0] == order[K - 1])[0][0]
    ids[0, weakest] = order[K] if near else order[-1]
    return ids, choice[order[K - 1]] - choice[ids[0, weakest]]


def test_an_expert_swap_at_a_routing_near_tie_passes_only_there(run):
    f, out = run
    reach = 2 * DerivedTolerance.from_dict(profile_taps(f.metadata, "bf16")["prefill/L1/router_scores"]).rule().atol
    for near in (True, False):
        ids, gap = routing_swap(f, near)
        if near:
            assert gap <= reach, "the runner-up is within the bf16 router bound on this bundle"
        else:
            assert gap > reach, "the weakest expert is far outside the bf16 router bound"
        swapped = {**out, "p0/prefill/L1/topk_ids": ids}
        c = status(judge(f, swapped, profile="bf16")[0], "p0/prefill/L1/topk_ids")
        assert (c.status == "pass") == near, (near, c.message)
        assert status(judge(f, swapped, profile="fp32")[0], "p0/prefill/L1/topk_ids").status == "fail"
        differ, ties = routing_near_ties(f, "golden/p0/", "prefill/L1/topk_ids", profile_taps(f.metadata, "bf16"),
                                         np.asarray(f["golden/p0/prefill/L1/topk_ids"]), ids)
        assert differ.tolist() == [0] and ties.tolist() == ([0] if near else [])


def test_decode_step_routing_flips_are_near_ties_only_where_bf16_itself_flips(run):
    """Decode steps keep no golden router scores: a differing set is a near-tie where the bf16 reference
    changed sets at that tap too, never under the fp32 profile or where the reference did not."""
    f, out = run
    bf16 = profile_taps(f.metadata, "bf16")
    key = "ar/L1/topk_ids"
    assert bf16[key]["reference_mismatches"] > 0
    ids = np.array(f["golden/p0/" + key])
    E = f.metadata["model_config"]["n_routed_experts"]
    swapped = ids.copy()
    swapped[1, 0] = next(e for e in range(E) if e not in ids[1])       # row 1: one expert for an unchosen one
    for profile, ok in (("bf16", True), ("fp32", False)):
        c = status(judge(f, {**out, "p0/" + key: swapped}, profile=profile)[0], "p0/" + key)
        assert (c.status == "pass") == ok, (profile, c.message)
    steady = {**bf16, key: {"exact": True, "reference_mismatches": 0}}
    differ, ties = routing_near_ties(f, "golden/p0/", key, steady, ids, swapped)
    assert differ.tolist() == [1] and ties.size == 0
