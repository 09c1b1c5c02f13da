"""Greedy exactness end to end: DDTree tokens == chain (vanilla DFlash) tokens == AR tokens, float64.

Most cases run on MICRO (see test_ddtree_verify) with a drafter distilled for it in the module fixture
(so rounds accept deep paths and runs end mid-round); `tiny` runs a share with an untrained drafter
(one token per round, the cheapest honest case at that size). Also: plain AR through the shared loop
equals refmodel.generate.greedy_generate, and the counters add up."""
import numpy as np
import pytest

from refmodel.config import PRESETS
from refmodel.ddtree import ar_generate, chain_generate, ddtree_generate, generate
from refmodel.drafter import DrafterConfig, init_drafter
from refmodel.generate import greedy_generate
from refmodel.model import KVCache, forward
from refmodel.weights import init_weights
from test_ddtree_verify import MICRO, MICRO_DRAFTER

TINY_DRAFTER = DrafterConfig(**{**MICRO_DRAFTER.to_dict(), "hidden_size": 192, "vocab_size": 400,
                                "mask_token_id": 399, "target_layer_ids": [1, 3, 5], "num_target_layers": 6})


@pytest.fixture(scope="module")
def micro():
    from refmodel.distill import DistillSettings, distill_drafter
    W = init_weights(MICRO, 0, alpha=0.5)   # follows its token rule at ~92 % of steps (alpha 1: ~60 %)
    s = DistillSettings(sequences=64, batch_gen=32, prompt_len=(1, 6), seq_len=40, batch=8, anchors=4)
    DW = distill_drafter(MICRO, W, MICRO_DRAFTER, seed=0, steps=200, settings=s)
    return W, DW


def _check_counters(res, n_new, drafted):
    c = res.counters
    assert c.target_forwards == 1 + len(c.tokens_per_round)
    assert c.drafter_forwards == (len(c.tokens_per_round) if drafted else 0)
    made = 1 + sum(c.tokens_per_round)            # the prefill's token + every round's accepted + bonus
    last = c.tokens_per_round[-1] if c.tokens_per_round else made
    assert made - last < n_new <= made             # stopped by length, in the first round that reached it
    assert [r.accepted_depth + 1 for r in res.rounds] == c.tokens_per_round
    assert len(res.tokens) == n_new


def _run_case(cfg, W, dcfg, DW, prompt, n_new, budget):
    ar = ar_generate(cfg, W, prompt, n_new)
    dd = ddtree_generate(cfg, W, dcfg, DW, prompt, n_new, budget=budget)
    ch = chain_generate(cfg, W, dcfg, DW, prompt, n_new)
    case = dict(prompt=prompt, n_new=n_new, budget=budget)
    assert dd.tokens == ar.tokens, case
    assert ch.tokens == ar.tokens, case
    _check_counters(ar, n_new, False)
    _check_counters(dd, n_new, True)
    _check_counters(ch, n_new, True)
    assert all(r.tree_size == 1 for r in ar.rounds)
    assert all(r.tree_size == dcfg.block_size for r in ch.rounds)   # K = 1, N = B-1: the full chain
    return dd


def test_greedy_exactness_micro_distilled(micro):
    W, DW = micro
    rng = np.random.default_rng(10)
    overshoot = deep = 0
    for case in range(40):
        P = 1 if case % 5 == 0 else int(rng.integers(2, 9))
        prompt = [int(t) for t in rng.integers(0, 47, size=P)]
        n_new = int(rng.integers(1, 40))
        dd = _run_case(MICRO, W, MICRO_DRAFTER, DW, prompt, n_new, budget=[1, 4, 16, 32][case % 4])
        overshoot += 1 + sum(dd.counters.tokens_per_round) > n_new   # the last round was cut by length
        deep += any(r.accepted_depth >= 3 for r in dd.rounds)
    assert overshoot >= 5 and deep >= 10, (overshoot, deep)  # the interesting paths really ran


def test_greedy_exactness_tiny_untrained_drafter():
    cfg = PRESETS["tiny"]
    rng = np.random.default_rng(11)
    for case in range(10):
        W = init_weights(cfg, case % 2)
        DW = init_drafter(TINY_DRAFTER, case)
        P = 1 if case % 3 == 0 else int(rng.integers(2, 12))
        prompt = [int(t) for t in rng.integers(0, 399, size=P)]
        _run_case(cfg, W, TINY_DRAFTER, DW, prompt, int(rng.integers(2, 6)), budget=32)


def test_ar_loop_equals_greedy_generate():
    for cfg, seed, prompt, n in [(MICRO, 3, [4], 20), (MICRO, 4, [1, 2, 3, 44, 5], 17),
                                 (PRESETS["tiny"], 0, [7, 300, 12], 10)]:
        W = init_weights(cfg, seed)
        assert ar_generate(cfg, W, prompt, n).tokens == greedy_generate(cfg, W, prompt, n).tokens


def test_budget_zero_is_ar_and_needs_no_drafter():
    W = init_weights(MICRO, 0)
    res = ddtree_generate(MICRO, W, MICRO_DRAFTER, init_drafter(MICRO_DRAFTER, 0), [3, 4], 9, budget=0)
    assert res.tokens == ar_generate(MICRO, W, [3, 4], 9).tokens
    assert res.counters.drafter_forwards == 0 and res.counters.target_forwards == 9
    with pytest.raises(ValueError, match="budget 4 needs a drafter"):
        ddtree_generate(MICRO, W, None, None, [3], 5, budget=4)


def test_distilled_micro_drafter_beats_ar(micro):
    W, DW = micro
    rng = np.random.default_rng(12)
    ar = dd = 0
    for _ in range(3):
        prompt = [int(t) for t in rng.integers(0, 47, size=4)]
        ar += ar_generate(MICRO, W, prompt, 40, record=False).counters.target_forwards
        dd += ddtree_generate(MICRO, W, MICRO_DRAFTER, DW, prompt, 40, record=False).counters.target_forwards
    assert ar / dd >= 2.0, (ar, dd)   # an untrained drafter gives ~1.0


def test_a_long_position_run_decides_like_a_position_zero_run(micro):
    """RoPE is relative: with the prompt at position 2^17 + 3 (cache row j at pos0 + j, for target and
    drafter alike) every float64 decision equals the position-0 run's, DDTree == AR there too, and the
    rounds are the same (the drafter's logits move by rounding only)."""
    W, DW = micro
    pos0 = 2**17 + 3
    for prompt, n in [([5], 30), ([1, 9, 30, 2], 25)]:
        ar0 = ar_generate(MICRO, W, prompt, n)
        ar = generate(MICRO, W, prompt, n, pos0=pos0)
        dd0 = ddtree_generate(MICRO, W, MICRO_DRAFTER, DW, prompt, n)
        dd = ddtree_generate(MICRO, W, MICRO_DRAFTER, DW, prompt, n, pos0=pos0)
        assert ar.tokens == ar0.tokens == dd.tokens == greedy_generate(MICRO, W, prompt, n, pos0=pos0).tokens
        assert [r.accepted for r in dd.rounds] == [r.accepted for r in dd0.rounds], prompt
        assert [r.start for r in dd.rounds] == [r.start for r in dd0.rounds]   # starts are cache rows
        g0, g = greedy_generate(MICRO, W, prompt, n), greedy_generate(MICRO, W, prompt, n, pos0=pos0)
        rows = prompt + g.tokens[:-1]                                          # what the cache holds
        want = KVCache(MICRO)
        forward(MICRO, W, rows, pos0 + np.arange(len(rows)), want)
        assert np.array_equal(g.cache.k_pe[0], want.k_pe[0])                  # rotated at pos0 + row
        assert not np.allclose(g.cache.k_pe[0], g0.cache.k_pe[0])


def test_the_drafter_rotates_at_pos0_plus_row(micro):
    from refmodel.drafter import DrafterCache, drafter_forward, target_features
    W, DW = micro
    prompt = np.array([3, 8, 13, 21])
    feats = target_features(MICRO_DRAFTER, forward(MICRO, W, prompt, np.arange(4))[1])     # [4, F]
    block = [5] + [MICRO_DRAFTER.mask_token_id] * (MICRO_DRAFTER.block_size - 1)
    c0, c1 = DrafterCache(MICRO_DRAFTER), DrafterCache(MICRO_DRAFTER)
    q0 = drafter_forward(MICRO_DRAFTER, DW, W, block, feats, c0, start=4)
    q1 = drafter_forward(MICRO_DRAFTER, DW, W, block, feats, c1, start=4, pos0=2**17 + 3)
    assert np.abs(q1 - q0).max() <= 1e-9                  # relative positions unchanged
    assert not np.allclose(c1.k[0], c0.k[0])              # absolute rotation of the cached keys moved
