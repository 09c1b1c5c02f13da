"""Coverage: how many of the checks a bundle defines an engine's run actually made, per group.

"Defined" comes from the bundle alone (`defined_checks`), never from what ran: per prompt, one check per
golden tap record it holds (prefill and decode), the AR token stream, the five DDTree replay checks, and,
whenever the bundle carries a drafter (metadata `drafter_config`), the five checks of the engine's own live
DDTree loop. So a passing and a failing run of one bundle define the same number. A defined check "ran"
when the verdict holds it with status pass or fail; one that is skipped (a tap the engine did not report,
a tolerance that judges nothing, a step kdtr performed for the engine: conformance/verify/not_judged.py)
or absent (an engine error stopped the run, an engine without its own DDTree loop) did not.

`--require-coverage FRACTION` (or `full` = 1) turns a shortfall into a failed check of kind "coverage"
(exit code 7, below every other failure: what ran, passed; conformance/verify/judge.py, `coverage_check`).

Groups, by check name: prefill (p{i}/prefill/...), decode (p{i}/ar/... but the token stream), tokens
(p{i}/ar/tokens), ddtree (p{i}/ddtree/... and p{i}/ddtree_live/...). Integrity checks, engine errors, the
per-prompt summaries (p{i}/long_position) and the coverage check itself are outside coverage.
"""
from __future__ import annotations

from conformance.records import numeric_keys, prompts_of
from refmodel.config import ModelConfig

GROUPS = ("prefill", "decode", "tokens", "ddtree")
# The DDTree checks of one prompt (judge_ddtree.py, judge_live.py emit exactly these names).
REPLAY_CHECKS = ("tokens", "tokens_vs_own_ar", "rounds", "path_logits", "target_forwards")
LIVE_CHECKS = ("tokens", "tokens_vs_own_ar", "trees", "target_forwards", "path_logits")
_PHASE_GROUP = {"prefill": "prefill", "ar": "decode", "ddtree": "ddtree", "ddtree_live": "ddtree"}


def group_of(name: str) -> str | None:
    """The coverage group of a check name, None for checks outside coverage."""
    parts = name.split("/")
    if len(parts) < 3 or not parts[0].startswith("p") or not parts[0][1:].isdigit():
        return None
    if parts[1:] == ["ar", "tokens"]:
        return "tokens"
    return _PHASE_GROUP.get(parts[1])


def check_group(c) -> str | None:
    """The coverage group of a check (by its name), None for checks outside coverage."""
    return group_of(c.name)


def defined_checks(f) -> dict[str, list[str]]:
    """{group: the names of the checks the open bundle `f` defines}, from the bundle alone."""
    meta = f.metadata
    keys = numeric_keys(ModelConfig.from_dict(meta["model_config"]), set(meta["taps"]["ar"]))
    live = "drafter_config" in meta
    names: dict[str, list[str]] = {g: [] for g in GROUPS}
    for i in prompts_of(f):
        p = f"p{i}/"
        taps = [p + k for k in keys if f"golden/{p}{k}" in f]
        taps += [p + "ar/tokens"] + [p + "ddtree/" + c for c in REPLAY_CHECKS]
        taps += [p + "ddtree_live/" + c for c in LIVE_CHECKS] if live else []
        for n in taps:
            names[group_of(n)].append(n)
    return {g: v for g, v in names.items() if v}


def coverage(checks, defined: dict[str, list[str]] | None = None) -> dict:
    """{group: {"run": defined checks that ran, "defined": checks the bundle defines}}, plus "total".
    `defined` None (the bundle could not be read): {}."""
    if not defined:
        return {}
    ran = {c.name for c in checks if c.status in ("pass", "fail")}
    cov = {g: {"run": sum(n in ran for n in names), "defined": len(names)} for g, names in defined.items()}
    cov["total"] = {k: sum(d[k] for d in cov.values()) for k in ("run", "defined")}
    return cov


def coverage_text(cov: dict) -> str:
    """"prefill 170/180, decode 48/48, tokens 2/2, ddtree 10/10 (total 230/240, 95.8%)"."""
    if not cov:
        return "no checks defined (the bundle could not be read)"
    parts = [f"{g} {d['run']}/{d['defined']}" for g, d in cov.items() if g != "total"]
    t = cov["total"]
    return ", ".join(parts) + f" (total {t['run']}/{t['defined']}, {100 * t['run'] / t['defined']:.1f}%)"


def not_run(checks, defined: dict[str, list[str]] | None) -> list[str]:
    """The defined checks that did not run: skipped, or absent from the verdict."""
    ran = {c.name for c in checks if c.status in ("pass", "fail")}
    return [n for names in (defined or {}).values() for n in names if n not in ran]


def skipped(checks) -> list[str]:
    return [c.name for c in checks if c.status == "skip" and check_group(c)]


def skip_reasons(checks, limit: int) -> list[str]:
    """"name (its own message)" for the first `limit` skipped checks: a tap the engine did not report,
    a DDTree round past a near-tie and a tolerance that judges nothing are different gaps."""
    return [f"{c.name} ({c.message or 'skipped'})" for c in checks if c.status == "skip" and check_group(c)][:limit]
