"""Weights: HF names and shapes, byte-stable determinism, and the golden target being worth drafting."""
import hashlib
import json

import numpy as np
import pytest

from refmodel.config import PRESETS
from refmodel.generate import greedy_generate
from refmodel.weights import construction_info, expected_shapes, init_weights, mask_token_id, permutation

TINY = PRESETS["tiny"]
# sha256 over (name, little-endian float64 bytes) of init_weights(tiny, 0), in dict order. If numpy ever changes
# its PCG64 / normal streams this fails: every golden bundle would have to be regenerated (`kdtr golden`).
TINY_SEED0_SHA256 = "23b9b9db7a0f254a4c27155c5d78fe1cb3347c7ddde361dd5e7b8b2ca473a81e"


def digest(W):
    h = hashlib.sha256()
    for k, v in W.items():
        h.update(k.encode())
        h.update(np.ascontiguousarray(v, dtype="<f8").tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tiny_w():
    return init_weights(TINY, 0)


def test_names_shapes_dtype(tiny_w):
    shapes = expected_shapes(TINY)
    assert list(tiny_w) == list(shapes)
    assert all(tiny_w[k].shape == s and tiny_w[k].dtype == np.float64 for k, s in shapes.items())
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (384, 192)                  # dense layer 0
    assert "model.layers.0.mlp.gate.weight" not in shapes
    assert shapes["model.layers.1.self_attn.q_b_proj.weight"] == (6 * 48, 96)
    assert shapes["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (64 + 16, 192)
    assert shapes["model.layers.1.self_attn.kv_b_proj.weight"] == (6 * 64, 64)
    assert shapes["model.layers.5.mlp.experts.15.down_proj.weight"] == (192, 32)
    assert shapes["model.layers.5.mlp.shared_experts.up_proj.weight"] == (32, 192)
    assert len(shapes) == 1 + 6 * 9 + 3 + 5 * (2 + 16 * 3 + 3) + 2


def test_k26_shapes_without_allocating():
    s = expected_shapes(PRESETS["k26"])
    assert s["model.layers.1.self_attn.q_b_proj.weight"] == (12288, 1536)
    assert s["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert s["model.layers.1.self_attn.kv_b_proj.weight"] == (16384, 512)
    assert s["model.layers.1.self_attn.o_proj.weight"] == (7168, 8192)
    assert s["model.layers.60.mlp.experts.383.gate_proj.weight"] == (2048, 7168)
    assert s["model.layers.0.mlp.down_proj.weight"] == (7168, 18432)
    assert s["lm_head.weight"] == (163840, 7168)


def test_deterministic_bytes(tiny_w):
    assert digest(tiny_w) == TINY_SEED0_SHA256
    assert digest(init_weights(TINY, 0)) == TINY_SEED0_SHA256
    assert digest(init_weights(TINY, 1)) != TINY_SEED0_SHA256


def test_golden_construction(tiny_w):
    V, perm = TINY.vocab_size, permutation(TINY, 0)
    assert sorted(perm) == list(range(V - 1))                                        # mask id V-1 not in image
    info = construction_info(TINY, 0, 1.0)
    json.dumps(info)
    head, emb = tiny_w["lm_head.weight"], tiny_w["model.embed_tokens.weight"]
    assert np.array_equal(head[perm], emb[: V - 1] * info["head_scale"])
    assert mask_token_id(TINY) == V - 1 == info["mask_token_id"]
    assert np.linalg.norm(head[V - 1]) < 0.02 * np.linalg.norm(head[:V - 1], axis=1).min()
    for l in range(1, 6):
        assert np.all(tiny_w[f"model.layers.{l}.mlp.gate.e_score_correction_bias"] != 0)
    half = init_weights(TINY, 0, alpha=0.5)
    assert np.allclose(half["model.layers.3.self_attn.o_proj.weight"],
                       0.5 * tiny_w["model.layers.3.self_attn.o_proj.weight"], rtol=1e-15, atol=0)
    assert np.array_equal(half["model.layers.3.self_attn.q_a_proj.weight"],
                          tiny_w["model.layers.3.self_attn.q_a_proj.weight"])


def test_golden_target_is_worth_drafting(tiny_w):
    """Predictable in stretches with deviations, decisive margins, every expert used (docs/golden-bundles.md)."""
    perm, rng = permutation(TINY, 0), np.random.default_rng(1)
    follow, margins, usage = [], [], np.zeros((6, 16))
    for _ in range(3):
        prompt = rng.integers(0, TINY.vocab_size - 1, size=rng.integers(1, 12))
        r = greedy_generate(TINY, tiny_w, prompt, 96, collect_taps=True)
        prev = [int(prompt[-1])] + r.tokens[:-1]
        follow += [int(perm[a]) == b for a, b in zip(prev, r.tokens)]
        margins += list(r.margins)
        assert mask_token_id(TINY) not in r.tokens
        for taps in r.taps:
            for l in range(1, 6):
                np.add.at(usage[l], taps[f"L{l}/topk_ids"].ravel(), 1)
    rate, share = np.mean(follow), usage[1:] / usage[1:].sum(1, keepdims=True)
    assert 0.85 <= rate < 1.0, f"rule-following {rate:.3f}: want predictable stretches and some deviations"
    assert min(margins) >= 0.04, f"min top-1/top-2 margin {min(margins):.3g}"
    assert share.min() > 0 and share.max() < 0.25, f"expert usage share {share.min():.4f}..{share.max():.4f}"
