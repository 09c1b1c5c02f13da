"""Driving a live engine (conformance.engines.protocol.Engine) through a bundle's golden prompts: the AR run,
teacher-forced with the golden tokens, the DDTree replay of the golden trees, and, for an engine that has
`ddtree_generate`, its own live DDTree loop. Returns the outputs under the run-dump names of
docs/run-dump.md, which the judge then compares with the goldens."""
from __future__ import annotations

import numpy as np

from conformance.verify.near_ties import near_tie_rows
from conformance.verify.outputs import LIVE
from conformance.records import golden_tree, offsets, position_offset, prompts_of, ragged
from kdtr_format import bf16_to_float32
from refmodel.config import ModelConfig
from refmodel.ddtree import compile_tree, walk


def _values(logits, dtype: str) -> np.ndarray:
    """Logits as numbers to take an argmax of: a bfloat16 engine returns raw uint16 bit patterns."""
    a = np.asarray(logits)
    return bf16_to_float32(a) if dtype == "bfloat16" and a.dtype == np.uint16 else a


def can_hold_routing(engine) -> bool:
    """Whether the engine takes held expert sets (the optional `hold_routing`, conformance/engines/protocol.py)."""
    return callable(getattr(engine, "hold_routing", None))


class HeldRouting:
    """The golden expert sets of one prompt, handed to an engine's `hold_routing` before each forward
    (conformance/engines/protocol.py) when the profile was derived with routing held (profiles.holds_routing):
    like teacher-forced tokens, it keeps a near-tie expert flip from moving every later tap, so those
    taps are judged under the conditions their tolerance was derived in. Only near-tie rows are held
    (`man`: the profile's taps; near_ties.near_tie_rows), every other row gets -1, "the router decides":
    where the golden decision is decisive a correct engine makes it itself, and an engine that reported
    the held ids as its own choice would otherwise hide a wrong router. `on` False: hands nothing."""

    def __init__(self, engine, f, i: int, on: bool, man: dict | None = None):
        cfg = f.metadata["model_config"]
        self.engine, self.f, self.p = engine, f, f"golden/p{i}/"
        self.on = on and can_hold_routing(engine)
        if self.on and man is None:
            raise ValueError("HeldRouting: pass the profile's taps (man): they say which rows are near-ties")
        self.cfg, self.man = (ModelConfig.from_dict(cfg), man) if self.on else (None, None)
        self.layers = range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
        self._held: dict = {}

    def _ids(self, phase: str) -> dict:
        """{layer: [T, K]} golden ids of `phase`, -1 on every decisive row (read once per phase)."""
        if phase not in self._held:
            out = {}
            for l in self.layers:
                if self.p + f"{phase}/L{l}/topk_ids" not in self.f:
                    continue
                ids = np.array(self.f[self.p + f"{phase}/L{l}/topk_ids"], np.int64)      # [T, K]
                near = near_tie_rows(self.f, self.p, phase, l, self.man, self.cfg)
                ids[np.ones(len(ids), bool) if near is None else ~near] = -1              # decisive: router
                out[l] = ids
            self._held[phase] = out
        return self._held[phase]

    def prefill(self) -> None:
        if self.on:
            self.engine.hold_routing(self._ids("prefill"))

    def decode(self, s: int) -> None:
        """Decode step s (token ar/tokens[s]): golden row s of the decode topk_ids."""
        if self.on:
            self.engine.hold_routing({l: ids[s:s + 1] for l, ids in self._ids("ar").items() if s < len(ids)})

    def tree(self, ids: np.ndarray, depths: np.ndarray, parents: np.ndarray, j0: int, golden: np.ndarray) -> None:
        """A verify forward whose root is stream token j0: a row whose path from the root spells the golden
        tokens j0 .. j0 + depth is decode step j0 + depth in another layout and holds that step's golden
        experts; every other row (off the golden path, or past the last decode step) is left to the router."""
        if not self.on:
            return
        on_path = np.zeros(len(ids), bool)
        for r in range(len(ids)):                                        # parents[r] < r: one pass
            j = j0 + int(depths[r])
            on_path[r] = (r == 0 or on_path[parents[r]]) and j < len(golden) and int(ids[r]) == int(golden[j])
        held = {}
        for l, g in self._ids("ar").items():                             # g: [n - 1, K], row s = step s
            rows = np.full((len(ids), g.shape[-1]), -1, np.int64)
            for r in np.nonzero(on_path)[0]:
                if j0 + depths[r] < len(g):
                    rows[r] = g[j0 + depths[r]]
            held[l] = rows
        self.engine.hold_routing(held)


def collect(engine, f, progress=None, hold_routing: bool = False, man: dict | None = None) -> dict:
    """Drive `engine` through every golden prompt; returns outputs under run-dump names. `hold_routing`:
    hand the engine the golden expert sets of the near-tie rows of every forward (HeldRouting; `man`: the
    profile's taps, which say what a near-tie is) when it can take them."""
    out, ps = {}, prompts_of(f)
    ar_taps = set(f.metadata["taps"]["ar"])
    for n, i in enumerate(ps):
        p = f"golden/p{i}/"
        prompt, tokens = np.asarray(f[p + "prompt_ids"]), np.asarray(f[p + "ar/tokens"])
        P, pos0 = len(prompt), position_offset(f, i)                    # cache row j sits at pos0 + j
        held = HeldRouting(engine, f, i, hold_routing, man)
        engine.reset()
        held.prefill()
        logits, taps = engine.prefill(prompt, pos0 + np.arange(P))
        out.update({f"p{i}/prefill/{k}": np.asarray(v) for k, v in taps.items()})
        rows, steps = [np.asarray(logits)[-1]], {}
        for s, tok in enumerate(tokens[:-1]):                            # teacher forcing: golden tokens in
            held.decode(s)
            lg, tp = engine.decode(int(tok), pos0 + P + s)
            rows.append(np.asarray(lg)[-1])
            for k, v in tp.items():
                if k.split("/")[-1] in ar_taps and k.startswith("L"):
                    steps.setdefault(f"p{i}/ar/{k}", []).append(np.asarray(v)[0])
        out[f"p{i}/ar/logits"] = np.stack(rows)                          # [n, V]
        out[f"p{i}/ar/tokens"] = np.argmax(_values(out[f"p{i}/ar/logits"], engine.dtype), axis=-1).astype(np.int64)
        out.update({k: np.stack(v) for k, v in steps.items()})
        out.update(replay_ddtree(engine, f, i, prompt, len(tokens), held))
        if callable(getattr(engine, "ddtree_generate", None)):          # optional: its own drafter and trees
            live = engine.ddtree_generate(prompt, position_offset(f, i), len(tokens))
            out.update({f"p{i}/{LIVE}/{k}": np.asarray(v) for k, v in live.items()})
        if progress:
            progress("engine", n + 1, len(ps), None)
    return out


def replay_ddtree(engine, f, i: int, prompt, n_tokens: int, held: HeldRouting | None = None) -> dict:
    """Verify the golden trees with the engine: depth positions, ancestor-only mask, walk, compaction.
    The roots are the engine's own bonus tokens, so its DDTree stream is its own. `held`: the golden
    expert sets, handed over for the prefill and for the tree rows on the golden stream."""
    p = f"golden/p{i}/"
    held = held or HeldRouting(engine, f, i, False)
    golden = np.asarray(f[p + "ar/tokens"])
    engine.reset()
    P, pos0 = len(prompt), position_offset(f, i)
    held.prefill()
    logits, _ = engine.prefill(prompt, pos0 + np.arange(P))
    emitted, start, forwards = [int(np.argmax(_values(logits, engine.dtype)[-1]))], P, 1
    argmaxes, accepted, acc_sizes, bonuses, path = [], [], [], [], []
    for r, golden_start in enumerate(np.asarray(f[p + "ddtree/round_start"])):
        if start != golden_start:
            break                                                        # already diverged: judged below
        tree = golden_tree(f, p, r)
        ids, positions, mask = compile_tree(tree, emitted[-1], start, pos0)   # rows: start; positions: pos0 + start
        held.tree(ids, positions - pos0 - start, tree.parents, start - P, golden)
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

