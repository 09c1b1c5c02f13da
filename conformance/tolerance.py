"""Tolerance rules: when is an engine's tap close enough to the golden one, and why that close.

A `Rule` is an elementwise bound plus optional aggregate gates, all of which must hold (AND):

    elementwise   |a - g| <= atol + rtol * |g|   for every element (numpy/torch additive form)
    max_ulp       max ULP distance in the engine dtype <= max_ulp
    nmse          sum (a - g)^2 / sum g^2 <= nmse

Bundle tolerances are derived, not guessed (`DerivedTolerance`, `derive_tolerance`): the generator
measures per tap the error of the float32 reference against the float64 truth (the same-precision
baseline) and an fp32 engine passes if it is within a multiple of that plus a floor of a few float32
ULPs. A rules file (TOML or JSON, glob over tap names -> rule, first match wins) overrides the bundle
for engines of other precisions. Full definitions and the reasons for the defaults: docs/conformance.md.
"""
from __future__ import annotations

import fnmatch
import json
import math
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from conformance.metrics import tensor_metrics
from kdtr_format.bf16 import bf16_to_float32
from kdtr_format.paths import open_regular

MODES = ("elementwise", "aggregate", "exact")
FP32_EPS = 2.0**-23                     # float32 machine epsilon: one ULP at 1.0
# Multiplier on the same-precision baseline, per bundle quantization. Same value for INT4: its golden
# is the exact output of the dequantized model, so a correct fp32 engine sees the same noise sources.
DEFAULT_MULTIPLIER = {"fp32": 16.0, "int4": 16.0}
DEFAULT_FLOOR_ULPS = 4                  # absolute floor: this many float32 ULPs of the tap's magnitude


@dataclass(frozen=True)
class Rule:
    """One tap's pass criterion. `mode`: "elementwise" (the bound and the gates), "aggregate" (gates
    only: for taps where a single element says little) or "exact" (bit-equal values)."""
    atol: float = 0.0
    rtol: float = 0.0
    max_ulp: int | None = None
    nmse: float | None = None
    mode: str = "elementwise"
    source: str = "default"              # where the rule came from, for the report

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"rule mode must be one of {MODES}, got {self.mode!r}")
        for key in ("atol", "rtol", "max_ulp", "nmse"):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, (int, float)) and v >= 0 and not math.isnan(v)):
                raise ValueError(f"rule {key} must be a number >= 0, got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DerivedTolerance:
    """A tap's tolerance derived from its same-precision baseline (the manifest entry):
    atol = multiplier * baseline_max_abs + abs_floor, nmse = multiplier * baseline_nmse + nmse_floor."""
    baseline_max_abs: float
    baseline_nmse: float
    multiplier: float
    abs_floor: float
    nmse_floor: float

    def rule(self, source: str = "manifest") -> Rule:
        return Rule(atol=self.multiplier * self.baseline_max_abs + self.abs_floor, rtol=0.0,
                    nmse=self.multiplier * self.baseline_nmse + self.nmse_floor, source=source)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DerivedTolerance:
        missing = [k for k in cls.__dataclass_fields__ if k not in d]
        if missing:
            raise ValueError(f"tolerance entry lacks {missing}: got keys {sorted(d)}")
        return cls(**{k: float(d[k]) for k in cls.__dataclass_fields__})


def float32_ulp(magnitude: float) -> float:
    """Spacing of float32 values at `magnitude` (the smallest subnormal at 0)."""
    return float(np.spacing(np.float32(abs(magnitude))))


def derive_tolerance(baseline_max_abs: float, baseline_nmse: float, multiplier: float | None = None,
                     abs_floor: float | None = None, *, magnitude: float | None = None,
                     quant: str = "fp32", floor_ulps: int = DEFAULT_FLOOR_ULPS) -> DerivedTolerance:
    """The bundle rule. `magnitude` (max |golden| of the tap) sets the default abs_floor of
    `floor_ulps` float32 ULPs there; the NMSE floor is (floor_ulps * eps32)^2, the same number of
    ULPs as a relative RMS error. `quant` ("fp32" or "int4") picks the default multiplier."""
    if quant not in DEFAULT_MULTIPLIER:
        raise ValueError(f"quant must be one of {sorted(DEFAULT_MULTIPLIER)}, got {quant!r}")
    if abs_floor is None:
        if magnitude is None:
            raise ValueError("derive_tolerance needs abs_floor or the tap's magnitude (max |golden|)")
        abs_floor = floor_ulps * float32_ulp(magnitude)
    for name, v in (("baseline_max_abs", baseline_max_abs), ("baseline_nmse", baseline_nmse)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
    return DerivedTolerance(
        baseline_max_abs=float(baseline_max_abs), baseline_nmse=float(baseline_nmse),
        multiplier=float(DEFAULT_MULTIPLIER[quant] if multiplier is None else multiplier),
        abs_floor=float(abs_floor), nmse_floor=float((floor_ulps * FP32_EPS) ** 2))


# ---------------------------------------------------------------------------------------------
# Rules file: ordered glob -> rule, first match wins
# ---------------------------------------------------------------------------------------------

_EXPLICIT = {"atol", "rtol", "max_ulp", "nmse", "mode"}
_DERIVED = {"multiplier", "abs_floor", "nmse_floor"}


@dataclass(frozen=True)
class RuleOverride:
    """One rules-file entry. `fields` holds explicit Rule fields; `derive` holds multiplier /
    abs_floor / nmse_floor that re-derive atol and nmse from the tap's manifest baseline."""
    pattern: str
    fields: dict = field(default_factory=dict)
    derive: dict = field(default_factory=dict)
    why: str = ""
    where: str = ""                      # "FILE: rule N", for messages and Rule.source

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)


_NUMBER_KEYS = ("atol", "rtol", "nmse", "multiplier", "abs_floor", "nmse_floor")
MAX_RULES_BYTES = 1 << 20               # a rules file is a few lines; more is a wrong path


def _check_value(at: str, key: str, v) -> None:
    """The type of one rules-file value, named in the message (values were JSON/TOML: anything)."""
    if key in ("match", "why", "mode"):
        ok, want = isinstance(v, str), "a string"
    elif key == "max_ulp":
        ok, want = type(v) is int and v >= 0, "an integer >= 0"
    else:
        ok = (type(v) is int and 0 <= v < 2**63) or (type(v) is float and v >= 0)   # NaN >= 0 is False
        want = "a number >= 0"
    if not ok:
        shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:60] + "..."
        raise ValueError(f"{at}: {key!r} must be {want}, got {shown}")


def parse_rules(doc, where: str = "rules") -> list[RuleOverride]:
    """A parsed rules document {"rule": [{"match": GLOB, ...}, ...]} -> overrides in file order.
    Every key and value is type-checked, so a bad file is a ValueError naming the key, never an
    AttributeError or TypeError from deep inside."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: the top level must be a table/object with the key 'rule', got a "
                         f"JSON {type(doc).__name__}")
    entries = doc.get("rule")
    if not isinstance(entries, list) or set(doc) - {"rule"}:
        raise ValueError(f"{where}: expected a list under the single key 'rule', got keys {sorted(doc)}")
    out = []
    for i, e in enumerate(entries, 1):
        at = f"{where}: rule {i}"
        if not isinstance(e, dict) or not isinstance(e.get("match"), str):
            raise ValueError(f"{at}: each rule needs a 'match' glob string")
        where_i, at = at, f"{at} ({e['match']!r})"
        unknown = set(e) - _EXPLICIT - _DERIVED - {"match", "why"}
        if unknown:
            raise ValueError(f"{at}: unknown keys {sorted(map(str, unknown))}; allowed: "
                             f"{sorted(_EXPLICIT | _DERIVED | {'match', 'why'})}")
        for key, v in e.items():
            _check_value(at, key, v)
        if "atol" in e and set(e) & _DERIVED:
            raise ValueError(f"{at}: give 'atol' or derive it ('multiplier', 'abs_floor', 'nmse_floor'), "
                             f"not both")
        fields = {k: e[k] for k in _EXPLICIT if k in e}
        Rule(**fields)                   # validate now, with the rule's position in the message
        out.append(RuleOverride(e["match"], fields, {k: float(e[k]) for k in _DERIVED if k in e},
                                e.get("why", ""), where_i))
    return out


def load_rules_file(path: str | Path) -> list[RuleOverride]:
    """Read a .toml (tomllib) or .json rules file; see docs/conformance.md for the format. Any problem
    (not a regular file, too large, not TOML/JSON, nested too deep, wrong keys or types) is an
    OSError or ValueError whose message names the file and the key."""
    path = Path(path)
    if path.suffix not in (".toml", ".json"):
        raise ValueError(f"rules file must end in .toml or .json, got {path.name!r}")
    with open_regular(path, "rules file") as f:   # a FIFO would block forever
        raw = f.read(MAX_RULES_BYTES + 1)
    if len(raw) > MAX_RULES_BYTES:
        raise ValueError(f"{path.name}: over {MAX_RULES_BYTES} bytes; a rules file is a short list of rules")
    try:
        text = raw.decode("utf-8")
        doc = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except RecursionError:
        raise ValueError(f"{path.name}: nests too deep to be a rules file") from None
    except (ValueError, tomllib.TOMLDecodeError) as e:   # not UTF-8, not TOML, not JSON
        raise ValueError(f"{path.name}: not valid {path.suffix[1:].upper()} ({e})") from None
    return parse_rules(doc, where=path.name)


def resolve_rule(name: str, manifest: DerivedTolerance | Rule | None,
                 overrides: list[RuleOverride] = ()) -> Rule:
    """The rule for tap `name`: the first override whose glob matches, else the manifest's.
    An override replaces the manifest rule (unset fields take Rule defaults); a derived override
    re-derives atol/nmse from this tap's baseline with its own multiplier or floors."""
    for o in overrides:
        if not o.matches(name):
            continue
        src = f"{o.where} {o.pattern!r}"
        if not o.derive:
            return Rule(**o.fields, source=src)
        if not isinstance(manifest, DerivedTolerance):
            continue                     # an exact tap (ids, tokens) has no baseline to re-derive from
        d = DerivedTolerance(**{**manifest.to_dict(), **o.derive}).rule()
        return Rule(**{"atol": d.atol, "nmse": d.nmse, **o.fields}, source=src)
    if manifest is None:
        raise ValueError(f"no tolerance for tap {name!r}: not in the bundle manifest and no "
                         f"rules-file pattern matches it")
    return manifest.rule() if isinstance(manifest, DerivedTolerance) else manifest


# ---------------------------------------------------------------------------------------------
# Checking a tap
# ---------------------------------------------------------------------------------------------

@dataclass
class TapCheck:
    """Outcome of one tap: `ratio` is the worst gate's value / limit (pass iff <= 1 and no
    failures), `failures` one readable line per failed gate, `min_passing` only when it failed."""
    passed: bool
    metrics: dict
    failures: list[str]
    ratio: float
    min_passing: dict | None


def _ratio(value: float, limit: float) -> float:
    if value <= limit:
        return value / limit if limit > 0 else 0.0
    return value / limit if limit > 0 else math.inf


def _elementwise(golden: np.ndarray, actual: np.ndarray, rule: Rule, dtype: str) -> tuple[float, float]:
    """(atol needed at the rule's rtol, max of |a-g| / (atol + rtol|g|)) over finite elements."""
    g = np.asarray(golden).astype(np.float64).ravel()
    if dtype == "bfloat16" and np.asarray(actual).dtype == np.uint16:
        a = bf16_to_float32(actual).astype(np.float64).ravel()
    else:
        a = np.asarray(actual).astype(np.float64).ravel()
    m = np.isfinite(g) & np.isfinite(a)
    err, mag = np.abs(a[m] - g[m]), np.abs(g[m])
    if not err.size:
        return 0.0, 0.0
    need = float(max(0.0, (err - rule.rtol * mag).max()))
    bound = rule.atol + rule.rtol * mag
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(err == 0, 0.0, err / bound)                 # 0/0 -> 0, e/0 -> inf
    return need, float(r.max())


def check_tap(golden: np.ndarray, actual: np.ndarray, rule: Rule, dtype: str = "float32",
              derived: DerivedTolerance | None = None) -> TapCheck:
    """Judge one tap. Integer goldens are always compared exactly, whatever the rule says.
    `derived` (the manifest entry the rule came from) adds the passing multiplier on failure."""
    m = tensor_metrics(golden, actual, dtype)
    if m["exact"]:
        ok = m["mismatch_count"] == 0
        fail = [] if ok else [f"{m['mismatch_count']} of {m['n']} values differ; first at "
                              f"{m['first_mismatch']}: golden {m['golden_at_first']}, "
                              f"actual {m['actual_at_first']}"]
        return TapCheck(ok, m, fail, 0.0 if ok else math.inf, None if ok else {"exact": True})

    fail, ratios = [], [0.0]
    if m["nonfinite"]:
        fail.append(f"{m['nonfinite']} non-finite or mismatched special values, first at "
                    f"{m['first_nonfinite']} (golden {m['golden_at_worst']}, actual "
                    f"{m['actual_at_worst']})")
        ratios.append(math.inf)
    if rule.mode == "exact":
        ratios.append(_ratio(m["max_abs"], 0.0))
        if m["max_abs"] > 0 and not m["nonfinite"]:
            fail.append(f"not bit-exact: max |a-g| {m['max_abs']:.3g} at {m['worst_index']}")
    if rule.mode == "elementwise" and not m["nonfinite"]:
        m["atol_needed"], r = _elementwise(golden, actual, rule, dtype)
        m["rtol"] = rule.rtol
        ratios.append(r)
        if r > 1:
            fail.append(f"|a-g| {m['max_abs']:.3g} at {m['worst_index']} (golden "
                        f"{m['golden_at_worst']:.6g}, actual {m['actual_at_worst']:.6g}) exceeds "
                        f"atol {rule.atol:.3g} + rtol {rule.rtol:.3g}*|g|")
    if rule.max_ulp is not None:
        ratios.append(_ratio(m["max_ulp"], rule.max_ulp))
        if m["max_ulp"] > rule.max_ulp and not m["nonfinite"]:
            fail.append(f"max ULP {m['max_ulp']} ({dtype}) > {rule.max_ulp}")
    if rule.nmse is not None:
        ratios.append(_ratio(m["nmse"], rule.nmse))
        if m["nmse"] > rule.nmse and not m["nonfinite"]:
            fail.append(f"NMSE {m['nmse']:.3g} > {rule.nmse:.3g}")
    ratio = max(ratios)
    m["ratio"] = ratio
    ok = not fail
    return TapCheck(ok, m, fail, ratio, None if ok else min_passing_tolerance(m, rule, derived))


def min_passing_tolerance(metrics: dict, rule: Rule, derived: DerivedTolerance | None = None) -> dict:
    """The loosest-needed settings that would have passed: atol at the rule's rtol, NMSE, max ULP,
    and with `derived` the baseline multiplier (at the same floors). `atol_exact` is False when the
    metrics came without the elementwise pass and max_abs stands in (an upper bound if rtol > 0)."""
    exact = "atol_needed" in metrics and metrics.get("rtol") == rule.rtol
    out = {"atol": metrics["atol_needed"] if exact else metrics["max_abs"], "rtol": rule.rtol,
           "atol_exact": exact or rule.rtol == 0, "nmse": metrics["nmse"],
           "max_ulp": metrics["max_ulp"]}
    if derived is not None:
        need = [0.0]
        for value, floor, base in ((out["atol"], derived.abs_floor, derived.baseline_max_abs),
                                   (out["nmse"], derived.nmse_floor, derived.baseline_nmse)):
            excess = value - floor
            if excess > 0:
                need.append(excess / base if base > 0 else math.inf)
        out["multiplier"] = max(need)
    return out


def judges_nothing(golden: np.ndarray, rule: Rule, dtype: str = "float32") -> str | None:
    """Why `rule` would pass an all-zero output against `golden`, or None. Such a tolerance is as wide as
    the signal: the check it makes cannot fail on any output of the right scale, so the judge reports it
    as skipped (counted in coverage), never as a pass. Exact rules, integer taps and all-zero goldens
    (where zero is the right answer) always judge."""
    g = np.asarray(golden)
    if rule.mode == "exact" or g.dtype.kind in "iu" or g.size == 0:
        return None
    big = float(np.max(np.abs(g.astype(np.float64))))
    if not (big > 0 and math.isfinite(big)) or not check_tap(g, np.zeros_like(g), rule, dtype).passed:
        return None
    nmse = "none" if rule.nmse is None else f"{rule.nmse:.3g}"
    return (f"not judged: its tolerance (atol {rule.atol:.3g}, NMSE {nmse}) would pass an all-zero output "
            f"(max |golden| {big:.3g}), so it judges nothing here")
