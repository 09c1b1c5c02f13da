"""Before the run: will localisation work? One call of the engine's `run_layer` on golden inputs, so that
an engine whose teacher forcing is broken hears it up front, in one line, and not at its first failure
(conformance/verify/localize.py re-runs the diverging layer the same way).
"""
from __future__ import annotations

from conformance.report.verdict import Divergence
from conformance.verify.localize import layer_inputs


def preflight_localisation(engine, f) -> str | None:
    """None when `engine.run_layer` answers on golden inputs with its layer's taps; else one line saying
    why localisation will not work. The call: the first MoE layer (layer 0 when there is none; attention
    and, where it has one, the router and experts all run) on prompt 0's golden prefill inputs."""
    if not getattr(engine, "supports_teacher_forcing", False):
        return ("localisation off: the engine sets supports_teacher_forcing = False (no run_layer), so a first "
                "divergence is reported without a local / inherited cause")
    cfg = f.metadata["model_config"]
    layer = cfg["first_k_dense_replace"] if cfg["first_k_dense_replace"] < cfg["num_hidden_layers"] else 0
    where = f"run_layer({layer}, prompt 0's golden prefill inputs)"
    div = Divergence(name=f"p0/prefill/L{layer}/attn_in", layer=layer, tap="attn_in", phase="prefill", step=None,
                     token_position=None, worst_index=None, golden=None, actual=None)
    try:
        taps = engine.run_layer(layer, layer_inputs(f, div))
    except Exception as e:  # noqa: BLE001 - any failure of the engine's run_layer is what this reports
        return f"localisation will not work: {where} raised {type(e).__name__}: {e}"
    if not isinstance(taps, dict):
        return f"localisation will not work: {where} returned a {type(taps).__name__}, not a dict of taps"
    if not any(k.startswith(f"L{layer}/") for k in taps):
        got = ", ".join(sorted(map(str, taps))[:3]) or "nothing"
        return (f"localisation will not work: {where} returned none of layer {layer}'s taps (names like "
                f"L{layer}/attn_in, docs/engine-api.md); it returned {got}")
    return None
