"""cuda_engine/weights.py's read of a bundle (CPU, no GPU): INT4 scales stay the stored bf16 bits (no float round
trip: at K2.6 size that trip took minutes of the load), words as stored, dense tensors float32."""
from pathlib import Path

import numpy as np

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
