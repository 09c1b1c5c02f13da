"""The cost-aware budget (refmodel/ddtree.py, docs/ddtree.md §3a): a built tree cut to the nodes whose expected
tokens pay for their verify rows. What it promises: the cut tree is exactly the tree build_ddtree makes with the
smaller budget (so every property of built trees holds for it); the choice maximises expected tokens per unit of
cost; and the tokens never change (greedy exactness: the committed tiny bundle's golden stream, under the K2.6
layer's measured verify costs)."""
from pathlib import Path

import numpy as np
import pytest

from bench.bench_budget_policy import K26_4K
from kdtr_format import open_kdtr
from refmodel.ddtree import (ar_generate, build_ddtree, cost_aware_nodes, ddtree_generate, expected_tokens,
                             generate, prune_tree, verify_cost_table)
from refmodel.drafter import read_drafter
from refmodel.stored import read_model

ROOT = Path(__file__).resolve().parent.parent


def _same_tree(a, b) -> None:
    for f in ("tokens", "depths", "parents", "ranks", "scores", "visibility"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.child_maps == b.child_maps


@pytest.mark.parametrize("topk", [None, 3])
def test_a_cut_tree_is_the_tree_of_the_smaller_budget(topk):
    rng = np.random.default_rng(7)
    for _ in range(20):
        L, V = int(rng.integers(1, 16)), int(rng.integers(2, 50))
        logits = (rng.standard_normal((L, V)) * rng.uniform(0.5, 4)).astype(np.float32)
        B = int(rng.integers(1, 40))
        full = build_ddtree(logits, B, topk)
        for b in range(len(full.tokens) + 1):
            _same_tree(prune_tree(full, b), build_ddtree(logits, b, topk))


def test_expected_tokens_sums_the_path_probabilities():
    e = expected_tokens(np.log([0.9, 0.5, 0.25]))
    assert np.allclose(e, [1.0, 1.9, 2.4, 2.65])


def test_the_choice_maximises_tokens_per_cost():
    scores = np.log([0.9, 0.81, 0.3, 0.05])                      # a confident spine, then weak siblings
    assert cost_aware_nodes(scores, lambda T: 1.0) == 4           # free rows: every node pays
    assert cost_aware_nodes(scores, lambda T: 10.0 ** T) == 0     # dear rows: plain AR
    linear = lambda T: 1.0 + 0.5 * (T - 1)                        # noqa: E731
    gains = expected_tokens(scores) / np.array([linear(b + 1) for b in range(5)])
    assert cost_aware_nodes(scores, linear) == int(np.argmax(gains)) == 2
    # a fixed drafter cost per round makes more nodes worth it
    assert cost_aware_nodes(scores, linear, draft_cost=5.0) >= cost_aware_nodes(scores, linear)


@pytest.mark.parametrize("bad", [lambda T: 0.0, lambda T: -1.0, lambda T: float("inf")])
def test_costs_that_are_not_positive_and_finite_are_refused(bad):
    with pytest.raises(ValueError, match="finite and positive"):
        cost_aware_nodes(np.log([0.5]), bad)


def test_the_cost_table_interpolates_and_extends():
    table = {1: 1.0, 2: 1.72, 5: 2.46, 9: 3.62, 17: 5.92, 33: 10.12}     # a table of its own, not the measured one
    c = verify_cost_table(table)
    assert c(1) == 1.0 and c(5) == 2.46 and c(3) == pytest.approx(1.72 + (2.46 - 1.72) / 3)
    assert c(49) == pytest.approx(10.12 + 16 * (10.12 - 5.92) / 16)
    with pytest.raises(ValueError, match="non-decreasing"):
        verify_cost_table({1: 2.0, 5: 1.0})


def test_greedy_exactness_under_the_k26_costs():
    """The committed tiny bundle's prompt 1: the cost-aware run gives the golden (AR) tokens, with more
    rounds than the fixed budget and smaller trees."""
    with open_kdtr(ROOT / "bundles" / "model_tiny.kdtr") as f:
        cfg, W = read_model(f)
        dcfg, DW = read_drafter(f)
        prompt = np.array(f["golden/p1/prompt_ids"], np.int64)
        golden = [int(t) for t in np.array(f["golden/p1/ar/tokens"])][:24]
    budget = 32
    fixed = ddtree_generate(cfg, W, dcfg, DW, prompt, 24, budget=budget)
    auto = generate(cfg, W, prompt, 24, dcfg, DW, budget, verify_cost=verify_cost_table(K26_4K))
    assert fixed.tokens == auto.tokens == golden == ar_generate(cfg, W, prompt, 24).tokens
    assert max(r.tree_size for r in auto.rounds) < budget + 1
    assert len(auto.rounds) >= len(fixed.rounds)
