"""Steps kdtr performs for an engine: listed in the verdict under "done by kdtr, not judged", and the
checks that would judge them taken out of coverage.

A verdict counts only what the engine computed. Where kdtr itself performs a step of the model for an
engine, a check of that step passing says nothing about the engine, so it is reported as skipped ("done by
kdtr, not judged"), not counted as covered (conformance/report/coverage.py), and `--require-coverage full`
fails. A check of such a step that fails still fails: something the engine computed around it is wrong.

The steps (docs/conformance.md, "Done by kdtr, not judged"):

- `int4_decode`: kdtr decoded the INT4 linears before handing the weights to the engine (a `--engine torch`
  port without `kdtr_int4_packed = True`): the `mlp_out` taps of the layers that hold INT4 linears;
- `cache_compaction`: kdtr compacted the engine's KV cache after each DDTree verify (a torch port whose
  cache has no `compact(start, keep)` method): the DDTree replay's checks (`p{i}/ddtree/...`);
- `ddtree_loop`: kdtr ran the DDTree loop (drafter, trees, acceptance walk) for an engine without its own
  `ddtree_generate`, by replaying the golden trees: the live DDTree checks (`p{i}/ddtree_live/...`), which
  then have no records to judge and are not run.

An engine adapter says which steps kdtr performed for it in `done_by_kdtr`, {step: why}, after `load`
(conformance/engines/torch_engine.py); the DDTree loop is told from the engine itself. A run dump that
`kdtr verify --save-dump` wrote records them in its metadata `done_by_kdtr`, so judging it again gives the
live run's verdict.
"""
from __future__ import annotations

import re

from conformance.records import dump_done_by_kdtr
from conformance.report.verdict import CheckResult

STEPS = {
    "int4_decode": "INT4 decoding of the weights",
    "cache_compaction": "KV-cache compaction after each DDTree verify",
    "ddtree_loop": "the DDTree loop (drafter, trees, acceptance walk)",
}


def kdtr_steps(engine, f, dump: str | None = None) -> dict[str, str]:
    """{step: why} for a live `engine` loaded from bundle `f`; for a run dump (engine None), the steps its
    metadata `done_by_kdtr` records (a `kdtr verify --save-dump` of a live run writes them)."""
    if engine is None:
        return {k: v for k, v in dump_done_by_kdtr(dump).items() if k in STEPS} if dump else {}
    steps = {k: v for k, v in dict(getattr(engine, "done_by_kdtr", None) or {}).items() if k in STEPS}
    if "drafter_config" in f.metadata and not callable(getattr(engine, "ddtree_generate", None)):
        steps["ddtree_loop"] = ("the engine has no ddtree_generate, so kdtr replays the golden trees on its "
                                "forwards and its own drafter, trees and loop are not judged")
    return steps


def _int4_layers(f) -> set[int]:
    """The layers of bundle `f` that hold an INT4 linear (`<m>.qw`, docs/int4.md)."""
    found = (re.match(r"model\.layers\.(\d+)\.", n) for n in f.names if n.endswith(".qw"))
    return {int(m[1]) for m in found if m}


def affected(step: str, f):
    """A predicate on check names: the checks that would judge `step`."""
    if step == "int4_decode":
        layers = _int4_layers(f)
        pat = re.compile(r"^p\d+/(prefill|ar)/L(\d+)/mlp_out$")
        return lambda name: bool((m := pat.match(name)) and int(m[2]) in layers)
    group = {"cache_compaction": "ddtree", "ddtree_loop": "ddtree_live"}[step]
    return lambda name: re.match(rf"^p\d+/{group}/", name) is not None


def mark_not_judged(checks: list[CheckResult], steps: dict[str, str], f) -> list[dict]:
    """Passing checks of the steps kdtr performed become skipped with that reason (module docstring);
    returns the verdict's `done_by_kdtr` list: {"step", "what", "why", "checks"} per step."""
    out = []
    for step, why in steps.items():
        hit = affected(step, f)
        mine = [c for c in checks if hit(c.name)]
        for c in mine:
            if c.status == "pass":
                c.status = "skip"
                c.message = f"done by kdtr, not judged: {STEPS[step]}" + (f"; {c.message}" if c.message else "")
        out.append({"step": step, "what": STEPS[step], "why": why, "checks": len(mine)})
    return out
