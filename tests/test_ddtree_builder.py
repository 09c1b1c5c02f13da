"""build_ddtree against brute-force enumeration of every prefix (docs/ddtree.md §3, §7), plus its
structural guarantees and degenerate cases (budget 0, the topk=1 DFlash chain)."""
import itertools

import numpy as np
import pytest

from refmodel.ddtree import build_ddtree


def _log_softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _all_prefixes(L, V):
    for d in range(1, L + 1):
        yield from itertools.product(range(V), repeat=d)


def _node_paths(tree):
    """Token path root -> node for every node 1..n, built from parents (checks prefix closure)."""
    paths = [()]
    for i in range(1, tree.size):
        paths.append(paths[tree.parents[i]] + (int(tree.tokens[i - 1]),))
    return paths


def _check_structure(tree, L, V, budget, case):
    n = tree.size - 1
    assert tree.parents[0] == -1, case
    for i in range(1, n + 1):
        p = tree.parents[i]
        assert 0 <= p < i, (case, i, p)
        assert tree.depths[i - 1] == (0 if p == 0 else tree.depths[p - 1]) + 1, (case, i)
        assert tree.child_maps[p][int(tree.tokens[i - 1])] == i, (case, i)
    assert sum(len(c) for c in tree.child_maps) == n, case  # siblings distinct, every node mapped once
    assert np.all(np.diff(tree.scores) <= 0), (case, tree.scores)  # pop order: non-increasing
    assert np.all((tree.depths >= 1) & (tree.depths <= L)), case
    for i in range(n + 1):  # visibility = ancestors (root included) + self
        anc, j = set(), i
        while j >= 0:
            anc.add(j)
            j = tree.parents[j]
        assert set(np.flatnonzero(tree.visibility[i])) == anc, (case, i)


def _random_logits(rng, L, V, kind):
    if kind == "ties":  # small integers: many exactly tied prefixes
        return rng.integers(0, 3, size=(L, V)).astype(np.float64)
    return rng.normal(0.0, 2.0, size=(L, V))


@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_tree_holds_top_n_prefix_mass(kind):
    rng = np.random.default_rng(0 if kind == "normal" else 1)
    exact_sets = 0
    for case in range(400):
        L, V = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        logits = _random_logits(rng, L, V, kind)
        prefixes = list(_all_prefixes(L, V))
        budget = int(rng.integers(1, min(len(prefixes), 40) + 1))
        tree = build_ddtree(logits, budget)
        info = dict(case=case, L=L, V=V, budget=budget)
        _check_structure(tree, L, V, budget, info)
        assert tree.size - 1 == budget, info  # enough prefixes exist, so the budget is always filled

        lp = _log_softmax64(logits)                                          # [L, V]
        score = {u: sum(lp[d, t] for d, t in enumerate(u)) for u in prefixes}
        ranked = sorted(score.values(), reverse=True)
        best_mass = sum(np.exp(ranked[:budget]))
        paths = _node_paths(tree)[1:]
        assert len(set(paths)) == budget, info
        tree_mass = sum(np.exp(score[u]) for u in paths)
        # float32 log-probs differ from float64 truth by ~1e-7 per depth; the mass may differ only by that.
        assert abs(tree_mass - best_mass) <= 1e-6 * best_mass, (info, tree_mass, best_mass)
        np.testing.assert_allclose(tree.scores, [score[u] for u in paths], rtol=0, atol=1e-5)
        gap = ranked[budget - 1] - ranked[budget] if budget < len(ranked) else np.inf
        if gap > 1e-4:  # the top-N set is unambiguous: it must be exactly the tree
            exact_sets += 1
            top = {u for u in prefixes if score[u] >= ranked[budget - 1] - 1e-4}
            assert set(paths) == top, info
    if kind == "normal":
        assert exact_sets > 300  # the exact-set check really ran on most cases


def test_budget_larger_than_prefix_count_takes_every_prefix():
    logits = np.random.default_rng(2).normal(size=(3, 2))
    tree = build_ddtree(logits, 100)
    assert sorted(_node_paths(tree)[1:]) == sorted(_all_prefixes(3, 2))


@pytest.mark.parametrize("L,V", [(3, 5), (0, 5)])
def test_budget_zero_or_no_depth_gives_root_alone(L, V):
    logits = np.zeros((L, V))
    for budget in ([0, -1] if L else [0, 5]):
        tree = build_ddtree(logits, budget)
        assert tree.size == 1 and tree.parents.tolist() == [-1] and tree.child_maps == [{}]
        assert tree.visibility.tolist() == [[True]]


def test_topk1_budget_L_is_the_dflash_chain():
    rng = np.random.default_rng(3)
    for _ in range(50):
        L, V = 15, 400
        logits = rng.normal(size=(L, V))
        tree = build_ddtree(logits, L, topk=1)
        assert tree.tokens.tolist() == logits.argmax(-1).tolist()
        assert tree.depths.tolist() == list(range(1, L + 1))
        assert tree.parents.tolist() == list(range(-1, L))
        assert np.array_equal(tree.visibility, np.tril(np.ones((L + 1, L + 1), dtype=bool)))
        assert np.all(tree.ranks == 0)


def test_budget_block_minus_one_is_not_the_chain_when_a_sibling_is_likelier():
    # q1 = [0.5, 0.45, ...], q2 = [0.6, ...]: rank-1 at depth 1 (0.45) beats the depth-2 chain node (0.3).
    p = np.array([[0.5, 0.45, 0.05], [0.6, 0.3, 0.1]])
    tree = build_ddtree(np.log(p), 2)
    assert tree.depths.tolist() == [1, 1] and tree.tokens.tolist() == [0, 1] and tree.ranks.tolist() == [0, 1]


def test_tie_order_prefers_smaller_rank_path_and_lower_token_id():
    # All logits equal: every prefix of one depth ties; ranks go to lower token ids first, and
    # on equal scores the smaller rank path pops first, so depth 1 fills before depth 2.
    tree = build_ddtree(np.zeros((2, 3)), 5)
    assert tree.tokens.tolist() == [0, 1, 2, 0, 1]
    assert tree.depths.tolist() == [1, 1, 1, 2, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1]


def test_real_shape_invariants():
    rng = np.random.default_rng(4)
    for budget in [1, 16, 32, 64, 256]:
        logits = rng.normal(0, 3, size=(15, 400))
        tree = build_ddtree(logits, budget)
        _check_structure(tree, 15, 400, budget, dict(budget=budget))
        assert tree.size - 1 == budget
