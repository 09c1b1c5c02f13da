"""Localising the first divergence with an engine that can run one layer alone (teacher forcing). The
diverging layer is re-run twice, and the two results name one of three causes:

    on golden inputs    on its own reported inputs    cause
    over tolerance      (not needed)                  local: the layer computes wrongly
    within              over tolerance                inherited: sub-tolerance errors of earlier layers,
                                                      carried in by the hidden state and cache rows
    within              within                        input: the layer is right on what the taps show, so
                                                      what differs is an input no tap shows: the
                                                      positions, the cache rows it really read, the
                                                      embedding

"Own reported inputs" are the engine's own taps: the previous layer's resid_out (the embedding of the
golden token at layer 0) and this layer's kv_latent / k_pe cache rows, at the golden positions. When the
engine did not report them the cause is "not local", with the missing taps as evidence.
"""
from __future__ import annotations

import numpy as np

from conformance.records import position_offset
from conformance.report.verdict import Divergence
from conformance.tolerance import check_tap
from conformance.verify.context import Run
from conformance.verify.judge_taps import canonical_routing
from conformance.verify.outputs import widened


def layer_inputs(f, div: Divergence, out: dict | None = None, dtype: str = "float32") -> dict:
    """The inputs of the diverging layer: its input hidden, positions and cache rows before. Golden ones
    (the bundle's taps), or with `out` the engine's own reported taps at the golden positions; KeyError
    naming the first tap the engine did not report."""
    if out is not None:
        i = int(div.name.split("/")[0][1:])
        src = _Own(f, out, f"p{i}/", f"golden/p{i}/", dtype)
        return _inputs(f, div, src)
    return _inputs(f, div, f)


class _Own:
    """The engine's reported taps read like the bundle's goldens: golden/p{i}/KEY -> out[p{i}/KEY],
    widened to float32; KeyError naming the run-dump name when the engine did not report it."""

    def __init__(self, f, out: dict, p: str, g: str, dtype: str):
        self.out, self.p, self.g, self.dtype = out, p, g, dtype

    def __getitem__(self, name: str):
        key = self.p + name[len(self.g):]
        if key not in self.out:
            raise KeyError(key)
        return widened({key: self.out[key]}, self.dtype)[key]


def _inputs(f, div: Divergence, src) -> dict:
    i = int(div.name.split("/")[0][1:])
    g, l = f"golden/p{i}/", div.layer
    prompt, tokens = np.asarray(f[g + "prompt_ids"]), np.asarray(f[g + "ar/tokens"])
    pos0 = position_offset(f, i)                                          # cache row j at position pos0 + j
    embed = f.get("model.embed_tokens.weight")
    if div.phase == "prefill":
        hidden = embed[prompt] if l == 0 else src[g + f"prefill/L{l - 1}/resid_out"]
        C, R = f[g + f"prefill/L{l}/kv_latent"].shape[1], f[g + f"prefill/L{l}/k_pe"].shape[1]
        return {"hidden": np.asarray(hidden), "positions": pos0 + np.arange(len(prompt)),
                "c_kv": np.zeros((0, C), np.float32), "k_pe": np.zeros((0, R), np.float32)}
    s = div.step
    hidden = embed[tokens[s:s + 1]] if l == 0 else src[g + f"ar/L{l - 1}/resid_out"][s:s + 1]
    cat = lambda t: np.concatenate([src[g + f"prefill/L{l}/{t}"], src[g + f"ar/L{l}/{t}"][:s]])  # noqa: E731
    return {"hidden": np.asarray(hidden), "positions": np.array([pos0 + len(prompt) + s]),
            "c_kv": cat("kv_latent"), "k_pe": cat("k_pe")}


def localize(engine, run: Run, div: Divergence, checks: list, out: dict) -> Divergence:
    """Fill in `div`'s local_error (the tap on golden inputs), inherited_error (the tap in the full run,
    from `checks`), cause and evidence (module docstring). `out`: the engine's outputs (run-dump names)."""
    f = run.f
    if div.layer is None or not getattr(engine, "supports_teacher_forcing", False):
        return div
    if div.phase == "ar" and (div.step is None or div.tap not in f.metadata["taps"]["ar"]):
        return div
    local = _replay(engine, run, div, layer_inputs(f, div))
    if local is None:
        return div
    div.local_error = _summary(local)
    full = next((c.metrics for c in checks if c.name == div.name), {})
    div.inherited_error = {k: full[k] for k in ("max_abs", "nmse", "max_ulp") if k in full}
    at = f"L{div.layer}/{div.tap}" + (f" at decode step {div.step}" if div.phase == "ar" else " in the prefill")
    if not local.passed:
        div.cause = "local"
        div.evidence = {"golden inputs": f"{at} is over tolerance with the layer fed the golden hidden state, "
                                         f"positions and cache rows: the fault is inside layer {div.layer}"}
        return div
    div.evidence = {"golden inputs": f"{at} is within tolerance on golden inputs ({metric_text(local)})",
                    "earlier taps": _earlier_taps(f, div, checks)}
    try:
        own = _replay(engine, run, div, layer_inputs(f, div, out, run.dtype))
    except KeyError as e:
        div.cause = "not local"
        div.evidence["own inputs"] = (f"the engine did not report {e.args[0]}, so its own inputs cannot be "
                                      f"replayed: inherited error and an input fault look alike here")
        return div
    if own is not None and not own.passed:
        div.cause = "inherited"
        div.evidence["own inputs"] = (f"over tolerance again ({metric_text(own)}) when fed the engine's own "
                                      f"reported hidden state and cache rows: the error arrives through them")
    else:
        div.cause = "input"
        div.evidence["own inputs"] = ("within tolerance too when fed the engine's own reported hidden state "
                                      "and cache rows at the golden positions")
        div.evidence["look at"] = ("an input no tap shows: the positions (RoPE), the cache rows the layer "
                                   "really read (offsets, compaction), the embedding")
    return div


def _replay(engine, run: Run, div: Divergence, inputs: dict):
    """The diverging tap of layer div.layer run alone on `inputs`, judged against its golden as the
    judge does (routing as per-row sets); None when run_layer does not report that tap."""
    taps = engine.run_layer(div.layer, inputs)
    key = f"L{div.layer}/{div.tap}"
    if key not in taps:
        return None
    f = run.f
    i, rel = int(div.name.split("/")[0][1:]), div.name.split("/", 1)[1]
    rows = slice(div.step, div.step + 1) if div.phase == "ar" else slice(None)
    golden = np.asarray(f[f"golden/p{i}/{rel}"][rows])
    rule = run.tolerance(div.name, rel).rule
    actual = np.asarray(taps[key])
    if div.tap in ("topk_ids", "topk_weights") and actual.shape == golden.shape:   # as judge: per-row sets
        g_ids = np.asarray(f[f"golden/p{i}/{rel.rsplit('/', 1)[0]}/topk_ids"][rows])
        a_ids = np.asarray(taps[f"L{div.layer}/topk_ids"])
        weights = div.tap == "topk_weights"
        golden = canonical_routing(g_ids, golden if weights else None)[int(weights)]
        actual = canonical_routing(a_ids, actual if weights else None)[int(weights)]
    return check_tap(golden, actual, rule, run.dtype)


def _summary(r) -> dict:
    d = {k: r.metrics.get(k) for k in ("max_abs", "nmse", "max_ulp", "mismatch_count") if k in r.metrics}
    d["passed"] = r.passed
    return d


def metric_text(r) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in _summary(r).items() if k != "passed")


def _earlier_taps(f, div: Divergence, checks: list) -> str:
    """What the taps computed before the diverging one in the same forward showed. The first divergence
    is the earliest failure in execution order, so each earlier tap that ran was within tolerance there;
    a skipped one (not reported) says nothing, and is named."""
    prefix = f"{div.name.split('/')[0]}/{div.phase}/L"
    names = [c for c in checks if c.name.startswith(prefix)]                   # layer taps, in order
    earlier = names[:[c.name for c in names].index(div.name)] if any(c.name == div.name for c in names) else []
    ran = sum(c.status != "skip" for c in earlier)
    skipped = [c.name for c in earlier if c.status == "skip"]
    where = "in the prefill" if div.phase == "prefill" else f"at decode step {div.step}"
    text = f"the {ran} tap{'' if ran == 1 else 's'} before it {where} {'was' if ran == 1 else 'were'} within tolerance"
    return text + (f"; {len(skipped)} were not reported ({', '.join(skipped[:3])})" if skipped else "")
