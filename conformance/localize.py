"""Localising the first divergence: re-run the diverging layer on golden inputs with an engine that can
run one layer alone (teacher forcing), to tell a local fault from error inherited from earlier layers."""
from __future__ import annotations

import numpy as np

from conformance.judge import manifest_rule, canonical_routing
from conformance.records import position_offset
from conformance.report import Divergence
from conformance.tolerance import check_tap, resolve_rule


def layer_inputs(f, div: Divergence) -> dict:
    """The golden inputs of the diverging layer: its input hidden, positions and cache rows before."""
    i = int(div.name.split("/")[0][1:])
    g, l = f"golden/p{i}/", div.layer
    prompt, tokens = np.asarray(f[g + "prompt_ids"]), np.asarray(f[g + "ar/tokens"])
    pos0 = position_offset(f, i)                                          # cache row j at position pos0 + j
    embed = f.get("model.embed_tokens.weight")
    if div.phase == "prefill":
        hidden = embed[prompt] if l == 0 else f[g + f"prefill/L{l - 1}/resid_out"]
        C, R = f[g + f"prefill/L{l}/kv_latent"].shape[1], f[g + f"prefill/L{l}/k_pe"].shape[1]
        return {"hidden": np.asarray(hidden), "positions": pos0 + np.arange(len(prompt)),
                "c_kv": np.zeros((0, C), np.float32), "k_pe": np.zeros((0, R), np.float32)}
    s = div.step
    hidden = embed[tokens[s:s + 1]] if l == 0 else f[g + f"ar/L{l - 1}/resid_out"][s:s + 1]
    cat = lambda t: np.concatenate([f[g + f"prefill/L{l}/{t}"], f[g + f"ar/L{l}/{t}"][:s]])  # noqa: E731
    return {"hidden": np.asarray(hidden), "positions": np.array([pos0 + len(prompt) + s]),
            "c_kv": cat("kv_latent"), "k_pe": cat("k_pe")}


def localize(engine, f, div: Divergence, overrides=(), dtype="float32", full_metrics=None) -> Divergence:
    """Re-run the diverging layer on golden inputs: over tolerance there too = a local fault;
    within = error inherited from earlier layers (each under tolerance, together over it).
    local_error: the tap's error on golden inputs; inherited_error: its error in the full run
    (`full_metrics`), which carries what earlier layers passed on."""
    if div.layer is None or not getattr(engine, "supports_teacher_forcing", False):
        return div
    if div.phase == "ar" and (div.step is None or div.tap not in f.metadata["taps"]["ar"]):
        return div
    taps = engine.run_layer(div.layer, layer_inputs(f, div))
    key = f"L{div.layer}/{div.tap}"
    if key not in taps:
        return div
    i = int(div.name.split("/")[0][1:])
    golden = f[f"golden/p{i}/{div.name.split('/', 1)[1]}"]
    if div.phase == "ar":
        golden = golden[div.step:div.step + 1]
    derived = manifest_rule(f.metadata["tolerances"]["taps"].get(div.name.split("/", 1)[1]))
    rule = resolve_rule(div.name, derived, overrides)
    actual = np.asarray(taps[key])
    if div.tap in ("topk_ids", "topk_weights") and actual.shape == golden.shape:   # as judge: per-row sets
        ids_key = f"golden/p{i}/{div.name.split('/', 1)[1].rsplit('/', 1)[0]}/topk_ids"
        g_ids = f[ids_key][div.step:div.step + 1] if div.phase == "ar" else f[ids_key]
        a_ids = np.asarray(taps[f"L{div.layer}/topk_ids"])
        golden = canonical_routing(np.asarray(g_ids), None if div.tap == "topk_ids" else np.asarray(golden))
        actual = canonical_routing(a_ids, None if div.tap == "topk_ids" else actual)
        golden, actual = (golden[0], actual[0]) if div.tap == "topk_ids" else (golden[1], actual[1])
    local = check_tap(golden, actual, rule, dtype)
    div.local_error = {k: local.metrics.get(k) for k in ("max_abs", "nmse", "max_ulp", "mismatch_count")
                       if k in local.metrics}
    div.local_error["passed"] = local.passed
    if full_metrics:                         # the same tap in the full run, on the engine's own inputs
        div.inherited_error = {k: full_metrics[k] for k in ("max_abs", "nmse", "max_ulp") if k in full_metrics}
    div.cause = "inherited" if local.passed else "local"
    return div
