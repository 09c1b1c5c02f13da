"""Precision profiles as a bundle carries them: their names, the profile an engine dtype gets, a bundle's
per-tap entries for one, and whether its derivation held routing. Read by the judge and the runner;
the bf16 profile itself is derived by `kdtr gen` (conformance/gen/bf16_profile.py, which says how).

The router gate and its correction bias stay float32 in a bf16 engine, as transformers keeps them
(`_keep_in_fp32_modules_strict`): `FP32_KEEP` names them for the bf16 reference and the torch engine.
"""
from __future__ import annotations

PROFILES = ("fp32", "bf16")
PROFILE_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
FP32_KEEP = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")   # router: float32 in bf16 engines


class ProfileError(ValueError):
    """A profile was asked for that the bundle does not carry (or that does not exist)."""


def holds_routing(meta: dict, profile: str) -> bool:
    """Whether `profile`'s reference run held routing to the golden expert sets, so that the runner holds a
    live engine's routing alike (conformance/collect.py) and its taps are measured under the conditions of
    the derivation: the bf16 profile always; the fp32 profile when the bundle's `tolerances.routing` is
    "held" (`kdtr gen --routing-near-ties held`: a bundle whose golden routing has near-ties; absent =
    "free", every routing decision decisive). The value is validated by records.check_schema."""
    if profile == "bf16":
        return True
    return profile == "fp32" and meta.get("tolerances", {}).get("routing", "free") == "held"


def profile_taps(meta: dict, profile: str) -> dict:
    """The per-tap manifest entries of `profile` from a bundle's metadata; a clear error when absent."""
    if profile not in PROFILES:
        raise ProfileError(f"unknown precision profile {profile!r}; choose one of {', '.join(PROFILES)}")
    tol = meta["tolerances"]
    if profile == "fp32":
        return tol["taps"]
    prof = tol.get("profiles", {}).get(profile)
    if prof is None:
        raise ProfileError(f"this bundle carries no {profile!r} precision profile (bundles made before "
                           f"profiles existed); regenerate it with the command in bundles/MANIFEST.md, or "
                           f"judge with --profile fp32 and a rules file")
    return prof["taps"]
