"""What one judging run resolves once (`Run`), and what the checks of one prompt share (`Prompt`).

A `Run` is made once per `kdtr verify` of a bundle, by the runner (or a test), before anything is
judged: the open bundle, its model config, the chosen precision profile with its per-tap manifest
entries and whether its derivation held routing, the tap keys in execution order, the rules-file
overrides and the engine's dtype. The judge, the localizer and held-routing collection read it; none of
them re-parses the bundle's config or profile.

A `Prompt` names one prompt's records (`golden/p{i}/...` in the bundle, `p{i}/...` in the outputs),
its length P and its near-tie token candidates (conformance/verify/near_ties.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conformance.precision import holds_routing, profile_taps
from conformance.records import numeric_keys
from conformance.tolerance import TapTolerance, judges_nothing, tap_tolerance
from conformance.verify.near_ties import token_near_ties
from refmodel.config import ModelConfig


@dataclass(frozen=True)
class Run:
    f: object                  # the open bundle (kdtr_format.open_kdtr)
    cfg: ModelConfig
    profile: str               # "fp32" or "bf16" (conformance/precision.py)
    man: dict                  # the profile's per-tap manifest entries
    keys: tuple                # the numeric tap keys, execution order (records.numeric_keys)
    overrides: tuple           # rules-file overrides (conformance/rules_file.py), first match wins
    dtype: str                 # the engine's (or the dump's) dtype
    holds_routing: bool        # the profile's derivation held routing to the golden expert sets

    @classmethod
    def of(cls, f, profile: str = "fp32", overrides=(), dtype: str = "float32") -> Run:
        """Resolve everything once; ProfileError when the bundle lacks `profile`."""
        meta = f.metadata
        man, held = profile_taps(meta, profile), holds_routing(meta, profile)
        cfg = ModelConfig.from_dict(meta["model_config"])
        keys = tuple(numeric_keys(cfg, set(meta["taps"]["ar"])))
        return cls(f, cfg, profile, man, keys, tuple(overrides), dtype, held)

    def tolerance(self, name: str, key: str) -> TapTolerance:
        """Check `name`'s tolerance: manifest entry `key` of the profile, then the overrides."""
        return tap_tolerance(name, self.man.get(key), self.overrides)


@dataclass(frozen=True)
class Prompt:
    run: Run
    i: int
    near: np.ndarray           # [n] bool: golden AR steps whose decision a profile-noise flip may change

    @classmethod
    def of(cls, run: Run, i: int) -> Prompt:
        pr = cls(run, i, np.zeros(0, bool))
        margins = run.f[pr.g + "ar/margins"]
        return cls(run, i, token_near_ties(margins, run.man, pr.vacuous("ar/logits") is not None))

    @property
    def g(self) -> str:
        """The prompt's prefix in the bundle."""
        return f"golden/p{self.i}/"

    @property
    def p(self) -> str:
        """The prompt's prefix in the outputs (run-dump names)."""
        return f"p{self.i}/"

    @property
    def P(self) -> int:
        """Prompt length: the cache rows before the first decode step."""
        return len(self.run.f[self.g + "prompt_ids"])

    def has(self, key: str) -> bool:
        return self.g + key in self.run.f

    def golden(self, key: str):
        return self.run.f[self.g + key]

    def vacuous(self, key: str) -> str | None:
        """Why the rule for tap `key` would pass an all-zero output (tolerance.judges_nothing); None when
        it judges, or the bundle does not hold the tap."""
        if not self.has(key):
            return None
        rule = self.run.tolerance(self.p + key, key).rule
        return judges_nothing(np.asarray(self.golden(key)), rule, self.run.dtype)
