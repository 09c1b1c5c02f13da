"""When may an engine's own draft tree differ from the golden one? Decisiveness of the golden trees.

The builder (refmodel/ddtree.py, `build_ddtree`) pops prefixes best first by their score, the sum of the
per-depth drafter log-probabilities along the prefix. An engine whose drafter logits are off by at most
`delta` per element (the drafter tolerance below) moves every log-prob by at most 2 * delta (the logit
itself and the log-sum-exp, which is 1-Lipschitz in the max norm), so a score by at most 2 * delta per
depth. Where two trees first differ (row k), the golden builder popped prefix g and the engine popped e;
both share the golden rows before k. Their shared leading tokens carry the same error on both sides, so
the engine can have popped e first only if

    score(g) - score(e) <= 2 * delta * ((depth(g) - c) + (depth(e) - c)),   c = their common prefix length,

scores taken from the golden drafter logits. Within that bound the difference is a near-tie (allowed);
beyond it the golden choice was decisive and the difference is a fault.

What the bundle holds: the drafter's weights (bfloat16) and the golden trees, but neither the golden
drafter logits nor a drafter tolerance. Both are derived here from what is there: running the bundle's
drafter in float64 on the golden context reproduces the golden drafter logits (checked: the trees they
build must be the stored ones), and the same run in float32 gives the same-precision baseline from which
`delta` is derived exactly as every tap's tolerance (conformance/tolerance.py, `derive_tolerance`: the
worst prompt's max error times the multiplier 16, plus a floor of 4 float32 ULPs of the largest logit).
It runs only when some engine tree differs. The floor also covers the builder's own float32 rounding of
the log-probs (an ULP or two of values below the largest logit).

Legend: L draft depth, V vocab, R rounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conformance.records import position_offset, prompts_of
from conformance.tolerance import DerivedTolerance, derive_tolerance
from refmodel.ddtree import build_ddtree
from refmodel.drafter import DrafterCache, drafter_forward, read_drafter, target_features
from refmodel.model import forward, weights_dtype
from refmodel.stored import read_model


def replay_drafts(cfg, W: dict, dcfg, DW: dict, f, i: int) -> list[np.ndarray]:
    """The drafter logits [L, V] of every golden round of prompt i, computed in the dtype of W and DW.
    The drafter's context at a round is the target's features of the committed rows; in exact arithmetic
    a committed tree row is the AR row (docs/ddtree.md §6), so one causal forward over the prompt and the
    golden stream gives every round's context, cheaper than replaying the tree forwards. Row j sits at
    position pos0 + j (the prompt's position offset)."""
    p, pos0 = f"golden/p{i}/", position_offset(f, i)
    ids = np.concatenate([f[p + "prompt_ids"], f[p + "ddtree/tokens"]]).astype(np.int64)    # [P + n]
    _, hiddens = forward(cfg, W, ids, pos0 + np.arange(len(ids)))
    feats = target_features(dcfg, hiddens)                              # [P + n, F]
    cache, done, drafts = DrafterCache(dcfg, weights_dtype(W)), 0, []
    for start in np.asarray(f[p + "ddtree/round_start"]):
        block = [int(ids[start])] + [dcfg.mask_token_id] * (dcfg.block_size - 1)   # the round's root
        drafts.append(drafter_forward(dcfg, DW, W, block, feats[done:start], cache, int(start), pos0))
        done = int(start)
    return drafts


def log_probs(q: np.ndarray) -> np.ndarray:
    """[L, V] float32 log-softmax per depth, as the builder forms it (docs/ddtree.md §3)."""
    x = np.asarray(q, np.float32)                                        # [L, V]
    m = x.max(axis=-1, keepdims=True)                                    # [L, 1]
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True, dtype=np.float32)))


def path_of(tokens: np.ndarray, parents: np.ndarray, k: int) -> tuple:
    """The token prefix of row k of a tree laid out as the bundle's (row 0 = the root, token -1)."""
    path = []
    while k > 0:
        path.append(int(tokens[k]))
        k = int(parents[k])
    return tuple(reversed(path))


def score(lp: np.ndarray, path: tuple) -> float:
    return float(sum(float(lp[d, t]) for d, t in enumerate(path)))


@dataclass
class TreeDifference:
    row: int                 # the first row where the trees differ
    golden: tuple            # the golden prefix at that row (() when the golden tree has no such row)
    engine: tuple
    gap: float | None        # |score(golden) - score(engine)| under the golden logits
    bound: float | None      # what a drafter within the tolerance can move that gap by
    near_tie: bool
    why: str


def first_difference(gold_tok, gold_par, eng_tok, eng_par, lp: np.ndarray, delta: float) -> TreeDifference | None:
    """None when the trees are equal; else their first differing row, classified (module docstring).
    Rows are whole rounds' rows (row 0 = the root). Only the first difference is judged: every later row
    follows from it."""
    n = min(len(gold_tok), len(eng_tok))
    diff = np.nonzero((gold_tok[:n] != eng_tok[:n]) | (gold_par[:n] != eng_par[:n]))[0]
    if not diff.size:
        if len(gold_tok) == len(eng_tok):
            return None
        return TreeDifference(n, (), (), None, None, False,
                              f"{len(eng_tok) - 1} nodes where the golden tree has {len(gold_tok) - 1} (the budget)")
    k = int(diff[0])
    g, e = path_of(gold_tok, gold_par, k), path_of(eng_tok, eng_par, k)
    if len(e) > lp.shape[0]:
        return TreeDifference(k, g, e, None, None, False, f"node {k} at depth {len(e)}, beyond the draft depth "
                                                          f"{lp.shape[0]}")
    if e in {path_of(eng_tok, eng_par, j) for j in range(1, k)}:
        return TreeDifference(k, g, e, None, None, False, f"node {k} repeats the prefix {list(e)} of an earlier node")
    c = next((j for j, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
    gap, bound = abs(score(lp, g) - score(lp, e)), 2.0 * delta * (len(g) + len(e) - 2 * c)
    near = gap <= bound
    why = (f"node {k}: prefix {list(e)}, golden {list(g)}: their golden scores differ by {gap:.3g}, "
           + (f"within the {bound:.3g} a drafter inside its tolerance can move them (a near-tie)" if near else
              f"more than the {bound:.3g} a drafter inside its tolerance can move them (the golden choice "
              f"is decisive)"))
    return TreeDifference(k, g, e, gap, bound, near, why)


class GoldenDrafts:
    """The golden drafter logits of every prompt's rounds and the derived drafter tolerance, computed on
    first use (module docstring). `problem` is set, and no difference can be called a near-tie, when the
    float64 logits do not rebuild the stored golden trees."""

    def __init__(self, f):
        self.f = f
        self._q64: dict[int, list] | None = None
        self.tolerance: DerivedTolerance | None = None
        self.problem = ""

    def _compute(self) -> None:
        f = self.f
        cfg, W64 = read_model(f)
        dcfg, DW64 = read_drafter(f)
        settings = f.metadata["ddtree"]
        W32 = {k: v.astype(np.float32) for k, v in W64.items()}
        DW32 = {k: v.astype(np.float32) for k, v in DW64.items()}
        self._q64, err, sq_err, sq, mag = {}, 0.0, 0.0, 0.0, 0.0
        for i in prompts_of(f):
            q64 = replay_drafts(cfg, W64, dcfg, DW64, f, i)
            q32 = replay_drafts(cfg, W32, dcfg, DW32, f, i)
            self._q64[i] = q64
            self._check_rebuilt(i, q64, settings)
            for a, b in zip(q64, q32):                                   # the float32 run's error, worst prompt
                d = b.astype(np.float64) - a
                err, mag = max(err, float(np.abs(d).max())), max(mag, float(np.abs(a).max()))
                sq_err, sq = sq_err + float((d * d).sum()), sq + float((a * a).sum())
        self.tolerance = derive_tolerance(err, sq_err / sq if sq else 0.0, magnitude=mag)

    def _check_rebuilt(self, i: int, q64: list, settings: dict) -> None:
        p, f = f"golden/p{i}/", self.f
        o = np.asarray(f[p + "ddtree/tree_offsets"])
        for r, q in enumerate(q64):
            t = build_ddtree(q, settings["budget"], settings.get("topk"))
            if not (np.array_equal(t.tokens, f[p + "ddtree/tree_tokens"][o[r] + 1:o[r + 1]])
                    and np.array_equal(t.parents, f[p + "ddtree/tree_parents"][o[r]:o[r + 1]])):
                self.problem = self.problem or (f"the float64 golden drafter logits of p{i} round {r} do not "
                                                f"rebuild the stored golden tree, so no tree difference counts "
                                                f"as a near-tie")

    @property
    def delta(self) -> float:
        """The drafter tolerance: the largest per-logit error a correct float32 drafter may make."""
        if self.tolerance is None:
            self._compute()
        return self.tolerance.rule().atol

    def log_probs(self, i: int, r: int) -> np.ndarray | None:
        """The golden builder's log-probs [L, V] of prompt i's golden round r (None if not replayed)."""
        if self._q64 is None:
            self._compute()
        q = self._q64.get(i, [])
        return log_probs(q[r]) if r < len(q) else None
