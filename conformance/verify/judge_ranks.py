"""Judging a sharded run rank by rank: the rank dumps of a folder (`kdtr verify BUNDLE --dump-dir DIR`,
files rank0.kdtr .. rank{W-1}.kdtr; docs/run-dump.md §7), or those kdtr's own sharded engine just wrote.

Each rank's view of the run is judged by conformance/judge.py, the judge of every other run: the view
holds the rank's own copy of every replicated record and the whole of every split record, its shards put
back in rank order (conformance/shard_plan.py, `reassemble`). Ranks whose replicated copies are the same
bits share one judgement. The views' checks merge by name, the worst status winning, and a failing check
names its ranks:

- a replicated record: the ranks whose copy fails. When other ranks' copies pass, those ranks diverge
  from the others (every rank computes, or receives by a collective, the same record), and the check's
  message says so;
- a split record: the ranks whose shard holds an element over the elementwise bound (for a failure of
  the aggregate gate alone, the ranks whose shard's share of the squared error is over the NMSE bound).

The first divergence is the earliest over the views, in execution order, with its ranks.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from conformance.tolerance import manifest_rule
from conformance.verify.context import Run
from conformance.verify.judge import judge
from conformance.verify.outputs import InvalidOutputs
from conformance.precision import profile_taps
from conformance.records import BundleSchemaError, numeric_keys, read_dump
from conformance.shard_plan import check_metadata, ranks_holding, reassemble
from conformance.tolerance import resolve_rule
from kdtr_format import open_kdtr
from refmodel.config import ModelConfig

_RANK_FILE = re.compile(r"rank(\d+)\.kdtr")
_WORST = {"error": 3, "fail": 2, "skip": 1, "pass": 0}


def read_dump_dir(folder: str) -> tuple[list[dict], list[dict], str, str | None]:
    """(outputs per rank, `shard` metadata per rank, dtype, routing) of the rank dumps in `folder`.
    Raises BundleSchemaError (an invalid file, exit 5) naming what is wrong."""
    d = Path(folder)
    if not d.is_dir():
        raise BundleSchemaError(f"--dump-dir {folder}: not a folder")
    ranks = sorted(int(m.group(1)) for p in d.iterdir() if (m := _RANK_FILE.fullmatch(p.name)))
    if not ranks or ranks != list(range(len(ranks))):
        raise BundleSchemaError(f"--dump-dir {folder}: holds rank dumps {['rank%d.kdtr' % r for r in ranks]}; a "
                                f"sharded run writes rank0.kdtr .. rank{{W-1}}.kdtr, one per rank "
                                f"(docs/run-dump.md §7)")
    outs, metas, dtypes, routings = [], [], set(), set()
    for r in ranks:
        path = d / f"rank{r}.kdtr"
        out, dtype = read_dump(str(path))
        with open_kdtr(str(path)) as f:
            meta = f.metadata
        if "shard" not in meta:
            raise BundleSchemaError(f"{path}: metadata has no `shard` (rank, world_size, records): not a rank dump "
                                    f"(docs/run-dump.md §7)")
        outs.append(out)
        metas.append(meta["shard"])
        dtypes.add(dtype)
        routings.add(meta.get("routing"))
    if len(dtypes) > 1 or len(routings) > 1:
        raise BundleSchemaError(f"--dump-dir {folder}: the ranks disagree on metadata dtype {sorted(dtypes)} or "
                                f"routing {sorted(map(str, routings))}; one run has one of each")
    return outs, metas, dtypes.pop(), routings.pop()


def judge_ranks(f, outs: list[dict], metas: list[dict], overrides=(), dtype: str = "float32",
                profile: str = "fp32"):
    """(checks, first divergence, summary) of a sharded run. Raises InvalidOutputs (each problem naming
    its rank or record) when the rank dumps do not fit the bundle or each other."""
    problems = check_metadata(metas)
    if problems:
        raise InvalidOutputs(problems)
    views, spans, problems = reassemble(f, outs, metas)
    if problems:
        raise InvalidOutputs(problems)
    groups: list[tuple[list[int], dict]] = []                            # ranks whose views are the same bits
    for r, v in enumerate(views):
        same = next((g for g in groups if _same(g[1], v)), None)
        if same is None:
            groups.append(([r], v))
        else:
            same[0].append(r)
    judged, run = [], Run.of(f, profile, overrides, dtype)
    for ranks, view in groups:
        try:
            judged.append((ranks, *judge(run, view)))
        except InvalidOutputs as e:
            raise InvalidOutputs([f"rank(s) {ranks}: {p}" for p in e.problems]) from None
    man = profile_taps(f.metadata, profile)
    checks = _merge(f, judged, spans, views[0], man, overrides)
    first = _first(f, judged, checks)
    summary = {"world_size": len(outs), "tp": metas[0].get("tp"), "ep": metas[0].get("ep"),
               "replicated_copies": ("the same bits on every rank" if len(groups) == 1 else
                                     f"{len(groups)} distinct sets: ranks {[g[0] for g in groups]}")}
    return checks, first, summary


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] or np.array_equal(a[k], b[k]) for k in a)


def _merge(f, judged, spans: dict, view: dict, man: dict, overrides) -> list:
    """One check per name over the views; `view`: any rank's view (split records are whole in each)."""
    by_name: dict[str, list] = {}
    for ranks, checks, _ in judged:
        for c in checks:
            by_name.setdefault(c.name, []).append((ranks, c))
    merged = []
    for name, seen in by_name.items():
        worst = max(seen, key=lambda rc: _WORST[rc[1].status])[1]
        if worst.status not in ("fail", "error"):
            merged.append(worst)
            continue
        bad = sorted(r for ranks, c in seen if c.status == worst.status for r in ranks)
        good = sorted(r for ranks, c in seen if c.status == "pass" for r in ranks)
        if name in spans:
            bad = _split_ranks(f, name, view[name], spans[name], man, overrides) or bad
            note = f"rank(s) {bad}: their shard(s) hold the values over the bound"
        elif good:
            note = (f"rank(s) {bad} diverge from rank(s) {good}: a replicated record, the same on every rank in a "
                    f"correct run")
        else:
            note = f"rank(s) {bad}"
        worst.metrics["ranks"] = bad
        worst.message = f"{note}; {worst.message}" if worst.message else note
        merged.append(worst)
    return merged


def _split_ranks(f, name: str, actual, span, man: dict, overrides) -> list[int]:
    """The ranks whose shard of split record `name` holds an element over the elementwise bound, else
    whose shard's squared error is over the NMSE bound of its share of the golden's energy."""
    layout, axis = span
    key = name.split("/", 1)[1]
    g = np.asarray(f["golden/" + name], np.float64)
    a = np.asarray(actual, np.float64)
    rule = resolve_rule(name, manifest_rule(man.get(key)), overrides)
    over = ~(np.abs(a - g) <= rule.atol + rule.rtol * np.abs(g))
    ranks = ranks_holding(over, layout, axis) if rule.mode != "aggregate" else []
    if ranks or rule.nmse is None:
        return ranks
    err, ref = np.moveaxis((a - g) ** 2, axis, 0), np.moveaxis(g ** 2, axis, 0)
    return [r for r, (lo, hi) in enumerate(layout)
            if hi > lo and err[lo:hi].sum() > rule.nmse * max(float(ref[lo:hi].sum()), np.finfo(float).tiny)]


def _first(f, judged, checks):
    """The earliest first divergence over the views (execution order), naming its ranks."""
    cfg = ModelConfig.from_dict(f.metadata["model_config"])
    keys = numeric_keys(cfg, set(f.metadata["taps"]["ar"]))
    firsts = [d for _, _, d in judged if d is not None]
    if not firsts:
        return None

    def when(d):
        prompt, key = d.name.split("/", 1)
        late = 0 if d.phase == "prefill" else 1
        return (int(prompt[1:]), late, (d.step or 0) if late else 0, int(late and d.tap == "logits"), keys.index(key))

    first = min(firsts, key=when)
    c = next(c for c in checks if c.name == first.name)
    first.ranks = c.metrics.get("ranks")
    return first
