"""Driving a live engine (conformance.protocol.Engine) through a bundle's golden prompts: the AR run,
teacher-forced with the golden tokens, and the DDTree replay of the golden trees. Returns the outputs
under the run-dump names of docs/run-dump.md, which the judge then compares with the goldens."""
from __future__ import annotations

import numpy as np

from conformance.records import golden_tree, offsets, position_offset, prompts_of, ragged
from kdtr_format import bfloat16_to_float32
from refmodel.ddtree import compile_tree, walk


def _values(logits, dtype: str) -> np.ndarray:
    """Logits as numbers to take an argmax of: a bfloat16 engine returns raw uint16 bit patterns."""
    a = np.asarray(logits)
    return bfloat16_to_float32(a) if dtype == "bfloat16" and a.dtype == np.uint16 else a


def collect(engine, f, progress=None) -> dict:
    """Drive `engine` through every golden prompt; returns outputs under run-dump names."""
    out, ps = {}, prompts_of(f)
    ar_taps = set(f.metadata["taps"]["ar"])
    for n, i in enumerate(ps):
        p = f"golden/p{i}/"
        prompt, tokens = np.asarray(f[p + "prompt_ids"]), np.asarray(f[p + "ar/tokens"])
        P, pos0 = len(prompt), position_offset(f, i)                    # cache row j sits at pos0 + j
        engine.reset()
        logits, taps = engine.prefill(prompt, pos0 + np.arange(P))
        out.update({f"p{i}/prefill/{k}": np.asarray(v) for k, v in taps.items()})
        rows, steps = [np.asarray(logits)[-1]], {}
        for s, tok in enumerate(tokens[:-1]):                            # teacher forcing: golden tokens in
            lg, tp = engine.decode(int(tok), pos0 + P + s)
            rows.append(np.asarray(lg)[-1])
            for k, v in tp.items():
                if k.split("/")[-1] in ar_taps and k.startswith("L"):
                    steps.setdefault(f"p{i}/ar/{k}", []).append(np.asarray(v)[0])
        out[f"p{i}/ar/logits"] = np.stack(rows)                          # [n, V]
        out[f"p{i}/ar/tokens"] = np.argmax(_values(out[f"p{i}/ar/logits"], engine.dtype), axis=-1).astype(np.int64)
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
    P, pos0 = len(prompt), position_offset(f, i)
    logits, _ = engine.prefill(prompt, pos0 + np.arange(P))
    emitted, start, forwards = [int(np.argmax(_values(logits, engine.dtype)[-1]))], P, 1
    argmaxes, accepted, acc_sizes, bonuses, path = [], [], [], [], []
    for r, golden_start in enumerate(np.asarray(f[p + "ddtree/round_start"])):
        if start != golden_start:
            break                                                        # already diverged: judged below
        tree = golden_tree(f, p, r)
        ids, positions, mask = compile_tree(tree, emitted[-1], start, pos0)   # rows: start; positions: pos0 + start
        lg, _ = engine.verify_tree(ids, positions, mask)
        forwards += 1
        post = np.argmax(_values(lg, engine.dtype), axis=-1)
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

