"""The CUDA engine's cost-aware tree budget (cuda_engine/ddtree.py, docs/ddtree.md §3a): each round's tree cut to
the nodes that pay for their verify rows, priced by a given table or by the engine's own measured times, the cut
verified over its own rows, each round's budget declared and judged.

CPU: the node scores the engine forms from the device builder's log-probs are build_ddtree's bit for bit; the
price is made non-decreasing and picks what refmodel's cost_aware_nodes picks; bad options are refused by the
engine and by `kdtr verify` (usage errors naming the option); the reference engine runs the cost-aware budget
from the command line.
GPU: `kdtr verify`'s runner passes the CUDA engine with the K2.6 price (rounds cut and judged) and with its own
measured price on every committed bundle; the device and host builders, and a run without CUDA graphs, give the
same records under a given price.
"""
import numpy as np
import pytest
from click.testing import CliRunner

from bench.bench_budget_policy import K26_4K, K26_4K_TEXT   # the K2.6 layer's verify cost per rows (H200)
from cuda_oracle import committed_bundles, gpu_ops
from refmodel.ddtree import _top_log_probs, build_ddtree, cost_aware_nodes, verify_cost_table

BUNDLES = committed_bundles()
TINY, EDGE = "bundles/model_tiny.kdtr", "bundles/model_edge.kdtr"


# ------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("case", ["normal", "ties", "topk2", "shallow"])
def test_node_scores_from_the_builders_log_probs_are_build_ddtrees(case):
    from cuda_engine.ddtree import node_scores

    rng = np.random.default_rng(5)
    x = {"normal": rng.normal(0, 3, (15, 400)), "ties": np.tile(rng.integers(0, 3, 400), (15, 1)),
         "topk2": rng.normal(0, 1, (15, 400)), "shallow": rng.normal(0, 0.3, (3, 400))}[case].astype(np.float32)
    budget, topk = (64, 2) if case == "topk2" else (32, None)
    tree = build_ddtree(x, budget, topk)
    _, lp = _top_log_probs(x, min(budget if topk is None else topk, 400))
    got = node_scores(tree, lp)
    assert got.dtype == np.float64 and np.array_equal(got, tree.scores), case      # the same bits
    assert len(set(tree.ranks.tolist())) > 1, "no sibling in the tree: the sibling rule is not reached"


def test_the_price_is_non_decreasing_and_cuts_as_cost_aware_nodes():
    from cuda_engine.ddtree import Price

    p = Price({1: 50.0, 2: 45.0, 5: 60.0, 33: 400.0}, 30.0, "measured")
    assert p.verify_us == {1: 50.0, 2: 50.0, 5: 60.0, 33: 400.0}                  # 2 rows never below 1 row
    scores = np.log(np.linspace(0.9, 0.05, 32))
    assert p.nodes(scores) == cost_aware_nodes(scores, verify_cost_table(p.verify_us), 30.0)
    assert 0 < p.nodes(scores) < 32
    assert Price(K26_4K, 0.0, "given").nodes(scores) == cost_aware_nodes(scores, verify_cost_table(K26_4K))
    assert p.as_dict() == {"source": "measured", "verify": {"1": 50.0, "2": 50.0, "5": 60.0, "33": 400.0},
                           "draft": 30.0}
    assert Price({1: 1.0, 2: 2.0}, np.nan, "measured").as_dict()["draft"] is None      # JSON: no NaN
    for bad in ({1: 1.0, 2: np.inf}, {1: np.nan, 2: 1.0}, {1: 1.0}, {1: 2.0, 2: 1.0}, {0: 1.0, 2: 2.0}):
        with pytest.raises(ValueError):
            verify_cost_table(bad)


def test_the_engine_refuses_bad_budget_options():
    from cuda_engine.device import CudaEngineError
    from cuda_engine.engine import CudaEngine

    for kw, words in (({"ddtree_budget": "greedy"}, "choose one of fixed, cost-aware"),
                      ({"ddtree_costs": K26_4K}, "give --ddtree-budget cost-aware"),
                      ({"ddtree_budget": "cost-aware", "ddtree_costs": {1: 2.0, 2: 1.0}}, "non-decreasing"),
                      ({"ddtree_budget": "cost-aware", "ddtree_draft_cost": -1.0}, ">= 0"),
                      ({"ddtree_budget": "cost-aware", "ddtree_draft_cost": 2.0}, "unit of given verify costs"),
                      ({"ddtree_budget": "cost-aware", "ddtree_costs": {1: 1.0, 2: np.inf}}, "finite")):
        with pytest.raises(CudaEngineError, match=words):
            CudaEngine(**kw)
    e = CudaEngine(ddtree_budget="cost-aware", ddtree_costs=K26_4K, ddtree_draft_cost=0.5)
    assert (e.ddtree_budget, e.ddtree_costs, e.ddtree_draft_cost) == ("cost-aware", K26_4K, 0.5)


@pytest.mark.parametrize("args, words", [
    (["--ddtree-costs", K26_4K_TEXT], "add --ddtree-budget cost-aware"),
    (["--ddtree-budget", "cost-aware", "--ddtree-costs", "1:1"], "two or more rows:cost pairs"),
    (["--ddtree-budget", "cost-aware", "--ddtree-costs", "1:x,2:3"], "rows:cost"),
    (["--ddtree-budget", "cost-aware", "--ddtree-draft-cost", "2"], "give both"),
    (["--ddtree-budget", "cost-aware", "--engine", "reference"], "needs --ddtree-costs"),
    (["--ddtree-budget", "cost-aware", "--ddtree-costs", K26_4K_TEXT, "--engine", "torch"],
     "applies to --engine cuda and --engine reference"),
    (["--ddtree-budget", "cost-aware", "--dump", TINY], "drop them"),
    (["--ddtree-budget", "cost-aware", "--ddtree-costs", K26_4K_TEXT, "--tp", "2"], "not to a sharded"),
    (["--ddtree-budget", "cost-aware", "--ddtree-costs", "1:1,2:inf"], "finite"),
    (["--ddtree-budget", "cost-aware", "--ddtree-costs", K26_4K_TEXT, "--ddtree-draft-cost", "nan"], "finite cost"),
    (["--ddtree-budget", "cost-aware", "--engine", "cuda", "--dtype", "bfloat16"], "apply to --engine torch"),
    (["--ddtree-budget", "cost-aware", "--ddtree-costs", K26_4K_TEXT, "--engine", "reference", "--w4a16", "fast"],
     "--w4a16 applies to --engine cuda"),
])
def test_kdtr_verify_refuses_budget_options_that_do_not_fit(args, words):
    from cli.main import main as cli

    r = CliRunner().invoke(cli, ["verify", TINY, *args])
    assert r.exit_code == 2 and words in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output


def test_kdtr_verify_runs_the_reference_with_the_cost_aware_budget(tmp_path):
    """From the command line: the reference cuts its trees under the given K2.6 price; the run passes with
    every check run, and the cut rounds were judged."""
    from cli.main import main as cli

    out = tmp_path / "r.json"
    r = CliRunner().invoke(cli, ["verify", EDGE, "--engine", "reference", "--ddtree-budget", "cost-aware",
                                 "--ddtree-costs", K26_4K_TEXT, "--require-coverage", "full", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "reference-cost-aware" in r.output and "declared budget" in r.output


# ------------------------------------------------------------------------------------------------ GPU


@pytest.fixture(scope="module")
def engine_cls():
    gpu_ops()                                                    # skips without pycuda / a device
    from cuda_engine.engine import CudaEngine

    return CudaEngine


def _live(v, what: str) -> list:
    return [c.metrics for c in v.checks if c.name.endswith(f"ddtree_live/{what}")]


@pytest.mark.cuda
@pytest.mark.parametrize("bundle", BUNDLES)
def test_the_cuda_engine_with_the_k26_price_passes_and_its_cut_rounds_are_judged(engine_cls, bundle):
    from conformance.verify.runner import verify

    e = engine_cls(ddtree_budget="cost-aware", ddtree_costs=K26_4K)
    v = verify(bundle, engine=e)
    assert v.verdict == "pass", [f"{c.name}: {c.message}" for c in v.checks if c.status == "fail"][:5]
    trees = _live(v, "trees")
    pruned, rounds = sum(m["pruned"] for m in trees), sum(m["rounds"] for m in trees)
    print(f"{bundle}: {rounds} rounds, {pruned} cut and compared with the golden tree")
    assert pruned > 0, "no round was cut and judged: the test does not reach the rule"
    forwards = _live(v, "target_forwards")
    assert sum(m["engine"] for m in forwards) > sum(m["golden"] for m in forwards)     # smaller trees, more rounds


@pytest.mark.cuda
@pytest.mark.parametrize("bundle", BUNDLES)
def test_the_cuda_engine_with_its_measured_price_passes(engine_cls, bundle):
    from conformance.verify.runner import verify
    from cuda_engine.ddtree import ddtree_run

    e = engine_cls(ddtree_budget="cost-aware")
    v = verify(bundle, engine=e)
    assert v.verdict == "pass", [f"{c.name}: {c.message}" for c in v.checks if c.status == "fail"][:5]
    from kdtr_format import open_kdtr

    with open_kdtr(bundle) as f:
        prompt = np.asarray(f["golden/p0/prompt_ids"])
    _, stats = ddtree_run(e, prompt, 0, 16)
    price = stats["price"]
    print(f"{bundle}: measured price (us) {price}; nodes per round {stats['budgets']}")
    st = e._ddtree_state()
    assert price["source"] == "measured" and price["draft"] > 0 and str(st.T) in price["verify"]
    verify_us = [price["verify"][r] for r in sorted(price["verify"], key=int)]
    assert verify_us == sorted(verify_us) and verify_us[0] > 0          # non-decreasing in the rows


@pytest.mark.cuda
@pytest.mark.parametrize("builder", ["device", "host"])
def test_every_cut_is_the_rule_on_the_engines_own_draft(engine_cls, builder):
    """Each round verified the first b nodes of the tree build_ddtree makes from the engine's own drafter logits,
    b = cost_aware_nodes under the given price: the cut is the rule, not any prefix the judge would accept."""
    from cuda_engine.ddtree import ddtree_run
    from kdtr_format import open_kdtr

    e = engine_cls(ddtree_budget="cost-aware", ddtree_costs=K26_4K)
    e.load(TINY)
    st = e._ddtree_state()
    with open_kdtr(TINY) as f:
        prompt = np.asarray(f["golden/p3/prompt_ids"])
    rec, stats = ddtree_run(e, prompt, 0, 48, keep_logits=True, builder=builder)
    price = verify_cost_table(K26_4K)
    for r in stats["verify"]:
        full = build_ddtree(r["draft_logits"], st.budget, st.topk)
        b = cost_aware_nodes(full.scores, price)
        assert np.array_equal(r["tree"].tokens, full.tokens[:b]), (r["start"], b, len(r["tree"].tokens))
        assert np.array_equal(r["tree"].parents, full.parents[:b + 1])
    assert list(rec["round_budget"]) == stats["budgets"] and min(stats["budgets"]) < st.budget


@pytest.mark.cuda
def test_builders_and_graphs_agree_under_a_given_price(engine_cls):
    from cuda_engine.ddtree import ddtree_run
    from kdtr_format import open_kdtr

    with open_kdtr(TINY) as f:
        prompt = np.asarray(f["golden/p2/prompt_ids"])
    runs = []
    for graph, builder in ((True, "device"), (True, "host"), (False, "device")):
        e = engine_cls(use_graph=graph, ddtree_budget="cost-aware", ddtree_costs=K26_4K)
        e.load(TINY)
        runs.append(ddtree_run(e, prompt, 0, 40, builder=builder))
    (rec, stats), others = runs[0], runs[1:]
    assert min(stats["budgets"]) < e._ddtree_state().budget, "no round was cut"
    for other, _ in others:
        assert rec.keys() == other.keys() and "round_budget" in rec
        for k in rec:
            assert np.array_equal(rec[k], other[k]), k
