"""refmodel.stored.StoredWeights (weights kept as stored, upcast per matmul) gives bit-identical results to
the dense float64 dict the reference used before (dequantize_model), on the tiny preset: FP32 and INT4,
the float64 oracle, the float32 baseline, the bf16 profile's run and the DDTree loop; and it never needs
the whole model in float64."""
import numpy as np
import pytest

from conformance.engines.reference_engine import ReferenceEngine
from conformance.gen.bf16_profile import bf16_weights
from conformance.gen.bundle_model import GenSettings, _f32, apply_quant, as_stored, model_from_preset
from conformance.gen.goldens import run_reference
from kdtr_format import open_kdtr
from refmodel.config import PRESETS, ModelConfig
from refmodel.ddtree import ddtree_generate
from refmodel.quant import dequantize_model
from refmodel.stored import StoredWeights, generate_stored, read_model
from refmodel.weights import init_weights

PROMPT = np.array([5, 17, 3, 250, 11], np.int64)


@pytest.fixture(scope="module", params=["fp32", "int4"])
def tiny_model(request):
    s = GenSettings(quant=request.param, distill_steps=0, seed=0)
    return apply_quant(model_from_preset(s), s)


def assert_identical(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.array_equal(x, y), f"{k}: max |diff| {np.max(np.abs(x.astype(np.float64) - y)):.3e}"


def test_float64_and_float32_runs_are_bit_identical(tiny_model):
    m = tiny_model
    dense64, lazy64 = dequantize_model(m.W), as_stored(m.W)
    g_d, tok_d, mar_d, gap_d = run_reference(m.cfg, dense64, PROMPT, 6)
    g_l, tok_l, mar_l, gap_l = run_reference(m.cfg, lazy64, PROMPT, 6)
    assert_identical(g_d, g_l)
    assert np.array_equal(tok_d, tok_l) and np.array_equal(mar_d, mar_l) and gap_d == gap_l
    g32_d = run_reference(m.cfg, _f32(dense64), PROMPT, 6, tokens=tok_d)[0]
    g32_l = run_reference(m.cfg, _f32(lazy64), PROMPT, 6, tokens=tok_d)[0]
    assert next(iter(g32_l.values())).dtype == np.float32
    assert_identical(g32_d, g32_l)


def test_bf16_profile_run_is_bit_identical(tiny_model):
    m = tiny_model
    dense64, lazy64 = dequantize_model(m.W), as_stored(m.W)
    g64, tokens, _, _ = run_reference(m.cfg, dense64, PROMPT, 4)
    a = run_reference(m.cfg, bf16_weights(dense64), PROMPT, 4, tokens=tokens, routing=g64)[0]
    b = run_reference(m.cfg, bf16_weights(lazy64), PROMPT, 4, tokens=tokens, routing=g64)[0]
    assert_identical(a, b)


def test_ddtree_is_bit_identical(tiny_model):
    m = tiny_model
    DW = {k: v.astype(np.float64) for k, v in m.DW.items()}
    a = ddtree_generate(m.cfg, dequantize_model(m.W), m.dcfg, DW, PROMPT, 8, budget=8)
    b = ddtree_generate(m.cfg, as_stored(m.W), m.dcfg, DW, PROMPT, 8, budget=8)
    assert a.tokens == b.tokens and len(a.rounds) == len(b.rounds)
    for ra, rb in zip(a.rounds, b.rounds):
        assert ra.accepted == rb.accepted and list(ra.verify_argmax) == list(rb.verify_argmax)


@pytest.mark.parametrize("upcast_once", [True, False])
@pytest.mark.parametrize("bundle", ["small_bundle", "small_int4_bundle"])
def test_reference_engine_reads_the_bundle_mapped(bundle, upcast_once, request, monkeypatch):
    """The engine's float32 weights equal the old float64-then-float32 dict, tensor by tensor: a small model
    upcast once at load (a dict), and one over the limit kept as stored (upcast per matmul)."""
    import refmodel.stored as stored

    if not upcast_once:                                  # no memory to spare: kept as stored
        monkeypatch.setattr(stored, "available_memory", lambda: 0)
    with open_kdtr(request.getfixturevalue(bundle)) as f:
        e = ReferenceEngine()
        e.load(f)
        if upcast_once:
            assert type(e.W) is dict and all(v.dtype == np.float32 for v in e.W.values())
        else:
            assert isinstance(e.W, StoredWeights) and e.W.dtype == np.float32
        old = {}
        for n in f.names:
            if not n.startswith(("golden/", "drafter.")):
                old[n] = np.array(f[n]) if f.info(n).int4_shape is not None else np.array(f.get(n), np.float64)
        old32 = {k: v.astype(np.float32) for k, v in dequantize_model(old).items()}
        assert_identical(old32, {k: e.W[k] for k in e.W})
        cfg, W64 = read_model(f)
        assert W64.dtype == np.float64 and cfg == ModelConfig.from_dict(f.metadata["model_config"])


def test_generate_stored_draws_init_weights_and_stores_each_tensor():
    cfg = PRESETS["tiny"]
    ref = init_weights(cfg, 3)
    st = generate_stored(cfg, 3, dense="float32")
    assert list(st) == list(ref)
    for k in ref:
        assert np.array_equal(st[k], ref[k].astype(np.float32).astype(np.float64)), k
    bf = generate_stored(cfg, 3, dense="bfloat16", int4_scope="experts")
    assert bf.is_int4() and any(n.endswith(".qw") for n in bf.stored_names())
    w = bf["model.layers.0.self_attn.o_proj.weight"]
    assert np.array_equal(w.astype(np.float32).view(np.uint32) & 0xFFFF, np.zeros(w.shape, np.uint32))
    assert bf.stored_bytes() < st.stored_bytes() / 2 + 1


def test_overrides_and_errors():
    W = StoredWeights.from_arrays({"a": np.ones((2, 2), np.float32)})
    W["a"] = W["a"] * 2                                  # augmented updates (fault injection) land here
    assert W["a"][0, 0] == 2 and W.astype(np.float32)["a"].dtype == np.float32
    W.update({"a": np.zeros((2, 2))})
    assert W["a"][0, 0] == 0
    del W["a"]                                           # the stored tensor shows again
    assert W["a"][0, 0] == 1
    with pytest.raises(KeyError, match="stored tensors cannot be deleted"):
        del W["a"]
    with pytest.raises(KeyError, match="no tensor 'b' to replace"):
        W["b"] = np.zeros(2)
    with pytest.raises(ValueError, match="scale tensor x.sc has no packed weights x.qw"):
        StoredWeights.from_arrays({"x.sc": np.ones((2, 1), np.float32)})
    with pytest.raises(ValueError, match="dense storage 'int8'"):
        generate_stored(PRESETS["tiny"], 0, dense="int8")
