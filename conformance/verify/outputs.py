"""An engine's outputs under run-dump names (docs/run-dump.md §2): which records are required, and the
checks that every record present has the documented dtype, shape and values consistent with the bundle.

A live engine's outputs (conformance/verify/collect.py) and a run dump (conformance/records.py, read_dump) go
through the same `validate_outputs`; any problem makes the run unjudgeable: an invalid file for a dump
(exit 5), an engine error for a live engine (exit 6), the message naming the record. The judge
(conformance/verify/judge.py) only ever sees outputs that passed, so it never meets a missing required record.

Storage dtypes: integer records are int64; float records are stored in the engine's compute dtype
(float32; bfloat16 as raw uint16 bit patterns; float16), except that `router_scores` may also be float32
in any engine: routers compute in float32, and rounding their scores to bfloat16 would hide the values
the engine chose its experts by (a near-tie flip is granted only when those values explain it,
conformance/verify/near_ties.py). `widened` turns the float records into float32 (exact) for the judge, which
measures ULPs in the compute dtype.

Legend: P prompt length, n golden tokens, V vocab, E routed experts, R rounds, T tree rows.
"""
from __future__ import annotations

import numpy as np

from conformance.records import LIVE_BUDGET, numeric_keys, prompts_of
from kdtr_format import bf16_to_float32
from refmodel.config import ModelConfig

# The records every run reports for every prompt (names relative to p{i}/). Everything else is optional:
# the taps (one not reported is a skipped check, counted in the verdict's coverage) and OWN_TREES.
REQUIRED = ("prefill/logits", "ar/logits", "ar/tokens", "ddtree/tokens", "ddtree/verify_argmax",
            "ddtree/accepted", "ddtree/accepted_offsets", "ddtree/round_bonus", "ddtree/counters",
            "ddtree/path_logits")
# An engine that drafts with its own drafter reports its trees; both or neither.
OWN_TREES = ("ddtree/tree_tokens", "ddtree/tree_parents")
# The optional live DDTree group (an engine's own loop, `ddtree_generate` in conformance/engines/protocol.py):
# all of these or none, under p{i}/ddtree_live/.
LIVE = "ddtree_live"
LIVE_RECORDS = ("tokens", "tree_tokens", "tree_parents", "verify_argmax", "accepted", "accepted_offsets",
                "round_bonus", "counters", "path_logits")
# Optional in the live group: LIVE_BUDGET (conformance/records.py), the engine's budget per round, so a
# round's tree may be the first round_budget nodes of the golden tree (judge_live.py).


def has_live(out: dict, i: int) -> bool:
    """Whether the outputs hold prompt i's live DDTree group (any of its records)."""
    p = f"p{i}/{LIVE}/"
    return any(k.startswith(p) for k in out)


class InvalidOutputs(ValueError):
    """Outputs that break docs/run-dump.md §2; `problems` lists every one, each naming its record."""

    def __init__(self, problems: list[str]):
        super().__init__(f"{len(problems)} problem(s), first: {problems[0]} (docs/run-dump.md)")
        self.problems = problems


def storage_name(a: np.ndarray, dtype: str) -> str:
    """The dtype a record is stored in, by run-dump name: uint16 is bfloat16 only for a bfloat16 engine."""
    if a.dtype == np.uint16 and dtype == "bfloat16":
        return "bfloat16"
    return a.dtype.name


def validate_outputs(f, out: dict, dtype: str, cfg: ModelConfig) -> list[str]:
    """Every problem of outputs `out` against the open bundle `f` (model config `cfg`, as the run resolved
    it), one line each naming the record; empty when the judge can proceed."""
    problems: list[str] = []
    for i in prompts_of(f):
        problems += _prompt_problems(f, i, out, dtype, cfg)
    return problems


def widened(out: dict, dtype: str) -> dict:
    """The outputs with float records as float32 (bfloat16 bits and float16 widen exactly)."""
    wide = {}
    for k, v in out.items():
        a = np.asarray(v)
        if dtype == "bfloat16" and a.dtype == np.uint16:
            a = bf16_to_float32(a)
        elif a.dtype == np.float16:
            a = a.astype(np.float32)
        wide[k] = a
    return wide


class _Checker:
    """One prompt's records: `get` returns a record with the expected dtype and shape, or None after
    noting the problem (so later checks that need it are skipped, never judged on garbage)."""

    def __init__(self, out: dict, prefix: str, dtype: str):
        self.out, self.p, self.dtype, self.problems = out, prefix, dtype, []

    def bad(self, name: str, msg: str) -> None:
        self.problems.append(f"{self.p}{name} {msg}")

    def get(self, name: str, kind: str, shape: tuple):
        """`kind` "int" (int64), "float" (the compute dtype) or "router" (the compute dtype or float32);
        `shape` entries None = any length. A name
        not reported is a problem: callers ask only for required records, or optional ones present."""
        if self.p + name not in self.out:
            self.bad(name, "is missing (required)")
            return None
        a = np.asarray(self.out[self.p + name])
        want = "int64" if kind == "int" else self.dtype
        got = storage_name(a, self.dtype)
        if kind == "router" and got == "float32":                        # routers compute in float32
            want = got
        dims = ", ".join("*" if s is None else str(s) for s in shape)
        if got != want or a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape)):
            self.bad(name, f"is {got}{list(a.shape)}, expected {want}[{dims}]")
            return None
        return a

    def in_range(self, name: str, a, lo: int, hi: int, what: str) -> None:
        """Note the first value of `a` (a record that passed `get`, or None) outside [lo, hi)."""
        if a is None or a.size == 0:
            return
        bad = np.argwhere((a < lo) | (a >= hi))
        if len(bad):
            at = tuple(int(x) for x in bad[0])
            self.bad(name, f"holds {int(a[at])} at {list(at)}: {what} must be in [{lo}, {hi})")


def _prompt_problems(f, i: int, out: dict, dtype: str, cfg: ModelConfig) -> list[str]:
    g = f"golden/p{i}/"
    P, n, V = len(f[g + "prompt_ids"]), len(f[g + "ar/tokens"]), cfg.vocab_size
    c = _Checker(out, f"p{i}/", dtype)
    c.get("prefill/logits", "float", (P, V))
    logits = c.get("ar/logits", "float", (n, V))
    toks = c.get("ar/tokens", "int", (n,))
    c.in_range("ar/tokens", toks, 0, V, "token ids")
    _argmax_problems(c, toks, logits)
    c.in_range("ddtree/tokens", c.get("ddtree/tokens", "int", (None,)), 0, V, "token ids")
    toks = out.get(c.p + "ddtree/tokens")
    if toks is not None and np.ndim(toks) == 1 and len(toks) > n:
        c.bad("ddtree/tokens", f"has {len(toks)} tokens: the stream is cut to the first n = {n}")
    _tap_problems(f, g, c, cfg)
    _ddtree_problems(f, g, c, n, V)
    if has_live(out, i):                 # the live group is whole: tokens exactly n, its own trees
        c.in_range(f"{LIVE}/tokens", c.get(f"{LIVE}/tokens", "int", (n,)), 0, V, "token ids")
        for name in LIVE_RECORDS:
            if c.p + f"{LIVE}/{name}" not in out:
                c.bad(f"{LIVE}/{name}", f"is missing: the {LIVE} group holds all of {', '.join(LIVE_RECORDS)}")
        _ddtree_problems(f, g, c, n, V, LIVE)
        if c.p + f"{LIVE}/{LIVE_BUDGET}" in out:
            _budget_problems(f, c)
    return c.problems


def _budget_problems(f, c: _Checker) -> None:
    """The live group's optional per-round budgets: int [R], each in 0 .. the bundle's budget, each round's
    tree within its budget."""
    q = f"{LIVE}/{LIVE_BUDGET}"
    b = c.get(q, "int", (None,))
    o, par = c.out.get(c.p + f"{LIVE}/accepted_offsets"), c.out.get(c.p + f"{LIVE}/tree_parents")
    if b is None or o is None or par is None:
        return
    top = int(f.metadata["ddtree"]["budget"])
    nodes = np.diff(np.append(np.nonzero(np.asarray(par) == -1)[0], len(par))) - 1
    if len(b) != len(o) - 1:
        c.bad(q, f"has {len(b)} rounds, accepted_offsets {len(o) - 1}")
    elif np.any(b < 0) or np.any(b > top):
        c.bad(q, f"budgets must lie in 0 .. {top} (the bundle's budget); got {b[:8].tolist()}"
                 f"{'...' if len(b) > 8 else ''}")
    elif len(nodes) == len(b) and np.any(nodes > b):
        r = int(np.nonzero(nodes > b)[0][0])
        c.bad(q, f"round {r}: its tree has {int(nodes[r])} nodes, over its budget {int(b[r])}")


def _argmax_problems(c: _Checker, toks, logits) -> None:
    """`ar/tokens` is the argmax of each `ar/logits` row (lowest id on an exact tie, docs/run-dump.md):
    a token its own logits do not choose is no greedy decision, and the judge's near-ties rely on it."""
    if toks is None or logits is None:
        return
    rows = np.asarray(widened({"x": logits}, c.dtype)["x"], np.float64)     # [n, V]
    own = np.argmax(rows, axis=-1)                                          # [n]
    bad = np.nonzero(own != toks)[0]
    if bad.size:
        s = int(bad[0])
        c.bad("ar/tokens", f"holds {int(toks[s])} at step {s}, but the argmax of ar/logits row {s} is "
                           f"{int(own[s])}: each token is its own logits row's argmax ({bad.size} steps differ)")


def _distinct_problems(c: _Checker, key: str, ids) -> None:
    """A row of `topk_ids` names K distinct experts: a repeated id is no top-K choice."""
    if ids is None or ids.size == 0:
        return
    srt = np.sort(ids.reshape(-1, ids.shape[-1]), axis=-1)                  # [rows, K]
    rep = np.argwhere(np.diff(srt, axis=-1) == 0)
    if len(rep):
        r, k = (int(x) for x in rep[0])
        c.bad(key, f"row {r} names expert {int(srt[r, k])} twice ({ids.reshape(-1, ids.shape[-1])[r].tolist()}): "
                   f"a top-K row holds K distinct expert ids")


def _tap_problems(f, g: str, c: _Checker, cfg: ModelConfig) -> None:
    """Optional taps: when present, the golden's shape, int64 topk_ids in [0, E), floats otherwise."""
    for key in numeric_keys(cfg, set(f.metadata["taps"]["ar"])):
        if key in REQUIRED or g + key not in f or c.p + key not in c.out:
            continue
        shape = tuple(f.info(g + key).shape)
        if key.endswith("/topk_ids"):
            ids = c.get(key, "int", shape)
            c.in_range(key, ids, 0, cfg.n_routed_experts, "expert ids")
            _distinct_problems(c, key, ids)
        else:
            c.get(key, "router" if key.endswith("/router_scores") else "float", shape)


def _ddtree_problems(f, g: str, c: _Checker, n: int, V: int, group: str = "ddtree") -> None:
    """The per-round records of `group` (the replay's "ddtree" or the live LIVE): offsets that partition
    `accepted`, one bonus per round, a verified row per tree row, paths that start at the root and stay
    inside their tree, counters[1] = rounds."""
    q = group + "/"
    o = c.get(q + "accepted_offsets", "int", (None,))
    acc = c.get(q + "accepted", "int", (None,))
    post = c.get(q + "verify_argmax", "int", (None,))
    bonus = c.get(q + "round_bonus", "int", (None,))
    counters = c.get(q + "counters", "int", (2,))
    path = c.get(q + "path_logits", "float", (None, V))
    c.in_range(q + "verify_argmax", post, 0, V, "token ids")
    c.in_range(q + "round_bonus", bonus, 0, V, "token ids")
    if o is None or acc is None:
        return
    if len(o) < 1 or o[0] != 0 or np.any(np.diff(o) < 1) or o[-1] != len(acc):
        c.bad(q + "accepted_offsets", f"must start at 0, increase (a round accepts at least its root) and "
                                      f"end at len(accepted) = {len(acc)}; got {o[:8].tolist()}...")
        return
    R = len(o) - 1
    if bonus is not None and len(bonus) != R:
        c.bad(q + "round_bonus", f"has {len(bonus)} rounds, accepted_offsets {R}")
    if counters is not None and int(counters[1]) != R:
        c.bad(q + "counters", f"[1] (rounds) is {int(counters[1])}, accepted_offsets has {R} rounds")
    if path is not None and not min(o[-1], n - 1) <= len(path) <= o[-1]:
        c.bad(q + "path_logits", f"has {len(path)} rows, expected one per accepted row ({int(o[-1])}; "
                                 f"at least the {min(int(o[-1]), n - 1)} that have a golden)")
    trees = _tree_problems(f, g, c, R, V, group)
    if trees is None:
        return
    if post is not None and len(post) != trees[-1]:
        c.bad(q + "verify_argmax", f"has {len(post)} rows, the {R} trees verified have {int(trees[-1])}")
    for r in range(R):
        a, size = acc[o[r]:o[r + 1]], int(trees[r + 1] - trees[r])
        if a[0] != 0 or np.any(np.diff(a) < 1) or a[-1] >= size:
            c.bad(q + "accepted", f"round {r}: {a.tolist()} is not a root-first path of increasing node "
                                  f"indices inside its tree of {size} rows")
            return


def tree_offsets(f, g: str, out: dict, p: str, R: int, group: str = "ddtree") -> np.ndarray:
    """[R + 1] row offsets of the R trees the engine verified in `group` (outputs that passed validation):
    its own trees' root rows when it reports them (always in LIVE), else the bundle's golden trees."""
    if p + group + "/tree_parents" in out:
        par = np.asarray(out[p + group + "/tree_parents"])
        return np.append(np.nonzero(par == -1)[0], len(par)).astype(np.int64)
    return np.asarray(f[g + "ddtree/tree_offsets"])[:R + 1]


def _tree_problems(f, g: str, c: _Checker, R: int, V: int, group: str = "ddtree") -> np.ndarray | None:
    """The verified trees' offsets, or None after noting why they cannot be trusted: more rounds than
    golden trees with no own trees, one of the own-tree records alone, or own trees that are not R trees."""
    own_trees = tuple(group + k[len("ddtree"):] for k in OWN_TREES)     # ddtree/... -> group/...
    present = [k for k in own_trees if c.p + k in c.out]
    if not present and group == LIVE:
        return None                                                      # noted missing by the caller
    if not present:
        golden = len(f[g + "ddtree/tree_offsets"]) - 1
        if R > golden:
            c.bad("ddtree/accepted_offsets", f"has {R} rounds but the bundle has {golden} trees (an engine "
                                             f"with its own drafter reports {' and '.join(OWN_TREES)})")
            return None
        return tree_offsets(f, g, c.out, c.p, R)
    if len(present) == 1:
        other = own_trees[1 - own_trees.index(present[0])]
        c.bad(present[0], f"is reported without {other}: an engine with its own drafter reports both")
        return None
    tok = c.get(own_trees[0], "int", (None,))
    par = c.get(own_trees[1], "int", (None if tok is None else len(tok),))
    if tok is None or par is None:
        return None
    own = tree_offsets(f, g, c.out, c.p, R, group)
    if len(own) != R + 1 or own[0] != 0:                                 # rows before a root: orphans
        c.bad(own_trees[1], f"has {len(own) - 1} root rows (parent -1); expected {R}, one per round, "
                            f"the first at row 0")
        return None
    for r in range(R):
        t, q = tok[own[r]:own[r + 1]], par[own[r]:own[r + 1]]
        if t[0] != -1 or np.any((t[1:] < 0) | (t[1:] >= V)):
            c.bad(own_trees[0], f"round {r}: {t[:8].tolist()}...: the root row holds -1, node rows token "
                                f"ids in [0, {V})")
            return None
        if np.any((q[1:] < 0) | (q[1:] >= np.arange(1, len(q)))):
            c.bad(own_trees[1], f"round {r}: {q[:8].tolist()}...: node k's parent must be in [0, k)")
            return None
    return own
