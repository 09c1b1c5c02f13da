"""The conformance runner behind `kdtr verify`: one verdict over taps, token streams and DDTree.

Two ways in, one judge. A live engine (conformance.engine.Engine) is driven by `collect`, which writes
its outputs under the run-dump names of docs/run-dump.md; an external engine writes a `.kdtr` run dump
with the same names itself. `judge` compares either against the bundle's goldens:

1. numeric: every tap, in execution order (prefill L0..L{n-1}, final_hidden, logits; then the decode
   steps, teacher-forced with the golden tokens), with the bundle's derived tolerances or a rules file;
2. tokens: the engine's argmax at every golden step equals the golden token (exact); a mismatch reports
   the step, both tokens, the golden top-1/top-2 margin and the engine's logit error there;
3. ddtree: the engine's DDTree stream equals the golden stream and its own AR stream (100%), every
   round's verify argmax, accepted path and bonus equal the golden ones, target-forward counts equal.

The first numeric failure in execution order is the first divergence; with a live engine that can run
one layer alone, that layer is re-run on golden inputs to tell a local fault from inherited error.
"""
from __future__ import annotations

import os
import time

import numpy as np

from conformance.gen import SCHEMA as GEN_SCHEMA, offsets, ragged
from conformance.metrics import logits_metrics
from conformance.report import CheckResult, Divergence, make_verdict
from conformance.tolerance import DerivedTolerance, Rule, check_tap, resolve_rule
from kdtr_format import KdtrError, Tensor, open_kdtr, write_kdtr
from refmodel.config import ModelConfig
from refmodel.ddtree import Tree, compile_tree, visibility, walk
from refmodel.model import tap_names

BUNDLE_SCHEMA = GEN_SCHEMA


class BundleSchemaError(KdtrError):
    """A well-formed .kdtr file that is not a golden bundle of a schema this kdtr understands."""


# ---------------------------------------------------------------- bundle layout

def prompts_of(f) -> list[int]:
    return sorted(int(n.split("/")[1][1:]) for n in f.names if n.startswith("golden/p") and n.endswith("/prompt_ids"))


def check_schema(f, path: str) -> None:
    meta = f.metadata
    if meta.get("schema") is None and "config" in meta:
        raise BundleSchemaError(f"{path} is a model file (from `kdtr import`), not a golden bundle: make one "
                                f"from it with `kdtr gen --model {path} --out BUNDLE.kdtr`")
    if meta.get("schema") != BUNDLE_SCHEMA:
        raise BundleSchemaError(f"{path}: metadata schema is {meta.get('schema')!r}, expected {BUNDLE_SCHEMA!r}: "
                                f"not a golden bundle (or a newer one); regenerate it with the command in "
                                f"bundles/MANIFEST.md")
    for key in ("model_config", "tolerances", "taps", "ddtree"):
        if key not in meta:
            raise BundleSchemaError(f"{path}: metadata lacks {key!r}; regenerate the bundle with `kdtr gen`")
    if not prompts_of(f):
        raise BundleSchemaError(f"{path}: no golden/p{{i}}/prompt_ids tensor; regenerate the bundle with `kdtr gen`")


def numeric_keys(cfg: ModelConfig, ar_taps) -> list[str]:
    """Golden keys relative to golden/p{i}/, in execution order."""
    keys = [f"prefill/L{l}/{t}" for l in range(cfg.num_hidden_layers) for t in tap_names(cfg, l)]
    keys += ["prefill/final_hidden", "prefill/logits", "ar/logits"]
    keys += [f"ar/L{l}/{t}" for l in range(cfg.num_hidden_layers) for t in tap_names(cfg, l) if t in ar_taps]
    return keys


def golden_tree(f, p: str, r: int) -> Tree:
    """Round r's tree from the ragged golden records (row 0 = root)."""
    o = f[p + "ddtree/tree_offsets"]
    lo, hi = int(o[r]), int(o[r + 1])
    tokens = np.asarray(f[p + "ddtree/tree_tokens"][lo + 1:hi], np.int64)
    parents = np.asarray(f[p + "ddtree/tree_parents"][lo:hi], np.int64)
    depths = np.asarray(f[p + "ddtree/tree_depths"][lo + 1:hi], np.int64)
    child_maps = [{} for _ in range(len(tokens) + 1)]
    for i in range(1, len(tokens) + 1):
        child_maps[parents[i]][int(tokens[i - 1])] = i
    ranks = np.asarray(f[p + "ddtree/tree_ranks"][lo + 1:hi], np.int64)
    return Tree(tokens, depths, parents, child_maps, visibility(parents), ranks, np.zeros(len(tokens)))


# ---------------------------------------------------------------- driving a live engine

def collect(engine, f, progress=None) -> dict:
    """Drive `engine` through every golden prompt; returns outputs under run-dump names."""
    out, ps = {}, prompts_of(f)
    ar_taps = set(f.metadata["taps"]["ar"])
    for n, i in enumerate(ps):
        p = f"golden/p{i}/"
        prompt, tokens = np.asarray(f[p + "prompt_ids"]), np.asarray(f[p + "ar/tokens"])
        P = len(prompt)
        engine.reset()
        logits, taps = engine.prefill(prompt, np.arange(P))
        out.update({f"p{i}/prefill/{k}": np.asarray(v) for k, v in taps.items()})
        rows, steps = [np.asarray(logits)[-1]], {}
        for s, tok in enumerate(tokens[:-1]):                            # teacher forcing: golden tokens in
            lg, tp = engine.decode(int(tok), P + s)
            rows.append(np.asarray(lg)[-1])
            for k, v in tp.items():
                if k.split("/")[-1] in ar_taps and k.startswith("L"):
                    steps.setdefault(f"p{i}/ar/{k}", []).append(np.asarray(v)[0])
        out[f"p{i}/ar/logits"] = np.stack(rows)                          # [n, V]
        out[f"p{i}/ar/tokens"] = np.argmax(out[f"p{i}/ar/logits"], axis=-1).astype(np.int64)
        out.update({k: np.stack(v) for k, v in steps.items()})
        out.update(replay_ddtree(engine, f, i, prompt, len(tokens)))
        if progress:
            progress("engine", n + 1, len(ps), None)
    return out


def replay_ddtree(engine, f, i: int, prompt, n_tokens: int) -> dict:
    """Verify the golden trees with the engine: depth positions, ancestor-only mask, walk, compaction.
    The roots are the engine's own bonus tokens, so its DDTree stream is its own."""
    p = f"golden/p{i}/"
    engine.reset()
    P = len(prompt)
    logits, _ = engine.prefill(prompt, np.arange(P))
    emitted, start, forwards = [int(np.argmax(np.asarray(logits)[-1]))], P, 1
    argmaxes, accepted, acc_sizes, bonuses, path = [], [], [], [], []
    for r, golden_start in enumerate(np.asarray(f[p + "ddtree/round_start"])):
        if start != golden_start:
            break                                                        # already diverged: judged below
        tree = golden_tree(f, p, r)
        ids, positions, mask = compile_tree(tree, emitted[-1], start)
        lg, _ = engine.verify_tree(ids, positions, mask)
        forwards += 1
        post = np.argmax(np.asarray(lg), axis=-1)
        acc, bonus = walk(tree.child_maps, post)
        engine.compact(start, np.asarray(acc))
        emitted += [int(t) for t in ids[acc[1:]]] + [int(bonus)]
        start += len(acc)
        argmaxes.append(post)
        path.append(np.asarray(lg)[acc])                                 # the rows that were committed
        accepted.append(acc)
        acc_sizes.append(len(acc))
        bonuses.append(bonus)
    return {
        f"p{i}/ddtree/tokens": np.asarray(emitted[:n_tokens], np.int64),
        f"p{i}/ddtree/verify_argmax": ragged(argmaxes),
        f"p{i}/ddtree/accepted": ragged(accepted),
        f"p{i}/ddtree/accepted_offsets": offsets(acc_sizes),
        f"p{i}/ddtree/round_bonus": np.asarray(bonuses, np.int64),
        f"p{i}/ddtree/counters": np.array([forwards, len(bonuses)], np.int64),
        f"p{i}/ddtree/path_logits": np.concatenate(path) if path else np.zeros((0, np.asarray(logits).shape[-1])),
    }


# ---------------------------------------------------------------- judging outputs against goldens

def _manifest_rule(entry: dict | None):
    if entry and "baseline_max_abs" in entry:
        return DerivedTolerance.from_dict(entry)
    return Rule(mode="exact", source="manifest (exact tap)")


def canonical_routing(ids: np.ndarray, weights: np.ndarray | None):
    """Routing as per-row sets: ids sorted ascending, weights permuted alike. The order of the top-k
    is a tie rule, not arithmetic (docs/golden-bundles.md): engines may list the same experts otherwise."""
    order = np.argsort(ids, axis=-1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=-1)
    return ids, None if weights is None else np.take_along_axis(weights, order, axis=-1)


def _routing_views(f, g: str, key: str, out: dict, name: str):
    """(golden, actual) for a tap, with topk_ids/topk_weights in canonical per-row order."""
    golden, actual = f[g + key], out.get(name)
    tap = key.rsplit("/", 1)[-1]
    if tap not in ("topk_ids", "topk_weights") or actual is None or np.shape(actual) != golden.shape:
        return golden, actual                                            # a wrong shape fails as such
    ids_key, ids_name = key[: -len(tap)] + "topk_ids", name[: -len(tap)] + "topk_ids"
    if ids_name not in out or np.asarray(out[ids_name]).shape != f[g + ids_key].shape:
        return golden, actual
    gi, gv = canonical_routing(np.asarray(f[g + ids_key]), np.asarray(golden) if tap == "topk_weights" else None)
    ai, av = canonical_routing(np.asarray(out[ids_name]), np.asarray(actual) if tap == "topk_weights" else None)
    return (gi, ai) if tap == "topk_ids" else (gv, av)


REQUIRED = ("prefill/logits", "ar/logits")    # an engine may skip taps, never these


def judge(f, out: dict, overrides=(), dtype: str = "float32") -> tuple[list[CheckResult], Divergence | None]:
    """All checks for outputs `out` (run-dump names) against the open bundle `f`, and the first
    divergence in execution order (earliest prompt, then prefill, then the earliest decode step)."""
    meta = f.metadata
    cfg = ModelConfig.from_dict(meta["model_config"])
    man = meta["tolerances"]["taps"]
    keys = numeric_keys(cfg, set(meta["taps"]["ar"]))
    checks, first = [], None
    for i in prompts_of(f):
        g = f"golden/p{i}/"
        failed_here = []
        for order, key in enumerate(keys):
            name = f"p{i}/{key}"
            if g + key not in f:
                continue
            golden, actual = _routing_views(f, g, key, out, name)
            c, failed = _numeric_check(name, golden, actual, man.get(key), overrides, dtype)
            if actual is None and key in REQUIRED:
                c = CheckResult(name, "fail", "numeric", message="the engine did not report it (required)")
            checks.append(c)
            if failed:
                failed_here.append((_time_key(key, c, order, cfg), c))
        if failed_here and first is None:
            first = _divergence(min(failed_here, key=lambda t: t[0])[1], len(f[g + "prompt_ids"]))
        checks.append(_token_check(f, g, i, out))
        ar_ok = all(c.status == "pass" for c in checks if c.name == f"p{i}/ar/logits")
        checks += _ddtree_checks(f, g, i, out, overrides, dtype, ar_ok)
    return checks, first


def _time_key(key: str, c: CheckResult, order: int, cfg: ModelConfig) -> tuple:
    """When a failing check's first bad value was computed: prefill first (in tap order), then decode
    step s (layer taps of step s in order, then logits row s + 1, which step s produced)."""
    row = c.metrics.get("first_bad_row", 0) or 0
    if key.startswith("prefill/"):
        return (-2, 0, order)
    if key == "ar/logits":
        return (row - 1, 1, order)                                       # row 0 came from the prefill
    return (row, 0, order)


def validate_outputs(f, out: dict) -> list[str]:
    """Structural problems of an engine's outputs (run-dump names) that would make judging meaningless:
    required names, ranks, integer dtypes, consistent DDTree offsets. Empty when judging can proceed."""
    V = ModelConfig.from_dict(f.metadata["model_config"]).vocab_size
    problems = []

    def need(name, ndim, kind, rows=None):
        if name not in out:
            problems.append(f"{name} is missing (required)")
            return None
        a = np.asarray(out[name])
        if a.ndim != ndim or (kind == "int" and a.dtype.kind not in "iu") or (kind == "float" and a.dtype.kind != "f"):
            problems.append(f"{name} is {a.dtype}{list(a.shape)}, expected a {ndim}-D {kind} tensor")
            return None
        if ndim == 2 and a.shape[1] != V:
            problems.append(f"{name} has {a.shape[1]} columns, the vocabulary has {V}")
            return None
        if rows is not None and a.shape[0] != rows:
            problems.append(f"{name} has {a.shape[0]} rows, expected {rows}")
            return None
        return a

    for i in prompts_of(f):
        p, n = f"p{i}/", len(f[f"golden/p{i}/ar/tokens"])
        need(p + "prefill/logits", 2, "float", len(f[f"golden/p{i}/prompt_ids"]))
        need(p + "ar/logits", 2, "float", n)
        for name in ("ar/tokens", "ddtree/tokens", "ddtree/verify_argmax", "ddtree/round_bonus"):
            need(p + name, 1, "int")
        need(p + "ddtree/counters", 1, "int", 2)
        offsets, acc = need(p + "ddtree/accepted_offsets", 1, "int"), need(p + "ddtree/accepted", 1, "int")
        bonus, path = out.get(p + "ddtree/round_bonus"), need(p + "ddtree/path_logits", 2, "float")
        if offsets is None or acc is None:
            continue
        if len(offsets) < 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 1) or offsets[-1] != len(acc):
            problems.append(f"{p}ddtree/accepted_offsets must start at 0, increase, and end at len(accepted) "
                            f"= {len(acc)}; got {offsets[:8].tolist()}...")
        elif bonus is not None and len(bonus) != len(offsets) - 1:
            problems.append(f"{p}ddtree/round_bonus has {len(bonus)} rounds, accepted_offsets {len(offsets) - 1}")
        elif path is not None and not min(offsets[-1], n - 1) <= len(path) <= offsets[-1]:
            problems.append(f"{p}ddtree/path_logits has {len(path)} rows, expected one per accepted row "
                            f"({int(offsets[-1])}; at least the {min(int(offsets[-1]), n - 1)} that have a golden)")
    return problems


def _numeric_check(name, golden, actual, entry, overrides, dtype) -> tuple[CheckResult, bool]:
    if actual is None:
        return CheckResult(name, "skip", "numeric", message="the engine did not report this tap"), False
    derived = _manifest_rule(entry)
    rule = resolve_rule(name, derived, overrides)
    golden, actual = np.asarray(golden), np.asarray(actual)
    if golden.shape != actual.shape:
        return CheckResult(name, "fail", "numeric", tolerance=rule.to_dict(),
                           message=f"shape {actual.shape} but the golden is {golden.shape}"), True
    r = check_tap(golden, actual, rule, dtype, derived=derived if isinstance(derived, DerivedTolerance) else None)
    if not r.passed:
        r.metrics["first_bad_row"] = first_bad_row(golden, actual, rule)
    if name.endswith("/logits") and golden.ndim == 2:                   # distribution-level view, reported
        lm = logits_metrics(golden, actual)
        r.metrics.update({k: lm[k] for k in ("topk_overlap_min", "kl_max", "argmax_agreement")})
    return CheckResult(name, "pass" if r.passed else "fail", "numeric", r.metrics, rule.to_dict(),
                       "; ".join(r.failures), r.min_passing), not r.passed


def first_bad_row(golden: np.ndarray, actual: np.ndarray, rule: Rule) -> int:
    """The first row (token or step) with an element over the elementwise bound: where the error began,
    which the worst element need not be. Aggregate-only failures point at row 0."""
    g, a = np.asarray(golden), np.asarray(actual)
    if g.ndim == 0 or g.shape[0] == 0:
        return 0
    g64, a64 = g.astype(np.float64), a.astype(np.float64)
    if g.dtype.kind in "iu" or rule.mode == "exact":
        bad = g64 != a64
    else:
        bad = ~(np.abs(a64 - g64) <= rule.atol + rule.rtol * np.abs(g64))  # NaN counts as bad
    rows = np.nonzero(bad.reshape(g.shape[0], -1).any(axis=1))[0]
    if not rows.size and rule.nmse is not None:                          # an aggregate-only failure:
        err = ((a64 - g64) ** 2).reshape(g.shape[0], -1).sum(axis=1)     # the first row over the NMSE
        ref = (g64 ** 2).reshape(g.shape[0], -1).sum(axis=1)
        rows = np.nonzero(err > rule.nmse * np.maximum(ref, np.finfo(float).tiny))[0]
    return int(rows[0]) if rows.size else 0


def _divergence(c: CheckResult, P: int) -> Divergence:
    """Where a failed numeric check points: layer, tap, phase, step, token position, worst element."""
    parts = c.name.split("/")                                            # p{i}/{phase}/[L{l}/]{tap}
    phase, tap = parts[1], parts[-1]
    layer = int(parts[2][1:]) if len(parts) == 4 else None
    worst = c.metrics.get("worst_index") or c.metrics.get("first_mismatch")
    worst = tuple(int(x) for x in worst) if worst is not None else None
    row = c.metrics.get("first_bad_row", worst[0] if worst else None)
    if phase == "prefill":
        step, pos = None, row
    elif tap == "logits":                                   # ar/logits row r: made by decode step r-1 at P-1+r
        step, pos = None if row is None else row - 1, None if row is None else P - 1 + row
    else:                                                                # decode forward s at position P+s
        step, pos = row, None if row is None else P + row
    golden = c.metrics.get("golden_at_worst", c.metrics.get("golden_at_first"))
    actual = c.metrics.get("actual_at_worst", c.metrics.get("actual_at_first"))
    return Divergence(c.name, layer, tap, phase, step, pos, worst, golden, actual)


def _token_check(f, g: str, i: int, out: dict) -> CheckResult:
    name = f"p{i}/ar/tokens"
    gold, got = np.asarray(f[g + "ar/tokens"]), out.get(name)
    if got is None:
        return CheckResult(name, "fail", "tokens", message="the engine reported no AR tokens (required)")
    got = np.asarray(got)
    n = min(len(gold), len(got))
    bad = np.nonzero(gold[:n] != got[:n])[0]
    metrics = {"tokens": int(len(gold)), "matching_prefix": int(bad[0]) if bad.size else n}
    if not bad.size and len(got) == len(gold):
        return CheckResult(name, "pass", "tokens", metrics, {"exact": True})
    if not bad.size:
        return CheckResult(name, "fail", "tokens", metrics, {"exact": True},
                           f"{len(got)} tokens, the golden stream has {len(gold)}")
    s = int(bad[0])
    margin = float(f[g + "ar/margins"][s])
    msg = f"step {s}: golden token {int(gold[s])}, engine {int(got[s])}; golden top-1/top-2 margin {margin:.4g}"
    logits = out.get(f"p{i}/ar/logits")
    if logits is not None and len(logits) > s:
        err = float(np.max(np.abs(np.asarray(logits[s], np.float64) - np.asarray(f[g + "ar/logits"][s]))))
        metrics.update(step=s, golden_token=int(gold[s]), engine_token=int(got[s]), margin=margin,
                       logit_error=err)
        why = ("its logit error exceeds half the margin: a numeric fault big enough to flip a decisive token"
               if 2 * err >= margin else
               "its logit error is under half the margin, so noise cannot explain the flip: "
               "look at argmax / tie-breaking / the token fed back")
        msg += f", engine logit error there {err:.4g}: {why}"
    return CheckResult(name, "fail", "tokens", metrics, {"exact": True}, msg)


def _ddtree_checks(f, g: str, i: int, out: dict, overrides=(), dtype="float32", ar_ok=True) -> list[CheckResult]:
    p = f"p{i}/ddtree/"
    if p + "tokens" not in out:
        return [CheckResult(p + "tokens", "fail", "ddtree", message="the engine reported no DDTree run (required)")]
    checks = []
    mine, gold = np.asarray(out[p + "tokens"]), np.asarray(f[g + "ddtree/tokens"])
    n = min(len(gold), len(mine))
    bad = np.nonzero(gold[:n] != mine[:n])[0]
    ok = not bad.size and len(gold) == len(mine)
    msg = "" if ok else (f"differs from the golden DDTree stream at token {int(bad[0])}: expected "
                         f"{int(gold[bad[0]])}, got {int(mine[bad[0]])}" if bad.size else
                         f"{len(mine)} tokens, the golden DDTree stream has {len(gold)}")
    checks.append(CheckResult(p + "tokens", "pass" if ok else "fail", "ddtree", {"tokens": int(len(mine))},
                              {"exact": True}, msg))
    ar = out.get(f"p{i}/ar/tokens")
    if ar is not None:
        # The AR tokens are teacher-forced (context = the golden prefix), so DDTree token j is comparable
        # while the DDTree stream's own prefix [:j] is golden: up to and including its first deviation.
        ar = np.asarray(ar)
        k = min(len(ar), len(mine), int(bad[0]) + 1 if bad.size else n)
        diff = np.nonzero(ar[:k] != mine[:k])[0]
        msg = "" if not diff.size else (f"token {int(diff[0])}: DDTree emitted {int(mine[diff[0]])} where the "
                                        f"engine's own AR argmax is {int(ar[diff[0]])}")
        checks.append(CheckResult(p + "tokens_vs_own_ar", "fail" if diff.size else "pass", "ddtree",
                                  {"compared": int(k)}, {"exact": True}, msg))
    checks.append(_rounds_check(f, g, p, out))
    checks.append(_path_logits_check(f, g, p, out, overrides, dtype, "ddtree" if ar_ok else "numeric"))
    fw, gfw = out.get(p + "counters"), np.asarray(f[g + "ddtree/counters"])
    if fw is None:
        checks.append(CheckResult(p + "target_forwards", "fail", "ddtree", message="no ddtree/counters (required)"))
    else:
        ok = int(fw[0]) == int(gfw[0])
        checks.append(CheckResult(p + "target_forwards", "pass" if ok else "fail", "ddtree",
                                  {"engine": int(fw[0]), "golden": int(gfw[0])}, {"exact": True},
                                  "" if ok else f"{int(fw[0])} target forwards, golden {int(gfw[0])}"))
    return checks


def _path_logits_check(f, g: str, p: str, out: dict, overrides, dtype, kind: str) -> CheckResult:
    """The tree forward's logits on the committed rows, against the golden AR logits with the AR logits
    tolerance. Committed row j sits at position P + j and predicts token j + 1: in exact arithmetic it is
    AR row j + 1 (docs/ddtree.md §6). Argmax checks alone would let a tree-only numeric bug smaller
    than the token margins pass; this catches it. Compared while the engine's stream is golden. `kind`:
    "ddtree" when the AR logits passed (the tree path alone is off: a DDTree failure), else "numeric"
    (the same drift as the AR path, not a DDTree-specific fault)."""
    name = p + "path_logits"
    got = out.get(name)
    if got is None:
        return CheckResult(name, "fail", kind, message="no ddtree/path_logits (required)")
    gold_ar, mine, gold = f[g + "ar/logits"], np.asarray(out[p + "tokens"]), np.asarray(f[g + "ar/tokens"])
    n = min(len(mine), len(gold))
    bad = np.nonzero(mine[:n] != gold[:n])[0]
    k = min(len(got), len(gold_ar) - 1, int(bad[0]) if bad.size else n)
    derived = _manifest_rule(f.metadata["tolerances"]["taps"].get("ar/logits"))
    rule = resolve_rule(name, derived, overrides)
    r = check_tap(np.asarray(gold_ar[1:1 + k]), np.asarray(got[:k]), rule, dtype,
                  derived=derived if isinstance(derived, DerivedTolerance) else None)
    r.metrics["rows"] = k
    return CheckResult(name, "pass" if r.passed else "fail", kind, r.metrics, rule.to_dict(),
                       "; ".join(r.failures), r.min_passing)


def _rounds_check(f, g: str, p: str, out: dict) -> CheckResult:
    """Round by round: the accepted node path, the target's argmax on it and the bonus equal the golden
    ones. Off-path rows are reported, not judged: their argmax changes no output and, unlike every
    decision on the path (an AR decision, margin-checked by `kdtr gen`), has no margin guarantee."""
    go, ga = np.asarray(f[g + "ddtree/tree_offsets"]), np.asarray(f[g + "ddtree/accepted_offsets"])
    eo = out.get(p + "accepted_offsets")
    if eo is None:
        return CheckResult(p + "rounds", "fail", "ddtree", message="the engine reported no per-round records")
    eo, R, off_path = np.asarray(eo), len(go) - 1, 0
    fail = lambda r, msg: CheckResult(p + "rounds", "fail", "ddtree", {"rounds": R, "matching": r},  # noqa: E731
                                      {"exact": True}, f"round {r}: {msg}")
    for r in range(R):
        if r + 1 >= len(eo):
            return fail(r, f"the engine ran {len(eo) - 1} rounds, the golden run {R}")
        for key in ("tree_tokens", "tree_parents"):                      # an engine with its own drafter
            if p + key in out and len(out[p + key]) >= go[r + 1]:
                tg, te = np.asarray(f[g + "ddtree/" + key][go[r]:go[r + 1]]), np.asarray(out[p + key])[go[r]:go[r + 1]]
                if not np.array_equal(tg, te):
                    return fail(r, f"{key} {te.tolist()} but golden {tg.tolist()} (the drafter proposed another tree)")
        acc_g = np.asarray(f[g + "ddtree/accepted"][ga[r]:ga[r + 1]])
        acc_e = np.asarray(out[p + "accepted"])[eo[r]:eo[r + 1]]
        if not np.array_equal(acc_g, acc_e):
            return fail(r, f"accepted rows {acc_e.tolist()} but golden {acc_g.tolist()}")
        post_g = np.asarray(f[g + "ddtree/verify_argmax"][go[r]:go[r + 1]])
        post_e = np.asarray(out.get(p + "verify_argmax", np.zeros(0)))[go[r]:go[r + 1]]
        if len(post_e) == len(post_g):
            if not np.array_equal(post_g[acc_g], post_e[acc_g]):
                return fail(r, f"target argmax on the accepted path {post_e[acc_g].tolist()} but golden "
                               f"{post_g[acc_g].tolist()}")
            off_path += int(np.count_nonzero(post_g != post_e))
        if int(out[p + "round_bonus"][r]) != int(f[g + "ddtree/round_bonus"][r]):
            return fail(r, f"bonus {int(out[p + 'round_bonus'][r])}, golden {int(f[g + 'ddtree/round_bonus'][r])}")
    return CheckResult(p + "rounds", "pass", "ddtree", {"rounds": R, "off_path_argmax_differences": off_path},
                       {"exact": True})


# ---------------------------------------------------------------- localisation

def layer_inputs(f, div: Divergence) -> dict:
    """The golden inputs of the diverging layer: its input hidden, positions and cache rows before."""
    i = int(div.name.split("/")[0][1:])
    g, l = f"golden/p{i}/", div.layer
    prompt, tokens = np.asarray(f[g + "prompt_ids"]), np.asarray(f[g + "ar/tokens"])
    embed = f.get("model.embed_tokens.weight")
    if div.phase == "prefill":
        hidden = embed[prompt] if l == 0 else f[g + f"prefill/L{l - 1}/resid_out"]
        C, R = f[g + f"prefill/L{l}/kv_latent"].shape[1], f[g + f"prefill/L{l}/k_pe"].shape[1]
        return {"hidden": np.asarray(hidden), "positions": np.arange(len(prompt)),
                "c_kv": np.zeros((0, C), np.float32), "k_pe": np.zeros((0, R), np.float32)}
    s = div.step
    hidden = embed[tokens[s:s + 1]] if l == 0 else f[g + f"ar/L{l - 1}/resid_out"][s:s + 1]
    cat = lambda t: np.concatenate([f[g + f"prefill/L{l}/{t}"], f[g + f"ar/L{l}/{t}"][:s]])  # noqa: E731
    return {"hidden": np.asarray(hidden), "positions": np.array([len(prompt) + s]),
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
    derived = _manifest_rule(f.metadata["tolerances"]["taps"].get(div.name.split("/", 1)[1]))
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


# ---------------------------------------------------------------- the verdict

def verify(bundle: str, engine=None, dump: str | None = None, overrides=(), progress=None,
           save_dump: str | None = None):
    """Judge `engine` (live) or `dump` (a run dump) against `bundle`; returns a report.Verdict."""
    t0 = time.perf_counter()
    name = "dump" if dump else getattr(engine, "name", "engine")
    try:
        f = open_kdtr(bundle, verify=True)
        check_schema(f, bundle)
    except KdtrError as e:
        return make_verdict(name, bundle, [CheckResult("bundle/integrity", "error", "integrity", message=str(e))])
    with f:
        checks = [CheckResult("bundle/integrity", "pass", "integrity",
                              {"tensors": len(f.names), "checksums": "verified"})]
        dtype = "float32"
        try:
            out, dtype = _outputs(f, engine, dump, progress)
        except KdtrError as e:
            checks.append(CheckResult("dump/integrity", "error", "integrity", message=f"{dump}: {e}"))
            return make_verdict(name, bundle, checks)
        except Exception as e:  # noqa: BLE001 - any failure inside the engine under test is its error
            checks.append(CheckResult("engine/run", "error", "numeric",
                                      message=f"{type(e).__name__}: {e}"))
            return make_verdict(name, bundle, checks)
        problems = validate_outputs(f, out)
        if problems:                                                     # a bad dump is a bad file (5);
            kind, label = ("integrity", "dump/structure") if dump else ("numeric", "engine/outputs")  # a bad engine, 6
            checks.append(CheckResult(label, "error", kind, {"problems": problems},
                                      message=f"{len(problems)} problem(s), first: {problems[0]} (docs/run-dump.md)"))
            return make_verdict(name, bundle, checks)
        if save_dump and dump is None:
            write_dump(out, save_dump, name, dtype, f.metadata.get("provenance", {}).get("command", ""))
        t1 = time.perf_counter()
        judged, first = judge(f, out, overrides, dtype)
        if first is not None and engine is not None and dump is None:
            try:
                full = next(c.metrics for c in judged if c.name == first.name)
                first = localize(engine, f, first, overrides, dtype, full)
            except Exception as e:  # noqa: BLE001 - localisation is best effort; the verdict stands
                first.cause = f"not localised: run_layer raised {type(e).__name__}: {e}"
        info = {"dtype": dtype, "engine_seconds": round(t1 - t0, 3),
                "judge_seconds": round(time.perf_counter() - t1, 3), "prompts": len(prompts_of(f)),
                "bundle_figures": f.metadata.get("figures", {})}
        return make_verdict(name, os.fspath(bundle), checks + judged, first, info)


def _outputs(f, engine, dump, progress) -> tuple[dict, str]:
    if dump is not None:
        with open_kdtr(dump, verify=True) as d:
            meta = d.metadata
            if meta.get("schema") == BUNDLE_SCHEMA:                      # a regenerated bundle: its goldens
                return bundle_as_outputs(d), "float32"
            if meta.get("schema") != DUMP_SCHEMA:
                raise BundleSchemaError(f"metadata schema is {meta.get('schema')!r}, expected {DUMP_SCHEMA!r} "
                                        f"(docs/run-dump.md)")
            dtype = meta.get("dtype", "float32")
            if dtype not in ("float32", "bfloat16", "float16"):
                raise BundleSchemaError(f"metadata dtype {dtype!r}: the engine's compute dtype must be float32, "
                                        f"bfloat16 or float16 (docs/run-dump.md)")
            return {n: np.array(d.get(n)) for n in d.names}, dtype
    engine.load(f)
    return collect(engine, f, progress), engine.dtype


DUMP_SCHEMA = "kdtr-run-dump/1"


def bundle_as_outputs(d) -> dict:
    """A bundle's goldens under run-dump names (to judge a regenerated bundle against a committed one).
    Its float64 tree forwards equal its AR forwards (to ~1e-10, tests/test_ddtree_verify.py), so the
    committed path rows are its AR logits rows 1.. (see _path_logits_check)."""
    out = {n[len("golden/"):]: np.array(d.get(n)) for n in d.names if n.startswith("golden/")}
    for i in prompts_of(d):
        p = f"p{i}/"
        rows = int(out[p + "ddtree/accepted_offsets"][-1])
        out[p + "ddtree/path_logits"] = out[p + "ar/logits"][1:1 + rows]
    return out


def write_dump(out: dict, path: str, engine_name: str, dtype: str, bundle_command: str = "") -> None:
    """A run dump (docs/run-dump.md) of a live engine's outputs: what an external engine writes."""

    meta = {"schema": DUMP_SCHEMA, "engine": engine_name, "dtype": dtype, "bundle_command": bundle_command}
    bf16 = lambda v: dtype == "bfloat16" and v.dtype == np.uint16  # noqa: E731 - raw bf16 bit patterns
    write_kdtr(path, ((k, Tensor(np.ascontiguousarray(v), dtype="bfloat16") if bf16(v) else np.ascontiguousarray(v))
                      for k, v in out.items()), meta)
