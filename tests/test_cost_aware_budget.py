"""An engine that picks its own tree budget per round (a cost-aware budget, docs/ddtree.md §3a) and declares it
(`ddtree_live/round_budget`, docs/run-dump.md §5) is judged on what it verified: a round whose tree is the
golden tree's first round_budget nodes has its path and bonus judged against the golden argmax on those rows;
the stream must stay the golden one. Without the declaration, or with a wrong one, a cut tree fails."""
import numpy as np
import pytest

from bench.bench_budget_policy import K26_4K     # the K2.6 layer's verify cost per rows, measured on the H200
from conformance.engines.reference_engine import CostAwareReference
from conformance.exit_codes import ExitCode
from conformance.records import LIVE_BUDGET
from conformance.verify.runner import verify

BUNDLES = ["bundles/model_tiny.kdtr", "bundles/model_int4_tiny.kdtr"]
# Under K26_4K (verify cost per forward of T rows relative to one AR step) the reference's trees of 32 nodes
# are cut in most rounds.


def live(v, what: str) -> list:
    return [c for c in v.checks if c.name.endswith(f"ddtree_live/{what}")]


@pytest.mark.parametrize("bundle", BUNDLES)
def test_a_cost_aware_engine_passes_and_its_cut_rounds_are_judged(bundle, tmp_path):
    dump = tmp_path / "run.kdtr"
    v = verify(bundle, engine=CostAwareReference(K26_4K), save_dump=str(dump))
    assert v.exit_code == ExitCode.OK, [(c.name, c.message) for c in v.checks if c.status != "pass"]
    again = verify(bundle, dump=str(dump))                              # the run dump carries the budgets
    assert again.exit_code == ExitCode.OK and [c.metrics for c in live(again, "trees")] == \
        [c.metrics for c in live(v, "trees")]
    trees = [c.metrics for c in live(v, "trees")]
    pruned, compared = sum(m["pruned"] for m in trees), sum(m["compared"] for m in trees)
    assert pruned > 0, "no round was cut: the test does not reach the rule"
    # what the judge could compare (docs/ddtree.md §3a): the cut rounds that start where a golden round does;
    # the others start elsewhere (an earlier cut accepted fewer tokens): only the stream and the records'
    # self-consistency judge them
    assert compared == pruned + sum(m["equal"] + m["after_routing_tie"] + len(m["near_ties"]) for m in trees)
    print(f"{bundle}: {sum(m['rounds'] for m in trees)} rounds, {pruned} cut and compared with the golden tree, "
          f"{sum(m['not_comparable'] for m in trees)} not comparable")
    forwards = [c.metrics for c in live(v, "target_forwards")]
    assert sum(m["engine"] for m in forwards) > sum(m["golden"] for m in forwards)   # smaller trees, more rounds
    assert all(c.status == "pass" and c.metrics["tokens"] > 0 for c in live(v, "tokens"))


class Undeclared(CostAwareReference):
    """Cuts its trees as the cost-aware engine does, but does not say so."""

    def records(self, live_records: dict, rounds: list) -> dict:
        return live_records


class DeclaresOneMore(CostAwareReference):
    """Declares a budget one node larger than the tree it verified (within the bundle's budget)."""

    def records(self, live_records: dict, rounds: list) -> dict:
        out = super().records(live_records, rounds)
        return {**out, LIVE_BUDGET: np.minimum(out[LIVE_BUDGET] + 1, 32)}


class DeclaresOneLess(CostAwareReference):
    def records(self, live_records: dict, rounds: list) -> dict:
        out = super().records(live_records, rounds)
        return {**out, LIVE_BUDGET: np.maximum(out[LIVE_BUDGET] - 1, 0)}


@pytest.mark.parametrize("engine, says", [(Undeclared, "declares no ddtree_live/round_budget"),
                                          (DeclaresOneMore, "a cut tree has exactly round_budget nodes")])
def test_a_cut_tree_without_its_budget_fails_the_trees_check(engine, says):
    v = verify(BUNDLES[0], engine=engine(K26_4K))
    assert v.exit_code != ExitCode.OK
    failed = [c for c in live(v, "trees") if c.status == "fail"]
    assert failed and all(says in c.message for c in failed), [c.message for c in failed]


def test_a_tree_over_its_declared_budget_is_an_invalid_output():
    v = verify(BUNDLES[0], engine=DeclaresOneLess(K26_4K))
    assert v.exit_code == ExitCode.ENGINE_ERROR
    assert any("round_budget" in c.message and "over its budget" in c.message for c in v.checks), \
        [c.message for c in v.checks if c.status != "pass"][:3]


class WrongBonusOnACutRound(CostAwareReference):
    """A consistent but wrong verify on a prompt's first round when it was cut (it starts where the golden
    round 0 does, so it is compared): the argmax at its last accepted node, and so its bonus, replaced by a
    token outside the tree (the walk over its own records still holds)."""

    def records(self, live_records: dict, rounds: list) -> dict:
        out = super().records(live_records, rounds)
        if len(rounds[0].tree_tokens) >= 32:
            return out
        r = 0
        offs = np.cumsum([0] + [len(x.verify_argmax) for x in rounds])
        last = int(rounds[r].accepted[-1])
        post, bonus = out["verify_argmax"].copy(), out["round_bonus"].copy()
        tree = rounds[r].tree_tokens
        wrong = next(t for t in range(self.cfg.vocab_size) if t != bonus[r] and t not in tree)
        post[offs[r] + last], bonus[r] = wrong, wrong
        return {**out, "verify_argmax": post, "round_bonus": bonus}


def test_a_wrong_verify_on_a_cut_round_fails_naming_the_golden_argmax():
    v = verify(BUNDLES[0], engine=WrongBonusOnACutRound(K26_4K))
    assert v.exit_code != ExitCode.OK
    failed = [c for c in live(v, "trees") if c.status == "fail"]
    assert failed and all("the golden tree's first" in c.message for c in failed), [c.message for c in failed]
