"""Signatures: facts of the verdict as a whole that point at a kind of mistake where no recomputation
decides (docs/diagnosis.md). Each fact is observed or not from the checks, the first divergence and the
outputs; the hypothesis library names the sets of facts each mistake is consistent with.

    long_position_only   every failing check belongs to a long-position prompt (positions from a large
                         offset), and some prompt at positions from 0 passes
    decode_only          no prefill tap fails; some decode-step tap does
    prefill_only         some prefill tap fails; no decode-step tap fails at an earlier layer
    multi_token_only     every prompt whose prefill fails has more than one token, and some one-token
                         prompt's prefill passes
    input_cause          the first divergence was localised as an input fault (right on every input its
                         taps show)
    ddtree_only          every AR tap and token passes; a DDTree check fails
    replay_fails         a check of the golden-tree replay (ddtree/) fails, not only the live loop's
    after_compaction     the first failing DDTree round follows a round whose accepted rows were moved in
                         the cache (an accepted path other than the first rows of the tree)
    same_tree_nodes      the engine's own tree holds exactly the golden tree's prefixes, in another order
    rounding_noise_bf16  the diverging tap's relative RMS error sqrt(nmse) is what bfloat16 rounding leaves
                         (2^-12 .. 2^-6); _tf32: what TF32 leaves (2^-15 .. 2^-9)
"""
from __future__ import annotations

import numpy as np

from conformance.verify.outputs import LIVE, tree_offsets

BANDS = {"rounding_noise_bf16": (2.0 ** -12, 2.0 ** -6), "rounding_noise_tf32": (2.0 ** -15, 2.0 ** -9)}


def _failing(checks) -> list:
    return [c for c in checks if c.status == "fail" and not c.name.endswith("/long_position")]


def observed(f, checks, div, out: dict) -> dict:
    """{fact: one line of evidence} for every fact observed (module docstring)."""
    facts = {}
    bad = _failing(checks)
    offs = f.metadata.get("position_offsets") or []
    long_ = {f"p{i}/" for i, o in enumerate(offs) if o}
    if bad and long_ and all(any(c.name.startswith(p) for p in long_) for c in bad) and len(long_) < len(offs):
        facts["long_position_only"] = (f"only the long-position prompt{'s' if len(long_) > 1 else ''} "
                                       f"({', '.join(sorted(p[:-1] for p in long_))}) fail; the prompts at "
                                       f"positions from 0 pass")
    layer_bad = [c for c in bad if c.kind == "numeric" and "/L" in c.name]
    pre = [c for c in layer_bad if "/prefill/" in c.name]
    dec = [c for c in layer_bad if "/ar/" in c.name]
    if dec and not pre:
        facts["decode_only"] = f"every prefill tap passes; {len(dec)} decode-step taps fail"
    if pre and not dec:
        facts["prefill_only"] = f"{len(pre)} prefill taps fail; no decode-step tap does"
    lengths = {i: len(f[f"golden/p{i}/prompt_ids"]) for i in range(len(offs) or 0)
               if f"golden/p{i}/prompt_ids" in f}
    pre_bad = {int(c.name.split("/")[0][1:]) for c in pre}
    if pre_bad and all(lengths.get(i, 2) > 1 for i in pre_bad) and any(n == 1 and i not in pre_bad
                                                                         for i, n in lengths.items()):
        facts["multi_token_only"] = "only prompts of several tokens fail their prefill; the one-token prompt passes"
    if div is not None and div.cause == "input":
        facts["input_cause"] = "the layer is right on every input its taps show (localised as an input fault)"
    if bad and all(c.kind == "ddtree" for c in bad):
        facts["ddtree_only"] = "every AR tap and token passes; only DDTree checks fail"
    replay = [c.name for c in bad if "/ddtree/" in c.name]
    if replay:
        facts["replay_fails"] = f"the golden-tree replay fails ({replay[0]})"
    comp = _after_compaction(f, bad)
    if comp:
        facts["after_compaction"] = comp
    same = _same_tree_nodes(f, bad, out)
    if same:
        facts["same_tree_nodes"] = same
    if div is not None:
        c = next((c for c in checks if c.name == div.name), None)
        nmse = (c.metrics or {}).get("nmse") if c is not None else None
        if isinstance(nmse, float) and np.isfinite(nmse):
            rel = float(np.sqrt(nmse))
            for fact, (lo, hi) in BANDS.items():
                if lo <= rel <= hi:
                    facts[fact] = f"{div.name}'s relative RMS error {rel:.2g} is in the band {lo:.2g}..{hi:.2g}"
    return facts


def _after_compaction(f, bad) -> str | None:
    c = next((c for c in bad if c.name.endswith("/ddtree/rounds")), None)
    if c is None or not c.metrics.get("matching"):
        return None
    i, r = int(c.name.split("/")[0][1:]), int(c.metrics["matching"])
    ga = np.asarray(f[f"golden/p{i}/ddtree/accepted_offsets"])
    acc = np.asarray(f[f"golden/p{i}/ddtree/accepted"][ga[r - 1]:ga[r]])
    if np.array_equal(acc, np.arange(len(acc))):
        return None
    return (f"p{i}: the first failing DDTree round {r} follows round {r - 1}, whose accepted rows "
            f"{acc.tolist()} were moved in the cache; the rounds before it pass")


def _paths(tok, par) -> list:
    paths = [()]
    for k in range(1, len(tok)):
        paths.append(paths[int(par[k])] + (int(tok[k]),))
    return paths


def _same_tree_nodes(f, bad, out: dict) -> str | None:
    c = next((c for c in bad if c.name.endswith(f"/{LIVE}/trees")), None)
    if c is None:
        return None
    i = int(c.name.split("/")[0][1:])
    g, p = f"golden/p{i}/", f"p{i}/{LIVE}/"
    eo = np.asarray(out[p + "accepted_offsets"])
    et = tree_offsets(f, g, out, f"p{i}/", len(eo) - 1, LIVE)
    go = np.asarray(f[g + "ddtree/tree_offsets"])
    for r in range(min(len(eo), len(go)) - 1):
        e = _paths(out[p + "tree_tokens"][et[r]:et[r + 1]], out[p + "tree_parents"][et[r]:et[r + 1]])
        gl = slice(go[r], go[r + 1])
        gold = _paths(f[g + "ddtree/tree_tokens"][gl], f[g + "ddtree/tree_parents"][gl])
        if e != gold:
            if sorted(e) == sorted(gold):
                return (f"p{i} round {r}: the engine's tree holds the golden tree's {len(gold) - 1} prefixes, "
                        f"in another order")
            return None
    return None
