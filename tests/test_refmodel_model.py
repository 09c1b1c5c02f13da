"""The float64 forward: MLA naive == absorbed, cache == recompute, masks, cache editing, taps, import purity."""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from refmodel.config import PRESETS
from refmodel.model import KVCache, causal_mask, forward, tap_names
from refmodel.weights import init_weights

TINY = PRESETS["tiny"]
_SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16,
              v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
              n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827, rope_theta=5e4,
              rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
              max_position_embeddings=1024, rms_norm_eps=1e-5)
# name -> (config, prompt length). Each odd setting is there to reach a code path Kimi's own values never take.
CONFIGS = {
    "tiny": (TINY, 9),
    "spec9": (dataclasses.replace(TINY, **_SMALL), 7),                       # the small HF-oracle recipe's shapes
    "groups_long": (dataclasses.replace(TINY, **{**_SMALL,                   # n_group > 1, topk_group < n_group
        "n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "n_shared_experts": 2,
        "first_k_dense_replace": 2, "num_hidden_layers": 4, "norm_topk_prob": False,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": 2048}), 70),                          # prompt > 64 rows; K2-Thinking betas
    "top1_len1": (dataclasses.replace(TINY, **{**_SMALL,                     # top-k 1, one-token prompt
        "n_routed_experts": 6, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 1, "num_attention_heads": 3,
        "v_head_dim": 20, "qk_rope_head_dim": 8}), 1),
    "plain_rope_all_moe": (dataclasses.replace(TINY, **{**_SMALL,            # no YaRN; every layer MoE
        "rope_scaling": None, "first_k_dense_replace": 0, "rope_theta": 10000.0}), 13),
}


def prompt_for(cfg, n, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size - 1, size=n)


@pytest.fixture(scope="module")
def tiny_w():
    return init_weights(TINY, 0)


def err(a, b):
    return float(np.max(np.abs(a - b)))


@pytest.mark.parametrize("name", CONFIGS)
def test_naive_equals_absorbed(name):
    cfg, n = CONFIGS[name]
    W = init_weights(cfg, 1)
    ids = prompt_for(cfg, max(n, 5))
    naive, h_naive = forward(cfg, W, ids, np.arange(len(ids)))
    absorbed, h_abs = forward(cfg, W, ids, np.arange(len(ids)), absorbed=True)
    assert err(naive, absorbed) <= 1e-10, f"{name}: max abs {err(naive, absorbed):.3g}"
    assert max(err(a, b) for a, b in zip(h_naive, h_abs)) <= 1e-10


@pytest.mark.parametrize("absorbed", [False, True])
def test_incremental_decoding_equals_full_recompute(tiny_w, absorbed):
    ids = prompt_for(TINY, 20, seed=3)
    full, _ = forward(TINY, tiny_w, ids, np.arange(20), absorbed=absorbed)
    cache = KVCache(TINY)
    parts = [forward(TINY, tiny_w, ids[:7], np.arange(7), cache=cache, absorbed=absorbed)[0]]
    parts += [forward(TINY, tiny_w, ids[7:10], np.arange(7, 10), cache=cache, absorbed=absorbed)[0]]
    parts += [forward(TINY, tiny_w, [t], [p], cache=cache, absorbed=absorbed)[0] for p, t in enumerate(ids[10:], 10)]
    assert cache.length == 20
    assert err(np.concatenate(parts), full) <= 1e-10


def test_explicit_causal_mask_equals_default(tiny_w):
    ids = prompt_for(TINY, 6)
    a, _ = forward(TINY, tiny_w, ids, np.arange(6))
    b, _ = forward(TINY, tiny_w, ids, np.arange(6), mask=causal_mask(6, 0))
    assert err(a, b) == 0.0


def test_tree_mask_and_depth_positions_equal_ar_on_the_branch(tiny_w):
    # Two siblings at the same depth position: each must see the prefix and itself only.
    prefix = prompt_for(TINY, 5)
    cache = KVCache(TINY)
    forward(TINY, tiny_w, prefix, np.arange(5), cache=cache)
    sib = np.array([11, 42])
    mask = np.zeros((2, 7))
    mask[0, 6] = mask[1, 5] = -np.inf
    tree, _ = forward(TINY, tiny_w, sib, [5, 5], cache=cache, mask=mask)
    for i, t in enumerate(sib):
        ar, _ = forward(TINY, tiny_w, np.append(prefix, t), np.arange(6))
        assert err(tree[i], ar[-1]) <= 1e-10


def test_cache_truncate_and_compact(tiny_w):
    ids = prompt_for(TINY, 9, seed=5)
    cache = KVCache(TINY)
    forward(TINY, tiny_w, ids, np.arange(9), cache=cache)
    # compact keeps rows 4 + [0, 2, 3] in order; it must equal a cache built from exactly those rows
    # when their latents do not depend on later rows (they do not: rows are per-token projections of the past).
    ref = cache.copy()
    cache.compact(4, [0, 2, 3])
    assert cache.length == 7
    for l in range(TINY.num_hidden_layers):
        assert np.array_equal(cache.c_kv[l], ref.c_kv[l][[0, 1, 2, 3, 4, 6, 7]])
        assert np.array_equal(cache.k_pe[l], ref.k_pe[l][[0, 1, 2, 3, 4, 6, 7]])
    assert ref.length == 9                                           # copy() is independent
    ref.truncate(5)
    short = KVCache(TINY)
    forward(TINY, tiny_w, ids[:5], np.arange(5), cache=short)
    for l in range(TINY.num_hidden_layers):
        # equal up to BLAS blocking (a 9-row and a 5-row matmul may round differently)
        assert err(ref.c_kv[l], short.c_kv[l]) <= 1e-12 and err(ref.k_pe[l], short.k_pe[l]) <= 1e-12
    a, _ = forward(TINY, tiny_w, ids[5:], np.arange(5, 9), cache=ref)   # decoding continues exactly
    full, _ = forward(TINY, tiny_w, ids, np.arange(9))
    assert err(a, full[5:]) <= 1e-10
    with pytest.raises(ValueError, match=r"KVCache.truncate\(10\): n must be in \[0, length=5\]"):
        short.truncate(10)
    with pytest.raises(ValueError, match=r"keep indices \[0, 5\] must be in \[0, 5\)"):
        KVCache.copy(cache).compact(2, [0, 5])


def test_taps_names_shapes_order(tiny_w):
    T, c = 3, TINY
    taps = {}
    logits, hiddens = forward(c, tiny_w, prompt_for(c, T), np.arange(T), taps=taps)
    expected = [f"L{l}/{n}" for l in range(c.num_hidden_layers) for n in tap_names(c, l)] + ["final_hidden", "logits"]
    assert list(taps) == expected
    H, D, A = c.num_attention_heads, c.hidden_size, c.qk_head_dim
    shapes = {"attn_in": (T, D), "q": (T, H, A), "kv_latent": (T, c.kv_lora_rank), "k_pe": (T, c.qk_rope_head_dim),
              "attn_out": (T, D), "resid_attn": (T, D), "mlp_in": (T, D), "router_scores": (T, c.n_routed_experts),
              "topk_ids": (T, c.num_experts_per_tok), "topk_weights": (T, c.num_experts_per_tok), "mlp_out": (T, D),
              "resid_out": (T, D), "final_hidden": (T, D), "logits": (T, c.vocab_size)}
    for k, v in taps.items():
        assert v.shape == shapes[k.split("/")[-1]], k
        assert v.dtype == (np.int64 if k.endswith("topk_ids") else np.float64), k
    assert tap_names(c, 0) == ["attn_in", "q", "kv_latent", "k_pe", "attn_out", "resid_attn", "mlp_in",
                               "mlp_out", "resid_out"]
    assert "L1/router_scores" in taps and "L0/router_scores" not in taps
    assert len(hiddens) == c.num_hidden_layers + 1
    for l in range(c.num_hidden_layers):
        assert np.array_equal(taps[f"L{l}/resid_out"], hiddens[l + 1])
        assert err(taps[f"L{l}/resid_attn"] + taps[f"L{l}/mlp_out"], taps[f"L{l}/resid_out"]) == 0.0
    assert np.array_equal(taps["logits"], logits)
    w = taps["L1/topk_weights"]
    assert np.allclose(w.sum(-1), c.routed_scaling_factor)           # renormalised, then scaled


def test_router_uses_bias_for_selection_only(tiny_w):
    taps = {}
    forward(TINY, tiny_w, prompt_for(TINY, 32), np.arange(32), taps=taps)
    s, ids, w = taps["L2/router_scores"], taps["L2/topk_ids"], taps["L2/topk_weights"]
    biased = s + tiny_w["model.layers.2.mlp.gate.e_score_correction_bias"]           # [T, E]
    chosen = np.zeros_like(biased, dtype=bool)
    np.put_along_axis(chosen, ids, True, axis=-1)
    assert np.all(np.where(chosen, biased, np.inf).min(-1) > np.where(chosen, -np.inf, biased).max(-1))
    unbiased_ids = np.argsort(-s, axis=-1, kind="stable")[:, :TINY.num_experts_per_tok]
    assert any(set(a) != set(b) for a, b in zip(ids, unbiased_ids)), "bias never changed a selection"
    raw = np.take_along_axis(s, ids, -1)                                             # weights use unbiased s
    assert np.allclose(w, raw / raw.sum(-1, keepdims=True) * TINY.routed_scaling_factor, rtol=0, atol=1e-14)


def test_forward_input_errors(tiny_w):
    with pytest.raises(ValueError, match=r"mask shape \(2, 2\) must be \[T, S_cache \+ T\] = \(2, 3\)"):
        c = KVCache(TINY)
        forward(TINY, tiny_w, [1], [0], cache=c)
        forward(TINY, tiny_w, [1, 2], [1, 2], cache=c, mask=np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 400\), got 0..400"):
        forward(TINY, tiny_w, [0, 400], [0, 1])


def test_refmodel_imports_only_numpy_and_stdlib():
    # modules already loaded at interpreter start (site .pth hooks, e.g. certifi) are not refmodel's doing
    code = ("import sys; before = set(sys.modules); "
            "import refmodel.config, refmodel.weights, refmodel.model, refmodel.generate; "
            "top = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "print(sorted(t for t in top if t not in sys.stdlib_module_names and not t.startswith('_')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["numpy", "refmodel"], out
