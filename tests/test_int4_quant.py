"""INT4 in the reference (refmodel.quant): scopes, exact dequantization, refusals, and the measured
quantization error of INT4 vs full precision on the `tiny` preset (printed; run with -s to see it)."""
import dataclasses
import re

import numpy as np
import pytest

from kdtr_format.int4 import Int4LayoutError, dequantize_w4a16, unpack_int4
from refmodel.config import PRESETS
from refmodel.generate import greedy_generate
from refmodel.model import forward
from refmodel.quant import dequantize_model, is_quantized, quant_config, quantize_model
from refmodel.weights import expected_shapes, init_weights

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def W():
    return init_weights(CFG, seed=0)


def test_experts_scope_quantizes_exactly_the_routed_experts(W):
    Q = quantize_model(W, CFG, "experts")
    moe_layers = CFG.num_hidden_layers - CFG.first_k_dense_replace
    qw = [n for n in Q if n.endswith(".qw")]
    assert len(qw) == moe_layers * CFG.n_routed_experts * 3
    assert all(".mlp.experts." in n for n in qw)
    assert all(n[:-3] + ".weight" not in Q and n[:-3] + ".sc" in Q for n in qw)
    dense = [n for n in Q if not n.endswith((".qw", ".sc"))]
    assert all(Q[n] is W[n] for n in dense)                   # untouched, not even copied
    assert len(dense) + len(qw) == len(W)
    name = "model.layers.1.mlp.experts.3.down_proj"
    assert Q[name + ".qw"].shape == (CFG.hidden_size, CFG.moe_intermediate_size // 8)
    assert Q[name + ".sc"].shape == (CFG.hidden_size, CFG.moe_intermediate_size // 32)


def test_mlp_scope_adds_shared_experts_and_dense_mlp_but_never_router_or_attention(W):
    Q = quantize_model(W, CFG, "mlp")
    qw = {n[:-3] for n in Q if n.endswith(".qw")}
    moe_layers = CFG.num_hidden_layers - CFG.first_k_dense_replace
    assert len(qw) == moe_layers * (CFG.n_routed_experts + 1) * 3 + CFG.first_k_dense_replace * 3
    assert "model.layers.0.mlp.gate_proj" in qw and "model.layers.2.mlp.shared_experts.up_proj" in qw
    assert "model.layers.2.mlp.gate.weight" in Q and not any("self_attn" in n for n in qw)
    assert not is_quantized("model.layers.2.mlp.gate", "mlp") and not is_quantized("lm_head", "mlp")


def test_dequantize_model_is_exact_and_float64(W):
    Q = quantize_model(W, CFG, "mlp")
    D = dequantize_model(Q)
    assert list(D) == list(W) and all(D[n].dtype == np.float64 for n in D)
    name = "model.layers.0.mlp.down_proj"
    expect = unpack_int4(Q[name + ".qw"]).astype(np.float64) * np.repeat(Q[name + ".sc"], 32, axis=1)
    assert np.array_equal(D[name + ".weight"], expect)
    assert np.array_equal(D["model.layers.3.self_attn.o_proj.weight"], W["model.layers.3.self_attn.o_proj.weight"])


def test_refuses_a_config_whose_expert_width_is_not_a_group_multiple():
    cfg = dataclasses.replace(CFG, moe_intermediate_size=40, num_hidden_layers=2)
    W = init_weights(cfg, seed=0)
    with pytest.raises(Int4LayoutError, match=re.escape(
            "model.layers.1.mlp.experts.0.down_proj.weight: INT4 W4A16 needs the input dim to be a multiple "
            "of group_size=32 and of 8 (8 nibbles per int32), got shape [out=192, in=40]")):
        quantize_model(W, cfg, "experts")


def test_unknown_scope_and_orphan_tensors_are_errors(W):
    with pytest.raises(ValueError, match="unknown INT4 quantization scope 'all': use one of experts, mlp"):
        quantize_model(W, CFG, "all")
    Q = quantize_model(W, CFG)
    del Q["model.layers.1.mlp.experts.0.up_proj.sc"]
    with pytest.raises(Int4LayoutError, match=r"packed weights model\.layers\.1\.mlp\.experts\.0\.up_proj\.qw "
                                              r"have no scales"):
        dequantize_model(Q)


def test_quant_config_describes_the_scheme():
    q = quant_config("experts", 32)
    assert (q["bits"], q["group_size"], q["symmetric"], q["scale_dtype"], q["scope"]) == (4, 32, True, "bfloat16",
                                                                                       "experts")
    assert re.fullmatch(q["modules"][0], "model.layers.7.mlp.experts.12.gate_proj")


def _weight_nmse(W, Q):
    """Measured and expected (uniform rounding noise, step^2 / 12) NMSE over the quantized weights."""
    err = sig = expect = 0.0
    for name in (n for n in Q if n.endswith(".qw")):
        w = W[name[:-3] + ".weight"]
        sc = Q[name[:-3] + ".sc"].astype(np.float64)
        deq = dequantize_w4a16(Q[name], sc, w.shape)
        err += np.sum((deq - w) ** 2)
        sig += np.sum(w ** 2)
        expect += np.sum(sc ** 2 / 12) * (w.shape[1] // sc.shape[1])
    return err / sig, expect / sig


@pytest.mark.parametrize("scope", ["experts", "mlp"])
def test_int4_vs_full_precision_on_tiny(W, scope):
    """The INT4-vs-dense figures: logit max abs diff (32-token teacher-forced prompt) and greedy agreement
    over 64 steps. Bounds are regression guards around the measured values (seed 0), not targets."""
    Q = quantize_model(W, CFG, scope)
    D = dequantize_model(Q)
    nmse, nmse_expected = _weight_nmse(W, Q)
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size - 1, size=32)
    ref, _ = forward(CFG, W, ids, np.arange(32))                       # [32, V]
    q4, _ = forward(CFG, D, ids, np.arange(32))                        # [32, V]
    diff = np.abs(q4 - ref)
    argmax_agree = np.mean(ref.argmax(-1) == q4.argmax(-1))
    greedy = []
    for prompt in ([1, 2, 3, 4], [int(t) for t in ids[:4]]):      # a rule-friendly and a random prompt
        a = np.array(greedy_generate(CFG, W, prompt, 64).tokens)
        b = np.array(greedy_generate(CFG, D, prompt, 64).tokens)
        prefix = int(np.argmin(a == b)) if (a != b).any() else 64      # steps before the first divergence
        greedy.append((prefix, int(np.sum(a == b))))
    print(f"\nINT4 ({scope}) vs FP on tiny seed 0: weight NMSE {nmse:.5f} (uniform-noise estimate "
          f"{nmse_expected:.5f}); logits max abs diff {diff.max():.4f}, mean {diff.mean():.4f} "
          f"(|logit| max {np.abs(ref).max():.2f}); teacher-forced argmax agreement {argmax_agree:.3f}; "
          f"greedy 64 steps (common prefix, position-wise equal) per prompt: {greedy}")
    assert 0.5 * nmse_expected < nmse < 1.5 * nmse_expected
    assert 0 < diff.max() < 0.5 * np.abs(ref).max()
    if scope == "experts":                       # as K2.6 ships; measured: argmax 1.000, greedy [(64, 64), (8, 8)]
        assert argmax_agree >= 0.9 and greedy[0][0] == 64


def test_the_int4_functions_raise_the_one_kdtr_error():
    """kdtr_format.int4's functions and the file checks raise one Int4LayoutError, a KdtrError, so a
    caller that catches KdtrError (every `kdtr` command does) catches a bad INT4 array too."""
    import kdtr_format
    from kdtr_format.int4 import pack_int4, quantize_w4a16, scales_as_float

    assert Int4LayoutError is kdtr_format.Int4LayoutError
    bad = [(lambda: quantize_w4a16(np.zeros((2, 12))), "multiple of group_size=32 and of 8"),
           (lambda: pack_int4(np.full((1, 8), 9)), r"values must lie in \[-8, 7\], got \[9, 9\]"),
           (lambda: unpack_int4(np.zeros((1, 1), np.int64)), "must be 2-D int32"),
           (lambda: scales_as_float(np.zeros(2, np.int32)), "got int32"),
           (lambda: dequantize_model({"m.sc": np.zeros((1, 1), np.float32)}), "m.sc has no packed weights")]
    for call, message in bad:
        with pytest.raises(kdtr_format.KdtrError, match=message) as e:
            call()
        assert type(e.value) is kdtr_format.Int4LayoutError
