"""Precision profiles: tolerances for engines that compute in another dtype, derived like the fp32 rule.

The bundle's own tolerances (`metadata.tolerances.taps`) are the `fp32` profile: a multiple of the float32
reference's error against the float64 golden. A bf16 engine makes far larger errors, so it gets its own
profile, derived the same way from a **bf16 reference run**: the refmodel on the bundle's weights rounded to
bfloat16, every array operation's result rounded to bfloat16 (round to nearest even) while reductions and
contractions accumulate in float32, teacher-forced with the golden tokens and with routing held to the
golden expert sets, measured against the float64 golden on the same prompts.

Why routing is held: between near-equal routing scores bf16 noise flips expert choices, and a flip swaps
a whole expert's output. A free-running reference folds those discrete jumps into every later tap's
baseline, so 16 x that baseline grew as large as the signal (decode logits x 0.3 passed). Held to the
golden sets, the run measures arithmetic noise only; an engine's own routing flips are judged by the
routing rules (conformance/verify/near_ties.py), not absorbed into every later bound. The topk_ids taps of
the run still record the router's own choice, so `reference_mismatches` counts the rows where bf16
would have flipped. Each tap's rule is then `DerivedTolerance` with the same multiplier, and the
floor is the same number of ULPs, counted in bfloat16 (docs/conformance.md, section 3a).

Rounding after every operation is stricter than a fused bf16 kernel (which keeps, say, an RMSNorm's
statistics in float32 and rounds once), so a correct bf16 engine sits inside the reference's noise. The
router gate and its correction bias stay float32, as transformers keeps them (`_keep_in_fp32_modules_strict`).

Stored as `metadata.tolerances.profiles.bf16` (schema: docs/golden-bundles.md).
"""
from __future__ import annotations

import numpy as np

from conformance.precision import FP32_KEEP
from conformance.tolerance import DEFAULT_FLOOR_ULPS, DEFAULT_MULTIPLIER, DerivedTolerance
from kdtr_format.bf16 import bf16_round
from refmodel.stored import StoredWeights

BF16_EPS = 2.0**-7                      # bfloat16 machine epsilon: one ULP at 1.0 (8-bit significand)


# ---------------------------------------------------------------- the bf16 reference

def _plain(x):
    """Strip the precision classes (recursively through lists/tuples) so NumPy computes on plain arrays."""
    if isinstance(x, _Precision):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _kind(args) -> type | None:
    """The precision of an operation on `args`: float32 if any input is Fp32Array (a float32 weight
    promotes, as torch promotes bf16 x fp32 to fp32), else bf16 if any is Bf16Array, else none."""
    flat = []
    for a in args:
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    kinds = {type(a) for a in flat if isinstance(a, _Precision)}
    return Fp32Array if Fp32Array in kinds else Bf16Array if Bf16Array in kinds else None


def _wrap(r, kind):
    """A float result in `kind`: rounded to bfloat16 for Bf16Array, kept for Fp32Array; integer and
    boolean results stay plain."""
    if isinstance(r, tuple):
        return tuple(_wrap(v, kind) for v in r)
    if kind is None or not isinstance(r, (np.ndarray, np.floating)) or np.asarray(r).dtype.kind != "f":
        return r
    r = np.asarray(r, np.float32)       # the op's result as float32 computes it, then stored in `kind`
    return (bf16_round(r) if kind is Bf16Array else r).view(kind)


class _Precision(np.ndarray):
    """An array whose operations compute on plain float32 arrays (reductions and contractions accumulate
    in float32) and whose float results are then stored in the class's precision."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        if out is not None:                                              # in place: the target decides
            plain_out = _plain(out)
            getattr(ufunc, method)(*_plain(inputs), out=plain_out, **kwargs)
            for o, p in zip(out, plain_out):
                if isinstance(o, Bf16Array) and p.dtype.kind == "f":
                    p[...] = bf16_round(p)
            return out[0] if len(out) == 1 else out
        return _wrap(getattr(ufunc, method)(*_plain(inputs), **kwargs), _kind(inputs))

    def __array_function__(self, func, types, args, kwargs):
        return _wrap(func(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()}), _kind(args))


class Bf16Array(_Precision):
    """float32 storage holding bfloat16 values: every operation's result is rounded to bfloat16. This
    turns the refmodel, unchanged, into a bf16 engine with float32 accumulation."""


class Fp32Array(_Precision):
    """A float32 tensor inside a bf16 model (the router gate and bias): operations touching it run and
    stay in float32, as transformers' router does (`F.linear(hidden.float(), weight.float())`)."""


def bf16_weights(W64) -> dict:
    """The weights a bf16 engine holds: every float tensor rounded to bfloat16 (Bf16Array), except the
    router gate and its bias (Fp32Array: the router runs in float32 on the bf16 hidden state). A
    StoredWeights stays lazy: each tensor is made so when a forward reads it."""
    if isinstance(W64, StoredWeights):
        return W64.astype(np.float32).with_transform(_bf16_tensor)
    return {k: _bf16_tensor(k, v) for k, v in W64.items()}


def _bf16_tensor(k: str, v: np.ndarray) -> np.ndarray:
    if v.dtype.kind != "f":
        return v
    if k.endswith(FP32_KEEP):
        return np.asarray(v, np.float32).view(Fp32Array)
    return bf16_round(v).view(Bf16Array)


def bf16_ulp(magnitude: float) -> float:
    """Spacing of bfloat16 values at `magnitude` (normal range)."""
    m = abs(float(magnitude))
    if m == 0 or not np.isfinite(m):
        return 2.0**-133                                                 # smallest bf16 subnormal
    return 2.0 ** (np.floor(np.log2(m)) - 7)


# ---------------------------------------------------------------- deriving the profile

def derive_profile(errors: list[dict], quant: str, floor_ulps: int = DEFAULT_FLOOR_ULPS) -> dict:
    """The bf16 profile from per-prompt errors of the bf16 reference (`reference_errors`): per float tap
    the worst prompt's max abs error and NMSE, the multiplier of the fp32 rule and a floor of `floor_ulps`
    bfloat16 ULPs of the tap's largest golden value. Integer taps (topk_ids) stay exact, with the worst
    prompt's count of rows where the reference's own router chose another expert set than the golden
    (informative: the run itself ran the golden sets)."""
    agg: dict[str, dict] = {}
    for e in errors:
        for k, v in e.items():
            a = agg.setdefault(k, {})
            for key, x in v.items():
                a[key] = max(a.get(key, 0), x)
    multiplier = DEFAULT_MULTIPLIER[quant]
    taps = {}
    for k, a in sorted(agg.items()):
        if "mismatches" in a:
            taps[k] = {"exact": True, "reference_mismatches": int(a["mismatches"])}
            continue
        taps[k] = DerivedTolerance(
            baseline_max_abs=float(a["max_abs"]), baseline_nmse=float(a["nmse"]), multiplier=multiplier,
            abs_floor=floor_ulps * bf16_ulp(a["magnitude"]),
            nmse_floor=float((floor_ulps * BF16_EPS) ** 2)).to_dict()
    return {
        "dtype": "bfloat16",
        "rule": ("bf16 engine passes a tap if max|a - g| <= multiplier * baseline_max_abs + abs_floor and "
                 "NMSE <= multiplier * baseline_nmse + nmse_floor, where the baseline is the bf16 reference "
                 "(weights and every operation's result rounded to bfloat16, float32 accumulation, router "
                 "gate float32, routing held to the golden expert sets) vs the float64 golden on the same "
                 "weights and tokens, worst prompt; abs_floor = floor_ulps bfloat16 ULPs of the tap's "
                 "largest golden value. Tokens and expert choices are exact except at near-ties: a golden "
                 "margin within twice the profile's logits (router_scores) atol, and the engine's own "
                 "reported logits (router_scores) choosing its decision."),
        "multiplier": multiplier,
        "floor_ulps": floor_ulps,
        "taps": taps,
    }


def bf16_profile(cfg, W64: dict, goldens: list[tuple], quant: str) -> dict:
    """Run the bf16 reference on every (prompt, golden tokens, float64 goldens, first position), routing
    held to the golden expert sets, and derive the profile."""
    from conformance.gen.goldens import baseline_errors, run_reference   # gen calls this: import when called

    Wb = bf16_weights(W64)
    errors = []
    for prompt, tokens, g64, pos0 in goldens:
        gb, _, _, _ = run_reference(cfg, Wb, prompt, len(tokens), tokens=tokens, pos0=pos0, routing=g64)
        errors.append(reference_errors(g64, {k: np.asarray(v) for k, v in gb.items()}, baseline_errors))
    return derive_profile(errors, quant)


def reference_errors(g64: dict, gb: dict, baseline_errors) -> dict:
    """gen.baseline_errors for float taps; for expert ids, the rows whose expert *set* differs (the
    order inside a row is a tie rule, as the judge compares it)."""
    out = baseline_errors(g64, gb)
    for k, g in g64.items():
        if g.dtype.kind in "iu":
            out[k] = {"mismatches": int(np.count_nonzero((np.sort(g, -1) != np.sort(gb[k], -1)).any(-1)))}
    return out
