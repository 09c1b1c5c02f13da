"""Rules files: ordered glob -> rule, first match wins (`kdtr verify --rules FILE`).

A rules file (TOML or JSON) overrides the bundle's tolerances for engines of other precisions: each
entry names a glob over check names and either explicit `Rule` fields or a re-derivation (multiplier,
floors) from the tap's manifest baseline; conformance/tolerance.py `resolve_rule` applies them. Format
and examples: docs/conformance.md.
"""
from __future__ import annotations

import fnmatch
import math
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from conformance.tolerance import Rule
from kdtr_format.paths import open_regular

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


MAX_RULES_BYTES = 1 << 20               # a rules file is a few lines; more is a wrong path


def _check_value(at: str, key: str, v) -> None:
    """The type of one rules-file value, named in the message (values were JSON/TOML: anything)."""
    if key in ("match", "why", "mode"):
        ok, want = isinstance(v, str), "a string"
    elif key == "max_ulp":
        ok, want = type(v) is int and v >= 0, "an integer >= 0"
    else:
        ok = (type(v) is int and 0 <= v < 2**63) or (type(v) is float and (v >= 0 or math.isnan(v)))
        want = "a number >= 0"
    if not ok:
        shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:60] + "..."
        raise ValueError(f"{at}: {key!r} must be {want}, got {shown}")
    if key not in ("match", "why", "mode") and (not math.isfinite(v) or v == 0):   # JSON 1e999 is inf; 0 and -0.0
        why = ("NaN is no tolerance" if math.isnan(v) else "an infinite tolerance passes anything" if v else
               "a zero tolerance passes only bit-equal values")
        raise ValueError(f"{at}: {key!r} = {v}: {why}; {_FORMS}")


_FORMS = ('for bit-equal values write mode = "exact", to judge by the aggregate gates only mode = "aggregate", '
          'to drop a gate leave its key out (docs/conformance.md, section 4)')


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
        if e.get("mode", "elementwise") == "elementwise" and not set(e) & ({"atol", "rtol"} | _DERIVED):
            raise ValueError(f"{at}: no atol, rtol or derived key: its elementwise bound is 0; {_FORMS}")  # bit-equal only
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


