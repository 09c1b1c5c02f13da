"""cuda_engine/weights.py's read of a bundle (CPU, no GPU): INT4 scales stay the stored bf16 bits (no float round
trip: at K2.6 size that trip took minutes of the load), words as stored, dense tensors float32."""
from pathlib import Path

import numpy as np
import pytest

from cuda_engine.weights import load_weights
from kdtr_format import open_kdtr
from kdtr_format.int4 import scale_bits, scales_as_float

BUNDLE = Path(__file__).resolve().parent.parent / "bundles" / "model_int4_tiny.kdtr"


def test_int4_scales_are_the_stored_bits_and_the_round_trip_agrees():
    cfg, W = load_weights(BUNDLE, keep_int4=True)
    with open_kdtr(BUNDLE) as f:
        scs = [n for n in f.names if n.endswith(".sc") and not n.startswith("golden/")]
        assert scs
        for n in scs:
            stored = np.asarray(f[n])
            assert W[n].dtype == np.uint16 and np.array_equal(W[n], stored)
            assert np.array_equal(W[n], scale_bits(scales_as_float(stored)))    # what the old read made
            q = n[:-3] + ".qw"
            assert W[q].dtype == np.int32 and np.array_equal(W[q], np.asarray(f[q]))
    dense = [k for k in W if not k.endswith((".qw", ".sc"))]
    assert dense and all(W[k].dtype == np.float32 for k in dense)


SLICE = BUNDLE.parent / "model_tiny_slice.kdtr"      # stored as K2.6 ships: bf16 dense, INT4 experts


def test_bf16_matmul_weights_stay_the_stored_bits_and_the_rest_is_float32():
    """dense="stored" (the engine's default): every matmul weight the bundle stores as bfloat16 is its stored
    bits (uint16); norm weights and the router's bias are float32; keep_bf16=False widens every one exactly."""
    from cuda_engine.weights import BF16_WEIGHTS
    from kdtr_format.bf16 import bf16_to_float32
    _, kept = load_weights(SLICE, keep_int4=True, keep_bf16=True)
    _, wide = load_weights(SLICE, keep_int4=True)
    with open_kdtr(SLICE) as f:
        bf16 = [n for n in f.names if not n.startswith(("golden/", "drafter.")) and f.info(n).dtype == "bfloat16"
                and not n.endswith(".sc")]
        matmul = [n for n in bf16 if n.endswith(BF16_WEIGHTS)]
        assert matmul and len(matmul) < len(bf16)                    # norms are bf16 in the bundle too
        for n in bf16:
            stored = np.asarray(f[n])
            if n in matmul:
                assert kept[n].dtype == np.uint16 and np.array_equal(kept[n], stored), n
            else:
                assert kept[n].dtype == np.float32 and np.array_equal(kept[n], bf16_to_float32(stored)), n
            assert wide[n].dtype == np.float32 and np.array_equal(wide[n], bf16_to_float32(stored)), n


def test_layer_arrays_keep_bf16_where_every_part_is():
    """The engine's layouts from bf16 weights: joined tensors (q_a with kv_a, kv_b split per head, the dense
    experts' stacks) stay bf16 bits, the same bits as the float32 layout widened; a join of bf16 and float32
    parts is float32 (exact), and gate/up of one launch always share a type."""
    from cuda_engine.weights import layer_arrays
    from kdtr_format.bf16 import bf16_to_float32
    cfg, kept = load_weights(SLICE, keep_int4=True, keep_bf16=True)
    _, wide = load_weights(SLICE, keep_int4=True)
    for l in range(cfg.num_hidden_layers):
        a, _ = layer_arrays(cfg, kept, l)
        b, _ = layer_arrays(cfg, wide, l)
        bf = {k for k, v in a.items() if v.dtype == np.uint16 and not k.endswith(".sc")}
        want = {"qkv_a", "q_b", "w_uk", "w_uv", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert bf == (want | {"gate"} if l >= cfg.first_k_dense_replace else want), (l, bf)
        for k in bf:
            assert b[k].dtype == np.float32 and np.array_equal(bf16_to_float32(a[k]), b[k]), (l, k)
        assert all(a[k].dtype == np.float32 for k in ("input_ln", "q_a_ln", "kv_a_ln", "post_ln"))
    mixed = dict(kept)
    p = "model.layers.1."
    mixed[p + "self_attn.q_a_proj.weight"] = bf16_to_float32(kept[p + "self_attn.q_a_proj.weight"])
    mixed[p + "mlp.shared_experts.gate_proj.weight"] = bf16_to_float32(kept[p + "mlp.shared_experts.gate_proj.weight"])
    a, _ = layer_arrays(cfg, mixed, 1)
    b, _ = layer_arrays(cfg, wide, 1)
    for k in ("qkv_a", "gate_proj", "up_proj"):
        assert a[k].dtype == np.float32 and np.array_equal(a[k], b[k]), k
    assert a["down_proj"].dtype == np.uint16


def test_an_unknown_dense_mode_is_refused_in_one_line():
    from cuda_engine.device import CudaEngineError
    from cuda_engine.engine import CudaEngine
    with pytest.raises(CudaEngineError, match="dense weights 'bf16': choose one of stored, float32"):
        CudaEngine(dense="bf16")
