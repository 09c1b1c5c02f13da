"""Decode steps record attn_out (docs/golden-bundles.md, "What decode steps keep"), so a fault that lives
only in the decode path is localised to its sublayer, not to the layer's resid_out."""
import pytest

from conformance.engines.faults import FaultyEngine
from conformance.exit_codes import ExitCode
from conformance.verify.runner import verify
from kdtr_format import open_kdtr


def test_bundles_record_decode_attn_out(small_bundle):
    with open_kdtr(small_bundle) as f:
        assert "attn_out" in f.metadata["taps"]["ar"]
        n = len(f["golden/p0/ar/tokens"])
        assert f["golden/p0/ar/L3/attn_out"].shape == (n - 1, f.metadata["model_config"]["hidden_size"])
        assert "ar/L3/attn_out" in f.metadata["tolerances"]["taps"]


def test_bundles_record_decode_router_scores(small_bundle):
    """Decode-step router scores: what a precision profile judges a decode expert flip against."""
    with open_kdtr(small_bundle) as f:
        cfg = f.metadata["model_config"]
        assert "router_scores" in f.metadata["taps"]["ar"]
        n = len(f["golden/p0/ar/tokens"])
        for l in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
            assert f[f"golden/p0/ar/L{l}/router_scores"].shape == (n - 1, cfg["n_routed_experts"])
            assert f"ar/L{l}/router_scores" in f.metadata["tolerances"]["taps"]
            assert f"ar/L{l}/router_scores" in f.metadata["tolerances"]["profiles"]["bf16"]["taps"]
        assert f"golden/p0/ar/L{cfg['first_k_dense_replace'] - 1}/router_scores" not in f   # dense layer


@pytest.mark.parametrize("layer", [1, 4])
def test_a_decode_only_attention_fault_is_localised_to_attn_out(small_bundle, layer):
    v = verify(str(small_bundle), engine=FaultyEngine("decode_attn_scale", layer=layer))
    bad = [c.name for c in v.checks if c.status in ("fail", "error")]
    assert v.exit_code == ExitCode.NUMERIC, bad
    assert not any("/prefill/" in n for n in bad), bad                   # prefill is untouched
    d = v.first_divergence
    assert (d.name, d.layer, d.tap, d.phase, d.step, d.cause) == (f"p0/ar/L{layer}/attn_out", layer, "attn_out",
                                                                  "ar", 0, "local"), d
