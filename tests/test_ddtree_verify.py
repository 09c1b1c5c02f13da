"""DDTree verification invariants (docs/ddtree.md §7): compile and walk, node context, KV compaction, draft cache.

Rounds are driven by hand with "oracle" draft logits that put the true AR continuation at rank 0, 1 or 2
(or nowhere) at each depth, so deep acceptances, off-spine acceptances and early rejections all occur
without a trained drafter. MICRO is a scaled-down kdtr target (MLA + MoE + YaRN) that keeps these fast;
`tiny` runs a few rounds of the same checks."""
import numpy as np
import pytest

from refmodel.config import PRESETS, ModelConfig
from refmodel.ddtree import Tree, build_ddtree, compile_tree, draft_tree, prefill, verify_round, walk
from refmodel.drafter import DrafterCache, DrafterConfig, drafter_forward, init_drafter, target_features
from refmodel.model import KVCache, forward
from refmodel.weights import init_weights

MICRO = ModelConfig(
    vocab_size=48, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
    v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, rope_theta=10000.0,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                      mscale_all_dim=1.0),
    max_position_embeddings=4096, rms_norm_eps=1e-5)
MICRO_DRAFTER = DrafterConfig(
    hidden_size=32, vocab_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, intermediate_size=64, block_size=8, mask_token_id=47, target_layer_ids=[0, 2],
    num_target_layers=3, rms_norm_eps=1e-6, rope_theta=10000.0)
TOL = 1e-10  # float64 forwards over the same math in a different row grouping: ~1e-14 observed


def _ar_tokens(cfg, W, prompt, n):
    cache = KVCache(cfg)
    logits, _ = forward(cfg, W, prompt, np.arange(len(prompt)), cache)
    out = [int(np.argmax(logits[-1]))]
    while len(out) < n:
        logits, _ = forward(cfg, W, [out[-1]], [cache.length], cache)
        out.append(int(np.argmax(logits[-1])))
    return out


def _oracle_logits(rng, truth, L, V):
    """Draft logits [L, V] whose depth-d row ranks truth[d-1] at 0, 1 or 2, or leaves it to chance."""
    logits = rng.normal(0.0, 1.0, size=(L, V))
    for d in range(min(L, len(truth))):
        rank = rng.choice([0, 0, 0, 1, 2, -1])
        if rank < 0:
            continue
        order = np.argsort(-logits[d], kind="stable")
        rivals = [t for t in order if t != truth[d]][:rank]
        logits[d, truth[d]] = 6.0 - rank
        logits[d, rivals] = 6.0 - np.arange(rank) + 0.5   # strictly above the true token
    return logits


def _causal_cache(cfg, W, tokens):
    cache = KVCache(cfg)
    logits, hiddens = forward(cfg, W, tokens, np.arange(len(tokens)), cache)
    return cache, hiddens


def _max_diff(a_list, b_list):
    return max(float(np.abs(a - b).max()) for a, b in zip(a_list, b_list))


def test_compile_tree_positions_and_mask():
    # root -> 1 (tok 7, d1) -> 3 (tok 9, d2); root -> 2 (tok 8, d1)
    vis = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)
    tree = Tree(np.array([7, 8, 9]), np.array([1, 1, 2]), np.array([-1, 0, 0, 1]),
                [{7: 1, 8: 2}, {9: 3}, {}, {}], vis, np.array([0, 1, 0]), np.array([-1.0, -2.0, -3.0]))
    ids, pos, mask = compile_tree(tree, root=5, start=10)
    assert ids.tolist() == [5, 7, 8, 9] and pos.tolist() == [10, 11, 11, 12]
    assert mask.shape == (4, 14) and np.all(mask[:, :10] == 0)
    assert np.array_equal(mask[:, 10:] == 0, vis) and np.all(np.isneginf(mask[:, 10:][~vis]))
    ids2, pos2, mask2 = compile_tree(tree, root=5, start=10, pos0=2**17)   # positions move, the mask stays
    assert np.array_equal(ids2, ids) and pos2.tolist() == [2**17 + p for p in pos.tolist()]
    assert np.array_equal(mask2, mask)


def test_walk_follows_argmax_and_returns_bonus():
    maps = [{7: 1, 8: 2}, {9: 3}, {}, {}]
    assert walk(maps, np.array([8, 0, 4, 0])) == ([0, 2], 4)        # sibling (rank 1) accepted
    assert walk(maps, np.array([7, 9, 0, 6])) == ([0, 1, 3], 6)     # full depth
    assert walk(maps, np.array([3, 9, 0, 6])) == ([0], 3)           # bonus only


def _run_oracle_rounds(cfg, W, dcfg, prompt, rounds, budget, seed, check_nodes=True):
    """Drive `rounds` rounds by hand; check node context before each commit and the caches after."""
    rng = np.random.default_rng(seed)
    truth = _ar_tokens(cfg, W, prompt, rounds * (dcfg.block_size + 1) + 2)
    dec = prefill(cfg, W, prompt, dcfg)
    P, seen = len(prompt), {"deep": 0, "off_spine": 0, "bonus_only": 0}
    for _ in range(rounds):
        start = dec.start
        L = dcfg.block_size - 1
        tree = build_ddtree(_oracle_logits(rng, truth[start - P + 1:], L, cfg.vocab_size), budget)
        if check_nodes:
            ids, pos, mask = compile_tree(tree, dec.out[start], start)
            tree_logits, _ = forward(cfg, W, ids, pos, dec.cache.copy(), mask)            # [T, V]
            for i in range(tree.size):
                path, j = [], i
                while j >= 0:
                    path.append(int(ids[j]))
                    j = tree.parents[j]
                ar_logits, _ = forward(cfg, W, dec.out[:start] + path[::-1], np.arange(start + len(path)))
                err = float(np.abs(ar_logits[-1] - tree_logits[i]).max())
                assert err <= TOL, dict(seed=seed, start=start, node=i, err=err)
        r = verify_round(cfg, W, dcfg, dec, tree)
        if check_nodes:
            assert r.verify_argmax.tolist() == tree_logits.argmax(-1).tolist()
        # committed tokens and the pending bonus equal the AR stream
        assert dec.out[P:] == truth[:len(dec.out) - P], dict(seed=seed, start=start)
        # compaction invariant: the cache equals a causal run over the committed tokens
        ref, hiddens = _causal_cache(cfg, W, dec.out[:dec.start])
        assert dec.cache.length == dec.start
        err = max(_max_diff(dec.cache.c_kv, ref.c_kv), _max_diff(dec.cache.k_pe, ref.k_pe))
        assert err <= TOL, dict(seed=seed, start=start, err=err)
        # the next drafter context is the accepted rows' features
        feats = target_features(dcfg, hiddens)[start:dec.start]
        assert float(np.abs(dec.ctx - feats).max()) <= TOL
        seen["deep"] += r.accepted_depth >= 2
        seen["bonus_only"] += r.accepted_depth == 0
        seen["off_spine"] += any(r.ranks[j - 1] >= 1 for j in r.accepted[1:])
    return seen


def test_node_context_and_compaction_invariants_micro():
    totals = {"deep": 0, "off_spine": 0, "bonus_only": 0}
    for seed in range(6):
        W = init_weights(MICRO, seed)
        prompt = list(np.random.default_rng(seed).integers(0, 47, size=1 + seed % 4))
        seen = _run_oracle_rounds(MICRO, W, MICRO_DRAFTER, prompt, rounds=4, budget=[4, 12, 24][seed % 3],
                                  seed=seed)
        totals = {k: totals[k] + seen[k] for k in totals}
    assert all(v > 0 for v in totals.values()), totals  # every kind of round was exercised


def test_node_context_and_compaction_invariants_tiny():
    cfg = PRESETS["tiny"]
    W = init_weights(cfg, 0)
    dcfg = DrafterConfig(**{**MICRO_DRAFTER.to_dict(), "hidden_size": 192, "vocab_size": 400,
                            "mask_token_id": 399, "target_layer_ids": [1, 3, 5], "num_target_layers": 6})
    _run_oracle_rounds(cfg, W, dcfg, [3, 141, 77], rounds=2, budget=12, seed=0)


def test_draft_cache_holds_exactly_the_committed_positions():
    W = init_weights(MICRO, 1)
    DW = init_drafter(MICRO_DRAFTER, 1)
    dec = prefill(MICRO, W, [5, 9, 2], MICRO_DRAFTER)
    rng = np.random.default_rng(1)
    truth = _ar_tokens(MICRO, W, [5, 9, 2], 60)
    for _ in range(6):
        start, C = dec.start, len(dec.ctx)
        assert dec.dcache.length == start - C   # before the call: everything up to the new context rows
        draft_tree(W, MICRO_DRAFTER, DW, dec, 8, None)
        assert dec.dcache.length == start       # after: all committed positions, no block rows
        # the cached context K/V equal those of one fresh call over a causal run's features
        _, hiddens = _causal_cache(MICRO, W, dec.out[:start])
        fresh = DrafterCache(MICRO_DRAFTER)
        drafter_forward(MICRO_DRAFTER, DW, W, [0] * 8, target_features(MICRO_DRAFTER, hiddens), fresh, start)
        assert max(_max_diff(dec.dcache.k, fresh.k), _max_diff(dec.dcache.v, fresh.v)) <= TOL
        # verify an oracle tree (deep acceptances) so the next context spans several rows
        tree = build_ddtree(_oracle_logits(rng, truth[start - 3 + 1:], 7, 48), 12)
        verify_round(MICRO, W, MICRO_DRAFTER, dec, tree)
        assert len(dec.ctx) == dec.start - start


def test_drafter_rejects_a_cache_that_does_not_match_start():
    W = init_weights(MICRO, 0)
    DW = init_drafter(MICRO_DRAFTER, 0)
    with pytest.raises(ValueError, match="drafter cache holds 0 rows; expected start - C = 5 - 3"):
        drafter_forward(MICRO_DRAFTER, DW, W, [0] * 8, np.zeros((3, 64)), DrafterCache(MICRO_DRAFTER), 5)
